//! The bf16 classifier as one hand-written kernel: `cast` of bf16 logits, `cross_entropy_with_grad`
//! with a scalar `dloss`, and the `cast` of the gradient back to bf16 (the kernel that
//! `fuse-elementwise` names `cast_cross_entropy_with_grad` in a bf16 step).
//!
//! The generated row kernel reads each row of logits from DRAM twice (an online pass for the
//! maximum and the sum, then the gradient pass), which bounds it at about 1.19 ms for GPT-2's
//! `[16384, 50304]` on an H200. Here a block of 512 threads takes a row, copies the whole row
//! (100 KiB) into shared memory with `cp.async` (every load in flight at once, no registers
//! held), and makes three cheap passes over the copy: the maximum on packed bf16 pairs
//! (`max.NaN.bf16x2`), the sum of `exp2(x log2e - max log2e)`, and the gradient written two
//! values at a time (`cvt.rn.bf16x2.f32`); padding columns and the target's column only in
//! their own 8-column chunks. Two such blocks fit an SM on sm_90 (one loads while the other
//! computes): 0.80 ms, against 0.78 ms for a plain copy of the same bytes (H200 harness).
//!
//! Each thread reads back only the 16-byte chunks it copied itself, so no barrier orders the
//! copies; the team reductions' barriers come after every thread's wait. The gradient may be
//! written over the logits (the memory plan's in-place result): a row is copied, and its
//! target's logit read, before any of its gradient is stored, and no block touches another's
//! row. The sums run in a fixed order per shape: same inputs, same bits.

use std::fmt::Write;

use fusec_ir::{Bindings, DType, Kernel, Op};

use crate::emit::LaunchRule;
use crate::KernelSource;

/// Threads a row.
const THREADS: u32 = 512;
/// The most dynamic shared memory a block may opt into on every sm_80+ GPU (sm_86/sm_89:
/// 99 KiB): the longest row taken here is that many bytes of bf16.
const MAX_ROW_BYTES: u64 = 99 * 1024;

/// The kernel of `k` when it is exactly the bf16 classifier (see the module docs) and its rows
/// fit in shared memory; `None` sends it to the generated row kernel.
pub(crate) fn source(k: &Kernel, bind: &Bindings) -> Option<KernelSource> {
    let (rows, vp, vocab) = shape(k, bind)?;
    if vp % 8 != 0 || vp > MAX_ROW_BYTES / 2 || vocab > vp || rows == 0 {
        return None;
    }
    let grid = crate::grid_1d(rows).ok()?;
    let name = crate::ident(&k.name);
    let mut src = String::new();
    let _ = writeln!(src, "// {} (fusec: {}); hand-written bf16 classifier", k.name, crate::CODEGEN_REVISION);
    src.push_str(crate::prelude::PRELUDE);
    src.push_str(&KERNEL.replace("NAME", &name).replace("VP", &vp.to_string()).replace("VOCAB", &vocab.to_string()));
    Some(KernelSource {
        name: k.name.clone(),
        ident: name.clone(),
        source: src,
        launches: vec![LaunchRule { entry: name, grid, block: [THREADS, 1, 1], shared: (vp * 2) as u32 }],
        scratch_bytes: 0,
        // max, exp and sum, exp and scale a column (as the profiler counts: about)
        flops: rows * vocab * 8,
        param_table: false,
    })
}

/// `(rows, padded vocabulary, vocabulary)` when `k`'s body is the bf16 classifier.
fn shape(k: &Kernel, bind: &Bindings) -> Option<(u64, u64, u64)> {
    let g = &k.body;
    let inputs: Vec<_> = g.nodes.iter().filter(|n| matches!(n.op, Op::Input { .. })).map(|n| n.results[0]).collect();
    let [logits, targets, dloss] = inputs[..] else { return None };
    let dtypes = [logits, targets, dloss].map(|v| g.ty(v).dtype);
    if dtypes != [DType::BF16, DType::I32, DType::F32] || !g.ty(dloss).shape.dims().is_empty() {
        return None;
    }
    let ops: Vec<_> = g.nodes.iter().filter(|n| !matches!(n.op, Op::Input { .. })).collect();
    let [widen, bcast, ce, narrow] = ops[..] else { return None };
    let vocab = match (&widen.op, &bcast.op, &ce.op, &narrow.op) {
        (Op::Cast { to: DType::F32 }, Op::Broadcast { dims, .. }, Op::CrossEntropyWithGrad { vocab }, Op::Cast { to: DType::BF16 })
            if dims.is_empty() => *vocab,
        _ => return None,
    };
    let wired = widen.inputs[..] == [logits]
        && bcast.inputs[..] == [dloss]
        && ce.inputs[..] == [widen.results[0], targets, bcast.results[0]]
        && narrow.inputs[..] == [ce.results[1]];
    let outs: Vec<_> = g.outputs.iter().map(|(_, v)| *v).collect();
    if !wired || outs[..] != [ce.results[0], narrow.results[0]] {
        return None;
    }
    let dims = g.ty(logits).shape.eval(bind).ok()?;
    let vp = *dims.last()? as u64;
    let rows = g.ty(targets).shape.eval_numel(bind).ok()?;
    (rows.checked_mul(vp)? == g.ty(logits).shape.eval_numel(bind).ok()?).then_some((rows, vp, vocab))
}

/// The kernel (`NAME`, `VP`, `VOCAB` substituted); the prelude gives `bf16_to_f32`,
/// `f32_to_bf16`, `max_nan` and `team_max`/`team_sum`.
const KERNEL: &str = r#"__device__ __forceinline__ unsigned max2_nan(unsigned a, unsigned b) {
  unsigned d;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ float ex2f(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  unsigned d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
extern "C" __global__ void __launch_bounds__(512, 2) NAME(const unsigned short* in0, const int* in1, const float* in2, float* out0, unsigned short* out1, float* scratch) {
  extern __shared__ __align__(16) uint4 row[];
  __shared__ float sh[16];
  const int NCH = VP / 8, FULL = VOCAB / 8;
  const float L2E = 1.44269504f;
  const long long r = blockIdx.x;
  const int lane = threadIdx.x;
  const unsigned short* x = in0 + r * VP;
  for (int k = lane; k < NCH; k += 512) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(&row[k]);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(a), "l"(x + k * 8) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  const int tgt = in1[r];
  const float dloss = in2[0];
  const float xt = (tgt >= 0 && tgt < VP) ? bf16_to_f32(x[tgt]) : 0.0f;
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  unsigned m2 = 0xff80ff80u;
  float mt = __uint_as_float(0xff800000u);
  for (int k = lane; k < NCH; k += 512) {
    const uint4 q = row[k];
    if (k < FULL) {
      m2 = max2_nan(m2, max2_nan(max2_nan(q.x, q.y), max2_nan(q.z, q.w)));
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) if (k * 8 + j < VOCAB) mt = max_nan(mt, bf16_to_f32(((const unsigned short*)&q)[j]));
    }
  }
  const float M = team_max<512>(max_nan(max_nan(__uint_as_float(m2 << 16), __uint_as_float(m2 & 0xffff0000u)), mt), sh);
  const float ML = M * L2E;
  float s0 = 0.0f, s1 = 0.0f;
  for (int k = lane; k < NCH; k += 512) {
    const uint4 q = row[k];
    if (k < FULL) {
      const unsigned* w = (const unsigned*)&q;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s0 += ex2f(fmaf(__uint_as_float(w[j] << 16), L2E, -ML));
        s1 += ex2f(fmaf(__uint_as_float(w[j] & 0xffff0000u), L2E, -ML));
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) if (k * 8 + j < VOCAB) s0 += ex2f(fmaf(bf16_to_f32(((const unsigned short*)&q)[j]), L2E, -ML));
    }
  }
  const float S = team_sum<512>(s0 + s1, sh);
  const float inv = 1.0f / S;
  for (int k = lane; k < NCH; k += 512) {
    const uint4 q = row[k];
    const int c0 = k * 8;
    uint4 o;
    if (k < FULL && (unsigned)(tgt - c0) >= 8u) {
      const unsigned* w = (const unsigned*)&q;
      unsigned* ow = (unsigned*)&o;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float lo = ex2f(fmaf(__uint_as_float(w[j] << 16), L2E, -ML)) * inv * dloss;
        const float hi = ex2f(fmaf(__uint_as_float(w[j] & 0xffff0000u), L2E, -ML)) * inv * dloss;
        ow[j] = pack_bf16x2(lo, hi);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int c = c0 + j;
        const float p = ex2f(fmaf(bf16_to_f32(((const unsigned short*)&q)[j]), L2E, -ML)) * inv;
        ((unsigned short*)&o)[j] = f32_to_bf16(c < VOCAB ? (c == tgt ? p - 1.0f : p) * dloss : 0.0f);
      }
    }
    st_b32x4(&out1[r * VP + c0], o);
  }
  if (lane == 0) out0[r] = M + logf(S) - xt;
}
"#;
