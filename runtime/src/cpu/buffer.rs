//! CPU device memory: a buffer of any [`DType`] in host memory, and the run
//! time check that stands in for the GPU's rule "order every conflicting
//! access with an event".
//!
//! Views of one buffer can be handed to kernels on different lanes (see
//! `crate::view`), so a kernel may only turn a view into a Rust slice while
//! no other kernel uses overlapping elements in a conflicting way. Every
//! kernel therefore opens a [`KernelAccess`] and registers each view it
//! reads or writes; a registration that overlaps a write (or writes over a
//! read) of another kernel still running, or of the same kernel, fails with
//! an error naming both kernels and their lanes. On the CPU that error means
//! a missing event in the schedule, which on a GPU would silently corrupt
//! data; nothing ever waits here, so the check cannot hide a race by
//! serialising it.

use super::arena::{CpuArena, Fill, Region, Storage, new_storage, words_for};
use crate::error::{Result, RuntimeError};
use crate::view::{DType, DTypeRule, DeviceBuffer, View, ViewMut};
use half::bf16;
use std::cell::{RefCell, UnsafeCell};
use std::ops::{Deref, DerefMut, Range};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

/// A kernel's use of some elements of a buffer.
#[derive(Clone, Debug)]
struct Access {
    elements: Range<usize>,
    write: bool,
    /// Which kernel call holds it (one call may hold several accesses).
    call: u64,
    kernel: &'static str,
    lane: String,
}

/// One CPU allocation. Storage is `u64` words, so every dtype is aligned.
pub struct CpuBuf {
    id: u64,
    dtype: DType,
    len: usize,
    memory: Memory,
    active: Mutex<Vec<Access>>,
}

/// Where a buffer's words are: its own allocation, or a region of an arena
/// that takes it back when the buffer is dropped.
enum Memory {
    Own(Storage),
    Arena {
        arena: Arc<CpuArena>,
        region: Region,
    },
}

impl Drop for CpuBuf {
    fn drop(&mut self) {
        if let Memory::Arena { arena, region } = &self.memory {
            arena.give(region);
        }
    }
}

// SAFETY: the words are only read or written through slices made by a
// `KernelAccess`, which registers the elements first and refuses any overlap
// with a conflicting registration of another thread (or of the same call),
// so no two live slices alias mutably.
unsafe impl Sync for CpuBuf {}

impl std::fmt::Debug for CpuBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuBuf#{}({} x {})", self.id, self.len, self.dtype)
    }
}

impl DeviceBuffer for CpuBuf {
    fn len(&self) -> usize {
        self.len
    }

    fn dtype(&self) -> DType {
        self.dtype
    }
}

impl CpuBuf {
    /// A zero-filled buffer with memory of its own; an error (not an abort)
    /// when the host cannot provide it.
    pub fn zeroed(len: usize, dtype: DType) -> Result<Self> {
        let words = words_for(len, dtype)?;
        let storage = new_storage(words, || format!("{len} x {dtype}"))?;
        Ok(CpuBuf::with_memory(Memory::Own(storage), len, dtype))
    }

    /// A zero-filled buffer in a region of `arena`, and whether the arena
    /// had to grow for it.
    pub(crate) fn in_arena(
        arena: &Arc<CpuArena>,
        len: usize,
        dtype: DType,
        fill: Fill,
    ) -> Result<(Self, bool)> {
        let words = words_for(len, dtype)?;
        let (region, grew) = arena.take(words, fill, || format!("{len} x {dtype}"))?;
        let memory = Memory::Arena {
            arena: arena.clone(),
            region,
        };
        Ok((CpuBuf::with_memory(memory, len, dtype), grew))
    }

    fn with_memory(memory: Memory, len: usize, dtype: DType) -> Self {
        CpuBuf {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            dtype,
            len,
            memory,
            active: Mutex::new(Vec::new()),
        }
    }

    /// A number naming this buffer in hazard messages.
    pub fn id(&self) -> u64 {
        self.id
    }

    fn base(&self) -> *mut u8 {
        match &self.memory {
            // `UnsafeCell<u64>` has the layout of `u64`; the cell makes
            // writing through a pointer derived from `&self` legal.
            Memory::Own(words) => UnsafeCell::raw_get(words.as_ptr()).cast::<u8>(),
            // SAFETY: the region lies inside its segment, which outlives
            // this buffer (the buffer holds the arena).
            Memory::Arena { region, .. } => unsafe { region.base.add(region.offset).cast::<u8>() },
        }
    }

    fn register(&self, access: Access) -> Result<()> {
        let mut active = self.active.lock().unwrap_or_else(PoisonError::into_inner);
        for other in active.iter() {
            let overlaps = other.elements.start < access.elements.end
                && access.elements.start < other.elements.end;
            if overlaps && (other.write || access.write) {
                let verb = |w: bool| if w { "writes" } else { "reads" };
                let message = if other.call == access.call {
                    format!(
                        "kernel `{}` {} elements {:?} of buffer #{} and also {} {:?} of it: \
                         one argument aliases another",
                        access.kernel,
                        verb(access.write),
                        access.elements,
                        self.id,
                        verb(other.write),
                        other.elements
                    )
                } else {
                    format!(
                        "hazard: kernel `{}` on the {} lane {} elements {:?} of buffer #{} while \
                         kernel `{}` on the {} lane {} {:?} of it; the schedule is missing an \
                         event between them",
                        access.kernel,
                        access.lane,
                        verb(access.write),
                        access.elements,
                        self.id,
                        other.kernel,
                        other.lane,
                        verb(other.write),
                        other.elements
                    )
                };
                return Err(RuntimeError::InvalidArgument(message));
            }
        }
        active.push(access);
        Ok(())
    }

    fn unregister(&self, call: u64) {
        let mut active = self.active.lock().unwrap_or_else(PoisonError::into_inner);
        active.retain(|a| a.call != call);
    }

    /// Elements `range` as `&[T]`. Only [`KernelAccess`] calls this, after
    /// registering the range.
    ///
    /// # Safety
    /// `T` must be the buffer's element type and the range registered for
    /// reading (or writing) for as long as the slice lives.
    unsafe fn slice<T>(&self, range: Range<usize>) -> &[T] {
        // SAFETY: in bounds (views are checked), aligned (u64 words), and the
        // caller holds a registration excluding concurrent writers.
        unsafe { std::slice::from_raw_parts(self.base().cast::<T>().add(range.start), range.len()) }
    }

    /// # Safety
    /// As [`Self::slice`], registered for writing.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut<T>(&self, range: Range<usize>) -> &mut [T] {
        // SAFETY: as above; the write registration excludes every other
        // reader and writer of these elements.
        unsafe {
            std::slice::from_raw_parts_mut(self.base().cast::<T>().add(range.start), range.len())
        }
    }
}

/// The registrations of one kernel call. Slices it hands out borrow it, so
/// they cannot outlive the registrations.
pub(crate) struct KernelAccess<'k> {
    kernel: &'static str,
    lane: &'k str,
    call: u64,
    held: RefCell<Vec<&'k CpuBuf>>,
}

impl Drop for KernelAccess<'_> {
    fn drop(&mut self) {
        for buf in self.held.get_mut().iter() {
            buf.unregister(self.call);
        }
    }
}

impl<'k> KernelAccess<'k> {
    pub(crate) fn new(kernel: &'static str, lane: &'k str) -> Self {
        KernelAccess {
            kernel,
            lane,
            call: NEXT_TOKEN.fetch_add(1, Ordering::Relaxed),
            held: RefCell::new(Vec::new()),
        }
    }

    fn hold(&self, buf: &'k CpuBuf, elements: Range<usize>, write: bool) -> Result<()> {
        buf.register(Access {
            elements,
            write,
            call: self.call,
            kernel: self.kernel,
            lane: self.lane.to_string(),
        })?;
        self.held.borrow_mut().push(buf);
        Ok(())
    }

    fn check(&self, arg: &str, rule: DTypeRule, dtype: DType) -> Result<()> {
        rule.check(self.kernel, arg, dtype)
    }

    /// A float view as f32 values: borrowed when stored in f32, widened from
    /// bf16 otherwise.
    pub(crate) fn f32_in(&self, arg: &str, view: View<'k, CpuBuf>) -> Result<F32In<'_>> {
        self.check(arg, DTypeRule::Float, view.dtype())?;
        let buf = view.buffer();
        self.hold(buf, view.range(), false)?;
        Ok(match view.dtype() {
            // SAFETY: registered for reading above; the slice borrows `self`.
            DType::F32 => F32In::Borrowed(unsafe { buf.slice::<f32>(view.range()) }),
            _ => F32In::Widened(
                // SAFETY: as above; the dtype was checked to be bf16.
                unsafe { buf.slice::<bf16>(view.range()) }
                    .iter()
                    .map(|v| v.to_f32())
                    .collect(),
            ),
        })
    }

    /// A float view written as f32 values: the storage itself when f32; for
    /// bf16 a widened copy rounded back into the storage when dropped (the
    /// one rounding of a bf16 output).
    pub(crate) fn f32_out(&self, arg: &str, view: ViewMut<'k, CpuBuf>) -> Result<F32Out<'_>> {
        self.check(arg, DTypeRule::Float, view.dtype())?;
        let buf = view.buffer();
        self.hold(buf, view.range(), true)?;
        Ok(match view.dtype() {
            // SAFETY: registered for writing above.
            DType::F32 => F32Out::Direct(unsafe { buf.slice_mut::<f32>(view.range()) }),
            _ => {
                // SAFETY: as above; bf16 checked.
                let target = unsafe { buf.slice_mut::<bf16>(view.range()) };
                let values = target.iter().map(|v| v.to_f32()).collect();
                F32Out::Narrowed { target, values }
            }
        })
    }

    /// A view of exactly `T`'s dtype, read.
    pub(crate) fn typed_in<T: crate::view::Scalar>(
        &self,
        arg: &str,
        view: View<'k, CpuBuf>,
    ) -> Result<&[T]> {
        self.check(arg, DTypeRule::Exactly(T::DTYPE), view.dtype())?;
        let buf = view.buffer();
        self.hold(buf, view.range(), false)?;
        // SAFETY: registered for reading; dtype checked.
        Ok(unsafe { buf.slice::<T>(view.range()) })
    }

    /// A view of exactly `T`'s dtype, written.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn typed_out<T: crate::view::Scalar>(
        &self,
        arg: &str,
        view: ViewMut<'k, CpuBuf>,
    ) -> Result<&mut [T]> {
        self.check(arg, DTypeRule::Exactly(T::DTYPE), view.dtype())?;
        let buf = view.buffer();
        self.hold(buf, view.range(), true)?;
        // SAFETY: registered for writing; dtype checked.
        Ok(unsafe { buf.slice_mut::<T>(view.range()) })
    }

    /// Raw bytes of a view of any dtype, read (copies, collectives).
    pub(crate) fn bytes_in(&self, view: View<'k, CpuBuf>) -> Result<&[u8]> {
        let buf = view.buffer();
        self.hold(buf, view.range(), false)?;
        let size = buf.dtype.bytes();
        let r = view.range();
        // SAFETY: registered for reading; byte ranges of those elements.
        Ok(unsafe { buf.slice::<u8>(r.start * size..r.end * size) })
    }

    /// Raw bytes of a view of any dtype, written.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn bytes_out(&self, view: ViewMut<'k, CpuBuf>) -> Result<&mut [u8]> {
        let buf = view.buffer();
        self.hold(buf, view.range(), true)?;
        let size = buf.dtype.bytes();
        let r = view.range();
        // SAFETY: registered for writing; byte ranges of those elements.
        Ok(unsafe { buf.slice_mut::<u8>(r.start * size..r.end * size) })
    }
}

/// f32 values of an input view.
pub(crate) enum F32In<'a> {
    Borrowed(&'a [f32]),
    Widened(Vec<f32>),
}

impl Deref for F32In<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            F32In::Borrowed(s) => s,
            F32In::Widened(v) => v,
        }
    }
}

/// f32 values of an output view; bf16 storage is written when dropped.
pub(crate) enum F32Out<'a> {
    Direct(&'a mut [f32]),
    Narrowed {
        target: &'a mut [bf16],
        values: Vec<f32>,
    },
}

impl Deref for F32Out<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            F32Out::Direct(s) => s,
            F32Out::Narrowed { values, .. } => values,
        }
    }
}

impl DerefMut for F32Out<'_> {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            F32Out::Direct(s) => s,
            F32Out::Narrowed { values, .. } => values,
        }
    }
}

impl Drop for F32Out<'_> {
    fn drop(&mut self) {
        if let F32Out::Narrowed { target, values } = self {
            for (t, v) in target.iter_mut().zip(values.iter()) {
                *t = bf16::from_f32(*v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_write_and_read_of_two_calls_is_a_hazard() {
        let buf = CpuBuf::zeroed(16, DType::F32).unwrap();
        let writer = KernelAccess::new("matmul", "compute");
        let _out = writer.f32_out("C", ViewMut::of(&buf, 0..8).unwrap());
        assert!(_out.is_ok());
        let reader = KernelAccess::new("all_gather", "comm");
        let err = reader
            .f32_in("shard", View::of(&buf, 4..12).unwrap())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("hazard"), "{err}");
        assert!(err.contains("`matmul` on the compute lane"), "{err}");
        // Disjoint elements are fine, and so are two readers.
        reader
            .f32_in("shard", View::of(&buf, 8..16).unwrap())
            .unwrap();
        let other = KernelAccess::new("copy", "comm");
        other.f32_in("src", View::of(&buf, 8..16).unwrap()).unwrap();
    }

    #[test]
    fn registrations_end_with_the_call() {
        let buf = CpuBuf::zeroed(4, DType::F32).unwrap();
        {
            let a = KernelAccess::new("fill", "compute");
            let _o = a.f32_out("dst", ViewMut::whole(&buf)).unwrap();
        }
        let b = KernelAccess::new("fill", "comm");
        b.f32_out("dst", ViewMut::whole(&buf)).unwrap();
    }

    #[test]
    fn aliased_arguments_of_one_call_are_refused() {
        let buf = CpuBuf::zeroed(8, DType::F32).unwrap();
        let a = KernelAccess::new("axpy", "compute");
        let _x = a.f32_in("x", View::of(&buf, 0..4).unwrap()).unwrap();
        let err = a
            .f32_out("y", ViewMut::of(&buf, 2..6).unwrap())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("aliases"), "{err}");
    }

    #[test]
    fn bf16_outputs_round_once_at_the_store() {
        let buf = CpuBuf::zeroed(2, DType::Bf16).unwrap();
        {
            let a = KernelAccess::new("fill", "compute");
            let mut out = a.f32_out("dst", ViewMut::whole(&buf)).unwrap();
            out[0] = 1.0 + 1.0 / 512.0; // not representable: rounds to even
            out[1] = 3.0;
        }
        let a = KernelAccess::new("read", "compute");
        let values = a.f32_in("src", View::whole(&buf)).unwrap();
        assert_eq!(&*values, &[1.0, 3.0]);
    }

    #[test]
    fn arena_buffers_come_back_zeroed_and_give_their_region_back() {
        let arena = Arc::new(CpuArena::new(crate::backend::ArenaGrowth::Quarter));
        let (a, grew) = CpuBuf::in_arena(&arena, 1000, DType::F32, Fill::Zero).unwrap();
        assert!(grew);
        {
            let k = KernelAccess::new("fill", "compute");
            k.f32_out("dst", ViewMut::whole(&a)).unwrap().fill(7.0);
        }
        drop(a);
        let (b, grew) = CpuBuf::in_arena(&arena, 990, DType::F32, Fill::Zero).unwrap();
        assert!(!grew);
        let k = KernelAccess::new("read", "compute");
        assert!(
            k.f32_in("src", View::whole(&b))
                .unwrap()
                .iter()
                .all(|&v| v == 0.0)
        );
    }

    #[test]
    fn dtype_rules_name_the_kernel_and_argument() {
        let buf = CpuBuf::zeroed(2, DType::U32).unwrap();
        let a = KernelAccess::new("matmul", "compute");
        let err = a.f32_in("A", View::whole(&buf)).err().unwrap().to_string();
        assert_eq!(
            err,
            "invalid argument: kernel `matmul`: `A` is u32, but it takes bf16 or f32"
        );
    }
}
