//! `hybridgen plot`: the loss and evaluation-loss curves of one or several
//! runs' `--log-file`s, drawn into an SVG by plotters.

use super::Failure;
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub(crate) struct PlotArgs {
    /// JSON-lines logs of `hybridgen train --log-file`, one per run.
    #[arg(value_name = "FILE", required = true)]
    logs: Vec<PathBuf>,
    /// The picture to write: an .svg file (this build draws SVG only).
    #[arg(long, short, value_name = "FILE", default_value = "loss.svg")]
    output: PathBuf,
    /// The chart's title.
    #[arg(long, default_value = "loss")]
    title: String,
}

/// One run's curves: step -> value (a resumed run's later line for a step
/// replaces the earlier one).
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Curves {
    pub loss: BTreeMap<u64, f64>,
    pub eval: BTreeMap<u64, f64>,
}

/// Reads the step lines of a log; other JSON lines (the summary) are
/// skipped, anything that is not JSON is an error naming the line.
pub(crate) fn read_log(path: &Path) -> Result<Curves, String> {
    let name = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("{name}: cannot read it: {e}"))?;
    if !meta.is_file() {
        return Err(format!(
            "{name}: this is not a regular file; give a log written by `hybridgen train \
             --log-file`"
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{name}: cannot read it: {e}"))?;
    let mut curves = Curves::default();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            format!(
                "{name}:{}: not a JSON line ({e}); give logs written by `hybridgen train \
                 --log-file`",
                i + 1
            )
        })?;
        let Some(step) = value.get("step").and_then(|s| s.as_u64()) else {
            continue;
        };
        let number = |key: &str| {
            value
                .get(key)
                .and_then(|v| v.as_f64())
                .filter(|v| v.is_finite())
        };
        if let Some(loss) = number("loss") {
            curves.loss.insert(step, loss);
        }
        if let Some(eval) = number("eval_loss") {
            curves.eval.insert(step, eval);
        }
    }
    if curves.loss.is_empty() {
        return Err(format!(
            "{name}: no step has a loss; give a log written by `hybridgen train --log-file`"
        ));
    }
    Ok(curves)
}

/// The ranges the axes span: every value of every curve, padded.
fn bounds(runs: &[(String, Curves)]) -> ((u64, u64), (f64, f64)) {
    let mut steps = (u64::MAX, 0u64);
    let mut values = (f64::INFINITY, f64::NEG_INFINITY);
    for (_, curves) in runs {
        for (step, value) in curves.loss.iter().chain(&curves.eval) {
            steps = (steps.0.min(*step), steps.1.max(*step));
            values = (values.0.min(*value), values.1.max(*value));
        }
    }
    if steps.1 <= steps.0 {
        steps.1 = steps.0 + 1;
    }
    let pad = ((values.1 - values.0) * 0.05).max(1e-3);
    ((steps.0, steps.1), (values.0 - pad, values.1 + pad))
}

pub(crate) fn run(args: &PlotArgs) -> Result<(), Failure> {
    let out = &args.output;
    match out.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("svg") => {}
        Some(e) if e.eq_ignore_ascii_case("png") => {
            return Err(Failure::Message(format!(
                "--output {}: this build draws SVG only (PNG would bring a font and image \
                 stack); write {} and convert it if you need a PNG (e.g. rsvg-convert)",
                out.display(),
                out.with_extension("svg").display()
            )));
        }
        _ => {
            return Err(Failure::Message(format!(
                "--output {}: give a file ending in .svg",
                out.display()
            )));
        }
    }
    let runs: Vec<(String, Curves)> = args
        .logs
        .iter()
        .map(|path| read_log(path).map(|c| (path.display().to_string(), c)))
        .collect::<Result<_, _>>()
        .map_err(Failure::Message)?;
    let svg = draw(&runs, &args.title).map_err(Failure::Message)?;
    super::write_file(out, svg.as_bytes(), "--output")?;
    let points: usize = runs.iter().map(|(_, c)| c.loss.len() + c.eval.len()).sum();
    super::emit(&format!(
        "wrote {} ({} run{}, {points} points)\n",
        out.display(),
        runs.len(),
        if runs.len() == 1 { "" } else { "s" }
    ))
}

/// The chart as SVG text: each run's loss as a line, its evaluation loss
/// as a dashed line of the same colour.
pub(crate) fn draw(runs: &[(String, Curves)], title: &str) -> Result<String, String> {
    let fail = |e: &dyn std::fmt::Display| format!("cannot draw the chart: {e}");
    let ((x0, x1), (y0, y1)) = bounds(runs);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 24))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss (nats/token)")
            .draw()
            .map_err(|e| fail(&e))?;
        for (i, (name, curves)) in runs.iter().enumerate() {
            let colour = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(
                    curves.loss.iter().map(|(s, v)| (*s, *v)),
                    colour.stroke_width(2),
                ))
                .map_err(|e| fail(&e))?
                .label(format!("{name} loss"))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2))
                });
            if !curves.eval.is_empty() {
                chart
                    .draw_series(DashedLineSeries::new(
                        curves.eval.iter().map(|(s, v)| (*s, *v)),
                        8,
                        5,
                        colour.stroke_width(2),
                    ))
                    .map_err(|e| fail(&e))?
                    .label(format!("{name} eval loss"))
                    .legend(move |(x, y)| {
                        PathElement::new([(x, y), (x + 8, y)], colour.stroke_width(2))
                    });
                chart
                    .draw_series(
                        curves
                            .eval
                            .iter()
                            .map(|(s, v)| Circle::new((*s, *v), 3, colour.filled())),
                    )
                    .map_err(|e| fail(&e))?;
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| fail(&e))?;
        root.present().map_err(|e| fail(&e))?;
    }
    Ok(svg)
}
