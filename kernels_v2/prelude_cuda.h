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
// 16-byte aligned, so that packed 8/16-byte stores into threadgroup arrays are legal.
#define threadgroup __shared__ __align__(16)
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

// 8x8 float matrices spread over a warp: the portable form of Metal's
// simdgroup_matrix<float, 8, 8>, two elements a lane. Accumulators and left operands
// (A) put element i of a lane at (ma_frag_row, ma_frag_col + i); right operands (B) at
// (ma_frag_bk(i), ma_frag_bn(i)). Here the layouts are those of the tensor-core
// instruction mma.m16n8k8 (rows 8..15 of its A operand are zero and its C/D rows 8..15
// are discarded): A/C row = lane / 4, columns 2 * (lane % 4) + i; B k-row 2 * (lane % 4) + i,
// column lane / 4. The products take 16-bit operands with float accumulation.
struct ma_frag8 {
  float v[2];
};
MA_FUNC int ma_frag_row(int lane) { return lane >> 2; }
MA_FUNC int ma_frag_col(int lane) { return (lane & 3) << 1; }
MA_FUNC int ma_frag_bk(int lane, int i) { return ((lane & 3) << 1) + i; }
MA_FUNC int ma_frag_bn(int lane, int i) { return lane >> 2; }
// Reduce over the four lanes that hold one accumulator row.
MA_FUNC float ma_frag_row_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
MA_FUNC float ma_frag_row_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// One 16-bit element type's packing and tensor-core product.
template <typename U>
struct ma_mma_op;
template <>
struct ma_mma_op<__half> {
  static MA_FUNC unsigned pack(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
  }
  static MA_FUNC float2 unpack(unsigned p) { return __half22float2(*reinterpret_cast<const __half2*>(&p)); }
  static MA_FUNC void mma(float& d0, float& d1, unsigned a, unsigned b) {
    float z0, z1;
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%7,%8};\n"
        : "+f"(d0), "+f"(d1), "=f"(z0), "=f"(z1)
        : "r"(a), "r"(0u), "r"(b), "f"(0.0f), "f"(0.0f));
  }
};
template <>
struct ma_mma_op<__nv_bfloat16> {
  static MA_FUNC unsigned pack(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
  }
  static MA_FUNC float2 unpack(unsigned p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p));
  }
  static MA_FUNC void mma(float& d0, float& d1, unsigned a, unsigned b) {
    float z0, z1;
    asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%7,%8};\n"
        : "+f"(d0), "+f"(d1), "=f"(z0), "=f"(z1)
        : "r"(a), "r"(0u), "r"(b), "f"(0.0f), "f"(0.0f));
  }
};

// d += a * b for operands that hold U values (loaded from U data): exact products,
// float accumulation, as Metal's float simdgroup product computes them.
template <typename U>
MA_FUNC void ma_mma(ma_frag8& d, const ma_frag8& a, const ma_frag8& b) {
  ma_mma_op<U>::mma(d.v[0], d.v[1], ma_mma_op<U>::pack(a.v[0], a.v[1]), ma_mma_op<U>::pack(b.v[0], b.v[1]));
}
// d += a * b where a holds arbitrary floats (softmax probabilities) and b U values: a is
// split into a high and a low U part (a = hi + lo to about 16 significant bits) and both
// products are accumulated, so the probabilities are not rounded to U's 8 or 11 bits.
template <typename U>
MA_FUNC void ma_mma_f(ma_frag8& d, const ma_frag8& a, const ma_frag8& b) {
  const unsigned bp = ma_mma_op<U>::pack(b.v[0], b.v[1]);
  const unsigned hi = ma_mma_op<U>::pack(a.v[0], a.v[1]);
  const float2 h = ma_mma_op<U>::unpack(hi);
  const unsigned lo = ma_mma_op<U>::pack(a.v[0] - h.x, a.v[1] - h.y);
  ma_mma_op<U>::mma(d.v[0], d.v[1], hi, bp);
  ma_mma_op<U>::mma(d.v[0], d.v[1], lo, bp);
}

// Four elements into threadgroup memory with one 8- or 16-byte store.
template <typename U>
MA_FUNC void ma_tg_store4(U* p, ma_raw4<U> r) {
  *reinterpret_cast<decltype(r.bits)*>(p) = r.bits;
}
