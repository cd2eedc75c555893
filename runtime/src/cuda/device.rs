//! The GPU as the executor sees it: the driver and libraries (loaded at run time, checked
//! before any call so a machine without them gets an error, never a panic), one context, one
//! stream, one cuBLAS handle bound to it, one device allocation, and raw launches.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::cublas::sys as blas;
use cudarc::driver::{sys, CudaContext, CudaStream};

/// A driver call's result as a `Result` naming the call.
pub(crate) fn ck(r: sys::CUresult, what: &str) -> Result<(), String> {
    r.result().map_err(|e| format!("{what}: {e:?}"))
}

/// A cuBLAS call's result as a `Result` naming the call.
pub(crate) fn ckb(r: blas::cublasStatus_t, what: &str) -> Result<(), String> {
    r.result().map_err(|e| format!("{what}: {e:?}"))
}

/// Runs `f`, turning a panic of the dynamically loaded bindings (a missing library or symbol)
/// into an error.
pub(crate) fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
        Err(format!("{what}: {msg}"))
    })
}

/// GPU 0's context and a cuBLAS handle (as an address), with how long each took to make.
/// The context, the cuBLAS handle, a warmed-up cuBLASLt handle if the library is there, and
/// how long the driver and cuBLAS took.
type Opened = (Arc<CudaContext>, usize, Option<usize>, [(&'static str, Duration); 2]);

/// The driver being opened in the background ([`start_driver`]), for [`Device::open`] to take.
static OPENING: Mutex<Option<JoinHandle<Result<Opened, String>>>> = Mutex::new(None);

/// Starts opening the driver, GPU 0's context and cuBLAS on a background thread, so that the
/// driver's own start-up (0.3–1.4 s; longest on a freshly started machine) overlaps parsing,
/// initialization, the passes and, when NVML names the architecture, NVRTC (see
/// [`super::CudaExecutor::new`]); building a `CudaExecutor` waits for it. NVML is asked for the
/// architecture meanwhile, on a thread of its own. Without a call, `open` does it in place.
pub fn start_driver() {
    super::nvml::start();
    let h = std::thread::spawn(open_driver);
    *OPENING.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
}

fn open_driver() -> Result<Opened, String> {
    let t0 = Instant::now();
    check_libraries()?;
    guard("CUDA", || {
        let ctx = CudaContext::new(0).map_err(|e| format!("CUDA driver present but no usable GPU: {e:?}"))?;
        let t1 = Instant::now();
        // cuBLASLt beside cuBLAS, on a thread of its own: its first heuristic query took
        // 104-110 ms in every process (H200), after the passes had waited for the device.
        let lt = std::thread::spawn({
            let ctx = ctx.clone();
            move || ctx.bind_to_thread().ok().and_then(|_| super::lt::open_warm()).map(|h| h as usize)
        });
        let handle = cudarc::cublas::result::create_handle().map_err(|e| format!("cuBLAS handle: {e:?}"))?;
        let lt = lt.join().ok().flatten();
        Ok((ctx, handle as usize, lt, [("driver", t1 - t0), ("cuBLAS", t1.elapsed())]))
    })
}

/// Checks that the driver, cuBLAS and NVRTC can be loaded; the error names what is missing.
pub fn check_libraries() -> Result<(), String> {
    // SAFETY: these only try to open the libraries.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver found (libcuda.so): --target cuda needs an NVIDIA GPU".into());
    }
    if !unsafe { blas::is_culib_present() } {
        return Err(
            "libcublas not found (looked for libcublas.so and libcublas.so.{13,12,11}; set LD_LIBRARY_PATH to the CUDA toolkit's lib64)"
                .into(),
        );
    }
    fusec_codegen_cuda::nvrtc::available()
}

/// The `sm_XY` name of a compute capability.
pub(crate) fn sm(arch: (i32, i32)) -> String {
    format!("sm_{}{}", arch.0, arch.1)
}

/// One context, stream, cuBLAS handle and allocation.
pub(crate) struct Device {
    ctx: Arc<CudaContext>,
    _stream: Arc<CudaStream>,
    /// The stream every launch goes to.
    pub stream: sys::CUstream,
    /// The process's cuBLAS handle, bound to `stream`.
    pub blas: blas::cublasHandle_t,
    /// The cuBLASLt handle, when TF32 products are allowed and libcublasLt is present.
    pub lt: Option<cudarc::cublaslt::sys::cublasLtHandle_t>,
    /// Base address of the one allocation (0 until [`Device::allocate`]).
    pub base: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Compute capability.
    pub arch: (i32, i32),
    /// The GPU's name.
    pub name: String,
    /// How long opening took: the driver and context, then cuBLAS (on a background thread
    /// when [`start_driver`] was called; the caller times its own wait).
    pub open_times: [(&'static str, Duration); 2],
    modules: HashMap<[u8; 32], sys::CUmodule>,
}

impl Device {
    /// Opens GPU 0: context, stream, cuBLAS (TF32 tensor-core math when `tf32`, else plain
    /// fp32).
    pub fn open(tf32: bool) -> Result<Device, String> {
        let pending = OPENING.lock().unwrap_or_else(|e| e.into_inner()).take();
        let (ctx, handle, warm_lt, open_times) = match pending {
            Some(h) => h.join().unwrap_or_else(|_| Err("opening the CUDA driver failed".into()))?,
            None => open_driver()?,
        };
        let handle = handle as blas::cublasHandle_t;
        guard("CUDA", || {
            ctx.bind_to_thread().map_err(|e| format!("CUDA context: {e:?}"))?;
            let arch = ctx.compute_capability().map_err(|e| format!("compute capability: {e:?}"))?;
            let name = ctx.name().unwrap_or_else(|_| "GPU".into());
            let stream = ctx.new_stream().map_err(|e| format!("stream: {e:?}"))?;
            // SAFETY: a fresh handle and a live stream.
            unsafe {
                ckb(blas::cublasSetStream_v2(handle, stream.cu_stream() as blas::cudaStream_t), "cublasSetStream")?;
                let mode = if tf32 { blas::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH } else { blas::cublasMath_t::CUBLAS_DEFAULT_MATH };
                ckb(blas::cublasSetMathMode(handle, mode), "cublasSetMathMode")?;
            }
            let s = stream.cu_stream();
            // SAFETY: only tries to open the library.
            let warm_lt = warm_lt.map(|h| h as cudarc::cublaslt::sys::cublasLtHandle_t);
            let lt = match warm_lt {
                Some(h) if tf32 => Some(h),
                Some(h) => {
                    // SAFETY: a handle made for this process and not used elsewhere.
                    unsafe { cudarc::cublaslt::sys::cublasLtDestroy(h) };
                    None
                }
                None => None,
            };
            Ok(Device {
                ctx,
                _stream: stream,
                stream: s,
                blas: handle,
                lt,
                base: 0,
                size: 0,
                arch,
                name,
                open_times,
                modules: HashMap::new(),
            })
        })
    }

    /// Makes the context current on this thread (every entry point calls it first).
    pub fn bind(&self) -> Result<(), String> {
        self.ctx.bind_to_thread().map_err(|e| format!("CUDA context: {e:?}"))
    }

    /// The `sm_XY` name of the architecture.
    pub fn sm(&self) -> String {
        sm(self.arch)
    }

    /// Allocates the one buffer (zeroed); the last `workspace` bytes become cuBLAS's workspace.
    pub fn allocate(&mut self, bytes: u64, workspace: u64) -> Result<(), String> {
        self.bind()?;
        let total = bytes + workspace;
        // SAFETY: plain allocation; freed on drop.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(total as usize) }
            .map_err(|e| format!("could not allocate {:.1} MiB on the GPU: {e:?}", total as f64 / 1048576.0))?;
        self.base = ptr;
        self.size = total;
        // SAFETY: the range was just allocated; the workspace lies at its end.
        unsafe {
            ck(sys::cuMemsetD8Async(ptr, 0, total as usize, self.stream), "cuMemsetD8")?;
            if workspace > 0 {
                ckb(blas::cublasSetWorkspace_v2(self.blas, (ptr + bytes) as *mut c_void, workspace as usize), "cublasSetWorkspace")?;
            }
        }
        self.sync("zeroing the allocation")
    }

    /// Waits for the stream; `what` names the work in the error.
    pub fn sync(&self, what: &str) -> Result<(), String> {
        // SAFETY: a live stream.
        unsafe { ck(sys::cuStreamSynchronize(self.stream), what) }
    }

    /// Loads a module image once per key and returns the named functions.
    pub fn functions(&mut self, key: [u8; 32], image: &[u8], names: &[&str]) -> Result<Vec<sys::CUfunction>, String> {
        self.bind()?;
        let module = match self.modules.get(&key) {
            Some(m) => *m,
            None => {
                // SAFETY: a CUBIN (or NUL-terminated PTX) produced by NVRTC.
                let m = unsafe { cudarc::driver::result::module::load_data(image.as_ptr() as *const c_void) }
                    .map_err(|e| format!("loading module: {e:?}"))?;
                self.modules.insert(key, m);
                m
            }
        };
        names
            .iter()
            .map(|n| {
                let c = CString::new(*n).map_err(|_| format!("bad entry name {n}"))?;
                // SAFETY: a loaded module.
                unsafe { cudarc::driver::result::module::get_function(module, c) }.map_err(|e| format!("entry `{n}`: {e:?}"))
            })
            .collect()
    }

    /// Host → device copy (stream-ordered; waits for it).
    pub fn upload<T>(&self, dst: u64, src: &[T]) -> Result<(), String> {
        self.bind()?;
        // SAFETY: `dst` is inside the allocation (callers check the size).
        unsafe {
            ck(sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr() as *const c_void, std::mem::size_of_val(src), self.stream), "copy to GPU")?
        };
        self.sync("copy to GPU")
    }

    /// Device → host copy (stream-ordered; waits for it).
    pub fn download<T>(&self, dst: &mut [T], src: u64) -> Result<(), String> {
        self.bind()?;
        // SAFETY: `src` is inside the allocation (callers check the size).
        unsafe {
            ck(sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src, std::mem::size_of_val(dst), self.stream), "copy from GPU")?
        };
        self.sync("copy from GPU")
    }

    /// Zeroes `bytes` at `dst` (stream-ordered, asynchronous).
    pub fn zero(&self, dst: u64, bytes: u64) -> Result<(), String> {
        self.bind()?;
        // SAFETY: inside the allocation.
        unsafe { ck(sys::cuMemsetD8Async(dst, 0, bytes as usize, self.stream), "memset") }
    }

    /// Launches `f` with the argument pointers `params`.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters and point into live memory.
    pub unsafe fn launch(
        &self,
        f: sys::CUfunction,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), String> {
        ck(
            sys::cuLaunchKernel(
                f,
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                shared,
                self.stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            ),
            "launch",
        )
    }

    /// Lets `f` launch with `bytes` of dynamic shared memory (needed above 48 KiB); a clear
    /// error where the GPU allows less.
    pub fn allow_shared(&self, f: sys::CUfunction, bytes: u32) -> Result<(), String> {
        const DEFAULT: u32 = 48 * 1024;
        if bytes <= DEFAULT {
            return Ok(());
        }
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: a loaded function; the attribute takes a byte count.
        unsafe { ck(sys::cuFuncSetAttribute(f, attr, bytes as i32), "cuFuncSetAttribute") }
            .map_err(|e| format!("needs {bytes} bytes of shared memory a block, more than this GPU ({}) allows: {e}", self.sm()))
    }

    /// Bytes of GPU memory free for a new allocation.
    pub fn free_bytes(&self) -> Result<u64, String> {
        self.bind()?;
        cudarc::driver::result::mem_get_info().map(|(free, _)| free as u64).map_err(|e| format!("cuMemGetInfo: {e:?}"))
    }

    /// GPU memory in use (every process): total minus free.
    pub fn used_bytes(&self) -> u64 {
        let _ = self.bind();
        match cudarc::driver::result::mem_get_info() {
            Ok((free, total)) => (total - free) as u64,
            Err(_) => 0,
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let _ = self.bind();
        // SAFETY: everything below was created by this device and is no longer used.
        unsafe {
            let _ = sys::cuStreamSynchronize(self.stream);
            let _ = blas::cublasDestroy_v2(self.blas);
            if let Some(lt) = self.lt {
                let _ = cudarc::cublaslt::sys::cublasLtDestroy(lt);
            }
            for m in self.modules.values() {
                let _ = sys::cuModuleUnload(*m);
            }
            if self.base != 0 {
                let _ = sys::cuMemFree_v2(self.base);
            }
        }
    }
}
