//! A schedule as data: the exact order in which one rank issues the work of
//! one optimizer step. The executor walks a [`Program`] and turns each
//! instruction into lane work; keeping the order here, as plain data, lets the
//! interleave of docs/overlap-schedule.md be tested without running a model,
//! and lets the buffer pool be sized by a dry run before any memory is
//! touched.
//!
//! Both schedules run the same pieces of work with the same inputs; only the
//! order across micro-batches differs. That is what makes the overlap
//! schedule bit-identical to the plain one.

use super::pipeline::{Chunk, Pass, PipelineShape, passes};
use hybridgen_dsl::Plan;
use hybridgen_dsl::plan::{ScheduleNode, SchedulePlan, Slot};

/// The pieces of one node's backward, in the order they run. Input-gradient
/// and weight-gradient work are separate pieces, so weight gradients can be
/// delayed to give the comm lane more compute to hide under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackwardPiece {
    /// Output heads (and final norms) backward.
    PostProcess,
    /// The combine all-to-all, backward (comm lane).
    Combine,
    /// The mlp slot's input gradients.
    Mlp,
    /// The mlp slot's weight gradients.
    MlpWeights,
    /// The dispatch all-to-all, backward (comm lane).
    Dispatch,
    /// The pre-dispatch slot's input gradients.
    PreDispatch,
    /// The pre-dispatch slot's weight gradients.
    PreDispatchWeights,
}

impl BackwardPiece {
    /// The forward slot this piece differentiates.
    pub const fn slot(self) -> Slot {
        match self {
            BackwardPiece::PostProcess => Slot::MtpPostProcess,
            BackwardPiece::Combine => Slot::Combine,
            BackwardPiece::Mlp | BackwardPiece::MlpWeights => Slot::Mlp,
            BackwardPiece::Dispatch => Slot::Dispatch,
            BackwardPiece::PreDispatch | BackwardPiece::PreDispatchWeights => Slot::PreDispatch,
        }
    }

    pub const fn is_weight_gradient(self) -> bool {
        matches!(
            self,
            BackwardPiece::MlpWeights | BackwardPiece::PreDispatchWeights
        )
    }

    pub const fn name(self) -> &'static str {
        match self {
            BackwardPiece::PostProcess => "post-process bwd",
            BackwardPiece::Combine => "combine bwd",
            BackwardPiece::Mlp => "mlp bwd",
            BackwardPiece::MlpWeights => "mlp wgrad",
            BackwardPiece::Dispatch => "dispatch bwd",
            BackwardPiece::PreDispatch => "pre-dispatch bwd",
            BackwardPiece::PreDispatchWeights => "pre-dispatch wgrad",
        }
    }
}

/// What crosses a stage boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Flow {
    /// The residual stream after a chunk's last node, to the next stage.
    Activation,
    /// Its gradient, from the next stage back.
    Gradient,
}

/// One stage-to-stage transfer of one micro-batch: what, for which of this
/// rank's chunks (by its first stage), with which pipeline rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Transfer {
    pub mb: usize,
    pub flow: Flow,
    /// The stage of this rank's chunk that sends or receives.
    pub stage: usize,
    /// The pipeline rank at the other end.
    pub peer: usize,
}

impl Transfer {
    fn shifted(self, by: usize) -> Transfer {
        Transfer {
            mb: self.mb + by,
            ..self
        }
    }
}

/// One instruction of a program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Instr {
    /// Stage-to-stage transfers issued together (comm lane): the sends of
    /// the passes just issued and the receives of the passes next, as one
    /// group, so two neighbours sending to each other never wait on each
    /// other (Megatron's paired send/receive).
    Exchange {
        sends: [Option<Transfer>; 2],
        recvs: [Option<Transfer>; 2],
    },
    /// One more user of a unit's parameters: make them resident (all-gather
    /// them unless they still are).
    Acquire { unit: usize },
    /// Take a zeroed gradient buffer for a unit about to run backward.
    GradBuffer { unit: usize },
    /// One forward slot of one node for one micro-batch.
    Forward { mb: usize, node: usize, slot: Slot },
    /// One backward piece of one node for one micro-batch.
    Backward {
        mb: usize,
        node: usize,
        piece: BackwardPiece,
    },
    /// Reduce-scatter the unit's gradients of micro-batch `mb` into the owned
    /// shard (accumulating over micro-batches) and free its gradient buffer.
    Reduce { unit: usize, mb: usize },
    /// The unit's parameters are no longer needed by issued work. The data
    /// stays resident until its buffer is reused (lazy release), so a unit
    /// needed again soon is not gathered twice.
    Release { unit: usize },
    /// Every piece of micro-batch `mb`'s work has been issued: its state can
    /// go once that work completes.
    Retire { mb: usize },
}

impl Instr {
    /// The instruction with its micro-batch moved on by `by`.
    fn shifted(self, by: usize) -> Instr {
        match self {
            Instr::Forward { mb, node, slot } => Instr::Forward {
                mb: mb + by,
                node,
                slot,
            },
            Instr::Backward { mb, node, piece } => Instr::Backward {
                mb: mb + by,
                node,
                piece,
            },
            Instr::Reduce { unit, mb } => Instr::Reduce { unit, mb: mb + by },
            Instr::Retire { mb } => Instr::Retire { mb: mb + by },
            Instr::Exchange { sends, recvs } => Instr::Exchange {
                sends: sends.map(|t| t.map(|t| t.shifted(by))),
                recvs: recvs.map(|t| t.map(|t| t.shifted(by))),
            },
            other => other,
        }
    }

    /// The micro-batches the instruction works on (an exchange's: its
    /// transfers', sends first).
    pub fn micro_batches(self) -> impl Iterator<Item = usize> {
        let one = |mb| [Some(mb), None, None, None];
        let mbs = match self {
            Instr::Forward { mb, .. }
            | Instr::Backward { mb, .. }
            | Instr::Reduce { mb, .. }
            | Instr::Retire { mb } => one(mb),
            Instr::Exchange { sends, recvs } => {
                let mb = |t: Option<Transfer>| t.map(|t| t.mb);
                [mb(sends[0]), mb(sends[1]), mb(recvs[0]), mb(recvs[1])]
            }
            Instr::Acquire { .. } | Instr::GradBuffer { .. } | Instr::Release { .. } => [None; 4],
        };
        mbs.into_iter().flatten()
    }

    /// The transfers of an exchange, sends first, each with whether it is
    /// a send.
    pub fn transfers(self) -> impl Iterator<Item = (bool, Transfer)> {
        let (sends, recvs) = match self {
            Instr::Exchange { sends, recvs } => (sends, recvs),
            _ => ([None; 2], [None; 2]),
        };
        let sends = sends.into_iter().flatten().map(|t| (true, t));
        sends.chain(recvs.into_iter().flatten().map(|t| (false, t)))
    }
}

/// Which schedule a program follows.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// Forward then backward per micro-batch, no overlap.
    Plain,
    /// Combined 1F1B: the forward of micro-batch k interleaved with the
    /// backward of micro-batch k-1, communication of one hidden under the
    /// computation of the other.
    #[default]
    Overlap,
}

/// One optimizer step's issue order on one rank.
///
/// Stored compactly: both schedules repeat one stretch of instructions per
/// micro-batch with only the micro-batch indices moving on, so a program is a
/// few `Block`s whose size depends on the model, not on the number of
/// micro-batches; [`Program::instrs`] expands them as the executor walks.
///
/// Only [`build`] makes one, and it checks what it made ([`Program::check`]):
/// every micro-batch runs every slot and piece of every node once, in order,
/// forward before backward, on acquired units, and is retired after its last
/// piece; so the executor never meets a piece whose inputs are not there yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Program {
    kind: ScheduleKind,
    micro_batches: usize,
    /// The rank's chunks of the pipeline (one, with every node, without
    /// one).
    chunks: Vec<Chunk>,
    blocks: Vec<Block>,
    /// The most units resident (acquired and not yet released) at once.
    pub max_resident_units: usize,
    /// The most gradient buffers in use at once.
    pub max_grad_buffers: usize,
    /// The most micro-batches in flight at once (first forward issued, not
    /// yet retired): what the executor keeps state for.
    pub max_live_micro_batches: usize,
}

/// A stretch of instructions issued `repeats` times, the micro-batches of
/// repeat `i` moved on by `first + i`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Block {
    instrs: Vec<Instr>,
    first: usize,
    repeats: usize,
}

impl Block {
    fn expand(&self, repeats: usize) -> impl Iterator<Item = Instr> + '_ {
        (0..repeats).flat_map(move |i| {
            self.instrs
                .iter()
                .map(move |instr| instr.shifted(self.first + i))
        })
    }
}

impl Program {
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// Whether this rank runs the heads (the last stage's chunk): the
    /// step's losses and token counts are its.
    pub fn runs_heads(&self) -> bool {
        self.chunks.last().is_some_and(|c| c.next.is_none())
    }

    /// Whether the program runs backward work (a training step; not an
    /// evaluation's forward-only program).
    pub fn trains(&self) -> bool {
        self.blocks
            .iter()
            .any(|b| b.instrs.iter().any(|i| matches!(i, Instr::Backward { .. })))
    }

    /// The most micro-batches in flight at once (issued, not yet retired):
    /// 1 for the plain schedule, 2 for the overlap one.
    pub fn in_flight(&self) -> usize {
        self.max_live_micro_batches
    }

    /// Every instruction, in issue order.
    pub fn instrs(&self) -> impl Iterator<Item = Instr> + '_ {
        self.blocks.iter().flat_map(|b| b.expand(b.repeats))
    }

    /// Checks the order rules the executor relies on (see the type's doc);
    /// an error names the first instruction that breaks one.
    pub fn check(&self, schedule: &SchedulePlan) -> Result<(), String> {
        let nodes = &schedule.nodes;
        let shapes: Vec<NodeShape> = nodes.iter().map(NodeShape::of).collect();
        let units = nodes
            .iter()
            .filter_map(|n| n.unit)
            .max()
            .map_or(0, |u| u + 1);
        // Per micro-batch: the next (node, step) expected, as a position in
        // that micro-batch's sequence of work.
        let sequence: Vec<(usize, Work)> = sequence_of(&shapes, &self.chunks);
        // A pipeline rank whose stages have no layers runs nothing.
        if self.chunks.is_empty() {
            return match self.instrs().next() {
                None => Ok(()),
                Some(instr) => Err(format!("a rank with no layers issues {instr:?}")),
            };
        }
        let mut next = vec![0usize; self.micro_batches];
        let mut refs = vec![0usize; units];
        let mut grads = vec![0usize; units];
        let mut retired = vec![false; self.micro_batches];
        for (at, instr) in self.instrs().enumerate() {
            let fail = |why: String| Err(format!("instruction {at} ({instr:?}): {why}"));
            if let Some(mb) = instr
                .micro_batches()
                .find(|&mb| retired.get(mb).copied().unwrap_or(false))
            {
                return fail(format!("micro-batch {mb} was retired"));
            }
            match instr {
                Instr::Exchange { .. } => {
                    for (send, t) in instr.transfers() {
                        if t.mb >= self.micro_batches {
                            return fail(format!("micro-batch {} is not in the step", t.mb));
                        }
                        let work = match send {
                            true => Work::Send(t.flow, t.peer),
                            false => Work::Recv(t.flow, t.peer),
                        };
                        let want = sequence.get(next[t.mb]);
                        if want != Some(&(t.stage, work)) {
                            return fail(format!("micro-batch {} expected {want:?} next", t.mb));
                        }
                        next[t.mb] += 1;
                    }
                }
                Instr::Acquire { unit } if unit < units => refs[unit] += 1,
                Instr::Release { unit } if unit < units => {
                    if refs[unit] == 0 {
                        return fail("releases a unit that is not acquired".into());
                    }
                    refs[unit] -= 1;
                }
                Instr::GradBuffer { unit } if unit < units => {
                    if refs[unit] == 0 {
                        return fail(
                            "takes a gradient buffer for a unit that is not acquired".into(),
                        );
                    }
                    grads[unit] += 1;
                }
                Instr::Reduce { unit, .. } if unit < units => {
                    if grads[unit] == 0 {
                        return fail("reduces a unit without a gradient buffer".into());
                    }
                    grads[unit] -= 1;
                }
                Instr::Forward { mb, node, slot } if mb < self.micro_batches => {
                    let want = sequence.get(next[mb]);
                    if want != Some(&(node, Work::Forward(slot))) {
                        return fail(format!("micro-batch {mb} expected {want:?} next"));
                    }
                    next[mb] += 1;
                    if let Some(u) = nodes[node].unit
                        && refs[u] == 0
                    {
                        return fail(format!("unit {u} is not acquired"));
                    }
                }
                Instr::Backward { mb, node, piece } if mb < self.micro_batches => {
                    let want = sequence.get(next[mb]);
                    if want != Some(&(node, Work::Backward(piece))) {
                        return fail(format!("micro-batch {mb} expected {want:?} next"));
                    }
                    next[mb] += 1;
                    if let Some(u) = nodes[node].unit
                        && (refs[u] == 0 || grads[u] == 0)
                    {
                        return fail(format!("unit {u} is not acquired with a gradient buffer"));
                    }
                }
                Instr::Retire { mb } if mb < self.micro_batches => {
                    if next[mb] != sequence.len() {
                        return fail(format!("micro-batch {mb} has work left"));
                    }
                    retired[mb] = true;
                }
                _ => return fail("names a unit or micro-batch the step does not have".into()),
            }
        }
        if let Some(mb) = retired.iter().position(|&r| !r) {
            return Err(format!("micro-batch {mb} is never retired"));
        }
        if let Some(mb) = next.iter().position(|&n| n != sequence.len()) {
            return Err(format!(
                "micro-batch {mb} ran {} of its {} pieces of work",
                next[mb],
                sequence.len()
            ));
        }
        if refs.iter().any(|&r| r != 0) || grads.iter().any(|&g| g != 0) {
            return Err(format!(
                "acquires and releases do not balance: references {refs:?}, gradient buffers {grads:?}"
            ));
        }
        Ok(())
    }

    /// Instructions in the whole step.
    pub fn len(&self) -> usize {
        self.blocks
            .iter()
            .map(|b| b.instrs.len().saturating_mul(b.repeats))
            .fold(0, usize::saturating_add)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Instructions held in memory (independent of the micro-batch count).
    pub fn stored_len(&self) -> usize {
        self.blocks.iter().map(|b| b.instrs.len()).sum()
    }

    /// The most micro-batches between their first instruction and their
    /// retirement, over the whole step: linear in the micro-batches, which
    /// is why [`build`] counts them on a program of a few and takes that
    /// for more (the steady state repeats).
    fn live_micro_batches(blocks: &[Block]) -> usize {
        let mut live = std::collections::BTreeSet::new();
        let mut most = 0;
        for instr in blocks.iter().flat_map(|b| b.expand(b.repeats)) {
            match instr {
                Instr::Retire { mb } => {
                    live.remove(&mb);
                }
                other => {
                    for mb in other.micro_batches() {
                        live.insert(mb);
                        most = most.max(live.len());
                    }
                }
            }
        }
        most
    }
}

/// One piece of work of one node (or, for a transfer, of one chunk, by
/// its stage) for one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Work {
    Forward(Slot),
    Backward(BackwardPiece),
    /// A transfer to and from a pipeline rank.
    Send(Flow, usize),
    Recv(Flow, usize),
}

/// The order every micro-batch runs its work in on this rank, whatever the
/// schedule: chunk by chunk, its input received, its nodes forward with
/// their slots in order, its output sent; then the chunks in reverse, the
/// output's gradient received, the nodes in reverse with their backward
/// pieces in order, the input's gradient sent.
fn sequence_of(shapes: &[NodeShape], chunks: &[Chunk]) -> Vec<(usize, Work)> {
    let mut out = Vec::new();
    for c in chunks {
        out.extend(
            c.prev
                .map(|(_, peer)| (c.stage, Work::Recv(Flow::Activation, peer))),
        );
        for i in c.nodes.clone() {
            out.extend(shapes[i].forward_slots().map(|s| (i, Work::Forward(s))));
        }
        out.extend(
            c.next
                .map(|(_, peer)| (c.stage, Work::Send(Flow::Activation, peer))),
        );
    }
    for c in chunks.iter().rev() {
        out.extend(
            c.next
                .map(|(_, peer)| (c.stage, Work::Recv(Flow::Gradient, peer))),
        );
        for i in c.nodes.clone().rev() {
            out.extend(
                PIECES
                    .iter()
                    .filter(|&&p| shapes[i].has_backward(p))
                    .map(|&p| (i, Work::Backward(p))),
            );
        }
        out.extend(
            c.prev
                .map(|(_, peer)| (c.stage, Work::Send(Flow::Gradient, peer))),
        );
    }
    out
}

/// Which slots and pieces of a node do any work.
#[derive(Clone, Copy)]
struct NodeShape {
    slots: [bool; 5],
    backward: [bool; 7],
}

const PIECES: [BackwardPiece; 7] = [
    BackwardPiece::PostProcess,
    BackwardPiece::Combine,
    BackwardPiece::Mlp,
    BackwardPiece::MlpWeights,
    BackwardPiece::Dispatch,
    BackwardPiece::PreDispatch,
    BackwardPiece::PreDispatchWeights,
];

impl NodeShape {
    fn of(node: &ScheduleNode) -> NodeShape {
        let slots = Slot::ALL.map(|s| !node.ops(s).is_empty());
        let has = |s: Slot| slots[Slot::ALL.iter().position(|&x| x == s).unwrap_or(0)];
        let backward = PIECES.map(|p| has(p.slot()));
        NodeShape { slots, backward }
    }

    fn forward_slots(self) -> impl Iterator<Item = Slot> {
        Slot::ALL
            .into_iter()
            .zip(self.slots)
            .filter(|&(_, on)| on)
            .map(|(s, _)| s)
    }

    fn has_backward(self, piece: BackwardPiece) -> bool {
        self.backward[PIECES.iter().position(|&p| p == piece).unwrap_or(0)]
    }
}

/// Builds pipeline rank `rank`'s program of one step of `micro_batches`
/// micro-batches (`rank` 0 of one for a plan without pipeline stages), and
/// checks it.
pub fn build(
    plan: &Plan,
    rank: usize,
    micro_batches: usize,
    kind: ScheduleKind,
) -> crate::error::Result<Program> {
    // Past the warm-up and cool-down, more micro-batches only repeat the
    // steady state's blocks, so the check runs on a program long enough to
    // hold every transition (a multiple of pp, as interleaving needs).
    let pp = plan.layout.pp.max(1);
    let enough = (4 * plan.stages.len().max(1) + 4).div_ceil(pp) * pp;
    if micro_batches > enough {
        let short = layout(plan, rank, enough, kind, false, None);
        checked(&short, &plan.schedule)?;
        let live = Some(short.max_live_micro_batches);
        return Ok(layout(plan, rank, micro_batches, kind, false, live));
    }
    let program = layout(plan, rank, micro_batches, kind, false, None);
    checked(&program, &plan.schedule)?;
    Ok(program)
}

/// `program`, checked against the plan it was built for. The planner
/// accepted the plan, so a program that breaks an order rule is hybridgen's
/// fault, reported as an internal error, never as the configuration's.
fn checked(program: &Program, schedule: &SchedulePlan) -> crate::error::Result<()> {
    program.check(schedule).map_err(|why| {
        crate::error::RuntimeError::Internal(format!(
            "the {:?} schedule built for this plan is out of order: {why}",
            program.kind
        ))
    })
}

/// A forward-only program for evaluation: each micro-batch runs every
/// forward slot of every node of the rank's chunks, in order, and is
/// retired; nothing runs backward, takes a gradient buffer or reduces.
/// Units are acquired and released (with the next one prefetched) as in a
/// training forward.
pub fn build_forward_only(plan: &Plan, rank: usize, micro_batches: usize) -> Program {
    layout(plan, rank, micro_batches, ScheduleKind::Plain, true, None)
}

/// The program: the rank's passes ([`passes`]) as instructions, with each
/// pass's transfers merged into one exchange with the next pass's, then
/// stored compactly (a run of segments that repeat with the micro-batches
/// moved on by one is one block).
fn layout(
    plan: &Plan,
    rank: usize,
    micro_batches: usize,
    kind: ScheduleKind,
    forward_only: bool,
    live: Option<usize>,
) -> Program {
    let nodes = &plan.schedule.nodes;
    let shapes: Vec<NodeShape> = nodes.iter().map(NodeShape::of).collect();
    let shape = PipelineShape::of(plan);
    let chunks = shape.chunks.get(rank).cloned().unwrap_or_default();
    let mut b = ProgramBuilder::new(nodes.iter().map(|n| n.unit).collect(), shapes);
    let combine = kind == ScheduleKind::Overlap;
    let mut order = passes(&shape, rank, micro_batches, combine, forward_only).peekable();
    let receives = |pass: &Pass| -> Vec<Transfer> { transfers_of(&chunks, pass, false) };
    // Segments are compressed as they are made: a segment that repeats the
    // last block's with the micro-batches moved on by one more is another
    // repeat of it.
    let mut blocks: Vec<Block> = Vec::new();
    let mut close = |segment: Vec<Instr>| {
        if let Some(last) = blocks.last_mut()
            && last.instrs.len() == segment.len()
            && last
                .instrs
                .iter()
                .zip(&segment)
                .all(|(a, b)| a.shifted(last.repeats) == *b)
        {
            last.repeats += 1;
        } else {
            blocks.push(Block {
                instrs: segment,
                first: 0,
                repeats: 1,
            });
        }
    };
    // Every segment is one pass (or a combined pair, or the plain steady
    // state's forward and backward) and the exchange after it, which holds
    // the pass's sends and the next pass's receives.
    let first = order.peek().map(receives).unwrap_or_default();
    if !first.is_empty() {
        close(vec![exchange(&[], &first)]);
    }
    while let Some(pass) = order.next() {
        let done = b.pass(&pass, &chunks, forward_only);
        let sends = transfers_of(&chunks, &pass, true);
        let next = order.peek();
        let receives = next.map(receives).unwrap_or_default();
        if !sends.is_empty() || !receives.is_empty() {
            b.instrs.push(exchange(&sends, &receives));
        }
        if let Some(mb) = done {
            b.instrs.push(Instr::Retire { mb });
        }
        let pairs =
            matches!(pass, Pass::Forward { .. }) && matches!(next, Some(Pass::Backward { .. }));
        if !pairs {
            close(std::mem::take(&mut b.instrs));
        }
    }
    b.blocks = blocks;
    b.finish(kind, micro_batches, chunks, live)
}

/// The transfers of `pass`: its sends (the activations after its forwards,
/// the gradients after its backwards) or its receives (their inputs).
fn transfers_of(chunks: &[Chunk], pass: &Pass, sends: bool) -> Vec<Transfer> {
    let mut out = Vec::new();
    let mut add = |chunk: usize, mb: usize, forward: bool| {
        let Some(c) = chunks.get(chunk) else { return };
        // A forward receives from the previous stage and sends to the
        // next; a backward the other way round.
        let (flow, end) = match (forward, sends) {
            (true, false) => (Flow::Activation, c.prev),
            (true, true) => (Flow::Activation, c.next),
            (false, false) => (Flow::Gradient, c.next),
            (false, true) => (Flow::Gradient, c.prev),
        };
        if let Some((_, peer)) = end {
            out.push(Transfer {
                mb,
                flow,
                stage: c.stage,
                peer,
            });
        }
    };
    match *pass {
        Pass::Forward { chunk, mb } => add(chunk, mb, true),
        Pass::Backward { chunk, mb } => add(chunk, mb, false),
        Pass::Combined { forward, backward } | Pass::Pair { forward, backward } => {
            add(forward.0, forward.1, true);
            add(backward.0, backward.1, false);
        }
    }
    out
}

/// An exchange of up to two sends and two receives (a combined pass's).
fn exchange(sends: &[Transfer], recvs: &[Transfer]) -> Instr {
    let two = |ts: &[Transfer]| [ts.first().copied(), ts.get(1).copied()];
    Instr::Exchange {
        sends: two(sends),
        recvs: two(recvs),
    }
}

/// Tracks which units are acquired, so acquires, prefetches and releases
/// land where the FSDP lifecycle (docs/fsdp.md) puts them.
struct ProgramBuilder {
    units: Vec<Option<usize>>,
    shapes: Vec<NodeShape>,
    blocks: Vec<Block>,
    /// The block being built.
    instrs: Vec<Instr>,
    /// Reference counts of acquired units (forward and backward users).
    refs: std::collections::HashMap<usize, usize>,
    grads_in_use: usize,
    max_resident: usize,
    max_grads: usize,
    /// The nodes of the chunk the forward (backward) being built runs:
    /// prefetches look no further.
    forward_nodes: std::ops::Range<usize>,
    backward_nodes: std::ops::Range<usize>,
}

impl ProgramBuilder {
    fn new(units: Vec<Option<usize>>, shapes: Vec<NodeShape>) -> Self {
        ProgramBuilder {
            units,
            shapes,
            blocks: Vec::new(),
            instrs: Vec::new(),
            refs: Default::default(),
            grads_in_use: 0,
            max_resident: 0,
            max_grads: 0,
            forward_nodes: 0..0,
            backward_nodes: 0..0,
        }
    }

    /// The program; `live` is its most micro-batches in flight when known
    /// (a shorter program's of the same shape), else counted.
    fn finish(
        self,
        kind: ScheduleKind,
        micro_batches: usize,
        chunks: Vec<Chunk>,
        live: Option<usize>,
    ) -> Program {
        Program {
            kind,
            micro_batches,
            chunks,
            max_live_micro_batches: live
                .unwrap_or_else(|| Program::live_micro_batches(&self.blocks)),
            blocks: self.blocks,
            max_resident_units: self.max_resident,
            max_grad_buffers: self.max_grads,
        }
    }

    fn acquire(&mut self, unit: usize) {
        *self.refs.entry(unit).or_default() += 1;
        self.max_resident = self.max_resident.max(self.refs.len());
        self.instrs.push(Instr::Acquire { unit });
    }

    fn grad_buffer(&mut self, unit: usize) {
        self.grads_in_use += 1;
        self.max_grads = self.max_grads.max(self.grads_in_use);
        self.instrs.push(Instr::GradBuffer { unit });
    }

    fn release(&mut self, unit: usize) {
        if let Some(n) = self.refs.get_mut(&unit) {
            *n -= 1;
            if *n == 0 {
                self.refs.remove(&unit);
            }
        }
        self.instrs.push(Instr::Release { unit });
    }

    fn reduce(&mut self, unit: usize, mb: usize) {
        self.grads_in_use = self.grads_in_use.saturating_sub(1);
        self.instrs.push(Instr::Reduce { unit, mb });
    }

    /// Whether node `i` starts a new unit in forward order (an MTP depth's
    /// nodes share one).
    fn starts_unit(&self, i: usize) -> Option<usize> {
        let unit = self.units[i]?;
        (i == 0 || self.units[i - 1] != Some(unit)).then_some(unit)
    }

    /// Whether node `i` is the last of its unit in forward order.
    fn ends_unit(&self, i: usize) -> Option<usize> {
        let unit = self.units[i]?;
        (i + 1 == self.units.len() || self.units[i + 1] != Some(unit)).then_some(unit)
    }

    /// The next unit after node `i` in forward order in its chunk, for
    /// prefetching.
    fn next_unit_forward(&self, i: usize) -> Option<(usize, usize)> {
        let current = self.units[i];
        (i + 1..self.forward_nodes.end).find_map(|j| match self.units[j] {
            Some(u) if Some(u) != current => Some((j, u)),
            _ => None,
        })
    }

    /// The next unit before node `i` in backward order in its chunk, for
    /// prefetching.
    fn next_unit_backward(&self, i: usize) -> Option<(usize, usize)> {
        let current = self.units[i];
        (self.backward_nodes.start..i)
            .rev()
            .find_map(|j| match self.units[j] {
                Some(u) if Some(u) != current => Some((j, u)),
                _ => None,
            })
    }

    /// Acquires for the forward of node `i`: its unit (if it starts one) and
    /// a prefetch of the next. A unit prefetched earlier is not acquired
    /// twice.
    ///
    /// The prefetch is held until the unit it names starts: nodes in no
    /// unit may lie between the two, and they leave it alone.
    fn forward_acquires(&mut self, i: usize, prefetched: &mut Option<usize>) {
        if let Some(unit) = self.starts_unit(i) {
            // A prefetched unit's reference is handed over to this use.
            if prefetched.take() != Some(unit) {
                self.acquire(unit);
            }
        }
        if self.ends_unit(i).is_some()
            && let Some((_, next)) = self.next_unit_forward(i)
        {
            self.acquire(next);
            *prefetched = Some(next);
        }
    }

    /// Acquires for the backward of node `i` (reverse order): the unit with
    /// a gradient buffer when node `i` is the unit's last node, and a
    /// prefetch of the unit before it.
    ///
    /// As in the forward, nodes in no unit between the two leave the
    /// prefetch alone.
    fn backward_acquires(&mut self, i: usize, prefetched: &mut Option<usize>) {
        if let Some(unit) = self.ends_unit(i) {
            // A prefetched unit's reference is handed over to this use.
            if prefetched.take() != Some(unit) {
                self.acquire(unit);
            }
            self.grad_buffer(unit);
        }
        if self.starts_unit(i).is_some()
            && let Some((_, next)) = self.next_unit_backward(i)
        {
            self.acquire(next);
            *prefetched = Some(next);
        }
    }

    fn forward_node(&mut self, mb: usize, i: usize) {
        for slot in self.shapes[i].forward_slots() {
            self.instrs.push(Instr::Forward { mb, node: i, slot });
        }
    }

    fn forward_done(&mut self, i: usize) {
        if let Some(unit) = self.ends_unit(i) {
            self.release(unit);
        }
    }

    fn backward_piece(&mut self, mb: usize, i: usize, piece: BackwardPiece) {
        if self.shapes[i].has_backward(piece) {
            self.instrs.push(Instr::Backward { mb, node: i, piece });
        }
    }

    fn backward_done(&mut self, mb: usize, i: usize) {
        if let Some(unit) = self.starts_unit(i) {
            self.reduce(unit, mb);
            self.release(unit);
        }
    }

    /// One pass of the rank's order; returns the micro-batch whose last
    /// work on this rank it was (the backward of its first chunk, or an
    /// evaluation's forward of its last), to be retired once the pass's
    /// sends are issued.
    fn pass(&mut self, pass: &Pass, chunks: &[Chunk], forward_only: bool) -> Option<usize> {
        let nodes = |chunk: usize| chunks.get(chunk).map_or(0..0, |c| c.nodes.clone());
        let last = chunks.len().saturating_sub(1);
        match *pass {
            Pass::Forward { chunk, mb } => {
                self.forward_pass(mb, nodes(chunk));
                (forward_only && chunk == last).then_some(mb)
            }
            Pass::Backward { chunk, mb } => {
                self.backward_pass(mb, nodes(chunk));
                (chunk == 0).then_some(mb)
            }
            Pass::Combined { forward, backward } => {
                self.combined(forward.1, nodes(forward.0), backward.1, nodes(backward.0));
                (backward.0 == 0).then_some(backward.1)
            }
            Pass::Pair { forward, backward } => {
                self.forward_pass(forward.1, nodes(forward.0));
                self.backward_pass(backward.1, nodes(backward.0));
                (backward.0 == 0).then_some(backward.1)
            }
        }
    }

    fn forward_pass(&mut self, mb: usize, nodes: std::ops::Range<usize>) {
        self.forward_nodes = nodes.clone();
        let mut prefetched = None;
        for i in nodes {
            self.forward_acquires(i, &mut prefetched);
            self.forward_node(mb, i);
            self.forward_done(i);
        }
        if let Some(unit) = prefetched {
            self.release(unit);
        }
    }

    fn backward_pass(&mut self, mb: usize, nodes: std::ops::Range<usize>) {
        self.backward_nodes = nodes.clone();
        let mut prefetched = None;
        for i in nodes.rev() {
            self.backward_acquires(i, &mut prefetched);
            for piece in PIECES {
                self.backward_piece(mb, i, piece);
            }
            self.backward_done(mb, i);
        }
        if let Some(unit) = prefetched {
            self.release(unit);
        }
    }

    /// Forward of micro-batch `f` over nodes `fwd` combined with backward
    /// of micro-batch `b` over nodes `bwd`, layer by layer: the t-th
    /// forward node with the t-th backward node (from the end), in the
    /// issue order of docs/overlap-schedule.md.
    fn combined(
        &mut self,
        f: usize,
        fwd: std::ops::Range<usize>,
        b: usize,
        bwd: std::ops::Range<usize>,
    ) {
        use BackwardPiece as P;
        self.forward_nodes = fwd.clone();
        self.backward_nodes = bwd.clone();
        let (mut f_pre, mut b_pre) = (None, None);
        for t in 0..fwd.len().max(bwd.len()) {
            let i = (t < fwd.len()).then(|| fwd.start + t);
            let j = (t < bwd.len()).then(|| bwd.end - 1 - t);
            if let Some(i) = i {
                self.forward_acquires(i, &mut f_pre);
            }
            if let Some(j) = j {
                self.backward_acquires(j, &mut b_pre);
            }
            let fwd = |s: &mut Self, slot: Slot| {
                if let Some(i) = i
                    && s.shapes[i].slots[Slot::ALL.iter().position(|&x| x == slot).unwrap_or(0)]
                {
                    s.instrs.push(Instr::Forward {
                        mb: f,
                        node: i,
                        slot,
                    });
                }
            };
            let bwd = |s: &mut Self, piece: P| {
                if let Some(j) = j {
                    s.backward_piece(b, j, piece);
                }
            };
            // 1. b: post-process bwd; b: combine bwd (comm) || 2
            bwd(self, P::PostProcess);
            bwd(self, P::Combine);
            // 2. f: pre-dispatch
            fwd(self, Slot::PreDispatch);
            // 3. b: mlp bwd || 4
            bwd(self, P::Mlp);
            // 4. f: dispatch (comm)
            fwd(self, Slot::Dispatch);
            // 5. b: mlp wgrad; b: dispatch bwd (comm) || 6
            bwd(self, P::MlpWeights);
            bwd(self, P::Dispatch);
            // 6. f: mlp
            fwd(self, Slot::Mlp);
            // 7. f: combine (comm) || 8
            fwd(self, Slot::Combine);
            // 8. b: pre-dispatch bwd
            bwd(self, P::PreDispatch);
            // 9. f: mtp post-process
            fwd(self, Slot::MtpPostProcess);
            // 10. b: pre-dispatch wgrad
            bwd(self, P::PreDispatchWeights);
            if let Some(i) = i {
                self.forward_done(i);
            }
            if let Some(j) = j {
                self.backward_done(b, j);
            }
        }
        for unit in [f_pre, b_pre].into_iter().flatten() {
            self.release(unit);
        }
    }
}

#[cfg(test)]
mod tests;
