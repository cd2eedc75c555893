//! Attention launches on the CPU: the per-head score scratch of [`ops::attention_stage`], and
//! bf16 storage. The stages compute in f32; on bf16 tensors a widening launch first copies
//! `qkv` (and in the backward `out` and `dout`) into f32 scratch, the stages run there, and a
//! narrowing launch rounds `out` (forward) or `dqkv` (backward) to bf16, nearest even: one
//! rounding of each result, as the interpreter's attention rounds its results once.

use fusec_codegen_cpu::gemm::{bf16_bits, widen_bits};
use fusec_ir::DType;
use rayon::prelude::*;

use super::ops::{self, AttnPtrs, AttnStage};
use crate::launches::Attention;

/// Elements per parallel conversion chunk.
const CHUNK: usize = 1 << 14;

/// Scratch shared by every attention launch (launches run one at a time), sized once for the
/// largest attention of the programs. Written only through the pointers taken when it was
/// allocated (launches hold `&self`).
pub struct AttnScratch {
    /// Per-head `p` then `ds` (`S * H * T * T` floats each).
    _scores: Vec<f32>,
    /// For bf16 storage: `qkv`, `out`, `dout`, `dqkv` widened (`8 * S * T * C` floats).
    _wide: Vec<f32>,
    scores: *mut f32,
    wide: *mut f32,
}

impl AttnScratch {
    /// Scratch for these attention launches.
    pub fn new<'a>(attns: impl Iterator<Item = &'a Attention>) -> AttnScratch {
        let (mut scores, mut wide) = (0, 0);
        for a in attns {
            let dm = a.dims;
            scores = scores.max(2 * dm.s * dm.h * dm.t * dm.t);
            if a.dtype == DType::BF16 {
                wide = wide.max(8 * dm.s * dm.t * dm.h * dm.d);
            }
        }
        let (mut s, mut w) = (vec![0.0; scores], vec![0.0; wide]);
        let (scores, wide) = (s.as_mut_ptr(), w.as_mut_ptr());
        AttnScratch { _scores: s, _wide: w, scores, wide }
    }

    /// The f32 copies of a bf16 attention's tensors: `(qkv, out, dout, dqkv)`.
    fn wide(&self, a: &Attention) -> (*mut f32, *mut f32, *mut f32, *mut f32) {
        let n = a.dims.s * a.dims.t * a.dims.h * a.dims.d;
        let w = self.wide;
        // SAFETY: `wide` holds `8 n` floats for every bf16 attention (see `new`).
        unsafe { (w, w.add(3 * n), w.add(4 * n), w.add(5 * n)) }
    }

    /// Runs one stage of `a` over the allocation at `base`.
    ///
    /// # Safety
    /// The attention's offsets must lie inside the allocation; for bf16 storage the widening
    /// launch must have run first.
    pub unsafe fn stage(&self, base: *mut u8, stage: AttnStage, a: &Attention) {
        let at = |o: u64| base.add(o as usize) as *mut f32;
        let t = a.at;
        let heads = a.dims.s * a.dims.h * a.dims.t * a.dims.t;
        let scores = self.scores;
        let (p, ds, lse) = (scores, scores.add(heads), at(t.lse));
        let ptrs = if a.dtype == DType::BF16 {
            let (qkv, out, dout, dqkv) = self.wide(a);
            AttnPtrs { qkv, out, lse, dout, dqkv, p, ds }
        } else {
            let dout = t.dout.map_or(std::ptr::null(), |o| at(o) as *const f32);
            let dqkv = t.dqkv.map_or(std::ptr::null_mut(), at);
            AttnPtrs { qkv: at(t.qkv), out: at(t.out), lse, dout, dqkv, p, ds }
        };
        ops::attention_stage(stage, a.dims, a.scale, ptrs)
    }

    /// Widens the bf16 tensors that `a`'s stages read into the scratch (`widen`), or rounds the
    /// one they write back to bf16.
    ///
    /// # Safety
    /// The attention's offsets must lie inside the allocation at `base` and hold bf16.
    pub unsafe fn convert(&self, base: *mut u8, a: &Attention, widen: bool) {
        let n = a.dims.s * a.dims.t * a.dims.h * a.dims.d;
        let bits = |o: u64, len: usize| std::slice::from_raw_parts_mut(base.add(o as usize) as *mut u16, len);
        let (qkv, out, dout, dqkv) = self.wide(a);
        let f = |p: *mut f32, len: usize| std::slice::from_raw_parts_mut(p, len);
        let t = a.at;
        match (widen, a.forward) {
            (true, _) => {
                to_f32(bits(t.qkv, 3 * n), f(qkv, 3 * n));
                if let Some(d) = t.dout {
                    to_f32(bits(t.out, n), f(out, n));
                    to_f32(bits(d, n), f(dout, n));
                }
            }
            (false, true) => to_bf16(f(out, n), bits(t.out, n)),
            (false, false) => {
                if let Some(d) = t.dqkv {
                    to_bf16(f(dqkv, 3 * n), bits(d, 3 * n))
                }
            }
        }
    }
}

/// `dst = src` widened, in parallel chunks.
fn to_f32(src: &[u16], dst: &mut [f32]) {
    dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d = widen_bits(*s)));
}

/// `dst = src` rounded to bf16, in parallel chunks.
fn to_bf16(src: &[f32], dst: &mut [u16]) {
    dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d = bf16_bits(*s)));
}
