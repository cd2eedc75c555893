//! GPT-2 initialization normals, several times faster than [`Rng::normal`] and bit for bit the
//! same f32 values.
//!
//! Each value is `(std * rng.normal()) as f32`: Box-Muller with the platform's `ln` and `cos`
//! ([`box_muller`]) over two uniforms of the SplitMix64 stream. [`fill`] draws them in batches
//! of [`LANES`]: the uniforms, then `ln`, `sqrt` and `cos` in f64 with branch-free polynomials
//! (plain loops that the compiler vectorizes, built for AVX2 or AVX-512 as the CPU target's
//! instruction-set level allows), then the f32 rounding. A value whose f64 result might round
//! differently from the exact path's is recomputed by the exact path.
//!
//! **Why the values are exact.** Let `y` be the fast f64 value and `y*` the exact path's
//! (`std * box_muller(u1, u2)` with libm). Both evaluate the same formula with the same
//! operations in the same order (the clamp of `u1` at 1e-300 included), differing only in
//! `ln` and `cos`: libm's are within 1 ulp; ours are fdlibm's `ln` (within 1 ulp) and its sine
//! and cosine polynomials (error ≤ 2^-58) after a reduction of the argument that is exact to
//! 2^-84 absolute, an argument within 2^-30 of a multiple of π/2 going to the exact path.
//! Through `sqrt` and the two products, `|y - y*| < 32·2^-53·|y|` (loosely: each step adds
//! at most a few ulps; the tests see at most 5). Converting to f32 rounds to the nearest,
//! ties to even, so the result changes only where `y` crosses a midpoint between two adjacent
//! f32 values. [`rounds_safely`] accepts `y` only in f32's normal range and more than
//! `2^-41·|y|` (= 4096·2^-53·|y|, 128 times the bound) from every midpoint; then `y*` lies on
//! the same side of every midpoint and `y as f32 == y* as f32`. Anything else (near a
//! midpoint, a tiny reduced argument, non-finite or out-of-range values) is recomputed
//! exactly: about one value in 2^16. The tests compare the paths over millions of values and
//! the edge cases, `init_bench check` over 10^9.

#[cfg(target_arch = "x86_64")]
use fusec_codegen_cpu::isa::{self, Isa};
use fusec_ir::rng::{box_muller, unit_f64, Rng};

/// Normals per batch (8 AVX-512 vectors of f64; 16, 32 and 128 measured slower). A batch
/// checks once whether any of its values needs the exact path.
pub const LANES: usize = 64;

/// Fills `out` with `(std * rng.normal()) as f32` for the next `out.len()` normals of `rng`
/// and advances it past them, like [`fill_exact`] but several times faster. Returns how many
/// values were recomputed by the exact path (a few in 10^5). Vectorized for the CPU target's
/// instruction-set level ([`isa::current`]: `FUSEC_CPU_ISA` can choose a lower one).
pub fn fill(rng: &mut Rng, out: &mut [f32], std: f64) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let level = isa::current();
        if level >= Isa::Avx512 && has!("avx512dq") && has!("avx512vl") {
            // SAFETY: AVX-512F comes with the level (which `current` checks), DQ and VL were
            // just detected.
            return unsafe { fill_avx512(rng, out, std) };
        }
        if level >= Isa::Avx2 {
            // SAFETY: `current` picks only levels the host supports.
            return unsafe { fill_avx2(rng, out, std) };
        }
    }
    fill_batches::<false>(rng, out, std)
}

/// The reference path: each value through [`Rng::normal`] (libm's `ln` and `cos`). Returns
/// `out.len()` (every value computed exactly), as [`fill`] counts.
pub fn fill_exact(rng: &mut Rng, out: &mut [f32], std: f64) -> usize {
    out.iter_mut().for_each(|x| *x = (std * rng.normal()) as f32);
    out.len()
}

/// A way to fill a slice with normals: [`fill`] or [`fill_exact`].
pub type FillFn = fn(&mut Rng, &mut [f32], f64) -> usize;

/// Fills `out` with `std` times the normals number `first`, `first + 1`, … of `stream`, in
/// parallel slices (SplitMix64 is a counter: each slice skips to its start), each through
/// `fill`. Returns the sum of `fill`'s counts.
pub fn par_fill(stream: &Rng, first: u64, out: &mut [f32], std: f64, fill: FillFn) -> usize {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .map(|(c, out)| {
            let mut rng = stream.clone();
            rng.skip(2 * (first + (c * CHUNK) as u64));
            fill(&mut rng, out, std)
        })
        .sum()
}

/// [`fill_batches`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn fill_avx2(rng: &mut Rng, out: &mut [f32], std: f64) -> usize {
    fill_batches::<false>(rng, out, std)
}

/// [`fill_batches`] compiled for AVX-512 with DQ (64-bit multiplies and integer conversions
/// in one instruction each).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl")]
fn fill_avx512(rng: &mut Rng, out: &mut [f32], std: f64) -> usize {
    fill_batches::<true>(rng, out, std)
}

/// [`fill`] for the target features of its caller: [`LANES`] pairs of uniforms at a time
/// (converted by [`unit_f64`] where the target has a vector instruction for it, `NATIVE`, else
/// by [`unit_split`]), then [`batch`].
#[inline(always)]
fn fill_batches<const NATIVE: bool>(rng: &mut Rng, out: &mut [f32], std: f64) -> usize {
    let unit = if NATIVE { unit_f64 } else { unit_split };
    let mut fallbacks = 0;
    for chunk in out.chunks_mut(LANES) {
        let (mut u1, mut u2) = ([0f64; LANES], [0f64; LANES]);
        for k in 0..LANES {
            u1[k] = unit(rng.peek(2 * k as u64));
            u2[k] = unit(rng.peek(2 * k as u64 + 1));
        }
        rng.skip(2 * chunk.len() as u64);
        fallbacks += batch(&u1, &u2, std, chunk);
    }
    fallbacks
}

/// 2^52, and its bits: `from_bits(TWO52_BITS | n) - TWO52` is `n` as an f64 for `n < 2^52`.
const TWO52: f64 = 4_503_599_627_370_496.0;
/// The bits of [`TWO52`].
const TWO52_BITS: u64 = 0x4330_0000_0000_0000;

/// [`unit_f64`] without a 64-bit integer conversion (which AVX2 lacks): the 53 bits in two
/// parts of 27 and 26 bits, each exact through the 2^52 trick, so the sum is the same f64.
#[inline(always)]
fn unit_split(bits: u64) -> f64 {
    let v = bits >> 11;
    let hi = f64::from_bits(TWO52_BITS | (v >> 26)) - TWO52;
    let lo = f64::from_bits(TWO52_BITS | (v & ((1 << 26) - 1))) - TWO52;
    (hi * (1u64 << 26) as f64 + lo) / (1u64 << 53) as f64
}

/// `out[k] = (std * box_muller(u1[k], u2[k])) as f32` for `k < out.len()` (at most
/// [`LANES`]): the fast path, and the exact one where [`rounds_safely`] or the argument of
/// `cos` says so. Returns how many values took the exact path.
#[inline(always)]
fn batch(u1: &[f64; LANES], u2: &[f64; LANES], std: f64, out: &mut [f32]) -> usize {
    let mut y32 = [0f32; LANES];
    let mut bad = [0u8; LANES];
    for k in 0..LANES {
        let (y, cos_ok) = fast_normal(u1[k], u2[k]);
        let y = std * y;
        y32[k] = y as f32;
        bad[k] = u8::from(!(cos_ok & rounds_safely(y)));
    }
    let n = out.len();
    out.copy_from_slice(&y32[..n]);
    if bad[..n].iter().fold(0, |a, &b| a | b) == 0 {
        return 0;
    }
    let mut fallbacks = 0;
    for k in (0..n).filter(|&k| bad[k] != 0) {
        out[k] = (std * box_muller(u1[k], u2[k])) as f32;
        fallbacks += 1;
    }
    fallbacks
}

/// [`box_muller`] with [`ln`] and [`cos`]; false where `cos`'s result is not reliable.
#[inline(always)]
fn fast_normal(u1: f64, u2: f64) -> (f64, bool) {
    let u1 = u1.max(1e-300);
    let (c, ok) = cos(2.0 * std::f64::consts::PI * u2);
    ((-2.0 * ln(u1)).sqrt() * c, ok)
}

/// Half an f32 ulp in the bits an f64 has beyond an f32's 24: an f64 whose low 29 bits are
/// `HALF` is a midpoint between two adjacent f32 values (in f32's normal range).
const HALF: u64 = 1 << 28;
/// How far, in units of the f64's last bit, a value must be from a midpoint: 2^12, i.e. a
/// relative distance of at least `2^12 · 2^-53 = 2^-41` (see the module comment).
const GUARD: u64 = 1 << 12;

/// 2^127: above it (the top binade of f32) [`rounds_safely`] does not look.
const F32_TOP: f64 = f64::from_bits((1023 + 127) << 52);

/// Whether `y` rounds to the same f32 as every value within `2^-41·|y|` of it: `y` is in
/// f32's normal range and at least that far from a midpoint between adjacent f32 values. With
/// `2^e ≤ |y| < 2^(e+1)` the midpoints of that binade are where the low 29 bits of `y` (units
/// of `2^(e-52)`) equal [`HALF`]; the nearest ones outside it are at least `2^27` units away.
#[inline(always)]
fn rounds_safely(y: f64) -> bool {
    let a = y.abs();
    let in_range = (a >= f32::MIN_POSITIVE as f64) & (a <= F32_TOP);
    let low = y.to_bits() & ((1 << 29) - 1);
    let far = low.wrapping_sub(HALF - GUARD) > 2 * GUARD;
    in_range & far
}

/// f64s from their bit patterns (fdlibm gives its constants so).
const fn f64s<const N: usize>(bits: [u64; N]) -> [f64; N] {
    let mut out = [0.0; N];
    let mut i = 0;
    while i < N {
        out[i] = f64::from_bits(bits[i]);
        i += 1;
    }
    out
}

/// fdlibm's minimax coefficients for `ln(1+f) = 2s + s·R(s²)`, `s = f/(2+f)`
/// (`e_log.c`, Sun Microsystems 1993, freely distributable; error of `R` ≤ 2^-58.45).
const LG: [f64; 7] = f64s([
    0x3FE5_5555_5555_5593,
    0x3FD9_9999_9997_FA04,
    0x3FD2_4924_9422_9359,
    0x3FCC_71C5_1D8E_78AF,
    0x3FC7_4664_96CB_03DE,
    0x3FC3_9A09_D078_C69F,
    0x3FC2_F112_DF3E_5244,
]);
/// ln 2 in two parts; `k · LN2_HI` is exact for `|k| < 2000`.
const LN2_HI: f64 = f64::from_bits(0x3FE6_2E42_FEE0_0000);
/// ln 2 - [`LN2_HI`].
const LN2_LO: f64 = f64::from_bits(0x3DEA_39EF_3579_3C76);

/// Natural logarithm of a positive normal finite `x`, within about 1 ulp, branch-free:
/// `x = 2^k (1+f)` with `1+f` in `[√2/2, √2)`, then fdlibm's polynomial.
#[inline(always)]
fn ln(x: f64) -> f64 {
    // Adding 1 - 0x3fe6a09e (√2/2's high word) to the high word moves the exponent up by
    // one exactly when the mantissa is ≥ √2/2's; the mantissa then gets √2/2's exponent back.
    const SHIFT: u64 = (0x3ff0_0000 - 0x3fe6_a09e) << 32;
    let t = x.to_bits().wrapping_add(SHIFT);
    let m = f64::from_bits((t & 0x000f_ffff_ffff_ffff) + (0x3fe6_a09e << 32));
    // The biased exponent (0..2047) as an f64 without an integer conversion.
    let k = f64::from_bits(TWO52_BITS | (t >> 52)) - (TWO52 + 1023.0);
    let f = m - 1.0;
    let hfsq = 0.5 * f * f;
    let s = f / (2.0 + f);
    let z = s * s;
    let w = z * z;
    let t1 = w * (LG[1] + w * (LG[3] + w * LG[5]));
    let t2 = z * (LG[0] + w * (LG[2] + w * (LG[4] + w * LG[6])));
    let r = t2 + t1;
    k * LN2_HI + (f - (hfsq - (s * (hfsq + r) + k * LN2_LO)))
}

/// fdlibm's minimax coefficients for `sin r = r + r³ S(r²)` and
/// `cos r = 1 - r²/2 + r⁴ C(r²)` on `|r| ≤ π/4` (`k_sin.c`, `k_cos.c`; error ≤ 2^-58).
const SIN: [f64; 6] = f64s([
    0xBFC5_5555_5555_5549,
    0x3F81_1111_1110_F8A6,
    0xBF2A_01A0_19C1_61D5,
    0x3EC7_1DE3_57B1_FE7D,
    0xBE5A_E5E6_8A2B_9CEB,
    0x3DE5_D93A_5ACF_D57C,
]);
/// The coefficients of `C` (see [`SIN`]).
const COS: [f64; 6] = f64s([
    0x3FA5_5555_5555_554C,
    0xBF56_C16C_16C1_5177,
    0x3EFA_01A0_19CB_1590,
    0xBE92_7E4F_809C_52AD,
    0x3E21_EE9E_BDB4_B1C4,
    0xBDA8_FAE9_BE88_38D4,
]);
/// π/2 in two parts: 33 bits (so `k · PIO2_HI` is exact for small `k`) and the next 53.
const PIO2_HI: f64 = f64::from_bits(0x3FF9_21FB_5440_0000);
/// π/2 - [`PIO2_HI`].
const PIO2_LO: f64 = f64::from_bits(0x3DD0_B461_1A62_6331);

/// 2^-30: a reduced argument below it goes to the exact path.
const TINY_R: f64 = f64::from_bits((1023 - 30) << 52);

/// `cos x` for `0 ≤ x < 2π` within a few ulps, branch-free, and whether that holds: false
/// when `x` is within 2^-30 of a multiple of π/2, where the reduced argument's absolute error
/// (≤ 2^-84) could be large relative to it.
#[inline(always)]
fn cos(x: f64) -> (f64, bool) {
    // q = round(x / (π/2)) through the 1.5·2^52 trick: the low bits of `kq` are q.
    const ROUND: f64 = 1.5 * TWO52;
    let kq = x * std::f64::consts::FRAC_2_PI + ROUND;
    let q = kq.to_bits();
    let k = kq - ROUND;
    // x - k·PIO2_HI is exact (Sterbenz: x is within π/4 of k·π/2 ≥ π/2, or k = 0).
    let r = (x - k * PIO2_HI) - k * PIO2_LO;
    let z = r * r;
    let sin = r + r * z * (SIN[0] + z * (SIN[1] + z * (SIN[2] + z * (SIN[3] + z * (SIN[4] + z * SIN[5])))));
    let cos = (1.0 - 0.5 * z) + z * z * (COS[0] + z * (COS[1] + z * (COS[2] + z * (COS[3] + z * (COS[4] + z * COS[5])))));
    // cos(r + qπ/2) = cos r, -sin r, -cos r, sin r for q mod 4 = 0, 1, 2, 3.
    let v = if q & 1 == 0 { cos } else { sin };
    let v = f64::from_bits(v.to_bits() ^ (((q + 1) & 2) << 62));
    (v, r.abs() >= TINY_R)
}

#[cfg(test)]
#[path = "normals_tests.rs"]
mod tests;
