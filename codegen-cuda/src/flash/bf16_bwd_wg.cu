// The backward on Hopper (sm_90a, head size 64; see flash/bf16.rs and bf16_fwd_wg.cu for the
// layouts and helpers). Both kernels give the mma.sync kernels' bits; with a non-null `colsum`
// they also write partial column sums of what they store (acc_colsum below).
//
// dk, dv: one warpgroup of 64 keys a block. k and v stay in swizzled shared
// tiles (the A operands of s^T = k q^T and dp^T = v dout^T); each 64-query tile of q and dout is
// double-buffered by cp.async with its (rowsum, lse log2(e)) pairs; p^T and ds^T go from the
// accumulators into registers as the A operands of dv += p^T dout and dk += ds^T q, whose B
// operands are the same q and dout tiles read N-major. Dynamic shared memory (its size is
// flash::bf16::DKV_WG_SHARED): 16 KiB of k and v, two stages of 16 KiB, 1 KiB of statistics,
// and 1 KiB to align the tiles to 1024 bytes.

// Query tile qt's q and dout rows (swizzled, at sb + stage * 16 KiB) and its (rowsum, lse log2 e)
// pairs (at stt + stage * 512) into stage `stage` of the dk/dv kernel, one commit.
__device__ __forceinline__ void dkv_wg_load(u32 sb, u32 stt, const elem* q, const elem* dO, const float* sts, long long rs, long long C,
                                            int stage, int qt, int T) {
  const u32 st = sb + stage * 16384;
  load_sw<64, 128>(st, q, rs, qt * 64, T);
  load_sw<64, 128>(st + 8192, dO, C, qt * 64, T);
  for (int r = threadIdx.x; r < 64; r += 128) {
    const int row = qt * 64 + r;
    cp8(stt + (stage * 64 + r) * 8, sts + 2 * (row < T ? row : 0), row < T);
  }
  cp_commit();
}

// The column sums the runtime folds into the backward (the qkv bias gradient,
// flash::sums_columns): the sums over the tile's first `rows` rows of the warpgroup's 64 x HD
// accumulator `acc` times `mul`, rounded to bf16 as stage_acc stores them, into dst[0, HD). Each
// thread adds its two rows, the eight row groups of a warp meet by shuffles, the four warps in
// order through `red` (4 HD floats of shared memory). Each (sequence, 64-row tile) writes its
// own row of partial sums; fusec_sum_rows adds them in row order (deterministic).
#if WG_N != 1
#error "the partial column sums take the 64-row tiles of both kernels"
#endif
__device__ __forceinline__ void acc_colsum(float* dst, const float* acc, float mul, int rows, float* red) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const bool lo = 16 * w + g < rows, hi = 16 * w + g + 8 < rows;
  float cs[2 * ND];
#pragma unroll
  for (int dn = 0; dn < ND; ++dn)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float a = lo ? __uint_as_float(pack2(acc[4 * dn + e] * mul, 0.0f) << 16) : 0.0f;
      const float b = hi ? __uint_as_float(pack2(acc[4 * dn + 2 + e] * mul, 0.0f) << 16) : 0.0f;
      cs[2 * dn + e] = a + b;
    }
#pragma unroll
  for (int i = 0; i < 2 * ND; ++i) {
    cs[i] += __shfl_xor_sync(FULL, cs[i], 4);
    cs[i] += __shfl_xor_sync(FULL, cs[i], 8);
    cs[i] += __shfl_xor_sync(FULL, cs[i], 16);
  }
  if (g == 0)
#pragma unroll
    for (int dn = 0; dn < ND; ++dn) *(float2*)(red + w * HD + dn * 8 + 2 * t) = make_float2(cs[2 * dn], cs[2 * dn + 1]);
  __syncthreads();
  if (threadIdx.x < HD) dst[threadIdx.x] = ((red[threadIdx.x] + red[HD + threadIdx.x]) + red[2 * HD + threadIdx.x]) + red[3 * HD + threadIdx.x];
}

// Three blocks an SM (168 registers): 0.155 -> 0.131 ms at the 124M shape on an H200 (four
// spill).
#ifndef DKVW_MINB
#define DKVW_MINB 3
#endif
#if !defined(FUSEC_FLASH_ONLY) || FUSEC_FLASH_ONLY == 2
extern "C" __global__ void __launch_bounds__(128, DKVW_MINB) fusec_flash_bwd_dkv(const elem* qkv, const float* lse, const elem* dout, const float* stats,
                                                                    elem* dqkv, int T, int H, float scale, float* colsum) {
  extern __shared__ unsigned char dyn[];
  const int kt = blockIdx.z, h = blockIdx.x;
  const long long s = blockIdx.y, C = (long long)H * HD, rs = 3 * C, bh = s * H + h;
  const elem* q = qkv + s * T * rs + h * HD;
  const elem* dO = dout + s * T * C + h * HD;
  const float* sts = stats + 2 * bh * T;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int k0 = kt * 64, wk0 = k0 + w * 16;
  const float scale2 = scale * LOG2E;
  (void)lse;
  const u32 base = (smem_u32(dyn) + 1023u) & ~1023u, ks = base, vs = base + 8192, sb = base + 16384, stt = base + 16384 + 2 * 16384;
  elem* sm = (elem*)(dyn + (base - smem_u32(dyn)));
  load_sw<64, 128>(ks, q + C, rs, k0, T);
  load_sw<64, 128>(vs, q + 2 * C, rs, k0, T);
  // Query tiles from the one holding key k0 to the end (64-row tiles: k0's tile is the diagonal).
  const int qt0 = kt, nqt = (T + 63) / 64;
  dkv_wg_load(sb, stt, q, dO, sts, rs, C, 0, qt0, T);
  float dk[32], dv[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) dk[i] = dv[i] = 0.0f;
  for (int qt = qt0; qt < nqt; ++qt) {
    const int i = qt - qt0;
    if (qt + 1 < nqt) {
      dkv_wg_load(sb, stt, q, dO, sts, rs, C, (i + 1) & 1, qt + 1, T);
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    fence_async_smem();
    __syncthreads();
    const u32 qs = sb + (i & 1) * 16384, ds = qs + 8192;
    const float2* st2 = (const float2*)(dyn + (stt - smem_u32(dyn))) + (i & 1) * 64;
    float sc[32], dp[32];
    wgmma_pair_ss(sc, dp, ks, qs, vs, ds);
    // Rows are keys (16 w + g, + 8), columns queries; the diagonal tile is masked (query < key).
    const bool mask = qt == kt;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
      const float4 qs2 = *(const float4*)(st2 + nb * 8 + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float rsum = (e & 1) ? qs2.z : qs2.x, l2 = (e & 1) ? qs2.w : qs2.y;
        float p = ex2(fmaf(sc[4 * nb + e], scale2, -l2));
        if (mask && qt * 64 + nb * 8 + 2 * t + (e & 1) < wk0 + g + 8 * (e >> 1)) p = 0.0f;
        sc[4 * nb + e] = p;
        dp[4 * nb + e] = p * (dp[4 * nb + e] - rsum);
      }
    }
    u32 pa[4][4], da[4][4];
    wg_pack_a(pa, sc);
    wg_pack_a(da, dp);
    wg_fence();
    wgmma_n64(dv, pa, ds);
    wgmma_n64(dk, da, qs);
    wg_commit();
    wg_wait();
    wg_pin(dv);
    wg_pin(dk);
    __syncthreads();
  }
  float one[1][2] = {{1.0f, 1.0f}}, sc2[1][2] = {{scale, scale}};
  elem* dst = dqkv + s * T * rs + h * HD;
  stage_acc<1>(sm + 8192, (const float(*)[ND][4])dk, w * 16, g, t, sc2);
  stage_acc<1>(sm + 8192 + 64 * LDS, (const float(*)[ND][4])dv, w * 16, g, t, one);
  __syncthreads();
  store_tile<64, 128>(dst + C, rs, sm + 8192, k0, T);
  store_tile<64, 128>(dst + 2 * C, rs, sm + 8192 + 64 * LDS, k0, T);
  if (colsum) {
    // Past the staged tiles: the q and dout stages are free now.
    float* red = (float*)(dyn + (base - smem_u32(dyn)) + 36864);
    float* row = colsum + (s * gridDim.z + kt) * rs + h * HD;
    acc_colsum(row + C, dk, scale, min(64, T - k0), red);
    acc_colsum(row + 2 * C, dv, 1.0f, min(64, T - k0), red + 4 * HD);
  }
}
#endif

// dq on Hopper: WG_N warpgroups of 64 query rows a block; each warpgroup's q and dout rows stay in
// swizzled shared tiles (the A operands of s = q k^T and dp = dout v^T), 64-key tiles of k and v
// are double-buffered; ds goes from the accumulators into registers as the A operand of
// dq += ds k. Writes the row statistics dk/dv reads, as the mma.sync kernel does. Dynamic shared
// memory (flash::bf16::DQ_WG_SHARED): q and dout (16 KiB a warpgroup), two stages of k and v
// (32 KiB), the row sums, and 1 KiB to align the tiles.
// Four one-warpgroup blocks an SM (128 registers).
#ifndef DQW_MINB
#define DQW_MINB 4
#endif

#if !defined(FUSEC_FLASH_ONLY) || FUSEC_FLASH_ONLY == 1
extern "C" __global__ void __launch_bounds__(WG_THREADS, DQW_MINB) fusec_flash_bwd_dq(const elem* qkv, const elem* out, const float* lse, const elem* dout,
                                                                 elem* dqkv, float* stats, int T, int H, float scale, float* colsum) {
  extern __shared__ unsigned char dyn[];
  const int nt = (T + WG_BM - 1) / WG_BM, qt = nt - 1 - (int)blockIdx.z, h = blockIdx.x;
  const long long s = blockIdx.y, C = (long long)H * HD, rs = 3 * C, bh = s * H + h;
  const elem* q = qkv + s * T * rs + h * HD;
  const elem* o = out + s * T * C + h * HD;
  const elem* dO = dout + s * T * C + h * HD;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = qt * WG_BM, wr = w * 16, wr0 = q0 + wr, wg0 = q0 + (w >> 2) * 64;
  const float scale2 = scale * LOG2E;
  const u32 base = (smem_u32(dyn) + 1023u) & ~1023u, qs = base, dos = base + WG_N * 8192, sb = base + WG_N * 16384;
  const u32 qw = qs + (w >> 2) * 8192, dw = dos + (w >> 2) * 8192;
  unsigned char* const b8 = dyn + (base - smem_u32(dyn));
  float* dsm = (float*)(b8 + WG_N * 16384 + 2 * 16384);
#pragma unroll
  for (int i = 0; i < WG_N; ++i) {
    load_sw<64, WG_THREADS>(qs + i * 8192, q, rs, q0 + 64 * i, T);
    load_sw<64, WG_THREADS>(dos + i * 8192, dO, C, q0 + 64 * i, T);
  }
  wg_load_kv(sb, q + C, q + 2 * C, rs, 0, T);
  dq_rowsums<16>(dsm, stats, dO, o, lse, C, bh, T, q0, wr, lane);
  __syncthreads();
  float lr[2], dr[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int rl = wr + g + 8 * hh, row = q0 + rl;
    lr[hh] = row < T ? lse[bh * T + row] * LOG2E : 0.0f;
    dr[hh] = dsm[rl];
  }
  const int nkt = (min(q0 + WG_BM, T) + WG_BN - 1) / WG_BN;
  float dq[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) dq[i] = 0.0f;
  for (int j = 0; j < nkt; ++j) {
    const u32 ks = wg_next_kv(sb, q + C, q + 2 * C, rs, j, nkt, T), vs = ks + WG_TILE;
    const int k0 = j * WG_BN;
    if (k0 <= wg0 + 63) {
      float sc[32], dp[32];
      wgmma_pair_ss(sc, dp, qw, ks, dw, vs);
      const bool mask = k0 + WG_BN - 1 > wg0;
#pragma unroll
      for (int nb = 0; nb < 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e >> 1;
          float p = ex2(fmaf(sc[4 * nb + e], scale2, -lr[hh]));
          if (mask && k0 + nb * 8 + 2 * t + (e & 1) > wr0 + g + 8 * hh) p = 0.0f;
          sc[4 * nb + e] = p * (dp[4 * nb + e] - dr[hh]);
        }
      u32 da[4][4];
      wg_pack_a(da, sc);
      wg_fence();
      wgmma_n64(dq, da, ks);
      wg_commit();
      wg_wait();
      wg_pin(dq);
    }
    __syncthreads();
  }
  float muls[1][2] = {{scale, scale}};
  elem* so = (elem*)(b8 + WG_N * 16384);
  stage_acc<1>(so, (const float(*)[ND][4])dq, wr, g, t, muls);
  __syncthreads();
  store_tile<WG_BM, WG_THREADS>(dqkv + s * T * rs + h * HD, rs, so, q0, T);
  // Past the staged tile: the k and v stages are free now.
  if (colsum) acc_colsum(colsum + (s * nt + qt) * rs + h * HD, dq, scale, min(WG_BM, T - q0), (float*)(b8 + 32768));
}
#endif
