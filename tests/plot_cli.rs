//! `fusec plot` end to end: one polyline per curve in the SVG (with the log's number of points),
//! the legend, a PNG of the requested size, a real `fusec run --log-json` log against tokens,
//! and errors that name the file and line.

use fusec_ir::testkit::TempDir;
use std::path::Path;
use std::process::{Command, Output};

fn fusec(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fusec")).args(args).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn dir(name: &str) -> TempDir {
    TempDir::new(&format!("plot-{name}"))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A log of `steps` steps (loss falling from 5), validated before every `val_every`-th step and
/// after the last one when set; the losses of the steps in `nan` were not finite (`null`).
fn write_log(path: &Path, steps: usize, val_every: Option<usize>, nan: &[usize]) {
    let mut out = String::new();
    for step in 0..steps {
        let loss = if nan.contains(&step) { "null".to_string() } else { format!("{}", 5.0 - 0.1 * step as f64) };
        out += &format!("{{\"step\":{step},\"loss\":{loss},\"lr\":0.001,\"tokens\":{},\"ms\":1.0", (step + 1) * 128);
        if val_every.is_some_and(|n| step % n == 0) {
            out += &format!(",\"val_loss\":{}", 5.1 - 0.1 * step as f64);
        }
        out += "}\n";
    }
    if val_every.is_some() {
        out += &format!("{{\"step\":{steps},\"val_loss\":{}}}\n", 5.1 - 0.1 * steps as f64);
    }
    std::fs::write(path, out).unwrap();
}

/// The series colors and the number of points of every polyline that draws a curve: colored
/// (axes and ticks are black) and of more than two points (legend samples have two).
fn curves(svg: &str) -> Vec<(String, usize)> {
    svg.lines()
        .filter(|l| l.starts_with("<polyline") && !l.contains("stroke=\"#000000\""))
        .map(|l| {
            let color = l.split("stroke=\"").nth(1).unwrap().split('"').next().unwrap().to_string();
            let points = l.split("points=\"").nth(1).unwrap().split('"').next().unwrap().split_whitespace().count();
            (color, points)
        })
        .filter(|(_, n)| *n > 2)
        .collect()
}

#[test]
fn the_svg_has_one_polyline_per_curve_and_a_legend() {
    let d = dir("svg");
    let (a, b) = (d.join("base.jsonl"), d.join("lr3e-3.jsonl"));
    write_log(&a, 12, Some(5), &[]);
    write_log(&b, 8, None, &[3]);
    let svg = d.join("loss.svg");
    let o = fusec(&["plot", s(&a), s(&b), "-o", s(&svg), "--title", "two runs"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let svg = std::fs::read_to_string(&svg).unwrap();
    // base: 12 training points and 4 validations (steps 0, 5, 10 and after 12); lr3e-3: 8 steps,
    // one of them NaN, no validation.
    let got = curves(&svg);
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!((got[0].1, got[1].1, got[2].1), (12, 4, 7), "{got:?}");
    assert!(got[0].0 == got[1].0 && got[0].0 != got[2].0, "one color per run: {got:?}");
    for label in ["base train", "base val", "lr3e-3 train", "two runs", "step", "loss"] {
        assert!(svg.contains(&format!("\n{label}\n")) || svg.contains(&format!(">{label}<")), "no text {label:?}");
    }
    assert!(!svg.contains("lr3e-3 val"));
    // The validation points are dots.
    assert_eq!(svg.matches("<circle").count(), 4 + 1, "4 dots and the legend's");
}

#[test]
fn the_png_is_a_png_of_the_requested_size() {
    let d = dir("png");
    let log = d.join("run.jsonl");
    write_log(&log, 20, Some(4), &[]);
    let png = d.join("loss.PNG");
    let o = fusec(&["plot", s(&log), "-o", s(&png), "--width", "640", "--height", "400", "--label", "my run"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    // IHDR: width and height, big-endian, right after the chunk's length and type.
    assert_eq!(&bytes[12..16], b"IHDR");
    assert_eq!((u32::from_be_bytes(bytes[16..20].try_into().unwrap()), u32::from_be_bytes(bytes[20..24].try_into().unwrap())), (640, 400));
    assert!(bytes.len() > 5000, "a chart, not an empty picture: {} bytes", bytes.len());
}

#[test]
fn a_real_run_log_plots_against_tokens() {
    let d = dir("run");
    let log = d.join("tiny.jsonl");
    let graph = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt2-tiny.graph");
    let o = fusec(&["run", graph, "--steps", "6", "--batch", "2", "--seq", "16", "--val-every", "3", "--log-json", s(&log)]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let svg = d.join("tiny.svg");
    let o = fusec(&["plot", s(&log), "-o", s(&svg), "--x", "tokens"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let svg = std::fs::read_to_string(&svg).unwrap();
    // 6 steps; validation before steps 0 and 3 and after the last.
    let got = curves(&svg);
    assert_eq!(got.iter().map(|c| c.1).collect::<Vec<_>>(), [6, 3], "{got:?}");
    assert!(svg.contains("tokens"), "the x axis says tokens");
}

#[test]
fn bad_input_names_the_file_and_line() {
    let d = dir("bad");
    let out = d.join("x.svg");
    let refused = |args: &[&str], want: &[&str]| {
        let o = fusec(&[&["plot"], args].concat());
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(want.iter().all(|w| err.contains(w)) && !err.contains("panicked"), "{want:?}: {err}");
    };
    let missing = d.join("nope.jsonl");
    refused(&[s(&missing), "-o", s(&out)], &["nope.jsonl", "cannot read"]);
    let empty = d.join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    refused(&[s(&empty), "-o", s(&out)], &["empty.jsonl", "the log is empty"]);
    let bad = d.join("bad.jsonl");
    std::fs::write(&bad, "{\"step\":0,\"loss\":5.0}\n{\"step\":1,\"loss\":4.9\n").unwrap();
    refused(&[s(&bad), "-o", s(&out)], &[&format!("{}:2: expected a JSON object", bad.display())]);
    let old = d.join("old.jsonl");
    std::fs::write(&old, "{\"step\":0,\"loss\":5.0}\n").unwrap();
    refused(&[s(&old), "-o", s(&out), "--x", "tokens"], &["old.jsonl", "does not record tokens", "--tokens-per-step"]);
    let o = fusec(&["plot", s(&old), "-o", s(&out), "--x", "tokens", "--tokens-per-step", "4096"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    refused(&[s(&old), "-o", s(&d.join("x.pdf"))], &["x.pdf", ".svg or .png"]);
    refused(&[s(&old), s(&old), "-o", s(&out), "--label", "one"], &["1 --label for 2 logs"]);
    refused(&[s(&old), "-o", s(&d.join("no/such/dir/x.svg"))], &["x.svg", "cannot write"]);
    let wide = d.join("wide.jsonl");
    std::fs::write(&wide, "{\"step\":0,\"loss\":1e308}\n{\"step\":1,\"loss\":-1e308}\n").unwrap();
    refused(&[s(&wide), "-o", s(&out)], &["too wide to draw"]);
}
