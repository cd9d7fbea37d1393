//! The CPU backend: f32 storage, deterministic loops, a worker thread per
//! lane, and ranks as threads of one process exchanging through shared
//! memory. It is the reference every other backend is checked against.

mod backend;
pub mod collective;
pub mod kernels;
pub mod lane;

pub use backend::CpuBackend;
