//! [`GemmSpec`]: the shape and flags of one batched matrix product, as both backends run it
//! (the CPU's `gemm_f32` / `gemm_bf16`, the CUDA backend's cuBLAS mapping). The graph's
//! `matmul` and `gemm` nodes become one each under concrete bindings.

/// The shape and flags of one batched matrix product with its epilogue.
///
/// Storage is row-major: `a` is `[batch, m, k]` (`[batch, k, m]` if `trans_a`), `b` is
/// `[batch, k, n]` (`[batch, n, k]` if `trans_b`; without the batch axis if `b_shared`), and
/// `y` (and `pre_gelu`) is `[batch, m, n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmSpec {
    /// Number of independent products (the product of the leading axes; 1 for plain 2-D).
    pub batch: usize,
    /// Rows of `op(a)` and of the result.
    pub m: usize,
    /// Columns of `op(b)` and of the result.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// `a` is stored transposed (`[k, m]` per batch).
    pub trans_a: bool,
    /// `b` is stored transposed (`[n, k]`).
    pub trans_b: bool,
    /// `b` has no batch axis: one `b` shared by every batch of `a`.
    pub b_shared: bool,
    /// Add a bias vector of length `n` over the last axis.
    pub bias: bool,
    /// Apply GELU (tanh form) after the bias; the pre-activation goes to `pre_gelu`.
    pub gelu: bool,
    /// Add the result into the existing contents of `y` (beta = 1) instead of overwriting.
    pub accumulate: bool,
}

impl GemmSpec {
    /// A plain 2-D `y = a @ b` with `a: [m, k]`, `b: [k, n]` and no epilogue.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        GemmSpec { batch: 1, m, n, k, trans_a: false, trans_b: false, b_shared: true, bias: false, gelu: false, accumulate: false }
    }

    /// Elements `a` must hold.
    pub fn a_len(&self) -> usize {
        self.batch * self.m * self.k
    }

    /// Elements `b` must hold.
    pub fn b_len(&self) -> usize {
        if self.b_shared {
            self.k * self.n
        } else {
            self.batch * self.k * self.n
        }
    }

    /// Elements `y` (and `pre_gelu`) must hold.
    pub fn y_len(&self) -> usize {
        self.batch * self.m * self.n
    }

    /// Floating-point operations of the product (`2 batch m n k`), for GFLOP/s figures.
    pub fn flops(&self) -> u64 {
        2 * (self.batch * self.m * self.n) as u64 * self.k as u64
    }
}
