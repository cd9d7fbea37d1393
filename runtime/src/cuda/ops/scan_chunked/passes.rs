//! The chunked forward and backward on [`KernelSet`]: two passes over a
//! problem's slices, with what crosses chunks in between (see the module
//! above for the maths).

use super::*;

impl KernelSet {
    /// `Backend::ssd_scan_backward` in chunked form, with `scratch` an f32
    /// view of at least [`ScanChunkPlan::scratch_len`] elements that
    /// nothing else uses until it returns. Same contract as
    /// [`KernelSet::ssd_scan_backward`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ssd_scan_backward_chunked(
        &self,
        stream: &CudaStream,
        blas: &Blas,
        queues: &QueueSet,
        inputs: ScanInputs<GpuView>,
        states: GpuView,
        dy: GpuView,
        grads: ScanGrads<GpuView>,
        scratch: GpuView,
        dims: ScanDims,
        plan: ScanChunkPlan,
    ) -> Result<()> {
        let k = "ssd_scan_backward";
        let checked = backward_tags(dims, &inputs, &dy, &grads);
        let [dyt, dxt, ddtt] = checked.others;
        let ScanGrads {
            xbc: d_xbc,
            dt: d_dt,
            a_log: d_a_log,
            d: d_d,
        } = grads;
        let call = Call::new(
            k,
            (blas, queues, self.scan_mma_sums),
            (inputs, Some(dy), states),
            Tags::new(checked.inputs, [dyt, dxt, ddtt]),
            (scratch, dims, plan, checked.chunks),
            &[d_xbc, d_dt],
        )?;
        let (parts, shape, slices, operands, tags) = (
            &call.parts,
            call.shape,
            call.plan.slices(call.items),
            &call.operands,
            &call.tags,
        );
        let gemm = |g: StridedGemm| call.gemm(g);
        let chunks = checked.chunks;

        // First pass: each chunk's own state gradient L_c = dY^T diag(e^Lam)
        // C (into the carries), then the carries K over all chunks.
        for (i0, i1) in slices.clone() {
            self.chunk_prepare(stream, operands, tags, parts, dims, i0, i1 - i0)?;
            // The group's heads at once: their columns of e^Lam dY and
            // their carries lie side by side (M = J P).
            gemm(batched(
                (i1 - i0) * dims.groups,
                (shape.jp, shape.n, shape.q),
                (shape.head_columns(parts.dy_e, 0), true),
                (pairs(parts.c, shape.n, shape.q * shape.n), false),
                shape.group_states(parts.carry, i0, dims.heads),
                0.0,
            ))?;
        }
        // The carries' bf16 copy, written as they are combined (none when
        // the operands are f32).
        let carry_copy = if parts.bf16() { parts.carry_op.ptr } else { 0 };
        self.ssd_scan_carry_combine(
            stream,
            (parts.carry.ptr, carry_copy),
            parts.chunk_decay.ptr,
            dims,
            chunks,
        )?;
        // The forward's states as operands: their bf16 copy, or themselves.
        let states_op = match parts.states_op {
            Some(copy) => {
                let copy = part(copy, 0, operands.states.len);
                self.cast(stream, operands.states, copy)?;
                copy
            }
            None => operands.states,
        };

        // Second pass: the gradients, slice by slice.
        for (i0, i1, prepared) in call.plan.second_pass(call.items) {
            if !prepared {
                self.chunk_prepare(stream, operands, tags, parts, dims, i0, i1 - i0)?;
            }
            self.chunk_gradients(
                stream,
                &gemm,
                (operands, states_op),
                tags,
                parts,
                (d_xbc, d_dt),
                dims,
                shape,
                (i0, i1 - i0),
            )?;
        }
        self.ssd_scan_backward_params(stream, parts.partials.ptr, dims, chunks, d_a_log, d_d)
    }

    /// `Backend::ssd_scan_forward` in chunked form (overwrites `y` and
    /// `states`), with `scratch` as for
    /// [`KernelSet::ssd_scan_backward_chunked`] (the forward uses part of
    /// it). Same contract as [`KernelSet::ssd_scan_forward`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ssd_scan_forward_chunked(
        &self,
        stream: &CudaStream,
        blas: &Blas,
        queues: &QueueSet,
        inputs: ScanInputs<GpuView>,
        y: GpuView,
        states: GpuView,
        scratch: GpuView,
        dims: ScanDims,
        plan: ScanChunkPlan,
    ) -> Result<()> {
        let k = "ssd_scan_forward";
        let checked: Tagged<1> = forward_tags(dims, &inputs, &y);
        let [yt] = checked.others;
        let chunks = checked.chunks;
        let call = Call::new(
            k,
            (blas, queues, self.scan_mma_sums),
            (inputs, None, states),
            Tags::new(checked.inputs, [0, yt, 0]),
            (scratch, dims, plan, chunks),
            &[y],
        )?;
        let (parts, s, slices, o, tags) = (
            &call.parts,
            call.shape,
            call.plan.slices(call.items),
            &call.operands,
            &call.tags,
        );
        let gemm = |g: StridedGemm| call.gemm(g);
        let (qq, qn) = (s.q * s.q, s.q * s.n);
        let wide = |view: GpuView, j: usize| s.head_columns(view, j);

        // First pass: each chunk's own X^T diag(w) B into its state slot,
        // then the states passed along the chunks.
        for (i0, i1) in slices.clone() {
            self.chunk_prepare(stream, o, tags, parts, dims, i0, i1 - i0)?;
            // The group's heads at once (M = J P), as in the backward.
            gemm(batched(
                (i1 - i0) * dims.groups,
                (s.jp, s.n, s.q),
                (wide(parts.x_w, 0), true),
                (pairs(parts.b, s.n, qn), false),
                s.group_states(states, i0, dims.heads),
                0.0,
            ))?;
        }
        let ks = "ssd_scan_state_combine";
        let [batch_u, heads_u, pn_u, chunks_u] =
            [dims.tokens.batch, dims.heads, s.pn, chunks].map(|v| v as u64);
        // The states as operands: their bf16 copy (written as they are
        // passed along), or themselves.
        let states_op = parts.states_op.map(|copy| part(copy, 0, states.len));
        let copy = states_op.map_or(0, |v| v.ptr);
        let states_op = states_op.unwrap_or(states);
        let quads = crate::cuda::ops::scan::combine_quads(pn_u, states.ptr, copy);
        let mut b = KernelArgs::new(stream, self.function(ks)?);
        b.arg(&states.ptr)
            .arg(&copy)
            .arg(&parts.chunk_decay.ptr)
            .arg(&batch_u);
        b.arg(&heads_u).arg(&pn_u).arg(&chunks_u).arg(&quads);
        let elements = product(k, &[dims.tokens.batch, dims.heads, s.pn])?;
        self.go(
            ks,
            &mut b,
            grid_for(elements / if quads == 1 { 4 } else { 1 }),
        )?;

        // Second pass: y, slice by slice.
        for (i0, i1, prepared) in call.plan.second_pass(call.items) {
            let count = i1 - i0;
            if !prepared {
                self.chunk_prepare(stream, o, tags, parts, dims, i0, count)?;
            }
            let pair_count = count * dims.groups;
            let c_mat = pairs(parts.c, s.n, qn);
            gemm(batched(
                pair_count,
                (s.q, s.q, s.n),
                (c_mat, false),
                (pairs(parts.b, s.n, qn), true),
                pairs(parts.cb, s.q, qq),
                0.0,
            ))?;
            if parts.mma_times {
                // M made and multiplied where it is needed, never stored: a
                // block per (item, head, block of rows).
                let blocks = product(k, &[count, dims.heads, dims.chunk / MMA_TIMES_ROWS])?;
                let pointers = [parts.x_op, parts.cb, parts.t_acc, parts.steps].map(|v| v.ptr);
                self.scores_mma(
                    stream,
                    MmaScores::Times,
                    &pointers,
                    (dims, count),
                    (blocks, MMA_TIMES_THREADS),
                )?;
            } else {
                self.chunk_scores(stream, parts, None, dims, count)?;
                s.head_scores_times(&gemm, pair_count, (parts.m, false), parts.x_op, parts.t_acc)?;
            }
            s.times_head_states(&gemm, (i0, count, dims.heads), c_mat, states_op, parts.u)?;
            let ko = if parts.quads {
                "ssd_chunk_output_quads"
            } else {
                "ssd_chunk_output"
            };
            let slice = SliceArgs::new(dims, i0, count);
            let narrow = slice.narrow();
            let mut b = KernelArgs::new(stream, self.function(ko)?);
            let op_tag = parts.operand_tag();
            b.arg(&parts.x_op.ptr)
                .arg(&op_tag)
                .arg(&parts.t_acc.ptr)
                .arg(&parts.u.ptr)
                .arg(&parts.steps.ptr)
                .arg(&o.d.ptr)
                .arg(&tags.skip)
                .arg(&y.ptr)
                .arg(&yt);
            let elements = product(k, &[pair_count, s.q, s.jp])?;
            if parts.quads {
                narrow.push(&mut b);
                self.go(ko, &mut b, grid_for(elements / 4))?;
            } else {
                slice.push(&mut b);
                self.go(ko, &mut b, grid_for(elements))?;
            }
        }
        Ok(())
    }

    /// A slice's per-step values (`ssd_chunk_factors`) and packed operands
    /// (`ssd_chunk_pack`).
    #[allow(clippy::too_many_arguments)]
    fn chunk_prepare(
        &self,
        stream: &CudaStream,
        o: &Operands,
        tags: &Tags,
        parts: &Parts,
        dims: ScanDims,
        first: usize,
        count: usize,
    ) -> Result<()> {
        let k = "ssd_scan_backward";
        let slice = SliceArgs::new(dims, first, count);
        let [first_u, count_u, seq, heads, _, _, _, chunk] = slice.0;
        let kf = "ssd_chunk_factors";
        let mut b = KernelArgs::new(stream, self.function(kf)?);
        push_step_inputs(&mut b, o, tags);
        b.arg(&parts.steps.ptr)
            .arg(&parts.chunk_decay.ptr)
            .arg(&first_u)
            .arg(&count_u)
            .arg(&seq)
            .arg(&heads)
            .arg(&chunk);
        self.go(kf, &mut b, per_item(count * dims.heads, THREADS)?)?;

        let dy_ptr = o.dy.map_or(0, |dy| dy.ptr);
        let kp = match (parts.quads, parts.bf16()) {
            (true, true) => "ssd_chunk_pack_quads_bf16",
            (true, false) => "ssd_chunk_pack_quads",
            (false, true) => "ssd_chunk_pack_bf16",
            (false, false) => "ssd_chunk_pack",
        };
        // x and dY in f32 where the operands are f32, else their bf16
        // operand copies (the per-step kernels read `x_op` and `dy_op`
        // either way).
        let ((x_f32, dy_f32), (x_copy, dy_copy)) = if parts.bf16() {
            ((0, 0), (parts.x_op.ptr, parts.dy_op.ptr))
        } else {
            ((parts.x.ptr, parts.dy.ptr), (0, 0))
        };
        let mut b = KernelArgs::new(stream, self.function(kp)?);
        b.arg(&o.xbc.ptr)
            .arg(&tags.xbc)
            .arg(&dy_ptr)
            .arg(&tags.dy)
            .arg(&parts.steps.ptr);
        b.arg(&x_f32)
            .arg(&dy_f32)
            .arg(&parts.dy_e.ptr)
            .arg(&parts.x_w.ptr)
            .arg(&parts.b.ptr)
            .arg(&parts.c.ptr)
            .arg(&x_copy)
            .arg(&dy_copy);
        let rows = product(k, &[count, dims.groups, dims.chunk])?;
        if parts.quads {
            let narrow = slice.narrow();
            narrow.push(&mut b);
            let quads = rows * (dims.heads / dims.groups * dims.head_dim + dims.state) / 4;
            return self.go(kp, &mut b, grid_for(quads));
        }
        slice.push(&mut b);
        self.go(kp, &mut b, block_per_row(rows))
    }

    /// `ssd_chunk_scores` over a slice of `count` items: M from CB, and in
    /// the backward (`gradients`: dM, dCB) the products and dCB.
    fn chunk_scores(
        &self,
        stream: &CudaStream,
        parts: &Parts,
        gradients: Option<(GpuView, GpuView)>,
        dims: ScanDims,
        count: usize,
    ) -> Result<()> {
        let k = "ssd_chunk_scores";
        let (d_m, d_cb) = gradients.map_or((0, 0), |(d_m, d_cb)| (d_m.ptr, d_cb.ptr));
        let rows = product(k, &[count, dims.groups, dims.chunk])?;
        let sizes = [count, dims.heads, dims.groups, dims.chunk];
        let (wide, narrow) = (sizes.map(|v| v as u64), sizes.map(|v| v as u32));
        if gradients.is_some() && parts.fused_sums {
            // With the sums (`ssd_chunk_scores_sums`): a block per (item,
            // group, block of columns).
            let kernel = if parts.bf16() {
                "ssd_chunk_scores_sums_bf16"
            } else {
                "ssd_chunk_scores_sums"
            };
            let mut b = KernelArgs::new(stream, self.function(kernel)?);
            b.arg(&parts.cb.ptr)
                .arg(&d_m)
                .arg(&parts.m.ptr)
                .arg(&d_cb)
                .arg(&parts.row_parts.ptr)
                .arg(&parts.steps.ptr);
            for v in &narrow {
                b.arg(v);
            }
            let blocks = product(k, &[count, dims.groups, dims.chunk / SUMS_COLUMNS])?;
            return self.go(kernel, &mut b, per_item(blocks, THREADS)?);
        }
        let kernel = match (parts.quads, parts.bf16()) {
            (true, true) => "ssd_chunk_scores_quads_bf16",
            (true, false) => "ssd_chunk_scores_quads",
            (false, true) => "ssd_chunk_scores_bf16",
            (false, false) => k,
        };
        let mut b = KernelArgs::new(stream, self.function(kernel)?);
        b.arg(&parts.cb.ptr)
            .arg(&d_m)
            .arg(&parts.m.ptr)
            .arg(&d_cb)
            .arg(&parts.steps.ptr);
        if parts.quads {
            for v in &narrow {
                b.arg(v);
            }
            return self.go(k, &mut b, grid_for(rows * dims.chunk / 4));
        }
        for v in &wide {
            b.arg(v);
        }
        self.go(k, &mut b, block_per_row(rows))
    }

    /// One of the tensor-core scores kernels (`which`, for the call's head
    /// width) over a slice of `count` items: its `pointers`, then the
    /// slice's items, heads, groups and chunk in 32 bits (the `_quads`
    /// kernels' indices), on `blocks` of `threads` (and, for the sums, the
    /// group's dynamic shared memory).
    fn scores_mma(
        &self,
        stream: &CudaStream,
        which: MmaScores,
        pointers: &[u64],
        (dims, count): (ScanDims, usize),
        (blocks, threads): (usize, u32),
    ) -> Result<()> {
        let k = which.kernel(dims.head_dim).ok_or_else(|| {
            crate::error::RuntimeError::Unsupported(format!(
                "ssd_chunk_scores {which:?} on tensor cores: no kernel for heads of {} channels \
                 (kernels exist for {MMA_HEAD_WIDTHS:?}; `takes_mma_sums` and `takes_mma_times` \
                 should have sent this call to the GEMMs: a launcher bug to report)",
                dims.head_dim
            ))
        })?;
        let sizes = [count, dims.heads, dims.groups, dims.chunk].map(|v| v as u32);
        let mut b = KernelArgs::new(stream, self.function(k)?);
        for p in pointers {
            b.arg(p);
        }
        for v in &sizes {
            b.arg(v);
        }
        let mut config = per_item(blocks, threads)?;
        if which == MmaScores::Sums {
            config.shared_mem_bytes =
                mma_sums_shared_bytes(dims.heads / dims.groups, dims.head_dim) as u32;
        }
        self.go(k, &mut b, config)
    }

    /// The second pass over one slice of `count` items from `first`.
    #[allow(clippy::too_many_arguments)]
    fn chunk_gradients(
        &self,
        stream: &CudaStream,
        gemm: &dyn Fn(StridedGemm) -> Result<()>,
        (o, states_op): (&Operands, GpuView),
        tags: &Tags,
        parts: &Parts,
        (d_xbc, d_dt): (GpuView, GpuView),
        dims: ScanDims,
        s: Shape,
        (first, count): (usize, usize),
    ) -> Result<()> {
        let k = "ssd_scan_backward";
        let pair_count = count * dims.groups;
        let (qq, qn) = (s.q * s.q, s.q * s.n);
        let wide = |view: GpuView, j: usize| s.head_columns(view, j);
        let run = |m, n, kk, a, a_trans, b, b_trans, c, beta| {
            gemm(batched(
                pair_count,
                (m, n, kk),
                (a, a_trans),
                (b, b_trans),
                c,
                beta,
            ))
        };
        // CB = C B^T per (item, group).
        let b_mat = pairs(parts.b, s.n, qn);
        let c_mat = pairs(parts.c, s.n, qn);
        let cb = pairs(parts.cb, s.q, qq);
        run(s.q, s.q, s.n, c_mat, false, b_mat, true, cb, 0.0)?;
        if parts.mma_sums {
            // dM made and used where it is needed, never stored: a block
            // per (item, group, block of columns).
            let blocks = product(k, &[count, dims.groups, dims.chunk / SUMS_COLUMNS])?;
            let pointers = [
                parts.dy_op,
                parts.x_op,
                parts.cb,
                parts.m,
                parts.d_cb,
                parts.row_parts,
                parts.steps,
            ]
            .map(|v| v.ptr);
            self.scores_mma(
                stream,
                MmaScores::Sums,
                &pointers,
                (dims, count),
                (blocks, MMA_SUMS_THREADS),
            )?;
        } else {
            // dM = dY X^T per head.
            for j in 0..s.j {
                let d_m = pairs(from(parts.d_m, j * qq), s.q, s.j * qq);
                run(
                    s.q,
                    s.q,
                    s.p,
                    wide(parts.dy_op, j),
                    false,
                    wide(parts.x_op, j),
                    true,
                    d_m,
                    0.0,
                )?;
            }
            self.chunk_scores(stream, parts, Some((parts.d_m, parts.d_cb)), dims, count)?;
        }
        let [count_u, heads, head_dim, groups, chunk] =
            [count, dims.heads, dims.head_dim, dims.groups, dims.chunk].map(|v| v as u64);
        // M^T dY, and C S_in^T (for the readout term of dLam) in u.
        s.head_scores_times(gemm, pair_count, (parts.m, true), parts.dy_op, parts.t_acc)?;
        let heads_of = (first, count, dims.heads);
        s.times_head_states(gemm, heads_of, c_mat, states_op, parts.u)?;
        let kr = "ssd_chunk_sums";
        // The row sums' partials when `chunk_scores` took the sums.
        let (row_parts, column_blocks) = if parts.fused_sums {
            (parts.row_parts.ptr, (dims.chunk / SUMS_COLUMNS) as u64)
        } else {
            (0, 0)
        };
        let op_tag = parts.operand_tag();
        let mut b = KernelArgs::new(stream, self.function(kr)?);
        b.arg(&parts.d_m.ptr)
            .arg(&row_parts)
            .arg(&column_blocks)
            .arg(&parts.u.ptr)
            .arg(&parts.dy_op.ptr)
            .arg(&op_tag)
            .arg(&parts.steps.ptr);
        b.arg(&count_u)
            .arg(&heads)
            .arg(&head_dim)
            .arg(&groups)
            .arg(&chunk);
        self.go(
            kr,
            &mut b,
            per_item(product(k, &[count, dims.heads])?, THREADS)?,
        )?;
        // U = B K^T per head (over C S_in^T, now summed).
        s.times_head_states(gemm, heads_of, b_mat, parts.carry_op, parts.u)?;
        // dB = (w X) K + dCB^T C and dC = (e^Lam dY) S_in + dCB B, the
        // group's heads side by side (K = J P).
        let group_rows = |view: GpuView| s.group_states(view, first, dims.heads);
        let d_cb = pairs(parts.d_cb, s.q, qq);
        let d_b = pairs(parts.d_b, s.n, qn);
        let d_c = pairs(parts.d_c, s.n, qn);
        run(
            s.q,
            s.n,
            s.jp,
            wide(parts.x_w, 0),
            false,
            group_rows(parts.carry_op),
            false,
            d_b,
            0.0,
        )?;
        run(s.q, s.n, s.q, d_cb, true, c_mat, false, d_b, 1.0)?;
        run(
            s.q,
            s.n,
            s.jp,
            wide(parts.dy_e, 0),
            false,
            group_rows(states_op),
            false,
            d_c,
            0.0,
        )?;
        run(s.q, s.n, s.q, d_cb, false, b_mat, false, d_c, 1.0)?;

        let slice = SliceArgs::new(dims, first, count);
        let kf = "ssd_chunk_final";
        let mut b = KernelArgs::new(stream, self.function(kf)?);
        push_step_inputs(&mut b, o, tags);
        b.arg(&o.d.ptr).arg(&tags.skip);
        b.arg(&o.states.ptr)
            .arg(&parts.carry.ptr)
            .arg(&parts.x_op.ptr)
            .arg(&parts.dy_op.ptr)
            .arg(&op_tag)
            .arg(&parts.t_acc.ptr)
            .arg(&parts.u.ptr)
            .arg(&parts.steps.ptr);
        b.arg(&d_xbc.ptr)
            .arg(&tags.dxbc)
            .arg(&d_dt.ptr)
            .arg(&tags.ddt)
            .arg(&parts.partials.ptr);
        slice.push(&mut b);
        self.go(
            kf,
            &mut b,
            per_item(product(k, &[count, dims.heads])?, THREADS)?,
        )?;

        let elements = product(k, &[pair_count, s.q, s.n])?;
        let quads = parts.quads && d_xbc.ptr.is_multiple_of(16);
        let ku = if quads {
            "ssd_chunk_unpack_quads"
        } else {
            "ssd_chunk_unpack"
        };
        let mut b = KernelArgs::new(stream, self.function(ku)?);
        b.arg(&parts.d_b.ptr)
            .arg(&parts.d_c.ptr)
            .arg(&d_xbc.ptr)
            .arg(&tags.dxbc);
        if quads {
            let narrow = slice.narrow();
            narrow.push(&mut b);
            return self.go(ku, &mut b, grid_for(elements / 4));
        }
        slice.push(&mut b);
        self.go(ku, &mut b, grid_for(elements))
    }
}
