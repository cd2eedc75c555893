//! The build's kernels: code generation (each distinct fused kernel's CUDA C once, whatever the
//! architecture), the modules of one architecture (those kernels, the hand-written modules, the
//! flash attention modules the run uses), their images from NVRTC or the disk cache, and their
//! functions once loaded into the device.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction;
use fusec_codegen_cuda::nvrtc::{Compiler, Image};
use fusec_codegen_cuda::{flash, kernel_source, native, KernelSource};
use fusec_ir::DType;

use super::device::{sm, Device};
use super::launch::attention_kinds;
use super::CudaOptions;
use crate::launches::{LaunchOp, LaunchPlan};
use crate::programs::{Program, RunPrograms};

/// The fused kernels' sources of a launch plan.
pub(super) struct Sources {
    /// The distinct sources (identical kernels share one).
    pub kernels: Vec<Arc<KernelSource>>,
    /// The source each kernel launch runs: (program, launch index) → index into `kernels`.
    pub of_launch: HashMap<(Program, usize), usize>,
    /// The (head size, storage) pairs of the plan's attention launches.
    pub attention: Vec<(usize, DType)>,
}

impl Sources {
    /// Generates the source of every kernel launch of `plan`.
    pub fn new(plan: &LaunchPlan, run: &RunPrograms) -> Result<Sources, String> {
        let mut kernels: Vec<Arc<KernelSource>> = vec![];
        let mut by_text: HashMap<String, usize> = HashMap::new();
        let mut of_launch = HashMap::new();
        for (p, launches, _) in &plan.programs {
            for (i, l) in launches.iter().enumerate() {
                if let LaunchOp::Kernel { kernel, .. } = &l.op {
                    let ks = kernel_source(kernel, &run.bind).map_err(|e| format!("{p:?} program, {}", l.err(e)))?;
                    let idx = *by_text.entry(ks.source.clone()).or_insert_with(|| {
                        kernels.push(Arc::new(ks));
                        kernels.len() - 1
                    });
                    of_launch.insert((*p, i), idx);
                }
            }
        }
        Ok(Sources { kernels, of_launch, attention: attention_kinds(plan) })
    }
}

/// The modules of one architecture, and their images once compiled.
pub(super) struct Modules {
    /// The architecture they are compiled for.
    pub arch: (i32, i32),
    /// (name, source): the fused kernels in [`Sources::kernels`]' order, the hand-written
    /// modules ([`native::MODULES`]), then one module per flash entry.
    pub items: Vec<(String, String)>,
    /// The attention kinds that have flash modules.
    pub flash: Vec<(usize, DType)>,
    /// NVRTC and the disk cache, for `arch`.
    pub compiler: Compiler,
    /// The images of `items`, in order (empty until [`Modules::compile`]).
    pub images: Vec<Result<Arc<Image>, String>>,
}

/// The entries of the loaded modules.
pub(super) struct Functions {
    /// Each fused kernel source's entries, in [`Sources::kernels`]' order.
    pub kernels: Vec<Vec<CUfunction>>,
    /// The hand-written modules' entries, in [`native::MODULES`]' order.
    pub native: Vec<CUfunction>,
    /// Each flash kind's forward and two backward kernels.
    pub flash: HashMap<(usize, DType), [CUfunction; 3]>,
}

impl Modules {
    /// The modules of `src` for `arch` (not compiled yet); `Err` when libnvrtc is missing.
    /// Flash modules serve this run's attention launches only: f32 attention where flash and
    /// TF32 are allowed, bf16 attention always (the score-matrix path is f32 only: see
    /// `attention`), both on sm_80+ for supported head sizes.
    pub fn new(src: &Sources, arch: (i32, i32), opts: &CudaOptions) -> Result<Modules, String> {
        let mut compiler = Compiler::new(&sm(arch))?;
        compiler.prefer_arch_specific();
        let mut items: Vec<(String, String)> = src.kernels.iter().map(|s| (s.ident.clone(), s.source.clone())).collect();
        items.extend((0..native::MODULES.len()).map(|i| (native::module_name(i), native::module_source(i))));
        let flash_mods: Vec<(usize, DType)> = src
            .attention
            .iter()
            .copied()
            .filter(|&(d, dt)| arch >= flash::MIN_ARCH && flash::supported(d, dt))
            .filter(|&(_, dt)| dt != DType::F32 || (opts.flash && opts.tf32))
            .collect();
        for &(d, dt) in &flash_mods {
            for (i, e) in flash::ENTRIES.iter().enumerate() {
                items.push((format!("{}_{}", flash::name(d, dt), e.trim_start_matches("fusec_flash_")), flash::entry_source(d, dt, i)));
            }
        }
        Ok(Modules { arch, items, flash: flash_mods, compiler, images: vec![] })
    }

    /// Compiles every module: the distinct missing ones by NVRTC in parallel, the rest from
    /// memory or the disk cache.
    pub fn compile(&mut self) {
        self.images = self.compiler.compile_all(&self.items);
    }

    /// Loads the images into `dev` (where a compile error surfaces) and finds their entries;
    /// kernels that need more than 48 KiB of shared memory are allowed it.
    pub fn load(&self, src: &Sources, dev: &mut Device) -> Result<Functions, String> {
        if self.images.len() != self.items.len() {
            return Err("internal: modules loaded before they were compiled".into());
        }
        let (n, nn) = (src.kernels.len(), native::MODULES.len());
        let mut funcs: Vec<Vec<CUfunction>> = vec![];
        for (i, img) in self.images.iter().enumerate() {
            let img = img.as_ref().map_err(|e| e.clone())?;
            let names: Vec<&str> = if i < n {
                src.kernels[i].launches.iter().map(|l| l.entry.as_str()).collect()
            } else if i < n + nn {
                native::MODULES[i - n].to_vec()
            } else {
                vec![flash::ENTRIES[(i - n - nn) % flash::ENTRIES.len()]]
            };
            let named = |e: String| format!("kernel `{}`: {e}", self.items[i].0);
            let f = dev.functions(self.compiler.key(&self.items[i].1), &img.bytes, &names).map_err(named)?;
            if let Some(s) = src.kernels.get(i) {
                for (rule, &func) in s.launches.iter().zip(&f) {
                    dev.allow_shared(func, rule.shared).map_err(named)?;
                }
            }
            funcs.push(f);
        }
        let one: Vec<CUfunction> = funcs.drain(n + nn..).map(|f| f[0]).collect();
        // Flash kernels with dynamic shared memory above the default are allowed it.
        for (&(d, dt), f) in self.flash.iter().zip(one.chunks_exact(3)) {
            for (func, geo) in f.iter().zip(flash::geometry(d, dt, self.compiler.arch())) {
                dev.allow_shared(*func, geo.shared).map_err(|e| format!("flash attention, head size {d}: {e}"))?;
            }
        }
        let flash = self.flash.iter().zip(one.chunks_exact(3)).map(|(k, f)| (*k, [f[0], f[1], f[2]])).collect();
        let native: Vec<CUfunction> = funcs.drain(n..).flatten().collect();
        if native.len() != native::MODULES.iter().map(|m| m.len()).sum::<usize>() {
            return Err("internal: the hand-written modules' entries".into());
        }
        Ok(Functions { kernels: funcs, native, flash })
    }
}
