//! Memory operations: alloc (zeroed, even where a freed buffer was, in the
//! default arena and a micro-batch arena), upload
//! and download of every [`Scalar`] bit for bit, copy, cast between every
//! pair of float dtypes (rounding once to nearest even), fill and zero, each
//! on a view inside a larger buffer whose other elements must not change.

use super::Suite;
use super::case::{download_values, upload_values};
use super::reference::round_to;
use crate::backend::Backend;
use crate::error::Result;
use crate::view::{DType, DeviceBuffer, Scalar, View, ViewMut};
use half::bf16;
use std::panic::{AssertUnwindSafe, catch_unwind};

const FLOATS: [DType; 3] = [DType::Bf16, DType::F32, DType::F64];

pub(super) fn check<B: Backend>(s: &mut Suite<'_, B>) {
    compute_dtype(s);
    alloc(s);
    upload_download(s);
    copy(s);
    cast(s);
    fill(s);
    zero(s);
}

/// Records a check made of direct calls: `body` returns its problems, and
/// an error or a panic is one more.
fn direct<B: Backend>(
    s: &mut Suite<'_, B>,
    kernel: &'static str,
    case: String,
    body: impl FnOnce(&B) -> Result<Vec<String>>,
) {
    let mut check = s.direct_check(kernel, case);
    match catch_unwind(AssertUnwindSafe(|| body(s.device))) {
        Ok(Ok(problems)) => check.problems.extend(problems),
        Ok(Err(e)) => check.problems.push(format!("returned an error: {e}")),
        Err(_) => check.problems.push("panicked".to_string()),
    }
    s.record(check);
}

fn same_value(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// The first element of `got` that is not `want` bit for bit (any NaN
/// matching any NaN), as a problem.
fn exact(what: &str, got: &[f64], want: &[f64]) -> Vec<String> {
    if got.len() != want.len() {
        return vec![format!(
            "{what}: {} elements, expected {}",
            got.len(),
            want.len()
        )];
    }
    match (0..got.len()).find(|&i| !same_value(got[i], want[i])) {
        Some(i) => vec![format!(
            "{what}: element {i} is {:e}, expected {:e}",
            got[i], want[i]
        )],
        None => Vec::new(),
    }
}

/// A buffer of `dtype` holding `values` (each representable).
fn buffer<B: Backend>(dev: &B, dtype: DType, values: &[f64]) -> Result<B::Buf> {
    let buf = dev.alloc(values.len(), dtype)?;
    upload_values(dev, values, ViewMut::whole(&buf))?;
    Ok(buf)
}

/// Random contents for a buffer of `dtype`, exactly representable.
fn contents<B: Backend>(s: &mut Suite<'_, B>, dtype: DType, len: usize) -> Vec<f64> {
    (0..len)
        .map(|_| match dtype {
            DType::U32 => s.rng.below(1 << 20) as f64,
            d => round_to(d, s.rng.uniform(-3.0, 3.0)),
        })
        .collect()
}

fn compute_dtype<B: Backend>(s: &mut Suite<'_, B>) {
    let compute = s.device.compute_dtype();
    direct(s, "compute_dtype", format!("{compute}"), |_| {
        Ok(if matches!(compute, DType::Bf16 | DType::F32) {
            Vec::new()
        } else {
            vec![format!(
                "is {compute}; parameters and activations are bf16 or f32"
            )]
        })
    });
}

fn alloc<B: Backend>(s: &mut Suite<'_, B>) {
    // The default arena, and a micro-batch arena (`in_arena`), whose pool
    // hands a freed region straight back to the next request of its size.
    for arena in [0, 1] {
        alloc_in(s, arena);
    }
}

fn alloc_in<B: Backend>(s: &mut Suite<'_, B>, arena: usize) {
    for dtype in DType::ALL {
        for len in [0, 1, 37] {
            let dirty = contents(s, dtype, len);
            let case = format!("{len} x {dtype} in arena {arena}");
            direct(s, "alloc", case, |dev| {
                let dev = &dev.in_arena(arena);
                // Free a dirty buffer of the same size first: a caching
                // allocator hands its memory straight back.
                drop(buffer(dev, dtype, &dirty)?);
                let buf = dev.alloc(len, dtype)?;
                let mut problems = wrong_shape(&buf, len, dtype);
                let got = download_values(dev, View::whole(&buf))?;
                problems.extend(exact("contents", &got, &vec![0.0; len]));
                Ok(problems)
            });
            // Contents unspecified: the buffer is the asked shape and holds
            // what is written into it whole, on a freed dirty region too.
            let values = contents(s, dtype, len);
            let case = format!("{len} x {dtype} in arena {arena}, written whole");
            direct(s, "alloc_uninit", case, |dev| {
                let dev = &dev.in_arena(arena);
                drop(buffer(dev, dtype, &dirty)?);
                let buf = dev.alloc_uninit(len, dtype)?;
                let mut problems = wrong_shape(&buf, len, dtype);
                upload_values(dev, &values, ViewMut::whole(&buf))?;
                let got = download_values(dev, View::whole(&buf))?;
                problems.extend(exact("contents", &got, &values));
                Ok(problems)
            });
        }
    }
}

/// A problem when a new buffer is not the `len x dtype` asked for.
fn wrong_shape(buf: &impl DeviceBuffer, len: usize, dtype: DType) -> Vec<String> {
    if buf.len() == len && buf.dtype() == dtype {
        return Vec::new();
    }
    vec![format!(
        "the buffer is {} x {}, asked for {len} x {dtype}",
        buf.len(),
        buf.dtype()
    )]
}

/// `values` uploaded into the middle of a zeroed buffer and read back, whole
/// and as the view, bit for bit.
fn roundtrip<B: Backend, T: Scalar>(s: &mut Suite<'_, B>, values: Vec<T>, bits: fn(T) -> u64) {
    let n = values.len();
    direct(
        s,
        "upload",
        format!("{n} x {} into a view", T::DTYPE),
        |dev| {
            let buf = dev.alloc(n + 5, T::DTYPE)?;
            dev.upload(&values, ViewMut::of(&buf, 2..2 + n)?)?;
            let mut whole = vec![T::default(); n + 5];
            dev.download(View::whole(&buf), &mut whole)?;
            let mut view = vec![T::default(); n];
            dev.download(View::of(&buf, 2..2 + n)?, &mut view)?;
            // A started download sees the work before its start, not the
            // zeroing after it.
            let read = dev.start_download::<T>(View::of(&buf, 2..2 + n)?)?;
            dev.zero(ViewMut::whole(&buf))?;
            let mut started = vec![T::default(); n];
            dev.finish_download(read, &mut started)?;
            let mut problems = Vec::new();
            if let Some(i) = (0..n).find(|&i| bits(started[i]) != bits(values[i])) {
                problems.push(format!(
                    "a download started before the buffer was zeroed differs at element {i}"
                ));
            }
            let want: Vec<u64> = [T::default(); 2]
                .into_iter()
                .chain(values.iter().copied())
                .chain([T::default(); 3])
                .map(bits)
                .collect();
            if let Some(i) = (0..n + 5).find(|&i| bits(whole[i]) != want[i]) {
                problems.push(format!(
                    "the buffer read back differs at element {i} (bits {:#x}, expected {:#x})",
                    bits(whole[i]),
                    want[i]
                ));
            }
            if let Some(i) = (0..n).find(|&i| bits(view[i]) != bits(values[i])) {
                problems.push(format!("downloading the view differs at element {i}"));
            }
            Ok(problems)
        },
    );
}

fn upload_download<B: Backend>(s: &mut Suite<'_, B>) {
    let mut f32s = vec![
        1.5f32,
        -0.0,
        f32::MIN_POSITIVE / 4.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(0x7fc0_1234),
        f32::MAX,
    ];
    f32s.extend((0..30).map(|_| s.rng.uniform(-3.0, 3.0) as f32));
    roundtrip(s, f32s, |v| u64::from(v.to_bits()));
    let mut f64s = vec![
        1.0f64 / 3.0,
        -0.0,
        f64::MIN_POSITIVE / 8.0,
        f64::INFINITY,
        f64::from_bits(0x7ff8_0000_0000_1234),
    ];
    f64s.extend((0..30).map(|_| s.rng.uniform(-3.0, 3.0)));
    roundtrip(s, f64s, f64::to_bits);
    let mut u32s = vec![0u32, 1, u32::MAX, 0xdead_beef, 1 << 31];
    u32s.extend((0..30).map(|_| s.rng.next_u64() as u32));
    roundtrip(s, u32s, u64::from);
    let mut bf16s: Vec<bf16> = [0x3fc0u16, 0x8000, 0x0001, 0x7f80, 0xff80, 0x7fc1, 0x7f7f]
        .into_iter()
        .map(bf16::from_bits)
        .collect();
    bf16s.extend((0..30).map(|_| bf16::from_bits(s.rng.next_u64() as u16 & 0x7f7f)));
    roundtrip(s, bf16s, |v| u64::from(v.to_bits()));

    s.check_direct_refusal("upload", "f32 values into a bf16 view", &[], |dev| {
        let buf = dev.alloc(4, DType::Bf16)?;
        dev.upload(&[1.0f32; 4], ViewMut::whole(&buf))
    });
    s.check_direct_refusal("upload", "5 values into a view of 4", &[], |dev| {
        let buf = dev.alloc(4, DType::F32)?;
        dev.upload(&[1.0f32; 5], ViewMut::whole(&buf))
    });
    s.check_direct_refusal("download", "a f32 view into u32 values", &[], |dev| {
        let buf = dev.alloc(4, DType::F32)?;
        dev.download(View::whole(&buf), &mut [0u32; 4])
    });
    s.check_direct_refusal("download", "a view of 4 into 3 values", &[], |dev| {
        let buf = dev.alloc(4, DType::F32)?;
        dev.download(View::whole(&buf), &mut [0.0f32; 3])
    });
    // Large enough that a backend staging small reads takes another path.
    let n = 300_000;
    let large: Vec<u32> = (0..n).map(|_| s.rng.next_u64() as u32).collect();
    direct(
        s,
        "start_download",
        format!("{n} x u32, the buffer zeroed before the finish"),
        |dev| {
            let buf = dev.alloc(n, DType::U32)?;
            dev.upload(&large, ViewMut::whole(&buf))?;
            let read = dev.start_download::<u32>(View::whole(&buf))?;
            dev.zero(ViewMut::whole(&buf))?;
            let mut got = vec![0u32; n];
            dev.finish_download(read, &mut got)?;
            Ok(match (0..n).find(|&i| got[i] != large[i]) {
                Some(i) => vec![format!("differs at element {i}")],
                None => Vec::new(),
            })
        },
    );
    s.check_direct_refusal(
        "start_download",
        "a f32 view as u32 values",
        &["src"],
        |dev| {
            let buf = dev.alloc(4, DType::F32)?;
            dev.start_download::<u32>(View::whole(&buf)).map(drop)
        },
    );
    s.check_direct_refusal("finish_download", "a view of 4 into 3 values", &[], |dev| {
        let buf = dev.alloc(4, DType::F32)?;
        let read = dev.start_download::<f32>(View::whole(&buf))?;
        dev.finish_download(read, &mut [0.0f32; 3])
    });
}

fn copy<B: Backend>(s: &mut Suite<'_, B>) {
    for dtype in DType::ALL {
        let src = contents(s, dtype, 20);
        let dst0 = contents(s, dtype, 24);
        direct(
            s,
            "copy",
            format!("{dtype}, 13 elements between views"),
            |dev| {
                let (a, b) = (buffer(dev, dtype, &src)?, buffer(dev, dtype, &dst0)?);
                dev.copy(View::of(&a, 2..15)?, ViewMut::of(&b, 5..18)?)?;
                let mut want = dst0.clone();
                want[5..18].copy_from_slice(&src[2..15]);
                let mut problems = exact("dst", &download_values(dev, View::whole(&b))?, &want);
                problems.extend(exact("src", &download_values(dev, View::whole(&a))?, &src));
                Ok(problems)
            },
        );
    }
    s.check_direct_refusal("copy", "bf16 into f32", &["src", "dst"], |dev| {
        let (a, b) = (dev.alloc(4, DType::Bf16)?, dev.alloc(4, DType::F32)?);
        dev.copy(View::whole(&a), ViewMut::whole(&b))
    });
    s.check_direct_refusal("copy", "4 elements into 5", &[], |dev| {
        let (a, b) = (dev.alloc(4, DType::F32)?, dev.alloc(5, DType::F32)?);
        dev.copy(View::whole(&a), ViewMut::whole(&b))
    });
}

/// Values worth converting from `dtype`: order-one randoms plus zeros of
/// both signs, infinities, NaN, subnormals, overflow and rounding ties
/// (with and without bits beyond f32's precision, which a conversion
/// through f32 would round twice).
fn cast_sources<B: Backend>(s: &mut Suite<'_, B>, dtype: DType) -> Vec<f64> {
    let p = |e: i32| 2f64.powi(e);
    let mut v = vec![
        0.0,
        -0.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        1.0,
        -2.5,
        1.0 + p(-8),             // bf16 tie: to even (down)
        1.0 + 3.0 * p(-8),       // bf16 tie: to even (up)
        -(1.0 + p(-8) + p(-20)), // above the bf16 tie within f32
        1.0 + p(-8) + p(-40),    // above the bf16 tie only in f64
        1.0 + p(-24) + p(-60),   // above the f32 tie only in f64
        1.0 + p(-24),            // f32 tie: to even
        f64::from(f32::MAX),     // bf16 overflow
        3.5e38,                  // f32 overflow
        1e-40,                   // f32 and bf16 subnormal
        -3e-39,
        1e-300, // underflow to 0
        -1e-300,
    ];
    v.extend((0..24).map(|_| s.rng.uniform(-3.0, 3.0)));
    v.iter().map(|&x| round_to(dtype, x)).collect()
}

fn cast<B: Backend>(s: &mut Suite<'_, B>) {
    for from in FLOATS {
        for to in FLOATS {
            let src = cast_sources(s, from);
            direct(s, "cast", format!("{from} to {to}"), |dev| {
                let a = buffer(dev, from, &src)?;
                let b = dev.alloc(src.len() + 4, to)?;
                dev.cast(View::whole(&a), ViewMut::of(&b, 2..2 + src.len())?)?;
                let want: Vec<f64> = [0.0, 0.0]
                    .into_iter()
                    .chain(src.iter().map(|&v| round_to(to, v)))
                    .chain([0.0, 0.0])
                    .collect();
                let got = download_values(dev, View::whole(&b))?;
                let mut problems = exact("dst", &got, &want);
                // Name the source value of the first wrong element.
                let wrong = (2..2 + src.len()).find(|&i| !same_value(got[i], want[i]));
                if let (Some(p), Some(i)) = (problems.first_mut(), wrong) {
                    p.push_str(&format!(" (from {:e})", src[i - 2]));
                }
                Ok(problems)
            });
        }
    }
    s.check_direct_refusal("cast", "u32 to f32", &["src"], |dev| {
        let (a, b) = (dev.alloc(4, DType::U32)?, dev.alloc(4, DType::F32)?);
        dev.cast(View::whole(&a), ViewMut::whole(&b))
    });
    s.check_direct_refusal("cast", "f64 to u32", &["dst"], |dev| {
        let (a, b) = (dev.alloc(4, DType::F64)?, dev.alloc(4, DType::U32)?);
        dev.cast(View::whole(&a), ViewMut::whole(&b))
    });
    s.check_direct_refusal("cast", "4 elements into 3", &[], |dev| {
        let (a, b) = (dev.alloc(4, DType::F32)?, dev.alloc(3, DType::Bf16)?);
        dev.cast(View::whole(&a), ViewMut::whole(&b))
    });
}

fn fill<B: Backend>(s: &mut Suite<'_, B>) {
    for dtype in FLOATS {
        for value in [0.1f32, -3.75, 1e30, -0.0, 1.0 + 1.0 / 256.0] {
            let dst0 = contents(s, dtype, 20);
            direct(s, "fill", format!("{dtype} with {value:e}"), |dev| {
                let b = buffer(dev, dtype, &dst0)?;
                dev.fill(ViewMut::of(&b, 4..15)?, value)?;
                let mut want = dst0.clone();
                want[4..15].fill(round_to(dtype, f64::from(value)));
                Ok(exact("dst", &download_values(dev, View::whole(&b))?, &want))
            });
        }
    }
    s.check_direct_refusal("fill", "a u32 view", &["dst"], |dev| {
        let b = dev.alloc(4, DType::U32)?;
        dev.fill(ViewMut::whole(&b), 1.0)
    });
}

fn zero<B: Backend>(s: &mut Suite<'_, B>) {
    for dtype in DType::ALL {
        let dst0 = contents(s, dtype, 20);
        direct(s, "zero", format!("{dtype}"), |dev| {
            let b = buffer(dev, dtype, &dst0)?;
            dev.zero(ViewMut::of(&b, 3..17)?)?;
            let mut want = dst0.clone();
            want[3..17].fill(0.0);
            Ok(exact("dst", &download_values(dev, View::whole(&b))?, &want))
        });
    }
}
