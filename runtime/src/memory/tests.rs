//! The memory estimates against hand counts (recomputed layers, the
//! kernels' scratch), and what the machine reports (meminfo, cgroups).

use super::*;
use crate::backend::AttentionBackend;
use crate::view::DType;

/// Recomputed layers keep their `[tokens, hidden]` input, and what they
/// would have kept moves to the working set; MoE layers keep theirs.
#[test]
fn recomputed_layers_keep_their_input() {
    let model = ModelConfig::preset("bench-hybrid-moe").unwrap();
    let tokens = Tokens::new(1, 4096);
    let sizes = ElementSizes::cpu(crate::backend::Precision::Bf16);
    let of = |kinds: &[LayerKind], recompute| {
        activations(&model, kinds.iter().copied(), 0, tokens, sizes, recompute)
    };
    let dense = [LayerKind::Mamba, LayerKind::Attention, LayerKind::Mlp];
    let (keep, again) = (of(&dense, Recompute::None), of(&dense, Recompute::Full));
    let input = 4096 * model.hidden_size as u64 * sizes.compute;
    assert_eq!(again.layers, 3 * input);
    assert!(keep.layers > 5 * again.layers, "{keep:?}");
    assert!(again.working_set > keep.working_set);
    assert!(again.total < keep.total);
    let moe = [LayerKind::Moe];
    assert_eq!(of(&moe, Recompute::Full), of(&moe, Recompute::None));
}

/// bench-hybrid-moe at one 4,096-token sequence: attention batches all
/// 4 KV heads (128 MiB of scores and probabilities each) under the
/// 512 MiB cap, plus 4,096 x (16 x 128 + 4 x 256) f32 accumulators; the
/// scan's backward needs 3 x 4,096 x 64 step values, 3 x 64 x 16 chunk
/// values and 16 chunks' 64 x 64 x 128 carries, in f32, sequentially;
/// chunked, the carries and 3 values a chunk and head, and each of the
/// 16 chunks' step values (7 x 64 x 256), operands (6 x 4,096 x 256
/// and 4 x 8 x 128 x 256) and scores (2 x 8 and 2 x 64 of 256 x 256).
#[test]
fn gpu_kernel_scratch_is_the_largest_call() {
    let model = ModelConfig::preset("bench-hybrid-moe").unwrap();
    let kinds = [LayerKind::Mamba, LayerKind::Attention, LayerKind::Moe];
    let tokens = Tokens::new(1, 4096);
    let attention = 4 * 4096 * 4096 * 8 + 4096 * (16 * 128 + 4 * 256) * 4;
    let scan = (3 * 4096 * 64 + 3 * 64 * 16 + 16 * 64 * 64 * 128) * 4;
    // Per chunk: step values, wide, narrow, group and head scores, and
    // the row sums' partials (8 blocks of 32 columns); across chunks:
    // the carries, the states' and carries' bf16 copies, decays and
    // partials.
    let per_chunk = 7 * 64 * 256
        + 6 * 4096 * 256
        + 4 * 8 * 128 * 256
        + (2 * 8 + 2 * 64) * 256 * 256
        + 64 * 256 * 8;
    let chunked = (16 * 64 * (2 * 64 * 128 + 3) + 16 * per_chunk) * 4;
    // In bf16 the flash kernels take the benchmark's attention (128
    // channels a head, 4 query heads a KV head): each query head's
    // share of dk and dv and D_t, in f32: more than the sequential
    // scan's, less than the chunked one's.
    let bf16 = |kinds: &[LayerKind], caps| {
        gpu_kernel_scratch(
            &model,
            kinds,
            tokens,
            DType::Bf16,
            AttentionBackend::Flash,
            caps,
        )
    };
    let flash = 4096 * 16 * (2 * 128 + 1) * 4;
    assert_eq!(bf16(&kinds, (512 << 20, 0)), flash);
    assert_eq!(bf16(&[LayerKind::Attention], (512 << 20, 0)), flash);
    let defaults = (512 << 20, crate::cuda::launch::SCAN_CHUNKED_SCRATCH_BYTES);
    assert_eq!(bf16(&kinds, defaults), chunked);
    // In f32, the GEMM path: f32 scores and probabilities, 8 bytes a
    // score entry (bf16 problems it takes store split bf16
    // probabilities, also 8 bytes).
    let f32_scratch = |kinds: &[LayerKind], caps| {
        gpu_kernel_scratch(
            &model,
            kinds,
            tokens,
            DType::F32,
            AttentionBackend::Flash,
            caps,
        )
    };
    assert_eq!(f32_scratch(&kinds, (512 << 20, 0)), attention);
    // A cap one KV head's scores do not fit: the tiled kernels, no
    // scratch; the scan's is what is left.
    assert_eq!(f32_scratch(&kinds, (1 << 20, 0)), scan);
    // Without attention layers, only the scan counts.
    let no_attention = [LayerKind::Mamba, LayerKind::Moe];
    assert_eq!(f32_scratch(&no_attention, (512 << 20, 0)), scan);
    // The chunked scan backward under the default cap: one slice of all
    // 16 chunks, more than attention's.
    assert_eq!(f32_scratch(&kinds, defaults), chunked);
    // On a GPU the need takes it where it is more than the CPU's.
    let need = MemoryNeed::new(
        1,
        StateEstimate::default(),
        ActivationEstimate::default(),
        1,
        1 << 20,
        1,
        false,
    );
    let gpu = need.clone().on_one_gpu(1 << 30, attention);
    assert_eq!(gpu.kernel_scratch, attention);
    assert_eq!(gpu.total, need.per_rank - (1 << 20) + attention + (1 << 30));
}

#[test]
fn meminfo_and_cgroups_are_read() {
    let meminfo = "MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n";
    assert_eq!(mem_available(meminfo), Some(20_000_000 * 1024));
    assert_eq!(mem_available("MemTotal: 5 kB\n"), None);

    let root = std::env::temp_dir().join(format!("hybridgen-cgroup-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // v2: the leaf has no limit, its parent 8 GiB with 3 GiB in use.
    let leaf = root.join("user.slice/job");
    std::fs::create_dir_all(&leaf).unwrap();
    std::fs::write(leaf.join("memory.max"), "max\n").unwrap();
    std::fs::write(leaf.join("memory.current"), "1000\n").unwrap();
    std::fs::write(
        root.join("user.slice/memory.max"),
        format!("{}\n", 8u64 << 30),
    )
    .unwrap();
    std::fs::write(
        root.join("user.slice/memory.current"),
        format!("{}\n", 3u64 << 30),
    )
    .unwrap();
    let v2 = cgroup_headroom("0::/user.slice/job\n", &root).unwrap();
    assert_eq!(v2.bytes, 5 << 30);
    assert!(v2.source.contains("user.slice/memory.max"), "{}", v2.source);
    // v1, unlimited: no figure; limited: limit - usage.
    let v1 = root.join("memory/docker/abc");
    std::fs::create_dir_all(&v1).unwrap();
    std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
    assert_eq!(cgroup_headroom("4:memory:/docker/abc\n", &root), None);
    std::fs::write(v1.join("memory.limit_in_bytes"), "4096\n").unwrap();
    std::fs::write(v1.join("memory.usage_in_bytes"), "1024\n").unwrap();
    let limited = cgroup_headroom("4:cpu,memory:/docker/abc\n", &root).unwrap();
    assert_eq!(limited.bytes, 3072);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn byte_figures_read_well() {
    assert_eq!(bytes(512), "512 B");
    assert_eq!(bytes(1536), "1.5 KiB");
    assert_eq!(bytes(3 << 30), "3.0 GiB");
    assert_eq!(bytes(u64::MAX), "16.0 EiB");
}

/// One layer of `kind` run forward and backward on a CPU backend of its own
/// (so its arena's peak is this layer's), with values of order one: what
/// the forward kept and the peak through forward and backward, in bytes
/// above the weights, inputs and gradients, against the memory model's
/// count of what it keeps and that plus its working set. Errors say which
/// figure is off.
fn layer_against_the_model(
    model: &ModelConfig,
    kind: LayerKind,
    tokens: Tokens,
    precision: crate::backend::Precision,
) -> std::result::Result<String, String> {
    use crate::backend::{Backend, Precision};
    use crate::cpu::CpuBackend;
    use crate::layers::LayerImpl;
    use crate::view::ViewMut;

    let b = CpuBackend::new(precision);
    let sizes = ElementSizes::cpu(precision);
    // splitmix64, uniform in [-0.5, 0.5).
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    };
    // Uploaded in the compute dtype: no staging copy raises the peak before
    // the layer runs.
    let filled = |host: Vec<f32>| {
        let buf = b.alloc(host.len(), b.compute_dtype()).unwrap();
        match precision {
            Precision::F32 => b.upload(&host, ViewMut::whole(&buf)),
            Precision::Bf16 => {
                let host: Vec<_> = host.into_iter().map(half::bf16::from_f32).collect();
                b.upload(&host, ViewMut::whole(&buf))
            }
        }
        .unwrap();
        buf
    };
    let experts = model.moe.as_ref().map_or(1, |m| m.num_experts);
    let layer = LayerImpl::new(kind, model, experts).map_err(|e| e.to_string())?;
    let weights: Vec<_> = layer
        .params()
        .iter()
        .map(|p| filled(values(p.numel())))
        .collect();
    let rows = tokens.batch * tokens.seq;
    let x = filled(values(rows * model.hidden_size));
    let dx = filled(values(rows * model.hidden_size));
    let grads: Vec<_> = layer
        .params()
        .iter()
        .map(|p| b.alloc(p.numel(), DType::F32).unwrap())
        .collect();
    let views: Vec<_> = weights.iter().map(|w| b.view(w).unwrap()).collect();
    let before = b.stats().in_use_bytes;
    assert_eq!(b.stats().peak_in_use_bytes, before);
    let saved = layer
        .forward(&b, &views, b.view_mut(&x).unwrap(), tokens)
        .map_err(|e| e.to_string())?;
    let kept = b.stats().in_use_bytes - before;
    let wgrad = layer
        .backward_input(&b, &views, saved, b.view_mut(&dx).unwrap(), 1.0)
        .map_err(|e| e.to_string())?;
    let mut grad_views: Vec<_> = grads.iter().map(|g| b.view_mut(g).unwrap()).collect();
    layer
        .backward_weight(&b, wgrad, &mut grad_views)
        .map_err(|e| e.to_string())?;
    let peak = b.stats().peak_in_use_bytes - before;
    let (saved, extra) = layer_sizes::layer(model, kind, tokens);
    let (counted, bound) = (saved.bytes(sizes), saved.plus(extra).bytes(sizes));
    let figures = format!(
        "{kind:?} {precision} at {tokens:?}: kept {kept}, counted {counted}; peak {peak}, bound {bound}"
    );
    // The arena's 64-byte granule a buffer, and the few fixed-size buffers
    // a layer keeps beside its per-token ones (an `E` layer's expert counts
    // and loss slots, a `D` layer's loss slot).
    let slack = 4096;
    if kept > counted + slack || counted > kept + slack {
        return Err(format!("keeps other than counted: {figures}"));
    }
    // Not counted in the bound: the norms' weight-gradient partial sums, at
    // most 256 slices of the norm's width in f32 whatever the tokens
    // (`NormDims`), 3 KiB of `tiny`'s `G` layer's 1.2 MB at 2 x 96 tokens.
    if peak > bound + slack + bound / 100 {
        return Err(format!("peaks above the bound: {figures}"));
    }
    Ok(figures)
}

/// What a layer of each kind keeps from its forward to its backward, as the
/// CPU backend's arena counts it, is what the memory model counts
/// (`layer_sizes::layer`), in f32 and in bf16, for the `tiny` preset and
/// its variants (the options that change what a layer keeps): never more (a
/// run the check lets through must fit) and not much less (a refusal must
/// not turn away a run that fits); and the layer's peak through its forward
/// and backward stays under that plus its working set
/// (`layer_against_the_model`).
#[test]
fn every_layer_keeps_what_the_memory_model_counts() {
    use crate::backend::Precision;
    use hybridgen_dsl::config::{Activation, Position};

    let kinds = LayerKind::ALL;
    let tiny = ModelConfig::preset("tiny").unwrap();
    let mut variants = vec![("tiny", tiny.clone(), &kinds[..])];
    let mut other = tiny.clone();
    let attention = other.attention.as_mut().unwrap();
    attention.qk_norm = !attention.qk_norm;
    attention.position = match attention.position {
        Position::None => Position::Rope,
        Position::Rope => Position::None,
    };
    let mla = other.mla.as_mut().unwrap();
    mla.qk_norm = !mla.qk_norm;
    other.dsa.as_mut().unwrap().indexer_loss_coeff = 0.01;
    other.mlp.as_mut().unwrap().activation = Activation::Swiglu;
    let moe = other.moe.as_mut().unwrap();
    moe.activation = Activation::Swiglu;
    moe.shared_expert_ffn_hidden_size = match moe.shared_expert_ffn_hidden_size {
        Some(_) => None,
        None => Some(48),
    };
    variants.push(("variant", other.clone(), &kinds[..]));
    other.dsa.as_mut().unwrap().indexer_sparse_loss = true;
    other.mlp.as_mut().unwrap().activation = Activation::Gelu;
    variants.push(("sparse loss", other.clone(), &kinds[..]));
    // Queries projected from the hidden state (`+` only: `D`'s indexer
    // reads the compressed query).
    other.mla.as_mut().unwrap().q_lora_rank = None;
    variants.push(("no q latent", other, &[LayerKind::Mla][..]));

    let tokens = Tokens::new(2, 96);
    let mut report = String::new();
    let mut failures = Vec::new();
    for (name, model, kinds) in &variants {
        for precision in [Precision::F32, Precision::Bf16] {
            for &kind in *kinds {
                match layer_against_the_model(model, kind, tokens, precision) {
                    Ok(figures) => report += &format!("{name} {figures}\n"),
                    Err(e) => failures.push(format!("{name} {e}")),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}\nthe others:\n{report}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]

    /// The same over generated widths, head counts, ranks, top-k, options
    /// and token counts: a count that is right only for the presets'
    /// widths (two terms that cancel there) fails here.
    #[test]
    fn every_layer_keeps_what_the_memory_model_counts_at_any_width(
        hidden in 1usize..7,
        attention in (1usize..4, 1usize..3, 1usize..4, proptest::bool::ANY, proptest::bool::ANY),
        mla in (1usize..4, 0usize..4, 1usize..5, 1usize..4, 1usize..3, 1usize..4, proptest::bool::ANY),
        dsa in (1usize..3, 1usize..4, 1usize..40, proptest::bool::ANY, proptest::bool::ANY),
        gdn in (1usize..3, 1usize..3, 1usize..4, 1usize..4, 2usize..5),
        mamba in (1usize..3, 1usize..3, 1usize..3, 1usize..4, 1usize..5, 2usize..5),
        ffn in (1usize..9, 0usize..3, 2usize..6, 1usize..6, 0usize..5, 0usize..3),
        tokens in (1usize..3, 3usize..48),
        bf16 in proptest::bool::ANY,
    ) {
        use crate::backend::Precision;
        use hybridgen_dsl::config::{Activation, Position};
        let mut model = ModelConfig::preset("tiny").unwrap();
        model.hidden_size = 8 * hidden;
        let a = model.attention.as_mut().unwrap();
        (a.num_kv_groups, a.num_heads) = (attention.0, attention.0 * attention.1);
        a.head_dim = Some(4 * attention.2);
        a.qk_norm = attention.3;
        a.position = if attention.4 { Position::Rope } else { Position::None };
        let m = model.mla.as_mut().unwrap();
        m.num_heads = mla.0;
        m.q_lora_rank = Some(8 * mla.1 + 4);
        m.kv_lora_rank = 8 * mla.2;
        m.qk_head_dim = 4 * mla.3;
        m.qk_rope_head_dim = 2 * mla.4;
        m.v_head_dim = 4 * mla.5;
        m.qk_norm = mla.6;
        let d = model.dsa.as_mut().unwrap();
        d.index_heads = dsa.0;
        d.index_head_dim = 8 * dsa.1;
        d.index_topk = dsa.2;
        d.indexer_loss_coeff = if dsa.3 { 0.01 } else { 0.0 };
        d.indexer_sparse_loss = dsa.4;
        let g = model.gdn.as_mut().unwrap();
        (g.key_heads, g.value_heads) = (gdn.0, gdn.0 * gdn.1);
        g.key_head_dim = 8 * gdn.2;
        g.value_head_dim = 8 * gdn.3;
        g.conv_kernel = gdn.4;
        let s = model.mamba.as_mut().unwrap();
        (s.num_groups, s.num_heads) = (mamba.0, mamba.0 * mamba.1);
        s.head_dim = 4 * mamba.2;
        s.state_size = 8 * mamba.3;
        s.chunk_size = 4 * mamba.4;
        s.conv_kernel = mamba.5;
        s.inner_size = None;
        let activation = [Activation::SquaredRelu, Activation::Gelu, Activation::Swiglu][ffn.1];
        let mlp = model.mlp.as_mut().unwrap();
        mlp.ffn_hidden_size = 8 * ffn.0;
        mlp.activation = activation;
        let e = model.moe.as_mut().unwrap();
        e.num_experts = ffn.2;
        e.top_k = ffn.3.min(ffn.2);
        e.ffn_hidden_size = 8 * ffn.0 + 4;
        e.shared_expert_ffn_hidden_size = (ffn.4 > 0).then_some(8 * ffn.4);
        e.activation = [Activation::Swiglu, Activation::SquaredRelu, Activation::Gelu][ffn.5];
        let tokens = Tokens::new(tokens.0, tokens.1);
        let precision = if bf16 { Precision::Bf16 } else { Precision::F32 };
        for kind in LayerKind::ALL {
            let figures = layer_against_the_model(&model, kind, tokens, precision);
            proptest::prop_assert!(figures.is_ok(), "{}", figures.unwrap_err());
        }
    }
}

/// What the output head keeps from its forward to its backward, as the CPU
/// backend's arena counts it, is what `Head::kept_elements` (and with it the
/// memory model) counts, whether it keeps its logit gradients or its
/// backward recomputes them, in whole chunks or in several; its peak through
/// forward and backward stays under that plus one chunk of logits and the
/// rows' losses.
#[test]
fn the_head_keeps_what_the_memory_model_counts() {
    use crate::backend::{Backend, Precision};
    use crate::cpu::CpuBackend;
    use crate::layers::Head;
    use crate::view::ViewMut;

    let model = ModelConfig::preset("tiny").unwrap();
    let rows = 2 * 96;
    let (h, vocab) = (model.hidden_size, model.padded_vocab_size());
    let head = Head::new(&model).unwrap();
    let heads = [
        ("keeping", head),
        ("recomputing", head.with_kept_limit(0)),
        (
            "recomputing in chunks",
            head.with_kept_limit(0).with_chunk_rows(7).unwrap(),
        ),
        ("keeping, in chunks", head.with_chunk_rows(7).unwrap()),
    ];
    let mut failures = Vec::new();
    for (name, head) in heads {
        for precision in [Precision::F32, Precision::Bf16] {
            let b = CpuBackend::new(precision);
            let sizes = ElementSizes::cpu(precision);
            let weight = b.alloc(vocab * h, b.compute_dtype()).unwrap();
            let hidden = b.alloc(rows * h, b.compute_dtype()).unwrap();
            let targets = b.alloc(rows, DType::U32).unwrap();
            let ids: Vec<u32> = (0..rows as u32).map(|t| t % vocab as u32).collect();
            b.upload(&ids, ViewMut::whole(&targets)).unwrap();
            let loss = b.alloc(1, DType::F64).unwrap();
            let dh = b.alloc(rows * h, b.compute_dtype()).unwrap();
            let dw = b.alloc(vocab * h, DType::F32).unwrap();
            let before = b.stats().in_use_bytes;
            let saved = head
                .forward(
                    &b,
                    b.view(&weight).unwrap(),
                    b.view(&hidden).unwrap(),
                    b.view(&targets).unwrap(),
                    b.view_mut(&loss).unwrap(),
                    Some(0.5),
                )
                .unwrap();
            let kept = b.stats().in_use_bytes - before;
            head.backward(
                &b,
                b.view(&weight).unwrap(),
                saved,
                b.view(&targets).unwrap(),
                0.5,
                b.view_mut(&dh).unwrap(),
                b.view_mut(&dw).unwrap(),
            )
            .unwrap();
            let peak = b.stats().peak_in_use_bytes - before;
            let counted = head.kept_elements(rows) as u64 * sizes.compute;
            let bound =
                counted + head.chunk_elements(rows) as u64 * sizes.compute + 4 * rows as u64;
            // Each buffer rounds up to the arena's 64-byte granule.
            if kept.abs_diff(counted) > 256 || peak > bound + 256 {
                failures.push(format!(
                    "{name} {precision}: kept {kept}, counted {counted}; peak {peak}, bound {bound}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    // The memory model counts the production head.
    let n = rows as u64;
    let model_head = head_activations(&model, n);
    assert_eq!(model_head.kept.compute, head.kept_elements(rows) as u64);
    assert_eq!(model_head.working.compute, head.chunk_elements(rows) as u64);
}
