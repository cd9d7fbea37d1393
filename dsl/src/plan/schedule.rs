//! The overlap schedule's static part (docs/overlap-schedule.md): the chain
//! of schedule nodes (one per logical layer) and, for each node, the work of
//! its five slots. The runtime executes these tables; the macro emits them as
//! `const` data.

use crate::pattern::LayerKind;
use serde::Serialize;
use std::borrow::Cow;

/// The five pieces a logical layer is cut into, in forward order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Slot {
    PreDispatch,
    Dispatch,
    Mlp,
    Combine,
    MtpPostProcess,
}

/// Where a slot runs: the compute lane (CUDA stream / worker thread) or the
/// communication lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LaneKind {
    Compute,
    Comm,
}

impl Slot {
    pub const ALL: [Slot; 5] = [
        Slot::PreDispatch,
        Slot::Dispatch,
        Slot::Mlp,
        Slot::Combine,
        Slot::MtpPostProcess,
    ];

    pub const fn lane(self) -> LaneKind {
        match self {
            Slot::Dispatch | Slot::Combine => LaneKind::Comm,
            _ => LaneKind::Compute,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Slot::PreDispatch => "pre-dispatch",
            Slot::Dispatch => "dispatch",
            Slot::Mlp => "mlp",
            Slot::Combine => "combine",
            Slot::MtpPostProcess => "mtp post-process",
        }
    }
}

/// A physical layer: of the decoder, or of an MTP depth.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerRef {
    Decoder(usize),
    Mtp { depth: usize, index: usize },
}

/// One step of a slot's work. Ops are coarse on purpose: each is one call
/// into a layer's forward (or, reversed, its backward).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Token embedding lookup (first node only).
    Embed,
    /// MTP depth `d` begins: `eh_proj` over the normed embedding of the
    /// shifted tokens and the normed previous hidden state.
    MtpEnter(usize),
    /// A whole pre-dispatch layer (`M * + D G`) with its residual add.
    Layer(LayerRef),
    /// MoE before dispatch: pre-MLP norm, router, shared expert, permute.
    MoePrepare(LayerRef),
    /// Tokens to their experts (an all-to-all under expert parallelism).
    MoeDispatch(LayerRef),
    /// The local experts.
    MoeExperts(LayerRef),
    /// Results back, unpermuted and weighted, plus the shared expert, into
    /// the residual.
    MoeCombine(LayerRef),
    /// A dense MLP terminal with its residual add.
    Mlp(LayerRef),
    /// The decoder's final norm.
    FinalNorm,
    /// Output layer and cross-entropy: of the main model (`None`), or of MTP
    /// depth `d` after its final norm.
    Head(Option<usize>),
}

/// One logical layer in the schedule's forward chain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ScheduleNode {
    pub index: usize,
    /// Module path of the logical layer.
    pub name: Cow<'static, str>,
    /// Logical decoder index, for decoder nodes.
    pub logical: Option<usize>,
    pub mtp_depth: Option<usize>,
    /// The FSDP unit whose parameters this node computes with, if any.
    pub unit: Option<usize>,
    /// Members before the terminal (all members if there is none).
    pub pre_layers: Cow<'static, [LayerRef]>,
    /// The last member if it is `-` or `E`.
    pub terminal: Option<(LayerRef, LayerKind)>,
    /// Extra work this node carries: the embedding, an MTP depth's entry, the
    /// final norm, and output heads.
    pub embed: bool,
    pub mtp_enter: Option<usize>,
    pub final_norm: bool,
    pub heads: Cow<'static, [Option<usize>]>,
}

impl ScheduleNode {
    /// The forward work of `slot`, in order; empty for a no-op slot.
    pub fn ops(&self, slot: Slot) -> Vec<Op> {
        let mut ops = Vec::new();
        let terminal = self
            .terminal
            .map(|(layer, kind)| (layer, kind == LayerKind::Moe));
        match slot {
            Slot::PreDispatch => {
                if self.embed {
                    ops.push(Op::Embed);
                }
                if let Some(d) = self.mtp_enter {
                    ops.push(Op::MtpEnter(d));
                }
                ops.extend(self.pre_layers.iter().map(|&l| Op::Layer(l)));
                match terminal {
                    Some((layer, true)) => ops.push(Op::MoePrepare(layer)),
                    None if self.final_norm => ops.push(Op::FinalNorm),
                    _ => {}
                }
            }
            Slot::Dispatch => {
                if let Some((layer, true)) = terminal {
                    ops.push(Op::MoeDispatch(layer));
                }
            }
            Slot::Mlp => match terminal {
                Some((layer, true)) => ops.push(Op::MoeExperts(layer)),
                Some((layer, false)) => {
                    ops.push(Op::Mlp(layer));
                    if self.final_norm {
                        ops.push(Op::FinalNorm);
                    }
                }
                None => {}
            },
            Slot::Combine => {
                if let Some((layer, true)) = terminal {
                    ops.push(Op::MoeCombine(layer));
                    if self.final_norm {
                        ops.push(Op::FinalNorm);
                    }
                }
            }
            Slot::MtpPostProcess => ops.extend(self.heads.iter().map(|&h| Op::Head(h))),
        }
        ops
    }

    /// Whether the node talks to other EP ranks (has a MoE terminal).
    pub fn has_expert_exchange(&self) -> bool {
        matches!(self.terminal, Some((_, LayerKind::Moe)))
    }
}

/// The whole forward chain. Backward runs it in reverse.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SchedulePlan {
    pub nodes: Cow<'static, [ScheduleNode]>,
}
