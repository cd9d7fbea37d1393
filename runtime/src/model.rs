//! The layers of one plan as one rank runs them, and where each layer takes
//! its weights from (its parameters' indices into the plan, in order).

use crate::error::{Result, RuntimeError};
use crate::layers::{Embedding, FinalNorm, Head, InitScale, LayerImpl, MtpEntry, init_param_range};
use hybridgen_dsl::Plan;
use hybridgen_dsl::plan::{LayerRef, ModuleKind, Owner};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// One rank's model: every layer's implementation, built once.
pub struct ModelRuntime {
    pub plan: Arc<Plan>,
    /// By physical index.
    pub decoder: Vec<LayerImpl>,
    /// Per MTP depth, its layers.
    pub mtp: Vec<Vec<LayerImpl>>,
    pub embedding: Embedding,
    pub head: Head,
    pub final_norm: FinalNorm,
    pub mtp_entry: MtpEntry,
    params_of: HashMap<Owner, Vec<usize>>,
}

impl ModelRuntime {
    /// Builds the layers of `plan`, refusing what the runtime cannot train.
    pub fn new(plan: Arc<Plan>) -> Result<Self> {
        let config = &plan.model;
        let local = plan.local_experts();
        for unit in plan.units.iter() {
            let kind = unit_module_kind(&unit.name);
            if matches!(
                kind,
                ModuleKind::Embedding | ModuleKind::FinalNorm | ModuleKind::OutputLayer
            ) {
                return Err(RuntimeError::Unsupported(format!(
                    "the unit filter makes `{}` an FSDP unit; the runtime keeps the embedding, the final norm and the \
                     output layer outside units (they are used at both ends of the model); drop it from the filter",
                    unit.name
                )));
            }
        }
        let decoder = plan
            .layers
            .iter()
            .map(|l| {
                LayerImpl::new(l.kind, config, local)
                    .map_err(|e| at_layer(e, &format!("layer {} ({})", l.index, l.path())))
            })
            .collect::<Result<Vec<_>>>()?;
        let mtp = plan
            .mtp_layers
            .iter()
            .map(|depth| {
                depth
                    .iter()
                    .map(|l| {
                        LayerImpl::new(l.kind, config, local).map_err(|e| at_layer(e, &l.path()))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let mut params_of: HashMap<Owner, Vec<usize>> = HashMap::new();
        for (i, p) in plan.params.iter().enumerate() {
            params_of.entry(p.owner).or_default().push(i);
        }
        let model = ModelRuntime {
            embedding: Embedding::new(config)?,
            head: Head::new(config)?,
            final_norm: FinalNorm::new(config.hidden_size)?,
            mtp_entry: MtpEntry::new(config)?,
            decoder,
            mtp,
            params_of,
            plan,
        };
        model.check_parameter_order()?;
        Ok(model)
    }

    /// Physical layers, decoder and MTP depths together.
    pub fn layer_count(&self) -> usize {
        self.decoder.len() + self.mtp.iter().map(Vec::len).sum::<usize>()
    }

    /// A dense index of `layer` among [`Self::layer_count`]: the decoder's
    /// layers first, then each MTP depth's.
    pub fn layer_index(&self, layer: LayerRef) -> Result<usize> {
        let index = match layer {
            LayerRef::Decoder(i) => (i < self.decoder.len()).then_some(i),
            LayerRef::Mtp { depth, index } => self.mtp.get(depth).and_then(|d| {
                (index < d.len()).then(|| {
                    self.decoder.len()
                        + self.mtp[..depth].iter().map(Vec::len).sum::<usize>()
                        + index
                })
            }),
        };
        index.ok_or_else(|| {
            RuntimeError::InvalidArgument(format!("no layer {layer:?} in this model"))
        })
    }

    pub fn layer(&self, layer: LayerRef) -> Result<&LayerImpl> {
        match layer {
            LayerRef::Decoder(i) => self.decoder.get(i),
            LayerRef::Mtp { depth, index } => self.mtp.get(depth).and_then(|d| d.get(index)),
        }
        .ok_or_else(|| RuntimeError::InvalidArgument(format!("no layer {layer:?} in this model")))
    }

    /// Indices into `plan.params` of `owner`'s parameters, in order.
    pub fn params_of(&self, owner: Owner) -> &[usize] {
        self.params_of.get(&owner).map_or(&[], Vec::as_slice)
    }

    /// The layers take weights in their own parameter order; it must be the
    /// plan's, or the weights would be bound to the wrong tensors.
    fn check_parameter_order(&self) -> Result<()> {
        let refs = self
            .plan
            .layers
            .iter()
            .map(|l| LayerRef::Decoder(l.index))
            .chain(
                self.plan
                    .mtp_layers
                    .iter()
                    .flatten()
                    .map(|l| LayerRef::Mtp {
                        depth: l.depth,
                        index: l.index,
                    }),
            );
        for layer in refs {
            let ours: Vec<_> = self
                .params_of(Owner::Layer(layer))
                .iter()
                .map(|&p| self.plan.def(&self.plan.params[p]))
                .collect();
            let theirs = self.layer(layer)?.params();
            let same = ours.len() == theirs.len()
                && ours
                    .iter()
                    .zip(theirs)
                    .all(|(a, b)| a.name == b.name && a.shape == b.shape);
            if !same {
                return Err(RuntimeError::InvalidArgument(format!(
                    "layer {layer:?}: the plan's parameters do not match the layer's ({} vs {})",
                    ours.len(),
                    theirs.len()
                )));
            }
        }
        Ok(())
    }

    /// The name a parameter is initialised by: the path it would have in an
    /// ungrouped model (`decoder.layers.{physical}.`), with experts by global
    /// index. Grouping therefore never changes initial values, so `[*-]` and
    /// `*-` start (and stay) bit-identical.
    pub fn init_name(&self, p: usize, ep_rank: usize) -> String {
        let param = &self.plan.params[p];
        let def = self.plan.def(param);
        let name = match def.local_expert {
            Some(j) => {
                let stem = def.name.trim_end_matches(|c: char| c.is_ascii_digit());
                format!("{stem}{}", ep_rank * self.plan.local_experts() + j)
            }
            None => def.name.to_string(),
        };
        match param.owner {
            Owner::Layer(LayerRef::Decoder(i)) => format!("decoder.layers.{i}.{name}"),
            _ => {
                let full = self.plan.param_name(param);
                let prefix = &full[..full.len() - def.name.len()];
                format!("{prefix}{name}")
            }
        }
    }

    /// Fills `out` with elements `range` of parameter `p`'s initial values
    /// (the values the whole parameter has there).
    pub fn init_param(
        &self,
        seed: u64,
        p: usize,
        ep_rank: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let scale = InitScale::new(&self.plan.model, self.plan.physical_layers());
        let def = self.plan.def(&self.plan.params[p]);
        let name = self.init_name(p, ep_rank);
        if range.len() != out.len() {
            return Err(RuntimeError::InvalidArgument(format!(
                "init of `{name}`: {} values for elements {range:?}",
                out.len()
            )));
        }
        init_param_range(seed, &name, def, &scale, range.start, out)
    }
}

fn unit_module_kind(name: &str) -> ModuleKind {
    match name {
        "embedding" => ModuleKind::Embedding,
        "decoder.final_norm" => ModuleKind::FinalNorm,
        "output_layer" => ModuleKind::OutputLayer,
        _ => ModuleKind::Layer,
    }
}

fn at_layer(error: RuntimeError, layer: &str) -> RuntimeError {
    match error {
        RuntimeError::Unsupported(m) => RuntimeError::Unsupported(format!("{layer}: {m}")),
        RuntimeError::InvalidArgument(m) => RuntimeError::InvalidArgument(format!("{layer}: {m}")),
        other => other,
    }
}
