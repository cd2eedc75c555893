//! Native row routines for hosts with AVX-512F: `exp` and `tanh` of a row (with its sum), and
//! the max of an operand row.
//!
//! Cranelift emits at most 128-bit vectors, so an `exp` costs about 45 instructions per four
//! lanes in generated code; these routines run the same algorithms 16 lanes at a time, once per
//! row (a call from the generated code). A kernel whose rows have at least [`MIN_COLS`]
//! columns computes an element `exp` / `tanh` into a per-chunk row buffer — reading its
//! argument straight from an operand row (`x - max`, softmax and cross-entropy) or from the
//! buffer, where a column loop wrote it — and later passes read the results back (see
//! [`Prog::offloads`]); the routine also returns the row sum of the results, and prefetches the
//! next row of the kernel's operands and results meanwhile (the first pass over a row is
//! otherwise a wait on memory). A row max of an operand row is one call too
//! ([`Prog::native_maxes`]).
//!
//! `exp` and `tanh` are op-for-op ports of the generated code in [`crate::math`] (same
//! constants, same order of IEEE operations, no FMA, compare-and-blend selects), and sums add
//! in the column loop's order, so they produce exactly the same bits: a kernel gives the same
//! results whether or not its host has AVX-512. The row max, the same value, may differ in the
//! sign of a zero maximum (it runs four chains where the loop runs one per lane), which no
//! use of it in softmax or cross-entropy can see (`x - m`, `m + log(s)` with `s ≥ 1`).

use fusec_ir::rows::{Expr, Mem, NodeId, Prog, Slot, View, FINAL};
use fusec_ir::{CmpOp, ReduceOp, UnaryOp};

/// `fn(dst, n, src, shift, a, a_bytes, b, b_bytes, c, c_bytes) -> sum`: `dst[i] = f(src[i] -
/// shift)` for `i < n` (`src` may be `dst`, with `shift` 0: in place; `dst` null: the results
/// are not stored), returning the sum of
/// the results in the generated column loop's order (so a row sum of them has the same bits
/// either way). Meanwhile it prefetches `a[..a_bytes]`, `b[..b_bytes]` and `c[..c_bytes]`
/// into L2 (the next row of the kernel's operands and results: the routine computes while
/// the memory system fetches; the ranges need not be valid memory).
pub(crate) type RowFn = unsafe extern "C" fn(*mut f32, u64, *const f32, f32, *const u8, u64, *const u8, u64, *const u8, u64) -> f32;

/// `fn(src, n, n4) -> max`: the NaN-propagating maximum of `src[..n]` as the column loop would
/// compute it with its vector part ending at column `n4` (the same value; a NaN anywhere gives
/// the loop's NaN; see the module docs for the sign of a zero maximum).
pub(crate) type MaxFn = unsafe extern "C" fn(*const f32, u64, u64) -> f32;

/// The native row maximum on this host, if there is one.
pub(crate) fn native_max() -> Option<MaxFn> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some(x86::max_row as MaxFn);
        }
    }
    None
}

/// The operand row and the number of leading columns a native row maximum reads for the
/// argument `a` of a row max: an f32 operand row, or one masked to its first `k` columns
/// (`select(c < k, x, -inf)`, the padded vocabulary of cross-entropy).
pub(crate) fn max_source(p: &Prog, a: NodeId) -> Option<(View, u64)> {
    let f32_row = |x: NodeId| match &p.node(x).expr {
        Expr::Load(v) if v.col && v.mem == Mem::F32 => Some(v.clone()),
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

/// The native routine for `u` on this host, if there is one.
pub(crate) fn native(u: UnaryOp) -> Option<RowFn> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return match u {
                UnaryOp::Exp => Some(x86::exp_row as RowFn),
                UnaryOp::Tanh => Some(x86::tanh_row as RowFn),
                _ => None,
            };
        }
    }
    let _ = u;
    None
}

/// Rows shorter than this compute `exp` / `tanh` inline (a call per row would not pay off).
pub(crate) const MIN_COLS: u64 = 64;

/// Fills in [`Prog::offloads`]: every element `exp` / `tanh` node with a native routine on this
/// host, in a program with rows of at least [`MIN_COLS`] columns, whose argument does not read
/// another offloaded value of its own level (those are computed in one pass before the calls).
/// A stashed node keeps its stash buffer as its row buffer (no longer a stash).
pub(crate) fn assign(p: &mut Prog) {
    if p.cols < MIN_COLS {
        return;
    }
    let n = p.nodes.len();
    let mut off = vec![false; n];
    for id in 0..n {
        let node = &p.nodes[id];
        let Expr::Unary(u, a) = node.expr else { continue };
        if !node.space.has_col() || node.level == FINAL || native(u).is_none() {
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
    if native_max().is_some() {
        for id in 0..n as NodeId {
            if let Expr::RowReduce(ReduceOp::Max, a) = p.node(id).expr {
                if p.node(a).space.has_col() && max_source(p, a).is_some() {
                    p.native_maxes.push(id);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The Cephes `expf` polynomial, highest degree first (as `math::exp`).
    #[allow(clippy::excessive_precision)]
    const EXP_P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.000_000_1e-1];
    /// The Cephes `tanhf` polynomial (as `math::tanh`).
    #[allow(clippy::excessive_precision)]
    const TANH_P: [f32; 5] = [-5.704_988_7e-3, 2.063_908_9e-2, -5.373_971_6e-2, 1.333_144_2e-1, -3.333_328_2e-1];

    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        _mm512_set1_ps(x)
    }

    /// `c[0] x^n + ...`, as `Fx::horner`: multiply, then add, one rounding each.
    #[inline(always)]
    unsafe fn horner(x: __m512, cs: &[f32]) -> __m512 {
        let mut p = splat(cs[0]);
        for &c in &cs[1..] {
            p = _mm512_mul_ps(p, x);
            p = _mm512_add_ps(p, splat(c));
        }
        p
    }

    /// `math::exp` on 16 lanes.
    #[inline(always)]
    unsafe fn exp16(x: __m512) -> __m512 {
        const LOG2E: f32 = std::f32::consts::LOG2_E;
        const C1: f32 = 0.693_359_4;
        #[allow(clippy::excessive_precision)]
        const C2: f32 = -2.121_944_4e-4;
        const MAGIC: f32 = 12_582_912.0;
        let hi = splat(89.0);
        let x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, hi), x, hi);
        let lo = splat(-104.0);
        let x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo), x, lo);
        let t = _mm512_mul_ps(x, splat(LOG2E));
        let tm = _mm512_add_ps(t, splat(MAGIC));
        let n = _mm512_sub_ps(tm, splat(MAGIC));
        let ni = _mm512_sub_epi32(_mm512_castps_si512(tm), _mm512_set1_epi32(MAGIC.to_bits() as i32));
        let r1 = _mm512_sub_ps(x, _mm512_mul_ps(n, splat(C1)));
        let r = _mm512_sub_ps(r1, _mm512_mul_ps(n, splat(C2)));
        let z = _mm512_mul_ps(r, r);
        let p = horner(r, &EXP_P);
        let pz = _mm512_mul_ps(p, z);
        let pr = _mm512_add_ps(pz, r);
        let y = _mm512_add_ps(pr, splat(1.0));
        let n1 = _mm512_srai_epi32::<1>(ni);
        let n2 = _mm512_sub_epi32(ni, n1);
        let bias = _mm512_set1_epi32(127);
        let s1 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n1, bias)));
        let s2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n2, bias)));
        _mm512_mul_ps(_mm512_mul_ps(y, s1), s2)
    }

    /// `math::tanh` on 16 lanes.
    #[inline(always)]
    unsafe fn tanh16(x: __m512) -> __m512 {
        let a = _mm512_abs_ps(x);
        let z = _mm512_mul_ps(x, x);
        let p = horner(z, &TANH_P);
        let pz = _mm512_mul_ps(p, z);
        let pzx = _mm512_mul_ps(pz, x);
        let small_v = _mm512_add_ps(pzx, x);
        let a2 = _mm512_add_ps(a, a);
        let e = exp16(a2);
        let e1 = _mm512_add_ps(e, splat(1.0));
        let q = _mm512_div_ps(splat(2.0), e1);
        let t = _mm512_sub_ps(splat(1.0), q);
        let nt = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(t), _mm512_set1_epi32(i32::MIN)));
        let neg = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, splat(0.0));
        let large_v = _mm512_mask_blend_ps(neg, t, nt);
        let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, splat(0.625));
        _mm512_mask_blend_ps(small, large_v, small_v)
    }

    /// Sum of the 16 lanes as the column loop combines its partial sums: lane `4k + l` is lane
    /// `l` of accumulator copy `k`; copies `(0 + 1) + (2 + 3)`, then lanes `(0 + 1) + (2 + 3)`.
    #[inline(always)]
    unsafe fn tree_sum(acc: __m512) -> f32 {
        let q = |i: i32| match i {
            0 => _mm512_extractf32x4_ps::<0>(acc),
            1 => _mm512_extractf32x4_ps::<1>(acc),
            2 => _mm512_extractf32x4_ps::<2>(acc),
            _ => _mm512_extractf32x4_ps::<3>(acc),
        };
        let v = _mm_add_ps(_mm_add_ps(q(0), q(1)), _mm_add_ps(q(2), q(3)));
        let mut l = [0f32; 4];
        _mm_storeu_ps(l.as_mut_ptr(), v);
        (l[0] + l[1]) + (l[2] + l[3])
    }

    /// `$dst[i] = $f($src[i] - $shift)` for `i < $n`, 16 lanes at a time (masked tails), while
    /// prefetching the byte ranges `$pf` into L2; evaluates to the row sum of the results in
    /// the column loop's order (see [`tree_sum`]; the last `n % 4` columns added in order).
    macro_rules! map {
        ($dst:expr, $n:expr, $src:expr, $shift:expr, $pf:expr, $f:ident) => {{
            let (dst, n, src): (*mut f32, usize, *const f32) = ($dst, $n as usize, $src);
            let store = !dst.is_null();
            let shift = _mm512_set1_ps($shift);
            let mut pf: [(*const u8, usize); 3] = $pf;
            // Cache lines to prefetch per iteration of 32 elements, over all streams.
            let lines: usize = pf.iter().map(|s| s.1.div_ceil(64)).sum();
            let per = lines.div_ceil(n.div_ceil(32).max(1));
            let n4 = n / 4 * 4;
            let mut acc = _mm512_setzero_ps();
            let mut i = 0;
            while i + 32 <= n4 {
                let mut k = 0;
                for s in pf.iter_mut() {
                    while k < per && s.1 > 0 {
                        _mm_prefetch::<_MM_HINT_T1>(s.0 as *const i8);
                        s.0 = s.0.wrapping_add(64);
                        s.1 = s.1.saturating_sub(64);
                        k += 1;
                    }
                }
                let a = $f(_mm512_sub_ps(_mm512_loadu_ps(src.add(i)), shift));
                let b = $f(_mm512_sub_ps(_mm512_loadu_ps(src.add(i + 16)), shift));
                if store {
                    _mm512_storeu_ps(dst.add(i), a);
                    _mm512_storeu_ps(dst.add(i + 16), b);
                }
                acc = _mm512_add_ps(acc, a);
                acc = _mm512_add_ps(acc, b);
                i += 32;
            }
            // Whole vectors of four: lanes of the sum as in the loop.
            while i < n4 {
                let rest = (n4 - i).min(16);
                let m: __mmask16 = if rest == 16 { 0xffff } else { (1u16 << rest) - 1 };
                let a = $f(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, src.add(i)), shift));
                if store {
                    _mm512_mask_storeu_ps(dst.add(i), m, a);
                }
                acc = _mm512_mask_add_ps(acc, m, acc, a);
                i += rest;
            }
            let mut sum = tree_sum(acc);
            // The scalar tail columns, in order.
            if n4 < n {
                let m: __mmask16 = (1u16 << (n - n4)) - 1;
                let a = $f(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, src.add(n4)), shift));
                if store {
                    _mm512_mask_storeu_ps(dst.add(n4), m, a);
                }
                let mut l = [0f32; 16];
                _mm512_storeu_ps(l.as_mut_ptr(), a);
                for x in &l[..n - n4] {
                    sum += *x;
                }
            }
            sum
        }};
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn exp_avx512(dst: *mut f32, n: u64, src: *const f32, shift: f32, pf: [(*const u8, usize); 3]) -> f32 {
        map!(dst, n, src, shift, pf, exp16)
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn tanh_avx512(dst: *mut f32, n: u64, src: *const f32, shift: f32, pf: [(*const u8, usize); 3]) -> f32 {
        map!(dst, n, src, shift, pf, tanh16)
    }

    /// # Safety
    /// `dst[..n]` must be valid for writes and `src[..n]` for reads (they may be the same
    /// buffer), and the host must have AVX-512F (the prefetched ranges need not be valid).
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe extern "C" fn exp_row(
        dst: *mut f32,
        n: u64,
        src: *const f32,
        shift: f32,
        a: *const u8,
        an: u64,
        b: *const u8,
        bn: u64,
        c: *const u8,
        cn: u64,
    ) -> f32 {
        exp_avx512(dst, n, src, shift, [(a, an as usize), (b, bn as usize), (c, cn as usize)])
    }

    /// `max_nan(a, b)` of the generated code: `b` if `b > a` or `b` is NaN, else `a`.
    #[inline(always)]
    fn max_nan(a: f32, b: f32) -> f32 {
        if b > a || b.is_nan() {
            b
        } else {
            a
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn max_avx512(src: *const f32, n: usize, n4: usize) -> f32 {
        // Four independent chains over interleaved blocks of 16 (one chain would wait on the
        // compare-and-blend latency), combined in block order.
        let mut accs = [_mm512_set1_ps(f32::NEG_INFINITY); 4];
        let mut nan: __mmask16 = 0;
        let mut i = 0;
        while i + 64 <= n4 {
            for (k, acc) in accs.iter_mut().enumerate() {
                let x = _mm512_loadu_ps(src.add(i + 16 * k));
                let lt = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(*acc, x);
                *acc = _mm512_mask_blend_ps(lt, *acc, x);
                nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            }
            i += 64;
        }
        let mut acc = accs[0];
        for a in &accs[1..] {
            let lt = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(acc, *a);
            acc = _mm512_mask_blend_ps(lt, acc, *a);
        }
        while i + 16 <= n4 {
            let x = _mm512_loadu_ps(src.add(i));
            let lt = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(acc, x);
            acc = _mm512_mask_blend_ps(lt, acc, x);
            nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            i += 16;
        }
        if i < n4 {
            let m: __mmask16 = (1u16 << (n4 - i)) - 1;
            let x = _mm512_maskz_loadu_ps(m, src.add(i));
            let lt = _mm512_mask_cmp_ps_mask::<_CMP_LT_OQ>(m, acc, x);
            acc = _mm512_mask_blend_ps(lt, acc, x);
            nan |= _mm512_mask_cmp_ps_mask::<_CMP_UNORD_Q>(m, x, x);
        }
        // The loop's combination: copies (0 ⊕ 1) ⊕ (2 ⊕ 3) with `a ⊕ b = a < b ? b : a`, NaN
        // flags or-ed, NaN lanes set to NaN, then lanes (0 ⊕' 1) ⊕' (2 ⊕' 3) with `max_nan`.
        let mut l = [0f32; 16];
        _mm512_storeu_ps(l.as_mut_ptr(), acc);
        let pick = |a: f32, b: f32| if a < b { b } else { a };
        let mut v = [0f32; 4];
        for (j, v) in v.iter_mut().enumerate() {
            let c = pick(pick(l[j], l[4 + j]), pick(l[8 + j], l[12 + j]));
            let flag = (nan >> j) & 1 | (nan >> (4 + j)) & 1 | (nan >> (8 + j)) & 1 | (nan >> (12 + j)) & 1;
            *v = if flag != 0 { f32::NAN } else { c };
        }
        let mut m = max_nan(max_nan(v[0], v[1]), max_nan(v[2], v[3]));
        for c in n4..n {
            m = max_nan(m, *src.add(c));
        }
        m
    }

    /// # Safety
    /// `src[..n]` must be valid for reads and the host must have AVX-512F.
    pub(super) unsafe extern "C" fn max_row(src: *const f32, n: u64, n4: u64) -> f32 {
        max_avx512(src, n as usize, n4 as usize)
    }

    /// # Safety
    /// As [`exp_row`].
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe extern "C" fn tanh_row(
        dst: *mut f32,
        n: u64,
        src: *const f32,
        shift: f32,
        a: *const u8,
        an: u64,
        b: *const u8,
        bn: u64,
        c: *const u8,
        cn: u64,
    ) -> f32 {
        tanh_avx512(dst, n, src, shift, [(a, an as usize), (b, bn as usize), (c, cn as usize)])
    }
}
