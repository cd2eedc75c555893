//! CUDA code generation: fused kernels → CUDA C source, hand-written CUDA C for the ops that
//! stay their own launches, NVRTC compilation with an on-disk cache, and the row-major →
//! column-major mapping of GEMMs onto cuBLAS.
//!
//! # Fused kernels
//!
//! [`kernel_source`] turns a `kernel` node's body into one CUDA C module, a pure function of the
//! body and the bindings (same body, same text: the twelve identical LayerNorms of GPT-2 124M
//! compile once). It consumes the backend-neutral kernel-level IR that the CPU backend consumes
//! too: [`fusec_passes::lower_rows`] lowers the body into *row programs* ([`fusec_ir::rows`]: the
//! kernel's domain as `[R, C]`, values per element / row / column / kernel, reduction levels),
//! so both backends agree on what a kernel computes and differ only in how it is scheduled.
//! `plan` picks the thread layout (flat, one team per row, a few adjacent columns a thread) and `emit`
//! prints the kernels: one statement per IR operation, deterministic team reductions (warp
//! shuffles, then shared memory in warp order), column reductions as per-team or per-chunk
//! partials summed in a fixed order by a second *finalize* kernel. The module starts with
//! [`prelude::PRELUDE`] (bf16 conversions by bit shifts with round-to-nearest-even, NaN-
//! propagating max/min, team reductions) and includes no header.
//!
//! Every entry of a fused kernel's module takes the same parameters: the operands (`in0`, ...,
//! `const T*`), the results (`out0`, ..., `T*`; a result may be the same buffer as an operand
//! where the memory planner made it in place), then `float* scratch` of at least
//! [`KernelSource::scratch_bytes`] — or, when that many pointers would not fit in the 4 KiB of
//! kernel parameters ([`KernelSource::param_table`]), a pointer to a device table of them and
//! `scratch`. Launch the [`KernelSource::launches`] in order on one stream.
//!
//! # The rest
//!
//! - `classifier`: the bf16 classifier (`cast_cross_entropy_with_grad`) as one hand-written
//!   kernel that reads each row of logits from DRAM once, used in place of the generated one.
//! - [`native`]: gather, deterministic scatter-add, causal attention (softmax parts around
//!   cuBLAS products), iota, the GEMM epilogue; one module.
//! - [`flash`]: causal flash attention (forward and backward), one module per head size and
//!   storage: bf16 tensor cores on bf16 storage, TF32 tensor cores on f32 storage (used there
//!   instead of the score-matrix path when TF32 products are allowed).
//! - [`nvrtc`]: compiles sources to CUBIN for the device's architecture, in parallel, with an
//!   on-disk cache keyed by SHA-256 of (source, options, architecture, NVRTC version, fusec
//!   version).
//! - [`gemm`]: `y = op(a) op(b)` on row-major buffers as a column-major cuBLAS call.

mod classifier;
mod emit;
pub mod flash;
pub mod gemm;
pub mod native;
pub mod nvrtc;
mod plan;
pub mod prelude;

use std::fmt::Write;

use fusec_ir::rows::Slot;
use fusec_ir::{Bindings, DType, Kernel, Op};
use fusec_passes::lower_rows::lower_kernel;

pub use emit::LaunchRule;
use emit::Seg;
use plan::{plan, Mapping, BLOCK, COL_BX, COL_BY};

/// Bumped whenever the generated code changes for the same kernel (part of the cache key).
pub const CODEGEN_REVISION: &str = "fusec-codegen-cuda/1";

/// The CUDA C of one fused kernel and how to launch it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSource {
    /// The kernel's name (from `fuse-elementwise`), as given.
    pub name: String,
    /// The C identifier the entries are named after (sanitized, at most 48 characters).
    pub ident: String,
    /// The module's CUDA C.
    pub source: String,
    /// The kernels to launch, in order.
    pub launches: Vec<LaunchRule>,
    /// Bytes of `scratch` the launches need (column partials), 256-byte multiple.
    pub scratch_bytes: u64,
    /// Approximate float operations of one run (for the profiler).
    pub flops: u64,
    /// The entries take `(const unsigned long long* args, float* scratch)`: `args` points at
    /// device memory holding the operand pointers then the result pointers (when they would
    /// not fit in kernel parameters, see [`MAX_PARAM_BYTES`]).
    pub param_table: bool,
}

impl KernelSource {
    /// The first entry's name.
    pub fn entry(&self) -> &str {
        &self.launches[0].entry
    }
}

/// A C identifier for a kernel name: letters, digits and `_`, at most 48 characters.
pub fn ident(name: &str) -> String {
    let mut s: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).take(48).collect();
    if s.is_empty() || s.as_bytes()[0].is_ascii_digit() {
        s.insert_str(0, "k_");
    }
    s
}

fn c_type(d: DType) -> Result<&'static str, String> {
    match d {
        DType::F32 => Ok("float"),
        DType::BF16 => Ok("unsigned short"),
        DType::I32 => Ok("int"),
        DType::F16 => Err("f16 storage is not supported by the CUDA kernel generator".into()),
    }
}

/// The C types of the kernel's operands and results.
fn io_types(k: &Kernel) -> Result<(Vec<&'static str>, Vec<&'static str>), String> {
    let mut ins = vec![];
    for n in &k.body.nodes {
        if let Op::Input { ty, .. } = &n.op {
            ins.push(c_type(ty.dtype)?);
        }
    }
    let outs = k.body.outputs.iter().map(|(_, v)| c_type(k.body.ty(*v).dtype)).collect::<Result<_, _>>()?;
    Ok((ins, outs))
}

/// Kernel parameter bytes above which the operand and result pointers are passed through a
/// table in device memory (CUDA's limit is 4 KiB; the multi-tensor AdamW of GPT-2 124M has
/// over 1000 pointers).
pub const MAX_PARAM_BYTES: usize = 2048;

/// The CUDA C source of a fused kernel under concrete bindings (see the crate docs). An `Err`
/// names what the generator does not support (the limits of `fusec_passes::lower_rows`).
pub fn kernel_source(k: &Kernel, bind: &Bindings) -> Result<KernelSource, String> {
    if let Some(ks) = classifier::source(k, bind) {
        return Ok(ks);
    }
    let progs = lower_kernel(k, bind)?;
    if progs.is_empty() {
        return Err(format!("kernel `{}` has no outputs", k.name));
    }
    let name = ident(&k.name);
    let (ins, outs) = io_types(k).map_err(|e| format!("kernel `{}`: {e}", k.name))?;
    let mut scratch = 0u64;
    let mut segs = vec![];
    for p in &progs {
        let plan = plan(p);
        let mut offs = vec![];
        for &c in &plan.colreds {
            let arg = p.node(plan::arg(p, c));
            offs.push((c, scratch));
            scratch += plan.parts * if arg.space.has_col() { p.cols } else { 1 };
        }
        segs.push(Seg {
            p,
            plan,
            scratch: offs,
            generic: false,
            vec: Default::default(),
            stage: Default::default(),
            keep: Default::default(),
            stashed: Default::default(),
            shared: Default::default(),
            fast_math: emit::reads_bf16(p),
        });
    }
    let merge = segs.len() > 1 && segs.iter().all(|s| s.plan.mapping == Mapping::Flat && s.plan.fin_stores.is_empty());
    let table = merge || (ins.len() + outs.len() + 1) * 8 > MAX_PARAM_BYTES;
    let params = if table {
        "const unsigned long long* args, float* scratch".to_string()
    } else {
        let mut ps: Vec<String> = ins.iter().enumerate().map(|(i, t)| format!("const {t}* in{i}")).collect();
        ps.extend(outs.iter().enumerate().map(|(j, t)| format!("{t}* out{j}")));
        ps.push("float* scratch".into());
        ps.join(", ")
    };
    let decls = |s: &Seg, ind: &str| -> String {
        if !table {
            return String::new();
        }
        let mut d = String::new();
        for sl in &s.p.slots {
            match *sl {
                Slot::Operand(i) => {
                    let _ = writeln!(d, "{ind}const {t}* in{i} = (const {t}*)args[{i}];", t = ins[i]);
                }
                Slot::Result(j) => {
                    let _ = writeln!(d, "{ind}{t}* out{j} = ({t}*)args[{}];", ins.len() + j, t = outs[j]);
                }
                Slot::Scratch(_) => {}
            }
        }
        d
    };
    let mut src = String::new();
    let _ = writeln!(src, "// {} (fusec: {CODEGEN_REVISION}); {} segment(s)", k.name, segs.len());
    src.push_str(prelude::PRELUDE);
    let mut launches = vec![];
    let sig = |entry: &str, threads: u32| format!("extern \"C\" __global__ void __launch_bounds__({threads}) {entry}({params}) {{\n");
    let err = |e: String| format!("kernel `{}`: {e}", k.name);
    if merge {
        let blocks = merged(&mut src, &name, &mut segs, &ins, &outs).map_err(err)?;
        launches.push(LaunchRule { entry: name.clone(), grid: grid_1d(blocks)?, block: [BLOCK, 1, 1], shared: 0 });
    } else {
        for (i, s) in segs.iter().enumerate() {
            let entry = if segs.len() == 1 { name.clone() } else { format!("{name}_s{i}") };
            let p = s.p;
            let (grid, block) = match s.plan.mapping {
                Mapping::Flat => (grid_1d((p.rows * p.cols).div_ceil(BLOCK as u64 * s.flat_width() as u64))?, [BLOCK, 1, 1]),
                Mapping::Rows { team, tpb, teams, cluster } => {
                    let blocks = teams.div_ceil(tpb as u64).checked_mul(cluster as u64).ok_or("grid too large")?;
                    (grid_1d(blocks)?, [team * tpb, 1, 1])
                }
                Mapping::Cols { chunks } => {
                    let gx = (p.cols / s.col_width() as u64).div_ceil(COL_BX as u64);
                    ([grid_1d(gx)?[0], u32::try_from(chunks).map_err(|e| e.to_string())?, 1], [COL_BX, COL_BY, 1])
                }
            };
            // Warp-per-row kernels: two blocks an SM (with the LayerNorm gradient's column
            // partials in registers, 138 of them, one block fitted; 6% faster on the H100), three
            // without column partials (the 1.5B LayerNorm had 105 registers a thread, two blocks:
            // 44 -> 40 us on the H200; four blocks spilled, 59 us).
            let min_blocks = match s.plan.mapping {
                Mapping::Rows { tpb, .. } if tpb > 1 && s.plan.colreds.is_empty() => ", 3",
                Mapping::Rows { tpb, .. } if tpb > 1 => ", 2",
                _ => "",
            };
            let mut head = sig(&entry, block[0] * block[1]).replacen(") ", &format!("{min_blocks}) "), 1);
            if let Mapping::Rows { cluster: k @ 2.., .. } = s.plan.mapping {
                head = head.replacen("__launch_bounds__", &format!("\n#if __CUDA_ARCH__ >= 900\n__cluster_dims__({k}, 1, 1)\n#endif\n__launch_bounds__"), 1);
            }
            src.push_str(&head);
            src.push_str(&decls(s, "  "));
            s.main_body(&mut src).map_err(err)?;
            src.push_str("}\n");
            launches.push(LaunchRule { entry: entry.clone(), grid, block, shared: s.shared.get() });
            let mut fin = String::new();
            if let Some(gx) = s.fin_body(&mut fin).map_err(err)? {
                let fe = format!("{entry}_fin");
                src.push_str(&sig(&fe, 32 * plan::FIN_SLICES));
                src.push_str(&decls(s, "  "));
                src.push_str(&fin);
                src.push_str("}\n");
                launches.push(LaunchRule { entry: fe, grid: [gx, 1, 1], block: [32, plan::FIN_SLICES, 1], shared: 0 });
            }
        }
    }
    let flops = progs.iter().map(|p| p.flops()).sum();
    Ok(KernelSource {
        name: k.name.clone(),
        ident: name,
        source: src,
        launches,
        scratch_bytes: (scratch * 4).div_ceil(256) * 256,
        flops,
        param_table: table,
    })
}

/// Independent pointwise segments (the multi-tensor AdamW) as one launch, a block range each.
/// Segments whose code differs only in operands and sizes share one device function (GPT-2
/// 124M's 148 AdamW segments need two), so NVRTC compiles each shape of code once: the kernel
/// finds its segment by binary search over block starts in constant memory, then calls the
/// segment's function with its sizes and the indices of its pointers in `args`. Returns the
/// total block count.
fn merged(src: &mut String, name: &str, segs: &mut [Seg], ins: &[&str], outs: &[&str]) -> Result<u64, String> {
    // Four (eight) elements a thread when every segment's rows allow it (one body shape for
    // all): widths are 1, 4 or 8, and a segment that allows 8 allows 4.
    let w = segs.iter().map(|s| s.flat_width()).min().unwrap_or(1);
    let mut bodies: Vec<String> = vec![];
    let (mut group, mut first, mut total, mut cols, mut slot0, mut slots) = (vec![], vec![0u64], vec![], vec![], vec![], vec![]);
    for s in segs.iter_mut() {
        s.generic = true;
        let p = s.p;
        let mut body = String::new();
        for (k, sl) in p.slots.iter().enumerate() {
            let t = match *sl {
                Slot::Operand(i) => format!("const {}*", ins[i]),
                Slot::Result(j) => format!("{}*", outs[j]),
                Slot::Scratch(_) => continue,
            };
            let _ = writeln!(body, "  {t} a{k} = ({t})args[sl[{k}]];");
        }
        s.flat(&mut body, "  ", 0, w)?;
        let g = bodies.iter().position(|b| *b == body).unwrap_or_else(|| {
            bodies.push(body);
            bodies.len() - 1
        });
        group.push(g);
        slot0.push(slots.len());
        for sl in &p.slots {
            slots.push(match *sl {
                Slot::Operand(i) => i,
                Slot::Result(j) => ins.len() + j,
                Slot::Scratch(_) => 0,
            });
        }
        let n = p.rows * p.cols;
        first.push(first.last().expect("starts at 0") + n.div_ceil(BLOCK as u64 * w as u64));
        total.push(n);
        cols.push(p.cols);
    }
    let list = |v: &[u64]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ");
    let to64 = |v: &[usize]| v.iter().map(|&x| x as u64).collect::<Vec<_>>();
    let nseg = segs.len();
    let _ = writeln!(src, "__constant__ unsigned long long {name}_first[{}] = {{{}}};", nseg + 1, list(&first));
    let _ = writeln!(src, "__constant__ unsigned long long {name}_total[{nseg}] = {{{}}};", list(&total));
    let _ = writeln!(src, "__constant__ unsigned {name}_cols[{nseg}] = {{{}}};", list(&cols));
    let _ = writeln!(src, "__constant__ unsigned {name}_slot0[{nseg}] = {{{}}};", list(&to64(&slot0)));
    let _ = writeln!(src, "__constant__ unsigned char {name}_group[{nseg}] = {{{}}};", list(&to64(&group)));
    let _ = writeln!(src, "__constant__ unsigned short {name}_slots[{}] = {{{}}};", slots.len().max(1), list(&to64(&slots)));
    for (g, body) in bodies.iter().enumerate() {
        let _ = writeln!(
            src,
            "__device__ __forceinline__ void {name}_g{g}(const unsigned long long* args, const unsigned short* sl, unsigned long long first, unsigned long long total, unsigned cols) {{"
        );
        src.push_str(body);
        src.push_str("}\n");
    }
    let _ =
        writeln!(src, "extern \"C\" __global__ void __launch_bounds__({BLOCK}) {name}(const unsigned long long* args, float* scratch) {{");
    let _ = writeln!(src, "  int lo = 0, hi = {nseg};");
    let _ = writeln!(
        src,
        "  while (hi - lo > 1) {{ const int mid = (lo + hi) >> 1; if ({name}_first[mid] <= blockIdx.x) lo = mid; else hi = mid; }}"
    );
    let _ = writeln!(src, "  const unsigned short* sl = {name}_slots + {name}_slot0[lo];");
    let _ = writeln!(src, "  switch ({name}_group[lo]) {{");
    for g in 0..bodies.len() {
        let _ = writeln!(src, "  case {g}: {name}_g{g}(args, sl, {name}_first[lo], {name}_total[lo], {name}_cols[lo]); break;");
    }
    src.push_str("  }\n}\n");
    Ok(*first.last().expect("starts at 0"))
}

fn grid_1d(blocks: u64) -> Result<[u32; 3], String> {
    let b = u32::try_from(blocks.max(1))
        .ok()
        .filter(|&b| b < i32::MAX as u32)
        .ok_or_else(|| format!("{blocks} blocks exceed the grid limit"))?;
    Ok([b, 1, 1])
}
