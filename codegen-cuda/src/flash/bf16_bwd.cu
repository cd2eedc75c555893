// Backward (see flash/bf16.rs). `stats` is [S, H, T] pairs (rowsum(dout * out), lse log2(e)),
// written by the dq kernel for the dk/dv kernel.
#define DQ_THREADS (DQ_WARPS * 32)
#define DQ_BM (DQ_WARPS * 16 * DQ_MT)
#define DQ_NB (DQ_KC / 8)
#define DQ_STAGE (2 * DQ_BN * LDS)
#define DQ_SMEM (2 * DQ_BM * LDS > 2 * DQ_STAGE ? 2 * DQ_BM * LDS : 2 * DQ_STAGE)
#define DKV_THREADS (DKV_WARPS * 32)
#define DKV_BK (DKV_WARPS * 16 * DKV_MT)
#define DKV_NB (DKV_QC / 8)
#define DKV_STAGE (2 * DKV_BQ * LDS)
#define DKV_SMEM (2 * DKV_BK * LDS > 2 * DKV_STAGE ? 2 * DKV_BK * LDS : 2 * DKV_STAGE)

// dq for DQ_KC keys of a staged tile (rows from `kr`): s = q k^T, dp = dout v^T,
// ds = p (dp - rowsum), dq += ds k (the scale is applied once, at the end).
template <bool MASK>
__device__ __forceinline__ void dq_chunk(float (*dq)[ND][4], const u32 (*qf)[KD][4], const u32 (*df)[KD][4], const float (*lr)[2],
                                         const float (*dr)[2], u32 ks, u32 vs, int kr, int kc0, int wr0, int lane, float scale2) {
  const int g = lane >> 2, t = lane & 3;
  float sc[DQ_MT][DQ_NB][4], dp[DQ_MT][DQ_NB][4];
#pragma unroll
  for (int mt = 0; mt < DQ_MT; ++mt)
#pragma unroll
    for (int nb = 0; nb < DQ_NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[mt][nb][e] = dp[mt][nb][e] = 0.0f;
#pragma unroll
  for (int p = 0; p < DQ_KC / 16; ++p)
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      u32 b[4], c[4];
      ld_bt(b, ks, kr + p * 16, kk, lane);
      ld_bt(c, vs, kr + p * 16, kk, lane);
#pragma unroll
      for (int mt = 0; mt < DQ_MT; ++mt) {
        mma16(sc[mt][2 * p], qf[mt][kk], b[0], b[1]);
        mma16(sc[mt][2 * p + 1], qf[mt][kk], b[2], b[3]);
        mma16(dp[mt][2 * p], df[mt][kk], c[0], c[1]);
        mma16(dp[mt][2 * p + 1], df[mt][kk], c[2], c[3]);
      }
    }
#pragma unroll
  for (int mt = 0; mt < DQ_MT; ++mt)
#pragma unroll
    for (int nb = 0; nb < DQ_NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        float p = ex2(fmaf(sc[mt][nb][e], scale2, -lr[mt][h]));
        if (MASK && kc0 + nb * 8 + 2 * t + (e & 1) > wr0 + mt * 16 + g + 8 * h) p = 0.0f;
        sc[mt][nb][e] = p * (dp[mt][nb][e] - dr[mt][h]);
      }
#pragma unroll
  for (int p = 0; p < DQ_KC / 16; ++p) {
    u32 da[DQ_MT][4];
#pragma unroll
    for (int mt = 0; mt < DQ_MT; ++mt) {
      da[mt][0] = pack2(sc[mt][2 * p][0], sc[mt][2 * p][1]);
      da[mt][1] = pack2(sc[mt][2 * p][2], sc[mt][2 * p][3]);
      da[mt][2] = pack2(sc[mt][2 * p + 1][0], sc[mt][2 * p + 1][1]);
      da[mt][3] = pack2(sc[mt][2 * p + 1][2], sc[mt][2 * p + 1][3]);
    }
#pragma unroll
    for (int d2 = 0; d2 < HD / 16; ++d2) {
      u32 b[4];
      ld_b(b, ks, kr + p * 16, d2, lane);
#pragma unroll
      for (int mt = 0; mt < DQ_MT; ++mt) {
        mma16(dq[mt][2 * d2], da[mt], b[0], b[1]);
        mma16(dq[mt][2 * d2 + 1], da[mt], b[2], b[3]);
      }
    }
  }
}

#if !defined(FUSEC_FLASH_ONLY) || FUSEC_FLASH_ONLY == 1
extern "C" __global__ void __launch_bounds__(DQ_THREADS, DQ_MINB) fusec_flash_bwd_dq(const elem* qkv, const elem* out, const float* lse, const elem* dout,
                                                                          elem* dqkv, float* stats, int T, int H, float scale) {
  __shared__ __align__(128) elem sm[DQ_SMEM];
  __shared__ float dsm[DQ_BM];
  const int nt = (T + DQ_BM - 1) / DQ_BM, qt = nt - 1 - (int)blockIdx.z, h = blockIdx.x;
  const long long s = blockIdx.y, C = (long long)H * HD, rs = 3 * C, bh = s * H + h;
  const elem* q = qkv + s * T * rs + h * HD;
  const elem* o = out + s * T * C + h * HD;
  const elem* dO = dout + s * T * C + h * HD;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = qt * DQ_BM, wr = w * 16 * DQ_MT, wr0 = q0 + wr;
  const float scale2 = scale * LOG2E;
  const u32 sb = smem_u32(sm);
  load_tile<DQ_BM, DQ_THREADS>(sb, q, rs, q0, T);
  load_tile<DQ_BM, DQ_THREADS>(sb + DQ_BM * LDS * 2, dO, C, q0, T);
  cp_commit();
  dq_rowsums<16 * DQ_MT>(dsm, stats, dO, o, lse, C, bh, T, q0, wr, lane);
  cp_wait<0>();
  __syncthreads();
  u32 qf[DQ_MT][KD][4], df[DQ_MT][KD][4];
  float lr[DQ_MT][2], dr[DQ_MT][2];
#pragma unroll
  for (int mt = 0; mt < DQ_MT; ++mt) {
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      ld_a(qf[mt][kk], sb, wr + mt * 16, kk, lane);
      ld_a(df[mt][kk], sb + DQ_BM * LDS * 2, wr + mt * 16, kk, lane);
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int rl = wr + mt * 16 + g + 8 * hh, row = q0 + rl;
      lr[mt][hh] = row < T ? lse[bh * T + row] * LOG2E : 0.0f;
      dr[mt][hh] = dsm[rl];
    }
  }
  __syncthreads();
  const int nkt = (min(q0 + DQ_BM, T) + DQ_BN - 1) / DQ_BN;
  load_tile<DQ_BN, DQ_THREADS>(sb, q + C, rs, 0, T);
  load_tile<DQ_BN, DQ_THREADS>(sb + DQ_BN * LDS * 2, q + 2 * C, rs, 0, T);
  cp_commit();
  float dq[DQ_MT][ND][4];
#pragma unroll
  for (int mt = 0; mt < DQ_MT; ++mt)
#pragma unroll
    for (int dn = 0; dn < ND; ++dn) dq[mt][dn][0] = dq[mt][dn][1] = dq[mt][dn][2] = dq[mt][dn][3] = 0.0f;
  for (int j = 0; j < nkt; ++j) {
    if (j + 1 < nkt) {
      const u32 st = sb + ((j + 1) & 1) * DQ_STAGE * 2;
      load_tile<DQ_BN, DQ_THREADS>(st, q + C, rs, (j + 1) * DQ_BN, T);
      load_tile<DQ_BN, DQ_THREADS>(st + DQ_BN * LDS * 2, q + 2 * C, rs, (j + 1) * DQ_BN, T);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const u32 ks = sb + (j & 1) * DQ_STAGE * 2, vs = ks + DQ_BN * LDS * 2;
#pragma unroll
    for (int c = 0; c < DQ_BN / DQ_KC; ++c) {
      const int kc0 = j * DQ_BN + c * DQ_KC;
      if (kc0 <= wr0 + 16 * DQ_MT - 1) {
        if (kc0 + DQ_KC - 1 > wr0)
          dq_chunk<true>(dq, qf, df, lr, dr, ks, vs, c * DQ_KC, kc0, wr0, lane, scale2);
        else
          dq_chunk<false>(dq, qf, df, lr, dr, ks, vs, c * DQ_KC, kc0, wr0, lane, scale2);
      }
    }
    __syncthreads();
  }
  float muls[DQ_MT][2];
#pragma unroll
  for (int mt = 0; mt < DQ_MT; ++mt) muls[mt][0] = muls[mt][1] = scale;
  stage_acc<DQ_MT>(sm, dq, wr, g, t, muls);
  __syncthreads();
  store_tile<DQ_BM, DQ_THREADS>(dqkv + s * T * rs + h * HD, rs, sm, q0, T);
}
#endif

// dk, dv for DKV_QC queries of a staged tile (rows from `qr`), keys as rows: s^T = k q^T,
// dp^T = v dout^T, p^T, ds^T = p^T (dp^T - rowsum), dv += p^T dout, dk += ds^T q.
template <bool MASK>
__device__ __forceinline__ void dkv_chunk(float (*dk)[ND][4], float (*dv)[ND][4], const u32 (*kf)[KD][4], const u32 (*vf)[KD][4], u32 qs, u32 ds,
                                          const float2* stt, int qr, int qc0, int wk0, int lane, float scale2) {
  const int g = lane >> 2, t = lane & 3;
  float sc[DKV_MT][DKV_NB][4], dp[DKV_MT][DKV_NB][4];
#pragma unroll
  for (int mt = 0; mt < DKV_MT; ++mt)
#pragma unroll
    for (int nb = 0; nb < DKV_NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[mt][nb][e] = dp[mt][nb][e] = 0.0f;
#pragma unroll
  for (int p = 0; p < DKV_QC / 16; ++p)
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      u32 b[4], c[4];
      ld_bt(b, qs, qr + p * 16, kk, lane);
      ld_bt(c, ds, qr + p * 16, kk, lane);
#pragma unroll
      for (int mt = 0; mt < DKV_MT; ++mt) {
        mma16(sc[mt][2 * p], kf[mt][kk], b[0], b[1]);
        mma16(sc[mt][2 * p + 1], kf[mt][kk], b[2], b[3]);
        mma16(dp[mt][2 * p], vf[mt][kk], c[0], c[1]);
        mma16(dp[mt][2 * p + 1], vf[mt][kk], c[2], c[3]);
      }
    }
#pragma unroll
  for (int nb = 0; nb < DKV_NB; ++nb) {
    // (rowsum, lse log2(e)) of the thread's two query columns.
    const float4 qs2 = *(const float4*)(stt + qr + nb * 8 + 2 * t);
#pragma unroll
    for (int mt = 0; mt < DKV_MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float rsum = (e & 1) ? qs2.z : qs2.x, l2 = (e & 1) ? qs2.w : qs2.y;
        float p = ex2(fmaf(sc[mt][nb][e], scale2, -l2));
        if (MASK && qc0 + nb * 8 + 2 * t + (e & 1) < wk0 + mt * 16 + g + 8 * (e >> 1)) p = 0.0f;
        sc[mt][nb][e] = p;
        dp[mt][nb][e] = p * (dp[mt][nb][e] - rsum);
      }
  }
#pragma unroll
  for (int p = 0; p < DKV_QC / 16; ++p) {
    u32 pa[DKV_MT][4], da[DKV_MT][4];
#pragma unroll
    for (int mt = 0; mt < DKV_MT; ++mt) {
      pa[mt][0] = pack2(sc[mt][2 * p][0], sc[mt][2 * p][1]);
      pa[mt][1] = pack2(sc[mt][2 * p][2], sc[mt][2 * p][3]);
      pa[mt][2] = pack2(sc[mt][2 * p + 1][0], sc[mt][2 * p + 1][1]);
      pa[mt][3] = pack2(sc[mt][2 * p + 1][2], sc[mt][2 * p + 1][3]);
      da[mt][0] = pack2(dp[mt][2 * p][0], dp[mt][2 * p][1]);
      da[mt][1] = pack2(dp[mt][2 * p][2], dp[mt][2 * p][3]);
      da[mt][2] = pack2(dp[mt][2 * p + 1][0], dp[mt][2 * p + 1][1]);
      da[mt][3] = pack2(dp[mt][2 * p + 1][2], dp[mt][2 * p + 1][3]);
    }
#pragma unroll
    for (int d2 = 0; d2 < HD / 16; ++d2) {
      u32 b[4], c[4];
      ld_b(b, ds, qr + p * 16, d2, lane);
      ld_b(c, qs, qr + p * 16, d2, lane);
#pragma unroll
      for (int mt = 0; mt < DKV_MT; ++mt) {
        mma16(dv[mt][2 * d2], pa[mt], b[0], b[1]);
        mma16(dv[mt][2 * d2 + 1], pa[mt], b[2], b[3]);
        mma16(dk[mt][2 * d2], da[mt], c[0], c[1]);
        mma16(dk[mt][2 * d2 + 1], da[mt], c[2], c[3]);
      }
    }
  }
}

// Query tile `qt` into stage `stage`: its q and dout rows, and its (rowsum, lse log2(e)) pairs
// (zeros past T: such queries then add nothing, as their dout rows are zeros too).
__device__ __forceinline__ void dkv_load(u32 sb, u32 stt_sb, int stage, int qt, const elem* q, const elem* dO, const float* sts, long long rs,
                                         long long C, int T) {
  const u32 st = sb + stage * DKV_STAGE * 2;
  load_tile<DKV_BQ, DKV_THREADS>(st, q, rs, qt * DKV_BQ, T);
  load_tile<DKV_BQ, DKV_THREADS>(st + DKV_BQ * LDS * 2, dO, C, qt * DKV_BQ, T);
  for (int r = threadIdx.x; r < DKV_BQ; r += DKV_THREADS) {
    const int row = qt * DKV_BQ + r;
    cp8(stt_sb + (stage * DKV_BQ + r) * 8, sts + 2 * (row < T ? row : 0), row < T);
  }
  cp_commit();
}

#if !defined(FUSEC_FLASH_ONLY) || FUSEC_FLASH_ONLY == 2
extern "C" __global__ void __launch_bounds__(DKV_THREADS, DKV_MINB) fusec_flash_bwd_dkv(const elem* qkv, const float* lse, const elem* dout, const float* stats,
                                                                            elem* dqkv, int T, int H, float scale) {
  __shared__ __align__(128) elem sm[DKV_SMEM];
  __shared__ __align__(16) float2 stt[2][DKV_BQ];
  const int kt = blockIdx.z, h = blockIdx.x;
  const long long s = blockIdx.y, C = (long long)H * HD, rs = 3 * C, bh = s * H + h;
  const elem* q = qkv + s * T * rs + h * HD;
  const elem* dO = dout + s * T * C + h * HD;
  const float* sts = stats + 2 * bh * T;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int k0 = kt * DKV_BK, wr = w * 16 * DKV_MT, wk0 = k0 + wr;
  const float scale2 = scale * LOG2E;
  const u32 sb = smem_u32(sm);
  (void)lse;
  load_tile<DKV_BK, DKV_THREADS>(sb, q + C, rs, k0, T);
  load_tile<DKV_BK, DKV_THREADS>(sb + DKV_BK * LDS * 2, q + 2 * C, rs, k0, T);
  cp_commit();
  cp_wait<0>();
  __syncthreads();
  u32 kf[DKV_MT][KD][4], vf[DKV_MT][KD][4];
#pragma unroll
  for (int mt = 0; mt < DKV_MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      ld_a(kf[mt][kk], sb, wr + mt * 16, kk, lane);
      ld_a(vf[mt][kk], sb + DKV_BK * LDS * 2, wr + mt * 16, kk, lane);
    }
  __syncthreads();
  // Query tiles from the one holding key k0 to the end.
  const int qt0 = k0 / DKV_BQ, nqt = (T + DKV_BQ - 1) / DKV_BQ;
  const u32 stt_sb = smem_u32(&stt[0][0]);
  dkv_load(sb, stt_sb, 0, qt0, q, dO, sts, rs, C, T);
  float dk[DKV_MT][ND][4], dv[DKV_MT][ND][4];
#pragma unroll
  for (int mt = 0; mt < DKV_MT; ++mt)
#pragma unroll
    for (int dn = 0; dn < ND; ++dn)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[mt][dn][e] = dv[mt][dn][e] = 0.0f;
  for (int qt = qt0; qt < nqt; ++qt) {
    const int i = qt - qt0;
    if (qt + 1 < nqt) {
      dkv_load(sb, stt_sb, (i + 1) & 1, qt + 1, q, dO, sts, rs, C, T);
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const u32 qs = sb + (i & 1) * DKV_STAGE * 2, ds = qs + DKV_BQ * LDS * 2;
#pragma unroll
    for (int c = 0; c < DKV_BQ / DKV_QC; ++c) {
      const int qc0 = qt * DKV_BQ + c * DKV_QC;
      // Queries before the warp's first key: nothing to do; before its last key: masked.
      if (qc0 + DKV_QC - 1 >= wk0) {
        if (qc0 < wk0 + 16 * DKV_MT - 1)
          dkv_chunk<true>(dk, dv, kf, vf, qs, ds, stt[i & 1], c * DKV_QC, qc0, wk0, lane, scale2);
        else
          dkv_chunk<false>(dk, dv, kf, vf, qs, ds, stt[i & 1], c * DKV_QC, qc0, wk0, lane, scale2);
      }
    }
    __syncthreads();
  }
  float one[DKV_MT][2], sc2[DKV_MT][2];
#pragma unroll
  for (int mt = 0; mt < DKV_MT; ++mt) {
    one[mt][0] = one[mt][1] = 1.0f;
    sc2[mt][0] = sc2[mt][1] = scale;
  }
  elem* dst = dqkv + s * T * rs + h * HD;
  stage_acc<DKV_MT>(sm, dk, wr, g, t, sc2);
  stage_acc<DKV_MT>(sm + DKV_BK * LDS, dv, wr, g, t, one);
  __syncthreads();
  store_tile<DKV_BK, DKV_THREADS>(dst + C, rs, sm, k0, T);
  store_tile<DKV_BK, DKV_THREADS>(dst + 2 * C, rs, sm + DKV_BK * LDS, k0, T);
}
#endif
