//! bf16 products: bf16 operands (`a`, `b`, `bias`), f32 accumulation, an f32 or bf16 result.
//!
//! Tiles are those of [`gemm_f32`](super::gemm_f32) (a pure function of the shape, so the
//! result does not depend on the thread count). Each tile's product is accumulated in f32 by
//! the path of the instruction-set level:
//!
//! - **AMX tiles** (`amx`, module `amx`): operands packed as bf16 pairs, `a` row by row, and
//!   multiplied 16 x 16 x 32 at a time by `tdpbf16ps` into four tiles of f32 sums;
//! - **dot products** (`avx512bf16`, [`Isa::bf16_dot`]): operands packed as bf16 pairs and
//!   multiplied by `vdpbf16ps` (32 products into 16 f32 sums per instruction, twice the
//!   multiply rate of f32 FMA; the pair's two products are added to the sum one after the other,
//!   with denormals flushed to zero, as the instruction defines);
//! - **FMA micro-kernels on widened operands** (`avx512`: 12 x 32 in zmm, `avx2`: 6 x 16 in
//!   ymm): the operands widened to f32 (exactly) as they are packed (module `packed`);
//! - **widened tiles** (`scalar`, module `widen`): the tile's rows of `op(a)` and columns of
//!   `op(b)` widened in per-thread scratch and multiplied by the `gemm` crate's f32 kernels.
//!
//! Measured on an AVX512-BF16 host (AMD EPYC, Zen 4) by `gemm_bench`, the dot products are the
//! faster path (see the README), so `avx512bf16` uses them. The paths sum in different
//! orders: they agree within f32 accumulation error, not bit for bit.
//!
//! The epilogue runs on the tile's f32 products while they are in cache and rounds where the
//! interpreter rounds the op sequence a `gemm` stands for: for a bf16 result, the product is
//! rounded to bf16, then `+ bias` rounded, then GELU rounded (the pre-activation kept as the
//! rounded value before it), then `acc + y` rounded (round to nearest even on the f32 bits, NaN
//! kept quiet). A plain product with an f32 result (amp's parameter gradients, `gemm {out =
//! f32}`) is never rounded to bf16: f32 accumulation and result, as on CUDA (the interpreter,
//! which defines the node as a bf16 matmul then a cast, rounds it first). Values agree with the
//! interpreter's to one bf16 rounding where the f32 sum falls on the other side of a rounding
//! boundary than the exact sum.
//!
//! The epilogue's loops are compiled for the level too (AVX2 or AVX-512 copies of
//! `Job::finish_rows`; this crate is otherwise compiled for SSE2): the same bits, wider vectors.
//!
//! Steady-state calls allocate nothing here (scratch is per thread and grows only); the widened
//! path's `gemm` crate calls allocate their packing buffers.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod kernels;
#[cfg(target_arch = "x86_64")]
mod packed;
#[cfg(target_arch = "x86_64")]
mod shared;
mod widen;

#[cfg(target_arch = "x86_64")]
pub use amx::amx_permitted;

use super::{check, for_each_task, Raw, Tile, Tiling};
use crate::isa::Isa;
use fusec_ir::GemmSpec;
use half::bf16;

/// Where [`gemm_bf16`] writes `y`: the `gemm` node's `out` dtype.
pub enum Bf16Out<'a> {
    /// An f32 result (`out = f32`); accumulation adds in f32.
    F32(&'a mut [f32]),
    /// A bf16 result (`out = bf16`), rounded as the module docs say.
    Bf16(&'a mut [bf16]),
}

/// `y[batch][m][n] (= or +=) gelu?(op(a) op(b) (+ bias))` on bf16 operands, through the path
/// of the selected instruction-set level ([`crate::isa::current`]); with `gelu`, `pre_gelu`
/// receives the value before GELU. Lengths and `threads` as in
/// [`gemm_f32`](super::gemm_f32); the result does not depend on `threads`.
///
/// # Panics
/// If a slice length does not match the spec.
pub fn gemm_bf16(
    spec: &GemmSpec,
    a: &[bf16],
    b: &[bf16],
    bias: Option<&[bf16]>,
    y: Bf16Out<'_>,
    pre_gelu: Option<&mut [bf16]>,
    threads: usize,
) {
    gemm_bf16_on(crate::isa::current(), spec, a, b, bias, y, pre_gelu, threads)
}

/// [`gemm_bf16`] through the path of level `isa` (tests and benchmarks compare them); a level
/// the host does not support runs the widened path.
///
/// # Panics
/// If a slice length does not match the spec.
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16_on(
    isa: Isa,
    spec: &GemmSpec,
    a: &[bf16],
    b: &[bf16],
    bias: Option<&[bf16]>,
    y: Bf16Out<'_>,
    pre_gelu: Option<&mut [bf16]>,
    threads: usize,
) {
    let (y_len, out) = match &y {
        Bf16Out::F32(v) => (v.len(), Out::F32(Raw(v.as_ptr().cast_mut()))),
        Bf16Out::Bf16(v) => (v.len(), Out::Bf16(Raw(v.as_ptr().cast_mut() as *mut u16))),
    };
    check(spec, a.len(), b.len(), bias.map(<[bf16]>::len), y_len, pre_gelu.as_deref().map(<[bf16]>::len));
    if spec.y_len() == 0 {
        return;
    }
    let job = Job {
        spec: *spec,
        tiling: Tiling::new(spec),
        a: Raw(a.as_ptr().cast_mut() as *mut u16),
        b: Raw(b.as_ptr().cast_mut() as *mut u16),
        bias: bias.map(|v| Raw(v.as_ptr().cast_mut() as *mut u16)),
        y: out,
        pre: pre_gelu.map(|v| Raw(v.as_mut_ptr() as *mut u16)),
        isa: if isa.supported() { isa } else { Isa::Scalar },
    };
    // SAFETY: the pointers come from slices checked against the spec above, distinct tasks
    // write disjoint tiles of `y` and `pre_gelu`, and the host supports `job.isa`.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        match job.isa {
            Isa::Amx => return shared::run::<amx::Amx>(&job, threads),
            Isa::Avx512Bf16 => return shared::run::<kernels::Dot512>(&job, threads),
            Isa::Avx512 => return shared::run::<kernels::Fma512>(&job, threads),
            Isa::Avx2 => return shared::run::<kernels::Fma256>(&job, threads),
            Isa::Scalar => {}
        }
        for_each_task(job.tiling.tasks(), threads, &|t| widen::tile(&job, t));
    }
}

/// The result's storage.
#[derive(Clone, Copy)]
enum Out {
    F32(Raw<f32>),
    Bf16(Raw<u16>),
}

/// One call's operands (bf16 as raw bits) and tiling, shared by the tasks.
struct Job {
    spec: GemmSpec,
    tiling: Tiling,
    a: Raw<u16>,
    b: Raw<u16>,
    bias: Option<Raw<u16>>,
    y: Out,
    pre: Option<Raw<u16>>,
    /// The level the tiles and their epilogue run at (one the host supports).
    isa: Isa,
}

// SAFETY: tasks read the operands and write disjoint tiles of the results.
unsafe impl Sync for Job {}

impl Job {
    /// Applies the epilogue to the tile's f32 products (overwriting them): row `i` of the tile
    /// is `prod[i * ld..][..nt]`.
    ///
    /// # Safety
    /// `prod` must hold the tile's rows; the job's pointers must cover the spec.
    unsafe fn finish(&self, tile: &Tile, prod: &mut [f32], ld: usize) {
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => self.finish_avx512(tile, prod, ld),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => self.finish_avx2(tile, prod, ld),
            _ => self.finish_rows(tile, prod, ld),
        }
    }

    /// [`Job::finish_rows`] compiled for AVX2: its loops (rounding, bias, stores) 8 lanes wide;
    /// this crate's own code is compiled for SSE2 (4 lanes) otherwise.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn finish_avx2(&self, tile: &Tile, prod: &mut [f32], ld: usize) {
        self.finish_rows(tile, prod, ld)
    }

    /// [`Job::finish_rows`] compiled for AVX-512 (16 lanes).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn finish_avx512(&self, tile: &Tile, prod: &mut [f32], ld: usize) {
        self.finish_rows(tile, prod, ld)
    }

    /// The epilogue of the tile's rows (see [`Job::finish`]); inlined into the level's copy.
    #[inline(always)]
    unsafe fn finish_rows(&self, tile: &Tile, prod: &mut [f32], ld: usize) {
        let s = &self.spec;
        let n = s.n;
        let off = self.tiling.y_offset(tile, n);
        let bias = self.bias.map(|p| std::slice::from_raw_parts(p.0.add(tile.j0), tile.nt));
        for i in 0..tile.mt {
            let row = &mut prod[i * ld..i * ld + tile.nt];
            let at = off + i * n;
            let pre = self.pre.map(|p| std::slice::from_raw_parts_mut(p.0.add(at), tile.nt));
            match self.y {
                Out::F32(y) => finish_row(s, row, bias, Row::F32(std::slice::from_raw_parts_mut(y.0.add(at), tile.nt)), pre),
                Out::Bf16(y) => finish_row(s, row, bias, Row::Bf16(std::slice::from_raw_parts_mut(y.0.add(at), tile.nt)), pre),
            }
        }
    }
}

/// One row of the result.
enum Row<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

/// The bits of `x` rounded to bf16: nearest, ties to even; a NaN stays NaN and becomes quiet
/// (the generated kernels' and the interpreter's rounding). Branch-free, so that loops over
/// rows vectorize.
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    let rounded = (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16;
    let quiet = ((u | 0x0040_0000) >> 16) as u16;
    if x.is_nan() {
        quiet
    } else {
        rounded
    }
}

/// The f32 of bf16 bits (exact).
#[inline(always)]
pub fn widen_bits(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `x` rounded to bf16, as an f32.
#[inline(always)]
fn round(x: f32) -> f32 {
    widen_bits(bf16_bits(x))
}

/// The bits of an f32 that holds a bf16 value (exact: the low half is zero).
#[inline(always)]
fn high_bits(x: f32) -> u16 {
    (x.to_bits() >> 16) as u16
}

/// The epilogue of one row of f32 products (`t`, overwritten), rounding as the module docs say;
/// one loop per step (one in all for a plain or biased bf16 product) so that each vectorizes.
#[inline(always)]
fn finish_row(s: &GemmSpec, t: &mut [f32], bias: Option<&[u16]>, y: Row<'_>, pre: Option<&mut [u16]>) {
    match y {
        // An f32 product: never rounded to bf16.
        Row::F32(y) if !s.bias && !s.gelu => add_or_copy(y, t, s.accumulate),
        Row::F32(y) => {
            round_steps(t, bias, pre);
            add_or_copy(y, t, s.accumulate);
        }
        // The common bf16 results, in one pass: `round(t)` or `round(round(t) + bias)`.
        Row::Bf16(y) if !s.gelu && !s.accumulate => match bias {
            Some(b) => y.iter_mut().zip(t.iter()).zip(b).for_each(|((y, t), b)| *y = bf16_bits(round(*t) + widen_bits(*b))),
            None => y.iter_mut().zip(t.iter()).for_each(|(y, t)| *y = bf16_bits(*t)),
        },
        Row::Bf16(y) => {
            round_steps(t, bias, pre);
            if s.accumulate {
                y.iter_mut().zip(t.iter()).for_each(|(y, v)| *y = bf16_bits(widen_bits(*y) + *v));
            } else {
                y.iter_mut().zip(t.iter()).for_each(|(y, v)| *y = high_bits(*v));
            }
        }
    }
}

/// `y += t` or `y = t`.
#[inline(always)]
fn add_or_copy(y: &mut [f32], t: &[f32], accumulate: bool) {
    if accumulate {
        y.iter_mut().zip(t).for_each(|(y, v)| *y += *v);
    } else {
        y.copy_from_slice(t);
    }
}

/// `t = round(t)`, then `t = round(t + bias)`, then `pre = t, t = round(gelu(t))`: the bf16
/// values the interpreter's product, bias add and GELU give.
#[inline(always)]
fn round_steps(t: &mut [f32], bias: Option<&[u16]>, pre: Option<&mut [u16]>) {
    let gelu = pre.is_some();
    let biased = |t: f32, b: Option<&u16>| match b {
        Some(b) => round(round(t) + widen_bits(*b)),
        None => round(t),
    };
    match (bias, pre) {
        (Some(b), Some(p)) => t.iter_mut().zip(b).zip(p.iter_mut()).for_each(|((t, b), p)| {
            *t = biased(*t, Some(b));
            *p = high_bits(*t);
        }),
        (None, Some(p)) => t.iter_mut().zip(p.iter_mut()).for_each(|(t, p)| {
            *t = biased(*t, None);
            *p = high_bits(*t);
        }),
        (Some(b), None) => t.iter_mut().zip(b).for_each(|(t, b)| *t = biased(*t, Some(b))),
        (None, None) => t.iter_mut().for_each(|t| *t = biased(*t, None)),
    }
    if gelu {
        // GELU in the host's widest vectors (the same bits as the scalar `gemm::gelu`), from a
        // copy of the pre-activations; this crate's own loops get SSE2 only.
        PRE.with(|pre| {
            let mut pre = pre.borrow_mut();
            pre.clear();
            pre.extend_from_slice(t);
            crate::vmath::gelu_rows(t, &pre, false);
        });
        t.iter_mut().for_each(|t| *t = round(*t));
    }
}

thread_local! {
    /// A row's pre-activations for the GELU epilogue (grown, never shrunk).
    static PRE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}
