//! # hybridgen-runtime
//!
//! The training runtime for plans made by `hybridgen-dsl`. One design, two
//! backends: the CPU backend here (tests, CI, laptops, the embedded default)
//! and CUDA behind the same traits.

pub mod backend;
pub mod checkpoint;
pub mod collective;
pub mod conformance;
pub mod cpu;
pub mod cuda;
pub mod data;
pub mod device;
pub mod error;
pub mod fsdp;
pub mod hf;
pub mod lane;
pub mod launch;
pub mod layers;
pub mod memory;
pub mod model;
pub mod optimizer;
pub mod platform;
pub mod schedule;
pub mod shared;
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
