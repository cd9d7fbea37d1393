//! Aux-loss-free load balancing (layers.md `E` step 3, Megatron's
//! `moe_router_enable_expert_bias`): each `E` layer's f32 expert bias is
//! moved after every optimizer step towards an even load,
//! `bias_i += rate * sign(mean(c) - c_i)`, with `c_i` the tokens routed to
//! expert `i` in that step, summed over micro-batches and data-parallel
//! ranks. The load stays on the device: each routing adds its per-expert
//! counts to the layer's f64 slots of the step's totals
//! ([`crate::schedule::StepTotals`], zeroed with the losses when a step
//! starts), which the host reads with the losses in the step's one read, so
//! balancing adds no host read. The training loop adds every rank's loads
//! and [`update_expert_bias`] moves the bias the same way on every rank.

use super::Balance;
use crate::backend::{Backend, SliceMut};
use crate::error::{Result, RuntimeError};
use crate::layers::zeros_f32;
use crate::model::ModelRuntime;
use hybridgen_dsl::Plan;
use hybridgen_dsl::plan::{LayerRef, Owner};
use std::sync::{Mutex, PoisonError};

/// The layer and checkpoint key of every balancing `E` layer's bias, in
/// parameter order: `...mlp.router.expert_bias`, next to the layer's router
/// weight (an f32 buffer of `[E]`, not a parameter).
pub fn expert_bias_keys(plan: &Plan) -> Vec<(LayerRef, String)> {
    if !plan.model.moe.as_ref().is_some_and(|m| m.expert_bias) {
        return Vec::new();
    }
    plan.params
        .iter()
        .filter_map(|param| {
            let Owner::Layer(layer) = param.owner else {
                return None;
            };
            (plan.def(param).name == "mlp.router.weight")
                .then(|| (layer, expert_bias_key(&plan.checkpoint_key(param, 0))))
        })
        .collect()
}

/// The checkpoint key of the expert bias of the router whose weight's key
/// is `router_key`: the same stem, `expert_bias` for `weight`.
pub fn expert_bias_key(router_key: &str) -> String {
    let stem = router_key.strip_suffix("weight").unwrap_or(router_key);
    format!("{stem}expert_bias")
}

/// One rank's balancing state: for every `E` layer with an expert bias, the
/// bias (on the host, where the update runs, and on the device, where the
/// routing reads it) and where its load lies among the step's load slots.
/// Every rank holds the same bias.
pub struct ExpertBalance<B: Backend> {
    /// By layer index ([`ModelRuntime::layer_index`]).
    layers: Vec<Option<BalancedLayer<B>>>,
    /// Every balancing layer's experts: the load slots they take.
    load_slots: usize,
}

struct BalancedLayer<B: Backend> {
    /// Its checkpoint key.
    key: String,
    rate: f32,
    host: Mutex<Vec<f32>>,
    device: B::Buf,
    experts: usize,
    /// Its first slot among the load slots ([`ExpertBalance::load_slots`]).
    load_at: usize,
}

impl<B: Backend> ExpertBalance<B> {
    /// A zero bias for every `E` layer of `model` that has one (Megatron
    /// starts it at zero).
    pub fn new(model: &ModelRuntime, b: &B) -> Result<Self> {
        let mut layers: Vec<Option<BalancedLayer<B>>> =
            (0..model.layer_count()).map(|_| None).collect();
        for (layer, key) in expert_bias_keys(&model.plan) {
            let index = model.layer_index(layer)?;
            let moe = model.layer(layer)?.as_moe();
            let Some((moe, rate)) = moe.and_then(|m| m.expert_bias_rate().map(|r| (m, r))) else {
                return Err(RuntimeError::InvalidArgument(format!(
                    "`{key}`: the plan gives this layer an expert bias but its layer has none"
                )));
            };
            let experts = moe.num_experts();
            layers[index] = Some(BalancedLayer {
                key,
                rate,
                host: Mutex::new(vec![0.0; experts]),
                device: zeros_f32(b, experts)?,
                experts,
                load_at: 0,
            });
        }
        // The loads lie in layer order, the order `update` reads them in.
        let mut load_at = 0;
        for layer in layers.iter_mut().flatten() {
            layer.load_at = load_at;
            load_at += layer.experts;
        }
        Ok(ExpertBalance {
            layers,
            load_slots: load_at,
        })
    }

    /// Whether any layer balances.
    pub fn is_empty(&self) -> bool {
        self.layers.iter().all(Option::is_none)
    }

    /// The f64 load slots every balancing layer's experts need, one after
    /// another in layer order (the order [`ExpertBalance::update`] takes
    /// the loads in).
    pub fn load_slots(&self) -> usize {
        self.load_slots
    }

    /// Layer `index`'s bias and load for its forward steps (`None` when it
    /// has no bias): `loads` is every layer's load slots
    /// ([`ExpertBalance::load_slots`] of them), of which the layer gets its
    /// own.
    pub fn context<'a>(
        &'a self,
        b: &B,
        index: usize,
        loads: SliceMut<'a, B>,
    ) -> Result<Option<Balance<'a, B>>> {
        match self.layers.get(index) {
            Some(Some(layer)) => {
                if loads.len() != self.load_slots() {
                    return Err(RuntimeError::InvalidArgument(format!(
                        "expert balance: {} load slots for {} balanced experts",
                        loads.len(),
                        self.load_slots()
                    )));
                }
                let load = loads.into_slice(layer.load_at..layer.load_at + layer.experts)?;
                Ok(Some(Balance {
                    bias: b.view(&layer.device)?,
                    load,
                }))
            }
            _ => Ok(None),
        }
    }

    /// Copies every host bias to the device (on the lane that routes next,
    /// so the copy is ordered before the step's routings).
    pub fn upload(&self, b: &B) -> Result<()> {
        for layer in self.layers.iter().flatten() {
            let host = layer.host.lock().unwrap_or_else(PoisonError::into_inner);
            b.upload(&host, b.view_mut(&layer.device)?)?;
        }
        Ok(())
    }

    /// Moves every bias by its layer's rate from `counts`, the step's loads
    /// (its load slots, in their order) summed over every rank.
    pub fn update(&self, counts: &[f64]) -> Result<()> {
        let mut at = 0;
        for layer in self.layers.iter().flatten() {
            let mut host = layer.host.lock().unwrap_or_else(PoisonError::into_inner);
            let end = at + host.len();
            let counts = counts.get(at..end).ok_or_else(|| {
                RuntimeError::InvalidArgument(format!(
                    "expert bias update: {} counts for the balancing layers' experts",
                    counts.len()
                ))
            })?;
            update_expert_bias(&mut host, counts, layer.rate)?;
            at = end;
        }
        Ok(())
    }

    /// Each balancing layer's checkpoint key and bias, in layer order.
    pub fn biases(&self) -> Vec<(String, Vec<f32>)> {
        self.layers
            .iter()
            .flatten()
            .map(|layer| {
                let host = layer.host.lock().unwrap_or_else(PoisonError::into_inner);
                (layer.key.clone(), host.clone())
            })
            .collect()
    }

    /// Sets the bias under checkpoint key `key` (a resume); the device copy
    /// follows at the next [`ExpertBalance::upload`].
    pub fn set_bias(&self, key: &str, values: &[f32]) -> Result<()> {
        let layer = self
            .layers
            .iter()
            .flatten()
            .find(|layer| layer.key == key)
            .ok_or_else(|| {
                RuntimeError::InvalidArgument(format!("this model has no expert bias `{key}`"))
            })?;
        let mut host = layer.host.lock().unwrap_or_else(PoisonError::into_inner);
        if host.len() != values.len() {
            return Err(RuntimeError::InvalidArgument(format!(
                "expert bias of {} values for {} experts",
                values.len(),
                host.len()
            )));
        }
        host.copy_from_slice(values);
        Ok(())
    }
}

/// Megatron's `get_updated_expert_bias`: `bias_i += rate * sign(mean(c) - c_i)`
/// (0 for an expert exactly at the mean), from `counts` summed over the
/// step's micro-batches and every data-parallel rank. Counts are integers,
/// exact in f64, so the signs (and the new bias) are the same on every rank.
pub fn update_expert_bias(bias: &mut [f32], counts: &[f64], rate: f32) -> Result<()> {
    if bias.len() != counts.len() || bias.is_empty() {
        return Err(RuntimeError::InvalidArgument(format!(
            "expert bias update: {} counts for {} experts",
            counts.len(),
            bias.len()
        )));
    }
    let mean = counts.iter().sum::<f64>() / counts.len() as f64;
    for (b, &c) in bias.iter_mut().zip(counts) {
        let sign = match mean.partial_cmp(&c) {
            Some(std::cmp::Ordering::Greater) => 1.0f32,
            Some(std::cmp::Ordering::Less) => -1.0,
            _ => 0.0,
        };
        *b += rate * sign;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bias_moves_towards_the_mean_load_by_the_rate() {
        // Mean 10: expert 0 over-loaded, 1 under, 2 exactly at the mean.
        let mut bias = [0.25f32, -0.5, 1.0];
        update_expert_bias(&mut bias, &[17.0, 3.0, 10.0], 1e-3).unwrap();
        assert_eq!(bias, [0.25 - 1e-3, -0.5 + 1e-3, 1.0]);
        assert!(update_expert_bias(&mut bias, &[1.0, 2.0], 1e-3).is_err());
    }
}
