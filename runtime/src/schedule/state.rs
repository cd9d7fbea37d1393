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

use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use crate::layers::{
    HeadSaved, LayerSaved, LayerWgrad, MoeStage, MtpSaved, MtpWgrad, NormSaved, NormWgrad,
};
use std::sync::{Mutex, PoisonError};

/// The tokens of one micro-batch.
#[derive(Clone, Debug)]
pub struct MicroBatchTokens {
    /// `[batch * seq]` input ids.
    pub inputs: Vec<u32>,
    /// Per depth (0: the main head, d + 1: MTP depth d), `[batch * seq]`
    /// target ids.
    pub targets: Vec<Vec<u32>>,
    /// Per MTP depth d, the ids embedded at its entry: position t holds
    /// token t + d + 1.
    pub mtp_inputs: Vec<Vec<u32>>,
}

/// Loss sums of one step on one rank, in micro-batch order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepLosses {
    /// Main cross-entropy: sum over tokens, and token count.
    pub main: (f64, usize),
    /// Per MTP depth: sum and count.
    pub mtp: Vec<(f64, usize)>,
    /// Sum of the MoE load-balancing losses over layers and micro-batches.
    pub aux: f64,
}

impl StepLosses {
    pub fn new(depths: usize) -> Self {
        StepLosses {
            mtp: vec![(0.0, 0); depths],
            ..StepLosses::default()
        }
    }

    /// Adds another micro-batch's sums (in micro-batch order: the f64 sums
    /// are then the same whatever order the lanes ran in).
    pub fn add(&mut self, other: &StepLosses) {
        self.main.0 += other.main.0;
        self.main.1 += other.main.1;
        for (total, mine) in self.mtp.iter_mut().zip(&other.mtp) {
            total.0 += mine.0;
            total.1 += mine.1;
        }
        self.aux += other.aux;
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

/// A head's state: its forward's cross-entropy state, how many targets it
/// counted, and (MTP depths) the depth's final norm before it.
pub(crate) enum HeadState<B: Backend> {
    Idle,
    Saved {
        saved: HeadSaved<B>,
        count: usize,
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
    pub(crate) tokens: MicroBatchTokens,
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
    pub(crate) losses: StepLosses,
}

impl<B: Backend> MicroBatch<B> {
    pub(crate) fn new(tokens: MicroBatchTokens, layers: usize, depths: usize) -> Self {
        MicroBatch {
            tokens,
            streams: (0..=depths).map(|_| Stream::new()).collect(),
            layers: (0..layers).map(|_| LayerState::Idle).collect(),
            final_norm: NormState::Idle,
            mtp_entries: (0..depths).map(|_| MtpEntryState::Idle).collect(),
            heads: (0..=depths).map(|_| HeadState::Idle).collect(),
            losses: StepLosses::new(depths),
        }
    }
}
