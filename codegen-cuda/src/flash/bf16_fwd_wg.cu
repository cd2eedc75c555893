// Forward on Hopper (sm_90a, head size 64; see flash/bf16.rs): warpgroup MMAs
// (`wgmma.mma_async`). One warpgroup of 64 query rows a block (the `dq` kernel in
// bf16_bwd_wg.cu takes WG_N); key tiles of 64 keys. q (loaded once) and k and v
// (double-buffered) go by cp.async into the
// 128-byte swizzled layout wgmma reads from shared memory: 16-byte chunk c of row r at
// r * 128 + ((c ^ (r % 8)) * 16), tiles 1024-byte aligned. `s = q k^T` reads both operands from
// shared memory; `o += p v` takes p from registers (the A fragments of mma.sync m16n8k16, a
// warp's 16 rows each), so the softmax is the mma.sync forward's on the same accumulator layout
// and the results are its bits. (q as a register operand as well gave wrong scores from the
// second key tile on: its registers did not survive the first tile's products.)
#define WG_THREADS (WG_N * 128)
#define WG_BM (WG_N * 64)
#define WG_BN 64
#define WG_TILE (WG_BN * 128)

// Rows [r0, r0 + R) of a 64-column bf16 matrix (from `base`, row stride `stride`) into the
// swizzled tile at `sm`, by NT threads; rows at or past T are zeros.
template <int R, int NT> __device__ __forceinline__ void load_sw(u32 sm, const elem* base, long long stride, int r0, int T) {
#pragma unroll
  for (int k = 0; k < R * 8 / NT; ++k) {
    const int i = k * NT + (int)threadIdx.x, r = i >> 3, c = i & 7, row = r0 + r;
    const bool valid = row < T;
    cp16(sm + (u32)(r * 128 + ((c ^ (r & 7)) << 4)), base + (long long)(valid ? row : 0) * stride + c * 8, valid);
  }
}
// The shared-memory descriptor of a swizzled tile from byte address `a`: start >> 4, leading
// offset 1 (unused by swizzled layouts), 1024 bytes between groups of 8 rows, 128-byte swizzle.
__device__ __forceinline__ unsigned long long wg_desc(u32 a) {
  return (unsigned long long)((a & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Pins 32 accumulators after a wait: the compiler sees the wgmma asm as writing them at issue,
// so without this it may move their readers above the wait.
__device__ __forceinline__ void wg_pin(float* d) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared-memory writes of this thread (cp.async) made visible to wgmma's reads.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

#define WG_D32(d)                                                                                                              \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]),       \
      "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),     \
      "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),     \
      "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
// d (64 x 64 f32, the warpgroup's accumulator fragments) += a b, where a (64 x 16) is a shared
// tile stored [m][k] and b (16 x 64) one stored [n][k] (both K-major: `q k^T`).
__device__ __forceinline__ void wgmma_ss(float* d, unsigned long long da, unsigned long long db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, "
               "%14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
               : WG_D32(d)
               : "l"(da), "l"(db), "r"(1));
}
// d += a b with a (64 x 16 bf16) in registers (the A fragments of mma.sync m16n8k16, a warp's
// 16 rows each) and b (16 x 64) a shared tile stored [k][n] (N-major: `v` in `p v`).
__device__ __forceinline__ void wgmma_n(float* d, const u32* a, unsigned long long desc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, "
               "%14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, "
               "p, 1, 1, 1;\n}\n"
               : WG_D32(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// Key tile k0's k and v (64 rows each) into the stage at `st` (v at st + WG_TILE), one commit.
__device__ __forceinline__ void wg_load_kv(u32 st, const elem* k, const elem* v, long long rs, int k0, int T) {
  load_sw<WG_BN, WG_THREADS>(st, k, rs, k0, T);
  load_sw<WG_BN, WG_THREADS>(st + WG_TILE, v, rs, k0, T);
  cp_commit();
}
// The key-tile pipeline of the Hopper kernels (two stages of k and v from `sb`): starts key tile
// j + 1's loads where there is one, waits for tile j's and makes them visible to wgmma. Returns
// tile j's k address (its v follows at + WG_TILE).
__device__ __forceinline__ u32 wg_next_kv(u32 sb, const elem* k, const elem* v, long long rs, int j, int nkt, int T) {
  if (j + 1 < nkt) {
    wg_load_kv(sb + ((j + 1) & 1) * 2 * WG_TILE, k, v, rs, (j + 1) * WG_BN, T);
    cp_wait<1>();
  } else {
    cp_wait<0>();
  }
  fence_async_smem();
  __syncthreads();
  return sb + (j & 1) * 2 * WG_TILE;
}
// x = xa xb^T and y = ya yb^T over the head dimension (KD steps of 16 columns), both from
// swizzled shared tiles stored K-major, issued together and waited for (the backward's s and dp).
__device__ __forceinline__ void wgmma_pair_ss(float* x, float* y, u32 xa, u32 xb, u32 ya, u32 yb) {
#pragma unroll
  for (int e = 0; e < 32; ++e) x[e] = y[e] = 0.0f;
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) wgmma_ss(x, wg_desc(xa + kk * 32), wg_desc(xb + kk * 32));
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) wgmma_ss(y, wg_desc(ya + kk * 32), wg_desc(yb + kk * 32));
  wg_commit();
  wg_wait();
  wg_pin(x);
  wg_pin(y);
}
// The 64 x 64 accumulator `a` as bf16 A fragments of 16-column slices: slice p is columns
// [16p, 16p + 16), the accumulators of n-tiles 2p and 2p + 1.
__device__ __forceinline__ void wg_pack_a(u32 (*pa)[4], const float* a) {
#pragma unroll
  for (int p = 0; p < 4; ++p)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[p][r] = pack2(a[8 * p + 2 * r], a[8 * p + 2 * r + 1]);
}
// d += a b for `a` packed by wg_pack_a and b the 64-row N-major swizzled tile at `b`.
__device__ __forceinline__ void wgmma_n64(float* d, const u32 (*pa)[4], u32 b) {
#pragma unroll
  for (int p = 0; p < 4; ++p) wgmma_n(d, pa[p], wg_desc(b + p * 2048));
}

#if !defined(FUSEC_FLASH_ONLY) || FUSEC_FLASH_ONLY == 0
// One warpgroup of 64 query rows a block (WG_N == 1), its products pipelined as in
// FlashAttention-3: at key tile j the block issues s_j = q k_j^T and o += p_{j-1} v_{j-1}
// together, waits for s_j only, and computes the softmax of s_j while the tensor cores add
// p_{j-1} v_{j-1}; then o is rescaled and p_j packed for the next tile. The sums are the serial
// loop's in its order (o = o alpha_j + p_j v_j), so the bits are the mma.sync forward's. k and v
// have two stages each, loaded at different times: k_{j+1} when tile j starts (its stage held
// k_{j-1}, read by s_{j-1}), v_{j+1} once p_{j-1} v_{j-1} is done (its stage held v_{j-1}).
extern "C" __global__ void __launch_bounds__(WG_THREADS, FWD_MINB) fusec_flash_fwd(const elem* qkv, elem* out, float* lse, int T, int H, float scale) {
  // 64 rows of q (8 KiB, swizzled), then two stages of k and v (8 KiB each).
  __shared__ __align__(1024) elem sm[4096 + 2 * WG_TILE];
  const int nt = (T + WG_BM - 1) / WG_BM, qt = nt - 1 - (int)blockIdx.z, h = blockIdx.x;
  const long long s = blockIdx.y, C = (long long)H * HD, rs = 3 * C;
  const elem* q = qkv + s * T * rs + h * HD;
  const elem* k = q + C;
  const elem* v = q + 2 * C;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = qt * WG_BM, wr = w * 16, wr0 = q0 + wr;
  const float scale2 = scale * LOG2E;
  const u32 qs = smem_u32(sm), sb = qs + 8192;
  // Stage x of k at sb + x * 2 WG_TILE, of v WG_TILE after it.
  load_sw<64, WG_THREADS>(qs, q, rs, q0, T);
  const int nkt = (min(q0 + WG_BM, T) + WG_BN - 1) / WG_BN;
  wg_load_kv(sb, k, v, rs, 0, T);
  float o[32], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i] = 0.0f;
  u32 pa[4][4];
  for (int j = 0; j < nkt; ++j) {
    const u32 ks = sb + (j & 1) * 2 * WG_TILE, vprev = sb + ((j + 1) & 1) * 2 * WG_TILE + WG_TILE;
    const int k0 = j * WG_BN;
    // Groups after k_j's: v_j (from tile j - 1) and k_{j+1}; k_j is in the first group at j = 0.
    if (j + 1 < nkt) {
      load_sw<WG_BN, WG_THREADS>(sb + ((j + 1) & 1) * 2 * WG_TILE, k, rs, (j + 1) * WG_BN, T);
      cp_commit();
      if (j > 0) cp_wait<2>(); else cp_wait<1>();
    } else {
      if (j > 0) cp_wait<1>(); else cp_wait<0>();
    }
    fence_async_smem();
    __syncthreads();
    float sc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) sc[i] = 0.0f;
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) wgmma_ss(sc, wg_desc(qs + kk * 32), wg_desc(ks + kk * 32));
    wg_commit();
    if (j > 0) {
      wgmma_n64(o, pa, vprev);
      wg_commit();
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    } else {
      wg_wait();
    }
    wg_pin(sc);
    const bool mask = k0 + WG_BN - 1 > q0;
    float ms[2], alpha[2];
    bool same = true;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = wr0 + g + 8 * hh;
      float mx = m[hh];
#pragma unroll
      for (int nb = 0; nb < 8; ++nb)
#pragma unroll
        for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
          if (mask && k0 + nb * 8 + 2 * t + (e & 1) > row) sc[4 * nb + e] = NEG_INF;
          mx = fmaxf(mx, sc[4 * nb + e]);
        }
      mx = quad_max(mx);
      ms[hh] = mx == NEG_INF ? 0.0f : mx * scale2;
      alpha[hh] = ex2(fmaf(m[hh], scale2, -ms[hh]));
      same = same && alpha[hh] == 1.0f;
      m[hh] = mx;
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float sum = l[hh] * alpha[hh];
#pragma unroll
      for (int nb = 0; nb < 8; ++nb)
#pragma unroll
        for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
          const float p = ex2(fmaf(sc[4 * nb + e], scale2, -ms[hh]));
          sum += p;
          sc[4 * nb + e] = p;
        }
      l[hh] = sum;
    }
    // p_{j-1} v_{j-1} done: o (and pa, which it read) are free.
    wg_wait();
    wg_pin(o);
    if (!__all_sync(FULL, same)) {
#pragma unroll
      for (int i = 0; i < 32; ++i) o[i] *= alpha[(i >> 1) & 1];
    }
    // The accumulators of key tiles 2p and 2p + 1 are the A fragment of keys [16p, 16p + 16).
    wg_pack_a(pa, sc);
    // Every warp is past s_j and p_{j-1} v_{j-1}: v_{j-1}'s stage takes v_{j+1}.
    __syncthreads();
    if (j + 1 < nkt) {
      load_sw<WG_BN, WG_THREADS>(sb + ((j + 1) & 1) * 2 * WG_TILE + WG_TILE, v, rs, (j + 1) * WG_BN, T);
      cp_commit();
    }
  }
  // o += p_last v_last (v_last is in the stage of the last tile).
  cp_wait<0>();
  fence_async_smem();
  __syncthreads();
  wg_fence();
  wgmma_n64(o, pa, sb + ((nkt - 1) & 1) * 2 * WG_TILE + WG_TILE);
  wg_commit();
  wg_wait();
  wg_pin(o);
  float inv[1][2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float sum = quad_sum(l[hh]);
    inv[0][hh] = 1.0f / sum;
    const int row = wr0 + g + 8 * hh;
    if (t == 0 && row < T) lse[(s * H + h) * T + row] = fmaf(m[hh], scale2, log2f(sum)) * LN2;
  }
  __syncthreads();
  elem* so = sm + 4096;
  stage_acc<1>(so, (const float(*)[ND][4])o, wr, g, t, inv);
  __syncthreads();
  store_tile<WG_BM, WG_THREADS>(out + s * T * C + h * HD, C, so, q0, T);
}
#endif
