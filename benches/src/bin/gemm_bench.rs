//! The GEMM ceiling of one GPT-2 training step on the CPU: every matmul of the step (forward
//! `x @ W^T` with its bias/GELU epilogue, backward `dX = dY @ W` and `dW += dY^T @ X`) timed
//! through `fusec_codegen_cpu::gemm::gemm_f32`, with ms and GFLOP/s per shape and the summed
//! GEMM time of one step: what a whole training step is compared against.
//!
//! `cargo run --release -p fusec-benches --bin gemm_bench -- [--threads N] [--plain]
//! [--config small|124m|both] [--secs S] [--only SUBSTR]`. `--plain` drops the forward epilogues
//! (pure products); `--only` keeps the shapes whose name contains `SUBSTR`.

use fusec_codegen_cpu::gemm::gemm_f32;
use fusec_ir::GemmSpec;
use std::time::{Duration, Instant};

/// A GPT-2 shape: layers, channels, padded vocabulary, batch and sequence length.
struct Config {
    name: &'static str,
    layers: usize,
    channels: usize,
    vocab_padded: usize,
    batch: usize,
    seq: usize,
}

/// One matmul of the step and how many times a step runs it.
struct Shape {
    name: String,
    spec: GemmSpec,
    per_step: usize,
}

/// Every matmul of one training step of `cfg` (attention's own products are not GEMMs here).
fn step_shapes(cfg: &Config, plain: bool) -> Vec<Shape> {
    let (c, bt) = (cfg.channels, cfg.batch * cfg.seq);
    let base = GemmSpec::new(0, 0, 0);
    let mut out = Vec::new();
    // (name, out features, in features, bias, gelu, count per step)
    let linears = [
        ("qkv", 3 * c, c, true, false, cfg.layers),
        ("attproj", c, c, true, false, cfg.layers),
        ("fc", 4 * c, c, true, true, cfg.layers),
        ("fcproj", c, 4 * c, true, false, cfg.layers),
        ("lm_head", cfg.vocab_padded, c, false, false, 1),
    ];
    for (name, oc, ic, bias, gelu, per_step) in linears {
        let (bias, gelu) = (bias && !plain, gelu && !plain);
        let tag = match (bias, gelu) {
            (true, true) => "+bias+gelu",
            (true, false) => "+bias",
            _ => "",
        };
        // y[BT, OC] = x[BT, IC] @ W[OC, IC]^T
        let fwd = GemmSpec { m: bt, n: oc, k: ic, trans_b: true, bias, gelu, ..base };
        out.push(Shape { name: format!("fwd {name}{tag}"), spec: fwd, per_step });
        // dx[BT, IC] = dy[BT, OC] @ W[OC, IC]
        out.push(Shape { name: format!("dX  {name}"), spec: GemmSpec { m: bt, n: ic, k: oc, ..base }, per_step });
        // dW[OC, IC] += dy[BT, OC]^T @ x[BT, IC]
        let dw = GemmSpec { m: oc, n: ic, k: bt, trans_a: true, accumulate: true, ..base };
        out.push(Shape { name: format!("dW  {name}"), spec: dw, per_step });
    }
    for s in &mut out {
        s.spec.batch = 1;
        s.spec.b_shared = true;
    }
    out
}

/// Deterministic pseudo-random values in `[-1, 1)`, never zero in practice.
fn fill(len: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0 + 1e-4
        })
        .collect()
}

/// `(median, best)` seconds per call of `s` over at least 3 calls and about `secs` seconds.
fn time(s: &GemmSpec, threads: usize, secs: f64) -> (f64, f64) {
    let a = fill(s.a_len(), 1);
    let b: Vec<f32> = fill(s.b_len(), 2).iter().map(|v| v * 0.05).collect();
    let bias = s.bias.then(|| fill(s.n, 3));
    let mut y = fill(s.y_len(), 4);
    let mut pre = vec![0.0f32; if s.gelu { s.y_len() } else { 0 }];
    let call = |y: &mut [f32], pre: &mut [f32]| {
        let pre = s.gelu.then_some(pre);
        gemm_f32(s, &a, &b, bias.as_deref(), y, pre, threads);
    };
    call(&mut y, &mut pre); // warm up: page in, fill the crate's caches
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < 3 || (start.elapsed() < Duration::from_secs_f64(secs) && samples.len() < 1000) {
        let t = Instant::now();
        call(&mut y, &mut pre);
        samples.push(t.elapsed().as_secs_f64());
        if s.accumulate && samples.len() % 16 == 0 {
            y.iter_mut().for_each(|v| *v *= 0.5); // keep the accumulator bounded
        }
    }
    std::hint::black_box(&y);
    samples.sort_by(f64::total_cmp);
    (samples[samples.len() / 2], samples[0])
}

fn bench(cfg: &Config, threads: usize, plain: bool, secs: f64, only: &str) {
    println!(
        "\n== {}: L={} C={} Vp={} B={} T={} (BT={}), {} thread(s){}",
        cfg.name,
        cfg.layers,
        cfg.channels,
        cfg.vocab_padded,
        cfg.batch,
        cfg.seq,
        cfg.batch * cfg.seq,
        threads,
        if plain { ", no epilogues" } else { "" }
    );
    println!(
        "{:<20} {:>6} {:>6} {:>6} {:>3} | {:>8} {:>7} | {:>8} {:>7} | {:>8}",
        "shape", "M", "N", "K", "x", "med ms", "GFLOP/s", "best ms", "GFLOP/s", "ms/step"
    );
    let (mut total_med, mut total_best, mut total_flops) = (0.0, 0.0, 0u64);
    for sh in step_shapes(cfg, plain).into_iter().filter(|s| s.name.contains(only)) {
        let (med, best) = time(&sh.spec, threads, secs);
        let (flops, x) = (sh.spec.flops(), sh.per_step);
        total_med += med * x as f64;
        total_best += best * x as f64;
        total_flops += flops * x as u64;
        let s = &sh.spec;
        let gf = |t: f64| flops as f64 / t / 1e9;
        println!(
            "{:<20} {:>6} {:>6} {:>6} {:>3} | {:>8.3} {:>7.1} | {:>8.3} {:>7.1} | {:>8.2}",
            sh.name,
            s.m,
            s.n,
            s.k,
            x,
            med * 1e3,
            gf(med),
            best * 1e3,
            gf(best),
            best * x as f64 * 1e3
        );
    }
    let gf = |t: f64| total_flops as f64 / t / 1e9;
    println!(
        "GEMM time of one step ({:.2} GFLOP): best {:.1} ms = {:.1} GFLOP/s (the ceiling); median {:.1} ms = {:.1} GFLOP/s",
        total_flops as f64 / 1e9,
        total_best * 1e3,
        gf(total_best),
        total_med * 1e3,
        gf(total_med)
    );
}

fn main() {
    let mut threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (mut plain, mut config, mut secs, mut only) = (false, "both".to_string(), 0.4, String::new());
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |what: &str| args.next().unwrap_or_else(|| panic!("{arg} needs {what}"));
        match arg.as_str() {
            "--threads" => threads = value("a count").parse().expect("--threads N"),
            "--config" => config = value("small, 124m or both"),
            "--secs" => secs = value("seconds").parse().expect("--secs S"),
            "--plain" => plain = true,
            "--only" => only = value("a substring of shape names"),
            "-h" | "--help" => {
                println!("gemm_bench [--threads N] [--config small|124m|both] [--secs S] [--plain]");
                return;
            }
            other => panic!("unknown argument `{other}` (try --help)"),
        }
    }
    let threads = threads.max(1);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().expect("the rayon pool is built once");
    let small = Config { name: "small", layers: 4, channels: 256, vocab_padded: 8192, batch: 8, seq: 256 };
    let gpt2 = Config { name: "gpt2-124M", layers: 12, channels: 768, vocab_padded: 50304, batch: 4, seq: 64 };
    for cfg in [small, gpt2] {
        if config == "both" || config.eq_ignore_ascii_case(cfg.name) || (config == "124m" && cfg.layers == 12) {
            bench(&cfg, threads, plain, secs, &only);
        }
    }
}
