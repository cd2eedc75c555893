//! Causal flash attention on bf16 tensor cores for bf16 storage: `mma.sync.m16n8k16` with fp32
//! accumulation, for sm_80 and newer (Hopper included: the same instructions).
//!
//! Design (FlashAttention-2's tiling, written for this layout):
//! - Tiles go from global to shared memory by `cp.async` (16 bytes a thread, rows past `T` filled
//!   with zeros), two stages deep: the next key (or query) tile loads while the current one is
//!   multiplied. Shared rows are padded to `D + 8` elements, so the eight 16-byte rows an
//!   `ldmatrix` reads fall in distinct banks.
//! - Operands reach the tensor cores by `ldmatrix` (`.trans` where the product needs the tile
//!   transposed: `v` in `p v`, `k` in `ds k`, `q` and `dout` in `ds^T q` and `p^T dout`); the
//!   operands a warp keeps for the whole loop (its `q` rows; `dout` rows in `dq`; `k` and `v`
//!   rows in `dk/dv`) are loaded into registers once.
//! - Probabilities never leave registers: the accumulator of two adjacent 8-key tiles is the A
//!   fragment of the next product over those 16 keys, so `p` (and `ds`) are rounded to bf16
//!   pairs in place (`cvt.rn.bf16x2`) with no shuffles.
//! - Softmax in base 2: `exp2(s * scale * log2(e) - m)` as one FMA and one `ex2.approx`; the
//!   running maximum and sum are fp32, `lse` is stored in natural log as the other paths do.
//! - Only chunks that cross the diagonal are masked; a warp skips chunks entirely above it, and
//!   blocks are launched heaviest first (the tile index is the grid's slowest dimension).
//! - Backward as two deterministic kernels (no atomics): `dq` per query tile (recomputing
//!   `q k^T` and `dout v^T`), which also writes `(rowsum(dout * out), lse log2(e))` per row for
//!   `dk/dv` per key tile. Every sum runs in a fixed order, so results repeat bit for bit.
//!
//! Each kernel's tile shape is a [`Shape`]; [`Config::for_head`] picks them per head size (see
//! the README for the measurements behind them), and `FUSEC_FLASH_BF16` overrides them for
//! tuning (`fwd=4x2x64x32x2,dq=...,dkv=...`: warps × 16-row m-tiles per warp × rows of a staged
//! tile × rows a warp takes at a time × minimum blocks per SM); `FUSEC_FLASH_BF16=tf32` runs bf16
//! storage on the TF32 kernels instead (head sizes up to 64), for comparisons.

/// Head sizes the bf16 kernels handle (whole 16-column MMA steps; `D / 8` lanes reduce a row).
pub const HEAD_SIZES: [usize; 4] = [16, 32, 64, 128];

/// Shared memory a block may use without opting in (static allocation).
const SMEM_LIMIT: usize = 48 * 1024;

/// The tile shape of one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Warps per block.
    pub warps: u32,
    /// 16-row m-tiles per warp (the block owns `warps * 16 * mt` rows).
    pub mt: u32,
    /// Rows of the tile staged per loop step (keys in `fwd` and `dq`, queries in `dk/dv`).
    pub bn: u32,
    /// Rows of the staged tile a warp multiplies at a time (a multiple of 16 dividing `bn`).
    pub kc: u32,
    /// Minimum resident blocks per SM (`__launch_bounds__`).
    pub min_blocks: u32,
}

impl Shape {
    const fn new(warps: u32, mt: u32, bn: u32, kc: u32, min_blocks: u32) -> Shape {
        Shape { warps, mt, bn, kc, min_blocks }
    }

    /// Rows a block owns (queries in `fwd` and `dq`, keys in `dk/dv`).
    pub fn rows(&self) -> u32 {
        self.warps * 16 * self.mt
    }

    /// Threads per block.
    pub fn threads(&self) -> u32 {
        self.warps * 32
    }

    fn parse(s: &str) -> Option<Shape> {
        let v: Vec<u32> = s.split('x').map(|x| x.trim().parse().ok()).collect::<Option<_>>()?;
        match v[..] {
            [warps, mt, bn, kc, min_blocks] => Some(Shape { warps, mt, bn, kc, min_blocks }),
            _ => None,
        }
    }
}

/// The shapes of the three kernels for one head size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Forward.
    pub fwd: Shape,
    /// `dq` (and the row statistics).
    pub dq: Shape,
    /// `dk`, `dv`.
    pub dkv: Shape,
}

impl Config {
    /// The default shapes for head size `d` (the fastest measured on an H100 at `d = 64`, see
    /// the README): forward 128 query rows a block, 32 a warp (the `k`/`v` fragments feed two
    /// m-tiles), 64 keys a softmax update, two blocks an SM; `dq` 128 query rows, 16 a warp,
    /// 128 registers for two blocks of 8 warps an SM; `dk/dv` 64 keys a block, 16 a warp, three
    /// blocks an SM. At `d = 128`, where the accumulators double and shared memory must stay
    /// under 48 KiB: 16 rows a warp and 32-row staged tiles in all three, 8 warps (128 query
    /// rows) a forward block (0.137 -> 0.127 ms against 4 warps on the H100).
    pub fn default_for(d: usize) -> Config {
        if d > 64 {
            Config { fwd: Shape::new(8, 1, 32, 32, 2), dq: Shape::new(4, 1, 32, 32, 2), dkv: Shape::new(4, 1, 32, 32, 2) }
        } else {
            Config { fwd: Shape::new(4, 2, 64, 64, 2), dq: Shape::new(8, 1, 64, 32, 2), dkv: Shape::new(4, 1, 64, 16, 3) }
        }
    }

    /// [`Config::default_for`] with the shapes named in `FUSEC_FLASH_BF16` (tuning only; a
    /// shape that does not parse or fit is reported and ignored).
    pub fn for_head(d: usize) -> Config {
        let mut c = Config::default_for(d);
        let Some(spec) = std::env::var("FUSEC_FLASH_BF16").ok().filter(|s| s != "tf32") else { return c };
        for part in spec.split(',').filter(|p| !p.is_empty()) {
            let (name, shape) = part.split_once('=').unwrap_or((part, ""));
            let mut next = c;
            let slot = match name.trim() {
                "fwd" => &mut next.fwd,
                "dq" => &mut next.dq,
                "dkv" => &mut next.dkv,
                _ => {
                    eprintln!("FUSEC_FLASH_BF16: unknown kernel `{name}` (fwd, dq, dkv)");
                    continue;
                }
            };
            match Shape::parse(shape) {
                Some(s) => *slot = s,
                None => {
                    eprintln!("FUSEC_FLASH_BF16: `{part}` is not warps x mt x bn x kc x min_blocks");
                    continue;
                }
            }
            match next.check(d) {
                Ok(()) => c = next,
                Err(e) => eprintln!("FUSEC_FLASH_BF16: `{part}` ignored for head size {d}: {e}"),
            }
        }
        c
    }

    /// Whether the shapes are valid for head size `d`: chunks of whole 16-row steps dividing the
    /// staged tile, and static shared memory within 48 KiB.
    pub fn check(&self, d: usize) -> Result<(), String> {
        let lds = d + 8;
        for (name, s) in [("fwd", self.fwd), ("dq", self.dq), ("dkv", self.dkv)] {
            if s.warps == 0 || s.mt == 0 || s.min_blocks == 0 || s.kc == 0 || s.kc % 16 != 0 || s.bn % s.kc != 0 || s.warps > 16 {
                return Err(format!("{name}: {s:?}"));
            }
        }
        let (fwd, dq, dkv) = (self.fwd, self.dq, self.dkv);
        let stage = |s: Shape| 2 * s.bn as usize * lds * 2;
        let smem = [
            ("fwd", (fwd.rows() as usize * lds * 2).max(2 * stage(fwd))),
            ("dq", (2 * dq.rows() as usize * lds * 2).max(2 * stage(dq)) + 4 * dq.rows() as usize),
            ("dkv", (2 * dkv.rows() as usize * lds * 2).max(2 * stage(dkv)) + 16 * dkv.bn as usize),
        ];
        for (name, bytes) in smem {
            if bytes > SMEM_LIMIT {
                return Err(format!("{name}: {bytes} bytes of shared memory (at most {SMEM_LIMIT})"));
            }
        }
        Ok(())
    }

    /// The `#define`s of these shapes.
    fn defines(&self) -> String {
        let mut s = String::new();
        for (p, sh) in [("FWD", self.fwd), ("DQ", self.dq), ("DKV", self.dkv)] {
            let (bn, kc) = match p {
                "DKV" => ("BQ", "QC"),
                _ => ("BN", "KC"),
            };
            s.push_str(&format!(
                "#define {p}_WARPS {}\n#define {p}_MT {}\n#define {p}_{bn} {}\n#define {p}_{kc} {}\n#define {p}_MINB {}\n",
                sh.warps, sh.mt, sh.bn, sh.kc, sh.min_blocks
            ));
        }
        s
    }
}

/// Whether the bf16 kernels handle heads of `d` columns (and are not switched off for
/// comparisons by `FUSEC_FLASH_BF16=tf32`, which puts bf16 storage back on the TF32 kernels
/// wherever they handle the head size).
pub fn supported(d: usize) -> bool {
    HEAD_SIZES.contains(&d) && !(std::env::var("FUSEC_FLASH_BF16").is_ok_and(|v| v == "tf32") && super::tf32::supported(d))
}

/// Threads of a block of the Hopper forward and `dq` (one warpgroup: in a standalone harness on
/// an H200 at the 124M shape, one warpgroup of 64 rows a block ran the forward in 0.0946 ms
/// and `dq` in 0.117 ms at four blocks an SM, against 0.100 and 0.125 ms with two).
pub const WG_THREADS: u32 = 128;
/// Query rows of a block of the Hopper forward and `dq` (64 a warpgroup).
pub const WG_ROWS: u32 = 64;
/// Dynamic shared memory of a block of the Hopper `dk/dv` kernel (its one definition): k and v, two
/// stages of q and dout, the statistics, and 1 KiB to align the tiles.
pub const DKV_WG_SHARED: u32 = 16384 + 2 * 16384 + 1024 + 1024;
/// Dynamic shared memory of a block of the Hopper `dq` kernel (its one definition): q and dout of each
/// warpgroup, two stages of k and v, the row sums, and 1 KiB to align the tiles.
pub const DQ_WG_SHARED: u32 = WG_THREADS / 128 * (16384 + 64 * 4) + 2 * 16384 + 1024;

/// Whether the three kernels at head size `d` run on Hopper's warpgroup MMAs
/// (`bf16_fwd_wg.cu`, `bf16_bwd_wg.cu`) when compiled for NVRTC architecture `arch`: head size
/// 64 on `sm_90a`, unless `FUSEC_FLASH_WGMMA=0` keeps the `mma.sync` kernels (for comparisons).
/// They give the `mma.sync` kernels' bits (the same sums in the same order).
pub fn wgmma(d: usize, arch: &str) -> bool {
    wgmma_source(d) && arch == "sm_90a"
}

/// Whether the module source for head size `d` carries the Hopper kernels.
fn wgmma_source(d: usize) -> bool {
    d == 64 && std::env::var("FUSEC_FLASH_WGMMA").map_or(true, |v| v != "0")
}

const COMMON: &str = include_str!("bf16_common.cuh");
const FWD: &str = include_str!("bf16_fwd.cu");
const FWD_WG: &str = include_str!("bf16_fwd_wg.cu");
const BWD_WG: &str = include_str!("bf16_bwd_wg.cu");
const BWD: &str = include_str!("bf16_bwd.cu");

/// The CUDA C of the three kernels for head size `d` (see [`supported`]) with shapes `c`.
pub fn source(d: usize, c: &Config) -> String {
    assert!(supported(d), "bf16 flash attention for head size {d}");
    let mut s = format!("#define HD {d}\n");
    s.push_str(&c.defines());
    s.push_str(COMMON);
    // The Hopper kernels where the compile targets sm_90a (see `wgmma`), else the mma.sync ones.
    let wg = wgmma_source(d);
    if wg {
        s.push_str(&format!("#if defined(__CUDA_ARCH_FEAT_SM90_ALL)\n#define WG_N {}\n", WG_THREADS / 128));
        s.push_str(FWD_WG);
        s.push_str(BWD_WG);
        s.push_str("#else\n");
    }
    s.push_str(FWD);
    s.push_str(BWD);
    if wg {
        s.push_str("#endif\n");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_default_shape_fits_and_shapes_parse() {
        for d in HEAD_SIZES {
            Config::default_for(d).check(d).unwrap_or_else(|e| panic!("head size {d}: {e}"));
        }
        assert_eq!(Shape::parse("8x1x64x16x1"), Some(Shape::new(8, 1, 64, 16, 1)));
        assert_eq!(Shape::parse("8x1x64"), None);
        let big = Config { fwd: Shape::new(8, 1, 128, 64, 1), ..Config::default_for(64) };
        assert!(big.check(64).unwrap_err().contains("shared memory"), "two 128-key stages of k and v exceed 48 KiB");
        let odd = Config { dq: Shape::new(4, 2, 64, 24, 1), ..Config::default_for(64) };
        assert!(odd.check(64).is_err(), "chunks are whole 16-row steps");
    }

    #[test]
    fn the_hopper_kernels_are_chosen_by_the_compiled_architecture() {
        use crate::flash::geometry;
        use fusec_ir::DType;
        // Only sm_90a (and head size 64) takes the wgmma kernels.
        let (plain, hopper) = (geometry(64, DType::BF16, "sm_90"), geometry(64, DType::BF16, "sm_90a"));
        assert!(plain.iter().all(|g| g.shared == 0));
        assert_eq!((hopper[0].threads, hopper[0].rows, hopper[0].shared), (WG_THREADS, WG_ROWS, 0));
        assert_eq!((hopper[1].threads, hopper[1].rows, hopper[1].shared), (WG_THREADS, WG_ROWS, DQ_WG_SHARED));
        assert_eq!((hopper[2].threads, hopper[2].rows, hopper[2].shared), (128, 64, DKV_WG_SHARED));
        assert_eq!(geometry(128, DType::BF16, "sm_90a"), geometry(128, DType::BF16, "sm_90"));
        // The source carries both families, the Hopper one behind sm_90a's feature macro.
        let src = source(64, &Config::default_for(64));
        let (hop, other) = (src.find("#if defined(__CUDA_ARCH_FEAT_SM90_ALL)").expect("the Hopper branch"), src.find("\n#else\n").expect("the other"));
        let kernels = |s: &str| s.matches("extern \"C\" __global__").count();
        assert_eq!((kernels(&src[hop..other]), kernels(&src[other..])), (3, 3));
        assert!(!source(128, &Config::default_for(128)).contains("__CUDA_ARCH_FEAT_SM90_ALL"));
    }
}
