//! Products on the CPU: f32 operands through `gemm_f32`, bf16 operands through `gemm_bf16` on
//! the executor's instruction-set level (AVX512-BF16 dot products or widened operands), into
//! an f32 or a bf16 result.

use fusec_codegen_cpu::gemm::{gemm_bf16_on, gemm_f32, Bf16Out};
use fusec_codegen_cpu::isa::Isa;
use fusec_ir::DType;
use half::bf16;

use crate::launches::Product;

/// Whether the CPU target runs a product of these storage types: f32 × f32 → f32, and bf16 ×
/// bf16 → f32 or bf16 (checked once, when the launch list is built).
pub fn check(p: &Product) -> Result<(), String> {
    match (p.operands, p.out) {
        (DType::F32, DType::F32) | (DType::BF16, DType::F32 | DType::BF16) => Ok(()),
        (a, y) => Err(format!("a product of {a} operands with a {y} result is not supported by the CPU target")),
    }
}

/// `n` elements of type `T` at byte offset `off` of the allocation at `base`.
///
/// # Safety
/// The range must lie inside the allocation and hold `T`s.
unsafe fn at<'a, T>(base: *mut u8, off: u64, n: usize) -> &'a mut [T] {
    std::slice::from_raw_parts_mut(base.add(off as usize) as *mut T, n)
}

/// `y`, holding the accumulator's values first when it accumulates into another buffer.
///
/// # Safety
/// As [`at`], for `y` and the accumulator.
unsafe fn result<'a, T: Copy>(base: *mut u8, p: &Product) -> &'a mut [T] {
    let n = p.spec.y_len();
    let y = at::<T>(base, p.y, n);
    if let Some(acc) = p.acc.filter(|acc| *acc != p.y) {
        y.copy_from_slice(at::<T>(base, acc, n));
    }
    y
}

/// Runs product `p` (which [`check`] accepted) in the allocation at `base`.
///
/// # Safety
/// The product's offsets must lie inside the allocation, typed as the product says.
pub unsafe fn run(base: *mut u8, p: &Product, isa: Isa, threads: usize) {
    let s = &p.spec;
    if p.operands == DType::F32 {
        let bias = p.bias.map(|o| &*at::<f32>(base, o, s.n));
        let pre = p.pre.map(|o| at::<f32>(base, o, s.y_len()));
        let y = result::<f32>(base, p);
        gemm_f32(s, at(base, p.a, s.a_len()), at(base, p.b, s.b_len()), bias, y, pre, threads);
        return;
    }
    let bias = p.bias.map(|o| &*at::<bf16>(base, o, s.n));
    let pre = p.pre.map(|o| at::<bf16>(base, o, s.y_len()));
    let y = if p.out == DType::F32 { Bf16Out::F32(result(base, p)) } else { Bf16Out::Bf16(result(base, p)) };
    gemm_bf16_on(isa, s, at(base, p.a, s.a_len()), at(base, p.b, s.b_len()), bias, y, pre, threads);
}
