//! Row program → Cranelift IR: the chunk function and the finalize function.
//!
//! The chunk function is `fn(args: *const *mut u8, row_begin: i64, row_end: i64, chunk: i64)`:
//!
//! ```text
//! entry:    slot pointers from `args`; kernel-wide values (constants, scalar operands);
//!           this chunk's column-reduction partials set to 0 (or -inf for max)
//! row loop: per-row addresses and level-0 row values (targets, mean, rstd, picked logits);
//!           the next row's addresses (for the native routines to prefetch)
//!           for each level L:
//!             [native pass]   native row maxima of operand rows; the arguments of the
//!                             offloaded exp/tanh values not read straight from an operand,
//!                             written to their row buffers by a column loop; the native calls
//!                             (results in the row buffers, row sums returned)
//!             pass L:         one-hot fix-up values computed (column t, before any store)
//!                             splat the row values it reads (hoisted out of the column loop)
//!                             vector loop over c, unrolled (4 copies of the f32x4 body with
//!                               one row reduction, 2 with two, each copy with its own
//!                               accumulators; 2 without reductions): element values, column
//!                               partials, accumulators, stashed values (written here, read
//!                               back by later passes), stores
//!                             the remaining whole vectors (into accumulator copies 0, 1, ..)
//!                             copies combined (0 ⊕ 1) ⊕ (2 ⊕ 3), then lanes (0 ⊕ 1) ⊕ (2 ⊕ 3)
//!                             scalar tail columns (C mod 4, unrolled: C is a constant)
//!                             the one-hot fix-up stores
//!             row values of level L + 1 (statistics)
//!           per-row results; row-value column partials
//! ```
//!
//! The finalize function `fn(args)` runs once after every chunk: it adds the partials in chunk
//! order (then the column-space epilogue, e.g. `grad.w + dw`) and stores column and scalar
//! results. Row reductions put column `c` into lane `c % 4u` of `4u` partial results (`u`
//! copies; combined as above, then the tail columns in order), column reductions sum rows in
//! order within a chunk then chunks in order: fixed orders, so results are deterministic. A
//! row max is a `maxps` per lane (which drops NaN) plus a per-lane NaN flag, so NaN still
//! propagates.
//!
//! The native routines (module `vmath`) compute the same bits as the loop would (a returned
//! row sum in the order of a pass with that one reduction) except, for a row max, the sign of
//! a zero maximum.
//!
//! Element code uses one instruction per IR operation (separate `fmul` and `fadd`: the
//! interpreter rounds after every op, so contraction into FMA would change results), and
//! compare + select for max/min so NaN propagates as in the interpreter.
//!
//! This module holds the code generation state (`Gen`: values, addresses, reductions) and
//! builds the two functions (entry, row loop, finalize); module `pass` emits the column loops
//! of a pass and the native calls around them.

use std::collections::{HashMap, HashSet};

use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{types, AbiParam, Function, InstBuilder, MemFlagsData, Signature, Type, UserFuncName, Value};
use cranelift_codegen::isa::{CallConv, TargetFrontendConfig};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use fusec_ir::rows::{region, Expr, NodeId, Prog, Region, RowTerm, Space, Ty, View, FINAL, UNI_PARTIAL_STRIDE};
use fusec_ir::ReduceOp;

use crate::isa::Isa;
use crate::math::Fx;
use crate::ops;
use crate::plan::{plan, Pass, Plan};

mod pass;

type R<T> = Result<T, String>;

/// Accumulators per vector loop, over all its row reductions: each reduction gets
/// `UNROLL_REDUCE / count` copies (a row reduction is otherwise one dependency chain through the
/// whole row; more accumulators than this are spilled, every iteration).
const UNROLL_REDUCE: usize = 4;
/// Copies of the vector-loop body per iteration in a pass without row reductions.
const UNROLL_STORE: usize = 2;
/// Memory ranges a native routine call prefetches (see [`crate::vmath::RowFn`]).
const PREFETCH_STREAMS: usize = 3;

/// The Cranelift functions of one program.
pub struct Built {
    /// The chunk function.
    pub main: Function,
    /// The finalize function, if the program has column-space or scalar results.
    pub finalize: Option<Function>,
}

/// The column being computed.
#[derive(Clone, Copy)]
pub(crate) enum ColPos {
    /// The loop's `c` (i64) plus a constant column offset (the unrolled copies of the body).
    Var(Value, u64),
    /// A tail column.
    Const(u64),
}

/// Code generation state for one function.
pub(crate) struct Gen<'p, 'f> {
    pub p: &'p Prog,
    pub b: FunctionBuilder<'f>,
    /// Slot pointers (loaded at entry).
    pub slots: Vec<Value>,
    /// Entry, row and finalize-scalar values, and raw comparison masks among them.
    pub scalars: HashMap<NodeId, Value>,
    pub scalar_masks: HashMap<NodeId, Value>,
    /// Splats of scalar values for the current vector loop.
    pub splats: HashMap<NodeId, Value>,
    /// Column values of the current column (vector or scalar), and their raw masks.
    pub cur: HashMap<NodeId, Value>,
    pub cur_masks: HashMap<NodeId, Value>,
    /// Per-row base addresses by (slot, row terms).
    pub rowaddr: HashMap<(u32, Vec<RowTerm>), Value>,
    /// Four lanes (else one).
    pub vec: bool,
    pub cpos: ColPos,
    /// The row index (chunk function).
    pub r: Option<Value>,
    /// This chunk's partials base per column reduction.
    pub partial_base: HashMap<NodeId, Value>,
    /// Generating the finalize function.
    pub fin: bool,
    /// This chunk's row buffer per stashed value.
    pub stash_base: HashMap<NodeId, Value>,
    /// This chunk's row buffer per offloaded value.
    pub offload_base: HashMap<NodeId, Value>,
    /// Offloaded values whose row buffers hold the current row's results (the native routine
    /// has run on them).
    pub ready: HashSet<NodeId>,
    /// The calling convention (of the native routines too).
    pub cc: CallConv,
    /// One-hot selects taken as not hit in the vector loop (see `Pass::one_hot`).
    pub assume_false: HashSet<NodeId>,
    /// The next row of up to [`PREFETCH_STREAMS`] element operands and results and its bytes,
    /// for the native routines to prefetch.
    pub prefetch: Vec<(Value, u64)>,
    /// The level of the pass being generated.
    pub level: u32,
    /// Which native row routines the calls go to.
    pub isa: Isa,
}

impl<'f> Gen<'_, 'f> {
    /// An `Fx` at the current width.
    pub fn fx(&mut self) -> Fx<'_, 'f> {
        Fx { b: &mut self.b, vec: self.vec }
    }

    /// The register type of a node at the current width.
    pub fn vty(&self, ty: Ty) -> Type {
        match (ty, self.vec) {
            (Ty::F32, true) => types::F32X4,
            (Ty::F32, false) => types::F32,
            (Ty::I32, true) => types::I32X4,
            (Ty::I32, false) => types::I32,
        }
    }

    /// Node `id` at the current width.
    pub fn get(&mut self, id: NodeId) -> R<Value> {
        let reg = region(self.p, id);
        if self.is_loop(id) {
            if let Some(&v) = self.cur.get(&id) {
                return Ok(v);
            }
            let ready = self.ready.contains(&id).then(|| self.offload_base[&id]);
            let v = match ready.or_else(|| self.stash_base.get(&id).copied().filter(|_| self.p.node(id).level < self.level)) {
                Some(base) => {
                    let addr = self.col_offset(base, 4);
                    let ty = self.vty(Ty::F32);
                    self.b.ins().load(ty, MemFlagsData::trusted(), addr, 0)
                }
                _ => ops::compute(self, id)?,
            };
            self.cur.insert(id, v);
            return Ok(v);
        }
        let map = if self.vec { &self.splats } else { &self.scalars };
        map.get(&id).copied().ok_or_else(|| format!("internal: %{id} ({reg:?}) is not available here"))
    }

    /// Whether node `id` is computed per column (inside a column loop).
    pub fn is_loop(&self, id: NodeId) -> bool {
        let reg = region(self.p, id);
        reg == Region::Col || (self.fin && reg == Region::Final && self.p.node(id).space.has_col())
    }

    /// Computes a scalar (entry, row or finalize) node and records it.
    fn emit_scalar(&mut self, id: NodeId) -> R<()> {
        let saved = self.vec;
        self.vec = false;
        let v = ops::compute(self, id)?;
        self.vec = saved;
        self.scalars.insert(id, v);
        Ok(())
    }

    /// The address of element `(r, c)` of a view at the current column.
    pub fn addr(&mut self, v: &View) -> R<Value> {
        let base = if v.row.is_empty() {
            self.slots[v.slot as usize]
        } else {
            *self.rowaddr.get(&(v.slot, v.row.clone())).ok_or("internal: row address not computed")?
        };
        if !v.col {
            return Ok(base);
        }
        Ok(self.col_offset(base, v.mem.size()))
    }

    fn row_addresses(&mut self, views: &[View]) {
        let r = self.r.expect("row loop");
        for v in views {
            let key = (v.slot, v.row.clone());
            if v.row.is_empty() || self.rowaddr.contains_key(&key) {
                continue;
            }
            let a = self.row_address(v, r);
            self.rowaddr.insert(key, a);
        }
    }

    /// The address of row `r` of a view with row terms.
    fn row_address(&mut self, v: &View, r: Value) -> Value {
        let mut off: Option<Value> = None;
        for t in &v.row {
            let mut q = r;
            if t.div != 1 {
                let d = self.b.ins().iconst(types::I64, t.div as i64);
                q = self.b.ins().udiv(q, d);
            }
            if t.modulo != 0 {
                let m = self.b.ins().iconst(types::I64, t.modulo as i64);
                q = self.b.ins().urem(q, m);
            }
            let q = self.b.ins().imul_imm_s(q, (t.stride * v.mem.size()) as i64);
            off = Some(match off {
                Some(o) => self.b.ins().iadd(o, q),
                None => q,
            });
        }
        self.b.ins().iadd(self.slots[v.slot as usize], off.expect("row terms"))
    }

    /// Identity of a reduction at the current width.
    fn red_init(&mut self, op: ReduceOp) -> Value {
        let x = if op == ReduceOp::Max { f32::NEG_INFINITY } else { 0.0 };
        self.fx().f(x)
    }

    /// `acc ⊕ v`.
    pub fn red_step(&mut self, op: ReduceOp, acc: Value, v: Value) -> Value {
        match op {
            ReduceOp::Sum => self.b.ins().fadd(acc, v),
            ReduceOp::Max => self.fx().max_nan(acc, v),
        }
    }

    /// The lanes of a vector accumulator combined as `(l0 ⊕ l1) ⊕ (l2 ⊕ l3)`.
    fn hreduce(&mut self, op: ReduceOp, acc: Value) -> Value {
        let l: Vec<Value> = (0..4u8).map(|i| self.b.ins().extractlane(acc, i)).collect();
        let saved = self.vec;
        self.vec = false;
        let a = self.red_step(op, l[0], l[1]);
        let b = self.red_step(op, l[2], l[3]);
        let r = self.red_step(op, a, b);
        self.vec = saved;
        r
    }

    /// `base + c * size` at the current column.
    pub fn col_offset(&mut self, base: Value, size: u64) -> Value {
        match self.cpos {
            ColPos::Var(c, k) => {
                let off = self.b.ins().ishl_imm_u(c, size.trailing_zeros() as i64);
                let a = self.b.ins().iadd(base, off);
                if k == 0 {
                    a
                } else {
                    self.b.ins().iadd_imm_s(a, (k * size) as i64)
                }
            }
            ColPos::Const(t) => self.b.ins().iadd_imm_s(base, (t * size) as i64),
        }
    }

    /// The per-row i32 node `t` as an i64 column index clamped into `[0, C)`.
    pub fn clamped_col(&mut self, t: NodeId) -> R<Value> {
        let cols = self.p.cols as i64;
        let t = self.get(t)?;
        let t64 = self.b.ins().sextend(types::I64, t);
        let zero = self.b.ins().iconst(types::I64, 0);
        let last = self.b.ins().iconst(types::I64, cols - 1);
        let lo = self.b.ins().smax(t64, zero);
        Ok(self.b.ins().smin(lo, last))
    }

    /// Sets this chunk's partials of every column reduction to the reduction's identity.
    fn init_partials(&mut self, colreds: &[NodeId], chunk: Value) -> R<()> {
        for &c in colreds {
            let Expr::ColReduce(op, a, slot) = self.p.node(c).expr else { unreachable!() };
            let has_col = self.p.node(a).space.has_col();
            let stride = if has_col { self.p.cols } else { UNI_PARTIAL_STRIDE } * 4;
            let off = self.b.ins().imul_imm_s(chunk, stride as i64);
            let base = self.b.ins().iadd(self.slots[slot as usize], off);
            self.partial_base.insert(c, base);
            let n = if has_col { self.p.cols } else { 1 };
            self.fill(base, n, op)?;
        }
        Ok(())
    }

    /// Stores the identity of `op` into `n` floats at `base`.
    fn fill(&mut self, base: Value, n: u64, op: ReduceOp) -> R<()> {
        let n4 = n / 4 * 4;
        if n4 > 0 {
            self.vec = true;
            let init = self.red_init(op);
            let cvar = self.b.declare_var(types::I64);
            let zero = self.b.ins().iconst(types::I64, 0);
            self.b.def_var(cvar, zero);
            let (body, after) = (self.b.create_block(), self.b.create_block());
            self.b.ins().jump(body, &[]);
            self.b.switch_to_block(body);
            let c = self.b.use_var(cvar);
            self.cpos = ColPos::Var(c, 0);
            let addr = self.col_offset(base, 4);
            self.b.ins().store(MemFlagsData::new().with_notrap(), init, addr, 0);
            let c2 = self.b.ins().iadd_imm_s(c, 4);
            self.b.def_var(cvar, c2);
            let more = self.b.ins().icmp_imm_s(IntCC::SignedLessThan, c2, n4 as i64);
            self.b.ins().brif(more, body, &[], after, &[]);
            self.b.switch_to_block(after);
        }
        self.vec = false;
        if n4 < n {
            let init = self.red_init(op);
            for t in n4..n {
                self.b.ins().store(MemFlagsData::new().with_notrap(), init, base, (t * 4) as i32);
            }
        }
        Ok(())
    }

    fn load_slots(&mut self, args: Value) {
        for i in 0..self.p.slots.len() {
            let v = self.b.ins().load(types::I64, MemFlagsData::trusted().with_readonly(), args, (i * 8) as i32);
            self.slots.push(v);
        }
    }
}

fn signature(cc: CallConv, n: usize) -> Signature {
    let mut s = Signature::new(cc);
    for _ in 0..n {
        s.params.push(AbiParam::new(types::I64));
    }
    s
}

fn new_gen<'p, 'f>(p: &'p Prog, b: FunctionBuilder<'f>, fin: bool) -> Gen<'p, 'f> {
    Gen {
        p,
        b,
        slots: vec![],
        scalars: HashMap::new(),
        scalar_masks: HashMap::new(),
        splats: HashMap::new(),
        cur: HashMap::new(),
        cur_masks: HashMap::new(),
        rowaddr: HashMap::new(),
        vec: false,
        cpos: ColPos::Const(0),
        r: None,
        partial_base: HashMap::new(),
        fin,
        stash_base: HashMap::new(),
        offload_base: HashMap::new(),
        ready: HashSet::new(),
        cc: CallConv::SystemV,
        assume_false: HashSet::new(),
        prefetch: Vec::new(),
        level: 0,
        isa: Isa::Scalar,
    }
}

/// Builds the Cranelift functions of a program (named `<name>_chunk` and `<name>_final`); the
/// program's native calls (see [`Prog::offloads`]) go to the routines of level `isa`.
pub fn build(p: &Prog, isa: Isa, cc: CallConv, tfc: TargetFrontendConfig, fctx: &mut FunctionBuilderContext) -> R<Built> {
    let plan = plan(p);
    let main = build_main(p, &plan, isa, cc, tfc, fctx)?;
    let finalize = if plan.fin_stores.is_empty() { None } else { Some(build_final(p, &plan, cc, tfc, fctx)?) };
    Ok(Built { main, finalize })
}

fn build_main(p: &Prog, plan: &Plan, isa: Isa, cc: CallConv, tfc: TargetFrontendConfig, fctx: &mut FunctionBuilderContext) -> R<Function> {
    let mut func = Function::with_name_signature(UserFuncName::testcase(format!("{}_chunk", p.name)), signature(cc, 4));
    let mut g = new_gen(p, FunctionBuilder::new(&mut func, fctx), false);
    let entry = g.b.create_block();
    g.b.append_block_params_for_function_params(entry);
    g.b.switch_to_block(entry);
    let params = g.b.block_params(entry).to_vec();
    let (args, rb, re, chunk) = (params[0], params[1], params[2], params[3]);
    g.load_slots(args);
    let live = |id: NodeId| plan.main_live[id as usize];
    for id in 0..p.nodes.len() as NodeId {
        if live(id) && region(p, id) == Region::Entry {
            g.emit_scalar(id)?;
        }
    }
    g.init_partials(&plan.colreds, chunk)?;
    g.cc = cc;
    g.isa = isa;
    for o in &plan.offloads {
        let off = g.b.ins().imul_imm_s(chunk, (p.cols * 4) as i64);
        let base = g.b.ins().iadd(g.slots[o.slot as usize], off);
        g.offload_base.insert(o.node, base);
    }
    for &(t, slot) in &plan.stashes {
        let off = g.b.ins().imul_imm_s(chunk, (p.cols * 4) as i64);
        let base = g.b.ins().iadd(g.slots[slot as usize], off);
        g.stash_base.insert(t, base);
    }
    // The row loop.
    let rvar = g.b.declare_var(types::I64);
    g.b.def_var(rvar, rb);
    let (header, body, exit) = (g.b.create_block(), g.b.create_block(), g.b.create_block());
    g.b.ins().jump(header, &[]);
    g.b.switch_to_block(header);
    let r = g.b.use_var(rvar);
    let more = g.b.ins().icmp(IntCC::SignedLessThan, r, re);
    g.b.ins().brif(more, body, &[], exit, &[]);
    g.b.switch_to_block(body);
    g.r = Some(r);
    let views: Vec<View> = p
        .nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| plan.main_live[*i])
        .filter_map(|(_, n)| if let Expr::Load(v) = &n.expr { Some(v.clone()) } else { None })
        .chain(p.stores.iter().filter(|s| s.view.space().has_row()).map(|s| s.view.clone()))
        .collect();
    g.row_addresses(&views);
    if !plan.offloads.is_empty() {
        // The next row of (up to) three element operands and results, for the native routines
        // to prefetch while they compute: the first pass over a row is otherwise a stall on
        // memory, and so are the stores to lines not yet in cache.
        let r1 = g.b.ins().iadd_imm_s(r, 1);
        let mut streams: Vec<View> = Vec::new();
        let loaded = p.nodes.iter().enumerate().filter(|(i, _)| plan.main_live[*i]).filter_map(|(_, n)| match &n.expr {
            Expr::Load(v) => Some(v),
            _ => None,
        });
        for v in loaded.chain(p.stores.iter().map(|s| &s.view)) {
            if v.col && !v.row.is_empty() && streams.len() < PREFETCH_STREAMS && !streams.iter().any(|s| s.slot == v.slot && s.row == v.row)
            {
                streams.push(v.clone());
            }
        }
        g.prefetch = streams.iter().map(|v| (g.row_address(v, r1), p.cols * v.mem.size())).collect();
    }
    let row_nodes = |level: u32| -> Vec<NodeId> {
        (0..p.nodes.len() as NodeId)
            .filter(|&id| {
                live(id) && region(p, id) == Region::Row && p.node(id).level == level && !matches!(p.node(id).expr, Expr::RowReduce(..))
            })
            .collect()
    };
    for id in row_nodes(0) {
        g.emit_scalar(id)?;
    }
    let max_level = p.nodes.iter().filter(|n| n.level != FINAL).map(|n| n.level).max().unwrap_or(0);
    let mut next_pass = 0;
    for level in 0..=max_level {
        while next_pass < plan.passes.len() && plan.passes[next_pass].level == level {
            g.pass(&plan.passes[next_pass])?;
            next_pass += 1;
        }
        for id in row_nodes(level + 1) {
            g.emit_scalar(id)?;
        }
    }
    // Per-row results and row-value column partials.
    g.vec = false;
    for &s in &plan.row_stores {
        let st = &p.stores[s];
        let v = g.get(st.value)?;
        let addr = g.addr(&st.view)?;
        ops::store(&mut g, st.view.mem, v, addr);
    }
    for &c in &plan.row_colreds {
        let Expr::ColReduce(op, a, _) = p.node(c).expr else { unreachable!() };
        let v = g.get(a)?;
        let base = g.partial_base[&c];
        let old = g.b.ins().load(types::F32, MemFlagsData::new().with_notrap(), base, 0);
        let new = g.red_step(op, old, v);
        g.b.ins().store(MemFlagsData::new().with_notrap(), new, base, 0);
    }
    let r1 = g.b.ins().iadd_imm_s(r, 1);
    g.b.def_var(rvar, r1);
    g.b.ins().jump(header, &[]);
    g.b.switch_to_block(exit);
    g.b.ins().return_(&[]);
    g.b.seal_all_blocks();
    g.b.finalize(tfc);
    Ok(func)
}

fn build_final(p: &Prog, plan: &Plan, cc: CallConv, tfc: TargetFrontendConfig, fctx: &mut FunctionBuilderContext) -> R<Function> {
    let mut func = Function::with_name_signature(UserFuncName::testcase(format!("{}_final", p.name)), signature(cc, 1));
    let mut g = new_gen(p, FunctionBuilder::new(&mut func, fctx), true);
    let entry = g.b.create_block();
    g.b.append_block_params_for_function_params(entry);
    g.b.switch_to_block(entry);
    let args = g.b.block_params(entry)[0];
    g.load_slots(args);
    // Scalars: kernel-wide values and combined scalar reductions.
    for id in 0..p.nodes.len() as NodeId {
        if !plan.fin_live[id as usize] {
            continue;
        }
        match region(p, id) {
            Region::Entry => g.emit_scalar(id)?,
            Region::Final if !p.node(id).space.has_col() => g.emit_scalar(id)?,
            Region::Row => return Err("a per-row value used by a column result".into()),
            _ => {}
        }
    }
    let (col_stores, uni_stores): (Vec<usize>, Vec<usize>) = plan.fin_stores.iter().partition(|&&s| p.stores[s].view.space() == Space::Col);
    if !col_stores.is_empty() {
        let pass = Pass {
            level: FINAL,
            rowreds: vec![],
            colreds: vec![],
            stores: col_stores,
            splats: (0..p.nodes.len() as NodeId).filter(|&id| plan.fin_live[id as usize] && g.scalars.contains_key(&id)).collect(),
            stash_writes: vec![],
            offload: vec![],
            native_maxes: vec![],
            one_hot: None,
        };
        g.pass(&pass)?;
    }
    g.vec = false;
    for &s in &uni_stores {
        let st = &p.stores[s];
        let v = g.get(st.value)?;
        let addr = g.addr(&st.view)?;
        ops::store(&mut g, st.view.mem, v, addr);
    }
    g.b.ins().return_(&[]);
    g.b.seal_all_blocks();
    g.b.finalize(tfc);
    Ok(func)
}
