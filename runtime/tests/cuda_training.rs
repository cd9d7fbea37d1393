//! Training on GPUs against the CPU and against itself:
//!
//! - f32 mode on one GPU against the CPU: first-step loss within 1e-5
//!   relative, five steps within 1e-4, for the tiny preset and patterns
//!   covering every kind (`M * + - E`), MTP and shared experts; `G`
//!   layers' losses within 1e-5 at every step;
//! - on two GPUs (EP 2, ZeRO-3, bf16): overlap equals plain bit for bit,
//!   the same run twice gives the same bits, ZeRO-3 and no_shard agree
//!   within a tolerance (different collectives sum in different orders);
//! - two ranks sharing one GPU over the copy transport: the same checks,
//!   and in f32 the CPU's two-rank run's losses;
//! - unit filters that leave layers in no unit between units: the same
//!   checks over the copy transport, in bf16 and f32;
//! - bf16 converges like f32 on the default model;
//! - aux-loss-free balancing on one GPU reads the host once a step and
//!   follows the CPU in f32;
//! - a run saved on the GPU resumes on the CPU, and the other way round;
//!   saves behind the steps write the streamed saves' bytes;
//! - refusals: a run that does not fit the GPU, a rank that fails.
//!
//! The GPU tests are `#[ignore]`d, `"needs a GPU"` or `"needs two GPUs"`
//! (those have `two_gpus` in their names): they run on a GPU machine with
//! `--include-ignored` and fail, saying why, where the GPUs are missing. The
//! refusal of `--device cuda` without a GPU is checked where there is none.

use hybridgen_dsl::{ModelConfig, UnitFilter};
use hybridgen_runtime::backend::{AttentionBackend, ExpertGemm};
use hybridgen_runtime::checkpoint::ResumeFrom;
use hybridgen_runtime::cuda::probe;
use hybridgen_runtime::fsdp::Sharding;
use hybridgen_runtime::platform::{DeviceChoice, Transport};
use hybridgen_runtime::recompute::Recompute;
use hybridgen_runtime::schedule::ScheduleKind;
use hybridgen_runtime::train::{StepReport, TrainConfig, TrainSummary, train};
use hybridgen_runtime::{Precision, RuntimeError};

/// GPUs visible, at least `needed` of them: a test that calls this is
/// `#[ignore]`d (it runs where the GPUs are, with `--include-ignored`), so a
/// machine without them fails it rather than passing it unrun.
fn gpus(needed: usize) -> usize {
    match probe() {
        Ok(info) if info.devices.len() >= needed => info.devices.len(),
        Ok(info) => panic!("needs {needed} GPUs, {} visible", info.devices.len()),
        Err(why) => panic!("needs a GPU: {why}"),
    }
}

/// A small run of `pattern` on the tiny preset.
fn config(pattern: &str, device: DeviceChoice, precision: Precision) -> TrainConfig {
    let mut model = ModelConfig::preset("tiny").unwrap();
    model.pattern = pattern.to_string();
    let mut config = TrainConfig::new(model);
    config.device = device;
    config.precision = precision;
    config.ranks = 1;
    config.ep = 1;
    config.steps = 5;
    config.micro_batches = 2;
    config.micro_batch_size = 2;
    config.seq_length = 32;
    config
}

fn run(config: &TrainConfig) -> (Vec<StepReport>, TrainSummary) {
    let mut reports = Vec::new();
    let summary = train(config, &mut |r| reports.push(r.clone()))
        .unwrap_or_else(|e| panic!("{} on {}: {e}", config.model.pattern, config.device));
    (reports, summary)
}

fn relative(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

/// What a bit-exact comparison compares: every loss of every step, the
/// gradient norm, then the parameter hash.
fn bits(reports: &[StepReport], summary: &TrainSummary) -> (Vec<[u64; 4]>, u64) {
    let steps = reports
        .iter()
        .map(|r| {
            [
                r.loss.to_bits(),
                r.mtp_loss.unwrap_or(f64::NAN).to_bits(),
                r.aux_loss.to_bits(),
                r.grad_norm.to_bits(),
            ]
        })
        .collect();
    (steps, summary.param_hash)
}

#[test]
#[ignore = "needs a GPU"]
fn f32_training_on_a_gpu_matches_the_cpu() {
    gpus(1);
    // Every kind (M Mamba, * attention, + MLA, - MLP, E MoE with the tiny
    // preset's shared expert), groups, and MTP.
    for pattern in ["M[*E]M-[*E]", "[M+]-[+E]M", "[M*E]-/*E", "+[ME]-/+E"] {
        let cpu = run(&config(pattern, DeviceChoice::Cpu, Precision::F32)).0;
        let gpu = run(&config(pattern, DeviceChoice::Cuda, Precision::F32)).0;
        follows_the_cpu(pattern, &cpu, &gpu);
    }
}

/// An f32 run on GPUs against the same run on the CPU: the first loss
/// within 1e-5 relative, every step's (and MTP's) within 1e-4.
fn follows_the_cpu(label: &str, cpu: &[StepReport], gpu: &[StepReport]) {
    assert_eq!(cpu.len(), gpu.len(), "{label}: steps");
    for (c, g) in cpu.iter().zip(gpu) {
        println!(
            "{label:14} step {}: cpu {:.9} gpu {:.9} (rel {:.1e}), grad norm rel {:.1e}",
            c.step,
            c.loss,
            g.loss,
            relative(g.loss, c.loss),
            relative(g.grad_norm, c.grad_norm)
        );
    }
    assert!(
        relative(gpu[0].loss, cpu[0].loss) <= 1e-5,
        "{label}: first loss {} vs {}",
        gpu[0].loss,
        cpu[0].loss
    );
    for (c, g) in cpu.iter().zip(gpu) {
        assert!(
            relative(g.loss, c.loss) <= 1e-4,
            "{label} step {}: {} vs {}",
            c.step,
            g.loss,
            c.loss
        );
        if let (Some(cm), Some(gm)) = (c.mtp_loss, g.mtp_loss) {
            assert!(relative(gm, cm) <= 1e-4, "{label} mtp: {gm} vs {cm}");
        }
    }
}

/// `G` layers (the gated delta rule's chunked kernels) in f32 on one GPU
/// against the CPU's step-by-step recurrence: sequences of 100 tokens
/// cross a chunk boundary (64) and end inside the second chunk, and one
/// key head serves two value heads (the tiny preset's `gdn`). Every
/// step's loss within 1e-5 relative; then overlap against plain, bit for
/// bit, in both precisions.
#[test]
#[ignore = "needs a GPU"]
fn gdn_training_on_a_gpu_matches_the_cpu_and_overlap_equals_plain() {
    gpus(1);
    for pattern in ["M[GE]", "G*[GE]"] {
        let gdn = |device| {
            let mut c = config(pattern, device, Precision::F32);
            c.steps = 3;
            c.seq_length = 100;
            c
        };
        let cpu = run(&gdn(DeviceChoice::Cpu)).0;
        let gpu = run(&gdn(DeviceChoice::Cuda)).0;
        follows_the_cpu(pattern, &cpu, &gpu);
        for (c, g) in cpu.iter().zip(&gpu) {
            assert!(
                relative(g.loss, c.loss) <= 1e-5,
                "{pattern} step {}: gpu {} vs cpu {} (rel {:.2e})",
                c.step,
                g.loss,
                c.loss,
                relative(g.loss, c.loss)
            );
        }
        for precision in [Precision::F32, Precision::Bf16] {
            let with = |schedule| {
                let mut c = gdn(DeviceChoice::Cuda);
                c.precision = precision;
                c.micro_batches = 3;
                c.schedule = schedule;
                let (r, s) = run(&c);
                bits(&r, &s)
            };
            let overlap = with(ScheduleKind::Overlap);
            assert_eq!(
                overlap,
                with(ScheduleKind::Plain),
                "{pattern} {precision:?}: overlap vs plain"
            );
        }
    }
}

/// Attention with 64-channel heads in bf16 takes the flash kernels on a
/// GPU (probabilities and score gradients rounded to bf16 between their
/// two products); training follows the CPU's bf16 run (which keeps them in
/// f32) within bf16's noise, and so does `--attention-backend unfused`,
/// which is another path (other bits). Sequences of 96 tokens end inside
/// a tile.
#[test]
#[ignore = "needs a GPU"]
fn bf16_training_with_flash_attention_follows_the_cpu() {
    gpus(1);
    let flash = |device, backend| {
        let mut c = config("[*E]*-*", device, Precision::Bf16);
        let attention = c.model.attention.as_mut().expect("tiny has attention");
        attention.head_dim = Some(64);
        c.seq_length = 96;
        c.steps = 4;
        c.attention = backend;
        c
    };
    let cpu = run(&flash(DeviceChoice::Cpu, AttentionBackend::Flash)).0;
    let (gpu, flash_run) = run(&flash(DeviceChoice::Cuda, AttentionBackend::Flash));
    let (unfused, unfused_run) = run(&flash(DeviceChoice::Cuda, AttentionBackend::Unfused));
    assert_ne!(
        flash_run.param_hash, unfused_run.param_hash,
        "the unfused backend ran the same kernels"
    );
    for (backend, steps) in [("flash", &gpu), ("unfused", &unfused)] {
        assert_eq!(steps.len(), cpu.len(), "{backend}: steps run");
        for (c, g) in cpu.iter().zip(steps) {
            println!(
                "{backend} step {}: cpu {:.6} gpu {:.6} (rel {:.1e}), grad norm {:.4} {:.4} \
                 (rel {:.1e})",
                c.step,
                c.loss,
                g.loss,
                relative(g.loss, c.loss),
                c.grad_norm,
                g.grad_norm,
                relative(g.grad_norm, c.grad_norm)
            );
            assert!(
                relative(g.loss, c.loss) <= 5e-3,
                "{backend} step {}: loss {} vs {}",
                c.step,
                g.loss,
                c.loss
            );
        }
    }
    assert!(
        relative(gpu[0].grad_norm, cpu[0].grad_norm) <= 2e-2,
        "first grad norm {} vs {}",
        gpu[0].grad_norm,
        cpu[0].grad_norm
    );
}

#[path = "support/balancing.rs"]
mod balancing;
use balancing::balanced;

/// Nemotron 3 Nano's routing on the tiny model (sigmoid scores, a top-k
/// scaling factor, aux-loss-free balancing with a bias updated after every
/// step and copied to the GPU before the next step's routing): f32 on a GPU
/// follows the CPU.
#[test]
#[ignore = "needs a GPU"]
fn balanced_routing_on_a_gpu_matches_the_cpu() {
    gpus(1);
    let run_on = |device| {
        let mut c = config("[M*E]-[*E]", device, Precision::F32);
        balanced(&mut c, 0.01);
        run(&c).0
    };
    let (cpu, gpu) = (run_on(DeviceChoice::Cpu), run_on(DeviceChoice::Cuda));
    assert_eq!(cpu.len(), gpu.len());
    for (c, g) in cpu.iter().zip(&gpu) {
        println!(
            "balanced step {}: cpu {:.9} gpu {:.9} (rel {:.1e}), aux {:.3e} vs {:.3e}",
            c.step,
            c.loss,
            g.loss,
            relative(g.loss, c.loss),
            c.aux_loss,
            g.aux_loss
        );
        assert!(
            relative(g.loss, c.loss) <= 1e-4,
            "step {}: {} vs {}",
            c.step,
            g.loss,
            c.loss
        );
        assert!(
            relative(g.aux_loss, c.aux_loss) <= 1e-3,
            "step {} aux",
            c.step
        );
    }
}

/// One GPU, bf16: the overlap schedule runs the same kernels on the same
/// inputs as the plain one, in another order across two streams, so every
/// loss and the parameter hash are the same bits; so is a repeat.
#[test]
#[ignore = "needs a GPU"]
fn on_one_gpu_overlap_equals_plain_bit_for_bit_and_repeats() {
    gpus(1);
    let with = |schedule| {
        let mut c = config("[M*E][M*E]/*E", DeviceChoice::Cuda, Precision::Bf16);
        c.steps = 3;
        c.micro_batches = 3;
        c.schedule = schedule;
        let (r, s) = run(&c);
        bits(&r, &s)
    };
    let overlap = with(ScheduleKind::Overlap);
    assert_eq!(overlap, with(ScheduleKind::Plain), "overlap vs plain");
    assert_eq!(overlap, with(ScheduleKind::Overlap), "the same run twice");
}

/// One GPU, bf16, expert parallelism 1: the experts' GEMMs read each
/// expert's rows on the device (the grouped kernel's segmented launches),
/// so a step reads the host once, its totals, whatever the number of MoE
/// layers and micro-batches. With the cuBLAS expert GEMMs, which need the
/// sizes on the host, every GEMM call reads them again: the count sees it.
#[test]
#[ignore = "needs a GPU"]
fn on_one_gpu_a_step_reads_the_host_once() {
    gpus(1);
    let mut c = config("[M*E][M*E]/*E", DeviceChoice::Cuda, Precision::Bf16);
    c.steps = 3;
    c.micro_batches = 3;
    let reads =
        |c: &TrainConfig| -> Vec<u64> { run(c).0.iter().map(|r| r.device.host_reads).collect() };
    assert_eq!(reads(&c), vec![1; 3], "the grouped kernel");
    c.expert_gemm = ExpertGemm::Cublas;
    let cublas = reads(&c);
    assert!(
        cublas.iter().all(|&n| n > 1 + 3 * 3),
        "cuBLAS's host sizes: {cublas:?}"
    );
}

/// Aux-loss-free balancing on one GPU, expert parallelism 1: each routing
/// adds its counts to the step's loads on the device, which come back with
/// the step's totals, so a step still reads the host once. The bias moves
/// (a rate of 0 trains otherwise after the first step, which routes with a
/// zero bias either way). That the run follows the CPU's is
/// `balanced_routing_on_a_gpu_matches_the_cpu`.
#[test]
#[ignore = "needs a GPU"]
fn on_one_gpu_balancing_reads_the_host_once() {
    gpus(1);
    let mut c = config("[M*E][M*E]/*E", DeviceChoice::Cuda, Precision::Bf16);
    c.steps = 3;
    c.micro_batches = 3;
    balanced(&mut c, 0.05);
    let (reports, summary) = run(&c);
    let reads: Vec<u64> = reports.iter().map(|r| r.device.host_reads).collect();
    assert_eq!(reads, vec![1; 3], "with an expert bias");
    let moving = bits(&reports, &summary);
    balanced(&mut c, 0.0);
    let (reports, summary) = run(&c);
    let frozen = bits(&reports, &summary);
    assert_eq!(
        moving.0[0], frozen.0[0],
        "the first step routes with a zero bias"
    );
    assert_ne!(moving.0[1..], frozen.0[1..], "the bias never moved");
}

/// Programmatic dependent launch (each kernel launched while the one
/// before drains, waiting on the device for its results) changes when
/// kernels start, never what they compute: the same bits with it on (the
/// default) and off, under both schedules. A kernel that read its inputs
/// before its wait would race with the kernel before it and show here.
#[test]
#[ignore = "needs a GPU"]
fn on_one_gpu_dependent_launch_changes_no_bits() {
    gpus(1);
    for schedule in [ScheduleKind::Overlap, ScheduleKind::Plain] {
        let with = |dependent_launch| {
            let mut c = config("[M*E]M-[*E]/*E", DeviceChoice::Cuda, Precision::Bf16);
            c.steps = 3;
            c.micro_batches = 3;
            c.schedule = schedule;
            c.dependent_launch = dependent_launch;
            let (r, s) = run(&c);
            bits(&r, &s)
        };
        assert_eq!(
            with(true),
            with(false),
            "{schedule:?}: dependent launch on vs off"
        );
    }
}

/// Recomputing the dense layers' forwards in the backward gives the same
/// bits on a GPU as keeping their activations, under both schedules.
#[test]
#[ignore = "needs a GPU"]
fn on_one_gpu_recomputation_changes_no_bits() {
    gpus(1);
    for schedule in [ScheduleKind::Overlap, ScheduleKind::Plain] {
        let with = |recompute| {
            let mut c = config("[M*E]M-[*E]/*E", DeviceChoice::Cuda, Precision::Bf16);
            c.steps = 3;
            c.micro_batches = 3;
            c.schedule = schedule;
            c.recompute = recompute;
            let (r, s) = run(&c);
            bits(&r, &s)
        };
        let keep = with(Recompute::None);
        // All of them, the first two (a group's layers split), and the two
        // that keep the most.
        for recompute in [Recompute::Full, Recompute::Layers(2), Recompute::Largest(2)] {
            assert_eq!(
                keep,
                with(recompute),
                "{schedule:?}: recompute {recompute} vs kept"
            );
        }
    }
}

/// Two GPUs, EP 2, ZeRO-3, bf16: the schedules change when work runs,
/// never what is computed.
fn two_gpu_config(schedule: ScheduleKind, sharding: Sharding) -> TrainConfig {
    let mut c = config("[M*E][M*E]/*E", DeviceChoice::Cuda, Precision::Bf16);
    c.ranks = 2;
    c.ep = 2;
    c.steps = 3;
    c.micro_batches = 3;
    c.schedule = schedule;
    c.sharding = sharding;
    c
}

#[test]
#[ignore = "needs two GPUs"]
fn on_two_gpus_overlap_equals_plain_bit_for_bit_and_repeats() {
    gpus(2);
    // Different collectives (reduce-scatters vs all-reduces) sum in
    // different orders on NCCL: equal to bf16's resolution.
    schedules_agree(two_gpu_config, 1e-2);
}

/// Runs of `config`: overlap equals plain and the same run repeats, bit
/// for bit (ZeRO-3); no_shard's losses are ZeRO-3's within `tolerance`.
fn schedules_agree(config: impl Fn(ScheduleKind, Sharding) -> TrainConfig, tolerance: f64) {
    let (r, s) = run(&config(ScheduleKind::Overlap, Sharding::Zero3));
    let (zero3, overlap) = (r.clone(), bits(&r, &s));
    let (r, s) = run(&config(ScheduleKind::Plain, Sharding::Zero3));
    let plain = bits(&r, &s);
    let (r, s) = run(&config(ScheduleKind::Overlap, Sharding::Zero3));
    let again = bits(&r, &s);
    assert_eq!(overlap, plain, "overlap vs plain");
    assert_eq!(overlap, again, "the same run twice");
    let (no_shard, _) = run(&config(ScheduleKind::Overlap, Sharding::NoShard));
    for (a, b) in zero3.iter().zip(&no_shard) {
        println!("step {}: zero3 {} no_shard {}", a.step, a.loss, b.loss);
        assert!(
            relative(a.loss, b.loss) <= tolerance,
            "{} vs {}",
            a.loss,
            b.loss
        );
    }
}

/// Two ranks on one GPU over the copy transport: ZeRO-3's gathers and
/// scatters and EP's all-to-alls run for real on the device, between the
/// ranks' own streams. Overlap equals plain and repeats bit for bit; in
/// f32, the losses are the CPU's two-rank run's (both sum in rank order).
#[test]
#[ignore = "needs a GPU"]
fn two_ranks_sharing_a_gpu_over_the_copy_transport_train_like_the_cpu() {
    gpus(1);
    let shared = |schedule, sharding| {
        let mut c = two_gpu_config(schedule, sharding);
        c.transport = Transport::Copy;
        c
    };
    // no_shard all-reduces what ZeRO-3 reduce-scatters (the same sums, in
    // rank order); the gradient norm's partial sums differ.
    schedules_agree(shared, 1e-3);

    let f32_run = |device| {
        let mut c = shared(ScheduleKind::Overlap, Sharding::Zero3);
        c.device = device;
        c.precision = Precision::F32;
        run(&c).0
    };
    let cpu = f32_run(DeviceChoice::Cpu);
    let gpu = f32_run(DeviceChoice::Cuda);
    follows_the_cpu("2 ranks, 1 GPU", &cpu, &gpu);
}

/// The filtered patterns below, on two GPUs over NCCL (EP 2, bf16):
/// overlap equals plain and repeats bit for bit.
#[test]
#[ignore = "needs two GPUs"]
fn filtered_units_on_two_gpus_keep_parity_over_nccl() {
    gpus(2);
    for (pattern, units) in FILTERED {
        println!("{pattern} --units {units}");
        let filtered = |schedule, sharding| {
            let mut c = two_gpu_config(schedule, sharding);
            c.model.pattern = pattern.to_string();
            c.unit_filter = UnitFilter::parse_kinds(units).unwrap();
            c
        };
        schedules_agree(filtered, 1e-2);
    }
}

/// Patterns and unit choices that leave layers in no unit between units.
const FILTERED: [(&str, &str); 4] = [
    ("[*E]M[*E]", "group"),
    ("M[*E]M[*E]", "E"),
    ("[ME][ME]M[*E]/*E", "group,mtp"),
    ("M[+E]-[+E]", "E"),
];

/// Unit filters that leave layers in no unit between units, on one GPU
/// with two ranks over the copy transport (EP 2, ZeRO-3's gathers and
/// scatters for real): in bf16 and f32 the overlap schedule gives the plain
/// schedule's bits and repeats them, no-shard follows ZeRO-3, and in f32
/// the losses are the CPU's two-rank run's.
#[test]
#[ignore = "needs a GPU"]
fn filtered_units_on_one_gpu_keep_parity_over_the_copy_transport() {
    gpus(1);
    for (pattern, units) in FILTERED {
        for (precision, tolerance) in [(Precision::Bf16, 1e-3), (Precision::F32, 1e-5)] {
            println!("{pattern} --units {units}, {precision:?}");
            let shared = |schedule, sharding| {
                let mut c = two_gpu_config(schedule, sharding);
                c.model.pattern = pattern.to_string();
                c.unit_filter = UnitFilter::parse_kinds(units).unwrap();
                c.transport = Transport::Copy;
                c.precision = precision;
                c
            };
            schedules_agree(shared, tolerance);
            if precision == Precision::F32 {
                let on = |device| {
                    let mut c = shared(ScheduleKind::Overlap, Sharding::Zero3);
                    c.device = device;
                    run(&c).0
                };
                follows_the_cpu(pattern, &on(DeviceChoice::Cpu), &on(DeviceChoice::Cuda));
            }
        }
    }
}

/// Pipeline stages on one GPU over the copy transport: two pipeline ranks
/// (and four: pp 2 with dp 2) share the GPU, their activations and
/// gradients cross by device copies. In f32 a pipeline follows the one-rank
/// run within the GPU's tolerance of the CPU, the schedules agree bit for
/// bit and the run repeats; in bf16 it follows one rank within bf16's.
#[test]
#[ignore = "needs a GPU"]
fn pipeline_stages_on_one_gpu_train_like_one_stage() {
    gpus(1);
    for (pattern, pp, dp, ep) in [
        ("M[*E]|M-[*E]", 2, 1, 1),
        ("[ME]*|E[*E]|M-|[*E]E", 2, 2, 2),
        ("M[*E]|M-[*E]/*E", 2, 1, 1),
    ] {
        for precision in [Precision::F32, Precision::Bf16] {
            let staged = |schedule, pp: usize| {
                let mut c = config(pattern, DeviceChoice::Cuda, precision);
                c.ranks = dp * pp;
                c.ep = ep;
                c.pp = pp;
                c.micro_batches = 4;
                c.steps = 3;
                c.schedule = schedule;
                c.transport = Transport::Copy;
                c
            };
            println!("{pattern} pp {pp} dp {dp} {precision:?}");
            let (r, s) = run(&staged(ScheduleKind::Overlap, pp));
            let overlap = bits(&r, &s);
            let (r2, s2) = run(&staged(ScheduleKind::Plain, pp));
            assert_eq!(overlap, bits(&r2, &s2), "{pattern}: overlap vs plain");
            let (r3, s3) = run(&staged(ScheduleKind::Overlap, pp));
            assert_eq!(overlap, bits(&r3, &s3), "{pattern}: the same run twice");
            let (one, _) = run(&staged(ScheduleKind::Overlap, 1));
            let tolerance = match precision {
                Precision::F32 => 1e-5,
                _ => 2e-2,
            };
            for (a, b) in one.iter().zip(&r) {
                println!("step {}: pp 1 {} pp {pp} {}", a.step, a.loss, b.loss);
                assert!(
                    relative(b.loss, a.loss) <= tolerance,
                    "{} vs {}",
                    b.loss,
                    a.loss
                );
            }
            println!(
                "stages waited {:?} (1F1B's bubble {:?})",
                s.stage_waits, s.ideal_bubble
            );
        }
    }
}

/// Pipeline stages on their own GPUs over NCCL's send and receive.
#[test]
#[ignore = "needs two GPUs"]
fn pipeline_stages_on_two_gpus_train_like_one_stage() {
    gpus(2);
    let staged = |pp: usize, schedule| {
        let mut c = config("M[*E]|M-[*E]", DeviceChoice::Cuda, Precision::F32);
        c.ranks = 2;
        c.pp = pp;
        c.ep = if pp == 1 { 2 } else { 1 };
        c.micro_batches = 4;
        c.steps = 3;
        c.schedule = schedule;
        c
    };
    let (r, s) = run(&staged(2, ScheduleKind::Overlap));
    let (r2, s2) = run(&staged(2, ScheduleKind::Plain));
    assert_eq!(bits(&r, &s), bits(&r2, &s2), "overlap vs plain");
    let cpu = {
        let mut c = staged(2, ScheduleKind::Overlap);
        c.device = DeviceChoice::Cpu;
        run(&c).0
    };
    follows_the_cpu("pp 2 over NCCL", &cpu, &r);
}

#[test]
#[ignore = "needs a GPU"]
fn bf16_converges_like_f32_on_the_default_model() {
    gpus(1);
    let default = |precision| {
        let mut c = TrainConfig::new(ModelConfig::preset("tiny").unwrap());
        c.device = DeviceChoice::Cuda;
        c.precision = precision;
        c.ranks = 1;
        c.ep = 1;
        c
    };
    let (_, f32_run) = run(&default(Precision::F32));
    let (_, bf16_run) = run(&default(Precision::Bf16));
    let (f, b) = (f32_run.final_loss.unwrap(), bf16_run.final_loss.unwrap());
    println!(
        "120 steps: f32 {f:.4}, bf16 {b:.4}; {:.0} and {:.0} tokens/s",
        f32_run.tokens_per_second, bf16_run.tokens_per_second
    );
    assert!((b - f).abs() <= 0.05, "bf16 {b} vs f32 {f}");
}

/// Saves after 2 steps on `first`, resumes for 2 more on `second`, and
/// compares with 4 uninterrupted steps on `first`.
fn save_and_resume(first: DeviceChoice, second: DeviceChoice) {
    let dir = std::env::temp_dir().join(format!(
        "hybridgen-cuda-resume-{}-{first}-{second}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let mut base = config("M[*E]M-[*E]", first, Precision::F32);
    base.steps = 4;
    let (whole, _) = run(&base);
    let mut saving = base.clone();
    saving.steps = 2;
    saving.save = Some(dir.clone());
    run(&saving);
    let mut resuming = base.clone();
    resuming.device = second;
    resuming.resume = Some(ResumeFrom::Dir(dir.clone()));
    let (rest, summary) = run(&resuming);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(summary.resumed_from, Some(2));
    for (a, b) in whole[2..].iter().zip(&rest) {
        println!(
            "{first} -> {second} step {}: {} vs {}",
            a.step, a.loss, b.loss
        );
        assert_eq!(a.step, b.step);
        assert!(relative(b.loss, a.loss) <= 1e-4, "{} vs {}", b.loss, a.loss);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_run_saved_on_the_gpu_resumes_on_the_cpu_and_back() {
    gpus(1);
    save_and_resume(DeviceChoice::Cuda, DeviceChoice::Cpu);
    save_and_resume(DeviceChoice::Cpu, DeviceChoice::Cuda);
}

/// Checkpoints written behind the steps on the GPU (`async_save`: the
/// tensors copied off the device at the save step, the files written on
/// threads) are the bytes of streamed saves, at each step saved, for two
/// ranks sharing the GPU over the copy transport.
#[test]
#[ignore = "needs a GPU"]
fn a_save_behind_the_steps_on_the_gpu_writes_the_streamed_bytes() {
    gpus(1);
    let root = |name: &str| {
        let dir = std::env::temp_dir().join(format!(
            "hybridgen-cuda-async-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    };
    let (streamed, behind) = (root("streamed"), root("behind"));
    let saving = |dir: &std::path::Path, async_save| {
        let mut c = two_gpu_config(ScheduleKind::Overlap, Sharding::Zero3);
        c.transport = Transport::Copy;
        c.steps = 5;
        c.save_every = Some(2);
        c.save = Some(dir.to_path_buf());
        c.async_save = async_save;
        run(&c).1
    };
    let (a, b) = (saving(&streamed, false), saving(&behind, true));
    assert_eq!(a.param_hash, b.param_hash);
    for step in ["step-000002", "step-000004", "step-000005"] {
        for file in [
            "checkpoint.json",
            "rank-00000.safetensors",
            "rank-00001.safetensors",
        ] {
            let (x, y) = (streamed.join(step).join(file), behind.join(step).join(file));
            assert!(
                std::fs::read(&x).unwrap() == std::fs::read(&y).unwrap(),
                "{} differs from the streamed save's",
                y.display()
            );
        }
    }
    let _ = std::fs::remove_dir_all(&streamed);
    let _ = std::fs::remove_dir_all(&behind);
}

#[test]
#[ignore = "needs a GPU"]
fn a_run_too_large_for_the_gpu_is_refused_before_it_allocates() {
    gpus(1);
    let mut c = config("M[*E]M-[*E]", DeviceChoice::Cuda, Precision::Bf16);
    c.model.vocab_size = 131_072;
    c.model.hidden_size = 8192;
    c.micro_batch_size = 64;
    c.seq_length = 4096;
    let err = train(&c, &mut |_| {}).unwrap_err();
    let message = err.to_string();
    println!("{message}");
    assert!(matches!(err, RuntimeError::OutOfMemory(_)), "{message}");
    assert!(message.contains("free on cuda:0"), "{message}");
}

/// Where no GPU is usable, `--device cuda` is refused naming what is
/// missing, and `auto` takes the CPU.
#[test]
fn device_cuda_without_a_gpu_is_refused_and_auto_takes_the_cpu() {
    if probe().is_ok() {
        println!("skipped: a GPU is visible here");
        return;
    }
    let c = config("M[*E]M-[*E]", DeviceChoice::Cuda, Precision::F32);
    let err = train(&c, &mut |_| {}).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, RuntimeError::Device { .. }), "{message}");
    assert_eq!(err.code(), "device_failed");
    // The library names the setting by its field (the CLI by its flag).
    assert!(message.contains("config.device = cuda"), "{message}");
    let mut auto = c.clone();
    auto.device = DeviceChoice::Auto;
    auto.steps = 1;
    train(&auto, &mut |_| {}).unwrap();
}
