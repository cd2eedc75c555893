//! A single-threaded product of strided matrices, for callers that parallelize themselves
//! (attention runs one head per thread and reads q, k, v in place from the packed qkv rows).

use gemm::Parallelism;

/// A read-only matrix view: element `(i, j)` is at `ptr + i*rs + j*cs` (in elements).
#[derive(Clone, Copy, Debug)]
pub struct Mat {
    /// First element.
    pub ptr: *const f32,
    /// Row stride.
    pub rs: isize,
    /// Column stride.
    pub cs: isize,
}

impl Mat {
    /// The transpose of the same memory.
    pub fn t(self) -> Mat {
        Mat { ptr: self.ptr, rs: self.cs, cs: self.rs }
    }
}

/// `dst = lhs · rhs` (`accumulate`: `dst += lhs · rhs`) for an `m × k` by `k × n` product;
/// `dst` is row-major with row stride `dst_rs`. f32 accumulation in the crate's order (which
/// depends on the shape only).
///
/// # Safety
/// Every view must cover its extent, and `dst` must not overlap the operands.
pub unsafe fn matmul_strided(m: usize, n: usize, k: usize, dst: *mut f32, dst_rs: isize, lhs: Mat, rhs: Mat, accumulate: bool) {
    super::count_crate_call();
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs,
        accumulate,
        lhs.ptr,
        lhs.cs,
        lhs.rs,
        rhs.ptr,
        rhs.cs,
        rhs.rs,
        1.0f32,
        1.0f32,
        false,
        false,
        false,
        Parallelism::None,
    )
}
