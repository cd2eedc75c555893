//! Fuzzing past the parser: valid graphs (the shipped GPT-2 tiny graph, that graph after the
//! fusion passes, and random graphs from `fusec_ir::testkit::gen`) are mutated as `.graph` text and as IR
//! (types, shapes, attributes, names, edges, op kinds, outputs, symbols), and every mutant that
//! parses and verifies is pushed through every pass up to `memplan` for `Mode::Step` and
//! `Mode::Forward` under `catch_unwind`, with varied options and bindings (huge ones included).
//!
//! The promise under test: bad input gets a clear error, never a panic. A pass that produces a
//! graph the verifier rejects (`after pass ...`) or an ill-typed node (`internal error`) on a
//! verified input is a bug too, and fails the test like a panic.
//!
//! Bounded for the normal test run: a fixed seed, at most [`MUTANTS`] mutants and [`SECONDS`]
//! of wall clock (`FUSEC_FUZZ_MUTANTS`, `FUSEC_FUZZ_SECS` and `FUSEC_FUZZ_SEED` override them
//! for soak runs).

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use fusec_ir::rng::Rng;
use fusec_ir::testkit::gen::{random_graph_with, GenOpts};
use fusec_ir::text::{parse, print};
use fusec_ir::verify::verify;
use fusec_ir::{Bindings, DType, Graph, Op, ReduceOp};
use fusec_passes::amp::Precision;
use fusec_passes::memplan::MemplanOptions;
use fusec_passes::optimizer::AdamWConfig;
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
use fusec_passes::recompute::Recompute;

use fusec_ir::testkit::mutate::{mutate_ir, mutate_text, pick, retype};

/// Mutants per run.
const MUTANTS: u64 = 4000;
/// Wall-clock cap per run, in seconds.
const SECONDS: u64 = 20;
/// The default seed.
const SEED: u64 = 0x5eed_f00d;

const TINY: &str = include_str!("../../models/gpt2-tiny.graph");

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A random graph with a scalar f32 `loss` output (the sum of some float value), so that
/// `Mode::Step` has something to differentiate, and (where that still types) f32 parameters,
/// which AdamW can update.
fn random_with_loss(rng: &mut Rng) -> Graph {
    let opts = GenOpts { max_ops: 12, max_dim: 4, symbolic: true, extreme_consts: true, odd_names: rng.chance(0.3) };
    let mut g = random_graph_with(rng, &opts);
    let mut f32_params = g.clone();
    for n in &mut f32_params.nodes {
        if let Op::Param { ty, .. } = &mut n.op {
            ty.dtype = DType::F32;
        }
    }
    if let Some(r) = retype(&f32_params) {
        g = r;
    }
    let floats: Vec<_> = (0..g.values.len()).filter(|&v| g.values[v].ty.dtype.is_float()).collect();
    if floats.is_empty() {
        return g;
    }
    let v = fusec_ir::ValueId(floats[rng.below(floats.len() as u64) as usize] as u32);
    let rank = g.ty(v).shape.rank();
    let mut s = v;
    if rank > 0 {
        match g.try_add(Op::Reduce { op: ReduceOp::Sum, axes: (0..rank).collect() }, &[s]) {
            Ok(r) => s = r[0],
            Err(_) => return g,
        }
    }
    if g.ty(s).dtype != DType::F32 {
        match g.try_add(Op::Cast { to: DType::F32 }, &[s]) {
            Ok(r) => s = r[0],
            Err(_) => return g,
        }
    }
    g.outputs.retain(|(n, _)| n != "loss");
    g.output("loss", s);
    g
}

/// The seeds of the mutants: GPT-2 tiny as parsed, after `fuse-grad-accum` and after all
/// fusion (with `gemm`, `adamw` and `kernel` nodes), and random graphs.
fn seeds(rng: &mut Rng) -> Vec<Graph> {
    let tiny = parse(TINY, "gpt2-tiny.graph").expect("the shipped graph parses");
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 8);
    let opts = PipelineOptions::default();
    let mut out = vec![tiny.clone()];
    for last in ["fuse-grad-accum", "fuse"] {
        out.push(compile(&tiny, last, Mode::Step, &opts, &b).expect("GPT-2 tiny compiles").graph);
    }
    for _ in 0..40 {
        out.push(random_with_loss(rng));
    }
    out
}

/// Options for one compile: mostly defaults, sometimes every switch flipped, sometimes an
/// AdamW configuration out of range.
fn options(rng: &mut Rng) -> PipelineOptions {
    let mut adamw = AdamWConfig { clip: rng.chance(0.3), ..AdamWConfig::default() };
    if rng.chance(0.1) {
        match rng.below(4) {
            0 => adamw.weight_decay = pick(rng, &[f64::NAN, -0.1, f64::INFINITY]),
            1 => adamw.beta1 = pick(rng, &[1.0, -0.5, f64::NAN]),
            2 => adamw.beta2 = pick(rng, &[1.5, f64::NAN]),
            _ => adamw.eps = pick(rng, &[-1e-8, f64::NAN, f64::NEG_INFINITY]),
        }
    }
    PipelineOptions {
        adamw,
        precision: if rng.chance(0.25) { Precision::Bf16 } else { Precision::F32 },
        recompute: if rng.chance(0.3) { pick(rng, &[Recompute::Gelu, Recompute::GeluLayernorm]) } else { Recompute::None },
        no_fusion: rng.chance(0.2),
        memplan: MemplanOptions { reuse: !rng.chance(0.2) },
        data_parallel: rng.chance(0.2),
    }
}

/// Every symbol bound to a small value, or (rarely) to a huge one.
fn bindings(rng: &mut Rng, g: &Graph) -> Bindings {
    let mut b = Bindings::default();
    for s in &g.syms {
        let v = if rng.chance(0.05) { pick(rng, &[1 << 31, 1 << 40, 1 << 62, u64::MAX]) } else { pick(rng, &[1, 2, 3, 5]) };
        b.set(s, v);
    }
    b
}

/// What happened to the mutants.
#[derive(Default)]
struct Tally {
    mutants: u64,
    parsed: u64,
    verified: u64,
    compiled: u64,
    errors: BTreeMap<String, u64>,
    /// Panics and pass bugs: what, and the mutant's text.
    failures: Vec<(String, String)>,
}

impl Tally {
    /// Compiles `g` for both modes, recording errors, panics and pass bugs.
    fn run(&mut self, rng: &mut Rng, g: &Graph) {
        for mode in [Mode::Step, Mode::Forward] {
            let opts = options(rng);
            let bind = bindings(rng, g);
            let r = catch_unwind(AssertUnwindSafe(|| compile(g, "memplan", mode, &opts, &bind)));
            let what = format!("{mode:?}, {opts:?}, {bind:?}");
            match r {
                Ok(Ok(_)) => self.compiled += 1,
                Ok(Err(e)) if e.starts_with("after pass") || e.contains("internal error") => {
                    self.failures.push((format!("pass bug ({what}): {e}"), print(g)));
                }
                Ok(Err(e)) => *self.errors.entry(error_kind(&e)).or_default() += 1,
                Err(p) => {
                    let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                    self.failures.push((format!("panic ({what}): {}", msg.unwrap_or_default()), print(g)));
                }
            }
        }
    }

    /// Checks a mutant built in memory: the verifier must not panic, and a verified graph
    /// goes through the passes.
    fn ir(&mut self, rng: &mut Rng, g: &Graph) {
        self.mutants += 1;
        match catch_unwind(AssertUnwindSafe(|| verify(g))) {
            Ok(Ok(())) => {
                self.verified += 1;
                self.run(rng, g);
            }
            Ok(Err(_)) => {}
            Err(_) => self.failures.push(("panic in verify".to_string(), print(g))),
        }
    }

    /// Checks a mutant as text: the parser must not panic, and what parses and verifies goes
    /// through the passes.
    fn text(&mut self, rng: &mut Rng, src: &str) {
        self.mutants += 1;
        match catch_unwind(AssertUnwindSafe(|| parse(src, "mutant.graph"))) {
            Ok(Ok(g)) => {
                self.parsed += 1;
                if verify(&g).is_ok() {
                    self.verified += 1;
                    self.run(rng, &g);
                }
            }
            Ok(Err(_)) => {}
            Err(_) => self.failures.push(("panic in parse".to_string(), src.to_string())),
        }
    }
}

/// An error message without its numbers and names, to group similar errors in the summary.
fn error_kind(e: &str) -> String {
    let mut out = String::new();
    let mut quoted = false;
    for c in e.chars() {
        match c {
            '`' | '"' => {
                quoted = !quoted;
                out.push(c);
            }
            _ if quoted => {}
            c if c.is_ascii_digit() => {
                if !out.ends_with('#') {
                    out.push('#');
                }
            }
            c => out.push(c),
        }
    }
    out.chars().take(80).collect()
}

#[test]
fn mutants_of_valid_graphs_never_panic_in_the_passes() {
    let seed = env_or("FUSEC_FUZZ_SEED", SEED);
    let max = env_or("FUSEC_FUZZ_MUTANTS", MUTANTS);
    let cap = Duration::from_secs(env_or("FUSEC_FUZZ_SECS", SECONDS));
    let mut rng = Rng::new(seed);
    let seeds = seeds(&mut rng);
    let texts: Vec<String> = seeds.iter().map(print).collect();

    // Panics are caught and reported below; keep the default hook from printing each one.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let t0 = Instant::now();
    let mut t = Tally::default();
    while t.mutants < max && t0.elapsed() < cap {
        // Half of the mutants come from the GPT-2 graphs (the first three seeds).
        let k = if rng.chance(0.5) { rng.below(3) } else { rng.below(seeds.len() as u64) } as usize;
        // One to three mutations, as IR (two thirds) or as text.
        let rounds = 1 + rng.below(3);
        if rng.chance(0.67) {
            let mut g = seeds[k].clone();
            for _ in 0..rounds {
                g = mutate_ir(&mut rng, &g);
            }
            t.ir(&mut rng, &g);
        } else {
            let mut src = texts[k].clone();
            for _ in 0..rounds {
                src = mutate_text(&mut rng, &src);
            }
            t.text(&mut rng, &src);
        }
    }
    std::panic::set_hook(hook);

    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "fuzz_passes: seed {seed:#x}: {} mutants in {secs:.1} s, {} parsed as text, {} verified, {} compiles succeeded, {} failures",
        t.mutants,
        t.parsed,
        t.verified,
        t.compiled,
        t.failures.len()
    );
    let mut errors: Vec<_> = t.errors.iter().collect();
    errors.sort_by_key(|(_, n)| std::cmp::Reverse(**n));
    for (e, n) in errors.iter().take(30) {
        eprintln!("  {n:>5}  {e}");
    }
    assert!(t.verified > 0 && t.compiled > 0, "no mutant got through the passes: the fuzzer tests nothing");
    if !t.failures.is_empty() {
        let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
        for (what, _) in &t.failures {
            let msg = what.split_once("): ").map_or(what.as_str(), |(_, m)| m);
            *kinds.entry(error_kind(msg)).or_default() += 1;
        }
        eprintln!("distinct failures:");
        for (k, n) in &kinds {
            eprintln!("  {n:>5}  {k}");
        }
        let shown: Vec<String> = t.failures.iter().take(3).map(|(what, src)| format!("{what}\n--- mutant ---\n{src}")).collect();
        panic!("{} of {} mutants panicked or broke a pass; the first ones:\n\n{}", t.failures.len(), t.mutants, shown.join("\n\n"));
    }
}
