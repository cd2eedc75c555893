//! A program turned into a flat list of launches with resolved byte offsets, built once per run:
//! executing a step walks the list and allocates nothing.

use std::sync::Arc;

use fusec_codegen_cpu::{CompiledKernel, KernelCompiler};
use fusec_ir::{Bindings, DType, GemmSpec, Graph, Op, ValueId};
use fusec_passes::memplan::MemPlan;

use super::layout::SharedLayout;
use super::ops::{AttnDims, AttnStage};

/// Byte offsets of the tensors an attention stage touches.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnOffsets {
    /// Packed projections.
    pub qkv: u64,
    /// Forward output.
    pub out: u64,
    /// Log-sum-exp.
    pub lse: u64,
    /// Output gradient (backward).
    pub dout: Option<u64>,
    /// Projection gradient (backward).
    pub dqkv: Option<u64>,
}

/// What one launch does; offsets are bytes into the shared allocation.
pub enum Kind {
    /// A matmul with its epilogue.
    Gemm { spec: GemmSpec, a: u64, b: u64, bias: Option<u64>, acc: Option<u64>, y: u64, pre: Option<u64> },
    /// A Cranelift-compiled fused kernel, with its operand and result addresses.
    Kernel { k: Arc<CompiledKernel>, ins: Vec<*const u8>, outs: Vec<*mut u8> },
    /// Embedding lookup.
    Gather { table: u64, rows: usize, cols: usize, idx: u64, n: usize, out: u64 },
    /// Embedding gradient.
    ScatterAdd { src: u64, cols: usize, idx: u64, n: usize, out: u64, rows: usize },
    /// One stage of causal attention; offsets of unused tensors are `None`.
    Attention { stage: AttnStage, dm: AttnDims, scale: f32, t: AttnOffsets },
    /// Index fill along an axis: `shape` concrete, element = index on `axis`.
    Iota { shape: Vec<usize>, axis: usize, dtype: DType, out: u64 },
    /// Constant fill.
    Fill { value: f64, dtype: DType, n: usize, out: u64 },
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
}

/// The launches of `g` under `plan`, compiling kernels through `kc`.
pub fn launches(
    g: &Graph,
    plan: &MemPlan,
    layout: &SharedLayout,
    bind: &Bindings,
    kc: &mut KernelCompiler,
    base: *mut u8,
) -> Result<Vec<Launch>, String> {
    let off = |v: ValueId| layout.offset(g, plan, v);
    let dims = |v: ValueId| g.ty(v).shape.eval(bind).map(|d| d.into_iter().map(|x| x as usize).collect::<Vec<_>>());
    let bytes_of = |v: ValueId| g.ty(v).bytes(bind).map(|b| b as u64);
    let mut out = vec![];
    for (i, n) in g.nodes.iter().enumerate() {
        let io_bytes = || -> Result<u64, String> { n.inputs.iter().chain(&n.results).map(|v| bytes_of(*v)).sum() };
        let err = |m: String| format!("node {i} (`{}`): {m}", n.op.mnemonic());
        for v in n.inputs.iter().chain(&n.results) {
            let dt = g.ty(*v).dtype;
            if dt == DType::BF16 || dt == DType::F16 {
                return Err(err(format!("{dt} storage is not supported by the CPU target yet (use --precision fp32)")));
            }
        }
        let (kind, name, flops) = match &n.op {
            Op::Param { .. } | Op::Input { .. } | Op::Reshape { .. } => continue,
            Op::MatMul { trans_a, trans_b } => {
                let spec = gemm_spec(g, bind, n.inputs[0], n.inputs[1], n.results[0], *trans_a, *trans_b).map_err(err)?;
                let f = spec.flops();
                (
                    Kind::Gemm {
                        spec,
                        a: off(n.inputs[0])?,
                        b: off(n.inputs[1])?,
                        bias: None,
                        acc: None,
                        y: off(n.results[0])?,
                        pre: None,
                    },
                    "matmul".to_string(),
                    f,
                )
            }
            Op::Gemm(gm) => {
                let mut spec = gemm_spec(g, bind, n.inputs[0], n.inputs[1], n.results[0], gm.trans_a, gm.trans_b).map_err(err)?;
                (spec.bias, spec.gelu, spec.accumulate) = (gm.bias, gm.gelu, gm.accumulate);
                let bias = if gm.bias { Some(off(n.inputs[2])?) } else { None };
                let acc = if gm.accumulate { Some(off(*n.inputs.last().expect("gemm has operands"))?) } else { None };
                let pre = if gm.gelu { Some(off(n.results[1])?) } else { None };
                let name = gm.launch_name();
                let f = spec.flops();
                (Kind::Gemm { spec, a: off(n.inputs[0])?, b: off(n.inputs[1])?, bias, acc, y: off(n.results[0])?, pre }, name, f)
            }
            Op::Kernel(k) => {
                let ck = kc.compile(k, bind).map_err(|e| err(format!("kernel `{}`: {e}", k.name)))?;
                // SAFETY: every offset lies inside the allocation at `base` (the plan's size).
                let ins =
                    n.inputs.iter().map(|v| off(*v).map(|o| unsafe { base.add(o as usize) as *const u8 })).collect::<Result<_, _>>()?;
                let outs = n.results.iter().map(|v| off(*v).map(|o| unsafe { base.add(o as usize) })).collect::<Result<_, _>>()?;
                let f = ck.flops();
                (Kind::Kernel { k: ck, ins, outs }, k.name.clone(), f)
            }
            Op::Gather => {
                let t = dims(n.inputs[0]).map_err(err)?;
                let idx = dims(n.inputs[1]).map_err(err)?.iter().product();
                (
                    Kind::Gather {
                        table: off(n.inputs[0])?,
                        rows: t[0],
                        cols: t[1],
                        idx: off(n.inputs[1])?,
                        n: idx,
                        out: off(n.results[0])?,
                    },
                    "gather".into(),
                    0,
                )
            }
            Op::ScatterAdd { .. } => {
                let o = dims(n.results[0]).map_err(err)?;
                let idx = dims(n.inputs[1]).map_err(err)?.iter().product();
                let kind = Kind::ScatterAdd {
                    src: off(n.inputs[0])?,
                    cols: o[1],
                    idx: off(n.inputs[1])?,
                    n: idx,
                    out: off(n.results[0])?,
                    rows: o[0],
                };
                (kind, "scatter_add".into(), (idx * o[1]) as u64)
            }
            Op::Attention { heads, scale } | Op::AttentionGrad { heads, scale } => {
                let q = dims(n.inputs[0]).map_err(err)?;
                let r = q.len();
                let h = *heads as usize;
                let dm = AttnDims { s: q[..r - 2].iter().product(), t: q[r - 2], h, d: q[r - 1] / 3 / h };
                let gemm_flops = (2 * dm.s * dm.h * dm.t * dm.t * dm.d) as u64;
                let (scale, io) = (*scale as f32, io_bytes()?);
                let forward = matches!(n.op, Op::Attention { .. });
                let t = if forward {
                    AttnOffsets { qkv: off(n.inputs[0])?, out: off(n.results[0])?, lse: off(n.results[1])?, dout: None, dqkv: None }
                } else {
                    let (dout, dqkv) = (Some(off(n.inputs[3])?), Some(off(n.results[0])?));
                    AttnOffsets { qkv: off(n.inputs[0])?, out: off(n.inputs[1])?, lse: off(n.inputs[2])?, dout, dqkv }
                };
                let stages: &[(AttnStage, &str, u64)] = if forward {
                    &[
                        (AttnStage::Scores, "gemm_attn_scores", gemm_flops),
                        (AttnStage::Softmax { recompute: false }, "attn_softmax", 0),
                        (AttnStage::Values, "gemm_attn_values", gemm_flops),
                    ]
                } else {
                    &[
                        (AttnStage::Scores, "gemm_attn_scores", gemm_flops),
                        (AttnStage::Softmax { recompute: true }, "attn_softmax", 0),
                        (AttnStage::GradDp, "gemm_attn_dp", gemm_flops),
                        (AttnStage::GradDs, "attn_softmax_grad", 0),
                        (AttnStage::GradQkv, "gemm_attn_dqkv", 3 * gemm_flops),
                    ]
                };
                for &(stage, name, flops) in stages {
                    out.push(Launch { kind: Kind::Attention { stage, dm, scale, t }, name: name.into(), bytes: io, flops });
                }
                continue;
            }
            Op::Iota { axis, ty } => (
                Kind::Iota { shape: dims(n.results[0]).map_err(err)?, axis: *axis, dtype: ty.dtype, out: off(n.results[0])? },
                "iota".into(),
                0,
            ),
            Op::Const { value, ty } => {
                let cnt = dims(n.results[0]).map_err(err)?.iter().product();
                (Kind::Fill { value: *value, dtype: ty.dtype, n: cnt, out: off(n.results[0])? }, "fill".into(), 0)
            }
            other => return Err(err(format!("`{}` outside a fused kernel has no CPU implementation", other.mnemonic()))),
        };
        out.push(Launch { kind, name, bytes: io_bytes()?, flops });
    }
    Ok(out)
}

/// The GEMM shape of `y = op(a) op(b)` (the CUDA target uses it too).
pub(crate) fn gemm_spec(g: &Graph, bind: &Bindings, a: ValueId, b: ValueId, y: ValueId, ta: bool, tb: bool) -> Result<GemmSpec, String> {
    let ev = |v: ValueId| g.ty(v).shape.eval(bind);
    let (ad, bd, yd) = (ev(a)?, ev(b)?, ev(y)?);
    let r = yd.len();
    let k = if ta { ad[ad.len() - 2] } else { ad[ad.len() - 1] };
    let mut spec = GemmSpec::new(yd[r - 2], yd[r - 1], k);
    spec.batch = yd[..r - 2].iter().product();
    (spec.trans_a, spec.trans_b) = (ta, tb);
    spec.b_shared = bd.len() == 2 && ad.len() > 2;
    Ok(spec)
}
