//! The column loops of the chunk and finalize functions: one pass over the columns of a row
//! (see the module docs of [`crate::clif`] for the shape of the loop and its fixed orders), the
//! sink values of one column, and the calls of the native row routines before a pass.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{types, AbiParam, InstBuilder, MemFlagsData, Signature, Value};
use cranelift_frontend::Variable;
use fusec_ir::rows::{Expr, Mem, NodeId, Store, Ty, View};
use fusec_ir::ReduceOp;

use super::{ColPos, Gen, PREFETCH_STREAMS, R, UNROLL_REDUCE, UNROLL_STORE};
use crate::ops;
use crate::plan::{Offload, Pass};

impl Gen<'_, '_> {
    /// Sink values of one column (all loads happen here, before any store); returns the values
    /// the pass's row reductions accumulate (the caller combines them).
    fn column(&mut self, pass: &Pass) -> R<Vec<Value>> {
        let p = self.p;
        let vals: Vec<Value> = pass.rowreds.iter().map(|&r| self.get(p.node(r).expr.args()[0])).collect::<R<_>>()?;
        let cvals: Vec<Value> = pass.colreds.iter().map(|&r| self.get(p.node(r).expr.args()[0])).collect::<R<_>>()?;
        let svals: Vec<Value> = pass.stores.iter().map(|&s| self.get(p.stores[s].value)).collect::<R<_>>()?;
        let stvals: Vec<Value> = pass.stash_writes.iter().map(|&(t, _)| self.get(t)).collect::<R<_>>()?;
        let written: Vec<NodeId> = pass.offload.iter().filter(|o| o.src.is_none()).map(|o| o.node).collect();
        let ovals: Vec<Value> = written.iter().map(|&t| self.get(p.node(t).expr.args()[0])).collect::<R<_>>()?;
        for (i, &t) in written.iter().enumerate() {
            let base = self.offload_base[&t];
            let addr = self.col_offset(base, 4);
            self.b.ins().store(MemFlagsData::trusted(), ovals[i], addr, 0);
        }
        for (i, &(t, _)) in pass.stash_writes.iter().enumerate() {
            let base = self.stash_base[&t];
            let addr = self.col_offset(base, 4);
            self.b.ins().store(MemFlagsData::trusted(), stvals[i], addr, 0);
        }
        for (i, &c) in pass.colreds.iter().enumerate() {
            let Expr::ColReduce(op, _, _) = p.node(c).expr else { unreachable!() };
            let base = self.partial_base[&c];
            let addr = self.col_offset(base, 4);
            let ty = self.vty(Ty::F32);
            let old = self.b.ins().load(ty, MemFlagsData::new().with_notrap(), addr, 0);
            let new = self.red_step(op, old, cvals[i]);
            self.b.ins().store(MemFlagsData::new().with_notrap(), new, addr, 0);
        }
        for (i, &s) in pass.stores.iter().enumerate() {
            self.store(&p.stores[s], svals[i])?;
        }
        Ok(vals)
    }

    fn store(&mut self, s: &Store, v: Value) -> R<()> {
        let addr = self.addr(&s.view)?;
        ops::store(self, s.view.mem, v, addr);
        Ok(())
    }

    /// One pass: an unrolled vector loop (`UNROLL` copies of the body, each with its own
    /// row-reduction accumulators so that the reductions are not one serial dependency chain),
    /// the remaining whole vectors (straight-line, into accumulator copies 0, 1, ..), the copies
    /// combined as a fixed tree and then their lanes, and the scalar tail columns. Every order is
    /// fixed by `C` alone.
    pub(super) fn pass(&mut self, pass: &Pass) -> R<()> {
        self.level = pass.level;
        for (r, v, k) in &pass.native_maxes {
            self.call_native_max(*r, v, *k)?;
        }
        // One-hot selects: the stores' values at column `t` first (see `Pass::one_hot`).
        let mut fixup: Option<(Value, Vec<Value>)> = None;
        if let Some((t, sels)) = &pass.one_hot {
            self.vec = false;
            let tc = self.clamped_col(*t)?;
            self.cpos = ColPos::Var(tc, 0);
            self.cur.clear();
            self.cur_masks.clear();
            let vals = pass.stores.iter().map(|&s| self.get(self.p.stores[s].value)).collect::<R<Vec<_>>>()?;
            fixup = Some((tc, vals));
            self.assume_false = sels.iter().copied().collect();
        }
        let work = !(pass.rowreds.is_empty() && pass.colreds.is_empty() && pass.stores.is_empty() && pass.stash_writes.is_empty())
            || pass.offload.iter().any(|o| o.src.is_none());
        let cols = if work { self.p.cols } else { 0 };
        let c4 = cols / 4 * 4;
        let unroll = match pass.rowreds.len() {
            0 => UNROLL_STORE,
            n => (UNROLL_REDUCE / n).max(1),
        };
        let step = 4 * unroll as u64;
        let cu = cols / step * step;
        let ops_of: Vec<ReduceOp> = pass
            .rowreds
            .iter()
            .map(|&r| match self.p.node(r).expr {
                Expr::RowReduce(op, _) => op,
                _ => unreachable!(),
            })
            .collect();
        let mut reds: Vec<Value>;
        if c4 > 0 {
            self.vec = true;
            self.splats.clear();
            for &id in &pass.splats {
                let s = self.scalars.get(&id).copied().ok_or_else(|| format!("internal: %{id} not computed before pass"))?;
                let ty = self.vty(self.p.node(id).ty);
                let sp = self.b.ins().splat(ty, s);
                self.splats.insert(id, sp);
            }
            // Per row reduction and copy: the accumulator, and for max a NaN flag (the vector
            // max is `maxps`, which drops NaN; the flag restores NaN propagation at the end).
            let copies = if cu > 0 { unroll } else { ((c4 / 4) as usize).min(unroll) };
            let mut accs: Vec<Vec<(Variable, Option<Variable>)>> = Vec::new();
            for &op in &ops_of {
                let mut v = Vec::new();
                for _ in 0..copies {
                    let var = self.b.declare_var(types::F32X4);
                    let init = self.red_init(op);
                    self.b.def_var(var, init);
                    let nan = (op == ReduceOp::Max).then(|| {
                        let nv = self.b.declare_var(types::I32X4);
                        let z = self.fx().i(0);
                        self.b.def_var(nv, z);
                        nv
                    });
                    v.push((var, nan));
                }
                accs.push(v);
            }
            let accumulate = |g: &mut Self, k: usize, vals: &[Value]| {
                for (i, &op) in ops_of.iter().enumerate() {
                    let (var, nan) = accs[i][k];
                    let acc = g.b.use_var(var);
                    let new = match op {
                        ReduceOp::Sum => g.b.ins().fadd(acc, vals[i]),
                        ReduceOp::Max => {
                            let x = vals[i];
                            let lt = g.b.ins().fcmp(FloatCC::LessThan, acc, x);
                            let m = g.fx().sel(lt, x, acc);
                            let nv = nan.expect("max has a NaN flag");
                            let n = g.b.use_var(nv);
                            let un = g.b.ins().fcmp(FloatCC::Unordered, x, x);
                            let n2 = g.b.ins().bor(n, un);
                            g.b.def_var(nv, n2);
                            m
                        }
                    };
                    g.b.def_var(var, new);
                }
            };
            if cu > 0 {
                let cvar = self.b.declare_var(types::I64);
                let zero = self.b.ins().iconst(types::I64, 0);
                self.b.def_var(cvar, zero);
                let (body, after) = (self.b.create_block(), self.b.create_block());
                self.b.ins().jump(body, &[]);
                self.b.switch_to_block(body);
                let c = self.b.use_var(cvar);
                for k in 0..unroll {
                    self.cpos = ColPos::Var(c, 4 * k as u64);
                    self.cur.clear();
                    self.cur_masks.clear();
                    let vals = self.column(pass)?;
                    accumulate(self, k, &vals);
                }
                let c2 = self.b.ins().iadd_imm_s(c, step as i64);
                self.b.def_var(cvar, c2);
                let more = self.b.ins().icmp_imm_s(IntCC::SignedLessThan, c2, cu as i64);
                self.b.ins().brif(more, body, &[], after, &[]);
                self.b.switch_to_block(after);
            }
            for (j, t) in (cu..c4).step_by(4).enumerate() {
                self.cpos = ColPos::Const(t);
                self.cur.clear();
                self.cur_masks.clear();
                let vals = self.column(pass)?;
                accumulate(self, j, &vals);
            }
            reds = Vec::new();
            for (i, &op) in ops_of.iter().enumerate() {
                let mut vs: Vec<(Value, Option<Value>)> =
                    accs[i].iter().map(|&(a, n)| (self.b.use_var(a), n.map(|n| self.b.use_var(n)))).collect();
                // Pairwise: (0 ⊕ 1) ⊕ (2 ⊕ 3).
                while vs.len() > 1 {
                    let mut next = Vec::new();
                    for pair in vs.chunks(2) {
                        if pair.len() == 1 {
                            next.push(pair[0]);
                            continue;
                        }
                        let ((a, na), (b, nb)) = (pair[0], pair[1]);
                        next.push(match op {
                            ReduceOp::Sum => (self.b.ins().fadd(a, b), None),
                            ReduceOp::Max => {
                                let lt = self.b.ins().fcmp(FloatCC::LessThan, a, b);
                                let m = self.fx().sel(lt, b, a);
                                let n = self.b.ins().bor(na.expect("flag"), nb.expect("flag"));
                                (m, Some(n))
                            }
                        });
                    }
                    vs = next;
                }
                let (mut acc, nan) = vs[0];
                if let Some(n) = nan {
                    let qnan = self.fx().f(f32::NAN);
                    acc = self.fx().sel(n, qnan, acc);
                }
                reds.push(self.hreduce(op, acc));
            }
        } else {
            self.vec = false;
            reds = ops_of.iter().map(|&op| self.red_init(op)).collect();
        }
        self.vec = false;
        for t in c4..cols {
            self.cpos = ColPos::Const(t);
            self.cur.clear();
            self.cur_masks.clear();
            let vals = self.column(pass)?;
            for (i, &op) in ops_of.iter().enumerate() {
                reds[i] = self.red_step(op, reds[i], vals[i]);
            }
        }
        for (i, &r) in pass.rowreds.iter().enumerate() {
            self.scalars.insert(r, reds[i]);
        }
        if let Some((tc, vals)) = fixup {
            self.assume_false.clear();
            self.vec = false;
            self.cpos = ColPos::Var(tc, 0);
            for (i, &s) in pass.stores.iter().enumerate() {
                self.store(&self.p.stores[s], vals[i])?;
            }
        }
        for o in &pass.offload {
            self.call_native(o)?;
        }
        Ok(())
    }

    /// Computes row max `r` of the operand row `v` (its first `k` columns) natively.
    fn call_native_max(&mut self, r: NodeId, v: &View, k: u64) -> R<()> {
        let f = crate::vmath::native_max(self.isa, v.mem).ok_or("internal: no native row max")?;
        let mut sig = Signature::new(self.cc);
        sig.params.extend([AbiParam::new(types::I64), AbiParam::new(types::I64), AbiParam::new(types::I64)]);
        sig.returns.push(AbiParam::new(types::F32));
        let sr = self.b.import_signature(sig);
        let fp = self.b.ins().iconst(types::I64, f as usize as i64);
        let src = self.row_base(v)?;
        let n = self.b.ins().iconst(types::I64, k as i64);
        let n4 = self.b.ins().iconst(types::I64, k.min(self.p.cols / 4 * 4) as i64);
        let call = self.b.ins().call_indirect(sr, fp, &[src, n, n4]);
        let m = self.b.inst_results(call)[0];
        self.scalars.insert(r, m);
        Ok(())
    }

    /// The address of column 0 of the current row of view `v`.
    fn row_base(&mut self, v: &View) -> R<Value> {
        Ok(if v.row.is_empty() {
            self.slots[v.slot as usize]
        } else {
            *self.rowaddr.get(&(v.slot, v.row.clone())).ok_or("internal: row address not computed")?
        })
    }

    /// Runs the native routine of an offloaded node into its row buffer (from the operand row,
    /// or in place over the arguments a pass wrote there); later reads of the node load the
    /// results, and its row sums are the routine's return value.
    fn call_native(&mut self, o: &Offload) -> R<()> {
        let t = o.node;
        let Expr::Unary(u, _) = self.p.node(t).expr else { return Err(format!("internal: offloaded %{t} is not a unary op")) };
        // The routine reads its argument from the operand row (f32 or bf16) or from the row
        // buffer (f32).
        let mem = o.src.as_ref().map_or(Mem::F32, |(v, _)| v.mem);
        let f = crate::vmath::native(u, self.isa, mem).ok_or_else(|| format!("internal: no native routine for `{u:?}` on {mem:?}"))?;
        let mut sig = Signature::new(self.cc);
        sig.params.extend([AbiParam::new(types::I64), AbiParam::new(types::I64), AbiParam::new(types::I64), AbiParam::new(types::F32)]);
        for _ in 0..2 * PREFETCH_STREAMS {
            sig.params.push(AbiParam::new(types::I64));
        }
        sig.returns.push(AbiParam::new(types::F32));
        let sr = self.b.import_signature(sig);
        let fp = self.b.ins().iconst(types::I64, f as usize as i64);
        let n = self.b.ins().iconst(types::I64, self.p.cols as i64);
        let base = self.offload_base[&t];
        let (src, shift) = match &o.src {
            Some((v, m)) => {
                let src = self.row_base(v)?;
                let shift = match m {
                    Some(m) => *self.scalars.get(m).ok_or_else(|| format!("internal: %{m} not computed before its call"))?,
                    None => self.b.ins().f32const(0.0),
                };
                (src, shift)
            }
            None => (base, self.b.ins().f32const(0.0)),
        };
        let zero = self.b.ins().iconst(types::I64, 0);
        let dst = if o.read { base } else { zero };
        let mut args = vec![dst, n, src, shift];
        for k in 0..PREFETCH_STREAMS {
            match self.prefetch.get(k) {
                Some(&(a, bytes)) => {
                    let nb = self.b.ins().iconst(types::I64, bytes as i64);
                    args.extend([a, nb]);
                }
                None => args.extend([zero, zero]),
            }
        }
        let call = self.b.ins().call_indirect(sr, fp, &args);
        let sum = self.b.inst_results(call)[0];
        for &r in &o.sums {
            self.scalars.insert(r, sum);
        }
        self.ready.insert(t);
        Ok(())
    }
}
