//! Buckets: flat, padded buffers of one unit's parameters of one dtype and
//! kind (dense or expert), and the shards ranks own (docs/fsdp.md).
//!
//! Everything here but the shard-group size `W` is known at build time, so
//! offsets are plain numbers and the padded length and shard range are
//! `const fn`s of `W`.

use serde::Serialize;
use std::borrow::Cow;
use std::ops::Range;

/// Every parameter starts at a multiple of this many elements.
pub const PARAM_ALIGN: usize = 64;
/// A bucket is padded to a multiple of `W x SHARD_ALIGN` elements, so every
/// shard starts 256-byte aligned in bf16.
pub const SHARD_ALIGN: usize = 128;
/// Non-unit parameters are split into buckets of at most this many elements
/// (a larger parameter gets a bucket of its own).
pub const DEFAULT_NON_UNIT_BUCKET_CAP: usize = 40_000_000;

/// An element type: of a bucket's parameters in the plan (bf16 in mixed
/// precision), and of every buffer the runtime allocates (f32 master weights
/// and gradients, f64 accumulators, u32 token ids and routing indices).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    Bf16,
    F32,
    F64,
    U32,
}

impl DType {
    pub const ALL: [DType; 4] = [DType::Bf16, DType::F32, DType::F64, DType::U32];

    pub const fn bytes(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 | DType::U32 => 4,
            DType::F64 => 8,
        }
    }

    /// Whether the type holds real numbers (kernels compute on them in f32
    /// or f64); the others hold indices and counts.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::Bf16 | DType::F32 | DType::F64)
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::U32 => "u32",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `x` rounded up to a multiple of `to` (`to` > 0).
pub const fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// A bucket's padded length for shard-group size `world`, from the end of
/// its last parameter: a multiple of `world x 128`.
pub const fn padded_numel(end: usize, world: usize) -> usize {
    round_up(end, world * SHARD_ALIGN)
}

/// Elements each of `world` ranks owns.
pub const fn shard_numel(end: usize, world: usize) -> usize {
    padded_numel(end, world) / world
}

/// The elements rank `rank` of `world` owns: `[r*S, (r+1)*S)`.
pub const fn shard_range(end: usize, world: usize, rank: usize) -> Range<usize> {
    let s = shard_numel(end, world);
    rank * s..(rank + 1) * s
}

/// One bucket of a plan: its static layout. Only the shard-group size `W`
/// is missing, so the padded length and shards are functions of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Bucket {
    /// Forward order; reduce-scatters of a unit are issued in id order.
    pub id: usize,
    /// The unit the bucket belongs to; `None` for non-unit buckets.
    pub unit: Option<usize>,
    pub dtype: DType,
    /// Expert buckets are sharded over the expert-data-parallel group.
    pub expert: bool,
    /// Indices into [`Plan::params`](super::Plan::params), in offset order.
    pub params: Cow<'static, [usize]>,
    /// Elements of parameters (no alignment gaps, no padding).
    pub numel: usize,
    /// One past the last parameter's last element (alignment gaps included).
    pub end: usize,
    /// Megatron's padding unit: lcm of the parameters' row sizes
    /// (`shape[1:].numel()`); `None` if it overflows 64 bits.
    pub megatron_row_lcm: Option<u64>,
}

impl Bucket {
    /// Padded length when sharded over `world` ranks.
    pub const fn padded_numel(&self, world: usize) -> usize {
        padded_numel(self.end, world)
    }

    pub const fn shard_numel(&self, world: usize) -> usize {
        shard_numel(self.end, world)
    }

    pub const fn shard_range(&self, world: usize, rank: usize) -> Range<usize> {
        shard_range(self.end, world, rank)
    }

    /// Elements of padding and alignment gaps in our layout.
    pub const fn padding(&self, world: usize) -> usize {
        self.padded_numel(world) - self.numel
    }

    /// What Megatron's FSDP rule would pad this bucket to: parameters packed
    /// back to back, the total rounded up to a multiple of `W x lcm(rows)`.
    pub fn megatron_padded_numel(&self, world: usize) -> Option<u64> {
        let unit = self.megatron_row_lcm?.checked_mul(world as u64)?;
        (self.numel as u64).div_ceil(unit).checked_mul(unit)
    }
}

/// `lcm(a, b)`, `None` on overflow.
pub(crate) fn lcm(a: u64, b: u64) -> Option<u64> {
    fn gcd(mut a: u64, mut b: u64) -> u64 {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    }
    (a / gcd(a, b)).checked_mul(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_is_a_multiple_of_world_times_128() {
        assert_eq!(padded_numel(1, 1), 128);
        assert_eq!(padded_numel(128, 1), 128);
        assert_eq!(padded_numel(129, 2), 256);
        assert_eq!(padded_numel(1000, 4), 1024);
        assert_eq!(shard_range(1000, 4, 3), 768..1024);
        assert_eq!(padded_numel(0, 8), 0);
    }

    #[test]
    fn lcm_reports_overflow() {
        assert_eq!(lcm(4, 6), Some(12));
        assert_eq!(lcm(u64::MAX, u64::MAX - 1), None);
    }
}
