//! The CPU backend: bf16 or f32 storage, deterministic f32 loops, a worker thread per
//! lane, and ranks as threads of one process exchanging through shared
//! memory. It is the reference every other backend is checked against.

mod arena;
mod backend;
mod buffer;
pub mod collective;
pub mod ops;

pub use backend::{CpuBackend, round_bf16};
pub use buffer::CpuBuf;
