//! The routing of Nemotron 3 Nano on any test model: sigmoid scores, a top-k
//! scaling factor, and aux-loss-free balancing whose expert bias moves by
//! `rate` after every step.

use hybridgen_dsl::config::ScoreFunction;
use hybridgen_runtime::train::TrainConfig;

/// Turns `c`'s MoE routing into balanced routing at `rate`.
pub fn balanced(c: &mut TrainConfig, rate: f32) {
    let moe = c.model.moe.as_mut().expect("a model with an [moe] section");
    moe.score_function = ScoreFunction::Sigmoid;
    moe.topk_scaling_factor = 2.5;
    moe.expert_bias = true;
    moe.expert_bias_update_rate = rate;
}
