//! The copy transport on GPUs (`--transport copy`): every collective
//! between ranks sharing the machine's GPUs (one GPU runs them all, round
//! robin) against the values the CPU's collectives give, bit for bit (both
//! sum in rank order), point-to-point transfers in order and bit for bit;
//! calls that disagree fail on every rank at once.
//!
//! Each test is `#[ignore = "needs a GPU"]`: the binary is built on a
//! machine without CUDA (`scripts/cuda_bundle.sh`) and run on one with it
//! with `--include-ignored`; run without a GPU, a test fails saying why.

use half::bf16;
use hybridgen_runtime::backend::Backend;
use hybridgen_runtime::cuda::peer_copy::{PeerCopyComm, RetiredEvents};
use hybridgen_runtime::cuda::{CudaBackend, CudaBuf, CudaComm, Gpu, probe};
use hybridgen_runtime::view::{DType, Scalar, View, ViewMut};
use hybridgen_runtime::{Collective, CpuWorld, Precision, RuntimeError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs `body` on `n` thread ranks, rank r on GPU `r % gpus`, each with its
/// copy transport communicator on a queue of its own; returns each rank's
/// result in rank order. The tests that call this are `#[ignore]`d: a
/// machine without a GPU fails them rather than passing them unrun.
fn ranks<R: Send>(n: usize, body: impl Fn(usize, &CudaBackend, &CudaComm) -> R + Sync) -> Vec<R> {
    let gpus = match probe() {
        Ok(info) => info.devices.len(),
        Err(why) => panic!("needs a GPU: {why}"),
    };
    let world = CpuWorld::with_timeout(n, Duration::from_secs(60)).unwrap();
    let retired = Arc::new(RetiredEvents::default());
    let comms = world.comms().unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, host)| {
                let (retired, body) = (retired.clone(), &body);
                scope.spawn(move || {
                    let gpu = Gpu::open(r % gpus, Precision::F32, Duration::from_secs(60))
                        .expect("the probed GPU opens");
                    let backend = gpu.backend("comm").expect("a queue");
                    // No peer access: ranks on other GPUs (where there
                    // are several) take the sums' copy path.
                    let comm = CudaComm::copy(
                        PeerCopyComm::new(host, backend.clone(), retired, Arc::from([]))
                            .expect("events"),
                    );
                    body(r, &backend, &comm)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

/// Values of order one, different for every rank and element.
fn noise(seed: usize, i: usize) -> f32 {
    let x = (seed as u64 * 0x9E37_79B9 + i as u64 * 0x85EB_CA6B) % 2_000_003;
    x as f32 / 1_000_001.5 - 1.0 + 0.37 * (i % 7) as f32
}

fn up<T: Scalar>(b: &CudaBackend, values: &[T]) -> CudaBuf {
    let buf = b.alloc(values.len(), T::DTYPE).unwrap();
    b.upload(values, ViewMut::whole(&buf)).unwrap();
    buf
}

/// A buffer's values (bf16 widened) on the host.
fn down(b: &CudaBackend, buf: &CudaBuf) -> Vec<f32> {
    let len = b.buf_len(buf);
    if View::whole(buf).dtype() == DType::Bf16 {
        let mut out = vec![bf16::ZERO; len];
        b.download(View::whole(buf), &mut out).unwrap();
        return out.iter().map(|x| x.to_f32()).collect();
    }
    let mut out = vec![0.0f32; len];
    b.download(View::whole(buf), &mut out).unwrap();
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `((x0 + x1) + x2) + ...` element by element, as every rank must get it.
fn sum_in_rank_order(parts: &[Vec<f32>]) -> Vec<f32> {
    let mut out = parts[0].clone();
    for part in &parts[1..] {
        for (o, x) in out.iter_mut().zip(part) {
            *o += *x;
        }
    }
    out
}

/// All-to-all counts: rank i sends `counts(i, j)` elements to rank j,
/// uneven, and none from rank 1 to rank 0.
fn count(i: usize, j: usize) -> usize {
    if (i, j) == (1, 0) {
        0
    } else {
        3 + 5 * i + 7 * j
    }
}

/// Sizes of 777 (the sums' one float at a time) and 1,024 (four at a
/// time); 17 ranks are past what one sum kernel adds (16), so their sums
/// take the copies into scratch.
#[test]
#[ignore = "needs a GPU"]
fn every_collective_gives_the_cpus_values_bit_for_bit() {
    for (n, s) in [
        (1, 777),
        (2, 777),
        (3, 777),
        (2, 1024),
        (3, 1024),
        (17, 777),
    ] {
        let results = ranks(n, |r, b, comm| {
            // Twice over, so each of the two event sets is used again.
            let mut outputs = Vec::new();
            for round in 0..2 {
                let seed = 100 * round + r;
                // all_gather, f32 and bf16.
                let shard: Vec<f32> = (0..s).map(|i| noise(seed, i)).collect();
                let shard_buf = up(b, &shard);
                let full = b.alloc(n * s, DType::F32).unwrap();
                comm.all_gather(View::whole(&shard_buf), ViewMut::whole(&full))
                    .unwrap();
                outputs.push(down(b, &full));
                let half: Vec<bf16> = shard.iter().map(|x| bf16::from_f32(*x)).collect();
                let half_buf = up(b, &half);
                let half_full = b.alloc(n * s, DType::Bf16).unwrap();
                comm.all_gather(View::whole(&half_buf), ViewMut::whole(&half_full))
                    .unwrap();
                outputs.push(down(b, &half_full));
                // reduce_scatter.
                let contribution: Vec<f32> = (0..n * s).map(|i| noise(seed + 7, i)).collect();
                let contribution_buf = up(b, &contribution);
                let mine = b.alloc(s, DType::F32).unwrap();
                comm.reduce_scatter(View::whole(&contribution_buf), ViewMut::whole(&mine))
                    .unwrap();
                outputs.push(down(b, &mine));
                // reduce_scatter in place: the shard is this rank's slot.
                let in_place = up(b, &contribution);
                comm.reduce_scatter(
                    View::whole(&in_place),
                    b.slice_mut(&in_place, r * s..(r + 1) * s).unwrap(),
                )
                .unwrap();
                outputs.push(down(b, &in_place)[r * s..(r + 1) * s].to_vec());
                // all_reduce, in place.
                let summed = up(b, &shard);
                comm.all_reduce(ViewMut::whole(&summed)).unwrap();
                outputs.push(down(b, &summed));
                // all_to_all, uneven and empty segments.
                let send_counts: Vec<usize> = (0..n).map(|j| count(r, j)).collect();
                let recv_counts: Vec<usize> = (0..n).map(|i| count(i, r)).collect();
                let send: Vec<f32> = (0..send_counts.iter().sum())
                    .map(|i| noise(seed + 13, i))
                    .collect();
                let send_buf = up(b, &send);
                let recv = b.alloc(recv_counts.iter().sum(), DType::F32).unwrap();
                comm.all_to_all(
                    View::whole(&send_buf),
                    &send_counts,
                    ViewMut::whole(&recv),
                    &recv_counts,
                )
                .unwrap();
                outputs.push(down(b, &recv));
            }
            outputs
        });
        for round in 0..2 {
            let seed = |r: usize| 100 * round + r;
            let shards: Vec<Vec<f32>> = (0..n)
                .map(|r| (0..s).map(|i| noise(seed(r), i)).collect())
                .collect();
            let gathered: Vec<f32> = shards.concat();
            let gathered_bf16: Vec<f32> = gathered
                .iter()
                .map(|x| bf16::from_f32(*x).to_f32())
                .collect();
            let contributions: Vec<Vec<f32>> = (0..n)
                .map(|r| (0..n * s).map(|i| noise(seed(r) + 7, i)).collect())
                .collect();
            let all_reduced = sum_in_rank_order(&shards);
            for (r, outputs) in results.iter().enumerate() {
                let o = &outputs[6 * round..6 * round + 6];
                let what = format!("{n} ranks, rank {r}, round {round}");
                assert_eq!(bits(&o[0]), bits(&gathered), "{what}: all_gather f32");
                assert_eq!(bits(&o[1]), bits(&gathered_bf16), "{what}: all_gather bf16");
                let segments: Vec<Vec<f32>> = contributions
                    .iter()
                    .map(|c| c[r * s..(r + 1) * s].to_vec())
                    .collect();
                let reduced = bits(&sum_in_rank_order(&segments));
                assert_eq!(bits(&o[2]), reduced, "{what}: reduce_scatter");
                assert_eq!(bits(&o[3]), reduced, "{what}: reduce_scatter in place");
                assert_eq!(bits(&o[4]), bits(&all_reduced), "{what}: all_reduce");
                let mut received = Vec::new();
                for i in 0..n {
                    let offset: usize = (0..r).map(|j| count(i, j)).sum();
                    received.extend((offset..offset + count(i, r)).map(|k| noise(seed(i) + 13, k)));
                }
                assert_eq!(bits(&o[5]), bits(&received), "{what}: all_to_all");
            }
        }
        println!("{n} ranks, {s} a shard: every collective as on the CPU, bit for bit");
    }
}

/// Host-side exchanges and splits ride on the same rendezvous; a split's
/// groups move data among their own members only.
#[test]
#[ignore = "needs a GPU"]
fn host_exchanges_and_splits() {
    let results = ranks(4, |r, b, comm| {
        let counts = comm
            .all_to_all_counts(&(0..4).map(|j| vec![r, j]).collect::<Vec<_>>())
            .unwrap();
        assert_eq!(counts, (0..4).map(|i| vec![i, r]).collect::<Vec<_>>());
        let host = comm.all_gather_host(&[r as f64]).unwrap();
        assert_eq!(host, (0..4).map(|i| vec![i as f64]).collect::<Vec<_>>());
        comm.barrier().unwrap();
        // EP 2's groups: {0, 1} and {2, 3}.
        let ep = comm.split(r / 2).unwrap();
        assert_eq!((ep.rank(), ep.size()), (r % 2, 2));
        let mine = up(b, &[r as f32 + 0.5]);
        let both = b.alloc(2, DType::F32).unwrap();
        ep.all_gather(View::whole(&mine), ViewMut::whole(&both))
            .unwrap();
        down(b, &both)
    });
    for (r, got) in results.iter().enumerate() {
        let first = (r / 2 * 2) as f32;
        assert_eq!(got, &[first + 0.5, first + 1.5], "rank {r}");
    }
}

/// Counts that do not agree fail every rank at once, naming the sender;
/// a call with a wrong output fails its rank and its waiting peers.
#[test]
#[ignore = "needs a GPU"]
fn disagreeing_calls_fail_every_rank_at_once() {
    let started = Instant::now();
    let errors = ranks(2, |r, b, comm| {
        let send = up(b, &[1.0f32; 4]);
        let recv = b.alloc(4, DType::F32).unwrap();
        // Rank 0 sends 1 + 3, but rank 1 expects 2 from rank 0.
        let recv_counts = if r == 0 { [1, 3] } else { [2, 2] };
        let send_counts = if r == 0 { [1, 3] } else { [2, 2] };
        comm.all_to_all(
            View::whole(&send),
            &send_counts,
            ViewMut::whole(&recv),
            &recv_counts,
        )
        .unwrap_err()
    });
    for e in &errors {
        let m = e.to_string();
        assert!(matches!(e, RuntimeError::Peer { .. }), "{m}");
        assert!(
            m.contains("sends 3 elements to rank 1") && m.contains("all_to_all_counts"),
            "{m}"
        );
    }
    let errors = ranks(2, |r, b, comm| {
        let shard = up(b, &[1.0f32; 4]);
        let full = b.alloc(if r == 1 { 7 } else { 8 }, DType::F32).unwrap();
        comm.all_gather(View::whole(&shard), ViewMut::whole(&full))
            .unwrap_err()
            .to_string()
    });
    assert!(
        errors[1].contains("the output holds 7 f32 elements"),
        "{}",
        errors[1]
    );
    assert!(errors[0].contains("rank 1"), "{}", errors[0]);
    assert!(started.elapsed() < Duration::from_secs(30), "{errors:?}");
}

/// A buffer's elements of any dtype, on the host.
fn fetch<T: Scalar>(b: &CudaBackend, buf: &CudaBuf) -> Vec<T> {
    let mut out = vec![T::default(); b.buf_len(buf)];
    b.download(View::whole(buf), &mut out).unwrap();
    out
}

/// Sends `values` to `to` and/or receives `len` elements of `T` from
/// `from`, in one call; returns what was received.
fn transfer<T: Scalar>(
    b: &CudaBackend,
    comm: &CudaComm,
    send: Option<(&[T], usize)>,
    recv: Option<(usize, usize)>,
) -> hybridgen_runtime::Result<Vec<T>> {
    let sent = send.map(|(values, to)| (up(b, values), to));
    let received = recv.map(|(len, from)| (b.alloc(len, T::DTYPE).unwrap(), from));
    comm.send_recv(
        sent.as_ref().map(|(buf, to)| (View::whole(buf), *to)),
        received
            .as_ref()
            .map(|(buf, from)| (ViewMut::whole(buf), *from)),
    )?;
    Ok(received.map(|(buf, _)| fetch(b, &buf)).unwrap_or_default())
}

/// Rank r's `k`th message: values that name both (k modulo 8), exact in
/// bf16 too (integers below 256).
fn letter(r: usize, k: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (r * 64 + k % 8 * 8 + i % 8) as f32)
        .collect()
}

/// Point-to-point on the copy transport, two and three ranks (sharing the
/// GPU on a machine with one; on one with several, the peer copies between
/// GPUs run too): a ring passes messages both ways, a call
/// each way with every rank sending before it receives (a deadlock unless
/// sends are buffered); messages between a pair arrive in order, across a
/// collective the receiver joins before its receives; every dtype moves
/// bit for bit; empty messages count. Repeated, so received buffers are
/// freed and their memory reused.
#[test]
#[ignore = "needs a GPU"]
fn point_to_point_passes_messages_in_order_between_ranks() {
    for n in [2, 3] {
        let results = ranks(n, |r, b, comm| {
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let mut got: Vec<Vec<f32>> = Vec::new();
            for round in 0..20 {
                let forward = transfer(
                    b,
                    comm,
                    Some((&letter(r, round, 1001)[..], next)),
                    Some((1001, prev)),
                );
                got.push(forward.unwrap());
                let halves: Vec<bf16> = letter(r, round, 777)
                    .iter()
                    .map(|x| bf16::from_f32(*x))
                    .collect();
                let backward = transfer(b, comm, Some((&halves[..], prev)), Some((777, next)));
                got.push(backward.unwrap().iter().map(|x| x.to_f32()).collect());
            }
            // Rank 0 sends rank 1 several messages before rank 1 receives
            // any (it joins the gather first, which rank 0 joins only after
            // sending).
            let words = [0u32, u32::MAX, 0xdead_beef, 7];
            let odd = [-0.0f32, f32::from_bits(0x7fc0_1234), f32::from_bits(1)];
            if r == 0 {
                transfer(b, comm, Some((&letter(0, 1, 5)[..], 1)), None).unwrap();
                transfer::<f32>(b, comm, Some((&[][..], 1)), None).unwrap();
                transfer(b, comm, Some((&words[..], 1)), None).unwrap();
                transfer(b, comm, Some((&odd[..], 1)), None).unwrap();
                comm.all_gather_host(&[0.0]).unwrap();
            } else if r == 1 {
                comm.all_gather_host(&[1.0]).unwrap();
                got.push(transfer(b, comm, None, Some((5, 0))).unwrap());
                assert!(
                    transfer::<f32>(b, comm, None, Some((0, 0)))
                        .unwrap()
                        .is_empty()
                );
                assert_eq!(transfer::<u32>(b, comm, None, Some((4, 0))).unwrap(), words);
                let bits: Vec<u32> = transfer::<f32>(b, comm, None, Some((3, 0)))
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                assert_eq!(bits, odd.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            } else {
                comm.all_gather_host(&[2.0]).unwrap();
            }
            comm.barrier().unwrap();
            got
        });
        for (r, got) in results.iter().enumerate() {
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            for round in 0..20 {
                assert_eq!(
                    bits(&got[2 * round]),
                    bits(&letter(prev, round, 1001)),
                    "{n} ranks, rank {r}, round {round}"
                );
                assert_eq!(
                    bits(&got[2 * round + 1]),
                    bits(&letter(next, round, 777)),
                    "{n} ranks, rank {r}, round {round}"
                );
            }
            if r == 1 {
                assert_eq!(
                    got[40],
                    letter(0, 1, 5),
                    "{n} ranks: the first of rank 0's messages"
                );
            }
        }
        println!("{n} ranks: point-to-point in a ring both ways and in order, bit for bit");
    }
}

/// A receive of another length or dtype than was sent fails both ranks
/// (the sender waiting in its own receive) naming the two ranks, dtypes
/// and lengths; a transfer to oneself is refused, failing the peer that
/// waits on it at once; a group of one has no peer.
#[test]
#[ignore = "needs a GPU"]
fn point_to_point_mismatches_and_refusals_fail_naming_the_ranks() {
    let started = Instant::now();
    let errors = ranks(2, |r, b, comm| {
        let error = if r == 0 {
            transfer(b, comm, Some((&[1.0f32; 4][..], 1)), None).unwrap();
            transfer::<f32>(b, comm, None, Some((4, 1))).unwrap_err()
        } else {
            transfer::<bf16>(b, comm, None, Some((4, 0))).unwrap_err()
        };
        error.to_string()
    });
    for (r, error) in errors.iter().enumerate() {
        assert!(
            error.contains("rank 1: receives 4 bf16 elements from rank 0")
                && error.contains("but rank 0 sent 4 f32 elements"),
            "rank {r}: {error}"
        );
    }
    let errors = ranks(2, |r, b, comm| {
        let error = if r == 0 {
            transfer(b, comm, Some((&[1.0f32; 3][..], 0)), None).unwrap_err()
        } else {
            transfer::<f32>(b, comm, None, Some((3, 0))).unwrap_err()
        };
        error.to_string()
    });
    assert!(errors[0].contains("cannot send to itself"), "{}", errors[0]);
    assert!(
        errors[1].contains("rank 0: called send_recv (sending 3 f32 elements to rank 0)"),
        "{}",
        errors[1]
    );
    assert!(started.elapsed() < Duration::from_secs(30), "{errors:?}");

    let gpu = Gpu::open(0, Precision::F32, Duration::from_secs(60)).expect("the GPU opens");
    let b = gpu.backend("solo").expect("a queue");
    let solo = CudaComm::solo(&b);
    let error = transfer(&b, &solo, Some((&[1.0f32][..], 1)), None).unwrap_err();
    assert!(
        matches!(error, RuntimeError::InvalidArgument(_))
            && error
                .to_string()
                .contains("a group of one rank has no peer"),
        "{error}"
    );
}
