//! NCCL on this host's GPUs: one communicator per GPU in this process (`ncclCommInitAll`), an
//! in-place sum all-reduce checked element by element and timed. It is what `fusec nccl-check`
//! runs, and the first piece of data parallelism that talks to a device: libnccl is opened at
//! first use (cudarc's dynamic loading), so a host without it gets an error, never a panic.

use std::time::Instant;

use cudarc::driver::CudaContext;
use cudarc::nccl::{group_end, group_start, Comm, ReduceOp};

/// What [`all_reduce_check`] found.
#[derive(Clone, Debug)]
pub struct CheckReport {
    /// GPUs taking part (one rank each).
    pub ranks: usize,
    /// NCCL's version, e.g. 22805 for 2.28.5.
    pub version: i32,
    /// Elements per rank of the timed all-reduce (f32).
    pub elements: usize,
    /// Median milliseconds of the timed all-reduces.
    pub ms: f64,
    /// Bus bandwidth in GB/s (`2 (n - 1) / n` of the bytes per rank, per second, as
    /// nccl-tests reports it).
    pub bus_gbps: f64,
}

/// Runs an in-place sum all-reduce over `elements` f32 per rank across every visible GPU
/// (`rank r` holds `r + 1 + i mod 7` at element `i`), checks every element of every rank
/// against the exact sum, then times `iters` more and reports the median.
pub fn all_reduce_check(elements: usize, iters: usize) -> Result<CheckReport, String> {
    crate::cuda::check_libraries()?;
    // A panic of the dynamically loaded bindings (no libnccl, a missing symbol) becomes an error.
    crate::cuda::guard("NCCL (libnccl.so.2, loaded at run time: install NCCL or set LD_LIBRARY_PATH)", || run(elements, iters.max(1)))
}

fn run(elements: usize, iters: usize) -> Result<CheckReport, String> {
    let e = |what: &'static str| move |err: cudarc::nccl::result::NcclError| format!("NCCL {what}: {err:?}");
    let d = |what: &'static str| move |err: cudarc::driver::DriverError| format!("CUDA {what}: {err:?}");
    let version = cudarc::nccl::result::get_nccl_version().map_err(e("version"))?;
    let n = CudaContext::device_count().map_err(d("device count"))? as usize;
    if n == 0 {
        return Err("no CUDA GPU visible".into());
    }
    let streams = (0..n).map(|i| CudaContext::new(i).map(|c| c.default_stream())).collect::<Result<Vec<_>, _>>().map_err(d("context"))?;
    let comms = Comm::from_devices(streams.clone()).map_err(e("communicators"))?;
    let value = |r: usize, i: usize| (r + 1 + i % 7) as f32;
    let mut bufs = Vec::with_capacity(n);
    for (r, s) in streams.iter().enumerate() {
        let host: Vec<f32> = (0..elements).map(|i| value(r, i)).collect();
        bufs.push(s.clone_htod(&host).map_err(d("upload"))?);
    }
    let all_reduce = |bufs: &mut Vec<cudarc::driver::CudaSlice<f32>>| -> Result<(), String> {
        group_start().map_err(e("group"))?;
        for (c, b) in comms.iter().zip(bufs.iter_mut()) {
            c.all_reduce_in_place(b, &ReduceOp::Sum).map_err(e("all-reduce"))?;
        }
        group_end().map_err(e("group"))?;
        for s in &streams {
            s.synchronize().map_err(d("synchronize"))?;
        }
        Ok(())
    };
    all_reduce(&mut bufs)?;
    for (r, (s, b)) in streams.iter().zip(&bufs).enumerate() {
        let got = s.clone_dtoh(b).map_err(d("download"))?;
        if let Some(i) = (0..elements).find(|&i| got[i] != (0..n).map(|q| value(q, i)).sum::<f32>()) {
            let want: f32 = (0..n).map(|q| value(q, i)).sum();
            return Err(format!("all-reduce wrong on rank {r}, element {i}: {} instead of {want}", got[i]));
        }
    }
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        all_reduce(&mut bufs)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let ms = times[times.len() / 2];
    let bytes = (elements * 4) as f64;
    let bus_gbps = if n > 1 { bytes * 2.0 * (n - 1) as f64 / n as f64 / (ms * 1e-3) / 1e9 } else { 0.0 };
    Ok(CheckReport { ranks: n, version, elements, ms, bus_gbps })
}

/// This process's rank of a data-parallel run on NCCL: one communicator over every rank's GPU,
/// made from the unique id rank 0 serves over the rendezvous.
pub struct NcclRank {
    comm: cudarc::nccl::sys::ncclComm_t,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
}

impl NcclRank {
    /// Joins the run of `env` (the calling thread's CUDA context is the rank's GPU): rank 0
    /// draws the unique id, every rank gets it through the rendezvous (`timeout` bounds the
    /// wait), then all make the communicator together.
    pub fn join(env: &super::launch_env::LaunchEnv, timeout: std::time::Duration) -> Result<NcclRank, String> {
        crate::cuda::guard("NCCL (libnccl.so.2, loaded at run time: install NCCL or set LD_LIBRARY_PATH)", || {
            let e = |what: &'static str| move |err: cudarc::nccl::result::NcclError| format!("NCCL {what}: {err:?}");
            let id = if env.rank == 0 { Some(cudarc::nccl::result::get_uniqueid().map_err(e("unique id"))?) } else { None };
            let blob = super::rendezvous::rendezvous(env, || id.map_or([0; 128], |id| id.internal.map(|c| c as u8)), timeout)?;
            let id = cudarc::nccl::sys::ncclUniqueId { internal: blob.map(|b| b as std::ffi::c_char) };
            let (rank, world) = (env.rank, env.world_size);
            let mut comm = std::mem::MaybeUninit::uninit();
            // SAFETY: every rank passes the same id and world size, and its own rank.
            let comm = unsafe {
                cudarc::nccl::result::comm_init_rank(comm.as_mut_ptr(), world as i32, id, rank as i32).map_err(e("communicator"))?;
                comm.assume_init()
            };
            Ok(NcclRank { comm, rank, world })
        })
    }

    /// Enqueues on `stream` one NCCL group: for each part `(src, dst, n, dtype, owner)`, the
    /// mean over the ranks of the `n` values (f32 or bf16) at device address `src` into `dst`
    /// (`owner` `None`; the same address: in place), or a broadcast of rank `owner`'s values.
    /// NCCL runs a group's collectives as one launch.
    ///
    /// # Safety
    /// Every range must be device memory of this rank's GPU, `n` values of `dtype` long.
    pub unsafe fn collective(
        &self,
        parts: impl Iterator<Item = (u64, u64, usize, fusec_ir::DType, Option<usize>)>,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), String> {
        use cudarc::nccl::result as nccl;
        use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t};
        let e = |what: &'static str| move |err: nccl::NcclError| format!("NCCL {what}: {err:?}");
        nccl::group_start().map_err(e("group"))?;
        let mut result = Ok(());
        for (src, dst, n, dtype, root) in parts {
            let ty = match dtype {
                fusec_ir::DType::F32 => ncclDataType_t::ncclFloat32,
                fusec_ir::DType::BF16 => ncclDataType_t::ncclBfloat16,
                d => {
                    result = Err(format!("collectives over {d} values are not supported on the GPU (f32 and bf16 are)"));
                    break;
                }
            };
            let (s, d, st) = (src as *const _, dst as *mut _, stream as _);
            let r = match root {
                None => nccl::all_reduce(s, d, n, ty, ncclRedOp_t::ncclAvg, self.comm, st),
                Some(root) => nccl::broadcast(s, d, n, ty, root as i32, self.comm, st),
            };
            if let Err(err) = r {
                result = Err(format!("NCCL {} of {n} values: {err:?}", if root.is_some() { "broadcast" } else { "all-reduce" }));
                break;
            }
        }
        // The group is closed whatever happened inside it.
        nccl::group_end().map_err(e("group"))?;
        result
    }
}

impl Drop for NcclRank {
    fn drop(&mut self) {
        // SAFETY: made by `join`, destroyed once.
        let _ = unsafe { cudarc::nccl::result::comm_destroy(self.comm) };
    }
}
