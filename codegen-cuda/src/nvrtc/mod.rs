//! NVRTC: CUDA C → CUBIN for one GPU architecture, in parallel (in worker processes: see
//! [`workers`]), with an on-disk cache.
//!
//! libnvrtc is opened at first use (cudarc's `dynamic-loading`): nothing here needs CUDA at
//! build time, and [`available`] says whether the library can be found (cudarc looks for
//! `libnvrtc.so`, `libnvrtc.so.13`, `.so.12`, `.so.11`, ... on the loader's path, so
//! `LD_LIBRARY_PATH` is respected; Debian's `libnvrtc11.2` package needs a `libnvrtc.so` link).
//!
//! Options: `--gpu-architecture=sm_XY` (a CUBIN for that architecture: no driver JIT at load)
//! and `--fmad=false` (no contraction of `a * b + c` into an FMA: one rounding per IR
//! operation, as the interpreter and the CPU backend). No fast math: `expf`, `logf`, `tanhf`,
//! division and square roots are the IEEE-accurate library versions.
//!
//! Cache: `$FUSEC_CACHE_DIR`, else `$XDG_CACHE_HOME/fusec`, else `~/.cache/fusec`, sub-folder
//! `cuda/`, one file per image named by the SHA-256 of (fusec version, [`crate::CODEGEN_REVISION`],
//! NVRTC version, architecture, options, source). Files are written to a temporary name and
//! renamed, so concurrent runs never read half a file. A cache that cannot be written is
//! skipped, not an error. Identical sources in one process compile once.

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::nvrtc::sys;
use rayon::prelude::*;
use sha2::{Digest, Sha256};

pub mod workers;

/// A compiled module image.
#[derive(Debug)]
pub struct Image {
    /// CUBIN bytes (or NUL-terminated PTX when `ptx`).
    pub bytes: Vec<u8>,
    /// Whether `bytes` is PTX (only when NVRTC produced no CUBIN).
    pub ptx: bool,
}

/// Whether libnvrtc can be loaded; `Err` says what is missing.
pub fn available() -> Result<(), String> {
    // SAFETY: only tries to open the library.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err("libnvrtc not found (looked for libnvrtc.so and libnvrtc.so.{13,12,11} on the loader path; set LD_LIBRARY_PATH)".into())
    }
}

/// NVRTC's version `(major, minor)`.
pub fn version() -> Result<(i32, i32), String> {
    available()?;
    guard(|| {
        let (mut a, mut b) = (0, 0);
        // SAFETY: plain out-parameters.
        check(unsafe { sys::nvrtcVersion(&mut a, &mut b) }, "nvrtcVersion")?;
        Ok((a, b))
    })
}

/// The options every module is compiled with for `arch` (e.g. `sm_90`).
pub fn options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--fmad=false".into()]
}

fn check(r: sys::nvrtcResult, what: &str) -> Result<(), String> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {r:?}"))
    }
}

/// Runs `f`, turning a panic of the dynamically loaded bindings (a missing symbol in an old
/// libnvrtc) into an error.
fn guard<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
        Err(format!("libnvrtc: {msg}"))
    })
}

/// What a module's compile is guessed to cost, to start the slowest first: its length, and
/// far more for tensor-core kernels (inline `mma`), whose unrolled loops keep ptxas busy:
/// measured on an H200 host, the flash modules took 150–670 ms against under 100 ms for the
/// generated row kernels, whose sources are longer.
fn compile_cost(source: &str) -> usize {
    source.len() + if source.contains("mma.sync") { 1 << 20 } else { 0 }
}

/// Compiles one module (no cache). `name` appears in NVRTC's diagnostics.
pub fn compile(source: &str, name: &str, arch: &str) -> Result<Image, String> {
    available()?;
    let src = CString::new(source).map_err(|_| format!("{name}: source contains NUL"))?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| format!("{name}: bad name"))?;
    let opts: Vec<CString> = options(arch).into_iter().map(|o| CString::new(o).expect("no NUL")).collect();
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    guard(|| {
        let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: valid C strings that outlive the program; the program is destroyed below.
        unsafe {
            check(
                sys::nvrtcCreateProgram(&mut prog, src.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null()),
                "nvrtcCreateProgram",
            )?;
            let r = sys::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr());
            let out = if r != sys::nvrtcResult::NVRTC_SUCCESS {
                Err(format!("NVRTC could not compile `{name}` ({r:?}):\n{}", log(prog)))
            } else {
                image(prog)
            };
            sys::nvrtcDestroyProgram(&mut prog);
            out
        }
    })
}

/// The program's log.
unsafe fn log(prog: sys::nvrtcProgram) -> String {
    let mut n = 0usize;
    if sys::nvrtcGetProgramLogSize(prog, &mut n) != sys::nvrtcResult::NVRTC_SUCCESS || n == 0 {
        return String::new();
    }
    let mut buf = vec![0u8; n];
    sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char);
    String::from_utf8_lossy(&buf).trim_end_matches('\0').to_string()
}

/// The CUBIN of a compiled program, or its PTX when there is no CUBIN.
unsafe fn image(prog: sys::nvrtcProgram) -> Result<Image, String> {
    let mut n = 0usize;
    check(sys::nvrtcGetCUBINSize(prog, &mut n), "nvrtcGetCUBINSize")?;
    if n > 0 {
        let mut bytes = vec![0u8; n];
        check(sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr() as *mut c_char), "nvrtcGetCUBIN")?;
        return Ok(Image { bytes, ptx: false });
    }
    check(sys::nvrtcGetPTXSize(prog, &mut n), "nvrtcGetPTXSize")?;
    let mut bytes = vec![0u8; n];
    check(sys::nvrtcGetPTX(prog, bytes.as_mut_ptr() as *mut c_char), "nvrtcGetPTX")?;
    Ok(Image { bytes, ptx: true })
}

/// The cache folder (not created here): `cuda/` in [`cache_root`].
pub fn cache_dir() -> Option<PathBuf> {
    cache_root().map(|d| d.join("cuda"))
}

/// fusec's cache folder: `$FUSEC_CACHE_DIR`, else `$XDG_CACHE_HOME/fusec`, else
/// `~/.cache/fusec` (not created here).
pub fn cache_root() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("FUSEC_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("fusec")))
        .or_else(|| env("HOME").map(|d| d.join(".cache").join("fusec")))
}

/// Compiled images by cache key, the on-disk cache, and counts.
pub struct Compiler {
    arch: String,
    version: (i32, i32),
    dir: Option<PathBuf>,
    images: Mutex<HashMap<[u8; 32], Arc<Image>>>,
    /// Modules compiled by NVRTC for this process.
    pub compiled: usize,
    /// Of those, the modules compiled in worker processes ([`workers`]).
    pub in_workers: usize,
    /// Modules read from the disk cache.
    pub disk_hits: usize,
    /// Requests answered by a module already compiled or loaded in this process.
    pub memory_hits: usize,
    /// Every module requested from disk or NVRTC in this process: name, whether it came from
    /// the disk cache, and the time it took (NVRTC's compile or the cache read), slowest first.
    pub times: Vec<(String, bool, std::time::Duration)>,
}

impl Compiler {
    /// A compiler for `arch` (e.g. `sm_90`); `Err` when libnvrtc is missing.
    pub fn new(arch: &str) -> Result<Compiler, String> {
        let version = version()?;
        Ok(Compiler {
            arch: arch.into(),
            version,
            dir: cache_dir(),
            images: Mutex::default(),
            compiled: 0,
            in_workers: 0,
            disk_hits: 0,
            memory_hits: 0,
            times: vec![],
        })
    }

    /// The same, with an explicit cache folder (`None`: no disk cache).
    pub fn with_cache_dir(arch: &str, dir: Option<PathBuf>) -> Result<Compiler, String> {
        let mut c = Compiler::new(arch)?;
        c.dir = dir;
        Ok(c)
    }

    /// NVRTC's version.
    pub fn nvrtc_version(&self) -> (i32, i32) {
        self.version
    }

    /// The architecture modules are compiled for (e.g. `sm_90a`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// On an sm_90 GPU with NVRTC 12 or newer, compiles for `sm_90a` instead (the same GPUs,
    /// plus Hopper's architecture-specific instructions: `wgmma` in the flash kernels).
    pub fn prefer_arch_specific(&mut self) {
        if self.arch == "sm_90" && self.version.0 >= 12 {
            self.arch = "sm_90a".into();
        }
    }

    /// The cache key of a source.
    pub fn key(&self, source: &str) -> [u8; 32] {
        let mut h = Sha256::new();
        let parts = [
            env!("CARGO_PKG_VERSION").to_string(),
            crate::CODEGEN_REVISION.to_string(),
            format!("nvrtc {}.{}", self.version.0, self.version.1),
            self.arch.clone(),
            options(&self.arch).join(" "),
            source.to_string(),
        ];
        for p in &parts {
            h.update((p.len() as u64).to_le_bytes());
            h.update(p.as_bytes());
        }
        h.finalize().into()
    }

    /// Images of `(name, source)` pairs, in order: from memory, the disk cache, or NVRTC (the
    /// distinct missing ones compiled in parallel: in worker processes where enabled, else on
    /// rayon's pool).
    pub fn compile_all(&mut self, items: &[(String, String)]) -> Vec<Result<Arc<Image>, String>> {
        let keys: Vec<[u8; 32]> = items.iter().map(|(_, s)| self.key(s)).collect();
        let mut todo: Vec<usize> = vec![];
        {
            let have = self.images.lock().unwrap_or_else(|e| e.into_inner());
            let mut seen = std::collections::HashSet::new();
            for (i, k) in keys.iter().enumerate() {
                if have.contains_key(k) || !seen.insert(*k) {
                    self.memory_hits += 1;
                } else {
                    todo.push(i);
                }
            }
        }
        // (item, its image and whether it came from the disk cache, the time it took)
        type Done = (usize, Result<(Image, bool), String>, std::time::Duration);
        let path = |i: usize| {
            let hex: String = keys[i].iter().map(|b| format!("{b:02x}")).collect();
            self.dir.as_ref().map(|d| d.join(format!("{hex}.bin")))
        };
        let mut done: Vec<Done> = vec![];
        let mut cold: Vec<usize> = vec![];
        for i in todo {
            let t0 = std::time::Instant::now();
            match path(i).and_then(|p| read_cached(&p)) {
                Some(img) => done.push((i, Ok((img, true)), t0.elapsed())),
                None => cold.push(i),
            }
        }
        // In child processes where enabled (see `workers`); what they did not compile, here.
        // The slowest compiles start first either way.
        cold.sort_by_key(|&i| std::cmp::Reverse(compile_cost(&items[i].1)));
        let named: Vec<(&str, &str)> = cold.iter().map(|&i| (items[i].0.as_str(), items[i].1.as_str())).collect();
        let mut from_workers = workers::compile_all(&named, &self.arch).unwrap_or_default();
        from_workers.resize_with(cold.len(), || None);
        let mut here: Vec<usize> = vec![];
        let mut compiled: Vec<(usize, Result<Image, String>, std::time::Duration)> = vec![];
        for (&i, w) in cold.iter().zip(from_workers) {
            match w {
                Some((r, took)) => {
                    self.in_workers += r.is_ok() as usize;
                    compiled.push((i, r, took));
                }
                None => here.push(i),
            }
        }
        let arch = self.arch.clone();
        compiled.par_extend(here.par_iter().with_max_len(1).map(|&i| {
            let t0 = std::time::Instant::now();
            let r = compile(&items[i].1, &items[i].0, &arch);
            (i, r, t0.elapsed())
        }));
        for (i, r, took) in compiled {
            if let (Ok(img), Some(p)) = (&r, path(i)) {
                write_cached(&p, img);
            }
            done.push((i, r.map(|img| (img, false)), took));
        }
        let mut errs: HashMap<usize, String> = HashMap::new();
        {
            let mut have = self.images.lock().unwrap_or_else(|e| e.into_inner());
            for (i, r, took) in done {
                match r {
                    Ok((img, from_disk)) => {
                        if from_disk {
                            self.disk_hits += 1;
                        } else {
                            self.compiled += 1;
                        }
                        self.times.push((items[i].0.clone(), from_disk, took));
                        have.insert(keys[i], Arc::new(img));
                    }
                    Err(e) => {
                        errs.insert(i, e);
                    }
                }
            }
        }
        self.times.sort_by_key(|t| std::cmp::Reverse(t.2));
        let have = self.images.lock().unwrap_or_else(|e| e.into_inner());
        (0..items.len())
            .map(|i| match errs.get(&i) {
                Some(e) => Err(e.clone()),
                None => have.get(&keys[i]).cloned().ok_or_else(|| format!("{}: not compiled (an identical source failed)", items[i].0)),
            })
            .collect()
    }
}

fn read_cached(p: &std::path::Path) -> Option<Image> {
    let b = std::fs::read(p).ok()?;
    let (&kind, bytes) = b.split_first()?;
    (kind <= 1 && !bytes.is_empty()).then(|| Image { bytes: bytes.to_vec(), ptx: kind == 1 })
}

fn write_cached(p: &std::path::Path, img: &Image) {
    let Some(dir) = p.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = p.with_extension(format!("tmp{}", std::process::id()));
    let mut b = Vec::with_capacity(img.bytes.len() + 1);
    b.push(img.ptx as u8);
    b.extend_from_slice(&img.bytes);
    if std::fs::write(&tmp, &b).is_ok() && std::fs::rename(&tmp, p).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}
