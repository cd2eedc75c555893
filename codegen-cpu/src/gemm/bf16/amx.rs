//! The AMX micro-kernel of the packed path ([`Micro`]): `tdpbf16ps` on 16 x 16 tiles of f32
//! sums (Intel Sapphire Rapids and later). A 32 x 32 block of sums is four tiles (`tmm0..3`),
//! fed per 16 k pairs by two tiles of `a` rows (`tmm4`, `tmm5`: 16 rows of 16 pairs each) and
//! two of `b` columns (`tmm6`, `tmm7`: 16 pairs of 16 columns each, the layout the packed `b`
//! panels already have). So `a` panels are packed row by row (`A_ROWS`) and k is padded to 16
//! pairs (`KPAD`) with zeros.
//!
//! Linux hands a process the tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`), asked once by [`amx_permitted`]; without it the first tile
//! instruction would fault, so [`crate::isa::Isa::Amx`] is supported only where it was
//! granted. Each call loads its tile configuration (`ldtilecfg`) first: the configuration is
//! per thread, and the kernels of other levels never touch it.

use std::sync::OnceLock;

use super::packed::{pack_pair, Micro};

/// AMX-BF16 tiles: 32 x 32 sums, k in pairs, 16 pairs a tile step.
pub(super) struct Amx;

impl Micro for Amx {
    const MR: usize = 32;
    const NR: usize = 32;
    const KU: usize = 2;
    const MC: usize = 96;
    const KC: usize = 128;
    const KPAD: usize = 16;
    const A_ROWS: bool = true;

    fn pack(lo: u16, hi: u16) -> u32 {
        pack_pair(lo, hi)
    }

    unsafe fn kernel(a: *const u32, b: *const u32, kc: usize, c: *mut f32, ldc: usize, first: bool) {
        tiles(a, b, kc, c, ldc, first)
    }
}

/// The tile configuration: palette 1, eight tiles of 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

const CONFIG: Config = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64;
        c[48 + t] = 16;
        t += 1;
    }
    Config(c)
};

/// `c[32 x 32] (= or +=) a · b` over `kc` pair steps (a multiple of 16): `a` is 32 rows of
/// `kc` pairs, `b` is `kc` steps of 32 columns' pairs.
unsafe fn tiles(a: *const u32, b: *const u32, kc: usize, c: *mut f32, ldc: usize, first: bool) {
    use std::arch::asm;
    let (sa, sb, sc) = (kc * 4, 32 * 4usize, ldc * 4);
    let (c1, c2, c3) = (c.add(16), c.add(16 * ldc), c.add(16 * ldc + 16));
    asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
    if first {
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
    } else {
        asm!(
            "tileloadd tmm0, [{c0} + {s}]",
            "tileloadd tmm1, [{c1} + {s}]",
            "tileloadd tmm2, [{c2} + {s}]",
            "tileloadd tmm3, [{c3} + {s}]",
            c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3, s = in(reg) sc,
            options(nostack, readonly)
        );
    }
    for q in (0..kc).step_by(16) {
        asm!(
            "tileloadd tmm4, [{a0} + {sa}]",
            "tileloadd tmm5, [{a1} + {sa}]",
            "tileloadd tmm6, [{b0} + {sb}]",
            "tileloadd tmm7, [{b1} + {sb}]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) a.add(q), a1 = in(reg) a.add(16 * kc + q), sa = in(reg) sa,
            b0 = in(reg) b.add(q * 32), b1 = in(reg) b.add(q * 32 + 16), sb = in(reg) sb,
            options(nostack, readonly)
        );
    }
    asm!(
        "tilestored [{c0} + {s}], tmm0",
        "tilestored [{c1} + {s}], tmm1",
        "tilestored [{c2} + {s}], tmm2",
        "tilestored [{c3} + {s}], tmm3",
        c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3, s = in(reg) sc,
        options(nostack)
    );
}

/// Whether this process may use AMX tiles: asks Linux once (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`; granted to the whole process). False elsewhere.
pub fn amx_permitted() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        #[cfg(target_os = "linux")]
        {
            const ARCH_PRCTL: usize = 158;
            const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
            const XFEATURE_XTILEDATA: usize = 18;
            let ret: isize;
            // SAFETY: the arch_prctl system call with two integer arguments; it only changes
            // which state the kernel saves for this process.
            unsafe {
                std::arch::asm!(
                    "syscall",
                    inlateout("rax") ARCH_PRCTL as isize => ret,
                    in("rdi") ARCH_REQ_XCOMP_PERM,
                    in("rsi") XFEATURE_XTILEDATA,
                    lateout("rcx") _, lateout("r11") _,
                    options(nostack)
                );
            }
            ret == 0
        }
        #[cfg(not(target_os = "linux"))]
        {
            false
        }
    })
}

#[cfg(test)]
mod tests {
    //! The AMX kernel runs only on hosts with AMX (the device's Xeon: `tests/gemm_bf16.rs`
    //! there). Here the packing and the padded k blocks it relies on run on every host through
    //! a scalar kernel that reads the same layout as the tiles do.

    use super::super::packed::{pack_pair, tile, Micro};
    use super::super::shared::{run, run_within, Shared};
    use super::super::{gemm_bf16_on, widen_bits, Bf16Out, Job, Out};
    use super::Amx;
    use crate::gemm::{Raw, Tiling};
    use crate::isa::Isa;
    use fusec_ir::rng::Rng;
    use fusec_ir::GemmSpec;
    use half::bf16;

    /// [`Amx`]'s blocking and packing with a scalar kernel: `a` rows of `kc` pairs, `b` steps
    /// of 32 columns' pairs, each pair's two products added in order.
    struct Layout;

    impl Micro for Layout {
        const MR: usize = Amx::MR;
        const NR: usize = Amx::NR;
        const KU: usize = Amx::KU;
        const MC: usize = Amx::MC;
        const KC: usize = Amx::KC;
        const KPAD: usize = Amx::KPAD;
        const A_ROWS: bool = Amx::A_ROWS;

        fn pack(lo: u16, hi: u16) -> u32 {
            pack_pair(lo, hi)
        }

        unsafe fn kernel(a: *const u32, b: *const u32, kc: usize, c: *mut f32, ldc: usize, first: bool) {
            assert_eq!(kc % 16, 0, "k padded to whole tiles");
            let half = |p: u32, hi: bool| widen_bits(if hi { (p >> 16) as u16 } else { p as u16 });
            for i in 0..Self::MR {
                for j in 0..Self::NR {
                    let mut s = if first { 0.0 } else { *c.add(i * ldc + j) };
                    for q in 0..kc {
                        let (pa, pb) = (*a.add(i * kc + q), *b.add(q * Self::NR + j));
                        s += half(pa, false) * half(pb, false) + half(pa, true) * half(pb, true);
                    }
                    *c.add(i * ldc + j) = s;
                }
            }
        }
    }

    #[test]
    fn rows_packed_for_tiles_give_the_product_at_every_padding() {
        let mut rng = Rng::new(7);
        // Odd k (a half pair), k not a whole tile, k past one block of pairs; rows and columns
        // past the 32 x 32 blocks; transposed operands and a batch.
        for (batch, m, n, k, ta, tb) in [(1, 40, 33, 7, false, false), (2, 70, 64, 300, true, false), (1, 33, 97, 517, false, true), (1, 96, 32, 32, true, true), (2, 70, 256, 600, true, false), (1, 300, 300, 33, false, true), (1, 300, 300, 800, false, true)] {
            let mut s = GemmSpec::new(m, n, k);
            (s.batch, s.trans_a, s.trans_b, s.b_shared) = (batch, ta, tb, false);
            let a: Vec<bf16> = (0..batch * m * k).map(|_| bf16::from_f32(rng.normal() as f32)).collect();
            let b: Vec<bf16> = (0..batch * k * n).map(|_| bf16::from_f32(rng.normal() as f32)).collect();
            let mut want = vec![0f32; batch * m * n];
            gemm_bf16_on(Isa::Scalar, &s, &a, &b, None, Bf16Out::F32(&mut want), None, 1);
            let mut got = vec![0f32; batch * m * n];
            let job = Job {
                spec: s,
                tiling: Tiling::new(&s),
                a: Raw(a.as_ptr().cast_mut() as *mut u16),
                b: Raw(b.as_ptr().cast_mut() as *mut u16),
                bias: None,
                y: Out::F32(Raw(got.as_mut_ptr())),
                pre: None,
                isa: Isa::Scalar,
            };
            for t in 0..job.tiling.tasks() {
                // SAFETY: the operands and result cover the spec; one task at a time.
                unsafe { tile::<Layout>(&job, t, &Shared::default()) };
            }
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{batch}x{m}x{n}x{k} ({ta}, {tb}): [{i}] {g} vs {w}");
            }
            // Operands packed once for all tiles: the same sums in the same order.
            let mut shared = vec![0f32; batch * m * n];
            let job = Job { y: Out::F32(Raw(shared.as_mut_ptr())), ..job };
            // SAFETY: as above, the tasks on two threads.
            unsafe { run::<Layout>(&job, 2) };
            assert!(shared.iter().zip(&got).all(|(s, g)| s.to_bits() == g.to_bits()), "{batch}x{m}x{n}x{k}: shared packing changed bits");
            // A small limit: `op(b)` shared a chunk of k blocks at a time where it has several.
            let job = Job { y: Out::F32(Raw(shared.as_mut_ptr())), ..job };
            shared.fill(f32::NAN);
            // SAFETY: as above.
            unsafe { run_within::<Layout>(&job, 2, 440_000) };
            assert!(shared.iter().zip(&got).all(|(s, g)| s.to_bits() == g.to_bits()), "{batch}x{m}x{n}x{k}: chunked packing changed bits");
        }
    }
}
