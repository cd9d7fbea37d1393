//! The engine on CPU thread ranks.

use super::*;
use crate::backend::Backend;
use hybridgen_dsl::{ModelConfig, ParallelLayout, PlanOptions};

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
                        FsdpEngine::new(plan.clone(), Sharding::Zero3, &rank, 2, 1, &init).unwrap();
                    let buckets = &plan.units[unit].buckets;
                    let gathered = &engine.gathered[unit];
                    assert!(!gathered.is_empty() && gathered.len() < buckets.len());
                    for &b in buckets.iter() {
                        assert_eq!(gathered.contains(&b), !plan.buckets[b].expert, "bucket {b}");
                        assert_eq!(engine.housed[b], plan.buckets[b].expert, "bucket {b}");
                    }
                    // The pool holds the gathered buckets only.
                    let gathered_len: usize =
                        gathered.iter().map(|&b| engine.regions[b].len()).sum();
                    let backend = &rank.backend;
                    let slot_len = backend.buf_len(&engine.param_slots[0].buf);
                    assert!(slot_len >= gathered_len, "{slot_len} < {gathered_len}");
                    let unit_len: usize = buckets.iter().map(|&b| engine.regions[b].len()).sum();
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
                            let want: Vec<f32> = (0..numel(p)).map(|i| value(p, e, i)).collect();
                            assert_eq!(got, want, "rank {r}, parameter {p} ({:?})", place.holder);
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
                        FsdpEngine::new(plan.clone(), Sharding::Zero3, &rank, 2, 1, &init).unwrap();
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
