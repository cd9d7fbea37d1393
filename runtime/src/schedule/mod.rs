//! The two schedules (plain, and combined-1F1B with EP overlap) as programs,
//! and the executor that runs a program on a rank's lanes.

mod program;

pub use program::{BackwardPiece, Instr, Program, ScheduleKind, build};
