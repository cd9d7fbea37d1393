//! The CPU backend's kernels, one module a kernel family (mirroring
//! `crate::backend`'s): each implements its family's trait for
//! [`CpuBackend`](crate::cpu::CpuBackend) (registering the views, widening
//! bf16 inputs, rounding bf16 outputs once at the store) over f32 loops on
//! slices. The loops run on arguments the family's checks accepted, each
//! next to the maths it computes (documented on the
//! [`Backend`](crate::Backend) method) and, in its tests, next to a naive
//! reference. Loop orders are fixed and no loop uses threads, so equal
//! inputs give equal bits.

pub mod attention;
pub mod conv;
pub mod delta;
pub mod dense;
pub mod layout;
pub mod lookup;
pub mod moe;
pub mod norm;
pub mod optim;
pub mod scan;
pub mod sparse_attention;

use crate::error::Result;
use crate::view::ensure;

/// `x` as a row index below `rows`, or an error naming `what`: the range
/// checks of index data (token ids, targets, selected experts, positions),
/// which only the data itself can fail. The CPU makes them before a loop
/// writes anything; a GPU's kernels report them through its fault word.
pub(crate) fn checked_index(kernel: &str, what: &str, x: u32, rows: usize) -> Result<usize> {
    let i = x as usize;
    ensure(i < rows, || {
        format!("{kernel}: {what} {x} is out of range (there are {rows})")
    })?;
    Ok(i)
}

/// What the families' tests of the CPU backend's refusals share: a
/// buffer, and the assertion that a call was refused naming its kernel and
/// argument.
#[cfg(test)]
pub(crate) mod refusals {
    use crate::backend::Backend;
    use crate::cpu::{CpuBackend, CpuBuf};
    use crate::error::Result;
    use crate::view::DType;

    pub(crate) fn buf(b: &CpuBackend, len: usize, dtype: DType) -> CpuBuf {
        b.alloc(len, dtype).unwrap()
    }

    pub(crate) fn refused(result: Result<()>, kernel: &str, arg: &str) {
        let err = result.unwrap_err().to_string();
        assert!(
            err.contains(&format!("kernel `{kernel}`")) && err.contains(&format!("`{arg}`")),
            "{err}"
        );
    }
}
