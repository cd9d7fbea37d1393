//! What a run of the suite found: one [`Check`] per kernel case or refusal,
//! with the largest errors seen and every problem, so one run shows every
//! failing kernel.

use crate::view::DType;
use std::fmt;

/// How close an output must be to the reference, element-wise:
/// `|got - want| <= abs + rel * |want|`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub abs: f64,
    pub rel: f64,
}

impl Tolerance {
    pub const EXACT: Tolerance = Tolerance { abs: 0.0, rel: 0.0 };

    pub const fn new(abs: f64, rel: f64) -> Self {
        Tolerance { abs, rel }
    }

    /// The bound for one element.
    pub fn allowed(self, want: f64) -> f64 {
        self.abs + self.rel * want.abs()
    }

    pub fn scaled(self, factor: f64) -> Self {
        Tolerance {
            abs: self.abs * factor,
            rel: self.rel * factor,
        }
    }
}

/// What was checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckKind {
    /// Outputs against the reference, bit-repeatability, untouched inputs
    /// and guards.
    Values,
    /// A bad argument must be refused with `InvalidArgument`.
    Refusal,
}

/// One checked case.
#[derive(Clone, Debug)]
pub struct Check {
    pub kernel: &'static str,
    pub case: String,
    pub kind: CheckKind,
    /// Largest `|got - want|` over the outputs (values checks).
    pub max_abs: f64,
    /// Largest `|got - want| / |want|` over elements with `|want| >= 1e-3`.
    pub max_rel: f64,
    /// Largest error as a fraction of its tolerance (above 1 fails).
    pub worst: f64,
    /// Everything wrong; empty when the case passed.
    pub problems: Vec<String>,
}

impl Check {
    pub fn passed(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Every check of one run of the suite.
#[derive(Clone, Debug)]
pub struct Report {
    pub backend: String,
    pub compute: DType,
    pub checks: Vec<Check>,
}

impl Report {
    pub(crate) fn new(backend: String, compute: DType) -> Self {
        Report {
            backend,
            compute,
            checks: Vec::new(),
        }
    }

    pub fn is_clean(&self) -> bool {
        self.checks.iter().all(Check::passed)
    }

    pub fn failures(&self) -> impl Iterator<Item = &Check> {
        self.checks.iter().filter(|c| !c.passed())
    }

    /// The kernels that have a failing check, in the order checked.
    pub fn failing_kernels(&self) -> Vec<&'static str> {
        let mut kernels = Vec::new();
        for c in self.failures() {
            if !kernels.contains(&c.kernel) {
                kernels.push(c.kernel);
            }
        }
        kernels
    }

    /// Per kernel, in the order checked: (kernel, checks, failures, max abs,
    /// max rel, worst fraction of tolerance).
    pub fn summary(&self) -> Vec<(&'static str, usize, usize, f64, f64, f64)> {
        let mut rows: Vec<(&'static str, usize, usize, f64, f64, f64)> = Vec::new();
        for c in &self.checks {
            let i = match rows.iter().position(|r| r.0 == c.kernel) {
                Some(i) => i,
                None => {
                    rows.push((c.kernel, 0, 0, 0.0, 0.0, 0.0));
                    rows.len() - 1
                }
            };
            let row = &mut rows[i];
            row.1 += 1;
            row.2 += usize::from(!c.passed());
            row.3 = row.3.max(c.max_abs);
            row.4 = row.4.max(c.max_rel);
            row.5 = row.5.max(c.worst);
        }
        rows
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let failures = self.failures().count();
        writeln!(
            f,
            "conformance of `{}` (compute {}): {} checks, {} failing",
            self.backend,
            self.compute,
            self.checks.len(),
            failures
        )?;
        writeln!(
            f,
            "  {:<24} {:>6} {:>5} {:>10} {:>10} {:>7}",
            "kernel", "checks", "fail", "max abs", "max rel", "worst"
        )?;
        for (kernel, checks, fails, abs, rel, worst) in self.summary() {
            writeln!(
                f,
                "  {kernel:<24} {checks:>6} {fails:>5} {abs:>10.2e} {rel:>10.2e} {worst:>7.3}"
            )?;
        }
        for c in self.failures() {
            writeln!(f, "FAIL {} [{}] ({:?}):", c.kernel, c.case, c.kind)?;
            for p in &c.problems {
                writeln!(f, "    {p}")?;
            }
        }
        Ok(())
    }
}
