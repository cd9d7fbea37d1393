//! CPU collectives with thread ranks: results for 1 to 4 ranks, bit-identical
//! sums across ranks and runs, uneven and zero all-to-all counts, subgroups,
//! and faults (mismatched calls, a missing rank, a dropped or panicking
//! rank, abort). No test asserts on elapsed time; the short timeouts only
//! bound the timeout tests.

use hybridgen_runtime::backend::Backend;
use hybridgen_runtime::cpu::{CpuBackend, CpuBuf};
use hybridgen_runtime::view::{DType, View, ViewMut};
use hybridgen_runtime::{Collective, CpuComm, CpuLane, CpuWorld, Event, Label, Lane, RuntimeError};
use std::sync::Arc;
use std::time::Duration;

/// The collectives on host slices: upload, call, download. The collectives
/// move device buffers; these tests reason about values.
trait HostCollective {
    fn gather(&self, shard: &[f32], full: &mut [f32]) -> hybridgen_runtime::Result<()>;
    fn scatter(&self, full: &[f32], shard: &mut [f32]) -> hybridgen_runtime::Result<()>;
    fn reduce(&self, buf: &mut [f32]) -> hybridgen_runtime::Result<()>;
    fn a2a(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> hybridgen_runtime::Result<()>;
}

fn up(values: &[f32]) -> CpuBuf {
    let dev = CpuBackend::default();
    let buf = dev.alloc(values.len(), DType::F32).unwrap();
    dev.upload(values, ViewMut::whole(&buf)).unwrap();
    buf
}

fn down(buf: &CpuBuf, out: &mut [f32]) {
    CpuBackend::default()
        .download(View::whole(buf), out)
        .unwrap();
}

impl<C: Collective<CpuBackend>> HostCollective for C {
    fn gather(&self, shard: &[f32], full: &mut [f32]) -> hybridgen_runtime::Result<()> {
        let (s, f) = (up(shard), up(full));
        self.all_gather(View::whole(&s), ViewMut::whole(&f))?;
        down(&f, full);
        Ok(())
    }

    fn scatter(&self, full: &[f32], shard: &mut [f32]) -> hybridgen_runtime::Result<()> {
        let (f, s) = (up(full), up(shard));
        self.reduce_scatter(View::whole(&f), ViewMut::whole(&s))?;
        down(&s, shard);
        Ok(())
    }

    fn reduce(&self, buf: &mut [f32]) -> hybridgen_runtime::Result<()> {
        let b = up(buf);
        self.all_reduce(ViewMut::whole(&b))?;
        down(&b, buf);
        Ok(())
    }

    fn a2a(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) -> hybridgen_runtime::Result<()> {
        let (s, r) = (up(send), up(recv));
        self.all_to_all(View::whole(&s), send_counts, ViewMut::whole(&r), recv_counts)?;
        down(&r, recv);
        Ok(())
    }
}

/// Generous: a correct test never waits this long; a broken one fails
/// instead of hanging.
const PATIENT: Duration = Duration::from_secs(20);

/// Runs `f` on every rank of a fresh world, one thread per rank; returns
/// the results in rank order.
fn run_ranks<T: Send>(size: usize, timeout: Duration, f: impl Fn(CpuComm) -> T + Sync) -> Vec<T> {
    let world = CpuWorld::with_timeout(size, timeout).unwrap();
    let comms = world.comms().unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let f = &f;
                s.spawn(move || f(comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Values whose float sum depends on the order of addition.
fn values(rank: usize, len: usize, salt: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x = ((i as u32).wrapping_mul(2654435761) ^ (rank as u32 * 7919 + salt)) % 1000;
            let scale = [1e8f32, 1.0, -1e8, 0.1][(i + rank) % 4];
            scale * (x as f32 + 0.37)
        })
        .collect()
}

/// `((x0 + x1) + x2) + ...` element-wise: the order the collectives promise.
fn rank_order_sum(parts: &[Vec<f32>]) -> Vec<f32> {
    let mut out = parts[0].clone();
    for part in &parts[1..] {
        for (o, x) in out.iter_mut().zip(part) {
            *o += *x;
        }
    }
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn all_gather_for_1_to_4_ranks() {
    for size in 1..=4 {
        for shard_len in [0, 1, 5] {
            let results = run_ranks(size, PATIENT, |comm| {
                let shard = values(comm.rank(), shard_len, 1);
                let mut full = vec![f32::NAN; shard_len * size];
                comm.gather(&shard, &mut full).unwrap();
                full
            });
            let expected: Vec<f32> = (0..size).flat_map(|r| values(r, shard_len, 1)).collect();
            for full in &results {
                assert_eq!(
                    bits(full),
                    bits(&expected),
                    "size {size}, shard {shard_len}"
                );
            }
        }
    }
}

#[test]
fn reduce_scatter_sums_in_rank_order() {
    for size in 1..=4 {
        for shard_len in [0, 1, 6] {
            let results = run_ranks(size, PATIENT, |comm| {
                let full = values(comm.rank(), shard_len * size, 2);
                let mut shard = vec![f32::NAN; shard_len];
                comm.scatter(&full, &mut shard).unwrap();
                shard
            });
            let parts: Vec<Vec<f32>> = (0..size).map(|r| values(r, shard_len * size, 2)).collect();
            let sum = rank_order_sum(&parts);
            for (rank, shard) in results.iter().enumerate() {
                assert_eq!(
                    bits(shard),
                    bits(&sum[rank * shard_len..(rank + 1) * shard_len]),
                    "size {size}, rank {rank}"
                );
            }
        }
    }
}

#[test]
fn all_reduce_is_bit_identical_across_ranks_and_runs() {
    // The test values really are order-sensitive: summing backwards differs.
    let parts: Vec<Vec<f32>> = (0..4).map(|r| values(r, 1000, 3)).collect();
    let forward = rank_order_sum(&parts);
    let reversed: Vec<Vec<f32>> = parts.iter().rev().cloned().collect();
    assert_ne!(bits(&forward), bits(&rank_order_sum(&reversed)));

    for size in 1..=4 {
        // Lengths not divisible by the rank count, and zero.
        for len in [0, 1, 7, 1000] {
            let run = || {
                run_ranks(size, PATIENT, |comm| {
                    let mut buf = values(comm.rank(), len, 3);
                    comm.reduce(&mut buf).unwrap();
                    bits(&buf)
                })
            };
            let first = run();
            let parts: Vec<Vec<f32>> = (0..size).map(|r| values(r, len, 3)).collect();
            let expected = if len == 0 {
                Vec::new()
            } else {
                bits(&rank_order_sum(&parts))
            };
            for result in &first {
                assert_eq!(result, &expected, "size {size}, len {len}");
            }
            assert_eq!(first, run(), "size {size}, len {len}: runs differ");
        }
    }
}

/// Rank r sends `(r + 2j) % 3` elements to rank j: uneven, with zeros.
fn send_counts(rank: usize, size: usize) -> Vec<usize> {
    (0..size).map(|j| (rank + 2 * j) % 3).collect()
}

/// Element k of what rank `from` sends to rank `to`.
fn tagged(from: usize, to: usize, k: usize) -> f32 {
    (from * 10_000 + to * 100 + k) as f32
}

#[test]
fn all_to_all_with_uneven_and_zero_counts() {
    for size in 1..=4 {
        let results = run_ranks(size, PATIENT, |comm| {
            let me = comm.rank();
            let counts = send_counts(me, size);
            let send: Vec<f32> = counts
                .iter()
                .enumerate()
                .flat_map(|(to, n)| (0..*n).map(move |k| tagged(me, to, k)))
                .collect();
            // Learn the receive counts the way the MoE dispatch does.
            let per_dest: Vec<Vec<usize>> = counts.iter().map(|n| vec![*n, 7]).collect();
            let recv_counts: Vec<usize> = comm
                .all_to_all_counts(&per_dest)
                .unwrap()
                .iter()
                .map(|v| {
                    assert_eq!(v[1], 7);
                    v[0]
                })
                .collect();
            let mut recv = vec![f32::NAN; recv_counts.iter().sum()];
            comm.a2a(&send, &counts, &mut recv, &recv_counts)
                .unwrap();
            (recv_counts, recv)
        });
        for (me, (recv_counts, recv)) in results.iter().enumerate() {
            let expected_counts: Vec<usize> = (0..size).map(|i| send_counts(i, size)[me]).collect();
            assert_eq!(recv_counts, &expected_counts);
            let expected: Vec<f32> = (0..size)
                .flat_map(|from| (0..expected_counts[from]).map(move |k| tagged(from, me, k)))
                .collect();
            assert_eq!(recv, &expected, "size {size}, rank {me}");
        }
    }
}

#[test]
fn host_gather_and_barrier() {
    let results = run_ranks(3, PATIENT, |comm| {
        comm.barrier().unwrap();
        let mine: Vec<f64> = (0..comm.rank()).map(|i| i as f64 + 0.5).collect();
        let all = comm.all_gather_host(&mine).unwrap();
        comm.barrier().unwrap();
        all
    });
    let expected = vec![vec![], vec![0.5], vec![0.5, 1.5]];
    assert!(results.iter().all(|r| r == &expected));
}

#[test]
fn many_calls_in_a_row_stay_in_step() {
    let results = run_ranks(4, PATIENT, |comm| {
        let mut total = 0.0f32;
        for i in 0..200 {
            let mut buf = vec![(comm.rank() + i) as f32; 3];
            comm.reduce(&mut buf).unwrap();
            total += buf[0];
        }
        total
    });
    assert!(results.iter().all(|t| *t == results[0]));
}

#[test]
fn subgroups_for_expert_and_expert_data_parallelism() {
    // 4 ranks, EP = 2: EP groups {0,1}, {2,3}; EDP groups {0,2}, {1,3}.
    let results = run_ranks(4, PATIENT, |world| {
        let rank = world.rank();
        let ep = world.split(rank / 2).unwrap();
        let edp = world.split(rank % 2).unwrap();
        let copy = world.split(0).unwrap();
        let mut in_ep = vec![rank as f32 + 1.0];
        ep.reduce(&mut in_ep).unwrap();
        let mut in_edp = vec![f32::NAN; 2];
        edp.gather(&[rank as f32], &mut in_edp).unwrap();
        let mut in_copy = vec![1.0f32];
        copy.reduce(&mut in_copy).unwrap();
        (
            ep.members().to_vec(),
            ep.rank(),
            edp.members().to_vec(),
            in_ep[0],
            in_edp,
            in_copy[0],
            ep.group_name().to_string(),
        )
    });
    let (members, ep_rank, edp_members, ep_sum, edp_gather, copy_sum, name) = &results[3];
    assert_eq!(members, &vec![2, 3]);
    assert_eq!(*ep_rank, 1);
    assert_eq!(edp_members, &vec![1, 3]);
    assert_eq!(*ep_sum, 3.0 + 4.0);
    assert_eq!(edp_gather, &vec![1.0, 3.0]);
    assert_eq!(*copy_sum, 4.0);
    assert_eq!(name, "group of ranks [2, 3]");
    assert_eq!(results[0].3, 1.0 + 2.0);
    assert_eq!(results[0].4, vec![0.0, 2.0]);
}

#[test]
fn collectives_run_on_a_comm_lane() {
    let results = run_ranks(2, PATIENT, |comm| {
        let comm = Arc::new(comm);
        let lane = CpuLane::new("comm").unwrap();
        let out = Arc::new(std::sync::Mutex::new(vec![0.0f32; 4]));
        let (c, o) = (comm.clone(), out.clone());
        let event = lane.submit(
            Label::new("all_gather bucket 0", "gather"),
            &[],
            Box::new(move |_: &CpuBackend| {
                let shard = [c.rank() as f32, 10.0 + c.rank() as f32];
                c.gather(&shard, &mut o.lock().unwrap())
            }),
        );
        event.wait().unwrap();
        lane.synchronize().unwrap();
        out.lock().unwrap().clone()
    });
    assert!(results.iter().all(|r| r == &vec![0.0, 10.0, 1.0, 11.0]));
}

// ---- faults -------------------------------------------------------------

fn peer_error(result: Result<(), RuntimeError>) -> (usize, String) {
    match result {
        Err(RuntimeError::Peer { rank, message }) => (rank, message),
        other => panic!("expected a peer error, got {other:?}"),
    }
}

#[test]
fn a_different_collective_is_reported_with_both_calls() {
    let results = run_ranks(2, PATIENT, |comm| {
        comm.barrier().unwrap();
        if comm.rank() == 0 {
            let mut full = vec![0.0; 8];
            comm.gather(&[1.0; 4], &mut full)
        } else {
            let mut shard = vec![0.0; 4];
            comm.scatter(&[1.0; 8], &mut shard)
        }
    });
    for result in results {
        let err = result.unwrap_err().to_string();
        // Whichever rank arrived second is named as the one that deviated.
        let rank0_second = err.starts_with(
            "rank 0: called all_gather #2 (4 f32 elements per rank) but \
                                            rank 1 called reduce_scatter #2 (8 f32 elements)",
        );
        let rank1_second = err.starts_with(
            "rank 1: called reduce_scatter #2 (8 f32 elements) but \
                                            rank 0 called all_gather #2 (4 f32 elements per rank)",
        );
        assert!(rank0_second || rank1_second, "{err}");
        assert!(err.contains("on world"), "{err}");
    }
}

#[test]
fn a_different_size_is_reported() {
    let results = run_ranks(3, PATIENT, |comm| {
        let mut buf = vec![0.0; if comm.rank() == 2 { 5 } else { 4 }];
        comm.reduce(&mut buf)
    });
    // The ranks that agree may all have arrived first or not: everyone
    // fails, and every error names the all_reduce sizes.
    for result in results {
        let err = result.unwrap_err().to_string();
        assert!(err.contains("all_reduce #1 (5 f32 elements)"), "{err}");
        assert!(err.contains("all_reduce #1 (4 f32 elements)"), "{err}");
    }
}

#[test]
fn inconsistent_all_to_all_counts_fail_on_every_rank() {
    let results = run_ranks(2, PATIENT, |comm| {
        // Rank 0 sends 2 to rank 1, but rank 1 expects 3 from rank 0.
        let (send_counts, recv_counts) = if comm.rank() == 0 {
            (vec![1, 2], vec![1, 1])
        } else {
            (vec![1, 0], vec![3, 0])
        };
        let send = vec![0.0; send_counts.iter().sum()];
        let mut recv = vec![0.0; recv_counts.iter().sum()];
        comm.a2a(&send, &send_counts, &mut recv, &recv_counts)
    });
    for result in results {
        let (rank, message) = peer_error(result);
        assert_eq!(rank, 0);
        assert!(
            message.starts_with(
                "sends 2 elements to rank 1 in all_to_all #1 on world, but rank 1 expects \
                 recv_counts[0] = 3"
            ),
            "{message}"
        );
    }
}

#[test]
fn invalid_arguments_on_one_rank_fail_its_peers_quickly() {
    let results = run_ranks(3, PATIENT, |comm| {
        let mut full = vec![0.0; if comm.rank() == 1 { 5 } else { 6 }];
        comm.gather(&[1.0, 2.0], &mut full)
    });
    let own = results[1].as_ref().unwrap_err().to_string();
    assert!(own.contains("invalid argument: rank 1: all_gather #1 (2 f32 elements per rank) on world: the output holds 5 f32 elements"), "{own}");
    for rank in [0, 2] {
        let message = results[rank].as_ref().unwrap_err().to_string();
        assert!(
            message.starts_with(
                "rank 1: called all_gather #1 (2 f32 elements per rank) on world with invalid arguments"
            ),
            "{message}"
        );
    }
}

#[test]
fn a_missing_rank_is_named_after_the_timeout() {
    let world = CpuWorld::with_timeout(3, Duration::from_millis(200)).unwrap();
    let comms = world.comms().unwrap();
    let (gave_up, seen) = std::sync::mpsc::channel::<()>();
    let mut seen = Some(seen);
    let results: Vec<Result<(), RuntimeError>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let gave_up = gave_up.clone();
                let seen = if comm.rank() == 2 { seen.take() } else { None };
                s.spawn(move || {
                    comm.all_gather_host(&[0.0]).unwrap();
                    match seen {
                        // Rank 2 stalls until both peers gave up, then
                        // arrives late and learns the group is broken.
                        Some(seen) => {
                            for _ in 0..2 {
                                seen.recv_timeout(PATIENT).unwrap();
                            }
                            comm.barrier()
                        }
                        None => {
                            let result = comm.barrier();
                            gave_up.send(()).unwrap();
                            result
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, result) in results.into_iter().enumerate() {
        let (missing, message) = peer_error(result);
        assert_eq!(missing, 2, "rank {rank}");
        assert!(
            message.starts_with(
                "did not join barrier #2 on world within 200ms: it may have died or stalled"
            ),
            "rank {rank}: {message}"
        );
    }
}

#[test]
fn a_late_rank_learns_that_its_peers_gave_up() {
    let world = CpuWorld::with_timeout(2, Duration::from_millis(200)).unwrap();
    let mut comms = world.comms().unwrap().into_iter();
    let (c0, c1) = (comms.next().unwrap(), comms.next().unwrap());
    let (rank, message) = peer_error(c0.barrier());
    assert_eq!(rank, 1);
    assert!(message.contains("did not join barrier #1"), "{message}");
    // Rank 1 finally arrives: it fails at once instead of waiting forever.
    let late = c1.barrier().unwrap_err().to_string();
    assert!(
        late.contains("rank 1: did not join barrier #1 on world within 200ms"),
        "{late}"
    );
    // And the group stays failed.
    assert!(c0.barrier().is_err());
}

#[test]
fn abort_wakes_blocked_ranks_in_every_group() {
    // With a 20 s timeout, only the abort can end this test quickly, and
    // the message tells the abort apart from a timeout.
    let results = run_ranks(4, PATIENT, |world| {
        let rank = world.rank();
        let ep = world.split(rank / 2).unwrap();
        match rank {
            // Ranks 0 and 2 block in groups that rank 1 / rank 3 never join.
            0 => {
                let mut out = vec![0.0; 2];
                ep.gather(&[1.0], &mut out).map(|_| ())
            }
            2 => world.barrier(),
            1 => {
                world.abort("loss is NaN at step 3");
                // Entering a collective after the abort fails too.
                ep.barrier()
            }
            _ => {
                let mut out = vec![0.0; 2];
                ep.gather(&[1.0], &mut out).map(|_| ())
            }
        }
    });
    for (rank, result) in results.into_iter().enumerate() {
        let (who, message) = peer_error(result);
        assert_eq!(who, 1, "rank {rank}: {message}");
        assert!(
            message.starts_with("aborted: loss is NaN at step 3"),
            "rank {rank}: {message}"
        );
    }
}

#[test]
fn a_rank_that_leaves_is_named() {
    let results = run_ranks(3, PATIENT, |comm| {
        if comm.rank() == 1 {
            drop(comm); // its thread ends without joining the barrier
            return Ok(());
        }
        comm.barrier()
    });
    assert!(results[1].is_ok());
    for rank in [0, 2] {
        let (who, message) = peer_error(results[rank].clone());
        assert_eq!(who, 1);
        assert!(
            message.starts_with("left world before joining barrier #1"),
            "{message}"
        );
    }
}

#[test]
fn a_panicking_rank_aborts_the_world() {
    let world = CpuWorld::with_timeout(2, PATIENT).unwrap();
    let mut comms = world.comms().unwrap().into_iter();
    let (c0, c1) = (comms.next().unwrap(), comms.next().unwrap());
    let crashed = std::thread::spawn(move || {
        let _comm = c1;
        panic!("rank 1 crashed");
    })
    .join();
    assert!(crashed.is_err());
    let (who, message) = peer_error(c0.barrier());
    assert_eq!(who, 1);
    assert!(
        message.contains("aborted: its thread panicked"),
        "{message}"
    );
    assert_eq!(world.aborted().map(|(r, _)| r), Some(1));
}
