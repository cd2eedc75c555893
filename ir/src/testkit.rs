//! What the workspace's tests share (behind the `testkit` feature, which only `[dev-dependencies]`
//! enable): tolerance checks on tensors and slices, error measures, random feeds and the random
//! graph generator [`gen`].
//!
//! Tolerances follow one convention everywhere: an element passes when `got == want`, when both
//! are NaN, or when `|got - want| <= atol + rtol * |want|` (`want` is the reference).

pub mod gen;
pub mod mutate;

use std::collections::HashMap;
use std::path::Path;

pub use crate::interp::random_feeds;

use crate::interp::Tensor;
use crate::rng::Rng;
use crate::{Bindings, DType, Graph};

/// A fresh folder under the system's temp folder for one test, named `fusec-{what}-{pid}`,
/// emptied when made and removed with what it holds when dropped.
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    /// Makes (or empties) the folder; panics if it cannot (a test's own setup).
    pub fn new(what: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("fusec-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
        TempDir(d)
    }
}

/// The folder `fusec-{what}-{pid}` under the system's temp folder for tests that share one
/// folder across a test process (cached checkpoints), made if missing. Folders of that name
/// left by test processes that have ended are removed first (on Linux, where `/proc` tells).
pub fn process_dir(what: &str) -> std::path::PathBuf {
    let tmp = std::env::temp_dir();
    let prefix = format!("fusec-{what}-");
    if let Ok(entries) = std::fs::read_dir(&tmp) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name.strip_prefix(&prefix).and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|p| p != std::process::id() && Path::new("/proc/self").exists() && !Path::new(&format!("/proc/{p}")).exists()) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let d = tmp.join(format!("{prefix}{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
    d
}

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whether `got` is within `atol + rtol * |want|` of `want` (equal values, both infinities of
/// one sign, and NaN against NaN pass).
pub fn close(got: f64, want: f64, atol: f64, rtol: f64) -> bool {
    got == want || (got.is_nan() && want.is_nan()) || (got - want).abs() <= atol + rtol * want.abs()
}

/// Checks `got` against the reference `want` element by element (see [`close`]); the error
/// names the worst element, or says that the lengths differ.
pub fn check_slice<T: Copy + Into<f64>>(got: &[T], want: &[f64], atol: f64, rtol: f64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} elements, the reference has {}", got.len(), want.len()));
    }
    let mut worst: Option<(usize, f64)> = None;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g: f64 = g.into();
        if !close(g, w, atol, rtol) {
            let excess = if (g - w).is_nan() { f64::INFINITY } else { (g - w).abs() / (atol + rtol * w.abs()) };
            if worst.is_none_or(|(_, x)| excess > x) {
                worst = Some((i, excess));
            }
        }
    }
    match worst {
        None => Ok(()),
        Some((i, _)) => {
            let (g, w): (f64, f64) = (got[i].into(), want[i]);
            Err(format!("element {i} is {g:e} but the reference is {w:e} (error {:e}; atol {atol:e}, rtol {rtol:e})", (g - w).abs()))
        }
    }
}

/// Panics (naming `what` and the worst element) unless `got` is close to `want`; see [`close`].
#[track_caller]
pub fn assert_close_slice<T: Copy + Into<f64>>(what: &str, got: &[T], want: &[f64], atol: f64, rtol: f64) {
    if let Err(e) = check_slice(got, want, atol, rtol) {
        panic!("{what}: {e}");
    }
}

/// Checks that the tensors have one dtype and shape and that every element is close (see
/// [`close`]); the error names the worst element.
pub fn check_tensor(got: &Tensor, want: &Tensor, atol: f64, rtol: f64) -> Result<(), String> {
    if (got.dtype, &got.shape) != (want.dtype, &want.shape) {
        return Err(format!("{}{:?} but the reference is {}{:?}", got.dtype, got.shape, want.dtype, want.shape));
    }
    check_slice(&got.data, &want.data, atol, rtol)
}

/// Panics (naming `what`) unless [`check_tensor`] passes.
#[track_caller]
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, atol: f64, rtol: f64) {
    if let Err(e) = check_tensor(got, want, atol, rtol) {
        panic!("{what}: {e}");
    }
}

/// [`assert_close`] on each pair of two runs' outputs (which must be as many).
#[track_caller]
pub fn assert_outputs_close(what: &str, got: &[Tensor], want: &[Tensor], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: output counts differ");
    for (k, (x, y)) in got.iter().zip(want).enumerate() {
        assert_close(&format!("{what}, output {k}"), x, y, atol, rtol);
    }
}

/// Panics unless two runs gave the same tensors bit for bit (any NaN equals any NaN).
#[track_caller]
pub fn assert_same_bits(what: &str, got: &[Tensor], want: &[Tensor]) {
    assert_eq!(got.len(), want.len(), "{what}: output counts differ");
    for (k, (x, y)) in got.iter().zip(want).enumerate() {
        assert_eq!((x.dtype, &x.shape), (y.dtype, &y.shape), "{what}: output {k} types differ");
        for (i, (p, q)) in x.data.iter().zip(&y.data).enumerate() {
            assert!(p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()), "{what}: output {k} element {i}: got {p:e}, want {q:e}");
        }
    }
}

/// The largest `|got - want|` (NaN if either holds a NaN); 0 for empty slices.
pub fn max_abs_diff<T: Copy + Into<f64>>(got: &[T], want: &[T]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(&a, &b)| (a.into() - b.into()).abs())
        .fold(0.0, |m, d| if d.is_nan() || m.is_nan() { f64::NAN } else { m.max(d) })
}

/// The relative L2 error `||got - want|| / ||want||` (in f64).
pub fn rel_l2<T: Copy + Into<f64>>(got: &[T], want: &[T]) -> f64 {
    let diff: f64 = got.iter().zip(want).map(|(&a, &b)| (a.into() - b.into()).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = want.iter().map(|&b| b.into().powi(2)).sum::<f64>().sqrt();
    diff / norm
}

/// The largest `|x|` of `data` (0 for an empty slice): the scale for tolerances relative to a
/// whole tensor rather than to each element.
pub fn max_abs(data: &[f64]) -> f64 {
    data.iter().fold(0.0, |m, v| m.max(v.abs()))
}

/// Every `*.graph` file directly in `dir`, sorted by name, with its parsed graph (comments, such
/// as a filetest's expectations, are ignored by the parser). Panics naming a file that does not
/// read or parse.
pub fn read_graphs(dir: &Path) -> Vec<(String, Graph)> {
    let mut paths: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "graph"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let name = p.file_name().expect("a file name").to_string_lossy().into_owned();
            let src = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            let g = crate::text::parse(&src, &p.display().to_string()).unwrap_or_else(|e| panic!("{e}"));
            (name, g)
        })
        .collect()
}

/// Random feeds (as [`random_feeds`]) in the ranges a training step sees: `lr`, `bc1`, `bc2`,
/// `grad_clip`, `dloss` set to typical values and AdamW's second moments `v.*` non-negative.
pub fn training_feeds(g: &Graph, b: &Bindings, seed: u64, int_hi: u64) -> HashMap<String, Tensor> {
    let mut feeds = random_feeds(g, b, &mut Rng::new(seed), int_hi).expect("random feeds of a verified graph");
    for (name, t) in feeds.iter_mut() {
        match name.as_str() {
            "lr" => *t = Tensor::scalar(DType::F32, 1e-3),
            "bc1" => *t = Tensor::scalar(DType::F32, 0.1),
            "bc2" => *t = Tensor::scalar(DType::F32, 0.001),
            "grad_clip" => *t = Tensor::scalar(DType::F32, 0.5),
            "dloss" => *t = Tensor::scalar(DType::F32, 1.0),
            n if n.starts_with("v.") => t.data.iter_mut().for_each(|x| *x = x.abs()),
            _ => {}
        }
    }
    feeds
}

/// Says that a test skips and why: one `SKIPPED: ...` line on standard error, and a line
/// appended to the file `$FUSEC_SKIP_LOG` names when it is set (`.ci/run` fails on any, since
/// CI has everything the skipping tests need).
pub fn skip(test: &str, reason: &str) {
    eprintln!("SKIPPED: {test}: {reason}");
    if let Some(path) = std::env::var_os("FUSEC_SKIP_LOG") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = writeln!(f, "{test}: {reason}");
        }
    }
}

/// Says that part of a test needs hardware that CI machines never have (AMX tiles) and did not
/// run here: one `NOT RUN HERE: ...` line on standard error, not logged as a skip. Such parts
/// run on the device machine, and the README gives their results.
pub fn not_on_this_host(part: &str, reason: &str) {
    eprintln!("NOT RUN HERE: {part}: {reason}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_accepts_nan_pairs_and_the_tolerance_band_only() {
        assert!(close(f64::NAN, f64::NAN, 0.0, 0.0));
        assert!(!close(1.0, f64::NAN, 1.0, 1.0));
        assert!(close(f64::INFINITY, f64::INFINITY, 0.0, 0.0));
        assert!(close(1.1, 1.0, 0.0, 0.1 + 1e-12) && !close(1.2, 1.0, 0.05, 0.1));
        let e = check_slice(&[1.0f32, 5.0, 2.0], &[1.0, 4.0, 3.0], 0.0, 0.1).unwrap_err();
        assert!(e.starts_with("element 2 is 2e0"), "{e}");
        assert!(check_slice(&[1.0f64], &[1.0, 2.0], 0.0, 0.0).is_err());
    }

    #[test]
    fn error_measures() {
        assert_eq!(max_abs_diff(&[1.0f32, -2.0], &[1.5, 0.0]), 2.0);
        assert!(max_abs_diff(&[f32::NAN], &[0.0]).is_nan());
        assert!(rel_l2(&[3.0f64], &[0.0]).is_infinite());
        assert!((rel_l2(&[1.0f64, 1.0], &[1.0, 2.0]) - 1.0 / 5f64.sqrt()).abs() < 1e-15);
        assert_eq!(max_abs(&[-3.0, 2.0]), 3.0);
    }
}
