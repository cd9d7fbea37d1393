//! The engine's construction: a rank's shards, the unit pool and the
//! non-unit buffers, and the master weights filled from the initialiser.

use super::buffers::{GradSlot, HeldBuckets, ParamSlot, Residency, ShardPart, ShardState};
use super::{FsdpEngine, InitParams, ShardLayout, Sharding};
use crate::backend::Backend;
use crate::device::{Device, RankContext};
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use hybridgen_dsl::Plan;
use hybridgen_dsl::plan::Bucket;
use std::sync::Arc;

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
        // Under pipeline parallelism a rank holds its stages' buckets only;
        // the others get empty shards and no room anywhere.
        let holds: Vec<bool> = plan
            .buckets
            .iter()
            .map(|b| plan.holds(rank.pp_rank, b))
            .collect();

        // Regions: a unit's gathered buckets back to back inside its pool
        // buffer, its held buckets back to back inside its held buffers,
        // non-unit buckets back to back inside the non-unit buffer.
        let mut regions = vec![0..0; plan.buckets.len()];
        let mut gathered_len = vec![0usize; plan.units.len()];
        let mut held_len = vec![0usize; plan.units.len()];
        let mut gathered = vec![Vec::new(); plan.units.len()];
        let mut non_unit_len = 0usize;
        for b in plan.buckets.iter().filter(|b| holds[b.id]) {
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
        let non_unit_sole = plan
            .non_unit_buckets()
            .filter(|b| holds[b.id])
            .all(|b| layout.sole(&plan, b));
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
            if !holds[b.id] {
                return Ok(Vec::new());
            }
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
                _ if !holds[b.id] => None,
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
            holds,
            clock: 0,
        })
    }
}
