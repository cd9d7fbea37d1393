//! # hybridgen-dsl
//!
//! The pattern language of hybrid Mamba / attention / MoE models and the
//! planner that turns a pattern, model dimensions and a parallel layout into
//! a validated [`Plan`](plan::Plan). The command line, the `model!` macro and
//! build scripts all call into this crate, so they cannot disagree.

pub mod diagnostic;
pub mod pattern;
pub mod span;

pub use diagnostic::{Code, Diagnostic, Diagnostics};
pub use pattern::{Group, Item, Layer, LayerKind, MtpDepth, Pattern, Segment};
pub use span::{LineCol, Span};
pub mod config;
pub mod flops;
pub mod params;

pub use config::ModelConfig;
pub mod codegen;
pub mod plan;

pub use plan::{ParallelLayout, Plan, PlanOptions, PlanTables, UnitFilter};
