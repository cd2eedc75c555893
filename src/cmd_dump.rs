//! `fusec dump FILE --pass NAME`: the graph after a pass, as text.

use clap::{Args, ValueEnum};
use std::path::PathBuf;

use fusec_ir::Bindings;
use fusec_passes::amp::Precision;
use fusec_passes::memplan::MemplanOptions;
use fusec_passes::optimizer::AdamWConfig;
use fusec_passes::pipeline::{compile, launches, Mode, PipelineOptions, PASSES};
use fusec_passes::recompute::Recompute;
use fusec_passes::zero::Shard;

use crate::{load_graph, CliResult};

/// Which program to dump.
#[derive(Clone, Copy, ValueEnum)]
pub enum Program {
    /// Forward and loss.
    Forward,
    /// Forward and backward.
    Grad,
    /// A whole training step (forward, backward, AdamW).
    Step,
}

/// Arguments of `fusec dump`.
#[derive(Args)]
pub struct DumpArgs {
    /// The `.graph` file.
    file: PathBuf,
    /// Print the graph after this pass (`parse`: the canonical input; `fuse`: after the last fusion pass).
    #[arg(long, default_value = "parse", value_parser = clap::builder::PossibleValuesParser::new(PASSES.iter().copied().chain([LOWER_ROWS, LOWER_CPU, LOWER_CUDA])))]
    pass: String,
    /// Which program the passes build.
    #[arg(long, value_enum, default_value = "step")]
    program: Program,
    /// Batch size B (binds the symbolic dim for memory planning).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
    batch: u64,
    /// Sequence length T (binds the symbolic dim for memory planning).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
    seq: u64,
    /// Mixed precision: `bf16` (bf16 activations and products, f32 residual stream) or
    /// `bf16+residual` (the residual stream in bf16 too); `--pass amp` prints the policy.
    #[arg(long, default_value = "fp32", value_parser = precision_parser())]
    precision: Precision,
    /// What the backward recomputes instead of storing: `none`, `gelu`, or `gelu+layernorm`
    /// (default: `none` in fp32, `gelu` in bf16, as `fusec run`).
    #[arg(long, value_parser = recompute_parser())]
    recompute: Option<Recompute>,
    /// Include global-norm gradient clipping in the optimizer.
    #[arg(long)]
    grad_clip: bool,
    /// Build one rank of a data-parallel run (`fusec run --ranks N`): the loss and the
    /// gradients go through `all_reduce` (pass `data-parallel`).
    #[arg(long)]
    data_parallel: bool,
    /// ZeRO-1 as rank R of N (`R/N`, e.g. `0/2`; implies --data-parallel): AdamW state only for
    /// the parameters this rank owns, then `from_owners` (`--pass memplan` shows the rank's bytes).
    #[arg(long, value_name = "R/N", value_parser = shard_parser)]
    zero_shard: Option<Shard>,
    /// Memory planning without reuse: every buffer gets its own range (for bisecting).
    #[arg(long)]
    no_reuse: bool,
    /// List the fusion candidates that were refused and the predicate that refused each.
    #[arg(long)]
    explain_fusion: bool,
    /// Print per-pass compile time and launch counts on standard error.
    #[arg(long)]
    timings: bool,
}

/// Parses `--zero-shard R/N`: a rank below a world of 1..=64 ranks.
fn shard_parser(s: &str) -> Result<Shard, String> {
    let err = || format!("`{s}`: expected RANK/RANKS with RANKS in 1..=64 and RANK below it, e.g. 0/2");
    let (r, n) = s.split_once('/').ok_or_else(err)?;
    let (rank, world): (usize, usize) = (r.trim().parse().map_err(|_| err())?, n.trim().parse().map_err(|_| err())?);
    if !(1..=64).contains(&world) || rank >= world {
        return Err(err());
    }
    Ok(Shard { rank, world })
}

/// Parses `--recompute` (none, gelu, gelu+layernorm) into the `recompute` pass's policy.
pub fn recompute_parser() -> impl clap::builder::TypedValueParser<Value = Recompute> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(Recompute::NAMES).try_map(|s| s.parse::<Recompute>())
}

/// Parses `--precision` (fp32, bf16, bf16+residual) into the `amp` pass's policy.
pub fn precision_parser() -> impl clap::builder::TypedValueParser<Value = Precision> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(Precision::NAMES).try_map(|s| s.parse::<Precision>())
}

/// The code generation step after `memplan`: each kernel's row programs (both backends' input).
const LOWER_ROWS: &str = "lower-rows";
/// The code generation step after `memplan`: each kernel's Cranelift IR.
const LOWER_CPU: &str = "lower-cpu";
/// The code generation step after `memplan`: each kernel's CUDA C source.
const LOWER_CUDA: &str = "lower-cuda";

/// Runs `fusec dump`.
pub fn dump(a: DumpArgs) -> CliResult {
    let t0 = std::time::Instant::now();
    let g = load_graph(&a.file)?;
    let parse_time = t0.elapsed();
    let opts = PipelineOptions {
        // As `fusec run` builds its step without `--grad-accum`: gradients are transients.
        adamw: AdamWConfig { clip: a.grad_clip, fresh_grads: true, shard: a.zero_shard, ..AdamWConfig::default() },
        precision: a.precision,
        recompute: a.recompute.unwrap_or(Recompute::default_for(a.precision)),
        no_fusion: false,
        memplan: MemplanOptions { reuse: !a.no_reuse },
        data_parallel: a.data_parallel || a.zero_shard.is_some(),
    };
    let mode = match a.program {
        Program::Forward => Mode::Forward,
        Program::Grad => Mode::Grad,
        Program::Step => Mode::Step,
    };
    let mut bind = Bindings::default();
    bind.set("B", a.batch).set("T", a.seq);
    let lower = a.pass == LOWER_ROWS || a.pass == LOWER_CPU || a.pass == LOWER_CUDA;
    let out = compile(&g, if lower { "memplan" } else { &a.pass }, mode, &opts, &bind)?;
    let t_lower = std::time::Instant::now();
    match &out.plan {
        _ if a.pass == LOWER_ROWS => out!("{}", fusec_passes::lower_rows::print(&out.graph, &bind)?),
        _ if a.pass == LOWER_CUDA => out!("{}", lower_cuda(&out.graph, &bind)?),
        _ if lower => out!("{}", lower_cpu(&out.graph, &bind)?),
        Some(plan) => out!("{}", plan.annotate(&out.graph)),
        None if a.pass == "amp" && a.precision.is_bf16() => {
            out!("{}{}", fusec_passes::amp::describe(a.precision), fusec_ir::text::print(&out.graph))
        }
        None => out!("{}", fusec_ir::text::print(&out.graph)),
    }?;
    let lower_time = t_lower.elapsed();
    if a.explain_fusion {
        errln!("# {} fusion candidate(s) refused", out.log.refusals.len());
        for r in &out.log.refusals {
            errln!("{r}");
        }
    }
    if a.timings {
        errln!("{:<18} {:>9.3} ms", "parse", parse_time.as_secs_f64() * 1e3);
        let mut total = parse_time;
        for r in &out.runs {
            errln!("{:<18} {:>9.3} ms", r.name, r.time.as_secs_f64() * 1e3);
            total += r.time;
        }
        if lower {
            errln!("{:<18} {:>9.3} ms", a.pass, lower_time.as_secs_f64() * 1e3);
            total += lower_time;
        }
        errln!("{:<18} {:>9.3} ms", "total", total.as_secs_f64() * 1e3);
    }
    let fused_at = PASSES.iter().position(|p| *p == "fuse-elementwise");
    if lower || PASSES.iter().position(|p| *p == a.pass) >= fused_at {
        let unfused =
            compile(&g, if lower { "memplan" } else { &a.pass }, mode, &PipelineOptions { no_fusion: true, ..opts.clone() }, &bind)?;
        let (before, after) = (launches(&unfused.graph), launches(&out.graph));
        errln!(
            "kernels per step: {} non-matmul + {} matmul before fusion, {} + {} after",
            before.other,
            before.matmul,
            after.other,
            after.matmul
        );
    }
    Ok(())
}

/// The Cranelift IR of every distinct kernel of `g` (identical kernels compile once).
fn lower_cpu(g: &fusec_ir::Graph, bind: &Bindings) -> Result<String, String> {
    let mut kc = fusec_codegen_cpu::KernelCompiler::new()?;
    let mut seen = std::collections::HashSet::new();
    let mut text = String::new();
    for n in &g.nodes {
        if let fusec_ir::Op::Kernel(k) = &n.op {
            let ck = kc.compile(k, bind)?;
            if seen.insert(std::sync::Arc::as_ptr(&ck)) {
                text += &format!("; kernel {}\n{}\n", ck.name, ck.clif);
            }
        }
    }
    let (compiled, hits) = kc.stats();
    Ok(text + &format!("; {compiled} kernels compiled, {hits} cache hits\n"))
}

/// The CUDA C source of every distinct kernel of `g` (same body, same text).
fn lower_cuda(g: &fusec_ir::Graph, bind: &Bindings) -> Result<String, String> {
    let mut seen = std::collections::HashSet::new();
    let mut text = String::new();
    for n in &g.nodes {
        if let fusec_ir::Op::Kernel(k) = &n.op {
            let src = fusec_codegen_cuda::kernel_source(k, bind)?;
            if seen.insert(src.source.clone()) {
                text += &format!("// kernel {}\n{}\n", src.name, src.source);
            }
        }
    }
    Ok(text + &format!("// {} distinct kernels\n", seen.len()))
}
