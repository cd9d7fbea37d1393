//! The FSDP engine (docs/fsdp.md): ZeRO-3 and `no_shard`, driven by
//! the plan's static bucket layout.
//!
//! Each rank keeps, per bucket, its shard of the f32 master weights, of the
//! compute-precision parameters that get all-gathered, and of the f32
//! gradients accumulated over micro-batches.
//!
//! Buffer dtypes follow Megatron's mixed precision (bf16 with its
//! default fp32 `main_grad`): what all-gathers move and layers read is in
//! the compute dtype (bf16, or f32 under `Precision::F32`); every gradient
//! buffer is f32, because gradients are accumulated over micro-batches and
//! reduce-scattered in f32 and never rounded to bf16 on the way:
//!
//! | buffer | dtype |
//! | --- | --- |
//! | shard master weights, shard gradients, reduce scratch | f32 |
//! | shard parameters (gather source), unit pool, non-unit parameters | compute |
//! | unit gradient buffers, non-unit gradients (wgrad GEMMs accumulate here) | f32 |
//!
//! A unit's full parameters exist only in a fixed pool of buffers sized by a dry run of the schedule; a
//! release is lazy (the data stays until its buffer is reused, least
//! recently released first), so a unit needed again soon is not gathered
//! twice. Non-unit buckets are gathered once per step and never released;
//! their gradients accumulate over the step and are reduced at its end.
//!
//! A bucket one rank holds whole and alone (every bucket in a world of
//! one; an expert bucket whose expert-data-parallel group is one rank, as
//! under EP 2 on 2 ranks) needs none of that: its unit's *held* buffers
//! are the shards' storage of all such buckets of the unit, so they are
//! never gathered, take no room in the pool, and the layers accumulate
//! every micro-batch's gradients straight into the shards, with nothing
//! copied, zeroed per micro-batch or reduced. A unit mixing both (an
//! `[ME]` group under EP 2: its Mamba and the MoE layer's norm, router and
//! shared expert are sharded, its routed experts held) gathers and reduces
//! only its sharded buckets. The non-unit buckets are held when all of them
//! are. On one H200 holding whole units took the benchmark's step from 245
//! to 229 ms (a gradient `axpy` and a memset per unit and micro-batch, and
//! a copy per gather).
//!
//! `no_shard` keeps every bucket whole on every rank and all-reduces
//! gradients where ZeRO-3 reduce-scatters them. Both sum over ranks in rank
//! order and accumulate over micro-batches in the same order, and the
//! optimizer is element-wise, so the two give the same bits.

use crate::backend::{Backend, Slice, SliceMut};
use crate::collective::Collective;
use crate::device::{Buf, Device, EventOf, RankContext};
use crate::error::{Result, RuntimeError};
use crate::lane::{Label, Lane};
use crate::view::DType;
use hybridgen_dsl::Plan;
use hybridgen_dsl::plan::{Bucket, LaneKind};
use std::ops::Range;
use std::sync::Arc;

/// How parameters, gradients and optimizer state are spread over ranks.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Sharding {
    /// Plain data parallelism: everything whole on every rank, gradients
    /// all-reduced.
    NoShard,
    /// ZeRO-3 (`optim_grads_params`): parameters, gradients and optimizer
    /// state sharded; units gathered before use and released after.
    #[default]
    Zero3,
}

/// Where the pieces of every bucket live: the one rule the engine, the
/// optimizer's norm, checkpoints and the parameter hash all follow. Ranks are
/// laid out as [`RankContext`] says: EP rank `r % ep`, EDP rank `r / ep`.
/// `world` and `ep` are a checked layout's (a plan's: [`ShardLayout::of`]):
/// `ep` is at least 1 and divides `world`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    pub sharding: Sharding,
    /// Data-parallel ranks.
    pub world: usize,
    pub ep: usize,
}

impl ShardLayout {
    /// The layout of `plan`'s ranks (its checked [`hybridgen_dsl::ParallelLayout`])
    /// under `sharding`.
    pub fn of(plan: &Plan, sharding: Sharding) -> Self {
        ShardLayout {
            sharding,
            world: plan.layout.dp,
            ep: plan.layout.ep,
        }
    }

    /// Ranks one copy of `bucket` is cut into (1: kept whole).
    pub fn group_size(&self, plan: &Plan, bucket: &Bucket) -> usize {
        match self.sharding {
            Sharding::NoShard => 1,
            Sharding::Zero3 => plan.bucket_world(bucket),
        }
    }

    /// Which piece of its bucket world rank `r` holds.
    pub fn group_rank(&self, expert: bool, r: usize) -> usize {
        match self.sharding {
            Sharding::NoShard => 0,
            Sharding::Zero3 if expert => r / self.ep,
            Sharding::Zero3 => r,
        }
    }

    /// The world ranks whose pieces, in order, make up the copy of a bucket
    /// that EP rank `e` holds (expert buckets differ per EP rank; dense ones
    /// do not, pass `e = 0`). Under `no_shard` that is one rank, the first
    /// holding it whole.
    pub fn holders(&self, expert: bool, e: usize) -> Vec<usize> {
        let ep = self.ep;
        match (self.sharding, expert) {
            (Sharding::NoShard, false) => vec![0],
            (Sharding::NoShard, true) => vec![e],
            (Sharding::Zero3, false) => (0..self.world).collect(),
            (Sharding::Zero3, true) => (0..self.world / ep).map(|q| q * ep + e).collect(),
        }
    }

    /// Whether one rank alone holds `bucket` (whole) and sums its
    /// gradients: no other rank has a piece or a copy of it (a world of
    /// one, or an expert bucket whose expert-data-parallel group is one
    /// rank). Nothing of it is ever gathered or reduced.
    pub fn sole(&self, plan: &Plan, bucket: &Bucket) -> bool {
        plan.bucket_world(bucket) == 1
    }

    /// Whether `unit` has a bucket that is not [`ShardLayout::sole`]: one
    /// it gathers before use (into the pool) and reduces after.
    pub fn gathers_unit(&self, plan: &Plan, unit: usize) -> bool {
        plan.units[unit]
            .buckets
            .iter()
            .any(|&b| !self.sole(plan, &plan.buckets[b]))
    }

    /// Whether every non-unit bucket is [`ShardLayout::sole`].
    pub fn sole_non_unit(&self, plan: &Plan) -> bool {
        plan.non_unit_buckets().all(|b| self.sole(plan, b))
    }

    /// The elements of `bucket` world rank `r` holds, in bucket coordinates.
    pub fn owned_range(&self, plan: &Plan, bucket: &Bucket, r: usize) -> Range<usize> {
        bucket.shard_range(
            self.group_size(plan, bucket),
            self.group_rank(bucket.expert, r),
        )
    }
}

/// What a rank keeps of one bucket between steps. Lane work and the
/// driver share it; lanes and events order their accesses.
pub struct ShardState<B: Backend> {
    /// f32 master weights of the owned elements.
    pub master: B::Buf,
    /// The same in the compute dtype: what all-gathers send.
    pub param: ShardPart<B>,
    /// f32 gradients of the owned elements, summed over micro-batches.
    pub grad: ShardPart<B>,
}

/// Where a shard's compute-dtype parameters or its gradients live: a
/// buffer of their own, or, for a bucket this rank holds whole and alone
/// (see [`FsdpEngine`]'s held buckets), the bucket's region of its unit's
/// held buffers, which layers then read and accumulate into directly.
pub struct ShardPart<B: Backend> {
    buf: Arc<B::Buf>,
    range: Range<usize>,
}

impl<B: Backend> ShardPart<B> {
    fn whole(buf: B::Buf, len: usize) -> Self {
        ShardPart {
            buf: Arc::new(buf),
            range: 0..len,
        }
    }

    fn region(buf: &Arc<B::Buf>, range: Range<usize>) -> Self {
        ShardPart {
            buf: buf.clone(),
            range,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    pub fn view<'a>(&'a self, b: &B) -> Result<Slice<'a, B>> {
        b.slice(&self.buf, self.range.clone())
    }

    pub fn view_mut<'a>(&'a self, b: &B) -> Result<SliceMut<'a, B>> {
        b.slice_mut(&self.buf, self.range.clone())
    }

    /// `piece`, in the shard's coordinates.
    pub fn piece<'a>(&'a self, b: &B, piece: Range<usize>) -> Result<Slice<'a, B>> {
        b.slice(&self.buf, self.within(piece)?)
    }

    pub fn piece_mut<'a>(&'a self, b: &B, piece: Range<usize>) -> Result<SliceMut<'a, B>> {
        b.slice_mut(&self.buf, self.within(piece)?)
    }

    /// `piece` of the shard as a range of its buffer.
    fn within(&self, piece: Range<usize>) -> Result<Range<usize>> {
        let end = self.range.start.checked_add(piece.end);
        match end {
            Some(end) if piece.start <= piece.end && end <= self.range.end => {
                Ok(self.range.start + piece.start..end)
            }
            _ => Err(RuntimeError::InvalidArgument(format!(
                "elements {piece:?} of a shard of {} elements",
                self.range.len()
            ))),
        }
    }
}

/// One buffer of the unit pool.
struct ParamSlot<D: Device> {
    buf: Arc<Buf<D>>,
    /// The unit whose parameters it holds (valid or being gathered).
    holder: Option<usize>,
    /// The last work on each lane (compute, comm) that read it: a new
    /// gather waits for them. Lanes are FIFO, so the newest use per lane
    /// covers the older ones.
    last_uses: [Option<EventOf<D>>; 2],
    /// When it was last released, for least-recently-released reuse.
    released_at: u64,
}

/// The held buffers of a unit: the storage of the shards of its buckets
/// that this rank holds whole and alone ([`ShardLayout::sole`]), back to
/// back. They are never gathered, and their gradients never copied or
/// reduced: the layers accumulate every micro-batch's straight into the
/// shards.
struct HeldBuckets<D: Device> {
    params: Arc<Buf<D>>,
    grads: Arc<Buf<D>>,
    /// The last work that wrote `grads` (the step's zeroing, then each
    /// micro-batch's backward): the next backward waits for it.
    written: Option<EventOf<D>>,
}

struct GradSlot<D: Device> {
    buf: Arc<Buf<D>>,
    busy: bool,
    /// The reduce that last read it; the next user waits for it.
    free_after: Option<EventOf<D>>,
}

/// Where a unit's parameters are.
struct Residency<D: Device> {
    slot: Option<usize>,
    refs: usize,
    /// Completes when the unit's parameters are in its slot.
    ready: Option<EventOf<D>>,
    grad_slot: Option<usize>,
    /// Completes when the unit's gradient buffer is zeroed.
    grad_ready: Option<EventOf<D>>,
}

/// One bucket's part of a gather or a reduce: the rank's shard, the
/// bucket's region in the full buffer, and the group it is sharded over.
struct BucketJob<D: Device> {
    shard: Arc<ShardState<D::Backend>>,
    region: Range<usize>,
    comm: Arc<D::Comm>,
}

/// A unit's (or the non-unit) parameter or gradient buffer, with the event
/// that must complete before work reads or writes it.
pub struct BufferAccess<D: Device, T> {
    pub buf: T,
    pub ready: Option<EventOf<D>>,
}

/// The non-unit parameters (read by many lane works at once).
pub type ParamAccess<D> = BufferAccess<D, Arc<Buf<D>>>;
/// The non-unit gradients.
pub type GradAccess<D> = BufferAccess<D, Arc<Buf<D>>>;

/// A unit's parameter (or gradient) buffers: the pool buffer its gathered
/// buckets are in, and its held buffer; `None` where it has no such
/// buckets.
pub struct UnitBuffers<D: Device> {
    pub gathered: Option<Arc<Buf<D>>>,
    pub held: Option<Arc<Buf<D>>>,
}

/// Which buffer a parameter (and its gradient) lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder {
    /// Its unit's pool buffer (gathered) and gradient buffer.
    Gathered,
    /// Its unit's held buffers: its shard itself.
    Held,
    /// The non-unit buffers.
    NonUnit,
}

/// Where a parameter lies: its holder and its elements there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamPlace {
    pub holder: Holder,
    pub range: Range<usize>,
}

/// What fills the master weights: elements `range` of parameter `p` (by
/// index into `plan.params`) into a slice of `range.len()` values.
pub type InitParams<'a> = dyn Fn(usize, Range<usize>, &mut [f32]) -> Result<()> + Sync + 'a;

/// The engine of one rank.
pub struct FsdpEngine<D: Device> {
    plan: Arc<Plan>,
    layout: ShardLayout,
    /// Per bucket id.
    shards: Vec<Arc<ShardState<D::Backend>>>,
    /// Per bucket: where its region starts inside its unit's pool buffer
    /// (or inside the non-unit buffer), and its length.
    regions: Vec<Range<usize>>,
    param_slots: Vec<ParamSlot<D>>,
    grad_slots: Vec<GradSlot<D>>,
    units: Vec<Residency<D>>,
    /// Per unit: its held buffers, when it has held buckets.
    held: Vec<Option<HeldBuckets<D>>>,
    /// Per unit: its buckets sharded over ranks (gathered and reduced).
    gathered: Vec<Vec<usize>>,
    /// Per bucket: whether its shard lives in its unit's held buffers or in
    /// the held non-unit buffers.
    housed: Vec<bool>,
    non_unit_params: Arc<Buf<D>>,
    non_unit_grads: Arc<Buf<D>>,
    /// Whether the non-unit buffers are the non-unit shards' storage (every
    /// non-unit bucket is sole): nothing to gather or reduce there either.
    non_unit_sole: bool,
    /// Completes when the non-unit parameters are gathered for this step.
    non_unit_ready: Option<EventOf<D>>,
    /// Reduce-scatter output before it is added to a shard (comm lane only).
    scratch: Arc<Buf<D>>,
    clock: u64,
}

impl<D: Device> FsdpEngine<D> {
    /// Builds the engine: allocates shards, the unit pool (`resident_units`
    /// parameter buffers and `grad_buffers` gradient buffers, from the
    /// schedule's dry run) and the non-unit buffers, and fills the master
    /// weights from `init`, which writes elements `range` of a parameter (by
    /// index into `plan.params`) into a slice of that length. A rank fills
    /// only the elements its shards hold (a ZeRO-3 rank of two draws half
    /// the model), with the values the whole parameter has there, so
    /// sharding never changes the initial values.
    pub fn new(
        plan: Arc<Plan>,
        sharding: Sharding,
        rank: &RankContext<D>,
        resident_units: usize,
        grad_buffers: usize,
        init: &InitParams<'_>,
    ) -> Result<Self> {
        let backend = &rank.backend;
        let compute = backend.compute_dtype();
        let layout = ShardLayout::of(&plan, sharding);
        let world_of = |b: &Bucket| layout.group_size(&plan, b);

        // Regions: a unit's gathered buckets back to back inside its pool
        // buffer, its held buckets back to back inside its held buffers,
        // non-unit buckets back to back inside the non-unit buffer.
        let mut regions = vec![0..0; plan.buckets.len()];
        let mut gathered_len = vec![0usize; plan.units.len()];
        let mut held_len = vec![0usize; plan.units.len()];
        let mut gathered = vec![Vec::new(); plan.units.len()];
        let mut non_unit_len = 0usize;
        for b in plan.buckets.iter() {
            let len = b.padded_numel(world_of(b));
            let end = match b.unit {
                Some(u) if layout.sole(&plan, b) => &mut held_len[u],
                Some(u) => {
                    gathered[u].push(b.id);
                    &mut gathered_len[u]
                }
                None => &mut non_unit_len,
            };
            regions[b.id] = *end..*end + len;
            *end += len;
        }

        // Held buffers and the non-unit buffers, when every non-unit
        // bucket is held, are their shards' storage; every other bucket's
        // shard has buffers of its own.
        let non_unit_sole = layout.sole_non_unit(&plan);
        let housed: Vec<bool> = plan
            .buckets
            .iter()
            .map(|b| match b.unit {
                Some(_) => layout.sole(&plan, b),
                None => non_unit_sole,
            })
            .collect();
        let mut held = Vec::with_capacity(plan.units.len());
        for &len in &held_len {
            held.push(if len > 0 {
                Some(HeldBuckets {
                    // Written whole by the casts below (regions tile it).
                    params: Arc::new(backend.alloc_uninit(len, compute)?),
                    grads: Arc::new(backend.alloc(len, DType::F32)?),
                    written: None,
                })
            } else {
                None
            });
        }
        let non_unit_params = Arc::new(backend.alloc(non_unit_len, compute)?);
        let non_unit_grads = Arc::new(backend.alloc(non_unit_len, DType::F32)?);

        let mut shards = Vec::with_capacity(plan.buckets.len());
        let mut max_shard = 0;
        // The shard's elements: each parameter's part inside it, zero in
        // the alignment gaps and padding.
        let shard_values = |b: &Bucket| -> Result<Vec<f32>> {
            let shard_range = layout.owned_range(&plan, b, rank.rank);
            let mut host = vec![0.0; shard_range.len()];
            for &p in b.params.iter() {
                let param = &plan.params[p];
                let numel = plan.def(param).numel();
                let start = param.offset.max(shard_range.start);
                let end = (param.offset + numel).min(shard_range.end);
                if start < end {
                    init(
                        p,
                        start - param.offset..end - param.offset,
                        &mut host[start - shard_range.start..end - shard_range.start],
                    )?;
                }
            }
            Ok(host)
        };
        // A shard's state on the device from its values: the f32 master,
        // the compute-dtype copy and the gradient, in the unit's buffers
        // where it is housed there.
        let place = |b: &Bucket, host: &[f32]| -> Result<ShardState<D::Backend>> {
            let master = backend.alloc_uninit(host.len(), DType::F32)?;
            backend.upload(host, backend.view_mut(&master)?)?;
            let home = match b.unit {
                Some(u) if housed[b.id] => held[u].as_ref().map(|h| (&h.params, &h.grads)),
                Some(_) => None,
                None => non_unit_sole.then_some((&non_unit_params, &non_unit_grads)),
            };
            let (param, grad): (ShardPart<D::Backend>, ShardPart<D::Backend>) = match home {
                Some((params, grads)) => (
                    ShardPart::region(params, regions[b.id].clone()),
                    ShardPart::region(grads, regions[b.id].clone()),
                ),
                None => (
                    ShardPart::whole(backend.alloc_uninit(host.len(), compute)?, host.len()),
                    ShardPart::whole(backend.alloc(host.len(), DType::F32)?, host.len()),
                ),
            };
            backend.cast(backend.view(&master)?, param.view_mut(&**backend)?)?;
            Ok(ShardState {
                master,
                param,
                grad,
            })
        };
        // Drawing a bucket's values (seconds, for a large model) overlaps
        // placing the one before: a thread draws them in bucket order, one
        // bucket ahead at most, so two shards' values are in host memory at
        // a time.
        let (drawn, values) = std::sync::mpsc::sync_channel::<Result<Vec<f32>>>(0);
        let buckets = &plan.buckets;
        let shard_values = &shard_values;
        std::thread::scope(|scope| -> Result<()> {
            // Owned here, so a failure below drops it and the drawing
            // thread stops at its next send instead of waiting forever.
            let values = values;
            scope.spawn(move || {
                for b in buckets.iter() {
                    let host = shard_values(b);
                    let failed = host.is_err();
                    // The receiver is gone only when placing a shard failed.
                    if drawn.send(host).is_err() || failed {
                        return;
                    }
                }
            });
            for b in buckets.iter() {
                // A closed channel here means the drawing thread panicked;
                // the scope re-raises that panic with its message.
                let host = values.recv().map_err(|_| {
                    RuntimeError::InvalidArgument(
                        "the thread drawing the initial parameters stopped without a result".into(),
                    )
                })??;
                max_shard = max_shard.max(host.len());
                shards.push(Arc::new(place(b, &host)?));
            }
            Ok(())
        })?;

        // The pool serves the units with gathered buckets.
        let pooled: Vec<usize> = (0..plan.units.len())
            .filter(|&u| !gathered[u].is_empty())
            .collect();
        let slot_len = pooled.iter().map(|&u| gathered_len[u]).max().unwrap_or(0);
        let slots = match sharding {
            // Every unit keeps its own buffer for the whole run.
            Sharding::NoShard => pooled.len(),
            Sharding::Zero3 => resident_units.min(pooled.len()),
        };
        let param_slots = (0..slots)
            .map(|i| {
                // `no_shard`: slot i is the i-th pooled unit's for the
                // whole run.
                let (len, holder) = match sharding {
                    Sharding::NoShard => (gathered_len[pooled[i]], Some(pooled[i])),
                    Sharding::Zero3 => (slot_len, None),
                };
                Ok(ParamSlot {
                    buf: Arc::new(backend.alloc(len, compute)?),
                    holder,
                    last_uses: [None, None],
                    released_at: 0,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let grad_slots = (0..grad_buffers.max(1).min(pooled.len()))
            .map(|_| {
                Ok(GradSlot {
                    buf: Arc::new(backend.alloc(slot_len, DType::F32)?),
                    busy: false,
                    free_after: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut units: Vec<Residency<D>> = (0..plan.units.len())
            .map(|_| Residency {
                slot: None,
                refs: 0,
                ready: None,
                grad_slot: None,
                grad_ready: None,
            })
            .collect();
        if sharding == Sharding::NoShard {
            for (i, &u) in pooled.iter().enumerate() {
                units[u].slot = Some(i);
            }
        }
        Ok(FsdpEngine {
            non_unit_params,
            non_unit_grads,
            non_unit_sole,
            non_unit_ready: None,
            scratch: Arc::new(backend.alloc_uninit(max_shard, DType::F32)?),
            plan,
            layout,
            shards,
            regions,
            param_slots,
            grad_slots,
            units,
            held,
            gathered,
            housed,
            clock: 0,
        })
    }

    pub fn sharding(&self) -> Sharding {
        self.layout.sharding
    }

    /// Where every bucket's pieces live.
    pub fn layout(&self) -> ShardLayout {
        self.layout
    }

    /// Per bucket id, the rank's shard state (for the optimizer and
    /// checkpoints).
    pub fn shards(&self) -> &[Arc<ShardState<D::Backend>>] {
        &self.shards
    }

    /// Ranks a bucket is sharded over under this engine's sharding.
    pub fn world_of(&self, bucket: &Bucket) -> usize {
        self.layout.group_size(&self.plan, bucket)
    }

    /// Where parameter `p` lives: which of its holder buffers, and where
    /// inside it.
    pub fn param_place(&self, p: usize) -> ParamPlace {
        let param = &self.plan.params[p];
        let start = self.regions[param.bucket].start + param.offset;
        let holder = match self.plan.buckets[param.bucket].unit {
            None => Holder::NonUnit,
            Some(_) if self.housed[param.bucket] => Holder::Held,
            Some(_) => Holder::Gathered,
        };
        ParamPlace {
            holder,
            range: start..start + self.plan.def(param).numel(),
        }
    }

    /// Starts a step: the optimizer changed every parameter, so pool
    /// buffers are stale (ZeRO-3) or refreshed from the master weights
    /// (`no_shard`); non-unit parameters are gathered and every gradient
    /// accumulator zeroed.
    pub fn begin_step(&mut self, rank: &RankContext<D>) -> Result<()> {
        for u in &mut self.units {
            u.ready = None;
            u.grad_ready = None;
            if self.layout.sharding == Sharding::Zero3 {
                u.slot = None;
            }
        }
        for slot in &mut self.param_slots {
            if self.layout.sharding == Sharding::Zero3 {
                slot.holder = None;
            }
        }
        // Zero the gradient accumulators: the shards with buffers of their
        // own, the units' held buffers and the non-unit buffer (which hold
        // the other shards').
        let own: Vec<_> = (0..self.shards.len())
            .filter(|&b| !self.housed[b])
            .map(|b| self.shards[b].clone())
            .collect();
        let mut whole: Vec<_> = self
            .held
            .iter()
            .flatten()
            .map(|h| h.grads.clone())
            .collect();
        whole.push(self.non_unit_grads.clone());
        let zeroed = rank.compute.submit(
            Label::new("zero gradients", "optimizer"),
            &[],
            Box::new(move |b: &D::Backend| {
                for shard in &own {
                    b.zero(shard.grad.view_mut(b)?)?;
                }
                for buf in &whole {
                    b.zero(b.view_mut(buf)?)?;
                }
                Ok(())
            }),
        );
        for held in self.held.iter_mut().flatten() {
            held.written = Some(zeroed.clone());
        }
        if self.layout.sharding == Sharding::NoShard {
            // Refresh every pooled unit's whole-bucket copy of its gathered
            // buckets from their shards (held buckets are read in place).
            for u in 0..self.units.len() {
                let Some(slot) = self.units[u].slot else {
                    continue;
                };
                let buckets = self.gathered[u].clone();
                let buf = self.param_slots[slot].buf.clone();
                let event = self.copy_params(rank, &buckets, buf, &zeroed, "refresh unit")?;
                self.units[u].ready = Some(event);
            }
        }
        let buckets: Vec<usize> = self.plan.non_unit_buckets().map(|b| b.id).collect();
        let params = self.non_unit_params.clone();
        self.non_unit_ready = Some(match self.layout.sharding {
            // Sole non-unit parameters are their shards, which the last
            // step's optimizer (done: steps end synchronised) refreshed.
            _ if self.non_unit_sole => zeroed,
            Sharding::Zero3 => self.gather(rank, &buckets, params, &[zeroed], "gather non-unit")?,
            Sharding::NoShard => {
                self.copy_params(rank, &buckets, params, &zeroed, "refresh non-unit")?
            }
        });
        Ok(())
    }

    /// The comm-lane work that all-gathers `buckets` into `dest` (at their
    /// regions), after `after`.
    fn gather(
        &self,
        rank: &RankContext<D>,
        buckets: &[usize],
        dest: Arc<Buf<D>>,
        after: &[EventOf<D>],
        what: &str,
    ) -> Result<EventOf<D>> {
        let jobs = self.bucket_jobs(rank, buckets);
        Ok(rank.comm.submit(
            Label::new(what.to_string(), "gather"),
            after,
            Box::new(move |b: &D::Backend| {
                for BucketJob {
                    shard,
                    region,
                    comm,
                } in &jobs
                {
                    comm.all_gather(shard.param.view(b)?, b.slice_mut(&dest, region.clone())?)?;
                }
                Ok(())
            }),
        ))
    }

    fn bucket_jobs(&self, rank: &RankContext<D>, buckets: &[usize]) -> Vec<BucketJob<D>> {
        buckets
            .iter()
            .map(|&b| BucketJob {
                shard: self.shards[b].clone(),
                region: self.regions[b].clone(),
                comm: if self.plan.buckets[b].expert {
                    rank.edp.clone()
                } else {
                    rank.dp.clone()
                },
            })
            .collect()
    }

    /// `no_shard`: copies whole buckets from their masters into `dest`.
    fn copy_params(
        &self,
        rank: &RankContext<D>,
        buckets: &[usize],
        dest: Arc<Buf<D>>,
        after: &EventOf<D>,
        what: &str,
    ) -> Result<EventOf<D>> {
        let jobs: Vec<_> = buckets
            .iter()
            .map(|&b| (self.shards[b].clone(), self.regions[b].clone()))
            .collect();
        Ok(rank.compute.submit(
            Label::new(what.to_string(), "gather"),
            std::slice::from_ref(after),
            Box::new(move |b: &D::Backend| {
                for (shard, region) in &jobs {
                    b.copy(shard.param.view(b)?, b.slice_mut(&dest, region.clone())?)?;
                }
                Ok(())
            }),
        ))
    }

    /// One more user of `unit`: gathers its gathered buckets into a free
    /// pool buffer unless they are still resident (a unit with none needs
    /// nothing).
    pub fn acquire(&mut self, unit: usize, rank: &RankContext<D>) -> Result<()> {
        self.units[unit].refs += 1;
        if self.units[unit].slot.is_some() || self.gathered[unit].is_empty() {
            return Ok(());
        }
        // Reuse the least recently released free buffer.
        let free =
            |s: &ParamSlot<D>, units: &[Residency<D>]| s.holder.is_none_or(|h| units[h].refs == 0);
        let slot = (0..self.param_slots.len())
            .filter(|&i| free(&self.param_slots[i], &self.units))
            .min_by_key(|&i| (self.param_slots[i].holder.is_some(), self.param_slots[i].released_at))
            .ok_or_else(|| {
                RuntimeError::InvalidArgument(format!(
                    "the unit pool ({} buffers) is exhausted gathering unit {unit}; the schedule's dry run should have sized it",
                    self.param_slots.len()
                ))
            })?;
        if let Some(previous) = self.param_slots[slot].holder.take() {
            self.units[previous].slot = None;
            self.units[previous].ready = None;
        }
        let after: Vec<_> = std::mem::take(&mut self.param_slots[slot].last_uses)
            .into_iter()
            .flatten()
            .collect();
        let buckets = self.gathered[unit].clone();
        let dest = self.param_slots[slot].buf.clone();
        let ready = self.gather(
            rank,
            &buckets,
            dest,
            &after,
            &format!("gather {}", self.plan.units[unit].name),
        )?;
        self.param_slots[slot].holder = Some(unit);
        self.units[unit].slot = Some(slot);
        self.units[unit].ready = Some(ready);
        Ok(())
    }

    /// One user of `unit` is done issuing work. The data stays until its
    /// buffer is needed for another unit.
    pub fn release(&mut self, unit: usize) {
        let u = &mut self.units[unit];
        u.refs = u.refs.saturating_sub(1);
        if u.refs == 0
            && let Some(slot) = u.slot
        {
            self.clock += 1;
            self.param_slots[slot].released_at = self.clock;
        }
    }

    /// Records work that read `unit`'s parameters, so the buffer is not
    /// overwritten before it ran.
    pub fn note_use(&mut self, unit: Option<usize>, lane: LaneKind, event: &EventOf<D>) {
        let Some(slot) = unit.and_then(|u| self.units[u].slot) else {
            return;
        };
        let index = match lane {
            LaneKind::Compute => 0,
            LaneKind::Comm => 1,
        };
        self.param_slots[slot].last_uses[index] = Some(event.clone());
    }

    /// A zeroed gradient buffer for `unit`'s gathered buckets, and its held
    /// buffer (the step's sum so far) once its last writer is done: ready
    /// when both are.
    pub fn grad_buffer(&mut self, unit: usize, rank: &RankContext<D>) -> Result<()> {
        let held_written = self.held[unit].as_ref().and_then(|h| h.written.clone());
        if self.gathered[unit].is_empty() {
            self.units[unit].grad_ready = held_written;
            return Ok(());
        }
        let slot = self
            .grad_slots
            .iter()
            .position(|s| !s.busy)
            .ok_or_else(|| {
                RuntimeError::InvalidArgument(format!(
                    "all {} gradient buffers are in use taking one for unit {unit}; the schedule's dry run should have sized them",
                    self.grad_slots.len()
                ))
            })?;
        let grad_slot = &mut self.grad_slots[slot];
        grad_slot.busy = true;
        // The zeroing waits for the held buffer's last writer too, so its
        // event covers both.
        let after: Vec<_> = grad_slot
            .free_after
            .take()
            .into_iter()
            .chain(held_written)
            .collect();
        let buf = grad_slot.buf.clone();
        let zeroed = rank.compute.submit(
            Label::new(
                format!("zero grads {}", self.plan.units[unit].name),
                "reduce",
            ),
            &after,
            Box::new(move |b: &D::Backend| b.zero(b.view_mut(&buf)?)),
        );
        self.units[unit].grad_slot = Some(slot);
        self.units[unit].grad_ready = Some(zeroed);
        Ok(())
    }

    /// Reduces `unit`'s gradients of one micro-batch into the owned shards
    /// of its gathered buckets (reduce-scatter, or all-reduce under
    /// `no_shard`, then `+=`), bucket by bucket in id order, after `after`;
    /// frees the gradient buffer. Its held buckets' gradients are in their
    /// shards already: `after` (the micro-batch's last work) becomes what
    /// the next backward waits for.
    pub fn reduce(
        &mut self,
        unit: usize,
        rank: &RankContext<D>,
        after: &[EventOf<D>],
    ) -> Result<()> {
        if let Some(held) = &mut self.held[unit] {
            match after {
                [] => {}
                [last] => held.written = Some(last.clone()),
                // One event that covers them all.
                many => {
                    let joined = rank.compute.submit(
                        Label::new("gradients written", "reduce"),
                        many,
                        Box::new(|_: &D::Backend| Ok(())),
                    );
                    held.written = Some(joined);
                }
            }
        }
        if self.gathered[unit].is_empty() {
            self.units[unit].grad_ready = None;
            return Ok(());
        }
        let slot = self.units[unit].grad_slot.take().ok_or_else(|| {
            RuntimeError::InvalidArgument(format!(
                "unit {unit} is reduced without a gradient buffer"
            ))
        })?;
        self.units[unit].grad_ready = None;
        let buckets = self.gathered[unit].clone();
        let event = self.reduce_into_shards(
            rank,
            &buckets,
            self.grad_slots[slot].buf.clone(),
            after,
            &format!("reduce {}", self.plan.units[unit].name),
        )?;
        let grad_slot = &mut self.grad_slots[slot];
        grad_slot.busy = false;
        grad_slot.free_after = Some(event);
        Ok(())
    }

    /// Ends a step's backward: reduces the non-unit gradients, accumulated
    /// over every micro-batch, into their shards (where they already are
    /// when the non-unit buckets are sole).
    pub fn reduce_non_unit(&mut self, rank: &RankContext<D>, after: &[EventOf<D>]) -> Result<()> {
        if self.non_unit_sole {
            return Ok(());
        }
        let buckets: Vec<usize> = self.plan.non_unit_buckets().map(|b| b.id).collect();
        self.reduce_into_shards(
            rank,
            &buckets,
            self.non_unit_grads.clone(),
            after,
            "reduce non-unit",
        )?;
        Ok(())
    }

    fn reduce_into_shards(
        &self,
        rank: &RankContext<D>,
        buckets: &[usize],
        source: Arc<Buf<D>>,
        after: &[EventOf<D>],
        what: &str,
    ) -> Result<EventOf<D>> {
        let jobs = self.bucket_jobs(rank, buckets);
        let scratch = self.scratch.clone();
        let sharding = self.layout.sharding;
        Ok(rank.comm.submit(
            Label::new(what.to_string(), "reduce"),
            after,
            Box::new(move |b: &D::Backend| {
                for BucketJob {
                    shard,
                    region,
                    comm,
                } in &jobs
                {
                    let len = shard.grad.len();
                    match sharding {
                        // One rank's reduce-scatter is a copy of its whole
                        // gradient: add it straight into the shard instead
                        // (the same values, one pass less over them).
                        Sharding::Zero3 if comm.size() == 1 && region.len() == len => {
                            b.axpy(
                                1.0,
                                b.slice(&source, region.clone())?,
                                shard.grad.view_mut(b)?,
                            )?;
                        }
                        Sharding::Zero3 => {
                            let src = b.slice(&source, region.clone())?;
                            comm.reduce_scatter(src, b.slice_mut(&scratch, 0..len)?)?;
                            b.axpy(1.0, b.slice(&scratch, 0..len)?, shard.grad.view_mut(b)?)?;
                        }
                        Sharding::NoShard => {
                            comm.all_reduce(b.slice_mut(&source, region.clone())?)?;
                            let summed = b.slice(&source, region.clone())?;
                            b.axpy(1.0, summed, shard.grad.view_mut(b)?)?;
                        }
                    }
                }
                Ok(())
            }),
        ))
    }

    /// The non-unit parameters, gathered for this step.
    pub fn non_unit_params(&self) -> ParamAccess<D> {
        BufferAccess {
            buf: self.non_unit_params.clone(),
            ready: self.non_unit_ready.clone(),
        }
    }

    /// The non-unit gradient buffer, accumulated over the whole step.
    pub fn non_unit_grads(&self) -> GradAccess<D> {
        BufferAccess {
            buf: self.non_unit_grads.clone(),
            ready: None,
        }
    }

    /// The parameters `unit`'s work reads.
    pub fn unit_params(&self, unit: usize) -> Result<BufferAccess<D, UnitBuffers<D>>> {
        let gathered = self.unit_slot(
            unit,
            self.units[unit].slot,
            "is used without being acquired",
        )?;
        Ok(BufferAccess {
            buf: UnitBuffers {
                gathered: gathered.map(|slot| self.param_slots[slot].buf.clone()),
                held: self.held[unit].as_ref().map(|h| h.params.clone()),
            },
            // A unit with nothing to gather never has a gather to wait for.
            ready: self.units[unit].ready.clone(),
        })
    }

    /// The gradient buffers `unit`'s backward accumulates into.
    pub fn unit_grads(&self, unit: usize) -> Result<BufferAccess<D, UnitBuffers<D>>> {
        let gathered = self.unit_slot(
            unit,
            self.units[unit].grad_slot,
            "runs backward without a gradient buffer",
        )?;
        Ok(BufferAccess {
            buf: UnitBuffers {
                gathered: gathered.map(|slot| self.grad_slots[slot].buf.clone()),
                held: self.held[unit].as_ref().map(|h| h.grads.clone()),
            },
            ready: self.units[unit].grad_ready.clone(),
        })
    }

    /// `unit`'s pool slot (`slot`, of parameters or gradients) when it has
    /// gathered buckets: an error saying it `missing` when it has none.
    fn unit_slot(&self, unit: usize, slot: Option<usize>, missing: &str) -> Result<Option<usize>> {
        if self.gathered[unit].is_empty() {
            return Ok(None);
        }
        slot.map(Some).ok_or_else(|| {
            RuntimeError::InvalidArgument(format!(
                "unit {unit} ({}) {missing}",
                self.plan.units[unit].name
            ))
        })
    }

    /// The elements of bucket `b` this rank owns, in bucket coordinates.
    pub fn owned_range(&self, b: usize, rank: &RankContext<D>) -> Range<usize> {
        self.layout
            .owned_range(&self.plan, &self.plan.buckets[b], rank.rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybridgen_dsl::{ModelConfig, ParallelLayout, PlanOptions};

    /// For every sharding and layout: each copy of a bucket is made of its
    /// holders' pieces, which tile `[0, padded)` in order, and every rank
    /// holds exactly one piece of every copy it belongs to.
    #[test]
    fn holders_pieces_tile_every_bucket() {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = "M[*E]-".into();
        for (world, ep) in [(1, 1), (2, 1), (2, 2), (4, 2), (8, 4)] {
            let options = PlanOptions {
                layout: ParallelLayout::new(world, ep),
                ..PlanOptions::default()
            };
            let plan = Plan::new(&model, &options).unwrap();
            for sharding in [Sharding::NoShard, Sharding::Zero3] {
                let layout = ShardLayout {
                    sharding,
                    world,
                    ep,
                };
                for bucket in plan.buckets.iter() {
                    let padded = bucket.padded_numel(layout.group_size(&plan, bucket));
                    let copies = if bucket.expert { ep } else { 1 };
                    for e in 0..copies {
                        let mut at = 0;
                        for r in layout.holders(bucket.expert, e) {
                            if bucket.expert {
                                assert_eq!(r % ep, e, "rank {r} holds EP rank {e}'s experts");
                            }
                            let piece = layout.owned_range(&plan, bucket, r);
                            assert_eq!(
                                piece.start, at,
                                "{sharding:?} world {world} ep {ep} bucket {}",
                                bucket.id
                            );
                            at = piece.end;
                        }
                        assert_eq!(at, padded);
                    }
                }
            }
        }
    }

    /// The tiny model as `M[*E]-` on two CPU thread ranks with expert
    /// parallelism `ep`: its plan, the ranks' settings and their platform.
    fn two_ranks(
        ep: usize,
    ) -> (
        Arc<Plan>,
        crate::platform::RankSettings,
        crate::platform::CpuPlatform,
    ) {
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = "M[*E]-".into();
        let options = PlanOptions {
            layout: ParallelLayout::new(2, ep),
            ..PlanOptions::default()
        };
        let plan = Arc::new(Plan::new(&model, &options).unwrap());
        let settings = crate::platform::RankSettings {
            ep,
            ..crate::platform::RankSettings::for_tests()
        };
        let platform = crate::platform::CpuPlatform::new(2, settings.timeout).unwrap();
        (plan, settings, platform)
    }

    /// Parameters are drawn on a thread of their own, a bucket ahead of
    /// their placement: an initialiser that fails on a bucket past the
    /// first ends the engine's construction with its error (the drawing
    /// thread stops, nothing waits on it), and no bucket after it is drawn.
    #[test]
    fn a_failing_initialiser_ends_the_engine_with_its_error() {
        use crate::device::Cpu;
        use crate::platform::Platform;

        let mut model = ModelConfig::preset("tiny").unwrap();
        model.pattern = "M[*E]-".into();
        let plan = Arc::new(Plan::new(&model, &PlanOptions::default()).unwrap());
        let settings = crate::platform::RankSettings::for_tests();
        let platform = crate::platform::CpuPlatform::new(1, settings.timeout).unwrap();
        let failing = plan.params[plan.buckets[1].params[0]].bucket;
        assert!(failing > 0 && failing + 1 < plan.buckets.len());
        let rank = platform.rank(0, &settings).unwrap();
        let latest = std::sync::atomic::AtomicUsize::new(0);
        let init = |p: usize, _: Range<usize>, out: &mut [f32]| {
            let bucket = plan.params[p].bucket;
            latest.fetch_max(bucket, std::sync::atomic::Ordering::Relaxed);
            if bucket == failing {
                return Err(RuntimeError::InvalidArgument(format!("no values for {p}")));
            }
            out.fill(1.0);
            Ok(())
        };
        let built = FsdpEngine::<Cpu>::new(plan.clone(), Sharding::Zero3, &rank, 2, 1, &init);
        let error = built.err().expect("the initialiser's error");
        assert!(error.to_string().contains("no values for"), "{error}");
        assert_eq!(latest.into_inner(), failing);
    }

    /// Under EP 2 on two ZeRO-3 ranks the `[*E]` unit mixes sharded
    /// buckets (attention, the MoE layer's norm and router) with held ones
    /// (each rank's own experts): acquiring it gathers only the former into
    /// a pool buffer sized for them, the experts are read where their
    /// shards are, and every parameter of the unit reads its whole values
    /// at the place the engine gives the layers.
    #[test]
    fn a_mixed_unit_gathers_its_sharded_buckets_and_reads_its_held_ones_in_place() {
        use crate::device::Cpu;
        use crate::lane::Lane;
        use crate::platform::Platform;

        let (plan, settings, platform) = two_ranks(2);
        let unit = plan
            .units
            .iter()
            .position(|u| u.buckets.iter().any(|&b| plan.buckets[b].expert));
        let unit = unit.expect("the [*E] unit");
        let numel = |p: usize| plan.def(&plan.params[p]).numel();
        // Parameter p's element i, on EP rank e (experts differ per rank).
        let value = |p: usize, e: usize, i: usize| {
            let expert = plan.buckets[plan.params[p].bucket].expert;
            p as f32 + i as f32 / numel(p) as f32 + if expert { 1000.0 * e as f32 } else { 0.0 }
        };
        std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..2)
                .map(|r| {
                    let (platform, settings, plan) = (&platform, &settings, &plan);
                    scope.spawn(move || {
                        let rank = platform.rank(r, settings).unwrap();
                        let e = r % 2;
                        let init = |p: usize, range: Range<usize>, out: &mut [f32]| {
                            for (v, i) in out.iter_mut().zip(range) {
                                *v = value(p, e, i);
                            }
                            Ok(())
                        };
                        let mut engine: FsdpEngine<Cpu> =
                            FsdpEngine::new(plan.clone(), Sharding::Zero3, &rank, 2, 1, &init)
                                .unwrap();
                        let buckets = &plan.units[unit].buckets;
                        let gathered = &engine.gathered[unit];
                        assert!(!gathered.is_empty() && gathered.len() < buckets.len());
                        for &b in buckets.iter() {
                            assert_eq!(
                                gathered.contains(&b),
                                !plan.buckets[b].expert,
                                "bucket {b}"
                            );
                            assert_eq!(engine.housed[b], plan.buckets[b].expert, "bucket {b}");
                        }
                        // The pool holds the gathered buckets only.
                        let gathered_len: usize =
                            gathered.iter().map(|&b| engine.regions[b].len()).sum();
                        let backend = &rank.backend;
                        let slot_len = backend.buf_len(&engine.param_slots[0].buf);
                        assert!(slot_len >= gathered_len, "{slot_len} < {gathered_len}");
                        let unit_len: usize =
                            buckets.iter().map(|&b| engine.regions[b].len()).sum();
                        assert!(slot_len < unit_len, "the pool has room for held buckets");

                        engine.begin_step(&rank).unwrap();
                        engine.acquire(unit, &rank).unwrap();
                        let access = engine.unit_params(unit).unwrap();
                        rank.compute.synchronize().unwrap();
                        rank.comm.synchronize().unwrap();
                        let (pool, held) = (access.buf.gathered.unwrap(), access.buf.held.unwrap());
                        for &b in buckets.iter() {
                            for &p in plan.buckets[b].params.iter() {
                                let place = engine.param_place(p);
                                let buf = match place.holder {
                                    Holder::Gathered => &pool,
                                    Holder::Held => &held,
                                    Holder::NonUnit => panic!("parameter {p} is in a unit"),
                                };
                                let mut got = vec![0.0f32; place.range.len()];
                                backend
                                    .download(
                                        backend.slice(buf, place.range.clone()).unwrap(),
                                        &mut got,
                                    )
                                    .unwrap();
                                let want: Vec<f32> =
                                    (0..numel(p)).map(|i| value(p, e, i)).collect();
                                assert_eq!(
                                    got, want,
                                    "rank {r}, parameter {p} ({:?})",
                                    place.holder
                                );
                            }
                        }
                        engine.release(unit);
                    })
                })
                .collect();
            for rank in ranks {
                rank.join().unwrap();
            }
        });
    }

    /// Each ZeRO-3 rank of two draws only the elements of its shards (the
    /// two together draw each element once), and its master shards hold
    /// what the whole parameters hold there: index `i` of a parameter is
    /// given the value `p + i / numel`, which names both.
    #[test]
    fn a_rank_fills_only_its_shards_with_the_whole_parameters_values() {
        use crate::device::Cpu;
        use crate::platform::Platform;
        use std::sync::Mutex;

        let (plan, settings, platform) = two_ranks(1);
        let numel = |p: usize| plan.def(&plan.params[p]).numel();
        let value = |p: usize, i: usize| p as f32 + i as f32 / numel(p) as f32;
        // Ranks join their communicators together: one thread each.
        let drawn_by_rank: Vec<usize> = std::thread::scope(|scope| {
            let ranks: Vec<_> = (0..2)
                .map(|r| {
                    let (platform, settings, plan) = (&platform, &settings, &plan);
                    scope.spawn(move || {
                        let rank = platform.rank(r, settings).unwrap();
                        let drawn = Mutex::new(0usize);
                        let init = |p: usize, range: Range<usize>, out: &mut [f32]| {
                            *drawn.lock().unwrap() += out.len();
                            for (v, i) in out.iter_mut().zip(range) {
                                *v = value(p, i);
                            }
                            Ok(())
                        };
                        let engine: FsdpEngine<Cpu> =
                            FsdpEngine::new(plan.clone(), Sharding::Zero3, &rank, 2, 1, &init)
                                .unwrap();
                        for b in plan.buckets.iter() {
                            let shard = &engine.shards()[b.id];
                            let owned = engine.layout.owned_range(plan, b, r);
                            let mut got = vec![0.0f32; owned.len()];
                            let backend = &rank.backend;
                            backend
                                .download(backend.view(&shard.master).unwrap(), &mut got)
                                .unwrap();
                            // What the whole bucket holds over this rank's piece.
                            let mut want = vec![0.0f32; owned.len()];
                            for &p in b.params.iter() {
                                let offset = plan.params[p].offset;
                                for i in 0..numel(p) {
                                    if owned.contains(&(offset + i)) {
                                        want[offset + i - owned.start] = value(p, i);
                                    }
                                }
                            }
                            assert_eq!(got, want, "rank {r}, bucket {}", b.id);
                        }
                        drawn.into_inner().unwrap()
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let total: usize = (0..plan.params.len()).map(numel).sum();
        assert_eq!(drawn_by_rank.iter().sum::<usize>(), total);
        assert!(
            drawn_by_rank.iter().all(|&d| d < total),
            "{drawn_by_rank:?}"
        );
    }
}
