//! Runs one step's [`Program`] on a rank's lanes.
//!
//! Every forward slot and backward piece becomes one item of lane work. A
//! micro-batch's items are chained by events, so they run in program order
//! whatever lane they are on; items of different micro-batches on different
//! lanes overlap. The FSDP engine is driven from the program's acquire,
//! release and reduce instructions, and its events gate the work that reads
//! or writes a unit's buffers.
//!
//! The maths of an item depends only on its micro-batch's state and the
//! parameters, never on what ran before it on the other lane, which is why
//! the plain and the overlap schedules give the same bits.

use super::program::{BackwardPiece, Instr, Program};
use crate::backend::{Backend, Tokens};
use crate::device::{Buf, Device, EventOf, RankContext};
use crate::error::{Result, RuntimeError};
use crate::fsdp::FsdpEngine;
use crate::lane::{Event, Label, Lane};
use crate::layers::{
    CollectiveExchange, ExpertExchange, HeadSaved, LayerSaved, LayerWgrad, MoeCombineGrad,
    MoeCombined, MoeExpertsSaved, MoeExpertsWgrad, MoeLayer, MoePrepareWgrad, MoeRouting, MtpSaved,
    MtpWgrad, NormSaved, NormWgrad,
};
use crate::model::ModelRuntime;
use crate::shared::{Shared, SharedRw, lock, read, shared};
use hybridgen_dsl::plan::{LaneKind, LayerRef, Op, Owner, ScheduleNode, Slot};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, MutexGuard, RwLockReadGuard};

/// The tokens of one micro-batch.
#[derive(Clone, Debug)]
pub struct MicroBatchTokens {
    /// `[batch * seq]` input ids.
    pub inputs: Vec<u32>,
    /// Per depth (0: the main head, d + 1: MTP depth d), `[batch * seq]`
    /// target ids.
    pub targets: Vec<Vec<u32>>,
    /// Per MTP depth d, the ids embedded at its entry: position t holds
    /// token t + d + 1.
    pub mtp_inputs: Vec<Vec<u32>>,
}

/// Loss sums of one step on one rank, in micro-batch order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepLosses {
    /// Main cross-entropy: sum over tokens, and token count.
    pub main: (f64, usize),
    /// Per MTP depth: sum and count.
    pub mtp: Vec<(f64, usize)>,
    /// Sum of the MoE load-balancing losses over layers and micro-batches.
    pub aux: f64,
}

/// What every item of one step shares, read-only.
pub struct StepContext<D: Device> {
    pub backend: Arc<D::Backend>,
    pub model: Arc<ModelRuntime>,
    pub ep_group: Arc<D::Comm>,
    /// Per parameter index: where it lies in its holder buffer.
    pub ranges: Arc<Vec<Range<usize>>>,
    pub tokens: Tokens,
    /// The weight of one micro-batch's mean loss in the step's loss:
    /// `1 / (micro-batches x data-parallel size)`.
    pub mb_weight: f32,
}

/// The staged state of one MoE layer for one micro-batch.
struct MoeState<B: Backend> {
    send: Option<B::Buf>,
    send_counts: Vec<usize>,
    routing: Option<MoeRouting<B>>,
    recv: Option<B::Buf>,
    recv_counts: Vec<Vec<usize>>,
    send_rows: Vec<usize>,
    recv_rows: Vec<usize>,
    expert_out: Option<B::Buf>,
    experts: Option<MoeExpertsSaved<B>>,
    combined: Option<MoeCombined<B>>,
    combine_grad: Option<MoeCombineGrad<B>>,
    d_expert_out: Option<B::Buf>,
    d_expert_in: Option<B::Buf>,
    experts_wgrad: Option<MoeExpertsWgrad<B>>,
    d_send: Option<B::Buf>,
    prepare_wgrad: Option<MoePrepareWgrad<B>>,
}

impl<B: Backend> Default for MoeState<B> {
    fn default() -> Self {
        MoeState {
            send: None,
            send_counts: Vec::new(),
            routing: None,
            recv: None,
            recv_counts: Vec::new(),
            send_rows: Vec::new(),
            recv_rows: Vec::new(),
            expert_out: None,
            experts: None,
            combined: None,
            combine_grad: None,
            d_expert_out: None,
            d_expert_in: None,
            experts_wgrad: None,
            d_send: None,
            prepare_wgrad: None,
        }
    }
}

/// A head's state: forward, then its weight gradient.
struct HeadState<B: Backend> {
    saved: Option<HeadSaved<B>>,
    count: usize,
    /// An MTP depth's final norm, before its head.
    norm: Option<NormSaved<B>>,
}

/// Everything one micro-batch carries through its forward and backward.
pub(crate) struct MicroBatch<B: Backend> {
    tokens: MicroBatchTokens,
    /// The decoder's residual stream, then its gradient.
    x: Option<B::Buf>,
    dx: Option<B::Buf>,
    /// The decoder output after its final norm, and its gradient (summed
    /// over the main head and the first MTP depth).
    h_final: Option<B::Buf>,
    d_h_final: Option<B::Buf>,
    final_norm: Option<NormSaved<B>>,
    final_norm_wgrad: Option<NormWgrad<B>>,
    /// Per MTP depth: residual stream, after final norm, and gradients.
    mtp_x: Vec<Option<B::Buf>>,
    mtp_h: Vec<Option<B::Buf>>,
    d_mtp_x: Vec<Option<B::Buf>>,
    d_mtp_h: Vec<Option<B::Buf>>,
    mtp_entry: Vec<Option<MtpSaved<B>>>,
    mtp_entry_wgrad: Vec<Option<(MtpWgrad<B>, B::Buf)>>,
    saved: HashMap<LayerRef, LayerSaved<B>>,
    wgrad: HashMap<LayerRef, LayerWgrad<B>>,
    moe: HashMap<LayerRef, MoeState<B>>,
    heads: HashMap<Option<usize>, HeadState<B>>,
    losses: StepLosses,
}

impl<B: Backend> MicroBatch<B> {
    pub(crate) fn new(tokens: MicroBatchTokens, depths: usize) -> Self {
        let none = || (0..depths).map(|_| None).collect::<Vec<_>>();
        MicroBatch {
            tokens,
            x: None,
            dx: None,
            h_final: None,
            d_h_final: None,
            final_norm: None,
            final_norm_wgrad: None,
            mtp_x: none(),
            mtp_h: none(),
            d_mtp_x: none(),
            d_mtp_h: none(),
            mtp_entry: (0..depths).map(|_| None).collect(),
            mtp_entry_wgrad: (0..depths).map(|_| None).collect(),
            saved: HashMap::new(),
            wgrad: HashMap::new(),
            moe: HashMap::new(),
            heads: HashMap::new(),
            losses: StepLosses {
                mtp: vec![(0.0, 0); depths],
                ..StepLosses::default()
            },
        }
    }
}

fn missing(what: &str) -> RuntimeError {
    RuntimeError::InvalidArgument(format!(
        "schedule: {what} is missing; a piece of work ran out of order"
    ))
}

fn take<T>(slot: &mut Option<T>, what: &str) -> Result<T> {
    slot.take().ok_or_else(|| missing(what))
}

/// Micro-batches whose work is all issued but may still be running that the
/// executor lets pile up before it waits for the oldest: enough to keep the
/// lanes fed while it issues the next micro-batch, few enough that memory
/// does not grow with the number of micro-batches.
const RETIRED_IN_FLIGHT: usize = 1;

/// A micro-batch the executor holds: its state, and the event of its latest
/// work (each micro-batch's work is chained, so that event completing means
/// all of it completed).
struct InFlight<D: Device> {
    state: Shared<MicroBatch<D::Backend>>,
    last: Option<EventOf<D>>,
}

/// Runs one step's program; returns this rank's loss sums once every lane
/// has finished (the non-unit gradients reduced too).
///
/// `micro_batch(mb)` makes micro-batch `mb`'s tokens; it is called when the
/// program first issues work for `mb`, in micro-batch order. A micro-batch's
/// state is dropped once its retired work has completed, and the executor
/// waits for that before starting a new micro-batch when more than
/// [`RETIRED_IN_FLIGHT`] are still running: memory stays that of the
/// schedule's live micro-batches however many a step has.
pub fn run_step<D: Device>(
    program: &Program,
    cx: &Arc<StepContext<D>>,
    engine: &mut FsdpEngine<D>,
    rank: &RankContext<D>,
    micro_batch: &mut dyn FnMut(usize) -> Result<MicroBatchTokens>,
) -> Result<StepLosses> {
    let plan = &cx.model.plan;
    let depths = plan.mtp_depths();
    engine.begin_step(rank)?;
    let mut losses = StepLosses {
        mtp: vec![(0.0, 0); depths],
        ..StepLosses::default()
    };
    let mut live: HashMap<usize, InFlight<D>> = HashMap::new();
    let mut retired: std::collections::VecDeque<InFlight<D>> = Default::default();
    let mut started = 0usize;
    for instr in program.instrs() {
        if let Some(mb) = instr.micro_batch()
            && !live.contains_key(&mb)
        {
            if mb != started {
                return Err(RuntimeError::InvalidArgument(format!(
                    "schedule: micro-batch {mb} is issued after its retirement or out of order \
                     (the next new one is {started})"
                )));
            }
            while retired.len() > RETIRED_IN_FLIGHT {
                if let Some(done) = retired.pop_front() {
                    finish(done, &mut losses)?;
                }
            }
            let tokens = micro_batch(mb)?;
            live.insert(
                mb,
                InFlight {
                    state: shared(MicroBatch::new(tokens, depths)),
                    last: None,
                },
            );
            started += 1;
        }
        let in_flight = |live: &mut HashMap<usize, InFlight<D>>, mb: usize| {
            live.remove(&mb)
                .ok_or_else(|| missing("a live micro-batch"))
        };
        match instr {
            Instr::Acquire { unit } => engine.acquire(unit, rank)?,
            Instr::Release { unit } => engine.release(unit),
            Instr::GradBuffer { unit } => engine.grad_buffer(unit, rank)?,
            Instr::Retire { mb } => retired.push_back(in_flight(&mut live, mb)?),
            Instr::Reduce { unit, mb } => {
                let mine = in_flight(&mut live, mb)?;
                let after: Vec<_> = mine.last.iter().cloned().collect();
                live.insert(mb, mine);
                engine.reduce(unit, rank, &after)?;
            }
            Instr::Forward { mb, node, slot } => {
                let mut mine = in_flight(&mut live, mb)?;
                let node = &plan.schedule.nodes[node];
                let lane_kind = slot.lane();
                let (after, params) = param_access(engine, node, &mine.last)?;
                let label = Label::new(
                    format!("fwd {} {} mb{mb}", slot.name(), node.name),
                    "forward",
                )
                .micro_batch(mb);
                let work = forward_work(cx.clone(), node.index, slot, mine.state.clone(), params);
                let event = lane(rank, lane_kind).submit(label, &after, work);
                engine.note_use(node.unit, lane_kind, &event);
                mine.last = Some(event);
                live.insert(mb, mine);
            }
            Instr::Backward { mb, node, piece } => {
                let mut mine = in_flight(&mut live, mb)?;
                let node = &plan.schedule.nodes[node];
                let lane_kind = piece.slot().lane();
                let (mut after, params) = param_access(engine, node, &mine.last)?;
                let grads = engine.grads(node.unit)?;
                let non_unit_grads = engine.grads(None)?;
                after.extend(grads.ready.clone());
                let category = if piece.is_weight_gradient() {
                    "wgrad"
                } else {
                    "backward"
                };
                let label = Label::new(format!("{} {} mb{mb}", piece.name(), node.name), category)
                    .micro_batch(mb);
                let grads = GradBuffers {
                    unit: node.unit.map(|_| grads.buf),
                    non_unit: non_unit_grads.buf,
                };
                let work = backward_work(
                    cx.clone(),
                    node.index,
                    piece,
                    mine.state.clone(),
                    params,
                    grads,
                );
                let event = lane(rank, lane_kind).submit(label, &after, work);
                engine.note_use(node.unit, lane_kind, &event);
                mine.last = Some(event);
                live.insert(mb, mine);
            }
        }
    }
    if !live.is_empty() {
        return Err(missing("the retirement of every micro-batch"));
    }
    let pending: Vec<_> = retired.iter().filter_map(|m| m.last.clone()).collect();
    engine.reduce_non_unit(rank, &pending)?;
    rank.compute.synchronize()?;
    rank.comm.synchronize()?;
    for done in retired {
        finish(done, &mut losses)?;
    }
    Ok(losses)
}

/// Waits for a retired micro-batch's work, adds its losses to the step's (in
/// micro-batch order, so the sums' bits do not depend on timing) and drops
/// its state.
fn finish<D: Device>(done: InFlight<D>, losses: &mut StepLosses) -> Result<()> {
    if let Some(event) = &done.last {
        event.wait()?;
    }
    let state = lock(&done.state, "a micro-batch")?;
    losses.main.0 += state.losses.main.0;
    losses.main.1 += state.losses.main.1;
    for (total, mine) in losses.mtp.iter_mut().zip(&state.losses.mtp) {
        total.0 += mine.0;
        total.1 += mine.1;
    }
    losses.aux += state.losses.aux;
    Ok(())
}

fn lane<D: Device>(rank: &RankContext<D>, kind: LaneKind) -> &D::Lane {
    match kind {
        LaneKind::Compute => &rank.compute,
        LaneKind::Comm => &rank.comm,
    }
}

/// The parameter buffers a node's work reads, and the events to wait for.
fn param_access<D: Device>(
    engine: &FsdpEngine<D>,
    node: &ScheduleNode,
    previous: &Option<EventOf<D>>,
) -> Result<(Vec<EventOf<D>>, ParamBuffers<D>)> {
    let mut after: Vec<EventOf<D>> = previous.iter().cloned().collect();
    let non_unit = engine.params(None)?;
    after.extend(non_unit.ready.clone());
    let unit = match node.unit {
        Some(u) => {
            let access = engine.params(Some(u))?;
            after.extend(access.ready.clone());
            Some(access.buf)
        }
        None => None,
    };
    Ok((
        after,
        ParamBuffers {
            unit,
            non_unit: non_unit.buf,
        },
    ))
}

struct ParamBuffers<D: Device> {
    unit: Option<SharedRw<Buf<D>>>,
    non_unit: SharedRw<Buf<D>>,
}

struct GradBuffers<D: Device> {
    unit: Option<Shared<Buf<D>>>,
    non_unit: Shared<Buf<D>>,
}

/// Locked parameters for the duration of one item.
struct Weights<'a, D: Device> {
    cx: &'a StepContext<D>,
    unit: Option<RwLockReadGuard<'a, Buf<D>>>,
    non_unit: RwLockReadGuard<'a, Buf<D>>,
}

impl<'a, D: Device> Weights<'a, D> {
    fn lock(cx: &'a StepContext<D>, buffers: &'a ParamBuffers<D>) -> Result<Self> {
        Ok(Weights {
            cx,
            unit: buffers
                .unit
                .as_ref()
                .map(|b| read(b, "a unit's parameters"))
                .transpose()?,
            non_unit: read(&buffers.non_unit, "the non-unit parameters")?,
        })
    }

    /// The weights of `owner`, in its parameter order.
    fn of(&self, owner: Owner) -> Result<Vec<<D::Backend as Backend>::Slice<'_>>> {
        let plan = &self.cx.model.plan;
        let backend = &*self.cx.backend;
        self.cx
            .model
            .params_of(owner)
            .iter()
            .map(|&p| {
                let buf: &Buf<D> = match plan.buckets[plan.params[p].bucket].unit {
                    Some(_) => self
                        .unit
                        .as_deref()
                        .ok_or_else(|| missing("a unit's parameters"))?,
                    None => &self.non_unit,
                };
                backend.slice(buf, self.cx.ranges[p].clone())
            })
            .collect()
    }

    /// The output layer's weight (or, tied, the embedding's).
    fn output(&self) -> Result<<D::Backend as Backend>::Slice<'_>> {
        let owner = if self.cx.model.plan.model.tie_embeddings {
            Owner::Embedding
        } else {
            Owner::OutputLayer
        };
        self.of(owner)?
            .into_iter()
            .next()
            .ok_or_else(|| missing("the output weight"))
    }
}

/// Locked gradient buffers for the duration of one item.
struct Grads<'a, D: Device> {
    cx: &'a StepContext<D>,
    unit: Option<MutexGuard<'a, Buf<D>>>,
    non_unit: MutexGuard<'a, Buf<D>>,
}

impl<'a, D: Device> Grads<'a, D> {
    fn lock(cx: &'a StepContext<D>, buffers: &'a GradBuffers<D>) -> Result<Self> {
        Ok(Grads {
            cx,
            unit: buffers
                .unit
                .as_ref()
                .map(|b| lock(b, "a unit's gradients"))
                .transpose()?,
            non_unit: lock(&buffers.non_unit, "the non-unit gradients")?,
        })
    }

    /// Writable views of `owner`'s gradients, in its parameter order.
    fn of(&mut self, owner: Owner) -> Result<Vec<<D::Backend as Backend>::SliceMut<'_>>> {
        let plan = &self.cx.model.plan;
        let params = self.cx.model.params_of(owner);
        let in_unit = params
            .first()
            .is_some_and(|&p| plan.buckets[plan.params[p].bucket].unit.is_some());
        let ranges: Vec<Range<usize>> = params.iter().map(|&p| self.cx.ranges[p].clone()).collect();
        let buf = if in_unit {
            self.unit
                .as_deref_mut()
                .ok_or_else(|| missing("a unit's gradients"))?
        } else {
            &mut *self.non_unit
        };
        views_mut(&*self.cx.backend, buf, &ranges)
    }

    fn output(&mut self) -> Result<<D::Backend as Backend>::SliceMut<'_>> {
        let owner = if self.cx.model.plan.model.tie_embeddings {
            Owner::Embedding
        } else {
            Owner::OutputLayer
        };
        self.of(owner)?
            .into_iter()
            .next()
            .ok_or_else(|| missing("the output gradient"))
    }
}

/// Disjoint writable views of `ranges` of one buffer, in the order given.
fn views_mut<'a, B: Backend>(
    b: &B,
    buf: &'a mut B::Buf,
    ranges: &[Range<usize>],
) -> Result<Vec<B::SliceMut<'a>>> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| ranges[i].start);
    let mut out: Vec<Option<B::SliceMut<'a>>> = (0..ranges.len()).map(|_| None).collect();
    let mut rest = b.view_mut(buf)?;
    let mut consumed = 0;
    for i in order {
        let range = &ranges[i];
        if range.start < consumed {
            return Err(RuntimeError::InvalidArgument(format!(
                "parameter ranges overlap at element {}",
                range.start
            )));
        }
        let (_, tail) = b.split_mut(rest, range.start - consumed)?;
        let (mine, tail) = b.split_mut(tail, range.len())?;
        out[i] = Some(mine);
        rest = tail;
        consumed = range.end;
    }
    out.into_iter()
        .map(|v| v.ok_or_else(|| missing("a gradient view")))
        .collect()
}

/// `slot += buf`, or `slot = buf` when empty.
fn add_into<B: Backend>(b: &B, slot: &mut Option<B::Buf>, buf: B::Buf) -> Result<()> {
    match slot {
        Some(existing) => b.axpy(1.0, b.view(&buf)?, b.view_mut(existing)?),
        None => {
            *slot = Some(buf);
            Ok(())
        }
    }
}

/// The residual stream (or its gradient) a layer reads and writes.
fn stream<B: Backend>(mb: &mut MicroBatch<B>, layer: LayerRef, grad: bool) -> Result<&mut B::Buf> {
    let slot = match (layer, grad) {
        (LayerRef::Decoder(_), false) => &mut mb.x,
        (LayerRef::Decoder(_), true) => &mut mb.dx,
        (LayerRef::Mtp { depth, .. }, false) => mb
            .mtp_x
            .get_mut(depth)
            .ok_or_else(|| missing("an MTP depth"))?,
        (LayerRef::Mtp { depth, .. }, true) => mb
            .d_mtp_x
            .get_mut(depth)
            .ok_or_else(|| missing("an MTP depth"))?,
    };
    slot.as_mut().ok_or_else(|| missing("the residual stream"))
}

fn moe_layer(model: &ModelRuntime, layer: LayerRef) -> Result<&MoeLayer> {
    model
        .layer(layer)?
        .as_moe()
        .ok_or_else(|| RuntimeError::InvalidArgument(format!("layer {layer:?} is not a MoE layer")))
}

fn forward_work<D: Device>(
    cx: Arc<StepContext<D>>,
    node: usize,
    slot: Slot,
    state: Shared<MicroBatch<D::Backend>>,
    params: ParamBuffers<D>,
) -> crate::lane::Work {
    Box::new(move || {
        let mut mb = lock(&state, "a micro-batch")?;
        let weights = Weights::lock(&cx, &params)?;
        for op in cx.model.plan.schedule.nodes[node].ops(slot) {
            forward_op(&cx, op, &mut mb, &weights)?;
        }
        Ok(())
    })
}

fn backward_work<D: Device>(
    cx: Arc<StepContext<D>>,
    node: usize,
    piece: BackwardPiece,
    state: Shared<MicroBatch<D::Backend>>,
    params: ParamBuffers<D>,
    grads: GradBuffers<D>,
) -> crate::lane::Work {
    Box::new(move || {
        let mut mb = lock(&state, "a micro-batch")?;
        let weights = Weights::lock(&cx, &params)?;
        // Comm-lane pieces write no weight gradients; locking the gradient
        // buffers there would only serialise the lanes.
        let mut grads = match piece.slot().lane() {
            LaneKind::Compute => Some(Grads::lock(&cx, &grads)?),
            LaneKind::Comm => None,
        };
        let mut ops = cx.model.plan.schedule.nodes[node].ops(piece.slot());
        ops.reverse();
        for op in ops {
            backward_op(&cx, op, piece, &mut mb, &weights, grads.as_mut())?;
        }
        // The final norm's input gradient may run on the comm lane (in a
        // combine); its weight gradient waits for this node's next
        // compute-lane weight piece.
        if piece.is_weight_gradient()
            && let Some(wgrad) = mb.final_norm_wgrad.take()
        {
            let grads = grads.as_mut().ok_or_else(|| missing("gradient buffers"))?;
            let mut dw = grads.of(Owner::FinalNorm)?;
            let dw = dw
                .first_mut()
                .ok_or_else(|| missing("the final norm's gradient"))?;
            cx.model.final_norm.backward_weight(
                &*cx.backend,
                wgrad,
                cx.backend.reborrow_mut(dw),
            )?;
        }
        Ok(())
    })
}

fn forward_op<D: Device>(
    cx: &StepContext<D>,
    op: Op,
    mb: &mut MicroBatch<D::Backend>,
    w: &Weights<'_, D>,
) -> Result<()> {
    let b = &*cx.backend;
    let model = &*cx.model;
    let h = model.plan.model.hidden_size;
    let rows = cx.tokens.rows()?;
    match op {
        Op::Embed => {
            let table = w.of(Owner::Embedding)?;
            let mut x = b.alloc(rows * h, crate::backend::Precision::Compute)?;
            model
                .embedding
                .forward(b, first(&table)?, &mb.tokens.inputs, b.view_mut(&mut x)?)?;
            mb.x = Some(x);
        }
        Op::Layer(layer) | Op::Mlp(layer) => {
            let weights = w.of(Owner::Layer(layer))?;
            let x = stream(mb, layer, false)?;
            let saved = model
                .layer(layer)?
                .forward(b, &weights, b.view_mut(x)?, cx.tokens)?;
            mb.saved.insert(layer, saved);
        }
        Op::MoePrepare(layer) => {
            let weights = w.of(Owner::Layer(layer))?;
            let x = stream(mb, layer, false)?;
            let prepared = moe_layer(model, layer)?.prepare(b, &weights, b.view(x)?, cx.tokens)?;
            mb.losses.aux += prepared.aux_loss;
            let state = mb.moe.entry(layer).or_default();
            state.send = Some(prepared.send);
            state.send_counts = prepared.send_counts;
            state.routing = Some(prepared.routing);
        }
        Op::MoeDispatch(layer) => {
            let moe = moe_layer(model, layer)?;
            let exchange = CollectiveExchange {
                collective: &*cx.ep_group,
            };
            let state = mb
                .moe
                .get_mut(&layer)
                .ok_or_else(|| missing("MoE routing"))?;
            let send_counts = moe.counts_per_rank(&state.send_counts)?;
            let recv_counts =
                ExpertExchange::<D::Backend>::exchange_counts(&exchange, &send_counts)?;
            state.send_rows = send_counts.iter().map(|c| c.iter().sum()).collect();
            state.recv_rows = recv_counts.iter().map(|c| c.iter().sum()).collect();
            let send = take(&mut state.send, "the MoE send buffer")?;
            state.recv = Some(exchange.exchange_rows(
                b,
                b.view(&send)?,
                &state.send_rows,
                &state.recv_rows,
                h,
            )?);
            state.recv_counts = recv_counts;
        }
        Op::MoeExperts(layer) => {
            let weights = w.of(Owner::Layer(layer))?;
            let moe = moe_layer(model, layer)?;
            let state = mb
                .moe
                .get_mut(&layer)
                .ok_or_else(|| missing("MoE routing"))?;
            let recv = take(&mut state.recv, "the received MoE rows")?;
            let mut out = b.alloc(b.buf_len(&recv), crate::backend::Precision::Compute)?;
            let saved = moe.experts(
                b,
                &weights,
                b.view(&recv)?,
                &state.recv_counts,
                b.view_mut(&mut out)?,
            )?;
            state.experts = Some(saved);
            state.expert_out = Some(out);
        }
        Op::MoeCombine(layer) => {
            let moe = moe_layer(model, layer)?;
            let exchange = CollectiveExchange {
                collective: &*cx.ep_group,
            };
            let state = mb
                .moe
                .get_mut(&layer)
                .ok_or_else(|| missing("MoE routing"))?;
            let out = take(&mut state.expert_out, "the experts' output")?;
            let returned =
                exchange.exchange_rows(b, b.view(&out)?, &state.recv_rows, &state.send_rows, h)?;
            drop(out);
            let routing = take(&mut state.routing, "MoE routing")?;
            let x = stream(mb, layer, false)?;
            let combined = moe.combine(b, routing, returned, b.view_mut(x)?)?;
            mb.moe
                .get_mut(&layer)
                .ok_or_else(|| missing("MoE routing"))?
                .combined = Some(combined);
        }
        Op::FinalNorm => {
            let weight = w.of(Owner::FinalNorm)?;
            let x = mb.x.as_ref().ok_or_else(|| missing("the decoder output"))?;
            let (y, saved) = model
                .final_norm
                .forward(b, first(&weight)?, b.view(x)?, cx.tokens)?;
            mb.h_final = Some(y);
            mb.final_norm = Some(saved);
        }
        Op::MtpEnter(d) => {
            let block = w.of(Owner::MtpBlock(d))?;
            let table = w.of(Owner::Embedding)?;
            let ids = mb
                .tokens
                .mtp_inputs
                .get(d)
                .ok_or_else(|| missing("MTP inputs"))?;
            let mut emb = b.alloc(rows * h, crate::backend::Precision::Compute)?;
            model
                .embedding
                .forward(b, first(&table)?, ids, b.view_mut(&mut emb)?)?;
            let h_prev = if d == 0 {
                mb.h_final.as_ref()
            } else {
                mb.mtp_h.get(d - 1).and_then(Option::as_ref)
            }
            .ok_or_else(|| missing("the previous depth's hidden states"))?;
            let entry = block
                .get(..3)
                .ok_or_else(|| missing("the MTP entry weights"))?;
            let (out, saved) = model
                .mtp_entry
                .forward(b, entry, b.view(&emb)?, b.view(h_prev)?)?;
            mb.mtp_x[d] = Some(out);
            mb.mtp_entry[d] = Some(saved);
        }
        Op::Head(depth) => {
            let out_w = w.output()?;
            let (hidden, targets, norm) = match depth {
                None => (
                    mb.h_final
                        .as_ref()
                        .ok_or_else(|| missing("the decoder output"))?,
                    mb.tokens.targets.first(),
                    None,
                ),
                Some(d) => {
                    let block = w.of(Owner::MtpBlock(d))?;
                    let x = mb
                        .mtp_x
                        .get(d)
                        .and_then(Option::as_ref)
                        .ok_or_else(|| missing("an MTP depth's output"))?;
                    let (y, saved) = model.final_norm.forward(
                        b,
                        *block.get(3).ok_or_else(|| missing("an MTP final norm"))?,
                        b.view(x)?,
                        cx.tokens,
                    )?;
                    mb.mtp_h[d] = Some(y);
                    (
                        mb.mtp_h[d]
                            .as_ref()
                            .ok_or_else(|| missing("an MTP depth's output"))?,
                        mb.tokens.targets.get(d + 1),
                        Some(saved),
                    )
                }
            };
            let targets = targets.ok_or_else(|| missing("targets"))?;
            let forward = model.head.forward(b, out_w, b.view(hidden)?, targets)?;
            match depth {
                None => {
                    mb.losses.main.0 += forward.loss_sum;
                    mb.losses.main.1 += forward.count;
                }
                Some(d) => {
                    mb.losses.mtp[d].0 += forward.loss_sum;
                    mb.losses.mtp[d].1 += forward.count;
                }
            }
            mb.heads.insert(
                depth,
                HeadState {
                    saved: Some(forward.saved),
                    count: forward.count,
                    norm,
                },
            );
        }
    }
    Ok(())
}

fn first<T: Copy>(list: &[T]) -> Result<T> {
    list.first().copied().ok_or_else(|| missing("a weight"))
}

fn backward_op<D: Device>(
    cx: &StepContext<D>,
    op: Op,
    piece: BackwardPiece,
    mb: &mut MicroBatch<D::Backend>,
    w: &Weights<'_, D>,
    grads: Option<&mut Grads<'_, D>>,
) -> Result<()> {
    let b = &*cx.backend;
    let model = &*cx.model;
    let h = model.plan.model.hidden_size;
    let rows = cx.tokens.rows()?;
    let zeros = || b.alloc(rows * h, crate::backend::Precision::Compute);
    let weights_piece = piece.is_weight_gradient();
    let need_grads = || missing("gradient buffers on this lane");
    match op {
        // The embedding's backward is all weight gradient.
        Op::Embed if weights_piece => {
            let grads = grads.ok_or_else(need_grads)?;
            let dx = mb
                .dx
                .as_ref()
                .ok_or_else(|| missing("the input gradient"))?;
            let mut table = grads.of(Owner::Embedding)?;
            let table = table
                .first_mut()
                .ok_or_else(|| missing("the embedding gradient"))?;
            model
                .embedding
                .backward(b, b.view(dx)?, &mb.tokens.inputs, b.reborrow_mut(table))?;
        }
        Op::Embed => {}
        Op::Layer(layer) | Op::Mlp(layer) if weights_piece => {
            let grads = grads.ok_or_else(need_grads)?;
            let wgrad = mb
                .wgrad
                .remove(&layer)
                .ok_or_else(|| missing("a layer's weight-gradient state"))?;
            let mut g = grads.of(Owner::Layer(layer))?;
            model.layer(layer)?.backward_weight(b, wgrad, &mut g)?;
        }
        Op::Layer(layer) | Op::Mlp(layer) => {
            let weights = w.of(Owner::Layer(layer))?;
            let saved = mb
                .saved
                .remove(&layer)
                .ok_or_else(|| missing("a layer's saved forward"))?;
            let dx = stream(mb, layer, true)?;
            let wgrad = model.layer(layer)?.backward_input(
                b,
                &weights,
                saved,
                b.view_mut(dx)?,
                cx.mb_weight,
            )?;
            mb.wgrad.insert(layer, wgrad);
        }
        Op::MoePrepare(layer) if weights_piece => {
            let grads = grads.ok_or_else(need_grads)?;
            let state = mb.moe.get_mut(&layer).ok_or_else(|| missing("MoE state"))?;
            let wgrad = take(
                &mut state.prepare_wgrad,
                "the MoE prepare weight-gradient state",
            )?;
            let mut g = grads.of(Owner::Layer(layer))?;
            moe_layer(model, layer)?.prepare_backward_weight(b, wgrad, &mut g)?;
            mb.moe.remove(&layer);
        }
        Op::MoePrepare(layer) => {
            let weights = w.of(Owner::Layer(layer))?;
            let state = mb.moe.get_mut(&layer).ok_or_else(|| missing("MoE state"))?;
            let combine = take(&mut state.combine_grad, "the MoE combine gradient")?;
            let d_send = take(&mut state.d_send, "the MoE dispatch gradient")?;
            let dx = stream(mb, layer, true)?;
            let wgrad = moe_layer(model, layer)?.prepare_backward_input(
                b,
                &weights,
                combine,
                b.view(&d_send)?,
                b.view_mut(dx)?,
                cx.mb_weight,
            )?;
            mb.moe
                .get_mut(&layer)
                .ok_or_else(|| missing("MoE state"))?
                .prepare_wgrad = Some(wgrad);
        }
        Op::MoeDispatch(layer) => {
            let exchange = CollectiveExchange {
                collective: &*cx.ep_group,
            };
            let state = mb.moe.get_mut(&layer).ok_or_else(|| missing("MoE state"))?;
            let d_in = take(&mut state.d_expert_in, "the experts' input gradient")?;
            state.d_send = Some(exchange.exchange_rows(
                b,
                b.view(&d_in)?,
                &state.recv_rows,
                &state.send_rows,
                h,
            )?);
        }
        Op::MoeExperts(layer) if weights_piece => {
            let grads = grads.ok_or_else(need_grads)?;
            let state = mb.moe.get_mut(&layer).ok_or_else(|| missing("MoE state"))?;
            let wgrad = take(
                &mut state.experts_wgrad,
                "the experts' weight-gradient state",
            )?;
            let mut g = grads.of(Owner::Layer(layer))?;
            moe_layer(model, layer)?.experts_backward_weight(b, wgrad, &mut g)?;
        }
        Op::MoeExperts(layer) => {
            let weights = w.of(Owner::Layer(layer))?;
            let state = mb.moe.get_mut(&layer).ok_or_else(|| missing("MoE state"))?;
            let saved = take(&mut state.experts, "the experts' saved forward")?;
            let d_out = take(&mut state.d_expert_out, "the experts' output gradient")?;
            let mut d_in = b.alloc(b.buf_len(&d_out), crate::backend::Precision::Compute)?;
            let wgrad = moe_layer(model, layer)?.experts_backward_input(
                b,
                &weights,
                saved,
                b.view(&d_out)?,
                b.view_mut(&mut d_in)?,
            )?;
            state.experts_wgrad = Some(wgrad);
            state.d_expert_in = Some(d_in);
        }
        Op::MoeCombine(layer) => {
            let moe = moe_layer(model, layer)?;
            let exchange = CollectiveExchange {
                collective: &*cx.ep_group,
            };
            let combined = take(
                &mut mb
                    .moe
                    .get_mut(&layer)
                    .ok_or_else(|| missing("MoE state"))?
                    .combined,
                "the MoE combine state",
            )?;
            let backward = {
                let dx = stream(mb, layer, true)?;
                moe.combine_backward(b, combined, b.view(dx)?)?
            };
            let state = mb.moe.get_mut(&layer).ok_or_else(|| missing("MoE state"))?;
            state.d_expert_out = Some(exchange.exchange_rows(
                b,
                b.view(&backward.d_returned)?,
                &state.send_rows,
                &state.recv_rows,
                h,
            )?);
            state.combine_grad = Some(backward.state);
        }
        Op::FinalNorm if weights_piece => {}
        Op::FinalNorm => {
            let weight = w.of(Owner::FinalNorm)?;
            let saved = take(&mut mb.final_norm, "the final norm's saved forward")?;
            let dy = mb
                .d_h_final
                .as_ref()
                .ok_or_else(|| missing("the decoder output gradient"))?;
            let mut dx = zeros()?;
            let wgrad = model.final_norm.backward_input(
                b,
                first(&weight)?,
                saved,
                b.view(dy)?,
                b.view_mut(&mut dx)?,
            )?;
            mb.dx = Some(dx);
            mb.final_norm_wgrad = Some(wgrad);
        }
        Op::MtpEnter(d) if weights_piece => {
            let grads = grads.ok_or_else(need_grads)?;
            let (wgrad, d_emb) = take(
                &mut mb.mtp_entry_wgrad[d],
                "the MTP entry's weight-gradient state",
            )?;
            {
                let mut g = grads.of(Owner::MtpBlock(d))?;
                let entry = g
                    .get_mut(..3)
                    .ok_or_else(|| missing("the MTP entry gradients"))?;
                model.mtp_entry.backward_weight(b, wgrad, entry)?;
            }
            let ids = mb
                .tokens
                .mtp_inputs
                .get(d)
                .ok_or_else(|| missing("MTP inputs"))?;
            let mut table = grads.of(Owner::Embedding)?;
            let table = table
                .first_mut()
                .ok_or_else(|| missing("the embedding gradient"))?;
            model
                .embedding
                .backward(b, b.view(&d_emb)?, ids, b.reborrow_mut(table))?;
        }
        Op::MtpEnter(d) => {
            let block = w.of(Owner::MtpBlock(d))?;
            let saved = take(&mut mb.mtp_entry[d], "the MTP entry's saved forward")?;
            let d_out = mb
                .d_mtp_x
                .get(d)
                .and_then(Option::as_ref)
                .ok_or_else(|| missing("an MTP depth's gradient"))?;
            let mut d_emb = zeros()?;
            let mut d_prev = zeros()?;
            let entry = block
                .get(..3)
                .ok_or_else(|| missing("the MTP entry weights"))?;
            let wgrad = model.mtp_entry.backward_input(
                b,
                entry,
                saved,
                b.view(d_out)?,
                b.view_mut(&mut d_emb)?,
                b.view_mut(&mut d_prev)?,
            )?;
            mb.mtp_entry_wgrad[d] = Some((wgrad, d_emb));
            let target = if d == 0 {
                &mut mb.d_h_final
            } else {
                &mut mb.d_mtp_h[d - 1]
            };
            add_into(b, target, d_prev)?;
        }
        Op::Head(depth) => {
            // Heads run in the post-process piece, input and weight
            // gradients together (their weights are outside units).
            let grads = grads.ok_or_else(need_grads)?;
            let out_w = w.output()?;
            let mut state = mb
                .heads
                .remove(&depth)
                .ok_or_else(|| missing("a head's saved forward"))?;
            let saved = take(&mut state.saved, "a head's saved forward")?;
            let depths = model.plan.mtp_depths().max(1) as f32;
            let weight = match depth {
                None => cx.mb_weight,
                Some(_) => cx.mb_weight * model.plan.model.mtp.loss_scale / depths,
            };
            let scale = if state.count == 0 {
                0.0
            } else {
                weight / state.count as f32
            };
            let mut dh = zeros()?;
            let wgrad = model
                .head
                .backward_input(b, out_w, saved, scale, b.view_mut(&mut dh)?)?;
            model.head.backward_weight(b, wgrad, grads.output()?)?;
            match depth {
                None => add_into(b, &mut mb.d_h_final, dh)?,
                Some(d) => {
                    add_into(b, &mut mb.d_mtp_h[d], dh)?;
                    let block = w.of(Owner::MtpBlock(d))?;
                    let norm = take(&mut state.norm, "an MTP final norm's saved forward")?;
                    let dy = mb.d_mtp_h[d]
                        .as_ref()
                        .ok_or_else(|| missing("an MTP depth's output gradient"))?;
                    let mut dx = zeros()?;
                    let final_norm = *block.get(3).ok_or_else(|| missing("an MTP final norm"))?;
                    let wgrad = model.final_norm.backward_input(
                        b,
                        final_norm,
                        norm,
                        b.view(dy)?,
                        b.view_mut(&mut dx)?,
                    )?;
                    mb.d_mtp_x[d] = Some(dx);
                    let mut g = grads.of(Owner::MtpBlock(d))?;
                    let dw = g
                        .get_mut(3)
                        .ok_or_else(|| missing("an MTP final norm's gradient"))?;
                    model
                        .final_norm
                        .backward_weight(b, wgrad, b.reborrow_mut(dw))?;
                }
            }
        }
    }
    Ok(())
}
