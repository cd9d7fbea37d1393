//! How a refusal words one pipeline rank: its stages and what it runs, and
//! its figures.

use super::{ActivationEstimate, Ends, StateEstimate, bytes, live};
use hybridgen_dsl::Plan;

/// Pipeline rank `pp_rank`'s stages and what it runs besides their layers,
/// for people: `stages 0 and 2 (layers 0..2, 4..6) with the embedding`.
pub(super) fn describe_share(plan: &Plan, pp_rank: usize, ends: Ends) -> String {
    let stages: Vec<usize> = (0..plan.stages.len())
        .filter(|&s| plan.stages[s].pp_rank == pp_rank)
        .collect();
    let names: Vec<String> = stages.iter().map(usize::to_string).collect();
    let layers: Vec<String> = stages
        .iter()
        .map(|&s| {
            let l = &plan.stages[s].layers;
            format!("{}..{}", l.start, l.end)
        })
        .collect();
    let mut out = match names.len() {
        1 => format!("stage {} (layers {})", names[0], layers[0]),
        _ => format!("stages {} (layers {})", names.join(", "), layers.join(", ")),
    };
    let mut with = Vec::new();
    if ends.first {
        with.push("the embedding");
    }
    if ends.last {
        with.push("the final norm");
        if ends.mtp_depths > 0 {
            with.push("the MTP depths");
        }
        with.push("the heads");
    }
    if let Some((last, rest)) = with.split_last() {
        out += " with ";
        if !rest.is_empty() {
            out += &rest.join(", ");
            out += " and ";
        }
        out += last;
    }
    out
}

/// One rank's figures in a refusal: its need, its state and what is live
/// (the micro-batches in flight, scratch, headroom, receive buffers), and
/// the largest bucket's scratch where it takes more than that.
pub(super) fn rank_figures(
    per_rank: u64,
    state: &StateEstimate,
    activations: &ActivationEstimate,
    live_micro_batches: usize,
    kernel_scratch: u64,
    arena_headroom: u64,
    transfers: u64,
) -> String {
    let live = live(
        activations,
        live_micro_batches,
        kernel_scratch,
        arena_headroom,
        transfers,
    );
    let receives = match transfers {
        0 => String::new(),
        t => format!("; receive buffers {}", bytes(t)),
    };
    let mut out = format!(
        "{} = {} parameters, gradients and optimizer state + {} activations \
         ({} micro-batch{} in flight x {} kept: layers {}, heads {}, streams {}; one working \
         set {}; kernel scratch {}; arena headroom {}{receives})",
        bytes(per_rank),
        bytes(state.total),
        bytes(live),
        live_micro_batches,
        if live_micro_batches == 1 { "" } else { "es" },
        bytes(activations.total.saturating_sub(activations.working_set)),
        bytes(activations.layers),
        bytes(activations.heads),
        bytes(activations.streams),
        bytes(activations.working_set),
        bytes(kernel_scratch),
        bytes(arena_headroom),
    );
    if state.scratch > live {
        out += &format!(
            " (the largest bucket's scratch, at the start and the end, takes {} more than \
             the activations)",
            bytes(state.scratch - live)
        );
    }
    out
}
