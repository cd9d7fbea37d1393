//! Runtime errors: each says what failed, where (rank, lane, layer), and what
//! to do about it. [`RuntimeError::code`] gives each kind a stable name for
//! tools (the command line's JSON output prints it).

/// Anything that can stop a training run.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RuntimeError {
    /// The configuration cannot run on this runtime; found before any work
    /// starts (e.g. a layer kind the runtime lacks, ranks not divisible by ep).
    #[error("{0}")]
    Unsupported(String),
    /// A bad argument to a runtime function (sizes that do not match, ...):
    /// a bug in the caller, reported instead of a panic.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An internal consistency check failed: hybridgen made something it
    /// should not have (a schedule out of order for a plan the planner
    /// accepted, ...). A bug in hybridgen, never the user's configuration.
    #[error(
        "internal error: {0}\n  this is a bug in hybridgen, not in the configuration: please report it with the command that hit it"
    )]
    Internal(String),
    /// The run would need more memory than the machine has available; found
    /// before anything is allocated. The message gives the figures and what
    /// to change.
    #[error("{0}")]
    OutOfMemory(String),
    /// Another rank failed, stalled past the timeout, or called a different
    /// collective; the message names the rank.
    #[error("rank {rank}: {message}")]
    Peer { rank: usize, message: String },
    /// Work on a lane failed (panicked, or gave up waiting).
    #[error("{lane} lane: {message}")]
    Lane { lane: String, message: String },
    /// Work on a lane did not run because other work failed first: `root` is
    /// that failure (the root cause), `origin` the work that failed with it.
    #[error("{lane} lane: skipped `{work}`: {how}: {root}")]
    Skipped {
        lane: String,
        work: String,
        /// Why it was skipped (which dependency or earlier work).
        how: String,
        /// The work that failed, as "`label` on the X lane".
        origin: String,
        root: Box<RuntimeError>,
    },
    /// A GPU or its libraries failed: no usable device, a CUDA, cuBLAS or
    /// NCCL call that returned an error, a kernel that faulted. `device`
    /// names it (`cuda:0`, or `cuda` before one is chosen).
    #[error("{device}: {message}")]
    Device { device: String, message: String },
    /// Reading or writing a file (checkpoint, trace, data).
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    /// A numeric problem worth stopping for (a non-finite loss, ...).
    #[error("{0}")]
    Numeric(String),
    /// Ranks of a run failed: the root cause first (with every rank that
    /// failed of it on its own), then what it made other ranks report.
    #[error("{}", describe_rank_failure(ranks, cause, others, stopped))]
    RankFailed {
        /// The ranks that failed with `cause` themselves (several when it
        /// is global, like a diverged loss); the first found it first.
        ranks: Vec<usize>,
        cause: Box<RuntimeError>,
        /// Ranks that failed on their own of something else: (rank, why).
        others: Vec<(usize, String)>,
        /// Ranks that stopped because a peer failed.
        stopped: Vec<usize>,
    },
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

impl RuntimeError {
    pub fn io(path: impl std::fmt::Display, err: impl std::fmt::Display) -> Self {
        RuntimeError::Io {
            path: path.to_string(),
            message: err.to_string(),
        }
    }

    /// The failure that started it all: through skipped work and rank
    /// reports to the error of the work that failed first.
    pub fn root_cause(&self) -> &RuntimeError {
        match self {
            RuntimeError::Skipped { root, .. } => root.root_cause(),
            RuntimeError::RankFailed { cause, .. } => cause.root_cause(),
            other => other,
        }
    }

    /// A stable name for the kind of failure (of the root cause), for tools:
    ///
    /// | code | meaning |
    /// | --- | --- |
    /// | `invalid_config` | the configuration cannot run; nothing started |
    /// | `out_of_memory` | the run would not fit in the memory available; nothing allocated |
    /// | `io` | reading or writing a file (data, checkpoint, trace) failed |
    /// | `diverged` | the loss or the gradients became non-finite |
    /// | `peer_failed` | another rank stalled past the timeout or left |
    /// | `lane_failed` | work on a lane panicked or stalled |
    /// | `device_failed` | the GPU, CUDA or one of its libraries is missing or failed |
    /// | `internal` | an internal consistency check failed (a bug: please report it) |
    pub fn code(&self) -> &'static str {
        match self.root_cause() {
            RuntimeError::Unsupported(_) => "invalid_config",
            RuntimeError::InvalidArgument(_) | RuntimeError::Internal(_) => "internal",
            RuntimeError::OutOfMemory(_) => "out_of_memory",
            RuntimeError::Peer { .. } => "peer_failed",
            RuntimeError::Lane { .. } => "lane_failed",
            RuntimeError::Device { .. } => "device_failed",
            RuntimeError::Io { .. } => "io",
            RuntimeError::Numeric(_) => "diverged",
            // `root_cause` never returns these two.
            RuntimeError::Skipped { .. } | RuntimeError::RankFailed { .. } => "internal",
        }
    }
}

fn rank_list(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match ranks {
        [_] => format!("rank {}", list.join("")),
        _ => format!("ranks {}", list.join(", ")),
    }
}

/// "rank R: <root cause>", then, summarised, what else failed and which
/// ranks stopped because of it: the root first, so it is the first thing a
/// reader sees.
fn describe_rank_failure(
    ranks: &[usize],
    cause: &RuntimeError,
    others: &[(usize, String)],
    stopped: &[usize],
) -> String {
    let who = rank_list(ranks);
    let mut out = match cause {
        RuntimeError::Skipped {
            lane,
            work,
            origin,
            root,
            ..
        } => format!(
            "{who}: {origin} failed: {}\n  because of it, the {lane} lane skipped `{work}` \
             and the work after it",
            root.root_cause()
        ),
        other => format!("{who}: {other}"),
    };
    for (rank, why) in others {
        let first = why.lines().next().unwrap_or_default();
        out += &format!("\n  rank {rank} also failed: {first}");
    }
    if !stopped.is_empty() {
        out += &format!("\n  {} stopped because of it", rank_list(stopped));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_cause_comes_first_and_gives_the_code() {
        let root = RuntimeError::Numeric("the loss is NaN at step 3".into());
        let skipped = RuntimeError::Skipped {
            lane: "compute".into(),
            work: "fwd mlp layer 2 mb1".into(),
            how: "it waits on `dispatch fwd layer 1 mb1` on the comm lane, which failed".into(),
            origin: "`dispatch fwd layer 1 mb1` on the comm lane".into(),
            root: Box::new(root.clone()),
        };
        assert_eq!(
            skipped.to_string(),
            "compute lane: skipped `fwd mlp layer 2 mb1`: it waits on `dispatch fwd layer 1 \
             mb1` on the comm lane, which failed: the loss is NaN at step 3"
        );
        let failed = RuntimeError::RankFailed {
            ranks: vec![1],
            cause: Box::new(skipped),
            others: vec![(3, "disk full\nmore".into())],
            stopped: vec![0, 2],
        };
        let message = failed.to_string();
        assert!(
            message.starts_with(
                "rank 1: `dispatch fwd layer 1 mb1` on the comm lane failed: the loss is NaN at \
                 step 3\n"
            ),
            "{message}"
        );
        assert!(
            message
                .ends_with("\n  rank 3 also failed: disk full\n  ranks 0, 2 stopped because of it"),
            "{message}"
        );
        assert_eq!(failed.code(), "diverged");
        assert!(matches!(failed.root_cause(), RuntimeError::Numeric(_)));
        assert_eq!(RuntimeError::io("x", "gone").code(), "io");
        assert_eq!(
            RuntimeError::Peer {
                rank: 1,
                message: "stalled".into()
            }
            .code(),
            "peer_failed"
        );
    }
}
