//! `impl Backend for CpuBackend`: buffers in host memory ([`CpuBuf`]),
//! uploads, downloads, copies and casts. The kernels are in
//! [`super::ops`], one module a family: each registers its views
//! ([`KernelAccess`]: the hazard check), widens bf16 inputs, runs its loop,
//! and rounds bf16 outputs once when it stores them, which is where a GPU
//! kernel rounds too.

use super::arena::{CpuArena, Fill};
use super::buffer::{CpuBuf, KernelAccess};
use crate::backend::{
    ArenaGrowth, Backend, DeviceStats, Precision, ScratchCall, ScratchSettings, Slice, SliceMut,
    memory,
};
use crate::error::Result;
use crate::view::{DType, Scalar, same_len};
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
        let arena = Arc::new(CpuArena::new(ArenaGrowth::of_arena(0)));
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
        let (in_use, peak, reserved) = self
            .arenas
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|a| (a.use_words(), a.total_words()))
            .fold((0, 0, 0), |(u, p, r), ((a, b), t)| (u + a, p + b, r + t));
        DeviceStats {
            allocations: self.counters.allocations.load(Ordering::Relaxed),
            allocated_bytes: self.counters.allocated_bytes.load(Ordering::Relaxed),
            host_reads: self.counters.host_reads.load(Ordering::Relaxed),
            in_use_bytes: 8 * in_use as u64,
            peak_in_use_bytes: 8 * peak as u64,
            reserved_bytes: 8 * reserved as u64,
        }
    }

    fn kernel_scratch(_call: ScratchCall, _settings: ScratchSettings) -> u64 {
        0
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
            let growth = ArenaGrowth::of_arena(arenas.len());
            arenas.push(Arc::new(CpuArena::new(growth)));
        }
        CpuBackend {
            arena: arenas[arena].clone(),
            ..self.clone()
        }
    }

    fn upload<T: Scalar>(&self, src: &[T], dst: SliceMut<'_, Self>) -> Result<()> {
        memory::check_upload(T::DTYPE, src.len(), dst.operand())?;
        let k = self.access("upload");
        let dst = k.typed_out::<T>("dst", dst)?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn download<T: Scalar>(&self, src: Slice<'_, Self>, dst: &mut [T]) -> Result<()> {
        memory::check_download("download", src.operand(), T::DTYPE, Some(dst.len()))?;
        let k = self.access("download");
        let src = k.typed_in::<T>("src", src)?;
        dst.copy_from_slice(src);
        self.counters.host_reads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn start_download<T: Scalar>(&self, src: Slice<'_, Self>) -> Result<Vec<T>> {
        // The lane's work has run by now (the CPU backend computes at the
        // call), so the read is done at the start.
        memory::check_download("start_download", src.operand(), T::DTYPE, None)?;
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
        memory::check_copy(src.operand(), dst.operand())?;
        let k = self.access("copy");
        let src = k.bytes_in(src)?;
        let dst = k.bytes_out(dst)?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn cast(&self, src: Slice<'_, Self>, dst: SliceMut<'_, Self>) -> Result<()> {
        memory::check_cast(src.operand(), dst.operand())?;
        let k = self.access("cast");
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
        memory::check_fill(dst.operand())?;
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
    use crate::cpu::ops::refusals::{buf, refused};
    use crate::view::{View, ViewMut};

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
