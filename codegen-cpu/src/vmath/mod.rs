//! Native row routines: `exp` and `tanh` of a row (with its sum), and the max of an operand
//! row, in 16 lanes (AVX-512F) or 8 (AVX2), chosen by the instruction-set level
//! ([`crate::isa::Isa`]; none at `scalar`, where the generated loops do the work).
//!
//! Cranelift emits at most 128-bit vectors, so an `exp` costs about 45 instructions per four
//! lanes in generated code; these routines run the same algorithms 8 or 16 lanes at a time,
//! once per row (a call from the generated code). A kernel whose rows have at least
//! [`MIN_COLS`] columns computes an element `exp` / `tanh` into a per-chunk row buffer —
//! reading its argument straight from an operand row (`x - max`, softmax and cross-entropy) or
//! from the buffer, where a column loop wrote it — and later passes read the results back (see
//! [`Prog::offloads`]); the routine also returns the row sum of the results, and prefetches the
//! next row of the kernel's operands and results meanwhile (the first pass over a row is
//! otherwise a wait on memory). A row max of an operand row is one call too
//! ([`Prog::native_maxes`]).
//!
//! `exp` and `tanh` are op-for-op ports of the generated code in [`crate::math`] (same
//! constants, same order of IEEE operations, no FMA, compare-and-blend selects), and sums add
//! in the column loop's order (column `c` into lane `c % 16` of a 16-lane accumulator, kept as
//! two 8-lane halves by the AVX2 routines), so they produce exactly the same bits at every
//! level: a kernel gives the same results whatever its host. The row max, the same value, may
//! differ from the loop's in the sign of a zero maximum (it runs four chains where the loop
//! runs one per lane; the AVX2 and AVX-512 routines run the same chains and agree bit for
//! bit), which no use of it in softmax or cross-entropy can see (`x - m`, `m + log(s)` with
//! `s ≥ 1`).

use fusec_ir::rows::{Expr, Mem, NodeId, Prog, Slot, View, FINAL};
use fusec_ir::{CmpOp, ReduceOp, UnaryOp};

use crate::isa::Isa;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod x86;

/// `y[i] = gelu(t[i])`, or `y[i] += gelu(t[i])` when `accumulate`, in the widest vectors this
/// host has (AVX-512, AVX2, else scalar): the GEMMs' GELU epilogue. Every path computes
/// [`crate::gemm::gelu`]'s operations in its order, so all give the same bits.
pub(crate) fn gelu_rows(y: &mut [f32], t: &[f32], accumulate: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the host has AVX-512F.
            return unsafe { avx512::gelu_rows(y, t, accumulate) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the host has AVX2.
            return unsafe { avx2::gelu_rows(y, t, accumulate) };
        }
    }
    for (v, x) in y.iter_mut().zip(t) {
        *v = if accumulate { *v + crate::gemm::gelu(*x) } else { crate::gemm::gelu(*x) };
    }
}

/// `fn(dst, n, src, shift, a, a_bytes, b, b_bytes, c, c_bytes) -> sum`: `dst[i] = f(src[i] -
/// shift)` for `i < n` (`src` may be `dst`, with `shift` 0: in place; `dst` null: the results
/// are not stored), returning the sum of
/// the results in the generated column loop's order (so a row sum of them has the same bits
/// either way). Meanwhile it prefetches `a[..a_bytes]`, `b[..b_bytes]` and `c[..c_bytes]`
/// into L2 (the next row of the kernel's operands and results: the routine computes while
/// the memory system fetches; the ranges need not be valid memory).
pub(crate) type RowFn = unsafe extern "C" fn(*mut f32, u64, *const u8, f32, *const u8, u64, *const u8, u64, *const u8, u64) -> f32;

/// `fn(src, n, n4) -> max`: the NaN-propagating maximum of `src[..n]` as the column loop would
/// compute it with its vector part ending at column `n4` (the same value; a NaN anywhere gives
/// the loop's NaN; see the module docs for the sign of a zero maximum).
pub(crate) type MaxFn = unsafe extern "C" fn(*const u8, u64, u64) -> f32;

/// The native row maximum at level `isa` of a row stored as `mem`, if it has one.
pub(crate) fn native_max(isa: Isa, mem: Mem) -> Option<MaxFn> {
    #[cfg(target_arch = "x86_64")]
    {
        let (f32s, bf16s): (MaxFn, MaxFn) = match isa {
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => (avx512::max_row, avx512::max_row_bf16),
            Isa::Avx2 => (avx2::max_row, avx2::max_row_bf16),
            Isa::Scalar => return None,
        };
        match mem {
            Mem::F32 => return Some(f32s),
            Mem::Bf16 => return Some(bf16s),
            Mem::I32 => {}
        }
    }
    let _ = (isa, mem);
    None
}

/// Whether a native routine can read a row stored as `mem` directly: f32, or bf16 widened.
pub(crate) fn readable(mem: Mem) -> bool {
    matches!(mem, Mem::F32 | Mem::Bf16)
}

/// The operand row and the number of leading columns a native row maximum reads for the
/// argument `a` of a row max: an f32 or bf16 operand row, or one masked to its first `k`
/// columns (`select(c < k, x, -inf)`, the padded vocabulary of cross-entropy).
pub(crate) fn max_source(p: &Prog, a: NodeId) -> Option<(View, u64)> {
    let f32_row = |x: NodeId| match &p.node(x).expr {
        Expr::Load(v) if v.col && readable(v.mem) => Some(v.clone()),
        _ => None,
    };
    if let Some(v) = f32_row(a) {
        return Some((v, p.cols));
    }
    let Expr::Select(c, x, z) = p.node(a).expr else { return None };
    if p.node(z).expr != Expr::ConstF(f32::NEG_INFINITY.to_bits()) {
        return None;
    }
    let Expr::Cmp(CmpOp::Lt, i, k) = p.node(c).expr else { return None };
    let (Expr::ColIota, Expr::ConstI(k)) = (&p.node(i).expr, &p.node(k).expr) else { return None };
    let k = *k as i64;
    if k <= 0 || k as u64 > p.cols {
        return None;
    }
    f32_row(x).map(|v| (v, k as u64))
}

/// The native routine for `u` at level `isa` reading its argument from a row stored as `mem`
/// (f32 for a row buffer), if it has one.
pub(crate) fn native(u: UnaryOp, isa: Isa, mem: Mem) -> Option<RowFn> {
    #[cfg(target_arch = "x86_64")]
    {
        let fns: [RowFn; 4] = match isa {
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => [avx512::exp_row, avx512::exp_row_bf16, avx512::tanh_row, avx512::tanh_row_bf16],
            Isa::Avx2 => [avx2::exp_row, avx2::exp_row_bf16, avx2::tanh_row, avx2::tanh_row_bf16],
            Isa::Scalar => return None,
        };
        let m = match mem {
            Mem::F32 => 0,
            Mem::Bf16 => 1,
            Mem::I32 => return None,
        };
        match u {
            UnaryOp::Exp => return Some(fns[m]),
            UnaryOp::Tanh => return Some(fns[2 + m]),
            _ => {}
        }
    }
    let _ = (u, isa, mem);
    None
}

/// Rows shorter than this compute `exp` / `tanh` inline (a call per row would not pay off).
pub(crate) const MIN_COLS: u64 = 64;

/// Fills in [`Prog::offloads`]: every element `exp` / `tanh` node with a native routine at
/// level `isa`, in a program with rows of at least [`MIN_COLS`] columns, whose argument does not read
/// another offloaded value of its own level (those are computed in one pass before the calls).
/// A stashed node keeps its stash buffer as its row buffer (no longer a stash).
pub(crate) fn assign(p: &mut Prog, isa: Isa) {
    if p.cols < MIN_COLS {
        return;
    }
    let n = p.nodes.len();
    let mut off = vec![false; n];
    for id in 0..n {
        let node = &p.nodes[id];
        let Expr::Unary(u, a) = node.expr else { continue };
        if !node.space.has_col() || node.level == FINAL || native(u, isa, Mem::F32).is_none() {
            continue;
        }
        // Does the argument read an offloaded node of this level (through element values)?
        let mut stack = vec![a];
        let mut seen = vec![false; n];
        let mut nested = false;
        while let Some(x) = stack.pop() {
            if std::mem::replace(&mut seen[x as usize], true) {
                continue;
            }
            let xn = &p.nodes[x as usize];
            if !xn.space.has_col() || xn.level != node.level {
                continue;
            }
            if off[x as usize] {
                nested = true;
                break;
            }
            stack.extend(xn.expr.args());
        }
        off[id] = !nested;
    }
    for id in (0..n as NodeId).filter(|&i| off[i as usize]) {
        let slot = match p.stashes.iter().position(|&(t, _)| t == id) {
            Some(k) => p.stashes.remove(k).1,
            None => {
                p.slots.push(Slot::Scratch((p.chunks * p.cols) as usize));
                (p.slots.len() - 1) as u32
            }
        };
        p.offloads.push((id, slot));
    }
    for id in 0..n as NodeId {
        if let Expr::RowReduce(ReduceOp::Max, a) = p.node(id).expr {
            if p.node(a).space.has_col() && max_source(p, a).is_some_and(|(v, _)| native_max(isa, v.mem).is_some()) {
                p.native_maxes.push(id);
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests;
