//! Product tuning: each distinct bf16 product of the build is timed on every algorithm that
//! cuBLASLt's heuristic offers for it (and, for a plain product, on cuBLAS's own choice), and
//! the fastest is the one the launches run.
//!
//! cuBLAS picks one algorithm per shape by heuristic. On an H200 that first choice ran GPT-2's
//! input-gradient products up to 1.3× slower than the best of the next seven (1.5B `dX = dY W`
//! of `qkv`: 240 against 183 µs). So after the launch lists are built and before the one
//! allocation, each product (shape, transposes, types, epilogue, accumulation) runs on a
//! temporary buffer of random bf16 values: every candidate once to warm up, then [`REPS`]
//! rounds in which each runs once after the L2 cache is flushed ([`FLUSH`]), timed alone; a
//! candidate's time is its median, and it replaces the default only when it is faster by
//! [`MARGIN`]. A plain product whose winner is a cuBLASLt algorithm becomes a cuBLASLt launch.
//!
//! Choices are cached in `gemm_tuning.txt` beside the kernel cache, keyed by the GPU, cuBLASLt's
//! version, the timing method and the product, so that later runs (a resumed one too) run the
//! same algorithms without timing them. A product that cannot be timed (no room for its
//! buffers, a failed launch) keeps the default, and the summary says why.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys;
use fusec_codegen_cuda::gemm::Batched;
use fusec_ir::DType;

use super::device::{ck, Device};
use super::gemm_bf16;
use super::launch::{Addr, Launch, Step};
use super::lt::{alignment, Epilogue, LtKey, LtPlans, LtTypes};
use crate::atomic::write_atomic;

/// Timed rounds: each candidate runs once per round, after the L2 cache is flushed.
const REPS: usize = 5;

/// Bytes written before each timed call to flush the L2 cache (50 MiB on an H200).
const FLUSH: u64 = 128 << 20;

/// How much faster than the default a candidate must time to be chosen: smaller gains were
/// not seen in the step (H200: choices within 3% ran slower or equal there).
const MARGIN: f64 = 0.97;

/// Names the timing method in the cache's keys, so that a change of method times again.
const METHOD: &str = "flushed median of 5, 3% margin";

/// What tuning did, for the run summary.
#[derive(Default)]
pub struct Tuning {
    /// Distinct products tuned (from the cache or timed).
    pub products: usize,
    /// Of them, those whose choice came from the cache.
    pub cached: usize,
    /// The timed per-call times summed over the launches, on the default algorithms and on
    /// the chosen ones (µs).
    pub default_us: f64,
    pub chosen_us: f64,
    /// Why some or all products were not tuned, if so.
    pub note: Option<String>,
    /// How long tuning took.
    pub time: Duration,
}

/// What a product runs: cuBLAS's own choice or one of the plan's cuBLASLt algorithms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Choice {
    Cublas,
    Lt(usize),
}

/// A cached choice with the default's and its per-call time (µs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Entry {
    pub choice: Choice,
    pub default_us: f64,
    pub chosen_us: f64,
}

/// The cache file: `gemm_tuning.txt` in fusec's cache folder.
pub fn cache_file() -> Option<PathBuf> {
    fusec_codegen_cuda::nvrtc::cache_root().map(|d| d.join("gemm_tuning.txt"))
}

/// The cache line of `entry` under `key` (`KEY<TAB>cublas|ltN<TAB>default µs<TAB>chosen µs`).
pub(crate) fn format_entry(key: &str, e: &Entry) -> String {
    let choice = match e.choice {
        Choice::Cublas => "cublas".to_string(),
        Choice::Lt(i) => format!("lt{i}"),
    };
    format!("{}\t{choice}\t{:.2}\t{:.2}", key.replace(['\t', '\n', '\r'], " "), e.default_us, e.chosen_us)
}

/// The entries of a cache file's text (bad lines are skipped).
pub(crate) fn parse_entries(text: &str) -> HashMap<String, Entry> {
    let entry = |line: &str| {
        let f: Vec<&str> = line.split('\t').collect();
        let [key, choice, d, c] = f[..] else { return None };
        let choice = match choice {
            "cublas" => Choice::Cublas,
            s => Choice::Lt(s.strip_prefix("lt")?.parse().ok()?),
        };
        let (default_us, chosen_us) = (d.parse::<f64>().ok()?, c.parse::<f64>().ok()?);
        (default_us.is_finite() && chosen_us.is_finite()).then(|| (key.to_string(), Entry { choice, default_us, chosen_us }))
    };
    text.lines().filter_map(entry).collect()
}

/// The bytes of a product's operands, result, pre-activation and bias, each rounded up to 256.
pub(crate) fn operand_bytes(key: &LtKey) -> [u64; 5] {
    let c = &key.call;
    let (m, n, k) = (c.m as u64, c.n as u64, c.k as u64);
    let out = match key.types {
        LtTypes::Bf16 { out, .. } => out.size_bytes() as u64,
        LtTypes::Tf32 => 4,
    };
    // Saturating: a product this large cannot be allocated, and then is not timed.
    let size = |ld: i32, cols: u64, elem: u64| (ld as u64).saturating_mul(cols).saturating_mul(elem);
    let a = size(c.lda, if c.trans_a { m } else { k }, 2);
    let b = size(c.ldb, if c.trans_b { k } else { n }, 2);
    let y = size(c.ldc, n, out);
    let aux = if key.epilogue == Epilogue::GeluAuxBias { size(c.ldc, n, 2) } else { 0 };
    [a, b, y, aux, m * 2].map(|x| x.div_ceil(256).saturating_mul(256))
}

/// The key of a plain bf16 product step (not batched), as a cuBLASLt plan would need it.
fn plain_key(st: &Step) -> Option<LtKey> {
    let Step::Gemm { g, a, b, c, beta, ab: DType::BF16, out } = st else { return None };
    if g.batch != 1 {
        return None;
    }
    let off = |x: &Addr| match *x {
        Addr::Plan(o) | Addr::Scratch(o) | Addr::Static(o) => o,
    };
    let align = alignment([a, b, c].map(off));
    (align >= 16).then_some(LtKey {
        call: g.call,
        epilogue: Epilogue::None,
        types: LtTypes::Bf16 { out: *out, align },
        accumulate: *beta != 0.0,
    })
}

/// Tunes every bf16 product of `launches` (all programs'), before the device's allocation.
pub(crate) fn tune(launches: &mut [&mut Vec<Launch>], plans: &mut LtPlans, dev: &Device) -> Result<Tuning, String> {
    let t0 = Instant::now();
    let mut out = Tuning::default();
    // Each distinct product, its plan and how many launches run it, in order of first use.
    let mut keys: Vec<(LtKey, usize, usize)> = vec![];
    for st in launches.iter().flat_map(|l| l.iter()).flat_map(|l| &l.steps) {
        let key = match st {
            Step::GemmLt { plan, .. } if matches!(plans.plans[*plan].key.types, LtTypes::Bf16 { .. }) => plans.plans[*plan].key,
            st => match plain_key(st) {
                Some(k) => k,
                None => continue,
            },
        };
        match keys.iter_mut().find(|k| k.0 == key) {
            Some(k) => k.2 += 1,
            None => {
                if let Some(plan) = plans.find(&key)? {
                    keys.push((key, plan, 1));
                }
            }
        }
    }
    if keys.is_empty() {
        return Ok(out);
    }
    let file = cache_file();
    let mut cache = file.as_deref().and_then(|f| std::fs::read_to_string(f).ok()).map_or_else(HashMap::new, |t| parse_entries(&t));
    // SAFETY: a plain query.
    let version = unsafe { lt::cublasLtGetVersion() };
    let name = |key: &LtKey| format!("{} | cuBLASLt {version} | {METHOD} | {key:?}", dev.name);
    let mut timer: Option<Result<Timer, String>> = None;
    let mut stored = false;
    // The choice of each tuned product, with its plan.
    let mut choices: HashMap<LtKey, (Choice, usize)> = HashMap::new();
    for &(key, plan, uses) in &keys {
        let p = &plans.plans[plan];
        let valid = |e: &Entry| match e.choice {
            Choice::Cublas => key.epilogue == Epilogue::None,
            Choice::Lt(i) => i < p.algos.len(),
        };
        let entry = match cache.get(&name(&key)).filter(|e| valid(e)) {
            Some(e) => {
                out.cached += 1;
                *e
            }
            None => {
                let t = timer.get_or_insert_with(|| {
                    // Room for the largest product's buffers, the flush region and the workspace.
                    let sum = |k: &LtKey| operand_bytes(k).iter().fold(0u64, |s, &b| s.saturating_add(b));
                    let bytes = keys.iter().map(|k| sum(&k.0)).max().unwrap_or(0);
                    Timer::new(dev, bytes.saturating_add(FLUSH + plans.workspace as u64))
                });
                let t = match t {
                    Ok(t) => t,
                    Err(e) => {
                        out.note = Some(e.clone());
                        break;
                    }
                };
                match t.time(dev, plans, plan) {
                    Ok(e) => {
                        cache.insert(name(&key), e);
                        stored = true;
                        e
                    }
                    Err(e) => {
                        // The product keeps its default.
                        plans.plans[plan].chosen = 0;
                        out.note = Some(format!("a product was not tuned: {e}"));
                        continue;
                    }
                }
            }
        };
        out.products += 1;
        out.default_us += entry.default_us * uses as f64;
        out.chosen_us += entry.chosen_us * uses as f64;
        choices.insert(key, (entry.choice, plan));
        if let Choice::Lt(i) = entry.choice {
            plans.plans[plan].chosen = i;
        }
    }
    if let Some(Ok(t)) = timer {
        t.free(dev)?;
    }
    // Plain products whose winner is a cuBLASLt algorithm become cuBLASLt launches.
    for st in launches.iter_mut().flat_map(|l| l.iter_mut()).flat_map(|l| l.steps.iter_mut()) {
        let Some(key) = plain_key(st) else { continue };
        let Some(&(Choice::Lt(_), plan)) = choices.get(&key) else { continue };
        let Step::Gemm { a, b, c, .. } = *st else { continue };
        *st = Step::GemmLt { plan, a, b, c, bias: c, aux: c };
    }
    if stored {
        if let Some(f) = &file {
            if let Err(e) = store(f, &cache) {
                out.note.get_or_insert(format!("choices not cached: {e}"));
            }
        }
    }
    out.time = t0.elapsed();
    Ok(out)
}

/// Writes every entry to `file`, atomically.
fn store(file: &Path, cache: &HashMap<String, Entry>) -> Result<(), String> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let mut lines: Vec<String> = cache.iter().map(|(k, e)| format_entry(k, e)).collect();
    lines.sort();
    write_atomic(file, |f| f.write((lines.join("\n") + "\n").as_bytes())).map_err(|e: crate::file_error::FileError| e.to_string())
}

/// A temporary device buffer of random bf16 values (workspace at its end) and two events.
struct Timer {
    base: u64,
    bytes: u64,
    events: [sys::CUevent; 2],
}

impl Timer {
    /// Allocates `bytes` and fills them with small random bf16 values.
    fn new(dev: &Device, bytes: u64) -> Result<Timer, String> {
        dev.bind()?;
        // SAFETY: a plain allocation, freed by `free`.
        let base = unsafe { cudarc::driver::result::malloc_sync(bytes as usize) }
            .map_err(|e| format!("no room to tune the products ({:.0} MiB): {e:?}", bytes as f64 / 1048576.0))?;
        // 1 MiB of values in ±0.05, then doubled by device copies.
        let mut seed = 0x9e3779b97f4a7c15u64;
        let chunk: Vec<u16> = (0..1 << 19)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let x = ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
                (x.to_bits() >> 16) as u16
            })
            .collect();
        let first = (chunk.len() as u64 * 2).min(bytes);
        let ev = || cudarc::driver::result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| format!("event: {e:?}"));
        let t = Timer { base, bytes, events: [ev()?, ev()?] };
        // SAFETY: every copy stays inside the allocation.
        unsafe {
            ck(sys::cuMemcpyHtoDAsync_v2(base, chunk.as_ptr() as *const c_void, first as usize, dev.stream), "copy to GPU")?;
            let mut filled = first;
            while filled < bytes {
                let n = filled.min(bytes - filled);
                ck(sys::cuMemcpyDtoDAsync_v2(base + filled, base, n as usize, dev.stream), "device copy")?;
                filled += n;
            }
        }
        dev.sync("filling the tuning buffer")?;
        Ok(t)
    }

    /// Times the default and every candidate of plan `plan` on this buffer.
    fn time(&self, dev: &Device, plans: &mut LtPlans, plan: usize) -> Result<Entry, String> {
        let key = plans.plans[plan].key;
        let [a, b, y, aux, _] = operand_bytes(&key);
        let (pa, pb, py) = (self.base, self.base + a, self.base + a + b);
        let (paux, pbias) = (py + y, py + y + aux);
        let (flush, ws) = (self.base + self.bytes - plans.workspace as u64 - FLUSH, self.base + self.bytes - plans.workspace as u64);
        // The candidates: cuBLAS's own choice for a plain product, then cuBLASLt's in order.
        let one = Batched { call: key.call, stride_a: 0, stride_b: 0, stride_c: 0, batch: 1 };
        let out = match key.types {
            LtTypes::Bf16 { out, .. } => out,
            LtTypes::Tf32 => return Err("internal: tuning a TF32 product".into()),
        };
        let beta = if key.accumulate { 1.0 } else { 0.0 };
        let cublas = key.epilogue == Epilogue::None;
        let mut cands: Vec<Choice> = if cublas { vec![Choice::Cublas] } else { vec![] };
        cands.extend((0..plans.plans[plan].algos.len()).map(Choice::Lt));
        let mut run = |c: Choice| -> Result<(), String> {
            match c {
                // SAFETY: the buffer holds every operand at the planned shape.
                Choice::Cublas => unsafe { gemm_bf16(dev, &one, pa, pb, py, out, beta) },
                Choice::Lt(i) => {
                    plans.plans[plan].chosen = i;
                    let p = &plans.plans[plan];
                    // SAFETY: as above; the workspace lies at the buffer's end.
                    unsafe { p.run(plans.handle, pa, pb, py, pbias, paux, ws, dev.stream as *mut c_void) }
                }
            }
        };
        // An algorithm that fails to launch is not a candidate.
        let mut ok = vec![];
        for c in cands {
            if run(c).is_ok() && dev.sync("a product").is_ok() {
                ok.push((c, vec![]));
            }
        }
        for _ in 0..REPS {
            for (c, times) in ok.iter_mut() {
                // SAFETY: the flush region lies inside the buffer.
                unsafe { ck(sys::cuMemsetD32Async(flush, 0, (FLUSH / 4) as usize, dev.stream), "memset")? };
                let [e0, e1] = self.events;
                // SAFETY: live events on the device's stream.
                unsafe { ck(sys::cuEventRecord(e0, dev.stream), "event")? };
                run(*c)?;
                unsafe { ck(sys::cuEventRecord(e1, dev.stream), "event")? };
                dev.sync("timing a product")?;
                // SAFETY: both events were recorded and completed.
                let ms = unsafe { cudarc::driver::result::event::elapsed(e0, e1) }.map_err(|e| format!("{e:?}"))?;
                times.push(ms as f64 * 1e3);
            }
        }
        plans.plans[plan].chosen = 0;
        let median = |t: &mut Vec<f64>| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        };
        let timed: Vec<(Choice, f64)> = ok.into_iter().map(|(c, mut t)| (c, median(&mut t))).collect();
        let &(_, default_us) = timed.first().ok_or("no product algorithm ran")?;
        let best = timed.iter().copied().fold(timed[0], |b, t| if t.1 < b.1 { t } else { b });
        let best = if best.1 < default_us * MARGIN { best } else { timed[0] };
        Ok(Entry { choice: best.0, default_us, chosen_us: best.1 })
    }

    /// Frees the buffer and the events.
    fn free(self, dev: &Device) -> Result<(), String> {
        dev.sync("tuning")?;
        // SAFETY: allocated and created in `new`, no longer used.
        unsafe {
            for e in self.events {
                let _ = cudarc::driver::result::event::destroy(e);
            }
            cudarc::driver::result::free_sync(self.base).map_err(|e| format!("freeing the tuning buffer: {e:?}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fusec_codegen_cuda::gemm::ColMajor;

    #[test]
    fn cache_lines_round_trip_and_bad_lines_are_skipped() {
        let e = Entry { choice: Choice::Lt(3), default_us: 239.71, chosen_us: 182.8 };
        let c = Entry { choice: Choice::Cublas, default_us: 10.0, chosen_us: 10.0 };
        let text = [format_entry("gpu | k\t1", &e), "junk".into(), "x\tlt\t1\t2".into(), format_entry("gpu | k2", &c)].join("\n");
        let got = parse_entries(&text);
        assert_eq!(got.len(), 2);
        assert_eq!(got["gpu | k 1"], Entry { choice: Choice::Lt(3), default_us: 239.71, chosen_us: 182.8 });
        assert_eq!(got["gpu | k2"], c);
    }

    #[test]
    fn operand_bytes_follow_the_transposes_and_strides() {
        // The 1.5B forward `fc`: A = W stored [k, m] (transposed), B = x [k, n], bf16 result.
        let call = ColMajor { trans_a: true, trans_b: false, m: 6400, n: 8192, k: 1600, lda: 1600, ldb: 1600, ldc: 6400 };
        let key = LtKey { call, epilogue: Epilogue::GeluAuxBias, types: LtTypes::Bf16 { out: DType::BF16, align: 256 }, accumulate: false };
        let [a, b, y, aux, bias] = operand_bytes(&key);
        assert_eq!((a, b, y, aux, bias), (1600 * 6400 * 2, 1600 * 8192 * 2, 6400 * 8192 * 2, 6400 * 8192 * 2, 12800));
        // An f32 weight gradient, no pre-activation; sizes round up to 256 bytes.
        let call = ColMajor { trans_a: false, trans_b: true, m: 7, n: 13, k: 37, lda: 7, ldb: 13, ldc: 7 };
        let key = LtKey { call, epilogue: Epilogue::None, types: LtTypes::Bf16 { out: DType::F32, align: 16 }, accumulate: true };
        assert_eq!(operand_bytes(&key), [768, 1024, 512, 0, 256]);
    }
}
