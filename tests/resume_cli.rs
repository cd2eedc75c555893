//! Exact resume and checkpoints that are never torn, through the `fusec` binary: *k steps +
//! save + resume + (N − k) steps* gives the losses, validation losses, learning rates, model and
//! state bytes of *N steps* in one run (CPU and interpreter here; CUDA with `--ignored` on a
//! GPU); a run killed at any moment of a save — at fixed points through `FUSEC_TEST_KILL_AT`,
//! and by SIGKILL at random times — leaves a checkpoint that `--resume` continues from to the
//! same bytes; mismatched, torn and foreign checkpoints are refused; a full disk keeps the last
//! good checkpoint.
//!
//! `FUSEC_BIN` may name the binary to test (the device runs a prebuilt one).

mod common;

use common::{assert_refused, bin, tiny};
use fusec_ir::testkit::TempDir;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn fusec(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(bin());
    c.args(args).stdin(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A fresh folder for one test.
fn scratch(name: &str) -> TempDir {
    TempDir::new(&format!("resume-{name}"))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `fusec run TINY ARGS`, asserting success.
fn ok(args: &[&str], env: &[(&str, &str)]) -> Output {
    let tiny = tiny();
    let o = fusec(&[&["run", tiny.as_str()], args].concat(), env);
    assert!(o.status.success(), "{args:?} {env:?}: {}", text(&o.stderr));
    o
}

/// The JSON log without the step times (which differ between runs).
fn log_without_ms(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("ms");
            v.to_string()
        })
        .collect()
}

fn assert_same_files(a: &Path, b: &Path, what: &str) {
    for f in ["model.bin", "state.bin"] {
        let (x, y) = (std::fs::read(a.join(f)).unwrap(), std::fs::read(b.join(f)).unwrap());
        assert!(x == y, "{what}: {f} differs between {} and {}", a.display(), b.display());
    }
}

/// The training flags of the resume tests: accumulation, the schedule, clipping, decay and
/// validation all on.
fn flags<'a>(target: &'a str, precision: &'a str, steps: &'a str) -> Vec<&'a str> {
    vec![
        "--target",
        target,
        "--precision",
        precision,
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        steps,
        "--grad-accum",
        "2",
        "--warmup-steps",
        "2",
        "--lr-decay-to",
        "0.1",
        "--grad-clip",
        "1.0",
        "--weight-decay",
        "0.01",
        "--val-every",
        "3",
        "--val-batches",
        "1",
    ]
}

/// One run of 8 steps, and the same run killed right after its save at step 3 and resumed:
/// every loss, validation loss and learning rate, and the bytes of model.bin and state.bin.
fn resumed_equals_one_run(target: &str, precision: &str) {
    let d = scratch(&format!("{target}-{}", precision.replace('+', "_")));
    let (one, two) = (d.join("one"), d.join("two"));
    let (log1, log2) = (d.join("one.jsonl"), d.join("two.jsonl"));
    let f = flags(target, precision, "8");
    ok(&[&f[..], &["--save", s(&one), "--log-json", s(&log1)]].concat(), &[]);
    let tiny = tiny();
    let first = [&["run", tiny.as_str()], &f[..], &["--save", s(&two), "--save-every", "3", "--log-json", s(&log2)]].concat();
    let o = fusec(&first, &[("FUSEC_TEST_KILL_AT", "saved:3")]);
    assert_eq!(o.status.code(), Some(137), "the run was to stop after saving step 3: {}", text(&o.stderr));
    assert_eq!(log_without_ms(&log2).len(), 3);
    let o = ok(&[&f[..], &["--resume", s(&two), "--save", s(&two), "--log-json", s(&log2)]].concat(), &[]);
    assert!(text(&o.stderr).contains("at step 3"), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("over 5 steps") && text(&o.stdout).contains("steps 4..=8 resumed from"), "{}", text(&o.stdout));
    let (a, b) = (log_without_ms(&log1), log_without_ms(&log2));
    assert_eq!(a.len(), 8 + 1, "8 steps and the final validation: {a:?}");
    assert_eq!(a, b, "{target} {precision}: the resumed run's log differs");
    assert!(a[0].contains("\"lr\":0.0005") && a[1].contains("\"lr\":0.001"), "warmup: {a:?}");
    assert!(a[8].contains("\"step\":8") && a[8].contains("val_loss"), "{a:?}");
    assert_same_files(&one, &two, &format!("{target} {precision}"));
}

#[test]
fn resume_on_the_cpu_target_is_bit_identical() {
    resumed_equals_one_run("cpu", "fp32");
}

#[test]
fn resume_on_the_interpreter_is_bit_identical_in_fp32_and_bf16() {
    resumed_equals_one_run("ref", "fp32");
    resumed_equals_one_run("ref", "bf16");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn resume_on_cuda_is_bit_identical_in_fp32_and_bf16() {
    resumed_equals_one_run("cuda", "fp32");
    resumed_equals_one_run("cuda", "bf16");
}

#[test]
fn a_shorter_run_continued_with_more_steps_equals_one_run_at_a_constant_lr() {
    // Without a decaying schedule the total number of steps changes nothing before the end.
    let d = scratch("extend");
    let (one, two) = (d.join("one"), d.join("two"));
    let (log1, log2) = (d.join("one.jsonl"), d.join("two.jsonl"));
    let base = ["--batch", "2", "--seq", "16", "--grad-accum", "2", "--val-every", "2", "--val-batches", "1"];
    ok(&[&base[..], &["--steps", "6", "--save", s(&one), "--log-json", s(&log1)]].concat(), &[]);
    ok(&[&base[..], &["--steps", "4", "--save", s(&two), "--log-json", s(&log2)]].concat(), &[]);
    ok(&[&base[..], &["--steps", "6", "--resume", s(&two), "--save", s(&two), "--log-json", s(&log2)]].concat(), &[]);
    // The first part's final validation (after step 4) was dropped from the log: step 4 is
    // validated again before it runs.
    assert_eq!(log_without_ms(&log1), log_without_ms(&log2));
    assert_same_files(&one, &two, "extended");
}

/// The reference for the kill tests: 8 steps, saved at the end.
fn reference(d: &Path, extra: &[&str]) -> PathBuf {
    let r = d.join("reference");
    ok(&[&["--batch", "2", "--seq", "16", "--steps", "8", "--save", s(&r)], extra].concat(), &[]);
    r
}

#[test]
fn a_run_killed_at_each_point_of_a_save_resumes_from_what_it_left() {
    let d = scratch("kill");
    let r = reference(&d, &[]);
    // (phase, the step the checkpoint left is at)
    for (phase, left) in [("model", 2), ("state", 2), ("commit", 4), ("saved", 4)] {
        let dir = d.join(phase);
        let args = ["--batch", "2", "--seq", "16", "--steps", "8", "--save-every", "2", "--save", s(&dir)];
        let tiny = tiny();
        let o = fusec(&[&["run", tiny.as_str()], &args[..]].concat(), &[("FUSEC_TEST_KILL_AT", &format!("{phase}:4"))]);
        assert_eq!(o.status.code(), Some(137), "{phase}: {}", text(&o.stderr));
        let tmp = |f: &str| dir.join(format!("{f}.tmp")).exists();
        match phase {
            "model" => assert!(tmp("model.bin") && !tmp("state.bin")),
            "state" => assert!(tmp("model.bin") && tmp("state.bin")),
            "commit" => assert!(!tmp("model.bin") && tmp("state.bin")),
            _ => assert!(!tmp("model.bin") && !tmp("state.bin")),
        }
        let o = ok(&["--batch", "2", "--seq", "16", "--steps", "8", "--resume", s(&dir), "--save", s(&dir)], &[]);
        assert!(text(&o.stderr).contains(&format!("at step {left}")), "{phase}: {}", text(&o.stderr));
        assert_same_files(&r, &dir, phase);
        assert!(!tmp("model.bin") && !tmp("state.bin"), "{phase}: temporary files left after the next save");
    }
}

#[test]
fn a_run_killed_between_the_renames_of_its_last_save_is_done_not_resumed() {
    // Killed after the final save's model.bin was renamed, before its state.bin was: the
    // checkpoint is the complete step-8 pair (state.bin.tmp), although state.bin still says
    // step 7. Resuming with --steps 8 must refuse (nothing left to train), never panic.
    let d = scratch("last-commit");
    let dir = d.join("run");
    let args = ["--batch", "2", "--seq", "16", "--steps", "8", "--save-every", "1", "--save", s(&dir)];
    let tiny = tiny();
    let o = fusec(&[&["run", tiny.as_str()], &args[..]].concat(), &[("FUSEC_TEST_KILL_AT", "commit:8")]);
    assert_eq!(o.status.code(), Some(137), "{}", text(&o.stderr));
    let o = fusec(&["run", tiny.as_str(), "--batch", "2", "--seq", "16", "--steps", "8", "--resume", s(&dir)], &[]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("at step 8 already") && !err.contains("panicked"), "{err}");
    // One step more continues from the complete step-8 pair.
    let o = fusec(&["run", tiny.as_str(), "--batch", "2", "--seq", "16", "--steps", "9", "--resume", s(&dir)], &[]);
    assert!(o.status.success() && text(&o.stderr).contains("at step 8"), "{}", text(&o.stderr));
}

#[test]
fn sigkill_at_random_moments_never_leaves_an_unusable_checkpoint() {
    let d = scratch("sigkill");
    let r = reference(&d, &[]);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut resumed = 0;
    for i in 0..6 {
        let dir = d.join(format!("run{i}"));
        let args = ["--batch", "2", "--seq", "16", "--steps", "8", "--save-every", "1", "--save", s(&dir)];
        let tiny = tiny();
        let mut child = Command::new(bin())
            .args([&["run", tiny.as_str()], &args[..]].concat())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        std::thread::sleep(Duration::from_millis(20 + state % 200));
        let _ = child.kill();
        let _ = child.wait();
        let o = fusec(&["run", tiny.as_str(), "--batch", "2", "--seq", "16", "--steps", "8", "--resume", s(&dir), "--save", s(&dir)], &[]);
        if o.status.success() {
            assert_same_files(&r, &dir, &format!("kill {i}"));
            resumed += 1;
        } else {
            // Killed before its first save finished (or after the run ended: then --steps 8 is done).
            let err = text(&o.stderr);
            assert!(
                ["no checkpoint to resume from", "does not exist", "at step 8 already"].iter().any(|m| err.contains(m)),
                "kill {i}: {err}"
            );
        }
    }
    eprintln!("{resumed} of 6 killed runs resumed from a checkpoint");
}

#[test]
fn mismatched_torn_and_foreign_checkpoints_are_refused() {
    let d = scratch("refused");
    let tiny = tiny();
    // B=2, T=16 unless the arguments say otherwise.
    let run = |args: &[&str]| {
        let mut all = vec!["run", tiny.as_str()];
        for (flag, v) in [("--batch", "2"), ("--seq", "16")] {
            if !args.contains(&flag) {
                all.extend([flag, v]);
            }
        }
        fusec(&[&all[..], args].concat(), &[])
    };
    let refused = |args: &[&str], needles: &[&str]| assert_refused(&run(args), args, needles);
    let (a, b) = (d.join("a"), d.join("b"));
    assert!(run(&["--steps", "2", "--save", s(&a)]).status.success());
    assert!(run(&["--steps", "2", "--save", s(&b), "--seed", "7"]).status.success());
    // Settings a resumed run must keep, and a run already at its end.
    refused(&["--steps", "4", "--resume", s(&a), "--batch", "4"], &["--batch 4 differs from the saved run's --batch 2"]);
    refused(&["--steps", "4", "--resume", s(&a), "--seq", "8"], &["--seq 8 differs"]);
    refused(&["--steps", "4", "--resume", s(&a), "--grad-accum", "2"], &["--grad-accum 2 differs"]);
    refused(&["--steps", "4", "--resume", s(&a), "--target", "ref", "--precision", "bf16"], &["--precision bf16 differs"]);
    refused(&["--steps", "2", "--resume", s(&a)], &["at step 2 already", "give more than 2"]);
    let other = d.join("other.graph");
    let args = ["export", "gpt2", "--layers", "1", "--heads", "2", "--channels", "16", "--vocab", "50", "--max-seq", "16", "-o", s(&other)];
    assert!(fusec(&args, &[]).status.success());
    let o = fusec(&["run", s(&other), "--batch", "2", "--seq", "16", "--steps", "4", "--resume", s(&a)], &[]);
    assert!(
        text(&o.stderr).contains("another model") && text(&o.stderr).contains("num_layers 2 there, 1 in this graph"),
        "{}",
        text(&o.stderr)
    );
    // Other settings may change, with a note.
    let c = d.join("c");
    std::fs::create_dir_all(&c).unwrap();
    for f in ["model.bin", "state.bin"] {
        std::fs::copy(a.join(f), c.join(f)).unwrap();
    }
    let o = run(&["--steps", "3", "--resume", s(&c), "--lr", "5e-4"]);
    assert!(o.status.success() && text(&o.stderr).contains("note: resuming with --lr 0.0005 (saved: 0.001)"), "{}", text(&o.stderr));
    // model.bin of another run beside this state.bin.
    std::fs::copy(b.join("model.bin"), c.join("model.bin")).unwrap();
    refused(&["--steps", "4", "--resume", s(&c)], &["model.bin (CRC-32", "a mismatched pair"]);
    // A torn state.bin, and a torn model.bin.
    std::fs::copy(a.join("model.bin"), c.join("model.bin")).unwrap();
    let state = std::fs::read(a.join("state.bin")).unwrap();
    std::fs::write(c.join("state.bin"), &state[..state.len() - 100]).unwrap();
    refused(&["--steps", "4", "--resume", s(&c)], &["state.bin", "truncated"]);
    std::fs::write(c.join("state.bin"), &state).unwrap();
    let model = std::fs::read(a.join("model.bin")).unwrap();
    std::fs::write(c.join("model.bin"), &model[..model.len() - 8]).unwrap();
    refused(&["--steps", "4", "--resume", s(&c)], &["model.bin", "truncated"]);
    // Not a checkpoint folder.
    refused(&["--steps", "4", "--resume", s(&d.join("nothing"))], &["does not exist", "--save DIR"]);
    refused(&["--steps", "4", "--resume", s(&d)], &["no checkpoint to resume from"]);
    refused(&["--steps", "4", "--resume", s(&a.join("model.bin"))], &["is not a folder"]);
}

#[test]
fn a_full_disk_keeps_the_last_checkpoint() {
    let d = scratch("full");
    let dir = d.join("ck");
    let tiny = tiny();
    let base = ["--batch", "2", "--seq", "16", "--save", s(&dir)];
    ok(&[&base[..], &["--steps", "2"]].concat(), &[]);
    let before = std::fs::read(dir.join("model.bin")).unwrap();
    // Files larger than 64 blocks cannot be written (write(2) fails with EFBIG, as it fails with
    // ENOSPC on a full disk); the signal that would kill the process instead is ignored.
    let cmd = "ulimit -f 64; trap '' XFSZ; exec \"$0\" \"$@\"";
    let o = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .arg(bin())
        .args([&["run", tiny.as_str(), "--steps", "4", "--resume", s(&dir)], &base[..]].concat())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("saving the checkpoint of step 4 failed") && err.contains("model.bin.tmp: cannot write"), "{err}");
    assert!(err.contains("size limit") && err.contains("the previous checkpoint in") && err.contains("is kept"), "{err}");
    assert_eq!(std::fs::read(dir.join("model.bin")).unwrap(), before, "the last good checkpoint changed");
    assert!(!dir.join("model.bin.tmp").exists(), "the partial file was left behind");
    let o = ok(&[&base[..], &["--steps", "4", "--resume", s(&dir)]].concat(), &[]);
    assert!(text(&o.stderr).contains("at step 2"), "{}", text(&o.stderr));
}

#[test]
fn a_save_to_a_bin_path_writes_the_llmc_checkpoint_alone() {
    let d = scratch("bin");
    let (file, dir) = (d.join("m.bin"), d.join("dir"));
    ok(&["--batch", "2", "--seq", "16", "--steps", "3", "--save", s(&file), "--save-every", "2"], &[]);
    ok(&["--batch", "2", "--seq", "16", "--steps", "3", "--save", s(&dir)], &[]);
    assert_eq!(std::fs::read(&file).unwrap(), std::fs::read(dir.join("model.bin")).unwrap());
    let names: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
}

#[test]
fn the_summary_accounts_for_the_wall_time_and_host_memory() {
    let o = ok(&["--batch", "2", "--seq", "16", "--steps", "6", "--val-every", "4", "--val-batches", "1"], &[]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(err.contains("validation after step 6: loss"), "{err}");
    assert!(err.contains("ETA"), "{err}");
    assert!(out.contains("(val ") && out.contains("after step 6)"), "{out}");
    let phases = out.lines().find(|l| l.starts_with("phases")).unwrap_or_else(|| panic!("no phases row: {out}"));
    let secs: Vec<f64> = phases.split(" s").filter_map(|p| p.rsplit(' ').next()?.parse().ok()).collect();
    assert_eq!(secs.len(), 8, "{phases}");
    let sum: f64 = secs[..7].iter().sum();
    assert!((sum - secs[7]).abs() <= 0.045, "the phases do not add up to the wall time: {phases}");
    assert!(out.lines().any(|l| l.starts_with("host memory") && l.contains("peak") && l.contains("resident")), "{out}");
}
