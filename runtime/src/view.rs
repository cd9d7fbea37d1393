//! Device buffers and views of them.
//!
//! A buffer is a flat array of one [`DType`] in device memory. Layers, the
//! FSDP engine and collectives pass around *views*: a buffer, an element
//! offset and a length. Views are plain handles, the same for every backend:
//! a GPU kernel launch takes a pointer and a length, and so does a view.
//!
//! Writable views ([`ViewMut`]) can be made from a shared reference to a
//! buffer. That is deliberate: buffers are shared between the lanes of a rank
//! (a unit's parameters are read by the compute lane's layers and the comm
//! lane's combine; a gradient buffer is written by one and reduced by the
//! other), and what orders those accesses is the lanes' events, not Rust
//! borrows or host locks, because on a GPU the kernels run long after the
//! host code that launched them returned. The CPU backend checks every
//! kernel's accesses at run time instead (`cpu::access`): two kernels that
//! overlap in time on overlapping elements, one of them writing, are an
//! error naming both, which is exactly the missing event that would corrupt
//! data on a GPU.

use crate::error::{Result, RuntimeError};
pub use hybridgen_dsl::plan::DType;
use std::ops::Range;

/// A device allocation: a flat array of `len` elements of one dtype.
pub trait DeviceBuffer: Send + Sync + 'static {
    fn len(&self) -> usize;
    fn dtype(&self) -> DType;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A host type that matches one [`DType`]: what uploads and downloads move.
pub trait Scalar: Copy + Default + Send + Sync + 'static {
    const DTYPE: DType;
}

impl Scalar for f32 {
    const DTYPE: DType = DType::F32;
}
impl Scalar for f64 {
    const DTYPE: DType = DType::F64;
}
impl Scalar for u32 {
    const DTYPE: DType = DType::U32;
}
impl Scalar for half::bf16 {
    const DTYPE: DType = DType::Bf16;
}

fn out_of_bounds(what: &str, range: &Range<usize>, len: usize) -> RuntimeError {
    RuntimeError::InvalidArgument(format!(
        "{what} {}..{} is out of bounds for a view of {len} elements",
        range.start, range.end
    ))
}

/// Elements `[offset, offset + len)` of a buffer, read-only.
pub struct View<'a, T> {
    buf: &'a T,
    offset: usize,
    len: usize,
}

impl<T> Clone for View<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for View<'_, T> {}

impl<T: DeviceBuffer> std::fmt::Debug for View<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "View({} [{}..{}])",
            self.buf.dtype(),
            self.offset,
            self.offset + self.len
        )
    }
}

impl<'a, T: DeviceBuffer> View<'a, T> {
    /// The whole buffer.
    pub fn whole(buf: &'a T) -> Self {
        View {
            buf,
            offset: 0,
            len: buf.len(),
        }
    }

    /// `buf[range]`, or an error when out of bounds.
    pub fn of(buf: &'a T, range: Range<usize>) -> Result<Self> {
        View::whole(buf).slice(range)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }

    /// The buffer this view is part of.
    pub fn buffer(&self) -> &'a T {
        self.buf
    }

    /// The elements of the buffer this view covers.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    /// Its length and dtype, as a kernel's check takes them.
    pub fn operand(&self) -> Operand {
        Operand::new(self.len, self.dtype())
    }

    /// `self[range]`.
    pub fn slice(self, range: Range<usize>) -> Result<View<'a, T>> {
        if range.start > range.end || range.end > self.len {
            return Err(out_of_bounds("slice", &range, self.len));
        }
        Ok(View {
            buf: self.buf,
            offset: self.offset + range.start,
            len: range.len(),
        })
    }
}

/// Elements `[offset, offset + len)` of a buffer, writable. Not `Copy`: a
/// layer hands a writable view on by reborrowing it ([`ViewMut::reborrow`]),
/// which keeps the Rust-level discipline of `&mut` inside one piece of work.
pub struct ViewMut<'a, T> {
    buf: &'a T,
    offset: usize,
    len: usize,
}

impl<T: DeviceBuffer> std::fmt::Debug for ViewMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ViewMut({} [{}..{}])",
            self.buf.dtype(),
            self.offset,
            self.offset + self.len
        )
    }
}

impl<'a, T: DeviceBuffer> ViewMut<'a, T> {
    /// The whole buffer, writable. Taking a writable view from a shared
    /// reference is sound because nothing touches device memory through a
    /// view except kernels, whose accesses the backend orders (GPU: lanes and
    /// events) or checks (CPU).
    pub fn whole(buf: &'a T) -> Self {
        ViewMut {
            buf,
            offset: 0,
            len: buf.len(),
        }
    }

    /// `buf[range]`, or an error when out of bounds.
    pub fn of(buf: &'a T, range: Range<usize>) -> Result<Self> {
        ViewMut::whole(buf).into_slice(range)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }

    pub fn buffer(&self) -> &'a T {
        self.buf
    }

    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    /// Its length and dtype, as a kernel's check takes them.
    pub fn operand(&self) -> Operand {
        Operand::new(self.len, self.dtype())
    }

    /// The same elements, read-only, for as long as this view is borrowed.
    pub fn as_view(&self) -> View<'_, T> {
        View {
            buf: self.buf,
            offset: self.offset,
            len: self.len,
        }
    }

    /// The same elements, writable, for a shorter borrow.
    pub fn reborrow(&mut self) -> ViewMut<'_, T> {
        ViewMut {
            buf: self.buf,
            offset: self.offset,
            len: self.len,
        }
    }

    /// `self[range]`, borrowed from this view.
    pub fn slice_mut(&mut self, range: Range<usize>) -> Result<ViewMut<'_, T>> {
        self.reborrow().into_slice(range)
    }

    /// `self[range]`, consuming this view.
    pub fn into_slice(self, range: Range<usize>) -> Result<ViewMut<'a, T>> {
        if range.start > range.end || range.end > self.len {
            return Err(out_of_bounds("slice", &range, self.len));
        }
        Ok(ViewMut {
            buf: self.buf,
            offset: self.offset + range.start,
            len: range.len(),
        })
    }

    /// Splits at `mid`, as `split_at_mut` does.
    pub fn split_at(self, mid: usize) -> Result<(ViewMut<'a, T>, ViewMut<'a, T>)> {
        if mid > self.len {
            return Err(out_of_bounds("split", &(mid..mid), self.len));
        }
        Ok((
            ViewMut {
                buf: self.buf,
                offset: self.offset,
                len: mid,
            },
            ViewMut {
                buf: self.buf,
                offset: self.offset + mid,
                len: self.len - mid,
            },
        ))
    }
}

/// The dtype rule of one kernel argument, checked before the kernel runs:
/// a kernel states what it takes, and anything else is an error naming the
/// kernel, the argument and both dtypes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DTypeRule {
    /// bf16 or f32 (computed in f32 either way).
    Float,
    /// Exactly this type.
    Exactly(DType),
}

impl DTypeRule {
    pub fn admits(self, dtype: DType) -> bool {
        match self {
            DTypeRule::Float => matches!(dtype, DType::Bf16 | DType::F32),
            DTypeRule::Exactly(d) => d == dtype,
        }
    }

    fn describe(self) -> String {
        match self {
            DTypeRule::Float => "bf16 or f32".into(),
            DTypeRule::Exactly(d) => d.to_string(),
        }
    }

    /// `Ok` when `dtype` is admitted, else an error for `kernel`'s `arg`.
    pub fn check(self, kernel: &str, arg: &str, dtype: DType) -> Result<()> {
        if self.admits(dtype) {
            Ok(())
        } else {
            Err(RuntimeError::InvalidArgument(format!(
                "kernel `{kernel}`: `{arg}` is {dtype}, but it takes {}",
                self.describe()
            )))
        }
    }
}

/// Two lengths that must agree (an upload's host slice and its view, a
/// copy's source and destination).
pub fn same_len(what: &str, a: usize, b: usize) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(RuntimeError::InvalidArgument(format!(
            "{what}: lengths differ ({a} vs {b})"
        )))
    }
}

/// Two arguments that must share a dtype (a matmul's A and B, a copy's
/// source and destination).
pub fn same_dtype(kernel: &str, (a, da): (&str, DType), (b, db): (&str, DType)) -> Result<()> {
    if da == db {
        Ok(())
    } else {
        Err(RuntimeError::InvalidArgument(format!(
            "kernel `{kernel}`: `{a}` is {da} but `{b}` is {db}; they must match (cast explicitly)"
        )))
    }
}

/// A kernel argument as the checks see it: its length and dtype, which are
/// the same facts on every device. Each kernel family's checks
/// (`crate::backend`'s modules) take these, so one check serves the CPU
/// and the GPU alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operand {
    pub len: usize,
    pub dtype: DType,
}

impl Operand {
    pub const fn new(len: usize, dtype: DType) -> Self {
        Operand { len, dtype }
    }

    /// `Ok` when it is bf16 or f32, else an error for `kernel`'s `arg`.
    pub fn float(self, kernel: &str, arg: &str) -> Result<()> {
        DTypeRule::Float.check(kernel, arg, self.dtype)
    }

    /// `Ok` when it is bf16, f32 or f64, else an error for `kernel`'s
    /// `arg`.
    pub fn any_float(self, kernel: &str, arg: &str) -> Result<()> {
        ensure(self.dtype.is_float(), || {
            format!(
                "kernel `{kernel}`: `{arg}` is {}, but it takes bf16, f32 or f64",
                self.dtype
            )
        })
    }

    /// `Ok` when it is `dtype`, else an error for `kernel`'s `arg`.
    pub fn exactly(self, dtype: DType, kernel: &str, arg: &str) -> Result<()> {
        DTypeRule::Exactly(dtype).check(kernel, arg, self.dtype)
    }

    /// `Ok` when it holds `want` elements, else an error saying which
    /// argument of which kernel is wrong.
    pub fn has_len(self, kernel: &str, arg: &str, want: usize) -> Result<()> {
        if self.len == want {
            Ok(())
        } else {
            Err(RuntimeError::InvalidArgument(format!(
                "{kernel}: `{arg}` has {} elements, expected {want}",
                self.len
            )))
        }
    }
}

/// `a * b * ...`, or an error naming `kernel` when the product overflows
/// (a size no view can have).
pub fn product(kernel: &str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| {
            RuntimeError::InvalidArgument(format!("{kernel}: size {factors:?} overflows"))
        })
}

/// `n` as a u32 (what an index view holds, or a kernel takes), or an error
/// naming `kernel` and `what` `n` counts.
pub fn as_u32(kernel: &str, what: &str, n: usize) -> Result<u32> {
    u32::try_from(n)
        .map_err(|_| RuntimeError::InvalidArgument(format!("{kernel}: {what} {n} overflows u32")))
}

/// `Ok` when `ok`, else an `InvalidArgument` error saying `message`.
pub fn ensure(ok: bool, message: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(RuntimeError::InvalidArgument(message()))
    }
}
