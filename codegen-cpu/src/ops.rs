//! One row-program node as Cranelift instructions at the current width (`f32x4` in the vector
//! loop, scalar elsewhere), and loads and stores of every storage type.
//!
//! bf16 is loaded by zero-extending the 16 bits and shifting them into the high half of an f32;
//! it is stored by rounding to nearest even on the f32 bits (`bits + 0x7fff + lsb`, NaN kept
//! quiet) and narrowing, and a `round_bf16` node does the same rounding but keeps the f32.
//! Comparisons produce lane masks that a following `select` uses directly; as values they are
//! i32 0 or 1 like the interpreter's.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{types, ConstantData, InstBuilder, MemFlagsData, Value};
use fusec_ir::rows::{Expr, Mem, NodeId, Ty, UNI_PARTIAL_STRIDE};
use fusec_ir::{BinaryOp, CmpOp, UnaryOp};

use crate::clif::{ColPos, Gen};
use crate::math::{self, lane_flags};

type R<T> = Result<T, String>;

fn flags() -> MemFlagsData {
    MemFlagsData::new().with_notrap()
}

fn float_cc(c: CmpOp) -> FloatCC {
    match c {
        CmpOp::Lt => FloatCC::LessThan,
        CmpOp::Le => FloatCC::LessThanOrEqual,
        CmpOp::Gt => FloatCC::GreaterThan,
        CmpOp::Ge => FloatCC::GreaterThanOrEqual,
        CmpOp::Eq => FloatCC::Equal,
        CmpOp::Ne => FloatCC::NotEqual,
    }
}

fn int_cc(c: CmpOp) -> IntCC {
    match c {
        CmpOp::Lt => IntCC::SignedLessThan,
        CmpOp::Le => IntCC::SignedLessThanOrEqual,
        CmpOp::Gt => IntCC::SignedGreaterThan,
        CmpOp::Ge => IntCC::SignedGreaterThanOrEqual,
        CmpOp::Eq => IntCC::Equal,
        CmpOp::Ne => IntCC::NotEqual,
    }
}

/// Computes node `id` at the current width from its arguments (fetched with [`Gen::get`]).
pub(crate) fn compute(g: &mut Gen, id: NodeId) -> R<Value> {
    let node = g.p.node(id).clone();
    Ok(match node.expr {
        Expr::ConstF(bits) => g.fx().f(f32::from_bits(bits)),
        Expr::ConstI(i) => g.fx().i(i),
        Expr::Load(v) => {
            let addr = g.addr(&v)?;
            load(g, v.mem, addr)
        }
        Expr::ColIota => {
            let c32 = match g.cpos {
                ColPos::Var(c, k) => {
                    let c32 = g.b.ins().ireduce(types::I32, c);
                    if k == 0 {
                        c32
                    } else {
                        g.b.ins().iadd_imm_s(c32, k as i64)
                    }
                }
                ColPos::Const(t) => g.b.ins().iconst(types::I32, t as i64),
            };
            if g.vec {
                let s = g.b.ins().splat(types::I32X4, c32);
                let lanes = g.fx().vconst(types::I32X4, [0, 1, 2, 3]);
                g.b.ins().iadd(s, lanes)
            } else {
                c32
            }
        }
        Expr::RowIota { div, modulo } => {
            let mut q = g.r.ok_or("internal: row index outside the row loop")?;
            if div != 1 {
                let d = g.b.ins().iconst(types::I64, div as i64);
                q = g.b.ins().udiv(q, d);
            }
            if modulo != 0 {
                let m = g.b.ins().iconst(types::I64, modulo as i64);
                q = g.b.ins().urem(q, m);
            }
            g.b.ins().ireduce(types::I32, q)
        }
        Expr::Unary(u, a) => {
            let x = g.get(a)?;
            match u {
                UnaryOp::Neg => g.b.ins().fneg(x),
                UnaryOp::Exp => math::exp(&mut g.fx(), x),
                UnaryOp::Log => math::log(&mut g.fx(), x),
                UnaryOp::Tanh => math::tanh(&mut g.fx(), x),
                UnaryOp::Sqrt => g.b.ins().sqrt(x),
                UnaryOp::Rsqrt => {
                    let s = g.b.ins().sqrt(x);
                    let one = g.fx().f(1.0);
                    g.b.ins().fdiv(one, s)
                }
                UnaryOp::Recip => {
                    let one = g.fx().f(1.0);
                    g.b.ins().fdiv(one, x)
                }
            }
        }
        Expr::Binary(op, a, b) => {
            let (x, y) = (g.get(a)?, g.get(b)?);
            match (node.ty, op) {
                (Ty::F32, BinaryOp::Add) => g.b.ins().fadd(x, y),
                (Ty::F32, BinaryOp::Sub) => g.b.ins().fsub(x, y),
                (Ty::F32, BinaryOp::Mul) => g.b.ins().fmul(x, y),
                (Ty::F32, BinaryOp::Div) => g.b.ins().fdiv(x, y),
                (Ty::F32, BinaryOp::Max) => g.fx().max_nan(x, y),
                (Ty::F32, BinaryOp::Min) => g.fx().min_nan(x, y),
                (Ty::I32, BinaryOp::Add) => g.b.ins().iadd(x, y),
                (Ty::I32, BinaryOp::Sub) => g.b.ins().isub(x, y),
                (Ty::I32, BinaryOp::Mul) => g.b.ins().imul(x, y),
                (Ty::I32, BinaryOp::Max) => g.b.ins().smax(x, y),
                (Ty::I32, BinaryOp::Min) => g.b.ins().smin(x, y),
                (Ty::I32, BinaryOp::Div) => return Err("i32 division".into()),
            }
        }
        Expr::Cmp(c, a, b) => {
            let (x, y) = (g.get(a)?, g.get(b)?);
            let mask = match g.p.node(a).ty {
                Ty::F32 => g.b.ins().fcmp(float_cc(c), x, y),
                Ty::I32 => g.b.ins().icmp(int_cc(c), x, y),
            };
            if g.is_loop(id) {
                g.cur_masks.insert(id, mask);
            } else {
                g.scalar_masks.insert(id, mask);
            }
            if g.vec {
                let one = g.fx().i(1);
                g.b.ins().band(mask, one)
            } else {
                g.b.ins().uextend(types::I32, mask)
            }
        }
        Expr::Select(_, _, b) if g.vec && g.assume_false.contains(&id) => g.get(b)?,
        Expr::Select(c, a, b) => {
            let cond = mask_of(g, c)?;
            let (x, y) = (g.get(a)?, g.get(b)?);
            g.fx().sel(cond, x, y)
        }
        Expr::RoundBf16(a) => {
            let x = g.get(a)?;
            round_bf16(g, x)
        }
        Expr::FToI(a) => {
            let x = g.get(a)?;
            let t = g.vty(Ty::I32);
            g.b.ins().fcvt_to_sint_sat(t, x)
        }
        Expr::IToF(a) => {
            let x = g.get(a)?;
            let t = g.vty(Ty::F32);
            g.b.ins().fcvt_from_sint(t, x)
        }
        Expr::RowReduce(..) => return Err(format!("internal: row reduction %{id} requested before its pass")),
        Expr::Pick(x, t) => pick(g, x, t)?,
        Expr::ColReduce(op, a, slot) => {
            if !g.fin {
                return Err(format!("internal: column reduction %{id} outside the finalize function"));
            }
            let has_col = g.p.node(a).space.has_col();
            let base = g.slots[slot as usize];
            let (addr, stride) = if has_col { (g.col_offset(base, 4), g.p.cols * 4) } else { (base, UNI_PARTIAL_STRIDE * 4) };
            let ty = g.vty(Ty::F32);
            let mut acc = g.b.ins().load(ty, flags(), addr, 0);
            for k in 1..g.p.chunks {
                let off = k * stride;
                let v = match i32::try_from(off) {
                    Ok(o) => g.b.ins().load(ty, flags(), addr, o),
                    Err(_) => {
                        let a = g.b.ins().iadd_imm_s(addr, off as i64);
                        g.b.ins().load(ty, flags(), a, 0)
                    }
                };
                acc = g.red_step(op, acc, v);
            }
            acc
        }
    })
}

/// [`Expr::Pick`]: `x` computed (as a scalar) at column `t` clamped into `[0, C)`, plus `+0.0`,
/// or `0.0` when `t` is out of range. Called outside the column loops.
fn pick(g: &mut Gen, x: NodeId, t: NodeId) -> R<Value> {
    let cols = g.p.cols as i64;
    let tc = g.clamped_col(t)?;
    let t32 = g.get(t)?;
    let t64 = g.b.ins().sextend(types::I64, t32);
    let inside = g.b.ins().icmp_imm_u(IntCC::UnsignedLessThan, t64, cols);
    let (saved_pos, saved_level) = (g.cpos, g.level);
    let (saved_cur, saved_masks) = (std::mem::take(&mut g.cur), std::mem::take(&mut g.cur_masks));
    g.cpos = ColPos::Var(tc, 0);
    // Stashed values of earlier passes are read back (see `Gen::get`).
    g.level = g.p.node(x).level;
    let v = g.get(x);
    g.cpos = saved_pos;
    g.level = saved_level;
    g.cur = saved_cur;
    g.cur_masks = saved_masks;
    let v = v?;
    let z = g.b.ins().f32const(0.0);
    let v0 = g.b.ins().fadd(v, z);
    Ok(g.b.ins().select(inside, v0, z))
}

/// The raw mask of condition `c` at the current width (a comparison's own mask, else `c != 0`).
fn mask_of(g: &mut Gen, c: NodeId) -> R<Value> {
    let v = g.get(c)?;
    if matches!(g.p.node(c).expr, Expr::Cmp(..)) {
        let m = if g.is_loop(c) {
            g.cur_masks.get(&c)
        } else if !g.vec {
            g.scalar_masks.get(&c)
        } else {
            None
        };
        if let Some(&m) = m {
            return Ok(m);
        }
    }
    let zero = g.fx().i(0);
    Ok(g.b.ins().icmp(IntCC::NotEqual, v, zero))
}

/// Loads one element (or four) of storage type `mem` at `addr`.
pub(crate) fn load(g: &mut Gen, mem: Mem, addr: Value) -> Value {
    match (mem, g.vec) {
        (Mem::F32, _) | (Mem::I32, _) => {
            let t = g.vty(mem.ty());
            g.b.ins().load(t, flags(), addr, 0)
        }
        (Mem::Bf16, true) => {
            let w = g.b.ins().uload16x4(flags(), addr, 0);
            let s = g.b.ins().ishl_imm_u(w, 16);
            g.b.ins().bitcast(types::F32X4, lane_flags(), s)
        }
        (Mem::Bf16, false) => {
            let w = g.b.ins().uload16(types::I32, flags(), addr, 0);
            let s = g.b.ins().ishl_imm_u(w, 16);
            g.b.ins().bitcast(types::F32, MemFlagsData::new(), s)
        }
    }
}

/// Stores `v` (one element or four) as storage type `mem` at `addr`.
pub(crate) fn store(g: &mut Gen, mem: Mem, v: Value, addr: Value) {
    match mem {
        Mem::F32 | Mem::I32 => {
            g.b.ins().store(flags(), v, addr, 0);
        }
        Mem::Bf16 if g.vec => {
            // The four lanes' high halves gathered into the low eight bytes by one byte shuffle
            // (a shift and a saturating narrowing before: 13 operations a store, now 10).
            let h = bf16_high(g, v);
            let bytes = g.b.ins().bitcast(types::I8X16, lane_flags(), h);
            let highs = g.b.func.dfg.immediates.push(ConstantData::from(vec![2u8, 3, 6, 7, 10, 11, 14, 15, 2, 3, 6, 7, 10, 11, 14, 15]));
            let n = g.b.ins().shuffle(bytes, bytes, highs);
            let q = g.b.ins().bitcast(types::I64X2, lane_flags(), n);
            let lo = g.b.ins().extractlane(q, 0);
            g.b.ins().store(flags(), lo, addr, 0);
        }
        Mem::Bf16 => {
            let h = bf16_high(g, v);
            let bits = g.b.ins().ushr_imm_u(h, 16);
            g.b.ins().istore16(flags(), bits, addr, 0);
        }
    }
}

/// f32 bits rounded to nearest even at bit 16: `bits + 0x7fff + ((bits >> 16) & 1)`.
fn rne16(g: &mut Gen, bits: Value) -> Value {
    let mut fx = g.fx();
    let sh = fx.b.ins().ushr_imm_u(bits, 16);
    let one = fx.i(1);
    let lsb = fx.b.ins().band(sh, one);
    let half = fx.i(0x7fff);
    let bias = fx.b.ins().iadd(lsb, half);
    fx.b.ins().iadd(bits, bias)
}

/// `v`'s bits with the bf16 pattern in each lane's high half: rounded to nearest even, or a
/// NaN made quiet (the low half is left as it falls).
fn bf16_high(g: &mut Gen, v: Value) -> Value {
    let bits = g.fx().as_int(v);
    let rounded = rne16(g, bits);
    let mut fx = g.fx();
    let quiet = fx.i(0x0040_0000);
    let qb = fx.b.ins().bor(bits, quiet);
    let is_nan = fx.fcmp(FloatCC::Unordered, v, v);
    fx.sel(is_nan, qb, rounded)
}

/// `v` rounded to the nearest bf16 (ties to even), as an f32.
fn round_bf16(g: &mut Gen, v: Value) -> Value {
    let bits = g.fx().as_int(v);
    let rounded = rne16(g, bits);
    let mut fx = g.fx();
    let hi = fx.i(0xffff_0000u32 as i32);
    let m = fx.b.ins().band(rounded, hi);
    let f = fx.as_float(m);
    let is_nan = fx.fcmp(FloatCC::Unordered, v, v);
    fx.sel(is_nan, v, f)
}
