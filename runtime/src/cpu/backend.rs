//! `impl Backend for CpuBackend`: buffers in host memory ([`CpuBuf`]), and
//! kernels as the f32 loops in [`super::kernels`]. Each method registers its
//! views ([`KernelAccess`]: dtype rules and the hazard check), widens bf16
//! inputs, runs the loop, and rounds bf16 outputs once when it stores them,
//! which is where a GPU kernel rounds too. The loops stay plain functions on
//! `f32` slices that tests call directly.

use super::arena::{CpuArena, Fill};
use super::buffer::{CpuBuf, KernelAccess};
use super::kernels;
use crate::backend::{
    AuxLossDims, Backend, DeviceStats, ExpertBias, ExpertOrder, Precision, ReceivedDims, RouteDims,
    RouteOutputs, RoutedSlots, RouterScores, Slice, SliceMut, UnpermuteDims, UnpermuteGrads,
};
use crate::error::Result;
use crate::view::{DType, Scalar, same_dtype, same_len};
use half::bf16;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// What the CPU device has done ([`DeviceStats`]).
#[derive(Debug, Default)]
pub struct CpuCounters {
    allocations: AtomicU64,
    allocated_bytes: AtomicU64,
    host_reads: AtomicU64,
}

/// The CPU device, bound to one lane (whose name hazard errors carry).
/// Clones share the device's counters.
#[derive(Clone, Debug)]
pub struct CpuBackend {
    compute: DType,
    lane: Arc<str>,
    counters: Arc<CpuCounters>,
    /// Every arena, by number (made as they are asked for).
    arenas: Arc<Mutex<Vec<Arc<CpuArena>>>>,
    /// The arena this value allocates from.
    arena: Arc<CpuArena>,
}

impl Default for CpuBackend {
    /// f32 everywhere, not bound to a lane: tests and the CPU default.
    fn default() -> Self {
        CpuBackend::new(Precision::F32)
    }
}

impl CpuBackend {
    fn alloc_filled(&self, len: usize, dtype: DType, fill: Fill) -> Result<CpuBuf> {
        let (buf, grew) = CpuBuf::in_arena(&self.arena, len, dtype, fill)?;
        if grew {
            self.counters.allocations.fetch_add(1, Ordering::Relaxed);
            self.counters
                .allocated_bytes
                .fetch_add((len * dtype.bytes()) as u64, Ordering::Relaxed);
        }
        Ok(buf)
    }

    /// A device storing parameters and activations as `precision` says.
    pub fn new(precision: Precision) -> Self {
        let arena = Arc::new(CpuArena::default());
        CpuBackend {
            compute: precision.compute_dtype(),
            lane: Arc::from("host"),
            counters: Arc::new(CpuCounters::default()),
            arenas: Arc::new(Mutex::new(vec![arena.clone()])),
            arena,
        }
    }

    /// The same device, bound to lane `lane`.
    pub fn on_lane(&self, lane: &str) -> Self {
        CpuBackend {
            compute: self.compute,
            lane: Arc::from(lane),
            counters: self.counters.clone(),
            arenas: self.arenas.clone(),
            arena: self.arena.clone(),
        }
    }

    pub(crate) fn access(&self, kernel: &'static str) -> KernelAccess<'_> {
        KernelAccess::new(kernel, &self.lane)
    }
}

impl Backend for CpuBackend {
    type Buf = CpuBuf;
    type HostRead<T: Scalar> = Vec<T>;

    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn compute_dtype(&self) -> DType {
        self.compute
    }

    fn stats(&self) -> DeviceStats {
        let (in_use, peak) = self
            .arenas
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|a| a.use_words())
            .fold((0, 0), |(u, p), (a, b)| (u + a, p + b));
        DeviceStats {
            allocations: self.counters.allocations.load(Ordering::Relaxed),
            allocated_bytes: self.counters.allocated_bytes.load(Ordering::Relaxed),
            host_reads: self.counters.host_reads.load(Ordering::Relaxed),
            in_use_bytes: 8 * in_use as u64,
            peak_in_use_bytes: 8 * peak as u64,
        }
    }

    fn alloc(&self, len: usize, dtype: DType) -> Result<CpuBuf> {
        self.alloc_filled(len, dtype, Fill::Zero)
    }

    fn alloc_uninit(&self, len: usize, dtype: DType) -> Result<CpuBuf> {
        self.alloc_filled(len, dtype, Fill::Poison)
    }

    fn in_arena(&self, arena: usize) -> Self {
        let mut arenas = self.arenas.lock().unwrap_or_else(PoisonError::into_inner);
        while arenas.len() <= arena {
            arenas.push(Arc::new(CpuArena::default()));
        }
        CpuBackend {
            arena: arenas[arena].clone(),
            ..self.clone()
        }
    }

    fn upload<T: Scalar>(&self, src: &[T], dst: SliceMut<'_, Self>) -> Result<()> {
        let k = self.access("upload");
        let dst = k.typed_out::<T>("dst", dst)?;
        same_len("upload", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn download<T: Scalar>(&self, src: Slice<'_, Self>, dst: &mut [T]) -> Result<()> {
        let k = self.access("download");
        let src = k.typed_in::<T>("src", src)?;
        same_len("download", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        self.counters.host_reads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn start_download<T: Scalar>(&self, src: Slice<'_, Self>) -> Result<Vec<T>> {
        // The lane's work has run by now (the CPU backend computes at the
        // call), so the read is done at the start.
        let k = self.access("start_download");
        Ok(k.typed_in::<T>("src", src)?.to_vec())
    }

    fn finish_download<T: Scalar>(&self, read: Vec<T>, dst: &mut [T]) -> Result<()> {
        same_len("finish_download", read.len(), dst.len())?;
        dst.copy_from_slice(&read);
        self.counters.host_reads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn copy(&self, src: Slice<'_, Self>, dst: SliceMut<'_, Self>) -> Result<()> {
        let k = self.access("copy");
        same_dtype(k.kernel(), ("src", src.dtype()), ("dst", dst.dtype()))?;
        let src = k.bytes_in(src)?;
        let dst = k.bytes_out(dst)?;
        same_len("copy", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn cast(&self, src: Slice<'_, Self>, dst: SliceMut<'_, Self>) -> Result<()> {
        let k = self.access("cast");
        same_len("cast", src.len(), dst.len())?;
        match (src.dtype(), dst.dtype()) {
            (DType::F64, DType::F64) => k
                .typed_out::<f64>("dst", dst)?
                .copy_from_slice(k.typed_in::<f64>("src", src)?),
            (DType::F64, DType::Bf16) => {
                let src = k.typed_in::<f64>("src", src)?;
                let dst = k.typed_out::<bf16>("dst", dst)?;
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = bf16_from_f64(*s);
                }
            }
            (DType::F64, _) => {
                let src = k.typed_in::<f64>("src", src)?;
                let mut dst = k.f32_out("dst", dst)?;
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = *s as f32;
                }
            }
            (_, DType::F64) => {
                let src = k.f32_in("src", src)?;
                let dst = k.typed_out::<f64>("dst", dst)?;
                for (d, s) in dst.iter_mut().zip(src.iter()) {
                    *d = f64::from(*s);
                }
            }
            _ => {
                let src = k.f32_in("src", src)?;
                k.f32_out("dst", dst)?.copy_from_slice(&src);
            }
        }
        Ok(())
    }

    fn fill(&self, dst: SliceMut<'_, Self>, value: f32) -> Result<()> {
        let k = self.access("fill");
        if dst.dtype() == DType::F64 {
            k.typed_out::<f64>("dst", dst)?.fill(f64::from(value));
        } else {
            k.f32_out("dst", dst)?.fill(value);
        }
        Ok(())
    }

    fn zero(&self, dst: SliceMut<'_, Self>) -> Result<()> {
        let k = self.access("zero");
        k.bytes_out(dst)?.fill(0);
        Ok(())
    }

    fn moe_route_forward(
        &self,
        logits: Slice<'_, Self>,
        expert_bias: Option<ExpertBias<Slice<'_, Self>, SliceMut<'_, Self>>>,
        out: RouteOutputs<SliceMut<'_, Self>>,
        selected: SliceMut<'_, Self>,
        dims: RouteDims,
    ) -> Result<()> {
        let k = self.access("moe_route_forward");
        let expert_bias = match expert_bias {
            Some(b) => Some(ExpertBias {
                bias: k.typed_in::<f32>("expert_bias", b.bias)?,
                unbiased: k.typed_out::<u32>("unbiased", b.unbiased)?,
            }),
            None => None,
        };
        kernels::moe_route_forward(
            k.typed_in::<f32>("logits", logits)?,
            expert_bias,
            RouteOutputs {
                scores: k.typed_out::<f32>("scores", out.scores)?,
                weights: k.typed_out::<f32>("weights", out.weights)?,
                prob_sum: out
                    .prob_sum
                    .map(|p| k.typed_out::<f32>("prob_sum", p))
                    .transpose()?,
            },
            k.typed_out::<u32>("selected", selected)?,
            dims,
        )
    }

    fn moe_route_backward(
        &self,
        saved: RouterScores<Slice<'_, Self>>,
        selected: Slice<'_, Self>,
        d_weights: Slice<'_, Self>,
        aux_grad: Slice<'_, Self>,
        d_logits: SliceMut<'_, Self>,
        dims: RouteDims,
    ) -> Result<()> {
        let k = self.access("moe_route_backward");
        kernels::moe_route_backward(
            RouterScores {
                logits: k.typed_in::<f32>("logits", saved.logits)?,
                scores: k.typed_in::<f32>("scores", saved.scores)?,
            },
            k.typed_in::<u32>("selected", selected)?,
            k.typed_in::<f32>("d_weights", d_weights)?,
            k.typed_in::<f32>("aux_grad", aux_grad)?,
            k.typed_out::<f32>("d_logits", d_logits)?,
            dims,
        )
    }

    fn moe_expert_counts(
        &self,
        selected: Slice<'_, Self>,
        counts: SliceMut<'_, Self>,
        slots: RoutedSlots,
    ) -> Result<()> {
        let k = self.access("moe_expert_counts");
        kernels::moe_expert_counts(
            k.typed_in::<u32>("selected", selected)?,
            k.typed_out::<u32>("counts", counts)?,
            slots,
        )
    }

    fn moe_sort_by_expert(
        &self,
        selected: Slice<'_, Self>,
        counts: Slice<'_, Self>,
        out: ExpertOrder<SliceMut<'_, Self>>,
        slots: RoutedSlots,
    ) -> Result<()> {
        let k = self.access("moe_sort_by_expert");
        kernels::moe_sort_by_expert(
            k.typed_in::<u32>("selected", selected)?,
            k.typed_in::<u32>("counts", counts)?,
            ExpertOrder {
                positions: k.typed_out::<u32>("positions", out.positions)?,
                sources: k.typed_out::<u32>("sources", out.sources)?,
            },
            slots,
        )
    }

    fn moe_expert_major_order(
        &self,
        recv_counts: Slice<'_, Self>,
        order: SliceMut<'_, Self>,
        dims: ReceivedDims,
    ) -> Result<()> {
        let k = self.access("moe_expert_major_order");
        kernels::moe_expert_major_order(
            k.typed_in::<u32>("recv_counts", recv_counts)?,
            k.typed_out::<u32>("order", order)?,
            dims,
        )
    }

    fn moe_aux_loss_forward(
        &self,
        counts: Slice<'_, Self>,
        prob_sum: Slice<'_, Self>,
        loss: SliceMut<'_, Self>,
        dims: AuxLossDims,
    ) -> Result<()> {
        let k = self.access("moe_aux_loss_forward");
        kernels::moe_aux_loss_forward(
            k.typed_in::<u32>("counts", counts)?,
            k.typed_in::<f32>("prob_sum", prob_sum)?,
            k.typed_out::<f64>("loss", loss)?,
            dims,
        )
    }

    fn moe_aux_loss_backward(
        &self,
        counts: Slice<'_, Self>,
        aux_grad: SliceMut<'_, Self>,
        dims: AuxLossDims,
        scale: f32,
    ) -> Result<()> {
        let k = self.access("moe_aux_loss_backward");
        kernels::moe_aux_loss_backward(
            k.typed_in::<u32>("counts", counts)?,
            k.typed_out::<f32>("aux_grad", aux_grad)?,
            dims,
            scale,
        )
    }

    fn gather_rows(
        &self,
        src: Slice<'_, Self>,
        index: Slice<'_, Self>,
        dst: SliceMut<'_, Self>,
        width: usize,
    ) -> Result<()> {
        let k = self.access("gather_rows");
        same_dtype(k.kernel(), ("src", src.dtype()), ("dst", dst.dtype()))?;
        let index = k.typed_in::<u32>("index", index)?;
        let src = k.f32_in("src", src)?;
        kernels::gather_rows(&src, index, &mut k.f32_out("dst", dst)?, width)
    }

    fn scatter_rows(
        &self,
        src: Slice<'_, Self>,
        index: Slice<'_, Self>,
        dst: SliceMut<'_, Self>,
        width: usize,
    ) -> Result<()> {
        let k = self.access("scatter_rows");
        same_dtype(k.kernel(), ("src", src.dtype()), ("dst", dst.dtype()))?;
        let index = k.typed_in::<u32>("index", index)?;
        let src = k.f32_in("src", src)?;
        kernels::scatter_rows(&src, index, &mut k.f32_out("dst", dst)?, width)
    }

    fn moe_unpermute(
        &self,
        rows: Slice<'_, Self>,
        weights: Option<Slice<'_, Self>>,
        positions: Slice<'_, Self>,
        out: SliceMut<'_, Self>,
        dims: UnpermuteDims,
    ) -> Result<()> {
        let k = self.access("moe_unpermute");
        let rows = k.f32_in("rows", rows)?;
        let weights = weights
            .map(|w| k.typed_in::<f32>("weights", w))
            .transpose()?;
        let positions = k.typed_in::<u32>("positions", positions)?;
        kernels::moe_unpermute(&rows, weights, positions, &mut k.f32_out("out", out)?, dims)
    }

    fn moe_combine(
        &self,
        rows: Slice<'_, Self>,
        weights: Slice<'_, Self>,
        positions: Slice<'_, Self>,
        shared: Option<Slice<'_, Self>>,
        x: SliceMut<'_, Self>,
        dims: UnpermuteDims,
    ) -> Result<()> {
        let k = self.access("moe_combine");
        let rows = k.f32_in("rows", rows)?;
        let weights = k.typed_in::<f32>("weights", weights)?;
        let positions = k.typed_in::<u32>("positions", positions)?;
        let shared = shared.map(|s| k.f32_in("shared", s)).transpose()?;
        kernels::moe_combine(
            &rows,
            weights,
            positions,
            shared.as_deref(),
            &mut k.f32_out("x", x)?,
            dims,
        )
    }

    fn moe_unpermute_backward(
        &self,
        dout: Slice<'_, Self>,
        rows: Slice<'_, Self>,
        weights: Slice<'_, Self>,
        positions: Slice<'_, Self>,
        grads: UnpermuteGrads<SliceMut<'_, Self>>,
        dims: UnpermuteDims,
    ) -> Result<()> {
        let k = self.access("moe_unpermute_backward");
        let (dout, rows) = (k.f32_in("dout", dout)?, k.f32_in("rows", rows)?);
        let weights = k.typed_in::<f32>("weights", weights)?;
        let positions = k.typed_in::<u32>("positions", positions)?;
        kernels::moe_unpermute_backward(
            &dout,
            &rows,
            weights,
            positions,
            UnpermuteGrads {
                rows: &mut k.f32_out("d_rows", grads.rows)?,
                weights: k.typed_out::<f32>("d_weights", grads.weights)?,
            },
            dims,
        )
    }
}

/// `v` rounded once to the nearest bf16, ties to even. Through f32 it would
/// round twice (a value just above a bf16 tie can land on the tie in f32 and
/// then round down), and `half`'s `bf16::from_f64` drops the low mantissa
/// bits before rounding, so: round to f32 *to odd* (an inexact result keeps
/// its last bit set, recording that bits were dropped; f32 keeps 16 more
/// bits than bf16, so that sticky bit decides ties correctly), then to bf16.
fn bf16_from_f64(v: f64) -> bf16 {
    let nearest = v as f32;
    let inexact = v.is_finite() && nearest.is_finite() && f64::from(nearest) != v;
    let to_odd = if inexact && nearest.to_bits() & 1 == 0 {
        // The other neighbour of `v` (one ulp towards it) is the odd one.
        let bits = nearest.to_bits();
        f32::from_bits(if f64::from(nearest).abs() < v.abs() {
            bits + 1
        } else {
            bits - 1
        })
    } else {
        nearest
    };
    bf16::from_f32(to_odd)
}

/// Rounds f32 values to bf16 and back: what storing them in a bf16 buffer
/// does (tests use it to build bf16 references).
pub fn round_bf16(values: &mut [f32]) {
    for v in values {
        *v = bf16::from_f32(*v).to_f32();
    }
}

#[cfg(test)]
mod tests {
    //! The wrappers' dtype rules for the kernels that take ids, losses and
    //! optimizer state (the loops themselves are tested in `kernels`).
    use super::*;
    use crate::view::{View, ViewMut};

    fn buf(b: &CpuBackend, len: usize, dtype: DType) -> CpuBuf {
        b.alloc(len, dtype).unwrap()
    }

    fn refused(result: Result<()>, kernel: &str, arg: &str) {
        let err = result.unwrap_err().to_string();
        assert!(
            err.contains(&format!("kernel `{kernel}`")) && err.contains(&format!("`{arg}`")),
            "{err}"
        );
    }

    #[test]
    fn accumulate_sum_takes_floats_into_one_f64() {
        let b = CpuBackend::default();
        let x = buf(&b, 3, DType::Bf16);
        b.upload(
            &[
                bf16::from_f32(1.5),
                bf16::from_f32(-0.25),
                bf16::from_f32(2.0),
            ],
            ViewMut::whole(&x),
        )
        .unwrap();
        let acc = buf(&b, 2, DType::F64);
        b.upload(&[10.0f64, 7.0], ViewMut::whole(&acc)).unwrap();
        b.accumulate_sum(View::whole(&x), ViewMut::of(&acc, 1..2).unwrap())
            .unwrap();
        let mut host = [0.0f64; 2];
        b.download(View::whole(&acc), &mut host).unwrap();
        assert_eq!(host, [10.0, 10.25]);
        let ids = buf(&b, 3, DType::U32);
        refused(
            b.accumulate_sum(View::whole(&ids), ViewMut::of(&acc, 0..1).unwrap()),
            "accumulate_sum",
            "x",
        );
        let f32_out = buf(&b, 1, DType::F32);
        refused(
            b.accumulate_sum(View::whole(&x), ViewMut::whole(&f32_out)),
            "accumulate_sum",
            "out",
        );
        assert!(
            b.accumulate_sum(View::whole(&x), ViewMut::whole(&acc))
                .is_err()
        );
    }

}
