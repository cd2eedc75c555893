//! `fusec plot LOG.jsonl [LOG2.jsonl ...] -o loss.svg`: the training and validation loss of
//! one or more runs (the JSON logs of `fusec run --log-json`) against steps or tokens, as SVG or
//! PNG (by the extension of `-o`). Reading the logs is [`log`], drawing is [`draw`].

mod draw;
mod log;

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

use crate::CliResult;
use draw::{Chart, Series};

/// What the x axis counts.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum XAxis {
    /// Optimizer steps done before the loss was measured.
    Steps,
    /// Tokens trained on before the loss was measured (steps × tokens per step).
    Tokens,
}

/// Arguments of `fusec plot`.
#[derive(Args)]
pub struct PlotArgs {
    /// JSON logs written by `fusec run --log-json` (one curve pair per log).
    #[arg(required = true, value_name = "LOG")]
    logs: Vec<PathBuf>,
    /// The picture to write: FILE.svg or FILE.png.
    #[arg(short, long)]
    output: PathBuf,
    /// The x axis.
    #[arg(long, value_enum, default_value = "steps")]
    x: XAxis,
    /// Tokens per optimizer step (B·T·grad-accum) for `--x tokens`, for logs that do not record
    /// them (logs written before fusec recorded `tokens`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    tokens_per_step: Option<u64>,
    /// The legend's name for each log, in order (default: the file name without extension).
    #[arg(long = "label", value_name = "NAME")]
    labels: Vec<String>,
    /// The title above the chart.
    #[arg(long, default_value = "loss")]
    title: String,
    /// Width in pixels.
    #[arg(long, default_value_t = 960, value_parser = clap::value_parser!(u32).range(200..=8000))]
    width: u32,
    /// Height in pixels.
    #[arg(long, default_value_t = 540, value_parser = clap::value_parser!(u32).range(150..=8000))]
    height: u32,
}

/// The picture formats, by the extension of `-o`.
enum Format {
    Svg,
    Png,
}

/// Runs `fusec plot`.
pub fn plot(a: PlotArgs) -> CliResult {
    let ext = a.output.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
    let format = match ext.as_deref() {
        Some("svg") => Format::Svg,
        Some("png") => Format::Png,
        _ => return Err(format!("-o {}: the picture's name must end in .svg or .png", a.output.display())),
    };
    if !a.labels.is_empty() && a.labels.len() != a.logs.len() {
        return Err(format!("{} --label for {} logs: give one per log, in order, or none", a.labels.len(), a.logs.len()));
    }
    let labels = if a.labels.is_empty() { default_labels(&a.logs) } else { a.labels.clone() };
    let mut series = Vec::with_capacity(a.logs.len());
    for (path, label) in a.logs.iter().zip(labels) {
        let run = log::read_log(path)?;
        let per = match a.x {
            XAxis::Steps => 1.0,
            XAxis::Tokens => run.tokens_per_step.or(a.tokens_per_step).ok_or_else(|| {
                format!(
                    "{}: --x tokens: the log does not record tokens; give --tokens-per-step N (B·T·grad-accum of the run)",
                    path.display()
                )
            })? as f64,
        };
        let at = |pts: &[(u64, f64)]| pts.iter().map(|&(s, l)| (s as f64 * per, l)).collect();
        series.push(Series { label, train: at(&run.train), val: at(&run.val) });
    }
    if series.iter().all(|s| s.train.is_empty() && s.val.is_empty()) {
        return Err("no finite loss in the logs: nothing to draw".into());
    }
    let chart = Chart {
        title: a.title.clone(),
        x_label: match a.x {
            XAxis::Steps => "step".into(),
            XAxis::Tokens => "tokens".into(),
        },
        x_is_tokens: a.x == XAxis::Tokens,
        width: a.width,
        height: a.height,
    };
    let bytes = match format {
        Format::Svg => draw::svg(&series, &chart)?.into_bytes(),
        Format::Png => draw::png(&series, &chart)?,
    };
    std::fs::write(&a.output, bytes).map_err(|e| format!("{}: cannot write: {e}", a.output.display()))?;
    outln!("wrote {}", a.output.display())
}

/// Each log's file name without its extension, or, where two are the same, the path as given.
fn default_labels(logs: &[PathBuf]) -> Vec<String> {
    let stem = |p: &PathBuf| p.file_stem().map_or_else(|| p.display().to_string(), |s| s.to_string_lossy().into_owned());
    let stems: Vec<String> = logs.iter().map(stem).collect();
    let unique = (0..stems.len()).all(|i| !stems[..i].contains(&stems[i]));
    if unique {
        stems
    } else {
        logs.iter().map(|p| p.display().to_string()).collect()
    }
}

/// The line `fusec run --log-json LOG` ends with: the command that draws the log, with
/// `LOG`'s extension replaced by `.svg` (`plot it: fusec plot log.jsonl -o log.svg`).
pub fn plot_hint(log: &Path) -> String {
    let mut svg = log.with_extension("svg");
    if svg == log {
        svg = PathBuf::from(format!("{}.svg", log.display()));
    }
    format!("plot it: fusec plot {} -o {}", shell_quoted(log), shell_quoted(&svg))
}

/// `p` as a shell word: as is when it is only letters, digits and `_./+-:@`, else single-quoted.
fn shell_quoted(p: &Path) -> String {
    let s = p.display().to_string();
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "_./+-:@".contains(c)) {
        s
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hint_replaces_the_extension_and_quotes_odd_paths() {
        assert_eq!(plot_hint(Path::new("runs/log.jsonl")), "plot it: fusec plot runs/log.jsonl -o runs/log.svg");
        assert_eq!(plot_hint(Path::new("log")), "plot it: fusec plot log -o log.svg");
        assert_eq!(plot_hint(Path::new("my run's.jsonl")), r"plot it: fusec plot 'my run'\''s.jsonl' -o 'my run'\''s.svg'");
    }

    #[test]
    fn labels_are_stems_unless_two_are_the_same() {
        let p = |v: &[&str]| v.iter().map(PathBuf::from).collect::<Vec<_>>();
        assert_eq!(default_labels(&p(&["a/x.jsonl", "b/y.jsonl"])), ["x", "y"]);
        assert_eq!(default_labels(&p(&["a/log.jsonl", "b/log.jsonl"])), ["a/log.jsonl", "b/log.jsonl"]);
    }
}
