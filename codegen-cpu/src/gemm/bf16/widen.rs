//! The widened path: a tile's rows of `op(a)` and columns of `op(b)` widened to f32 (exactly)
//! in per-thread scratch, multiplied by the `gemm` crate's f32 kernels into an f32 tile, then
//! the epilogue. Runs on every host.

use std::cell::RefCell;

use super::super::strided::{matmul_strided, Mat};
use super::{widen_bits, Job};

/// Per-thread buffers (grown, never shrunk): the widened operands and the tile's products.
#[derive(Default)]
struct Scratch {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `v[..len]`, growing `v` first if needed.
fn take(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

/// Widens the `rows x cols` matrix at `src` with strides `(rs, cs)` (one of them 1) into `dst`,
/// keeping its orientation in memory; returns the view of `dst` as the same matrix.
///
/// # Safety
/// `src` must cover the matrix's extent.
unsafe fn widen(src: *const u16, rows: usize, cols: usize, rs: isize, cs: isize, dst: &mut Vec<f32>) -> Mat {
    // Lines of `len` contiguous elements, `stride` apart.
    let (lines, len, stride, view) = if cs == 1 { (rows, cols, rs, (cols as isize, 1)) } else { (cols, rows, cs, (1, rows as isize)) };
    let d = take(dst, lines * len);
    for l in 0..lines {
        let s = std::slice::from_raw_parts(src.offset(l as isize * stride), len);
        for (d, s) in d[l * len..(l + 1) * len].iter_mut().zip(s) {
            *d = widen_bits(*s);
        }
    }
    Mat { ptr: d.as_ptr(), rs: view.0, cs: view.1 }
}

/// Computes tile `t` of `job` and its epilogue.
///
/// # Safety
/// The job's pointers must cover its spec and no other task may run tile `t`.
pub(super) unsafe fn tile(job: &Job, t: usize) {
    let (s, tl) = (&job.spec, &job.tiling);
    let tile = tl.tile(t, s.n);
    let (a_off, b_off) = tl.operand_offsets(&tile);
    SCRATCH.with(|cell| {
        let mut guard = cell.borrow_mut();
        let sc = &mut *guard;
        let a = widen(job.a.0.offset(a_off), tile.mt, s.k, tl.a_rs, tl.a_cs, &mut sc.a);
        let b = widen(job.b.0.offset(b_off), s.k, tile.nt, tl.b_rs, tl.b_cs, &mut sc.b);
        let c = take(&mut sc.c, tile.mt * tile.nt);
        matmul_strided(tile.mt, tile.nt, s.k, c.as_mut_ptr(), tile.nt as isize, a, b, false);
        job.finish(&tile, c, tile.nt);
    });
}
