//! One kernel case: its arguments (name, role, what dtype it is stored in,
//! initial values), a reference and a launch. [`Suite::check_kernel`] runs
//! it in every layout, twice, inside guarded views, compares, and derives
//! the dtype and length refusals from the argument list, so a family module
//! only states arguments, maths and the call.

use super::Suite;
use super::reference::round_to;
use super::report::{Check, CheckKind, Tolerance};
use crate::backend::{Backend, Slice, SliceMut};
use crate::error::{Result, RuntimeError};
use crate::view::{DType, DeviceBuffer, View, ViewMut};
use half::bf16;
use std::fmt;
use std::ops::{Index, Range};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// Elements before and after every argument's view, which must come back
/// unchanged. Three, so that views start off every alignment a kernel
/// could assume (a backend must take them, on a slower path if need be);
/// [`KernelCase::aligned`] cases put [`ALIGNED_LEAD`] before instead.
const GUARD: usize = 3;
/// Elements before the view of an [`KernelCase::aligned`] case: 16 bytes
/// of bf16 (32 of f32), so its views are as aligned as their buffers, as
/// a model's are (and the fast paths that need it take them).
const ALIGNED_LEAD: usize = 8;
/// What the guards of a float buffer hold (exact in bf16, f32 and f64).
const GUARD_VALUES: [f64; GUARD] = [96.0, -40.0, 0.15625];
/// What the guards of an index (u32) buffer hold: mostly far out of any
/// range, so a kernel that reads an index past its view (or ignores the
/// view's offset) fails its range check instead of reading a plausible row.
const GUARD_INDICES: [f64; GUARD] = [4_294_967_280.0, 96.0, 3_000_000_000.0];
/// What a u32 output starts as (there is no NaN to show an unwritten one).
const U32_UNWRITTEN: f64 = 4_042_322_160.0;

fn guard_values(dtype: DType) -> [f64; GUARD] {
    match dtype {
        DType::U32 => GUARD_INDICES,
        _ => GUARD_VALUES,
    }
}

/// The error a bf16 output may carry beyond the f32 computation: bf16 keeps
/// 8 significant bits, so the one rounding at the store is at most half an
/// ulp, `2^-8` of the value. The bound is tight (the CPU backend reaches
/// 0.99 of it); a backend that rounds anywhere else exceeds it.
pub(crate) const BF16_STORE: f64 = 1.0 / 256.0;

/// The dtypes float ("bf16 or f32") arguments are stored in for one run of
/// a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub input: DType,
    pub output: DType,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.input == self.output {
            write!(f, "{}", self.input)
        } else {
            write!(f, "{} in, {} out", self.input, self.output)
        }
    }
}

/// How a kernel uses an argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// Read only: must come back unchanged.
    In,
    /// Overwritten: starts as NaN.
    Out,
    /// Read and written (accumulated into, or updated in place).
    InOut,
}

/// What an argument is stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Storage {
    /// "bf16 or f32": the layout's dtype.
    Float,
    /// This dtype in every layout (f32 statistics, routing and optimizer
    /// state; u32 indices; f64 accumulators).
    Exactly(DType),
}

/// Computes an argument from the others as stored.
type Derive = Box<dyn Fn(&Values) -> Vec<f64>>;

struct Arg {
    name: &'static str,
    role: Role,
    storage: Storage,
    /// Initial contents, before rounding to the storage dtype.
    values: Vec<f64>,
    /// Or, for an input a forward saved (`rstd`, `out`, `states`, ...):
    /// computed by the reference forward from the other arguments as stored
    /// in the layout, so a backward sees what its forward would have saved.
    derive: Option<Derive>,
    /// Whether one element more must be refused (false where a kernel takes
    /// any length, e.g. `scale`).
    fixed_len: bool,
    /// Dtypes taken besides the storage's rule (`accumulate_sum`'s `x` is
    /// also f64), so the derived refusals do not expect them refused.
    also_takes: Vec<DType>,
}

impl Arg {
    fn dtype(&self, layout: Layout) -> DType {
        match (self.storage, self.role) {
            (Storage::Exactly(d), _) => d,
            (Storage::Float, Role::In) => layout.input,
            (Storage::Float, _) => layout.output,
        }
    }

    /// The dtypes the argument must be refused in: a float given indices or
    /// f64, f32 state given bf16 or indices, indices given f32, an f64
    /// accumulator given f32.
    fn refused_dtypes(&self) -> Vec<DType> {
        let wrong: &[DType] = match self.storage {
            Storage::Float => &[DType::U32, DType::F64],
            Storage::Exactly(DType::F32) => &[DType::Bf16, DType::U32],
            Storage::Exactly(_) => &[DType::F32],
        };
        wrong
            .iter()
            .copied()
            .filter(|d| !self.also_takes.contains(d))
            .collect()
    }
}

/// What a launch returns besides its buffers: host outputs by name (no
/// kernel returns any today; every output is a device view).
pub(crate) type HostOutputs = Vec<(&'static str, Vec<f64>)>;

/// One expected output of the reference.
pub(crate) struct Expected {
    name: &'static str,
    values: Vec<f64>,
    tolerance: Option<Tolerance>,
    /// Elements whose reference is exactly zero must be exactly zero.
    zeros_exact: bool,
}

impl Expected {
    pub fn new(name: &'static str, values: Vec<f64>) -> Self {
        Expected {
            name,
            values,
            tolerance: None,
            zeros_exact: false,
        }
    }

    /// Where the reference is exactly zero the output must be too (a
    /// masked loss, padding an optimizer step must leave alone), whatever
    /// the tolerance elsewhere.
    pub fn zeros_exact(mut self) -> Self {
        self.zeros_exact = true;
        self
    }

    /// Must match exactly (indices, copies, sums in a specified order):
    /// the reference rounded once to the output's dtype, bit for bit. A
    /// case whose default tolerance is exact is checked the same way.
    pub fn exact(mut self) -> Self {
        self.tolerance = Some(Tolerance::EXACT);
        self
    }

    /// A tolerance of its own instead of the case's.
    pub fn tolerance(mut self, abs: f64, rel: f64) -> Self {
        self.tolerance = Some(Tolerance::new(abs, rel));
        self
    }
}

/// The arguments' initial values as stored, by name: what the reference
/// computes from.
pub(crate) struct Values {
    entries: Vec<(&'static str, Vec<f64>)>,
}

impl Index<&str> for Values {
    type Output = [f64];
    fn index(&self, name: &str) -> &[f64] {
        match self.entries.iter().find(|(n, _)| *n == name) {
            Some((_, v)) => v,
            // A bug in the suite's own case, caught as a failed check.
            None => panic!("the case has no argument `{name}`"),
        }
    }
}

/// The device buffers of one launch, each argument a view into the middle
/// of its own buffer.
pub(crate) struct Bufs<B: Backend> {
    entries: Vec<(&'static str, B::Buf, Range<usize>)>,
}

impl<B: Backend> Bufs<B> {
    fn find(&self, name: &str) -> Result<(&B::Buf, Range<usize>)> {
        self.entries
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, b, r)| (b, r.clone()))
            .ok_or_else(|| {
                RuntimeError::InvalidArgument(format!(
                    "conformance suite: the case has no argument `{name}`"
                ))
            })
    }

    pub fn view(&self, name: &str) -> Result<Slice<'_, B>> {
        let (buf, range) = self.find(name)?;
        View::of(buf, range)
    }

    pub fn view_mut(&self, name: &str) -> Result<SliceMut<'_, B>> {
        let (buf, range) = self.find(name)?;
        ViewMut::of(buf, range)
    }
}

/// A refusal of bad argument values ([`Suite::check_bad_input`]).
pub(crate) struct BadInput {
    what: String,
    changed: Vec<(&'static str, Vec<f64>)>,
    names: Vec<String>,
    nothing_written: bool,
}

impl BadInput {
    pub fn new(what: impl Into<String>) -> Self {
        BadInput {
            what: what.into(),
            changed: Vec::new(),
            names: Vec::new(),
            nothing_written: false,
        }
    }

    /// Argument `name` holds `values` instead (its length becomes theirs).
    pub fn with(mut self, name: &'static str, values: Vec<f64>) -> Self {
        self.changed.push((name, values));
        self
    }

    /// Index argument `name` holds `values` instead.
    pub fn with_u32(self, name: &'static str, values: &[u32]) -> Self {
        self.with(name, values.iter().map(|&v| f64::from(v)).collect())
    }

    /// The error must name these arguments.
    pub fn naming(mut self, names: &[&str]) -> Self {
        self.names = names.iter().map(|n| n.to_string()).collect();
        self
    }

    /// The kernel documents that a refused call writes nothing: every
    /// argument must come back as it was.
    pub fn nothing_written(mut self) -> Self {
        self.nothing_written = true;
        self
    }
}

/// One case of one kernel.
pub(crate) struct KernelCase {
    kernel: &'static str,
    case: String,
    args: Vec<Arg>,
    same_dtype: Vec<(&'static str, &'static str)>,
    tolerance: Tolerance,
    refusals: bool,
    /// Guard elements before each view.
    lead: usize,
}

impl KernelCase {
    pub fn new(kernel: &'static str, case: impl Into<String>) -> Self {
        KernelCase {
            kernel,
            case: case.into(),
            args: Vec::new(),
            same_dtype: Vec::new(),
            tolerance: Tolerance::EXACT,
            refusals: false,
            lead: GUARD,
        }
    }

    /// Views 16-byte aligned (bf16; more for wider dtypes) instead of
    /// offset by three elements.
    pub fn aligned(mut self) -> Self {
        self.lead = ALIGNED_LEAD;
        self
    }

    fn arg(mut self, name: &'static str, role: Role, storage: Storage, values: Vec<f64>) -> Self {
        self.args.push(Arg {
            name,
            role,
            storage,
            values,
            derive: None,
            fixed_len: true,
            also_takes: Vec::new(),
        });
        self
    }

    fn derived(mut self, name: &'static str, storage: Storage, derive: Derive) -> Self {
        self.args.push(Arg {
            name,
            role: Role::In,
            storage,
            values: Vec::new(),
            derive: Some(derive),
            fixed_len: true,
            also_takes: Vec::new(),
        });
        self
    }

    /// A float input computed from the other arguments as stored (what a
    /// forward saved for this backward).
    pub fn input_from(
        self,
        name: &'static str,
        derive: impl Fn(&Values) -> Vec<f64> + 'static,
    ) -> Self {
        self.derived(name, Storage::Float, Box::new(derive))
    }
    pub fn input_f32_from(
        self,
        name: &'static str,
        derive: impl Fn(&Values) -> Vec<f64> + 'static,
    ) -> Self {
        self.derived(name, Storage::Exactly(DType::F32), Box::new(derive))
    }

    /// A float input ("bf16 or f32").
    pub fn input(self, name: &'static str, values: Vec<f64>) -> Self {
        self.arg(name, Role::In, Storage::Float, values)
    }
    pub fn input_f32(self, name: &'static str, values: Vec<f64>) -> Self {
        self.arg(name, Role::In, Storage::Exactly(DType::F32), values)
    }
    /// A float output the kernel overwrites.
    pub fn output(self, name: &'static str, len: usize) -> Self {
        self.arg(name, Role::Out, Storage::Float, vec![f64::NAN; len])
    }
    pub fn output_f32(self, name: &'static str, len: usize) -> Self {
        self.arg(
            name,
            Role::Out,
            Storage::Exactly(DType::F32),
            vec![f64::NAN; len],
        )
    }
    /// A float argument read and written (accumulated, or in place).
    pub fn inout(self, name: &'static str, values: Vec<f64>) -> Self {
        self.arg(name, Role::InOut, Storage::Float, values)
    }
    pub fn inout_f32(self, name: &'static str, values: Vec<f64>) -> Self {
        self.arg(name, Role::InOut, Storage::Exactly(DType::F32), values)
    }

    /// A u32 index input.
    pub fn input_u32(self, name: &'static str, values: &[u32]) -> Self {
        let values = values.iter().map(|&v| f64::from(v)).collect();
        self.arg(name, Role::In, Storage::Exactly(DType::U32), values)
    }
    /// A u32 index output the kernel overwrites.
    pub fn output_u32(self, name: &'static str, len: usize) -> Self {
        self.arg(
            name,
            Role::Out,
            Storage::Exactly(DType::U32),
            vec![U32_UNWRITTEN; len],
        )
    }
    /// An f64 input.
    pub fn input_f64(self, name: &'static str, values: Vec<f64>) -> Self {
        self.arg(name, Role::In, Storage::Exactly(DType::F64), values)
    }
    /// An f64 output the kernel overwrites.
    pub fn output_f64(self, name: &'static str, len: usize) -> Self {
        self.arg(
            name,
            Role::Out,
            Storage::Exactly(DType::F64),
            vec![f64::NAN; len],
        )
    }
    /// An f64 accumulator.
    pub fn inout_f64(self, name: &'static str, values: Vec<f64>) -> Self {
        self.arg(name, Role::InOut, Storage::Exactly(DType::F64), values)
    }

    /// `name` is also taken in `dtype` (no dtype refusal for it).
    pub fn also_takes(mut self, name: &'static str, dtype: DType) -> Self {
        for a in self.args.iter_mut().filter(|a| a.name == name) {
            a.also_takes.push(dtype);
        }
        self
    }

    /// `name` may have any length (no length refusal for it).
    pub fn free_len(mut self, name: &'static str) -> Self {
        for a in self.args.iter_mut().filter(|a| a.name == name) {
            a.fixed_len = false;
        }
        self
    }

    /// `a` and `b` must share a dtype.
    pub fn same_dtype(mut self, a: &'static str, b: &'static str) -> Self {
        self.same_dtype.push((a, b));
        self
    }

    /// The default tolerance of its outputs in f32.
    pub fn tolerance(mut self, abs: f64, rel: f64) -> Self {
        self.tolerance = Tolerance::new(abs, rel);
        self
    }

    /// Also check the refusals derived from the arguments.
    pub fn with_refusals(mut self) -> Self {
        self.refusals = true;
        self
    }

    fn admits(&self, layout: Layout) -> bool {
        self.same_dtype.iter().all(|&(a, b)| {
            let dtype = |n| {
                self.args
                    .iter()
                    .find(|x| x.name == n)
                    .map(|x| x.dtype(layout))
            };
            dtype(a) == dtype(b)
        })
    }

    fn position(&self, name: &str) -> Option<usize> {
        self.args.iter().position(|a| a.name == name)
    }

    /// Every argument's initial contents as stored in `dtypes`: given ones
    /// rounded, then derived ones computed from those and rounded.
    fn stored(&self, dtypes: &[DType]) -> Values {
        let round = |values: &[f64], d: DType| values.iter().map(|&v| round_to(d, v)).collect();
        let mut values = Values {
            entries: self
                .args
                .iter()
                .zip(dtypes)
                .filter(|(a, _)| a.derive.is_none())
                .map(|(a, &d)| (a.name, round(&a.values, d)))
                .collect(),
        };
        for (a, &d) in self.args.iter().zip(dtypes) {
            if let Some(derive) = &a.derive {
                let v = round(&derive(&values), d);
                values.entries.push((a.name, v));
            }
        }
        values
    }
}

impl Values {
    /// In the order of `case`'s arguments.
    fn in_order(&self, case: &KernelCase) -> Vec<Vec<f64>> {
        case.args.iter().map(|a| self[a.name].to_vec()).collect()
    }
}

/// How a launch's arguments are set up: each one's dtype, length and
/// initial values (fewer values than the length are padded).
#[derive(Clone)]
struct Setup {
    dtypes: Vec<DType>,
    lens: Vec<usize>,
    stored: Vec<Vec<f64>>,
}

/// What one launch left behind.
struct Observed {
    /// The view of every output argument (with its dtype), then every host
    /// output (no dtype).
    outputs: Vec<(&'static str, Option<DType>, Vec<f64>)>,
    /// Every buffer (guards included) and host output read back, by name,
    /// for the bit comparison of two runs.
    bits: Vec<(&'static str, Vec<u64>)>,
    /// Inputs or guards that changed.
    problems: Vec<String>,
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

fn same_value(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// `values` into a view of any dtype (each value already representable).
pub(crate) fn upload_values<B: Backend>(
    dev: &B,
    values: &[f64],
    dst: SliceMut<'_, B>,
) -> Result<()> {
    match dst.dtype() {
        DType::F32 => {
            let host: Vec<f32> = values.iter().map(|&v| v as f32).collect();
            dev.upload(&host, dst)
        }
        DType::Bf16 => {
            let host: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v as f32)).collect();
            dev.upload(&host, dst)
        }
        DType::F64 => dev.upload(values, dst),
        DType::U32 => {
            let host: Vec<u32> = values.iter().map(|&v| v as u32).collect();
            dev.upload(&host, dst)
        }
    }
}

/// A view of any dtype, widened to f64 (exact for every dtype).
pub(crate) fn download_values<B: Backend>(dev: &B, src: Slice<'_, B>) -> Result<Vec<f64>> {
    let n = src.len();
    Ok(match src.dtype() {
        DType::F32 => {
            let mut host = vec![0.0f32; n];
            dev.download(src, &mut host)?;
            host.iter().map(|&v| f64::from(v)).collect()
        }
        DType::Bf16 => {
            let mut host = vec![bf16::ZERO; n];
            dev.download(src, &mut host)?;
            host.iter().map(|v| v.to_f64()).collect()
        }
        DType::F64 => {
            let mut host = vec![0.0f64; n];
            dev.download(src, &mut host)?;
            host
        }
        DType::U32 => {
            let mut host = vec![0u32; n];
            dev.download(src, &mut host)?;
            host.iter().map(|&v| f64::from(v)).collect()
        }
    })
}

/// Element-wise comparison of one output, folded into `check`.
fn compare(
    check: &mut Check,
    name: &str,
    got: &[f64],
    want: &[f64],
    tol: Tolerance,
    zeros_exact: bool,
) {
    if got.len() != want.len() {
        check.problems.push(format!(
            "`{name}`: {} values read back, the reference has {}",
            got.len(),
            want.len()
        ));
        return;
    }
    let (mut bad, mut worst, mut worst_at) = (0usize, 0.0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = if w.is_nan() || w.is_infinite() || g.is_nan() || g.is_infinite() {
            if same_value(g, w) { 0.0 } else { f64::INFINITY }
        } else {
            (g - w).abs()
        };
        let allowed = if zeros_exact && w == 0.0 {
            0.0
        } else {
            tol.allowed(w)
        };
        let ratio = if err == 0.0 {
            0.0
        } else if allowed > 0.0 {
            err / allowed
        } else {
            f64::INFINITY
        };
        check.max_abs = check.max_abs.max(err);
        if w.abs() >= 1e-3 {
            check.max_rel = check.max_rel.max(err / w.abs());
        }
        if ratio > 1.0 {
            bad += 1;
        }
        if ratio > worst {
            (worst, worst_at) = (ratio, i);
        }
    }
    check.worst = check.worst.max(worst);
    if bad > 0 {
        check.problems.push(format!(
            "`{name}`: {bad} of {} elements outside abs {:.1e} + rel {:.1e}; worst at [{worst_at}]: \
             got {:e}, want {:e}",
            got.len(),
            tol.abs,
            tol.rel,
            got[worst_at],
            want[worst_at]
        ));
    }
}

fn new_check(kernel: &'static str, case: String, kind: CheckKind) -> Check {
    Check {
        kernel,
        case,
        kind,
        max_abs: 0.0,
        max_rel: 0.0,
        worst: 0.0,
        problems: Vec::new(),
    }
}

type Launch<'l, B> = dyn Fn(&B, &Bufs<B>) -> Result<HostOutputs> + 'l;

impl<B: Backend> Suite<'_, B> {
    /// Runs `case` in every layout it admits (values, repeatability, views),
    /// then its refusals if it asks for them.
    pub(crate) fn check_kernel(
        &mut self,
        case: KernelCase,
        reference: impl Fn(&Values) -> Vec<Expected>,
        launch: impl Fn(&B, &Bufs<B>) -> Result<HostOutputs>,
    ) {
        // A layout that stores every argument as an earlier one did (a
        // kernel of indices and f32 state only) would repeat that run.
        let mut seen: Vec<Vec<DType>> = Vec::new();
        for layout in self.layouts() {
            let dtypes: Vec<DType> = case.args.iter().map(|a| a.dtype(layout)).collect();
            if seen.contains(&dtypes) {
                continue;
            }
            seen.push(dtypes);
            if case.admits(layout) {
                let check = self.values_check(&case, layout, &reference, &launch);
                self.report.checks.push(check);
            }
        }
        if case.refusals {
            self.derived_refusals(&case, &launch);
        }
    }

    fn values_check(
        &self,
        case: &KernelCase,
        layout: Layout,
        reference: &dyn Fn(&Values) -> Vec<Expected>,
        launch: &Launch<'_, B>,
    ) -> Check {
        let mut check = new_check(
            case.kernel,
            format!("{} [{layout}]", case.case),
            CheckKind::Values,
        );
        let dtypes: Vec<DType> = case.args.iter().map(|a| a.dtype(layout)).collect();
        let prepared = catch_unwind(AssertUnwindSafe(|| {
            let values = case.stored(&dtypes);
            let expected = reference(&values);
            (values.in_order(case), expected)
        }));
        let (stored, expected) = match prepared {
            Ok(e) => e,
            Err(p) => {
                check.problems.push(format!(
                    "the suite's reference panicked: {}",
                    panic_message(p)
                ));
                return check;
            }
        };
        let setup = Setup {
            lens: stored.iter().map(Vec::len).collect(),
            dtypes,
            stored,
        };
        let first = self.observe(case, &setup, launch);
        let second = self.observe(case, &setup, launch);
        let (first, second) = match (first, second) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => {
                check.problems.push(e);
                return check;
            }
        };
        check.problems.extend(first.problems.iter().cloned());
        for ((name, a), (_, b)) in first.bits.iter().zip(&second.bits) {
            if let Some(i) = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)) {
                check.problems.push(format!(
                    "not bit-repeatable: `{name}` differs between two runs on the same inputs \
                     (element {i} of its buffer)"
                ));
            }
        }
        for e in &expected {
            let Some((_, dtype, got)) = first.outputs.iter().find(|(n, _, _)| *n == e.name) else {
                check.problems.push(format!(
                    "the suite expects an output `{}` the case lacks",
                    e.name
                ));
                continue;
            };
            let tol = e.tolerance.unwrap_or(case.tolerance);
            if tol == Tolerance::EXACT {
                // An exact result (a copy, an index, a specified order of
                // f64 sums) stored once: exactly its value rounded to the
                // output's dtype, in bf16 too.
                let want: Vec<f64> = match dtype {
                    Some(d) => e.values.iter().map(|&v| round_to(*d, v)).collect(),
                    None => e.values.clone(),
                };
                compare(&mut check, e.name, got, &want, tol, e.zeros_exact);
                continue;
            }
            let mut tol = tol.scaled(self.slack);
            if *dtype == Some(DType::Bf16) {
                tol.rel += BF16_STORE;
            }
            compare(&mut check, e.name, got, &e.values, tol, e.zeros_exact);
        }
        check
    }

    /// Allocates and uploads every argument inside its guards.
    fn prepare(&self, case: &KernelCase, setup: &Setup) -> Result<Bufs<B>> {
        let mut entries = Vec::with_capacity(case.args.len());
        for (i, arg) in case.args.iter().enumerate() {
            let len = setup.lens[i];
            let lead = case.lead;
            let buf = self.device.alloc(lead + len + GUARD, setup.dtypes[i])?;
            let guards = guard_values(setup.dtypes[i]);
            let mut whole = Vec::with_capacity(lead + len + GUARD);
            whole.extend(guards.iter().cycle().take(lead));
            whole.extend(
                setup.stored[i]
                    .iter()
                    .copied()
                    .chain(std::iter::repeat(0.5))
                    .take(len),
            );
            whole.extend(guards);
            upload_values(self.device, &whole, ViewMut::whole(&buf))?;
            entries.push((arg.name, buf, lead..lead + len));
        }
        Ok(Bufs { entries })
    }

    /// Runs the launch, turning a panic into an `Err` message.
    fn launch_guarded(
        &self,
        bufs: &Bufs<B>,
        launch: &Launch<'_, B>,
    ) -> Result<Result<HostOutputs>, String> {
        catch_unwind(AssertUnwindSafe(|| launch(self.device, bufs)))
            .map_err(|p| format!("panicked: {}", panic_message(p)))
    }

    /// One run of the case on its values: what it wrote, or why it failed.
    fn observe(
        &self,
        case: &KernelCase,
        setup: &Setup,
        launch: &Launch<'_, B>,
    ) -> Result<Observed, String> {
        let bufs = self
            .prepare(case, setup)
            .map_err(|e| format!("could not set up the arguments: {e}"))?;
        let host = self
            .launch_guarded(&bufs, launch)?
            .map_err(|e| format!("returned an error: {e}"))?;
        let mut observed = Observed {
            outputs: Vec::new(),
            bits: Vec::new(),
            problems: Vec::new(),
        };
        let inputs = case.args.iter().zip(&bufs.entries).zip(&setup.stored);
        for ((arg, (_, buf, range)), before) in inputs {
            let whole = download_values(self.device, View::whole(buf))
                .map_err(|e| format!("could not read `{}` back: {e}", arg.name))?;
            observed
                .bits
                .push((arg.name, whole.iter().map(|v| v.to_bits()).collect()));
            let guards = whole[..range.start].iter().chain(&whole[range.end..]);
            let want = guard_values(buf.dtype());
            let lead = want.iter().cycle().take(range.start);
            if guards
                .zip(lead.chain(&want))
                .any(|(&g, &want)| !same_value(g, want))
            {
                observed.problems.push(format!(
                    "wrote outside the view of `{}` (the elements around it changed)",
                    arg.name
                ));
            }
            let view = whole[range.clone()].to_vec();
            match arg.role {
                Role::In => {
                    if let Some(i) = (0..view.len()).find(|&i| !same_value(view[i], before[i])) {
                        observed.problems.push(format!(
                            "changed its input `{}` (element {i}: {:e} became {:e})",
                            arg.name, before[i], view[i]
                        ));
                    }
                }
                Role::Out | Role::InOut => {
                    observed.outputs.push((arg.name, Some(buf.dtype()), view));
                }
            }
        }
        for (name, values) in host {
            observed
                .bits
                .push((name, values.iter().map(|v| v.to_bits()).collect()));
            observed.outputs.push((name, None, values));
        }
        Ok(observed)
    }

    fn derived_refusals(&mut self, case: &KernelCase, launch: &Launch<'_, B>) {
        let compute = self.device.compute_dtype();
        let layout = Layout {
            input: compute,
            output: compute,
        };
        let dtypes: Vec<DType> = case.args.iter().map(|a| a.dtype(layout)).collect();
        let Some(stored) = self.refusal_values(case, &dtypes) else {
            return;
        };
        let base = Setup {
            dtypes: dtypes.clone(),
            lens: stored.iter().map(Vec::len).collect(),
            stored,
        };
        for (i, arg) in case.args.iter().enumerate() {
            for bad in arg.refused_dtypes() {
                let mut setup = base.clone();
                setup.dtypes[i] = bad;
                let what = format!("`{}` given as {bad}", arg.name);
                self.expect_refusal(case, &what, &setup, &[arg.name], false, launch);
            }
        }
        for &(a, b) in &case.same_dtype {
            let (Some(ia), Some(ib)) = (case.position(a), case.position(b)) else {
                continue;
            };
            let other = if dtypes[ib] == DType::F32 {
                DType::Bf16
            } else {
                DType::F32
            };
            let mut setup = base.clone();
            setup.dtypes[ia] = other;
            let what = format!("`{a}` {other} but `{b}` {}", dtypes[ib]);
            self.expect_refusal(case, &what, &setup, &[a, b], false, launch);
        }
        for (i, arg) in case.args.iter().enumerate().filter(|(_, a)| a.fixed_len) {
            let mut setup = base.clone();
            setup.lens[i] += 1;
            let what = format!("`{}` one element too long", arg.name);
            self.expect_refusal(case, &what, &setup, &[], false, launch);
        }
    }

    /// A refusal written by a family (bad dimensions, a bad hyper-parameter):
    /// `launch` runs on the case's arguments in the compute dtype and must
    /// return `InvalidArgument` naming the kernel and each of `names`.
    pub(crate) fn check_refusal(
        &mut self,
        case: &KernelCase,
        what: &str,
        names: &[&str],
        launch: impl Fn(&B, &Bufs<B>) -> Result<HostOutputs>,
    ) {
        self.check_bad_input(case, BadInput::new(what).naming(names), launch);
    }

    /// A refusal of bad argument values (an index out of range, counts that
    /// do not match, a length the dims do not give): the case's arguments
    /// in the compute dtype with `bad`'s changes, which `launch` must refuse
    /// with `InvalidArgument` naming the kernel (and `bad`'s names), leaving
    /// every argument as it was where `bad` says nothing is written.
    pub(crate) fn check_bad_input(
        &mut self,
        case: &KernelCase,
        bad: BadInput,
        launch: impl Fn(&B, &Bufs<B>) -> Result<HostOutputs>,
    ) {
        let compute = self.device.compute_dtype();
        let layout = Layout {
            input: compute,
            output: compute,
        };
        let dtypes: Vec<DType> = case.args.iter().map(|a| a.dtype(layout)).collect();
        let Some(mut stored) = self.refusal_values(case, &dtypes) else {
            return;
        };
        for (name, values) in bad.changed {
            match case.position(name) {
                Some(i) => stored[i] = values.iter().map(|&v| round_to(dtypes[i], v)).collect(),
                None => {
                    let mut check = new_check(case.kernel, bad.what.clone(), CheckKind::Refusal);
                    check.problems.push(format!(
                        "the suite's case has no argument `{name}` to change"
                    ));
                    self.report.checks.push(check);
                    return;
                }
            }
        }
        let setup = Setup {
            dtypes,
            lens: stored.iter().map(Vec::len).collect(),
            stored,
        };
        let names: Vec<&str> = bad.names.iter().map(String::as_str).collect();
        self.expect_refusal(
            case,
            &bad.what,
            &setup,
            &names,
            bad.nothing_written,
            &launch,
        );
    }

    /// The case's values in the compute layout, for refusals; `None` (and
    /// a failed check) when the suite's own derivation panics.
    fn refusal_values(&mut self, case: &KernelCase, dtypes: &[DType]) -> Option<Vec<Vec<f64>>> {
        match catch_unwind(AssertUnwindSafe(|| case.stored(dtypes).in_order(case))) {
            Ok(v) => Some(v),
            Err(p) => {
                let mut check = new_check(case.kernel, case.case.clone(), CheckKind::Refusal);
                check.problems.push(format!(
                    "the suite's reference panicked: {}",
                    panic_message(p)
                ));
                self.report.checks.push(check);
                None
            }
        }
    }

    fn expect_refusal(
        &mut self,
        case: &KernelCase,
        what: &str,
        setup: &Setup,
        names: &[&str],
        nothing_written: bool,
        launch: &Launch<'_, B>,
    ) {
        let mut check = new_check(case.kernel, what.to_string(), CheckKind::Refusal);
        let bufs = match self.prepare(case, setup) {
            Ok(bufs) => bufs,
            Err(e) => {
                check
                    .problems
                    .push(format!("could not set up the arguments: {e}"));
                self.report.checks.push(check);
                return;
            }
        };
        let mut outcome = self.launch_guarded(&bufs, launch);
        if matches!(outcome, Ok(Ok(_))) {
            // A GPU checks index values on the device: the refusal surfaces
            // at the next host read, which this forces.
            if let Some((_, buf, _)) = bufs.entries.first()
                && let Err(e) = download_values(self.device, View::whole(buf))
            {
                outcome = Ok(Err(e));
            }
        }
        let refused = matches!(outcome, Ok(Err(RuntimeError::InvalidArgument(_))));
        refusal_problems(&mut check, case.kernel, names, outcome);
        if refused && nothing_written {
            self.unchanged(&mut check, case, setup, &bufs);
        }
        self.report.checks.push(check);
    }

    /// Adds a problem for every argument of a refused call whose view no
    /// longer holds what it was set up with.
    fn unchanged(&self, check: &mut Check, case: &KernelCase, setup: &Setup, bufs: &Bufs<B>) {
        let views = case.args.iter().zip(&bufs.entries).zip(&setup.stored);
        for ((arg, (_, buf, range)), before) in views {
            let now = match download_values(self.device, View::whole(buf)) {
                Ok(whole) => whole[range.clone()].to_vec(),
                Err(e) => {
                    check
                        .problems
                        .push(format!("could not read `{}` back: {e}", arg.name));
                    continue;
                }
            };
            let before = before.iter().chain(std::iter::repeat(&0.5));
            if let Some(i) = now
                .iter()
                .zip(before)
                .position(|(a, b)| !same_value(*a, *b))
            {
                check.problems.push(format!(
                    "the refused call wrote `{}` (element {i}); a refused call must write nothing",
                    arg.name
                ));
            }
        }
    }

    /// A refusal of a call made directly (memory ops).
    pub(crate) fn check_direct_refusal(
        &mut self,
        kernel: &'static str,
        what: &str,
        names: &[&str],
        call: impl FnOnce(&B) -> Result<()>,
    ) {
        let mut check = new_check(kernel, what.to_string(), CheckKind::Refusal);
        let outcome = catch_unwind(AssertUnwindSafe(|| call(self.device)))
            .map(|r| r.map(|()| HostOutputs::new()))
            .map_err(|p| format!("panicked: {}", panic_message(p)));
        refusal_problems(&mut check, kernel, names, outcome);
        self.report.checks.push(check);
    }

    /// Records a values check made directly (memory ops).
    pub(crate) fn record(&mut self, check: Check) {
        self.report.checks.push(check);
    }

    pub(crate) fn direct_check(&self, kernel: &'static str, case: String) -> Check {
        new_check(kernel, case, CheckKind::Values)
    }
}

fn refusal_problems(
    check: &mut Check,
    kernel: &str,
    names: &[&str],
    outcome: Result<Result<HostOutputs>, String>,
) {
    match outcome {
        Err(e) => check
            .problems
            .push(format!("{e} (must return InvalidArgument)")),
        Ok(Ok(_)) => check
            .problems
            .push("was accepted; it must be refused with InvalidArgument".to_string()),
        Ok(Err(RuntimeError::InvalidArgument(message))) => {
            if !message.contains(kernel) {
                check
                    .problems
                    .push(format!("the error does not name the kernel: \"{message}\""));
            }
            for name in names {
                if !message.contains(&format!("`{name}`")) {
                    check
                        .problems
                        .push(format!("the error does not name `{name}`: \"{message}\""));
                }
            }
        }
        Ok(Err(other)) => check.problems.push(format!(
            "refused with {other:?}, which is not InvalidArgument"
        )),
    }
}
