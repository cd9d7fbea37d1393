//! How a backend's arenas grow: one rule for the CPU's arenas
//! (`cpu::arena`) and the GPU's (`cuda::arena`).
//!
//! An arena takes a new segment when no free region fits a request. Arena 0
//! holds what is made once and kept (parameters, gradients, optimizer
//! state): it grows by the request alone, since headroom there would only
//! sit unused. The micro-batches' arena ([`super::Backend::in_arena`]) sees
//! buffers come and go whose sizes and order vary a little from step to step
//! (the rows an expert receives, how two lanes interleave): it grows by a
//! quarter of what it holds, so that once a step has run, the next ones
//! find room and allocate nothing.

/// How an arena grows when no free region fits a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArenaGrowth {
    /// By a quarter of what it holds, at least the request.
    Quarter,
    /// By the request alone.
    Exact,
}

impl ArenaGrowth {
    /// The growth of arena number `arena`.
    pub fn of_arena(arena: usize) -> Self {
        if arena == 0 {
            ArenaGrowth::Exact
        } else {
            ArenaGrowth::Quarter
        }
    }

    /// The size of the segment an arena holding `total` adds for a request
    /// of `want`, in the arena's units, at least `min_segment`.
    pub fn segment(self, want: usize, total: usize, min_segment: usize) -> usize {
        match self {
            ArenaGrowth::Quarter => want.max(total / 4),
            ArenaGrowth::Exact => want,
        }
        .max(min_segment)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_arena_grows_by_the_request_and_the_others_by_a_quarter() {
        let (state, batches) = (ArenaGrowth::of_arena(0), ArenaGrowth::of_arena(1));
        assert_eq!(state, ArenaGrowth::Exact);
        assert_eq!(batches, ArenaGrowth::Quarter);
        assert_eq!(state.segment(300, 4000, 16), 300);
        assert_eq!(batches.segment(300, 4000, 16), 1000);
        assert_eq!(batches.segment(3000, 4000, 16), 3000);
        assert_eq!(state.segment(3, 4000, 16), 16);
        assert_eq!(batches.segment(3, 40, 16), 16);
    }
}
