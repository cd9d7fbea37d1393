//! The parallel layout a plan is made for, and the pipeline stages it cuts
//! the model into (H020-H023).

use crate::config::ModelConfig;
use crate::diagnostic::{Code, Diagnostic};
use crate::pattern::{LayerKind, Pattern};
use crate::span::Span;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// How the model is spread over ranks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParallelLayout {
    /// Data-parallel size: dense buckets are sharded over this many ranks.
    pub dp: usize,
    /// Expert-parallel size: each MoE layer's experts are split over this many
    /// ranks; expert buckets are sharded over the other `dp / ep`.
    pub ep: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Physical layers on the first pipeline stage, when not an even split.
    pub first_stage_layers: Option<usize>,
    /// Physical layers on the last pipeline stage, when not an even split.
    pub last_stage_layers: Option<usize>,
}

impl Default for ParallelLayout {
    fn default() -> Self {
        ParallelLayout {
            dp: 1,
            ep: 1,
            pp: 1,
            first_stage_layers: None,
            last_stage_layers: None,
        }
    }
}

impl ParallelLayout {
    pub fn new(dp: usize, ep: usize) -> Self {
        ParallelLayout {
            dp,
            ep,
            ..ParallelLayout::default()
        }
    }

    /// The expert-data-parallel size: ranks an expert's shard group spans.
    /// For a layout that passed `ParallelLayout::check` (every plan's):
    /// `ep` is at least 1 and divides `dp`.
    pub fn expert_dp(&self) -> usize {
        self.dp / self.ep
    }

    /// H023 (and H021/H022 for the explicit stage counts): sizes that cannot
    /// work for this model, independent of where the pipeline cuts fall.
    pub(crate) fn check(&self, model: &ModelConfig, pattern: &Pattern) -> Vec<Diagnostic> {
        let mut out = Vec::new();
        for (name, value) in [("dp", self.dp), ("ep", self.ep), ("pp", self.pp)] {
            if value == 0 {
                out.push(Diagnostic::new(Code::H023, format!("--{name} is 0")).help(
                    "every parallel size is at least 1 (1 means no parallelism of that kind)",
                ));
            }
        }
        if self.dp == 0 || self.ep == 0 || self.pp == 0 {
            return out;
        }
        if !self.dp.is_multiple_of(self.ep) {
            out.push(
                Diagnostic::new(
                    Code::H023,
                    format!(
                        "data-parallel size {} is not a multiple of expert-parallel size {}",
                        self.dp, self.ep
                    ),
                )
                .help(
                    "expert parameters are sharded over dp / ep ranks: pick an ep that divides dp",
                ),
            );
        }
        if pattern.kinds().contains(&LayerKind::Moe)
            && let Some(moe) = &model.moe
            && moe.num_experts % self.ep != 0
        {
            out.push(
                Diagnostic::new(
                    Code::H023,
                    format!("{} experts do not split over expert-parallel size {}", moe.num_experts, self.ep),
                )
                .help("each EP rank holds num_experts / ep experts: pick an ep that divides num_experts"),
            );
        }
        out
    }
}

/// One (virtual) pipeline stage: the physical and logical layers it builds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Stage {
    pub pp_rank: usize,
    pub vp_stage: usize,
    /// Physical decoder layers `[start, end)`.
    pub layers: Range<usize>,
    /// Logical decoder layers `[start, end)`.
    pub logical: Range<usize>,
    /// Whether the MTP depths live here (the last pipeline rank's last stage).
    pub has_mtp: bool,
}

/// Cuts the decoder into stages, or says why it cannot (H020-H022).
pub(crate) fn stages(
    pattern: &Pattern,
    layout: &ParallelLayout,
) -> Result<Vec<Stage>, Vec<Diagnostic>> {
    let pp = layout.pp.max(1);
    let explicit = layout.first_stage_layers.is_some() || layout.last_stage_layers.is_some();
    // Physical and logical offsets at every item boundary.
    let mut item_starts = Vec::with_capacity(pattern.logical_count() + 1);
    let mut physical = 0;
    for item in pattern.items() {
        item_starts.push(physical);
        physical += item.layers().len();
    }
    item_starts.push(physical);

    let mut stages = Vec::new();
    if pattern.has_pipeline_segments() {
        if explicit {
            return Err(vec![
                Diagnostic::new(
                    Code::H022,
                    "the pattern places stage boundaries with `|` and the layout also gives first/last stage layer counts",
                )
                .help("drop --first-stage-layers/--last-stage-layers, or remove the `|`s and let the counts decide"),
            ]);
        }
        let segments = pattern.segments.len();
        if !segments.is_multiple_of(pp) {
            return Err(vec![
                Diagnostic::new(
                    Code::H020,
                    format!("{segments} pipeline segments do not divide over {pp} pipeline stages"),
                )
                .at(pattern.segments.last().map_or(Span::default(), |s| s.span))
                .help(format!(
                    "segment s runs on pipeline rank s % pp: use a multiple of {pp} segments (empty segments are allowed), or change --pp"
                )),
            ]);
        }
        let (mut layer, mut logical) = (0, 0);
        for (s, segment) in pattern.segments.iter().enumerate() {
            let count: usize = segment.items.iter().map(|i| i.layers().len()).sum();
            stages.push(Stage {
                pp_rank: s % pp,
                vp_stage: s / pp,
                layers: layer..layer + count,
                logical: logical..logical + segment.items.len(),
                has_mtp: false,
            });
            layer += count;
            logical += segment.items.len();
        }
    } else {
        let sizes = stage_sizes(physical, layout)?;
        let cut = cut_groups(pattern, &item_starts, &sizes);
        if !cut.is_empty() {
            return Err(cut);
        }
        let mut start = 0;
        for (rank, size) in sizes.into_iter().enumerate() {
            let end = start + size;
            // Both are item boundaries: `cut_groups` found no cut.
            let first = item_starts.partition_point(|&p| p < start);
            let last = item_starts.partition_point(|&p| p < end);
            stages.push(Stage {
                pp_rank: rank,
                vp_stage: 0,
                layers: start..end,
                logical: first..last,
                has_mtp: false,
            });
            start = end;
        }
    }
    // MTP lives with the last pipeline rank's last virtual stage.
    if let Some(last) = stages
        .iter_mut()
        .filter(|s| s.pp_rank == pp - 1)
        .max_by_key(|s| s.vp_stage)
    {
        last.has_mtp = true;
    }
    Ok(stages)
}

/// H021 for every group a stage boundary falls inside, once per group, each
/// at its group: the stages' sizes come from the layout, so the message
/// gives the whole split (`3 + 2 + 2 + 2`), even or not.
fn cut_groups(pattern: &Pattern, item_starts: &[usize], sizes: &[usize]) -> Vec<Diagnostic> {
    let split = sizes
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(" + ");
    // (boundary, item it falls inside), in order, each item once.
    let mut cuts: Vec<(usize, usize)> = Vec::new();
    let mut boundary = 0;
    for size in &sizes[..sizes.len().saturating_sub(1)] {
        boundary += size;
        if item_starts.binary_search(&boundary).is_ok() {
            continue;
        }
        let item = item_starts.partition_point(|&p| p <= boundary) - 1;
        if cuts.last().is_none_or(|&(_, last)| last != item) {
            cuts.push((boundary, item));
        }
    }
    if cuts.is_empty() {
        return Vec::new();
    }
    // One pass over the items finds every cut group's span.
    let mut spans = vec![None; cuts.len()];
    let mut next = 0;
    for (index, item) in pattern.items().enumerate() {
        if next == cuts.len() {
            break;
        }
        if cuts[next].1 == index {
            spans[next] = Some(item.span());
            next += 1;
        }
    }
    cuts.iter()
        .zip(spans)
        .map(|(&(boundary, _), span)| {
            let d = Diagnostic::new(
                Code::H021,
                format!(
                    "the stage boundary before physical layer {boundary} cuts a group: the {} stages hold {split} layers",
                    sizes.len()
                ),
            )
            .label("this group would span two stages")
            .help("a group is built on one stage: change --pp or the first/last stage counts, or place the boundaries yourself with `|` around groups");
            match span {
                Some(span) => d.at(span),
                None => d,
            }
        })
        .collect()
}

/// Physical layers per stage without `|`: explicit first/last counts, the
/// rest split evenly (H021).
fn stage_sizes(physical: usize, layout: &ParallelLayout) -> Result<Vec<usize>, Vec<Diagnostic>> {
    let pp = layout.pp.max(1);
    let first = layout.first_stage_layers;
    let last = layout.last_stage_layers;
    if pp == 1 {
        if first.is_some() || last.is_some() {
            return Err(vec![
                Diagnostic::new(
                    Code::H021,
                    "first/last stage layer counts need more than one pipeline stage",
                )
                .help("drop the stage counts, or set --pp above 1"),
            ]);
        }
        return Ok(vec![physical]);
    }
    let fixed = first.unwrap_or(0) + last.unwrap_or(0);
    let free_stages = pp - usize::from(first.is_some()) - usize::from(last.is_some());
    if fixed > physical {
        return Err(vec![Diagnostic::new(
            Code::H021,
            format!("first/last stage layer counts ({fixed} layers) exceed the model's {physical} physical layers"),
        )
        .help("lower the stage counts")]);
    }
    let rest = physical - fixed;
    let even = if free_stages == 0 {
        if rest != 0 {
            return Err(vec![Diagnostic::new(
                Code::H021,
                format!("with pp {pp}, the first and last stage counts must cover all {physical} layers; {rest} are left over"),
            )
            .help("raise the stage counts, or set --pp higher")]);
        }
        0
    } else if !rest.is_multiple_of(free_stages) {
        return Err(vec![
            Diagnostic::new(
                Code::H021,
                format!(
                    "{rest} physical layers do not split evenly over {free_stages} pipeline stages"
                ),
            )
            .help("change --pp or the stage counts, or place boundaries yourself with `|`"),
        ]);
    } else {
        rest / free_stages
    };
    Ok((0..pp)
        .map(|rank| match (rank, first, last) {
            (0, Some(f), _) => f,
            (r, _, Some(l)) if r == pp - 1 => l,
            _ => even,
        })
        .collect())
}
