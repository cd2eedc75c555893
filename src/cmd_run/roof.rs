//! The limits behind the profile's `% roof` column for this run: `--peak-gbps` and
//! `--peak-tflops` where given, else the cache, else a measurement on the run's executor
//! ([`fusec_runtime::roofline::resolve`]). Cached limits are measured again when a product of
//! this run ran faster than [`STALE_PERCENT`] of the cached product rate (bandwidth is not
//! judged: a kernel whose data stays in cache may well beat the memory roof; nor are other
//! kernels: attention may use faster instructions than the run's products).

use fusec_ir::DType;
use fusec_runtime::executor::Executor;
use fusec_runtime::profile::Profile;
use fusec_runtime::roofline::{cache_file, resolve, Limits, Roof, STALE_PERCENT};

use super::args::RunArgs;

/// The roof of this run's products (bf16 with `--precision bf16`, else f32), or why there is
/// none (a measurement that failed: the column then stays empty and the run goes on).
pub fn roof(a: &RunArgs, ex: &mut dyn Executor, profile: &Profile) -> Result<Roof, String> {
    let operands = if a.precision.is_bf16() { DType::BF16 } else { DType::F32 };
    let key = ex.roof_key(operands).ok_or("this target has no roofline")?;
    let (gbps, tflops) = (a.peak_gbps.map(|g| g * 1e9), a.peak_tflops.map(|t| t * 1e12));
    let rows = profile.rows();
    let stale = |lim: &Limits| {
        let product = |name: &str| (name.starts_with("matmul") || name.starts_with("gemm")) && !name.contains("attn");
        rows.iter()
            .filter(|(name, st)| product(name) && !st.total.is_zero())
            .any(|(_, st)| st.flops as f64 / st.total.as_secs_f64() > STALE_PERCENT / 100.0 * lim.flops_per_s)
    };
    resolve(&key, gbps, tflops, cache_file(), stale, || ex.measure_limits(operands))
}
