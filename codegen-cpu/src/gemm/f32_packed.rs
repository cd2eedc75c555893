//! f32 products on the packed FMA micro-kernels (module `packed`, shared with the bf16
//! products): each operand packed once per call into a buffer that all tiles read (the f32
//! bits as they are, no widening), then 12 x 32 (AVX-512F) or 6 x 16 (AVX2) blocks of sums, then
//! the epilogue of [`gemm_f32`](super::gemm_f32) on each tile's rows while they are in cache.
//!
//! Tiles are those of the `gemm` crate's path ([`Tiling`]), and each output is one FMA chain
//! over k in order from zero, so the result depends neither on the thread count nor on the
//! level (AVX-512 and AVX2 give the same bits); it differs from the crate's (another summation
//! order) within f32 accumulation error. [`F32Path::for_isa`] says which path a level takes.

use fusec_ir::GemmSpec;

#[cfg(target_arch = "x86_64")]
use super::packed::{kernels, shared, Product};
#[cfg(target_arch = "x86_64")]
use super::{epilogue, Raw, Tile, Tiling};
use crate::isa::Isa;

/// What multiplies f32 operands ([`gemm_f32_on`](super::gemm_f32_on)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum F32Path {
    /// The `gemm` crate: one single-threaded call per tile, each re-packing its operands; its
    /// kernels follow the host's features (AVX-512 where it has them), not the level.
    Crate,
    /// The packed FMA kernels in zmm (12 x 32 sums), operands packed once per call.
    Avx512,
    /// The packed FMA kernels in ymm (6 x 16 sums): the same bits as [`F32Path::Avx512`].
    Avx2,
}

impl F32Path {
    /// Every path.
    pub const ALL: [F32Path; 3] = [F32Path::Crate, F32Path::Avx512, F32Path::Avx2];

    /// The path of instruction-set level `isa`: the packed kernels of the level from AVX2 up,
    /// the crate at [`Isa::Scalar`] (no FMA kernels there).
    pub fn for_isa(isa: Isa) -> F32Path {
        match isa {
            Isa::Scalar => F32Path::Crate,
            Isa::Avx2 => F32Path::Avx2,
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => F32Path::Avx512,
        }
    }

    /// The name `gemm_bench --products f32@NAME` takes.
    pub fn name(self) -> &'static str {
        match self {
            F32Path::Crate => "crate",
            F32Path::Avx512 => "avx512",
            F32Path::Avx2 => "avx2",
        }
    }

    /// The path named `s` (as [`F32Path::name`] prints it).
    pub fn parse(s: &str) -> Option<F32Path> {
        F32Path::ALL.into_iter().find(|p| p.name() == s)
    }

    /// Whether this host can run the path (the crate runs everywhere).
    pub fn supported(self) -> bool {
        match self {
            F32Path::Crate => true,
            F32Path::Avx512 => Isa::Avx512.supported(),
            F32Path::Avx2 => Isa::Avx2.supported(),
        }
    }
}

/// One call's operands (f32 as bits) and tiling, shared by the tasks.
#[cfg(target_arch = "x86_64")]
pub(super) struct Job {
    spec: GemmSpec,
    tiling: Tiling,
    a: Raw<u32>,
    b: Raw<u32>,
    bias: Option<Raw<f32>>,
    y: Raw<f32>,
    pre: Option<Raw<f32>>,
    /// Whether the epilogue runs in zmm (else ymm): the same bits either way.
    wide: bool,
}

// SAFETY: tasks read the operands and write disjoint tiles of the results.
#[cfg(target_arch = "x86_64")]
unsafe impl Sync for Job {}

/// `y (= or +=) gelu?(op(a) op(b) (+ bias))` on the packed kernels of `path` (not
/// [`F32Path::Crate`]), with the arguments of [`gemm_f32`](super::gemm_f32) already checked
/// against `spec` and `y` not empty.
///
/// # Safety
/// The host must support `path`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn run(
    path: F32Path,
    spec: &GemmSpec,
    a: &[f32],
    b: &[f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
    pre: Option<&mut [f32]>,
    threads: usize,
) {
    let job = Job {
        spec: *spec,
        tiling: Tiling::new(spec),
        a: Raw(a.as_ptr().cast_mut() as *mut u32),
        b: Raw(b.as_ptr().cast_mut() as *mut u32),
        bias: bias.map(|v| Raw(v.as_ptr().cast_mut())),
        y: Raw(y.as_mut_ptr()),
        pre: pre.map(|v| Raw(v.as_mut_ptr())),
        wide: path == F32Path::Avx512,
    };
    // SAFETY: the slices cover the spec (checked by the caller), distinct tasks write disjoint
    // tiles of `y` and `pre_gelu`, and the host supports the kernel (the caller's promise).
    match path {
        F32Path::Avx512 => shared::run::<kernels::Fma512, Job>(&job, threads),
        F32Path::Avx2 => shared::run::<kernels::Fma256, Job>(&job, threads),
        F32Path::Crate => unreachable!("the crate's path is not packed"),
    }
}

#[cfg(target_arch = "x86_64")]
impl Product for Job {
    type Src = u32;

    fn spec(&self) -> &GemmSpec {
        &self.spec
    }

    fn tiling(&self) -> &Tiling {
        &self.tiling
    }

    fn operands(&self) -> (*const u32, *const u32) {
        (self.a.0, self.b.0)
    }

    unsafe fn finish(&self, tile: &Tile, prod: &mut [f32], ld: usize) {
        // SAFETY: the job runs only on hosts with its kernel's level (see `run`).
        if self.wide {
            self.finish_avx512(tile, prod, ld)
        } else {
            self.finish_avx2(tile, prod, ld)
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Job {
    /// [`Job::finish_rows`] compiled for AVX-512 (16 lanes; this crate is compiled for SSE2).
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn finish_avx512(&self, tile: &Tile, prod: &mut [f32], ld: usize) {
        self.finish_rows(tile, prod, ld)
    }

    /// [`Job::finish_rows`] compiled for AVX2 (8 lanes).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn finish_avx2(&self, tile: &Tile, prod: &mut [f32], ld: usize) {
        self.finish_rows(tile, prod, ld)
    }

    /// The epilogue of [`gemm_f32`](super::gemm_f32) on the tile's sums, row by row, with the
    /// crate path's operations in its order: `pre = t (+ bias)` then `y (= or +=) gelu(pre)`;
    /// `y = t + bias`; `y += t + bias`; `y = t`; `y += t`.
    #[inline(always)]
    unsafe fn finish_rows(&self, tile: &Tile, prod: &mut [f32], ld: usize) {
        let (s, nt) = (&self.spec, tile.nt);
        let off = self.tiling.y_offset(tile, s.n);
        let bias = self.bias.map(|p| std::slice::from_raw_parts(p.0.add(tile.j0), nt));
        for i in 0..tile.mt {
            let t = &prod[i * ld..i * ld + nt];
            let at = off + i * s.n;
            let y = std::slice::from_raw_parts_mut(self.y.0.add(at), nt);
            match (self.pre, bias) {
                (Some(pre), bias) => {
                    let pre = std::slice::from_raw_parts_mut(pre.0.add(at), nt);
                    pre.copy_from_slice(t);
                    epilogue::bias_gelu(pre, y, bias, s.accumulate);
                }
                (None, Some(bias)) if s.accumulate => epilogue::accumulate_bias(y, t, bias),
                (None, Some(bias)) => y.iter_mut().zip(t).zip(bias).for_each(|((y, t), b)| *y = *t + *b),
                (None, None) if s.accumulate => y.iter_mut().zip(t).for_each(|(y, t)| *y += *t),
                (None, None) => y.copy_from_slice(t),
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    //! The shared and chunked packing of `op(b)` with f32 operands: forced here by small
    //! buffer limits (the real limit needs an `op(b)` over 32 MiB).

    use super::*;
    use crate::gemm::packed::shared::run_within;
    use fusec_ir::rng::Rng;

    #[test]
    fn chunked_and_per_tile_packing_give_the_same_bits_on_both_levels() {
        if !Isa::Avx2.supported() {
            return fusec_ir::testkit::skip("packed f32 products", "this host has no AVX2");
        }
        let mut rng = Rng::new(11);
        for (batch, m, n, k, ta, tb, shared_b) in [(1, 300, 300, 800, false, true, true), (2, 70, 260, 600, true, false, false), (3, 130, 200, 257, false, false, true)] {
            let mut s = GemmSpec::new(m, n, k);
            (s.batch, s.trans_a, s.trans_b, s.b_shared) = (batch, ta, tb, shared_b);
            (s.bias, s.accumulate) = (true, true);
            let a: Vec<f32> = (0..s.a_len()).map(|_| rng.normal() as f32).collect();
            let b: Vec<f32> = (0..s.b_len()).map(|_| rng.normal() as f32).collect();
            let bias: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
            let y0: Vec<f32> = (0..s.y_len()).map(|_| rng.normal() as f32).collect();
            let mut paths = vec![F32Path::Avx2];
            if Isa::Avx512.supported() {
                paths.push(F32Path::Avx512);
            }
            let mut want: Option<Vec<f32>> = None;
            for path in paths {
                // (limit, threads): the whole call's packing shared, `op(b)` a chunk of k blocks
                // at a time (the first shape at 440 000, the last at 120 000 with `Fma512`),
                // and no sharing at all (every tile packs its own).
                for (max, threads) in [(32 << 20, 2), (440_000, 2), (440_000, 1), (120_000, 2), (0, 2)] {
                    let mut y = y0.clone();
                    let job = Job {
                        spec: s,
                        tiling: Tiling::new(&s),
                        a: Raw(a.as_ptr().cast_mut() as *mut u32),
                        b: Raw(b.as_ptr().cast_mut() as *mut u32),
                        bias: Some(Raw(bias.as_ptr().cast_mut())),
                        y: Raw(y.as_mut_ptr()),
                        pre: None,
                        wide: path == F32Path::Avx512,
                    };
                    // SAFETY: the slices cover the spec; the host has the level.
                    unsafe {
                        match path {
                            F32Path::Avx512 => run_within::<kernels::Fma512, Job>(&job, threads, max),
                            _ => run_within::<kernels::Fma256, Job>(&job, threads, max),
                        }
                    }
                    match &want {
                        None => {
                            // The first run against an f64 reference, the rest against it.
                            for (o, got) in y.iter().enumerate() {
                                let (z, i, j) = (o / (m * n), o / n % m, o % n);
                                let bz = if shared_b { 0 } else { z * k * n };
                                let mut t = 0f64;
                                for p in 0..k {
                                    let av = if ta { a[z * m * k + p * m + i] } else { a[z * m * k + i * k + p] };
                                    let bv = if tb { b[bz + j * k + p] } else { b[bz + p * n + j] };
                                    t += av as f64 * bv as f64;
                                }
                                let w = y0[o] as f64 + t + bias[j] as f64;
                                assert!((*got as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()), "{s:?}: [{o}] {got} vs {w}");
                            }
                            want = Some(y);
                        }
                        Some(w) => assert!(
                            y.iter().zip(w).all(|(p, q)| p.to_bits() == q.to_bits()),
                            "{s:?}: {path:?} with limit {max} on {threads} thread(s) changed bits"
                        ),
                    }
                }
            }
        }
    }
}
