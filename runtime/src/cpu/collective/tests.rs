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

// ---- point-to-point ------------------------------------------------------------------

use crate::backend::Backend;
use crate::cpu::CpuBuf;
use crate::view::{Scalar, View, ViewMut};
use half::bf16;

/// Runs `f` on every rank of a fresh world with `timeout`, a thread each;
/// returns the results in rank order.
fn on_ranks<T: Send>(n: usize, timeout: Duration, f: impl Fn(&CpuComm) -> T + Sync) -> Vec<T> {
    let world = CpuWorld::with_timeout(n, timeout).unwrap();
    let comms = world.comms().unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                let f = &f;
                scope.spawn(move || f(comm))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("no rank panics"))
            .collect()
    })
}

fn up<T: Scalar>(values: &[T]) -> CpuBuf {
    let dev = CpuBackend::default();
    let buf = dev.alloc(values.len(), T::DTYPE).unwrap();
    dev.upload(values, ViewMut::whole(&buf)).unwrap();
    buf
}

fn down<T: Scalar>(buf: &CpuBuf) -> Vec<T> {
    let mut out = vec![T::default(); View::whole(buf).len()];
    CpuBackend::default()
        .download(View::whole(buf), &mut out)
        .unwrap();
    out
}

/// Sends `values` to `to` and/or receives `len` elements of `T` from
/// `from`, in one call; returns what was received.
fn exchange<T: Scalar>(
    comm: &CpuComm,
    send: Option<(&[T], usize)>,
    recv: Option<(usize, usize)>,
) -> Result<Vec<T>> {
    let sent = send.map(|(values, to)| (up(values), to));
    let received = recv.map(|(len, from)| (up(&vec![T::default(); len]), from));
    comm.send_recv(
        sent.as_ref().map(|(buf, to)| (View::whole(buf), *to)),
        received
            .as_ref()
            .map(|(buf, from)| (ViewMut::whole(buf), *from)),
    )?;
    Ok(received.map(|(buf, _)| down(&buf)).unwrap_or_default())
}

fn rank_of(comm: &CpuComm) -> usize {
    Collective::<CpuBackend>::rank(comm)
}

/// Rank r's message: values that name it and the element.
fn message(r: usize, len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (salt * 10_000 + r * 1000 + i) as f32 + 0.25)
        .collect()
}

/// Every rank sends to its successor and receives from its predecessor in
/// one call, then the other way round: with every rank sending before any
/// receives, this deadlocks unless sends are buffered. Two ranks are each
/// other's successor and predecessor, so they send to each other in one
/// call.
#[test]
fn a_ring_passes_messages_both_ways_in_one_call_each() {
    for n in [2, 4] {
        let got = on_ranks(n, Duration::from_secs(30), |comm| {
            let r = rank_of(comm);
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let forward = exchange(comm, Some((&message(r, 37, 1)[..], next)), Some((37, prev)));
            let backward = exchange(comm, Some((&message(r, 5, 2)[..], prev)), Some((5, next)));
            (forward.unwrap(), backward.unwrap())
        });
        for (r, (forward, backward)) in got.iter().enumerate() {
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            assert_eq!(forward, &message(prev, 37, 1), "{n} ranks, rank {r}");
            assert_eq!(backward, &message(next, 5, 2), "{n} ranks, rank {r}");
        }
    }
}

/// Messages between a pair are received in the order they were sent,
/// whoever comes first; and transfers take no part in the group's rounds,
/// so a rank may send before a collective that its peer receives after.
#[test]
fn messages_between_a_pair_arrive_in_order_and_leave_the_rounds_alone() {
    let lens = [3, 0, 8, 1, 5];
    let got = on_ranks(2, Duration::from_secs(30), |comm| {
        if rank_of(comm) == 0 {
            for (k, len) in lens.iter().enumerate() {
                exchange(comm, Some((&message(0, *len, k)[..], 1)), None).unwrap();
            }
            let all = comm.all_gather_host(&[0.0]).unwrap();
            // Rank 1 receives only after the gather: the first two
            // messages were sent before its receives were posted.
            exchange(comm, Some((&message(0, 4, 9)[..], 1)), None).unwrap();
            (all, Vec::new())
        } else {
            let all = comm.all_gather_host(&[1.0]).unwrap();
            let received: Vec<Vec<f32>> = lens
                .iter()
                .map(|len| exchange(comm, None, Some((*len, 0))).unwrap())
                .collect();
            let last = exchange(comm, None, Some((4, 0))).unwrap();
            (all, [received, vec![last]].concat())
        }
    });
    for (all, _) in &got {
        assert_eq!(all, &vec![vec![0.0], vec![1.0]]);
    }
    let want: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(k, len)| message(0, *len, k))
        .chain([message(0, 4, 9)])
        .collect();
    assert_eq!(got[1].1, want);
}

/// A receive whose view is not what was sent fails the receiver, and the
/// sender (waiting for its own receive here) as soon as it is found, both
/// naming the two ranks, dtypes and lengths; the group is broken after.
#[test]
fn a_mismatched_receive_fails_both_ranks_naming_them() {
    for (what, want_len, sent, wanted) in [
        ("length", 5, "4 f32 elements", "5 f32 elements"),
        ("dtype", 4, "4 bf16 elements", "4 f32 elements"),
    ] {
        let started = Instant::now();
        let errors = on_ranks(2, Duration::from_secs(30), |comm| {
            let error = if rank_of(comm) == 0 {
                let halves = [bf16::ONE; 4];
                let floats = [1.0f32; 4];
                let sent = if what == "dtype" {
                    let buf = up(&halves);
                    comm.send_recv(Some((View::whole(&buf), 1)), None)
                } else {
                    let buf = up(&floats);
                    comm.send_recv(Some((View::whole(&buf), 1)), None)
                };
                sent.unwrap();
                exchange::<f32>(comm, None, Some((4, 1))).unwrap_err()
            } else {
                exchange::<f32>(comm, None, Some((want_len, 0))).unwrap_err()
            };
            // Every later call on the group fails with the same error.
            let later = comm.barrier().unwrap_err();
            (error.to_string(), later.to_string())
        });
        for (r, (error, later)) in errors.iter().enumerate() {
            for part in [
                "rank 1: receives",
                wanted,
                "from rank 0 on world",
                "but rank 0 sent",
                sent,
            ] {
                assert!(
                    error.contains(part),
                    "{what}, rank {r}: `{part}` in {error}"
                );
            }
            assert_eq!(later, error, "{what}, rank {r}");
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{errors:?}");
    }
}

/// A peer that never sends fails the receive after the timeout, naming
/// it; a peer whose communicator is dropped fails it at once.
#[test]
fn a_missing_or_departed_sender_fails_the_receive_naming_it() {
    let timeout = Duration::from_millis(200);
    let world = CpuWorld::with_timeout(2, timeout).unwrap();
    let comms = world.comms().unwrap();
    let started = Instant::now();
    let error = exchange::<f32>(&comms[1], None, Some((3, 0))).unwrap_err();
    let waited = started.elapsed();
    assert!(waited >= timeout, "{waited:?}");
    assert!(waited < Duration::from_secs(10), "{waited:?}");
    assert!(
        matches!(error, RuntimeError::Peer { rank: 0, .. }),
        "{error}"
    );
    let text = error.to_string();
    assert!(
        text.contains("rank 0: did not send to rank 1 on world within 200ms")
            && text.contains("receiving 3 f32 elements from rank 0"),
        "{text}"
    );

    let world = CpuWorld::with_timeout(2, Duration::from_secs(30)).unwrap();
    let mut comms = world.comms().unwrap();
    let receiver = comms.pop().unwrap();
    let started = Instant::now();
    let error = std::thread::scope(|scope| {
        let waiting = scope.spawn(|| exchange::<f32>(&receiver, None, Some((3, 0))));
        std::thread::sleep(Duration::from_millis(50));
        drop(comms);
        waiting.join().unwrap().unwrap_err().to_string()
    });
    assert!(
        error.contains("rank 0: left world before sending what rank 1 waits for"),
        "{error}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "{error}");
}

/// A message sent before its sender's communicator is dropped is still
/// received.
#[test]
fn a_message_outlives_its_senders_communicator() {
    let world = CpuWorld::with_timeout(2, Duration::from_secs(30)).unwrap();
    let mut comms = world.comms().unwrap();
    let receiver = comms.pop().unwrap();
    exchange(&comms[0], Some((&[7.0f32, 8.0][..], 1)), None).unwrap();
    drop(comms);
    assert_eq!(
        exchange::<f32>(&receiver, None, Some((2, 0))).unwrap(),
        vec![7.0, 8.0]
    );
}

/// Sending to or receiving from oneself, a rank outside the group, or
/// neither, is refused, and the refusal fails the peer waiting on this
/// rank at once rather than at the timeout.
#[test]
fn transfers_to_oneself_or_outside_the_group_are_refused() {
    let world = CpuWorld::with_timeout(1, Duration::from_secs(30)).unwrap();
    let comm = world.comm(0).unwrap();
    let error = exchange(&comm, Some((&[1.0f32][..], 0)), None).unwrap_err();
    assert!(
        error.to_string().contains(
            "rank 0: send_recv (sending 1 f32 elements to rank 0) on world: cannot send to itself"
        ),
        "{error}"
    );

    for (case, want) in [
        ("itself", "cannot receive from itself"),
        ("outside", "cannot send to rank 2: the group has 2 ranks"),
        ("neither", "neither a send nor a receive was given"),
    ] {
        let started = Instant::now();
        let errors = on_ranks(2, Duration::from_secs(30), |comm| {
            if rank_of(comm) == 1 {
                return exchange::<f32>(comm, None, Some((3, 0)))
                    .unwrap_err()
                    .to_string();
            }
            let refused = match case {
                "itself" => exchange::<f32>(comm, None, Some((3, 0))),
                "outside" => exchange(comm, Some((&[1.0f32][..], 2)), None),
                _ => exchange::<f32>(comm, None, None),
            };
            refused.unwrap_err().to_string()
        });
        assert!(errors[0].contains(want), "{case}: {}", errors[0]);
        assert!(
            errors[0].contains("rank 0: send_recv"),
            "{case}: {}",
            errors[0]
        );
        assert!(
            errors[1].contains("rank 0: called send_recv") && errors[1].contains(want),
            "{case}: {}",
            errors[1]
        );
        assert!(started.elapsed() < Duration::from_secs(10), "{errors:?}");
    }
}

/// Any dtype moves bit for bit: bf16, f32 (signed zero, NaN payloads,
/// subnormals), f64 and u32.
#[test]
fn payloads_of_every_dtype_arrive_bit_exact() {
    let floats = [
        -0.0f32,
        f32::from_bits(0x7fc0_1234),
        f32::from_bits(1),
        f32::MAX,
        1.0 / 3.0,
    ];
    let halves: Vec<bf16> = [0x8000u16, 0x7fc1, 0x0001, 0x3eab]
        .into_iter()
        .map(bf16::from_bits)
        .collect();
    let doubles = [f64::from_bits(0x7ff8_0000_0000_0042), -0.0, 1e-310];
    let words = [0u32, u32::MAX, 0xdead_beef];
    let got = on_ranks(2, Duration::from_secs(30), |comm| {
        let other = 1 - rank_of(comm);
        let f = exchange(
            comm,
            Some((&floats[..], other)),
            Some((floats.len(), other)),
        );
        let h = exchange(
            comm,
            Some((&halves[..], other)),
            Some((halves.len(), other)),
        );
        let d = exchange(
            comm,
            Some((&doubles[..], other)),
            Some((doubles.len(), other)),
        );
        let w = exchange(comm, Some((&words[..], other)), Some((words.len(), other)));
        (f.unwrap(), h.unwrap(), d.unwrap(), w.unwrap())
    });
    for (f, h, d, w) in got {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&f), bits(&floats));
        assert_eq!(
            h.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            halves.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(
            d.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            doubles.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(w, words);
    }
}

/// Transfers in a split group name world ranks, and go only between the
/// group's members.
#[test]
fn transfers_in_a_split_group_use_its_ranks() {
    let got = on_ranks(4, Duration::from_secs(30), |comm| {
        let r = rank_of(comm);
        // Groups {0, 2} and {1, 3}: group rank 1 is world rank r + 2.
        let group = comm.split(r % 2).unwrap();
        let me = rank_of(&group);
        let other = 1 - me;
        let got = exchange(&group, Some((&[r as f32][..], other)), Some((1, other))).unwrap();
        let refused = exchange(&group, Some((&[0.0f32][..], me)), None)
            .unwrap_err()
            .to_string();
        (got, refused)
    });
    for (r, (value, refused)) in got.iter().enumerate() {
        assert_eq!(value, &vec![((r + 2) % 4) as f32], "rank {r}");
        let group = if r % 2 == 0 { "[0, 2]" } else { "[1, 3]" };
        assert!(
            refused.contains(&format!(
                "rank {r}: send_recv (sending 1 f32 elements to rank {r}) on group of ranks {group}"
            )),
            "{refused}"
        );
    }
}
