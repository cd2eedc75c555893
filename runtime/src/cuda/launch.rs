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

use cudarc::driver::sys::CUfunction;
use fusec_codegen_cuda::gemm::{batched, Batched, ColMajor};
use fusec_codegen_cuda::KernelSource;
use fusec_ir::DType;

use crate::cuda::lt::{Epilogue, LtPlans};
use crate::launches::{self, LaunchOp, Product};

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
    /// The flash-attention entries ([`fusec_codegen_cuda::flash::ENTRIES`]) per head size and
    /// storage type of `qkv`.
    pub flash: HashMap<(usize, DType), [CUfunction; 3]>,
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

/// The (head size, storage of `qkv`) pairs of the attention launches of a launch plan, sorted.
pub(crate) fn attention_kinds(plan: &launches::LaunchPlan) -> Vec<(usize, DType)> {
    let mut out = vec![];
    for (_, launches, _) in &plan.programs {
        for l in launches {
            if let LaunchOp::Attention(a) = &l.op {
                if !out.contains(&(a.dims.d, a.dtype)) {
                    out.push((a.dims.d, a.dtype));
                }
            }
        }
    }
    out.sort_unstable();
    out
}

pub(crate) fn blocks(n: u64, per: u64) -> [u32; 3] {
    [n.div_ceil(per).max(1) as u32, 1, 1]
}

impl Builder<'_> {
    /// `ptrs` as a table of 8-byte words in the static region.
    pub(crate) fn table(&mut self, ptrs: impl IntoIterator<Item = Addr>) -> Addr {
        let at = Addr::Static(self.words.len() as u64 * 8);
        self.words.extend(ptrs.into_iter().map(Some));
        at
    }

    /// Makes the shared scratch region at least `bytes` long.
    pub(crate) fn need_scratch(&mut self, bytes: u64) {
        self.scratch = self.scratch.max(bytes.div_ceil(256) * 256);
    }

    /// The CUDA launches of a program's launch plan; `kernels(i)` is the compiled kernel of
    /// launch `i`.
    pub fn translate(&mut self, plan: &[launches::Launch], kernels: &dyn Fn(usize) -> Option<Loaded>) -> Result<Vec<Launch>, String> {
        let err_flag = Addr::Static(0);
        let mut out = vec![];
        for (i, l) in plan.iter().enumerate() {
            let err = |m: String| l.err(m);
            let product = matches!(l.op, LaunchOp::Product(_));
            // bf16 operands of products (the `amp` pass's casts) are read as bf16 by cuBLAS.
            let bf16 = product && l.dtypes[0] == DType::BF16;
            if product && l.dtypes[1] != l.dtypes[0] {
                return Err(err(format!("a product of {} and {} operands", l.dtypes[0], l.dtypes[1])));
            }
            // Products and attention read and write bf16 themselves; other launches are f32/i32.
            if !matches!(l.op, LaunchOp::Kernel { .. } | LaunchOp::Product(_) | LaunchOp::Attention(_)) {
                if let Some(dt) = l.dtypes.iter().find(|d| matches!(d, DType::BF16 | DType::F16)) {
                    return Err(err(format!(
                        "{dt} storage outside fused kernels is not supported by the CUDA target yet (use --precision fp32)"
                    )));
                }
            }
            let mut push = |steps: Vec<Step>, name: &str, flops: u64| {
                out.push(Launch { steps, name: name.to_string(), bytes: l.bytes, flops });
            };
            let p = |o: u64| Arg::Ptr(Addr::Plan(o));
            match &l.op {
                LaunchOp::Product(pr) => {
                    let steps = self.product(pr, bf16, l.name != "matmul").map_err(err)?;
                    push(steps, &l.name, l.flops);
                }
                LaunchOp::Kernel { kernel, ins, outs } => {
                    let k = kernels(i).ok_or_else(|| err(format!("kernel `{}` was not compiled", kernel.name)))?;
                    self.need_scratch(k.src.scratch_bytes);
                    let ptrs: Vec<Addr> = ins.iter().chain(outs).map(|&o| Addr::Plan(o)).collect();
                    let args: Vec<Arg> = if k.src.param_table {
                        vec![Arg::Ptr(self.table(ptrs)), Arg::Ptr(Addr::Scratch(0))]
                    } else {
                        ptrs.into_iter().map(Arg::Ptr).chain([Arg::Ptr(Addr::Scratch(0))]).collect()
                    };
                    let steps = k
                        .src
                        .launches
                        .iter()
                        .zip(&k.funcs)
                        .map(|(r, f)| Step::Kernel { f: *f, grid: r.grid, block: r.block, args: args.clone() })
                        .collect();
                    push(steps, &kernel.name, k.src.flops);
                }
                LaunchOp::Gather(g) => {
                    let args = vec![
                        p(g.table),
                        p(g.idx),
                        p(g.out),
                        Arg::I32(g.rows as i32),
                        Arg::I32(g.cols as i32),
                        Arg::I64(g.n as i64),
                        Arg::Ptr(err_flag),
                    ];
                    let f = self.native.gather;
                    push(vec![Step::Kernel { f, grid: blocks((g.n * g.cols) as u64, 256), block: [256, 1, 1], args }], "gather", 0);
                }
                LaunchOp::ScatterAdd(s) => {
                    let args = vec![
                        p(s.src),
                        p(s.idx),
                        p(s.out),
                        Arg::I32(s.rows as i32),
                        Arg::I32(s.cols as i32),
                        Arg::I32(s.n as i32),
                        Arg::Ptr(err_flag),
                    ];
                    let grid = blocks(s.rows as u64, fusec_codegen_cuda::native::SCATTER_ROWS as u64);
                    push(vec![Step::Kernel { f: self.native.scatter_add, grid, block: [256, 1, 1], args }], "scatter_add", l.flops);
                }
                LaunchOp::Attention(a) => {
                    for (steps, name, flops) in self.attention(a).map_err(err)? {
                        push(steps, name, flops);
                    }
                }
                LaunchOp::Iota(it) => {
                    let cnt: usize = it.shape.iter().product();
                    let inner: usize = it.shape[it.axis + 1..].iter().product();
                    let f = if it.dtype == DType::I32 { self.native.iota_i32 } else { self.native.iota_f32 };
                    let args = vec![p(it.out), Arg::I64(cnt as i64), Arg::I64(inner as i64), Arg::I64(it.shape[it.axis] as i64)];
                    push(vec![Step::Kernel { f, grid: blocks(cnt as u64, 256), block: [256, 1, 1], args }], "iota", 0);
                }
                LaunchOp::Fill(fl) => {
                    let dst = Addr::Plan(fl.out);
                    let bits = match fl.dtype {
                        DType::I32 => fusec_ir::interp::round_to(DType::I32, fl.value) as i32 as u32,
                        DType::F32 => (fl.value as f32).to_bits(),
                        d => return Err(err(format!("a {d} constant outside a fused kernel"))),
                    };
                    push(vec![Step::Fill32 { dst, bits, n: fl.n }], "fill", 0);
                }
            }
        }
        Ok(out)
    }

    /// A product's steps: a cuBLASLt call with its epilogue where one applies, else a cuBLAS
    /// product (accumulating with beta = 1), followed by the epilogue kernel when there is a
    /// bias or GELU. `fused`: a `gemm` node (a plain `matmul` never carries an epilogue).
    fn product(&mut self, pr: &Product, bf16: bool, fused: bool) -> Result<Vec<Step>, String> {
        let spec = &pr.spec;
        if fused && pr.out != DType::F32 {
            return Err(format!("a {} GEMM result is not supported by the CUDA target yet", pr.out));
        }
        let bg = batched(spec)?;
        let (a, b, y) = (Addr::Plan(pr.a), Addr::Plan(pr.b), Addr::Plan(pr.y));
        let (bias, acc, pre) = (pr.bias.map(Addr::Plan), pr.acc.map(Addr::Plan), pr.pre.map(Addr::Plan));
        let mut steps = vec![];
        let total = spec.y_len() as u64;
        let lt = match self.lt.as_mut() {
            Some(lt) if spec.bias && !spec.accumulate && bg.batch == 1 && !bf16 => {
                lt.plan(&bg.call, if spec.gelu { Epilogue::GeluAuxBias } else { Epilogue::Bias })?
            }
            _ => None,
        };
        if let (Some(plan), Some(bias)) = (lt, bias) {
            steps.push(Step::GemmLt { plan, a, b, c: y, bias, aux: pre.unwrap_or(y) });
        } else if !spec.bias && !spec.gelu {
            if let Some(acc) = acc.filter(|&acc| acc != y) {
                steps.push(Step::Copy { dst: y, src: acc, bytes: total * 4 });
            }
            steps.push(Step::Gemm { g: bg, a, b, c: y, beta: if spec.accumulate { 1.0 } else { 0.0 }, bf16 });
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
            let flags = spec.bias as i32 | (spec.gelu as i32) << 1 | (spec.accumulate as i32) << 2;
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
        Ok(steps)
    }
}
