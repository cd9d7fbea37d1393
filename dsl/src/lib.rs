//! # hybridgen-dsl
//!
//! The pattern language of hybrid Mamba / attention / MoE models and the
//! planner that turns a pattern, model dimensions and a parallel layout into
//! a validated [`Plan`]. The command line, the `model!` macro and
//! build scripts all call into this crate, so they cannot disagree.
//!
//! The code generator behind `model!` and build scripts is the
//! `hybridgen-codegen` crate; this one holds only what planning and generated
//! modules use at run time, including [`static_model`] (the
//! [`StaticModel`] trait and the `const` table types generated code is made
//! of).

pub mod diagnostic;
pub mod pattern;
pub mod span;

pub use diagnostic::{Code, Diagnostic, Diagnostics};
pub use pattern::{Group, Item, Layer, LayerKind, MtpDepth, Pattern, Segment};
pub use span::{LineCol, Span};
pub mod config;
pub mod flops;
mod model_check;
pub mod params;

pub use config::ModelConfig;
pub mod plan;
pub mod static_model;

pub use plan::{ParallelLayout, Plan, PlanOptions, PlanTables, UnitFilter};
pub use static_model::{LayerHandle, SlotTable, StaticModel};
