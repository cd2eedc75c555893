//! The roofline of the `--profile` table: how close each kernel comes to the device's limit at
//! its arithmetic intensity `I = FLOPs / bytes`. The limits are a memory bandwidth and one
//! compute rate, the rate of the run's products (bf16, TF32 or fp32 GEMMs: tensor cores where
//! the run uses them); a kernel can attain `min(compute rate, I × bandwidth)` FLOP/s.
//!
//! The limits are measured once per device and product type (the targets' `measure_limits`: a
//! large copy and a large product through the target's own GEMM path) and cached in
//! `roofline.txt` in the kernel cache's folder ([`cache_file`]), or given on the command line;
//! [`resolve`] picks, and [`Roof::describe`] says which.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::atomic::write_atomic;
use crate::file_error::FileError;

/// A device's limits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// Memory bandwidth, bytes per second (bytes read plus bytes written).
    pub bytes_per_s: f64,
    /// The run's product rate, FLOP per second.
    pub flops_per_s: f64,
}

/// The percentage of its roof a kernel reached: `flops` and `bytes` (static counts) moved in
/// `secs`. The roof at `I = flops / bytes` is `min(peak FLOP/s, I × bandwidth)`; the achieved
/// FLOP rate is compared with it, which is the achieved byte rate over the bandwidth where the
/// kernel is memory-bound. A kernel without FLOPs is compared by bytes alone, one without bytes
/// by FLOPs alone; `None` when there is nothing to compare (no time, or neither count).
pub fn percent_of_roof(flops: u64, bytes: u64, secs: f64, lim: &Limits) -> Option<f64> {
    if secs.is_nan() || secs <= 0.0 || (flops == 0 && bytes == 0) {
        return None;
    }
    let (f, b) = (flops as f64, bytes as f64);
    if flops == 0 {
        return Some(100.0 * b / secs / lim.bytes_per_s);
    }
    let attainable = if bytes == 0 { lim.flops_per_s } else { lim.flops_per_s.min(f / b * lim.bytes_per_s) };
    Some(100.0 * f / secs / attainable)
}

/// Where a limit came from.
#[derive(Clone, Debug, PartialEq)]
pub enum Origin {
    /// Given on the command line.
    Given,
    /// Read from the cache file.
    Cached,
    /// Measured by this run (and cached where the file could be written).
    Measured,
}

/// The limits a profile is compared with, and where each came from.
#[derive(Clone, Debug)]
pub struct Roof {
    /// The limits.
    pub limits: Limits,
    /// Where the bandwidth came from.
    pub bandwidth: Origin,
    /// Where the product rate came from.
    pub compute: Origin,
    /// The device and product path the limits belong to (the cache key).
    pub key: String,
    /// The cache file, when there is one.
    pub file: Option<PathBuf>,
    /// Seconds the measurement took (0 when nothing was measured).
    pub measure_secs: f64,
    /// Why measured limits were not cached, when they were not.
    pub not_cached: Option<String>,
    /// Cached limits were measured again because the caller's `stale` test rejected them (a
    /// kernel faster than [`STALE_PERCENT`] of them: a measurement taken on a busy host would
    /// stay in the cache otherwise).
    pub remeasured: bool,
}

/// A kernel at more than this percentage of a cached limit shows it too low.
pub const STALE_PERCENT: f64 = 120.0;

impl Roof {
    /// One line for the run summary: both limits and where they came from.
    pub fn describe(&self) -> String {
        let origin = |o: &Origin| match o {
            Origin::Given => "given".to_string(),
            Origin::Cached => "cached".to_string(),
            Origin::Measured => "measured".to_string(),
        };
        let mut s = format!(
            "memory {:.1} GB/s ({}), products {:.2} TFLOP/s ({}) for {}",
            self.limits.bytes_per_s / 1e9,
            origin(&self.bandwidth),
            self.limits.flops_per_s / 1e12,
            origin(&self.compute),
            self.key
        );
        let uses = |o: Origin| self.bandwidth == o || self.compute == o;
        if uses(Origin::Measured) {
            if self.remeasured {
                s += &format!("; the cached limits were below this run's kernels (over {STALE_PERCENT:.0}% of them)");
            }
            s += &format!("; measured in {:.2} s", self.measure_secs);
            match (&self.not_cached, &self.file) {
                (Some(why), _) => s += &format!(", not cached: {why}"),
                (None, Some(f)) => s += &format!(", saved to {}", f.display()),
                (None, None) => {}
            }
        } else if let (true, Some(f)) = (uses(Origin::Cached), &self.file) {
            s += &format!(" from {}", f.display());
        }
        s
    }
}

/// The cache file: `roofline.txt` beside the CUDA kernel cache's folder, in
/// `$FUSEC_CACHE_DIR`, else `$XDG_CACHE_HOME/fusec`, else `~/.cache/fusec`.
pub fn cache_file() -> Option<PathBuf> {
    fusec_codegen_cuda::nvrtc::cache_root().map(|d| d.join("roofline.txt"))
}

/// The cache's lines are `KEY<TAB>bytes per second<TAB>FLOP per second`; keys lose tabs and
/// line breaks.
fn clean(key: &str) -> String {
    key.replace(['\t', '\n', '\r'], " ")
}

/// The limits cached in `file` under `key`, if any (a missing or unreadable file, or a bad
/// line, is no entry).
pub fn read_cached(file: &Path, key: &str) -> Option<Limits> {
    let text = std::fs::read_to_string(file).ok()?;
    let key = clean(key);
    text.lines().find_map(|line| {
        let mut f = line.split('\t');
        if f.next()? != key {
            return None;
        }
        let (b, c) = (f.next()?.parse::<f64>().ok()?, f.next()?.parse::<f64>().ok()?);
        let ok = |x: f64| x.is_finite() && x > 0.0;
        (ok(b) && ok(c)).then_some(Limits { bytes_per_s: b, flops_per_s: c })
    })
}

/// Stores `lim` under `key` in `file` (created with its folder; other keys kept), atomically.
pub fn store(file: &Path, key: &str, lim: &Limits) -> Result<(), FileError> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir).map_err(|e| FileError::io(dir, "cannot create the folder", &e))?;
    }
    let key = clean(key);
    let old = std::fs::read_to_string(file).unwrap_or_default();
    let mut lines: Vec<String> = old.lines().filter(|l| l.split('\t').next() != Some(key.as_str())).map(str::to_string).collect();
    lines.push(format!("{key}\t{}\t{}", lim.bytes_per_s, lim.flops_per_s));
    write_atomic(file, |f| f.write((lines.join("\n") + "\n").as_bytes()))
}

/// The limits for `key`: each one given (`bytes_per_s`, `flops_per_s`), else both from `file`
/// when it holds `key` and `stale` does not reject them, else both from `measure` (then
/// stored in `file`, best effort).
pub fn resolve(
    key: &str,
    bytes_per_s: Option<f64>,
    flops_per_s: Option<f64>,
    file: Option<PathBuf>,
    stale: impl Fn(&Limits) -> bool,
    measure: impl FnOnce() -> Result<Limits, String>,
) -> Result<Roof, String> {
    let mut roof = Roof {
        limits: Limits { bytes_per_s: bytes_per_s.unwrap_or(0.0), flops_per_s: flops_per_s.unwrap_or(0.0) },
        bandwidth: Origin::Given,
        compute: Origin::Given,
        key: key.to_string(),
        file,
        measure_secs: 0.0,
        not_cached: None,
        remeasured: false,
    };
    if bytes_per_s.is_some() && flops_per_s.is_some() {
        return Ok(roof);
    }
    let cached = roof.file.as_deref().and_then(|f| read_cached(f, key));
    // Only the cached limits are judged: a given one counts as no limit.
    let inf = |given: Option<f64>, cached: f64| if given.is_some() { f64::INFINITY } else { cached };
    let merged = |c: &Limits| Limits { bytes_per_s: inf(bytes_per_s, c.bytes_per_s), flops_per_s: inf(flops_per_s, c.flops_per_s) };
    roof.remeasured = cached.as_ref().is_some_and(|c| stale(&merged(c)));
    let (found, origin) = match cached.filter(|_| !roof.remeasured) {
        Some(lim) => (lim, Origin::Cached),
        None => {
            let t = Instant::now();
            let lim = measure()?;
            roof.measure_secs = t.elapsed().as_secs_f64();
            match &roof.file {
                Some(f) => roof.not_cached = store(f, key, &lim).err().map(|e| e.to_string()),
                None => roof.not_cached = Some("no cache folder (set FUSEC_CACHE_DIR)".into()),
            }
            (lim, Origin::Measured)
        }
    };
    if bytes_per_s.is_none() {
        (roof.limits.bytes_per_s, roof.bandwidth) = (found.bytes_per_s, origin.clone());
    }
    if flops_per_s.is_none() {
        (roof.limits.flops_per_s, roof.compute) = (found.flops_per_s, origin);
    }
    Ok(roof)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIM: Limits = Limits { bytes_per_s: 10e9, flops_per_s: 1e12 };

    fn close(got: Option<f64>, want: f64) {
        let g = got.expect("a percentage");
        assert!((g - want).abs() < 1e-9 * want.abs().max(1.0), "{g} != {want}");
    }

    #[test]
    fn memory_bound_kernels_are_measured_against_the_bandwidth() {
        // I = 10 FLOP/byte: the roof is 10 × 10 GB/s = 100 GFLOP/s, below the 1 TFLOP/s peak.
        // 1 GB and 10 GFLOP in 0.2 s: 5 GB/s = 50 GFLOP/s = 50 % of it.
        close(percent_of_roof(10_000_000_000, 1_000_000_000, 0.2, &LIM), 50.0);
    }

    #[test]
    fn compute_bound_kernels_are_measured_against_the_peak() {
        // I = 1000 FLOP/byte: the roof is the 1 TFLOP/s peak; 500 GFLOP in 1 s is 50 %.
        close(percent_of_roof(500_000_000_000, 500_000_000, 1.0, &LIM), 50.0);
        // At the ridge (I = 100) both limits agree.
        close(percent_of_roof(100_000_000_000, 1_000_000_000, 1.0, &LIM), 10.0);
    }

    #[test]
    fn zero_flops_use_bytes_and_zero_bytes_use_flops() {
        close(percent_of_roof(0, 2_000_000_000, 1.0, &LIM), 20.0);
        close(percent_of_roof(250_000_000_000, 0, 1.0, &LIM), 25.0);
        assert_eq!(percent_of_roof(0, 0, 1.0, &LIM), None);
        assert_eq!(percent_of_roof(5, 5, 0.0, &LIM), None);
        assert_eq!(percent_of_roof(5, 5, f64::NAN, &LIM), None);
    }

    #[test]
    fn limits_are_given_else_cached_else_measured_and_cached() {
        let dir = std::env::temp_dir().join(format!("fusec-roofline-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let file = dir.join("sub").join("roofline.txt");
        let measured = Limits { bytes_per_s: 3e9, flops_per_s: 4e11 };
        let fail = || -> Result<Limits, String> { Err("must not measure".into()) };
        // Both given: nothing is read or measured.
        let r = resolve("k\tA", Some(1.0), Some(2.0), Some(file.clone()), |_| true, fail).unwrap();
        assert_eq!((r.limits, r.bandwidth, r.compute), (Limits { bytes_per_s: 1.0, flops_per_s: 2.0 }, Origin::Given, Origin::Given));
        // Not cached: measured and stored; one given value wins over the measurement.
        let r = resolve("k\tA", Some(7e9), None, Some(file.clone()), |_| false, || Ok(measured)).unwrap();
        assert_eq!((r.limits.bytes_per_s, r.limits.flops_per_s), (7e9, 4e11));
        assert_eq!((&r.bandwidth, &r.compute, &r.not_cached), (&Origin::Given, &Origin::Measured, &None));
        assert!(r.describe().contains("saved to"), "{}", r.describe());
        // Cached now, next to another key.
        store(&file, "other", &LIM).unwrap();
        let r = resolve("k\tA", None, None, Some(file.clone()), |_| false, fail).unwrap();
        assert_eq!((r.limits, r.bandwidth.clone()), (measured, Origin::Cached));
        assert!(r.describe().starts_with("memory 3.0 GB/s (cached), products 0.40 TFLOP/s (cached) for k\tA from "), "{}", r.describe());
        assert_eq!(read_cached(&file, "other"), Some(LIM));
        assert_eq!(std::fs::read_to_string(&file).unwrap().lines().count(), 2);
        // A measurement that fails is the error.
        assert!(resolve("new", None, None, Some(file.clone()), |_| false, fail).is_err());
        // Cached limits that this run's kernels beat are measured again and replace the entry;
        // `stale` sees a given limit as none.
        let faster = Limits { bytes_per_s: 5e9, flops_per_s: 9e11 };
        let r = resolve("k\tA", Some(8e9), None, Some(file.clone()), |l| l.bytes_per_s == f64::INFINITY && l.flops_per_s == 4e11, || Ok(faster)).unwrap();
        assert!(r.remeasured && r.compute == Origin::Measured, "{r:?}");
        assert_eq!((r.limits.bytes_per_s, r.limits.flops_per_s), (8e9, 9e11));
        assert!(r.describe().contains("the cached limits were below this run's kernels"), "{}", r.describe());
        assert_eq!(read_cached(&file, "k\tA"), Some(faster));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
