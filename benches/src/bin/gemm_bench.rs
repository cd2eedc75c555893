//! The GEMM ceiling of one GPT-2 training step on the CPU: every matmul of the step (forward
//! `x @ W^T` with its bias/GELU epilogue, backward `dX = dY @ W` and `dW += dY^T @ X`) timed
//! through `fusec_codegen_cpu::gemm::gemm_f32`, with ms and GFLOP/s per shape and the summed
//! GEMM time of one step: what a whole training step is compared against.
//!
//! `cargo run --release -p fusec-benches --bin gemm_bench -- [--threads N] [--plain] [--cold]
//! [--config small|124m|both] [--secs S] [--only SUBSTR] [--products LIST]`. `--plain` drops the
//! forward epilogues (pure products); `--cold` writes 256 MiB before every timed call (untimed),
//! so that each product starts with its operands out of the caches, as a step's products may; `--only` keeps the shapes whose name contains `SUBSTR`;
//! `--products` lists what multiplies (comma-separated, default `f32`): `f32` (`gemm_f32`), and
//! `bf16@LEVEL` (`gemm_bf16` on the path of an instruction-set level: `avx512bf16` dot
//! products, `avx512` or `avx2` FMA on operands widened while packing, `scalar` widened
//! operands through the `gemm` crate; bf16 operands and activations, f32 weight gradients, as
//! `--precision bf16` runs them). With more than one, each shape runs them in turn, alternating,
//! so that a busy host slows all alike.

use clap::Parser;
use fusec_benches::arg_error;
use fusec_codegen_cpu::gemm::{gemm_bf16_on, gemm_f32, Bf16Out};
use fusec_codegen_cpu::isa::Isa;
use fusec_ir::GemmSpec;
use half::bf16;
use std::time::{Duration, Instant};

/// The command line (see the module docs).
#[derive(Parser)]
#[command(about = "The GEMM ceiling of one GPT-2 training step on the CPU: every matmul of the step timed alone, \
                   with ms and GFLOP/s per shape and the summed GEMM time of one step")]
struct Args {
    /// Threads of the products and of rayon's pool [default: the host's cores; 0 counts as 1]
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Which GPT-2 shape's step: `small` (L=4 C=256 B=8 T=256), `124m` (L=12 C=768 B=4 T=64) or both
    #[arg(long, value_enum, ignore_case = true, default_value_t = Which::Both)]
    config: Which,
    /// Seconds of timing per shape and product (at least 3 calls each)
    #[arg(long, value_name = "S", default_value_t = 0.4, value_parser = seconds, allow_negative_numbers = true)]
    secs: f64,
    /// Drop the forward epilogues (bias, GELU): pure products
    #[arg(long)]
    plain: bool,
    /// Write 256 MiB (untimed) before every timed call, so that each product starts with its operands out of the caches
    #[arg(long)]
    cold: bool,
    /// Keep only the shapes whose name contains SUBSTR (e.g. `qkv`, `dW`, `gelu`) [default: all]
    #[arg(long, value_name = "SUBSTR")]
    only: Option<String>,
    /// What multiplies, comma-separated, alternating call by call: `f32` (gemm_f32) and
    /// `bf16@LEVEL` (gemm_bf16 at LEVEL: avx512bf16, avx512, avx2, scalar or amx)
    #[arg(long, value_name = "LIST", default_value = "f32")]
    products: String,
}

/// The `--config` choices.
#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum Which {
    Small,
    #[value(name = "124m", alias = "gpt2-124m")]
    M124,
    Both,
}

/// A `--secs` value: a finite, non-negative number.
fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(_) => Err("must be a finite, non-negative number of seconds".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// What multiplies.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    F32,
    Bf16(Isa),
}

impl Kind {
    fn parse(s: &str) -> Result<Kind, String> {
        let levels = || Isa::ALL.map(Isa::name).join(", ");
        match s.split_once('@') {
            None if s == "f32" => Ok(Kind::F32),
            Some(("bf16", level)) => Isa::parse(level).map(Kind::Bf16).map_err(|_| format!("unknown level in `{s}` (one of {})", levels())),
            _ => Err(format!("unknown `{s}` (f32, bf16@avx512bf16, bf16@avx512, bf16@avx2, bf16@scalar)")),
        }
    }

    fn name(self) -> String {
        match self {
            Kind::F32 => "f32".into(),
            Kind::Bf16(isa) => format!("bf16@{}", isa.name()),
        }
    }
}

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

/// Operands and results of one product in f32 and bf16.
struct Data {
    a: Vec<f32>,
    b: Vec<f32>,
    bias: Option<Vec<f32>>,
    y: Vec<f32>,
    pre: Vec<f32>,
    a16: Vec<bf16>,
    b16: Vec<bf16>,
    bias16: Option<Vec<bf16>>,
    y16: Vec<bf16>,
    pre16: Vec<bf16>,
}

impl Data {
    fn new(s: &GemmSpec) -> Data {
        let a = fill(s.a_len(), 1);
        let b: Vec<f32> = fill(s.b_len(), 2).iter().map(|v| v * 0.05).collect();
        let bias = s.bias.then(|| fill(s.n, 3));
        let y = fill(s.y_len(), 4);
        let pre = vec![0.0f32; if s.gelu { s.y_len() } else { 0 }];
        let h = |v: &[f32]| v.iter().map(|x| bf16::from_f32(*x)).collect::<Vec<_>>();
        let (a16, b16, bias16, y16, pre16) = (h(&a), h(&b), bias.as_deref().map(h), h(&y), h(&pre));
        Data { a, b, bias, y, pre, a16, b16, bias16, y16, pre16 }
    }

    /// One product. bf16: weight gradients (`accumulate`) into f32, the rest into bf16.
    fn call(&mut self, s: &GemmSpec, kind: Kind, threads: usize) {
        match kind {
            Kind::F32 => gemm_f32(s, &self.a, &self.b, self.bias.as_deref(), &mut self.y, s.gelu.then_some(&mut self.pre[..]), threads),
            Kind::Bf16(isa) => {
                let y = if s.accumulate { Bf16Out::F32(&mut self.y) } else { Bf16Out::Bf16(&mut self.y16) };
                let pre = s.gelu.then_some(&mut self.pre16[..]);
                gemm_bf16_on(isa, s, &self.a16, &self.b16, self.bias16.as_deref(), y, pre, threads)
            }
        }
        if s.accumulate {
            self.y.iter_mut().for_each(|v| *v *= 0.5); // keep the accumulator bounded
        }
    }
}

/// Bytes `--cold` writes before each timed call: more than any host's last-level cache here.
const COLD_BYTES: usize = 256 << 20;

/// `(median, best)` seconds per call of `s` for each of `kinds`, over at least 3 rounds and
/// about `secs` seconds per kind, the kinds alternating call by call; with `cold` a buffer of
/// [`COLD_BYTES`] is written (on every thread of the pool) before each call.
fn time(s: &GemmSpec, kinds: &[Kind], threads: usize, secs: f64, cold: bool) -> Vec<(f64, f64)> {
    use rayon::prelude::*;
    let mut flush = vec![0u64; if cold { COLD_BYTES / 8 } else { 0 }];
    let mut d = Data::new(s);
    for &k in kinds {
        d.call(s, k, threads); // warm up: page in, fill the caches
    }
    let mut samples = vec![Vec::new(); kinds.len()];
    let start = Instant::now();
    let budget = Duration::from_secs_f64(secs * kinds.len() as f64);
    while samples[0].len() < 3 || (start.elapsed() < budget && samples[0].len() < 1000) {
        for (k, kind) in kinds.iter().enumerate() {
            flush.par_chunks_mut(1 << 16).for_each(|c| c.iter_mut().for_each(|x| *x = x.wrapping_add(1)));
            let t = Instant::now();
            d.call(s, *kind, threads);
            samples[k].push(t.elapsed().as_secs_f64());
        }
    }
    std::hint::black_box((&d.y, &d.y16, &flush));
    samples
        .into_iter()
        .map(|mut v| {
            v.sort_by(f64::total_cmp);
            (v[v.len() / 2], v[0])
        })
        .collect()
}

fn bench(cfg: &Config, kinds: &[Kind], threads: usize, plain: bool, secs: f64, only: &str, cold: bool) {
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
        if plain { ", no epilogues" } else { "" },
    );
    if cold {
        println!("(cold: {} MiB written before every timed call)", COLD_BYTES >> 20);
    }
    print!("{:<20} {:>6} {:>6} {:>6} {:>3}", "shape", "M", "N", "K", "x");
    for k in kinds {
        print!(" | {:>17} {:>7} {:>8} {:>7}", format!("{} med ms", k.name()), "GFLOP/s", "best ms", "GFLOP/s");
    }
    println!();
    let mut totals = vec![(0.0, 0.0); kinds.len()];
    let mut total_flops = 0u64;
    for sh in step_shapes(cfg, plain).into_iter().filter(|s| s.name.contains(only)) {
        let times = time(&sh.spec, kinds, threads, secs, cold);
        let (flops, x) = (sh.spec.flops(), sh.per_step);
        total_flops += flops * x as u64;
        let s = &sh.spec;
        let gf = |t: f64| flops as f64 / t / 1e9;
        print!("{:<20} {:>6} {:>6} {:>6} {:>3}", sh.name, s.m, s.n, s.k, x);
        for ((med, best), tot) in times.iter().zip(totals.iter_mut()) {
            tot.0 += med * x as f64;
            tot.1 += best * x as f64;
            print!(" | {:>17.3} {:>7.1} {:>8.3} {:>7.1}", med * 1e3, gf(*med), best * 1e3, gf(*best));
        }
        println!();
    }
    let gf = |t: f64| total_flops as f64 / t / 1e9;
    for (k, (med, best)) in kinds.iter().zip(&totals) {
        println!(
            "{:>15}: GEMM time of one step ({:.2} GFLOP): best {:.1} ms = {:.1} GFLOP/s (the ceiling); median {:.1} ms = {:.1} GFLOP/s",
            k.name(),
            total_flops as f64 / 1e9,
            best * 1e3,
            gf(*best),
            med * 1e3,
            gf(*med)
        );
    }
}

fn main() {
    let args = Args::parse();
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let kinds: Vec<Kind> =
        args.products.split(',').map(Kind::parse).collect::<Result<_, _>>().unwrap_or_else(|e| arg_error("--products", e));
    if let Some(Kind::Bf16(isa)) = kinds.iter().find(|k| matches!(k, Kind::Bf16(i) if !i.supported())) {
        eprintln!("this host does not support {}", isa.name());
        std::process::exit(2);
    }
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().expect("the rayon pool is built once");
    let small = Config { name: "small", layers: 4, channels: 256, vocab_padded: 8192, batch: 8, seq: 256 };
    let gpt2 = Config { name: "gpt2-124M", layers: 12, channels: 768, vocab_padded: 50304, batch: 4, seq: 64 };
    let only = args.only.as_deref().unwrap_or("");
    for (which, cfg) in [(Which::Small, small), (Which::M124, gpt2)] {
        if args.config == Which::Both || args.config == which {
            bench(&cfg, &kinds, threads, args.plain, args.secs, only, args.cold);
        }
    }
}
