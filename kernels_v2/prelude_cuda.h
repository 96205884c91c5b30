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
