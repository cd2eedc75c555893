//! Bad input through the `fusec` binary: every case found by a fresh-clone trial gets a clear
//! error (exit 2, naming the flag or `file:line:col`) or the right behaviour, never a panic,
//! an abort or a hang; and a fuzz of `run` flag values.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt2-tiny.graph");

fn fusec(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fusec")).args(args).stdin(Stdio::null()).output().unwrap()
}

fn tmp(name: &str) -> PathBuf {
    fusec_ir::testkit::process_dir("bad").join(name)
}

/// Runs `fusec run TINY --steps N ARGS` and returns (exit code, stdout, stderr).
fn run_tiny(steps: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let mut all = vec!["run", TINY, "--steps", steps];
    all.extend_from_slice(args);
    let o = fusec(&all);
    (o.status.code(), String::from_utf8_lossy(&o.stdout).into(), String::from_utf8_lossy(&o.stderr).into())
}

/// Asserts exit 2, no panic, and every `needle` in standard error.
fn refused(args: &[&str], needles: &[&str]) {
    let (code, _, err) = run_tiny("3", args);
    assert_eq!(code, Some(2), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: expected `{n}` in: {err}");
    }
}

#[test]
fn hyper_parameters_out_of_range_name_the_flag() {
    refused(&["--weight-decay", "nan"], &["--weight-decay", "finite"]);
    refused(&["--weight-decay", "-1"], &["--weight-decay", "at least 0"]);
    refused(&["--lr", "-1"], &["--lr", "at least 0"]);
    refused(&["--grad-clip", "-1"], &["--grad-clip", "above 0"]);
    refused(&["--temperature", "-1"], &["--temperature"]);
    refused(&["--temperature", "nan"], &["--temperature", "finite"]);
    refused(&["--threads", "0"], &["--threads", "1..=1024"]);
    refused(&["--val-batches", "0"], &["--val-batches", "1..="]);
    refused(&["--batch", "0"], &["--batch", "1..="]);
    refused(&["--divergence-factor", "0.5"], &["--divergence-factor", "above 1"]);
}

#[test]
fn schedule_and_checkpoint_flags_out_of_range_name_the_flag() {
    refused(&["--lr-decay-to", "1.5"], &["--lr-decay-to 1.5", "at least 0 and at most 1"]);
    refused(&["--lr-decay-to", "-0.1"], &["--lr-decay-to", "at least 0"]);
    refused(&["--lr-decay-to", "nan"], &["--lr-decay-to", "finite"]);
    refused(&["--warmup-steps", "-1"], &["--warmup-steps"]);
    refused(&["--warmup-steps", "4294967296"], &["--warmup-steps", "0..="]);
    refused(&["--save-every", "0"], &["--save-every", "1..="]);
    refused(&["--save-every", "2"], &["--save-every needs --save"]);
    let file = tmp("not-a-folder");
    std::fs::write(&file, b"x").unwrap();
    refused(&["--save", file.to_str().unwrap()], &["--save", "is a file, not a folder", ".bin"]);
    refused(&["--save", "/nonexistent/ckpt"], &["--save", "does not exist"]);
    refused(&["--resume", "/nonexistent/ckpt"], &["/nonexistent/ckpt: does not exist", "--resume takes the checkpoint folder"]);
    refused(&["--resume", std::env::temp_dir().to_str().unwrap()], &["no checkpoint to resume from"]);
    refused(&["--resume", "/tmp", "--init", TINY], &["--resume restores the parameters", "leave out --init"]);
}

#[test]
fn sizes_that_would_run_forever_or_overflow_are_refused() {
    refused(&["--grad-accum", "4611686018427387904"], &["--grad-accum", "1..=4096"]);
    refused(&["--val-batches", "1000000000"], &["--val-batches"]);
    // Up front, not after training: no checkpoint is half-promised.
    let save = tmp("never.bin");
    refused(&["--sample", "4611686018427387904", "--save", save.to_str().unwrap()], &["--sample", "0..=65536"]);
    assert!(!save.exists());
    // More validation batches than the validation data holds.
    refused(&["--batch", "64", "--seq", "64", "--val-batches", "100"], &["--val-batches 100 exceeds the"]);
}

#[test]
fn flags_that_the_target_does_not_read_are_refused() {
    for flag in ["--no-tf32", "--no-flash-attention", "--no-cublaslt", "--no-cuda-graph", "--no-gemm-tuning", "--timings"] {
        refused(&[flag], &[flag, "--target cuda only"]);
    }
    refused(&["--target", "ref", "--profile"], &["--profile", "--target cpu"]);
}

#[test]
fn missing_inputs_and_unwritable_outputs_fail_before_training() {
    refused(&["--val", "/nonexistent/val.bin"], &["--val needs --data"]);
    let data = tmp("missing_train.bin");
    refused(&["--data", data.to_str().unwrap()], &["--data", "no such file"]);
    let t0 = Instant::now();
    refused(&["--save", "/nonexistent/x.bin"], &["--save", "/nonexistent", "does not exist"]);
    let dir = std::env::temp_dir();
    refused(&["--profile-json", dir.to_str().unwrap()], &["--profile-json", "is a directory"]);
    refused(&["--log-json", dir.to_str().unwrap()], &["--log-json", "is a directory"]);
    assert!(t0.elapsed() < Duration::from_secs(20), "refused only after training");
}

#[test]
fn divergence_stops_with_the_right_step() {
    let (code, _, err) = run_tiny("30", &["--lr", "1e6"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("training diverged") && err.contains("at step 2") && err.contains("10x the first step"), "{err}");
    // The step that printed a finite loss is not the step that diverged.
    let (code, _, err) = run_tiny("5", &["--lr", "1e20"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("step     1/5: loss 5.5"), "{err}");
    assert!(err.contains("loss is NaN at step 2"), "{err}");
    // Off with a flag: the run goes on (and ends with a finite or non-finite loss, not a panic).
    let (code, _, err) = run_tiny("3", &["--lr", "10", "--no-divergence-check"]);
    assert!(!err.contains("panicked") && matches!(code, Some(0) | Some(2)), "{err}");
}

#[test]
fn closed_stdout_ends_the_run_cleanly_after_saving() {
    let save = tmp("y.bin");
    let _ = std::fs::remove_file(&save);
    let mut child = Command::new(env!("CARGO_BIN_EXE_fusec"))
        .args(["run", TINY, "--steps", "3", "--save", save.to_str().unwrap(), "--sample", "20"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read one line of standard output (the summary's first), then close it, like `| head -1`.
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(save.exists(), "the checkpoint was lost: {err}");
    for args in [vec!["export", "gpt2", "--preset", "tiny"], vec!["dump", TINY, "--pass", "fuse"]] {
        let mut child =
            Command::new(env!("CARGO_BIN_EXE_fusec")).args(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        drop(child.stdout.take());
        let mut err = String::new();
        child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        let status = child.wait().unwrap();
        assert!(!err.contains("panicked") && status.code() == Some(0), "{args:?}: {status} {err}");
    }
}

#[test]
fn configs_that_cannot_be_allocated_are_refused() {
    let o = fusec(&["export", "gpt2", "--layers", "1", "--heads", "1", "--channels", "10000000", "--vocab", "100", "--max-seq", "8"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("channels 10000000 is absurdly large"), "{err}");
    // The same sizes written into a graph by hand (the builder would refuse them).
    let g = tmp("huge.graph");
    let text = std::fs::read_to_string(TINY).unwrap().replace("f32[256, 64]", "f32[256, 10000000]");
    std::fs::write(&g, text).unwrap();
    let o = fusec(&["run", g.to_str().unwrap(), "--steps", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_plan_larger_than_memory_is_refused_before_initialization() {
    let g = tmp("d48.graph");
    assert!(fusec(&["export", "gpt2", "--preset", "d48", "-o", g.to_str().unwrap()]).status.success());
    let t0 = Instant::now();
    let o = fusec(&["run", g.to_str().unwrap(), "--batch", "64", "--seq", "1024", "--steps", "1", "--val-batches", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("the memory plan needs") && err.contains("available"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
}

#[test]
fn a_checkpoint_of_another_config_is_refused() {
    // Same tensor shapes, different num_heads: shapes alone would accept it.
    let ck = tmp("heads.bin");
    let mut bytes = fusec_ckpt_bytes();
    bytes[5 * 4..6 * 4].copy_from_slice(&4i32.to_le_bytes());
    std::fs::write(&ck, bytes).unwrap();
    refused(&["--init", ck.to_str().unwrap()], &["does not fit the graph", "num_heads 4 in the checkpoint, 2 in the graph"]);
}

/// A checkpoint of the tiny model, written by `fusec run --steps 1 --save`.
fn fusec_ckpt_bytes() -> Vec<u8> {
    let p = tmp("tiny.bin");
    let (code, _, err) = run_tiny("1", &["--save", p.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    std::fs::read(p).unwrap()
}

#[test]
fn fuzzed_run_flags_never_panic() {
    // Random values (huge, negative, NaN, zero, garbage) for each flag of `run --steps 1`: every
    // run exits 0 or 2 without a panic, within a bound.
    let flags = [
        "--batch",
        "--seq",
        "--lr",
        "--weight-decay",
        "--grad-accum",
        "--grad-clip",
        "--val-every",
        "--val-batches",
        "--threads",
        "--sample",
        "--temperature",
        "--seed",
        "--divergence-factor",
        "--warmup-steps",
        "--lr-decay-to",
    ];
    let values = ["0", "1", "-1", "nan", "inf", "-inf", "1e38", "4611686018427387904", "18446744073709551616", "0.5", "abc", "", "3"];
    let mut state = 0x2545f4914f6cdd1du64;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let t0 = Instant::now();
    let mut runs = 0;
    while runs < 60 && t0.elapsed() < Duration::from_secs(40) {
        let (f, v) = (flags[next(flags.len())], values[next(values.len())]);
        let (g, w) = (flags[next(flags.len())], values[next(values.len())]);
        let arg1 = format!("{f}={v}");
        let arg2 = format!("{g}={w}");
        let (code, _, err) = run_tiny("1", &[&arg1, &arg2, "--val-every", "1000"]);
        assert!(!err.contains("panicked") && matches!(code, Some(0) | Some(2)), "{arg1} {arg2}: exit {code:?}: {err}");
        runs += 1;
    }
    assert!(runs >= 10, "only {runs} runs in the time bound");
}

#[test]
fn graph_files_that_used_to_panic_or_abort() {
    // Two parameters of one name: refused at parse time with both lines.
    let dup = tmp("dup.graph");
    std::fs::write(&dup, std::fs::read_to_string(TINY).unwrap().replace("%1 = param \"wpe\"", "%1 = param \"wte\"")).unwrap();
    let o = fusec(&["dump", dup.to_str().unwrap(), "--pass", "memplan"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(&format!("{}:3:14: parameter \"wte\" is declared twice (first at line 2)", dup.display())), "{err}");
    // A graph whose `wte` is a vector: not a GPT-2 graph, said before anything runs.
    let w = tmp("wte.graph");
    let text =
        std::fs::read_to_string(TINY).unwrap().replace("param \"wte\"", "param \"wtx\"").replace("param \"ln1w.0\"", "param \"wte\"");
    std::fs::write(&w, text).unwrap();
    let o = fusec(&["run", w.to_str().unwrap(), "--steps", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("parameter `wte` has shape [64]"), "{err}");
    // A chain of 200,000 nodes goes through every pass (no recursion per node).
    let chain = tmp("chain.graph");
    let mut text = String::from("graph chain(B) {\n  %0 = input \"x\" : f32[B, 4]\n");
    for i in 1..=200_000 {
        text += &format!("  %{i} = tanh %{} : f32[B, 4]\n", i - 1);
    }
    text += "  output \"y\" = %200000\n}\n";
    std::fs::write(&chain, text).unwrap();
    let o = fusec(&["dump", chain.to_str().unwrap(), "--pass", "schedule", "--program", "forward"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    // Sizes that overflow 64 bits are an error, not a wrapped-around plan.
    let o = fusec(&["dump", TINY, "--pass", "memplan", "--batch", "9223372036854775808"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--batch"));
    let big = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt2-124m.graph");
    let o = fusec(&["dump", big, "--pass", "memplan", "--batch", "16777216", "--seq", "16777216"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("more than 2^64 bytes") && !err.contains("panicked"), "{err}");
}

#[test]
fn nccl_check_without_a_gpu_or_with_bad_flags_is_a_clear_error() {
    for (args, want) in [(vec!["nccl-check", "--mib", "0"], "--mib"), (vec!["nccl-check", "--iters", "5000"], "--iters")] {
        let o = Command::new(env!("CARGO_BIN_EXE_fusec")).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
    }
    // On a machine without a GPU (CI) the check says what is missing; with one, it passes.
    let o = Command::new(env!("CARGO_BIN_EXE_fusec")).args(["nccl-check", "--mib", "1", "--iters", "1"]).output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(!err.contains("panicked"), "{err}");
    match o.status.code() {
        Some(0) => assert!(out.contains("correct on every rank"), "{out}"),
        code => assert!(code == Some(2) && err.starts_with("error: "), "{code:?}: {err}"),
    }
}
