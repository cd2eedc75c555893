//! The kernel compiler: lowering, Cranelift compilation for the host, and two caches.
//!
//! - **Kernel cache**: key = SHA-256 of the codegen version, the kernel's name, its printed body
//!   (canonical `.graph` text) and the bindings. Identical kernels (the same LayerNorm in every
//!   layer) compile once; [`KernelCompiler::stats`] counts compilations and hits.
//! - **Function cache**: key = SHA-256 of the codegen version and a segment's printed row
//!   program ([`Prog::text`], which names memory only by slot). Different kernels with equal
//!   segments — the AdamW updates of equally shaped parameters — share one compiled function.
//!
//! Each compiled program gets its own small `JITModule`, owned by an [`Arc`] that every kernel
//! using it holds, so code is freed exactly when no kernel needs it. The target is the host's
//! (`cranelift-native`: SSE4.1/AVX are used where present) limited to the instruction-set level
//! ([`Isa`]: no AVX-512 encodings below `avx512`, no AVX below `avx2`), `opt_level = speed`, the
//! IR verifier on in debug builds.

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::{Arc, Mutex};

use cranelift_codegen::isa::OwnedTargetIsa;
use cranelift_codegen::settings::{self, Configurable};
use cranelift_codegen::Context;
use cranelift_frontend::FunctionBuilderContext;
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{default_libcall_names, Linkage, Module};
use fusec_ir::rows::{Prog, Slot};
use fusec_passes::lower_rows::lower_kernel;
use sha2::{Digest, Sha256};

use crate::clif;
use crate::isa::Isa;
use crate::run::{CompiledKernel, RunState, SegmentRun, SlotRef};

/// Bumped whenever generated code changes for the same input (part of every cache key).
const CODEGEN_REVISION: &str = "fusec-codegen-cpu/2";

/// `fn(args, row_begin, row_end, chunk)`.
pub(crate) type ChunkFn = unsafe extern "C" fn(*const *mut u8, i64, i64, i64);
/// `fn(args)`.
pub(crate) type FinalFn = unsafe extern "C" fn(*const *mut u8);

/// The machine code of one row program.
pub(crate) struct Code {
    module: Option<JITModule>,
    pub chunk: ChunkFn,
    pub finalize: Option<FinalFn>,
}

// SAFETY: after `finalize_definitions` the module is never touched again except to free it on
// drop (when no kernel can call into it); the code itself is immutable and reentrant.
unsafe impl Send for Code {}
unsafe impl Sync for Code {}

impl Drop for Code {
    fn drop(&mut self) {
        if let Some(m) = self.module.take() {
            // SAFETY: the last `Arc<Code>` is gone, so no function pointer into it remains.
            unsafe { m.free_memory() };
        }
    }
}

/// Compiles fused kernels to machine code and caches them (see the module docs).
pub struct KernelCompiler {
    target: OwnedTargetIsa,
    fctx: FunctionBuilderContext,
    kernels: HashMap<[u8; 32], Arc<CompiledKernel>>,
    codes: HashMap<[u8; 32], (Arc<Code>, String)>,
    compiled: usize,
    hits: usize,
    level: Isa,
}

fn sha(parts: &[&str]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(CODEGEN_REVISION.as_bytes());
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p.as_bytes());
    }
    h.finalize().into()
}

impl KernelCompiler {
    /// A compiler for the host CPU at the selected instruction-set level
    /// ([`crate::isa::current`]).
    pub fn new() -> Result<Self, String> {
        Self::for_isa(crate::isa::current())
    }

    /// A compiler whose code uses level `level`'s native routines and target flags; an error if
    /// the host does not support it.
    pub fn for_isa(level: Isa) -> Result<Self, String> {
        if !level.supported() {
            return Err(format!("this host does not support the instruction-set level {}", level.name()));
        }
        let mut flags = settings::builder();
        let set = |f: &mut settings::Builder, k: &str, v: &str| f.set(k, v).map_err(|e| format!("cranelift flag {k}: {e}"));
        set(&mut flags, "opt_level", "speed")?;
        set(&mut flags, "is_pic", "false")?;
        set(&mut flags, "use_colocated_libcalls", "false")?;
        set(&mut flags, "enable_verifier", if cfg!(debug_assertions) { "true" } else { "false" })?;
        let mut target = cranelift_native::builder().map_err(|e| format!("this host is not supported by Cranelift: {e}"))?;
        #[cfg(target_arch = "x86_64")]
        {
            let mut off: Vec<&str> = vec![];
            if level < Isa::Avx512 {
                off.extend(["has_avx512f", "has_avx512vl", "has_avx512dq", "has_avx512bitalg", "has_avx512vbmi", "has_avx512vnni"]);
            }
            if level < Isa::Avx2 {
                off.extend(["has_avx", "has_avx2", "has_fma"]);
            }
            for flag in off {
                target.set(flag, "false").map_err(|e| format!("cranelift flag {flag}: {e}"))?;
            }
        }
        let target = target.finish(settings::Flags::new(flags)).map_err(|e| format!("cranelift ISA: {e}"))?;
        Ok(KernelCompiler {
            target,
            fctx: FunctionBuilderContext::new(),
            kernels: HashMap::new(),
            codes: HashMap::new(),
            compiled: 0,
            hits: 0,
            level,
        })
    }

    /// The instruction-set level of the code this compiler makes.
    pub fn isa(&self) -> Isa {
        self.level
    }

    /// Compiles (or fetches from the cache) one kernel for concrete symbolic-dim values. An
    /// `Err` names what the lowering or the CPU compiler does not support.
    pub fn compile(&mut self, k: &fusec_ir::Kernel, bind: &fusec_ir::Bindings) -> Result<Arc<CompiledKernel>, String> {
        let binds: String = bind.0.iter().map(|(s, v)| format!("{s}={v};")).collect();
        let key = sha(&[&k.name, &fusec_ir::text::print(&k.body), &binds, self.level.name()]);
        if let Some(c) = self.kernels.get(&key) {
            self.hits += 1;
            return Ok(c.clone());
        }
        let mut progs = lower_kernel(k, bind)?;
        let (mut narrows, native_narrows) = (Vec::with_capacity(progs.len()), crate::narrow::enabled());
        for p in progs.iter_mut() {
            crate::vmath::assign(p, self.level);
            crate::stash::assign(p);
            narrows.push(if native_narrows { crate::narrow::assign(p) } else { vec![] });
        }
        let mut segments = Vec::with_capacity(progs.len());
        let mut scratch: Vec<Vec<f32>> = Vec::new();
        let mut clif_text = String::new();
        let mut flops = 0u64;
        let mut seen: Vec<[u8; 32]> = Vec::new();
        for (p, narrows) in progs.iter().zip(narrows) {
            let (code, text, fkey) = self.code_for(p)?;
            if !seen.contains(&fkey) {
                seen.push(fkey);
                clif_text.push_str(&text);
            }
            let slots = p
                .slots
                .iter()
                .map(|s| match *s {
                    Slot::Operand(i) => SlotRef::Operand(i),
                    Slot::Result(j) => SlotRef::Result(j),
                    Slot::Scratch(n) => {
                        scratch.push(vec![0.0; n]);
                        SlotRef::Scratch(scratch.len() - 1)
                    }
                })
                .collect();
            flops += p.flops();
            segments.push(SegmentRun { code, slots, rows: p.rows, cols: p.cols, chunks: p.chunks, narrows });
        }
        let copies: usize = segments.iter().map(|s: &SegmentRun| s.narrows.len()).sum();
        if copies > 0 {
            let _ = writeln!(clif_text, "; {copies} bf16 copies of f32 results are rounded natively after each block of rows, not in these functions");
        }
        let mut bytes = 0u64;
        for n in &k.body.nodes {
            if let fusec_ir::Op::Input { ty, .. } = &n.op {
                bytes += ty.bytes(bind)? as u64;
            }
        }
        for (_, v) in &k.body.outputs {
            bytes += k.body.ty(*v).bytes(bind)? as u64;
        }
        let max_slots = segments.iter().map(|s| s.slots.len()).max().unwrap_or(0);
        let n_operands = k.body.nodes.iter().filter(|n| matches!(n.op, fusec_ir::Op::Input { .. })).count();
        let ck = Arc::new(CompiledKernel {
            name: k.name.clone(),
            clif: clif_text,
            segments,
            state: Mutex::new(RunState { scratch, args: Vec::with_capacity(max_slots) }),
            n_operands,
            n_results: k.body.outputs.len(),
            bytes,
            flops,
        });
        self.compiled += 1;
        self.kernels.insert(key, ck.clone());
        Ok(ck)
    }

    /// `(kernels compiled, kernel cache hits)`.
    pub fn stats(&self) -> (usize, usize) {
        (self.compiled, self.hits)
    }

    /// How many distinct machine-code functions pairs exist (after function-level sharing).
    pub fn functions(&self) -> usize {
        self.codes.len()
    }

    /// The compiled code of a program, from the function cache or freshly compiled.
    fn code_for(&mut self, p: &Prog) -> Result<(Arc<Code>, String, [u8; 32]), String> {
        let key = sha(&[&p.text()]);
        if let Some((c, t)) = self.codes.get(&key) {
            return Ok((c.clone(), t.clone(), key));
        }
        let built = clif::build(p, self.level, self.target.default_call_conv(), self.target.frontend_config(), &mut self.fctx)
            .map_err(|e| format!("kernel `{}`: {e}", p.name))?;
        let mut module = JITModule::new(JITBuilder::with_isa(self.target.clone(), default_libcall_names()));
        let mut text = String::new();
        let mut ids = Vec::new();
        for (i, f) in std::iter::once(built.main).chain(built.finalize).enumerate() {
            let _ = write!(text, "{}", f.display());
            let name = if i == 0 { "chunk" } else { "final" };
            let id = module.declare_function(name, Linkage::Local, &f.signature).map_err(|e| e.to_string())?;
            let mut ctx = Context::for_function(f);
            if let Err(e) = module.define_function(id, &mut ctx) {
                let detail = match e {
                    cranelift_module::ModuleError::Compilation(ce) => cranelift_codegen::print_errors::pretty_error(&ctx.func, ce),
                    other => other.to_string(),
                };
                return Err(format!("kernel `{}`: Cranelift rejected the generated code: {detail}", p.name));
            }
            ids.push(id);
        }
        module.finalize_definitions().map_err(|e| e.to_string())?;
        // SAFETY: the functions were built with exactly these signatures.
        let chunk: ChunkFn = unsafe { std::mem::transmute(module.get_finalized_function(ids[0])) };
        let finalize: Option<FinalFn> = ids.get(1).map(|&id| unsafe { std::mem::transmute(module.get_finalized_function(id)) });
        let code = Arc::new(Code { module: Some(module), chunk, finalize });
        self.codes.insert(key, (code.clone(), text.clone()));
        Ok((code, text, key))
    }
}
