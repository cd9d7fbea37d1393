//! Bounded waits on the GPU and on NCCL.
//!
//! NCCL's operations are asynchronous: a peer that died or stalled shows
//! as a stream that never finishes, and a kernel waiting for it spins
//! forever. So the host never blocks on a stream or an NCCL call: it polls
//! (the event, or `ncclCommGetAsyncError`) with a short sleep, watching the
//! communicators' asynchronous errors and an [`AbortSignal`], and at the
//! deadline aborts the communicators involved (`ncclCommAbort` ends their
//! kernels, so the stream drains) and reports which rank gave up waiting
//! for what, and what to do.

use super::NcclComm;
use crate::error::{Result, RuntimeError};
use crate::lane::thread::deadline_after;
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Why communicators were aborted: the rank that failed first, and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortCause {
    pub rank: usize,
    pub reason: String,
}

#[derive(Debug, Default)]
struct AbortState {
    raised: AtomicBool,
    cause: Mutex<Option<AbortCause>>,
}

/// A process-wide "stop": raised once (by the rank that failed, or by the
/// platform that saw it fail), it ends every bounded wait of every
/// communicator built with it within a poll interval: the waiting rank
/// aborts its communicators and fails with an error naming the rank that
/// raised it and why. Clones share the signal.
#[derive(Clone, Debug, Default)]
pub struct AbortSignal {
    state: Arc<AbortState>,
}

impl AbortSignal {
    pub fn new() -> Self {
        Self::default()
    }

    /// Raises the signal; the first cause is kept, later ones are ignored
    /// (they are usually consequences of the first).
    pub fn raise(&self, rank: usize, reason: &str) {
        let mut cause = self
            .state
            .cause
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if cause.is_none() {
            *cause = Some(AbortCause {
                rank,
                reason: reason.to_string(),
            });
        }
        self.state.raised.store(true, Ordering::Release);
    }

    pub fn is_raised(&self) -> bool {
        self.state.raised.load(Ordering::Acquire)
    }

    /// The first cause, once raised.
    pub fn cause(&self) -> Option<AbortCause> {
        if !self.is_raised() {
            return None;
        }
        self.state
            .cause
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Calls `attempt` until it reports done (`Ok(true)`: returns `Ok(true)`)
/// or fails, or `deadline` passes (returns `Ok(false)`). Spins briefly
/// first (most collectives are issued in microseconds), then sleeps from
/// 20 µs up to 1 ms between attempts.
pub(super) fn poll_until(
    deadline: Instant,
    mut attempt: impl FnMut() -> Result<bool>,
) -> Result<bool> {
    const SPINS: u32 = 200;
    let mut round = 0u32;
    loop {
        if attempt()? {
            return Ok(true);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        if round < SPINS {
            std::thread::yield_now();
        } else {
            let pause =
                Duration::from_micros(20 << (round - SPINS).min(6)).min(Duration::from_millis(1));
            std::thread::sleep(pause.min(deadline - now));
        }
        round = round.saturating_add(1);
    }
}

/// A bounded wait for work on a GPU stream, for lanes and platforms: what
/// the host does instead of `cuStreamSynchronize`.
#[derive(Clone, Copy)]
pub struct StreamWait<'a> {
    /// The waiting rank (its world rank), named in errors.
    pub rank: usize,
    pub timeout: Duration,
    /// The communicators whose collectives the waited work may contain:
    /// their asynchronous errors and their abort signals end the wait, and
    /// on a timeout or a failure they are all aborted (which ends their
    /// kernels, so the stream drains).
    pub comms: &'a [&'a NcclComm],
    /// A signal that ends the wait besides the communicators' own (for
    /// waits on work with no collectives).
    pub signal: Option<&'a AbortSignal>,
}

impl StreamWait<'_> {
    /// Waits until `event` (recorded on some stream) has completed.
    /// `what` says what the event marks, for errors ("the comm lane's
    /// all-gather of bucket 3").
    pub fn event(&self, event: &CudaEvent, what: &str) -> Result<()> {
        let device = format!("cuda:{}", event.context().ordinal());
        event
            .context()
            .bind_to_thread()
            .map_err(|e| device_error(&device, what, e))?;
        let done = poll_until(deadline_after(self.timeout), || {
            if let Some(cause) = self.signal.and_then(AbortSignal::cause) {
                self.abort_all(&cause);
                return Err(aborted_error(
                    &cause,
                    self.rank,
                    &format!("waiting for {what}"),
                ));
            }
            for comm in self.comms {
                if let Err(error) = comm.health(&format!("waiting for {what}")) {
                    self.abort_all(&AbortCause {
                        rank: self.rank,
                        reason: error.to_string(),
                    });
                    return Err(error);
                }
            }
            event
                .try_is_complete()
                .map_err(|e| device_error(&device, what, e))
        })?;
        if done {
            return Ok(());
        }
        let reason = format!(
            "rank {} timed out after {:?} waiting for {what}",
            self.rank, self.timeout
        );
        self.abort_all(&AbortCause {
            rank: self.rank,
            reason,
        });
        Err(RuntimeError::Peer {
            rank: self.rank,
            message: format!(
                "timed out after {:?} waiting for {what} on {device}{}: a peer rank stalled \
                 or died (its own error says why), or the work takes longer than the \
                 timeout (then raise --timeout); the communicators were aborted",
                self.timeout,
                peers(self.comms)
            ),
        })
    }

    /// Waits until everything enqueued on `stream` so far has completed.
    pub fn stream(&self, stream: &CudaStream, what: &str) -> Result<()> {
        let device = format!("cuda:{}", stream.context().ordinal());
        let event = stream
            .context()
            .new_event(None)
            .map_err(|e| device_error(&device, what, e))?;
        event
            .record(stream)
            .map_err(|e| device_error(&device, what, e))?;
        self.event(&event, what)
    }

    fn abort_all(&self, cause: &AbortCause) {
        for comm in self.comms {
            comm.abort_because(cause.clone());
        }
    }
}

/// ", which holds collectives with ranks [1] of world and ranks [2, 3] of
/// group of ranks [0, 2, 3]": who the waiting rank depends on.
fn peers(comms: &[&NcclComm]) -> String {
    let groups: Vec<String> = comms
        .iter()
        .filter(|c| c.size() > 1)
        .map(|c| {
            let others: Vec<usize> = c
                .members()
                .iter()
                .copied()
                .filter(|&r| r != c.world_rank())
                .collect();
            format!("ranks {others:?} of {}", c.group_name())
        })
        .collect();
    if groups.is_empty() {
        String::new()
    } else {
        format!(", which holds collectives with {}", groups.join(" and "))
    }
}

pub(super) fn aborted_error(cause: &AbortCause, me: usize, doing: &str) -> RuntimeError {
    RuntimeError::Peer {
        rank: cause.rank,
        message: format!("aborted: {} (rank {me} was {doing})", cause.reason),
    }
}

pub(super) fn device_error(device: &str, what: &str, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Lane {
        lane: device.to_string(),
        message: format!("{what}: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_cause_wins() {
        let signal = AbortSignal::new();
        assert!(!signal.is_raised());
        assert_eq!(signal.cause(), None);
        let clone = signal.clone();
        clone.raise(3, "out of memory");
        signal.raise(1, "a consequence");
        assert!(signal.is_raised());
        assert_eq!(
            signal.cause(),
            Some(AbortCause {
                rank: 3,
                reason: "out of memory".into()
            })
        );
    }

    #[test]
    fn polling_stops_when_done_on_error_and_at_the_deadline() {
        let mut calls = 0;
        let done = poll_until(Instant::now() + Duration::from_secs(5), || {
            calls += 1;
            Ok(calls == 300)
        });
        assert!(done.unwrap());
        assert_eq!(calls, 300);
        let failed = poll_until(Instant::now() + Duration::from_secs(5), || {
            Err(RuntimeError::Numeric("stop".into()))
        });
        assert!(failed.is_err());
        let start = Instant::now();
        let timed_out = poll_until(start + Duration::from_millis(30), || Ok(false)).unwrap();
        assert!(!timed_out);
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(30), "{waited:?}");
        assert!(waited < Duration::from_secs(2), "{waited:?}");
    }

    #[test]
    fn aborted_errors_name_the_cause_and_the_waiter() {
        let cause = AbortCause {
            rank: 1,
            reason: "its thread panicked".into(),
        };
        let error = aborted_error(&cause, 0, "waiting for all_gather on world");
        assert_eq!(
            error.to_string(),
            "rank 1: aborted: its thread panicked (rank 0 was waiting for all_gather on world)"
        );
        assert_eq!(error.code(), "peer_failed");
    }
}
