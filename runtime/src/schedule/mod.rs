//! The two schedules (plain, and combined-1F1B with EP overlap) as programs,
//! and the executor that runs a program on a rank's lanes.

mod executor;
mod program;

pub use executor::{MicroBatchTokens, StepContext, StepLosses, run_step};
pub use program::{BackwardPiece, Instr, Program, ScheduleKind, build};
