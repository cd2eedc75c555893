// Forward (see flash/bf16.rs): FWD_WARPS warps of FWD_MT 16-row m-tiles each; key tiles of
// FWD_BN keys, double-buffered by cp.async, taken FWD_KC keys at a time (one softmax update).
#define FWD_THREADS (FWD_WARPS * 32)
#define FWD_BM (FWD_WARPS * 16 * FWD_MT)
#define FWD_NB (FWD_KC / 8)
#define FWD_STAGE (2 * FWD_BN * LDS)
#define FWD_SMEM (FWD_BM * LDS > 2 * FWD_STAGE ? FWD_BM * LDS : 2 * FWD_STAGE)

// FWD_KC keys of a staged tile (rows from `kr`) for one warp: s = q k^T, the online softmax,
// o += p v. MASK: some of the keys are past some of the warp's rows.
template <bool MASK>
__device__ __forceinline__ void fwd_tile(float (*o)[ND][4], float (*m)[2], float (*l)[2], const u32 (*qf)[KD][4], u32 ks, u32 vs,
                                         int kr, int k0, int wr0, int lane, float scale2) {
  const int g = lane >> 2, t = lane & 3;
  float sc[FWD_MT][FWD_NB][4];
#pragma unroll
  for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
    for (int nb = 0; nb < FWD_NB; ++nb) sc[mt][nb][0] = sc[mt][nb][1] = sc[mt][nb][2] = sc[mt][nb][3] = 0.0f;
#pragma unroll
  for (int p = 0; p < FWD_KC / 16; ++p)
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      u32 b[4];
      ld_bt(b, ks, kr + p * 16, kk, lane);
#pragma unroll
      for (int mt = 0; mt < FWD_MT; ++mt) {
        mma16(sc[mt][2 * p], qf[mt][kk], b[0], b[1]);
        mma16(sc[mt][2 * p + 1], qf[mt][kk], b[2], b[3]);
      }
    }
  float ms[FWD_MT][2], alpha[FWD_MT][2];
  bool same = true;
#pragma unroll
  for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = wr0 + mt * 16 + g + 8 * h;
      float mx = m[mt][h];
#pragma unroll
      for (int nb = 0; nb < FWD_NB; ++nb)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          if (MASK && k0 + nb * 8 + 2 * t + (e & 1) > row) sc[mt][nb][e] = NEG_INF;
          mx = fmaxf(mx, sc[mt][nb][e]);
        }
      mx = quad_max(mx);
      // Key 0 is in every row's first tile, so the maximum is finite from the first tile on.
      ms[mt][h] = mx == NEG_INF ? 0.0f : mx * scale2;
      alpha[mt][h] = ex2(fmaf(m[mt][h], scale2, -ms[mt][h]));
      same = same && alpha[mt][h] == 1.0f;
      m[mt][h] = mx;
    }
  // Rescale the output rows only when some row's maximum moved (often not, past the first tiles).
  if (!__all_sync(FULL, same)) {
#pragma unroll
    for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
      for (int dn = 0; dn < ND; ++dn)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][dn][e] *= alpha[mt][e >> 1];
  }
#pragma unroll
  for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = l[mt][h] * alpha[mt][h];
#pragma unroll
      for (int nb = 0; nb < FWD_NB; ++nb)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const float p = ex2(fmaf(sc[mt][nb][e], scale2, -ms[mt][h]));
          sum += p;
          sc[mt][nb][e] = p;
        }
      l[mt][h] = sum;
    }
#pragma unroll
  for (int p = 0; p < FWD_KC / 16; ++p) {
    // The accumulators of n-tiles 2p and 2p + 1 are the A fragment of keys [16p, 16p + 16).
    u32 pa[FWD_MT][4];
#pragma unroll
    for (int mt = 0; mt < FWD_MT; ++mt) {
      pa[mt][0] = pack2(sc[mt][2 * p][0], sc[mt][2 * p][1]);
      pa[mt][1] = pack2(sc[mt][2 * p][2], sc[mt][2 * p][3]);
      pa[mt][2] = pack2(sc[mt][2 * p + 1][0], sc[mt][2 * p + 1][1]);
      pa[mt][3] = pack2(sc[mt][2 * p + 1][2], sc[mt][2 * p + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < HD / 16; ++dp) {
      u32 b[4];
      ld_b(b, vs, kr + p * 16, dp, lane);
#pragma unroll
      for (int mt = 0; mt < FWD_MT; ++mt) {
        mma16(o[mt][2 * dp], pa[mt], b[0], b[1]);
        mma16(o[mt][2 * dp + 1], pa[mt], b[2], b[3]);
      }
    }
  }
}

#if !defined(FUSEC_FLASH_ONLY) || FUSEC_FLASH_ONLY == 0
extern "C" __global__ void __launch_bounds__(FWD_THREADS, FWD_MINB) fusec_flash_fwd(const elem* qkv, elem* out, float* lse, int T, int H, float scale) {
  __shared__ __align__(128) elem sm[FWD_SMEM];
  const int nt = (T + FWD_BM - 1) / FWD_BM, qt = nt - 1 - (int)blockIdx.z, h = blockIdx.x;
  const long long s = blockIdx.y, C = (long long)H * HD, rs = 3 * C;
  const elem* q = qkv + s * T * rs + h * HD;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = qt * FWD_BM, wr = w * 16 * FWD_MT, wr0 = q0 + wr;
  const float scale2 = scale * LOG2E;
  const u32 sb = smem_u32(sm);
  load_tile<FWD_BM, FWD_THREADS>(sb, q, rs, q0, T);
  cp_commit();
  cp_wait<0>();
  __syncthreads();
  u32 qf[FWD_MT][KD][4];
#pragma unroll
  for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) ld_a(qf[mt][kk], sb, wr + mt * 16, kk, lane);
  __syncthreads();
  const int nkt = (min(q0 + FWD_BM, T) + FWD_BN - 1) / FWD_BN;
  load_tile<FWD_BN, FWD_THREADS>(sb, q + C, rs, 0, T);
  load_tile<FWD_BN, FWD_THREADS>(sb + FWD_BN * LDS * 2, q + 2 * C, rs, 0, T);
  cp_commit();
  float o[FWD_MT][ND][4], m[FWD_MT][2], l[FWD_MT][2];
#pragma unroll
  for (int mt = 0; mt < FWD_MT; ++mt) {
    m[mt][0] = m[mt][1] = NEG_INF;
    l[mt][0] = l[mt][1] = 0.0f;
#pragma unroll
    for (int dn = 0; dn < ND; ++dn) o[mt][dn][0] = o[mt][dn][1] = o[mt][dn][2] = o[mt][dn][3] = 0.0f;
  }
  for (int j = 0; j < nkt; ++j) {
    if (j + 1 < nkt) {
      const u32 st = sb + ((j + 1) & 1) * FWD_STAGE * 2;
      load_tile<FWD_BN, FWD_THREADS>(st, q + C, rs, (j + 1) * FWD_BN, T);
      load_tile<FWD_BN, FWD_THREADS>(st + FWD_BN * LDS * 2, q + 2 * C, rs, (j + 1) * FWD_BN, T);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const u32 ks = sb + (j & 1) * FWD_STAGE * 2, vs = ks + FWD_BN * LDS * 2;
#pragma unroll
    for (int c = 0; c < FWD_BN / FWD_KC; ++c) {
      const int k0 = j * FWD_BN + c * FWD_KC;
      // Keys past the warp's last row: nothing to do; past its first row: masked.
      if (k0 <= wr0 + 16 * FWD_MT - 1) {
        if (k0 + FWD_KC - 1 > wr0)
          fwd_tile<true>(o, m, l, qf, ks, vs, c * FWD_KC, k0, wr0, lane, scale2);
        else
          fwd_tile<false>(o, m, l, qf, ks, vs, c * FWD_KC, k0, wr0, lane, scale2);
      }
    }
    __syncthreads();
  }
  float inv[FWD_MT][2];
#pragma unroll
  for (int mt = 0; mt < FWD_MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float sum = quad_sum(l[mt][hh]);
      inv[mt][hh] = 1.0f / sum;
      const int row = wr0 + mt * 16 + g + 8 * hh;
      if (t == 0 && row < T) lse[(s * H + h) * T + row] = fmaf(m[mt][hh], scale2, log2f(sum)) * LN2;
    }
  stage_acc<FWD_MT>(sm, o, wr, g, t, inv);
  __syncthreads();
  store_tile<FWD_BM, FWD_THREADS>(out + s * T * C + h * HD, C, sm, q0, T);
}
#endif
