//! What the CUDA target is asked to build ([`CudaOptions`]) and what the build reports for the
//! run summary ([`CudaBuild`]).

use std::time::Duration;

use fusec_codegen_cuda::flash::{self, Family};
use fusec_ir::DType;
use fusec_passes::memplan::MemPlan;

/// Kernel compilation counts of a build.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelStats {
    /// Fused-kernel launches built (every `kernel` node of every program).
    pub kernels: usize,
    /// Distinct CUDA modules (identical kernels share one), the hand-written module included.
    pub modules: usize,
    /// Modules NVRTC compiled for this run.
    pub compiled: usize,
    /// Of those, the modules compiled in worker processes.
    pub in_workers: usize,
    /// Modules read from the on-disk cache.
    pub disk_hits: usize,
}

/// How to build the programs for the GPU.
#[derive(Clone, Copy, Debug)]
pub struct CudaOptions {
    /// Time every launch with CUDA events (`--profile`); [`super::CudaExecutor::profile`] may
    /// then be replaced by a profile that times one traced step only.
    pub profile: bool,
    /// Products on TF32 tensor cores (about 1e-3 relative); otherwise plain fp32 (`--no-tf32`).
    pub tf32: bool,
    /// Attention with the flash kernels where they apply (TF32 allowed, sm_80 or newer, head
    /// size a multiple of 8 up to 64); otherwise score matrices, cuBLAS and softmax kernels.
    /// Attention on bf16 storage always runs on the flash kernels (it has no other path), off
    /// or on and with or without TF32.
    pub flash: bool,
    /// Bias and bias + GELU epilogues inside cuBLASLt products (f32 operands on TF32, or bf16
    /// operands; only with TF32 on, which opens cuBLASLt); otherwise a cuBLAS product and an
    /// epilogue kernel.
    pub lt_epilogues: bool,
    /// Capture each program into a CUDA graph on its first run and replay it; otherwise launch
    /// one by one (`--no-cuda-graph`).
    pub graphs: bool,
    /// Time each bf16 product's cuBLAS and cuBLASLt algorithms at build time and run the
    /// fastest (`tune.rs`; cached on disk); otherwise the libraries' heuristic choices
    /// (`--no-gemm-tuning`). Needs cuBLASLt (`lt_epilogues`).
    pub tune_products: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions { profile: false, tf32: true, flash: true, lt_epilogues: true, graphs: true, tune_products: true }
    }
}

/// What building the programs for the GPU produced, for the run summary.
pub struct CudaBuild {
    /// The whole build: asking NVML, the wait for the device, memory planning, code
    /// generation, NVRTC (or the cache), module loading, the launch lists and the allocation.
    pub compile_time: Duration,
    /// Opening the driver and context, and cuBLAS (with cuBLASLt's warm-up beside it): on a
    /// background thread from the process start ([`super::start_driver`]), else inside the
    /// `waited for both` phase.
    pub opened: [(&'static str, Duration); 2],
    /// Where `compile_time` went, one phase after the other, in order: `NVML`, then with an
    /// architecture from NVML `memplan`, `codegen`, `nvrtc`, `waited for both` (the driver and
    /// cuBLAS; NVRTC ran while they opened), without one `waited for both` first; then
    /// `module load`, `launch lists`, `cuBLASLt plans` (made among the launch lists), `product
    /// tuning` (when products are tuned) and `alloc` (`nvrtc again` before them where NVML and
    /// the driver disagreed).
    pub phases: Vec<(&'static str, Duration)>,
    /// Where the architecture came from, e.g. `arch sm_90 from NVML, before the driver was up`.
    pub arch: String,
    /// Each module from NVRTC or the disk cache: name, cache hit, time; slowest first.
    pub modules: Vec<(String, bool, Duration)>,
    /// Kernel compilation counts.
    pub kernels: KernelStats,
    /// The GPU, e.g. `NVIDIA H100 80GB HBM3 (sm_90)`.
    pub device: String,
    /// NVRTC's version.
    pub nvrtc: (i32, i32),
    /// Bytes of the one device allocation (everything, the cuBLAS workspace included).
    pub device_bytes: u64,
    /// Bytes of it that are scratch shared by the launches.
    pub scratch_bytes: u64,
    /// The Step program's plan (for the summary).
    pub step_plan: MemPlan,
    /// How attention runs, e.g. `flash (TF32 tensor cores, head size 64)`.
    pub attention: String,
    /// Products whose bias (and GELU) runs inside a cuBLASLt call.
    pub lt_epilogues: usize,
    /// Column sums of `dqkv` (the qkv bias gradient) folded into the attention backward, over
    /// every program (`cuda/attention.rs`).
    pub column_sums: usize,
    /// What tuning the products did (`tune.rs`).
    pub tuning: super::Tuning,
}

/// How attention runs, for [`CudaBuild::attention`]: `kinds` are the (head size, storage)
/// pairs of the run's attention launches, `flash` those that have flash modules.
pub(crate) fn attention_summary(kinds: &[(usize, DType)], flash: &[(usize, DType)]) -> String {
    // Head sizes of one storage type served by one family of kernels.
    let sizes = |dt: DType, fam: Family| {
        let of = flash.iter().filter(|k| k.1 == dt && flash::family(k.0, dt) == Some(fam));
        of.map(|k| k.0.to_string()).collect::<Vec<_>>().join(", ")
    };
    let f32_sizes = sizes(DType::F32, Family::Tf32);
    let f32_part = if f32_sizes.is_empty() {
        "score matrices: cuBLAS products and softmax kernels".to_string()
    } else {
        format!("flash (TF32 tensor cores, head size {f32_sizes})")
    };
    let bf16_parts: Vec<String> = [Family::Bf16, Family::Tf32]
        .into_iter()
        .filter_map(|fam| Some((fam, sizes(DType::BF16, fam))).filter(|(_, s)| !s.is_empty()))
        .map(|(fam, s)| format!("{}, head size {s}", fam.describe()))
        .collect();
    if bf16_parts.is_empty() {
        return f32_part;
    }
    let bf16_part = format!("flash on bf16 storage ({})", bf16_parts.join("; "));
    if kinds.iter().any(|k| k.1 == DType::F32) {
        format!("{f32_part}; {bf16_part}")
    } else {
        bf16_part
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_attention_summary_names_the_path_of_each_storage() {
        let (f, b) = (DType::F32, DType::BF16);
        assert_eq!(attention_summary(&[], &[]), "score matrices: cuBLAS products and softmax kernels");
        assert_eq!(attention_summary(&[(64, f)], &[(64, f)]), "flash (TF32 tensor cores, head size 64)");
        assert_eq!(
            attention_summary(&[(32, b), (64, b)], &[(32, b), (64, b)]),
            "flash on bf16 storage (bf16 tensor cores, head size 32, 64)"
        );
        assert_eq!(
            attention_summary(&[(48, b), (64, b)], &[(48, b), (64, b)]),
            "flash on bf16 storage (bf16 tensor cores, head size 64; TF32 tensor cores, head size 48)"
        );
        assert_eq!(
            attention_summary(&[(64, f), (64, b)], &[(64, b)]),
            "score matrices: cuBLAS products and softmax kernels; flash on bf16 storage (bf16 tensor cores, head size 64)"
        );
    }
}
