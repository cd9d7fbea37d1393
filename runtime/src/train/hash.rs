//! The run's closing parameter hash: every final parameter's bits, the
//! same on every rank and under every layout.

use crate::backend::Backend;
use crate::collective::Collective;
use crate::device::{Device, RankContext};
use crate::error::{Result, RuntimeError};
use crate::fsdp::FsdpEngine;
use hybridgen_dsl::Plan;

/// Every rank's `shard` (f32), by rank, on every rank, into `all` (one
/// vector a rank, reused from bucket to bucket so the host pages are
/// touched once). Shards of one length everywhere (every bucket of the
/// planner's layouts) are gathered on the device and downloaded once; the
/// host exchange's f64 copies they replace took 25 s for the 0.9 B
/// parameters of the benchmark model on two ranks. Shards of different
/// lengths go through the host.
fn every_ranks_shard<D: Device>(
    rank: &RankContext<D>,
    shard: &<D::Backend as Backend>::Buf,
    all: &mut Vec<Vec<f32>>,
) -> Result<()> {
    let backend = &*rank.backend;
    let len = backend.buf_len(shard);
    let n = rank.host.size();
    all.resize_with(n, Vec::new);
    if n == 1 {
        all[0].resize(len, 0.0);
        return backend.download(backend.view(shard)?, &mut all[0]);
    }
    let lengths = rank.host.all_gather_host(&[len as f64])?;
    if lengths.iter().all(|l| l.first() == Some(&(len as f64))) {
        let full = backend.alloc(n * len, crate::view::DType::F32)?;
        rank.host
            .all_gather(backend.view(shard)?, backend.view_mut(&full)?)?;
        for (r, host) in all.iter_mut().enumerate() {
            host.resize(len, 0.0);
            let theirs = backend.view(&full)?.slice(r * len..(r + 1) * len)?;
            backend.download(theirs, host)?;
        }
        return Ok(());
    }
    let mut mine = vec![0.0f32; len];
    backend.download(backend.view(shard)?, &mut mine)?;
    let mine: Vec<f64> = mine.iter().map(|&v| f64::from(v)).collect();
    // f32 -> f64 -> f32 is exact.
    for (host, theirs) in all.iter_mut().zip(rank.host.all_gather_host(&mine)?) {
        host.clear();
        host.extend(theirs.iter().map(|&x| x as f32));
    }
    Ok(())
}

/// The digest ([`crate::digest`]) of every parameter's bits in plan order,
/// experts once per EP rank. Collective; every rank returns it (so does
/// every process of a multi-process job). Buckets are gathered one at a
/// time, so the hash needs the memory of one bucket, not of the model, and
/// each bucket's parameters are hashed in one go, straight from the
/// downloaded shards.
pub(super) fn param_hash<D: Device>(
    plan: &Plan,
    engine: &FsdpEngine<D>,
    rank: &RankContext<D>,
) -> Result<u64> {
    let ep = plan.layout.ep;
    let layout = engine.layout();
    let mut digest = crate::digest::StreamDigest::new();
    // Every rank's shard of the bucket in hand, by rank.
    let mut all: Vec<Vec<f32>> = Vec::new();
    // The pipeline rank that hashes a bucket: its first stage's (the
    // shared embedding is hashed once).
    let hasher = |b: usize| plan.bucket_owner(&plan.buckets[b]);
    let mut turn = hasher(plan.params.first().map_or(0, |p| p.bucket));
    // The plan's parameters in runs of one bucket each.
    for params in plan.params.chunk_by(|a, b| a.bucket == b.bucket) {
        let b = params[0].bucket;
        // The stages take turns in plan order, each going on from the
        // digest the one before left.
        if hasher(b) != turn {
            digest = hand_over(rank, digest, turn)?;
            turn = hasher(b);
        }
        if turn != rank.pp_rank {
            continue;
        }
        every_ranks_shard(rank, &engine.shards()[b].master, &mut all)?;
        let bucket = &plan.buckets[b];
        let piece = bucket.shard_numel(engine.world_of(bucket)).max(1);
        let mut runs: Vec<&[f32]> = Vec::new();
        for param in params {
            let numel = plan.def(param).numel();
            let copies = if bucket.expert { ep } else { 1 };
            for e in 0..copies {
                // The whole bucket as EP rank `e` holds it is its holders'
                // pieces one after another: the parameter is a run of
                // slices of them (a per-element lookup took 18 s for the
                // 0.9 B parameters of the benchmark model).
                let holders = layout.holders(bucket.expert, e);
                let (mut i, end) = (param.offset, param.offset + numel);
                while i < end {
                    let (j, at) = (i / piece, i % piece);
                    let n = (piece - at).min(end - i);
                    let values = holders
                        .get(j)
                        .and_then(|&r| all.get(r))
                        .and_then(|v| v.get(at..at + n))
                        .ok_or_else(|| RuntimeError::Peer {
                            rank: holders.get(j).copied().unwrap_or(0),
                            message: "sent a parameter shard of the wrong length for the hash"
                                .into(),
                        })?;
                    runs.push(values);
                    i += n;
                }
            }
        }
        digest.extend(&runs);
    }
    Ok(hand_over(rank, digest, turn)?.finish())
}

/// The digest as pipeline rank `from` left it, on every rank (collective
/// over the rank's pipeline group; without a pipeline, `digest` itself).
fn hand_over<D: Device>(
    rank: &RankContext<D>,
    digest: crate::digest::StreamDigest,
    from: usize,
) -> Result<crate::digest::StreamDigest> {
    if rank.pp == 1 {
        return Ok(digest);
    }
    let mine = if rank.pp_rank == from {
        digest.state()
    } else {
        Vec::new()
    };
    let all = rank.pipe_host.all_gather_host(&mine)?;
    all.get(from)
        .and_then(|state| crate::digest::StreamDigest::resume(state))
        .ok_or_else(|| RuntimeError::Peer {
            rank: from,
            message: "sent no parameter digest to go on from".into(),
        })
}
