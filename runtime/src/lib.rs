//! # hybridgen-runtime
//!
//! The training runtime for plans made by `hybridgen-dsl`. One design, two
//! backends behind the same traits: the CPU backend ([`cpu`]: tests, CI,
//! laptops, the default without a GPU) and the CUDA backend ([`cuda`]:
//! NVRTC kernels, cuBLAS and NCCL, loaded when a run starts, so the crate
//! builds without CUDA). The conformance suite (module `conformance`, behind
//! the feature of that name) checks every kernel of either against an f64
//! reference; the GPU tests (`tests/cuda_*.rs`) skip, saying
//! why, on a machine without a usable GPU, and run on one through
//! `scripts/cuda_bundle.sh`.

pub mod backend;
pub mod checkpoint;
pub mod collective;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod cpu;
pub mod cuda;
pub mod data;
pub mod device;
pub mod digest;
pub mod error;
pub mod fsdp;
pub mod hf;
pub mod lane;
pub mod layers;
pub mod loader;
pub mod memory;
pub mod model;
pub mod optimizer;
pub mod platform;
pub mod recompute;
pub mod rendezvous;
pub mod schedule;
pub mod setting;
pub mod tensor_file;
pub mod trace;
pub mod train;
pub mod view;

pub use backend::{Backend, Precision};
pub use collective::Collective;
pub use cpu::collective::{CpuComm, CpuWorld};
pub use error::{Result, RuntimeError};
pub use lane::thread::{CpuEvent, CpuLane, LaneConfig};
pub use lane::{Event, Label, Lane, Work};
pub use trace::{RankStats, Span, TraceRecorder};
