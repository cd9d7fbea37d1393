//! `impl Backend for CpuBackend`: memory as plain `Vec<f32>`, kernels as the
//! loops in [`super::kernels`].

use crate::backend::{Backend, Precision};
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
}
