//! Activation recomputation (Megatron's full recompute granularity):
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
    /// (Megatron's `block` recompute method with `n` layers);
    /// `n` past their count is all of them.
    Layers(usize),
    /// The `n` layers that can recompute and keep the most: every layer of
    /// the kind whose layers keep the most first, in order, then the next
    /// kind's ([`crate::memory::recomputed`] ranks them). A Mamba layer
    /// of the 9B keeps 2.9 times what its MLP layers do for about the same
    /// forward compute, so these make a run fit with fewer forwards run
    /// again than the first `n`.
    Largest(usize),
    /// The fewest layers, taken as [`Recompute::Largest`] takes them, with
    /// which the run fits the memory available. [`crate::train::prepare`]
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
    /// whether it keeps only its input; `largest_first` ranks the kinds
    /// for [`Recompute::Largest`] ([`crate::memory::recomputed`] gives the
    /// model's ranking), which takes them in that order and each kind's
    /// layers in theirs.
    pub fn chosen(self, kinds: &[LayerKind], largest_first: &[LayerKind]) -> Vec<bool> {
        let take = match self {
            Recompute::None => 0,
            Recompute::Full | Recompute::Auto => usize::MAX,
            Recompute::Layers(n) | Recompute::Largest(n) => n,
        };
        let rank = |kind: LayerKind| match self {
            Recompute::Largest(_) => largest_first.iter().position(|&k| k == kind),
            _ => Some(0),
        };
        // The candidates in the order they are taken: a stable sort keeps
        // each kind's layers in order.
        let mut order: Vec<usize> = (0..kinds.len())
            .filter(|&i| Recompute::can_recompute(kinds[i]))
            .collect();
        order.sort_by_key(|&i| rank(kinds[i]).unwrap_or(usize::MAX));
        let mut chosen = vec![false; kinds.len()];
        for &i in order.iter().take(take) {
            chosen[i] = true;
        }
        chosen
    }

    /// How many of `kinds` recompute (whatever their order).
    pub fn count(self, kinds: &[LayerKind]) -> usize {
        let candidates = Recompute::candidates(kinds.iter().copied());
        match self {
            Recompute::None => 0,
            Recompute::Full | Recompute::Auto => candidates,
            Recompute::Layers(n) | Recompute::Largest(n) => n.min(candidates),
        }
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
            Recompute::Largest(n) => write!(f, "largest:{n}"),
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
            _ => {
                let (count, make): (&str, fn(usize) -> Recompute) =
                    match text.strip_prefix("largest:") {
                        Some(count) => (count, Recompute::Largest),
                        None => (text, Recompute::Layers),
                    };
                count.parse::<usize>().map(make).map_err(|_| {
                    format!(
                        "`{text}` is not a recomputation: give none, full, auto (the fewest \
                         layers that fit the memory), a number of layers N (the first N but MoE \
                         ones) or largest:N (the N that keep the most)"
                    )
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use LayerKind::{Attention as A, Mamba as M, Mlp as D, Moe as E};

    fn chosen(recompute: Recompute, kinds: &[LayerKind]) -> Vec<bool> {
        recompute.chosen(kinds, &[A, D, M])
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
        assert_eq!(Recompute::Layers(3).count(&kinds), 3);
        assert_eq!(Recompute::Layers(9).count(&kinds), 4);
    }

    /// `Largest(n)` takes the kinds in the order given (here attention,
    /// then MLP, then Mamba), each kind's layers in order.
    #[test]
    fn largest_takes_the_kinds_in_their_rank() {
        let kinds = [M, E, A, M, A, D];
        let f = false;
        assert_eq!(chosen(Recompute::Largest(0), &kinds), [f; 6]);
        assert_eq!(chosen(Recompute::Largest(1), &kinds), [f, f, true, f, f, f]);
        assert_eq!(
            chosen(Recompute::Largest(3), &kinds),
            [f, f, true, f, true, true]
        );
        assert_eq!(
            chosen(Recompute::Largest(4), &kinds),
            [true, f, true, f, true, true]
        );
        assert_eq!(
            chosen(Recompute::Largest(7), &kinds),
            chosen(Recompute::Full, &kinds)
        );
        assert_eq!(Recompute::Largest(4).count(&kinds), 4);
        assert_eq!(Recompute::Largest(7).count(&kinds), 5);
    }

    #[test]
    fn the_command_line_spellings_round_trip() {
        for r in [
            Recompute::None,
            Recompute::Full,
            Recompute::Auto,
            Recompute::Layers(12),
            Recompute::Largest(3),
        ] {
            assert_eq!(r.to_string().parse::<Recompute>(), Ok(r));
        }
        let err = "some".parse::<Recompute>().unwrap_err();
        assert!(err.contains("`some`") && err.contains("auto"), "{err}");
        assert!("-1".parse::<Recompute>().is_err());
        assert!("largest:".parse::<Recompute>().is_err());
    }
}
