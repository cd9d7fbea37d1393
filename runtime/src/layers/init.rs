//! Parameter initialisation (layers.md): every value is a function of
//! `(seed, full parameter name, element index)` only, through a small
//! counter-based generator (splitmix64, Box–Muller for normals). So a
//! parameter gets the same values however it is later sharded, and expert
//! weights, keyed by their **global** expert name, agree across EP layouts.
//!
//! | parameter | values |
//! | --- | --- |
//! | norms (`*norm*.weight`, `layer_norm_weight`), Mamba `D` | 1 |
//! | Mamba `conv1d_weight`, `conv1d_bias` | uniform in `+-1/sqrt(K)` (PyTorch's conv default, which Megatron's `MambaMixer` keeps) |
//! | `G`'s `conv1d.weight` | uniform in `+-1/sqrt(kg)` (the same default, which Megatron's `GatedDeltaNet` keeps) |
//! | other biases | 0 |
//! | `A_log` | `log(U(1, 16))` |
//! | Mamba `dt_bias` | `softplus^-1(dt0)`, `dt0` log-uniform in [1e-3, 0.1] (floor 1e-4) |
//! | `G`'s `dt_bias` | 1 |
//! | `linear_proj`, `out_proj`, `linear_fc2` (experts and shared too) | normal(0, std / sqrt(2 * layers)) |
//! | everything else | normal(0, std) |

use crate::error::{Result, RuntimeError};
use hybridgen_dsl::ModelConfig;
use hybridgen_dsl::params::ParamDef;

/// The scales the rules need: `init_std`, the number of decoder layers
/// the output projections are scaled by, and the conv kernels of Mamba (K)
/// and of the gated delta net (kg).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InitScale {
    pub std: f32,
    pub num_layers: usize,
    pub conv_kernel: usize,
    pub gdn_conv_kernel: usize,
}

impl InitScale {
    /// `config.init_std` with `num_layers` physical decoder layers.
    pub fn new(config: &ModelConfig, num_layers: usize) -> Self {
        InitScale {
            std: config.init_std,
            num_layers,
            conv_kernel: config.mamba.as_ref().map_or(4, |m| m.conv_kernel),
            gdn_conv_kernel: config.gdn.as_ref().map_or(4, |g| g.conv_kernel),
        }
    }

    /// `1 / sqrt(K)`: PyTorch's default bound for a depthwise conv's weight
    /// and bias (fan-in K), which Megatron's `MambaMixer` leaves in place.
    pub fn conv_bound(&self) -> f32 {
        (1.0 / (self.conv_kernel.max(1) as f64).sqrt()) as f32
    }

    /// `1 / sqrt(kg)`: the same default for the gated delta net's conv
    /// weight (fan-in kg), which Megatron's `GatedDeltaNet` leaves in place
    /// (its `conv_init` is unset in the hybrid layer spec).
    pub fn gdn_conv_bound(&self) -> f32 {
        (1.0 / (self.gdn_conv_kernel.max(1) as f64).sqrt()) as f32
    }

    /// `std / sqrt(2 * layers)`, Megatron's scaled init for output projections.
    pub fn output_std(&self) -> f32 {
        (self.std as f64 / (2.0 * self.num_layers.max(1) as f64).sqrt()) as f32
    }
}

/// How a parameter is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ParamInit {
    Normal {
        std: f32,
    },
    Ones,
    Zeros,
    /// `U(-bound, bound)`.
    Uniform {
        bound: f32,
    },
    /// `log(U(1, 16))`.
    MambaALog,
    /// `softplus^-1(dt0)`, `dt0` log-uniform in [1e-3, 0.1].
    MambaDtBias,
}

impl ParamInit {
    /// The rule for a parameter, from its full name.
    pub fn for_name(full_name: &str, scale: &InitScale) -> ParamInit {
        let mut parts = full_name.rsplit('.');
        let last = parts.next().unwrap_or_default();
        let owner = parts.next().unwrap_or_default();
        // Mamba's conv (the plan's names; `mixer.conv1d.weight` is only the
        // Hugging Face name, which never reaches initialisation).
        let mamba_conv = matches!((owner, last), ("mixer", "conv1d_weight" | "conv1d_bias"));
        if mamba_conv {
            return ParamInit::Uniform {
                bound: scale.conv_bound(),
            };
        }
        // The gated delta net's (`self_attention.conv1d.weight`, no bias),
        // and its dt_bias, which Megatron's `GatedDeltaNet` sets to ones.
        let mut above = parts.clone();
        if (owner, last) == ("conv1d", "weight") && above.next() == Some("self_attention") {
            return ParamInit::Uniform {
                bound: scale.gdn_conv_bound(),
            };
        }
        if (owner, last) == ("self_attention", "dt_bias") {
            return ParamInit::Ones;
        }
        match last {
            "A_log" => return ParamInit::MambaALog,
            "dt_bias" => return ParamInit::MambaDtBias,
            "D" => return ParamInit::Ones,
            "layer_norm_weight" => return ParamInit::Ones,
            "bias" | "conv1d_bias" => return ParamInit::Zeros,
            _ => {}
        }
        if last.starts_with("weight") {
            if owner.contains("norm") {
                return ParamInit::Ones;
            }
            if matches!(owner, "linear_proj" | "out_proj" | "linear_fc2") {
                return ParamInit::Normal {
                    std: scale.output_std(),
                };
            }
        }
        ParamInit::Normal { std: scale.std }
    }
}

/// Fills `out` (the whole parameter, `def.numel()` values) for `full_name`
/// (for an expert weight, its global name: see [`global_expert_name`]).
pub fn init_param(
    seed: u64,
    full_name: &str,
    def: &ParamDef,
    scale: &InitScale,
    out: &mut [f32],
) -> Result<()> {
    if out.len() != def.numel() {
        return Err(RuntimeError::InvalidArgument(format!(
            "init of `{full_name}`: {} values for shape {:?} ({} elements)",
            out.len(),
            def.shape,
            def.numel()
        )));
    }
    init_param_range(seed, full_name, def, scale, 0, out)
}

/// Fills `out` with elements `[offset, offset + out.len())` of the parameter,
/// the same values [`init_param`] puts there (for filling a shard directly).
pub fn init_param_range(
    seed: u64,
    full_name: &str,
    def: &ParamDef,
    scale: &InitScale,
    offset: usize,
    out: &mut [f32],
) -> Result<()> {
    if offset
        .checked_add(out.len())
        .is_none_or(|end| end > def.numel())
    {
        return Err(RuntimeError::InvalidArgument(format!(
            "init of `{full_name}`: elements {offset}..{} are outside its {} elements",
            offset.saturating_add(out.len()),
            def.numel()
        )));
    }
    let rule = ParamInit::for_name(full_name, scale);
    let stream = Stream::new(seed, full_name);
    // Every value depends on its index alone, so the range splits over
    // threads with the same bits: an 8.9 B-parameter model draws billions
    // of normals (about 30 ns each) before its first step.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads > 1 && out.len() >= 2 * PARALLEL_PIECE {
        let piece = out.len().div_ceil(threads).max(PARALLEL_PIECE);
        std::thread::scope(|scope| {
            for (k, part) in out.chunks_mut(piece).enumerate() {
                let start = offset + k * piece;
                scope.spawn(move || fill(rule, stream, start, part));
            }
        });
    } else {
        fill(rule, stream, offset, out);
    }
    Ok(())
}

/// Values a thread of [`init_param_range`] draws at least.
const PARALLEL_PIECE: usize = 1 << 16;

/// Elements `[offset, offset + out.len())` of the parameter `rule` and
/// `stream` describe, into `out`.
fn fill(rule: ParamInit, stream: Stream, offset: usize, out: &mut [f32]) {
    // Element `i` of `out` is `f(offset + i)`.
    let each = |out: &mut [f32], f: &dyn Fn(u64) -> f32| {
        for (i, v) in out.iter_mut().enumerate() {
            *v = f((offset + i) as u64);
        }
    };
    match rule {
        ParamInit::Normal { std } => fill_normals(std, stream, offset, out),
        ParamInit::Ones => out.fill(1.0),
        ParamInit::Zeros => out.fill(0.0),
        ParamInit::Uniform { bound } => each(out, &|i| {
            (bound as f64 * (2.0 * stream.uniform(i) - 1.0)) as f32
        }),
        ParamInit::MambaALog => each(out, &|i| (1.0 + 15.0 * stream.uniform(i)).ln() as f32),
        ParamInit::MambaDtBias => each(out, &|i| {
            let (lo, hi) = (1e-3f64.ln(), 0.1f64.ln());
            let dt = (lo + stream.uniform(i) * (hi - lo)).exp().max(1e-4);
            // softplus^-1(y) = y + log(1 - exp(-y)).
            (dt + (-(-dt).exp_m1()).ln()) as f32
        }),
    }
}

/// Normals `[offset, offset + out.len())` times `std`. Box–Muller gives two
/// normals a pair of uniforms: each pair is drawn once (the operations of
/// `Stream::normal` on each element, so the same bits).
fn fill_normals(std: f32, stream: Stream, offset: usize, out: &mut [f32]) {
    let end = offset + out.len();
    for pair in offset / 2..end.div_ceil(2) {
        let (radius, angle) = stream.polar(pair as u64);
        let normals = [radius * angle.cos(), radius * angle.sin()];
        for (index, normal) in (2 * pair..).zip(normals) {
            if (offset..end).contains(&index) {
                out[index - offset] = (std as f64 * normal) as f32;
            }
        }
    }
}

/// The global name of a rank-local expert weight: `...weight{j}` on EP rank
/// `ep_rank` holding `local_experts` experts is `...weight{ep_rank * L + j}`.
/// Names without `.experts.` are returned unchanged.
pub fn global_expert_name(
    local_name: &str,
    ep_rank: usize,
    local_experts: usize,
) -> Result<String> {
    if !local_name.contains(".experts.") {
        return Ok(local_name.to_string());
    }
    let stem = local_name.trim_end_matches(|c: char| c.is_ascii_digit());
    let j: usize = local_name[stem.len()..].parse().map_err(|_| {
        RuntimeError::InvalidArgument(format!("expert weight `{local_name}` has no expert index"))
    })?;
    if j >= local_experts {
        return Err(RuntimeError::InvalidArgument(format!(
            "expert weight `{local_name}`: index {j} but {local_experts} local experts"
        )));
    }
    Ok(format!("{stem}{}", ep_rank * local_experts + j))
}

/// The splitmix64 finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// A counter-based stream of random values, keyed by (seed, name): value `i`
/// is `mix(key + (i + 1) * gamma)`, splitmix64's sequence, computable at any
/// index.
#[derive(Clone, Copy)]
struct Stream {
    key: u64,
}

impl Stream {
    fn new(seed: u64, name: &str) -> Self {
        let mut key = mix(seed.wrapping_add(GAMMA));
        for byte in name.bytes() {
            key = mix(key ^ u64::from(byte)).wrapping_add(GAMMA);
        }
        Stream { key }
    }

    fn bits(&self, counter: u64) -> u64 {
        mix(self
            .key
            .wrapping_add(counter.wrapping_add(1).wrapping_mul(GAMMA)))
    }

    /// Uniform in (0, 1), never 0 (Box–Muller takes its log).
    fn uniform(&self, counter: u64) -> f64 {
        ((self.bits(counter) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Box–Muller's radius and angle for the pair `pair` of normals.
    fn polar(&self, pair: u64) -> (f64, f64) {
        let radius = (-2.0 * self.uniform(2 * pair).ln()).sqrt();
        let angle = std::f64::consts::TAU * self.uniform(2 * pair + 1);
        (radius, angle)
    }

    /// Standard normal: Box–Muller on the pair `(2p, 2p + 1)` of uniforms,
    /// cosine for even elements, sine for odd (element by element: what
    /// `fill_normals` draws a pair at a time, as its tests check).
    #[cfg(test)]
    fn normal(&self, index: u64) -> f64 {
        let (radius, angle) = self.polar(index / 2);
        if index.is_multiple_of(2) {
            radius * angle.cos()
        } else {
            radius * angle.sin()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scale() -> InitScale {
        InitScale {
            std: 0.02,
            num_layers: 8,
            conv_kernel: 4,
            gdn_conv_kernel: 4,
        }
    }

    #[test]
    fn rules_follow_the_names() {
        let s = scale();
        let out = ParamInit::Normal { std: 0.02 / 4.0 };
        for (name, want) in [
            ("decoder.layers.0.mixer.A_log", ParamInit::MambaALog),
            ("decoder.layers.0.mixer.dt_bias", ParamInit::MambaDtBias),
            ("decoder.layers.0.mixer.D", ParamInit::Ones),
            (
                "decoder.layers.0.mixer.conv1d_bias",
                ParamInit::Uniform { bound: 0.5 },
            ),
            (
                "decoder.layers.0.mixer.conv1d_weight",
                ParamInit::Uniform { bound: 0.5 },
            ),
            (
                "decoder.layers.3.self_attention.conv1d.weight",
                ParamInit::Uniform { bound: 0.5 },
            ),
            ("decoder.layers.3.self_attention.dt_bias", ParamInit::Ones),
            (
                "decoder.layers.3.self_attention.A_log",
                ParamInit::MambaALog,
            ),
            (
                "decoder.layers.3.self_attention.out_norm.weight",
                ParamInit::Ones,
            ),
            ("decoder.layers.3.self_attention.out_proj.weight", out),
            (
                "decoder.layers.0.mixer.in_proj.layer_norm_weight",
                ParamInit::Ones,
            ),
            ("decoder.layers.0.mixer.norm.weight", ParamInit::Ones),
            ("decoder.layers.0.mixer.out_proj.weight", out),
            ("decoder.layers.1.self_attention.linear_proj.weight", out),
            (
                "decoder.layers.1.self_attention.q_layernorm.weight",
                ParamInit::Ones,
            ),
            ("decoder.layers.2.mlp.linear_fc2.weight", out),
            ("decoder.layers.2.mlp.experts.linear_fc2.weight7", out),
            ("decoder.layers.2.mlp.shared_experts.linear_fc2.weight", out),
            (
                "decoder.layers.2.mlp.experts.linear_fc1.weight7",
                ParamInit::Normal { std: 0.02 },
            ),
            ("decoder.layers.2.pre_mlp_layernorm.weight", ParamInit::Ones),
            ("decoder.final_norm.weight", ParamInit::Ones),
            ("mtp.layers.0.enorm.weight", ParamInit::Ones),
            (
                "mtp.layers.0.eh_proj.weight",
                ParamInit::Normal { std: 0.02 },
            ),
            (
                "embedding.word_embeddings.weight",
                ParamInit::Normal { std: 0.02 },
            ),
            ("output_layer.weight", ParamInit::Normal { std: 0.02 }),
        ] {
            assert_eq!(ParamInit::for_name(name, &s), want, "{name}");
        }
    }

    #[test]
    fn values_depend_on_seed_and_name_only_and_ranges_agree_with_the_whole() {
        let def = ParamDef::new("weight", &[64, 33]);
        let name = "decoder.layers.0.mlp.linear_fc1.weight";
        let mut a = vec![0.0; def.numel()];
        let mut b = vec![0.0; def.numel()];
        init_param(7, name, &def, &scale(), &mut a).unwrap();
        init_param(7, name, &def, &scale(), &mut b).unwrap();
        assert_eq!(a, b);
        let mut shard = vec![0.0; 301];
        init_param_range(7, name, &def, &scale(), 999, &mut shard).unwrap();
        assert_eq!(&shard[..], &a[999..1300]);
        init_param(8, name, &def, &scale(), &mut b).unwrap();
        assert_ne!(a, b);
        init_param(
            7,
            "decoder.layers.1.mlp.linear_fc1.weight",
            &def,
            &scale(),
            &mut b,
        )
        .unwrap();
        assert_ne!(a, b);
        assert!(init_param_range(7, name, &def, &scale(), 2000, &mut shard).is_err());
        assert!(init_param(7, name, &def, &scale(), &mut shard).is_err());
    }

    /// Normals drawn a pair at a time are element `i`'s normal, for runs
    /// starting and ending on either element of a pair.
    #[test]
    fn normals_drawn_by_pairs_are_the_elements_normals() {
        let stream = Stream::new(7, "w");
        let std = 0.75f32;
        for offset in [0usize, 1, 2, 7] {
            for len in [0usize, 1, 2, 3, 6] {
                let mut out = vec![f32::NAN; len];
                fill(ParamInit::Normal { std }, stream, offset, &mut out);
                for (i, v) in out.iter().enumerate() {
                    let want = (std as f64 * stream.normal((offset + i) as u64)) as f32;
                    assert_eq!(v.to_bits(), want.to_bits(), "offset {offset}, element {i}");
                }
            }
        }
    }

    /// A parameter large enough to be drawn over threads gets the bits a
    /// single thread draws, for every rule, from any offset.
    #[test]
    fn values_drawn_over_threads_are_the_values_of_one_thread() {
        let n = 3 * PARALLEL_PIECE + 17;
        let def = ParamDef::new("weight", &[n + 5]);
        for name in [
            "decoder.layers.0.mlp.linear_fc1.weight",
            "decoder.layers.0.mixer.A_log",
            "decoder.layers.0.mixer.dt_bias",
            "decoder.layers.0.mixer.conv1d_weight",
        ] {
            let rule = ParamInit::for_name(name, &scale());
            for offset in [0, 5] {
                let mut parallel = vec![0.0f32; n];
                init_param_range(7, name, &def, &scale(), offset, &mut parallel).unwrap();
                let mut serial = vec![0.0f32; n];
                fill(rule, Stream::new(7, name), offset, &mut serial);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(bits(&parallel) == bits(&serial), "{name} from {offset}");
                assert!(serial.iter().any(|&v| v != serial[0]), "{name}");
            }
        }
    }

    #[test]
    fn normals_have_the_requested_moments() {
        let def = ParamDef::new("weight", &[100_000]);
        let mut v = vec![0.0; def.numel()];
        init_param(1, "x.weight", &def, &scale(), &mut v).unwrap();
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 3e-4, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 3e-4, "std {}", var.sqrt());
    }

    #[test]
    fn mamba_parameters_fall_in_their_ranges() {
        let def = ParamDef::new("dt_bias", &[1000]);
        let mut dt = vec![0.0; 1000];
        init_param(3, "decoder.layers.0.mixer.dt_bias", &def, &scale(), &mut dt).unwrap();
        for &b in &dt {
            let softplus = (b as f64).exp().ln_1p();
            assert!((1e-3 - 1e-6..=0.1 + 1e-6).contains(&softplus), "{softplus}");
        }
        let mut a = vec![0.0; 1000];
        init_param(3, "decoder.layers.0.mixer.A_log", &def, &scale(), &mut a).unwrap();
        assert!(a.iter().all(|&v| (0.0..=16f32.ln()).contains(&v)));
        assert!(a.iter().any(|&v| v > 2.0) && a.iter().any(|&v| v < 1.0));
    }

    /// Megatron's `MambaMixer` keeps PyTorch's conv init: weight and bias
    /// uniform in +-1/sqrt(K) (+-0.5 for K = 4), filling the range.
    #[test]
    fn mamba_conv_is_uniform_in_one_over_root_k() {
        for (k, bound) in [(4usize, 0.5f32), (9, 1.0 / 3.0)] {
            let s = InitScale {
                conv_kernel: k,
                ..scale()
            };
            for name in ["conv1d_weight", "conv1d_bias"] {
                let def = ParamDef::new(name, &[4000]);
                let mut v = vec![0.0; 4000];
                let full = format!("decoder.layers.0.mixer.{name}");
                init_param(5, &full, &def, &s, &mut v).unwrap();
                assert!(
                    v.iter().all(|x| x.abs() <= bound),
                    "{full}: out of +-{bound}"
                );
                let max = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                assert!(
                    max > 0.95 * bound,
                    "{full}: largest |value| {max} of +-{bound}"
                );
                let mean = v.iter().map(|&x| x as f64).sum::<f64>() / 4000.0;
                assert!(mean.abs() < 0.03 * bound as f64, "{full}: mean {mean}");
            }
        }
    }

    #[test]
    fn global_expert_names_offset_by_the_rank() {
        let n = "decoder.layers.1.mlp.experts.linear_fc1.weight1";
        assert_eq!(
            global_expert_name(n, 2, 4).unwrap(),
            "decoder.layers.1.mlp.experts.linear_fc1.weight9"
        );
        assert_eq!(
            global_expert_name("output_layer.weight", 3, 4).unwrap(),
            "output_layer.weight"
        );
        assert!(global_expert_name(n, 0, 1).is_err());
        assert!(global_expert_name("a.experts.weight", 0, 1).is_err());
    }
}
