//! The NCCL communicator on GPUs: every collective and point-to-point
//! transfer against the values it must give, the host-side exchanges,
//! splits, repeatability, and the ways it fails (a rank that never joins,
//! a peer that never calls or never sends, an abort from another thread, a
//! raised signal) ending within their deadlines with errors that name the
//! ranks.
//!
//! One process, a thread per GPU (as the single-process platform runs).
//! What runs on one GPU is checked with a communicator of one rank. The
//! tests are `#[ignore]`d, `"needs a GPU"` or `"needs two GPUs"` (those
//! have `two_gpus` in their names, so a one-GPU machine can skip them by
//! name): the binary is built on a machine without CUDA and run on one with
//! it with `--include-ignored` (scripts/cuda_bundle.sh); run without the
//! GPUs or NCCL it needs, a test fails saying why.
//! NVLink multicast must be off (`NCCL_NVLS_ENABLE=0`, as the bundle's
//! run.sh sets): on shared GPUs a test refuses to run otherwise.

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use half::bf16;
use hybridgen_runtime::RuntimeError;
use hybridgen_runtime::cuda::nccl::{
    AbortSignal, NcclComm, NcclUniqueId, StreamWait, nccl_version,
};
use hybridgen_runtime::cuda::{GpuView, probe};
use hybridgen_runtime::rendezvous::{Launcher, RankInfo};
use hybridgen_runtime::view::DType;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

// ---- set-up -----------------------------------------------------------------------

/// GPUs this test can use, or why none (printed by the caller).
fn gpus() -> Result<usize, String> {
    if std::env::var("NCCL_NVLS_ENABLE").as_deref() != Ok("0") {
        return Err(
            "NCCL_NVLS_ENABLE=0 is not set: NVLink multicast must stay off on shared \
                    GPUs (export NCCL_NVLS_ENABLE=0, as gpu-bundle/run.sh does)"
                .into(),
        );
    }
    let info = probe().map_err(|e| e.to_string())?;
    let version = nccl_version().map_err(|e| e.to_string())?;
    println!("{} GPU(s), NCCL {version}", info.devices.len());
    Ok(info.devices.len())
}

/// Runs `body` on at least `needed` GPUs with NCCL. The tests that call
/// this are `#[ignore]`d (they run where the GPUs are, with
/// `--include-ignored`): a machine without them fails them rather than
/// passing them unrun.
fn with_gpus(needed: usize, body: impl FnOnce()) {
    match gpus() {
        Ok(n) if n >= needed => {
            let _watchdog = Watchdog::arm(Duration::from_secs(180));
            body()
        }
        Ok(n) => panic!("needs {needed} GPUs, {n} visible"),
        Err(why) => panic!("needs {needed} GPUs with NCCL: {why}"),
    }
}

/// Ends the process if a test hangs (the failure every bounded wait here
/// exists to prevent), so a GPU run never stalls on it.
struct Watchdog(Arc<AtomicBool>);

impl Watchdog {
    fn arm(limit: Duration) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            while start.elapsed() < limit {
                if flag.load(Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            eprintln!("FAILED: a test hung for {limit:?}; aborting the process");
            std::process::abort();
        });
        Watchdog(done)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

fn stream_on(ordinal: usize) -> Arc<CudaStream> {
    let context = CudaContext::new(ordinal).expect("the probed device opens");
    // The backend orders its work with its own events, and so do these
    // tests (one stream per rank).
    // SAFETY: nothing has been allocated on this context by this test yet;
    // every buffer here is used on one stream.
    unsafe { context.disable_event_tracking() };
    context.new_stream().expect("a stream")
}

/// Device data and its view.
struct Buf<T> {
    slice: CudaSlice<T>,
    dtype: DType,
}

impl<T: DeviceRepr + Clone + Default> Buf<T> {
    fn new(stream: &Arc<CudaStream>, data: &[T], dtype: DType) -> Self {
        Buf {
            slice: stream.clone_htod(data).expect("upload"),
            dtype,
        }
    }

    fn zeros(stream: &Arc<CudaStream>, len: usize, dtype: DType) -> Self {
        Self::new(stream, &vec![T::default(); len], dtype)
    }

    fn view(&self, stream: &CudaStream) -> GpuView {
        let (ptr, _record) = self.slice.device_ptr(stream);
        GpuView::new(ptr, self.slice.len(), self.dtype)
    }

    /// A view of elements `[start, start + len)`.
    fn part(&self, stream: &CudaStream, start: usize, len: usize) -> GpuView {
        let whole = self.view(stream);
        GpuView::new(
            whole.ptr + (start * self.dtype.bytes()) as u64,
            len,
            self.dtype,
        )
    }

    /// The data, after a bounded wait for the stream (a download would
    /// block unboundedly on a stalled collective).
    fn read(&self, stream: &Arc<CudaStream>, comm: &NcclComm) -> Vec<T> {
        settle(stream, comm);
        stream.clone_dtoh(&self.slice).expect("download")
    }
}

fn settle(stream: &Arc<CudaStream>, comm: &NcclComm) {
    StreamWait {
        rank: comm.world_rank(),
        timeout: Duration::from_secs(60),
        comms: &[comm],
        signal: None,
    }
    .stream(stream, "the test's collectives")
    .expect("the collectives finish");
}

fn bits_f32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A deterministic pseudo-random f32 in [-1, 1): order-one values whose
/// sums round, for repeatability checks.
fn noise(seed: u64, i: usize) -> f32 {
    let mut x = seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// A world of `ranks` GPU ranks (ranks 0.. on GPUs 0..), each running
/// `body` on its own thread; returns what each returned, in rank order.
fn world<R: Send>(
    ranks: usize,
    timeout: Duration,
    body: impl Fn(usize, NcclComm, Arc<CudaStream>) -> R + Sync,
) -> Vec<R> {
    let id = NcclUniqueId::new().expect("a unique id");
    let signal = AbortSignal::new();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let (body, signal) = (&body, signal.clone());
                scope.spawn(move || {
                    let stream = stream_on(r);
                    let comm =
                        NcclComm::from_unique_id(&id, r, ranks, stream.clone(), timeout, signal)
                            .unwrap_or_else(|e| panic!("rank {r} joins: {e}"));
                    body(r, comm, stream)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("no rank panics"))
            .collect()
    })
}

fn assert_contains(error: &RuntimeError, parts: &[&str]) {
    let text = error.to_string();
    for part in parts {
        assert!(text.contains(part), "`{part}` is missing from: {text}");
    }
}

// ---- one rank ---------------------------------------------------------------------

#[test]
#[ignore = "needs a GPU"]
fn every_call_on_a_world_of_one_rank() {
    with_gpus(1, || {
        world(1, Duration::from_secs(30), |_, comm, stream| {
            assert_eq!((comm.rank(), comm.size(), comm.world_rank()), (0, 1, 0));
            assert_eq!(comm.group_name(), "world");
            // Gather and reduce of one rank copy; in place and apart.
            let data: Vec<f32> = (0..1001).map(|i| noise(1, i)).collect();
            let shard = Buf::new(&stream, &data, DType::F32);
            let full = Buf::<f32>::zeros(&stream, 1001, DType::F32);
            comm.all_gather(shard.view(&stream), full.view(&stream))
                .unwrap();
            assert_eq!(bits_f32(&full.read(&stream, &comm)), bits_f32(&data));
            let out = Buf::<f32>::zeros(&stream, 1001, DType::F32);
            comm.reduce_scatter(shard.view(&stream), out.view(&stream))
                .unwrap();
            comm.all_reduce(out.view(&stream)).unwrap();
            assert_eq!(bits_f32(&out.read(&stream, &comm)), bits_f32(&data));
            let halves: Vec<bf16> = (0..777).map(|i| bf16::from_f32(noise(2, i))).collect();
            let b = Buf::new(&stream, &halves, DType::Bf16);
            let gathered = Buf::<bf16>::zeros(&stream, 777, DType::Bf16);
            comm.all_gather(b.view(&stream), gathered.view(&stream))
                .unwrap();
            assert_eq!(gathered.read(&stream, &comm), halves);
            // All-to-all to itself (a device copy), and of nothing.
            let to_self = Buf::<f32>::zeros(&stream, 1001, DType::F32);
            comm.all_to_all(shard.view(&stream), &[1001], to_self.view(&stream), &[1001])
                .unwrap();
            assert_eq!(bits_f32(&to_self.read(&stream, &comm)), bits_f32(&data));
            comm.all_to_all(
                shard.part(&stream, 0, 0),
                &[0],
                to_self.part(&stream, 0, 0),
                &[0],
            )
            .unwrap();
            // Host exchanges, short and long (a second round, then a grown
            // block), and the barrier.
            assert_eq!(
                comm.all_gather_host(&[1.5, -2.0]).unwrap(),
                vec![vec![1.5, -2.0]]
            );
            let long: Vec<f64> = (0..300).map(|i| i as f64 * 0.25).collect();
            assert_eq!(comm.all_gather_host(&long).unwrap(), vec![long.clone()]);
            assert_eq!(comm.all_gather_host(&long).unwrap(), vec![long]);
            let counts: Vec<usize> = (0..150).collect();
            assert_eq!(
                comm.all_to_all_counts(std::slice::from_ref(&counts))
                    .unwrap(),
                vec![counts]
            );
            assert_eq!(
                comm.all_to_all_counts(&[vec![]]).unwrap(),
                vec![Vec::<usize>::new()]
            );
            comm.barrier().unwrap();
            comm.check().unwrap();
            // Bad arguments are refused, naming the call, and leave the
            // communicator usable.
            let err = comm
                .all_gather(shard.view(&stream), full.part(&stream, 0, 1000))
                .unwrap_err();
            assert_contains(
                &err,
                &[
                    "rank 0: all_gather (1001 f32 elements per rank) on world",
                    "1000",
                ],
            );
            let err = comm.all_reduce(b.view(&stream)).unwrap_err();
            assert_contains(&err, &["`buf` is bf16"]);
            let err = comm.all_to_all_counts(&[vec![1], vec![2]]).unwrap_err();
            assert_contains(
                &err,
                &["2 count vectors were given but the group has 1 ranks"],
            );
            comm.barrier().unwrap();
            // Splits: a copy, a group of its own, one on another stream.
            let copy = comm.split(0).unwrap();
            assert_eq!((copy.size(), copy.group_name()), (1, "copy of world"));
            copy.barrier().unwrap();
            let other_stream = stream.context().new_stream().unwrap();
            let on_other = comm.split_on(7, other_stream.clone()).unwrap();
            assert!(Arc::ptr_eq(on_other.stream(), &other_stream));
            assert_eq!(on_other.all_gather_host(&[3.0]).unwrap(), vec![vec![3.0]]);
            let err = comm.split(usize::MAX).unwrap_err();
            assert_contains(&err, &["colour", "larger than NCCL takes"]);
            // Abort: idempotent, and every later call says why.
            copy.abort();
            copy.abort();
            assert!(copy.is_aborted());
            let err = copy.barrier().unwrap_err();
            assert_contains(
                &err,
                &["aborted", "aborted its communicator on copy of world"],
            );
            assert!(copy.check().is_err());
            comm.barrier().unwrap();
        });
    });
}

#[test]
#[ignore = "needs a GPU"]
fn a_world_from_the_rendezvous() {
    with_gpus(1, || {
        let info = RankInfo {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: free_port(),
            launcher: Launcher::Torchrun,
        };
        let stream = stream_on(0);
        let comm =
            NcclComm::from_rendezvous(&info, stream, Duration::from_secs(30), AbortSignal::new())
                .unwrap();
        comm.barrier().unwrap();
    });
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

#[test]
#[ignore = "needs a GPU"]
fn a_rank_that_never_joins_times_out_naming_the_ranks() {
    with_gpus(1, || {
        // Rank 1 of 2 never comes: rank 0 gives up at its timeout.
        let id = NcclUniqueId::new().unwrap();
        let timeout = Duration::from_secs(2);
        let start = Instant::now();
        let err = NcclComm::from_unique_id(&id, 0, 2, stream_on(0), timeout, AbortSignal::new())
            .unwrap_err();
        let waited = start.elapsed();
        println!("a missing rank: {err} (after {waited:?})");
        assert_contains(
            &err,
            &[
                "rank 0: timed out after 2s",
                "the other rank (rank 1) did not join",
                "--timeout",
            ],
        );
        assert_eq!(err.code(), "peer_failed");
        assert!(waited < timeout + Duration::from_secs(20), "{waited:?}");
        // A raised signal (the platform saw rank 1 fail) ends the wait at
        // once, naming rank 1.
        let id = NcclUniqueId::new().unwrap();
        let signal = AbortSignal::new();
        let raiser = signal.clone();
        let start = Instant::now();
        let err = std::thread::scope(|scope| {
            scope.spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                raiser.raise(1, "it failed to load its data");
            });
            NcclComm::from_unique_id(&id, 0, 2, stream_on(0), Duration::from_secs(120), signal)
                .unwrap_err()
        });
        let waited = start.elapsed();
        println!("a raised signal: {err} (after {waited:?})");
        assert_contains(
            &err,
            &["rank 1: aborted: it failed to load its data (rank 0 was joining"],
        );
        assert!(waited < Duration::from_secs(30), "{waited:?}");
    });
}

/// Stalls a stream with a host function that waits for a flag (at most a
/// minute): work queued behind it never starts until the flag is set.
struct Stall(&'static AtomicBool);

impl Stall {
    fn on(stream: &CudaStream) -> Self {
        let flag: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
        unsafe extern "C" fn hold(arg: *mut std::ffi::c_void) {
            // SAFETY: `arg` is the leaked AtomicBool below.
            let flag = unsafe { &*(arg as *const AtomicBool) };
            let start = Instant::now();
            while !flag.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        stream.context().bind_to_thread().unwrap();
        // SAFETY: the flag lives for the process; `hold` calls no CUDA API.
        unsafe {
            cudarc::driver::result::stream::launch_host_function(
                stream.cu_stream(),
                hold,
                flag as *const AtomicBool as *mut std::ffi::c_void,
            )
        }
        .expect("a host function");
        Stall(flag)
    }

    fn release(&self) {
        self.0.store(true, Ordering::Release);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_stalled_stream_times_out_and_an_abort_ends_a_wait() {
    with_gpus(1, || {
        world(1, Duration::from_secs(60), |_, comm, stream| {
            let stall = Stall::on(&stream);
            let start = Instant::now();
            let err = StreamWait {
                rank: 0,
                timeout: Duration::from_millis(500),
                comms: &[],
                signal: None,
            }
            .stream(&stream, "the compute lane's work")
            .unwrap_err();
            let waited = start.elapsed();
            println!("a stalled stream: {err} (after {waited:?})");
            assert_contains(
                &err,
                &[
                    "rank 0: timed out after 500ms waiting for the compute lane's work on cuda:0",
                    "--timeout",
                ],
            );
            assert!(waited < Duration::from_secs(10), "{waited:?}");
            // A wait on the stalled stream that involves the communicator
            // (its timeout is a minute) ends when another thread aborts it.
            // (Only the wait is queued behind the stall: NCCL's abort of the
            // last communicator of a process waits for work of its own on
            // the stream, which a host function holds up, unlike the NCCL
            // kernels an abort ends; the two-GPU tests abort those.)
            let comm = Arc::new(comm);
            let aborter = comm.clone();
            let start = Instant::now();
            let err = std::thread::scope(|scope| {
                scope.spawn(move || {
                    std::thread::sleep(Duration::from_millis(300));
                    aborter.abort_with(0, "the driver gave up on step 3");
                });
                StreamWait {
                    rank: 0,
                    timeout: Duration::from_secs(60),
                    comms: &[&comm],
                    signal: None,
                }
                .stream(&stream, "the comm lane's work")
                .unwrap_err()
            });
            let waited = start.elapsed();
            println!("an abort: {err} (after {waited:?})");
            assert_contains(
                &err,
                &[
                    "rank 0: aborted: the driver gave up on step 3 (rank 0 was waiting for the comm lane's work)",
                ],
            );
            assert!(waited < Duration::from_secs(20), "{waited:?}");
            assert!(
                comm.barrier().is_err(),
                "an aborted communicator stays aborted"
            );
            stall.release();
            StreamWait {
                rank: 0,
                timeout: Duration::from_secs(30),
                comms: &[],
                signal: None,
            }
            .stream(&stream, "the stream after the abort")
            .expect("the stream drains");
        });
    });
}

// ---- two ranks --------------------------------------------------------------------

#[test]
#[ignore = "needs two GPUs"]
fn collectives_between_two_gpus_give_the_expected_values() {
    with_gpus(2, || {
        world(2, Duration::from_secs(60), |r, comm, stream| {
            let n = 2;
            // All-gather, f32 of an odd size and bf16.
            let s = 1001;
            let shard: Vec<f32> = (0..s).map(|i| (r * 100_000 + i) as f32).collect();
            let full = Buf::<f32>::zeros(&stream, s * n, DType::F32);
            comm.all_gather(
                Buf::new(&stream, &shard, DType::F32).view(&stream),
                full.view(&stream),
            )
            .unwrap();
            let want: Vec<f32> = (0..n)
                .flat_map(|q| (0..s).map(move |i| (q * 100_000 + i) as f32))
                .collect();
            assert_eq!(full.read(&stream, &comm), want, "rank {r}");
            let s = 777;
            let halves: Vec<bf16> = (0..s).map(|i| bf16::from_f32(noise(r as u64, i))).collect();
            let gathered = Buf::<bf16>::zeros(&stream, s * n, DType::Bf16);
            comm.all_gather(
                Buf::new(&stream, &halves, DType::Bf16).view(&stream),
                gathered.view(&stream),
            )
            .unwrap();
            let want: Vec<bf16> = (0..n)
                .flat_map(|q| (0..s).map(move |i| bf16::from_f32(noise(q as u64, i))))
                .collect();
            assert_eq!(gathered.read(&stream, &comm), want, "rank {r}");
            // In place: this rank's slot of the full buffer is the shard.
            let start: Vec<f32> = (0..6)
                .map(|k| if k / 3 == r { r as f32 + 10.0 } else { -1.0 })
                .collect();
            let inplace = Buf::new(&stream, &start, DType::F32);
            comm.all_gather(inplace.part(&stream, 3 * r, 3), inplace.view(&stream))
                .unwrap();
            assert_eq!(
                inplace.read(&stream, &comm),
                vec![10.0, 10.0, 10.0, 11.0, 11.0, 11.0]
            );
            // Reduce-scatter and all-reduce of exact integers.
            let s = 513;
            let contribution: Vec<f32> = (0..s * n).map(|k| (k * (r + 1)) as f32).collect();
            let out = Buf::<f32>::zeros(&stream, s, DType::F32);
            comm.reduce_scatter(
                Buf::new(&stream, &contribution, DType::F32).view(&stream),
                out.view(&stream),
            )
            .unwrap();
            let want: Vec<f32> = (0..s).map(|i| ((r * s + i) * 3) as f32).collect();
            assert_eq!(out.read(&stream, &comm), want, "rank {r}");
            let summed = Buf::new(&stream, &contribution, DType::F32);
            comm.all_reduce(summed.view(&stream)).unwrap();
            let want: Vec<f32> = (0..s * n).map(|k| (k * 3) as f32).collect();
            assert_eq!(summed.read(&stream, &comm), want, "rank {r}");
            comm.check().unwrap();
        });
    });
}

#[test]
#[ignore = "needs two GPUs"]
fn on_two_gpus_all_to_all_moves_uneven_and_empty_segments() {
    with_gpus(2, || {
        world(2, Duration::from_secs(60), |r, comm, stream| {
            // counts[i][j]: what rank i sends rank j. Rank 0 sends rank 1
            // nothing; rank 1 sends rank 0 a large segment.
            let cases: [[[usize; 2]; 2]; 3] = [
                [[3, 0], [5, 2]],
                [[0, 7], [0, 0]],
                [[1, 100_000], [65_537, 4]],
            ];
            for (case, counts) in cases.iter().enumerate() {
                for dtype in [DType::F32, DType::Bf16] {
                    let send_counts = counts[r];
                    let recv_counts = [counts[0][r], counts[1][r]];
                    // Element k of the segment rank r sends rank j: r, j, k.
                    let value =
                        |from: usize, to: usize, k: usize| (from * 1000 + to * 100 + k % 97) as f32;
                    let send: Vec<f32> = (0..2)
                        .flat_map(|j| (0..send_counts[j]).map(move |k| value(r, j, k)))
                        .collect();
                    let want: Vec<f32> = (0..2)
                        .flat_map(|i| (0..recv_counts[i]).map(move |k| value(i, r, k)))
                        .collect();
                    let total: usize = recv_counts.iter().sum();
                    let got: Vec<f32> = if dtype == DType::F32 {
                        let s = Buf::new(&stream, &send, dtype);
                        let out = Buf::<f32>::zeros(&stream, total, dtype);
                        comm.all_to_all(
                            s.view(&stream),
                            &send_counts,
                            out.view(&stream),
                            &recv_counts,
                        )
                        .unwrap();
                        out.read(&stream, &comm)
                    } else {
                        let halves: Vec<bf16> = send.iter().map(|&x| bf16::from_f32(x)).collect();
                        let s = Buf::new(&stream, &halves, dtype);
                        let out = Buf::<bf16>::zeros(&stream, total, dtype);
                        comm.all_to_all(
                            s.view(&stream),
                            &send_counts,
                            out.view(&stream),
                            &recv_counts,
                        )
                        .unwrap();
                        out.read(&stream, &comm)
                            .iter()
                            .map(|x| x.to_f32())
                            .collect()
                    };
                    let want: Vec<f32> = if dtype == DType::F32 {
                        want
                    } else {
                        want.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
                    };
                    assert_eq!(got, want, "case {case} {dtype} rank {r}");
                }
            }
        });
    });
}

#[test]
#[ignore = "needs two GPUs"]
fn host_exchanges_and_splits_between_two_gpus() {
    with_gpus(2, || {
        world(2, Duration::from_secs(60), |r, comm, stream| {
            // Different lengths per rank, one past the first block.
            let mine: Vec<f64> = if r == 0 {
                vec![0.5]
            } else {
                (0..200).map(f64::from).collect()
            };
            let all = comm.all_gather_host(&mine).unwrap();
            assert_eq!(all[0], vec![0.5]);
            assert_eq!(all[1], (0..200).map(f64::from).collect::<Vec<_>>());
            // Count vectors of different lengths per peer, empty ones too.
            let send: Vec<Vec<usize>> = (0..2)
                .map(|to| {
                    (0..(r * 70 + to * 3))
                        .map(|k| r * 10_000 + to * 1000 + k)
                        .collect()
                })
                .collect();
            let got = comm.all_to_all_counts(&send).unwrap();
            for (from, got) in got.iter().enumerate() {
                let want: Vec<usize> = (0..(from * 70 + r * 3))
                    .map(|k| from * 10_000 + r * 1000 + k)
                    .collect();
                assert_eq!(got, &want, "rank {r} from {from}");
            }
            comm.barrier().unwrap();
            // Split into a group each, then a copy of the world.
            let alone = comm.split(r).unwrap();
            assert_eq!(
                (alone.size(), alone.rank(), alone.members()),
                (1, 0, &[r][..])
            );
            assert_eq!(alone.group_name(), format!("group of ranks [{r}]"));
            let copy = comm.split(0).unwrap();
            assert_eq!(
                (copy.size(), copy.rank(), copy.group_name()),
                (2, r, "copy of world")
            );
            let one = Buf::new(&stream, &[1.0f32; 5], DType::F32);
            alone.all_reduce(one.view(&stream)).unwrap();
            copy.all_reduce(one.view(&stream)).unwrap();
            assert_eq!(one.read(&stream, &copy), vec![2.0; 5]);
            let second_stream = stream.context().new_stream().unwrap();
            let on_other = comm.split_on(0, second_stream).unwrap();
            assert_eq!(
                on_other.all_gather_host(&[r as f64]).unwrap(),
                vec![vec![0.0], vec![1.0]]
            );
            // A refusal reaches the peer at once, naming the rank.
            let sent = if r == 0 {
                vec![vec![1], vec![2], vec![3]]
            } else {
                vec![vec![1], vec![2]]
            };
            let err = comm.all_to_all_counts(&sent).unwrap_err();
            if r == 0 {
                assert!(matches!(err, RuntimeError::InvalidArgument(_)), "{err}");
                assert_contains(
                    &err,
                    &["3 count vectors were given but the group has 2 ranks"],
                );
            } else {
                assert_contains(
                    &err,
                    &[
                        "rank 0: called all_to_all_counts #",
                        "with invalid arguments: 3 count vectors",
                    ],
                );
            }
            // Different calls are reported, each rank naming the other.
            let err = if r == 0 {
                comm.barrier().unwrap_err()
            } else {
                comm.all_gather_host(&[1.0]).unwrap_err()
            };
            let other = 1 - r;
            assert_contains(
                &err,
                &[
                    &format!("rank {other}: called "),
                    &format!("but rank {r} called"),
                ],
            );
            // The exchanges stay in step afterwards.
            comm.barrier().unwrap();
        });
    });
}

#[test]
#[ignore = "needs two GPUs"]
fn on_two_gpus_the_same_call_gives_the_same_bits() {
    with_gpus(2, || {
        let runs = world(2, Duration::from_secs(60), |r, comm, stream| {
            let len = 1 << 20;
            let data: Vec<f32> = (0..len).map(|i| noise(r as u64 + 7, i)).collect();
            let mut results = Vec::new();
            for _ in 0..2 {
                let buf = Buf::new(&stream, &data, DType::F32);
                comm.all_reduce(buf.view(&stream)).unwrap();
                let shard = Buf::<f32>::zeros(&stream, len / 2, DType::F32);
                comm.reduce_scatter(
                    Buf::new(&stream, &data, DType::F32).view(&stream),
                    shard.view(&stream),
                )
                .unwrap();
                results.push((
                    bits_f32(&buf.read(&stream, &comm)),
                    bits_f32(&shard.read(&stream, &comm)),
                ));
            }
            assert_eq!(results[0], results[1], "rank {r}: two runs differ");
            // The host time of issuing a small collective (non-blocking
            // communicators hand each call to an NCCL thread).
            let small = Buf::<f32>::zeros(&stream, 1024, DType::F32);
            settle(&stream, &comm);
            let calls = 200;
            let start = Instant::now();
            for _ in 0..calls {
                comm.all_reduce(small.view(&stream)).unwrap();
            }
            let issue = start.elapsed() / calls;
            settle(&stream, &comm);
            (results.remove(0), issue)
        });
        assert_eq!(runs[0].0.0, runs[1].0.0, "every rank holds the same sum");
        println!(
            "issuing an all_reduce of 1024 f32: {:?} (rank 0), {:?} (rank 1) of host time per call",
            runs[0].1, runs[1].1
        );
    });
}

#[test]
#[ignore = "needs two GPUs"]
fn on_two_gpus_a_peer_that_never_calls_times_out_and_the_stream_drains() {
    with_gpus(2, || {
        let timeout = Duration::from_secs(2);
        world(2, timeout, |r, comm, stream| {
            // Both ranks run the collective once (NCCL connects its
            // algorithm's peers on first use), then only rank 0 does.
            let buf = Buf::new(&stream, &vec![1.0f32; 4096], DType::F32);
            comm.all_reduce(buf.view(&stream)).unwrap();
            settle(&stream, &comm);
            comm.barrier().unwrap();
            if r == 1 {
                // Rank 1 never calls; it keeps its communicator until rank 0
                // has given up (the barrier below is never reached by rank 0).
                std::thread::sleep(timeout * 3);
                return;
            }
            comm.all_reduce(buf.view(&stream)).unwrap();
            let start = Instant::now();
            let err = StreamWait {
                rank: 0,
                timeout,
                comms: &[&comm],
                signal: None,
            }
            .stream(&stream, "the comm lane's all_reduce")
            .unwrap_err();
            let waited = start.elapsed();
            println!("a peer that never calls: {err} (after {waited:?})");
            assert_contains(
                &err,
                &[
                    "rank 0: timed out after 2s waiting for the comm lane's all_reduce on cuda:0",
                    "ranks [1] of world",
                    "--timeout",
                ],
            );
            assert!(waited < timeout + Duration::from_secs(10), "{waited:?}");
            assert!(comm.is_aborted());
            // The abort ended the kernel: the stream drains.
            StreamWait {
                rank: 0,
                timeout: Duration::from_secs(30),
                comms: &[],
                signal: None,
            }
            .stream(&stream, "the stream after the abort")
            .expect("the aborted collective ends");
        });
    });
}

#[test]
#[ignore = "needs two GPUs"]
fn on_two_gpus_an_abort_or_a_signal_ends_a_pending_collective() {
    with_gpus(2, || {
        // An abort from another thread while rank 0 waits on a collective
        // rank 1 never joins (the timeout is far away).
        let signal_seen = world(2, Duration::from_secs(120), |r, comm, stream| {
            // Both ranks run the collective once (NCCL connects its
            // algorithm's peers on first use), then only rank 0 does.
            let buf = Buf::new(&stream, &vec![1.0f32; 4096], DType::F32);
            comm.all_reduce(buf.view(&stream)).unwrap();
            settle(&stream, &comm);
            comm.barrier().unwrap();
            if r == 1 {
                std::thread::sleep(Duration::from_secs(3));
                return None;
            }
            let comm = Arc::new(comm);
            comm.all_reduce(buf.view(&stream)).unwrap();
            let aborter = comm.clone();
            let start = Instant::now();
            let err = std::thread::scope(|scope| {
                scope.spawn(move || {
                    std::thread::sleep(Duration::from_millis(300));
                    aborter.abort_with(1, "its thread panicked");
                });
                StreamWait {
                    rank: 0,
                    timeout: Duration::from_secs(120),
                    comms: &[&comm],
                    signal: None,
                }
                .stream(&stream, "the all_reduce")
                .unwrap_err()
            });
            let waited = start.elapsed();
            println!("an abort: {err} (after {waited:?})");
            assert_contains(
                &err,
                &["rank 1: aborted: its thread panicked (rank 0 was waiting for"],
            );
            assert!(waited < Duration::from_secs(20), "{waited:?}");
            Some(err)
        });
        assert!(signal_seen[0].is_some());
        // The signal: rank 1 fails and raises it; rank 0's wait ends.
        world(2, Duration::from_secs(120), |r, comm, stream| {
            // Both ranks run the collective once (NCCL connects its
            // algorithm's peers on first use), then only rank 0 does.
            let buf = Buf::new(&stream, &vec![1.0f32; 4096], DType::F32);
            comm.all_reduce(buf.view(&stream)).unwrap();
            settle(&stream, &comm);
            comm.barrier().unwrap();
            if r == 1 {
                std::thread::sleep(Duration::from_millis(300));
                comm.signal().raise(1, "its optimizer step failed");
                return;
            }
            comm.all_reduce(buf.view(&stream)).unwrap();
            let start = Instant::now();
            let err = StreamWait {
                rank: 0,
                timeout: Duration::from_secs(120),
                comms: &[&comm],
                signal: None,
            }
            .stream(&stream, "the all_reduce")
            .unwrap_err();
            println!("a signal: {err} (after {:?})", start.elapsed());
            assert_contains(&err, &["rank 1: aborted: its optimizer step failed"]);
            assert!(start.elapsed() < Duration::from_secs(20));
            assert!(comm.is_aborted());
        });
    });
}

/// Point-to-point between two GPUs: the ranks send to each other in one
/// call (one NCCL group, so neither waits on the other), large and small;
/// messages of several dtypes from one rank to the other arrive in order,
/// bit for bit, in calls of their own and several to a group; empty views
/// move nothing; bad peers and overlapping views are refused, naming the
/// call, and leave the communicator usable.
#[test]
#[ignore = "needs two GPUs"]
fn on_two_gpus_point_to_point_passes_messages_both_ways_and_in_order() {
    with_gpus(2, || {
        world(2, Duration::from_secs(60), |r, comm, stream| {
            let other = 1 - r;
            for (round, len) in [(0u64, 1001), (1, 1 << 20), (2, 3)] {
                let mine: Vec<f32> = (0..len).map(|i| noise(10 * round + r as u64, i)).collect();
                let send = Buf::new(&stream, &mine, DType::F32);
                let recv = Buf::<f32>::zeros(&stream, len, DType::F32);
                comm.send_recv(
                    Some((send.view(&stream), other)),
                    Some((recv.view(&stream), other)),
                )
                .unwrap();
                let want: Vec<f32> = (0..len)
                    .map(|i| noise(10 * round + other as u64, i))
                    .collect();
                assert_eq!(
                    bits_f32(&recv.read(&stream, &comm)),
                    bits_f32(&want),
                    "rank {r}, round {round}"
                );
            }
            let halves: Vec<bf16> = (0..777).map(|i| bf16::from_f32(noise(7, i))).collect();
            let words: Vec<u32> = (0..513u32).map(|i| i.wrapping_mul(0x9E37_79B9)).collect();
            let floats: Vec<f32> = (0..65).map(|i| noise(8, i)).collect();
            if r == 0 {
                let a = Buf::new(&stream, &halves, DType::Bf16);
                let b = Buf::new(&stream, &words, DType::U32);
                let c = Buf::new(&stream, &floats, DType::F32);
                for view in [a.view(&stream), b.view(&stream), c.view(&stream)] {
                    comm.send_recv(Some((view, 1)), None).unwrap();
                }
                comm.send_recv(Some((c.part(&stream, 0, 0), 1)), None)
                    .unwrap();
                settle(&stream, &comm);
            } else {
                let a = Buf::<bf16>::zeros(&stream, 777, DType::Bf16);
                let b = Buf::<u32>::zeros(&stream, 513, DType::U32);
                let c = Buf::<f32>::zeros(&stream, 65, DType::F32);
                for view in [a.view(&stream), b.view(&stream), c.view(&stream)] {
                    comm.send_recv(None, Some((view, 0))).unwrap();
                }
                comm.send_recv(None, Some((c.part(&stream, 0, 0), 0)))
                    .unwrap();
                assert_eq!(a.read(&stream, &comm), halves);
                assert_eq!(b.read(&stream, &comm), words);
                assert_eq!(bits_f32(&c.read(&stream, &comm)), bits_f32(&floats));
            }
            // Several transfers as one group: two each way, matched in the
            // order they were posted.
            let first: Vec<f32> = (0..300).map(|i| noise(20 + r as u64, i)).collect();
            let second: Vec<bf16> = (0..77)
                .map(|i| bf16::from_f32(noise(30 + r as u64, i)))
                .collect();
            let (x, y) = (
                Buf::new(&stream, &first, DType::F32),
                Buf::new(&stream, &second, DType::Bf16),
            );
            let (rx, ry) = (
                Buf::<f32>::zeros(&stream, 300, DType::F32),
                Buf::<bf16>::zeros(&stream, 77, DType::Bf16),
            );
            comm.send_recv_all(
                &[(x.view(&stream), other), (y.view(&stream), other)],
                &[(rx.view(&stream), other), (ry.view(&stream), other)],
            )
            .unwrap();
            let want: Vec<f32> = (0..300).map(|i| noise(20 + other as u64, i)).collect();
            assert_eq!(bits_f32(&rx.read(&stream, &comm)), bits_f32(&want));
            let want: Vec<bf16> = (0..77)
                .map(|i| bf16::from_f32(noise(30 + other as u64, i)))
                .collect();
            assert_eq!(ry.read(&stream, &comm), want);
            let buf = Buf::<f32>::zeros(&stream, 8, DType::F32);
            let err = comm
                .send_recv(Some((buf.view(&stream), r)), None)
                .unwrap_err();
            let call = format!("rank {r}: send_recv (sending 8 f32 elements to rank {r}) on world");
            assert_contains(&err, &[&call, "cannot send to itself"]);
            let err = comm
                .send_recv(None, Some((buf.view(&stream), 2)))
                .unwrap_err();
            assert_contains(&err, &["cannot receive from rank 2: the group has 2 ranks"]);
            let err = comm
                .send_recv(
                    Some((buf.part(&stream, 0, 6), other)),
                    Some((buf.part(&stream, 4, 4), other)),
                )
                .unwrap_err();
            assert_contains(&err, &["the send and recv buffers overlap"]);
            let err = comm.send_recv(None, None).unwrap_err();
            assert_contains(
                &err,
                &["send_recv (nothing)", "neither a send nor a receive"],
            );
            comm.barrier().unwrap();
            comm.check().unwrap();
        });
    });
}

/// A receive whose peer never sends stalls the stream until the wait on it
/// times out, naming the peer's group, and aborts the communicator, which
/// ends the stalled receive.
#[test]
#[ignore = "needs two GPUs"]
fn on_two_gpus_a_receive_nobody_sends_times_out_and_the_stream_drains() {
    with_gpus(2, || {
        let timeout = Duration::from_secs(2);
        world(2, timeout, |r, comm, stream| {
            // One exchange both ways first: NCCL connects a pair's
            // point-to-point channels on first use.
            let send = Buf::new(&stream, &vec![1.0f32; 1024], DType::F32);
            let recv = Buf::<f32>::zeros(&stream, 1024, DType::F32);
            comm.send_recv(
                Some((send.view(&stream), 1 - r)),
                Some((recv.view(&stream), 1 - r)),
            )
            .unwrap();
            settle(&stream, &comm);
            comm.barrier().unwrap();
            if r == 1 {
                // Rank 1 never sends; it keeps its communicator until rank 0
                // has given up.
                std::thread::sleep(timeout * 3);
                return;
            }
            comm.send_recv(None, Some((recv.view(&stream), 1))).unwrap();
            let start = Instant::now();
            let err = StreamWait {
                rank: 0,
                timeout,
                comms: &[&comm],
                signal: None,
            }
            .stream(&stream, "the receive from rank 1")
            .unwrap_err();
            let waited = start.elapsed();
            println!("a receive nobody sends: {err} (after {waited:?})");
            assert_contains(
                &err,
                &[
                    "rank 0: timed out after 2s waiting for the receive from rank 1 on cuda:0",
                    "ranks [1] of world",
                ],
            );
            assert!(waited < timeout + Duration::from_secs(10), "{waited:?}");
            assert!(comm.is_aborted());
            StreamWait {
                rank: 0,
                timeout: Duration::from_secs(30),
                comms: &[],
                signal: None,
            }
            .stream(&stream, "the stream after the abort")
            .expect("the aborted receive ends");
        });
    });
}

#[test]
#[ignore = "needs two GPUs"]
fn a_world_of_two_gpus_from_the_rendezvous() {
    with_gpus(2, || {
        let port = free_port();
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..2)
                .map(|r| {
                    scope.spawn(move || {
                        let info = RankInfo {
                            rank: r,
                            world_size: 2,
                            local_rank: r,
                            local_world_size: 2,
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            launcher: Launcher::Torchrun,
                        };
                        let comm = NcclComm::from_rendezvous(
                            &info,
                            stream_on(r),
                            Duration::from_secs(60),
                            AbortSignal::new(),
                        )
                        .unwrap_or_else(|e| panic!("rank {r}: {e}"));
                        comm.all_gather_host(&[r as f64]).unwrap()
                    })
                })
                .collect();
            for h in handles {
                assert_eq!(h.join().unwrap(), vec![vec![0.0], vec![1.0]]);
            }
        });
    });
}

// ---- without a GPU ----------------------------------------------------------------

#[test]
fn without_nccl_every_entry_point_says_what_is_missing() {
    // On a machine with NCCL this checks nothing but the version; on one
    // without it, the errors (never a panic).
    match nccl_version() {
        Ok(version) => println!("NCCL {version} loads"),
        Err(err) => {
            println!("{err}");
            assert_contains(&err, &["NCCL", "libnccl", "install NCCL 2.18 or newer"]);
            let err = NcclUniqueId::new().unwrap_err();
            assert_contains(&err, &["libnccl"]);
            assert_eq!(err.code(), "invalid_config");
        }
    }
}
