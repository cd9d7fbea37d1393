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

/// What a layer of each kind keeps from its forward to its backward, as the
/// CPU backend's arena counts it, is what the memory model counts
/// (`layer_sizes::layer`), in f32 and in bf16, for the `tiny` preset and
/// its variants (the options that change what a layer keeps): never more (a
/// run the check lets through must fit) and not much less (a refusal must
/// not turn away a run that fits); and the layer's peak through its forward
/// and backward stays under that plus its working set. The slack is the
/// arena's 64-byte granule a buffer and the few fixed-size buffers a layer
/// keeps beside its per-token ones (an `E` layer's expert counts and loss
/// slots, a `D` layer's loss slot).
#[test]
fn every_layer_keeps_what_the_memory_model_counts() {
    use crate::backend::{Backend, Precision};
    use crate::cpu::CpuBackend;
    use crate::layers::LayerImpl;
    use crate::view::ViewMut;
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
    // Values of order one, the same in every run.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    };
    let mut report = String::new();
    let mut failures = Vec::new();
    for (name, model, kinds) in &variants {
        for precision in [Precision::F32, Precision::Bf16] {
            let sizes = ElementSizes::cpu(precision);
            for &kind in *kinds {
                // A backend of its own, so its arena's peak is this layer's.
                let b = CpuBackend::new(precision);
                // Uploaded in the compute dtype: no staging copy raises
                // the peak before the layer runs.
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
                let experts = model.moe.as_ref().unwrap().num_experts;
                let layer = LayerImpl::new(kind, model, experts).unwrap();
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
                    .unwrap();
                let kept = b.stats().in_use_bytes - before;
                let wgrad = layer
                    .backward_input(&b, &views, saved, b.view_mut(&dx).unwrap(), 1.0)
                    .unwrap();
                let mut grad_views: Vec<_> = grads.iter().map(|g| b.view_mut(g).unwrap()).collect();
                layer.backward_weight(&b, wgrad, &mut grad_views).unwrap();
                let peak = b.stats().peak_in_use_bytes - before;
                let (saved, extra) = layer_sizes::layer(model, kind, tokens);
                let (counted, bound) = (saved.bytes(sizes), saved.plus(extra).bytes(sizes));
                report += &format!(
                    "{name} {kind:?} {precision}: kept {kept}, counted {counted}; peak {peak}, bound {bound}\n"
                );
                let slack = 4096;
                if kept > counted + slack || counted > kept + slack {
                    failures.push(format!("{name} {kind:?} {precision} keeps"));
                }
                // The peak through forward and backward stays under what
                // is kept plus the working set. Not counted: the norms'
                // weight-gradient partial sums, at most 256 slices of the
                // norm's width in f32 whatever the tokens (`NormDims`),
                // 3 KiB of `G`'s 1.2 MB here.
                if peak > bound + slack + bound / 100 {
                    failures.push(format!("{name} {kind:?} {precision} peaks"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:?} differ:\n{report}");
}
