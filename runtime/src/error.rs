//! Runtime errors: each says what failed, where (rank, lane, layer), and what
//! to do about it.

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
    /// Another rank failed, stalled past the timeout, or called a different
    /// collective; the message names the rank.
    #[error("rank {rank}: {message}")]
    Peer { rank: usize, message: String },
    /// Work on a lane failed, or depended on work that failed.
    #[error("{lane} lane: {message}")]
    Lane { lane: String, message: String },
    /// Reading or writing a file (checkpoint, trace, data).
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    /// A numeric problem worth stopping for (a non-finite loss, ...).
    #[error("{0}")]
    Numeric(String),
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

impl RuntimeError {
    pub fn io(path: impl std::fmt::Display, err: impl std::fmt::Display) -> Self {
        RuntimeError::Io {
            path: path.to_string(),
            message: err.to_string(),
        }
    }
}
