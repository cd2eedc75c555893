//! The arguments of `fusec run` and every check that can be made on them before the graph is
//! compiled: ranges (in the parsers, so `--help` and the error name them), finiteness, flags that
//! only one target reads, and output paths that must be writable. Checks that need the model
//! (the sequence length, the checkpoint's header, the validation data's size) are in `mod.rs`.

use std::path::{Path, PathBuf};

use clap::builder::TypedValueParser;
use clap::{Args, ValueEnum};
use fusec_passes::amp::Precision;

use crate::cmd_dump::{precision_parser, recompute_parser};
use fusec_passes::recompute::Recompute;
use fusec_runtime::cuda::CudaOptions;

/// Where the graph runs.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum Target {
    /// The reference interpreter on the unfused programs (slow, obviously correct: the oracle).
    Ref,
    /// Cranelift-compiled fused kernels and GEMMs on this CPU (AVX-512, AVX2 or scalar paths, chosen at start-up).
    Cpu,
    /// NVRTC-compiled fused kernels and cuBLAS on an NVIDIA GPU, replayed as a CUDA graph.
    Cuda,
}

/// Arguments of `fusec run`.
#[derive(Args)]
pub struct RunArgs {
    /// The `.graph` file (forward + loss, e.g. from `fusec export`).
    pub file: PathBuf,
    /// Where to run it.
    #[arg(long, value_enum, default_value = "cpu")]
    pub target: Target,
    /// Initial parameters: an llm.c checkpoint file, or `random` (GPT-2 initialization).
    #[arg(long, default_value = "random")]
    pub init: String,
    /// Seed for `--init random` and sampling.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Training tokens (llm.c token file); default: the embedded generated corpus.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Validation tokens (llm.c token file).
    #[arg(long)]
    pub val: Option<PathBuf>,
    /// Compute the validation loss before every N-th step and after the last one (1..=2^32-1;
    /// needs --val, or the embedded corpus).
    #[arg(long, default_value_t = 10, value_parser = in_range(1, u32::MAX as u64))]
    pub val_every: usize,
    /// Validation batches per evaluation, at most the batches the validation data holds
    /// (default: 4, or all of them when it holds fewer).
    #[arg(long, value_parser = in_range(1, 1 << 20))]
    pub val_batches: Option<usize>,
    /// Batch size B.
    #[arg(long, default_value_t = 4, value_parser = in_range(1, 1 << 16))]
    pub batch: usize,
    /// Sequence length T (at most the model's maximum sequence length).
    #[arg(long, default_value_t = 64, value_parser = in_range(1, 1 << 20))]
    pub seq: usize,
    /// Training steps of the whole run (with --resume, counting the steps before it; the
    /// learning-rate decay spans them); 0 evaluates the loss of the first batch.
    #[arg(long, default_value_t = 50)]
    pub steps: usize,
    /// Learning rate (finite, at least 0): the peak of the schedule.
    #[arg(long, default_value_t = 1e-3, allow_negative_numbers = true)]
    pub lr: f32,
    /// Linear warmup: step s (0-based) of the first N gets lr·(s+1)/N (0..=2^31; may exceed
    /// --steps).
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = in_range(0, 1 << 31), allow_negative_numbers = true)]
    pub warmup_steps: usize,
    /// After the warmup, cosine-decay the learning rate to this fraction of --lr at --steps
    /// (llm.c's and nanoGPT's schedule; 0..=1; 1: constant).
    #[arg(long, value_name = "FRACTION", default_value_t = 1.0, allow_negative_numbers = true)]
    pub lr_decay_to: f32,
    /// AdamW weight decay (finite, at least 0).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub weight_decay: f64,
    /// Micro-steps accumulated per optimizer step.
    #[arg(long, default_value_t = 1, value_parser = in_range(1, 4096))]
    pub grad_accum: usize,
    /// Clip the global gradient norm to this value (finite, above 0).
    #[arg(long, allow_negative_numbers = true)]
    pub grad_clip: Option<f32>,
    /// Stop when a step's loss exceeds this many times the first step's loss (above 1).
    #[arg(long, default_value_t = 10.0, allow_negative_numbers = true)]
    pub divergence_factor: f64,
    /// Do not stop on an exploding loss (a NaN or infinite loss or gradient norm still stops).
    #[arg(long)]
    pub no_divergence_check: bool,
    /// Mixed precision: `bf16` stores activations and runs products in bf16 (fp32 master weights,
    /// statistics, softmax, loss and residual stream); `bf16+residual` also keeps the residual
    /// stream in bf16 (llm.c). `fusec dump --pass amp` prints the policy. Every target: on the CPU,
    /// products use AVX512-BF16 dot products where the host has them, else widened operands.
    #[arg(long, default_value = "fp32", value_parser = precision_parser())]
    pub precision: Precision,
    /// What the backward recomputes instead of storing: `none`, `gelu` (GELU outputs: less
    /// memory, one more elementwise kernel per layer) or `gelu+layernorm` (also LayerNorm outputs).
    /// Default: `none` in fp32, `gelu` in bf16 (chosen by measurement, see the README).
    #[arg(long, value_parser = recompute_parser())]
    pub recompute: Option<Recompute>,
    /// Exact fp32 matmuls on CUDA (default: TF32 tensor cores, as PyTorch allows).
    #[arg(long)]
    pub no_tf32: bool,
    /// Attention on CUDA through score matrices, cuBLAS and softmax kernels instead of the
    /// flash kernels (which need TF32 and sm_80+).
    #[arg(long)]
    pub no_flash_attention: bool,
    /// On CUDA, run bias and GELU epilogues as a kernel after each cuBLAS product instead of
    /// inside cuBLASLt calls.
    #[arg(long)]
    pub no_cublaslt: bool,
    /// Launch kernels one by one instead of replaying the step as a CUDA graph.
    #[arg(long)]
    pub no_cuda_graph: bool,
    /// On CUDA, run each bf16 product on cuBLAS's heuristic choice instead of timing the
    /// algorithms cuBLAS and cuBLASLt offer at build time and keeping the fastest (choices
    /// are cached in `gemm_tuning.txt` in the kernel cache's folder).
    #[arg(long)]
    pub no_gemm_tuning: bool,
    /// CPU threads (default: all cores).
    #[arg(long, value_parser = in_range(1, 1024))]
    pub threads: Option<usize>,
    /// Time every launch and print a per-kernel table at the end (`cpu` and `cuda` targets):
    /// times, GB/s, GFLOP/s and `% roof`, the share of the device's limit at the kernel's
    /// FLOPs per byte (see --peak-gbps, --peak-tflops).
    #[arg(long)]
    pub profile: bool,
    /// Write the per-kernel profile as JSON (with `roof_pct`, the table's `% roof`).
    #[arg(long)]
    pub profile_json: Option<PathBuf>,
    /// The memory bandwidth, in GB/s, that the profile's `% roof` column compares kernels with
    /// (finite, above 0, at most 1e6; with --profile or --profile-json). Default: measured
    /// once per device (a large copy) and cached in the kernel cache's folder.
    #[arg(long, value_name = "GB/S", allow_negative_numbers = true)]
    pub peak_gbps: Option<f64>,
    /// The product rate, in TFLOP/s, that the `% roof` column compares kernels with: the rate
    /// of the run's products (bf16, TF32 or fp32 GEMMs) (finite, above 0, at most 1e6; with
    /// --profile or --profile-json). Default: measured once per device and product type (a
    /// large product through the target's GEMM path) and cached.
    #[arg(long, value_name = "TFLOP/S", allow_negative_numbers = true)]
    pub peak_tflops: Option<f64>,
    /// Write a timeline of one training step as a Chrome trace (JSON; open it in
    /// https://ui.perfetto.dev or chrome://tracing): the first step after the warm-up, i.e.
    /// the second step this run takes (needs --steps 2 or more), each launch with its start and
    /// duration (host clocks on the CPU, CUDA events on the GPU), bytes, FLOPs and fused IR
    /// ops, on a track of its own (the CUDA stream, or the CPU executor thread), with a track
    /// per CPU worker thread (where each spent each launch), a track of the collectives in a
    /// data-parallel run (rank 0 writes the file), and a track of the compile passes before
    /// it. Only that step is timed unless --profile: the other steps run as usual.
    #[arg(long, value_name = "FILE.json")]
    pub trace: Option<PathBuf>,
    /// Print each CUDA module's compile or disk-cache time (hits and misses) after the build.
    #[arg(long)]
    pub timings: bool,
    /// Generate this many tokens at the end (GPT-2 BPE text, or token ids for other vocabularies).
    #[arg(long, default_value_t = 0, value_parser = in_range(0, 1 << 16))]
    pub sample: usize,
    /// Sampling temperature (0: greedy; finite, at most 100).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Save after training (and every --save-every steps) to a folder, created if missing:
    /// `model.bin` (llm.c checkpoint) and `state.bin` (AdamW moments, step, schedule and data
    /// position) for --resume; or, to a path ending in `.bin`, the llm.c checkpoint alone.
    /// Written to a temporary file and renamed: never torn.
    #[arg(long, value_name = "DIR|FILE.bin")]
    pub save: Option<PathBuf>,
    /// Also save every N steps (1..=2^31; needs --save).
    #[arg(long, value_name = "N", value_parser = in_range(1, 1 << 31), allow_negative_numbers = true)]
    pub save_every: Option<usize>,
    /// Continue the run saved in this folder (by --save DIR) from its step up to --steps in
    /// all, with the losses of one uninterrupted run. The graph's model, --precision, --batch,
    /// --seq and --grad-accum must be the saved run's.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Write one JSON object per step (step, loss, lr, ms, val_loss).
    #[arg(long)]
    pub log_json: Option<PathBuf>,
    /// Data parallelism on this host: start N ranks (1..=64), one process each (one GPU each on
    /// --target cuda), every one training on its --batch rows of a global batch of N·B with
    /// gradients averaged across ranks (NCCL on the GPU). Launched by `torchrun` instead (its
    /// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set), a process is one rank and
    /// this flag, if given, must equal WORLD_SIZE.
    #[arg(long, visible_alias = "gpus", value_name = "N", value_parser = in_range(1, 64))]
    pub ranks: Option<usize>,
    /// On CUDA, run each bucket's all-reduce on the step's stream, in line with the backward,
    /// instead of on a second stream beside it.
    #[arg(long)]
    pub no_comm_overlap: bool,
    /// ZeRO stage (llm.c's `-z`): 0 keeps the whole AdamW state on every rank; 1 shards it by
    /// parameters (each rank keeps the moments of, and updates, the parameters it owns, then
    /// every rank takes every parameter from its owner). Needs a data-parallel run.
    #[arg(long, default_value_t = 0, value_parser = in_range(0, 1))]
    pub zero: usize,
    /// How long a rank waits for the others, in seconds, at start-up and in each collective of
    /// the CPU target, before it stops with an error naming the missing rank; also how long any
    /// rank may go without finishing a step (or a save) before its watchdog stops it
    /// (1..=86400).
    #[arg(long, value_name = "SECONDS", default_value_t = 300, value_parser = in_range(1, 86400))]
    pub rank_timeout: usize,
}

/// An integer flag parser that accepts `lo..=hi` and says so otherwise.
fn in_range(lo: u64, hi: u64) -> impl TypedValueParser<Value = usize> {
    clap::builder::RangedU64ValueParser::<u64>::new().range(lo..=hi).map(|v| v as usize)
}

impl RunArgs {
    /// The CUDA options the flags ask for (`profile`: time every launch).
    pub fn cuda_options(&self, profile: bool) -> CudaOptions {
        CudaOptions {
            profile,
            tf32: !self.no_tf32,
            flash: !self.no_flash_attention,
            lt_epilogues: !self.no_cublaslt,
            graphs: !self.no_cuda_graph,
            tune_products: !self.no_gemm_tuning,
        }
    }

    /// Checks the flags that need no model: finite hyper-parameters in range, flags that the
    /// target reads, and writable output paths. Errors name the flag and the allowed range.
    pub fn validate(&self) -> Result<(), String> {
        let finite = |name: &str, v: f64, lo: f64, hi: f64, open: bool| -> Result<(), String> {
            let ok = v.is_finite() && v <= hi && if open { v > lo } else { v >= lo };
            let range = if open { format!("above {lo}") } else { format!("at least {lo}") };
            let hi = if hi.is_finite() { format!(" and at most {hi}") } else { String::new() };
            if ok {
                Ok(())
            } else {
                Err(format!("{name} {v} is out of range: it must be finite, {range}{hi}"))
            }
        };
        finite("--lr", self.lr as f64, 0.0, f64::INFINITY, false)?;
        finite("--weight-decay", self.weight_decay, 0.0, f64::INFINITY, false)?;
        if let Some(c) = self.grad_clip {
            finite("--grad-clip", c as f64, 0.0, f64::INFINITY, true)?;
        }
        finite("--temperature", self.temperature as f64, 0.0, 100.0, false)?;
        finite("--lr-decay-to", self.lr_decay_to as f64, 0.0, 1.0, false)?;
        finite("--divergence-factor", self.divergence_factor, 1.0, f64::INFINITY, true)?;
        if self.ranks.is_some() && self.target == Target::Ref {
            return Err("--ranks needs --target cpu or --target cuda (the reference interpreter is one process)".into());
        }
        if self.val.is_some() && self.data.is_none() {
            return Err("--val needs --data (the embedded corpus brings its own validation split)".into());
        }
        let cuda_only = [
            ("--no-tf32", self.no_tf32),
            ("--no-flash-attention", self.no_flash_attention),
            ("--no-cublaslt", self.no_cublaslt),
            ("--no-cuda-graph", self.no_cuda_graph),
            ("--no-gemm-tuning", self.no_gemm_tuning),
            ("--no-comm-overlap", self.no_comm_overlap),
            ("--timings", self.timings),
        ];
        if let Some((flag, _)) = cuda_only.iter().find(|(_, on)| *on).filter(|_| self.target != Target::Cuda) {
            return Err(format!("{flag} applies to --target cuda only (this run is --target {})", self.target_name()));
        }
        let profiles = [("--profile", self.profile), ("--profile-json", self.profile_json.is_some()), ("--trace", self.trace.is_some())];
        if let Some((flag, _)) = profiles.iter().find(|(_, on)| *on).filter(|_| self.target == Target::Ref) {
            return Err(format!("{flag} times compiled kernels: use --target cpu or --target cuda"));
        }
        for (flag, v) in [("--peak-gbps", self.peak_gbps), ("--peak-tflops", self.peak_tflops)] {
            if let Some(v) = v {
                finite(flag, v, 0.0, 1e6, true)?;
                if !profiles[..2].iter().any(|(_, on)| *on) {
                    return Err(format!("{flag} sets a limit of the profile's roofline: it needs --profile or --profile-json"));
                }
            }
        }
        if self.trace.is_some() && self.steps < 2 {
            return Err(format!(
                "--trace records the first step after the warm-up (the second step): it needs --steps 2 or more (this run has {})",
                self.steps
            ));
        }
        if self.save_every.is_some() && self.save.is_none() {
            return Err("--save-every needs --save DIR (where to save)".into());
        }
        if self.resume.is_some() && self.init != "random" {
            return Err("--resume restores the parameters from its folder: leave out --init".into());
        }
        if let Some(dir) = self.save.as_ref().filter(|p| !saves_model_only(p)) {
            save_dir_writable(dir)?;
        }
        let save_file = self.save.as_ref().filter(|p| saves_model_only(p)).cloned();
        let outputs =
            [("--save", &save_file), ("--profile-json", &self.profile_json), ("--log-json", &self.log_json), ("--trace", &self.trace)];
        for (flag, path) in outputs {
            if let Some(p) = path {
                writable(flag, p)?;
            }
        }
        for (flag, path) in [("--data", &self.data), ("--val", &self.val)] {
            if let Some(p) = path.as_ref().filter(|p| !p.is_file()) {
                return Err(format!("{flag} {}: no such file", p.display()));
            }
        }
        Ok(())
    }

    /// The target's name as on the command line.
    pub fn target_name(&self) -> &'static str {
        match self.target {
            Target::Ref => "ref",
            Target::Cpu => "cpu",
            Target::Cuda => "cuda",
        }
    }
}

/// Whether `--save PATH` writes the llm.c checkpoint alone (a path ending in `.bin`) rather than
/// a checkpoint folder.
pub fn saves_model_only(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "bin")
}

/// Checks that `--save DIR` can be a checkpoint folder: an existing folder that takes new files,
/// or a new one whose parent exists.
fn save_dir_writable(dir: &Path) -> Result<(), String> {
    if dir.is_dir() {
        return writable("--save", &dir.join(fusec_runtime::savedir::STATE_FILE));
    }
    if dir.exists() {
        return Err(format!("--save {}: is a file, not a folder (a path ending in .bin saves the llm.c checkpoint alone)", dir.display()));
    }
    writable("--save", dir)
}

/// Checks that a file can be written at `path` (its folder exists and takes a new file) without
/// touching `path` itself: an existing file there is only replaced when the run writes it.
fn writable(flag: &str, path: &Path) -> Result<(), String> {
    if path.is_dir() {
        return Err(format!("{flag} {}: is a directory, not a file", path.display()));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(format!("{flag} {}: the folder {} does not exist", path.display(), dir.display()));
    }
    let probe = dir.join(format!(".fusec-write-test-{}", std::process::id()));
    match std::fs::File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(format!("{flag} {}: cannot write in {}: {e}", path.display(), dir.display())),
    }
}
