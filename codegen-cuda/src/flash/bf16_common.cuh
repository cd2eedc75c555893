// Helpers of the bf16 flash-attention kernels (see flash/bf16.rs). HD (head size) and the
// tile configuration are #defined before this.
#define LDS (HD + 8)
#define KD (HD / 16)
#define ND (HD / 8)
#define CH (HD / 8)
#define NEG_INF __int_as_float(0xff800000)
#define FULL 0xffffffffu
#define LOG2E 1.44269504088896340736f
#define LN2 0.693147180559945309417f
typedef unsigned short elem;
typedef unsigned int u32;

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
// 16 bytes global -> shared, asynchronous; `valid` false writes zeros (reads nothing).
__device__ __forceinline__ void cp16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp8(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
// Four 8x8 b16 matrices from shared memory; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldsm4(u32* r, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm4t(u32* r, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// c (16x8 f32) += a (16x16 bf16, row) b (16x8 bf16, col).
__device__ __forceinline__ void mma16(float* c, const u32* a, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats rounded to bf16 (nearest even), `lo` in the low half.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// QUAD_REDUCTIONS
// rowsum(dout * out) of a warp's ROWS rows from local row `wr` of the query tile at q0: CH lanes
// a row, 8 columns a lane, a fixed butterfly. Into dsm[local row] and, with lse log2(e), into
// the (rowsum, lse log2 e) pairs of `stats` that the dk/dv kernel reads.
template <int ROWS>
__device__ __forceinline__ void dq_rowsums(float* dsm, float* stats, const elem* dO, const elem* o, const float* lse, long long C,
                                           long long bh, int T, int q0, int wr, int lane) {
#pragma unroll
  for (int i = 0; i < ROWS / (32 / CH); ++i) {
    const int rl = wr + i * (32 / CH) + lane / CH, row = q0 + rl, c = (lane % CH) * 8;
    float acc = 0.0f;
    if (row < T) {
      const uint4 a = *(const uint4*)(dO + (long long)row * C + c), b = *(const uint4*)(o + (long long)row * C + c);
      const u32 av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        acc = fmaf(__uint_as_float(av[k] << 16), __uint_as_float(bv[k] << 16), acc);
        acc = fmaf(__uint_as_float(av[k] & 0xffff0000u), __uint_as_float(bv[k] & 0xffff0000u), acc);
      }
    }
#pragma unroll
    for (int k = CH / 2; k >= 1; k >>= 1) acc += __shfl_xor_sync(FULL, acc, k);
    if (lane % CH == 0) {
      dsm[rl] = acc;
      if (row < T) *(float2*)(stats + 2 * (bh * T + row)) = make_float2(acc, lse[bh * T + row] * LOG2E);
    }
  }
}
// Rows [r0, r0 + R) of a row-major bf16 matrix (row stride `stride` elements, HD columns from
// `base`) into shared memory at byte address `sm` (rows of LDS elements), by NT threads, 16
// bytes each; rows at or past T are zeros.
template <int R, int NT> __device__ __forceinline__ void load_tile(u32 sm, const elem* base, long long stride, int r0, int T) {
#pragma unroll
  for (int k = 0; k < (R * CH + NT - 1) / NT; ++k) {
    const int i = k * NT + (int)threadIdx.x;
    if ((R * CH) % NT == 0 || i < R * CH) {
      const int r = i / CH, c = (i % CH) * 8, row = r0 + r;
      const bool valid = row < T;
      cp16(sm + (u32)(r * LDS + c) * 2, base + (long long)(valid ? row : 0) * stride + c, valid);
    }
  }
}
// The A fragments of rows [r, r + 16) and columns [16 kk, 16 kk + 16) of a staged tile.
__device__ __forceinline__ void ld_a(u32* a, u32 sm, int r, int kk, int lane) {
  ldsm4(a, sm + (u32)((r + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8) * 2);
}
// B fragments of a product with a staged [n][k] tile (b = tile^T): rows (n) [n0, n0 + 16),
// columns (k) [16 kk, 16 kk + 16); b[0], b[1] for n-tile n0, b[2], b[3] for n0 + 8.
__device__ __forceinline__ void ld_bt(u32* b, u32 sm, int n0, int kk, int lane) {
  ldsm4(b, sm + (u32)((n0 + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 + ((lane >> 3) & 1) * 8) * 2);
}
// B fragments of a product with a staged [k][n] tile: rows (k) [k0, k0 + 16), columns (n)
// [16 dp, 16 dp + 16); b[0], b[1] for n-tile 2 dp, b[2], b[3] for 2 dp + 1.
__device__ __forceinline__ void ld_b(u32* b, u32 sm, int k0, int dp, int lane) {
  ldsm4t(b, sm + (u32)((k0 + (lane & 15)) * LDS + dp * 16 + (lane >> 4) * 8) * 2);
}
// Accumulator pairs (16 rows from `r`, HD columns, times `mul` per row) rounded to bf16 into a
// staged tile; then, after a barrier, `store_tile` copies rows below T to global memory.
template <int MT> __device__ __forceinline__ void stage_acc(elem* sm, const float (*acc)[ND][4], int r, int g, int t, const float (*mul)[2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dn = 0; dn < ND; ++dn)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *(u32*)(sm + (r + mt * 16 + g + 8 * h) * LDS + dn * 8 + 2 * t) = pack2(acc[mt][dn][2 * h] * mul[mt][h], acc[mt][dn][2 * h + 1] * mul[mt][h]);
}
template <int R, int NT> __device__ __forceinline__ void store_tile(elem* base, long long stride, const elem* sm, int r0, int T) {
#pragma unroll
  for (int k = 0; k < (R * CH + NT - 1) / NT; ++k) {
    const int i = k * NT + (int)threadIdx.x;
    if ((R * CH) % NT == 0 || i < R * CH) {
      const int r = i / CH, c = (i % CH) * 8, row = r0 + r;
      if (row < T) *(uint4*)(base + (long long)row * stride + c) = *(const uint4*)(sm + r * LDS + c);
    }
  }
}
