//! Dense algebra: matmul (every transpose and accumulate combination, odd
//! sizes), the grouped matmul (expert-like row ranges, an empty one, mixed
//! flags; same bits as one matmul per problem), the strided batched matmul
//! (heads of interleaved tensors and blocks of a stacked weight in place,
//! pitches past the width, every transpose, accumulate, a shared operand,
//! batch 1 and 0, k = 0, and its layout refusals), axpy, scale, copy_cols,
//! column_sum, and the loss accumulators' `accumulate_sum`.

use super::Suite;
use super::case::{BadInput, Bufs, Expected, KernelCase, download_values, upload_values};
use super::reference::{self as r, round_to};
use crate::backend::{
    Backend, BatchLayout, BatchedMatmulDims, CopyCols, GroupedMatmul, MatmulDims, SegmentedGroup,
    SegmentedMatmul,
};
use crate::error::Result;
use crate::view::{DType, View, ViewMut};

/// f32 unit roundoff: tolerances are stated in multiples of it.
pub(super) const U: f64 = 1.0 / (1u64 << 24) as f64;

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    matmul(s);
    grouped_matmul(s);
    batched_matmul(s);
    segmented_matmul(s);
    axpy(s);
    scale(s);
    copy_cols(s);
    column_sum(s);
    accumulate_sum(s);
}

fn matmul<B: Backend>(s: &mut Suite<'_, B>) {
    let shapes = [
        (1, 1, 1),
        (3, 17, 33),
        (17, 3, 65),
        (33, 65, 3),
        (65, 33, 17),
        (130, 17, 33),
        (17, 130, 65),
        (1, 130, 130),
        (130, 1, 17),
        (5, 4, 0),
    ];
    let mut first = true;
    for (m, n, k) in shapes {
        for flags in 0..8u8 {
            let dims = MatmulDims {
                m,
                n,
                k,
                a_trans: flags & 1 != 0,
                b_trans: flags & 2 != 0,
                accumulate: flags & 4 != 0,
            };
            let name = format!(
                "m={m} n={n} k={k}{}{}{}",
                if dims.a_trans { " A^T" } else { "" },
                if dims.b_trans { " B^T" } else { "" },
                if dims.accumulate { " C+=" } else { "" }
            );
            let a = s.rng.values(m * k, -2.0, 2.0);
            let b = s.rng.values(k * n, -2.0, 2.0);
            let case = KernelCase::new("matmul", name)
                .input("A", a)
                .input("B", b)
                .same_dtype("A", "B")
                // k order-one products: the error of any summation order
                // stays well inside k * 16u * (|terms|).
                .tolerance(64.0 * U * (k as f64 + 1.0), 16.0 * U);
            let case = if dims.accumulate {
                case.inout("C", s.rng.values(m * n, -2.0, 2.0))
            } else {
                case.output("C", m * n)
            };
            let case = if std::mem::take(&mut first) {
                case.with_refusals()
            } else {
                case
            };
            s.check_kernel(
                case,
                |x| {
                    vec![Expected::new(
                        "C",
                        r::matmul(&x["A"], &x["B"], &x["C"], dims),
                    )]
                },
                |dev, b| {
                    dev.matmul(b.view("A")?, b.view("B")?, b.view_mut("C")?, dims)?;
                    Ok(vec![])
                },
            );
        }
    }
}

/// Elements an operand of a batched matmul needs: up to its last matrix's
/// last element.
fn batched_len(d: &BatchedMatmulDims, which: usize) -> usize {
    let (rows, width) = d.stored()[which];
    d.layouts()[which]
        .span(d.batch, rows, width)
        .expect("the suite's layouts are small")
}

/// The batched matmul by its definition: each matrix packed out of its
/// layout, the f64 matmul, written back where `C`'s matrix lies; every
/// other element of `C` as it was.
fn batched_reference(a: &[f64], b: &[f64], c0: &[f64], d: &BatchedMatmulDims) -> Vec<f64> {
    let mut c = c0.to_vec();
    let (m, n) = (d.dims.m, d.dims.n);
    for i in 0..d.batch {
        let pack = |v: &[f64], which: usize| -> Vec<f64> {
            let (rows, width) = d.stored()[which];
            (0..rows)
                .flat_map(|r| (0..width).map(move |col| (r, col)))
                .map(|(r, col)| v[d.at(which, i, r, col)])
                .collect()
        };
        let out = r::matmul(&pack(a, 0), &pack(b, 1), &pack(c0, 2), d.dims);
        for r in 0..m {
            for j in 0..n {
                c[d.at(2, i, r, j)] = out[r * n + j];
            }
        }
    }
    c
}

fn batched_matmul<B: Backend>(s: &mut Suite<'_, B>) {
    let flags = |m, n, k, a_trans, b_trans, accumulate| MatmulDims {
        m,
        n,
        k,
        a_trans,
        b_trans,
        accumulate,
    };
    let heads = BatchLayout::heads;
    let packed = BatchLayout::packed;
    let layout = |pitch, stride| BatchLayout { pitch, stride };
    let batched = |batch, dims, [a, b, c]: [BatchLayout; 3]| BatchedMatmulDims {
        batch,
        dims,
        a,
        b,
        c,
    };
    // The `D` layer's products (3 heads, 5 rows; a stacked weight of 4 key
    // and 2 value rows a head, 7 wide), then the other layouts.
    let cases: [(&str, BatchedMatmulDims); 10] = [
        (
            "absorbed queries: heads of A (pitch past k) times weight blocks into heads of C",
            batched(
                3,
                MatmulDims::linear_input_grad(5, 7, 4, false),
                [heads(3, 6), layout(7, 6 * 7), heads(3, 9)],
            ),
        ),
        (
            "value up-projection: B^T of weight blocks",
            batched(
                3,
                MatmulDims::linear(5, 7, 2),
                [heads(3, 7), layout(7, 6 * 7), heads(3, 2)],
            ),
        ),
        (
            "weight gradient: A^T of heads, C += into weight blocks",
            batched(
                3,
                MatmulDims::linear_weight_grad(5, 7, 4),
                [heads(3, 6), heads(3, 9), layout(7, 6 * 7)],
            ),
        ),
        (
            "both transposed, packed",
            batched(
                4,
                flags(6, 5, 3, true, true, false),
                [packed(3, 6), packed(5, 3), packed(6, 5)],
            ),
        ),
        (
            "both transposed, C += with gaps between matrices",
            batched(
                2,
                flags(3, 4, 33, true, true, true),
                [
                    layout(5, 33 * 5 + 2),
                    layout(35, 4 * 35),
                    layout(6, 3 * 6 + 1),
                ],
            ),
        ),
        (
            "batch 1, every pitch past its width",
            batched(
                1,
                flags(17, 9, 13, false, false, true),
                [layout(15, 0), layout(10, 0), layout(11, 0)],
            ),
        ),
        (
            "B shared by every matrix (stride 0)",
            batched(
                4,
                flags(5, 3, 65, false, true, false),
                [packed(5, 65), layout(65, 0), packed(5, 3)],
            ),
        ),
        (
            "k = 0: C zeroed where its matrices lie",
            batched(
                3,
                flags(2, 3, 0, false, false, false),
                [packed(2, 0), packed(0, 3), heads(3, 4)],
            ),
        ),
        (
            "k = 0, C +=: C as it was",
            batched(
                3,
                flags(2, 3, 0, false, false, true),
                [packed(2, 0), packed(0, 3), heads(3, 4)],
            ),
        ),
        (
            "batch 0: nothing",
            batched(
                0,
                flags(2, 3, 4, false, false, false),
                [packed(2, 4), packed(4, 3), packed(2, 3)],
            ),
        ),
    ];
    for (i, (name, dims)) in cases.into_iter().enumerate() {
        let lens = [0, 1, 2].map(|w| batched_len(&dims, w));
        let case = KernelCase::new("batched_matmul", name)
            .input("A", s.rng.values(lens[0], -2.0, 2.0))
            .input("B", s.rng.values(lens[1], -2.0, 2.0))
            // In and out whatever `accumulate` says: the elements between
            // `C`'s matrices must come back as they were.
            .inout("C", s.rng.values(lens[2], -2.0, 2.0))
            .same_dtype("A", "B")
            .free_len("A")
            .free_len("B")
            .free_len("C")
            .tolerance(64.0 * U * (dims.dims.k as f64 + 1.0), 16.0 * U);
        let case = if i == 0 { case.with_refusals() } else { case };
        s.check_kernel(
            case,
            move |x| {
                vec![Expected::new(
                    "C",
                    batched_reference(&x["A"], &x["B"], &x["C"], &dims),
                )]
            },
            move |dev: &B, b: &Bufs<B>| {
                dev.batched_matmul(b.view("A")?, b.view("B")?, b.view_mut("C")?, dims)?;
                Ok(vec![])
            },
        );
    }
    batched_refusals(s);
}

/// A batched matmul's layout refusals, on the absorbed queries' case: each
/// names the operand, and nothing is written.
fn batched_refusals<B: Backend>(s: &mut Suite<'_, B>) {
    let dims = BatchedMatmulDims {
        batch: 3,
        dims: MatmulDims::linear_input_grad(5, 7, 4, false),
        a: BatchLayout::heads(3, 6),
        b: BatchLayout {
            pitch: 7,
            stride: 6 * 7,
        },
        c: BatchLayout::heads(3, 9),
    };
    let lens = [0, 1, 2].map(|w| batched_len(&dims, w));
    let case = KernelCase::new("batched_matmul", "refusals")
        .input("A", s.rng.values(lens[0], -2.0, 2.0))
        .input("B", s.rng.values(lens[1], -2.0, 2.0))
        .inout("C", s.rng.values(lens[2], -2.0, 2.0))
        .same_dtype("A", "B");
    let bad: [(&str, &str, BatchedMatmulDims); 4] = [
        (
            "A's pitch below its rows' width",
            "A",
            BatchedMatmulDims {
                a: BatchLayout {
                    pitch: 3,
                    stride: 3,
                },
                ..dims
            },
        ),
        (
            "C's matrices overlapping (stride below the width)",
            "C",
            BatchedMatmulDims {
                c: BatchLayout {
                    pitch: 27,
                    stride: 6,
                },
                ..dims
            },
        ),
        (
            "C's matrices overlapping (one after another, too close)",
            "C",
            BatchedMatmulDims {
                c: BatchLayout {
                    pitch: 7,
                    stride: 4 * 7,
                },
                ..dims
            },
        ),
        (
            "B's last block past its view",
            "B",
            BatchedMatmulDims {
                b: BatchLayout {
                    pitch: 7,
                    stride: 7 * 7,
                },
                ..dims
            },
        ),
    ];
    for (what, operand, bad) in bad {
        s.check_bad_input(
            &case,
            BadInput::new(what).naming(&[operand]).nothing_written(),
            move |dev, b| {
                dev.batched_matmul(b.view("A")?, b.view("B")?, b.view_mut("C")?, bad)?;
                Ok(vec![])
            },
        );
    }
}

/// The names of problem `i`'s operands: the ones the dtype errors use.
const PROBLEM_ARGS: [[&str; 3]; 4] = [
    ["problems[0].A", "problems[0].B", "problems[0].C"],
    ["problems[1].A", "problems[1].B", "problems[1].C"],
    ["problems[2].A", "problems[2].B", "problems[2].C"],
    ["problems[3].A", "problems[3].B", "problems[3].C"],
];

fn grouped_matmul<B: Backend>(s: &mut Suite<'_, B>) {
    let (hidden, ffn) = (33, 7);
    let flags = |m, n, k, a_trans, b_trans, accumulate| MatmulDims {
        m,
        n,
        k,
        a_trans,
        b_trans,
        accumulate,
    };
    // The experts' GEMMs over their row ranges, one of them empty (an
    // expert nobody chose), then unrelated problems.
    // The shapes with every contiguous dimension a multiple of 8 (hidden
    // 136, width 200) are the ones a GPU's grouped kernel takes (Hopper):
    // rows past a 128-row tile, a single row, an empty expert, all four
    // layouts, adding into C.
    let (wide, width) = (136, 200);
    let groups: [(&str, Vec<MatmulDims>); 11] = [
        (
            "experts' forward, 5/0/17 rows",
            [5, 0, 17]
                .map(|rows| MatmulDims::linear(rows, hidden, ffn))
                .to_vec(),
        ),
        (
            "experts' input gradient, 5/0/17/1 rows",
            [5, 0, 17, 1]
                .map(|rows| MatmulDims::linear_input_grad(rows, hidden, ffn, false))
                .to_vec(),
        ),
        (
            "experts' weight gradient, 5/0/17/1 rows",
            [5, 0, 17, 1]
                .map(|rows| MatmulDims::linear_weight_grad(rows, hidden, ffn))
                .to_vec(),
        ),
        (
            "mixed shapes and flags",
            vec![
                flags(3, 65, 2, true, false, false),
                flags(1, 1, 130, false, true, true),
                flags(17, 3, 9, true, true, false),
            ],
        ),
        ("one problem", vec![flags(9, 4, 11, false, false, true)]),
        (
            "experts' forward, 136 -> 200, 5/0/130/1 rows",
            [5, 0, 130, 1]
                .map(|rows| MatmulDims::linear(rows, wide, width))
                .to_vec(),
        ),
        (
            "experts' input gradient, 200 -> 136, 130/1/0/17 rows, added",
            [130, 1, 0, 17]
                .map(|rows| MatmulDims::linear_input_grad(rows, wide, width, true))
                .to_vec(),
        ),
        (
            "experts' weight gradient, 136 x 200, 5/130/0/1 rows",
            [5, 130, 0, 1]
                .map(|rows| MatmulDims::linear_weight_grad(rows, wide, width))
                .to_vec(),
        ),
        (
            "both operands transposed, and every layout at once",
            vec![
                flags(72, 24, 136, true, true, false),
                flags(8, 16, 24, false, false, true),
                flags(136, 8, 72, true, false, false),
                flags(9, 144, 40, false, true, true),
            ],
        ),
        // One expert alone (nothing to spread over streams): a few rows,
        // then a whole tile's.
        (
            "one expert's forward, 5 rows",
            vec![MatmulDims::linear(5, wide, width)],
        ),
        (
            "one expert's forward, 128 rows",
            vec![MatmulDims::linear(128, wide, width)],
        ),
    ];
    for (i, (name, problems)) in groups.into_iter().enumerate() {
        let values: Vec<[Vec<f64>; 3]> = problems
            .iter()
            .map(|d| {
                [
                    s.rng.values(d.m * d.k, -2.0, 2.0),
                    s.rng.values(d.k * d.n, -2.0, 2.0),
                    s.rng.values(d.m * d.n, -2.0, 2.0),
                ]
            })
            .collect();
        // Every group runs twice: views offset by three elements (a GPU's
        // general path) and 16-byte aligned (where its fast paths, the
        // grouped kernel among them, take the kernel-shaped groups).
        for aligned in [false, true] {
            let case_name = if aligned {
                format!("{name}, 16-byte aligned")
            } else {
                name.to_string()
            };
            let k_max = problems.iter().map(|d| d.k).max().unwrap_or(0);
            let mut case = KernelCase::new("grouped_matmul", case_name)
                .tolerance(64.0 * U * (k_max as f64 + 1.0), 16.0 * U);
            for (p, (d, [a, b, c])) in problems.iter().zip(&values).enumerate() {
                let [a_name, b_name, c_name] = PROBLEM_ARGS[p];
                case = case.input(a_name, a.clone()).input(b_name, b.clone());
                case = if d.accumulate {
                    case.inout(c_name, c.clone())
                } else {
                    case.output(c_name, d.m * d.n)
                };
                // One type per operand for the whole group.
                case = case.same_dtype(b_name, PROBLEM_ARGS[0][0]);
                if p > 0 {
                    case = case
                        .same_dtype(a_name, PROBLEM_ARGS[0][0])
                        .same_dtype(c_name, PROBLEM_ARGS[0][2]);
                }
            }
            let case = if i == 0 { case.with_refusals() } else { case };
            let case = if aligned { case.aligned() } else { case };
            let reference_problems = problems.clone();
            let launch_problems = problems.clone();
            s.check_kernel(
                case,
                move |x| {
                    reference_problems
                        .iter()
                        .enumerate()
                        .map(|(p, &d)| {
                            let [a, b, c] = PROBLEM_ARGS[p];
                            Expected::new(c, r::matmul(&x[a], &x[b], &x[c], d))
                        })
                        .collect()
                },
                move |dev: &B, b: &Bufs<B>| {
                    let mut group: Vec<GroupedMatmul<'_, B>> = Vec::new();
                    for (p, &dims) in launch_problems.iter().enumerate() {
                        let [a, bn, c] = PROBLEM_ARGS[p];
                        group.push(GroupedMatmul::<B> {
                            a: b.view(a)?,
                            b: b.view(bn)?,
                            c: b.view_mut(c)?,
                            dims,
                        });
                    }
                    dev.grouped_matmul(group)?;
                    Ok(vec![])
                },
            );
        }
        grouped_same_bits(s, name, &problems, &values);
    }
    // No problems at all: nothing to do, and no error.
    let mut check = s.direct_check("grouped_matmul", "no problems".to_string());
    if let Err(e) = s.device.grouped_matmul(Vec::new()) {
        check
            .problems
            .push(format!("an empty group returned an error: {e}"));
    }
    s.record(check);
}

/// The names of a segmented matmul's per-segment operands.
const SEGMENT_B: [&str; 5] = [
    "problems[0].B[0]",
    "problems[0].B[1]",
    "problems[0].B[2]",
    "problems[0].B[3]",
    "problems[0].B[4]",
];
const SEGMENT_C: [&str; 5] = [
    "problems[0].C[0]",
    "problems[0].C[1]",
    "problems[0].C[2]",
    "problems[0].C[3]",
    "problems[0].C[4]",
];
/// Its shared operands, named as its errors name them.
const SEG_A: &str = "problems[0].A";
const SEG_B: &str = "problems[0].B";
const SEG_C: &str = "problems[0].C";

/// The experts' GEMMs with the rows of each expert in a device buffer:
/// rows problems (forward, input gradient, added to) and depth problems
/// (the weight gradient) over segments with no rows, one row, and rows
/// past a 128-row tile and not a multiple of it, against f64 references of
/// each segment's matmul. The 136/200 shapes are the ones a GPU's grouped
/// kernel takes (its segmented launches); the 33/7 ones take the general
/// path.
fn segmented_matmul<B: Backend>(s: &mut Suite<'_, B>) {
    let cases: [(&str, Vec<u32>, bool, MatmulDims); 7] = [
        (
            "experts' forward, 5/0/17/1 rows",
            vec![5, 0, 17, 1],
            false,
            MatmulDims::linear(0, 33, 7),
        ),
        (
            "experts' forward, 136 -> 200, 5/0/130/1/200 rows",
            vec![5, 0, 130, 1, 200],
            false,
            MatmulDims::linear(0, 136, 200),
        ),
        (
            "experts' input gradient, 200 -> 136, 130/1/0/17 rows, added",
            vec![130, 1, 0, 17],
            false,
            MatmulDims::linear_input_grad(0, 136, 200, true),
        ),
        (
            "experts' input gradient, 200 -> 136, 0/0/131 rows",
            vec![0, 0, 131],
            false,
            MatmulDims::linear_input_grad(0, 136, 200, false),
        ),
        (
            "experts' weight gradient, 5/0/17/1 rows",
            vec![5, 0, 17, 1],
            true,
            MatmulDims::linear_weight_grad(0, 33, 7),
        ),
        (
            "experts' weight gradient, 136 x 200, 5/130/0/1/70 rows",
            vec![5, 130, 0, 1, 70],
            true,
            MatmulDims::linear_weight_grad(0, 136, 200),
        ),
        (
            "one expert's weight gradient, 136 x 200, 64 rows",
            vec![64],
            true,
            MatmulDims::linear_weight_grad(0, 136, 200),
        ),
    ];
    for (i, (name, rows, depth, shape)) in cases.into_iter().enumerate() {
        let total: usize = rows.iter().map(|&n| n as usize).sum();
        let segments = rows.len();
        let dims = if depth {
            MatmulDims { k: total, ..shape }
        } else {
            MatmulDims { m: total, ..shape }
        };
        // Each segment's own matmul: (rows, its dims).
        let mut start = 0;
        let parts: Vec<(std::ops::Range<usize>, MatmulDims)> = rows
            .iter()
            .map(|&n| {
                let r = start..start + n as usize;
                start = r.end;
                let d = if depth {
                    MatmulDims { k: r.len(), ..dims }
                } else {
                    MatmulDims { m: r.len(), ..dims }
                };
                (r, d)
            })
            .collect();
        for aligned in [false, true] {
            let case_name = if aligned {
                format!("{name}, 16-byte aligned")
            } else {
                name.to_string()
            };
            let k_max = if depth { total } else { dims.k };
            let mut case = KernelCase::new("segmented_matmul", case_name)
                .tolerance(64.0 * U * (k_max as f64 + 1.0), 16.0 * U)
                .input_u32("rows", &rows)
                .input(SEG_A, s.rng.values(dims.m * dims.k, -2.0, 2.0));
            if depth {
                case = case
                    .input(SEG_B, s.rng.values(dims.k * dims.n, -2.0, 2.0))
                    .same_dtype(SEG_B, SEG_A);
                for name in &SEGMENT_C[..segments] {
                    let values = s.rng.values(dims.m * dims.n, -2.0, 2.0);
                    case = case.inout(name, values).same_dtype(name, SEGMENT_C[0]);
                }
            } else {
                for name in &SEGMENT_B[..segments] {
                    let values = s.rng.values(dims.k * dims.n, -2.0, 2.0);
                    case = case.input(name, values).same_dtype(name, SEG_A);
                }
                case = if dims.accumulate {
                    case.inout(SEG_C, s.rng.values(dims.m * dims.n, -2.0, 2.0))
                } else {
                    case.output(SEG_C, dims.m * dims.n)
                };
            }
            let case = if i == 0 { case.with_refusals() } else { case };
            let case = if aligned { case.aligned() } else { case };
            let reference_parts = parts.clone();
            s.check_kernel(
                case,
                move |x| {
                    if depth {
                        let per_row = |name: &str, width: usize, r: &std::ops::Range<usize>| {
                            x[name][r.start * width..r.end * width].to_vec()
                        };
                        return reference_parts
                            .iter()
                            .enumerate()
                            .map(|(e, (r, d))| {
                                let c = &x[SEGMENT_C[e]];
                                let want = if r.is_empty() {
                                    c.to_vec()
                                } else {
                                    let a = per_row(SEG_A, d.m, r);
                                    r::matmul(&a, &per_row(SEG_B, d.n, r), c, *d)
                                };
                                Expected::new(SEGMENT_C[e], want)
                            })
                            .collect();
                    }
                    let mut c = x[SEG_C].to_vec();
                    for (e, (r, d)) in reference_parts.iter().enumerate() {
                        if r.is_empty() {
                            continue;
                        }
                        let a = &x[SEG_A][r.start * d.k..r.end * d.k];
                        let c0 = &x[SEG_C][r.start * d.n..r.end * d.n];
                        let part = r::matmul(a, &x[SEGMENT_B[e]], c0, *d);
                        c[r.start * d.n..r.end * d.n].copy_from_slice(&part);
                    }
                    vec![Expected::new(SEG_C, c)]
                },
                move |dev: &B, b: &Bufs<B>| {
                    let problem: SegmentedGroup<'_, B> = if depth {
                        SegmentedMatmul::Depth {
                            a: b.view(SEG_A)?,
                            b: b.view(SEG_B)?,
                            c: SEGMENT_C[..segments]
                                .iter()
                                .map(|name| b.view_mut(name))
                                .collect::<Result<_>>()?,
                            dims,
                        }
                    } else {
                        SegmentedMatmul::Rows {
                            a: b.view(SEG_A)?,
                            b: SEGMENT_B[..segments]
                                .iter()
                                .map(|name| b.view(name))
                                .collect::<Result<_>>()?,
                            c: b.view_mut(SEG_C)?,
                            dims,
                        }
                    };
                    dev.segmented_matmul(b.view("rows")?, vec![problem])?;
                    Ok(vec![])
                },
            );
        }
    }
    // Counts that do not add up to the rows are refused (the CPU backend
    // reads them; a GPU clips at the rows instead, so only the reference
    // backend is held to it).
    if s.device.name() == "cpu" {
        let mut check = s.direct_check("segmented_matmul", "rows summing past M".to_string());
        let outcome = (|| -> Result<()> {
            let dev = s.device;
            let rows = dev.alloc(2, DType::U32)?;
            dev.upload(&[3u32, 2], ViewMut::whole(&rows))?;
            let (a, w, c) = (
                dev.alloc(4 * 2, DType::F32)?,
                dev.alloc(2 * 2, DType::F32)?,
                dev.alloc(4 * 2, DType::F32)?,
            );
            dev.segmented_matmul(
                View::whole(&rows),
                vec![SegmentedMatmul::Rows {
                    a: View::whole(&a),
                    b: vec![View::whole(&w), View::whole(&w)],
                    c: ViewMut::whole(&c),
                    dims: MatmulDims::linear(4, 2, 2),
                }],
            )
        })();
        match outcome {
            Ok(()) => check
                .problems
                .push("counts of 3 + 2 rows over 4 rows were accepted".into()),
            Err(e) if e.to_string().contains("sum to 5") => {}
            Err(e) => check.problems.push(format!("the wrong error: {e}")),
        }
        s.record(check);
    }
}

/// The grouped matmul's promise that grouping never changes a bit: each
/// problem's `C` the same bits as the same problem grouped alone, on the
/// same inputs in the compute dtype: its bits depend on it alone, never on
/// the other problems of the group (a GPU's grouped kernel may sum in
/// another order than [`Backend::matmul`], so not those bits).
fn grouped_same_bits<B: Backend>(
    s: &mut Suite<'_, B>,
    name: &str,
    problems: &[MatmulDims],
    values: &[[Vec<f64>; 3]],
) {
    let mut check = s.direct_check(
        "grouped_matmul",
        format!("{name}: the same bits as each problem grouped alone"),
    );
    let dtype = s.device.compute_dtype();
    let outcome = (|| -> Result<Vec<String>> {
        let dev = s.device;
        let upload = |v: &[f64]| -> Result<B::Buf> {
            let buf = dev.alloc(v.len(), dtype)?;
            let stored: Vec<f64> = v.iter().map(|&x| round_to(dtype, x)).collect();
            upload_values(dev, &stored, ViewMut::whole(&buf))?;
            Ok(buf)
        };
        let mut operands = Vec::new();
        for [a, b, c] in values {
            operands.push((upload(a)?, upload(b)?, upload(c)?, upload(c)?));
        }
        let group = problems
            .iter()
            .zip(&operands)
            .map(|(&dims, (a, b, grouped, _))| GroupedMatmul::<B> {
                a: View::whole(a),
                b: View::whole(b),
                c: ViewMut::whole(grouped),
                dims,
            })
            .collect();
        dev.grouped_matmul(group)?;
        let mut problems_found = Vec::new();
        for (p, (&dims, (a, b, grouped, alone))) in problems.iter().zip(&operands).enumerate() {
            dev.grouped_matmul(vec![GroupedMatmul::<B> {
                a: View::whole(a),
                b: View::whole(b),
                c: ViewMut::whole(alone),
                dims,
            }])?;
            let grouped = download_values(dev, View::whole(grouped))?;
            let alone = download_values(dev, View::whole(alone))?;
            if let Some(e) =
                (0..grouped.len()).find(|&e| grouped[e].to_bits() != alone[e].to_bits())
            {
                problems_found.push(format!(
                    "problem {p}: `C` element {e} is {:e} in the group but {:e} grouped alone",
                    grouped[e], alone[e]
                ));
            }
        }
        Ok(problems_found)
    })();
    match outcome {
        Ok(found) => check.problems.extend(found),
        Err(e) => check.problems.push(format!("returned an error: {e}")),
    }
    s.record(check);
}

fn axpy<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, len) in [0usize, 1, 37, 1000].into_iter().enumerate() {
        let alpha = s.rng.uniform(-2.0, 2.0) as f32;
        let case = KernelCase::new("axpy", format!("{len} elements, alpha {alpha}"))
            .input("x", s.rng.values(len, -2.0, 2.0))
            .inout("y", s.rng.values(len, -2.0, 2.0))
            .tolerance(8.0 * U, 8.0 * U);
        let case = if i == 1 { case.with_refusals() } else { case };
        s.check_kernel(
            case,
            |x| {
                let y = x["y"].iter().zip(&x["x"]);
                vec![Expected::new(
                    "y",
                    y.map(|(y, x)| y + f64::from(alpha) * x).collect(),
                )]
            },
            |dev, b| {
                dev.axpy(alpha, b.view("x")?, b.view_mut("y")?)?;
                Ok(vec![])
            },
        );
    }
}

fn scale<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, len) in [0usize, 1, 37, 1000].into_iter().enumerate() {
        let alpha = s.rng.uniform(-2.0, 2.0) as f32;
        let case = KernelCase::new("scale", format!("{len} elements, alpha {alpha}"))
            .inout("x", s.rng.values(len, -2.0, 2.0))
            .free_len("x")
            .tolerance(0.0, 2.0 * U);
        let case = if i == 1 { case.with_refusals() } else { case };
        s.check_kernel(
            case,
            |x| {
                let v = x["x"].iter().map(|v| v * f64::from(alpha)).collect();
                vec![Expected::new("x", v)]
            },
            |dev, b| {
                dev.scale(b.view_mut("x")?, alpha)?;
                Ok(vec![])
            },
        );
    }
}

fn copy_cols<B: Backend>(s: &mut Suite<'_, B>) {
    let blocks = [
        // rows, cols, src stride/offset, dst stride/offset
        (5, 3, 7, 2, 4, 1),
        (1, 1, 1, 0, 1, 0),
        (9, 8, 8, 0, 17, 9),
        (4, 5, 12, 7, 5, 0),
        (0, 3, 4, 1, 3, 0),
    ];
    let mut first = true;
    for (rows, cols, src_stride, src_offset, dst_stride, dst_offset) in blocks {
        for accumulate in [false, true] {
            let dims = CopyCols {
                rows,
                cols,
                src_stride,
                src_offset,
                dst_stride,
                dst_offset,
                accumulate,
            };
            let case = KernelCase::new(
                "copy_cols",
                format!(
                    "{rows} rows of {cols} from [{src_offset}..] of {src_stride} to \
                     [{dst_offset}..] of {dst_stride}{}",
                    if accumulate { ", accumulate" } else { "" }
                ),
            )
            .input("src", s.rng.values(rows * src_stride, -2.0, 2.0))
            .inout("dst", s.rng.values(rows * dst_stride, -2.0, 2.0))
            .same_dtype("src", "dst")
            .tolerance(0.0, 2.0 * U);
            let case = if std::mem::take(&mut first) {
                case.with_refusals()
            } else {
                case
            };
            if accumulate && rows == 5 {
                let bad = CopyCols {
                    src_offset: src_stride - cols + 1,
                    ..dims
                };
                s.check_refusal(&case, "a block past its row stride", &[], |dev, b| {
                    dev.copy_cols(b.view("src")?, b.view_mut("dst")?, bad)?;
                    Ok(vec![])
                });
            }
            s.check_kernel(
                case,
                |x| {
                    vec![Expected::new(
                        "dst",
                        r::copy_cols(&x["src"], &x["dst"], dims),
                    )]
                },
                |dev, b| {
                    dev.copy_cols(b.view("src")?, b.view_mut("dst")?, dims)?;
                    Ok(vec![])
                },
            );
        }
    }
}

fn column_sum<B: Backend>(s: &mut Suite<'_, B>) {
    for (i, (rows, cols)) in [(1, 1), (7, 33), (130, 5), (0, 4)].into_iter().enumerate() {
        let case = KernelCase::new("column_sum", format!("{rows} rows of {cols}"))
            .input("x", s.rng.values(rows * cols, -2.0, 2.0))
            .inout("out", s.rng.values(cols, -2.0, 2.0))
            .tolerance(16.0 * U * (rows as f64 + 1.0), 16.0 * U);
        let case = if i == 1 { case.with_refusals() } else { case };
        s.check_kernel(
            case,
            |x| {
                vec![Expected::new(
                    "out",
                    r::column_sum(&x["x"], &x["out"], rows, cols),
                )]
            },
            |dev, b| {
                dev.column_sum(b.view("x")?, b.view_mut("out")?, rows, cols)?;
                Ok(vec![])
            },
        );
    }
}

fn accumulate_sum<B: Backend>(s: &mut Suite<'_, B>) {
    // The f64 sum, then added. Its order is the backend's own (fixed by the
    // length), so the result may differ from index order by the rounding
    // any order of an f64 sum allows.
    let reference = |x: &[f64], out: f64| out + x.iter().fold(0.0, |sum, v| sum + v);
    let allowed =
        |x: &[f64], out: f64| super::reference::f64_sum_error(x.iter().copied().chain([out]));
    for (i, len) in [0usize, 1, 37, 1000, 4099].into_iter().enumerate() {
        let case = KernelCase::new("accumulate_sum", format!("{len} elements"))
            .input("x", s.rng.values(len, -2.0, 2.0))
            .inout_f64("out", vec![s.rng.uniform(-3.0, 3.0)])
            .also_takes("x", DType::F64)
            .free_len("x");
        let case = if i == 2 { case.with_refusals() } else { case };
        s.check_kernel(
            case,
            move |x| {
                let (sum, err) = (
                    reference(&x["x"], x["out"][0]),
                    allowed(&x["x"], x["out"][0]),
                );
                vec![Expected::new("out", vec![sum]).tolerance(err, 0.0)]
            },
            |dev, b| {
                dev.accumulate_sum(b.view("x")?, b.view_mut("out")?)?;
                Ok(vec![])
            },
        );
    }
    // f64 partial sums (values no f32 holds).
    for len in [3usize, 1000] {
        let case = KernelCase::new("accumulate_sum", format!("{len} f64 elements"))
            .input_f64(
                "x",
                s.rng
                    .values(len, -2.0, 2.0)
                    .iter()
                    .map(|v| v * (1.0 + 1e-12))
                    .collect(),
            )
            .inout_f64("out", vec![s.rng.uniform(-3.0, 3.0)])
            .also_takes("x", DType::F32);
        s.check_kernel(
            case,
            move |x| {
                let (sum, err) = (
                    reference(&x["x"], x["out"][0]),
                    allowed(&x["x"], x["out"][0]),
                );
                vec![Expected::new("out", vec![sum]).tolerance(err, 0.0)]
            },
            |dev, b| {
                dev.accumulate_sum(b.view("x")?, b.view_mut("out")?)?;
                Ok(vec![])
            },
        );
    }
}
