//! The limits behind the profile's `% roof` column for this run: `--peak-gbps` and
//! `--peak-tflops` where given, else the cache, else a measurement on the run's executor
//! ([`fusec_runtime::roofline::resolve`]).

use fusec_ir::DType;
use fusec_runtime::executor::Executor;
use fusec_runtime::roofline::{cache_file, resolve, Roof};

use super::args::RunArgs;

/// The roof of this run's products (bf16 with `--precision bf16`, else f32), or why there is
/// none (a measurement that failed: the column then stays empty and the run goes on).
pub fn roof(a: &RunArgs, ex: &mut dyn Executor) -> Result<Roof, String> {
    let operands = if a.precision.is_bf16() { DType::BF16 } else { DType::F32 };
    let key = ex.roof_key(operands).ok_or("this target has no roofline")?;
    let (gbps, tflops) = (a.peak_gbps.map(|g| g * 1e9), a.peak_tflops.map(|t| t * 1e12));
    resolve(&key, gbps, tflops, cache_file(), || ex.measure_limits(operands))
}
