//! Hand-written CUDA C for the ops that stay their own launches after fusion, in one module.
//!
//! - `fusec_gather`: embedding rows, one thread per output element; an index outside the table
//!   writes 0 and raises the error word (`err[0] = 1`, `err[1]` the index, `err[2]` the position).
//! - `fusec_scatter_add`: the adjoint, deterministic: each block owns [`SCATTER_ROWS`] output
//!   rows, zeroes them, then scans the indices in order (256 a step, warp ballots) and adds each
//!   matching source row; a thread owns its columns, so every output element is `0 + src[s0] +
//!   src[s1] + ...` in increasing `s`, exactly the CPU's and the interpreter's order.
//! - Causal attention around cuBLAS products (the runtime runs `q k^T`, `p v` and the backward
//!   products as batched GEMMs): `fusec_attn_softmax` (row max, sum of `exp`, the log-sum-exp
//!   saved, `p = exp(scale s - lse)` below the diagonal, 0 above), `fusec_attn_probs` (`p` again
//!   from the saved log-sum-exp, for the backward) and `fusec_attn_dscores`
//!   (`ds = scale p (dp - rowsum(dout * out))`, 0 above the diagonal). One warp per score row,
//!   shuffle reductions in a fixed order.
//! - `fusec_iota_f32` / `fusec_iota_i32`: `out[i] = (i / inner) % len`.
//! - `fusec_gemm_epilogue`: after a cuBLAS product, `t (+ bias[c])`, GELU with the
//!   pre-activation saved, `acc + t`, in `Op::Gemm`'s order (flags 1 bias, 2 GELU, 4 accumulate).
//! - `fusec_gemm_epilogue_mixed`: the same after an f32 product when some of it is bf16 (the
//!   [`EPILOGUE_BIAS_BF16`], [`EPILOGUE_PRE_BF16`], [`EPILOGUE_Y_BF16`] flags): loads widen,
//!   the arithmetic stays f32 and only the stores round (as the CPU backend's bf16 products);
//!   a bf16 result accumulates as the IR orders it, `acc + round(t)` rounded again.
//!
//! Fills are driver memsets (`cuMemsetD32`), not kernels.

use crate::emit::float_lit;

/// Output rows per block of `fusec_scatter_add`.
pub const SCATTER_ROWS: u32 = 16;
/// Score rows per block (one warp each) of the attention kernels.
pub const ATTN_ROWS_PER_BLOCK: u32 = 8;

/// `fusec_gemm_epilogue_mixed` flag: the bias is bf16.
pub const EPILOGUE_BIAS_BF16: i32 = 8;
/// `fusec_gemm_epilogue_mixed` flag: the pre-activation is stored as bf16.
pub const EPILOGUE_PRE_BF16: i32 = 16;
/// `fusec_gemm_epilogue_mixed` flag: the result (and the accumulator) are bf16.
pub const EPILOGUE_Y_BF16: i32 = 32;

/// The module's name (for error messages and the profiler).
pub const NAME: &str = "fusec_native";

/// The CUDA C of the hand-written kernels (with the generated kernels' prelude).
pub fn source() -> String {
    let scale = ((2.0f64 / std::f64::consts::PI) as f32).sqrt();
    let mut s = format!("// {NAME} (fusec: {})\n", crate::CODEGEN_REVISION);
    s.push_str(crate::prelude::PRELUDE);
    s.push_str(&BODY.replace("GELU_SCALE", &float_lit(scale)).replace("SCATTER_ROWS", &SCATTER_ROWS.to_string()));
    s
}

const BODY: &str = r#"__device__ __forceinline__ float gelu_f(float x) {
  const float kx = 0.044715f * x;
  const float kxx = kx * x;
  const float cube = kxx * x;
  const float inner = x + cube;
  const float t = tanhf(GELU_SCALE * inner);
  const float hx = 0.5f * x;
  return hx * (1.0f + t);
}
extern "C" __global__ void __launch_bounds__(256) fusec_gather(const float* table, const int* idx, float* out, int rows, int cols, long long n, int* err) {
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  if (i >= n * cols) return;
  const long long s = i / cols;
  const int c = (int)(i % cols);
  const int t = idx[s];
  if (t < 0 || t >= rows) {
    err[0] = 1; err[1] = t; err[2] = (int)s;
    out[i] = 0.0f;
    return;
  }
  out[i] = table[(long long)t * cols + c];
}
extern "C" __global__ void __launch_bounds__(256) fusec_scatter_add(const float* src, const int* idx, float* out, int rows, int cols, int n, int* err) {
  __shared__ unsigned masks[8];
  const int v0 = blockIdx.x * SCATTER_ROWS;
  const int nv = min(SCATTER_ROWS, rows - v0);
  for (int v = 0; v < nv; ++v)
    for (int c = threadIdx.x; c < cols; c += 256) out[(long long)(v0 + v) * cols + c] = 0.0f;
  for (int base = 0; base < n; base += 256) {
    const int s = base + threadIdx.x;
    const int t = s < n ? idx[s] : -1;
    if (blockIdx.x == 0 && s < n && (t < 0 || t >= rows)) { err[0] = 1; err[1] = t; err[2] = s; }
    const unsigned m = __ballot_sync(0xffffffffu, t >= v0 && t < v0 + nv);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) masks[threadIdx.x >> 5] = m;
    __syncthreads();
    for (int w = 0; w < 8; ++w) {
      unsigned mm = masks[w];
      while (mm) {
        const int b = __ffs(mm) - 1;
        mm &= mm - 1;
        const int ss = base + w * 32 + b;
        const float* sr = src + (long long)ss * cols;
        float* o = out + (long long)idx[ss] * cols;
        for (int c = threadIdx.x; c < cols; c += 256) o[c] = o[c] + sr[c];
      }
    }
  }
}
extern "C" __global__ void __launch_bounds__(256) fusec_attn_softmax(float* sc, float* lse, int T, long long nrows, float scale) {
  const long long row = (long long)blockIdx.x * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= nrows) return;
  const int i = (int)(row % T);
  float* x = sc + row * T;
  float mx = __uint_as_float(0xff800000u);
  for (int j = lane; j <= i; j += 32) mx = max_nan(mx, scale * x[j]);
  mx = team_max<32>(mx, 0);
  float sum = 0.0f;
  for (int j = lane; j <= i; j += 32) sum = sum + expf(scale * x[j] - mx);
  sum = team_sum<32>(sum, 0);
  const float l = mx + logf(sum);
  if (lane == 0) lse[row] = l;
  for (int j = lane; j < T; j += 32) x[j] = j <= i ? expf(scale * x[j] - l) : 0.0f;
}
extern "C" __global__ void __launch_bounds__(256) fusec_attn_probs(float* sc, const float* lse, int T, long long nrows, float scale) {
  const long long row = (long long)blockIdx.x * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= nrows) return;
  const int i = (int)(row % T);
  float* x = sc + row * T;
  const float l = lse[row];
  for (int j = lane; j < T; j += 32) x[j] = j <= i ? expf(scale * x[j] - l) : 0.0f;
}
extern "C" __global__ void __launch_bounds__(256) fusec_attn_dscores(const float* p, float* dp, const float* out, const float* dout, int T, int H, int D, long long nrows, float scale) {
  const long long row = (long long)blockIdx.x * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= nrows) return;
  const int i = (int)(row % T);
  const long long bh = row / T;
  const long long s = bh / H;
  const int h = (int)(bh % H);
  const long long at = (s * T + i) * (long long)(H * D) + (long long)h * D;
  float dsum = 0.0f;
  for (int d = lane; d < D; d += 32) dsum = dsum + dout[at + d] * out[at + d];
  dsum = team_sum<32>(dsum, 0);
  const float* pr = p + row * T;
  float* x = dp + row * T;
  for (int j = lane; j < T; j += 32) x[j] = j <= i ? scale * pr[j] * (x[j] - dsum) : 0.0f;
}
extern "C" __global__ void __launch_bounds__(256) fusec_iota_f32(float* out, long long n, long long inner, long long len) {
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  if (i < n) out[i] = (float)((i / inner) % len);
}
extern "C" __global__ void __launch_bounds__(256) fusec_iota_i32(int* out, long long n, long long inner, long long len) {
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  if (i < n) out[i] = (int)((i / inner) % len);
}
extern "C" __global__ void __launch_bounds__(256) fusec_gemm_epilogue(float* y, const float* src, const float* bias, float* pre, const float* acc, long long total, int n, int flags) {
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  if (i >= total) return;
  float t = src[i];
  if (flags & 1) t = t + bias[i % n];
  if (flags & 2) { pre[i] = t; t = gelu_f(t); }
  if (flags & 4) t = acc[i] + t;
  y[i] = t;
}
extern "C" __global__ void __launch_bounds__(256) fusec_gemm_epilogue_mixed(void* y, const float* src, const void* bias, void* pre, const void* acc, long long total, int n, int flags) {
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  if (i >= total) return;
  float t = src[i];
  if (flags & 1) t = t + ((flags & 8) ? bf16_to_f32(((const unsigned short*)bias)[i % n]) : ((const float*)bias)[i % n]);
  if (flags & 2) {
    if (flags & 16) ((unsigned short*)pre)[i] = f32_to_bf16(t); else ((float*)pre)[i] = t;
    t = gelu_f(t);
  }
  if (flags & 32) {
    if (flags & 4) t = bf16_to_f32(((const unsigned short*)acc)[i]) + round_bf16(t);
    ((unsigned short*)y)[i] = f32_to_bf16(t);
  } else {
    if (flags & 4) t = ((const float*)acc)[i] + t;
    ((float*)y)[i] = t;
  }
}
"#;
