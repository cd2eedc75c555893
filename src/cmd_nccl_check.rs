//! `fusec nccl-check`: whether NCCL works across this host's GPUs (every visible GPU one rank),
//! with a checked and timed all-reduce.

use clap::Args;

use crate::CliResult;

/// Arguments of `fusec nccl-check`.
#[derive(Args)]
pub struct NcclCheckArgs {
    /// Mebibytes of f32 each rank all-reduces (1 to 4096).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=4096))]
    mib: u64,
    /// Timed all-reduces after the checked one (1 to 1000).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=1000))]
    iters: u64,
}

/// Runs `fusec nccl-check`.
pub fn nccl_check(a: NcclCheckArgs) -> CliResult {
    let elements = (a.mib << 20) as usize / 4;
    let r = fusec_runtime::dist::nccl::all_reduce_check(elements, a.iters as usize)?;
    let v = r.version;
    outln!(
        "NCCL {}.{}.{}: {} rank(s), one per GPU; all-reduce of {} MiB a rank correct on every rank; {:.3} ms (median of {}), bus {:.1} GB/s",
        v / 10000,
        v / 100 % 100,
        v % 100,
        r.ranks,
        a.mib,
        r.ms,
        a.iters,
        r.bus_gbps
    )?;
    Ok(())
}
