//! Cranelift code generation for fused kernels (issue 5). Will own: fused kernel -> Cranelift IR -> machine code, and GEMM calls.

pub mod gemm;
