//! Mixture of experts on a GPU: [`MoeKernels`] for [`CudaBackend`], and the
//! launchers of `kernels/routing.cu`, `dispatch.cu` and `permute.cu` on
//! [`KernelSet`] (routing and its backward, the expert histogram and the
//! dispatch sort, the regroup after the all-to-all, the load-balancing
//! loss, the balancing load's running sum, row gathers and scatters, and
//! the unpermute and combine with their backward). The launchers take
//! views `backend::moe`'s checks accepted and check what the kernels limit
//! (experts a row holds in registers, the histogram a block's shared memory
//! holds, u32 arguments); selected experts, counts and positions are
//! checked on the device, each bad one reported through the fault word.

use crate::backend::{
    AuxLossDims, ExpertBias, ExpertOrder, MoeKernels, ReceivedDims, RouteDims, RouteOutputs,
    RoutedSlots, RouterScores, UnpermuteDims, UnpermuteGrads,
};
use crate::cuda::launch::args::KernelArgs;
use crate::cuda::launch::{
    GpuView, KernelSet, as_u32, bf16_words, block_per_row, dtype_tag, ensure, grid_for, per_item,
    warp_per_item, words8,
};
use crate::cuda::{CudaBackend, CudaBuf};
use crate::error::{Result, RuntimeError};
use crate::view::{View, ViewMut};
use cudarc::driver::CudaStream;
use hybridgen_dsl::config::ScoreFunction;

/// The routing kernels hold a row's experts in registers, eight a lane.
const MAX_EXPERTS: usize = 256;
/// The sort's block (`SORT_THREADS` in `dispatch.cu`).
const SORT_THREADS: u32 = 1024;

impl MoeKernels<CudaBuf> for CudaBackend {
    fn moe_route_forward_unchecked(
        &self,
        logits: View<'_, CudaBuf>,
        expert_bias: Option<ExpertBias<View<'_, CudaBuf>, ViewMut<'_, CudaBuf>>>,
        out: RouteOutputs<ViewMut<'_, CudaBuf>>,
        selected: ViewMut<'_, CudaBuf>,
        dims: RouteDims,
    ) -> Result<()> {
        self.k().moe_route_forward(
            self.s(),
            self.v(logits),
            expert_bias.map(|b| ExpertBias {
                bias: self.v(b.bias),
                unbiased: self.m(&b.unbiased),
            }),
            self.m(&out.scores),
            self.m(&out.weights),
            out.prob_sum.as_ref().map(|p| self.m(p)),
            self.m(&selected),
            dims,
        )
    }

    fn moe_route_backward_unchecked(
        &self,
        saved: RouterScores<View<'_, CudaBuf>>,
        selected: View<'_, CudaBuf>,
        d_weights: View<'_, CudaBuf>,
        aux_grad: View<'_, CudaBuf>,
        d_logits: ViewMut<'_, CudaBuf>,
        dims: RouteDims,
    ) -> Result<()> {
        self.k().moe_route_backward(
            self.s(),
            self.v(saved.logits),
            self.v(saved.scores),
            self.v(selected),
            self.v(d_weights),
            self.v(aux_grad),
            self.m(&d_logits),
            dims,
        )
    }

    fn moe_expert_counts_unchecked(
        &self,
        selected: View<'_, CudaBuf>,
        counts: ViewMut<'_, CudaBuf>,
        slots: RoutedSlots,
    ) -> Result<()> {
        self.k()
            .moe_expert_counts(self.s(), self.v(selected), self.m(&counts), slots)
    }

    fn moe_sort_by_expert_unchecked(
        &self,
        selected: View<'_, CudaBuf>,
        counts: View<'_, CudaBuf>,
        out: ExpertOrder<ViewMut<'_, CudaBuf>>,
        slots: RoutedSlots,
    ) -> Result<()> {
        self.k().moe_sort_by_expert(
            self.s(),
            self.v(selected),
            self.v(counts),
            self.m(&out.positions),
            self.m(&out.sources),
            slots,
        )
    }

    fn moe_expert_major_order_unchecked(
        &self,
        recv_counts: View<'_, CudaBuf>,
        order: ViewMut<'_, CudaBuf>,
        dims: ReceivedDims,
    ) -> Result<()> {
        self.k()
            .moe_expert_major_order(self.s(), self.v(recv_counts), self.m(&order), dims)
    }

    fn moe_aux_loss_forward_unchecked(
        &self,
        counts: View<'_, CudaBuf>,
        prob_sum: View<'_, CudaBuf>,
        loss: ViewMut<'_, CudaBuf>,
        dims: AuxLossDims,
    ) -> Result<()> {
        self.k().moe_aux_loss_forward(
            self.s(),
            self.v(counts),
            self.v(prob_sum),
            self.m(&loss),
            dims,
        )
    }

    fn moe_load_accumulate_unchecked(
        &self,
        counts: View<'_, CudaBuf>,
        load: ViewMut<'_, CudaBuf>,
    ) -> Result<()> {
        self.k()
            .moe_load_accumulate(self.s(), self.v(counts), self.m(&load))
    }

    fn moe_aux_loss_backward_unchecked(
        &self,
        counts: View<'_, CudaBuf>,
        aux_grad: ViewMut<'_, CudaBuf>,
        dims: AuxLossDims,
        scale: f32,
    ) -> Result<()> {
        self.k()
            .moe_aux_loss_backward(self.s(), self.v(counts), self.m(&aux_grad), dims, scale)
    }

    fn gather_rows_unchecked(
        &self,
        src: View<'_, CudaBuf>,
        index: View<'_, CudaBuf>,
        dst: ViewMut<'_, CudaBuf>,
        width: usize,
    ) -> Result<()> {
        self.k()
            .gather_rows(self.s(), self.v(src), self.v(index), self.m(&dst), width)
    }

    fn scatter_rows_unchecked(
        &self,
        src: View<'_, CudaBuf>,
        index: View<'_, CudaBuf>,
        dst: ViewMut<'_, CudaBuf>,
        width: usize,
    ) -> Result<()> {
        self.k()
            .scatter_rows(self.s(), self.v(src), self.v(index), self.m(&dst), width)
    }

    fn moe_unpermute_unchecked(
        &self,
        rows: View<'_, CudaBuf>,
        weights: Option<View<'_, CudaBuf>>,
        positions: View<'_, CudaBuf>,
        out: ViewMut<'_, CudaBuf>,
        dims: UnpermuteDims,
    ) -> Result<()> {
        self.k().moe_unpermute(
            self.s(),
            self.v(rows),
            weights.map(|w| self.v(w)),
            self.v(positions),
            self.m(&out),
            dims,
        )
    }

    fn moe_combine_unchecked(
        &self,
        rows: View<'_, CudaBuf>,
        weights: View<'_, CudaBuf>,
        positions: View<'_, CudaBuf>,
        shared: Option<View<'_, CudaBuf>>,
        x: ViewMut<'_, CudaBuf>,
        dims: UnpermuteDims,
    ) -> Result<()> {
        self.k().moe_combine(
            self.s(),
            self.v(rows),
            self.v(weights),
            self.v(positions),
            shared.map(|s| self.v(s)),
            self.m(&x),
            dims,
        )
    }

    fn moe_unpermute_backward_unchecked(
        &self,
        dout: View<'_, CudaBuf>,
        rows: View<'_, CudaBuf>,
        weights: View<'_, CudaBuf>,
        positions: View<'_, CudaBuf>,
        grads: UnpermuteGrads<ViewMut<'_, CudaBuf>>,
        dims: UnpermuteDims,
    ) -> Result<()> {
        self.k().moe_unpermute_backward(
            self.s(),
            self.v(dout),
            self.v(rows),
            self.v(weights),
            self.v(positions),
            self.m(&grads.rows),
            self.m(&grads.weights),
            dims,
        )
    }
}

fn score_code(score: ScoreFunction) -> i32 {
    match score {
        ScoreFunction::Softmax => 0,
        ScoreFunction::Sigmoid => 1,
    }
}

impl KernelSet {
    /// The CUDA routing kernels' limits: a row's experts in registers, eight
    /// a lane, and the top-k of a warp; gives the experts as the kernels
    /// take them.
    fn route_limits(k: &str, d: RouteDims) -> Result<u32> {
        if d.experts > MAX_EXPERTS || d.top_k > 32 {
            return Err(RuntimeError::Unsupported(format!(
                "{k}: the CUDA routing kernels take at most {MAX_EXPERTS} experts and top-k 32 \
                 ({} experts, top-k {} asked)",
                d.experts, d.top_k
            )));
        }
        as_u32(k, "experts", d.experts)
    }

    /// `Backend::moe_route_forward` (two launches: selection per row, then the
    /// per-expert sums of the normalised scores as a column sum).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route_forward(
        &self,
        stream: &CudaStream,
        logits: GpuView,
        expert_bias: Option<ExpertBias<GpuView, GpuView>>,
        scores: GpuView,
        weights: GpuView,
        prob_sum: Option<GpuView>,
        selected: GpuView,
        d: RouteDims,
    ) -> Result<()> {
        let k = "moe_route_forward";
        let experts = Self::route_limits(k, d)?;
        // Null pointers: no expert bias.
        let (bias, unbiased) = expert_bias.map_or((0, 0), |b| (b.bias.ptr, b.unbiased.ptr));
        if d.rows == 0 {
            return Ok(());
        }
        let (rows, top_k, score) = (d.rows as u64, d.top_k as u32, score_code(d.score));
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&logits.ptr)
            .arg(&bias)
            .arg(&scores.ptr)
            .arg(&weights.ptr)
            .arg(&selected.ptr)
            .arg(&unbiased);
        b.arg(&rows)
            .arg(&experts)
            .arg(&top_k)
            .arg(&score)
            .arg(&d.topk_scale);
        self.go(k, &mut b, warp_per_item(d.rows))?;
        let Some(prob_sum) = prob_sum else {
            return Ok(());
        };
        let mut b = KernelArgs::new(stream, self.function("moe_prob_sum")?);
        b.arg(&logits.ptr)
            .arg(&prob_sum.ptr)
            .arg(&rows)
            .arg(&experts)
            .arg(&score);
        self.go("moe_prob_sum", &mut b, per_item(d.experts, 256)?)
    }

    /// `Backend::moe_route_backward`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route_backward(
        &self,
        stream: &CudaStream,
        logits: GpuView,
        scores: GpuView,
        selected: GpuView,
        d_weights: GpuView,
        aux_grad: GpuView,
        d_logits: GpuView,
        d: RouteDims,
    ) -> Result<()> {
        let k = "moe_route_backward";
        let experts = Self::route_limits(k, d)?;
        if d.rows == 0 {
            return Ok(());
        }
        let (rows, top_k, score) = (d.rows as u64, d.top_k as u32, score_code(d.score));
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&logits.ptr)
            .arg(&scores.ptr)
            .arg(&selected.ptr)
            .arg(&d_weights.ptr);
        b.arg(&aux_grad.ptr)
            .arg(&d_logits.ptr)
            .arg(&rows)
            .arg(&experts)
            .arg(&top_k);
        b.arg(&score).arg(&d.topk_scale).arg(&self.fault_ptr);
        self.go(k, &mut b, warp_per_item(d.rows))
    }

    /// `Backend::moe_expert_counts` (overwrites `counts`).
    pub fn moe_expert_counts(
        &self,
        stream: &CudaStream,
        selected: GpuView,
        counts: GpuView,
        s: RoutedSlots,
    ) -> Result<()> {
        let k = "moe_expert_counts";
        let n = s.tokens * s.top_k;
        let experts = as_u32(k, "experts", s.experts)?;
        ensure(s.experts <= 12 * 1024, || {
            format!(
                "{k}: {} experts do not fit a block's shared histogram",
                s.experts
            )
        })?;
        self.zero(stream, counts)?;
        if n == 0 {
            return Ok(());
        }
        let slots = n as u64;
        let mut config = grid_for(n);
        config.grid_dim.0 = config.grid_dim.0.min(264);
        config.shared_mem_bytes = 4 * experts;
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&selected.ptr)
            .arg(&slots)
            .arg(&counts.ptr)
            .arg(&experts)
            .arg(&self.fault_ptr);
        self.go(k, &mut b, config)
    }

    /// `Backend::moe_sort_by_expert`.
    pub fn moe_sort_by_expert(
        &self,
        stream: &CudaStream,
        selected: GpuView,
        counts: GpuView,
        positions: GpuView,
        sources: GpuView,
        s: RoutedSlots,
    ) -> Result<()> {
        let k = "moe_sort_by_expert";
        let n = s.tokens * s.top_k;
        if s.experts > MAX_EXPERTS {
            return Err(RuntimeError::Unsupported(format!(
                "{k}: the CUDA dispatch sort takes at most {MAX_EXPERTS} experts ({} asked)",
                s.experts
            )));
        }
        let (slots, top_k, experts) = (n as u64, s.top_k as u32, s.experts as u32);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&selected.ptr)
            .arg(&counts.ptr)
            .arg(&positions.ptr)
            .arg(&sources.ptr);
        b.arg(&slots).arg(&top_k).arg(&experts).arg(&self.fault_ptr);
        self.go(k, &mut b, per_item(1, SORT_THREADS)?)
    }

    /// `Backend::moe_expert_major_order`. `order` must hold the sum of
    /// `recv_counts` (the host knows it from the count exchange); the kernel
    /// reports counts that disagree with it.
    pub fn moe_expert_major_order(
        &self,
        stream: &CudaStream,
        recv_counts: GpuView,
        order: GpuView,
        d: ReceivedDims,
    ) -> Result<()> {
        let k = "moe_expert_major_order";
        let pairs = d.ranks * d.local_experts;
        if pairs == 0 {
            return Ok(());
        }
        let (ranks, local) = (
            as_u32(k, "ranks", d.ranks)?,
            as_u32(k, "local experts", d.local_experts)?,
        );
        let total = order.len as u64;
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&recv_counts.ptr)
            .arg(&order.ptr)
            .arg(&ranks)
            .arg(&local)
            .arg(&total);
        b.arg(&self.fault_ptr);
        self.go(k, &mut b, per_item(pairs, 256)?)
    }

    /// `Backend::moe_aux_loss_forward` (accumulates into `loss[0]`).
    pub fn moe_aux_loss_forward(
        &self,
        stream: &CudaStream,
        counts: GpuView,
        prob_sum: GpuView,
        loss: GpuView,
        d: AuxLossDims,
    ) -> Result<()> {
        let k = "moe_aux_loss_forward";
        let (tokens, top_k) = (d.slots.tokens as u64, d.slots.top_k as u64);
        let experts = as_u32(k, "experts", d.slots.experts)?;
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&counts.ptr)
            .arg(&prob_sum.ptr)
            .arg(&loss.ptr)
            .arg(&tokens)
            .arg(&top_k);
        b.arg(&experts).arg(&d.coeff);
        self.go(k, &mut b, per_item(1, 32)?)
    }

    /// `Backend::moe_aux_loss_backward` (overwrites `aux_grad`).
    pub fn moe_aux_loss_backward(
        &self,
        stream: &CudaStream,
        counts: GpuView,
        aux_grad: GpuView,
        d: AuxLossDims,
        scale: f32,
    ) -> Result<()> {
        let k = "moe_aux_loss_backward";
        if d.slots.experts == 0 {
            return Ok(());
        }
        let (tokens, top_k) = (d.slots.tokens as u64, d.slots.top_k as u64);
        let experts = as_u32(k, "experts", d.slots.experts)?;
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&counts.ptr)
            .arg(&aux_grad.ptr)
            .arg(&tokens)
            .arg(&top_k)
            .arg(&experts);
        b.arg(&d.coeff).arg(&scale);
        self.go(k, &mut b, grid_for(d.slots.experts))
    }

    /// `Backend::moe_load_accumulate` (accumulates into `load`).
    pub fn moe_load_accumulate(
        &self,
        stream: &CudaStream,
        counts: GpuView,
        load: GpuView,
    ) -> Result<()> {
        let k = "moe_load_accumulate";
        if counts.len == 0 {
            return Ok(());
        }
        let experts = as_u32(k, "experts", counts.len)?;
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&counts.ptr).arg(&load.ptr).arg(&experts);
        self.go(k, &mut b, grid_for(counts.len))
    }

    fn row_move(
        &self,
        stream: &CudaStream,
        k: &'static str,
        src: GpuView,
        index: GpuView,
        dst: GpuView,
        width: usize,
    ) -> Result<()> {
        // The rows the indices point into.
        let other = if k == "gather_rows" { src } else { dst };
        if width == 0 || index.len == 0 {
            return Ok(());
        }
        // The widest word every row and both pointers are aligned to.
        let row_bytes = (width * src.dtype.bytes()) as u64;
        let word: i32 = [16, 4, 2]
            .into_iter()
            .find(|&w| (row_bytes | src.ptr | dst.ptr).is_multiple_of(w as u64))
            .unwrap_or(2);
        let words = row_bytes / word as u64;
        let (count, rows) = (index.len as u64, (other.len / width) as u64);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        b.arg(&src.ptr)
            .arg(&index.ptr)
            .arg(&dst.ptr)
            .arg(&word)
            .arg(&count)
            .arg(&words)
            .arg(&rows);
        b.arg(&self.fault_ptr);
        self.go(k, &mut b, block_per_row(index.len))
    }

    /// `Backend::gather_rows`: `dst[i] = src[index[i]]`.
    pub fn gather_rows(
        &self,
        stream: &CudaStream,
        src: GpuView,
        index: GpuView,
        dst: GpuView,
        width: usize,
    ) -> Result<()> {
        self.row_move(stream, "gather_rows", src, index, dst, width)
    }

    /// `Backend::scatter_rows`: `dst[index[i]] = src[i]` (distinct indices;
    /// unlike the CPU backend, the GPU checks their range but not that they
    /// are distinct).
    pub fn scatter_rows(
        &self,
        stream: &CudaStream,
        src: GpuView,
        index: GpuView,
        dst: GpuView,
        width: usize,
    ) -> Result<()> {
        self.row_move(stream, "scatter_rows", src, index, dst, width)
    }

    /// `Backend::moe_unpermute` (overwrites `out`).
    pub fn moe_unpermute(
        &self,
        stream: &CudaStream,
        rows: GpuView,
        weights: Option<GpuView>,
        positions: GpuView,
        out: GpuView,
        d: UnpermuteDims,
    ) -> Result<()> {
        self.unpermute(
            "moe_unpermute",
            stream,
            [rows, positions],
            out,
            weights,
            None,
            false,
            d,
        )
    }

    /// `Backend::moe_combine` (adds into `x`).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        stream: &CudaStream,
        rows: GpuView,
        weights: GpuView,
        positions: GpuView,
        shared: Option<GpuView>,
        x: GpuView,
        d: UnpermuteDims,
    ) -> Result<()> {
        let w = Some(weights);
        self.unpermute(
            "moe_combine",
            stream,
            [rows, positions],
            x,
            w,
            shared,
            true,
            d,
        )
    }

    /// The `moe_unpermute` kernel for `k`: `out` (+)= each token's
    /// weighted rows (+ its `shared` row).
    #[allow(clippy::too_many_arguments)]
    fn unpermute(
        &self,
        k: &str,
        stream: &CudaStream,
        [rows, positions]: [GpuView; 2],
        out: GpuView,
        weights: Option<GpuView>,
        shared: Option<GpuView>,
        accumulate: bool,
        d: UnpermuteDims,
    ) -> Result<()> {
        let (rt, ot) = (dtype_tag(rows.dtype), dtype_tag(out.dtype));
        as_u32(k, "rows", d.rows)?;
        // Null pointers: no weights (all ones), no shared rows.
        let w = weights.map_or(0, |w| w.ptr);
        let (sp, st) = shared.map_or((0, 0), |s| (s.ptr, dtype_tag(s.dtype)));
        if out.len == 0 {
            return Ok(());
        }
        let dims = [d.tokens, d.top_k, d.rows, d.width].map(|x| x as u64);
        // Rows combine 8 channels a thread where the words line up.
        let vec8 = words8(&[rows, out], d.width) && shared.is_none_or(|s| words8(&[s], d.width));
        let vec8 = i32::from(vec8);
        let accumulate = i32::from(accumulate);
        let mut b = KernelArgs::new(stream, self.function("moe_unpermute")?);
        b.arg(&rows.ptr)
            .arg(&rt)
            .arg(&w)
            .arg(&positions.ptr)
            .arg(&sp)
            .arg(&st)
            .arg(&out.ptr)
            .arg(&ot)
            .arg(&accumulate);
        for x in &dims {
            b.arg(x);
        }
        b.arg(&vec8).arg(&self.fault_ptr);
        self.go(k, &mut b, block_per_row(d.tokens))
    }

    /// `Backend::moe_unpermute_backward` (overwrites both gradients; the
    /// positions must be distinct, as the dispatch makes them).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_unpermute_backward(
        &self,
        stream: &CudaStream,
        dout: GpuView,
        rows: GpuView,
        weights: GpuView,
        positions: GpuView,
        d_rows: GpuView,
        d_weights: GpuView,
        d: UnpermuteDims,
    ) -> Result<()> {
        let k = "moe_unpermute_backward";
        let [dt, rt, drt] = [dout, rows, d_rows].map(|view| dtype_tag(view.dtype));
        as_u32(k, "rows", d.rows)?;
        // Distinct positions over as many slots as rows write every row.
        if positions.len != d.rows {
            self.zero(stream, d_rows)?;
        }
        if d.width == 0 || d.top_k == 0 {
            return self.zero(stream, d_weights);
        }
        let dims = [d.tokens, d.top_k, d.rows, d.width].map(|x| x as u64);
        let rows_vec8 = i32::from(bf16_words(&[dout, d_rows], d.width));
        let weights_vec8 = i32::from(bf16_words(&[dout, rows], d.width));
        let k_rows = "moe_unpermute_backward_rows";
        let mut b = KernelArgs::new(stream, self.function(k_rows)?);
        b.arg(&dout.ptr)
            .arg(&dt)
            .arg(&weights.ptr)
            .arg(&positions.ptr)
            .arg(&d_rows.ptr)
            .arg(&drt);
        for x in &dims {
            b.arg(x);
        }
        b.arg(&rows_vec8).arg(&self.fault_ptr);
        self.go(k_rows, &mut b, block_per_row(positions.len))?;
        let k_weights = "moe_unpermute_backward_weights";
        let mut b = KernelArgs::new(stream, self.function(k_weights)?);
        b.arg(&dout.ptr)
            .arg(&dt)
            .arg(&rows.ptr)
            .arg(&rt)
            .arg(&positions.ptr)
            .arg(&d_weights.ptr);
        for x in &dims {
            b.arg(x);
        }
        b.arg(&weights_vec8);
        self.go(k_weights, &mut b, warp_per_item(positions.len))
    }
}
