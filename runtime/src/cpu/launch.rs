//! The launch plan translated for the CPU, built once per run: kernels compiled by Cranelift
//! with their operand addresses resolved, attention split into its GEMM and softmax stages,
//! storage types checked.
//! Executing a step walks the list and allocates nothing.

use std::sync::Arc;

use fusec_codegen_cpu::{CompiledKernel, KernelCompiler};
use fusec_ir::{Bindings, DType};

use super::attention::AttnStage;
use crate::launches::{self, Attention, CollectivePart, Fill, Gather, Iota, LaunchOp, Product, ScatterAdd};

/// What one CPU launch does; offsets are bytes into the one allocation.
pub enum Kind {
    /// A matmul with its epilogue.
    Gemm(Product),
    /// A Cranelift-compiled fused kernel, with its operand and result addresses.
    Kernel { k: Arc<CompiledKernel>, ins: Vec<*const u8>, outs: Vec<*mut u8> },
    /// Embedding lookup.
    Gather(Gather),
    /// Embedding gradient.
    ScatterAdd(ScatterAdd),
    /// Causal attention's stages, run one head after another (each head's stages in turn, its
    /// score matrix still in cache); `keep`: the layer's probabilities are kept from its forward
    /// for its backward ([`keep_scores`]).
    Attention { stages: &'static [AttnStage], attn: Attention, keep: bool },
    /// Index fill.
    Iota(Iota),
    /// Constant fill.
    Fill(Fill),
    /// One collective over every operand (the executor's
    /// [`crate::dist::star::HostCollective`]).
    Collective(Vec<CollectivePart>),
}

/// One launch: its kind, the name the profiler shows, and static byte and FLOP counts.
pub struct Launch {
    /// What it runs.
    pub kind: Kind,
    /// Kernel or op name.
    pub name: String,
    /// Bytes read and written (static).
    pub bytes: u64,
    /// Floating-point operations (static).
    pub flops: u64,
    /// The IR ops it runs ([`launches::fused_ops`]; an attention stage: its attention's).
    pub ops: Vec<&'static str>,
}

/// The most bytes of attention probabilities kept from the forward for the backward, in all
/// (`FUSEC_CPU_KEEP_SCORES_MIB` overrides it, 0 turns keeping off).
const KEEP_SCORES_BYTES: u64 = 256 << 20;

/// The bytes of probabilities that may be kept: `FUSEC_CPU_KEEP_SCORES_MIB` MiB, else
/// [`KEEP_SCORES_BYTES`].
pub fn keep_budget() -> u64 {
    std::env::var("FUSEC_CPU_KEEP_SCORES_MIB").ok().and_then(|v| v.parse::<u64>().ok()).map_or(KEEP_SCORES_BYTES, |m| m << 20)
}

/// Whether the attention backwards of `plan` read the probabilities their forwards kept instead
/// of recomputing them (`q k^T` and the softmax again): when there are some and all of them fit
/// [`KEEP_SCORES_BYTES`] (`S H T²` floats a layer; GPT-2 `small` at B = 8, T = 256: 8 MiB). A
/// plan without a backward (evaluation) keeps nothing.
pub fn keep_scores(plan: &[launches::Launch]) -> bool {
    let budget = keep_budget();
    let mut bytes = 0u64;
    for l in plan {
        if let LaunchOp::Attention(a) = &l.op {
            let d = a.dims;
            let layer = [d.s, d.h, d.t, d.t, 4].iter().try_fold(1u64, |acc, &x| acc.checked_mul(x as u64));
            match layer.and_then(|b| bytes.checked_add(if a.forward { 0 } else { b })) {
                Some(b) => bytes = b,
                None => return false,
            }
        }
    }
    bytes > 0 && bytes <= budget
}

/// The CPU launches of a program's plan, compiling kernels through `kc`; `base` is the
/// address of the one allocation.
pub fn translate(plan: &[launches::Launch], bind: &Bindings, kc: &mut KernelCompiler, base: *mut u8) -> Result<Vec<Launch>, String> {
    let mut out = vec![];
    let keep = keep_scores(plan);
    for l in plan {
        if l.dtypes.contains(&DType::F16) {
            return Err(l.err("f16 storage is not supported by the CPU target (use --precision fp32 or bf16)"));
        }
        let f32_only = |what: &str| match l.dtypes.iter().find(|d| **d == DType::BF16) {
            Some(_) => Err(l.err(format!("{what} on bf16 storage is not supported by the CPU target"))),
            None => Ok(()),
        };
        let (kind, flops) = match &l.op {
            LaunchOp::Product(p) => {
                super::product::check(p).map_err(|e| l.err(e))?;
                (Kind::Gemm(*p), l.flops)
            }
            LaunchOp::Kernel { kernel, ins, outs } => {
                let ck = kc.compile(kernel, bind).map_err(|e| l.err(format!("kernel `{}`: {e}", kernel.name)))?;
                // SAFETY: every offset lies inside the allocation at `base` (the plan's size).
                let ins = ins.iter().map(|&o| unsafe { base.add(o as usize) as *const u8 }).collect();
                let outs = outs.iter().map(|&o| unsafe { base.add(o as usize) }).collect();
                let f = ck.flops();
                (Kind::Kernel { k: ck, ins, outs }, f)
            }
            LaunchOp::Gather(g) => {
                f32_only("gather")?;
                (Kind::Gather(*g), 0)
            }
            LaunchOp::ScatterAdd(s) => {
                f32_only("scatter_add")?;
                (Kind::ScatterAdd(*s), l.flops)
            }
            LaunchOp::Attention(attn) => {
                let dm = attn.dims;
                let gemm = (2 * dm.s * dm.h * dm.t * dm.t * dm.d) as u64;
                use AttnStage::*;
                // (stages, the launch's name after them, how many products of `gemm` FLOPs they run)
                let (stages, name, products): (&'static [AttnStage], &str, u64) = if attn.forward {
                    (&[Scores, Softmax { recompute: false }, Values], "gemm_attn_scores_softmax_values", 2)
                } else if keep {
                    (&[GradDp, GradDs, GradQkv], "gemm_attn_dp_softmax_grad_dqkv", 4)
                } else {
                    (&[Scores, Softmax { recompute: true }, GradDp, GradDs, GradQkv], "gemm_attn_scores_softmax_dp_softmax_grad_dqkv", 5)
                };
                if !matches!(attn.dtype, DType::F32 | DType::BF16) {
                    return Err(l.err(format!("attention on {} storage is not supported by the CPU target", attn.dtype)));
                }
                let kind = Kind::Attention { stages, attn: *attn, keep };
                out.push(Launch { kind, name: name.into(), bytes: l.bytes, flops: products * gemm, ops: l.ops.clone() });
                continue;
            }
            LaunchOp::Iota(i) => (Kind::Iota(i.clone()), 0),
            LaunchOp::Fill(f) => (Kind::Fill(*f), 0),
            LaunchOp::Collective(parts) => (Kind::Collective(parts.clone()), 0),
        };
        out.push(Launch { kind, name: l.name.clone(), bytes: l.bytes, flops, ops: l.ops.clone() });
    }
    Ok(out)
}
