//! What one micro-batch carries from one piece of lane work to the next.
//!
//! Every layer owns a typed state for the micro-batch ([`LayerState`]): what
//! its forward saved, then what its weight gradient needs, or, for an `E`
//! layer, the [`MoeStage`] between its staged steps. Model-level ops (final
//! norm, MTP entries, heads) have typed states of their own. A piece of work
//! takes the state it consumes and leaves the state the next piece needs, so
//! a piece that ran out of order finds the wrong state and says which.
//!
//! The state moves between the lanes' host threads in a [`Handoff`]: the
//! schedule's events already order the pieces of one micro-batch, so the
//! handoff is never contended; it only carries ownership across threads.

use crate::backend::{Backend, DType, Slice, SliceMut};
use crate::error::{Result, RuntimeError};
use crate::layers::{
    HeadSaved, LayerSaved, LayerWgrad, MoeStage, MtpSaved, MtpWgrad, NormSaved, NormWgrad,
    counted_targets,
};
use std::sync::{Arc, Mutex, PoisonError};

/// The tokens of one micro-batch, on the host.
#[derive(Clone, Debug)]
pub struct MicroBatchTokens {
    /// `[batch * seq]` input ids.
    pub inputs: Vec<u32>,
    /// Per depth (0: the main head, d + 1: MTP depth d), `[batch * seq]`
    /// target ids.
    pub targets: Vec<Vec<u32>>,
    /// Per MTP depth d (0-based), the ids embedded at its entry: position t
    /// holds token t + d + 1 of the sample, rolled as Megatron rolls them
    /// (0 past the sample's inputs).
    pub mtp_inputs: Vec<Vec<u32>>,
}

/// A micro-batch's token ids on the device: one u32 buffer holding the
/// inputs, the targets of every head and the MTP inputs, `rows` ids each,
/// uploaded once by the micro-batch's first piece of work (on its lane).
pub(crate) struct TokenIds<B: Backend> {
    buf: B::Buf,
    rows: usize,
    depths: usize,
}

impl<B: Backend> TokenIds<B> {
    fn upload(b: &B, tokens: &MicroBatchTokens, depths: usize) -> Result<Self> {
        let rows = tokens.inputs.len();
        let parts: Vec<&[u32]> = std::iter::once(&tokens.inputs)
            .chain(&tokens.targets)
            .chain(&tokens.mtp_inputs)
            .map(Vec::as_slice)
            .collect();
        if tokens.targets.len() != depths + 1
            || tokens.mtp_inputs.len() != depths
            || parts.iter().any(|p| p.len() != rows)
        {
            return Err(RuntimeError::InvalidArgument(format!(
                "a micro-batch's tokens must be {rows} inputs, {} target rows and {depths} MTP \
                 input rows of {rows} ids each; got {} target rows and {} MTP input rows of \
                 {:?} ids",
                depths + 1,
                tokens.targets.len(),
                tokens.mtp_inputs.len(),
                parts.iter().map(|p| p.len()).collect::<Vec<_>>()
            )));
        }
        let all = parts.concat();
        let buf = b.alloc_uninit(all.len(), DType::U32)?;
        b.upload(&all, b.view_mut(&buf)?)?;
        Ok(TokenIds { buf, rows, depths })
    }

    fn part(&self, i: usize) -> Result<Slice<'_, B>> {
        Slice::<B>::of(&self.buf, i * self.rows..(i + 1) * self.rows)
    }

    /// The input ids.
    pub(crate) fn inputs(&self) -> Result<Slice<'_, B>> {
        self.part(0)
    }

    /// Head `head`'s targets (0: the main head, d + 1: MTP depth d).
    pub(crate) fn targets(&self, head: usize) -> Result<Slice<'_, B>> {
        self.part(1 + head)
    }

    /// The ids MTP depth `d` embeds.
    pub(crate) fn mtp_inputs(&self, d: usize) -> Result<Slice<'_, B>> {
        self.part(2 + self.depths + d)
    }
}

/// Loss sums of one step on one rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepLosses {
    /// Main cross-entropy: sum over tokens, and token count.
    pub main: (f64, usize),
    /// Per MTP depth: sum and count.
    pub mtp: Vec<(f64, usize)>,
    /// Sum of the MoE load-balancing losses over layers and micro-batches.
    pub aux: f64,
    /// Sum of the `D` layers' indexer losses (each with its coefficient,
    /// a mean over its micro-batch's rows) over layers and micro-batches.
    pub indexer: f64,
}

/// What a step reads back at its end, in one device buffer of f64 slots: the
/// loss sums (the main loss, the MoE aux loss, the `D` layers' indexer
/// loss, then each MTP depth's loss) and the expert loads of aux-loss-free
/// balancing (the tokens routed to each expert of every balancing `E`
/// layer, in [`crate::layers::ExpertBalance`]'s order), zeroed when a step
/// starts, then this rank's gradient-norm partials, one per bucket (written
/// by [`Optimizer::norm_partials`]). The host reads the buffer once per step
/// ([`StepTotals::read`]); token counts are not here: the host knows them
/// from the tokens.
///
/// Each loss slot is a running f64 sum, so the order of the additions is part
/// of the result. Every addition runs on the compute lane inside a forward
/// slot (heads in the post-process slot, MoE aux losses and loads in
/// pre-dispatch, indexer losses in their layer's forward),
/// and both schedules issue every micro-batch's forward slots in micro-batch
/// order, all of micro-batch k's before any of k + 1's; the lane runs its
/// work in issue order. So the additions happen in one order, the same for
/// the plain and the overlap schedule; `tests/training.rs` compares the
/// reported losses bit for bit to hold this. The loads are sums of integers,
/// exact in f64 in any order.
///
/// [`Optimizer::norm_partials`]: crate::optimizer::Optimizer::norm_partials
pub struct StepTotals<B: Backend> {
    buf: Arc<B::Buf>,
    depths: usize,
    loads: usize,
    buckets: usize,
}

/// A step's totals on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReadout {
    pub losses: StepLosses,
    /// The tokens this rank routed to each expert of every balancing `E`
    /// layer ([`StepTotals::loads`]).
    pub loads: Vec<f64>,
    /// This rank's gradient-norm partials, one per bucket in id order.
    pub norm_partials: Vec<f64>,
}

impl<B: Backend> StepTotals<B> {
    /// The main head's loss sum.
    const MAIN: usize = 0;
    /// The MoE load-balancing loss's sum.
    const AUX: usize = 1;
    /// The `D` layers' indexer loss's sum.
    const INDEXER: usize = 2;
    /// MTP depth 0's loss sum; depth `d`'s is at `MTP + d`, and the load
    /// slots follow the last depth's, then the gradient-norm partials.
    const MTP: usize = 3;

    /// Slots for the main loss, the aux loss, the indexer loss, `depths`
    /// MTP depths, `loads` expert loads
    /// ([`crate::layers::ExpertBalance::load_slots`]) and `buckets`
    /// gradient-norm partials.
    pub fn new(b: &B, depths: usize, loads: usize, buckets: usize) -> Result<Self> {
        Ok(StepTotals {
            buf: Arc::new(b.alloc(Self::MTP + depths + loads + buckets, DType::F64)?),
            depths,
            loads,
            buckets,
        })
    }

    /// The loss and load slots: everything a step adds to, zeroed when it
    /// starts.
    pub fn losses(&self) -> Result<SliceMut<'_, B>> {
        SliceMut::<B>::of(&self.buf, 0..self.partials_at())
    }

    /// The expert load slots (for [`crate::layers::ExpertBalance::context`]).
    pub fn loads(&self) -> Result<SliceMut<'_, B>> {
        let at = self.loads_at();
        SliceMut::<B>::of(&self.buf, at..at + self.loads)
    }

    fn slot(&self, i: usize) -> Result<SliceMut<'_, B>> {
        SliceMut::<B>::of(&self.buf, i..i + 1)
    }

    /// The slot of head `head` (0: the main head, d + 1: MTP depth d).
    pub fn head(&self, head: usize) -> Result<SliceMut<'_, B>> {
        match head {
            0 => self.slot(Self::MAIN),
            d if d <= self.depths => self.slot(Self::mtp_at(d - 1)),
            _ => Err(RuntimeError::InvalidArgument(format!(
                "step totals: no head {head} (the model has {} MTP depths)",
                self.depths
            ))),
        }
    }

    /// The MoE load-balancing loss's slot.
    pub fn aux(&self) -> Result<SliceMut<'_, B>> {
        self.slot(Self::AUX)
    }

    /// The `D` layers' indexer loss's slot.
    pub fn indexer(&self) -> Result<SliceMut<'_, B>> {
        self.slot(Self::INDEXER)
    }

    /// The buffer, for lane work that writes the partials from index
    /// [`StepTotals::partials_at`] on.
    pub fn buffer(&self) -> Arc<B::Buf> {
        self.buf.clone()
    }

    /// MTP depth `d`'s loss slot.
    fn mtp_at(d: usize) -> usize {
        Self::MTP + d
    }

    /// Where the expert loads start.
    fn loads_at(&self) -> usize {
        Self::mtp_at(self.depths)
    }

    /// Where the gradient-norm partials start: bucket `b`'s is at
    /// `partials_at() + b`.
    pub fn partials_at(&self) -> usize {
        self.loads_at() + self.loads
    }

    /// The step's one read: every slot, after the losses, the loads and the
    /// partials are complete; `counts` are the unmasked targets of each
    /// head.
    pub fn read(&self, b: &B, counts: &[usize]) -> Result<StepReadout> {
        let mut values = vec![0.0f64; self.partials_at() + self.buckets];
        b.download(b.view(&*self.buf)?, &mut values)?;
        let norm_partials = values.split_off(self.partials_at());
        let loads = values.split_off(self.loads_at());
        let at = |i: usize| values[i];
        let count = |i: usize| counts.get(i).copied().unwrap_or(0);
        Ok(StepReadout {
            losses: StepLosses {
                main: (at(Self::MAIN), count(0)),
                mtp: (0..self.depths)
                    .map(|d| (at(Self::mtp_at(d)), count(d + 1)))
                    .collect(),
                aux: at(Self::AUX),
                indexer: at(Self::INDEXER),
            },
            loads,
            norm_partials,
        })
    }
}

/// A step's sums as the ranks add them up: this rank's loss sums and
/// token counts and the tokens each expert got (aux-loss-free balancing),
/// laid out for one host exchange ([`StepSums::mine`]), then every rank's
/// added ([`StepSums::total`]). Token counts and loads are integers, exact
/// in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct StepSums {
    /// The main loss's sum and count, the aux loss's sum, the indexer
    /// loss's sum, each MTP depth's sum and count, then the expert loads.
    values: Vec<f64>,
    depths: usize,
}

impl StepSums {
    const MAIN_SUM: usize = 0;
    const MAIN_COUNT: usize = 1;
    const AUX_SUM: usize = 2;
    const INDEXER_SUM: usize = 3;
    /// MTP depth 0's sum; its count follows, then the next depth's pair.
    const MTP: usize = 4;

    /// This rank's sums: `losses`, then `loads`.
    pub fn mine(losses: &StepLosses, loads: impl IntoIterator<Item = f64>) -> Self {
        let mut values = vec![
            losses.main.0,
            losses.main.1 as f64,
            losses.aux,
            losses.indexer,
        ];
        for (sum, count) in &losses.mtp {
            values.extend([*sum, *count as f64]);
        }
        values.extend(loads);
        StepSums {
            values,
            depths: losses.mtp.len(),
        }
    }

    /// The values the host exchange sends.
    pub fn values(&self) -> &[f64] {
        &self.values
    }

    /// Every rank's sums (`all`, by rank, as the exchange returns them),
    /// slot by slot, added in rank order from 0 (a slot a rank did not
    /// send counts 0): the same bits on every rank.
    pub fn total(&self, all: &[Vec<f64>]) -> StepSums {
        let values = (0..self.values.len())
            .map(|i| {
                all.iter()
                    .map(|v| v.get(i).copied().unwrap_or(0.0))
                    .fold(0.0, |a, b| a + b)
            })
            .collect();
        StepSums {
            values,
            depths: self.depths,
        }
    }

    /// The main cross-entropy: mean over every token summed.
    pub fn main_loss(&self) -> f64 {
        self.values[Self::MAIN_SUM] / self.values[Self::MAIN_COUNT].max(1.0)
    }

    /// MTP depth `depth`'s cross-entropy: mean over its tokens.
    pub fn mtp_loss(&self, depth: usize) -> f64 {
        let at = Self::MTP + 2 * depth;
        self.values[at] / self.values[at + 1].max(1.0)
    }

    /// The mean of the MTP depths' losses, when there are depths.
    pub fn mean_mtp_loss(&self) -> Option<f64> {
        (self.depths > 0)
            .then(|| (0..self.depths).map(|d| self.mtp_loss(d)).sum::<f64>() / self.depths as f64)
    }

    /// The MoE load-balancing losses' sum.
    pub fn aux_sum(&self) -> f64 {
        self.values[Self::AUX_SUM]
    }

    /// The `D` layers' indexer losses' sum.
    pub fn indexer_sum(&self) -> f64 {
        self.values[Self::INDEXER_SUM]
    }

    /// The tokens each expert got, in [`crate::layers::ExpertBalance`]'s
    /// order (empty without MoE layers).
    pub fn expert_loads(&self) -> &[f64] {
        &self.values[Self::MTP + 2 * self.depths..]
    }
}

/// A value handed from one piece of lane work to the next.
pub(crate) struct Handoff<T>(Mutex<Option<T>>);

impl<T> Handoff<T> {
    pub(crate) fn new(value: T) -> Self {
        Handoff(Mutex::new(Some(value)))
    }

    /// Runs `f` on the value. The previous holder's event completed before
    /// this piece started, so the value is here; if it is not, a piece failed
    /// half-way (and reported why) or the program is broken.
    pub(crate) fn with<R>(&self, what: &str, f: impl FnOnce(&mut T) -> Result<R>) -> Result<R> {
        let mut guard = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let value = guard.as_mut().ok_or_else(|| {
            RuntimeError::InvalidArgument(format!("{what}: the micro-batch's state is gone"))
        })?;
        f(value)
    }

    /// Takes the value out for good.
    pub(crate) fn take(&self) -> Option<T> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

/// One layer's state for one micro-batch.
pub(crate) enum LayerState<B: Backend> {
    Idle,
    /// A dense layer between its forward and its input-gradient backward.
    Saved(LayerSaved<B>),
    /// A recomputed layer between its forward and its backward: its input
    /// alone (`crate::recompute`).
    Input(B::Buf),
    /// Between its input gradient and its weight gradient.
    Wgrad(LayerWgrad<B>),
    /// An `E` layer between steps.
    Moe(MoeStage<B>),
}

impl<B: Backend> LayerState<B> {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            LayerState::Idle => "no forward",
            LayerState::Saved(_) => "its forward",
            LayerState::Input(_) => "its input, kept to recompute its forward",
            LayerState::Wgrad(_) => "its input gradient",
            LayerState::Moe(_) => "a MoE step",
        }
    }
}

/// A norm's (the final norm's, an MTP depth's) state.
pub(crate) enum NormState<B: Backend> {
    Idle,
    Saved(NormSaved<B>),
    Wgrad(NormWgrad<B>),
}

/// An MTP depth's entry (norms and projection) state.
pub(crate) enum MtpEntryState<B: Backend> {
    Idle,
    Saved(MtpSaved<B>),
    /// With the embedding's gradient, which its weight piece adds into the
    /// embedding table's gradient.
    Wgrad(MtpWgrad<B>, B::Buf),
}

/// A head's state: its forward's saved hidden states and (MTP depths) the
/// depth's final norm before it.
pub(crate) enum HeadState<B: Backend> {
    Idle,
    Saved {
        saved: HeadSaved<B>,
        norm: Option<NormSaved<B>>,
    },
}

/// The residual stream of the decoder or of one MTP depth, its gradient,
/// and (after a final norm) the normed output and its gradient.
pub(crate) struct Stream<B: Backend> {
    pub(crate) x: Option<B::Buf>,
    pub(crate) dx: Option<B::Buf>,
    pub(crate) h: Option<B::Buf>,
    pub(crate) dh: Option<B::Buf>,
}

impl<B: Backend> Stream<B> {
    fn new() -> Self {
        Stream {
            x: None,
            dx: None,
            h: None,
            dh: None,
        }
    }
}

/// Everything one micro-batch carries through its forward and backward.
pub(crate) struct MicroBatch<B: Backend> {
    /// The host tokens until the first piece of work uploads them.
    tokens: Option<MicroBatchTokens>,
    ids: Option<TokenIds<B>>,
    depths: usize,
    /// Per head (main, then each MTP depth): unmasked targets.
    pub(crate) counts: Vec<usize>,
    /// Whether a backward follows the forward (a training step, not an
    /// evaluation): the heads then keep their logit gradients.
    pub(crate) trains: bool,
    /// The decoder's stream, then one per MTP depth.
    pub(crate) streams: Vec<Stream<B>>,
    /// Per physical layer: the decoder's, then every MTP depth's
    /// ([`crate::model::ModelRuntime::layer_index`]).
    pub(crate) layers: Vec<LayerState<B>>,
    pub(crate) final_norm: NormState<B>,
    /// Per MTP depth.
    pub(crate) mtp_entries: Vec<MtpEntryState<B>>,
    /// Per head: the main one, then one per MTP depth.
    pub(crate) heads: Vec<HeadState<B>>,
}

impl<B: Backend> MicroBatch<B> {
    pub(crate) fn new(
        tokens: MicroBatchTokens,
        layers: usize,
        depths: usize,
        trains: bool,
    ) -> Self {
        MicroBatch {
            counts: tokens.targets.iter().map(|t| counted_targets(t)).collect(),
            trains,
            tokens: Some(tokens),
            ids: None,
            depths,
            streams: (0..=depths).map(|_| Stream::new()).collect(),
            layers: (0..layers).map(|_| LayerState::Idle).collect(),
            final_norm: NormState::Idle,
            mtp_entries: (0..depths).map(|_| MtpEntryState::Idle).collect(),
            heads: (0..=depths).map(|_| HeadState::Idle).collect(),
        }
    }

    /// Uploads the tokens on the first call (from the micro-batch's first
    /// piece of work, so on a lane); later calls do nothing.
    pub(crate) fn upload_tokens(&mut self, b: &B) -> Result<()> {
        if let Some(tokens) = self.tokens.take() {
            self.ids = Some(TokenIds::upload(b, &tokens, self.depths)?);
        }
        Ok(())
    }

    /// The token ids on the device.
    pub(crate) fn ids(&self) -> Result<&TokenIds<B>> {
        self.ids.as_ref().ok_or_else(|| {
            RuntimeError::InvalidArgument(
                "schedule: a micro-batch's token ids are not on the device; its first piece of \
                 work did not run"
                    .into(),
            )
        })
    }
}
