//! `impl Backend for CpuBackend`: memory as plain `Vec<f32>`, kernels as the
//! loops in [`super::kernels`] (each method a one-line delegation, so the
//! kernels stay plain functions on slices that tests call directly).

use super::kernels;
use crate::backend::{
    AdamStep, AttentionDims, AttentionInputs, Backend, ConvDims, CopyCols, LookupDims, LossDims,
    MatmulDims, NormDims, Precision, RotaryDims, RouteDims, RouteOutputs, RouterScores, ScanDims,
    ScanGrads, ScanInputs, SgdStep, Unary, UnpermuteDims, UnpermuteGrads,
};
use crate::error::{Result, RuntimeError};
use std::ops::Range;

/// The CPU device. Stateless: every buffer is a `Vec<f32>`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

fn out_of_bounds(what: &str, range: &Range<usize>, len: usize) -> RuntimeError {
    RuntimeError::InvalidArgument(format!(
        "{what} {}..{} is out of bounds for length {len}",
        range.start, range.end
    ))
}

fn same_len(what: &str, a: usize, b: usize) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(RuntimeError::InvalidArgument(format!(
            "{what}: lengths differ ({a} vs {b})"
        )))
    }
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Slice<'a> = &'a [f32];
    type SliceMut<'a> = &'a mut [f32];

    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn alloc(&self, len: usize, _precision: Precision) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn buf_len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn slice<'a>(&self, buf: &'a Vec<f32>, range: Range<usize>) -> Result<&'a [f32]> {
        let len = buf.len();
        buf.get(range.clone())
            .ok_or_else(|| out_of_bounds("slice", &range, len))
    }

    fn slice_mut<'a>(&self, buf: &'a mut Vec<f32>, range: Range<usize>) -> Result<&'a mut [f32]> {
        let len = buf.len();
        buf.get_mut(range.clone())
            .ok_or_else(|| out_of_bounds("slice", &range, len))
    }

    fn split_mut<'a>(
        &self,
        slice: &'a mut [f32],
        mid: usize,
    ) -> Result<(&'a mut [f32], &'a mut [f32])>
    where
        Self: 'a,
    {
        let len = slice.len();
        slice
            .split_at_mut_checked(mid)
            .ok_or_else(|| out_of_bounds("split", &(mid..mid), len))
    }

    fn as_slice<'a, 'b>(&self, slice: &'b &'a mut [f32]) -> &'b [f32]
    where
        'a: 'b,
    {
        slice
    }

    fn slice_len(&self, slice: &[f32]) -> usize {
        slice.len()
    }

    fn upload(&self, src: &[f32], dst: &mut [f32]) -> Result<()> {
        same_len("upload", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn download(&self, src: &[f32], dst: &mut [f32]) -> Result<()> {
        same_len("download", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn copy(&self, src: &[f32], dst: &mut [f32]) -> Result<()> {
        same_len("copy", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn fill(&self, dst: &mut [f32], value: f32) -> Result<()> {
        dst.fill(value);
        Ok(())
    }

    fn subslice<'a>(&self, slice: &'a [f32], range: Range<usize>) -> Result<&'a [f32]>
    where
        Self: 'a,
    {
        let len = slice.len();
        slice
            .get(range.clone())
            .ok_or_else(|| out_of_bounds("subslice", &range, len))
    }

    fn subslice_mut<'a, 'b>(
        &self,
        slice: &'b mut &'a mut [f32],
        range: Range<usize>,
    ) -> Result<&'b mut [f32]>
    where
        'a: 'b,
    {
        let len = slice.len();
        slice
            .get_mut(range.clone())
            .ok_or_else(|| out_of_bounds("subslice", &range, len))
    }

    fn shorten<'a, 'b>(&self, slice: &'a [f32]) -> &'b [f32]
    where
        'a: 'b,
        Self: 'a,
    {
        slice
    }

    fn reborrow_mut<'a, 'b>(&self, slice: &'b mut &'a mut [f32]) -> &'b mut [f32]
    where
        'a: 'b,
    {
        slice
    }

    fn matmul(&self, a: &[f32], b: &[f32], c: &mut [f32], dims: MatmulDims) -> Result<()> {
        kernels::matmul(a, b, c, dims)
    }

    fn axpy(&self, alpha: f32, x: &[f32], y: &mut [f32]) -> Result<()> {
        kernels::axpy(alpha, x, y)
    }

    fn scale(&self, x: &mut [f32], alpha: f32) -> Result<()> {
        kernels::scale(x, alpha)
    }

    fn copy_cols(&self, src: &[f32], dst: &mut [f32], dims: CopyCols) -> Result<()> {
        kernels::copy_cols(src, dst, dims)
    }

    fn column_sum(&self, x: &[f32], out: &mut [f32], rows: usize, cols: usize) -> Result<()> {
        kernels::column_sum(x, out, rows, cols)
    }

    fn rmsnorm_forward(
        &self,
        x: &[f32],
        weight: &[f32],
        y: &mut [f32],
        rstd: &mut [f32],
        dims: NormDims,
    ) -> Result<()> {
        kernels::rmsnorm_forward(x, weight, y, rstd, dims)
    }

    fn rmsnorm_backward_input(
        &self,
        dy: &[f32],
        x: &[f32],
        weight: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        dims: NormDims,
    ) -> Result<()> {
        kernels::rmsnorm_backward_input(dy, x, weight, rstd, dx, dims)
    }

    fn rmsnorm_backward_weight(
        &self,
        dy: &[f32],
        x: &[f32],
        rstd: &[f32],
        dw: &mut [f32],
        dims: NormDims,
    ) -> Result<()> {
        kernels::rmsnorm_backward_weight(dy, x, rstd, dw, dims)
    }

    fn unary_forward(&self, op: Unary, x: &[f32], y: &mut [f32]) -> Result<()> {
        kernels::unary_forward(op, x, y)
    }

    fn unary_backward(&self, op: Unary, x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<()> {
        kernels::unary_backward(op, x, dy, dx)
    }

    fn silu_mul_forward(&self, gate: &[f32], up: &[f32], y: &mut [f32]) -> Result<()> {
        kernels::silu_mul_forward(gate, up, y)
    }

    fn silu_mul_backward(
        &self,
        gate: &[f32],
        up: &[f32],
        dy: &[f32],
        dgate: &mut [f32],
        dup: &mut [f32],
    ) -> Result<()> {
        kernels::silu_mul_backward(gate, up, dy, dgate, dup)
    }

    fn conv1d_forward(
        &self,
        x: &[f32],
        weight: &[f32],
        bias: &[f32],
        y: &mut [f32],
        dims: ConvDims,
    ) -> Result<()> {
        kernels::conv1d_forward(x, weight, bias, y, dims)
    }

    fn conv1d_backward_input(
        &self,
        dy: &[f32],
        weight: &[f32],
        dx: &mut [f32],
        dims: ConvDims,
    ) -> Result<()> {
        kernels::conv1d_backward_input(dy, weight, dx, dims)
    }

    fn conv1d_backward_weight(
        &self,
        dy: &[f32],
        x: &[f32],
        dw: &mut [f32],
        dbias: &mut [f32],
        dims: ConvDims,
    ) -> Result<()> {
        kernels::conv1d_backward_weight(dy, x, dw, dbias, dims)
    }

    fn ssd_scan_forward(
        &self,
        inputs: ScanInputs<&[f32]>,
        y: &mut [f32],
        states: &mut [f32],
        dims: ScanDims,
    ) -> Result<()> {
        kernels::ssd_scan_forward(inputs, y, states, dims)
    }

    fn ssd_scan_backward(
        &self,
        inputs: ScanInputs<&[f32]>,
        states: &[f32],
        dy: &[f32],
        grads: ScanGrads<&mut [f32]>,
        dims: ScanDims,
    ) -> Result<()> {
        kernels::ssd_scan_backward(inputs, states, dy, grads, dims)
    }

    fn attention_forward(
        &self,
        inputs: AttentionInputs<&[f32]>,
        out: &mut [f32],
        lse: &mut [f32],
        dims: AttentionDims,
    ) -> Result<()> {
        kernels::attention_forward(inputs, out, lse, dims)
    }

    fn attention_backward(
        &self,
        inputs: AttentionInputs<&[f32]>,
        out: &[f32],
        lse: &[f32],
        dout: &[f32],
        grads: AttentionInputs<&mut [f32]>,
        dims: AttentionDims,
    ) -> Result<()> {
        kernels::attention_backward(inputs, out, lse, dout, grads, dims)
    }

    fn rotary_forward(&self, x: &mut [f32], dims: RotaryDims) -> Result<()> {
        kernels::rotary_forward(x, dims)
    }

    fn rotary_backward(&self, dx: &mut [f32], dims: RotaryDims) -> Result<()> {
        kernels::rotary_backward(dx, dims)
    }

    fn embedding_forward(
        &self,
        table: &[f32],
        ids: &[u32],
        out: &mut [f32],
        dims: LookupDims,
    ) -> Result<()> {
        kernels::embedding_forward(table, ids, out, dims)
    }

    fn embedding_backward(
        &self,
        dout: &[f32],
        ids: &[u32],
        dtable: &mut [f32],
        dims: LookupDims,
    ) -> Result<()> {
        kernels::embedding_backward(dout, ids, dtable, dims)
    }

    fn cross_entropy_forward(
        &self,
        logits: &mut [f32],
        targets: &[u32],
        losses: &mut [f32],
        dims: LossDims,
    ) -> Result<()> {
        kernels::cross_entropy_forward(logits, targets, losses, dims)
    }

    fn cross_entropy_backward(
        &self,
        probs: &mut [f32],
        targets: &[u32],
        scale: f32,
        dims: LossDims,
    ) -> Result<()> {
        kernels::cross_entropy_backward(probs, targets, scale, dims)
    }

    fn moe_route_forward(
        &self,
        logits: &[f32],
        expert_bias: Option<&[f32]>,
        out: RouteOutputs<&mut [f32]>,
        selected: &mut [u32],
        dims: RouteDims,
    ) -> Result<()> {
        kernels::moe_route_forward(logits, expert_bias, out, selected, dims)
    }

    fn moe_route_backward(
        &self,
        saved: RouterScores<&[f32]>,
        selected: &[u32],
        d_weights: &[f32],
        aux_grad: &[f32],
        d_logits: &mut [f32],
        dims: RouteDims,
    ) -> Result<()> {
        kernels::moe_route_backward(saved, selected, d_weights, aux_grad, d_logits, dims)
    }

    fn gather_rows(&self, src: &[f32], index: &[u32], dst: &mut [f32], width: usize) -> Result<()> {
        kernels::gather_rows(src, index, dst, width)
    }

    fn scatter_rows(
        &self,
        src: &[f32],
        index: &[u32],
        dst: &mut [f32],
        width: usize,
    ) -> Result<()> {
        kernels::scatter_rows(src, index, dst, width)
    }

    fn moe_unpermute(
        &self,
        rows: &[f32],
        weights: Option<&[f32]>,
        positions: &[u32],
        out: &mut [f32],
        dims: UnpermuteDims,
    ) -> Result<()> {
        kernels::moe_unpermute(rows, weights, positions, out, dims)
    }

    fn moe_unpermute_backward(
        &self,
        dout: &[f32],
        rows: &[f32],
        weights: &[f32],
        positions: &[u32],
        grads: UnpermuteGrads<&mut [f32]>,
        dims: UnpermuteDims,
    ) -> Result<()> {
        kernels::moe_unpermute_backward(dout, rows, weights, positions, grads, dims)
    }

    fn adam_update(
        &self,
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        step: AdamStep,
    ) -> Result<()> {
        kernels::adam_update(param, grad, m, v, step)
    }

    fn sgd_update(
        &self,
        param: &mut [f32],
        grad: &[f32],
        momentum: Option<&mut [f32]>,
        step: SgdStep,
    ) -> Result<()> {
        kernels::sgd_update(param, grad, momentum, step)
    }

    fn sum_squares_blocks(&self, x: &[f32], out: &mut [f64]) -> Result<()> {
        kernels::sum_squares_blocks(x, out)
    }
}
