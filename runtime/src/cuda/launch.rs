//! A program turned into a flat list of launches, built once per run, as on the CPU: each
//! launch is a few *steps* (cuBLAS calls, kernel launches, memsets, copies) with every address
//! resolved to a place in the one allocation.
//!
//! Addresses are [`Addr`]s — an offset into the planned region (persistent tensors, then the
//! arena), into the shared scratch region (column partials, attention score matrices, a GEMM
//! epilogue's temporary: launches run one at a time on one stream, so they share it), or into
//! the static region (pointer tables: attention's batched-GEMM arrays, the operand table of
//! kernels with too many operands for kernel parameters, the error word) — so the list can be
//! built before the allocation exists.

use std::collections::HashMap;
use std::sync::Arc;

use crate::cpu::launch::gemm_spec;
use cudarc::driver::sys::CUfunction;
use fusec_codegen_cuda::gemm::{batched, row_major, Batched, ColMajor};
use fusec_codegen_cuda::{flash, KernelSource};
use fusec_ir::{Bindings, DType, Graph, Op, ValueId};
use fusec_passes::memplan::MemPlan;

use crate::cpu::layout::SharedLayout;
use crate::cuda::lt::{Epilogue, LtPlans};

/// A place in the one allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Addr {
    /// Byte offset into the planned region (persistent + arena).
    Plan(u64),
    /// Byte offset into the scratch region.
    Scratch(u64),
    /// Byte offset into the static region.
    Static(u64),
}

/// A kernel argument.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    Ptr(Addr),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// One call on the stream.
pub(crate) enum Step {
    /// A strided-batched cuBLAS product (`c = b_op a_op`, column-major view), `beta` 0 or 1;
    /// `bf16`: the operands are bf16 (fp32 accumulation and result).
    Gemm { g: Batched, a: Addr, b: Addr, c: Addr, beta: f32, bf16: bool },
    /// A cuBLASLt product with its epilogue: plan `plan` of the builder's list (operands as in
    /// `Gemm`; `aux` is GELU's pre-activation, unused for a bias alone).
    GemmLt { plan: usize, a: Addr, b: Addr, c: Addr, bias: Addr, aux: Addr },
    /// A pointer-array batched product; the `A`, `B`, `C` arrays follow each other at `arrays`.
    GemmArrays { call: ColMajor, arrays: Addr, batch: i32 },
    /// A kernel launch.
    Kernel { f: CUfunction, grid: [u32; 3], block: [u32; 3], args: Vec<Arg> },
    /// `n` 32-bit words set to `bits`.
    Fill32 { dst: Addr, bits: u32, n: usize },
    /// A device-to-device copy.
    Copy { dst: Addr, src: Addr, bytes: u64 },
}

/// One launch: its steps, the name the profiler shows, static byte and FLOP counts.
pub(crate) struct Launch {
    pub steps: Vec<Step>,
    pub name: String,
    pub bytes: u64,
    pub flops: u64,
}

/// The hand-written kernels' entries.
pub(crate) struct Native {
    pub gather: CUfunction,
    pub scatter_add: CUfunction,
    pub attn_softmax: CUfunction,
    pub attn_probs: CUfunction,
    pub attn_dscores: CUfunction,
    pub iota_f32: CUfunction,
    pub iota_i32: CUfunction,
    pub gemm_epilogue: CUfunction,
    /// The flash-attention entries ([`fusec_codegen_cuda::flash::ENTRIES`]) per head size.
    pub flash: HashMap<usize, [CUfunction; 3]>,
}

/// Entry names of [`Native`], in field order.
pub(crate) const NATIVE_ENTRIES: [&str; 8] = [
    "fusec_gather",
    "fusec_scatter_add",
    "fusec_attn_softmax",
    "fusec_attn_probs",
    "fusec_attn_dscores",
    "fusec_iota_f32",
    "fusec_iota_i32",
    "fusec_gemm_epilogue",
];

/// A compiled fused kernel: its source (launch rules) and one function per rule.
pub(crate) struct Loaded {
    pub src: Arc<KernelSource>,
    pub funcs: Vec<CUfunction>,
}

/// What building launches accumulates across programs.
pub(crate) struct Builder<'a> {
    pub native: &'a Native,
    /// Static region, in 8-byte words: pointers to resolve (`None`: zero).
    pub words: Vec<Option<Addr>>,
    /// Bytes of scratch the largest launch needs.
    pub scratch: u64,
    /// cuBLASLt plans for fused bias / GELU epilogues, when cuBLASLt is used.
    pub lt: Option<LtPlans>,
}

/// The static word holding the error flag of gather and scatter-add (three i32s, zeroed).
pub(crate) const ERR_WORDS: usize = 2;

/// The head sizes of the attention nodes of `graphs`.
pub(crate) fn attention_head_sizes<'a>(graphs: impl IntoIterator<Item = &'a Graph>, bind: &Bindings) -> Vec<usize> {
    let mut out = vec![];
    for g in graphs {
        for n in &g.nodes {
            if let Op::Attention { heads, .. } | Op::AttentionGrad { heads, .. } = n.op {
                if let Ok(q) = g.ty(n.inputs[0]).shape.eval(bind) {
                    let d = q[q.len() - 1] / 3 / (heads as usize).max(1);
                    if !out.contains(&d) {
                        out.push(d);
                    }
                }
            }
        }
    }
    out.sort_unstable();
    out
}

fn blocks(n: u64, per: u64) -> [u32; 3] {
    [n.div_ceil(per).max(1) as u32, 1, 1]
}

impl Builder<'_> {
    fn table(&mut self, ptrs: impl IntoIterator<Item = Addr>) -> Addr {
        let at = Addr::Static(self.words.len() as u64 * 8);
        self.words.extend(ptrs.into_iter().map(Some));
        at
    }

    fn need_scratch(&mut self, bytes: u64) {
        self.scratch = self.scratch.max(bytes.div_ceil(256) * 256);
    }

    /// The launches of `g` under `plan`; `kernels(i)` is the compiled kernel of node `i`.
    pub fn launches(
        &mut self,
        g: &Graph,
        plan: &MemPlan,
        layout: &SharedLayout,
        bind: &Bindings,
        kernels: &dyn Fn(usize) -> Option<Loaded>,
    ) -> Result<Vec<Launch>, String> {
        let off = |v: ValueId| layout.offset(g, plan, v).map(Addr::Plan);
        let dims = |v: ValueId| g.ty(v).shape.eval(bind).map(|d| d.into_iter().collect::<Vec<usize>>());
        let bytes_of = |v: ValueId| g.ty(v).bytes(bind).map(|b| b as u64);
        let err_flag = Addr::Static(0);
        let mut out = vec![];
        for (i, n) in g.nodes.iter().enumerate() {
            let io_bytes = n.inputs.iter().chain(&n.results).map(|v| bytes_of(*v)).sum::<Result<u64, String>>()?;
            let err = |m: String| format!("node {i} (`{}`): {m}", n.op.mnemonic());
            // bf16 operands of products (the `amp` pass's casts) read as bf16 by cuBLAS.
            let product = matches!(n.op, Op::MatMul { .. } | Op::Gemm(_));
            let bf16 = product && g.ty(n.inputs[0]).dtype == DType::BF16;
            if product && g.ty(n.inputs[1]).dtype != g.ty(n.inputs[0]).dtype {
                return Err(err(format!("a product of {} and {} operands", g.ty(n.inputs[0]).dtype, g.ty(n.inputs[1]).dtype)));
            }
            // Reshapes are views (no launch), of any dtype.
            if !matches!(n.op, Op::Kernel(_) | Op::Reshape { .. }) {
                let operands = if bf16 { 2 } else { 0 };
                for v in n.inputs.iter().skip(operands).chain(&n.results) {
                    let dt = g.ty(*v).dtype;
                    if dt == DType::BF16 || dt == DType::F16 {
                        return Err(err(format!(
                            "{dt} storage outside fused kernels is not supported by the CUDA target yet (use --precision fp32)"
                        )));
                    }
                }
            }
            let mut push =
                |steps: Vec<Step>, name: &str, flops: u64| out.push(Launch { steps, name: name.to_string(), bytes: io_bytes, flops });
            match &n.op {
                Op::Param { .. } | Op::Input { .. } | Op::Reshape { .. } => {}
                Op::MatMul { trans_a, trans_b } => {
                    let spec = gemm_spec(g, bind, n.inputs[0], n.inputs[1], n.results[0], *trans_a, *trans_b).map_err(err)?;
                    let b = batched(&spec).map_err(err)?;
                    let step = Step::Gemm { g: b, a: off(n.inputs[0])?, b: off(n.inputs[1])?, c: off(n.results[0])?, beta: 0.0, bf16 };
                    push(vec![step], "matmul", spec.flops());
                }
                Op::Gemm(gm) => {
                    let spec = gemm_spec(g, bind, n.inputs[0], n.inputs[1], n.results[0], gm.trans_a, gm.trans_b).map_err(err)?;
                    if gm.out != DType::F32 {
                        return Err(err(format!("a {} GEMM result is not supported by the CUDA target yet", gm.out)));
                    }
                    let bg = batched(&spec).map_err(err)?;
                    let (a, b, y) = (off(n.inputs[0])?, off(n.inputs[1])?, off(n.results[0])?);
                    let bias = if gm.bias { Some(off(n.inputs[2])?) } else { None };
                    let acc = if gm.accumulate { Some(off(*n.inputs.last().expect("gemm has operands"))?) } else { None };
                    let pre = if gm.gelu { Some(off(n.results[1])?) } else { None };
                    let name = gm.launch_name();
                    let mut steps = vec![];
                    let total = spec.y_len() as u64;
                    let lt = match self.lt.as_mut() {
                        Some(lt) if gm.bias && !gm.accumulate && bg.batch == 1 && !bf16 => {
                            lt.plan(&bg.call, if gm.gelu { Epilogue::GeluAuxBias } else { Epilogue::Bias }).map_err(err)?
                        }
                        _ => None,
                    };
                    if let Some(plan) = lt {
                        let (bias, aux) = (bias.expect("a bias"), pre.unwrap_or(y));
                        steps.push(Step::GemmLt { plan, a, b, c: y, bias, aux });
                    } else if !gm.bias && !gm.gelu {
                        if let Some(acc) = acc.filter(|&acc| acc != y) {
                            steps.push(Step::Copy { dst: y, src: acc, bytes: total * 4 });
                        }
                        steps.push(Step::Gemm { g: bg, a, b, c: y, beta: if gm.accumulate { 1.0 } else { 0.0 }, bf16 });
                    } else {
                        // The product into `y` (or scratch when `y` must first be read as the
                        // accumulator), then bias / GELU / accumulate in one pass.
                        let src = if acc.is_some() {
                            self.need_scratch(total * 4);
                            Addr::Scratch(0)
                        } else {
                            y
                        };
                        steps.push(Step::Gemm { g: bg, a, b, c: src, beta: 0.0, bf16 });
                        let flags = gm.bias as i32 | (gm.gelu as i32) << 1 | (gm.accumulate as i32) << 2;
                        let zero = Arg::Ptr(src);
                        let args = vec![
                            Arg::Ptr(y),
                            Arg::Ptr(src),
                            bias.map_or(zero, Arg::Ptr),
                            pre.map_or(zero, Arg::Ptr),
                            acc.map_or(zero, Arg::Ptr),
                            Arg::I64(total as i64),
                            Arg::I32(spec.n as i32),
                            Arg::I32(flags),
                        ];
                        steps.push(Step::Kernel { f: self.native.gemm_epilogue, grid: blocks(total, 256), block: [256, 1, 1], args });
                    }
                    push(steps, &name, spec.flops());
                }
                Op::Kernel(k) => {
                    let l = kernels(i).ok_or_else(|| err(format!("kernel `{}` was not compiled", k.name)))?;
                    self.need_scratch(l.src.scratch_bytes);
                    let mut ptrs: Vec<Addr> = n.inputs.iter().map(|v| off(*v)).collect::<Result<_, _>>()?;
                    for v in &n.results {
                        ptrs.push(off(*v)?);
                    }
                    let args: Vec<Arg> = if l.src.param_table {
                        vec![Arg::Ptr(self.table(ptrs)), Arg::Ptr(Addr::Scratch(0))]
                    } else {
                        ptrs.into_iter().map(Arg::Ptr).chain([Arg::Ptr(Addr::Scratch(0))]).collect()
                    };
                    let steps = l
                        .src
                        .launches
                        .iter()
                        .zip(&l.funcs)
                        .map(|(r, f)| Step::Kernel { f: *f, grid: r.grid, block: r.block, args: args.clone() })
                        .collect();
                    push(steps, &k.name, l.src.flops);
                }
                Op::Gather => {
                    let t = dims(n.inputs[0]).map_err(err)?;
                    let cnt: usize = dims(n.inputs[1]).map_err(err)?.iter().product();
                    let args = vec![
                        Arg::Ptr(off(n.inputs[0])?),
                        Arg::Ptr(off(n.inputs[1])?),
                        Arg::Ptr(off(n.results[0])?),
                        Arg::I32(t[0] as i32),
                        Arg::I32(t[1] as i32),
                        Arg::I64(cnt as i64),
                        Arg::Ptr(err_flag),
                    ];
                    let f = self.native.gather;
                    push(vec![Step::Kernel { f, grid: blocks((cnt * t[1]) as u64, 256), block: [256, 1, 1], args }], "gather", 0);
                }
                Op::ScatterAdd { .. } => {
                    let o = dims(n.results[0]).map_err(err)?;
                    let cnt: usize = dims(n.inputs[1]).map_err(err)?.iter().product();
                    let args = vec![
                        Arg::Ptr(off(n.inputs[0])?),
                        Arg::Ptr(off(n.inputs[1])?),
                        Arg::Ptr(off(n.results[0])?),
                        Arg::I32(o[0] as i32),
                        Arg::I32(o[1] as i32),
                        Arg::I32(cnt as i32),
                        Arg::Ptr(err_flag),
                    ];
                    let grid = blocks(o[0] as u64, fusec_codegen_cuda::native::SCATTER_ROWS as u64);
                    push(
                        vec![Step::Kernel { f: self.native.scatter_add, grid, block: [256, 1, 1], args }],
                        "scatter_add",
                        (cnt * o[1]) as u64,
                    );
                }
                Op::Attention { heads, scale } | Op::AttentionGrad { heads, scale } => {
                    let q = dims(n.inputs[0]).map_err(err)?;
                    let r = q.len();
                    let (s, t, h) = (q[..r - 2].iter().product::<usize>(), q[r - 2], *heads as usize);
                    let (d, c) = (q[r - 1] / 3 / h, q[r - 1] / 3);
                    let forward = matches!(n.op, Op::Attention { .. });
                    let (qkv, out_v, lse) = if forward {
                        (off(n.inputs[0])?, off(n.results[0])?, off(n.results[1])?)
                    } else {
                        (off(n.inputs[0])?, off(n.inputs[1])?, off(n.inputs[2])?)
                    };
                    let plan_off = |a: Addr| match a {
                        Addr::Plan(o) => o,
                        _ => unreachable!("planned"),
                    };
                    if let Some(f) = self.native.flash.get(&d) {
                        let (scale, tiles) = (*scale as f32, (t as u32).div_ceil(flash::TILE));
                        let (grid, block) = ([tiles, h as u32, s as u32], [flash::THREADS, 1, 1]);
                        // Products done, the causal half: 2 forward, 3 for dq and 4 for dk, dv.
                        let half = (s * h * t * t * d) as u64;
                        let (ti, hi) = (Arg::I32(t as i32), Arg::I32(h as i32));
                        if forward {
                            let args = vec![Arg::Ptr(qkv), Arg::Ptr(out_v), Arg::Ptr(lse), ti, hi, Arg::F32(scale)];
                            push(vec![Step::Kernel { f: f[0], grid, block, args }], "flash_attention", 2 * half);
                        } else {
                            let (dout, dqkv) = (off(n.inputs[3])?, off(n.results[0])?);
                            self.need_scratch((s * h * t * 4) as u64);
                            let dsum = Arg::Ptr(Addr::Scratch(0));
                            let args = vec![
                                Arg::Ptr(qkv),
                                Arg::Ptr(out_v),
                                Arg::Ptr(lse),
                                Arg::Ptr(dout),
                                Arg::Ptr(dqkv),
                                dsum,
                                ti,
                                hi,
                                Arg::F32(scale),
                            ];
                            push(vec![Step::Kernel { f: f[1], grid, block, args }], "flash_attention_grad_q", 3 * half);
                            let args = vec![Arg::Ptr(qkv), Arg::Ptr(lse), Arg::Ptr(dout), dsum, Arg::Ptr(dqkv), ti, hi, Arg::F32(scale)];
                            push(vec![Step::Kernel { f: f[2], grid, block, args }], "flash_attention_grad_kv", 4 * half);
                        }
                        continue;
                    }
                    let (bh, tt) = (s * h, (t * t) as u64);
                    let p_bytes = bh as u64 * tt * 4;
                    self.need_scratch(if forward { p_bytes } else { 2 * p_bytes });
                    let (p, dp) = (0u64, p_bytes);
                    // Per (batch row, head): its q, k, v (row stride 3C), its score matrix, its
                    // output columns (row stride C).
                    let head = |base: Addr, stride: usize, part: usize| -> Vec<Addr> {
                        (0..bh)
                            .map(|b| {
                                let (si, hi) = (b / h, b % h);
                                Addr::Plan(plan_off(base) + 4 * (si * t * stride + part * c + hi * d) as u64)
                            })
                            .collect()
                    };
                    let scores = |o: u64| -> Vec<Addr> { (0..bh as u64).map(|b| Addr::Scratch(o + b * tt * 4)).collect() };
                    let (qs, ks, vs) = (head(qkv, 3 * c, 0), head(qkv, 3 * c, 1), head(qkv, 3 * c, 2));
                    let arrays = |this: &mut Self, a: Vec<Addr>, b: Vec<Addr>, cc: Vec<Addr>| this.table(a.into_iter().chain(b).chain(cc));
                    let flops = (2 * bh * t * t * d) as u64;
                    let nrows = (bh * t) as i64;
                    let rows_grid = blocks(nrows as u64, fusec_codegen_cuda::native::ATTN_ROWS_PER_BLOCK as u64);
                    // scores = q k^T (cuBLAS A = k, B = q).
                    let sc = row_major(t, t, d, false, true, 3 * c, 3 * c, t).map_err(err)?;
                    let sc_arr = arrays(self, ks.clone(), qs.clone(), scores(p));
                    push(vec![Step::GemmArrays { call: sc, arrays: sc_arr, batch: bh as i32 }], "gemm_attn_scores", flops);
                    let scale = *scale as f32;
                    if forward {
                        let args = vec![Arg::Ptr(Addr::Scratch(p)), Arg::Ptr(lse), Arg::I32(t as i32), Arg::I64(nrows), Arg::F32(scale)];
                        push(
                            vec![Step::Kernel { f: self.native.attn_softmax, grid: rows_grid, block: [256, 1, 1], args }],
                            "attn_softmax",
                            0,
                        );
                        // out = p v (cuBLAS A = v, B = p).
                        let pv = row_major(t, d, t, false, false, t, 3 * c, c).map_err(err)?;
                        let pv_arr = arrays(self, vs, scores(p), head(out_v, c, 0));
                        push(vec![Step::GemmArrays { call: pv, arrays: pv_arr, batch: bh as i32 }], "gemm_attn_values", flops);
                    } else {
                        let (dout, dqkv) = (off(n.inputs[3])?, off(n.results[0])?);
                        let args = vec![Arg::Ptr(Addr::Scratch(p)), Arg::Ptr(lse), Arg::I32(t as i32), Arg::I64(nrows), Arg::F32(scale)];
                        push(
                            vec![Step::Kernel { f: self.native.attn_probs, grid: rows_grid, block: [256, 1, 1], args }],
                            "attn_softmax",
                            0,
                        );
                        // dp = dout v^T (cuBLAS A = v, B = dout).
                        let dpc = row_major(t, t, d, false, true, c, 3 * c, t).map_err(err)?;
                        let dp_arr = arrays(self, vs.clone(), head(dout, c, 0), scores(dp));
                        push(vec![Step::GemmArrays { call: dpc, arrays: dp_arr, batch: bh as i32 }], "gemm_attn_dp", flops);
                        let args = vec![
                            Arg::Ptr(Addr::Scratch(p)),
                            Arg::Ptr(Addr::Scratch(dp)),
                            Arg::Ptr(out_v),
                            Arg::Ptr(dout),
                            Arg::I32(t as i32),
                            Arg::I32(h as i32),
                            Arg::I32(d as i32),
                            Arg::I64(nrows),
                            Arg::F32(scale),
                        ];
                        push(
                            vec![Step::Kernel { f: self.native.attn_dscores, grid: rows_grid, block: [256, 1, 1], args }],
                            "attn_softmax_grad",
                            0,
                        );
                        // dq = ds k, dk = ds^T q, dv = p^T dout.
                        let dq = row_major(t, d, t, false, false, t, 3 * c, 3 * c).map_err(err)?;
                        let dk = row_major(t, d, t, true, false, t, 3 * c, 3 * c).map_err(err)?;
                        let dv = row_major(t, d, t, true, false, t, c, 3 * c).map_err(err)?;
                        let dq_arr = arrays(self, ks, scores(dp), head(dqkv, 3 * c, 0));
                        let dk_arr = arrays(self, qs, scores(dp), head(dqkv, 3 * c, 1));
                        let dv_arr = arrays(self, head(dout, c, 0), scores(p), head(dqkv, 3 * c, 2));
                        let b = bh as i32;
                        let steps = vec![
                            Step::GemmArrays { call: dq, arrays: dq_arr, batch: b },
                            Step::GemmArrays { call: dk, arrays: dk_arr, batch: b },
                            Step::GemmArrays { call: dv, arrays: dv_arr, batch: b },
                        ];
                        push(steps, "gemm_attn_dqkv", 3 * flops);
                    }
                }
                Op::Iota { axis, ty } => {
                    let shape = dims(n.results[0]).map_err(err)?;
                    let cnt: usize = shape.iter().product();
                    let inner: usize = shape[axis + 1..].iter().product();
                    let f = if ty.dtype == DType::I32 { self.native.iota_i32 } else { self.native.iota_f32 };
                    let args =
                        vec![Arg::Ptr(off(n.results[0])?), Arg::I64(cnt as i64), Arg::I64(inner as i64), Arg::I64(shape[*axis] as i64)];
                    push(vec![Step::Kernel { f, grid: blocks(cnt as u64, 256), block: [256, 1, 1], args }], "iota", 0);
                }
                Op::Const { value, ty } => {
                    let cnt: usize = dims(n.results[0]).map_err(err)?.iter().product();
                    let dst = off(n.results[0])?;
                    let step = match ty.dtype {
                        DType::I32 => Step::Fill32 { dst, bits: fusec_ir::interp::round_to(DType::I32, *value) as i32 as u32, n: cnt },
                        DType::F32 => Step::Fill32 { dst, bits: (*value as f32).to_bits(), n: cnt },
                        d => return Err(err(format!("a {d} constant outside a fused kernel"))),
                    };
                    push(vec![step], "fill", 0);
                }
                other => return Err(err(format!("`{}` outside a fused kernel has no CUDA implementation", other.mnemonic()))),
            }
        }
        Ok(out)
    }
}
