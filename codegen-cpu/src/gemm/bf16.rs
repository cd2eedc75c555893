//! bf16 products: operands widened to f32 in thread-local scratch, multiplied by
//! [`gemm_f32`](super::gemm_f32), results narrowed.

use super::{check, gemm_f32};
use fusec_ir::GemmSpec;
use half::bf16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use std::cell::RefCell;

/// Where [`gemm_bf16`] writes `y`: the `gemm` node's `out` dtype.
pub enum Bf16Out<'a> {
    /// An f32 result (`out = f32`); accumulation adds in f32.
    F32(&'a mut [f32]),
    /// A bf16 result (`out = bf16`): the value is rounded to bf16, then, when accumulating,
    /// added to the bf16 accumulator in f32 and rounded again (cast, then add, as in the IR).
    Bf16(&'a mut [bf16]),
}

/// Reusable per-thread buffers (grown, never shrunk).
#[derive(Default)]
struct Scratch {
    a: Vec<f32>,
    b: Vec<f32>,
    bias: Vec<f32>,
    y: Vec<f32>,
    pre: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `v[..len]`, growing `v` first if needed.
fn take(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

/// Elements per parallel conversion chunk.
const CHUNK: usize = 1 << 16;

/// `dst = src` widened, in parallel chunks when `threads > 1`.
fn widen(src: &[bf16], dst: &mut [f32], threads: usize) {
    if threads > 1 && src.len() > CHUNK {
        dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| s.convert_to_f32_slice(d));
    } else {
        src.convert_to_f32_slice(dst);
    }
}

/// `dst = src` rounded to nearest even, in parallel chunks when `threads > 1`.
fn narrow(src: &[f32], dst: &mut [bf16], threads: usize) {
    if threads > 1 && src.len() > CHUNK {
        dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| d.convert_from_f32_slice(s));
    } else {
        dst.convert_from_f32_slice(src);
    }
}

/// [`gemm_f32`] for bf16 operands (`a`, `b`, `bias`) and pre-activation (`pre_gelu`), with
/// `y` in f32 or bf16 per [`Bf16Out`].
///
/// Operands are widened to f32 (exactly) in this thread's scratch and multiplied in f32; the
/// bias add and GELU also run in f32, and only the results are rounded to bf16. This is more
/// precise than rounding after every step, and within the bf16 tolerance (`1e-2`) of the IR.
///
/// # Panics
/// If a slice length does not match the spec.
pub fn gemm_bf16(
    spec: &GemmSpec,
    a: &[bf16],
    b: &[bf16],
    bias: Option<&[bf16]>,
    y: Bf16Out<'_>,
    pre_gelu: Option<&mut [bf16]>,
    threads: usize,
) {
    let y_len = match &y {
        Bf16Out::F32(v) => v.len(),
        Bf16Out::Bf16(v) => v.len(),
    };
    check(spec, a.len(), b.len(), bias.map(<[bf16]>::len), y_len, pre_gelu.as_deref().map(<[bf16]>::len));
    SCRATCH.with(|cell| {
        let mut guard = cell.borrow_mut();
        let s = &mut *guard;
        let a32 = take(&mut s.a, a.len());
        widen(a, a32, threads);
        let b32 = take(&mut s.b, b.len());
        widen(b, b32, threads);
        let bias32 = bias.map(|bias| {
            let v = take(&mut s.bias, bias.len());
            widen(bias, v, 1);
            &*v
        });
        let mut pre32 = spec.gelu.then(|| take(&mut s.pre, spec.y_len()));
        match y {
            Bf16Out::F32(y) => gemm_f32(spec, a32, b32, bias32, y, pre32.as_deref_mut(), threads),
            Bf16Out::Bf16(y) => {
                let y32 = take(&mut s.y, spec.y_len());
                gemm_f32(&GemmSpec { accumulate: false, ..*spec }, a32, b32, bias32, y32, pre32.as_deref_mut(), threads);
                if spec.accumulate {
                    let add = |(d, v): (&mut [bf16], &[f32])| {
                        for (d, v) in d.iter_mut().zip(v) {
                            *d = bf16::from_f32(d.to_f32() + bf16::from_f32(*v).to_f32());
                        }
                    };
                    if threads > 1 {
                        y.par_chunks_mut(CHUNK).zip(y32.par_chunks(CHUNK)).for_each(add);
                    } else {
                        add((y, y32));
                    }
                } else {
                    narrow(y32, y, threads);
                }
            }
        }
        if let (Some(dst), Some(src)) = (pre_gelu, pre32) {
            narrow(src, dst, threads);
        }
    });
}
