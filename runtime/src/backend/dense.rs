//! Dense algebra: matrix products (one, or many as one grouped call), the
//! element-wise sums and scalings built on them, column sums, and the f64
//! sum that loss accumulators are built from.
//!
//! A kernel of this family is written in three places: its [`Backend`]
//! method and its check here (the method in `dense_methods`, which the
//! trait expands; the check a `check_` function of the kernel's name), and
//! its [`DenseKernels`] method on each backend (`cpu::ops::dense`,
//! `cuda::ops::dense`).

#[cfg(doc)]
use super::Backend;
use super::{Slice, SliceMut};
use crate::error::{Result, RuntimeError};
use crate::view::{DType, DTypeRule, DeviceBuffer, Operand, View, ViewMut, product, same_dtype};

/// Dimensions of [`Backend::matmul`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulDims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_trans: bool,
    pub b_trans: bool,
    pub accumulate: bool,
}

impl MatmulDims {
    /// `y[rows, out] = x[rows, in] W^T` with `W` `[out, in]`.
    pub const fn linear(rows: usize, in_features: usize, out_features: usize) -> Self {
        MatmulDims {
            m: rows,
            n: out_features,
            k: in_features,
            a_trans: false,
            b_trans: true,
            accumulate: false,
        }
    }

    /// `dx[rows, in] (+)= dy[rows, out] W`.
    pub const fn linear_input_grad(
        rows: usize,
        in_features: usize,
        out_features: usize,
        accumulate: bool,
    ) -> Self {
        MatmulDims {
            m: rows,
            n: in_features,
            k: out_features,
            a_trans: false,
            b_trans: false,
            accumulate,
        }
    }

    /// `dW[out, in] += dy[rows, out]^T x[rows, in]`.
    pub const fn linear_weight_grad(rows: usize, in_features: usize, out_features: usize) -> Self {
        MatmulDims {
            m: out_features,
            n: in_features,
            k: rows,
            a_trans: true,
            b_trans: false,
            accumulate: true,
        }
    }
}

/// Where the matrices of one [`Backend::batched_matmul`] operand lie in
/// its view: element `(r, c)` of matrix `i` (as stored, row-major) at
/// `i * stride + r * pitch + c`. `pitch` (the leading dimension) is at least
/// the stored row's width; `stride` may be anything for `A` and `B` (0
/// shares one matrix across the batch), while `C`'s matrices must not
/// overlap. Head `h` of a `[rows, heads, dim]` tensor is `{ pitch: heads *
/// dim, stride: dim }` from the view's start; consecutive `[m, n]` blocks
/// are `{ pitch: n, stride: m * n }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BatchLayout {
    pub pitch: usize,
    pub stride: usize,
}

impl BatchLayout {
    /// Matrices of `rows` stored rows of `width` elements, one after
    /// another with no gap.
    pub const fn packed(rows: usize, width: usize) -> Self {
        BatchLayout {
            pitch: width,
            stride: rows * width,
        }
    }

    /// Head after head of a `[rows, heads, head_width]` tensor: each
    /// matrix is one head's `head_width`-wide row slices.
    pub const fn heads(heads: usize, head_width: usize) -> Self {
        BatchLayout {
            pitch: heads * head_width,
            stride: head_width,
        }
    }

    /// Elements from matrix 0's first to matrix `batch - 1`'s last, for
    /// matrices of `rows` stored rows of `width` (0 when there are none);
    /// `None` past `usize`.
    pub fn span(&self, batch: usize, rows: usize, width: usize) -> Option<usize> {
        if batch == 0 || rows == 0 || width == 0 {
            return Some(0);
        }
        let last_item = (batch - 1).checked_mul(self.stride)?;
        let last_row = (rows - 1).checked_mul(self.pitch)?;
        last_item.checked_add(last_row)?.checked_add(width)
    }

    /// Whether no element belongs to two matrices: the matrices one after
    /// another (each starts past the previous one's last element), or
    /// interleaved a row at a time (each row of every matrix inside one
    /// pitch, side by side).
    fn disjoint(&self, batch: usize, rows: usize, width: usize) -> bool {
        if batch <= 1 || rows == 0 || width == 0 {
            return true;
        }
        let one = (rows - 1).saturating_mul(self.pitch).saturating_add(width);
        let row_of_all = (batch - 1)
            .saturating_mul(self.stride)
            .saturating_add(width);
        self.stride >= one || (self.stride >= width && self.pitch >= row_of_all)
    }
}

/// Dimensions of [`Backend::batched_matmul`]: `batch` products of `dims`
/// (each as [`Backend::matmul`] with those dims), each operand's matrices
/// where its layout says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BatchedMatmulDims {
    pub batch: usize,
    pub dims: MatmulDims,
    pub a: BatchLayout,
    pub b: BatchLayout,
    pub c: BatchLayout,
}

impl BatchedMatmulDims {
    /// Stored rows and width of `A`, `B` and `C`'s matrices.
    pub fn stored(&self) -> [(usize, usize); 3] {
        let MatmulDims { m, n, k, .. } = self.dims;
        let a = if self.dims.a_trans { (k, m) } else { (m, k) };
        let b = if self.dims.b_trans { (n, k) } else { (k, n) };
        [a, b, (m, n)]
    }

    /// The layouts of `A`, `B` and `C`.
    pub fn layouts(&self) -> [BatchLayout; 3] {
        [self.a, self.b, self.c]
    }

    /// The offset of element `(r, c)` of operand `which`'s (0: A, 1: B, 2:
    /// C) matrix `i` in its view.
    pub fn at(&self, which: usize, i: usize, r: usize, c: usize) -> usize {
        let l = self.layouts()[which];
        i * l.stride + r * l.pitch + c
    }
}

/// How a GPU backend runs the MoE experts' GEMMs
/// ([`Backend::grouped_matmul`]'s bf16 problems). The CPU backend has one
/// path.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ExpertGemm {
    /// One cuBLAS GEMM a problem, dealt over three streams.
    Cublas,
    /// One launch of `grouped_gemm.cu` for every problem of a layout, on
    /// Hopper (TMA and `wgmma`; the faster on an H200: README, "How it is
    /// built"); elsewhere, and for problems it does not take, cuBLAS. The
    /// same bits as cuBLAS on the benchmark model.
    #[default]
    Grouped,
}

/// One problem of [`Backend::grouped_matmul`]: `c (+)= op(a) op(b)` as
/// [`Backend::matmul`] with `dims`.
#[derive(Debug)]
pub struct MatmulProblem<S, M> {
    pub a: S,
    pub b: S,
    pub c: M,
    pub dims: MatmulDims,
}

/// A [`MatmulProblem`] on `B`'s views.
pub type GroupedMatmul<'a, B> = MatmulProblem<Slice<'a, B>, SliceMut<'a, B>>;

/// One problem of [`Backend::segmented_matmul`]: a matmul over rows cut
/// into consecutive segments (one an expert) whose sizes sit in a device
/// buffer, so that no host needs them. `dims` is the whole problem's, its
/// row count (M for [`SegmentedMatmul::Rows`], K for
/// [`SegmentedMatmul::Depth`]) the sum over the segments; the per-segment
/// operand has one view a segment, empty segments included.
#[derive(Debug)]
pub enum SegmentedMatmul<S, M> {
    /// Variable M: `c[rows_e] (+)= a[rows_e] op(b[e])` for each segment
    /// `e`, with `a` `[m, k]` and `c` `[m, n]` (not transposed) and `b[e]`
    /// `[k, n]`, or `[n, k]` with `b_trans`. Rows of other segments are
    /// neither read into a segment's sums nor written by it.
    Rows {
        a: S,
        b: Vec<S>,
        c: M,
        dims: MatmulDims,
    },
    /// Variable K (a weight gradient): `c[e] += a[rows_e]^T b[rows_e]` for
    /// each segment `e`, with `a` `[k, m]`, `b` `[k, n]` and `c[e]` `[m,
    /// n]` (`a_trans`, not `b_trans`, accumulating). A segment without rows
    /// leaves its `c[e]` as it is.
    Depth {
        a: S,
        b: S,
        c: Vec<M>,
        dims: MatmulDims,
    },
}

/// A [`SegmentedMatmul`] on `B`'s views.
pub type SegmentedGroup<'a, B> = SegmentedMatmul<Slice<'a, B>, SliceMut<'a, B>>;

impl<S, M> SegmentedMatmul<S, M> {
    /// The whole problem's dimensions.
    pub fn dims(&self) -> MatmulDims {
        match self {
            SegmentedMatmul::Rows { dims, .. } | SegmentedMatmul::Depth { dims, .. } => *dims,
        }
    }

    /// The rows the segments share: M, or K for a depth problem.
    pub fn total_rows(&self) -> usize {
        match self {
            SegmentedMatmul::Rows { dims, .. } => dims.m,
            SegmentedMatmul::Depth { dims, .. } => dims.k,
        }
    }
}

/// The dense kernels as a backend implements them: each runs once
/// [`Backend`]'s method of the same name (without `_unchecked`) has checked
/// its arguments here, so their dtypes and lengths are right.
pub trait DenseKernels<Buf: DeviceBuffer> {
    fn matmul_unchecked(
        &self,
        a: View<'_, Buf>,
        b: View<'_, Buf>,
        c: ViewMut<'_, Buf>,
        dims: MatmulDims,
    ) -> Result<()>;

    fn grouped_matmul_unchecked(
        &self,
        problems: Vec<MatmulProblem<View<'_, Buf>, ViewMut<'_, Buf>>>,
    ) -> Result<()>;

    fn batched_matmul_unchecked(
        &self,
        a: View<'_, Buf>,
        b: View<'_, Buf>,
        c: ViewMut<'_, Buf>,
        dims: BatchedMatmulDims,
    ) -> Result<()>;

    fn segmented_matmul_unchecked(
        &self,
        rows: View<'_, Buf>,
        problems: Vec<SegmentedMatmul<View<'_, Buf>, ViewMut<'_, Buf>>>,
    ) -> Result<()>;

    fn axpy_unchecked(&self, alpha: f32, x: View<'_, Buf>, y: ViewMut<'_, Buf>) -> Result<()>;

    fn scale_unchecked(&self, x: ViewMut<'_, Buf>, alpha: f32) -> Result<()>;

    fn column_sum_unchecked(
        &self,
        x: View<'_, Buf>,
        out: ViewMut<'_, Buf>,
        rows: usize,
        cols: usize,
    ) -> Result<()>;

    fn accumulate_sum_unchecked(&self, x: View<'_, Buf>, out: ViewMut<'_, Buf>) -> Result<()>;
}

/// One matmul's operands: float dtypes, `A` and `B` alike (and, in a
/// group, like the first problem's: `group` is its `A` and `C` dtypes), and
/// lengths that fit the dimensions. `name` spells an operand in errors; it
/// runs only when there is one to report, so a grouped call formats
/// nothing when its operands are right.
fn check_operands(
    kernel: &str,
    name: impl Fn(&str) -> String,
    [a, b, c]: [Operand; 3],
    dims: MatmulDims,
    group: Option<(DType, DType)>,
) -> Result<()> {
    let MatmulDims { m, n, k, .. } = dims;
    let want = [
        product(kernel, &[m, k])?,
        product(kernel, &[k, n])?,
        product(kernel, &[m, n])?,
    ];
    let (ab, out) = group.unwrap_or((a.dtype, c.dtype));
    let right = [a, b, c].iter().all(|v| DTypeRule::Float.admits(v.dtype))
        && (a.dtype, b.dtype, c.dtype) == (ab, ab, out)
        && [a.len, b.len, c.len] == want;
    if right {
        return Ok(());
    }
    let names = ["A", "B", "C"].map(&name);
    if group.is_some() {
        let first = ["problems[0].A", "problems[0].C"];
        same_dtype(kernel, (first[0], ab), (&names[0], a.dtype))?;
        same_dtype(kernel, (first[0], ab), (&names[1], b.dtype))?;
        same_dtype(kernel, (first[1], out), (&names[2], c.dtype))?;
    }
    for (name, operand) in names.iter().zip([a, b, c]) {
        operand.float(kernel, name)?;
    }
    same_dtype(kernel, (&names[0], a.dtype), (&names[1], b.dtype))?;
    for ((name, operand), want) in names.iter().zip([a, b, c]).zip(want) {
        operand.has_len(kernel, name, want)?;
    }
    Ok(())
}

/// [`Backend::matmul`]'s arguments.
pub fn check_matmul(a: Operand, b: Operand, c: Operand, dims: MatmulDims) -> Result<()> {
    check_operands("matmul", str::to_string, [a, b, c], dims, None)
}

/// [`Backend::batched_matmul`]'s arguments: float `A` and `B` of one
/// dtype and a float `C`; each layout's pitch at least its stored row's
/// width; each view long enough for its last matrix (longer is fine: a
/// view of a whole weight may end past the last block it is read at);
/// `C`'s matrices disjoint.
pub fn check_batched_matmul(
    a: Operand,
    b: Operand,
    c: Operand,
    dims: BatchedMatmulDims,
) -> Result<()> {
    let k = "batched_matmul";
    let names = ["A", "B", "C"];
    for (name, operand) in names.iter().zip([a, b, c]) {
        operand.float(k, name)?;
    }
    same_dtype(k, ("A", a.dtype), ("B", b.dtype))?;
    let shapes = dims.stored();
    for (i, (name, operand)) in names.iter().zip([a, b, c]).enumerate() {
        let ((rows, width), layout) = (shapes[i], dims.layouts()[i]);
        if dims.batch == 0 || rows == 0 || width == 0 {
            continue;
        }
        if layout.pitch < width {
            return Err(RuntimeError::InvalidArgument(format!(
                "kernel `{k}`: `{name}`'s pitch {} is below its rows' width {width} (stored \
                 [{rows}, {width}]); give a pitch of at least {width}",
                layout.pitch
            )));
        }
        let span = layout.span(dims.batch, rows, width).ok_or_else(|| {
            RuntimeError::InvalidArgument(format!(
                "kernel `{k}`: `{name}`'s {} matrices of [{rows}, {width}] with pitch {} and \
                 stride {} address past usize",
                dims.batch, layout.pitch, layout.stride
            ))
        })?;
        if operand.len < span {
            return Err(RuntimeError::InvalidArgument(format!(
                "kernel `{k}`: `{name}` has {} elements, but its {} matrices of [{rows}, \
                 {width}] with pitch {} and stride {} reach element {span}; give a longer \
                 view or a smaller pitch or stride",
                operand.len, dims.batch, layout.pitch, layout.stride
            )));
        }
    }
    let (m, n) = (dims.dims.m, dims.dims.n);
    if !dims.c.disjoint(dims.batch, m, n) {
        return Err(RuntimeError::InvalidArgument(format!(
            "kernel `{k}`: `C`'s {} matrices of [{m}, {n}] with pitch {} and stride {} \
             overlap; give a stride of at least {} (one after another) or of at least {n} \
             with a pitch of at least {} (interleaved)",
            dims.batch,
            dims.c.pitch,
            dims.c.stride,
            (m.max(1) - 1) * dims.c.pitch + n,
            (dims.batch - 1) * dims.c.stride + n
        )));
    }
    Ok(())
}

/// [`Backend::grouped_matmul`]'s problems, each a matmul whose `A`s and
/// `B`s share the first problem's `A` dtype and whose `C`s share its `C`
/// dtype. (That the `C`s do not overlap is each backend's to check: it
/// takes where the views lie, not only their lengths.)
pub fn check_grouped_matmul(
    problems: impl IntoIterator<Item = MatmulProblem<Operand, Operand>>,
) -> Result<()> {
    let mut first = None;
    for (i, p) in problems.into_iter().enumerate() {
        let group = *first.get_or_insert((p.a.dtype, p.c.dtype));
        let name = |operand: &str| format!("problems[{i}].{operand}");
        check_operands("grouped_matmul", name, [p.a, p.b, p.c], p.dims, Some(group))?;
    }
    Ok(())
}

/// [`Backend::segmented_matmul`]'s arguments: `rows` a u32 count a
/// segment (at least one); each problem's shared operands sized by its
/// dims and its per-segment operand one view a segment, each sized as one
/// segment's matmul; a row problem not transposing A, a depth problem
/// transposing A alone and accumulating; one float dtype for every `A` and
/// `B` and one for every `C`, as in [`check_grouped_matmul`].
pub fn check_segmented_matmul(
    rows: Operand,
    problems: impl IntoIterator<Item = SegmentedMatmul<Operand, Operand>>,
) -> Result<()> {
    let k = "segmented_matmul";
    rows.exactly(DType::U32, k, "rows")?;
    let segments = rows.len;
    if segments == 0 {
        return Err(RuntimeError::InvalidArgument(format!(
            "kernel `{k}`: `rows` is empty; there must be one count a segment"
        )));
    }
    let mut group = None;
    for (i, p) in problems.into_iter().enumerate() {
        let dims = p.dims();
        let name = |operand: &str| format!("problems[{i}].{operand}");
        // `b`: the per-segment views; `c`: the other shared operand.
        let (a, b, c, depth) = match &p {
            SegmentedMatmul::Rows { a, b, c, .. } => (*a, b, c, false),
            SegmentedMatmul::Depth { a, b, c, .. } => (*a, c, b, true),
        };
        let per_segment = if depth { "C" } else { "B" };
        let layout_ok = if depth {
            dims.a_trans && !dims.b_trans && dims.accumulate
        } else {
            !dims.a_trans
        };
        if !layout_ok {
            let want = if depth {
                "a depth problem is a weight gradient: `a_trans`, not `b_trans`, accumulating"
            } else {
                "a row problem cuts A's stored rows: not `a_trans`"
            };
            return Err(RuntimeError::InvalidArgument(format!(
                "kernel `{k}`: `problems[{i}]` has a_trans {}, b_trans {}, accumulate {}; {want}",
                dims.a_trans, dims.b_trans, dims.accumulate
            )));
        }
        if b.len() != segments {
            return Err(RuntimeError::InvalidArgument(format!(
                "kernel `{k}`: `problems[{i}].{per_segment}` has {} views for {segments} \
                 segments; give one a segment, empty segments included",
                b.len()
            )));
        }
        let (m, n, kk) = (dims.m, dims.n, dims.k);
        let shared_len = |rows_first: usize, width: usize| product(k, &[rows_first, width]);
        let (ab, out) = *group.get_or_insert((a.dtype, if depth { b[0].dtype } else { c.dtype }));
        a.float(k, &name("A"))?;
        same_dtype(k, ("problems[0].A", ab), (&name("A"), a.dtype))?;
        a.has_len(k, &name("A"), product(k, &[m, kk])?)?;
        // The other shared operand: C of a row problem, B of a depth one.
        let (other, other_name) = (*c, if depth { "B" } else { "C" });
        other.float(k, &name(other_name))?;
        if depth {
            same_dtype(k, ("problems[0].A", ab), (&name("B"), other.dtype))?;
            other.has_len(k, &name("B"), shared_len(kk, n)?)?;
        } else {
            same_dtype(k, ("problems[0].C", out), (&name("C"), other.dtype))?;
            other.has_len(k, &name("C"), shared_len(m, n)?)?;
        }
        let segment_len = if depth {
            product(k, &[m, n])?
        } else {
            product(k, &[kk, n])?
        };
        for (e, v) in b.iter().enumerate() {
            let arg = format!("problems[{i}].{per_segment}[{e}]");
            v.float(k, &arg)?;
            let (first, want) = if depth {
                ("problems[0].C", out)
            } else {
                ("problems[0].A", ab)
            };
            same_dtype(k, (first, want), (&arg, v.dtype))?;
            v.has_len(k, &arg, segment_len)?;
        }
    }
    Ok(())
}

/// A [`SegmentedMatmul`] group as the grouped problems its segments make,
/// given the rows of each segment on the host (what a backend without a
/// kernel for device counts runs after reading them): every segment with
/// rows, in order; an error when the rows do not sum to a problem's.
pub fn segments_as_problems<'a, Buf: DeviceBuffer>(
    rows: &[u32],
    problems: Vec<SegmentedMatmul<View<'a, Buf>, ViewMut<'a, Buf>>>,
) -> Result<Vec<MatmulProblem<View<'a, Buf>, ViewMut<'a, Buf>>>> {
    let total: usize = rows.iter().map(|&n| n as usize).sum();
    let mut out = Vec::with_capacity(problems.len() * rows.len());
    for (i, p) in problems.into_iter().enumerate() {
        if p.total_rows() != total {
            return Err(RuntimeError::InvalidArgument(format!(
                "kernel `segmented_matmul`: the segments' rows sum to {total} but \
                 `problems[{i}]` has {} rows; give counts that add up to the rows the \
                 problems share (a count a segment, in the rows' order)",
                p.total_rows()
            )));
        }
        match p {
            SegmentedMatmul::Rows { a, b, mut c, dims } => {
                let mut start = 0;
                for (&n, b) in rows.iter().zip(b) {
                    let n = n as usize;
                    let (here, rest) = c.split_at(n * dims.n)?;
                    c = rest;
                    if n > 0 {
                        out.push(MatmulProblem {
                            a: a.slice(start * dims.k..(start + n) * dims.k)?,
                            b,
                            c: here,
                            dims: MatmulDims { m: n, ..dims },
                        });
                    }
                    start += n;
                }
            }
            SegmentedMatmul::Depth { a, b, c, dims } => {
                let mut start = 0;
                for (&n, c) in rows.iter().zip(c) {
                    let n = n as usize;
                    if n > 0 {
                        out.push(MatmulProblem {
                            a: a.slice(start * dims.m..(start + n) * dims.m)?,
                            b: b.slice(start * dims.n..(start + n) * dims.n)?,
                            c,
                            dims: MatmulDims { k: n, ..dims },
                        });
                    }
                    start += n;
                }
            }
        }
    }
    Ok(out)
}

/// [`Backend::axpy`]'s arguments.
pub fn check_axpy(x: Operand, y: Operand) -> Result<()> {
    let k = "axpy";
    x.float(k, "x")?;
    y.float(k, "y")?;
    y.has_len(k, "y", x.len)
}

/// [`Backend::scale`]'s argument.
pub fn check_scale(x: Operand) -> Result<()> {
    x.float("scale", "x")
}

/// [`Backend::column_sum`]'s arguments.
pub fn check_column_sum(x: Operand, out: Operand, rows: usize, cols: usize) -> Result<()> {
    let k = "column_sum";
    x.float(k, "x")?;
    out.float(k, "out")?;
    x.has_len(k, "x", product(k, &[rows, cols])?)?;
    out.has_len(k, "out", cols)
}

/// [`Backend::accumulate_sum`]'s arguments.
pub fn check_accumulate_sum(x: Operand, out: Operand) -> Result<()> {
    let k = "accumulate_sum";
    x.any_float(k, "x")?;
    out.exactly(DType::F64, k, "out")?;
    out.has_len(k, "out", 1)
}

/// [`Backend`]'s dense methods: each checks its arguments, then runs its
/// [`DenseKernels`] method.
macro_rules! dense_methods {
    () => {
        /// `C = op(A) op(B)`, or `C += op(A) op(B)` with `dims.accumulate`, with
        /// `op(A)` `[m, k]` and `op(B)` `[k, n]`, all row-major. `A` is stored
        /// `[m, k]`, or `[k, m]` when `a_trans`; `B` is stored `[k, n]`, or
        /// `[n, k]` when `b_trans`. A linear layer is `y = x W^T` (`b_trans`),
        /// its input gradient `dx = dy W`, its weight gradient `dW += dy^T x`
        /// (`a_trans`, accumulate); see [`MatmulDims::linear`] and friends.
        fn matmul(
            &self,
            a: Slice<'_, Self>,
            b: Slice<'_, Self>,
            c: SliceMut<'_, Self>,
            dims: MatmulDims,
        ) -> Result<()> {
            $crate::backend::dense::check_matmul(a.operand(), b.operand(), c.operand(), dims)?;
            self.matmul_unchecked(a, b, c, dims)
        }

        /// `dims.batch` independent [`Backend::matmul`]s of `dims.dims`, as
        /// one operation (on a GPU, one strided-batched cuBLAS GEMM): matrix
        /// `i` of each operand lies in its view as its [`BatchLayout`] says,
        /// so a head of a `[rows, heads, dim]` tensor or a block of a
        /// stacked weight is read and written in place, with no copy. Each
        /// product is the one [`Backend::matmul`] computes on those matrices
        /// with the same precision (the CPU: the same bits; a GPU: the same
        /// compute type, its own summation order), `C (+)= op(A_i) op(B_i)`
        /// with `accumulate`. `A` and `B` share a float dtype; `C` is bf16 or
        /// f32; views may be longer than their last matrix; `C`'s matrices
        /// must be disjoint and overlap no `A` or `B`.
        fn batched_matmul(
            &self,
            a: Slice<'_, Self>,
            b: Slice<'_, Self>,
            c: SliceMut<'_, Self>,
            dims: BatchedMatmulDims,
        ) -> Result<()> {
            $crate::backend::dense::check_batched_matmul(
                a.operand(),
                b.operand(),
                c.operand(),
                dims,
            )?;
            self.batched_matmul_unchecked(a, b, c, dims)
        }

        /// Many independent [`Backend::matmul`]s as one operation (with
        /// [`ExpertGemm::Grouped`] on Hopper, one kernel launch): each problem
        /// is the matmul its dims describe, and its bits depend on it alone
        /// (its operands and dims, never the other problems or their order), so
        /// grouping never changes a bit. Every `A` and `B` is of one float
        /// dtype (bf16 or f32) and every `C` of one float dtype, as one grouped
        /// GEMM call takes one type per operand; f32 accumulation.
        /// The `C` views must be pairwise disjoint (the CPU backend refuses
        /// overlapping ones) and none may overlap an `A` or `B`. The MoE experts
        /// run each of their GEMMs this way over their row ranges.
        fn grouped_matmul(&self, problems: Vec<GroupedMatmul<'_, Self>>) -> Result<()> {
            $crate::backend::dense::check_grouped_matmul(problems.iter().map(|p| MatmulProblem {
                a: p.a.operand(),
                b: p.b.operand(),
                c: p.c.operand(),
                dims: p.dims,
            }))?;
            self.grouped_matmul_unchecked(problems)
        }

        /// Matmuls whose rows are cut into segments by device counts
        /// (`rows`: u32, one a segment, summing to each problem's M, or K for
        /// a depth problem): the MoE experts' GEMMs without the host knowing
        /// how many rows each expert got. Each segment's product is the
        /// [`Backend::grouped_matmul`] problem its row range makes, with the
        /// same bits. The CPU backend reads the counts (its own memory) and
        /// refuses counts that do not sum to the rows; a GPU reads them in
        /// its kernel and clips a segment at the shared operands' rows, so
        /// nothing waits for the host.
        fn segmented_matmul(
            &self,
            rows: Slice<'_, Self>,
            problems: Vec<SegmentedGroup<'_, Self>>,
        ) -> Result<()> {
            $crate::backend::dense::check_segmented_matmul(
                rows.operand(),
                problems.iter().map(|p| match p {
                    SegmentedMatmul::Rows { a, b, c, dims } => SegmentedMatmul::Rows {
                        a: a.operand(),
                        b: b.iter().map(|v| v.operand()).collect(),
                        c: c.operand(),
                        dims: *dims,
                    },
                    SegmentedMatmul::Depth { a, b, c, dims } => SegmentedMatmul::Depth {
                        a: a.operand(),
                        b: b.operand(),
                        c: c.iter().map(|v| v.operand()).collect(),
                        dims: *dims,
                    },
                }),
            )?;
            self.segmented_matmul_unchecked(rows, problems)
        }

        /// `y += alpha x`.
        fn axpy(&self, alpha: f32, x: Slice<'_, Self>, y: SliceMut<'_, Self>) -> Result<()> {
            $crate::backend::dense::check_axpy(x.operand(), y.operand())?;
            self.axpy_unchecked(alpha, x, y)
        }

        /// `x *= alpha`.
        fn scale(&self, x: SliceMut<'_, Self>, alpha: f32) -> Result<()> {
            $crate::backend::dense::check_scale(x.operand())?;
            self.scale_unchecked(x, alpha)
        }

        /// `out[j] += sum_r x[r, j]` over `rows` rows of `cols` columns, rows in
        /// order (a bias gradient).
        fn column_sum(
            &self,
            x: Slice<'_, Self>,
            out: SliceMut<'_, Self>,
            rows: usize,
            cols: usize,
        ) -> Result<()> {
            $crate::backend::dense::check_column_sum(x.operand(), out.operand(), rows, cols)?;
            self.column_sum_unchecked(x, out, rows, cols)
        }

        /// `out[0] += sum_i x[i]`: the sum taken in f64 in an order fixed by the
        /// length alone (the CPU: index order from zero; a GPU: a fixed tree),
        /// then added to `out[0]`. `x` is bf16, f32 or f64; `out` is
        /// one f64 (a slot of a loss accumulator). Losses accumulate on the
        /// device this way and are read once per step.
        fn accumulate_sum(&self, x: Slice<'_, Self>, out: SliceMut<'_, Self>) -> Result<()> {
            $crate::backend::dense::check_accumulate_sum(x.operand(), out.operand())?;
            self.accumulate_sum_unchecked(x, out)
        }
    };
}
pub(super) use dense_methods;

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(len: usize) -> Operand {
        Operand::new(len, DType::F32)
    }

    #[test]
    fn a_bad_problem_is_named() {
        let problem = |c, dims| MatmulProblem {
            a: f32s(6),
            b: f32s(6),
            c: f32s(c),
            dims,
        };
        let short = [
            problem(4, MatmulDims::linear(2, 3, 2)),
            problem(3, MatmulDims::linear(2, 3, 2)),
        ];
        let err = check_grouped_matmul(short).unwrap_err().to_string();
        assert!(err.contains("problems[1].C"), "{err}");
        assert!(check_matmul(f32s(6), f32s(6), f32s(4), MatmulDims::linear(2, 3, 2)).is_ok());
    }
}
