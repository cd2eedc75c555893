//! Flash attention with bf16 products, for `--precision bf16`: the same three kernels, tiling,
//! online softmax, masks and deterministic `dq` as [`crate::flash`], on
//! `mma.sync.m16n8k16` with bf16 operands (round to nearest even) and fp32 accumulation —
//! the bf16 policy of the `amp` pass (matmul operands in bf16, softmax and statistics in f32)
//! applied to attention's five products. Twice the tensor-core rate of TF32 and half the
//! shared memory per tile.
//!
//! Tiles are staged from fp32 global memory into bf16 shared memory, row-major (`[64][D + 8]`)
//! where a product reads rows, transposed (`[D][64 + 8]`) where it reads columns; both
//! paddings make every 32-bit fragment load conflict-free. The probabilities of two adjacent
//! 8-key accumulator tiles are exactly the next product's 16-key operand fragment, packed.

use crate::flash::{COMMON, ENTRIES};

/// Whether the kernels handle heads of `d` columns (whole 16-column MMA steps, at most 64).
pub fn supported(d: usize) -> bool {
    d % 16 == 0 && (16..=64).contains(&d)
}

/// The module's name for head size `d`.
pub fn name(d: usize) -> String {
    format!("fusec_flash_bf16_d{d}")
}

/// The CUDA C of the three kernels (named [`ENTRIES`]) for head size `d` (see [`supported`]).
pub fn source(d: usize) -> String {
    assert!(supported(d), "bf16 flash attention for head size {d}");
    debug_assert_eq!(ENTRIES.len(), 3);
    let mut s = format!("// {} (fusec: {})\n#define HD {d}\n", name(d), crate::CODEGEN_REVISION);
    s.push_str(COMMON);
    s.push_str(BODY);
    s
}

const BODY: &str = r#"#define LB (HD + 8)
#define LT (TILE + 8)
#define K16 (HD / 16)
typedef unsigned short bf;

// (lo, hi) rounded to bf16 and packed, lo in the low half.
__device__ __forceinline__ unsigned pack(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned word(const bf* p, int i) { return *(const unsigned*)(p + i); }
// c += a b for one 16x8 tile, k = 16.
__device__ __forceinline__ void mma16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Rows [r0, r0 + 64) of a row-major fp32 matrix as bf16: into `rows` ([64][LB]) and/or,
// transposed, into `cols` ([HD][LT]); rows at or past T are zeros.
__device__ __forceinline__ void load_bf(bf* rows, bf* cols, const float* base, long long stride, int r0, int T) {
  for (int i = threadIdx.x; i < TILE * (HD / 4); i += 128) {
    const int r = i / (HD / 4), c = (i % (HD / 4)) * 4;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (r0 + r < T) v = *(const float4*)(base + (long long)(r0 + r) * stride + c);
    const unsigned lo = pack(v.x, v.y), hi = pack(v.z, v.w);
    if (rows) *(uint2*)(rows + r * LB + c) = make_uint2(lo, hi);
    if (cols) {
      cols[(c + 0) * LT + r] = (bf)(lo & 0xffffu);
      cols[(c + 1) * LT + r] = (bf)(lo >> 16);
      cols[(c + 2) * LT + r] = (bf)(hi & 0xffffu);
      cols[(c + 3) * LT + r] = (bf)(hi >> 16);
    }
  }
}
// The A fragments (16 rows from `row`, all HD columns) of a row-major tile.
__device__ __forceinline__ void load_a(unsigned (*a)[4], const bf* sm, int row, int g, int t) {
#pragma unroll
  for (int kc = 0; kc < K16; ++kc) {
    const bf* p = sm + (row + g) * LB + kc * 16 + 2 * t;
    a[kc][0] = word(p, 0);
    a[kc][1] = word(p, 8 * LB);
    a[kc][2] = word(p, 8);
    a[kc][3] = word(p, 8 * LB + 8);
  }
}
// c[j] (16 x 8, j < NJ) = a (16 x HD) times rows n0 + 8j .. n0 + 8j + 8 of a row-major tile,
// transposed.
template <int NJ> __device__ __forceinline__ void mma_nt(float (*c)[4], const unsigned (*a)[4], const bf* sm, int n0, int g, int t) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < K16; ++kc) {
      const bf* p = sm + (n0 + 8 * j + g) * LB + kc * 16 + 2 * t;
      mma16(c[j], a[kc], word(p, 0), word(p, 8));
    }
  }
}
// acc (16 x HD) += [p0 p1] (16 x 16, two accumulator tiles) times rows k0 .. k0 + 16 of the
// matrix whose transposed tile is `smt`.
__device__ __forceinline__ void mma_pv(float (*acc)[4], const float* p0, const float* p1, const bf* smt, int k0, int g, int t) {
  const unsigned a[4] = {pack(p0[0], p0[1]), pack(p0[2], p0[3]), pack(p1[0], p1[1]), pack(p1[2], p1[3])};
#pragma unroll
  for (int dn = 0; dn < KC; ++dn) {
    const bf* p = smt + (dn * 8 + g) * LT + k0 + 2 * t;
    mma16(acc[dn], a, word(p, 0), word(p, 8));
  }
}

extern "C" __global__ void __launch_bounds__(128) fusec_flash_fwd(const float* qkv, float* out, float* lse, int T, int H, float scale) {
  __shared__ __align__(16) bf ks[TILE * LB];
  __shared__ __align__(16) bf vt[HD * LT];
  const int nt = (T + TILE - 1) / TILE, qt = nt - 1 - blockIdx.x, h = blockIdx.y;
  const long long s = blockIdx.z, C = (long long)H * HD, rs = 3 * C;
  const float* q = qkv + s * T * rs + h * HD;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = qt * TILE, row0 = q0 + w * 16 + g;
  const float scale2 = scale * LOG2E;
  unsigned qa[K16][4];
  load_bf(ks, 0, q, rs, q0, T);
  __syncthreads();
  load_a(qa, ks, w * 16, g, t);
  float o[KC][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f}, mu[2] = {0.0f, 0.0f};
#pragma unroll
  for (int dn = 0; dn < KC; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * TILE;
    const bool diagonal = kt == qt;
    __syncthreads();
    load_bf(ks, 0, q + C, rs, k0, T);
    load_bf(0, vt, q + 2 * C, rs, k0, T);
    __syncthreads();
    float sc[8][4];
    mma_nt<8>(sc, qa, ks, 0, g, t);
    float mx[2] = {m[0], m[1]};
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
    for (int j = 0; j < 4; ++j) mma_pv(o, sc[2 * j], sc[2 * j + 1], vt, j * 16, g, t);
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

extern "C" __global__ void __launch_bounds__(128) fusec_flash_bwd_dq(const float* qkv, const float* out, const float* lse, const float* dout, float* dqkv, float* dsum, int T, int H, float scale) {
  __shared__ __align__(16) bf ks[TILE * LB];
  __shared__ __align__(16) bf kts[HD * LT];
  __shared__ __align__(16) bf vs[TILE * LB];
  __shared__ float dsm[TILE];
  const int nt = (T + TILE - 1) / TILE, qt = nt - 1 - blockIdx.x, h = blockIdx.y;
  const long long s = blockIdx.z, C = (long long)H * HD, rs = 3 * C, bh = s * H + h;
  const float* q = qkv + s * T * rs + h * HD;
  const float* o = out + s * T * C + h * HD;
  const float* dO = dout + s * T * C + h * HD;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = qt * TILE, row0 = q0 + w * 16 + g;
  const float scale2 = scale * LOG2E;
  // rowsum(dout * out) of this warp's 16 rows, lanes over columns, a fixed butterfly.
  for (int i = 0; i < 16; ++i) {
    const int row = q0 + w * 16 + i;
    float acc = 0.0f;
    if (row < T)
      for (int d = lane; d < HD; d += 32) acc = acc + dO[(long long)row * C + d] * o[(long long)row * C + d];
#pragma unroll
    for (int k = 16; k >= 1; k >>= 1) acc = acc + __shfl_xor_sync(FULL, acc, k);
    if (lane == 0) {
      dsm[w * 16 + i] = acc;
      if (row < T) dsum[bh * T + row] = acc;
    }
  }
  unsigned qa[K16][4], da[K16][4];
  load_bf(ks, 0, q, rs, q0, T);
  load_bf(vs, 0, dO, C, q0, T);
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
    load_bf(ks, kts, q + C, rs, k0, T);
    load_bf(vs, 0, q + 2 * C, rs, k0, T);
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
      for (int j = 0; j < 2; ++j) mma_pv(dq, sc[2 * j], sc[2 * j + 1], kts, half * 32 + j * 16, g, t);
    }
  }
  const float one[2] = {1.0f, 1.0f};
  store_rows(dqkv + s * T * rs + h * HD, rs, dq, row0, T, t, one);
}

extern "C" __global__ void __launch_bounds__(128) fusec_flash_bwd_dkv(const float* qkv, const float* lse, const float* dout, const float* dsum, float* dqkv, int T, int H, float scale) {
  __shared__ __align__(16) bf qs[TILE * LB];
  __shared__ __align__(16) bf qts[HD * LT];
  __shared__ __align__(16) bf ds[TILE * LB];
  __shared__ __align__(16) bf dts[HD * LT];
  __shared__ float lse_s[TILE], dsum_s[TILE];
  const int nt = (T + TILE - 1) / TILE, kt = blockIdx.x, h = blockIdx.y;
  const long long s = blockIdx.z, C = (long long)H * HD, rs = 3 * C, bh = s * H + h;
  const float* q = qkv + s * T * rs + h * HD;
  const float* dO = dout + s * T * C + h * HD;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int k0 = kt * TILE, key0 = k0 + w * 16 + g;
  const float scale2 = scale * LOG2E;
  unsigned ka[K16][4], va[K16][4];
  float dk[KC][4], dv[KC][4];
  load_bf(qs, 0, q + C, rs, k0, T);
  load_bf(ds, 0, q + 2 * C, rs, k0, T);
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
    load_bf(qs, qts, q, rs, q0, T);
    load_bf(ds, dts, dO, C, q0, T);
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
      for (int j = 0; j < 2; ++j) {
        mma_pv(dv, pt[2 * j], pt[2 * j + 1], dts, half * 32 + j * 16, g, t);
        mma_pv(dk, dst[2 * j], dst[2 * j + 1], qts, half * 32 + j * 16, g, t);
      }
    }
  }
  const float one[2] = {1.0f, 1.0f};
  store_rows(dqkv + s * T * rs + C + h * HD, rs, dk, key0, T, t, one);
  store_rows(dqkv + s * T * rs + 2 * C + h * HD, rs, dv, key0, T, t, one);
}
"#;
