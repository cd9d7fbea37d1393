//! Activation recomputation (Megatron's `--recompute-granularity full`):
//! a recomputed layer keeps only its input from its forward, and its
//! backward runs the forward again from that input before it starts.
//! Activations then grow with one `[tokens, hidden]` input a layer instead
//! of everything a layer keeps (about 1 GiB a layer of the 9B Nemotron-H
//! at 4,096 tokens), for about one forward pass more of compute.
//!
//! The recomputed forward runs the same kernels on the same values, so a
//! run gives the same bits with recomputation as without it. `E` (MoE)
//! layers keep their activations: their forward spans the dispatch and
//! combine all-to-alls on the comm lane, and running those again in the
//! backward is not done yet.

use hybridgen_dsl::pattern::LayerKind;

/// Which layers recompute their forward in the backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Every layer keeps what its backward needs.
    #[default]
    None,
    /// Every layer but the `E` layers keeps only its input.
    Full,
}

impl Recompute {
    /// Whether a layer of `kind` keeps only its input.
    pub fn recomputes(self, kind: LayerKind) -> bool {
        self == Recompute::Full && kind != LayerKind::Moe
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_recomputes_every_layer_but_moe() {
        for kind in LayerKind::ALL {
            assert!(!Recompute::None.recomputes(kind));
            assert_eq!(Recompute::Full.recomputes(kind), kind != LayerKind::Moe);
        }
    }
}
