//! End-to-end tests of the `fusec` binary: help, exit codes and messages on bad input, export,
//! dump and a short training run on the interpreter.

use fusec_ir::testkit::TempDir;
use std::process::{Command, Output};

fn fusec(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fusec")).args(args).output().unwrap()
}


fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn every_command_has_help() {
    for args in [
        vec!["--help"],
        vec!["dump", "--help"],
        vec!["export", "--help"],
        vec!["run", "--help"],
        vec!["prepare", "--help"],
        vec!["plot", "--help"],
        vec!["import", "--help"],
        vec!["export-weights", "--help"],
        vec!["sample", "--help"],
        vec!["nccl-check", "--help"],
    ] {
        let o = fusec(&args);
        assert!(o.status.success(), "{args:?}");
        assert!(text(&o.stdout).contains("Usage"), "{args:?}");
    }
}

#[test]
fn malformed_graph_gets_file_line_col_and_exit_2() {
    let dir = TempDir::new("cli-malformed_graph_gets_file_line_col_and_exit_2");
    let p = dir.join("bad.graph");
    std::fs::write(&p, "graph g(B) {\n  %0 = param \"w\" : f32[4]\n  %1 = frobnicate %0 : f32[4]\n}\n").unwrap();
    let o = fusec(&["dump", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o.stderr);
    assert!(err.contains(&format!("{}:3:", p.display())), "{err}");
    assert!(err.contains("frobnicate"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn export_then_dump_is_canonical() {
    let dir = TempDir::new("cli-export_then_dump_is_canonical");
    let p = dir.join("tiny.graph");
    assert!(fusec(&["export", "gpt2", "--preset", "tiny", "-o", p.to_str().unwrap()]).status.success());
    let o = fusec(&["dump", p.to_str().unwrap(), "--pass", "parse"]);
    assert!(o.status.success());
    assert_eq!(text(&o.stdout), std::fs::read_to_string(&p).unwrap());
    let o = fusec(&["dump", p.to_str().unwrap(), "--pass", "optimizer"]);
    assert!(o.status.success());
    assert!(text(&o.stdout).contains("adamw"));
}

#[test]
fn export_rejects_bad_sizes() {
    let o = fusec(&["export", "gpt2", "--layers", "2", "--heads", "3", "--channels", "32", "--vocab", "100", "--max-seq", "16"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("divisible"), "{}", text(&o.stderr));
}

#[test]
fn train_on_the_interpreter_and_save_a_checkpoint() {
    let dir = TempDir::new("cli-train_on_the_interpreter_and_save_a_checkpoint");
    let graph = dir.join("small.graph");
    let data = dir.join("train.bin");
    let ckpt = dir.join("out.bin");
    let log = dir.join("log.jsonl");
    let args = ["export", "gpt2", "--layers", "1", "--heads", "2", "--channels", "16", "--vocab", "50", "--max-seq", "16", "-o"];
    assert!(fusec(&[&args[..], &[graph.to_str().unwrap()]].concat()).status.success());
    let toks: Vec<u16> = (0..500u32).map(|i| ((i * 7 + i / 3) % 50) as u16).collect();
    fusec_runtime::tokens::write_tokens(&data, &toks).unwrap();
    let o = fusec(&[
        "run",
        graph.to_str().unwrap(),
        "--target",
        "ref",
        "--data",
        data.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "8",
        "--steps",
        "3",
        "--lr",
        "1e-2",
        "--save",
        ckpt.to_str().unwrap(),
        "--log-json",
        log.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("over 3 steps"), "{}", text(&o.stdout));
    assert_eq!(std::fs::read_to_string(&log).unwrap().lines().count(), 3);
    // The saved checkpoint loads back as --init and evaluates.
    let o = fusec(&[
        "run",
        graph.to_str().unwrap(),
        "--init",
        ckpt.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "8",
        "--steps",
        "0",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("step 0: loss"));
}

#[test]
fn bad_checkpoint_and_token_files_are_named() {
    let dir = TempDir::new("cli-bad_checkpoint_and_token_files_are_named");
    let graph = dir.join("g2.graph");
    assert!(fusec(&["export", "gpt2", "--preset", "tiny", "-o", graph.to_str().unwrap()]).status.success());
    let bad = dir.join("garbage.bin");
    std::fs::write(&bad, vec![7u8; 2048]).unwrap();
    let o = fusec(&["run", graph.to_str().unwrap(), "--init", bad.to_str().unwrap(), "--data", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o.stderr);
    assert!(err.contains("garbage.bin") && err.contains("magic"), "{err}");
    let o = fusec(&["run", graph.to_str().unwrap(), "--data", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("magic"), "{}", text(&o.stderr));
}

#[test]
fn checkpoint_that_does_not_fit_the_graph_is_refused() {
    let dir = TempDir::new("cli-checkpoint_that_does_not_fit_the_graph_is_refused");
    let graph = dir.join("g3.graph");
    let other = dir.join("g4.graph");
    let ckpt = dir.join("other.bin");
    let data = dir.join("t3.bin");
    assert!(fusec(&["export", "gpt2", "--preset", "tiny", "-o", graph.to_str().unwrap()]).status.success());
    let args = ["export", "gpt2", "--layers", "1", "--heads", "2", "--channels", "16", "--vocab", "50", "--max-seq", "16", "-o"];
    assert!(fusec(&[&args[..], &[other.to_str().unwrap()]].concat()).status.success());
    fusec_runtime::tokens::write_tokens(&data, &[1u16; 300]).unwrap();
    let o = fusec(&[
        "run",
        other.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--batch",
        "1",
        "--seq",
        "4",
        "--steps",
        "1",
        "--save",
        ckpt.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = fusec(&["run", graph.to_str().unwrap(), "--init", ckpt.to_str().unwrap(), "--data", data.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("does not fit"), "{}", text(&o.stderr));
}

#[test]
fn cpu_target_trains_profiles_and_samples() {
    let dir = TempDir::new("cli-cpu_target_trains_profiles_and_samples");
    let json = dir.join("profile.json");
    let o = fusec(&[
        "run",
        "models/gpt2-tiny.graph",
        "--target",
        "cpu",
        "--steps",
        "12",
        "--profile",
        "--profile-json",
        json.to_str().unwrap(),
        "--sample",
        "5",
        "--threads",
        "2",
    ]);
    let out = text(&o.stdout);
    assert!(o.status.success(), "{}", text(&o.stderr));
    for want in ["── summary", "over 12 steps", "tok/s", "kernels", "memory", "adamw", "GFLOP/s", "MB/call", "── sample"] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    let profile: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(profile.as_array().unwrap().iter().any(|k| k["kernel"] == "add_layernorm"));
}

#[test]
fn bf16_runs_on_the_interpreter_and_the_cpu_target() {
    let args = ["run", "models/gpt2-tiny.graph", "--precision", "bf16", "--batch", "2", "--seq", "16", "--steps", "3"];
    let o = fusec(&[&args[..], &["--target", "ref"]].concat());
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("over 3 steps"), "{}", text(&o.stdout));
    for precision in ["bf16", "bf16+residual"] {
        let mut a = args;
        a[3] = precision;
        let o = fusec(&[&a[..], &["--target", "cpu"]].concat());
        let out = text(&o.stdout);
        assert!(o.status.success(), "{precision}: {}", text(&o.stderr));
        assert!(out.contains("over 3 steps") && out.contains("cpu isa "), "{precision}: {out}");
    }
}

#[test]
fn the_cpu_isa_is_detected_or_forced_and_a_bad_name_is_refused() {
    let run = |isa: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_fusec"));
        c.args(["run", "models/gpt2-tiny.graph", "--target", "cpu", "--batch", "2", "--seq", "16", "--steps", "2"]);
        match isa {
            Some(v) => c.env("FUSEC_CPU_ISA", v),
            None => c.env_remove("FUSEC_CPU_ISA"),
        };
        c.output().unwrap()
    };
    let o = run(None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let detected = text(&o.stdout).lines().find(|l| l.starts_with("cpu isa")).map(str::to_string).expect("a `cpu isa` row");
    assert!(detected.contains("detected") && detected.contains("avx512_bf16: ") && detected.contains("amx: "), "{detected}");
    // The lowest level runs everywhere and says so.
    let o = run(Some("scalar"));
    assert!(o.status.success(), "{}", text(&o.stderr));
    let row = text(&o.stdout).lines().find_map(|l| l.strip_prefix("cpu isa").map(|r| r.trim_start().to_string()));
    assert!(row.as_deref().is_some_and(|r| r.starts_with("scalar (FUSEC_CPU_ISA")), "{}", text(&o.stdout));
    let o = run(Some("avx9"));
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("FUSEC_CPU_ISA=\"avx9\" is not an instruction-set level"), "{}", text(&o.stderr));
    // A level the host lacks is refused before anything runs (AMX tiles: only where the CPU
    // has them and Linux grants the tile state).
    if detected.contains("amx: no") {
        let o = run(Some("amx"));
        assert_eq!(o.status.code(), Some(2));
        assert!(text(&o.stderr).contains("FUSEC_CPU_ISA=amx: this host does not support amx"), "{}", text(&o.stderr));
    } else {
        fusec_ir::testkit::not_on_this_host("refusing FUSEC_CPU_ISA=amx", "this host has AMX");
    }
}

#[test]
fn gemm_tiles_per_core_are_taken_from_the_environment_keep_the_bits_and_a_bad_value_is_refused() {
    let run = |v: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_fusec"));
        c.args(["run", "models/gpt2-tiny.graph", "--target", "cpu", "--batch", "2", "--seq", "16", "--steps", "2"]);
        c.env("FUSEC_GEMM_TILES_PER_CORE", v).output().unwrap()
    };
    // The summary names the count; a product's tiles split rows and columns, never the sum, so
    // the losses are the same bits whatever the count.
    let losses = |v: &str| {
        let o = run(v);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let out = text(&o.stdout);
        assert!(out.contains(&format!("tiles each ({v} a core")), "{out}");
        let loss = |l: &str| l.split(": loss ").nth(1).and_then(|r| r.split_whitespace().next()).map(str::to_string);
        text(&o.stderr).lines().filter_map(loss).collect::<Vec<_>>()
    };
    let one = losses("1");
    assert_eq!(one.len(), 3, "two steps and the validation");
    assert_eq!(one, losses("4"));
    assert_eq!(one, losses("16"));
    for bad in ["0", "17", "four"] {
        let o = run(bad);
        assert_eq!(o.status.code(), Some(2), "{bad}");
        let err = text(&o.stderr);
        assert!(err.contains(&format!("FUSEC_GEMM_TILES_PER_CORE=\"{bad}\": expected a whole number of tiles a core from 1 to 16")), "{err}");
    }
}

#[test]
fn host_memory_beyond_the_cpu_arena_stays_under_half_the_parameters() {
    let dir = TempDir::new("cli-host_memory_beyond_the_cpu_arena_stays_under_half_the_parameters");
    // 21M parameters (80 MiB): initialized and loaded one tensor at a time as f32, never as a
    // whole-model host copy (the f64 tensors of before held 3x the parameters beyond the arena).
    let graph = dir.join("mid.graph");
    let ckpt = dir.join("mid.bin");
    let args = ["export", "gpt2", "--layers", "4", "--heads", "8", "--channels", "512", "--vocab", "16384", "--max-seq", "64", "-o"];
    assert!(fusec(&[&args[..], &[graph.to_str().unwrap()]].concat()).status.success());
    let mib = |out: &str, before: &str| -> f64 {
        let at = out.find(before).unwrap_or_else(|| panic!("no `{before}` in {out}")) + before.len();
        out[at..].split_whitespace().next().unwrap().parse().unwrap()
    };
    for init in ["random", ckpt.to_str().unwrap()] {
        let g = graph.to_str().unwrap();
        let mut run = vec!["run", g, "--init", init, "--batch", "1", "--seq", "16", "--steps", "1", "--val-batches", "1"];
        if init == "random" {
            run.extend(["--save", ckpt.to_str().unwrap()]);
        }
        let o = fusec(&run);
        let out = text(&o.stdout);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let (arena, peak, params) = (mib(&out, "one allocation of"), mib(&out, "host memory  peak"), mib(&out, "x the"));
        assert!((params - 80.2).abs() < 0.1, "{out}");
        assert!(peak <= arena + 0.5 * params + 64.0, "--init {init}: peak {peak} MiB, arena {arena} MiB, parameters {params} MiB:\n{out}");
    }
}
