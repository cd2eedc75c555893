//! The GPUs' compute capability from NVML, which answers without a CUDA context: so the
//! kernels can be compiled for the right architecture while the driver is still starting
//! ([`super::CudaExecutor::new`]).
//!
//! `libnvidia-ml.so.1` (installed with the driver) is opened at run time and closed again:
//! `nvmlInit_v2`, then `nvmlDeviceGetCount_v2`, `nvmlDeviceGetHandleByIndex_v2` and
//! `nvmlDeviceGetCudaComputeCapability` for every GPU, then `nvmlShutdown`. NVML numbers the
//! GPUs its own way, and `CUDA_VISIBLE_DEVICES` (or a rank's choice) may make any of them
//! CUDA's device 0: so an answer counts only when every GPU of the host agrees. Anything else
//! (no library or symbol, an error code, no GPU, GPUs that differ) is no answer, never a
//! panic. `FUSEC_NVML=0` asks nothing (the driver decides, after it started).

use std::ffi::{c_int, c_uint, c_void};
use std::sync::Mutex;
use std::thread::JoinHandle;

use libloading::Library;

/// `nvmlReturn_t`; 0 is `NVML_SUCCESS`.
type Ret = c_int;
/// `nvmlDevice_t`, an opaque pointer.
type Handle = *mut c_void;

/// A compute capability `(major, minor)`, if NVML gave one.
type Answer = Option<(i32, i32)>;

/// The question put to NVML in the background ([`start`]), for [`compute_capability`] to take.
static ASKING: Mutex<Option<JoinHandle<Answer>>> = Mutex::new(None);

/// Starts asking NVML on a background thread, with the driver's start at the beginning of the
/// process. (On a freshly started H200 machine NVML answers only once the GPU is initialized,
/// about 1 s after start, as the driver does; on a used one in 30–120 ms.)
pub(crate) fn start() {
    *ASKING.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::thread::spawn(ask));
}

/// The compute capability `(major, minor)` shared by every GPU of the host, from NVML (the
/// answer to [`start`]'s question, else asked now); `None` when NVML cannot say, the GPUs
/// differ, or `FUSEC_NVML=0`.
pub(crate) fn compute_capability() -> Answer {
    match ASKING.lock().unwrap_or_else(|e| e.into_inner()).take() {
        Some(h) => h.join().ok().flatten(),
        None => ask(),
    }
}

fn ask() -> Answer {
    if std::env::var_os("FUSEC_NVML").is_some_and(|v| v == "0") {
        return None;
    }
    // SAFETY: NVIDIA's library; each symbol is given its signature from `nvml.h`, and the
    // device handles are used between `nvmlInit_v2` and `nvmlShutdown` only.
    unsafe {
        let lib = Library::new("libnvidia-ml.so.1").ok()?;
        let init = lib.get::<unsafe extern "C" fn() -> Ret>(b"nvmlInit_v2\0").ok()?;
        let shutdown = lib.get::<unsafe extern "C" fn() -> Ret>(b"nvmlShutdown\0").ok()?;
        let count = lib.get::<unsafe extern "C" fn(*mut c_uint) -> Ret>(b"nvmlDeviceGetCount_v2\0").ok()?;
        let handle = lib.get::<unsafe extern "C" fn(c_uint, *mut Handle) -> Ret>(b"nvmlDeviceGetHandleByIndex_v2\0").ok()?;
        let capability =
            lib.get::<unsafe extern "C" fn(Handle, *mut c_int, *mut c_int) -> Ret>(b"nvmlDeviceGetCudaComputeCapability\0").ok()?;
        if init() != 0 {
            return None;
        }
        let mut n: c_uint = 0;
        let answer = if count(&mut n) == 0 {
            agreed((0..n).map(|i| {
                let mut h: Handle = std::ptr::null_mut();
                let (mut major, mut minor): (c_int, c_int) = (0, 0);
                let ok = handle(i, &mut h) == 0 && capability(h, &mut major, &mut minor) == 0;
                ok.then_some((major, minor))
            }))
        } else {
            None
        };
        shutdown();
        answer
    }
}

/// The one compute capability of `gpus` (each `None` where asking failed): `None` when there
/// are none, one failed, or two differ.
fn agreed(gpus: impl IntoIterator<Item = Option<(i32, i32)>>) -> Option<(i32, i32)> {
    let mut one = None;
    for g in gpus {
        let g = g?;
        if one.is_some_and(|o| o != g) {
            return None;
        }
        one = Some(g);
    }
    one
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_only_when_every_gpu_agrees() {
        assert_eq!(agreed([]), None, "no GPU");
        assert_eq!(agreed([Some((9, 0))]), Some((9, 0)));
        assert_eq!(agreed([Some((9, 0)); 8]), Some((9, 0)));
        assert_eq!(agreed([Some((9, 0)), Some((8, 0))]), None, "mixed GPUs: device 0 may be either");
        assert_eq!(agreed([Some((8, 0)), Some((8, 6))]), None, "the minor version counts");
        assert_eq!(agreed([Some((9, 0)), None, Some((9, 0))]), None, "one GPU NVML could not read");
        assert_eq!(agreed([None]), None);
    }

    #[test]
    fn asking_never_panics() {
        // Whatever this machine has (no library on CI, GPUs on the device): an answer or none.
        let _ = compute_capability();
    }
}
