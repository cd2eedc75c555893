//! CPU matrix products for `matmul` and `gemm` nodes, on raw row-major f32 slices.
//!
//! Every product goes through the `gemm` crate (AVX-512 kernels with its `x86-v4` feature),
//! with strides expressing the transposes, so no operand is ever copied. The output is cut
//! into tiles of fixed size (a pure function of the shape, never of the thread count, so one
//! and two threads give the same bits); tiles run in parallel on the current rayon pool, each
//! as one single-threaded `gemm` call followed at once by its epilogue (bias add, GELU with
//! the pre-activation saved, accumulation) while the tile (at most 1024 x 1024) is still in
//! cache. Tiles are large because each one re-packs its rows of `op(a)` and columns of
//! `op(b)`; there are at least four per product (when the shape allows) to keep two threads
//! busy.
//!
//! GELU uses the same branch-free Cephes `tanhf` as the Cranelift kernels (within 2 ulp; the
//! loop vectorizes). glibc's `tanhf` (llm.c's) cost 10-15 ns an element here, several times the
//! product's own time for the GPT-2 MLP shapes (see `gemm_bench`).
//!
//! Semantics are those of `Op::Gemm` in `fusec-ir`: `t = op(a) op(b)`, then `t + bias[n]`,
//! then `pre_gelu = t, y = gelu(t)` (tanh form, evaluated in f32 exactly as llm.c's
//! `gelu_forward`), then `y = acc + y` in place when accumulating. The product accumulates in
//! f32 with FMA in the crate's order (which depends on the shape only), so results agree with
//! an f64 reference to about `1e-5` relative.
//!
//! bf16 operands ([`gemm_bf16`]) take the same tiles, multiplied by AVX512-BF16 dot products
//! or on operands widened to f32 (module `bf16`).
//!
//! Steady-state calls allocate nothing in this module (scratch is thread-local and grows
//! only); the `gemm` crate itself may allocate its packing buffers per call.

mod bf16;
mod epilogue;
mod small;
mod strided;

pub use bf16::{bf16_bits, gemm_bf16, gemm_bf16_on, widen_bits, Bf16Out};
#[cfg(target_arch = "x86_64")]
pub use bf16::amx_permitted;
pub(crate) use epilogue::gelu_scale;
pub use epilogue::{exp, gelu, tanh};
pub use small::matmul_small;
pub use strided::{matmul_strided, Mat};

static CRATE_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many times the `gemm` crate has been called. The crate allocates its packing buffer
/// inside each call; the no-allocation test uses this count to tell those apart from ours.
pub fn crate_calls() -> u64 {
    CRATE_CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

fn count_crate_call() {
    CRATE_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

use fusec_ir::GemmSpec;
use gemm::Parallelism;
use rayon::prelude::*;
use std::cell::RefCell;

/// Whether anything happens after the product besides plain accumulation.
fn has_epilogue(spec: &GemmSpec) -> bool {
    spec.bias || spec.gelu
}

/// Panics unless the slice lengths fit the spec.
fn check(spec: &GemmSpec, a: usize, b: usize, bias: Option<usize>, y: usize, pre: Option<usize>) {
    assert_eq!(a, spec.a_len(), "gemm: `a` has {a} elements, the spec needs {}", spec.a_len());
    assert_eq!(b, spec.b_len(), "gemm: `b` has {b} elements, the spec needs {}", spec.b_len());
    assert_eq!(y, spec.y_len(), "gemm: `y` has {y} elements, the spec needs {}", spec.y_len());
    match (spec.bias, bias) {
        (true, Some(len)) => assert_eq!(len, spec.n, "gemm: bias has {len} elements, the spec needs {}", spec.n),
        (false, None) => {}
        (want, _) => panic!("gemm: spec.bias is {want} but a bias was{} given", if want { " not" } else { "" }),
    }
    match (spec.gelu, pre) {
        (true, Some(len)) => assert_eq!(len, spec.y_len(), "gemm: pre_gelu has {len} elements, the spec needs {}", spec.y_len()),
        (false, None) => {}
        (want, _) => panic!("gemm: spec.gelu is {want} but pre_gelu was{} given", if want { " not" } else { "" }),
    }
}

/// `y[batch][m][n] (= or +=) gelu?(op(a) op(b) (+ bias))`; with `gelu`, `pre_gelu` receives
/// the value before GELU (never accumulated).
///
/// `bias` must be given exactly when `spec.bias` (length `n`) and `pre_gelu` exactly when
/// `spec.gelu` (length of `y`). `threads <= 1` runs on the calling thread; otherwise tiles run
/// on the current rayon pool, split into at most `threads` parallel parts. The result does not
/// depend on `threads`.
///
/// # Panics
/// If a slice length does not match the spec.
pub fn gemm_f32(spec: &GemmSpec, a: &[f32], b: &[f32], bias: Option<&[f32]>, y: &mut [f32], pre_gelu: Option<&mut [f32]>, threads: usize) {
    check(spec, a.len(), b.len(), bias.map(<[f32]>::len), y.len(), pre_gelu.as_deref().map(<[f32]>::len));
    if spec.y_len() == 0 {
        return;
    }
    let plan = Plan::new(spec, a, b, bias, y, pre_gelu);
    for_each_task(plan.tasks(), threads, &|t| {
        // SAFETY: the plan's pointers come from slices checked against the spec above, and
        // distinct tasks write disjoint tiles of `y` and `pre_gelu`.
        unsafe { plan.run(t) }
    });
}

/// Largest tile height (rows). Big tiles repack operands least; measured on the GPT-2 step
/// shapes (`gemm_bench`), 512 to 2048 were within noise of each other, 256 and below slower.
const TILE_M: usize = 1024;
/// Largest tile width (columns).
const TILE_N: usize = 1024;
/// Tiles are halved (down to [`MIN_TILE`]) until a product has at least this many: the host's
/// cores (at least 4, at most 64) times [`tiles_per_core`]. Measured on a 16-core Xeon at 8
/// threads, 16 tiles instead of 4: `small` step 305 → 247 ms, GPT-2 124M (B=4, T=64) 719 → 569
/// ms; on the 2-core EPYC at 2 threads 16 tiles cost 5–8% (more packing), so the count follows
/// the host. It depends on the host (and the variable) only, not on `--threads`: a run's
/// results are the same for any thread count.
pub fn min_tiles() -> usize {
    static TILES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *TILES.get_or_init(|| {
        let cores = host_cores();
        cores.clamp(4, 64) * tiles_per_core().unwrap_or_else(|_| host_tiles_per_core(cores))
    })
}

/// The cores this process may run on (1 when the host does not say).
fn host_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The variable that sets [`tiles_per_core`].
pub const TILES_ENV: &str = "FUSEC_GEMM_TILES_PER_CORE";

/// The default of [`tiles_per_core`] on a host with `cores` cores: four from eight cores up,
/// else one. Measured (README, CPU backend): on a 16-core Xeon four a core made `small` 5–15%
/// faster at 8 and 16 threads and left GPT-2 124M (B=4, T=64) within noise; on a 2-core host
/// they cost 3–12%.
pub fn host_tiles_per_core(cores: usize) -> usize {
    if cores >= 8 {
        4
    } else {
        1
    }
}

/// Tiles a core that products are cut into at least: `FUSEC_GEMM_TILES_PER_CORE` (1 to 16),
/// else [`host_tiles_per_core`]. An error names a value outside the range.
pub fn tiles_per_core() -> Result<usize, String> {
    match std::env::var(TILES_ENV) {
        Err(_) => Ok(host_tiles_per_core(host_cores())),
        Ok(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=16).contains(n))
            .ok_or_else(|| format!("{TILES_ENV}={v:?}: expected a whole number of tiles a core from 1 to 16")),
    }
}
/// Smallest tile side the halving goes to.
const MIN_TILE: usize = 64;

/// Tile sides `(rows, cols)` for a `rows x n` output: a function of the shape and the host's
/// core count ([`min_tiles`]), so results do not depend on the thread count. Large tiles keep
/// operand re-packing small (each `op(b)` column is packed once per row tile, each `op(a)` row
/// once per column tile); enough tiles keep the host's cores busy.
fn tile_sides(rows: usize, n: usize) -> (usize, usize) {
    let even = |len: usize, max: usize, unit: usize| len.div_ceil(len.div_ceil(max)).next_multiple_of(unit).min(len).max(1);
    let (mut tm, mut tn) = (even(rows, TILE_M, 8), even(n, TILE_N, 16));
    while rows.div_ceil(tm) * n.div_ceil(tn) < min_tiles() {
        if tm >= tn && tm / 2 >= MIN_TILE {
            tm = even(rows, tm / 2, 8);
        } else if tn / 2 >= MIN_TILE {
            tn = even(n, tn / 2, 16);
        } else {
            break;
        }
    }
    (tm, tn)
}

/// A raw pointer that tiles share; each task touches only its own tile.
#[derive(Clone, Copy)]
pub(crate) struct Raw<T>(pub *mut T);
// SAFETY: tasks write disjoint tiles through it and only read the operands.
unsafe impl<T> Send for Raw<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Raw<T> {}

/// How a product is cut into tiles, and its operands' strides: shared by the f32 and the bf16
/// products (a pure function of the spec).
#[derive(Clone, Copy)]
pub(crate) struct Tiling {
    /// Independent products after folding a shared-`b` batch into the rows.
    pub batches: usize,
    /// Rows per product after folding.
    pub rows: usize,
    /// Tiles per product along rows and columns, and the sides of one tile.
    pub row_tiles: usize,
    pub col_tiles: usize,
    pub tile_m: usize,
    pub tile_n: usize,
    /// Element offsets between consecutive batches of `a` and `b`.
    pub a_batch: usize,
    pub b_batch: usize,
    /// Row and column strides of `op(a)` and `op(b)` (in elements).
    pub a_rs: isize,
    pub a_cs: isize,
    pub b_rs: isize,
    pub b_cs: isize,
}

/// One tile of a [`Tiling`]: batch `z`, rows `i0..i0 + mt`, columns `j0..j0 + nt`.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    pub z: usize,
    pub i0: usize,
    pub j0: usize,
    pub mt: usize,
    pub nt: usize,
}

impl Tiling {
    pub fn new(spec: &GemmSpec) -> Tiling {
        let (m, n, k) = (spec.m, spec.n, spec.k);
        // With one `b` and `a` stored `[batch*m, k]`, the batch is just more rows.
        let fold = spec.batch == 1 || (spec.b_shared && !spec.trans_a);
        let (batches, rows) = if fold { (1, spec.batch * m) } else { (spec.batch, m) };
        let (tile_m, tile_n) = tile_sides(rows, n);
        let (a_rs, a_cs) = if spec.trans_a { (1, m as isize) } else { (k as isize, 1) };
        let (b_rs, b_cs) = if spec.trans_b { (1, k as isize) } else { (n as isize, 1) };
        Tiling {
            batches,
            rows,
            row_tiles: rows.div_ceil(tile_m),
            col_tiles: n.div_ceil(tile_n),
            tile_m,
            tile_n,
            a_batch: m * k,
            b_batch: if spec.b_shared { 0 } else { k * n },
            a_rs,
            a_cs,
            b_rs,
            b_cs,
        }
    }

    pub fn tasks(&self) -> usize {
        self.batches * self.row_tiles * self.col_tiles
    }

    /// Tile `t` of a product with `n` columns.
    pub fn tile(&self, t: usize, n: usize) -> Tile {
        let per_batch = self.row_tiles * self.col_tiles;
        let (z, rest) = (t / per_batch, t % per_batch);
        let (it, jt) = (rest / self.col_tiles, rest % self.col_tiles);
        let (i0, j0) = (it * self.tile_m, jt * self.tile_n);
        Tile { z, i0, j0, mt: self.tile_m.min(self.rows - i0), nt: self.tile_n.min(n - j0) }
    }

    /// Element offset of the tile's first output in `y` (of a product with `n` columns).
    pub fn y_offset(&self, t: &Tile, n: usize) -> usize {
        t.z * self.rows * n + t.i0 * n + t.j0
    }

    /// Element offsets of the tile's first row of `op(a)` and first column of `op(b)`.
    pub fn operand_offsets(&self, t: &Tile) -> (isize, isize) {
        ((t.z * self.a_batch) as isize + t.i0 as isize * self.a_rs, (t.z * self.b_batch) as isize + t.j0 as isize * self.b_cs)
    }
}

/// One call's operands and tiling.
struct Plan {
    spec: GemmSpec,
    tiling: Tiling,
    a: Raw<f32>,
    b: Raw<f32>,
    bias: Option<Raw<f32>>,
    y: Raw<f32>,
    pre: Option<Raw<f32>>,
}

impl Plan {
    fn new(spec: &GemmSpec, a: &[f32], b: &[f32], bias: Option<&[f32]>, y: &mut [f32], pre: Option<&mut [f32]>) -> Self {
        Plan {
            spec: *spec,
            tiling: Tiling::new(spec),
            a: Raw(a.as_ptr().cast_mut()),
            b: Raw(b.as_ptr().cast_mut()),
            bias: bias.map(|s| Raw(s.as_ptr().cast_mut())),
            y: Raw(y.as_mut_ptr()),
            pre: pre.map(|s| Raw(s.as_mut_ptr())),
        }
    }

    fn tasks(&self) -> usize {
        self.tiling.tasks()
    }

    /// Computes tile `t`: its product, then its epilogue.
    ///
    /// # Safety
    /// The pointers must cover the spec's extents and no other task may run tile `t`.
    unsafe fn run(&self, t: usize) {
        let s = &self.spec;
        let tl = &self.tiling;
        let tile = tl.tile(t, s.n);
        let (j0, mt, nt) = (tile.j0, tile.mt, tile.nt);
        let n = s.n;
        let y_off = tl.y_offset(&tile, n);
        let (a_off, b_off) = tl.operand_offsets(&tile);
        let a = self.a.0.offset(a_off);
        let b = self.b.0.offset(b_off);
        let y = self.y.0.add(y_off);
        let product_to = |dst: *mut f32, dst_cs: usize, dst_rs: usize, read_dst: bool| {
            count_crate_call();
            gemm::gemm(
                mt,
                nt,
                s.k,
                dst,
                dst_cs as isize,
                dst_rs as isize,
                read_dst,
                a,
                tl.a_cs,
                tl.a_rs,
                b,
                tl.b_cs,
                tl.b_rs,
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                Parallelism::None,
            )
        };
        let product = |dst: *mut f32, dst_rs: usize, read_dst: bool| product_to(dst, 1, dst_rs, read_dst);
        if !has_epilogue(s) {
            if column_major_pays(mt, nt, s.k) {
                with_scratch(mt * nt, |tmp| {
                    product_to(tmp.as_mut_ptr(), mt, 1, false);
                    store_transposed(y, n, tmp, mt, nt, s.accumulate);
                });
            } else {
                product(y, n, s.accumulate);
            }
            return;
        }
        let bias = self.bias.map(|p| std::slice::from_raw_parts(p.0.add(j0), nt));
        let rows = |p: *mut f32, stride: usize, i: usize| std::slice::from_raw_parts_mut(p.add(i * stride), nt);
        if let Some(pre) = self.pre {
            // The product lands in `pre_gelu`, becomes the pre-activation there, then feeds `y`.
            let pre = pre.0.add(y_off);
            product(pre, n, false);
            for i in 0..mt {
                epilogue::bias_gelu(rows(pre, n, i), rows(y, n, i), bias, s.accumulate);
            }
        } else if !s.accumulate {
            product(y, n, false);
            for i in 0..mt {
                epilogue::add_bias(rows(y, n, i), bias.expect("an epilogue without gelu has a bias"));
            }
        } else {
            // `y += product + bias`: the product needs a place of its own.
            with_scratch(mt * nt, |tmp| {
                product(tmp.as_mut_ptr(), nt, false);
                let bias = bias.expect("an epilogue without gelu has a bias");
                for i in 0..mt {
                    epilogue::accumulate_bias(rows(y, n, i), &tmp[i * nt..(i + 1) * nt], bias);
                }
            });
        }
    }
}

/// Whether a tile of `mt x nt` outputs over `k` is faster computed column-major into scratch and
/// copied into its row-major place. The crate multiplies a row-major result as its transpose,
/// an `nt`-row problem, which fills its register blocks worse than the `mt`-row one when the
/// tile is tall; the copy costs `mt nt` against the product's `mt nt k`, so it pays at long `k`.
/// Measured on a 2-core Zen 4 (`gemm_bench --only dW`, twentieth and twenty-first sessions): the
/// `small` LM head's weight gradient (8192 x 256, k = 2,048) 49.2 / 52.7 -> 45.9 / 47.2 ms; wide
/// or square tiles and k = 256 (the 124M shape at B = 4, T = 64) were slower, and so was the LM
/// head on the crate's AVX2 kernels (49.1 / 48.0 -> 49.8 / 48.9 ms), so only hosts where the crate
/// runs its AVX-512 kernels take it. `FUSEC_GEMM_COLUMN_TILES=0` keeps every tile row-major.
fn column_major_pays(mt: usize, nt: usize, k: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    k >= 1024
        && mt >= 4 * nt
        && *ON.get_or_init(|| std::env::var("FUSEC_GEMM_COLUMN_TILES").map_or(true, |v| v != "0") && crate::isa::Isa::Avx512.supported())
}

/// `y[i, j] = t[j * mt + i]` (or `+=` when `accumulate`) for the `mt x nt` tile at `y` (row
/// stride `n`), in blocks that stay in cache on both sides. `y + t` is the crate's own
/// accumulation (`1 * y + 1 * product`).
///
/// # Safety
/// `y` must cover the tile.
unsafe fn store_transposed(y: *mut f32, n: usize, t: &[f32], mt: usize, nt: usize, accumulate: bool) {
    const B: usize = 32;
    for i0 in (0..mt).step_by(B) {
        for j0 in (0..nt).step_by(B) {
            for i in i0..(i0 + B).min(mt) {
                let row = std::slice::from_raw_parts_mut(y.add(i * n), nt);
                for j in j0..(j0 + B).min(nt) {
                    let v = t[j * mt + i];
                    row[j] = if accumulate { row[j] + v } else { v };
                }
            }
        }
    }
}

thread_local! {
    /// Per-thread f32 scratch for tiles whose product cannot go straight to an output.
    static TILE_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on `len` elements of this thread's tile scratch (grown, never shrunk).
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    TILE_SCRATCH.with(|cell| {
        let mut v = cell.borrow_mut();
        if v.len() < len {
            v.resize(len, 0.0);
        }
        f(&mut v[..len])
    })
}

/// Runs `f(0..n)`: inline for one thread, else on the current rayon pool, dynamically when
/// `threads` covers the pool, in `threads` contiguous parts otherwise.
pub(crate) fn for_each_task(n: usize, threads: usize, f: &(dyn Fn(usize) + Sync)) {
    use crate::thread_spans::task;
    if threads <= 1 || n <= 1 {
        (0..n).for_each(|k| task(|| f(k)));
    } else if threads >= rayon::current_num_threads() {
        (0..n).into_par_iter().for_each(|k| task(|| f(k)));
    } else {
        let per = n.div_ceil(threads);
        (0..threads).into_par_iter().for_each(|p| task(|| (p * per..((p + 1) * per).min(n)).for_each(f)));
    }
}
