//! The instruction-set level of the CPU backend's hand-written routines, chosen once per
//! process.
//!
//! Three things depend on it: the native row routines ([`crate::vmath`]: 16 lanes with
//! AVX-512F, 8 with AVX2, none at [`Isa::Scalar`], where the generated 4-lane loops do the
//! work), the bf16 products ([`crate::gemm::gemm_bf16`]: AMX tiles, AVX512-BF16 dot products,
//! or operands widened to f32), and the Cranelift target flags (AVX-512 encodings only at the AVX-512
//! levels). The row routines give the same bits at every level (they are ports of the
//! generated code); the bf16 products differ in summation order between the dot-product and
//! the widened paths (see `gemm_bf16`).
//!
//! The level is the best the host supports ([`Isa::preferred`]), unless `FUSEC_CPU_ISA` names
//! one (`scalar`, `avx2`, `avx512`, `avx512bf16`, `amx`), so that tests and benchmarks can run
//! every path on one host. A level the host lacks, or an unknown name, is an error ([`selected`]); the
//! f32 products of the `gemm` crate choose their own kernels from the host's features
//! whatever this says.

use std::sync::OnceLock;

/// Runs `f(args)` compiled for instruction-set level `isa` (one the host has): the
/// `#[inline(always)]` function `f` inside an AVX-512 or AVX2 function (`target_feature`), so
/// that its loops vectorize that wide, or as built (the SSE2 baseline). For loops outside the
/// generated kernels whose operations do not depend on the vector width (maps, fixed-lane
/// reductions, no fused multiply-adds): every level then gives the same bits. A macro, so the
/// `target_feature` functions are instantiated beside their caller: a generic function here
/// taking the caller's closure was tried, and LLVM left the attention's closures uninlined in
/// it (their loops kept the baseline's four lanes).
#[macro_export]
macro_rules! at_level {
    ($isa:expr, $f:ident($($arg:expr),* $(,)?)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx2")]
            unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            #[target_feature(enable = "avx2")]
            unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            use $crate::isa::Isa;
            match $isa {
                // SAFETY: the level in use is one the host has.
                Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => unsafe { avx512(|| $f($($arg),*)) },
                Isa::Avx2 => unsafe { avx2(|| $f($($arg),*)) },
                _ => $f($($arg),*),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $f($($arg),*)
        }
    }};
}

/// The environment variable that overrides the detected level.
pub const ENV: &str = "FUSEC_CPU_ISA";

/// An instruction-set level, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// No hand-written vector routines: generated 4-lane loops, widened bf16 products.
    Scalar,
    /// AVX2 and FMA (8-lane row routines).
    Avx2,
    /// AVX-512F (16-lane row routines).
    Avx512,
    /// AVX-512F with AVX512-BF16 (bf16 dot-product instructions for bf16 products).
    Avx512Bf16,
    /// [`Isa::Avx512Bf16`] with AMX-BF16 tiles for bf16 products (Intel Sapphire Rapids and
    /// later, where Linux grants the process the tile state).
    Amx,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 5] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::Amx];

    /// The name `FUSEC_CPU_ISA` takes.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Amx => "amx",
        }
    }

    /// The level named `s` (as [`Isa::name`] prints it).
    pub fn parse(s: &str) -> Result<Isa, String> {
        Isa::ALL.into_iter().find(|i| i.name() == s.trim()).ok_or_else(|| {
            let names: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
            format!("{ENV}={s:?} is not an instruction-set level: use one of {}", names.join(", "))
        })
    }

    /// The best level this host supports.
    pub fn detect() -> Isa {
        Isa::ALL.into_iter().rev().find(|i| i.supported()).unwrap_or(Isa::Scalar)
    }

    /// The level used when `FUSEC_CPU_ISA` is not set: the best the host supports, except that
    /// a host with AMX-BF16 whose tile state Linux does not grant gets [`Isa::Avx512`], whose
    /// bf16 products widen their operands in FMA kernels: measured on such a host (16-core
    /// Xeon, 8 threads, the `small` bf16 step) 323 ms with the AVX512-BF16 dot products,
    /// 241–257 ms widened (fp32 214 ms); on the AMD EPYC without AMX the dot products are the
    /// faster path.
    pub fn preferred() -> Isa {
        match Isa::detect() {
            Isa::Avx512Bf16 if has_amx_bf16() => Isa::Avx512,
            best => best,
        }
    }

    /// Whether this host can run the level's routines.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => has!("avx2") && has!("fma"),
                Isa::Avx512 => has!("avx512f") && Isa::Avx2.supported(),
                Isa::Avx512Bf16 => has!("avx512bf16") && has!("avx512bw") && Isa::Avx512.supported(),
                Isa::Amx => has_amx_bf16() && Isa::Avx512Bf16.supported() && crate::gemm::amx_permitted(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Scalar
        }
    }

    /// Lanes of the native `exp` / `tanh` / row-max routines (0: none, generated code only).
    pub fn row_lanes(self) -> usize {
        match self {
            Isa::Scalar => 0,
            Isa::Avx2 => 8,
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => 16,
        }
    }

    /// Whether bf16 products use the AVX512-BF16 dot-product instructions.
    pub fn bf16_dot(self) -> bool {
        self == Isa::Avx512Bf16
    }

    /// One line for run summaries: the level, the host's own, and what the level selects.
    pub fn describe(self) -> String {
        let host = Isa::detect();
        let how = match std::env::var(ENV) {
            Ok(_) => format!("{ENV} (host: {})", host.name()),
            Err(_) if self != host => format!("detected {}, preferred for bf16 products on this host", host.name()),
            Err(_) => "detected".to_string(),
        };
        let rows = match self.row_lanes() {
            0 => "generated 4-lane loops".to_string(),
            n => format!("{n}-lane routines"),
        };
        let products = match self {
            Isa::Amx => "AMX tiles",
            _ if self.bf16_dot() => "AVX512-BF16 dot products",
            _ => "operands widened to f32",
        };
        let yes = |b: bool| if b { "yes" } else { "no" };
        let (bf, amx) = (Isa::Avx512Bf16.supported(), Isa::Amx.supported());
        format!("{} ({how}; avx512_bf16: {}, amx: {}): row math {rows}, bf16 products {products}", self.name(), yes(bf), yes(amx))
    }
}

/// Whether the CPU has AMX-BF16 and AMX tiles (CPUID leaf 7, EDX bits 22 and 24).
fn has_amx_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        edx & (1 << 22) != 0 && edx & (1 << 24) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The level in use: `FUSEC_CPU_ISA` if set (an error if it names no level or one the host
/// lacks), else [`Isa::preferred`]. Decided on the first call.
pub fn selected() -> Result<Isa, String> {
    static CHOICE: OnceLock<Result<Isa, String>> = OnceLock::new();
    CHOICE
        .get_or_init(|| match std::env::var(ENV) {
            Err(_) => Ok(Isa::preferred()),
            Ok(s) => {
                let isa = Isa::parse(&s)?;
                if isa.supported() {
                    Ok(isa)
                } else {
                    Err(format!("{ENV}={s}: this host does not support {} (its best level is {})", isa.name(), Isa::detect().name()))
                }
            }
        })
        .clone()
}

/// The level in use, falling back to [`Isa::preferred`] when `FUSEC_CPU_ISA` is not valid
/// (the CLI reports that error through [`selected`] before anything runs).
pub fn current() -> Isa {
    selected().unwrap_or_else(|_| Isa::preferred())
}
