use super::*;

#[test]
fn chunks_cover_the_buffer_once() {
    for len in 0..12 {
        for parts in 1..5 {
            let mut next = 0;
            for i in 0..parts {
                let (s, e) = chunk(len, parts, i);
                assert_eq!(s, next);
                assert!(e - s <= len / parts + 1);
                next = e;
            }
            assert_eq!(next, len);
        }
    }
}

#[test]
fn call_descriptions() {
    let call = Call {
        kind: OpKind::AllGather,
        elements: Some(1024),
        dtype: Some(DType::F32),
        seq: 12,
        phase: 0,
    };
    assert_eq!(
        call.to_string(),
        "all_gather #12 (1024 f32 elements per rank)"
    );
    let a2a = Call {
        kind: OpKind::AllToAll,
        elements: None,
        dtype: None,
        seq: 3,
        phase: 0,
    };
    assert_eq!(a2a.to_string(), "all_to_all #3");
    assert!(!call.agrees_with(&a2a));
}

#[test]
fn overlapping_calls_on_one_communicator_are_refused() {
    let world = CpuWorld::new(1).unwrap();
    let comm = world.comm(0).unwrap();
    // As if another thread were inside a collective on this handle.
    comm.in_call.store(true, Ordering::SeqCst);
    let err = comm.barrier().unwrap_err().to_string();
    assert!(
        err.contains("rank 0 called barrier on world while another collective"),
        "{err}"
    );
    comm.in_call.store(false, Ordering::SeqCst);
    // The refused call took no sequence number: the next call is #1.
    assert_eq!(comm.next_seq.load(Ordering::SeqCst), 1);
    comm.barrier().unwrap();
    assert!(!comm.in_call.load(Ordering::SeqCst));
}

#[test]
fn a_timeout_too_long_for_the_clock_waits_without_panicking() {
    // `Instant::now() + u64::MAX seconds` overflows (and panics): every
    // rank's collective must still run.
    let world = CpuWorld::with_timeout(2, Duration::from_secs(u64::MAX)).unwrap();
    let comms: Vec<CpuComm> = (0..2).map(|r| world.comm(r).unwrap()).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, comm)| scope.spawn(move || comm.all_gather_host(&[r as f64])))
            .collect();
        for handle in handles {
            let all = handle.join().expect("no rank panics").unwrap();
            assert_eq!(all, vec![vec![0.0], vec![1.0]]);
        }
    });
}

#[test]
fn world_of_zero_ranks_and_double_take_are_errors() {
    assert!(CpuWorld::new(0).is_err());
    let world = CpuWorld::new(2).unwrap();
    let _c0 = world.comm(0).unwrap();
    assert!(
        world
            .comm(0)
            .unwrap_err()
            .to_string()
            .contains("already taken")
    );
    assert!(
        world
            .comm(2)
            .unwrap_err()
            .to_string()
            .contains("out of range")
    );
}

/// Another transport's rounds: every rank gets every token in rank
/// order, phase after phase of one call; a rank that calls another
/// collective, or fails between rounds, fails its peers at once.
#[test]
fn device_rounds_exchange_tokens_in_rank_order_and_fail_together() {
    let world = CpuWorld::with_timeout(3, Duration::from_secs(30)).unwrap();
    let comms = world.comms().unwrap();
    std::thread::scope(|scope| {
        for comm in &comms {
            scope.spawn(move || {
                let me = Collective::<CpuBackend>::rank(comm);
                let mut round = comm
                    .device_round(OpKind::AllGather, Some(4), Some(DType::F32))
                    .unwrap();
                let first = round.exchange(10 * me).unwrap();
                assert_eq!(first.iter().map(|t| **t).collect::<Vec<_>>(), [0, 10, 20]);
                let second = round.exchange(format!("done {me}")).unwrap();
                assert_eq!(*second[2], "done 2");
            });
        }
    });
    // The next call: rank 2 calls another collective.
    let started = Instant::now();
    let errors: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                scope.spawn(move || {
                    let kind = match Collective::<CpuBackend>::rank(comm) {
                        2 => OpKind::ReduceScatter,
                        _ => OpKind::AllGather,
                    };
                    let mut round = comm.device_round(kind, Some(4), Some(DType::F32))?;
                    round.exchange(0u8).map(|_| ())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap_err().to_string())
            .collect()
    });
    // Whoever came first, every rank's error names both calls.
    assert!(
        errors
            .iter()
            .all(|e| e.contains("reduce_scatter #2 (4 f32 elements)")
                && e.contains("all_gather #2 (4 f32 elements per rank)")),
        "{errors:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "{errors:?}");

    // A rank that fails between its rounds fails the peers waiting in
    // the next one at once, naming it.
    let world = CpuWorld::with_timeout(2, Duration::from_secs(30)).unwrap();
    let comms = world.comms().unwrap();
    let started = Instant::now();
    let waiting = std::thread::scope(|scope| {
        let failing = scope.spawn(|| {
            let mut round = comms[1]
                .device_round(OpKind::AllReduce, Some(1), None)
                .unwrap();
            round.exchange(()).unwrap();
            round.abandon(&RuntimeError::InvalidArgument("out of memory".into()));
        });
        let waiting = scope.spawn(|| {
            let mut round = comms[0]
                .device_round(OpKind::AllReduce, Some(1), None)
                .unwrap();
            round.exchange(()).unwrap();
            round.exchange(()).map(|_| ()).unwrap_err().to_string()
        });
        failing.join().unwrap();
        waiting.join().unwrap()
    });
    assert!(
        waiting.contains("rank 1") && waiting.contains("out of memory"),
        "{waiting}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "{waiting}");
}
