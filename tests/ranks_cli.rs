//! Data-parallel runs through the `fusec` binary on the CPU target (CUDA with `--ignored` on
//! GPUs): one rank computes exactly what a plain run does; N ranks of batch B train like one
//! process of batch N·B (the same global batches, gradients averaged); rank 0 alone prints and
//! saves; a rank that never comes, or dies mid-run, stops the others with an error naming it,
//! within the timeout; bad combinations of flags and torchrun's variables are refused.
//!
//! `FUSEC_BIN` may name the binary to test (the device runs a prebuilt one).

mod common;

use common::{bin, tiny};
use fusec_ir::testkit::TempDir;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn command(args: &[&str], env: &[(&str, String)]) -> Command {
    let mut c = Command::new(bin());
    c.args(args).stdin(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

fn fusec(args: &[&str], env: &[(&str, String)]) -> Output {
    command(args, env).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// (step, loss) and (step, val_loss) from a `--log-json` file.
fn losses(path: &Path) -> Vec<(String, f64)> {
    let s = std::fs::read_to_string(path).unwrap();
    s.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let key = if v.get("loss").is_some() { "loss" } else { "val_loss" };
            (format!("{key}@{}", v["step"]), v[key].as_f64().unwrap())
        })
        .collect()
}

/// Trains the tiny model for 6 steps with `extra` flags, logging to `log`; returns stdout.
fn train(target: &str, log: &Path, extra: &[&str]) -> String {
    let g = tiny();
    let mut args = vec!["run", &g, "--target", target, "--steps", "6", "--seq", "32", "--val-every", "3", "--val-batches", "2"];
    args.extend(["--log-json", log.to_str().unwrap()]);
    args.extend(extra);
    let o = fusec(&args, &[]);
    assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
    text(&o.stdout)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// torchrun's variables for rank `rank` of `world` on this host.
fn torchrun(rank: usize, world: usize, port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
    ]
}

/// Every logged number but the timings (`loss`, `val_loss`, `grad_norm`, ...), per step.
fn logged(path: &Path) -> Vec<(String, f64)> {
    let s = std::fs::read_to_string(path).unwrap();
    let mut out = vec![];
    for l in s.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        for (k, x) in v.as_object().unwrap() {
            if k != "ms" && k != "step" {
                out.push((format!("{k}@{}", v["step"]), x.as_f64().unwrap_or(f64::NAN)));
            }
        }
    }
    out
}

fn one_rank_is_bit_identical(target: &str) {
    let d = TempDir::new(&format!("ranks-one-{target}"));
    // (Seed 6 with accumulation and clipping differed in the last bits while one rank still
    // compiled the data-parallel program: its `all_reduce`s changed the fusions.)
    let accum = ["--batch", "1", "--grad-accum", "2", "--grad-clip", "1"];
    for extra in [&["--batch", "2"][..], &["--batch", "2", "--precision", "bf16"], &accum, &[&accum[..], &["--seed", "6"]].concat()] {
        let (plain, ranked) = (d.join("plain.jsonl"), d.join("ranked.jsonl"));
        train(target, &plain, extra);
        train(target, &ranked, &[extra, &["--ranks", "1"]].concat());
        let (a, b) = (logged(&plain), logged(&ranked));
        assert!(a.len() > 6 && a.iter().zip(&b).all(|(x, y)| x.0 == y.0 && x.1.to_bits() == y.1.to_bits()) && a.len() == b.len(), "{extra:?}:\n{a:?}\n{b:?}");
    }
}

fn ranks_train_like_one_process_of_the_global_batch(target: &str, ranks: usize) {
    let d = TempDir::new(&format!("ranks-{ranks}-{target}"));
    let n = ranks.to_string();
    let global = (2 * ranks).to_string();
    for extra in [&[][..], &["--grad-clip", "0.5"], &["--grad-accum", "2"], &["--precision", "bf16"]] {
        let (one, many) = (d.join("one.jsonl"), d.join("many.jsonl"));
        train(target, &one, &[extra, &["--batch", &global]].concat());
        let save = d.join("ckpt");
        let out = train(target, &many, &[extra, &["--batch", "2", "--ranks", &n, "--save", save.to_str().unwrap()]].concat());
        let (a, b) = (losses(&one), losses(&many));
        assert_eq!(a.len(), b.len(), "{extra:?}");
        for ((ka, va), (kb, vb)) in a.iter().zip(&b) {
            assert_eq!(ka, kb);
            // The same sums in another order (per-rank means, then the mean over ranks): f32
            // rounding apart, and bf16's products round per rank.
            let tol = if extra.contains(&"bf16") { 2e-3 } else { 2e-5 };
            assert!((va - vb).abs() <= tol * va.abs(), "{extra:?} {ka}: one process {va}, {ranks} ranks {vb}");
        }
        // Rank 0 alone printed and saved.
        assert_eq!(out.matches("── summary").count(), 1, "{out}");
        assert!(out.contains(&format!("ranks        {ranks} ")), "{out}");
        // What a step averages: every gradient (and the loss), the parameters' f32 bytes.
        let mib_after = |label: &str| -> String {
            let at = out.find(label).unwrap_or_else(|| panic!("no `{label}` in {out}")) + label.len();
            out[at..].split_whitespace().next().unwrap().to_string()
        };
        assert_eq!(mib_after("each step averages "), mib_after("x the "), "{out}");
        // Every rank's step time, gathered at rank 0, and how long the collectives held the step.
        assert!(out.contains("per rank     rank 0 ") && out.contains(&format!(" · rank {} ", ranks - 1)), "{out}");
        assert!(out.contains("comm         collectives ") && out.contains(" exposed ("), "{out}");
        assert!(save.join("model.bin").is_file() && save.join("state.bin").is_file());
    }
}

#[test]
fn one_cpu_rank_is_bit_identical_to_a_plain_run() {
    one_rank_is_bit_identical("cpu");
}

#[test]
fn two_cpu_ranks_train_like_one_process_of_the_global_batch() {
    ranks_train_like_one_process_of_the_global_batch("cpu", 2);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn one_cuda_rank_is_bit_identical_to_a_plain_run() {
    one_rank_is_bit_identical("cuda");
}

#[test]
#[ignore = "needs 2 NVIDIA GPUs and NCCL"]
fn two_cuda_ranks_train_like_one_gpu_of_the_global_batch() {
    ranks_train_like_one_process_of_the_global_batch("cuda", 2);
}

#[test]
fn zero_1_trains_exactly_like_zero_0_with_less_state_per_rank() {
    let d = TempDir::new("ranks-zero");
    for extra in [&[][..], &["--precision", "bf16"], &["--grad-accum", "2", "--grad-clip", "0.5"]] {
        let (z0, z1) = (d.join("z0.jsonl"), d.join("z1.jsonl"));
        let base = [extra, &["--batch", "2", "--ranks", "2"]].concat();
        let out0 = train("cpu", &z0, &[&base[..], &["--zero", "0"]].concat());
        let out1 = train("cpu", &z1, &[&base[..], &["--zero", "1", "--save", d.join("m.bin").to_str().unwrap()]].concat());
        // Each owner applies the update every rank applied before: the same bits.
        assert_eq!(losses(&z0), losses(&z1), "{extra:?}");
        assert!(out1.contains("ZeRO-1: AdamW state of ") && !out0.contains("ZeRO-1"), "{out1}");
        let persistent = |out: &str| -> f64 {
            let at = out.find("persistent ").unwrap() + "persistent ".len();
            out[at..].split_whitespace().next().unwrap().parse().unwrap()
        };
        assert!(persistent(&out1) < persistent(&out0), "{out0}\n{out1}");
        assert!(d.join("m.bin").is_file());
    }
    // `dump` shows a rank's share of the AdamW state.
    let adam_m = |extra: &[&str]| -> u64 {
        let o = fusec(&[&["dump", &tiny(), "--pass", "memplan"][..], extra].concat(), &[]);
        let out = text(&o.stdout);
        let line = out.lines().find(|l| l.starts_with("#   adam_m")).unwrap_or_else(|| panic!("{out}{}", text(&o.stderr)));
        line.split_whitespace().nth(5).unwrap().parse().unwrap()
    };
    let (whole, r0, r1) = (adam_m(&[]), adam_m(&["--zero-shard", "0/2"]), adam_m(&["--zero-shard", "1/2"]));
    assert!(r0 < whole && r1 < whole && r0 + r1 >= whole, "{whole} {r0} {r1}");
    let o = fusec(&["dump", &tiny(), "--zero-shard", "2/2"], &[]);
    assert!(text(&o.stderr).contains("RANK below it"), "{}", text(&o.stderr));
    let o = fusec(&["run", &tiny(), "--zero", "1"], &[]);
    assert!(text(&o.stderr).contains("--zero 1 shards the AdamW state across the ranks"), "{}", text(&o.stderr));
}

#[test]
fn zero_1_checkpoints_are_those_of_zero_0_and_resume_either_way() {
    let d = TempDir::new("ranks-zero-ckpt");
    let g = tiny();
    let run = |log: &str, extra: &[&str]| {
        let mut args = vec!["run", &g, "--seq", "32", "--batch", "2", "--ranks", "2", "--val-every", "3"];
        let log = d.join(log);
        args.extend(["--log-json", log.to_str().unwrap()]);
        args.extend(extra);
        let o = fusec(&args, &[]);
        assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
        losses(&log).into_iter().filter(|(k, _)| k.starts_with("loss@")).collect::<Vec<_>>()
    };
    let (s0, s1) = (d.join("s0"), d.join("s1"));
    let whole = run("whole.jsonl", &["--steps", "6"]);
    run("a.jsonl", &["--steps", "3", "--zero", "0", "--save", s0.to_str().unwrap()]);
    run("b.jsonl", &["--steps", "3", "--zero", "1", "--save", s1.to_str().unwrap()]);
    // Rank 0 gathered the moments the other rank held: the same files, byte for byte.
    for f in ["model.bin", "state.bin"] {
        assert!(std::fs::read(s0.join(f)).unwrap() == std::fs::read(s1.join(f)).unwrap(), "{f} differs");
    }
    // Either checkpoint resumes with either setting, exactly.
    for (ckpt, zero) in [(&s1, "1"), (&s1, "0"), (&s0, "1")] {
        let tail = run("tail.jsonl", &["--steps", "6", "--zero", zero, "--resume", ckpt.to_str().unwrap()]);
        assert_eq!(whole[3..], tail[..], "resume {} with --zero {zero}", ckpt.display());
    }
}

#[test]
fn two_ranks_resume_exactly_and_keep_their_rank_count() {
    let d = TempDir::new("ranks-resume");
    let g = tiny();
    let run = |log: &Path, extra: &[&str]| {
        let mut args = vec!["run", &g, "--seq", "32", "--batch", "2", "--ranks", "2", "--val-every", "3", "--log-json", log.to_str().unwrap()];
        args.extend(extra);
        let o = fusec(&args, &[]);
        assert!(o.status.success(), "{args:?}: {}", text(&o.stderr));
    };
    // 6 steps in one run, and 3 + save + resume + 3.
    let (whole, mid, tail) = (d.join("whole.jsonl"), d.join("mid"), d.join("tail.jsonl"));
    run(&whole, &["--steps", "6"]);
    run(&d.join("x.jsonl"), &["--steps", "3", "--save", mid.to_str().unwrap()]);
    run(&tail, &["--steps", "6", "--resume", mid.to_str().unwrap()]);
    let steps = |p: &Path| losses(p).into_iter().filter(|(k, _)| k.starts_with("loss@")).collect::<Vec<_>>();
    assert_eq!(steps(&whole)[3..], steps(&tail)[..], "steps 4..6 after a resume at 3");
    let o = fusec(&["run", &g, "--seq", "32", "--batch", "2", "--steps", "6", "--resume", mid.to_str().unwrap()], &[]);
    assert!(text(&o.stderr).contains("--ranks 1 differs from the saved run's --ranks 2"), "{}", text(&o.stderr));
}

#[test]
fn a_rank_that_never_comes_is_named_within_the_timeout() {
    let t0 = Instant::now();
    let o = fusec(&["run", &tiny(), "--steps", "3", "--rank-timeout", "1"], &torchrun(0, 2, free_port()));
    stopped_soon_with(&text(&o.stderr), o.status.code(), t0, "rank 1 never arrived");
}

/// A run that stopped with exit code 2, `want` in its error, within 20 s of `t0`.
fn stopped_soon_with(err: &str, code: Option<i32>, t0: Instant, want: &str) {
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains(want), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}

#[test]
fn a_rank_that_dies_mid_run_stops_the_others_with_its_name() {
    let port = free_port();
    let g = tiny();
    let args = ["run", &g, "--steps", "1000000", "--batch", "1", "--seq", "16", "--rank-timeout", "30"];
    let mut root = command(&args, &torchrun(0, 2, port)).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let mut peer = command(&args, &torchrun(1, 2, port)).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    // Rank 0's first step line: both ranks are training. Then rank 1 is killed.
    let mut lines = BufReader::new(root.stderr.take().unwrap()).lines().map_while(Result::ok);
    let mut err: Vec<String> = lines.by_ref().take_while(|l| !l.starts_with("step")).collect();
    peer.kill().unwrap();
    peer.wait().unwrap();
    let t0 = Instant::now();
    err.extend(lines);
    let code = root.wait().unwrap().code();
    stopped_soon_with(&err.join("\n"), code, t0, "rank 1 closed its connection");
}

#[test]
fn a_rank_that_hangs_mid_run_stops_the_run_within_the_timeout() {
    let g = tiny();
    let args = ["run", &g, "--steps", "1000000", "--batch", "1", "--seq", "16", "--rank-timeout", "2"];
    // Alone (no collective to time out: what NCCL is like), the rank's watchdog stops it.
    let t0 = Instant::now();
    let mut env = torchrun(0, 1, free_port());
    env.push(("FUSEC_TEST_STALL", "0:2".into()));
    let o = fusec(&args, &env);
    stopped_soon_with(&text(&o.stderr), o.status.code(), t0, "rank 0: no training step finished for 2 s");
    // Two ranks under the launcher, rank 1 stalled: the run stops, naming a rank.
    let t0 = Instant::now();
    let o = fusec(&[&args[..], &["--ranks", "2"]].concat(), &[("FUSEC_TEST_STALL", "1:3".into())]);
    stopped_soon_with(&text(&o.stderr), o.status.code(), t0, "hangs");
    assert!(text(&o.stderr).contains("the other ranks were stopped"), "{}", text(&o.stderr));
}

#[test]
fn the_launcher_names_the_rank_that_failed() {
    // Every rank fails on a missing token file only after the launcher started it: the error
    // names a rank and says the others were stopped.
    let d = TempDir::new("ranks-launcher");
    let bad = d.join("bad.bin");
    std::fs::write(&bad, [0u8; 64]).unwrap();
    let o = fusec(&["run", &tiny(), "--steps", "2", "--ranks", "2", "--data", bad.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o.stderr);
    assert!(err.contains("exited with code 2; the other ranks were stopped"), "{err}");
    assert!(err.contains("truncated header"), "the rank's own error is shown: {err}");
}

#[test]
fn bad_combinations_are_refused_before_any_rank_starts() {
    let g = tiny();
    let o = fusec(&["run", &g, "--target", "ref", "--ranks", "2"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("--ranks needs --target cpu or --target cuda"), "{}", text(&o.stderr));
    let o = fusec(&["run", &g, "--ranks", "2", "--no-comm-overlap"], &[]);
    assert!(text(&o.stderr).contains("--no-comm-overlap applies to --target cuda only"), "{}", text(&o.stderr));
    let o = fusec(&["run", &g, "--ranks", "0"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("1..=64"), "{}", text(&o.stderr));
    let o = fusec(&["run", &g, "--ranks", "3"], &torchrun(0, 2, free_port()));
    assert!(text(&o.stderr).contains("--ranks 3 but WORLD_SIZE=2"), "{}", text(&o.stderr));
    let o = fusec(&["run", &g, "--target", "ref"], &torchrun(0, 1, free_port()));
    assert!(text(&o.stderr).contains("data-parallel runs need --target cpu"), "{}", text(&o.stderr));
    let mut half = torchrun(0, 2, 1);
    half.truncate(2);
    let o = fusec(&["run", &g], &half);
    assert!(text(&o.stderr).contains("LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing"), "{}", text(&o.stderr));
}
