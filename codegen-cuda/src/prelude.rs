//! The device helpers every generated source starts with.
//!
//! No header is included: NVRTC 11.8 (what CI has) ships no `cuda_bf16.h`, and the builtins
//! used here (`__shfl_xor_sync`, `__float_as_uint`, `expf`, `tanhf`, ...) need none. bf16 is
//! converted exactly as the CPU backend does it: widening is a 16-bit shift, narrowing rounds
//! to nearest even (on sm_80+ one `cvt.rn.bf16.f32`, elsewhere `bits + 0x7fff + lsb` on the f32
//! bits: the same bits, subnormals included) and keeps NaN a quiet NaN with its sign and
//! payload (a branch around the conversion, whose own NaN is canonical). `max_nan`/`min_nan` propagate NaN like the interpreter (compare + select, never
//! `fmaxf`).
//!
//! `fast_exp` serves kernels that read bf16 storage (`emit::reads_bf16`): `ex2.approx` of the
//! argument times log2(e), relative error about 2^-21 for arguments of magnitude up to 2^6;
//! NaN stays NaN, results below 2^-126 flush to zero. `fast_tanh` serves the same kernels:
//! the hardware's `tanh.approx.f32` on sm_75 and newer (relative error at most 2^-10.99, a
//! quarter of a bf16 rounding step; one instruction where `tanhf` takes about twenty: the
//! GELU backward was bound by them on the H200), `tanhf` before.
//!
//! `st_f32x4`/`st_b32x4`/`st_b32x2` store a vector register of a wide row loop (see
//! `emit/rows.rs`) with one 16-byte (8-byte) `st.global`: NVRTC 11.2 splits a plain C store of a
//! register filled one lane at a time into 4- or 2-byte stores.
//!
//! Team reductions combine a row's partial values held by the `TEAM` threads that work on it:
//! a butterfly of `__shfl_xor_sync` inside each warp (every lane ends with the same bits, since
//! each step adds the same two values in either order), then, for teams wider than a warp,
//! the warps' values in warp order through shared memory. The order is fixed by the shape
//! alone, so the results are the same bits on every run (no atomics).

/// The helpers, as CUDA C.
pub const PRELUDE: &str = r#"__device__ __forceinline__ float bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  if (f != f) return (unsigned short)((u | 0x400000u) >> 16);
#if __CUDA_ARCH__ >= 800
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}
__device__ __forceinline__ float round_bf16(float f) {
  if (f != f) return f;
#if __CUDA_ARCH__ >= 800
  return bf16_to_f32(f32_to_bf16(f));
#else
  unsigned u = __float_as_uint(f);
  return __uint_as_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
#endif
}
__device__ __forceinline__ void st_f32x4(float* p, float4 v) {
  asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
__device__ __forceinline__ void st_b32x4(unsigned short* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void st_b32x2(unsigned short* p, uint2 v) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" :: "l"(p), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ float fast_exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504f));
  return y;
}
__device__ __forceinline__ float fast_tanh(float x) {
#if __CUDA_ARCH__ >= 750
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return tanhf(x);
#endif
}
__device__ __forceinline__ float max_nan(float a, float b) { return (b > a || b != b) ? b : a; }
__device__ __forceinline__ float min_nan(float a, float b) { return (b < a || b != b) ? b : a; }
__device__ __forceinline__ float red_sum(float a, float b) { return a + b; }
__device__ __forceinline__ float red_max(float a, float b) { return max_nan(a, b); }
template <int TEAM> __device__ __forceinline__ float team_sum(float v, float* sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, o);
  if (TEAM > 32) {
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sh[0];
#pragma unroll
    for (int w = 1; w < TEAM / 32; ++w) v = v + sh[w];
  }
  return v;
}
#if __CUDA_ARCH__ >= 900
// Cluster teams (sm_90): a row taken by a cluster of K blocks of 256 threads. Each block puts
// its total (its warps in order) in sh[8 + slot]; after the cluster barrier every thread adds
// the K totals in rank order through distributed shared memory. A row's body ends with one
// more cluster_sync, so no block reuses or leaves its slots while another reads them.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
__device__ __forceinline__ float cluster_load(const float* p, unsigned rank) {
  unsigned a, b;
  float v;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(b) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(b) : "memory");
  return v;
}
struct RedSum { __device__ float operator()(float a, float b) const { return a + b; } };
struct RedMax { __device__ float operator()(float a, float b) const { return max_nan(a, b); } };
template <int K, typename F> __device__ __forceinline__ float cluster_reduce(float v, float* sh, int slot, F f) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = f(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = sh[0];
#pragma unroll
    for (int w = 1; w < 8; ++w) b = f(b, sh[w]);
    sh[8 + slot] = b;
  }
  cluster_sync();
  float t = cluster_load(sh + 8 + slot, 0);
#pragma unroll
  for (int r = 1; r < K; ++r) t = f(t, cluster_load(sh + 8 + slot, r));
  return t;
}
template <int K> __device__ __forceinline__ float cluster_sum(float v, float* sh, int slot) { return cluster_reduce<K>(v, sh, slot, RedSum()); }
template <int K> __device__ __forceinline__ float cluster_max(float v, float* sh, int slot) { return cluster_reduce<K>(v, sh, slot, RedMax()); }
#endif
template <int TEAM> __device__ __forceinline__ float team_max(float v, float* sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (TEAM > 32) {
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sh[0];
#pragma unroll
    for (int w = 1; w < TEAM / 32; ++w) v = max_nan(v, sh[w]);
  }
  return v;
}
"#;
