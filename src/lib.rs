//! # hybridgen
//!
//! Build-time planned training of hybrid Mamba / attention / MoE language
//! models. A layer pattern such as `M[*E]M[*E]` plus model dimensions and a
//! parallel layout becomes a validated plan (layers, FSDP units, static
//! bucket layouts, the overlap schedule's slots) at build time; the runtime
//! trains it on the CPU or on GPUs.
//!
//! This facade re-exports the three crates users need:
//! - [`dsl`]: the pattern language, model dimensions and the planner;
//! - [`runtime`]: layers, ZeRO-3 FSDP, expert parallelism, schedules;
//! - the `model!` macro (from `hybridgen-macros`).

pub use hybridgen_dsl as dsl;
pub use hybridgen_runtime as runtime;

pub use hybridgen_dsl::{
    Code, Diagnostic, Diagnostics, ModelConfig, ParallelLayout, Pattern, Plan, PlanOptions,
    UnitFilter,
};

pub use hybridgen_dsl::StaticModel;
pub use hybridgen_macros::model;

pub mod build;
pub mod tensorboard;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;

#[doc(hidden)]
pub mod cli;
