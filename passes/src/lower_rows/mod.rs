//! `lower-rows`: a kernel body → row programs ([`Prog`], the kernel-level IR of
//! [`fusec_ir::rows`]), the code generation step both backends start from. It runs on the graph
//! after `memplan` (`fusec dump --pass lower-rows` prints the programs, see [`print()`]); the CPU
//! backend compiles each program with Cranelift, the CUDA backend prints it as CUDA C.
//!
//! The body is first split into *segments* (module `segment`), each lowered on its own.
//!
//! Each segment gets a *domain*: the largest shape among its values and the operands of its
//! ops (the reduction input, the composite's main operand, the pointwise shape). The domain is
//! split into row and column axes: at the first reduced axis for a reduction over trailing axes,
//! after the last reduced axis for a reduction over leading axes (a column reduction), and before
//! the last axis otherwise (row composites work on the last axis).
//!
//! Values are then lowered lazily from the outputs, each in a *context*: for each of the value's
//! axes, the domain axis it indexes (or none for a broadcast size-1 axis). An operand read in a
//! context becomes a load through a [`View`] (per-row offset terms plus a contiguous or absent
//! column part); `broadcast` and `reshape` of operands only change the context or the view, so
//! they cost nothing. Composites are expanded into primitive row operations by
//! `expand`, and module `builder` makes the nodes. A body that does not fit (an unsupported op,
//! a strided column access, a reduction over middle axes, f16 storage, i32 reductions or
//! division) is an `Err` naming what does not fit.

mod builder;
mod expand;
mod print;
mod segment;

use std::collections::HashMap;

use fusec_ir::interp::round_to;
use fusec_ir::rows::{Expr, Mem, NodeId, Prog, RowTerm, Slot, Store, Ty, View, FINAL};
use fusec_ir::{Bindings, DType, Kernel, Op, ReduceOp, ValueId};

pub use print::print;
use segment::{Body, Seg};

/// For each axis of a value, the domain axis it indexes (`None`: a size-1 axis, index 0).
pub(crate) type Ctx = Vec<Option<u8>>;

/// Chunks never hold fewer elements than this (smaller kernels run on one thread).
pub const MIN_CHUNK_ELEMS: u64 = 16 * 1024;
/// The most chunks a segment is split into.
pub const MAX_CHUNKS: u64 = 64;

/// The number of row chunks of an `[rows, cols]` domain: a function of the shape only, so that
/// column-reduction partials (and so the results) do not depend on the thread count.
pub fn chunk_count(rows: u64, cols: u64) -> u64 {
    (rows.saturating_mul(cols) / MIN_CHUNK_ELEMS).clamp(1, MAX_CHUNKS).min(rows).max(1)
}

/// Lowers a kernel body under concrete bindings into one program per segment.
pub fn lower_kernel(k: &Kernel, bind: &Bindings) -> Result<Vec<Prog>, String> {
    let body = Body::new(&k.body, bind)?;
    let mut progs = Vec::new();
    for seg in body.segments() {
        progs.push(lower_segment(&body, &k.name, &seg).map_err(|e| format!("kernel `{}`: {e}", k.name))?);
    }
    Ok(progs)
}

/// How a reduction's axes sit in a domain of rank `n` split at `split`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum RedKind {
    /// Over the column axes: one value per row.
    Row,
    /// Over the row axes: one value per column.
    Col,
    /// Over everything.
    Full,
}

fn red_kind(axes: &[usize], n: usize, split: usize) -> Option<RedKind> {
    let is_range = |lo: usize, hi: usize| axes.len() == hi - lo && axes.iter().enumerate().all(|(i, &a)| a == lo + i);
    if is_range(split, n) {
        Some(RedKind::Row)
    } else if is_range(0, split) {
        Some(RedKind::Col)
    } else if is_range(0, n) {
        Some(RedKind::Full)
    } else {
        None
    }
}

/// The row/column split a reduction wants (`None`: any).
fn wanted_split(axes: &[usize], n: usize) -> Result<Option<usize>, String> {
    let contiguous = axes.windows(2).all(|w| w[1] == w[0] + 1);
    match (axes.first(), axes.last()) {
        (None, _) | (_, None) => Ok(None),
        (Some(&lo), Some(&hi)) if contiguous && lo == 0 && hi == n - 1 => Ok(None),
        (Some(&lo), Some(&hi)) if contiguous && hi == n - 1 => Ok(Some(lo)),
        (Some(&lo), Some(&hi)) if contiguous && lo == 0 => Ok(Some(hi + 1)),
        _ => Err(format!("reduction over axes {axes:?} (neither leading nor trailing axes)")),
    }
}

fn lower_segment(body: &Body, name: &str, seg: &Seg) -> Result<Prog, String> {
    // The domain: the largest shape among the segment's values and operands.
    let mut dom: Vec<usize> = Vec::new();
    let mut best = 0usize;
    let mut consider = |s: &[usize]| {
        let n: usize = s.iter().product();
        if n > best {
            best = n;
            dom = s.to_vec();
        }
    };
    for &i in &seg.nodes {
        let node = &body.g.nodes[i];
        for v in node.inputs.iter().chain(node.results.iter()) {
            consider(body.shape(*v));
        }
    }
    for &j in &seg.outputs {
        consider(body.shape(body.g.outputs[j].1));
    }
    let n = dom.len();
    let mut split: Option<usize> = None;
    for &i in &seg.nodes {
        let node = &body.g.nodes[i];
        let want = match &node.op {
            Op::Reduce { axes, .. } => {
                if body.shape(node.inputs[0]) != dom.as_slice() {
                    return Err(format!("a reduction of {:?} in a kernel over {dom:?}", body.shape(node.inputs[0])));
                }
                wanted_split(axes, n)?
            }
            op if op.is_row_composite() => Some(n.saturating_sub(1)),
            _ => None,
        };
        match (want, split) {
            (Some(w), Some(s)) if w != s => return Err(format!("reductions over different axes (split {s} and {w})")),
            (Some(w), _) => split = Some(w),
            _ => {}
        }
    }
    let split = split.unwrap_or(n.saturating_sub(1));
    let rows: u64 = dom[..split].iter().map(|&d| d as u64).product();
    let cols: u64 = dom[split..].iter().map(|&d| d as u64).product();
    let chunks = chunk_count(rows, cols);
    let mut l = Lowerer {
        b: body,
        dom,
        split,
        rows,
        cols,
        prog: Prog {
            name: name.to_string(),
            rows,
            cols,
            chunks,
            nodes: vec![],
            stores: vec![],
            slots: vec![],
            stashes: vec![],
            offloads: vec![],
            native_maxes: vec![],
        },
        cse: HashMap::new(),
        memo: HashMap::new(),
        comp: HashMap::new(),
        colred: HashMap::new(),
        slot_of: HashMap::new(),
    };
    for &j in &seg.outputs {
        let v = body.g.outputs[j].1;
        let ctx = match l.natural(v)? {
            Some(c) => c,
            None => l.ctx_by_shape(body.shape(v))?,
        };
        let value = l.lower(v, &ctx)?;
        let mem = mem_of(body.dtype(v))?;
        let strides = row_major(body.shape(v));
        let view = l.view(Slot::Result(j), mem, body.shape(v), &ctx, &strides)?;
        if l.prog.node(value).level == FINAL && view.space().has_row() {
            return Err("a column-reduction result stored per row".into());
        }
        l.prog.stores.push(Store { view, value });
    }
    l.add_stashes();
    Ok(l.prog)
}

fn row_major(shape: &[usize]) -> Vec<u64> {
    let mut s = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1] as u64;
    }
    s
}

/// How elements of dtype `d` are stored (f16 is an `Err`).
pub(crate) fn mem_of(d: DType) -> Result<Mem, String> {
    match d {
        DType::F32 => Ok(Mem::F32),
        DType::BF16 => Ok(Mem::Bf16),
        DType::I32 => Ok(Mem::I32),
        DType::F16 => Err("f16 storage is not supported in row programs".into()),
    }
}

/// Lowers one segment.
pub(crate) struct Lowerer<'b, 'g> {
    /// The kernel body being lowered.
    pub b: &'b Body<'g>,
    /// The segment's domain (concrete shape).
    pub(crate) dom: Vec<usize>,
    /// Domain axes before `split` are row axes, the others column axes.
    pub(crate) split: usize,
    /// Rows of the domain.
    rows: u64,
    /// Columns of the domain.
    pub cols: u64,
    /// The program built so far.
    pub prog: Prog,
    /// Existing nodes by expression and type (hash-consing).
    pub(crate) cse: HashMap<(Expr, Ty), NodeId>,
    /// Lowered values by (value, context).
    memo: HashMap<(ValueId, Ctx), NodeId>,
    /// The lowered results of each composite node.
    comp: HashMap<usize, Vec<NodeId>>,
    /// Column reductions by (op, argument) (each gets its own scratch slot once).
    pub(crate) colred: HashMap<(ReduceOp, NodeId), NodeId>,
    /// Slot index of each operand and result.
    slot_of: HashMap<Slot, u32>,
}

impl Lowerer<'_, '_> {
    /// The context mapping a value's axes onto every domain axis.
    pub fn elem_ctx(&self) -> Ctx {
        (0..self.dom.len()).map(|a| Some(a as u8)).collect()
    }
    /// The context of a per-row value (the row axes).
    pub fn row_ctx(&self) -> Ctx {
        (0..self.split).map(|a| Some(a as u8)).collect()
    }
    /// The context of a per-column value (the column axes).
    pub fn col_ctx(&self) -> Ctx {
        (self.split..self.dom.len()).map(|a| Some(a as u8)).collect()
    }

    /// `ctx` with size-1 axes of `shape` mapped to nothing (so equal layouts compare equal).
    fn norm(&self, ctx: &[Option<u8>], shape: &[usize]) -> Ctx {
        ctx.iter().zip(shape).map(|(c, &d)| if d == 1 { None } else { *c }).collect()
    }

    fn ctx_by_shape(&self, s: &[usize]) -> Result<Ctx, String> {
        let n = self.dom.len();
        if s == self.dom.as_slice() {
            Ok(self.elem_ctx())
        } else if s == &self.dom[..self.split] {
            Ok(self.row_ctx())
        } else if s == &self.dom[self.split..n] {
            Ok(self.col_ctx())
        } else if s.iter().all(|&d| d == 1) {
            Ok(vec![None; s.len()])
        } else {
            Err(format!("an output of shape {s:?} in a kernel over {:?}", self.dom))
        }
    }

    /// The context a computed value lives in (`None` for free values).
    fn natural(&mut self, v: ValueId) -> Result<Option<Ctx>, String> {
        if self.b.free[v.0 as usize] {
            return Ok(None);
        }
        let node = &self.b.g.nodes[self.b.prod(v)];
        let idx = self.b.g.values[v.0 as usize].index as usize;
        let n = self.dom.len();
        let ctx = match &node.op {
            op if op.is_elementwise() => {
                let mut found: Option<Ctx> = None;
                for &x in &node.inputs {
                    if let Some(c) = self.natural(x)? {
                        let c = self.norm(&c, self.b.shape(v));
                        match &found {
                            Some(f) if *f != c => return Err(format!("`{}` mixes per-row and per-column values", op.mnemonic())),
                            Some(_) => {}
                            None => found = Some(c),
                        }
                    }
                }
                found.expect("a computed elementwise op has a computed operand")
            }
            Op::Reduce { axes, .. } => match red_kind(axes, n, self.split) {
                Some(RedKind::Row) => self.row_ctx(),
                Some(RedKind::Col) => self.col_ctx(),
                Some(RedKind::Full) => vec![],
                None => return Err(format!("reduction over axes {axes:?}")),
            },
            Op::LayerNorm { .. } if idx > 0 => self.row_ctx(),
            Op::LayerNormGrad if idx > 0 => self.col_ctx(),
            Op::CrossEntropy { .. } => self.row_ctx(),
            Op::CrossEntropyWithGrad { .. } if idx == 0 => self.row_ctx(),
            op if op.is_row_composite() || matches!(op, Op::AdamW { .. }) => self.elem_ctx(),
            op => return Err(format!("`{}` cannot be lowered into a row program", op.mnemonic())),
        };
        Ok(Some(self.norm(&ctx, self.b.shape(v))))
    }

    /// The index of slot `s` (a new slot on first use; every scratch request is a new slot).
    pub(crate) fn slot(&mut self, s: Slot) -> u32 {
        if let Some(&i) = self.slot_of.get(&s) {
            return i;
        }
        let i = self.prog.slots.len() as u32;
        self.prog.slots.push(s);
        if !matches!(s, Slot::Scratch(_)) {
            self.slot_of.insert(s, i);
        }
        i
    }

    /// The view of a buffer of `shape` with element strides `strides`, read in `ctx`.
    fn view(&mut self, slot: Slot, mem: Mem, shape: &[usize], ctx: &[Option<u8>], strides: &[u64]) -> Result<View, String> {
        let n = self.dom.len();
        if ctx.len() != shape.len() {
            return Err(format!("internal: context of rank {} for shape {shape:?}", ctx.len()));
        }
        let mut dstr = vec![0u64; n];
        for (i, c) in ctx.iter().enumerate() {
            if let (Some(a), true) = (c, shape[i] > 1) {
                let a = *a as usize;
                if shape[i] != self.dom[a] {
                    return Err(format!("shape {shape:?} does not fit the kernel's domain {:?}", self.dom));
                }
                dstr[a] += strides[i];
            }
        }
        // Row terms, outermost first, merging axes that are contiguous with each other.
        let mut row: Vec<RowTerm> = Vec::new();
        let mut prev_axis: Option<usize> = None;
        for a in 0..self.split {
            if self.dom[a] == 1 {
                continue;
            }
            let div: u64 = self.dom[a + 1..self.split].iter().map(|&d| d as u64).product();
            let d = self.dom[a] as u64;
            if dstr[a] != 0 {
                match row.last_mut() {
                    Some(t) if prev_axis.is_some_and(|p| dstr[p] != 0) && t.stride == dstr[a] * d => {
                        t.div = div;
                        t.modulo *= d;
                        t.stride = dstr[a];
                    }
                    _ => row.push(RowTerm { div, modulo: d, stride: dstr[a] }),
                }
            }
            prev_axis = Some(a);
        }
        for t in &mut row {
            if t.div.saturating_mul(t.modulo) >= self.rows {
                t.modulo = 0;
            }
        }
        let col_axes: Vec<usize> = (self.split..n).filter(|&a| self.dom[a] > 1).collect();
        let col = if col_axes.iter().all(|&a| dstr[a] == 0) {
            false
        } else if col_axes.iter().all(|&a| dstr[a] == self.dom[a + 1..].iter().map(|&d| d as u64).product::<u64>()) {
            true
        } else {
            return Err(format!("a strided or partially broadcast column access (domain {:?})", self.dom));
        };
        Ok(View { slot: self.slot(slot), mem, row, col })
    }

    /// Marks the transcendental element values that a later pass needs for stashing (see
    /// [`Prog::stashes`]).
    fn add_stashes(&mut self) {
        let p = &self.prog;
        let elem_max = p.nodes.iter().filter(|n| n.level != FINAL && n.space.has_col()).map(|n| n.level).max().unwrap_or(0);
        let mut later = vec![false; p.nodes.len()];
        for n in p.nodes.iter().filter(|n| n.level != FINAL && n.space.has_col()) {
            for a in n.expr.args() {
                if p.node(a).level < n.level {
                    later[a as usize] = true;
                }
            }
        }
        for st in &p.stores {
            if st.view.col && p.node(st.value).level < elem_max {
                later[st.value as usize] = true;
            }
        }
        let picks: Vec<NodeId> = (0..p.nodes.len() as NodeId)
            .filter(|&i| {
                let n = p.node(i);
                later[i as usize]
                    && n.space.has_col()
                    && n.level != FINAL
                    && matches!(n.expr, Expr::Unary(fusec_ir::UnaryOp::Exp | fusec_ir::UnaryOp::Log | fusec_ir::UnaryOp::Tanh, _))
            })
            .collect();
        for id in picks {
            let slot = self.slot(Slot::Scratch((self.prog.chunks * self.cols) as usize));
            self.prog.stashes.push((id, slot));
        }
    }

    /// Lowers value `v` read in context `ctx`.
    pub fn lower(&mut self, v: ValueId, ctx: &[Option<u8>]) -> Result<NodeId, String> {
        let ctx = self.norm(ctx, self.b.shape(v));
        if let Some(&id) = self.memo.get(&(v, ctx.clone())) {
            return Ok(id);
        }
        let id = self.lower_uncached(v, &ctx)?;
        self.memo.insert((v, ctx), id);
        Ok(id)
    }

    fn lower_uncached(&mut self, v: ValueId, ctx: &[Option<u8>]) -> Result<NodeId, String> {
        let ni = self.b.prod(v);
        let node = &self.b.g.nodes[ni];
        let dt = self.b.dtype(v);
        let ins: Vec<ValueId> = node.inputs.to_vec();
        match &node.op {
            Op::Input { .. } => {
                let k = self.b.operand[ni].expect("input nodes are operands");
                let shape = self.b.shape(v).to_vec();
                let view = self.view(Slot::Operand(k), mem_of(dt)?, &shape, ctx, &row_major(&shape))?;
                let ty = view.mem.ty();
                self.node(Expr::Load(view), ty)
            }
            Op::Const { value, .. } => match dt {
                DType::I32 => self.consti(round_to(DType::I32, *value) as i32),
                d => {
                    mem_of(d)?;
                    self.constf(round_to(d, *value) as f32)
                }
            },
            Op::Iota { axis, .. } => {
                let i = match ctx[*axis] {
                    None => self.consti(0)?,
                    Some(a) if (a as usize) >= self.split => self.col_iota()?,
                    Some(a) => {
                        let a = a as usize;
                        let div: u64 = self.dom[a + 1..self.split].iter().map(|&d| d as u64).product();
                        let d = self.dom[a] as u64;
                        let modulo = if div * d >= self.rows { 0 } else { d };
                        self.node(Expr::RowIota { div, modulo }, Ty::I32)?
                    }
                };
                self.cast_node(i, DType::I32, dt)
            }
            Op::Broadcast { dims, .. } => {
                let (xs, vs) = (self.b.shape(ins[0]).to_vec(), self.b.shape(v).to_vec());
                let sub: Ctx = xs.iter().enumerate().map(|(i, &d)| if d == vs[dims[i]] { ctx[dims[i]] } else { None }).collect();
                self.lower(ins[0], &sub)
            }
            Op::Reshape { .. } => self.reshape(v, ins[0], ctx),
            Op::Unary(u) => {
                let a = self.lower(ins[0], ctx)?;
                let r = self.un(*u, a)?;
                self.round(r, dt)
            }
            Op::Binary(op) => {
                let (a, b) = (self.lower(ins[0], ctx)?, self.lower(ins[1], ctx)?);
                let r = self.bin(*op, a, b)?;
                self.round(r, dt)
            }
            Op::Compare(c) => {
                let (a, b) = (self.lower(ins[0], ctx)?, self.lower(ins[1], ctx)?);
                self.cmp(*c, a, b)
            }
            Op::Select => {
                let (c, a, b) = (self.lower(ins[0], ctx)?, self.lower(ins[1], ctx)?, self.lower(ins[2], ctx)?);
                self.select(c, a, b)
            }
            Op::Cast { to } => {
                let a = self.lower(ins[0], ctx)?;
                self.cast_node(a, self.b.dtype(ins[0]), *to)
            }
            Op::Gelu => {
                let x = self.lower(ins[0], ctx)?;
                let r = expand::gelu(self, x)?;
                self.round(r, dt)
            }
            Op::GeluGrad => {
                let (x, dy) = (self.lower(ins[0], ctx)?, self.lower(ins[1], ctx)?);
                let r = expand::gelu_grad(self, x, dy)?;
                self.round(r, dt)
            }
            Op::Reduce { op, axes } => {
                let n = self.dom.len();
                if axes.is_empty() {
                    return self.lower(ins[0], ctx);
                }
                let kind = red_kind(axes, n, self.split).ok_or_else(|| format!("reduction over axes {axes:?}"))?;
                let want = match kind {
                    RedKind::Row => self.row_ctx(),
                    RedKind::Col => self.col_ctx(),
                    RedKind::Full => vec![],
                };
                if self.norm(&want, self.b.shape(v)) != ctx {
                    return Err("a reduction result read through a layout change".into());
                }
                let x = self.lower(ins[0], &self.elem_ctx())?;
                let r = match kind {
                    RedKind::Row => self.row_reduce(*op, x)?,
                    RedKind::Col => self.col_reduce(*op, x)?,
                    RedKind::Full => {
                        let rr = self.row_reduce(*op, x)?;
                        self.col_reduce(*op, rr)?
                    }
                };
                self.round(r, dt)
            }
            op if op.is_row_composite() || matches!(op, Op::AdamW { .. }) => {
                let idx = self.b.g.values[v.0 as usize].index as usize;
                if self.natural(v)?.as_deref() != Some(ctx) {
                    return Err(format!("a result of `{}` read through a layout change", node.op.mnemonic()));
                }
                if !self.comp.contains_key(&ni) {
                    let rs = expand::composite(self, ni)?;
                    let node = &self.b.g.nodes[ni];
                    let rs = rs
                        .into_iter()
                        .zip(node.results.clone())
                        .map(|(r, rv)| self.round(r, self.b.dtype(rv)))
                        .collect::<Result<Vec<_>, _>>()?;
                    self.comp.insert(ni, rs);
                }
                Ok(self.comp[&ni][idx])
            }
            op => Err(format!("`{}` cannot be lowered into a row program", op.mnemonic())),
        }
    }

    /// `reshape(x)` read in `ctx`: a load with the reshaped layout when `x` is an operand (or a
    /// reshape chain of one), a constant, or `x` itself when only size-1 axes change.
    fn reshape(&mut self, v: ValueId, x: ValueId, ctx: &[Option<u8>]) -> Result<NodeId, String> {
        let mut root = x;
        while let Op::Reshape { .. } = self.b.g.nodes[self.b.prod(root)].op {
            root = self.b.g.nodes[self.b.prod(root)].inputs[0];
        }
        let ni = self.b.prod(root);
        match &self.b.g.nodes[ni].op {
            Op::Input { .. } => {
                let k = self.b.operand[ni].expect("input nodes are operands");
                let shape = self.b.shape(v).to_vec();
                let view = self.view(Slot::Operand(k), mem_of(self.b.dtype(v))?, &shape, ctx, &row_major(&shape))?;
                let ty = view.mem.ty();
                return self.node(Expr::Load(view), ty);
            }
            Op::Const { .. } => return self.lower(root, &vec![None; self.b.shape(root).len()]),
            _ => {}
        }
        let (xs, vs) = (self.b.shape(x).to_vec(), self.b.shape(v).to_vec());
        let xi: Vec<usize> = (0..xs.len()).filter(|&i| xs[i] > 1).collect();
        let vi: Vec<usize> = (0..vs.len()).filter(|&i| vs[i] > 1).collect();
        if xi.len() != vi.len() || xi.iter().zip(&vi).any(|(&a, &b)| xs[a] != vs[b]) {
            return Err("a reshape that regroups the axes of a computed value".into());
        }
        let mut sub: Ctx = vec![None; xs.len()];
        for (&a, &b) in xi.iter().zip(&vi) {
            sub[a] = ctx[b];
        }
        self.lower(x, &sub)
    }

    /// A conversion between dtypes.
    fn cast_node(&mut self, a: NodeId, from: DType, to: DType) -> Result<NodeId, String> {
        use DType::*;
        match (from, to) {
            (F16, _) | (_, F16) => Err("f16 casts are not supported in row programs".into()),
            (I32, I32) | (F32 | BF16, F32) | (BF16, BF16) => Ok(a),
            (F32, BF16) => self.node(Expr::RoundBf16(a), Ty::F32),
            (F32 | BF16, I32) => self.node(Expr::FToI(a), Ty::I32),
            (I32, F32 | BF16) => {
                let f = self.node(Expr::IToF(a), Ty::F32)?;
                self.round(f, to)
            }
        }
    }
}
