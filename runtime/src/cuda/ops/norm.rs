//! The norm and activation kernels on a GPU: [`NormKernels`] for
//! [`CudaBackend`], and their launchers on [`KernelSet`] (`rmsnorm.cu`,
//! `activation.cu`). The launchers take views `backend::norm`'s checks
//! accepted.

use crate::backend::{NormDims, NormKernels, Unary};
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{
    GpuView, KernelSet, bf16_words, column_blocks, dtype_tag, grid_for, per_item, reduce_threads,
    warp_per_item, words8,
};
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::Result;
use crate::view::{View, ViewMut};
use cudarc::driver::{CudaStream, LaunchConfig};

impl NormKernels<CudaBuf> for CudaBackend {
    fn rmsnorm_forward_unchecked(
        &self,
        x: View<'_, CudaBuf>,
        weight: View<'_, CudaBuf>,
        y: ViewMut<'_, CudaBuf>,
        rstd: ViewMut<'_, CudaBuf>,
        x_copy: Option<ViewMut<'_, CudaBuf>>,
        dims: NormDims,
    ) -> Result<()> {
        self.k().rmsnorm_forward(
            self.s(),
            self.v(x),
            self.v(weight),
            self.m(&y),
            self.m(&rstd),
            x_copy.map(|copy| self.m(&copy)),
            dims,
        )
    }

    fn rmsnorm_backward_input_unchecked(
        &self,
        dy: View<'_, CudaBuf>,
        x: View<'_, CudaBuf>,
        weight: View<'_, CudaBuf>,
        rstd: View<'_, CudaBuf>,
        dx: ViewMut<'_, CudaBuf>,
        dx_before: Option<ViewMut<'_, CudaBuf>>,
        partials: ViewMut<'_, CudaBuf>,
        dims: NormDims,
    ) -> Result<()> {
        self.k().rmsnorm_backward_input(
            self.s(),
            self.v(dy),
            self.v(x),
            self.v(weight),
            self.v(rstd),
            self.m(&dx),
            dx_before.map(|before| self.m(&before)),
            self.m(&partials),
            dims,
        )
    }

    fn rmsnorm_backward_weight_unchecked(
        &self,
        partials: View<'_, CudaBuf>,
        dw: ViewMut<'_, CudaBuf>,
        dims: NormDims,
    ) -> Result<()> {
        self.k()
            .rmsnorm_backward_weight(self.s(), self.v(partials), self.m(&dw), dims)
    }

    fn unary_forward_unchecked(
        &self,
        op: Unary,
        x: View<'_, CudaBuf>,
        y: ViewMut<'_, CudaBuf>,
    ) -> Result<()> {
        self.k().unary_forward(self.s(), op, self.v(x), self.m(&y))
    }

    fn unary_backward_unchecked(
        &self,
        op: Unary,
        x: View<'_, CudaBuf>,
        dy: View<'_, CudaBuf>,
        dx: ViewMut<'_, CudaBuf>,
    ) -> Result<()> {
        self.k()
            .unary_backward(self.s(), op, self.v(x), self.v(dy), self.m(&dx), None)
    }

    fn unary_backward_recompute_unchecked(
        &self,
        op: Unary,
        x: View<'_, CudaBuf>,
        dy_then_y: ViewMut<'_, CudaBuf>,
        dx: ViewMut<'_, CudaBuf>,
    ) -> Result<()> {
        let dy = self.m(&dy_then_y);
        self.k()
            .unary_backward(self.s(), op, self.v(x), dy, self.m(&dx), Some(dy))
    }

    fn silu_mul_forward_unchecked(
        &self,
        gate: View<'_, CudaBuf>,
        up: View<'_, CudaBuf>,
        y: ViewMut<'_, CudaBuf>,
    ) -> Result<()> {
        self.k()
            .silu_mul_forward(self.s(), self.v(gate), self.v(up), self.m(&y))
    }

    fn silu_mul_backward_unchecked(
        &self,
        gate: View<'_, CudaBuf>,
        up: View<'_, CudaBuf>,
        dy: View<'_, CudaBuf>,
        dgate: ViewMut<'_, CudaBuf>,
        dup: ViewMut<'_, CudaBuf>,
    ) -> Result<()> {
        self.k().silu_mul_backward(
            self.s(),
            self.v(gate),
            self.v(up),
            self.v(dy),
            self.m(&dgate),
            self.m(&dup),
            None,
        )
    }

    fn silu_mul_backward_recompute_unchecked(
        &self,
        gate: View<'_, CudaBuf>,
        up: View<'_, CudaBuf>,
        dy_then_y: ViewMut<'_, CudaBuf>,
        dgate: ViewMut<'_, CudaBuf>,
        dup: ViewMut<'_, CudaBuf>,
    ) -> Result<()> {
        let dy = self.m(&dy_then_y);
        self.k().silu_mul_backward(
            self.s(),
            self.v(gate),
            self.v(up),
            dy,
            self.m(&dgate),
            self.m(&dup),
            Some(dy),
        )
    }
}

fn unary_code(op: Unary) -> i32 {
    match op {
        Unary::Silu => 0,
        Unary::Gelu => 1,
        Unary::SquaredRelu => 2,
    }
}

/// The block of an RMSNorm kernel's (row, group): a thread a channel, or
/// a thread 8 channels on the `vec8` path, up to 256. Mamba's gated norm
/// (groups of 512 channels) thus takes 64 threads, not 256 of which three
/// quarters would idle. Its sums do not change: the block's reduction adds
/// the idle threads' zeros.
fn norm_threads(group_size: usize, vec8: bool) -> u32 {
    // (`rmsnorm_forward_warps` replays this block's sums for groups of up
    // to NORM_WARP_WORDS words.)
    reduce_threads(if vec8 { group_size / 8 } else { group_size }, 256)
}

/// The widest group (8-channel words) `rmsnorm_forward_warps` takes
/// (`RMSNORM_WARP_WORDS`): a lane holds up to 8 of its words.
const NORM_WARP_WORDS: usize = 256;

/// `rmsnorm_backward`'s blocks for a norm of `dim` channels in groups of
/// `group_size` (one pass for both gradients): `(threads, blocks a row)`,
/// or `None` where it does not take the shape. A thread takes a word of 8
/// channels; a group's words are summed by a shuffle tree inside a warp (a
/// power of two up to 32) or by whole warps (a multiple of 32); a block is
/// one group of whole warps where a row holds several, else a row (rounded
/// up to whole warps); at most 512 threads a block (the kernel's launch
/// bounds).
fn fused_norm_blocks(dim: usize, group_size: usize) -> Option<(usize, usize)> {
    let (words, group_words) = (dim / 8, group_size / 8);
    if !group_size.is_multiple_of(8) || group_words == 0 {
        return None;
    }
    let whole_warps = group_words.is_multiple_of(32);
    let in_a_warp = group_words <= 32 && group_words.is_power_of_two();
    let (threads, blocks_a_row) = if whole_warps && group_words < words {
        (group_words, words / group_words)
    } else if whole_warps || in_a_warp {
        (words.next_multiple_of(32), 1)
    } else {
        return None;
    };
    (threads <= 512).then_some((threads, blocks_a_row))
}

/// The arguments both RMSNorm backward kernels begin with: dy, x, the
/// weight (each with its dtype tag), rstd, dx (with its tag) and the copy
/// of dx before (0: none); `pointers` and `tags` in that order.
fn norm_backward_operands<'a>(b: &mut KernelArgs<'a>, pointers: &'a [u64; 6], tags: &'a [i32; 4]) {
    let [dy, x, w, rstd, dx, before] = pointers;
    let [dyt, xt, wt, dxt] = tags;
    b.arg(dy).arg(dyt).arg(x).arg(xt).arg(w).arg(wt);
    b.arg(rstd).arg(dx).arg(dxt).arg(before);
}

/// The column-sum shape 8 channels a thread: 8 column threads (64
/// channels) by 32 row slices a block (`PARTIALS_COLUMN_THREADS` in
/// `rmsnorm.cu`).
fn column_word_blocks(cols: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (cols.div_ceil(64).max(1) as u32, 1, 1),
        block_dim: (8, 32, 1),
        shared_mem_bytes: 0,
    }
}

impl KernelSet {
    /// `Backend::rmsnorm_forward` (with `x_copy`, the copy in the same pass).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_forward(
        &self,
        stream: &CudaStream,
        x: GpuView,
        weight: GpuView,
        y: GpuView,
        rstd: GpuView,
        x_copy: Option<GpuView>,
        d: NormDims,
    ) -> Result<()> {
        let k = "rmsnorm_forward";
        let (xt, wt, yt) = (
            dtype_tag(x.dtype),
            dtype_tag(weight.dtype),
            dtype_tag(y.dtype),
        );
        let gs = d.dim / d.groups;
        if gs == 0 || d.rows == 0 {
            return Ok(());
        }
        let (g, s) = (d.groups as u64, gs as u64);
        let vec8 =
            bf16_words(&[x, weight, y], gs) && x_copy.is_none_or(|c| c.ptr.is_multiple_of(16));
        // A null pointer: no copy.
        let copy = x_copy.map_or(0u64, |c| c.ptr);
        let threads = norm_threads(gs, vec8);
        let items = d.rows * d.groups;
        if vec8 && gs / 8 <= NORM_WARP_WORDS {
            // A warp an item (`rmsnorm_forward_warps`): the block kernel's
            // bits without its barriers.
            let k = "rmsnorm_forward_warps";
            let n = items as u64;
            let mut b = KernelArgs::new(stream, self.function(k)?);
            b.arg(&x.ptr).arg(&weight.ptr).arg(&y.ptr).arg(&rstd.ptr);
            b.arg(&copy)
                .arg(&n)
                .arg(&g)
                .arg(&s)
                .arg(&threads)
                .arg(&d.eps);
            return self.go(k, &mut b, warp_per_item(items));
        }
        let vec8 = i32::from(vec8);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&x.ptr)
            .arg(&xt)
            .arg(&weight.ptr)
            .arg(&wt)
            .arg(&y.ptr)
            .arg(&yt);
        b.arg(&rstd.ptr)
            .arg(&copy)
            .arg(&g)
            .arg(&s)
            .arg(&d.eps)
            .arg(&vec8);
        self.go(k, &mut b, per_item(items, threads)?)
    }

    /// `Backend::rmsnorm_backward_input` (accumulates into `dx`; with
    /// `dx_before`, the copy in the same pass; the weight gradient's
    /// partial sums into `partials`). One kernel, `rmsnorm_backward`, where
    /// the views and the shape allow it; else the input gradient's block per
    /// (row, group) and the partials' column-sum kernel, two passes.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward_input(
        &self,
        stream: &CudaStream,
        dy: GpuView,
        x: GpuView,
        weight: GpuView,
        rstd: GpuView,
        dx: GpuView,
        dx_before: Option<GpuView>,
        partials: GpuView,
        d: NormDims,
    ) -> Result<()> {
        let k = "rmsnorm_backward_input";
        let (dyt, xt) = (dtype_tag(dy.dtype), dtype_tag(x.dtype));
        let (wt, dxt) = (dtype_tag(weight.dtype), dtype_tag(dx.dtype));
        let gs = d.dim / d.groups;
        if gs == 0 {
            return Ok(());
        }
        let (g, s) = (d.groups as u64, gs as u64);
        let vec8 =
            words8(&[dy, x, weight, dx], gs) && dx_before.is_none_or(|v| v.ptr.is_multiple_of(16));
        // A null pointer: no copy.
        let before = dx_before.map_or(0u64, |v| v.ptr);
        let (rows, dim, slice_rows) = (d.rows as u64, d.dim as u64, d.weight_slice_rows() as u64);
        let pointers = [dy.ptr, x.ptr, weight.ptr, rstd.ptr, dx.ptr, before];
        let tags = [dyt, xt, wt, dxt];
        let fused =
            fused_norm_blocks(d.dim, gs).filter(|_| vec8 && partials.ptr.is_multiple_of(16));
        if let Some((threads, blocks_a_row)) = fused {
            let kf = "rmsnorm_backward";
            let mut b = KernelArgs::new(stream, self.function(kf)?);
            norm_backward_operands(&mut b, &pointers, &tags);
            b.arg(&partials.ptr)
                .arg(&rows)
                .arg(&dim)
                .arg(&g)
                .arg(&s)
                .arg(&slice_rows);
            let mut config = per_item(d.weight_slices(), threads as u32)?;
            config.grid_dim.1 = blocks_a_row as u32;
            return self.go(kf, &mut b, config);
        }
        if d.rows > 0 {
            let threads = norm_threads(gs, vec8);
            let flag = i32::from(vec8);
            let mut b = KernelArgs::new(stream, self.function(k)?);
            norm_backward_operands(&mut b, &pointers, &tags);
            b.arg(&g).arg(&s).arg(&flag);
            self.go(k, &mut b, per_item(d.rows * d.groups, threads)?)?;
        }
        // 8 channels a thread where the views allow (the same bits).
        let (kp, mut config) = if words8(&[dy, x], gs) {
            ("rmsnorm_weight_partials_vec8", column_word_blocks(d.dim))
        } else {
            ("rmsnorm_weight_partials", column_blocks(d.dim))
        };
        let mut b = KernelArgs::new(stream, self.function(kp)?);
        b.arg(&dy.ptr)
            .arg(&dyt)
            .arg(&x.ptr)
            .arg(&xt)
            .arg(&rstd.ptr)
            .arg(&partials.ptr);
        let dims = [rows, dim, g, s];
        for v in &dims {
            b.arg(v);
        }
        config.grid_dim.1 = d.weight_slices() as u32;
        self.go(kp, &mut b, config)
    }

    /// `Backend::rmsnorm_backward_weight`: `dw += ` the partials' slices,
    /// summed per channel in `column_sum`'s fixed shape.
    pub fn rmsnorm_backward_weight(
        &self,
        stream: &CudaStream,
        partials: GpuView,
        dw: GpuView,
        d: NormDims,
    ) -> Result<()> {
        self.column_sum(stream, partials, dw, d.weight_slices(), d.dim)
    }

    /// `Backend::unary_forward`.
    pub fn unary_forward(
        &self,
        stream: &CudaStream,
        op: Unary,
        x: GpuView,
        y: GpuView,
    ) -> Result<()> {
        let k = "unary_forward";
        let (xt, yt) = (dtype_tag(x.dtype), dtype_tag(y.dtype));
        if x.len == 0 {
            return Ok(());
        }
        let (code, n) = (unary_code(op), x.len as u64);
        let vec8 = bf16_words(&[x, y], x.len);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&code)
            .arg(&x.ptr)
            .arg(&xt)
            .arg(&y.ptr)
            .arg(&yt)
            .arg(&n);
        let flag = i32::from(vec8);
        b.arg(&flag);
        self.go(k, &mut b, grid_for(if vec8 { x.len / 8 } else { x.len }))
    }

    /// `Backend::unary_backward`; with `y` (`dy` itself, or null), also
    /// `Backend::unary_backward_recompute`'s `f(x)`, written over `dy`
    /// element by element after the thread read it.
    pub fn unary_backward(
        &self,
        stream: &CudaStream,
        op: Unary,
        x: GpuView,
        dy: GpuView,
        dx: GpuView,
        y: Option<GpuView>,
    ) -> Result<()> {
        let k = "unary_backward";
        let (xt, dyt, dxt) = (dtype_tag(x.dtype), dtype_tag(dy.dtype), dtype_tag(dx.dtype));
        if x.len == 0 {
            return Ok(());
        }
        let (code, n) = (unary_code(op), x.len as u64);
        let vec8 = bf16_words(&[x, dy, dx], x.len);
        // A null pointer: no recompute.
        let y_ptr = y.map_or(0u64, |y| y.ptr);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&code)
            .arg(&x.ptr)
            .arg(&xt)
            .arg(&dy.ptr)
            .arg(&dyt)
            .arg(&dx.ptr)
            .arg(&dxt)
            .arg(&y_ptr)
            .arg(&n);
        let flag = i32::from(vec8);
        b.arg(&flag);
        self.go(k, &mut b, grid_for(if vec8 { x.len / 8 } else { x.len }))
    }

    /// `Backend::silu_mul_forward`.
    pub fn silu_mul_forward(
        &self,
        stream: &CudaStream,
        gate: GpuView,
        up: GpuView,
        y: GpuView,
    ) -> Result<()> {
        let k = "silu_mul_forward";
        let (gt, ut, yt) = (
            dtype_tag(gate.dtype),
            dtype_tag(up.dtype),
            dtype_tag(y.dtype),
        );
        if gate.len == 0 {
            return Ok(());
        }
        let n = gate.len as u64;
        let vec8 = bf16_words(&[gate, up, y], gate.len);
        let flag = i32::from(vec8);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&gate.ptr)
            .arg(&gt)
            .arg(&up.ptr)
            .arg(&ut)
            .arg(&y.ptr)
            .arg(&yt)
            .arg(&n)
            .arg(&flag);
        self.go(
            k,
            &mut b,
            grid_for(if vec8 { gate.len / 8 } else { gate.len }),
        )
    }

    /// `Backend::silu_mul_backward`; with `y` (`dy` itself, or null),
    /// also `Backend::silu_mul_backward_recompute`'s `silu(gate) * up`,
    /// as `unary_backward`'s.
    #[allow(clippy::too_many_arguments)]
    pub fn silu_mul_backward(
        &self,
        stream: &CudaStream,
        gate: GpuView,
        up: GpuView,
        dy: GpuView,
        dgate: GpuView,
        dup: GpuView,
        y: Option<GpuView>,
    ) -> Result<()> {
        let k = "silu_mul_backward";
        let (gt, ut, dyt) = (
            dtype_tag(gate.dtype),
            dtype_tag(up.dtype),
            dtype_tag(dy.dtype),
        );
        let (dgt, dut) = (dtype_tag(dgate.dtype), dtype_tag(dup.dtype));
        if gate.len == 0 {
            return Ok(());
        }
        let n = gate.len as u64;
        let vec8 = bf16_words(&[gate, up, dy, dgate, dup], gate.len);
        let flag = i32::from(vec8);
        // A null pointer: no recompute.
        let y_ptr = y.map_or(0u64, |y| y.ptr);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&gate.ptr)
            .arg(&gt)
            .arg(&up.ptr)
            .arg(&ut)
            .arg(&dy.ptr)
            .arg(&dyt);
        b.arg(&dgate.ptr)
            .arg(&dgt)
            .arg(&dup.ptr)
            .arg(&dut)
            .arg(&y_ptr)
            .arg(&n)
            .arg(&flag);
        self.go(
            k,
            &mut b,
            grid_for(if vec8 { gate.len / 8 } else { gate.len }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::launch::source_with_defines;

    /// `rmsnorm_forward_warps` replays the block kernel's reduction: for
    /// every group it takes, the block has a thread a word (its words one
    /// each) and at most 8 warps (a lane's registers).
    #[test]
    fn the_warp_norm_forward_takes_groups_of_a_word_a_block_thread() {
        source_with_defines("rmsnorm.cu", &[("RMSNORM_WARP_WORDS", NORM_WARP_WORDS)]);
        for words in 1..=NORM_WARP_WORDS {
            let threads = norm_threads(8 * words, true) as usize;
            assert!(
                threads >= words && threads <= 8 * 32,
                "{words} words: {threads}"
            );
        }
        assert!(norm_threads(8 * (NORM_WARP_WORDS + 1), true) as usize <= NORM_WARP_WORDS);
    }

    /// The one-pass norm backward's blocks: a row of whole warps, a group
    /// of whole warps where a row holds several, a row whose groups are
    /// sub-warp powers of two; the others (groups of 6 words, rows or
    /// groups past the launch bounds) take the two-pass way.
    #[test]
    fn the_one_pass_norm_backward_takes_rows_or_groups_of_whole_warps() {
        assert_eq!(fused_norm_blocks(2048, 2048), Some((256, 1)));
        assert_eq!(fused_norm_blocks(4096, 512), Some((64, 8)));
        assert_eq!(fused_norm_blocks(8192, 2048), Some((256, 4)));
        assert_eq!(fused_norm_blocks(512, 128), Some((64, 1)));
        assert_eq!(fused_norm_blocks(64, 32), Some((32, 1)));
        assert_eq!(fused_norm_blocks(96, 48), None);
        assert_eq!(fused_norm_blocks(8200, 8200), None);
        assert_eq!(fused_norm_blocks(8192, 8192), None);
        assert_eq!(fused_norm_blocks(24, 12), None);
    }
}
