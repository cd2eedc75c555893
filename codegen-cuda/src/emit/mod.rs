//! Row program → CUDA C: the main kernel of each mapping and the finalize kernel.
//!
//! Every node becomes one C statement `const T v<id> = ...;` placed in the scope where its
//! [`Region`] lives (function entry, once per row, per column); element values needed by a pass
//! are (re)computed inside that pass's column loop. One IR operation is one C operation: NVRTC
//! runs with `--fmad=false`, so `a * b + c` is rounded twice, as in the interpreter, and
//! `exp`/`log`/`tanh`/`sqrt` are the CUDA math library's `expf`/`logf`/`tanhf`/`sqrtf` (no fast
//! math), except in segments that read bf16 storage: there `exp` is the prelude's `fast_exp`
//! on the hardware's `ex2` (see [`reads_bf16`]). Kernel parameters are
//! the kernel's operands (`in0..`), results (`out0..`) and one `float* scratch` for column
//! partials, for every entry of the module.

use std::collections::BTreeSet;
use std::fmt::Write;

use fusec_ir::rows::{region, Expr, Mem, NodeId, Prog, Region, RowTerm, Slot, Store, Ty, View};
use fusec_ir::{BinaryOp, CmpOp, ReduceOp, UnaryOp};

use crate::plan::{Mapping, Plan, BLOCK, FIN_SLICES};

type R<T> = Result<T, String>;

mod cols;
mod online;
mod rows;
mod stash;
mod views;

/// One generated kernel entry and how to launch it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchRule {
    /// The `extern "C"` function name.
    pub entry: String,
    /// Grid size (blocks).
    pub grid: [u32; 3],
    /// Block size (threads).
    pub block: [u32; 3],
    /// Dynamic shared memory in bytes (the runtime opts the function in above 48 KiB).
    pub shared: u32,
}

/// Code generation state for one segment.
pub(crate) struct Seg<'p> {
    pub p: &'p Prog,
    pub plan: Plan,
    /// Scratch offset (in floats) of each column reduction's partials.
    pub scratch: Vec<(NodeId, u64)>,
    /// Printed as the body of a function shared by segments of the same shape of code: slots
    /// are `a{slot}`, and the sizes are the variables `first`, `total` and `cols`.
    pub generic: bool,
    /// Inside a wide column loop: views read from (or written to) the vector register named
    /// here (`float4`, `float4[2]`, `uint2` or `uint4`; see `rows.rs`), element `j`, instead of
    /// memory.
    pub vec: std::cell::RefCell<Vec<(View, String)>>,
    /// Inside a row pass: the views staged in shared memory that it loads, each with its copy's
    /// name and whether this pass fills the copy (else it reads it); see `rows.rs`.
    pub stage: std::cell::RefCell<Vec<(View, String, bool)>>,
    /// Inside a short unrolled row pass: the views kept in registers across passes that it
    /// loads, each with its register array's name (indexed by the pass's `k4`) and whether
    /// this pass fills it (else it reads it); see `rows.rs`.
    pub keep: std::cell::RefCell<Vec<(View, String, bool)>>,
    /// Inside a later row pass: the values stashed by the first pass (`stash.rs`), which
    /// it reads instead of computing.
    pub stashed: std::cell::RefCell<Vec<NodeId>>,
    /// Dynamic shared memory the main kernel needs, in bytes (staged row views).
    pub shared: std::cell::Cell<u32>,
    /// `exp` through the hardware's `ex2` (the prelude's `fast_exp`): set when the segment
    /// reads bf16 storage (see [`reads_bf16`]).
    pub fast_math: bool,
}

/// Whether a row program loads a bf16 view: its inputs then carry bf16's 2^-9 relative
/// rounding, and `ex2.approx` (2^-22 relative, a few f32 ulps with the argument's scaling)
/// costs nothing measurable in its results, where `expf` takes about ten instructions (the
/// fused classifier was bound by them: 1.80 -> 1.59 ms on the H100). The same for `tanh`
/// (`tanh.approx`, 2^-11 relative): the GELU backward, memory-bound on the H100 (an
/// exp-based `tanh` did not move it there), was bound by `tanhf` on the H200 (SM 79%, DRAM
/// 54%).
pub(crate) fn reads_bf16(p: &Prog) -> bool {
    p.nodes.iter().any(|n| matches!(&n.expr, Expr::Load(v) if v.mem == Mem::Bf16))
}

fn ty(t: Ty) -> &'static str {
    match t {
        Ty::F32 => "float",
        Ty::I32 => "int",
    }
}

/// A C float literal that reads back as exactly `x`.
pub(crate) fn float_lit(x: f32) -> String {
    if x.is_finite() {
        let s = format!("{x:?}");
        format!("{s}f")
    } else {
        format!("__uint_as_float(0x{:08x}u)", x.to_bits())
    }
}

fn red_fn(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "red_sum",
        ReduceOp::Max => "red_max",
    }
}

fn red_init(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "0.0f",
        ReduceOp::Max => "__uint_as_float(0xff800000u)",
    }
}

fn op_of(e: &Expr) -> ReduceOp {
    match e {
        Expr::RowReduce(op, _) | Expr::ColReduce(op, _, _) => *op,
        _ => unreachable!("not a reduction"),
    }
}

impl Seg<'_> {
    fn slot_name(&self, slot: u32) -> R<String> {
        if self.generic && !matches!(self.p.slots[slot as usize], Slot::Scratch(_)) {
            return Ok(format!("a{slot}"));
        }
        match self.p.slots[slot as usize] {
            Slot::Operand(k) => Ok(format!("in{k}")),
            Slot::Result(j) => Ok(format!("out{j}")),
            Slot::Scratch(_) => Err("internal: a load or store through a scratch slot".into()),
        }
    }

    /// The element offset of `(r, c)` in a view (`i` for a whole row-major `[rows, cols]`
    /// buffer in a generic body).
    fn offset(&self, v: &View) -> String {
        let whole = [RowTerm { div: 1, modulo: 0, stride: self.p.cols }];
        if self.generic && v.col && v.row == whole {
            return "i".into();
        }
        let terms: Vec<String> = v.row.iter().map(term).collect();
        let mut s = terms.join(" + ");
        if v.col {
            s = if s.is_empty() { "c".into() } else { format!("{s} + c") };
        }
        if s.is_empty() {
            "0".into()
        } else {
            s
        }
    }

    /// The register element standing for `v` in a wide loop, if any: an f32, or the 16 bits
    /// of a bf16.
    fn vec_name(&self, v: &View) -> Option<String> {
        let t = if v.mem == Mem::Bf16 { "unsigned short" } else { "float" };
        self.vec.borrow().iter().find(|(w, _)| w == v).map(|(_, n)| format!("(({t}*)&{n})[j]"))
    }

    fn load(&self, v: &View) -> R<String> {
        let a = match self.vec_name(v) {
            Some(n) => n,
            None => format!("{}[{}]", self.slot_name(v.slot)?, self.offset(v)),
        };
        Ok(match v.mem {
            Mem::Bf16 => format!("bf16_to_f32({a})"),
            Mem::F32 | Mem::I32 => a,
        })
    }

    fn store(&self, s: &Store) -> R<String> {
        let a = match self.vec_name(&s.view) {
            Some(n) => n,
            None => format!("{}[{}]", self.slot_name(s.view.slot)?, self.offset(&s.view)),
        };
        let v = format!("v{}", s.value);
        Ok(match s.view.mem {
            // Narrowing a value rounded to bf16 is narrowing the value: the rounding is dead.
            Mem::Bf16 => match self.p.node(s.value).expr {
                Expr::RoundBf16(x) if !self.stashed.borrow().contains(&s.value) => format!("{a} = f32_to_bf16(v{x});"),
                _ => format!("{a} = f32_to_bf16({v});"),
            },
            Mem::F32 | Mem::I32 => format!("{a} = {v};"),
        })
    }

    /// The right-hand side of node `id` (not a reduction).
    fn expr(&self, id: NodeId) -> R<String> {
        let n = self.p.node(id);
        let v = |a: &NodeId| format!("v{a}");
        Ok(match &n.expr {
            Expr::ConstF(b) => float_lit(f32::from_bits(*b)),
            Expr::ConstI(i) => {
                if *i == i32::MIN {
                    "(-2147483647 - 1)".into()
                } else {
                    i.to_string()
                }
            }
            Expr::Load(view) => self.load(view)?,
            Expr::ColIota => "c".into(),
            Expr::RowIota { div, modulo } => {
                let q = if *div == 1 { "r".to_string() } else { format!("(r / {div})") };
                if *modulo == 0 {
                    format!("(int)({q})")
                } else {
                    format!("(int)({q} % {modulo})")
                }
            }
            Expr::Unary(u, a) => match u {
                UnaryOp::Neg => format!("-{}", v(a)),
                UnaryOp::Exp if self.fast_math => format!("fast_exp({})", v(a)),
                UnaryOp::Exp => format!("expf({})", v(a)),
                UnaryOp::Log => format!("logf({})", v(a)),
                UnaryOp::Sqrt => format!("sqrtf({})", v(a)),
                UnaryOp::Rsqrt => format!("1.0f / sqrtf({})", v(a)),
                UnaryOp::Tanh if self.fast_math => format!("fast_tanh({})", v(a)),
                UnaryOp::Tanh => format!("tanhf({})", v(a)),
                UnaryOp::Recip => format!("1.0f / {}", v(a)),
            },
            Expr::Binary(op, a, b) => {
                let (x, y) = (v(a), v(b));
                match (n.ty, op) {
                    (_, BinaryOp::Add) => format!("{x} + {y}"),
                    (_, BinaryOp::Sub) => format!("{x} - {y}"),
                    (_, BinaryOp::Mul) => format!("{x} * {y}"),
                    (Ty::F32, BinaryOp::Div) => format!("{x} / {y}"),
                    (Ty::F32, BinaryOp::Max) => format!("max_nan({x}, {y})"),
                    (Ty::F32, BinaryOp::Min) => format!("min_nan({x}, {y})"),
                    (Ty::I32, BinaryOp::Max) => format!("max({x}, {y})"),
                    (Ty::I32, BinaryOp::Min) => format!("min({x}, {y})"),
                    (Ty::I32, BinaryOp::Div) => return Err("i32 division".into()),
                }
            }
            Expr::Cmp(c, a, b) => {
                let o = match c {
                    CmpOp::Lt => "<",
                    CmpOp::Le => "<=",
                    CmpOp::Gt => ">",
                    CmpOp::Ge => ">=",
                    CmpOp::Eq => "==",
                    CmpOp::Ne => "!=",
                };
                format!("({} {o} {}) ? 1 : 0", v(a), v(b))
            }
            Expr::Select(c, a, b) => format!("{} != 0 ? {} : {}", v(c), v(a), v(b)),
            Expr::RoundBf16(a) => format!("round_bf16({})", v(a)),
            Expr::FToI(a) => format!("__float2int_rz({})", v(a)),
            Expr::IToF(a) => format!("__int2float_rn({})", v(a)),
            Expr::RowReduce(..) | Expr::ColReduce(..) | Expr::Pick(..) => return Err(format!("internal: %{id} outside its place")),
        })
    }

    fn node_line(&self, out: &mut String, ind: &str, id: NodeId) -> R<()> {
        if let Expr::Pick(x, t) = self.p.node(id).expr {
            // `x` at column `t` (`+ 0.0`, as the row sum it replaces), 0 outside the row.
            let _ = writeln!(out, "{ind}float v{id} = 0.0f;");
            let _ = writeln!(out, "{ind}if (v{t} >= 0 && v{t} < {}) {{\n{ind}  const int c = v{t};", self.p.cols);
            let inner = format!("{ind}  ");
            // Another column than the loop's: loads from memory.
            let vec = self.vec.take();
            for n in self.needed([x], |i| region(self.p, i) == Region::Col) {
                self.node_line(out, &inner, n)?;
            }
            *self.vec.borrow_mut() = vec;
            let _ = writeln!(out, "{ind}  v{id} = v{x} + 0.0f;\n{ind}}}");
            return Ok(());
        }
        let e = self.expr(id)?;
        let _ = writeln!(out, "{ind}const {} v{id} = {e};", ty(self.p.node(id).ty));
        Ok(())
    }

    /// The nodes needed for `roots`, following arguments while `inside` holds (others are in
    /// scope already), in topological (id) order.
    fn needed(&self, roots: impl IntoIterator<Item = NodeId>, inside: impl Fn(NodeId) -> bool) -> Vec<NodeId> {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<NodeId> = roots.into_iter().filter(|&r| inside(r)).collect();
        while let Some(id) = stack.pop() {
            if seen.insert(id) {
                stack.extend(self.p.node(id).expr.args().into_iter().filter(|&a| inside(a)));
            }
        }
        seen.into_iter().collect()
    }

    fn lines(&self, out: &mut String, ind: &str, ids: &[NodeId]) -> R<()> {
        ids.iter().try_for_each(|&id| self.node_line(out, ind, id))
    }

    fn scratch_of(&self, id: NodeId) -> u64 {
        self.scratch.iter().find(|(n, _)| *n == id).map(|(_, o)| *o).expect("column reduction has scratch")
    }

    fn entry_nodes(&self, live: &[bool]) -> Vec<NodeId> {
        (0..self.p.nodes.len() as NodeId).filter(|&i| live[i as usize] && region(self.p, i) == Region::Entry).collect()
    }

    /// The body of the main kernel (after the signature), indented by two spaces.
    pub fn main_body(&self, out: &mut String) -> R<()> {
        match self.plan.mapping {
            Mapping::Flat => self.flat(out, "  ", 0, self.flat_width()),
            Mapping::Cols { chunks } => self.cols(out, chunks),
            Mapping::Rows { team, tpb, teams, cluster: 1 } => self.rows(out, team, tpb, teams, 1),
            Mapping::Rows { team, tpb, teams, cluster } => {
                // A cluster of blocks a row on sm_90; elsewhere one block a row, the other
                // blocks of the grid idle.
                out.push_str("#if __CUDA_ARCH__ >= 900\n");
                self.rows(out, team * cluster, tpb, teams, cluster)?;
                let shared = self.shared.get();
                out.push_str("#else\n");
                self.rows(out, team, tpb, teams, 1)?;
                out.push_str("#endif\n");
                self.shared.set(self.shared.get().max(shared));
                Ok(())
            }
        }
    }

    /// Elements a thread of the flat body moves (1, 4 or 8: see `width`; rows of a multiple of
    /// four or eight elements).
    pub fn flat_width(&self) -> u32 {
        let stores = self.plan.elem_stores.iter().map(|&s| &self.p.stores[s]);
        let live: Vec<NodeId> = (0..self.p.nodes.len() as NodeId).filter(|&i| self.plan.main_live[i as usize]).collect();
        self.width(&live, stores)
    }

    /// The flat body: element `i` of this segment is thread `threadIdx.x` of block
    /// `blockIdx.x - first_block`, or, `w > 1`, elements `w i .. w i + w` with vector accesses
    /// to the contiguous views (a `w` from `flat_width`, or one that divides it).
    pub fn flat(&self, out: &mut String, ind: &str, first_block: u64, w: u32) -> R<()> {
        let wide = w > 1;
        let (p, plan) = (self.p, &self.plan);
        let total = p.rows * p.cols;
        let it = if total < (1 << 31) { "unsigned" } else { "unsigned long long" };
        let b = match first_block {
            _ if self.generic => "(blockIdx.x - first)".to_string(),
            0 => "blockIdx.x".to_string(),
            f => format!("(blockIdx.x - {f}u)"),
        };
        let (total, cols) = if self.generic { ("total".into(), "cols".into()) } else { (format!("{total}ull"), format!("{}u", p.cols)) };
        let live = &plan.main_live;
        let ids: Vec<NodeId> = (0..p.nodes.len() as NodeId).filter(|&i| live[i as usize]).collect();
        let stores = || plan.elem_stores.iter().map(|&s| &p.stores[s]);
        let place = format!("const {it} r = i / {cols};\n{ind}const int c = (int)(i % {cols});");
        // Where the vector accesses of a wide body are: its first element's row and column.
        let at = format!("const {it} i = i0, r = i / {cols}; const int c = (int)(i % {cols});");
        let inner = if wide {
            let _ = writeln!(out, "{ind}const {it} i0 = ((({it}){b}) * {BLOCK}u + threadIdx.x) * {w}u;");
            let _ = writeln!(out, "{ind}if (i0 >= {total}) return;");
            self.vector_io(out, (ind, &at), &ids, stores(), w, true)?;
            let _ = writeln!(out, "#pragma unroll\n{ind}for (int j = 0; j < {w}; ++j) {{");
            let inner = format!("{ind}  ");
            let _ = writeln!(out, "{inner}const {it} i = i0 + j;\n{inner}{}", place.replace(ind, &inner));
            inner
        } else {
            let _ = writeln!(out, "{ind}const {it} i = (({it}){b}) * {BLOCK}u + threadIdx.x;");
            let _ = writeln!(out, "{ind}if (i >= {total}) return;");
            let _ = writeln!(out, "{ind}{place}");
            ind.to_string()
        };
        self.lines(out, &inner, &ids)?;
        for s in stores() {
            let _ = writeln!(out, "{inner}{}", self.store(s)?);
        }
        if !plan.row_stores.is_empty() {
            let _ = writeln!(out, "{inner}if (c == 0) {{");
            for &s in &plan.row_stores {
                let _ = writeln!(out, "{inner}  {}", self.store(&p.stores[s])?);
            }
            let _ = writeln!(out, "{inner}}}");
        }
        if wide {
            let _ = writeln!(out, "{ind}}}");
            self.vector_io(out, (ind, &at), &ids, stores(), w, false)?;
        }
        Ok(())
    }

    /// The body of the finalize kernel (block 32 x [`FIN_SLICES`]), or `None` when there is
    /// nothing to do after the rows.
    ///
    /// Each of the block's thread rows sums a contiguous slice of the partials with four
    /// interleaved accumulators (`q mod 4`, combined as `(a0 + a1) + (a2 + a3)`), then thread
    /// row 0 adds the slice sums in order: a fixed order, with 4 x [`FIN_SLICES`] loads in flight
    /// per column instead of a chain of dependent adds (the 2,048 partials of a LayerNorm
    /// gradient took 30 us with 8 serial slices on an H100).
    pub fn fin_body(&self, out: &mut String) -> R<Option<u32>> {
        let (p, plan) = (self.p, &self.plan);
        if plan.fin_stores.is_empty() {
            return Ok(None);
        }
        let live = &plan.fin_live;
        let cols = p.cols;
        let np = plan.parts;
        let col_colreds: Vec<NodeId> = plan.colreds.iter().copied().filter(|c| !plan.row_colreds.contains(c)).collect();
        for &c in &col_colreds {
            let _ = writeln!(out, "  __shared__ float f{c}[{FIN_SLICES}][33];");
        }
        let _ = writeln!(out, "  const int x = threadIdx.x, y = threadIdx.y;\n  const int c = blockIdx.x * 32 + x;");
        // Kernel-wide values: entry nodes, combined row-value reductions and what follows them.
        for id in 0..p.nodes.len() as NodeId {
            if !live[id as usize] {
                continue;
            }
            let n = p.node(id);
            match region(p, id) {
                Region::Entry => self.node_line(out, "  ", id)?,
                Region::Final if !n.space.has_col() => {
                    if let Expr::ColReduce(op, _, _) = n.expr {
                        let off = self.scratch_of(id);
                        let _ = writeln!(out, "  float v{id} = scratch[{off}];");
                        let _ = writeln!(out, "  for (int q = 1; q < {np}; ++q) v{id} = {}(v{id}, scratch[{off} + q]);", red_fn(op));
                    } else {
                        self.node_line(out, "  ", id)?;
                    }
                }
                Region::Row => return Err("a per-row value used by a column result".into()),
                _ => {}
            }
        }
        for &c in &col_colreds {
            let op = op_of(&p.node(c).expr);
            let off = self.scratch_of(c);
            let (f, init) = (red_fn(op), red_init(op));
            let _ = writeln!(out, "  {{\n    float a0 = {init}, a1 = {init}, a2 = {init}, a3 = {init};\n    if (c < {cols}) {{");
            let _ = writeln!(out, "      const long long q0 = y * {np}ll / {FIN_SLICES}, q1 = (y + 1) * {np}ll / {FIN_SLICES};");
            let _ = writeln!(out, "      const float* s = scratch + {off} + c;\n      long long q = q0;");
            let _ = writeln!(out, "      for (; q + 4 <= q1; q += 4) {{");
            for j in 0..4 {
                let _ = writeln!(out, "        a{j} = {f}(a{j}, s[(q + {j}) * {cols}]);");
            }
            let _ = writeln!(out, "      }}\n      for (; q < q1; ++q) a0 = {f}(a0, s[q * {cols}]);\n    }}");
            let _ = writeln!(out, "    f{c}[y][x] = {f}({f}(a0, a1), {f}(a2, a3));\n  }}");
        }
        if !col_colreds.is_empty() {
            let _ = writeln!(out, "  __syncthreads();");
        }
        let (col_stores, uni_stores): (Vec<usize>, Vec<usize>) = plan.fin_stores.iter().partition(|&&s| p.stores[s].view.col);
        if !col_stores.is_empty() {
            let _ = writeln!(out, "  if (y == 0 && c < {cols}) {{");
            let is_col =
                |id: NodeId| live[id as usize] && p.node(id).space.has_col() && matches!(region(p, id), Region::Col | Region::Final);
            let ids = self.needed(col_stores.iter().map(|&s| p.stores[s].value), is_col);
            for id in ids {
                if let Expr::ColReduce(op, _, _) = p.node(id).expr {
                    let _ = writeln!(out, "    float v{id} = f{id}[0][x];");
                    let _ = writeln!(out, "    for (int j = 1; j < {FIN_SLICES}; ++j) v{id} = {}(v{id}, f{id}[j][x]);", red_fn(op));
                } else {
                    self.node_line(out, "    ", id)?;
                }
            }
            for &s in &col_stores {
                let _ = writeln!(out, "    {}", self.store(&p.stores[s])?);
            }
            let _ = writeln!(out, "  }}");
        }
        if !uni_stores.is_empty() {
            let _ = writeln!(out, "  if (blockIdx.x == 0 && x == 0 && y == 0) {{");
            for &s in &uni_stores {
                let _ = writeln!(out, "    {}", self.store(&p.stores[s])?);
            }
            let _ = writeln!(out, "  }}");
        }
        let grid = if col_stores.is_empty() { 1 } else { cols.div_ceil(32) as u32 };
        Ok(Some(grid))
    }
}

fn term(t: &RowTerm) -> String {
    let mut q = if t.div == 1 { "r".to_string() } else { format!("(r / {})", t.div) };
    if t.modulo != 0 {
        q = format!("({q} % {})", t.modulo);
    }
    if t.stride == 1 {
        q
    } else {
        format!("{q} * {}", t.stride)
    }
}
