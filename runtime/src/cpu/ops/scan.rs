//! The Mamba-2 selective scan, evaluated sequentially per (sequence, head).
//!
//! Forward keeps only the state at the start of every chunk; backward walks
//! the chunks in reverse, recomputes the chunk's states from its saved start
//! (the same operations in the same order, so the same bits), and runs the
//! reverse recurrence of the state gradient `G_t = dy_t C_t^T + a_{t+1} G_{t+1}`.

use crate::backend::{ScanDims, ScanGrads, ScanInputs, ScanKernels};
use crate::cpu::{CpuBackend, CpuBuf};
use crate::error::Result;
use crate::view::{View, ViewMut};

/// `log(1 + exp(x))`, linear above 20 as PyTorch's default threshold.
impl ScanKernels<CpuBuf> for CpuBackend {
    fn ssd_scan_forward_unchecked(
        &self,
        inputs: ScanInputs<View<'_, CpuBuf>>,
        y: ViewMut<'_, CpuBuf>,
        states: ViewMut<'_, CpuBuf>,
        dims: ScanDims,
    ) -> Result<()> {
        let k = self.access("ssd_scan_forward");
        let (xbc, dt, dt_bias, a_log, d) = (
            k.f32_in("xbc", inputs.xbc)?,
            k.f32_in("dt", inputs.dt)?,
            k.f32_in("dt_bias", inputs.dt_bias)?,
            k.f32_in("a_log", inputs.a_log)?,
            k.f32_in("d", inputs.d)?,
        );
        let states = k.typed_out::<f32>("states", states)?;
        ssd_scan_forward(
            ScanInputs {
                xbc: &xbc,
                dt: &dt,
                dt_bias: &dt_bias,
                a_log: &a_log,
                d: &d,
            },
            &mut k.f32_out("y", y)?,
            states,
            dims,
        );
        Ok(())
    }

    fn ssd_scan_backward_unchecked(
        &self,
        inputs: ScanInputs<View<'_, CpuBuf>>,
        states: View<'_, CpuBuf>,
        dy: View<'_, CpuBuf>,
        grads: ScanGrads<ViewMut<'_, CpuBuf>>,
        dims: ScanDims,
    ) -> Result<()> {
        let k = self.access("ssd_scan_backward");
        let (xbc, dt, dt_bias, a_log, d) = (
            k.f32_in("xbc", inputs.xbc)?,
            k.f32_in("dt", inputs.dt)?,
            k.f32_in("dt_bias", inputs.dt_bias)?,
            k.f32_in("a_log", inputs.a_log)?,
            k.f32_in("d", inputs.d)?,
        );
        let states = k.typed_in::<f32>("states", states)?;
        let dy = k.f32_in("dy", dy)?;
        ssd_scan_backward(
            ScanInputs {
                xbc: &xbc,
                dt: &dt,
                dt_bias: &dt_bias,
                a_log: &a_log,
                d: &d,
            },
            states,
            &dy,
            ScanGrads {
                xbc: &mut k.f32_out("d_xbc", grads.xbc)?,
                dt: &mut k.f32_out("d_dt", grads.dt)?,
                a_log: &mut k.f32_out("d_a_log", grads.a_log)?,
                d: &mut k.f32_out("d_d", grads.d)?,
            },
            dims,
        );
        Ok(())
    }
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// The derivative of [`softplus`].
fn softplus_derivative(x: f32) -> f32 {
    if x > 20.0 {
        1.0
    } else {
        1.0 / (1.0 + (-x).exp())
    }
}

/// Where one head's pieces live in a row of `xbc`.
struct Layout {
    width: usize,
    d_inner: usize,
    heads: usize,
    p: usize,
    n: usize,
    groups: usize,
    heads_per_group: usize,
}

impl Layout {
    fn new(dims: ScanDims) -> Self {
        Layout {
            width: dims.xbc_width(),
            d_inner: dims.heads * dims.head_dim,
            heads: dims.heads,
            p: dims.head_dim,
            n: dims.state,
            groups: dims.groups,
            heads_per_group: dims.heads / dims.groups,
        }
    }
    fn x(&self, h: usize) -> usize {
        h * self.p
    }
    fn b(&self, h: usize) -> usize {
        self.d_inner + (h / self.heads_per_group) * self.n
    }
    fn c(&self, h: usize) -> usize {
        self.d_inner + (self.groups + h / self.heads_per_group) * self.n
    }
}

/// One step of the recurrence on the state: `S = decay S + dt x B^T`.
fn step_state(state: &mut [f32], decay: f32, dt: f32, x: &[f32], b: &[f32], n: usize) {
    for (s_row, &xp) in state.chunks_exact_mut(n).zip(x) {
        let dx = dt * xp;
        for (s, &bn) in s_row.iter_mut().zip(b) {
            *s = decay * *s + dx * bn;
        }
    }
}

pub fn ssd_scan_forward(
    inputs: ScanInputs<&[f32]>,
    y: &mut [f32],
    states: &mut [f32],
    dims: ScanDims,
) {
    let chunks = dims.tokens.seq.div_ceil(dims.chunk);
    let l = Layout::new(dims);
    let (seq, pn) = (dims.tokens.seq, l.p * l.n);
    if pn == 0 {
        y.fill(0.0);
        return;
    }
    let mut state = vec![0.0f32; pn];
    for b in 0..dims.tokens.batch {
        for h in 0..l.heads {
            let a = -inputs.a_log[h].exp();
            let skip = inputs.d[h];
            state.fill(0.0);
            for t in 0..seq {
                if t % dims.chunk == 0 {
                    let at = ((b * chunks + t / dims.chunk) * l.heads + h) * pn;
                    states[at..at + pn].copy_from_slice(&state);
                }
                let r = b * seq + t;
                let row = &inputs.xbc[r * l.width..][..l.width];
                let (x, bv, cv) = (
                    &row[l.x(h)..][..l.p],
                    &row[l.b(h)..][..l.n],
                    &row[l.c(h)..][..l.n],
                );
                let dt = softplus(inputs.dt[r * l.heads + h] + inputs.dt_bias[h]);
                step_state(&mut state, (dt * a).exp(), dt, x, bv, l.n);
                let out = &mut y[r * l.d_inner + l.x(h)..][..l.p];
                for ((o, s_row), &xp) in out.iter_mut().zip(state.chunks_exact(l.n)).zip(x) {
                    let mut acc = 0.0f32;
                    for (s, c) in s_row.iter().zip(cv) {
                        acc += s * c;
                    }
                    *o = acc + skip * xp;
                }
            }
        }
    }
}

/// The same forward in the chunked "SSD" form (Mamba-2's
/// state-space duality): per chunk of `L` steps with start state `S0` and
/// cumulative log-decay `c_t = sum_{s<=t} dt_s A` inside the chunk,
/// `y_t = exp(c_t) S0 C_t + sum_{s<=t} exp(c_t - c_s) dt_s (C_t . B_s) x_s + D x_t`
/// (a causally masked `C B^T` matmul), and the next chunk's start state
/// `exp(c_L) S0 + sum_s exp(c_L - c_s) dt_s x_s B_s^T`. It writes the same
/// chunk-start `states` (so [`ssd_scan_backward`] works on its output) and
/// agrees with [`ssd_scan_forward`] to rounding: the reference for a GPU
/// kernel that evaluates the scan this way. The CPU backend uses the
/// sequential form.
pub fn ssd_scan_forward_chunked(
    inputs: ScanInputs<&[f32]>,
    y: &mut [f32],
    states: &mut [f32],
    dims: ScanDims,
) {
    let chunks = dims.tokens.seq.div_ceil(dims.chunk);
    let l = Layout::new(dims);
    let (seq, pn) = (dims.tokens.seq, l.p * l.n);
    if pn == 0 || seq == 0 {
        y.fill(0.0);
        states.fill(0.0);
        return;
    }
    let chunk = dims.chunk.min(seq);
    let mut state = vec![0.0f32; pn];
    let mut log_decay = vec![0.0f32; chunk];
    let mut dts = vec![0.0f32; chunk];
    for b in 0..dims.tokens.batch {
        for h in 0..l.heads {
            let a = -inputs.a_log[h].exp();
            let skip = inputs.d[h];
            state.fill(0.0);
            for c in 0..chunks {
                let at = ((b * chunks + c) * l.heads + h) * pn;
                states[at..at + pn].copy_from_slice(&state);
                let (t0, t1) = (c * dims.chunk, ((c + 1) * dims.chunk).min(seq));
                let row = |t: usize| &inputs.xbc[(b * seq + t) * l.width..][..l.width];
                let mut cum = 0.0f32;
                for t in t0..t1 {
                    let dt = softplus(inputs.dt[(b * seq + t) * l.heads + h] + inputs.dt_bias[h]);
                    cum += dt * a;
                    log_decay[t - t0] = cum;
                    dts[t - t0] = dt;
                }
                // Outputs: the start state's contribution plus the masked intra-chunk matmul.
                for t in t0..t1 {
                    let (xt, ct) = (&row(t)[l.x(h)..][..l.p], &row(t)[l.c(h)..][..l.n]);
                    let out = &mut y[(b * seq + t) * l.d_inner + l.x(h)..][..l.p];
                    let carry = log_decay[t - t0].exp();
                    for ((o, s_row), &xp) in out.iter_mut().zip(state.chunks_exact(l.n)).zip(xt) {
                        let mut acc = 0.0f32;
                        for (s, cn) in s_row.iter().zip(ct) {
                            acc += s * cn;
                        }
                        *o = carry * acc + skip * xp;
                    }
                    for s in t0..=t {
                        let (xs, bs) = (&row(s)[l.x(h)..][..l.p], &row(s)[l.b(h)..][..l.n]);
                        let mut cb = 0.0f32;
                        for (cn, bn) in ct.iter().zip(bs) {
                            cb += cn * bn;
                        }
                        let w = (log_decay[t - t0] - log_decay[s - t0]).exp() * dts[s - t0] * cb;
                        for (o, &xp) in out.iter_mut().zip(xs) {
                            *o += w * xp;
                        }
                    }
                }
                // The next chunk's start state.
                let last = log_decay[t1 - 1 - t0];
                let carry = last.exp();
                for v in state.iter_mut() {
                    *v *= carry;
                }
                for s in t0..t1 {
                    let (xs, bs) = (&row(s)[l.x(h)..][..l.p], &row(s)[l.b(h)..][..l.n]);
                    let w = (last - log_decay[s - t0]).exp() * dts[s - t0];
                    for (s_row, &xp) in state.chunks_exact_mut(l.n).zip(xs) {
                        for (v, &bn) in s_row.iter_mut().zip(bs) {
                            *v += w * xp * bn;
                        }
                    }
                }
            }
        }
    }
}

pub fn ssd_scan_backward(
    inputs: ScanInputs<&[f32]>,
    states: &[f32],
    dy: &[f32],
    grads: ScanGrads<&mut [f32]>,
    dims: ScanDims,
) {
    let chunks = dims.tokens.seq.div_ceil(dims.chunk);
    let l = Layout::new(dims);
    let ScanGrads {
        xbc: dxbc,
        dt: ddt,
        a_log: da_log,
        d: dd,
    } = grads;
    dxbc.fill(0.0);
    ddt.fill(0.0);
    let (seq, pn) = (dims.tokens.seq, l.p * l.n);
    if pn == 0 || seq == 0 {
        return;
    }
    let chunk = dims.chunk.min(seq);
    // States after each step of the current chunk, and the state gradient.
    let mut history = vec![0.0f32; chunk * pn];
    let mut g = vec![0.0f32; pn];
    let mut gb = vec![0.0f32; l.p];
    for b in 0..dims.tokens.batch {
        for h in 0..l.heads {
            let a = -inputs.a_log[h].exp();
            let skip = inputs.d[h];
            let (mut d_a, mut d_skip) = (0.0f32, 0.0f32);
            g.fill(0.0);
            for c in (0..chunks).rev() {
                let start = &states[((b * chunks + c) * l.heads + h) * pn..][..pn];
                let (t0, t1) = (c * dims.chunk, ((c + 1) * dims.chunk).min(seq));
                for t in t0..t1 {
                    let r = b * seq + t;
                    let row = &inputs.xbc[r * l.width..][..l.width];
                    let dt = softplus(inputs.dt[r * l.heads + h] + inputs.dt_bias[h]);
                    let (prev, cur) = history.split_at_mut((t - t0) * pn);
                    let cur = &mut cur[..pn];
                    cur.copy_from_slice(if t == t0 {
                        start
                    } else {
                        &prev[(t - t0 - 1) * pn..]
                    });
                    step_state(
                        cur,
                        (dt * a).exp(),
                        dt,
                        &row[l.x(h)..][..l.p],
                        &row[l.b(h)..][..l.n],
                        l.n,
                    );
                }
                for t in (t0..t1).rev() {
                    let r = b * seq + t;
                    let row = &inputs.xbc[r * l.width..][..l.width];
                    let (x, bv, cv) = (
                        &row[l.x(h)..][..l.p],
                        &row[l.b(h)..][..l.n],
                        &row[l.c(h)..][..l.n],
                    );
                    let raw = inputs.dt[r * l.heads + h] + inputs.dt_bias[h];
                    let dt = softplus(raw);
                    let decay = (dt * a).exp();
                    let s_t = &history[(t - t0) * pn..][..pn];
                    let s_prev = if t == t0 {
                        start
                    } else {
                        &history[(t - t0 - 1) * pn..][..pn]
                    };
                    let dyr = &dy[r * l.d_inner + l.x(h)..][..l.p];
                    let drow = &mut dxbc[r * l.width..][..l.width];
                    // G_t += dy_t C_t^T; dC_t += S_t^T dy_t.
                    {
                        let dc = &mut drow[l.c(h)..][..l.n];
                        for ((g_row, s_row), &dyp) in
                            g.chunks_exact_mut(l.n).zip(s_t.chunks_exact(l.n)).zip(dyr)
                        {
                            for (((gv, &sv), &cn), dcn) in
                                g_row.iter_mut().zip(s_row).zip(cv).zip(dc.iter_mut())
                            {
                                *gv += dyp * cn;
                                *dcn += sv * dyp;
                            }
                        }
                    }
                    // (G B)_p, d decay = <G, S_{t-1}>, dB += dt G^T x.
                    let mut d_decay = 0.0f32;
                    {
                        let db = &mut drow[l.b(h)..][..l.n];
                        for (((g_row, sp_row), &xp), gbp) in g
                            .chunks_exact(l.n)
                            .zip(s_prev.chunks_exact(l.n))
                            .zip(x)
                            .zip(gb.iter_mut())
                        {
                            let mut acc = 0.0f32;
                            for (((&gv, &sv), &bn), dbn) in
                                g_row.iter().zip(sp_row).zip(bv).zip(db.iter_mut())
                            {
                                acc += gv * bn;
                                d_decay += gv * sv;
                                *dbn += dt * gv * xp;
                            }
                            *gbp = acc;
                        }
                    }
                    // dx = D dy + dt (G B); d dt = x . (G B) + d decay * decay * A.
                    let mut d_dt = 0.0f32;
                    {
                        let dx = &mut drow[l.x(h)..][..l.p];
                        for (((dxp, &gbp), &dyp), &xp) in dx.iter_mut().zip(&gb).zip(dyr).zip(x) {
                            *dxp = skip * dyp + dt * gbp;
                            d_dt += xp * gbp;
                            d_skip += dyp * xp;
                        }
                    }
                    d_dt += d_decay * decay * a;
                    d_a += d_decay * decay * dt;
                    ddt[r * l.heads + h] = d_dt * softplus_derivative(raw);
                    for gv in g.iter_mut() {
                        *gv *= decay;
                    }
                }
            }
            // A = -exp(A_log): dA/dA_log = A.
            da_log[h] += d_a * a;
            dd[h] += d_skip;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Tokens;

    fn data(n: usize, seed: f32, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|i| amp * (i as f32 * 0.71 + seed).sin())
            .collect()
    }

    struct Case {
        dims: ScanDims,
        xbc: Vec<f32>,
        dt: Vec<f32>,
        dt_bias: Vec<f32>,
        a_log: Vec<f32>,
        d: Vec<f32>,
    }

    fn case(chunk: usize) -> Case {
        let dims = ScanDims {
            tokens: Tokens::new(2, 5),
            heads: 4,
            head_dim: 3,
            groups: 2,
            state: 2,
            chunk,
        };
        let rows = 10;
        Case {
            dims,
            xbc: data(rows * dims.xbc_width(), 0.3, 1.0),
            dt: data(rows * 4, 1.7, 1.0),
            dt_bias: data(4, 0.5, 0.5),
            a_log: data(4, 2.2, 0.8),
            d: data(4, 0.9, 1.0),
        }
    }

    fn inputs(c: &Case) -> ScanInputs<&[f32]> {
        ScanInputs {
            xbc: &c.xbc,
            dt: &c.dt,
            dt_bias: &c.dt_bias,
            a_log: &c.a_log,
            d: &c.d,
        }
    }

    /// The recurrence of layers.md, in f64, for head `h` of sequence `b`
    /// with `A_log[h] = a_log`: its y, `[seq, P]`.
    fn reference_head(c: &Case, b: usize, h: usize, a_log: f64) -> Vec<f64> {
        let l = Layout::new(c.dims);
        let seq = c.dims.tokens.seq;
        let mut y = vec![0.0; seq * l.p];
        let mut s = vec![0.0f64; l.p * l.n];
        let a = -a_log.exp();
        for t in 0..seq {
            let r = b * seq + t;
            let row = &c.xbc[r * l.width..];
            let raw = (c.dt[r * l.heads + h] + c.dt_bias[h]) as f64;
            let dt = raw.exp().ln_1p();
            for p in 0..l.p {
                let mut acc = 0.0;
                for n in 0..l.n {
                    let v = &mut s[p * l.n + n];
                    *v = (dt * a).exp() * *v + dt * row[l.x(h) + p] as f64 * row[l.b(h) + n] as f64;
                    acc += *v * row[l.c(h) + n] as f64;
                }
                y[t * l.p + p] = acc + c.d[h] as f64 * row[l.x(h) + p] as f64;
            }
        }
        y
    }

    /// The recurrence of layers.md, in f64, one (sequence, head) at a time.
    fn reference(c: &Case) -> Vec<f64> {
        let dims = c.dims;
        let l = Layout::new(dims);
        let seq = dims.tokens.seq;
        let mut y = vec![0.0; dims.tokens.batch * seq * l.d_inner];
        for b in 0..dims.tokens.batch {
            for h in 0..l.heads {
                let head = reference_head(c, b, h, c.a_log[h] as f64);
                for (t, values) in head.chunks_exact(l.p).enumerate() {
                    let r = b * seq + t;
                    y[r * l.d_inner + l.x(h)..][..l.p].copy_from_slice(values);
                }
            }
        }
        y
    }

    /// The backward's gradients (xbc, dt, A_log, D) of `c` given dy, with
    /// the forward's chunk states.
    fn gradients(c: &Case, states: &[f32], dy: &[f32]) -> [Vec<f32>; 4] {
        let heads = c.dims.heads;
        let mut out = [
            vec![0.0; c.xbc.len()],
            vec![0.0; c.dt.len()],
            vec![0.0; heads],
            vec![0.0; heads],
        ];
        let [gx, gdt, ga, gd] = &mut out;
        let grads = ScanGrads {
            xbc: &mut gx[..],
            dt: &mut gdt[..],
            a_log: &mut ga[..],
            d: &mut gd[..],
        };
        ssd_scan_backward(inputs(c), states, dy, grads, c.dims);
        out
    }

    /// The forward's y and chunk states.
    fn run(c: &Case) -> (Vec<f32>, Vec<f32>) {
        let rows = c.dims.tokens.batch * c.dims.tokens.seq;
        let mut y = vec![0.0; rows * c.dims.heads * c.dims.head_dim];
        let mut states = vec![0.0; c.dims.states_len()];
        ssd_scan_forward(inputs(c), &mut y, &mut states, c.dims);
        (y, states)
    }

    #[test]
    fn forward_matches_the_recurrence() {
        let c = case(2);
        let (y, _) = run(&c);
        for (a, b) in y.iter().zip(reference(&c)) {
            assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn backward_matches_finite_differences_and_is_chunk_independent() {
        let dy = data(120, 4.4, 1.0);
        let mut results = Vec::new();
        for chunk in [1, 2, 3, 5, 8] {
            let c = case(chunk);
            let (y, states) = run(&c);
            let [gx, gdt, ga, gd] = gradients(&c, &states, &dy);
            results.push((y, gx, gdt, ga, gd));
        }
        for r in &results[1..] {
            assert!(r == &results[0], "the chunk length changed the bits");
        }
        let (_, gx, gdt, ga, gd) = &results[0];
        let loss = |c: &Case| -> f64 {
            reference(c)
                .iter()
                .zip(&dy)
                .map(|(y, d)| y * *d as f64)
                .sum()
        };
        let h = 1e-3f32;
        let fd = |field: fn(&mut Case) -> &mut Vec<f32>, i: usize| -> f64 {
            let mut plus = case(3);
            field(&mut plus)[i] += h;
            let mut minus = case(3);
            field(&mut minus)[i] -= h;
            (loss(&plus) - loss(&minus)) / (2.0 * h as f64)
        };
        let close = |got: f32, want: f64, what: &str| {
            assert!(
                (got as f64 - want).abs() < 2e-3 * (1.0 + want.abs()),
                "{what}: {got} vs {want}"
            );
        };
        for (i, &g) in gx.iter().enumerate() {
            close(g, fd(|c| &mut c.xbc, i), &format!("xbc[{i}]"));
        }
        for (i, &g) in gdt.iter().enumerate() {
            close(g, fd(|c| &mut c.dt, i), &format!("dt[{i}]"));
        }
        for i in 0..4 {
            close(ga[i], fd(|c| &mut c.a_log, i), &format!("a_log[{i}]"));
            close(gd[i], fd(|c| &mut c.d, i), &format!("d[{i}]"));
        }
    }

    /// The GPU tests hold their kernels to this backward, so its precision
    /// is measured here: at real widths (heads of 80 channels, states of
    /// 64, 16 heads a group) and fast decays (dt A down to -4.6 a step,
    /// where the chunked forms lose precision), d_a_log in f32 against an
    /// f64 central difference of the f64 recurrence (8e-7 of its norm
    /// when this test was written).
    #[test]
    fn backward_d_a_log_at_real_widths_is_within_2e_6_of_f64() {
        let dims = ScanDims {
            tokens: Tokens::new(1, 130),
            heads: 32,
            head_dim: 80,
            groups: 2,
            state: 64,
            chunk: 128,
        };
        let l = Layout::new(dims);
        let (rows, heads) = (dims.tokens.seq, dims.heads);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut uniform = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    lo + (hi - lo) * ((seed >> 40) as f32 / (1u64 << 24) as f32)
                })
                .collect()
        };
        let c = Case {
            dims,
            xbc: uniform(rows * dims.xbc_width(), -1.5, 1.5),
            dt: uniform(rows * heads, -2.0, 1.0),
            dt_bias: uniform(heads, -1.0, 0.5),
            a_log: uniform(heads, -1.0, 1.0),
            d: uniform(heads, -1.0, 1.0),
        };
        let dy = uniform(rows * l.d_inner, -1.0, 1.0);
        let (_, states) = run(&c);
        let [_, _, ga, _] = gradients(&c, &states, &dy);
        // sum_t dy_t . y_t of head h in f64, with A_log[h] = a_log.
        let head_loss = |h: usize, a_log: f64| -> f64 {
            reference_head(&c, 0, h, a_log)
                .chunks_exact(l.p)
                .enumerate()
                .map(|(t, y)| {
                    let dy = &dy[t * l.d_inner + l.x(h)..][..l.p];
                    y.iter().zip(dy).map(|(y, d)| y * *d as f64).sum::<f64>()
                })
                .sum()
        };
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for (h, &got) in ga.iter().enumerate() {
            let (at, e) = (c.a_log[h] as f64, 1e-5);
            let want = (head_loss(h, at + e) - head_loss(h, at - e)) / (2.0 * e);
            diff += (got as f64 - want).powi(2);
            norm += want * want;
        }
        let error = (diff / norm).sqrt();
        assert!(error < 2e-6, "d_a_log: {error:e} of its norm from f64");
    }

    #[test]
    fn chunked_form_agrees_with_the_sequential_scan() {
        for chunk in [1, 2, 3, 5, 8] {
            let c = case(chunk);
            let (y, states) = run(&c);
            let mut y2 = vec![0.0; y.len()];
            let mut states2 = vec![0.0; states.len()];
            ssd_scan_forward_chunked(inputs(&c), &mut y2, &mut states2, c.dims);
            for (a, b) in y.iter().zip(&y2).chain(states.iter().zip(&states2)) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + a.abs()),
                    "chunk {chunk}: {a} vs {b}"
                );
            }
        }
    }
}
