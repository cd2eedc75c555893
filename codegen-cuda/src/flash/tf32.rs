//! Causal flash attention on TF32 tensor cores: the `attention` composite and its gradient
//! without the `T × T` score matrix (FlashAttention-2's tiling), for sm_80 and newer; the
//! kernels of f32 storage.
//!
//! Layout as the composite: `qkv` is `[S, T, 3C]` (q, k, v of head `h` at columns `h D`,
//! `C + h D`, `2C + h D`), `out` and `dout` are `[S, T, C]`, `lse` is `[S, H, T]` (the
//! log-sum-exp of the scaled scores of a row, saved by the forward for the backward).
//!
//! - `fusec_flash_fwd`: a block (4 warps) owns 64 query rows, a warp 16; it walks the key tiles
//!   up to the diagonal with an online softmax (running max and sum per row) and writes `out`
//!   and `lse`. Grid `(T/64, H, S)`, heaviest tiles first.
//! - `fusec_flash_bwd_dq`: per 64 query rows: `rowsum(dout * out)` (also written to `dsum` for
//!   the next kernel), then over key tiles `p = exp(scale s - lse)`, `dp = dout v^T`,
//!   `ds = scale p (dp - rowsum)`, `dq += ds k`.
//! - `fusec_flash_bwd_dkv`: per 64 keys, over the query tiles from the diagonal on: the same
//!   `p` and `ds` transposed, `dv += p^T dout`, `dk += ds^T q`.
//!
//! Deterministic: no atomics (dq has its own kernel instead of FlashAttention-2's atomic adds,
//! at the price of recomputing `q k^T` and `dout v^T` once more), every sum in a fixed order.
//!
//! Exponentials are base 2 (`exp2f`) on scores pre-multiplied by `scale · log2(e)`: a few
//! instructions instead of `expf`'s dozen, far below TF32's error; only the diagonal tile (and
//! the last one, past `T`) is masked.
//!
//! Products are `mma.sync.m16n8k8` with TF32 operands rounded to nearest (`cvt.rna.tf32`) and
//! fp32 accumulation — the numerics of cuBLAS's TF32 mode, so on f32 storage the runtime uses
//! these kernels only when TF32 products are allowed (`--no-tf32` keeps the exact cuBLAS +
//! softmax path; on bf16 storage see below).
//! Operand tiles are staged in shared memory with rows padded to `D + 4` floats, which makes
//! every fragment load free of bank conflicts. The probabilities go from the accumulator layout
//! to the next product's `A` operand without shuffles: an `A` fragment's column `t` (`t + 4`) is
//! read as key `2t` (`2t + 1`), and the `B` operand's rows are read with the same permutation.
//!
//! Storage: one module per head size and storage type of `qkv`, `out`, `dout` and `dqkv` — f32
//! (`fusec_flash_d64`), or bf16 at the head sizes the bf16 kernels ([`super::bf16`]) lack;
//! `lse` and the `dsum` row sums are f32 either way. The kernels differ only in the element type
//! and three access helpers (`ld4` stages four elements of a tile row, `ld1` reads one for the
//! row sums, `st2` writes two results): bf16 is widened to f32 by a 16-bit shift on the way into
//! shared memory (8-byte loads where f32 loads 16), so tiles, fragments and the TF32 products are
//! the same; results are rounded to bf16 to nearest even (the prelude's `f32_to_bf16`) as they
//! are stored. Every bf16 value is exact in TF32 (8 significant bits against 11), so on bf16
//! storage the products round only the probabilities, far below bf16's own rounding of the
//! results.

use fusec_ir::DType;

/// Query (and key) rows per block.
pub const TILE: u32 = 64;
/// Threads per block (4 warps of 16 rows each).
pub const THREADS: u32 = 128;

/// Whether the kernels handle heads of `d` columns (whole 8-column MMA steps; 64 at most so the
/// backward's fragments stay in registers).
pub fn supported(d: usize) -> bool {
    d.is_multiple_of(8) && (8..=64).contains(&d)
}

/// The CUDA C of the three kernels for head size `d` (see [`supported`]) on storage `dtype` (f32
/// or bf16), under the module name `name`.
pub fn source(d: usize, dtype: DType, name: &str) -> String {
    assert!(supported(d), "TF32 flash attention for head size {d}");
    assert!(matches!(dtype, DType::F32 | DType::BF16), "TF32 flash attention on {dtype} storage");
    let mut s = format!("// {name} (fusec: {})\n#define HD {d}\n", crate::CODEGEN_REVISION);
    if dtype == DType::BF16 {
        // For `f32_to_bf16` (the rounding every other bf16 store uses).
        s.push_str(crate::prelude::PRELUDE);
        s.push_str(BF16_IO);
    } else {
        s.push_str(F32_IO);
    }
    s.push_str(BODY);
    s
}

/// Element type and global-memory access of f32 storage: `ld4` is one `float4` load, `st2` one
/// `float2` store.
const F32_IO: &str = r#"typedef float elem;
__device__ __forceinline__ float ld1(const elem* p) { return *p; }
__device__ __forceinline__ float4 ld4(const elem* p) { return *(const float4*)p; }
__device__ __forceinline__ void st2(elem* p, float a, float b) { *(float2*)p = make_float2(a, b); }
"#;

/// The same for bf16 storage: four elements (8 bytes, little-endian: the first in the low half)
/// widened by 16-bit shifts; two results rounded to nearest even and stored as one 32-bit word.
const BF16_IO: &str = r#"typedef unsigned short elem;
__device__ __forceinline__ float ld1(const elem* p) { return __uint_as_float(((unsigned)*p) << 16); }
__device__ __forceinline__ float4 ld4(const elem* p) {
  const uint2 u = *(const uint2*)p;
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ void st2(elem* p, float a, float b) {
  *(unsigned*)p = (unsigned)f32_to_bf16(a) | ((unsigned)f32_to_bf16(b) << 16);
}
"#;

const BODY: &str = r#"#define LD (HD + 4)
#define TILE 64
#define KC (HD / 8)
#define NEG_INF __int_as_float(0xff800000)
#define FULL 0xffffffffu
#define LOG2E 1.44269504088896340736f
#define LN2 0.693147180559945309417f

__device__ __forceinline__ float tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}
// c += a b for one 16x8 tile, k = 8 (a: 16x8 row-major fragment, b: 8x8 column fragment).
__device__ __forceinline__ void mma8(float* c, const float* a, float b0, float b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])), "r"(__float_as_uint(a[3])),
                 "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}
// Rows [r0, r0 + 64) of a row-major matrix (row stride `stride` elements) into sm[64][LD] as f32,
// rounded to TF32; rows at or past T are zeros.
__device__ __forceinline__ void load_tile(float* sm, const elem* base, long long stride, int r0, int T) {
  for (int i = threadIdx.x; i < TILE * (HD / 4); i += 128) {
    const int r = i / (HD / 4), c = (i % (HD / 4)) * 4;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (r0 + r < T) v = ld4(base + (long long)(r0 + r) * stride + c);
    v.x = tf32(v.x); v.y = tf32(v.y); v.z = tf32(v.z); v.w = tf32(v.w);
    *(float4*)(sm + r * LD + c) = v;
  }
}
// The A fragments (16 rows from `row`, all HD columns) of a staged tile.
__device__ __forceinline__ void load_a(float (*a)[4], const float* sm, int row, int g, int t) {
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    a[kc][0] = sm[(row + g) * LD + kc * 8 + t];
    a[kc][1] = sm[(row + g + 8) * LD + kc * 8 + t];
    a[kc][2] = sm[(row + g) * LD + kc * 8 + t + 4];
    a[kc][3] = sm[(row + g + 8) * LD + kc * 8 + t + 4];
  }
}
// c[j] (16 x 8, j < NJ) = a (16 x HD) times rows n0 + 8j .. n0 + 8j + 8 of the staged tile,
// transposed.
template <int NJ> __device__ __forceinline__ void mma_nt(float (*c)[4], const float (*a)[4], const float* sm, int n0, int g, int t) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      const float* b = sm + (n0 + 8 * j + g) * LD + kc * 8 + t;
      mma8(c[j], a[kc], b[0], b[4]);
    }
  }
}
// acc (16 x HD) += p (16 x 8, accumulator layout) times rows k0 .. k0 + 8 of the staged tile.
__device__ __forceinline__ void mma_pv(float (*acc)[4], const float* p, const float* sm, int k0, int g, int t) {
  const float a[4] = {tf32(p[0]), tf32(p[2]), tf32(p[1]), tf32(p[3])};
#pragma unroll
  for (int dn = 0; dn < KC; ++dn) mma8(acc[dn], a, sm[(k0 + 2 * t) * LD + dn * 8 + g], sm[(k0 + 2 * t + 1) * LD + dn * 8 + g]);
}
// QUAD_REDUCTIONS
// Rows `row0` and `row0 + 8` of a 16 x HD accumulator into a row-major matrix.
__device__ __forceinline__ void store_rows(elem* base, long long stride, const float (*acc)[4], int row0, int T, int t, const float* mul) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    if (row >= T) continue;
#pragma unroll
    for (int dn = 0; dn < KC; ++dn)
      st2(base + (long long)row * stride + dn * 8 + 2 * t, acc[dn][2 * r] * mul[r], acc[dn][2 * r + 1] * mul[r]);
  }
}

// Four blocks an SM (at most 128 registers): 8% faster than three on the H200; the backward
// kernels at three blocks an SM spill (dk/dv) or gain nothing (dq).
#if !defined(FUSEC_FLASH_ONLY) || FUSEC_FLASH_ONLY == 0
extern "C" __global__ void __launch_bounds__(128, 4) fusec_flash_fwd(const elem* qkv, elem* out, float* lse, int T, int H, float scale) {
  __shared__ __align__(16) float ks[TILE * LD];
  __shared__ __align__(16) float vs[TILE * LD];
  const int nt = (T + TILE - 1) / TILE, qt = nt - 1 - blockIdx.x, h = blockIdx.y;
  const long long s = blockIdx.z, C = (long long)H * HD, rs = 3 * C;
  const elem* q = qkv + s * T * rs + h * HD;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = qt * TILE, row0 = q0 + w * 16 + g;
  const float scale2 = scale * LOG2E;
  float qa[KC][4];
  load_tile(ks, q, rs, q0, T);
  __syncthreads();
  load_a(qa, ks, w * 16, g, t);
  float o[KC][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f}, mu[2] = {0.0f, 0.0f};
#pragma unroll
  for (int dn = 0; dn < KC; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * TILE;
    __syncthreads();
    load_tile(ks, q + C, rs, k0, T);
    load_tile(vs, q + 2 * C, rs, k0, T);
    __syncthreads();
    float sc[8][4];
    mma_nt<8>(sc, qa, ks, 0, g, t);
    float mx[2] = {m[0], m[1]};
    const bool diagonal = kt == qt;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, key = k0 + j * 8 + 2 * t + (e & 1);
        float x = sc[j][e] * scale2;
        if (diagonal && (key > row0 + 8 * r || key >= T)) x = NEG_INF;
        sc[j][e] = x;
        mx[r] = fmaxf(mx[r], x);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = quad_max(mx[r]);
      mu[r] = mx[r] == NEG_INF ? 0.0f : mx[r];
      const float alpha = exp2f(m[r] - mu[r]);
      m[r] = mx[r];
      l[r] = l[r] * alpha;
#pragma unroll
      for (int dn = 0; dn < KC; ++dn) { o[dn][2 * r] = o[dn][2 * r] * alpha; o[dn][2 * r + 1] = o[dn][2 * r + 1] * alpha; }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(sc[j][e] - mu[e >> 1]);
        l[e >> 1] = l[e >> 1] + p;
        sc[j][e] = p;
      }
#pragma unroll
    for (int j = 0; j < 8; ++j) mma_pv(o, sc[j], vs, j * 8, g, t);
  }
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = quad_sum(l[r]);
    inv[r] = 1.0f / l[r];
    const int row = row0 + 8 * r;
    if (t == 0 && row < T) lse[(s * H + h) * T + row] = (mu[r] + log2f(l[r])) * LN2;
  }
  store_rows(out + s * T * C + h * HD, C, o, row0, T, t, inv);
}
#endif

#if !defined(FUSEC_FLASH_ONLY) || FUSEC_FLASH_ONLY == 1
extern "C" __global__ void __launch_bounds__(128) fusec_flash_bwd_dq(const elem* qkv, const elem* out, const float* lse, const elem* dout, elem* dqkv, float* dsum, int T, int H, float scale) {
  __shared__ __align__(16) float ks[TILE * LD];
  __shared__ __align__(16) float vs[TILE * LD];
  __shared__ float dsm[TILE];
  const int nt = (T + TILE - 1) / TILE, qt = nt - 1 - blockIdx.x, h = blockIdx.y;
  const long long s = blockIdx.z, C = (long long)H * HD, rs = 3 * C, bh = s * H + h;
  const elem* q = qkv + s * T * rs + h * HD;
  const elem* o = out + s * T * C + h * HD;
  const elem* dO = dout + s * T * C + h * HD;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = qt * TILE, row0 = q0 + w * 16 + g;
  const float scale2 = scale * LOG2E;
  // rowsum(dout * out) of this warp's 16 rows, lanes over columns, a fixed butterfly.
  for (int i = 0; i < 16; ++i) {
    const int row = q0 + w * 16 + i;
    float acc = 0.0f;
    if (row < T)
      for (int d = lane; d < HD; d += 32) acc = acc + ld1(dO + (long long)row * C + d) * ld1(o + (long long)row * C + d);
#pragma unroll
    for (int k = 16; k >= 1; k >>= 1) acc = acc + __shfl_xor_sync(FULL, acc, k);
    if (lane == 0) {
      dsm[w * 16 + i] = acc;
      if (row < T) dsum[bh * T + row] = acc;
    }
  }
  float qa[KC][4], da[KC][4];
  load_tile(ks, q, rs, q0, T);
  load_tile(vs, dO, C, q0, T);
  __syncthreads();
  load_a(qa, ks, w * 16, g, t);
  load_a(da, vs, w * 16, g, t);
  float lr[2], dr[2], dq[KC][4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    lr[r] = row < T ? lse[bh * T + row] * LOG2E : 0.0f;
    dr[r] = dsm[w * 16 + g + 8 * r];
  }
#pragma unroll
  for (int dn = 0; dn < KC; ++dn) dq[dn][0] = dq[dn][1] = dq[dn][2] = dq[dn][3] = 0.0f;
  for (int kt = 0; kt <= qt; ++kt) {
    const bool diagonal = kt == qt;
    const int k0 = kt * TILE;
    __syncthreads();
    load_tile(ks, q + C, rs, k0, T);
    load_tile(vs, q + 2 * C, rs, k0, T);
    __syncthreads();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sc[4][4], dp[4][4];
      mma_nt<4>(sc, qa, ks, half * 32, g, t);
      mma_nt<4>(dp, da, vs, half * 32, g, t);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n0 = (half * 4 + j) * 8;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1, key = k0 + n0 + 2 * t + (e & 1), row = row0 + 8 * r;
          float p = exp2f(sc[j][e] * scale2 - lr[r]);
          if (diagonal && (key > row || key >= T)) p = 0.0f;
          sc[j][e] = scale * p * (dp[j][e] - dr[r]);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_pv(dq, sc[j], ks, (half * 4 + j) * 8, g, t);
    }
  }
  const float one[2] = {1.0f, 1.0f};
  store_rows(dqkv + s * T * rs + h * HD, rs, dq, row0, T, t, one);
}
#endif

#if !defined(FUSEC_FLASH_ONLY) || FUSEC_FLASH_ONLY == 2
extern "C" __global__ void __launch_bounds__(128) fusec_flash_bwd_dkv(const elem* qkv, const float* lse, const elem* dout, const float* dsum, elem* dqkv, int T, int H, float scale) {
  __shared__ __align__(16) float qs[TILE * LD];
  __shared__ __align__(16) float ds[TILE * LD];
  __shared__ float lse_s[TILE], dsum_s[TILE];
  const int nt = (T + TILE - 1) / TILE, kt = blockIdx.x, h = blockIdx.y;
  const long long s = blockIdx.z, C = (long long)H * HD, rs = 3 * C, bh = s * H + h;
  const elem* q = qkv + s * T * rs + h * HD;
  const elem* dO = dout + s * T * C + h * HD;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int k0 = kt * TILE, key0 = k0 + w * 16 + g;
  const float scale2 = scale * LOG2E;
  float ka[KC][4], va[KC][4], dk[KC][4], dv[KC][4];
  load_tile(qs, q + C, rs, k0, T);
  load_tile(ds, q + 2 * C, rs, k0, T);
  __syncthreads();
  load_a(ka, qs, w * 16, g, t);
  load_a(va, ds, w * 16, g, t);
#pragma unroll
  for (int dn = 0; dn < KC; ++dn) {
    dk[dn][0] = dk[dn][1] = dk[dn][2] = dk[dn][3] = 0.0f;
    dv[dn][0] = dv[dn][1] = dv[dn][2] = dv[dn][3] = 0.0f;
  }
  for (int qt = kt; qt < nt; ++qt) {
    // Masks: the diagonal tile, and the last one (queries past T).
    const bool diagonal = qt == kt || (qt + 1) * TILE > T;
    const int q0 = qt * TILE;
    __syncthreads();
    load_tile(qs, q, rs, q0, T);
    load_tile(ds, dO, C, q0, T);
    if (threadIdx.x < TILE) {
      const int row = q0 + threadIdx.x;
      lse_s[threadIdx.x] = row < T ? lse[bh * T + row] * LOG2E : 0.0f;
      dsum_s[threadIdx.x] = row < T ? dsum[bh * T + row] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float pt[4][4], dst[4][4];
      mma_nt<4>(pt, ka, qs, half * 32, g, t);
      mma_nt<4>(dst, va, ds, half * 32, g, t);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n0 = (half * 4 + j) * 8;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = n0 + 2 * t + (e & 1), key = key0 + 8 * (e >> 1), row = q0 + c;
          float p = exp2f(pt[j][e] * scale2 - lse_s[c]);
          if (diagonal && (key > row || row >= T || key >= T)) p = 0.0f;
          pt[j][e] = p;
          dst[j][e] = scale * p * (dst[j][e] - dsum_s[c]);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n0 = (half * 4 + j) * 8;
        mma_pv(dv, pt[j], ds, n0, g, t);
        mma_pv(dk, dst[j], qs, n0, g, t);
      }
    }
  }
  const float one[2] = {1.0f, 1.0f};
  store_rows(dqkv + s * T * rs + C + h * HD, rs, dk, key0, T, t, one);
  store_rows(dqkv + s * T * rs + 2 * C + h * HD, rs, dv, key0, T, t, one);
}
#endif
"#;
