//! The pipeline's shape and its 1F1B order, as data.
//!
//! A plan's stages ([`hybridgen_dsl::plan::Stage`]) run on `pp` pipeline
//! ranks; the stages that run anything form the *chain* an activation
//! passes through ([`Plan::stage_chain`]). A rank's *chunks* are its maximal
//! runs of consecutive chain stages: one chunk a rank without virtual
//! stages, `v` chunks a rank when the pattern has `v x pp` segments
//! (Megatron's interleaved schedule), and one chunk for the whole model when
//! `pp` is 1 (every stage runs on the one rank, so nothing is sent).
//!
//! The order a rank runs its chunks' forward and backward passes in is
//! Megatron's 1F1B ([`passes`]): a warm-up of forwards, a steady state
//! that alternates one forward with one backward, a cool-down of
//! backwards. The warm-up is as long as the chunks downstream of this one
//! need to fill: `chain length - 1 - position` micro-batches without
//! virtual stages, `2 (pp - 1 - rank) + (v - 1) pp` with them. Under the
//! combined-1F1B (EP overlap) schedule the warm-up is one forward longer and
//! each steady forward is combined with the backward beside it, so the
//! forward of one micro-batch runs while the backward of another does its
//! all-to-alls; with one rank that is exactly the overlap schedule of a
//! model without stages. Backwards run in micro-batch order on every rank,
//! so gradients accumulate in the order they do without a pipeline.

use crate::error::{Result, RuntimeError};
use crate::setting::{Setting, SettingSpelling};
use hybridgen_dsl::Plan;
use std::ops::Range;

/// One rank's run of consecutive chain stages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// The schedule nodes it runs.
    pub nodes: Range<usize>,
    /// The stage an activation comes from (`None`: this chunk embeds the
    /// tokens) and its pipeline rank; the gradient goes back there.
    pub prev: Option<(usize, usize)>,
    /// The stage the activation goes to (`None`: this chunk runs the
    /// heads) and its pipeline rank; the gradient comes from there.
    pub next: Option<(usize, usize)>,
    /// The stage this chunk's first node runs on (what its transfers are
    /// labelled by).
    pub stage: usize,
}

/// Where every rank's chunks lie.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineShape {
    pub pp: usize,
    /// Per pipeline rank, its chunks in model order.
    pub chunks: Vec<Vec<Chunk>>,
}

impl PipelineShape {
    pub fn of(plan: &Plan) -> PipelineShape {
        let pp = plan.layout.pp.max(1);
        let nodes = plan.stage_nodes();
        let chain = plan.stage_chain();
        let rank_of = |s: usize| plan.stages.get(s).map_or(0, |st| st.pp_rank);
        // Maximal runs of consecutive chain stages on one rank.
        let mut runs: Vec<(usize, Range<usize>, usize)> = Vec::new(); // (rank, nodes, first stage)
        for &s in &chain {
            match runs.last_mut() {
                Some((rank, range, _)) if *rank == rank_of(s) => range.end = nodes[s].end,
                _ => runs.push((rank_of(s), nodes[s].clone(), s)),
            }
        }
        if runs.is_empty() {
            // A model with no nodes cannot be planned; keep the shape total.
            runs.push((0, 0..0, 0));
        }
        let mut chunks = vec![Vec::new(); pp];
        for (i, (rank, range, stage)) in runs.iter().enumerate() {
            let prev = i.checked_sub(1).map(|j| (runs[j].2, runs[j].0));
            let next = runs.get(i + 1).map(|r| (r.2, r.0));
            chunks[*rank].push(Chunk {
                nodes: range.clone(),
                prev,
                next,
                stage: *stage,
            });
        }
        PipelineShape { pp, chunks }
    }

    /// The chunks of every rank, in chain order: (rank, index among its
    /// chunks).
    fn chain(&self) -> Vec<(usize, usize)> {
        let mut all: Vec<(usize, usize)> = self
            .chunks
            .iter()
            .enumerate()
            .flat_map(|(r, cs)| (0..cs.len()).map(move |c| (r, c)))
            .collect();
        all.sort_by_key(|&(r, c)| self.chunks[r][c].nodes.start);
        all
    }

    /// Chunks a rank when every rank has the same number (interleaving
    /// needs it), else `None`.
    pub fn virtual_stages(&self) -> Option<usize> {
        let v = self.chunks.first().map_or(0, Vec::len);
        self.chunks.iter().all(|c| c.len() == v).then_some(v)
    }

    /// Whether the chain runs through each rank once (no interleaving).
    pub fn is_simple(&self) -> bool {
        self.chunks.iter().all(|c| c.len() <= 1)
    }
}

/// One pass of one micro-batch through one chunk of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward {
        chunk: usize,
        mb: usize,
    },
    Backward {
        chunk: usize,
        mb: usize,
    },
    /// A forward and a backward of two micro-batches, interleaved node by
    /// node (the combined 1F1B).
    Combined {
        forward: (usize, usize),
        backward: (usize, usize),
    },
    /// A forward, then a backward, with their transfers together: the
    /// interleaved schedule's steady state without overlap (Megatron sends
    /// and receives both directions of a step in one group there).
    Pair {
        forward: (usize, usize),
        backward: (usize, usize),
    },
}

/// The passes rank `rank` runs in one step of `m` micro-batches, in order
/// (see the module doc); `combine` pairs the steady state's passes.
/// `forward_only`: an evaluation's forwards, in the same order. The shape
/// must have passed [`check_pipeline`]. Made as they are walked, so a
/// step of many micro-batches takes no memory for its order.
pub fn passes(
    shape: &PipelineShape,
    rank: usize,
    m: usize,
    combine: bool,
    forward_only: bool,
) -> impl Iterator<Item = Pass> + use<> {
    let chunks = shape.chunks.get(rank).map_or(0, Vec::len);
    let order = if chunks == 0 || m == 0 {
        Order::default()
    } else if shape.is_simple() {
        let chain = shape.chain();
        let position = chain.iter().position(|&(r, _)| r == rank).unwrap_or(0);
        Order {
            total: m,
            warmup: chain.len() - 1 - position,
            pp: 1,
            chunks: 1,
        }
    } else {
        Order {
            total: m * chunks,
            warmup: 2 * (shape.pp - 1 - rank) + (chunks - 1) * shape.pp,
            pp: shape.pp,
            chunks,
        }
    };
    let total = order.total;
    let warmup = if forward_only {
        total
    } else {
        (order.warmup + usize::from(combine)).min(total)
    };
    let interleaved = order.chunks > 1;
    let steady = (0..total - warmup).flat_map(move |i| {
        let (f, b) = (order.forward(warmup + i), order.backward(i));
        let pair = match (combine, interleaved) {
            (true, _) => [
                Some(Pass::Combined {
                    forward: f,
                    backward: b,
                }),
                None,
            ],
            (false, true) => [
                Some(Pass::Pair {
                    forward: f,
                    backward: b,
                }),
                None,
            ],
            (false, false) => [
                Some(Pass::Forward {
                    chunk: f.0,
                    mb: f.1,
                }),
                Some(Pass::Backward {
                    chunk: b.0,
                    mb: b.1,
                }),
            ],
        };
        pair.into_iter().flatten()
    });
    let cooldown = (total - warmup..total).filter(move |_| !forward_only);
    (0..warmup)
        .map(move |k| {
            let (chunk, mb) = order.forward(k);
            Pass::Forward { chunk, mb }
        })
        .chain(steady)
        .chain(cooldown.map(move |k| {
            let (chunk, mb) = order.backward(k);
            Pass::Backward { chunk, mb }
        }))
}

/// A rank's 1F1B order: `total` forwards (and backwards) of `chunks`
/// chunks, the first `warmup` forwards before the first backward.
#[derive(Clone, Copy, Default)]
struct Order {
    total: usize,
    warmup: usize,
    pp: usize,
    chunks: usize,
}

impl Order {
    /// The (chunk, micro-batch) of the k-th forward: Megatron's interleaved
    /// order, micro-batches in groups of pp through each chunk in turn (one
    /// chunk: micro-batch k).
    fn forward(self, k: usize) -> (usize, usize) {
        let (pp, v) = (self.pp.max(1), self.chunks.max(1));
        ((k / pp) % v, (k / (pp * v)) * pp + k % pp)
    }

    /// The (chunk, micro-batch) of the k-th backward: the chunks in reverse.
    fn backward(self, k: usize) -> (usize, usize) {
        let (chunk, mb) = self.forward(k);
        (self.chunks.max(1) - 1 - chunk, mb)
    }
}

/// Refuses, before any work, a pipeline this runtime cannot schedule:
/// virtual stages spread unevenly over the ranks (a `|` segment with no
/// layers inside an interleaved pattern), or too few micro-batches for the
/// interleaved order (it needs a multiple of `pp`).
pub fn check_pipeline(plan: &Plan, micro_batches: usize, spelling: SettingSpelling) -> Result<()> {
    let shape = PipelineShape::of(plan);
    if shape.is_simple() {
        return Ok(());
    }
    let pp = shape.pp;
    let Some(v) = shape.virtual_stages() else {
        let counts: Vec<String> = shape
            .chunks
            .iter()
            .enumerate()
            .map(|(r, c)| format!("rank {r}: {}", c.len()))
            .collect();
        return Err(RuntimeError::Unsupported(format!(
            "the pattern's `|` segments give the pipeline ranks different numbers of virtual \
             stages with layers ({}); the interleaved schedule needs the same number on every \
             rank: give every segment layers, or use {} segments",
            counts.join(", "),
            pp
        )));
    };
    if !micro_batches.is_multiple_of(pp) {
        return Err(RuntimeError::Unsupported(format!(
            "{} with {v} virtual stages a pipeline rank: the interleaved schedule runs \
             micro-batches in groups of pp ({pp}); use a multiple of {pp}",
            spelling.given(Setting::MicroBatches, micro_batches)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{Instr, ScheduleKind, Transfer, build, build_forward_only};
    use hybridgen_dsl::{ModelConfig, ParallelLayout, PlanOptions};

    fn plan(pattern: &str, pp: usize) -> Plan {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = pattern.to_string();
        let options = PlanOptions {
            layout: ParallelLayout {
                pp,
                ..ParallelLayout::default()
            },
            ..PlanOptions::default()
        };
        Plan::new(&model, &options).unwrap()
    }

    /// Runs every rank's program as NCCL would, blocking: a rank stops at
    /// each exchange (one NCCL group) until each of its sends and receives
    /// has met its other half, which the peer posts when it gets to the
    /// exchange holding it (the strictest a transport may be; buffered
    /// transports only ever wait less). Every rank must get to its end, and
    /// every message must be received as it was sent.
    fn runs_to_the_end(plan: &Plan, programs: &[Vec<Instr>]) -> Result<(), String> {
        let ranks = programs.len();
        let mut at = vec![0usize; ranks];
        // Per rank, which halves of its current exchange have met theirs.
        let mut met: Vec<Vec<bool>> = vec![Vec::new(); ranks];
        let halves = |r: usize, at: &[usize]| -> Vec<(bool, Transfer)> {
            programs[r]
                .get(at[r])
                .map(|i| i.transfers().collect())
                .unwrap_or_default()
        };
        loop {
            // Everything up to the next exchange runs without waiting.
            for r in 0..ranks {
                while at[r] < programs[r].len()
                    && !matches!(programs[r][at[r]], Instr::Exchange { .. })
                {
                    at[r] += 1;
                }
                let n = halves(r, &at).len();
                met[r].resize(n, false);
            }
            if (0..ranks).all(|r| at[r] == programs[r].len()) {
                return Ok(());
            }
            let mut progress = false;
            for r in 0..ranks {
                for (i, (send, t)) in halves(r, &at).into_iter().enumerate() {
                    if met[r][i] || t.peer >= ranks {
                        continue;
                    }
                    let theirs = halves(t.peer, &at);
                    let other = theirs.iter().enumerate().position(|(j, &(s, u))| {
                        s != send
                            && u.peer == r
                            && u.mb == t.mb
                            && u.flow == t.flow
                            && !met[t.peer][j]
                    });
                    if let Some(j) = other {
                        met[r][i] = true;
                        met[t.peer][j] = true;
                        progress = true;
                    }
                }
            }
            for r in 0..ranks {
                if at[r] < programs[r].len() && met[r].iter().all(|&m| m) {
                    at[r] += 1;
                    met[r].clear();
                    progress = true;
                }
            }
            if !progress {
                let stuck: Vec<String> = (0..ranks)
                    .filter(|&r| at[r] < programs[r].len())
                    .map(|r| format!("rank {r} at {:?}", programs[r][at[r]]))
                    .collect();
                return Err(format!(
                    "{}: deadlock: {}",
                    plan.model.pattern,
                    stuck.join("; ")
                ));
            }
        }
    }

    #[test]
    fn every_pipeline_runs_to_the_end_under_blocking_transfers() {
        let cases = [
            ("M*E-", 2),
            ("M*E-", 4),
            ("M[*E]|M-[*E]", 2),
            ("[ME]*|E[*E]|M-|[*E]E", 2),
            ("[ME]*|E[*E]|M-|[*E]E", 4),
            ("M*|E-|ME|*-|M*|E-", 2),
            ("M*|E-|ME|*-|M*|E-", 3),
            ("M[*E]|M-[*E]/*E", 2),
            ("|M*E-", 2),
        ];
        for (pattern, pp) in cases {
            let plan = plan(pattern, pp);
            let shape = PipelineShape::of(&plan);
            for m in 1..=9 {
                if check_pipeline(&plan, m, SettingSpelling::FIELDS).is_err() {
                    assert!(!shape.is_simple() && m % pp != 0, "{pattern} pp {pp} m {m}");
                    continue;
                }
                for kind in [ScheduleKind::Plain, ScheduleKind::Overlap] {
                    let programs: Vec<Vec<Instr>> = (0..pp)
                        .map(|r| {
                            build(&plan, r, m, kind)
                                .unwrap_or_else(|e| panic!("{pattern} pp {pp} m {m} rank {r}: {e}"))
                                .instrs()
                                .collect()
                        })
                        .collect();
                    runs_to_the_end(&plan, &programs)
                        .unwrap_or_else(|e| panic!("pp {pp} m {m} {kind:?}: {e}"));
                }
                let eval: Vec<Vec<Instr>> = (0..pp)
                    .map(|r| build_forward_only(&plan, r, m).instrs().collect())
                    .collect();
                runs_to_the_end(&plan, &eval).unwrap_or_else(|e| panic!("eval pp {pp} m {m}: {e}"));
            }
        }
    }

    /// One rank runs every stage of a `|` pattern as one chunk: the same
    /// program as the pattern without bars.
    #[test]
    fn one_rank_runs_a_barred_pattern_as_one_chunk() {
        for kind in [ScheduleKind::Plain, ScheduleKind::Overlap] {
            let barred = build(&plan("M[*E]|M-[*E]", 1), 0, 5, kind).unwrap();
            let plain = build(&plan("M[*E]M-[*E]", 1), 0, 5, kind).unwrap();
            assert_eq!(
                barred.instrs().collect::<Vec<_>>(),
                plain.instrs().collect::<Vec<_>>()
            );
        }
    }

    /// The 1F1B shape: a stage keeps as many micro-batches in flight as
    /// the stages from it to the end (one more under the combined
    /// schedule), whatever the number of micro-batches, and the program's
    /// size does not grow with them.
    #[test]
    fn stages_keep_the_1f1b_number_of_micro_batches_in_flight() {
        let plan = plan("M*|E-|ME|*-", 4);
        for kind in [ScheduleKind::Plain, ScheduleKind::Overlap] {
            for r in 0..4 {
                let extra = usize::from(kind == ScheduleKind::Overlap);
                let small = build(&plan, r, 16, kind).unwrap();
                let large = build(&plan, r, 4000, kind).unwrap();
                // A stage after the first receives the next micro-batch's
                // input with the last one's sends, before retiring it.
                let receiving = usize::from(r > 0);
                assert_eq!(
                    small.in_flight(),
                    4 - r + extra + receiving,
                    "rank {r} {kind:?}"
                );
                assert_eq!(large.in_flight(), small.in_flight());
                assert_eq!(large.stored_len(), small.stored_len(), "rank {r} {kind:?}");
            }
        }
    }
}
