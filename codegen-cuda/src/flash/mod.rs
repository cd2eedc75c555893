//! Causal flash attention: the `attention` composite and its gradient without the `T × T` score
//! matrix, one module per (head size, storage type), for sm_80 and newer.
//!
//! Layout as the composite: `qkv` is `[S, T, 3C]` (q, k, v of head `h` at columns `h D`,
//! `C + h D`, `2C + h D`), `out` and `dout` are `[S, T, C]`, `dqkv` is `[S, T, 3C]`, `lse` is
//! `[S, H, T]` f32 (the log-sum-exp of the scaled scores of a row, saved by the forward for the
//! backward). Every module has the three [`ENTRIES`] with the same parameters:
//! `fwd(qkv, out, lse, T, H, scale)`, `dq(qkv, out, lse, dout, dqkv, stats, T, H, scale)`,
//! `dkv(qkv, lse, dout, stats, dqkv, T, H, scale)`, where `stats` is scratch of
//! [`stats_bytes`] that `dq` fills for `dkv`; the Hopper `dq` and `dkv` take one more,
//! `colsum` (see [`sums_columns`]). Launch them with [`geometry`].
//!
//! Two families ([`Family`]):
//! - [`bf16`]: bf16 storage on bf16 tensor cores (`m16n8k16`, `ldmatrix`, `cp.async`), head
//!   sizes 16, 32, 64, 128.
//! - [`tf32`]: f32 storage on TF32 tensor cores (`m16n8k8`), head sizes 8 to 64 in steps of 8;
//!   also bf16 storage at the head sizes of that range the bf16 kernels lack (widened to f32).

pub mod bf16;
pub mod tf32;

use fusec_ir::DType;

/// Reductions over the four lanes (`t = lane % 4`) that hold one row of an `mma` accumulator,
/// shared by both families (spliced in where their sources say `// QUAD_REDUCTIONS`).
const QUAD_REDUCTIONS: &str = r#"__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(FULL, x, 1));
  return fmaxf(x, __shfl_xor_sync(FULL, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x = x + __shfl_xor_sync(FULL, x, 1);
  return x + __shfl_xor_sync(FULL, x, 2);
}"#;

/// The oldest architecture with the `mma.sync` shapes both families use (compute capability 8.0).
pub const MIN_ARCH: (i32, i32) = (8, 0);

/// Entry names, in launch order: forward, then the two backward kernels.
pub const ENTRIES: [&str; 3] = ["fusec_flash_fwd", "fusec_flash_bwd_dq", "fusec_flash_bwd_dkv"];

/// Which kernels serve a (head size, storage) pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// [`tf32`]: TF32 products on f32 (or widened bf16) tiles.
    Tf32,
    /// [`bf16`]: bf16 products on bf16 tiles.
    Bf16,
}

impl Family {
    /// How the run summary names the products, e.g. `bf16 tensor cores`.
    pub fn describe(self) -> &'static str {
        match self {
            Family::Tf32 => "TF32 tensor cores",
            Family::Bf16 => "bf16 tensor cores",
        }
    }
}

/// The kernels for heads of `d` columns stored as `dtype`, if any.
pub fn family(d: usize, dtype: DType) -> Option<Family> {
    match dtype {
        DType::BF16 if bf16::supported(d) => Some(Family::Bf16),
        DType::F32 | DType::BF16 if tf32::supported(d) => Some(Family::Tf32),
        _ => None,
    }
}

/// Whether some kernels handle heads of `d` columns stored as `dtype`.
pub fn supported(d: usize, dtype: DType) -> bool {
    family(d, dtype).is_some()
}

/// Every head size handled on `dtype` storage, for error messages.
pub fn head_sizes(dtype: DType) -> Vec<usize> {
    (1..=128).filter(|d| supported(*d, dtype)).collect()
}

/// Whether any kernels read and write `qkv`, `out`, `dout` and `dqkv` stored as `dtype` (f32 or
/// bf16; `lse` and the row statistics are f32 either way).
pub fn storage_supported(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16)
}

/// The module's name for head size `d` and storage `dtype`: `fusec_flash_d64`,
/// `fusec_flash_d64_bf16`.
pub fn name(d: usize, dtype: DType) -> String {
    match dtype {
        DType::F32 => format!("fusec_flash_d{d}"),
        _ => format!("fusec_flash_d{d}_{dtype}"),
    }
}

/// The CUDA C of the three kernels for head size `d` on storage `dtype` (see [`supported`]).
pub fn source(d: usize, dtype: DType) -> String {
    let src = match family(d, dtype) {
        Some(Family::Tf32) => tf32::source(d, dtype, &name(d, dtype)),
        Some(Family::Bf16) => {
            let head = format!("// {} (fusec: {})\n", name(d, dtype), crate::CODEGEN_REVISION);
            head + &bf16::source(d, &bf16::Config::for_head(d))
        }
        None => panic!("flash attention for head size {d} on {dtype} storage"),
    };
    src.replacen("// QUAD_REDUCTIONS", QUAD_REDUCTIONS, 1)
}

/// The CUDA C of kernel `entry` of [`ENTRIES`] alone (the module's other kernels are left out
/// by `FUSEC_FLASH_ONLY`): the three compile as three modules side by side, since one module
/// of all three took NVRTC 1.5 s, the longest of a cold GPT-2 124M build.
pub fn entry_source(d: usize, dtype: DType, entry: usize) -> String {
    format!("#define FUSEC_FLASH_ONLY {entry}\n{}", source(d, dtype))
}

/// How one kernel is launched: `threads` per block, each block owning `rows` rows (queries in
/// the forward and `dq`, keys in `dk/dv`) of one (sequence, head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Threads per block.
    pub threads: u32,
    /// Rows per block.
    pub rows: u32,
    /// Whether the tile index is the grid's `z` (`(H, S, tiles)`, the bf16 kernels: blocks of
    /// every head start heaviest first) rather than its `x` (`(tiles, H, S)`).
    pub tiles_in_z: bool,
    /// Bytes of dynamic shared memory a block takes (0: static only).
    pub shared: u32,
}

impl Geometry {
    /// The grid for `s` sequences of `t` positions and `h` heads.
    pub fn grid(&self, t: usize, h: usize, s: usize) -> [u32; 3] {
        let tiles = (t as u32).div_ceil(self.rows);
        if self.tiles_in_z {
            [h as u32, s as u32, tiles]
        } else {
            [tiles, h as u32, s as u32]
        }
    }

    /// The block.
    pub fn block(&self) -> [u32; 3] {
        [self.threads, 1, 1]
    }
}

/// The launch geometry of the [`ENTRIES`] for head size `d` on storage `dtype`, compiled for
/// `arch` (an NVRTC architecture such as `sm_90a`, which changes the bf16 forward: see
/// [`bf16::wgmma`]).
pub fn geometry(d: usize, dtype: DType, arch: &str) -> [Geometry; 3] {
    match family(d, dtype) {
        Some(Family::Bf16) => {
            let c = bf16::Config::for_head(d);
            let mut g = [c.fwd, c.dq, c.dkv].map(|s| Geometry { threads: s.threads(), rows: s.rows(), tiles_in_z: true, shared: 0 });
            if bf16::wgmma(d, arch) {
                g[0] = Geometry { threads: bf16::WG_THREADS, rows: bf16::WG_ROWS, tiles_in_z: true, shared: 0 };
                g[1] = Geometry { threads: bf16::WG_THREADS, rows: bf16::WG_ROWS, tiles_in_z: true, shared: bf16::DQ_WG_SHARED };
                g[2] = Geometry { threads: 128, rows: 64, tiles_in_z: true, shared: bf16::DKV_WG_SHARED };
            }
            g
        }
        _ => [Geometry { threads: tf32::THREADS, rows: tf32::TILE, tiles_in_z: false, shared: 0 }; 3],
    }
}

/// Rows of the tiles whose partial column sums the Hopper backward writes (see [`sums_columns`]).
pub const COLSUM_TILE: usize = 64;

/// Whether the backward kernels for head size `d` on `dtype` storage, compiled for `arch`, also
/// write partial column sums of `dqkv` (the Hopper bf16 kernels, `bf16::wgmma`). Those kernels
/// take one more parameter, `colsum`: null, or `[S · ceil(T / COLSUM_TILE), 3C]` f32 where each
/// (sequence, tile of COLSUM_TILE rows) writes the sums over its rows of the values it stored
/// (`dq` the first C columns, `dk/dv` the rest). Adding those rows in order (`fusec_sum_rows`)
/// gives the column sums over every row: the qkv bias gradient, without reading `dqkv` again.
pub fn sums_columns(d: usize, dtype: DType, arch: &str) -> bool {
    dtype == DType::BF16 && family(d, dtype) == Some(Family::Bf16) && bf16::wgmma(d, arch)
}

/// Bytes of the `stats` scratch for `s` sequences, `h` heads and `t` positions: one f32 row sum
/// per row for the TF32 kernels, a (row sum, `lse log2(e)`) pair for the bf16 ones.
pub fn stats_bytes(d: usize, dtype: DType, s: usize, h: usize, t: usize) -> u64 {
    let per_row = if family(d, dtype) == Some(Family::Bf16) { 8 } else { 4 };
    (s * h * t * per_row) as u64
}
