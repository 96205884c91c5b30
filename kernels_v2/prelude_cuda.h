// metal-attn: CUDA prelude.
// Supplies the Metal vocabulary the shared kernel bodies use, so that the same
// text compiles with mx.fast.cuda_kernel (NVRTC). MLX places this header before
// `namespace mlx::core::cu { __global__ void ...(...) { <template lines> <body> } }`.
// Assumptions: threadgroups are 1-D in x for the simd indices below only in
// that they are linearised x-fastest, like Metal; a simdgroup is a 32-lane warp,
// and every simd_* call is made by all 32 lanes (full mask).

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned int uint;
typedef unsigned short ushort;

// Address-space words and function qualifiers.
#define device
#define constant
#define thread
#define threadgroup __shared__
#define MA_FUNC __device__ __forceinline__

// Thread-position attributes (Metal passes them as kernel arguments).
#define thread_position_in_threadgroup (make_uint3(threadIdx.x, threadIdx.y, threadIdx.z))
#define threadgroup_position_in_grid (make_uint3(blockIdx.x, blockIdx.y, blockIdx.z))
#define threads_per_threadgroup (make_uint3(blockDim.x, blockDim.y, blockDim.z))
#define thread_position_in_grid                                                     \
  (make_uint3(blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y, \
              blockIdx.z * blockDim.z + threadIdx.z))
#define thread_index_in_threadgroup \
  (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z))
#define thread_index_in_simdgroup (thread_index_in_threadgroup & 31u)
#define simdgroup_index_in_threadgroup (thread_index_in_threadgroup >> 5)

// Barriers and memory flags.
namespace mem_flags {
constexpr unsigned mem_none = 0u;
constexpr unsigned mem_device = 1u;
constexpr unsigned mem_threadgroup = 2u;
}  // namespace mem_flags
#define threadgroup_barrier(flags) __syncthreads()
#define simdgroup_barrier(flags) __syncwarp()

// SIMD-group functions (warp shuffles over all 32 lanes).
template <typename U>
MA_FUNC U simd_shuffle_xor(U v, uint mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
template <typename U>
MA_FUNC U simd_shuffle(U v, uint lane) {
  return __shfl_sync(0xffffffffu, v, lane);
}
template <typename U>
MA_FUNC U simd_sum(U v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename U>
MA_FUNC U simd_max(U v) {
  for (int o = 16; o > 0; o >>= 1) {
    U w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// Four warp sums at once, every lane receiving all four: a transposed butterfly
// (2 + 1 + 3 exchanges, then 4 broadcasts: 10 shuffles instead of 4 x 5). Lanes 0, 8,
// 16 and 24 end up holding the totals of a, b, c and d.
MA_FUNC void ma_simd_sum4(float& a, float& b, float& c, float& d) {
  const unsigned lane = thread_index_in_simdgroup;
  const bool h16 = (lane & 16u) != 0u;
  float x0 = h16 ? c : a;
  float x1 = h16 ? d : b;
  const float y0 = h16 ? a : c;
  const float y1 = h16 ? b : d;
  x0 += __shfl_xor_sync(0xffffffffu, y0, 16);
  x1 += __shfl_xor_sync(0xffffffffu, y1, 16);
  const bool h8 = (lane & 8u) != 0u;
  float z = h8 ? x1 : x0;
  const float w = h8 ? x0 : x1;
  z += __shfl_xor_sync(0xffffffffu, w, 8);
  z += __shfl_xor_sync(0xffffffffu, z, 4);
  z += __shfl_xor_sync(0xffffffffu, z, 2);
  z += __shfl_xor_sync(0xffffffffu, z, 1);
  a = __shfl_sync(0xffffffffu, z, 0);
  b = __shfl_sync(0xffffffffu, z, 8);
  c = __shfl_sync(0xffffffffu, z, 16);
  d = __shfl_sync(0xffffffffu, z, 24);
}

// metal:: math used by the bodies.
namespace metal {
MA_FUNC float exp2(float x) { return exp2f(x); }
MA_FUNC float tanh(float x) { return tanhf(x); }
MA_FUNC float abs(float x) { return fabsf(x); }
MA_FUNC float max(float a, float b) { return fmaxf(a, b); }
MA_FUNC float min(float a, float b) { return fminf(a, b); }
MA_FUNC int max(int a, int b) { return a > b ? a : b; }
MA_FUNC int min(int a, int b) { return a < b ? a : b; }
namespace fast {
MA_FUNC float exp2(float x) { return exp2f(x); }
}  // namespace fast
}  // namespace metal

// Element conversions.
MA_FUNC float ma_to_float(float x) { return x; }
MA_FUNC float ma_to_float(__half x) { return __half2float(x); }
MA_FUNC float ma_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename U>
MA_FUNC U ma_from_float(float x);
template <>
MA_FUNC float ma_from_float<float>(float x) { return x; }
template <>
MA_FUNC __half ma_from_float<__half>(float x) { return __float2half_rn(x); }
template <>
MA_FUNC __nv_bfloat16 ma_from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Load 4 consecutive elements as float with one vector load (8 or 16 bytes).
MA_FUNC void ma_load4(const float* p, float* out) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
}
MA_FUNC void ma_load4(const __half* p, float* out) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  out[0] = a.x; out[1] = a.y; out[2] = b.x; out[3] = b.y;
}
MA_FUNC void ma_load4(const __nv_bfloat16* p, float* out) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  out[0] = a.x; out[1] = a.y; out[2] = b.x; out[3] = b.y;
}

// Four packed elements kept in registers until they are used: one 8-byte (16-bit
// types) or 16-byte (float) load now, the conversion later. Issuing every load of a
// chunk of tokens before any arithmetic keeps many loads in flight per warp.
template <typename U>
struct ma_raw4 {
  uint2 bits;
};
template <>
struct ma_raw4<float> {
  float4 bits;
};
template <typename U>
MA_FUNC ma_raw4<U> ma_load_raw4(const U* p) {
  ma_raw4<U> r;
  r.bits = *reinterpret_cast<const decltype(r.bits)*>(p);
  return r;
}
MA_FUNC void ma_unpack4(ma_raw4<float> r, float* out) {
  out[0] = r.bits.x; out[1] = r.bits.y; out[2] = r.bits.z; out[3] = r.bits.w;
}
MA_FUNC void ma_unpack4(ma_raw4<__half> r, float* out) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&r.bits.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&r.bits.y));
  out[0] = a.x; out[1] = a.y; out[2] = b.x; out[3] = b.y;
}
MA_FUNC void ma_unpack4(ma_raw4<__nv_bfloat16> r, float* out) {
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.bits.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.bits.y));
  out[0] = a.x; out[1] = a.y; out[2] = b.x; out[3] = b.y;
}

// Ask L2 for the 128-byte line holding `p` (no register, no wait): used one page
// ahead so that the page's loads later hit L2 instead of DRAM.
template <typename U>
MA_FUNC void ma_prefetch(const U* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
