//! The CPU's roofline limits ([`crate::roofline`]), measured in-process: the memory bandwidth
//! of a parallel copy of 128 MiB (larger than the last-level caches of common hosts), and the
//! rate of one 2048³ product through the executor's own product path ([`super::product::run`])
//! on its operand type, instruction-set level and thread count. Each is the best of a few runs
//! after a warm-up.

use std::time::Instant;

use fusec_codegen_cpu::isa::Isa;
use fusec_ir::{DType, GemmSpec};
use rayon::prelude::*;

use crate::launches::Product;
use crate::roofline::Limits;

/// Bytes copied by the bandwidth measurement (read once and written once per run).
const COPY_BYTES: usize = 128 << 20;
/// The product's m = n = k.
const GEMM_SIZE: usize = 2048;
/// Timed runs of each measurement (after one warm-up); the fastest counts.
const RUNS: usize = 5;

/// The fastest of [`RUNS`] runs of `f` after a warm-up, in seconds.
fn fastest(mut f: impl FnMut()) -> f64 {
    f();
    (0..RUNS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Bytes per second of a parallel copy (bytes read plus bytes written) on rayon's pool.
pub fn copy_bandwidth() -> f64 {
    let words = COPY_BYTES / 8;
    let src: Vec<u64> = (0..words as u64).into_par_iter().collect();
    let mut dst = vec![0u64; words];
    // Chunks of 1 MiB: every thread streams through its own pages.
    let chunk = (1 << 20) / 8;
    let secs = fastest(|| dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s)));
    std::hint::black_box(&dst);
    2.0 * COPY_BYTES as f64 / secs
}

/// FLOP per second of one product of `operands` (f32, or bf16 with a bf16 result as in the
/// forward) through the executor's product path at level `isa` on `threads` threads.
pub fn product_rate(operands: DType, isa: Isa, threads: usize) -> Result<f64, String> {
    let n = GEMM_SIZE;
    let (out, width) = match operands {
        DType::F32 => (DType::F32, 4),
        DType::BF16 => (DType::BF16, 2),
        d => return Err(format!("no CPU product of {d} operands")),
    };
    // y = a · bᵀ, as the model's projections (weights stored [out, in]).
    let mut spec = GemmSpec::new(n, n, n);
    spec.trans_b = true;
    let bytes = (n * n * width) as u64;
    let p = Product { spec, a: 0, b: bytes, bias: None, acc: None, y: 2 * bytes, pre: None, operands, out };
    super::product::check(&p)?;
    // Small values (bf16 1/64 or f32 1/64): no infinities, no denormals. u64 words keep the
    // buffer aligned for every element type.
    let fill: u64 = if width == 2 { 0x3c80_3c80_3c80_3c80 } else { 0x3c80_0000_3c80_0000 };
    let mut buf = vec![fill; (3 * bytes as usize).div_ceil(8)];
    let base = buf.as_mut_ptr() as *mut u8;
    // SAFETY: the product's three operands lie inside `buf`, typed as `p` says.
    let secs = fastest(|| unsafe { super::product::run(base, &p, isa, threads) });
    Ok(spec.flops() as f64 / secs)
}

/// Both limits for products of `operands`.
pub fn measure(operands: DType, isa: Isa, threads: usize) -> Result<Limits, String> {
    Ok(Limits { bytes_per_s: copy_bandwidth(), flops_per_s: product_rate(operands, isa, threads)? })
}

/// The host's CPU model (`/proc/cpuinfo`'s `model name`), or `unknown CPU`.
pub fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_string()))
        .unwrap_or_else(|| "unknown CPU".into())
}

#[cfg(test)]
mod tests {
    #[test]
    fn products_and_copies_have_a_positive_finite_rate() {
        let isa = fusec_codegen_cpu::isa::current();
        for dt in [fusec_ir::DType::F32, fusec_ir::DType::BF16] {
            let r = super::product_rate(dt, isa, 2).unwrap();
            assert!(r.is_finite() && r > 1e6, "{dt}: {r}");
        }
        let b = super::copy_bandwidth();
        assert!(b.is_finite() && b > 1e6, "{b}");
        assert!(!super::cpu_model().is_empty());
    }
}
