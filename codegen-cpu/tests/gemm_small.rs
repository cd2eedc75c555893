//! `matmul_small` (attention's per-head products) against an f64 triple loop, in the operand
//! layouts attention passes and others: contiguous and strided right operands (the second
//! through the crate), row-major and transposed left operands, row counts that are not whole
//! register blocks and column counts that are not whole vectors; accumulation falls back to
//! the crate and must add.

use fusec_codegen_cpu::gemm::{matmul_small, Mat};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::assert_close_slice;

/// `len` values in `[-0.5, 0.5)`.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..len).map(|_| r.range(-0.5, 0.5) as f32).collect()
}

/// Element `(i, j)` of a view.
unsafe fn at(m: Mat, i: usize, j: usize) -> f32 {
    *m.ptr.offset(i as isize * m.rs + j as isize * m.cs)
}

/// Checks `m x k` by `k x n` with `lhs` and `rhs` views of `a` and `b` in the given layouts.
fn check(m: usize, n: usize, k: usize, lhs_t: bool, rhs_t: bool, accumulate: bool) {
    let (a, b) = (values(m * k, (m * 31 + k) as u64), values(k * n, (n * 17 + k) as u64));
    // A transposed view reads the same memory the other way round (stored `k x m` / `n x k`).
    let lhs = if lhs_t { Mat { ptr: a.as_ptr(), rs: 1, cs: m as isize } } else { Mat { ptr: a.as_ptr(), rs: k as isize, cs: 1 } };
    let rhs = if rhs_t { Mat { ptr: b.as_ptr(), rs: 1, cs: k as isize } } else { Mat { ptr: b.as_ptr(), rs: n as isize, cs: 1 } };
    let rs = n + 3;
    let y0 = values(m * rs, 99);
    let mut y = y0.clone();
    // SAFETY: the views cover their extents; `y` has m rows of stride rs >= n.
    unsafe { matmul_small(m, n, k, y.as_mut_ptr(), rs as isize, lhs, rhs, accumulate) };
    let mut want = vec![0.0f64; m * rs];
    for i in 0..m {
        for j in 0..rs {
            want[i * rs + j] = y0[i * rs + j] as f64;
        }
        for j in 0..n {
            // SAFETY: as above.
            let dot: f64 = (0..k).map(|p| unsafe { at(lhs, i, p) as f64 * at(rhs, p, j) as f64 }).sum();
            want[i * rs + j] = if accumulate { y0[i * rs + j] as f64 + dot } else { dot };
        }
    }
    assert_close_slice(&format!("{m}x{n}x{k} lhs_t={lhs_t} rhs_t={rhs_t} acc={accumulate}"), &y, &want, 1e-5, 1e-5);
}

#[test]
fn attention_shapes_in_every_layout() {
    for (m, n, k) in [(64, 256, 64), (64, 64, 256), (64, 128, 64), (6, 16, 1), (64, 64, 192)] {
        for (lhs_t, rhs_t) in [(false, false), (false, true), (true, false), (true, true)] {
            check(m, n, k, lhs_t, rhs_t, false);
        }
    }
}

#[test]
fn ragged_blocks_and_vectors() {
    // Rows past whole blocks of six, columns past whole vectors and whole 64-column chunks.
    for (m, n, k) in [(1, 1, 1), (5, 17, 3), (13, 65, 40), (37, 100, 36), (64, 129, 17), (7, 3, 300)] {
        check(m, n, k, false, false, false);
        check(m, n, k, true, true, false);
    }
}

#[test]
fn accumulation_adds() {
    check(13, 65, 40, false, false, true);
    check(64, 64, 64, true, false, true);
}
