//! Row-major products as column-major cuBLAS calls.
//!
//! cuBLAS is column-major; fusec's buffers are row-major. A row-major `[r, c]` matrix with row
//! stride `ld` is, read column-major, its transpose (`[c, r]` with leading dimension `ld`), so
//! `C = op(A) op(B)` (row-major) is computed as `C^T = op(B)^T op(A)^T` (column-major): swap
//! the operands, swap `m` and `n`, keep each operand's transpose flag and stride. No data moves.

use fusec_ir::GemmSpec;

/// The arguments of `cublasSgemm`-style calls (column-major, `transa`/`transb` as booleans).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ColMajor {
    /// Transpose cuBLAS's `A` (which is the row-major product's `b`).
    pub trans_a: bool,
    /// Transpose cuBLAS's `B` (the row-major `a`).
    pub trans_b: bool,
    /// cuBLAS `m` (the row-major `n`).
    pub m: i32,
    /// cuBLAS `n` (the row-major `m`).
    pub n: i32,
    /// The contracted dimension.
    pub k: i32,
    /// Leading dimension of cuBLAS's `A` (row stride of the row-major `b`).
    pub lda: i32,
    /// Leading dimension of cuBLAS's `B` (row stride of the row-major `a`).
    pub ldb: i32,
    /// Leading dimension of the result (row stride of the row-major `c`).
    pub ldc: i32,
}

fn i32_of(x: usize, what: &str) -> Result<i32, String> {
    i32::try_from(x).map_err(|_| format!("GEMM {what} {x} exceeds cuBLAS's 32-bit sizes"))
}

/// Row-major `c[m, n] = op(a)[m, k] op(b)[k, n]` with row strides `lda`, `ldb`, `ldc` (elements)
/// as a column-major call whose `A` is `b` and whose `B` is `a`.
#[allow(clippy::too_many_arguments)]
pub fn row_major(m: usize, n: usize, k: usize, ta: bool, tb: bool, lda: usize, ldb: usize, ldc: usize) -> Result<ColMajor, String> {
    Ok(ColMajor {
        trans_a: tb,
        trans_b: ta,
        m: i32_of(n, "n")?,
        n: i32_of(m, "m")?,
        k: i32_of(k, "k")?,
        lda: i32_of(ldb, "stride")?,
        ldb: i32_of(lda, "stride")?,
        ldc: i32_of(ldc, "stride")?,
    })
}

/// A strided-batched column-major call for a [`GemmSpec`] (contiguous row-major operands).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batched {
    /// The per-batch call (cuBLAS `A` = the spec's `b`, `B` = the spec's `a`).
    pub call: ColMajor,
    /// Elements between batches of cuBLAS's `A` (0: `b` shared).
    pub stride_a: i64,
    /// Elements between batches of cuBLAS's `B`.
    pub stride_b: i64,
    /// Elements between batches of the result.
    pub stride_c: i64,
    /// Batch count.
    pub batch: i32,
}

/// The cuBLAS call of a spec's product (the epilogue is the caller's). A batch of products
/// sharing `b` with an untransposed `a` is one product with `batch * m` rows.
pub fn batched(s: &GemmSpec) -> Result<Batched, String> {
    let (mut m, mut batch) = (s.m, s.batch);
    if s.b_shared && !s.trans_a && batch > 1 {
        m *= batch;
        batch = 1;
    }
    let lda = if s.trans_a { m } else { s.k };
    let ldb = if s.trans_b { s.k } else { s.n };
    let call = row_major(m, s.n, s.k, s.trans_a, s.trans_b, lda, ldb, s.n)?;
    Ok(Batched {
        call,
        stride_a: if s.b_shared { 0 } else { (s.k * s.n) as i64 },
        stride_b: (m * s.k) as i64,
        stride_c: (m * s.n) as i64,
        batch: i32_of(batch, "batch")?,
    })
}

/// The reference semantics of a column-major `C = op(A) op(B)` (for tests): `a`, `b`, `c`
/// column-major with the given leading dimensions.
pub fn colmajor_reference(g: &ColMajor, a: &[f32], b: &[f32], c: &mut [f32]) {
    let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
    let at = |i: usize, p: usize| if g.trans_a { a[p + i * g.lda as usize] } else { a[i + p * g.lda as usize] };
    let bt = |p: usize, j: usize| if g.trans_b { b[j + p * g.ldb as usize] } else { b[p + j * g.ldb as usize] };
    for j in 0..n {
        for i in 0..m {
            let mut s = 0f32;
            for p in 0..k {
                s += at(i, p) * bt(p, j);
            }
            c[i + j * g.ldc as usize] = s;
        }
    }
}
