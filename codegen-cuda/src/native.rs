//! Hand-written CUDA C for the ops that stay their own launches after fusion, in one module.
//!
//! - `fusec_gather`: embedding rows, a `float4` a thread (one element where rows are not whole
//!   `float4`s); an index outside the table writes 0 and raises the error word (`err[0] = 1`,
//!   `err[1]` the index, `err[2]` the position).
//! - Scatter-add, the adjoint, deterministic, in [`SCATTER_ENTRIES`]' five launches: the
//!   positions of each output row as a CSR list (`count`: integer atomics, which also tally
//!   each segment of [`SCATTER_SEG`] rows; `offsets`: a block per segment scans its rows after
//!   the segments before it, and lists the rows some index points to), `sort`: each listed
//!   row's list into increasing position (a bitonic sort in shared memory up to
//!   [`SCATTER_SORT`] entries, ranks from global memory beyond), `sum`: per listed row, warp
//!   `w` sums the `w`-th eighth of the sorted list 1,024 columns at a time, and the eight
//!   partial rows are added in warp order. `sort` and `sum` take at most [`SCATTER_BLOCKS`]
//!   blocks, each walking the listed rows. The order of every sum is a function of the
//!   indices alone (no float atomics): same input, same bits. The other rows are zeroed by a
//!   memset first. (Measured with `ncu` on the H200 for `wte`, 50,304 rows: the one-block scan
//!   this replaced took 193 µs of the 330, a block per index 33 + 95 µs for sort and sum.)
//! - Causal attention around cuBLAS products (the runtime runs `q k^T`, `p v` and the backward
//!   products as batched GEMMs): `fusec_attn_softmax` (row max, sum of `exp`, the log-sum-exp
//!   saved, `p = exp(scale s - lse)` below the diagonal, 0 above), `fusec_attn_probs` (`p` again
//!   from the saved log-sum-exp, for the backward) and `fusec_attn_dscores`
//!   (`ds = scale p (dp - rowsum(dout * out))`, 0 above the diagonal). One warp per score row,
//!   shuffle reductions in a fixed order.
//! - `fusec_iota_f32` / `fusec_iota_i32`: `out[i] = (i / inner) % len`.
//! - `fusec_round_bf16`: `out[i] = bf16(in[i])` (nearest even; the bf16 copies of the weights
//!   made on the device from the f32 values just uploaded).
//! - `fusec_sum_rows`: `out[c] = (acc[c] +) sum of part[r][c]` over the rows (eight row groups a
//!   block, each in row order, their sums added in group order; `acc` may be null): the partial
//!   column sums that the Hopper flash backward writes when the runtime folds a column sum of
//!   `dqkv` into it.
//! - `fusec_gemm_epilogue`: after a cuBLAS product, `t (+ bias[c])`, GELU with the
//!   pre-activation saved, `acc + t`, in `Op::Gemm`'s order (flags 1 bias, 2 GELU, 4 accumulate).
//! - `fusec_gemm_epilogue_mixed`: the same after an f32 product when some of it is bf16 (the
//!   [`EPILOGUE_BIAS_BF16`], [`EPILOGUE_PRE_BF16`], [`EPILOGUE_Y_BF16`] flags): loads widen,
//!   the arithmetic stays f32 and only the stores round (as the CPU backend's bf16 products);
//!   a bf16 result accumulates as the IR orders it, `acc + round(t)` rounded again.
//!
//! Fills are driver memsets (`cuMemsetD32`), not kernels.

use crate::emit::float_lit;

/// The scatter-add launches, in order (see the module docs).
pub const SCATTER_ENTRIES: [&str; 5] =
    ["fusec_scatter_count", "fusec_scatter_offsets", "fusec_scatter_fill", "fusec_scatter_sort", "fusec_scatter_sum"];
/// Output rows per block of `fusec_scatter_offsets` (a multiple of 256).
pub const SCATTER_SEG: u32 = 1024;
/// The most blocks `fusec_scatter_sort` and `fusec_scatter_sum` launch: each walks the listed
/// rows from its index in steps of the grid (empty blocks for rows no index points to had
/// cost more than the work, at up to one block per index).
pub const SCATTER_BLOCKS: u32 = 1024;
/// List entries `fusec_scatter_sort` sorts in shared memory (32 KiB).
pub const SCATTER_SORT: u32 = 8192;
/// Columns a thread of `fusec_scatter_sum` adds at a time (one `float4`).
pub const SCATTER_VEC: u32 = 4;
/// `float4` steps a lane of `fusec_scatter_sum` takes per list entry: a block adds
/// `32 * SCATTER_VEC * SCATTER_STEPS` columns (1,024) of a row at a time.
pub const SCATTER_STEPS: u32 = 8;
/// Columns a thread of `fusec_gather` copies (one `float4`) when a row is a multiple of it.
pub const GATHER_VEC: u32 = 4;
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

/// The hand-written kernels, as the modules they are compiled in. The runtime takes the
/// entries in this order (`runtime/src/cuda/mod.rs`: its `Native` fields, `fusec_round_bf16`
/// at 13). One module took 0.9 s of NVRTC on a freshly started VM, the longest of
/// a cold build; four compile side by side.
pub const MODULES: [&[&str]; 4] = [
    &["fusec_gather", "fusec_scatter_count", "fusec_scatter_offsets", "fusec_scatter_fill"],
    &["fusec_scatter_sort", "fusec_scatter_sum"],
    &["fusec_attn_softmax", "fusec_attn_probs", "fusec_attn_dscores"],
    &["fusec_iota_f32", "fusec_iota_i32", "fusec_gemm_epilogue", "fusec_gemm_epilogue_mixed", "fusec_round_bf16", "fusec_sum_rows"],
];

/// The name of module `i` of [`MODULES`].
pub fn module_name(i: usize) -> String {
    format!("{NAME}_{i}")
}

/// The CUDA C of module `i` of [`MODULES`]: [`source`] without the other modules' kernels
/// (every `__device__` helper stays).
pub fn module_source(i: usize) -> String {
    let src = source();
    let mut out = String::with_capacity(src.len());
    let mut keep = true;
    for line in src.split_inclusive('\n') {
        if line.starts_with("extern \"C\"") {
            keep = MODULES[i].iter().any(|e| line.contains(&format!(" {e}(")));
        } else if line.starts_with("__device__") {
            keep = true;
        }
        if keep {
            out.push_str(line);
        }
    }
    out
}

/// The CUDA C of the hand-written kernels (with the generated kernels' prelude).
pub fn source() -> String {
    let scale = ((2.0f64 / std::f64::consts::PI) as f32).sqrt();
    let mut s = format!("// {NAME} (fusec: {})\n", crate::CODEGEN_REVISION);
    s.push_str(crate::prelude::PRELUDE);
    s.push_str(
        &BODY
            .replace("GELU_SCALE", &float_lit(scale))
            .replace("SCATTER_SORT", &SCATTER_SORT.to_string())
            .replace("SCATTER_VEC", &SCATTER_VEC.to_string())
            .replace("SCATTER_SEG", &SCATTER_SEG.to_string())
            .replace("SCATTER_STEPS", &SCATTER_STEPS.to_string())
            .replace("SCATTER_SPAN", &(32 * SCATTER_VEC * SCATTER_STEPS).to_string())
            .replace("GATHER_VEC", &GATHER_VEC.to_string()),
    );
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
  // A float4 a thread where rows are whole float4s (GATHER_VEC), else one float.
  const int v = cols % GATHER_VEC == 0 ? GATHER_VEC : 1;
  const long long i = ((long long)blockIdx.x * 256 + threadIdx.x) * v;
  if (i >= n * cols) return;
  const long long s = i / cols;
  const int c = (int)(i - s * cols);
  const int t = idx[s];
  if (t < 0 || t >= rows) {
    err[0] = 1; err[1] = t; err[2] = (int)s;
    for (int k = 0; k < v; ++k) out[i + k] = 0.0f;
    return;
  }
  if (v == GATHER_VEC) *(float4*)&out[i] = *(const float4*)&table[(long long)t * cols + c];
  else out[i] = table[(long long)t * cols + c];
}
extern "C" __global__ void __launch_bounds__(256) fusec_scatter_count(const int* idx, int* count, int* seg, int nseg, int rows, int n, int* err) {
  const int s = blockIdx.x * 256 + threadIdx.x;
  if (s >= n) return;
  const int t = idx[s];
  if (t < 0 || t >= rows) { err[0] = 1; err[1] = t; err[2] = s; return; }
  // Per segment of SCATTER_SEG rows: its positions, and its rows some index points to.
  if (atomicAdd(&count[t], 1) == 0) atomicAdd(&seg[nseg + t / SCATTER_SEG], 1);
  atomicAdd(&seg[t / SCATTER_SEG], 1);
}
__device__ __forceinline__ int block_sum256(int v, int* sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  int t = 0;
#pragma unroll
  for (int w = 0; w < 8; ++w) t += sh[w];
  return t;
}
// A block per segment of SCATTER_SEG rows, SCATTER_SEG / 256 rows a thread: the segments
// before it (from `count`'s tallies), then an exclusive scan of its own rows.
extern "C" __global__ void __launch_bounds__(256) fusec_scatter_offsets(const int* count, const int* seg, int nseg, int* offs, int* cursor, int* nz, int rows) {
  __shared__ int sh[8];
  const int b = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  int ps = 0, pu = 0;
  for (int i = threadIdx.x; i < b; i += 256) { ps += seg[i]; pu += seg[nseg + i]; }
  ps = block_sum256(ps, sh);
  pu = block_sum256(pu, sh);
  const int per = SCATTER_SEG / 256, r0 = b * SCATTER_SEG + threadIdx.x * per;
  int c[SCATTER_SEG / 256], ts = 0, tu = 0;
#pragma unroll
  for (int k = 0; k < per; ++k) {
    c[k] = r0 + k < rows ? count[r0 + k] : 0;
    ts += c[k];
    tu += c[k] > 0;
  }
  // Inclusive scans of (ts, tu) in the warp, then over the warps' totals.
  int is = ts, iu = tu;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, is, o), y = __shfl_up_sync(0xffffffffu, iu, o);
    if (lane >= o) { is += x; iu += y; }
  }
  __shared__ int ws[8], wu[8];
  __syncthreads();
  if (lane == 31) { ws[w] = is; wu[w] = iu; }
  __syncthreads();
  int run = ps + is - ts, k_used = pu + iu - tu;
  for (int k = 0; k < w; ++k) { run += ws[k]; k_used += wu[k]; }
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const int r = r0 + k;
    if (r < rows) {
      offs[r] = run; cursor[r] = run; run += c[k];
      if (c[k] > 0) nz[1 + k_used++] = r;
    }
  }
  if (b == nseg - 1 && threadIdx.x == 255) { offs[rows] = run; nz[0] = k_used; }
}
extern "C" __global__ void __launch_bounds__(256) fusec_scatter_fill(const int* idx, int* cursor, int* slots, int rows, int n) {
  const int s = blockIdx.x * 256 + threadIdx.x;
  if (s >= n) return;
  const int t = idx[s];
  if (t >= 0 && t < rows) slots[atomicAdd(&cursor[t], 1)] = s;
}
extern "C" __global__ void __launch_bounds__(256) fusec_scatter_sort(const int* offs, const int* nz, const int* slots, int* sorted) {
  __shared__ int sl[SCATTER_SORT];
  for (int lr = blockIdx.x; lr < nz[0]; lr += gridDim.x) {
    __syncthreads();
    const int r = nz[1 + lr];
    const int o = offs[r], len = offs[r + 1] - o;
    if (len <= SCATTER_SORT) {
      // Bitonic sort of the list padded to a power of two with INT_MAX.
      int p = 1;
      while (p < len) p <<= 1;
      for (int i = threadIdx.x; i < p; i += 256) sl[i] = i < len ? slots[o + i] : 0x7fffffff;
      __syncthreads();
      for (int k = 2; k <= p; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
          for (int i = threadIdx.x; i < p; i += 256) {
            const int l = i ^ j;
            if (l > i) {
              const int a = sl[i], b = sl[l];
              if ((a > b) == ((i & k) == 0)) { sl[i] = b; sl[l] = a; }
            }
          }
          __syncthreads();
        }
      }
      for (int i = threadIdx.x; i < len; i += 256) sorted[o + i] = sl[i];
      continue;
    }
    // Longer lists (one index repeated more than SCATTER_SORT times): each entry's rank.
    for (int i = threadIdx.x; i < len; i += 256) {
      const int v = slots[o + i];
      int k = 0;
      for (int j = 0; j < len; ++j) k += slots[o + j] < v;
      sorted[o + k] = v;
    }
  }
}
extern "C" __global__ void __launch_bounds__(256) fusec_scatter_sum(const float* src, const int* offs, const int* nz, const int* sorted, float* out, int cols) {
  __shared__ float part[8][SCATTER_SPAN];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int lr = blockIdx.x; lr < nz[0]; lr += gridDim.x) {
    const int r = nz[1 + lr], o = offs[r], len = offs[r + 1] - o;
    const int j0 = (int)((long long)len * warp / 8), j1 = (int)((long long)len * (warp + 1) / 8);
    // SCATTER_SPAN columns at a time (GPT-2's 768 in one step): every load of a list entry's
    // columns in flight at once; the eight warps' partial rows added in warp order.
    for (int cb = 0; cb < cols; cb += SCATTER_SPAN) {
      float a[SCATTER_STEPS][SCATTER_VEC];
#pragma unroll
      for (int u = 0; u < SCATTER_STEPS; ++u)
#pragma unroll
        for (int k = 0; k < SCATTER_VEC; ++k) a[u][k] = 0.0f;
      for (int j = j0; j < j1; ++j) {
        const float* row = src + (long long)sorted[o + j] * cols;
#pragma unroll
        for (int u = 0; u < SCATTER_STEPS; ++u) {
          const int c0 = cb + (u * 32 + lane) * SCATTER_VEC;
          if (cols % SCATTER_VEC == 0 && c0 < cols) {
            const float4 v = *(const float4*)&row[c0];
            a[u][0] = a[u][0] + v.x; a[u][1] = a[u][1] + v.y; a[u][2] = a[u][2] + v.z; a[u][3] = a[u][3] + v.w;
          } else if (cols % SCATTER_VEC != 0) {
#pragma unroll
            for (int k = 0; k < SCATTER_VEC; ++k)
              if (c0 + k < cols) a[u][k] = a[u][k] + row[c0 + k];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < SCATTER_STEPS; ++u)
#pragma unroll
        for (int k = 0; k < SCATTER_VEC; ++k) part[warp][(u * 32 + lane) * SCATTER_VEC + k] = a[u][k];
      __syncthreads();
      for (int i = threadIdx.x; i < SCATTER_SPAN && cb + i < cols; i += 256) {
        float v = part[0][i];
        for (int w = 1; w < 8; ++w) v = v + part[w][i];
        out[(long long)r * cols + cb + i] = v;
      }
      __syncthreads();
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
extern "C" __global__ void __launch_bounds__(256) fusec_round_bf16(unsigned short* out, const float* in, long long n) {
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
  if (i < n) out[i] = f32_to_bf16(in[i]);
}
extern "C" __global__ void __launch_bounds__(256) fusec_sum_rows(float* out, const float* acc, const float* part, int rows, int cols) {
  __shared__ float sums[8][33];
  const int lane = threadIdx.x & 31, g = threadIdx.x >> 5, c = blockIdx.x * 32 + lane;
  float s = 0.0f;
  if (c < cols)
    for (int r = g; r < rows; r += 8) s += part[(long long)r * cols + c];
  sums[g][lane] = s;
  __syncthreads();
  if (g == 0 && c < cols) {
    float t = sums[0][lane];
    for (int k = 1; k < 8; ++k) t += sums[k][lane];
    out[c] = acc ? acc[c] + t : t;
  }
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
