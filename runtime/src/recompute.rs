//! Activation recomputation (Megatron's `--recompute-granularity full`):
//! a recomputed layer keeps only its input from its forward, and its
//! backward runs the forward again from that input before it starts.
//! Activations then grow with one `[tokens, hidden]` input a layer instead
//! of everything a layer keeps (about 1 GiB a layer of the 9B Nemotron-H
//! at 4,096 tokens), for about one forward pass more of that layer's
//! compute.
//!
//! All of a model's layers, or only the first `n` (Megatron's `block`
//! method), or as few as the memory available needs (`Auto`, settled by
//! [`crate::train::prepare`] from the memory plan): every layer left out
//! keeps its activations and costs no extra compute, so the fewest
//! recomputed layers that fit is the fastest run that fits.
//!
//! The recomputed forward runs the same kernels on the same values, so a
//! run gives the same bits with recomputation as without it. `E` (MoE)
//! layers keep their activations: their forward spans the dispatch and
//! combine all-to-alls on the comm lane, and running those again in the
//! backward is not done yet.

use hybridgen_dsl::pattern::LayerKind;
use std::fmt;

/// Which layers recompute their forward in the backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Every layer keeps what its backward needs.
    #[default]
    None,
    /// Every layer but the `E` layers keeps only its input.
    Full,
    /// The first `n` layers that can recompute (every kind but `E`), counted
    /// over the decoder's layers in order and then each MTP depth's
    /// (Megatron's `--recompute-method block --recompute-num-layers n`);
    /// `n` past their count is all of them.
    Layers(usize),
    /// The fewest layers, counted as [`Recompute::Layers`] counts them,
    /// with which the run fits the memory available. [`crate::train::prepare`]
    /// settles it into one of the others; until then (the memory check's
    /// bound made before planning) it counts as `Full`, the most it may
    /// take.
    Auto,
}

impl Recompute {
    /// Whether a layer of `kind` can keep only its input: every kind but
    /// `E`.
    pub fn can_recompute(kind: LayerKind) -> bool {
        kind != LayerKind::Moe
    }

    /// The layers among `kinds` that can recompute.
    pub fn candidates(kinds: impl IntoIterator<Item = LayerKind>) -> usize {
        kinds
            .into_iter()
            .filter(|&k| Recompute::can_recompute(k))
            .count()
    }

    /// For each layer of `kinds` (the decoder's, then each MTP depth's),
    /// whether it keeps only its input.
    pub fn chosen(self, kinds: impl IntoIterator<Item = LayerKind>) -> impl Iterator<Item = bool> {
        let mut left = match self {
            Recompute::None => 0,
            Recompute::Layers(n) => n,
            Recompute::Full | Recompute::Auto => usize::MAX,
        };
        kinds.into_iter().map(move |kind| {
            let recomputes = left > 0 && Recompute::can_recompute(kind);
            left -= usize::from(recomputes);
            recomputes
        })
    }

    /// How many of `kinds` recompute.
    pub fn count(self, kinds: impl IntoIterator<Item = LayerKind>) -> usize {
        self.chosen(kinds).filter(|&r| r).count()
    }
}

/// As the command line takes it: `none`, `full`, `auto` or a number of
/// layers.
impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recompute::None => f.write_str("none"),
            Recompute::Full => f.write_str("full"),
            Recompute::Layers(n) => write!(f, "{n}"),
            Recompute::Auto => f.write_str("auto"),
        }
    }
}

impl std::str::FromStr for Recompute {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "none" => Ok(Recompute::None),
            "full" => Ok(Recompute::Full),
            "auto" => Ok(Recompute::Auto),
            _ => text.parse::<usize>().map(Recompute::Layers).map_err(|_| {
                format!(
                    "`{text}` is not a recomputation: give none, full, auto (the fewest layers \
                     that fit the memory) or a number of layers (the first N but MoE ones)"
                )
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use LayerKind::{Attention as A, Mamba as M, Mlp as D, Moe as E};

    fn chosen(recompute: Recompute, kinds: &[LayerKind]) -> Vec<bool> {
        recompute.chosen(kinds.iter().copied()).collect()
    }

    #[test]
    fn full_recomputes_every_layer_but_moe() {
        let kinds = LayerKind::ALL;
        assert!(chosen(Recompute::None, &kinds).iter().all(|&r| !r));
        let full = chosen(Recompute::Full, &kinds);
        for (kind, recomputes) in kinds.iter().zip(full) {
            assert_eq!(recomputes, *kind != E, "{kind:?}");
        }
    }

    /// `Layers(n)` takes the first n that can recompute, skipping MoE
    /// layers without counting them.
    #[test]
    fn layers_counts_the_first_that_can_recompute() {
        let kinds = [M, E, A, E, M, D];
        let f = false;
        assert_eq!(chosen(Recompute::Layers(0), &kinds), [f; 6]);
        assert_eq!(
            chosen(Recompute::Layers(2), &kinds),
            [true, f, true, f, f, f]
        );
        assert_eq!(
            chosen(Recompute::Layers(3), &kinds),
            [true, f, true, f, true, f]
        );
        assert_eq!(
            chosen(Recompute::Layers(99), &kinds),
            chosen(Recompute::Full, &kinds)
        );
        assert_eq!(Recompute::candidates(kinds), 4);
        assert_eq!(Recompute::Layers(3).count(kinds), 3);
        assert_eq!(Recompute::Layers(9).count(kinds), 4);
    }

    #[test]
    fn the_command_line_spellings_round_trip() {
        for r in [
            Recompute::None,
            Recompute::Full,
            Recompute::Auto,
            Recompute::Layers(12),
        ] {
            assert_eq!(r.to_string().parse::<Recompute>(), Ok(r));
        }
        let err = "some".parse::<Recompute>().unwrap_err();
        assert!(err.contains("`some`") && err.contains("auto"), "{err}");
        assert!("-1".parse::<Recompute>().is_err());
    }
}
