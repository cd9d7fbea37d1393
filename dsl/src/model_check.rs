//! A model's dimensions checked against the pattern that uses them (H025,
//! H026): every kind the pattern uses has its section, each section's sizes
//! can build its layers, and the whole model's parameter count stays within
//! what the planner can address. It needs both the dimensions
//! ([`crate::config`]) and the parameters they make ([`crate::params`]), so
//! it sits above both, and neither depends on the other's caller.

use crate::config::{MAX_MODEL_ELEMENTS, ModelConfig, kind_section};
use crate::diagnostic::{Code, Diagnostic};
use crate::params::layer_params;
use crate::pattern::{LayerKind, Pattern};

impl ModelConfig {
    /// H025 and H026: dimensions that cannot build the layers `pattern` uses.
    /// Sections the pattern does not use are checked too (a preset must be
    /// sound for any pattern), but only when present.
    pub fn check(&self, pattern: &Pattern) -> Vec<Diagnostic> {
        let mut out = Vec::new();
        for kind in pattern.kinds() {
            if !self.has_dimensions_for(kind) {
                let section = match kind {
                    LayerKind::Dsa if self.mla.is_none() => "[mla] and [dsa]",
                    LayerKind::Dsa => "[dsa]",
                    _ => kind_section(kind),
                };
                let first = pattern
                    .layers()
                    .chain(pattern.mtp_depths.iter().flat_map(|d| &d.layers))
                    .find(|l| l.kind == kind);
                let mut d = Diagnostic::new(
                    Code::H026,
                    format!("the pattern uses `{}` ({}) but the model has no {section} section", kind, kind.name()),
                )
                .label("no dimensions for this kind")
                .help(format!("add {section} to the model file, or use the `tiny` preset, which has every kind"));
                if let Some(layer) = first {
                    d = d.at(layer.span);
                }
                out.push(d);
            }
        }
        let before = out.len();
        self.check_dimensions(&mut out);
        self.check_limits(&mut out);
        // Only sizes that passed can be multiplied out safely.
        if out[before..].is_empty() {
            self.check_total(pattern, &mut out);
        }
        out
    }

    /// The whole model's elements, counted without overflow: at most 2^53,
    /// so every offset and total the planner computes fits.
    fn check_total(&self, pattern: &Pattern, out: &mut Vec<Diagnostic>) {
        let experts = self.moe.as_ref().map_or(0, |m| m.num_experts);
        let layer_elements = |kind: LayerKind| -> u128 {
            layer_params(kind, self, experts)
                .iter()
                .map(|p| p.shape.iter().map(|&d| d as u128).product::<u128>())
                .sum()
        };
        let h = self.hidden_size as u128;
        let mut total = 2 * self.padded_vocab_size() as u128 * h;
        for kind in pattern.kinds() {
            let count = pattern
                .layers()
                .chain(pattern.mtp_depths.iter().flat_map(|d| &d.layers))
                .filter(|l| l.kind == kind)
                .count() as u128;
            total = total.saturating_add(count.saturating_mul(layer_elements(kind)));
        }
        total = total.saturating_add(pattern.mtp_depths.len() as u128 * (3 * h + 2 * h * h));
        if total > MAX_MODEL_ELEMENTS {
            out.push(
                Diagnostic::new(
                    Code::H025,
                    format!("the model would have {total} parameters, over the limit of 2^53"),
                )
                .help("lower the dimensions or the number of layers; is there a typo?"),
            );
        }
    }
}
