//! CPU code generation: fused kernels → Cranelift IR → machine code, and GEMM calls.
//!
//! # Fused kernels
//!
//! [`KernelCompiler::compile`] turns a `kernel` node's body (as `fuse-elementwise` builds it:
//! pointwise, reduction with prologue/epilogue, one row composite with prologue/epilogue, or the
//! multi-tensor AdamW update) into native code through three steps:
//!
//! 1. [`fusec_passes::lower_rows`] (the backend-neutral step this crate consumes, shared with
//!    the CUDA backend): the body becomes one or more *row programs* ([`fusec_ir::rows`]): the
//!    kernel's domain viewed as `[R, C]`, values classified as per-element, per-row, per-column
//!    or kernel-wide, scheduled into passes over each row (a value that depends on a row
//!    reduction is computed in a later pass; earlier element values are recomputed, except
//!    `exp`/`log`/`tanh` results, which are stashed in a per-chunk row buffer), with column
//!    reductions as per-chunk partials. The row sum of a one-hot selection (the target logit of
//!    cross-entropy) becomes a pick of one column.
//! 2. [`clif`] (+ `plan`, `ops`, `math`): each program becomes a Cranelift function over a chunk
//!    of rows (unrolled f32x4 column loops with independent reduction accumulators, a scalar tail)
//!    and, when it has column results, a finalize function; `exp`/`log`/`tanh` are inline
//!    polynomial routines (≤ 1.4 ulp measured). At the `avx512` and `avx2` instruction-set
//!    levels ([`isa`]), element `exp`/`tanh` of rows of at least 64 columns and the row max of
//!    an f32 or bf16 operand row run in native 16- or 8-lane routines (`vmath`) called once per
//!    row, which also return the row sum and prefetch the next row; they give the same bits as
//!    the generated loops (but for the sign of a zero row max). bf16-derived element values
//!    that later passes would recompute are kept in row buffers instead (`stash`).
//! 3. `jit`: compilation for the host CPU (limited to the instruction-set level), with a kernel cache (identical bodies compile once)
//!    and a function cache (equal segments of different kernels share code); `run`
//!    ([`CompiledKernel::run`]) invokes it over rayon, allocating nothing per call.
//!
//! A body outside this model (an op other than the elementwise, reduction, composite and AdamW
//! ops, a reduction over middle axes, a strided column access, f16) is an `Err` naming it.
//!
//! Numerics follow the interpreter: one f32 rounding per IR op (no FMA contraction), bf16
//! rounded to nearest even at every bf16 result, NaN-propagating max/min, deterministic
//! reduction orders independent of the thread count.

pub mod clif;
pub mod convert;
pub mod gemm;
pub mod isa;
mod jit;
mod math;
mod narrow;
mod ops;
mod plan;
mod run;
mod stash;
pub mod thread_spans;
mod vmath;

pub use jit::KernelCompiler;
pub use run::{pool as thread_pool, CompiledKernel};
