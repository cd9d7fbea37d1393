//! Launchers of `kernels/attention.cu`: causal attention with grouped KV
//! heads, forward (`attention_forward`) and backward (`attention_backward_dq`
//! then `attention_backward_dkdv`).
//!
//! The kernels are tiled the flash-attention way (a block per 64-query or
//! 32-key tile per head, scores only in registers and shared memory) and
//! take no scratch memory: the backward recomputes the probabilities from
//! `lse` and `D_t = dout_t . out_t` where it needs them. Their grids depend on
//! the dimensions alone, so every sum has one order and the same inputs give
//! the same bits.

use super::{GpuView, KernelSet, as_u32, ensure, exactly, float, len, product};
use crate::backend::{AttentionDims, AttentionInputs};
use crate::error::{Result, RuntimeError};
use crate::view::DType;
use cudarc::driver::{CudaStream, LaunchArgs, LaunchConfig, PushKernelArg};

/// Threads of every attention block (`ATT_THREADS`).
const THREADS: u32 = 256;
/// Query rows of a forward or dq block (`TILE`).
const QUERY_TILE: usize = 64;
/// Key rows of a dk/dv block (`KEYS_DKDV`).
const KEY_TILE: usize = 32;
/// Head channels of one block (`COLS`); a larger head dim takes more blocks.
const CHANNEL_GROUP: usize = 256;
/// A CUDA grid's limits along x and along y.
const MAX_GRID_X: usize = i32::MAX as usize;
const MAX_GRID_Y: usize = 65_535;

/// The dimensions as the kernels take them, checked to fit their u32
/// arithmetic.
struct KernelDims {
    batch: u32,
    seq: u32,
    heads: u32,
    kv_heads: u32,
    qk_dim: u32,
    v_dim: u32,
    scale: f32,
}

impl KernelDims {
    fn new(kernel: &str, d: AttentionDims) -> Result<KernelDims> {
        // Tile starts run to `seq` plus a tile in u32.
        ensure(d.tokens.seq <= i32::MAX as usize, || {
            format!(
                "{kernel}: sequences of {} tokens exceed the CUDA kernels' {} tokens",
                d.tokens.seq,
                i32::MAX
            )
        })?;
        Ok(KernelDims {
            batch: as_u32(kernel, "batch", d.tokens.batch)?,
            seq: as_u32(kernel, "sequence length", d.tokens.seq)?,
            heads: as_u32(kernel, "heads", d.heads)?,
            kv_heads: as_u32(kernel, "KV heads", d.kv_heads)?,
            qk_dim: as_u32(kernel, "qk dim", d.qk_dim)?,
            v_dim: as_u32(kernel, "v dim", d.v_dim)?,
            scale: d.scale,
        })
    }

    /// Pushes `batch, seq, heads, kv_heads, qk_dim, v_dim, scale` (the tail
    /// of every attention kernel's arguments).
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.batch)
            .arg(&self.seq)
            .arg(&self.heads)
            .arg(&self.kv_heads)
            .arg(&self.qk_dim)
            .arg(&self.v_dim)
            .arg(&self.scale);
    }
}

/// A grid of `tiles` tiles for each of `pairs` (sequence, head) pairs along
/// x, and `channel_groups` groups of head channels along y (at least one).
fn tile_grid(kernel: &str, tiles: usize, pairs: usize, channels: usize) -> Result<LaunchConfig> {
    let blocks = tiles.checked_mul(pairs).filter(|&b| b <= MAX_GRID_X);
    let groups = channels.div_ceil(CHANNEL_GROUP).max(1);
    match blocks {
        Some(blocks) if groups <= MAX_GRID_Y => Ok(LaunchConfig {
            grid_dim: (blocks as u32, groups as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }),
        _ => Err(RuntimeError::Unsupported(format!(
            "{kernel}: {tiles} tiles x {pairs} (sequence, head) pairs x {groups} channel groups \
             exceed a CUDA grid"
        ))),
    }
}

/// The CPU backend's checks of q, k and v; returns the rows.
fn validate(
    kernel: &str,
    d: AttentionDims,
    q: &GpuView,
    k: &GpuView,
    v: &GpuView,
) -> Result<usize> {
    let rows = d.tokens.rows()?;
    ensure(d.kv_heads > 0 && d.heads.is_multiple_of(d.kv_heads), || {
        format!(
            "{kernel}: {} KV heads do not divide {} heads",
            d.kv_heads, d.heads
        )
    })?;
    len(kernel, "q", q, product(kernel, &[rows, d.heads, d.qk_dim])?)?;
    len(
        kernel,
        "k",
        k,
        product(kernel, &[rows, d.kv_heads, d.qk_dim])?,
    )?;
    len(
        kernel,
        "v",
        v,
        product(kernel, &[rows, d.kv_heads, d.v_dim])?,
    )?;
    product(kernel, &[rows, d.heads, d.v_dim])?;
    Ok(rows)
}

impl KernelSet {
    /// `Backend::attention_forward`: `out` (the dtype of the activations)
    /// and the f32 log-sum-exp of each (row, head) in `lse`.
    pub fn attention_forward(
        &self,
        stream: &CudaStream,
        inputs: AttentionInputs<GpuView>,
        out: GpuView,
        lse: GpuView,
        dims: AttentionDims,
    ) -> Result<()> {
        let kn = "attention_forward";
        let AttentionInputs { q, k, v } = inputs;
        let (qt, kt, vt) = (
            float(kn, "q", &q)?,
            float(kn, "k", &k)?,
            float(kn, "v", &v)?,
        );
        exactly(kn, "lse", &lse, DType::F32)?;
        let ot = float(kn, "out", &out)?;
        let rows = validate(kn, dims, &q, &k, &v)?;
        len(
            kn,
            "out",
            &out,
            product(kn, &[rows, dims.heads, dims.v_dim])?,
        )?;
        len(kn, "lse", &lse, product(kn, &[rows, dims.heads])?)?;
        if rows == 0 || dims.heads == 0 {
            return Ok(());
        }
        let shape = KernelDims::new(kn, dims)?;
        let config = tile_grid(
            kn,
            dims.tokens.seq.div_ceil(QUERY_TILE),
            dims.tokens.batch * dims.heads,
            dims.v_dim,
        )?;
        let mut b = stream.launch_builder(self.function(kn)?);
        b.arg(&q.ptr)
            .arg(&qt)
            .arg(&k.ptr)
            .arg(&kt)
            .arg(&v.ptr)
            .arg(&vt);
        b.arg(&out.ptr).arg(&ot).arg(&lse.ptr);
        shape.push(&mut b);
        self.go(kn, &mut b, config)
    }

    /// `Backend::attention_backward`: overwrites `grads.q`, `grads.k` and
    /// `grads.v`. Two kernels: dq by query tiles, then dk and dv by key
    /// tiles, each key tile summing over the query tiles and the group's
    /// query heads in a fixed order.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &self,
        stream: &CudaStream,
        inputs: AttentionInputs<GpuView>,
        out: GpuView,
        lse: GpuView,
        dout: GpuView,
        grads: AttentionInputs<GpuView>,
        dims: AttentionDims,
    ) -> Result<()> {
        let kn = "attention_backward";
        let AttentionInputs { q, k, v } = inputs;
        let (qt, kt, vt) = (
            float(kn, "q", &q)?,
            float(kn, "k", &k)?,
            float(kn, "v", &v)?,
        );
        let (ot, gt) = (float(kn, "out", &out)?, float(kn, "dout", &dout)?);
        exactly(kn, "lse", &lse, DType::F32)?;
        let AttentionInputs {
            q: dq,
            k: dk,
            v: dv,
        } = grads;
        let (dqt, dkt, dvt) = (
            float(kn, "dq", &dq)?,
            float(kn, "dk", &dk)?,
            float(kn, "dv", &dv)?,
        );
        let rows = validate(kn, dims, &q, &k, &v)?;
        len(
            kn,
            "out",
            &out,
            product(kn, &[rows, dims.heads, dims.v_dim])?,
        )?;
        len(kn, "dout", &dout, out.len)?;
        len(kn, "lse", &lse, product(kn, &[rows, dims.heads])?)?;
        len(kn, "grads.q", &dq, q.len)?;
        len(kn, "grads.k", &dk, k.len)?;
        len(kn, "grads.v", &dv, v.len)?;
        if rows == 0 || dims.heads == 0 {
            return Ok(());
        }
        let shape = KernelDims::new(kn, dims)?;
        let pairs = dims.tokens.batch * dims.heads;
        if dq.len > 0 {
            let k_dq = "attention_backward_dq";
            let config = tile_grid(kn, dims.tokens.seq.div_ceil(QUERY_TILE), pairs, dims.qk_dim)?;
            let mut b = stream.launch_builder(self.function(k_dq)?);
            b.arg(&q.ptr)
                .arg(&qt)
                .arg(&k.ptr)
                .arg(&kt)
                .arg(&v.ptr)
                .arg(&vt);
            b.arg(&out.ptr)
                .arg(&ot)
                .arg(&lse.ptr)
                .arg(&dout.ptr)
                .arg(&gt);
            b.arg(&dq.ptr).arg(&dqt);
            shape.push(&mut b);
            self.go(k_dq, &mut b, config)?;
        }
        if dk.len > 0 || dv.len > 0 {
            let k_dkdv = "attention_backward_dkdv";
            let config = tile_grid(
                kn,
                dims.tokens.seq.div_ceil(KEY_TILE),
                dims.tokens.batch * dims.kv_heads,
                dims.qk_dim.max(dims.v_dim),
            )?;
            let mut b = stream.launch_builder(self.function(k_dkdv)?);
            b.arg(&q.ptr)
                .arg(&qt)
                .arg(&k.ptr)
                .arg(&kt)
                .arg(&v.ptr)
                .arg(&vt);
            b.arg(&out.ptr)
                .arg(&ot)
                .arg(&lse.ptr)
                .arg(&dout.ptr)
                .arg(&gt);
            b.arg(&dk.ptr).arg(&dkt).arg(&dv.ptr).arg(&dvt);
            shape.push(&mut b);
            self.go(k_dkdv, &mut b, config)?;
        }
        Ok(())
    }
}
