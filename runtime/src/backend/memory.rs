//! The checks of a backend's memory moves ([`Backend::upload`],
//! [`Backend::download`], [`Backend::copy`], [`Backend::cast`],
//! [`Backend::fill`]), written once for every backend: each backend's
//! method runs its check first.

#[cfg(doc)]
use super::Backend;
use crate::error::Result;
use crate::view::{DType, DTypeRule, Operand, same_dtype, same_len};

/// An upload of `host_len` elements of `host` into `dst`.
pub fn check_upload(host: DType, host_len: usize, dst: Operand) -> Result<()> {
    DTypeRule::Exactly(host).check("upload", "dst", dst.dtype)?;
    same_len("upload", host_len, dst.len)
}

/// A read of `src` into host memory of `host` (`kernel`: `download` or
/// `start_download`), `host_len` elements where the length is known.
pub fn check_download(
    kernel: &str,
    src: Operand,
    host: DType,
    host_len: Option<usize>,
) -> Result<()> {
    DTypeRule::Exactly(host).check(kernel, "src", src.dtype)?;
    match host_len {
        Some(len) => same_len(kernel, src.len, len),
        None => Ok(()),
    }
}

/// A copy: one dtype, one length.
pub fn check_copy(src: Operand, dst: Operand) -> Result<()> {
    same_dtype("copy", ("src", src.dtype), ("dst", dst.dtype))?;
    same_len("copy", src.len, dst.len)
}

/// A cast: bf16, f32 or f64 either side, one length.
pub fn check_cast(src: Operand, dst: Operand) -> Result<()> {
    same_len("cast", src.len, dst.len)?;
    src.any_float("cast", "src")?;
    dst.any_float("cast", "dst")
}

/// A fill: a bf16, f32 or f64 view.
pub fn check_fill(dst: Operand) -> Result<()> {
    dst.any_float("fill", "dst")
}
