//! Runs one step's [`Program`] on a rank's lanes.
//!
//! Every forward slot and backward piece becomes one item of lane work that
//! receives its lane's backend. A micro-batch's items are chained by events,
//! so they run in program order whatever lane they are on; items of
//! different micro-batches on different lanes overlap. The FSDP engine is
//! driven from the program's acquire, release and reduce instructions, and
//! its events gate the work that reads or writes a unit's buffers. Nothing
//! else orders anything: there are no host locks on device data.
//!
//! The executor only dispatches `(node, slot)` to the ops the plan puts
//! there; each op's handler takes the typed state its layer left for this
//! micro-batch ([`super::state`]) and leaves the next one. The maths of an
//! item depends only on its micro-batch's state and the parameters, never on
//! what ran before it on the other lane, which is why the plain and the
//! overlap schedules give the same bits.

use super::program::{BackwardPiece, Flow, Instr, Program, Transfer};
use super::state::{
    Handoff, HeadState, LayerState, MicroBatch, MtpEntryState, NormState, StepTotals, Stream,
};
use crate::backend::{Backend, Slice, SliceMut, Tokens};
use crate::device::{Buf, Device, EventOf, RankContext};
use crate::error::{Result, RuntimeError};
use crate::fsdp::{FsdpEngine, Holder, ParamPlace, UnitBuffers};
use crate::lane::{Event, Label, Lane};
use crate::layers::{
    CollectiveExchange, ExpertBalance, MoeBackward, MoeForward, MoeLayer, MoeStage, RouterContext,
    copy_of,
};
use crate::model::ModelRuntime;
use crate::recompute::Recompute;
use hybridgen_dsl::plan::{LaneKind, LayerRef, Op, Owner, ScheduleNode, Slot};
use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;

pub use super::state::MicroBatchTokens;

/// A micro-batch's state, shared by the lane work that runs it.
type SharedBatch<D> = Arc<Handoff<MicroBatch<<D as Device>::Backend>>>;

/// What every item of one step shares, read-only.
pub struct StepContext<D: Device> {
    pub model: Arc<ModelRuntime>,
    pub ep_group: Arc<D::Comm>,
    /// The pipeline's ranks of this data-parallel rank: stage-to-stage
    /// transfers.
    pub pipe: Arc<D::Comm>,
    /// Per parameter index: which holder buffer it lies in, and where.
    pub places: Arc<Vec<ParamPlace>>,
    pub tokens: Tokens,
    /// The weight of one micro-batch's mean loss in the step's loss:
    /// `1 / (micro-batches x data-parallel size)`.
    pub mb_weight: f32,
    /// The step's loss sums, expert loads and gradient-norm partials on the
    /// device (the sums and loads zeroed by [`run_step`]), read once at the
    /// step's end.
    pub totals: StepTotals<D::Backend>,
    /// The expert biases of aux-loss-free balancing (copied to the device by
    /// [`run_step`] before the first routing); the step's loads lie in
    /// `totals`.
    pub balance: ExpertBalance<D::Backend>,
    /// For each layer (decoder, then MTP, as [`ModelRuntime::layer_index`]
    /// numbers them) whether it keeps only its input and recomputes its
    /// forward in the backward.
    pub recomputed: Box<[bool]>,
}

impl<D: Device> StepContext<D> {
    /// What the steps of a run share; allocates the step totals on
    /// `backend`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: Arc<ModelRuntime>,
        ep_group: Arc<D::Comm>,
        pipe: Arc<D::Comm>,
        places: Arc<Vec<ParamPlace>>,
        tokens: Tokens,
        mb_weight: f32,
        recompute: Recompute,
        backend: &D::Backend,
    ) -> Result<Self> {
        let plan = &model.plan;
        let balance = ExpertBalance::new(&model, backend)?;
        let totals = StepTotals::new(
            backend,
            plan.mtp_depths(),
            balance.load_slots(),
            plan.buckets.len(),
        )?;
        let kinds: Vec<_> = crate::memory::layer_kinds(plan).collect();
        let recomputed = crate::memory::recomputed(&plan.model, &kinds, tokens, recompute).into();
        Ok(StepContext {
            balance,
            model,
            ep_group,
            pipe,
            places,
            tokens,
            mb_weight,
            totals,
            recomputed,
        })
    }
}

fn missing(what: &str) -> RuntimeError {
    RuntimeError::InvalidArgument(format!(
        "schedule: {what} is missing; a piece of work ran out of order"
    ))
}

/// Micro-batches whose work is all issued but may still be running that the
/// executor lets pile up before it waits for the oldest: enough to keep the
/// lanes fed while it issues the next micro-batch, few enough that host
/// memory does not grow with the number of micro-batches.
const RETIRED_IN_FLIGHT: usize = 1;

/// The arena ([`Backend::in_arena`]) every micro-batch's buffers come from;
/// arena 0 keeps the parameters and optimizer state.
const ACTIVATION_ARENA: usize = 1;

/// Work queued behind a step's ([`run_step`]): given the engine and the
/// event of the step's reduces.
pub type AfterStep<'a, D> = dyn FnMut(&FsdpEngine<D>, &[EventOf<D>]) + 'a;

/// Runs one step's program; returns, per head, the number of unmasked
/// targets this rank trained on, once every lane has finished (the non-unit
/// gradients reduced too). `micro_batch(mb)` makes micro-batch `mb`'s
/// tokens; it is called when the program first issues work for `mb`, in
/// micro-batch order. `after_step(engine, reduced)` queues work behind the
/// step's before the host waits for the lanes (the optimizer's norm
/// partials), so the GPU goes on to it without a trip to the host;
/// `reduced` completes once every gradient reduce into the shards has.
/// The losses accumulate on the device in [`StepContext::totals`], which
/// the caller reads once, after the optimizer's norm partials joined them
/// ([`StepTotals::read`]).
///
/// Memory: every micro-batch allocates from one arena
/// (`ACTIVATION_ARENA`), and a micro-batch's retirement drops everything
/// it still holds, on a lane, after its last work. Sharing the arena is
/// what lets the overlap schedule hold about one micro-batch's activations
/// rather than two: its backward of micro-batch `k - 1` frees layer after
/// layer while the forward of `k` keeps layer after layer, and the forward
/// reuses what the backward freed. Each step issues the same work, so the
/// arena sized by the first step serves the next ones: after the first
/// step, nothing is allocated (`tests/training.rs` holds this over many
/// steps; how two lanes' threads interleave their allocations may vary,
/// which the arena's growth headroom absorbs). The host waits for old
/// retirements before starting more than `RETIRED_IN_FLIGHT` beyond the
/// micro-batches in flight, so what it holds does not grow with the
/// number of micro-batches either.
pub fn run_step<D: Device>(
    program: &Program,
    cx: &Arc<StepContext<D>>,
    engine: &mut FsdpEngine<D>,
    rank: &RankContext<D>,
    micro_batch: &mut dyn FnMut(usize) -> Result<MicroBatchTokens>,
    after_step: &mut AfterStep<'_, D>,
) -> Result<Vec<usize>> {
    let plan = &cx.model.plan;
    let depths = plan.mtp_depths();
    let layers = cx.model.layer_count();
    let trains = program.trains();
    engine.begin_step(rank)?;
    let in_flight = program.in_flight().max(1);
    // Live micro-batches, and the event of each one's latest work.
    let mut live: HashMap<usize, (SharedBatch<D>, Option<EventOf<D>>)> = HashMap::new();
    // Retirements, oldest first: (micro-batch, its last event).
    let mut retired: VecDeque<(usize, EventOf<D>)> = VecDeque::new();
    let mut started = 0usize;
    // Per head, the unmasked targets of the step's micro-batches.
    let mut counts = vec![0usize; depths + 1];
    // Before any head or MoE layer adds to them, loads included (the
    // compute lane runs its work in issue order).
    let sums = cx.clone();
    rank.compute.submit(
        Label::new("zero loss sums", "forward"),
        &[],
        Box::new(move |b: &D::Backend| b.zero(sums.totals.losses()?)),
    );
    // The biases the last step's update left, before any routing reads them.
    if !cx.balance.is_empty() {
        let balance = cx.clone();
        rank.compute.submit(
            Label::new("expert bias", "forward"),
            &[],
            Box::new(move |b: &D::Backend| balance.balance.upload(b)),
        );
    }
    for instr in program.instrs() {
        for mb in instr.micro_batches() {
            if live.contains_key(&mb) {
                continue;
            }
            if mb != started {
                return Err(missing(&format!(
                    "micro-batch {mb} (issued after its retirement or out of order; the next \
                     new one is {started})"
                )));
            }
            while retired.len() > RETIRED_IN_FLIGHT + in_flight - 1 {
                if let Some((_, event)) = retired.pop_front() {
                    event.wait()?;
                }
            }
            let state = MicroBatch::new(micro_batch(mb)?, layers, depths, trains);
            // Only the rank running the heads counts their targets: every
            // stage's counts are added into the step's.
            if program.runs_heads() {
                for (total, n) in counts.iter_mut().zip(&state.counts) {
                    *total += n;
                }
            }
            live.insert(mb, (Arc::new(Handoff::new(state)), None));
            started += 1;
        }
        match instr {
            Instr::Exchange { .. } => {
                let mut after = Vec::new();
                let mut transfers = Vec::with_capacity(4);
                for (send, t) in instr.transfers() {
                    let (state, last) = live
                        .get(&t.mb)
                        .ok_or_else(|| missing("a live micro-batch"))?;
                    after.extend(last.clone());
                    transfers.push((send, t, state.clone()));
                }
                let label = Label::new(exchange_name(&transfers), crate::trace::P2P);
                let work = exchange_work(cx.clone(), transfers);
                let event = rank.comm.submit(label, &after, work);
                for (_, t) in instr.transfers() {
                    if let Some((_, last)) = live.get_mut(&t.mb) {
                        *last = Some(event.clone());
                    }
                }
            }
            Instr::Acquire { unit } => engine.acquire(unit, rank)?,
            Instr::Release { unit } => engine.release(unit),
            Instr::GradBuffer { unit } => engine.grad_buffer(unit, rank)?,
            Instr::Reduce { unit, mb } => {
                let last = live.get(&mb).and_then(|(_, last)| last.clone());
                engine.reduce(unit, rank, &Vec::from_iter(last))?;
            }
            Instr::Forward { mb, node, slot } => {
                let (state, last) = live
                    .get_mut(&mb)
                    .ok_or_else(|| missing("a live micro-batch"))?;
                let node = &plan.schedule.nodes[node];
                let lane_kind = slot.lane();
                let (after, params) = param_access(engine, node, last)?;
                let label = Label::new(
                    format!("fwd {} {} mb{mb}", slot.name(), node.name),
                    "forward",
                )
                .micro_batch(mb);
                let item = Item {
                    cx: cx.clone(),
                    node: node.index,
                    state: state.clone(),
                    params,
                };
                let work = forward_work(item, slot);
                let event = lane(rank, lane_kind).submit(label, &after, work);
                engine.note_use(node.unit, lane_kind, &event);
                *last = Some(event);
            }
            Instr::Backward { mb, node, piece } => {
                let (state, last) = live
                    .get_mut(&mb)
                    .ok_or_else(|| missing("a live micro-batch"))?;
                let node = &plan.schedule.nodes[node];
                let lane_kind = piece.slot().lane();
                let (mut after, params) = param_access(engine, node, last)?;
                let grads = node.unit.map(|u| engine.unit_grads(u)).transpose()?;
                let non_unit_grads = engine.non_unit_grads();
                after.extend(grads.as_ref().and_then(|g| g.ready.clone()));
                let category = if piece.is_weight_gradient() {
                    "wgrad"
                } else {
                    "backward"
                };
                let label = Label::new(format!("{} {} mb{mb}", piece.name(), node.name), category)
                    .micro_batch(mb);
                let grads = HolderBuffers {
                    unit: grads.map(|g| g.buf),
                    non_unit: non_unit_grads.buf,
                };
                let item = Item {
                    cx: cx.clone(),
                    node: node.index,
                    state: state.clone(),
                    params,
                };
                let work = backward_work(item, piece, grads);
                let event = lane(rank, lane_kind).submit(label, &after, work);
                engine.note_use(node.unit, lane_kind, &event);
                *last = Some(event);
            }
            Instr::Retire { mb } => {
                let (state, last) = live
                    .remove(&mb)
                    .ok_or_else(|| missing("a live micro-batch"))?;
                // Dropped inside lane work, after the micro-batch's last
                // work was issued, so the arena fences what it takes back
                // behind every use.
                let event = rank.compute.submit(
                    Label::new(format!("retire mb{mb}"), "forward").micro_batch(mb),
                    &Vec::from_iter(last),
                    Box::new(move |_: &D::Backend| {
                        drop(state.take());
                        Ok(())
                    }),
                );
                retired.push_back((mb, event));
            }
        }
    }
    let all: Vec<_> = retired.into_iter().map(|(_, event)| event).collect();
    engine.reduce_non_unit(rank, &all)?;
    // The comm lane runs in order: behind every reduce of the step.
    let _ = engine.sum_shared(rank, &cx.pipe, &all);
    // The reduces run in order on the comm lane: work behind them all.
    let reduced = rank.comm.submit(
        Label::new("gradients reduced", "reduce"),
        &[],
        Box::new(|_: &D::Backend| Ok(())),
    );
    after_step(engine, &[reduced]);
    rank.compute.synchronize()?;
    rank.comm.synchronize()?;
    Ok(counts)
}

/// An exchange's name in traces: `send act mb3 to 1 + recv grad mb1 from 1`.
fn exchange_name<S>(transfers: &[(bool, Transfer, S)]) -> String {
    let parts: Vec<String> = transfers
        .iter()
        .map(|(send, t, _)| {
            let what = match t.flow {
                Flow::Activation => "act",
                Flow::Gradient => "grad",
            };
            match send {
                true => format!("send {what} mb{} to {}", t.mb, t.peer),
                false => format!("recv {what} mb{} from {}", t.mb, t.peer),
            }
        })
        .collect();
    parts.join(" + ")
}

/// The comm-lane work of one exchange: the sends' tensors taken from their
/// micro-batches (the residual stream after a chunk's forward, or its
/// gradient after a chunk's backward: the sender has no further use for
/// either), the receives' buffers made in the activation arena and left
/// where the next chunk's work looks for them.
fn exchange_work<D: Device>(
    cx: Arc<StepContext<D>>,
    transfers: Vec<(bool, Transfer, SharedBatch<D>)>,
) -> crate::lane::Work<D::Backend> {
    Box::new(move |lane: &D::Backend| {
        let rows = cx.tokens.rows()?;
        let h = cx.model.plan.model.hidden_size;
        let mut sends = Vec::with_capacity(2);
        let mut recvs = Vec::with_capacity(2);
        for (send, t, state) in &transfers {
            if *send {
                let buf = state.with("a stage-to-stage send", |mb| {
                    let stream = &mut mb.streams[0];
                    let slot = match t.flow {
                        Flow::Activation => &mut stream.x,
                        Flow::Gradient => &mut stream.dx,
                    };
                    slot.take()
                        .ok_or_else(|| missing("the tensor a stage sends on"))
                })?;
                sends.push((buf, t.peer));
            } else {
                let b = lane.in_arena(ACTIVATION_ARENA);
                // Written whole by the receive.
                let buf = b.alloc_uninit(rows * h, b.compute_dtype())?;
                recvs.push((buf, t.peer, *t, state.clone()));
            }
        }
        let views = sends
            .iter()
            .map(|(buf, peer)| Ok((lane.view(buf)?, *peer)))
            .collect::<Result<Vec<_>>>()?;
        let into = recvs
            .iter()
            .map(|(buf, peer, _, _)| Ok((lane.view_mut(buf)?, *peer)))
            .collect::<Result<Vec<_>>>()?;
        crate::collective::Collective::exchange(&*cx.pipe, views, into)?;
        for (buf, _, t, state) in recvs {
            state.with("a stage-to-stage receive", |mb| {
                let stream = &mut mb.streams[0];
                match t.flow {
                    Flow::Activation => stream.x = Some(buf),
                    Flow::Gradient => stream.dx = Some(buf),
                }
                Ok(())
            })?;
        }
        Ok(())
    })
}

/// One piece of lane work's share of the step.
struct Item<D: Device> {
    cx: Arc<StepContext<D>>,
    node: usize,
    state: SharedBatch<D>,
    params: HolderBuffers<D>,
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
) -> Result<(Vec<EventOf<D>>, HolderBuffers<D>)> {
    let mut after: Vec<EventOf<D>> = previous.iter().cloned().collect();
    let non_unit = engine.non_unit_params();
    after.extend(non_unit.ready.clone());
    let unit = match node.unit {
        Some(u) => {
            let access = engine.unit_params(u)?;
            after.extend(access.ready.clone());
            Some(access.buf)
        }
        None => None,
    };
    Ok((
        after,
        HolderBuffers {
            unit,
            non_unit: non_unit.buf,
        },
    ))
}

/// The buffers a piece of work finds its owners' parameters (or
/// gradients) in: its unit's, if it has one, and the non-unit ones.
struct HolderBuffers<D: Device> {
    unit: Option<UnitBuffers<D>>,
    non_unit: Arc<Buf<D>>,
}

/// Views of the parameters (or gradients) of owners, in their order.
struct Params<'a, D: Device> {
    cx: &'a StepContext<D>,
    gathered: Option<&'a Buf<D>>,
    held: Option<&'a Buf<D>>,
    non_unit: &'a Buf<D>,
}

impl<'a, D: Device> Params<'a, D> {
    fn new(cx: &'a StepContext<D>, buffers: &'a HolderBuffers<D>) -> Self {
        let unit = buffers.unit.as_ref();
        Params {
            cx,
            gathered: unit.and_then(|u| u.gathered.as_deref()),
            held: unit.and_then(|u| u.held.as_deref()),
            non_unit: &buffers.non_unit,
        }
    }

    /// Parameter `p`'s holder buffer and its elements there.
    fn place(&self, p: usize) -> Result<(&'a Buf<D>, Range<usize>)> {
        let place = self
            .cx
            .places
            .get(p)
            .ok_or_else(|| missing("a parameter's place"))?;
        let buf = match place.holder {
            Holder::Gathered => self
                .gathered
                .ok_or_else(|| missing("a unit's gathered buffer"))?,
            Holder::Held => self.held.ok_or_else(|| missing("a unit's held buffer"))?,
            Holder::NonUnit => self.non_unit,
        };
        Ok((buf, place.range.clone()))
    }

    /// The place of `owner`'s `i`-th parameter.
    fn place_of(&self, owner: Owner, i: usize, what: &str) -> Result<(&'a Buf<D>, Range<usize>)> {
        let p = *self
            .cx
            .model
            .params_of(owner)
            .get(i)
            .ok_or_else(|| missing(what))?;
        self.place(p)
    }

    fn output_owner(&self) -> Owner {
        if self.cx.model.plan.model.tie_embeddings {
            Owner::Embedding
        } else {
            Owner::OutputLayer
        }
    }

    /// The places of `owner`'s parameters, in its parameter order.
    fn places(
        &self,
        owner: Owner,
    ) -> impl Iterator<Item = Result<(&'a Buf<D>, Range<usize>)>> + '_ {
        self.cx
            .model
            .params_of(owner)
            .iter()
            .map(|&p| self.place(p))
    }

    /// The weights of `owner`, in its parameter order.
    fn weights(&self, owner: Owner) -> Result<Vec<Slice<'a, D::Backend>>> {
        self.places(owner)
            .map(|place| place.and_then(|(buf, range)| Slice::<D::Backend>::of(buf, range)))
            .collect()
    }

    fn weight(&self, owner: Owner, i: usize) -> Result<Slice<'a, D::Backend>> {
        let (buf, range) = self.place_of(owner, i, "a weight")?;
        Slice::<D::Backend>::of(buf, range)
    }

    /// Writable views of `owner`'s gradients, in its parameter order.
    fn grads(&self, owner: Owner) -> Result<Vec<SliceMut<'a, D::Backend>>> {
        self.places(owner)
            .map(|place| place.and_then(|(buf, range)| SliceMut::<D::Backend>::of(buf, range)))
            .collect()
    }

    fn grad(&self, owner: Owner, i: usize) -> Result<SliceMut<'a, D::Backend>> {
        let (buf, range) = self.place_of(owner, i, "a gradient")?;
        SliceMut::<D::Backend>::of(buf, range)
    }
}

fn moe_layer(model: &ModelRuntime, layer: LayerRef) -> Result<&MoeLayer> {
    model
        .layer(layer)?
        .as_moe()
        .ok_or_else(|| RuntimeError::InvalidArgument(format!("layer {layer:?} is not a MoE layer")))
}

/// The stream a layer of `layer`'s part (decoder or MTP depth) works on.
fn stream_of<B: Backend>(mb: &mut MicroBatch<B>, layer: LayerRef) -> Result<&mut Stream<B>> {
    let i = match layer {
        LayerRef::Decoder(_) => 0,
        LayerRef::Mtp { depth, .. } => depth + 1,
    };
    mb.streams.get_mut(i).ok_or_else(|| missing("an MTP depth"))
}

fn forward_work<D: Device>(item: Item<D>, slot: Slot) -> crate::lane::Work<D::Backend> {
    Box::new(move |lane: &D::Backend| {
        let b = &lane.in_arena(ACTIVATION_ARENA);
        let cx = &*item.cx;
        let weights = Params::new(cx, &item.params);
        item.state.with("a forward slot", |mb| {
            mb.upload_tokens(b)?;
            for op in cx.model.plan.schedule.nodes[item.node].ops(slot) {
                forward_op(cx, b, op, mb, &weights)?;
            }
            Ok(())
        })
    })
}

fn backward_work<D: Device>(
    item: Item<D>,
    piece: BackwardPiece,
    grads: HolderBuffers<D>,
) -> crate::lane::Work<D::Backend> {
    Box::new(move |lane: &D::Backend| {
        let b = &lane.in_arena(ACTIVATION_ARENA);
        let cx = &*item.cx;
        let weights = Params::new(cx, &item.params);
        // Comm-lane pieces write no weight gradients.
        let grads = match piece.slot().lane() {
            LaneKind::Compute => Some(Params::new(cx, &grads)),
            LaneKind::Comm => None,
        };
        item.state.with("a backward piece", |mb| {
            let mut ops = cx.model.plan.schedule.nodes[item.node].ops(piece.slot());
            ops.reverse();
            for op in ops {
                backward_op(cx, b, op, piece, mb, &weights, grads.as_ref())?;
            }
            // The final norm's input gradient may run on the comm lane (in a
            // combine); its weight gradient waits for this node's next
            // compute-lane weight piece.
            if piece.is_weight_gradient()
                && let NormState::Wgrad(_) = &mb.final_norm
                && let NormState::Wgrad(wgrad) =
                    std::mem::replace(&mut mb.final_norm, NormState::Idle)
            {
                let grads = grads.as_ref().ok_or_else(|| missing("gradient buffers"))?;
                cx.model
                    .final_norm
                    .backward_weight(b, wgrad, grads.grad(Owner::FinalNorm, 0)?)?;
            }
            Ok(())
        })
    })
}

fn forward_op<D: Device>(
    cx: &StepContext<D>,
    b: &D::Backend,
    op: Op,
    mb: &mut MicroBatch<D::Backend>,
    w: &Params<'_, D>,
) -> Result<()> {
    let model = &*cx.model;
    let h = model.plan.model.hidden_size;
    let rows = cx.tokens.rows()?;
    match op {
        Op::Embed => {
            let x = b.alloc_uninit(rows * h, b.compute_dtype())?;
            model.embedding.forward(
                b,
                w.weight(Owner::Embedding, 0)?,
                mb.ids()?.inputs()?,
                b.view_mut(&x)?,
            )?;
            mb.streams[0].x = Some(x);
        }
        Op::Layer(layer) | Op::Mlp(layer) => {
            let i = model.layer_index(layer)?;
            let weights = w.weights(Owner::Layer(layer))?;
            let x = stream_of(mb, layer)?
                .x
                .as_ref()
                .ok_or_else(|| missing("the residual stream"))?;
            let runtime = model.layer(layer)?;
            // A recomputed layer keeps a copy of its input (the forward
            // adds into the residual stream in place) and drops the rest.
            let input = cx.recomputed[i]
                .then(|| copy_of(b, b.view(x)?))
                .transpose()?;
            let saved = runtime.forward(b, &weights, b.view_mut(x)?, cx.tokens)?;
            // A `D` layer's indexer loss joins the step's sum here, on the
            // compute lane in forward issue order (see `StepTotals`), once
            // a micro-batch: a recomputed forward in the backward adds
            // nothing.
            saved.add_indexer_loss(b, cx.totals.indexer()?)?;
            mb.layers[i] = match input {
                Some(input) => LayerState::Input(input),
                None => LayerState::Saved(saved),
            };
        }
        Op::MoePrepare(layer)
        | Op::MoeDispatch(layer)
        | Op::MoeExperts(layer)
        | Op::MoeCombine(layer) => {
            let step = match op {
                Op::MoePrepare(_) => MoeForward::Prepare,
                Op::MoeDispatch(_) => MoeForward::Dispatch,
                Op::MoeExperts(_) => MoeForward::Experts,
                _ => MoeForward::Combine,
            };
            let i = model.layer_index(layer)?;
            let weights = w.weights(Owner::Layer(layer))?;
            let stage = match std::mem::replace(&mut mb.layers[i], LayerState::Idle) {
                LayerState::Idle => MoeStage::idle(),
                LayerState::Moe(stage) => stage,
                other => {
                    return Err(missing(&format!(
                        "a MoE layer's stage (found {})",
                        other.name()
                    )));
                }
            };
            let x = stream_of(mb, layer)?
                .x
                .as_ref()
                .ok_or_else(|| missing("the residual stream"))?;
            let exchange = CollectiveExchange {
                collective: &*cx.ep_group,
            };
            // `Prepare` adds the layer's load-balancing loss and (balancing)
            // its expert load into the step's totals, on the compute lane,
            // in forward issue order (see `StepTotals`).
            let stage = moe_layer(model, layer)?.forward_step(
                step,
                b,
                &weights,
                stage,
                b.view_mut(x)?,
                RouterContext {
                    aux_loss: cx.totals.aux()?,
                    balance: cx.balance.context(b, i, cx.totals.loads()?)?,
                },
                cx.tokens,
                &exchange,
            )?;
            mb.layers[i] = LayerState::Moe(stage);
        }
        Op::FinalNorm => {
            let stream = &mut mb.streams[0];
            let x = stream
                .x
                .as_ref()
                .ok_or_else(|| missing("the decoder output"))?;
            let (y, saved) = model.final_norm.forward(
                b,
                w.weight(Owner::FinalNorm, 0)?,
                b.view(x)?,
                cx.tokens,
            )?;
            stream.h = Some(y);
            mb.final_norm = NormState::Saved(saved);
        }
        Op::MtpEnter(d) => {
            let emb = b.alloc_uninit(rows * h, b.compute_dtype())?;
            model.embedding.forward(
                b,
                w.weight(Owner::Embedding, 0)?,
                mb.ids()?.mtp_inputs(d)?,
                b.view_mut(&emb)?,
            )?;
            let block = w.weights(Owner::MtpBlock(d))?;
            let entry = block
                .get(..3)
                .ok_or_else(|| missing("the MTP entry weights"))?;
            let h_prev = mb.streams[d]
                .h
                .as_ref()
                .ok_or_else(|| missing("the previous depth's hidden states"))?;
            let (out, saved) = model
                .mtp_entry
                .forward(b, entry, b.view(&emb)?, b.view(h_prev)?)?;
            mb.streams[d + 1].x = Some(out);
            mb.mtp_entries[d] = MtpEntryState::Saved(saved);
        }
        Op::Head(depth) => {
            let index = depth.map_or(0, |d| d + 1);
            let norm = match depth {
                None => None,
                Some(d) => {
                    let stream = &mut mb.streams[d + 1];
                    let x = stream
                        .x
                        .as_ref()
                        .ok_or_else(|| missing("an MTP depth's output"))?;
                    let (y, saved) = model.final_norm.forward(
                        b,
                        w.weight(Owner::MtpBlock(d), 3)?,
                        b.view(x)?,
                        cx.tokens,
                    )?;
                    stream.h = Some(y);
                    Some(saved)
                }
            };
            let hidden = mb.streams[index]
                .h
                .as_ref()
                .ok_or_else(|| missing("a head's hidden states"))?;
            let output = w.weight(w.output_owner(), 0)?;
            let grad_scale = mb.trains.then(|| head_grad_scale(cx, mb, depth));
            // Adds into the step's running sum on the compute lane, in
            // forward issue order (see `LossAccumulator`).
            let saved = model.head.forward(
                b,
                output,
                b.view(hidden)?,
                mb.ids()?.targets(index)?,
                cx.totals.head(index)?,
                grad_scale,
            )?;
            mb.heads[index] = HeadState::Saved { saved, norm };
        }
    }
    Ok(())
}

/// The factor of a head's summed token losses in the step's loss: the
/// micro-batch's mean (over its counted targets) times its weight, an MTP
/// depth's also times the MTP loss scale over the depths. The head's logit
/// gradients are scaled by it.
fn head_grad_scale<D: Device>(
    cx: &StepContext<D>,
    mb: &MicroBatch<D::Backend>,
    depth: Option<usize>,
) -> f32 {
    let plan = &cx.model.plan;
    let count = mb
        .counts
        .get(depth.map_or(0, |d| d + 1))
        .copied()
        .unwrap_or(0);
    let weight = match depth {
        None => cx.mb_weight,
        Some(_) => cx.mb_weight * plan.model.mtp.loss_scale / plan.mtp_depths().max(1) as f32,
    };
    if count == 0 {
        0.0
    } else {
        weight / count as f32
    }
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

fn backward_op<D: Device>(
    cx: &StepContext<D>,
    b: &D::Backend,
    op: Op,
    piece: BackwardPiece,
    mb: &mut MicroBatch<D::Backend>,
    w: &Params<'_, D>,
    grads: Option<&Params<'_, D>>,
) -> Result<()> {
    let model = &*cx.model;
    let h = model.plan.model.hidden_size;
    let rows = cx.tokens.rows()?;
    let zeros = || b.alloc(rows * h, b.compute_dtype());
    let weights_piece = piece.is_weight_gradient();
    let grads = || grads.ok_or_else(|| missing("gradient buffers on this lane"));
    match op {
        // The embedding's backward is all weight gradient.
        Op::Embed if weights_piece => {
            let dx = mb.streams[0]
                .dx
                .as_ref()
                .ok_or_else(|| missing("the input gradient"))?;
            model.embedding.backward(
                b,
                b.view(dx)?,
                mb.ids()?.inputs()?,
                grads()?.grad(Owner::Embedding, 0)?,
            )?;
        }
        Op::Embed => {}
        Op::Layer(layer) | Op::Mlp(layer) if weights_piece => {
            let i = model.layer_index(layer)?;
            let wgrad = match std::mem::replace(&mut mb.layers[i], LayerState::Idle) {
                LayerState::Wgrad(wgrad) => wgrad,
                other => {
                    return Err(missing(&format!(
                        "a layer's weight-gradient state (found {})",
                        other.name()
                    )));
                }
            };
            let mut g = grads()?.grads(Owner::Layer(layer))?;
            model.layer(layer)?.backward_weight(b, wgrad, &mut g)?;
        }
        Op::Layer(layer) | Op::Mlp(layer) => {
            let i = model.layer_index(layer)?;
            let weights = w.weights(Owner::Layer(layer))?;
            let saved = match std::mem::replace(&mut mb.layers[i], LayerState::Idle) {
                LayerState::Saved(saved) => saved,
                // The forward again, from the kept input (which becomes the
                // layer's output, unused): the same kernels on the same
                // values give what the forward would have kept.
                LayerState::Input(input) => {
                    model
                        .layer(layer)?
                        .forward(b, &weights, b.view_mut(&input)?, cx.tokens)?
                }
                other => {
                    return Err(missing(&format!(
                        "a layer's saved forward (found {})",
                        other.name()
                    )));
                }
            };
            let dx = stream_of(mb, layer)?
                .dx
                .as_ref()
                .ok_or_else(|| missing("the residual gradient"))?;
            let wgrad = model.layer(layer)?.backward_input(
                b,
                &weights,
                saved,
                b.view_mut(dx)?,
                cx.mb_weight,
            )?;
            mb.layers[i] = LayerState::Wgrad(wgrad);
        }
        Op::MoePrepare(layer)
        | Op::MoeDispatch(layer)
        | Op::MoeExperts(layer)
        | Op::MoeCombine(layer) => {
            let step = match (op, weights_piece) {
                (Op::MoeCombine(_), _) => MoeBackward::Combine,
                (Op::MoeExperts(_), false) => MoeBackward::Experts,
                (Op::MoeExperts(_), true) => MoeBackward::ExpertsWeights,
                (Op::MoeDispatch(_), _) => MoeBackward::Dispatch,
                (_, false) => MoeBackward::Prepare,
                (_, true) => MoeBackward::PrepareWeights,
            };
            let i = model.layer_index(layer)?;
            let stage = match std::mem::replace(&mut mb.layers[i], LayerState::Idle) {
                LayerState::Moe(stage) => stage,
                other => {
                    return Err(missing(&format!(
                        "a MoE layer's stage (found {})",
                        other.name()
                    )));
                }
            };
            let weights = w.weights(Owner::Layer(layer))?;
            let mut g = if weights_piece {
                Some(grads()?.grads(Owner::Layer(layer))?)
            } else {
                None
            };
            let dx = stream_of(mb, layer)?
                .dx
                .as_ref()
                .ok_or_else(|| missing("the residual gradient"))?;
            let exchange = CollectiveExchange {
                collective: &*cx.ep_group,
            };
            let stage = moe_layer(model, layer)?.backward_step(
                step,
                b,
                &weights,
                stage,
                b.view_mut(dx)?,
                g.as_deref_mut(),
                cx.mb_weight,
                &exchange,
            )?;
            mb.layers[i] = if stage.is_idle() {
                LayerState::Idle
            } else {
                LayerState::Moe(stage)
            };
        }
        Op::FinalNorm if weights_piece => {}
        Op::FinalNorm => {
            let saved = match std::mem::replace(&mut mb.final_norm, NormState::Idle) {
                NormState::Saved(saved) => saved,
                _ => return Err(missing("the final norm's saved forward")),
            };
            let stream = &mut mb.streams[0];
            let dy = stream
                .dh
                .as_ref()
                .ok_or_else(|| missing("the decoder output gradient"))?;
            let dx = zeros()?;
            let wgrad = model.final_norm.backward_input(
                b,
                w.weight(Owner::FinalNorm, 0)?,
                saved,
                b.view(dy)?,
                b.view_mut(&dx)?,
            )?;
            stream.dx = Some(dx);
            mb.final_norm = NormState::Wgrad(wgrad);
        }
        Op::MtpEnter(d) if weights_piece => {
            let (wgrad, d_emb) =
                match std::mem::replace(&mut mb.mtp_entries[d], MtpEntryState::Idle) {
                    MtpEntryState::Wgrad(wgrad, d_emb) => (wgrad, d_emb),
                    _ => return Err(missing("the MTP entry's weight-gradient state")),
                };
            let g = grads()?;
            let mut block = g.grads(Owner::MtpBlock(d))?;
            let entry = block
                .get_mut(..3)
                .ok_or_else(|| missing("the MTP entry gradients"))?;
            model.mtp_entry.backward_weight(b, wgrad, entry)?;
            model.embedding.backward(
                b,
                b.view(&d_emb)?,
                mb.ids()?.mtp_inputs(d)?,
                g.grad(Owner::Embedding, 0)?,
            )?;
        }
        Op::MtpEnter(d) => {
            let saved = match std::mem::replace(&mut mb.mtp_entries[d], MtpEntryState::Idle) {
                MtpEntryState::Saved(saved) => saved,
                _ => return Err(missing("the MTP entry's saved forward")),
            };
            let block = w.weights(Owner::MtpBlock(d))?;
            let entry = block
                .get(..3)
                .ok_or_else(|| missing("the MTP entry weights"))?;
            let d_out = mb.streams[d + 1]
                .dx
                .as_ref()
                .ok_or_else(|| missing("an MTP depth's gradient"))?;
            let (d_emb, d_prev) = (zeros()?, zeros()?);
            let wgrad = model.mtp_entry.backward_input(
                b,
                entry,
                saved,
                b.view(d_out)?,
                b.view_mut(&d_emb)?,
                b.view_mut(&d_prev)?,
            )?;
            mb.mtp_entries[d] = MtpEntryState::Wgrad(wgrad, d_emb);
            add_into(b, &mut mb.streams[d].dh, d_prev)?;
        }
        Op::Head(depth) => {
            // Heads run in the post-process piece, input and weight
            // gradients together (their weights are outside units).
            let g = grads()?;
            let index = depth.map_or(0, |d| d + 1);
            let (saved, norm) = match std::mem::replace(&mut mb.heads[index], HeadState::Idle) {
                HeadState::Saved { saved, norm } => (saved, norm),
                HeadState::Idle => return Err(missing("a head's saved forward")),
            };
            let scale = head_grad_scale(cx, mb, depth);
            // Written whole by the head's backward.
            let dh = b.alloc_uninit(rows * h, b.compute_dtype())?;
            let output = w.output_owner();
            model.head.backward(
                b,
                w.weight(output, 0)?,
                saved,
                mb.ids()?.targets(index)?,
                scale,
                b.view_mut(&dh)?,
                g.grad(output, 0)?,
            )?;
            add_into(b, &mut mb.streams[index].dh, dh)?;
            if let Some(d) = depth {
                let norm = norm.ok_or_else(|| missing("an MTP final norm's saved forward"))?;
                let stream = &mut mb.streams[d + 1];
                let dy = stream
                    .dh
                    .as_ref()
                    .ok_or_else(|| missing("an MTP depth's output gradient"))?;
                let dx = zeros()?;
                let wgrad = model.final_norm.backward_input(
                    b,
                    w.weight(Owner::MtpBlock(d), 3)?,
                    norm,
                    b.view(dy)?,
                    b.view_mut(&dx)?,
                )?;
                stream.dx = Some(dx);
                model
                    .final_norm
                    .backward_weight(b, wgrad, g.grad(Owner::MtpBlock(d), 3)?)?;
            }
        }
    }
    Ok(())
}
