//! `fusec run --trace` (a Chrome trace of one step) and the profile's `% roof` column, through
//! the binary on the tiny GPT-2 on the CPU: the trace holds exactly the launches of one step,
//! the column agrees with the table's own rates, and bad flags are refused before training.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;

const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt2-tiny.graph");

/// Runs `fusec run TINY --batch 2 --seq 16 --threads 2 ARGS` (`--target cpu` unless ARGS
/// name a target) with a private cache folder; returns (exit code, stdout, stderr).
fn run_tiny(args: &[&str]) -> (Option<i32>, String, String) {
    let target: &[&str] = if args.contains(&"--target") { &[] } else { &["--target", "cpu"] };
    let o = Command::new(env!("CARGO_BIN_EXE_fusec"))
        .args(["run", TINY, "--batch", "2", "--seq", "16", "--threads", "2"])
        .args(target)
        .args(args)
        .env("FUSEC_CACHE_DIR", tmp("cache"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (o.status.code(), String::from_utf8_lossy(&o.stdout).into(), String::from_utf8_lossy(&o.stderr).into())
}

fn tmp(name: &str) -> PathBuf {
    fusec_ir::testkit::process_dir("profile-cli").join(name)
}

/// Asserts exit 2, no panic, no training step, and every `needle` in standard error.
fn refused(args: &[&str], needles: &[&str]) {
    let (code, _, err) = run_tiny(args);
    assert_eq!(code, Some(2), "{args:?}: {err}");
    assert!(!err.contains("panicked") && !err.contains("step     1"), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: expected `{n}` in: {err}");
    }
}

/// The trace's launch slices (name, program, ts, dur) and every slice by track name.
struct Trace {
    launches: Vec<(String, String, f64, f64)>,
    tracks: BTreeMap<String, Vec<(String, f64, f64)>>,
}

fn read_trace(path: &PathBuf) -> Trace {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(v["displayTimeUnit"], "ms");
    let events = v["traceEvents"].as_array().unwrap();
    let names: BTreeMap<u64, String> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| (e["tid"].as_u64().unwrap(), e["args"]["name"].as_str().unwrap().to_string()))
        .collect();
    let mut t = Trace { launches: vec![], tracks: BTreeMap::new() };
    for e in events.iter().filter(|e| e["ph"] == "X") {
        let (name, ts, dur) = (e["name"].as_str().unwrap().to_string(), e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        assert!(ts >= 0.0 && dur >= 0.0, "{e}");
        let track = names.get(&e["tid"].as_u64().unwrap()).unwrap_or_else(|| panic!("a slice on an unnamed track: {e}"));
        t.tracks.entry(track.clone()).or_default().push((name.clone(), ts, dur));
        if e["cat"] == "launch" {
            let a = &e["args"];
            assert!(a["bytes"].is_u64() && a["flops"].is_u64() && !a["ops"].as_array().unwrap().is_empty(), "{e}");
            t.launches.push((name, a["program"].as_str().unwrap().to_string(), ts, dur));
        }
    }
    for (track, slices) in &mut t.tracks {
        slices.sort_by(|a, b| a.1.total_cmp(&b.1));
        for w in slices.windows(2) {
            assert!(w[0].1 + w[0].2 <= w[1].1 + 1e-6, "overlapping slices on `{track}`: {:?} and {:?}", w[0], w[1]);
        }
    }
    t
}

/// Launch names with their counts.
fn multiset<'a>(names: impl Iterator<Item = &'a str>) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for n in names {
        *m.entry(n.to_string()).or_default() += 1;
    }
    m
}

/// Runs two steps on `target` with `--trace` and `--profile-json` (`--grad-accum accum`) and
/// checks that the trace holds exactly the profiled step's launches, on one launch track named
/// `track…` beside the compile track, after compiling; returns the trace.
fn trace_matches_the_profile(target: &str, accum: &str, track: &str) -> Trace {
    let (trace, json) = (tmp(&format!("{target}-t{accum}.json")), tmp(&format!("{target}-p{accum}.json")));
    // Two steps: the first is the warm-up, so the profile times exactly the traced step.
    let (tr, js) = (trace.to_str().unwrap(), json.to_str().unwrap());
    let args = ["--target", target, "--steps", "2", "--grad-accum", accum, "--profile-json", js, "--trace", tr];
    let (code, _, err) = run_tiny(&[&args[..], &["--peak-gbps", "10", "--peak-tflops", "1"]].concat());
    assert_eq!(code, Some(0), "{err}");
    let t = read_trace(&trace);
    let n = t.launches.len();
    assert!(err.contains(&format!("trace: {tr} ({n} launches; open in https://ui.perfetto.dev)")), "{err}");
    let profile: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let mut want = BTreeMap::new();
    for k in profile.as_array().unwrap() {
        want.insert(k["kernel"].as_str().unwrap().to_string(), k["calls"].as_u64().unwrap());
    }
    assert_eq!(multiset(t.launches.iter().map(|l| l.0.as_str())), want, "--grad-accum {accum}");
    // The compile track, the launch track, and on the CPU a track per thread that worked.
    let is_thread = |k: &str| k.starts_with("CPU worker") || k.starts_with("executor thread (tasks run inline)");
    let others: Vec<&String> = t.tracks.keys().filter(|k| !is_thread(k)).collect();
    assert_eq!(others.len(), 2, "{:?}", t.tracks.keys());
    let launch_track = t.tracks.keys().find(|k| k.starts_with(track)).unwrap_or_else(|| panic!("no `{track}` track"));
    assert_eq!(t.tracks[launch_track].len(), n);
    let threads: Vec<&String> = t.tracks.keys().filter(|k| is_thread(k)).collect();
    assert_eq!(threads.is_empty(), target == "cuda", "{:?}", t.tracks.keys());
    for k in threads {
        // Each thread's slice lies inside the launch of its name.
        for (name, ts, dur) in &t.tracks[k] {
            let inside = t.launches.iter().any(|l| &l.0 == name && l.2 <= ts + 1e-3 && ts + dur <= l.2 + l.3 + 1e-3);
            assert!(inside, "`{k}`: {name} at {ts} for {dur} is inside no launch of that name");
        }
    }
    let compile: Vec<&str> = t.tracks["compile"].iter().map(|s| s.0.as_str()).collect();
    for pass in ["autodiff", "fuse-elementwise", "schedule"] {
        assert!(compile.contains(&pass), "no `{pass}` in the compile track: {compile:?}");
    }
    // The step comes after compiling; with accumulation its Grad run precedes its Step run.
    let compile_end = t.tracks["compile"].iter().map(|s| s.1 + s.2).fold(0.0, f64::max);
    assert!(t.launches.iter().all(|l| l.2 >= compile_end), "a launch before the end of compiling");
    let mut programs: Vec<&str> = t.launches.iter().map(|l| l.1.as_str()).collect();
    programs.dedup();
    assert_eq!(programs, if accum == "1" { vec!["Step"] } else { vec!["Grad", "Step"] }, "--grad-accum {accum}");
    t
}

/// A run of three steps with `--trace` alone on `target` times that one step: the same
/// launches as `first`.
fn a_trace_alone_has_the_same_launches(target: &str, first: &Trace) {
    let trace = tmp(&format!("{target}-alone.json"));
    let (code, out, err) = run_tiny(&["--target", target, "--steps", "3", "--trace", trace.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.contains("% roof") && !out.contains("roofline"), "{out}");
    let alone = read_trace(&trace);
    assert_eq!(multiset(alone.launches.iter().map(|l| l.0.as_str())), multiset(first.launches.iter().map(|l| l.0.as_str())));
}

#[test]
fn the_trace_holds_exactly_the_launches_of_one_step() {
    let first = trace_matches_the_profile("cpu", "1", "executor thread");
    let compile = &first.tracks["compile"];
    assert!(compile.iter().any(|s| s.0 == "memory plans, launch lists, Cranelift"), "{compile:?}");
    trace_matches_the_profile("cpu", "2", "executor thread");
    a_trace_alone_has_the_same_launches("cpu", &first);
}

#[test]
fn a_data_parallel_trace_shows_the_collectives_on_their_own_track() {
    let trace = tmp("ranks.json");
    let (code, _, err) = run_tiny(&["--steps", "2", "--ranks", "2", "--trace", trace.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    let t = read_trace(&trace);
    let track = t.tracks.keys().find(|k| k.starts_with("collectives")).unwrap_or_else(|| panic!("{:?}", t.tracks.keys()));
    let on_track: Vec<&str> = t.tracks[track].iter().map(|s| s.0.as_str()).collect();
    // The loss and the gradients' bucket, and nothing else; the launch track has the rest.
    assert!(on_track.len() >= 2 && on_track.iter().all(|n| *n == "all_reduce"), "{on_track:?}");
    let executor = t.tracks.keys().find(|k| k.starts_with("executor thread (each")).unwrap();
    assert!(t.tracks[executor].iter().all(|s| s.0 != "all_reduce"));
    assert_eq!(t.tracks[executor].len() + on_track.len(), t.launches.len());
}

#[test]
fn a_bad_trace_path_or_too_few_steps_is_refused_before_training() {
    refused(&["--steps", "3", "--trace", "/nonexistent/dir/t.json"], &["--trace /nonexistent/dir/t.json", "does not exist"]);
    let dir = std::env::temp_dir();
    refused(&["--steps", "3", "--trace", dir.to_str().unwrap()], &["--trace", "is a directory"]);
    let t = tmp("few.json");
    refused(&["--steps", "1", "--trace", t.to_str().unwrap()], &["--trace", "--steps 2 or more"]);
    assert!(!t.exists());
    refused(&["--steps", "3", "--target", "ref", "--trace", t.to_str().unwrap()], &["--trace", "--target cpu"]);
}

#[test]
fn a_resumed_run_traces_its_own_second_step() {
    let (dir, trace) = (tmp("resume-ck"), tmp("resumed.json"));
    let (code, _, err) = run_tiny(&["--steps", "2", "--save", dir.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    let resume = ["--resume", dir.to_str().unwrap(), "--trace", trace.to_str().unwrap()];
    refused(&[&resume[..], &["--steps", "3"]].concat(), &["--trace", "resuming at step 2", "--steps 4 or more"]);
    let (code, _, err) = run_tiny(&[&resume[..], &["--steps", "4"]].concat());
    assert_eq!(code, Some(0), "{err}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert_eq!(v["otherData"]["step"], 4);
}

/// The `(GB/s, GFLOP/s, % roof)` of each table row that has a `% roof`.
fn roof_rows(out: &str) -> Vec<(String, f64, f64, f64)> {
    let mut rows = vec![];
    let mut lines = out.lines().skip_while(|l| !l.starts_with("kernel "));
    let header = lines.next().expect("the profile table");
    assert!(header.trim_end().ends_with("GB/s   GFLOP/s  % roof"), "{header}");
    for l in lines.take_while(|l| !l.contains("launches timed")) {
        let f: Vec<&str> = l.split_whitespace().collect();
        let n = f.len();
        if f[n - 1] == "-" {
            continue;
        }
        let num = |s: &str| s.parse::<f64>().unwrap_or_else(|_| panic!("{s} in {l}"));
        rows.push((f[0].to_string(), num(f[n - 3]), num(f[n - 2]), num(f[n - 1])));
    }
    rows
}

/// Checks the `% roof` column of a `--profile` run on `target` with given limits (10 GB/s,
/// 1 TFLOP/s) against the table's own GB/s and GFLOP/s.
fn the_roof_column_agrees_on(target: &str) {
    let (code, out, err) = run_tiny(&["--target", target, "--steps", "3", "--profile", "--peak-gbps", "10", "--peak-tflops", "1"]);
    assert_eq!(code, Some(0), "{err}");
    let row = out.lines().find(|l| l.starts_with("roofline")).expect("a roofline row");
    assert!(row.contains(&format!("memory 10.0 GB/s (given), products 1.00 TFLOP/s (given) for {target} ")), "{row}");
    let rows = roof_rows(&out);
    assert!(rows.len() > 5, "{out}");
    // At I = FLOP/byte the roof is min(1000 GFLOP/s, I × 10 GB/s), so % roof =
    // 100 × max(GFLOP/s / 1000, GB/s / 10) whether memory- or compute-bound (and with no
    // FLOPs, GB/s / 10). The printed columns are rounded to 0.05.
    let pct = |gbs: f64, gflops: f64| (gflops / 10.0).max(10.0 * gbs);
    for (name, gbs, gflops, roof) in rows {
        let (lo, hi) = (pct((gbs - 0.05).max(0.0), (gflops - 0.05).max(0.0)), pct(gbs + 0.05, gflops + 0.05));
        assert!(roof >= lo - 0.05 && roof <= hi + 0.05, "{name}: {roof} % roof from {gbs} GB/s and {gflops} GFLOP/s: want {lo}..{hi}");
    }
}

/// Profiles `target` at `precision` twice without given limits: measured (into a fresh cache
/// file, for `products`) and written to the JSON, then read from the cache; returns the
/// measured (GB/s, TFLOP/s).
fn limits_are_measured_once_then_cached_on(target: &str, precision: &str, products: &str) -> (f64, f64) {
    let cache = tmp("cache").join("roofline.txt");
    let _ = std::fs::remove_file(&cache);
    let json = tmp(&format!("{target}-{precision}-measured.json"));
    let mut limits = (0.0, 0.0);
    for (i, want) in ["(measured)", "(cached)"].iter().enumerate() {
        let args = ["--target", target, "--precision", precision, "--steps", "2", "--profile-json", json.to_str().unwrap()];
        let (code, out, err) = run_tiny(&args);
        assert_eq!(code, Some(0), "{err}");
        let row = out.lines().find(|l| l.starts_with("roofline")).expect("a roofline row");
        assert!(row.contains(&format!("GB/s {want}, products ")) && row.contains(&format!(" {products} products")), "run {i}: {row}");
        assert!(cache.exists(), "{row}");
        let num = |after: &str| row[row.find(after).unwrap() + after.len()..].split_whitespace().next().unwrap().parse::<f64>().unwrap();
        limits = (num("memory "), num("products "));
        let profile: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let roofs: Vec<&Value> = profile.as_array().unwrap().iter().map(|k| &k["roof_pct"]).collect();
        assert!(roofs.iter().all(|r| r.is_null() || r.as_f64().unwrap() >= 0.0) && roofs.iter().any(|r| r.is_f64()), "{profile}");
    }
    limits
}

#[test]
fn the_roof_column_agrees_with_the_tables_rates() {
    the_roof_column_agrees_on("cpu");
}

#[test]
fn limits_are_measured_once_then_cached() {
    for (precision, products) in [("fp32", "f32"), ("bf16", "bf16")] {
        let (gbps, tflops) = limits_are_measured_once_then_cached_on("cpu", precision, products);
        assert!(gbps > 0.0 && tflops > 0.0, "{precision}: {gbps} GB/s, {tflops} TFLOP/s");
    }
}

#[test]
fn bad_limits_are_refused() {
    for v in ["0", "-1", "nan", "inf", "2e6"] {
        for flag in ["--peak-gbps", "--peak-tflops"] {
            refused(&["--profile", flag, v], &[flag, "finite, above 0 and at most 1000000"]);
        }
    }
    refused(&["--profile", "--peak-tflops", "fast"], &["--peak-tflops", "fast"]);
    refused(&["--peak-gbps", "10"], &["--peak-gbps", "needs --profile or --profile-json"]);
}

/// On a GPU (`cargo test --test profile_cli -- --ignored`): the trace and the roofline on
/// `--target cuda`, fp32 (TF32 products) then bf16 products, measured on the device.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_trace_and_roofline_on_a_gpu() {
    let first = trace_matches_the_profile("cuda", "1", "CUDA stream");
    let compile: Vec<&str> = first.tracks["compile"].iter().map(|s| s.0.as_str()).collect();
    for phase in ["memplan", "codegen", "nvrtc", "module load"] {
        assert!(compile.contains(&phase), "no `{phase}` in {compile:?}");
    }
    trace_matches_the_profile("cuda", "2", "CUDA stream");
    a_trace_alone_has_the_same_launches("cuda", &first);
    the_roof_column_agrees_on("cuda");
    for (precision, products) in [("fp32", "tf32"), ("bf16", "bf16")] {
        let (gbps, tflops) = limits_are_measured_once_then_cached_on("cuda", precision, products);
        // Any GPU with tensor cores has more than these.
        assert!(gbps > 300.0 && tflops > 10.0, "{precision}: {gbps} GB/s, {tflops} TFLOP/s");
    }
}
