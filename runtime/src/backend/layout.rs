//! Layout moves: strided column copies and the splits and joins of fused
//! attention projections.

/// Dimensions of [`Backend::copy_cols`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyCols {
    pub rows: usize,
    pub cols: usize,
    pub src_stride: usize,
    pub src_offset: usize,
    pub dst_stride: usize,
    pub dst_offset: usize,
    pub accumulate: bool,
}

/// Dimensions of [`Backend::qkv_split`] and [`Backend::qkv_join`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QkvDims {
    pub rows: usize,
    /// KV groups (key/value heads).
    pub groups: usize,
    /// Query heads per group.
    pub heads_per_group: usize,
    pub head_dim: usize,
}

impl QkvDims {
    /// Elements of one fused `qkv` row.
    pub const fn width(&self) -> usize {
        self.groups * (self.heads_per_group + 2) * self.head_dim
    }
}

/// Dimensions of [`Backend::mla_kv_split`] and [`Backend::mla_kv_join`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MlaKvDims {
    pub rows: usize,
    pub heads: usize,
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
}
