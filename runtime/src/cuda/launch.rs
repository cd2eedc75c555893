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
//!
//! Products ([`Builder::product`]) take the fastest path their types and epilogue allow:
//! 1. a bias (+ GELU) without accumulation, one product (no batch): one cuBLASLt call
//!    (`lt.rs`: TF32 for f32 operands; bf16 operands with a bf16 or f32 result, bf16 bias and
//!    pre-activation), when cuBLASLt is in use and offers an algorithm;
//! 2. no bias or GELU: one cuBLAS call writing the result itself (`sgemm`, or `GemmEx` with
//!    bf16 operands and an f32 or bf16 result; beta = 1 accumulates in place, f32 results
//!    only);
//! 3. otherwise the product in f32 (into the result, or scratch) and an epilogue kernel:
//!    `fusec_gemm_epilogue` when everything is f32, else `fusec_gemm_epilogue_mixed`
//!    (bf16 bias, pre-activation, result or accumulator).
//!
//! Operands and results other than f32 and bf16 (f16) are refused with an error. Runs of
//! consecutive independent plain bf16 products of one shape then become one batched call
//! (`batch.rs`).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction;
use fusec_codegen_cuda::gemm::{batched, Batched, ColMajor};
use fusec_codegen_cuda::KernelSource;
use fusec_codegen_cuda::native::GATHER_VEC;
use fusec_ir::DType;

use crate::cuda::attention::ColumnSums;
use crate::cuda::lt::{alignment, Epilogue, LtKey, LtPlans, LtTypes};
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
    /// `ab`: the operands' type, `out`: the result's (f32 and f32, or bf16 and f32 / bf16;
    /// f32 accumulation).
    Gemm { g: Batched, a: Addr, b: Addr, c: Addr, beta: f32, ab: DType, out: DType },
    /// A cuBLASLt product with its epilogue: plan `plan` of the builder's list (operands as in
    /// `Gemm`; `aux` is GELU's pre-activation, unused for a bias alone).
    GemmLt { plan: usize, a: Addr, b: Addr, c: Addr, bias: Addr, aux: Addr },
    /// A pointer-array batched product; the `A`, `B`, `C` arrays follow each other at `arrays`.
    GemmArrays { call: ColMajor, arrays: Addr, batch: i32 },
    /// Products of bf16 operands merged into one pointer-array call (`batch.rs`): arrays as
    /// in `GemmArrays`, an `out` result, `beta` 0 or 1, f32 accumulation.
    GemmBatched { call: ColMajor, arrays: Addr, batch: i32, out: DType, beta: f32 },
    /// A kernel launch.
    Kernel { f: CUfunction, grid: [u32; 3], block: [u32; 3], shared: u32, args: Vec<Arg> },
    /// `n` 32-bit words set to `bits`.
    Fill32 { dst: Addr, bits: u32, n: usize },
    /// A device-to-device copy.
    Copy { dst: Addr, src: Addr, bytes: u64 },
    /// For each part `(src, dst, n, dtype, owner)`, the mean over the ranks of the `n` values at
    /// `src` into `dst` (`owner` `None`), or rank `owner`'s values: one NCCL group (copies
    /// without a communicator).
    Collective { parts: Vec<(Addr, Addr, usize, DType, Option<usize>)> },
}

/// One launch: its steps, the name the profiler shows, static byte and FLOP counts.
pub(crate) struct Launch {
    pub steps: Vec<Step>,
    pub name: String,
    pub bytes: u64,
    pub flops: u64,
    /// The IR ops it runs ([`launches::fused_ops`]).
    pub ops: Vec<&'static str>,
    /// The collectives (indices in this list) whose results it reads (`collectives.rs`).
    pub waits: Vec<usize>,
    /// A collective whose every result overwrites its operand: it may run beside the launches
    /// that follow (nothing else touches its buffers until a reader waits for it).
    pub side: bool,
}

/// The hand-written kernels' entries, in the order of `fusec_codegen_cuda::native::MODULES`.
pub(crate) struct Native {
    pub gather: CUfunction,
    /// [`fusec_codegen_cuda::native::SCATTER_ENTRIES`], in order.
    pub scatter: [CUfunction; 5],
    pub attn_softmax: CUfunction,
    pub attn_probs: CUfunction,
    pub attn_dscores: CUfunction,
    pub iota_f32: CUfunction,
    pub iota_i32: CUfunction,
    pub gemm_epilogue: CUfunction,
    pub gemm_epilogue_mixed: CUfunction,
    /// `fusec_sum_rows`: adds the flash backward's partial column sums.
    pub sum_rows: CUfunction,
    /// The flash-attention entries ([`fusec_codegen_cuda::flash::ENTRIES`]) per head size and
    /// storage type of `qkv`.
    pub flash: HashMap<(usize, DType), [CUfunction; 3]>,
    /// The NVRTC architecture they were compiled for (their launch geometry depends on it).
    pub flash_arch: String,
}

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

    /// The launches of a deterministic scatter-add (see `fusec_codegen_cuda::native`): the CSR
    /// lists of positions per output row live in scratch (`count`, two tallies per segment of
    /// rows, `offs`, `cursor`, `slots`, `sorted`, and `nz`, the count and list of rows with
    /// positions: 32-bit words, `4 rows + 2 n + 2 + 2 segments` of them); the output is
    /// zeroed first.
    fn scatter_add(&mut self, s: &launches::ScatterAdd, err: Addr) -> Result<Vec<Step>, String> {
        use fusec_codegen_cuda::native::{SCATTER_BLOCKS, SCATTER_SEG};
        let too_big =
            || format!("scatter_add: {} rows of {} columns and {} indices exceed the kernels' 32-bit indexing", s.rows, s.cols, s.n);
        let nseg = s.rows.div_ceil(SCATTER_SEG as usize);
        let words = s
            .rows
            .checked_mul(4)
            .and_then(|w| w.checked_add(s.n.checked_mul(2)?))
            .and_then(|w| w.checked_add(2 + 2 * nseg))
            .ok_or_else(too_big)?;
        let out_words = s.rows.checked_mul(s.cols).ok_or_else(too_big)?;
        if i32::try_from(words).is_err() || i32::try_from(s.cols).is_err() {
            return Err(too_big());
        }
        if s.rows == 0 {
            return Ok(vec![]);
        }
        self.need_scratch(words as u64 * 4);
        let (rows, n, segs) = (s.rows as u64, s.n as u64, 2 * nseg as u64);
        let at = |w: u64| Arg::Ptr(Addr::Scratch(w * 4));
        // `count` and the segments' tallies first, zeroed together.
        let (count, seg) = (at(0), at(rows));
        let (offs, cursor) = (at(rows + segs), at(2 * rows + 1 + segs));
        let (slots, sorted, nz) = (at(3 * rows + 1 + segs), at(3 * rows + 1 + segs + n), at(3 * rows + 1 + segs + 2 * n));
        // Blocks walking the listed rows (at most one per index).
        let listed = s.rows.min(s.n).clamp(1, SCATTER_BLOCKS as usize) as u32;
        let (ri, ni, ci, si) = (Arg::I32(s.rows as i32), Arg::I32(s.n as i32), Arg::I32(s.cols as i32), Arg::I32(nseg as i32));
        let (src, idx, out) = (Arg::Ptr(Addr::Plan(s.src)), Arg::Ptr(Addr::Plan(s.idx)), Arg::Ptr(Addr::Plan(s.out)));
        let f = self.native.scatter;
        let by_index = blocks(n, 256);
        let block = [256, 1, 1];
        Ok(vec![
            Step::Fill32 { dst: Addr::Scratch(0), bits: 0, n: s.rows + 2 * nseg },
            Step::Kernel { f: f[0], grid: by_index, block, shared: 0, args: vec![idx, count, seg, si, ri, ni, Arg::Ptr(err)] },
            Step::Kernel { f: f[1], grid: [nseg as u32, 1, 1], block, shared: 0, args: vec![count, seg, si, offs, cursor, nz, ri] },
            Step::Kernel { f: f[2], grid: by_index, block, shared: 0, args: vec![idx, cursor, slots, ri, ni] },
            Step::Kernel { f: f[3], grid: [listed, 1, 1], block, shared: 0, args: vec![offs, nz, slots, sorted] },
            Step::Fill32 { dst: Addr::Plan(s.out), bits: 0, n: out_words },
            Step::Kernel { f: f[4], grid: [listed, 1, 1], block, shared: 0, args: vec![src, offs, nz, sorted, out, ci] },
        ])
    }

    /// The CUDA launches of a program's launch plan; `kernels(i)` is the compiled kernel of
    /// launch `i`.
    pub fn translate(&mut self, plan: &[launches::Launch], kernels: &dyn Fn(usize) -> Option<Loaded>) -> Result<Vec<Launch>, String> {
        let err_flag = Addr::Static(0);
        let mut out: Vec<Launch> = vec![];
        // Each plan launch's first launch here (attention becomes several).
        let mut index_of = Vec::with_capacity(plan.len());
        // Partial column sums the attention launch just before wrote for this launch to add.
        let mut folded: Option<ColumnSums> = None;
        for (i, l) in plan.iter().enumerate() {
            let fold_in = folded.take();
            let first = out.len();
            index_of.push(first);
            let err = |m: String| l.err(m);
            let product = matches!(l.op, LaunchOp::Product(_));
            if product && l.dtypes[1] != l.dtypes[0] {
                return Err(err(format!("a product of {} and {} operands", l.dtypes[0], l.dtypes[1])));
            }
            // Products and attention read and write bf16 themselves; other launches are f32/i32.
            let collective = matches!(l.op, LaunchOp::Collective(_));
            if !collective && !matches!(l.op, LaunchOp::Kernel { .. } | LaunchOp::Product(_) | LaunchOp::Attention(_)) {
                if let Some(dt) = l.dtypes.iter().find(|d| matches!(d, DType::BF16 | DType::F16)) {
                    return Err(err(format!(
                        "{dt} storage outside fused kernels is not supported by the CUDA target yet (use --precision fp32)"
                    )));
                }
            }
            let mut push = |steps: Vec<Step>, name: &str, flops: u64| {
                let (waits, side) = (vec![], false);
                out.push(Launch { steps, name: name.to_string(), bytes: l.bytes, flops, ops: l.ops.clone(), waits, side });
            };
            let p = |o: u64| Arg::Ptr(Addr::Plan(o));
            match &l.op {
                LaunchOp::Product(pr) => {
                    let steps = self.product(pr).map_err(err)?;
                    push(steps, &l.name, l.flops);
                }
                LaunchOp::Kernel { ins, outs, .. } if fold_in.is_some() => {
                    let c = fold_in.expect("checked");
                    let acc = if c.accumulates { p(ins[1]) } else { Arg::I64(0) };
                    let args = vec![p(outs[0]), acc, Arg::Ptr(c.at), Arg::I32(c.rows as i32), Arg::I32(c.cols as i32)];
                    let step = Step::Kernel { f: self.native.sum_rows, grid: blocks(c.cols as u64, 32), block: [256, 1, 1], shared: 0, args };
                    let (bytes, flops) = ((c.rows + 1) as u64 * c.cols as u64 * 4, (c.rows * c.cols) as u64);
                    out.push(Launch { steps: vec![step], name: super::attention::COLSUM_LAUNCH.into(), bytes, flops, ops: l.ops.clone(), waits: vec![], side: false });
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
                        .map(|(r, f)| Step::Kernel { f: *f, grid: r.grid, block: r.block, shared: r.shared, args: args.clone() })
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
                    // The kernel copies GATHER_VEC columns a thread when a row allows it.
                    let v = if g.cols % GATHER_VEC as usize == 0 { GATHER_VEC as u64 } else { 1 };
                    push(
                        vec![Step::Kernel { f, grid: blocks((g.n * g.cols) as u64 / v, 256), block: [256, 1, 1], shared: 0, args }],
                        "gather",
                        0,
                    );
                }
                LaunchOp::ScatterAdd(s) => push(self.scatter_add(s, err_flag)?, "scatter_add", l.flops),
                LaunchOp::Attention(a) => {
                    folded = self.column_sums(a, plan.get(i + 1)).map_err(err)?;
                    for (steps, name, flops) in self.attention(a, folded.map(|c| c.at)).map_err(err)? {
                        push(steps, name, flops);
                    }
                }
                LaunchOp::Iota(it) => {
                    let cnt: usize = it.shape.iter().product();
                    let inner: usize = it.shape[it.axis + 1..].iter().product();
                    let f = if it.dtype == DType::I32 { self.native.iota_i32 } else { self.native.iota_f32 };
                    let args = vec![p(it.out), Arg::I64(cnt as i64), Arg::I64(inner as i64), Arg::I64(it.shape[it.axis] as i64)];
                    push(vec![Step::Kernel { f, grid: blocks(cnt as u64, 256), block: [256, 1, 1], shared: 0, args }], "iota", 0);
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
                LaunchOp::Collective(parts) => {
                    // An all-reduce written in place may run beside the launches that follow.
                    let side = parts.iter().all(|r| r.x == r.y && r.owner.is_none());
                    let parts = parts.iter().map(|r| (Addr::Plan(r.x), Addr::Plan(r.y), r.n, r.dtype, r.owner)).collect();
                    push(vec![Step::Collective { parts }], &l.name, 0);
                    out[first].side = side;
                }
            }
            if let Some(f) = out.get_mut(first) {
                f.waits = l.waits.iter().map(|&j| index_of[j]).collect();
            }
        }
        Ok(self.batch_products(out, &mut index_of))
    }

    /// A product's steps, on the fastest of the paths in the module docs that applies.
    pub(crate) fn product(&mut self, pr: &Product) -> Result<Vec<Step>, String> {
        let spec = &pr.spec;
        let (ab, out) = (pr.operands, pr.out);
        for (what, d) in [("operands", ab), ("results", out)] {
            if !matches!(d, DType::F32 | DType::BF16) {
                return Err(format!("{d} GEMM {what} are not supported by the CUDA target (f32 and bf16 are)"));
            }
        }
        let bg = batched(spec)?;
        let (a, b, y) = (Addr::Plan(pr.a), Addr::Plan(pr.b), Addr::Plan(pr.y));
        let (bias, acc, pre) = (pr.bias.map(Addr::Plan), pr.acc.map(Addr::Plan), pr.pre.map(Addr::Plan));
        if spec.bias != bias.is_some() || spec.gelu != pre.is_some() || spec.accumulate != acc.is_some() {
            return Err("internal: a product's operands do not match its epilogue".into());
        }
        let total = spec.y_len() as u64;
        if let Some(bias) = bias.filter(|_| !spec.accumulate && bg.batch == 1) {
            if let Some(plan) = self.lt_plan(pr, &bg.call)? {
                return Ok(vec![Step::GemmLt { plan, a, b, c: y, bias, aux: pre.unwrap_or(y) }]);
            }
        }
        let mut steps = vec![];
        // cuBLAS writes f32 results from either operand type, and bf16 results from bf16
        // operands (not accumulated: the IR rounds the product before adding it).
        let direct = match (ab, out) {
            (_, DType::F32) => true,
            (DType::BF16, DType::BF16) => !spec.accumulate,
            _ => false,
        };
        if !spec.bias && !spec.gelu && direct {
            if let Some(acc) = acc.filter(|&acc| acc != y) {
                steps.push(Step::Copy { dst: y, src: acc, bytes: total * out.size_bytes() as u64 });
            }
            steps.push(Step::Gemm { g: bg, a, b, c: y, beta: if spec.accumulate { 1.0 } else { 0.0 }, ab, out });
            return Ok(steps);
        }
        // The f32 product into `y` (or scratch when `y` is bf16 or must first be read as the
        // accumulator), then bias / GELU / accumulate / rounding in one pass.
        let src = if acc.is_some() || out != DType::F32 {
            self.need_scratch(total * 4);
            Addr::Scratch(0)
        } else {
            y
        };
        steps.push(Step::Gemm { g: bg, a, b, c: src, beta: 0.0, ab, out: DType::F32 });
        let mut flags = spec.bias as i32 | (spec.gelu as i32) << 1 | (spec.accumulate as i32) << 2;
        let f = if ab == DType::F32 && out == DType::F32 {
            self.native.gemm_epilogue
        } else {
            use fusec_codegen_cuda::native::{EPILOGUE_BIAS_BF16, EPILOGUE_PRE_BF16, EPILOGUE_Y_BF16};
            let bf16 = ab == DType::BF16;
            for (on, flag) in
                [(bf16 && spec.bias, EPILOGUE_BIAS_BF16), (bf16 && spec.gelu, EPILOGUE_PRE_BF16), (out == DType::BF16, EPILOGUE_Y_BF16)]
            {
                flags |= if on { flag } else { 0 };
            }
            self.native.gemm_epilogue_mixed
        };
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
        steps.push(Step::Kernel { f, grid: blocks(total, 256), block: [256, 1, 1], shared: 0, args });
        Ok(steps)
    }

    /// The cuBLASLt plan of a bias (+ GELU) product, when cuBLASLt is used and has one: TF32
    /// for f32 operands and result; bf16 operands (result bf16 or f32) when every pointer is
    /// 16-byte aligned and, with GELU, the result's row stride is a multiple of 8 elements.
    fn lt_plan(&mut self, pr: &Product, call: &ColMajor) -> Result<Option<usize>, String> {
        let Some(lt) = self.lt.as_mut() else { return Ok(None) };
        let spec = &pr.spec;
        let epilogue = if spec.gelu { Epilogue::GeluAuxBias } else { Epilogue::Bias };
        let types = match (pr.operands, pr.out) {
            (DType::F32, DType::F32) => LtTypes::Tf32,
            (DType::BF16, out) => {
                let offsets = [Some(pr.a), Some(pr.b), Some(pr.y), pr.bias, pr.pre];
                let align = alignment(offsets.into_iter().flatten());
                if align < 16 || (spec.gelu && call.ldc % 8 != 0) {
                    return Ok(None);
                }
                LtTypes::Bf16 { out, align }
            }
            _ => return Ok(None),
        };
        lt.plan(&LtKey { call: *call, epilogue, types, accumulate: false })
    }
}

#[cfg(test)]
mod tests {
    //! Which steps a product becomes, without a GPU (no cuBLASLt: `lt` is `None`).
    use super::*;
    use fusec_ir::GemmSpec;

    fn native() -> Native {
        // Distinct fake entries: only compared, never launched.
        let f = |k: usize| k as CUfunction;
        Native {
            gather: f(1),
            scatter: [f(21), f(22), f(23), f(24), f(25)],
            attn_softmax: f(3),
            attn_probs: f(4),
            attn_dscores: f(5),
            iota_f32: f(6),
            iota_i32: f(7),
            gemm_epilogue: f(8),
            gemm_epilogue_mixed: f(9),
            sum_rows: f(10),
            flash: HashMap::new(),
            flash_arch: "sm_80".into(),
        }
    }

    /// `y[7, 13] = a[7, 37] b[13, 37]^T` with the given epilogue and types.
    fn product(bias: bool, gelu: bool, accumulate: bool, operands: DType, out: DType) -> Product {
        let mut spec = GemmSpec::new(7, 13, 37);
        (spec.trans_b, spec.bias, spec.gelu, spec.accumulate) = (true, bias, gelu, accumulate);
        let at = |i: u64| i * 4096;
        Product {
            spec,
            a: at(0),
            b: at(1),
            bias: bias.then(|| at(2)),
            acc: accumulate.then(|| at(3)),
            y: at(3),
            pre: gelu.then(|| at(4)),
            operands,
            out,
        }
    }

    /// The steps as text: `gemm(ab->out, c, beta)`, `kernel(entry, flags)`, `copy`.
    fn steps(p: &Product) -> Result<Vec<String>, String> {
        let native = native();
        let mut b = Builder { native: &native, words: vec![], scratch: 0, lt: None };
        let steps = b.product(p)?;
        Ok(steps
            .iter()
            .map(|s| match s {
                Step::Gemm { c, beta, ab, out, .. } => format!("gemm({ab}->{out}, {c:?}, {beta})"),
                Step::Kernel { f, args, .. } => {
                    let flags = match args.last() {
                        Some(Arg::I32(v)) => *v,
                        _ => -1,
                    };
                    format!("kernel({}, {flags})", *f as usize)
                }
                Step::Copy { .. } => "copy".into(),
                _ => "other".into(),
            })
            .collect())
    }

    const Y: &str = "Plan(12288)";

    #[test]
    fn f32_products_keep_their_steps() {
        let f = DType::F32;
        assert_eq!(steps(&product(false, false, false, f, f)).unwrap(), [format!("gemm(f32->f32, {Y}, 0)")]);
        assert_eq!(steps(&product(false, false, true, f, f)).unwrap(), [format!("gemm(f32->f32, {Y}, 1)")]);
        assert_eq!(steps(&product(true, true, false, f, f)).unwrap(), [format!("gemm(f32->f32, {Y}, 0)"), "kernel(8, 3)".into()]);
        assert_eq!(steps(&product(true, false, true, f, f)).unwrap(), ["gemm(f32->f32, Scratch(0), 0)", "kernel(8, 5)"]);
    }

    #[test]
    fn bf16_products_write_bf16_results_through_cublas_or_the_mixed_epilogue() {
        let (b, f) = (DType::BF16, DType::F32);
        // No epilogue: cuBLAS writes the bf16 (or f32, accumulated) result itself.
        assert_eq!(steps(&product(false, false, false, b, b)).unwrap(), [format!("gemm(bf16->bf16, {Y}, 0)")]);
        assert_eq!(steps(&product(false, false, true, b, f)).unwrap(), [format!("gemm(bf16->f32, {Y}, 1)")]);
        // Bias + GELU into bf16 without cuBLASLt: f32 scratch, then bias, pre and y in bf16.
        assert_eq!(steps(&product(true, true, false, b, b)).unwrap(), ["gemm(bf16->f32, Scratch(0), 0)", "kernel(9, 59)"]);
        // An f32 result with a bf16 bias and pre-activation: the product in place.
        assert_eq!(steps(&product(true, true, false, b, f)).unwrap(), [format!("gemm(bf16->f32, {Y}, 0)"), "kernel(9, 27)".into()]);
        // A bf16 accumulator: product rounded, then added (the IR's order).
        assert_eq!(steps(&product(false, false, true, b, b)).unwrap(), ["gemm(bf16->f32, Scratch(0), 0)", "kernel(9, 36)"]);
        // f32 operands, bf16 result: cuBLAS cannot write it; the kernel rounds.
        assert_eq!(steps(&product(false, false, false, f, b)).unwrap(), ["gemm(f32->f32, Scratch(0), 0)", "kernel(9, 32)"]);
    }

    #[test]
    fn collectives_keep_their_readers_across_expanded_launches() {
        use crate::launches::{AttnDims, AttnOffsets, Attention, CollectivePart, Fill, Launch as PlanLaunch};
        let launch = |op: LaunchOp<'static>, waits: Vec<usize>| PlanLaunch {
            node: 0,
            name: if matches!(op, LaunchOp::Collective(_)) { "all_reduce" } else { "fill" }.into(),
            op,
            dtypes: vec![DType::F32],
            bytes: 4,
            flops: 0,
            ops: vec![],
            waits,
        };
        let attn = Attention {
            forward: true,
            dims: AttnDims { s: 1, t: 4, h: 1, d: 8 },
            scale: 1.0,
            dtype: DType::F32,
            at: AttnOffsets { qkv: 0, out: 512, lse: 1024, dout: None, dqkv: None },
        };
        let part = |x: u64, y: u64| CollectivePart { x, y, n: 16, dtype: DType::F32, owner: None };
        let plan = vec![
            // Score-matrix attention: several launches here.
            launch(LaunchOp::Attention(attn), vec![]),
            launch(LaunchOp::Collective(vec![part(2048, 2048), part(4096, 4096)]), vec![]),
            launch(LaunchOp::Collective(vec![part(8192, 12288)]), vec![]),
            launch(LaunchOp::Fill(Fill { value: 0.0, dtype: DType::F32, n: 4, out: 16384 }), vec![1, 2]),
        ];
        let native = native();
        let mut b = Builder { native: &native, words: vec![], scratch: 0, lt: None };
        let out = b.translate(&plan, &|_| None).unwrap();
        let at = |name: &str| out.iter().position(|l| l.name == name).unwrap();
        let first = at("all_reduce");
        assert!(first > 1, "attention expands into several launches");
        // In place: beside the backward; a copy to another place: in line.
        assert!(out[first].side && !out[first + 1].side);
        assert!(matches!(&out[first].steps[..], [Step::Collective { parts }] if parts.len() == 2));
        // The reader waits for both collectives, by their indices here.
        assert_eq!(out[at("fill")].waits, [first, first + 1]);
        assert!(out[..first].iter().all(|l| l.waits.is_empty() && !l.side));
    }

    #[test]
    fn f16_products_are_an_error() {
        let e = steps(&product(false, false, false, DType::F16, DType::F16)).unwrap_err();
        assert!(e.contains("f16 GEMM operands are not supported"), "{e}");
        let e = steps(&product(true, false, false, DType::BF16, DType::F16)).unwrap_err();
        assert!(e.contains("f16 GEMM results"), "{e}");
    }
}
