//! The chunked scan's plans and scratch against hand counts, and its sizes
//! against the kernel source's.

use super::*;
use crate::backend::Tokens;
use crate::cuda::launch::SCAN_CHUNKED_SCRATCH_BYTES;

fn dims(batch: usize, seq: usize, chunk: usize) -> ScanDims {
    ScanDims {
        tokens: Tokens::new(batch, seq),
        heads: 64,
        head_dim: 64,
        groups: 8,
        state: 128,
        chunk,
    }
}

/// The launcher's sizes are the kernels': a block launched with more
/// threads than a kernel's launch bound is refused on the GPU
/// (`ssd_chunk_scores_sums_mma` was, once), and a shape the launcher
/// admits past a kernel's arrays would run over them.
#[test]
fn the_launchers_sizes_are_the_kernels_defines() {
    let source = crate::cuda::launch::source_with_defines(
        "scan_chunked.cu",
        &[
            ("CHUNKED_MAX_CHUNK", CHUNKED_MAX_CHUNK),
            ("SUMS_COLUMNS", SUMS_COLUMNS),
            ("SUMS_MAX_HEADS", SUMS_MAX_HEADS),
            ("SUMS_WARPS", THREADS as usize / 32),
            ("MMA_SUMS_WARPS", MMA_SUMS_WARPS),
            ("MMA_TIMES_ROWS", MMA_TIMES_ROWS),
            ("MMA_TIMES_MAX_CHUNK", MMA_TIMES_MAX_CHUNK),
        ],
    );
    // The forward kernel's launch bound is a warp per 16 rows, which
    // is how MMA_TIMES_THREADS is defined here; the sums' staging
    // pitch is this one's.
    for needle in [
        "__launch_bounds__(MMA_TIMES_ROWS / 16 * 32)",
        "__launch_bounds__(MMA_SUMS_WARPS * 32, 3)",
        "#define MMA_STAGE_PITCH (SUMS_COLUMNS + 8)",
        "return (jp + 63) / 64 * 64 + 32;",
    ] {
        assert!(source.text.contains(needle), "{needle}");
    }
    // Every width's kernels are compiled (named in the source and its
    // entry points).
    for p in MMA_HEAD_WIDTHS {
        for which in [MmaScores::Sums, MmaScores::Times] {
            let name = which.kernel(p).unwrap();
            let macro_call = format!("({name}, {p})");
            assert!(source.text.contains(&macro_call), "{macro_call}");
            assert!(source.entry_points.contains(&name), "{name}");
        }
    }
}

#[test]
fn the_default_cap_takes_a_benchmark_sequence_in_one_slice() {
    // bench-hybrid-moe: one sequence of 4096 tokens, chunks of 256.
    let d = dims(1, 4096, 256);
    let plan = ScanChunkPlan::new(d, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
    assert_eq!(plan.items_per_slice, 16);
    assert!(plan.scratch_bytes(d) <= SCAN_CHUNKED_SCRATCH_BYTES);
    // Four sequences: slices of what fits, never past the cap.
    let d4 = dims(4, 4096, 256);
    let plan = ScanChunkPlan::new(d4, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
    assert!(
        plan.items_per_slice >= 8 && plan.items_per_slice < 64,
        "{plan:?}"
    );
    assert!(plan.scratch_bytes(d4) <= SCAN_CHUNKED_SCRATCH_BYTES);
}

#[test]
fn problems_the_chunked_path_does_not_take_go_to_the_sequential_kernels() {
    let d = dims(1, 4096, 256);
    // A cap below one chunk, a chunk past the limit, nothing to do.
    assert_eq!(ScanChunkPlan::new(d, 1 << 20), None);
    assert_eq!(ScanChunkPlan::new(d, 0), None);
    assert_eq!(ScanChunkPlan::new(dims(1, 4096, 2048), usize::MAX), None);
    assert_eq!(ScanChunkPlan::new(dims(0, 4096, 256), usize::MAX), None);
    let no_state = ScanDims { state: 0, ..d };
    assert_eq!(ScanChunkPlan::new(no_state, usize::MAX), None);
    let bad_groups = ScanDims { groups: 7, ..d };
    assert_eq!(ScanChunkPlan::new(bad_groups, usize::MAX), None);
}

/// `times_head_states` is one GEMM a (item, group) pair over the
/// group's J heads side by side: head j's `[Q, P]` block of the output
/// and `[P, N]` block of the states are where a GEMM of that head alone
/// reads and writes them (columns j P of the pair's `[Q, J P]` rows;
/// state slot `(item, g J + j)` from item `first`).
#[test]
fn a_groups_heads_are_one_gemm_over_their_side_by_side_blocks() {
    let d = dims(2, 1024, 256);
    let f32s = |len| GpuView::new(1 << 30, len, DType::F32);
    let shape = Shape::new(d, &[f32s(1)]);
    let (first, count) = (3usize, 4usize);
    let (out, states) = (f32s(1 << 26), GpuView::new(1 << 34, 1 << 26, DType::F32));
    let lhs = pairs(f32s(1 << 20), shape.n, shape.q * shape.n);
    let calls = std::cell::RefCell::new(Vec::new());
    let record = |g: StridedGemm| {
        calls.borrow_mut().push(g);
        Ok(())
    };
    shape
        .times_head_states(&record, (first, count, d.heads), lhs, states, out)
        .unwrap();
    let calls = calls.into_inner();
    assert_eq!(calls.len(), 1, "one GEMM for every head");
    let g = calls[0];
    assert_eq!(
        (g.batch, g.m, g.n, g.k),
        (count * d.groups, shape.q, shape.jp, shape.n)
    );
    assert!(!g.a_trans && g.b_trans);
    let at = |m: StridedMatrix, pair: usize, row: usize, col: usize| {
        m.ptr + 4 * (pair * m.stride + row * m.ld + col) as u64
    };
    for pair in 0..g.batch {
        let (item, group) = (pair / d.groups, pair % d.groups);
        for j in 0..shape.j {
            // A head's own GEMM: its columns of the output, its state.
            let head = (first + item) * d.heads + group * shape.j + j;
            let own_out = out.ptr + 4 * (pair * shape.q * shape.jp + j * shape.p) as u64;
            let own_state = states.ptr + 4 * (head * shape.pn) as u64;
            assert_eq!(
                at(g.c, pair, 0, j * shape.p),
                own_out,
                "pair {pair}, head {j}"
            );
            assert_eq!(g.c.ld, shape.jp);
            // B is stored [J P, N]: head j's rows start at row j P.
            assert_eq!(
                at(g.b, pair, j * shape.p, 0),
                own_state,
                "pair {pair}, head {j}"
            );
            assert_eq!(g.b.ld, shape.n);
        }
    }
}

/// With bf16 operands the GEMMs read bf16 matrices and write f32 ones,
/// and every offset into a bf16 view counts 2-byte elements: head j's
/// scores, its columns of x and the states of item `first` lie where
/// the kernels wrote them.
#[test]
fn bf16_operands_are_addressed_in_their_own_elements() {
    let d = dims(1, 4096, 256);
    let plan = ScanChunkPlan::new(d, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
    let items = 16;
    let scratch = GpuView::new(1 << 20, plan.scratch_len(d), DType::F32);
    let parts = Parts::new(scratch, d, plan, items, DType::Bf16, true);
    let shape = Shape::new(d, &[GpuView::new(0, 1, DType::Bf16)]);
    assert_eq!(shape.operand, DType::Bf16);
    let calls = std::cell::RefCell::new(Vec::new());
    let record = |g: StridedGemm| {
        calls.borrow_mut().push(g);
        Ok(())
    };
    let j = 3;
    shape
        .head_scores_times(&record, 2, (parts.m, false), parts.x_op, parts.t_acc)
        .unwrap();
    let first = 5;
    let states = parts.states_op.unwrap();
    let lhs = pairs(parts.c, shape.n, shape.q * shape.n);
    shape
        .times_head_states(&record, (first, 2, d.heads), lhs, states, parts.u)
        .unwrap();
    let calls = calls.into_inner();
    let (scores, product) = (calls[j], calls[shape.j]);
    let (q, p) = (shape.q, shape.p);
    assert_eq!(
        (scores.a.dtype, scores.b.dtype, scores.c.dtype),
        (DType::Bf16, DType::Bf16, DType::F32)
    );
    assert_eq!(scores.a.ptr, parts.m.ptr + (2 * j * q * q) as u64);
    assert_eq!(scores.b.ptr, parts.x_op.ptr + (2 * j * p) as u64);
    assert_eq!(scores.c.ptr, parts.t_acc.ptr + (4 * j * p) as u64);
    assert_eq!(
        (product.b.dtype, product.c.dtype),
        (DType::Bf16, DType::F32)
    );
    assert_eq!(
        product.b.ptr,
        states.ptr + (2 * first * d.heads * shape.pn) as u64
    );
}

#[test]
fn the_quad_kernels_take_aligned_scratch_and_shapes_of_whole_quads() {
    let takes = |d: ScanDims, base: u64| {
        let plan = ScanChunkPlan::new(d, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
        let items = d.tokens.batch * d.tokens.seq.div_ceil(d.chunk);
        let scratch = GpuView::new(base, plan.scratch_len(d), DType::F32);
        let [f32, bf16] =
            [DType::F32, DType::Bf16].map(|t| Parts::new(scratch, d, plan, items, t, true));
        assert_eq!(
            f32.quads, bf16.quads,
            "the operands' dtype does not decide it"
        );
        assert!(!f32.fused_sums || f32.quads);
        f32.quads
    };
    // The benchmark's scan, on an aligned scratch.
    assert!(takes(dims(1, 4096, 256), 1 << 20));
    // A scratch 4 bytes off, a chunk or a state that is not whole
    // quads: the element kernels.
    assert!(!takes(dims(1, 4096, 256), (1 << 20) + 4));
    assert!(!takes(dims(1, 4096, 250), 1 << 20));
    let odd_state = ScanDims {
        state: 130,
        ..dims(1, 4096, 256)
    };
    assert!(!takes(odd_state, 1 << 20));
    // Parts one item long (3 heads of 4 x 4 states) lie 12 bytes apart:
    // not every part is aligned.
    let narrow = ScanDims {
        tokens: Tokens::new(1, 4),
        heads: 3,
        head_dim: 4,
        groups: 1,
        state: 4,
        chunk: 4,
    };
    assert!(!takes(narrow, 1 << 20));
}

/// Every part lies inside the scratch and no two overlap, with f32 and
/// with bf16 operands (the bf16 ones share their f32 slots in halves).
#[test]
fn the_parts_tile_the_scratch_without_overlap() {
    for d in [dims(1, 4096, 256), dims(2, 1000, 96)] {
        let plan = ScanChunkPlan::new(d, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
        let items = d.tokens.batch * d.tokens.seq.div_ceil(d.chunk);
        let scratch = GpuView::new(1 << 20, plan.scratch_len(d), DType::F32);
        let end = scratch.ptr + (scratch.len * 4) as u64;
        for operand in [DType::F32, DType::Bf16] {
            let parts = Parts::new(scratch, d, plan, items, operand, true);
            assert_eq!(parts.bf16(), operand == DType::Bf16);
            let mut spans: Vec<(u64, u64)> = parts
                .all()
                .iter()
                .map(|v| (v.ptr, v.ptr + (v.len * v.dtype.bytes()) as u64))
                .collect();
            // With f32 operands, x's, dY's and the carries' operand
            // views are those arrays themselves.
            spans.sort_unstable();
            spans.dedup();
            for (start, stop) in &spans {
                assert!(
                    *start >= scratch.ptr && stop <= &end,
                    "{operand}: a part past the scratch"
                );
            }
            for pair in spans.windows(2) {
                assert!(pair[0].1 <= pair[1].0, "{operand}: parts overlap: {pair:?}");
            }
        }
    }
}

#[test]
fn the_scores_take_their_sums_where_blocks_of_columns_and_the_heads_fit() {
    let fused = |d: ScanDims| {
        let plan = ScanChunkPlan::new(d, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
        let items = d.tokens.batch * d.tokens.seq.div_ceil(d.chunk);
        let scratch = GpuView::new(1 << 20, plan.scratch_len(d), DType::F32);
        Parts::new(scratch, d, plan, items, DType::Bf16, true).fused_sums
    };
    // The benchmark's 8 heads a group in chunks of 256; 16 heads a group.
    assert!(fused(dims(1, 4096, 256)));
    assert!(fused(ScanDims {
        heads: 128,
        ..dims(1, 4096, 256)
    }));
    // 17 heads a group, chunks that are not whole blocks of 32 columns,
    // shapes the `_quads` kernels do not take.
    assert!(!fused(ScanDims {
        heads: 136,
        ..dims(1, 4096, 256)
    }));
    assert!(!fused(dims(1, 4096, 48)));
    assert!(!fused(ScanDims {
        state: 130,
        ..dims(1, 4096, 256)
    }));
}

#[test]
fn the_tensor_core_scores_take_heads_of_64_and_80_channels() {
    let takes = |d: ScanDims, reserved: bool| {
        let plan = ScanChunkPlan::new(d, usize::MAX).unwrap();
        let items = d.tokens.batch * d.tokens.seq.div_ceil(d.chunk);
        let scratch = GpuView::new(1 << 20, plan.scratch_len(d), DType::F32);
        let parts = Parts::new(scratch, d, plan, items, DType::Bf16, reserved);
        (parts.mma_sums, parts.mma_times)
    };
    // The benchmark model (8 heads of 64 a group), Nemotron-H 9B (16
    // heads of 80 a group), 16 heads of 64.
    let nine_b = ScanDims {
        heads: 128,
        head_dim: 80,
        ..dims(1, 4096, 256)
    };
    assert_eq!(takes(dims(1, 4096, 256), true), (true, true));
    assert_eq!(takes(nine_b, true), (true, true));
    assert_eq!(
        takes(
            ScanDims {
                heads: 128,
                ..dims(1, 4096, 256)
            },
            true
        ),
        (true, true)
    );
    // Without the shared memory reserved, the sums take the GEMMs.
    assert_eq!(takes(nine_b, false), (false, true));
    // A width without kernels; chunks of 512 (past the forward's
    // staging) and of 32 (not whole blocks of its rows).
    assert_eq!(
        takes(
            ScanDims {
                head_dim: 72,
                ..nine_b
            },
            true
        ),
        (false, false)
    );
    assert_eq!(
        takes(
            ScanDims {
                chunk: 512,
                ..nine_b
            },
            true
        ),
        (true, false)
    );
    assert_eq!(
        takes(
            ScanDims {
                chunk: 32,
                ..nine_b
            },
            true
        ),
        (true, false)
    );
    // f32 operands take the GEMMs.
    let plan = ScanChunkPlan::new(nine_b, SCAN_CHUNKED_SCRATCH_BYTES).unwrap();
    let scratch = GpuView::new(1 << 20, plan.scratch_len(nine_b), DType::F32);
    let f32_parts = Parts::new(scratch, nine_b, plan, 16, DType::F32, true);
    assert!(!f32_parts.mma_sums && !f32_parts.mma_times);
    // The shared memory of a block grows with the group, up to the
    // reservation at its widest.
    assert!(mma_sums_shared_bytes(8, 64) < 48 * 1024);
    assert!(mma_sums_shared_bytes(16, 64) < MMA_SUMS_MAX_SHARED);
    // 99 KiB: 32 rows of 1,312 bf16, 4 warps' 16 staging rows of 40,
    // and 16 heads' Lam, dt and 4 warps' column sums of 32.
    assert_eq!(MMA_SUMS_MAX_SHARED, 101_376);
}

#[test]
fn the_second_pass_starts_with_the_slice_the_first_left_prepared() {
    let plan = ScanChunkPlan { items_per_slice: 2 };
    assert_eq!(plan.slices(5).collect::<Vec<_>>(), [(0, 2), (2, 4), (4, 5)]);
    assert_eq!(
        plan.second_pass(5).collect::<Vec<_>>(),
        [(4, 5, true), (2, 4, false), (0, 2, false)]
    );
    // One slice: prepared once, by the first pass.
    let whole = ScanChunkPlan {
        items_per_slice: 16,
    };
    assert_eq!(whole.second_pass(16).collect::<Vec<_>>(), [(0, 16, true)]);
}

#[test]
fn the_scratch_is_the_carries_and_a_slice_of_items() {
    // 2 sequences of 100 steps in chunks of 64: 4 items.
    let d = ScanDims {
        tokens: Tokens::new(2, 100),
        heads: 6,
        head_dim: 10,
        groups: 3,
        state: 20,
        chunk: 64,
    };
    // Steps, wide, narrow, group and head scores, the row sums' partials
    // (2 blocks of 32 columns).
    let per_item =
        7 * 6 * 64 + 6 * 60 * 64 + 4 * 3 * 20 * 64 + 2 * 3 * 64 * 64 + 2 * 6 * 64 * 64 + 6 * 64 * 2;
    // Per chunk: carries, the states' and carries' bf16 copies, decay
    // and two partials a head.
    let global = 4 * 6 * (2 * 10 * 20 + 3);
    let plan = ScanChunkPlan::new(d, (global + 3 * per_item) * 4).unwrap();
    assert_eq!(plan.items_per_slice, 3);
    assert_eq!(plan.scratch_len(d), global + 3 * per_item);
    let all = ScanChunkPlan::new(d, usize::MAX).unwrap();
    assert_eq!(all.items_per_slice, 4);
    let cap = ScanChunkPlan::cap_for(d, 2).unwrap();
    assert_eq!(ScanChunkPlan::new(d, cap).unwrap().items_per_slice, 2);
    assert_eq!(ScanChunkPlan::new(d, cap - 1).unwrap().items_per_slice, 1);
}
