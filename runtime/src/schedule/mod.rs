//! The two schedules (plain, and combined-1F1B with EP overlap) as programs,
//! and the executor that runs a program on a rank's lanes.

mod executor;
mod pipeline;
mod program;
mod state;

pub use executor::{StepContext, run_step};
pub use pipeline::{Chunk, Pass, PipelineShape, check_pipeline, passes};
pub use program::{
    BackwardPiece, Flow, Instr, Program, ScheduleKind, Transfer, build, build_forward_only,
};
pub use state::{MicroBatchTokens, StepLosses, StepReadout, StepSums, StepTotals};
