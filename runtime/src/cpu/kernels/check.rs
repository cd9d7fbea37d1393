//! Size checks shared by the kernels: every mismatch becomes an
//! `InvalidArgument` naming the kernel and the view.

use crate::error::{Result, RuntimeError};

/// `a * b * ...`, or an error naming `what` when the product overflows.
pub(crate) fn product(what: &str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| RuntimeError::InvalidArgument(format!("{what}: size {factors:?} overflows")))
}

/// `len == want`, or an error saying which view of which kernel is wrong.
pub(crate) fn len(kernel: &str, view: &str, len: usize, want: usize) -> Result<()> {
    if len == want {
        Ok(())
    } else {
        Err(RuntimeError::InvalidArgument(format!(
            "{kernel}: `{view}` has {len} elements, expected {want}"
        )))
    }
}

/// An error unless `ok`.
pub(crate) fn ensure(ok: bool, message: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(RuntimeError::InvalidArgument(message()))
    }
}

/// `x` as a row index below `rows`.
pub(crate) fn index(kernel: &str, what: &str, x: u32, rows: usize) -> Result<usize> {
    let i = x as usize;
    ensure(i < rows, || {
        format!("{kernel}: {what} {x} is out of range (there are {rows})")
    })?;
    Ok(i)
}
