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
MA_FUNC U simd_min(U v) {
  for (int o = 16; o > 0; o >>= 1) {
    const U w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w < v ? w : v;
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

// Non-finite values (the NaN contract): exponent bits all set is a NaN or an infinity; a
// non-finite score becomes NaN (bit tests: independent of any fast-math option).
MA_FUNC bool ma_isfinite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }
MA_FUNC float ma_nan() { return __uint_as_float(0x7fc00000u); }
MA_FUNC float ma_finite_or_nan(float x) { return ma_isfinite(x) ? x : __uint_as_float(0x7fc00000u); }

// Element conversions.
MA_FUNC float ma_to_float(float x) { return x; }
MA_FUNC float ma_to_float(__half x) { return __half2float(x); }
MA_FUNC float ma_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Reading what other threadgroups of the same launch wrote (the fused split-KV reducer): the
// writers fence their stores device-wide (ma_device_fence) and count themselves in on a counter
// (ma_atomic_add); the last to arrive fences again and reads the partials past L1
// (ma_partial_reader<true>: ld.global.cg), where another threadgroup's read of the same line may
// still sit. ma_partial_reader<false> is a plain load (the standalone reducer).
MA_FUNC void ma_device_fence() { __threadfence(); }
MA_FUNC int ma_atomic_add(int* p, int v) { return atomicAdd(p, v); }
template <bool CG>
struct ma_partial_reader {
  template <typename P>
  MA_FUNC static float read(P p) { return ma_to_float(*p); }
};
template <>
struct ma_partial_reader<true> {
  MA_FUNC static float read(const float* p) { return __ldcg(p); }
};

template <typename U>
MA_FUNC U ma_from_float(float x);
template <>
MA_FUNC float ma_from_float<float>(float x) { return x; }
template <>
MA_FUNC __half ma_from_float<__half>(float x) { return __float2half_rn(x); }
template <>
MA_FUNC __nv_bfloat16 ma_from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

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

// Load 4 consecutive elements as float with one vector load (8 or 16 bytes).
template <typename U>
MA_FUNC void ma_load4(const U* p, float* out) {
  ma_unpack4(ma_load_raw4(p), out);
}

// The same four elements read from threadgroup memory (a staged tile).
template <typename U>
MA_FUNC ma_raw4<U> ma_tg_load_raw4(const U* p) {
  return ma_load_raw4(p);
}

// Asynchronous 16-byte copies from device into threadgroup memory (cp.async, bypassing
// registers and L1): `live == false` zero-fills the destination without reading `src`.
// Copies issued since the last commit form a group; ma_async_wait<N>() returns once at
// most N of this thread's groups are still in flight (a threadgroup barrier must follow
// before other threads read what this one copied).
template <typename U>
MA_FUNC void ma_async_copy16(U* dst, const U* src, bool live) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(live ? 16 : 0));
}
MA_FUNC void ma_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
MA_FUNC void ma_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Ask L2 for the 128-byte line holding `p` (no register, no wait): used one page
// ahead so that the page's loads later hit L2 instead of DRAM.
template <typename U>
MA_FUNC void ma_prefetch(const U* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// 8x8 matrices spread over a warp: the portable form of Metal's simdgroup_matrix<float,
// 8, 8>. Accumulators (ma_frag8) hold two floats a lane, element i at (ma_frag_row,
// ma_frag_col + i); products take operands in the multiplier's input format
// (ma_opnd<U>: two U values in one register; ma_popnd<U>: a float operand kept as a high
// and a low U part). Here the layouts are those of the tensor-core instruction
// mma.m16n8k16 with rows 8..15 of A zero and of C/D discarded: accumulator and A row =
// lane / 4, columns 2 * (lane % 4) + i; B k-row 2 * (lane % 4) + i, column lane / 4; the
// instruction's 16-deep k holds two 8x8x8 products (ma_mma2), and its 16 rows two 8-row
// blocks that share the right operands (ma_mma2x2).
struct ma_frag8 {
  float v[2];
};
MA_FUNC int ma_frag_row(int lane) { return lane >> 2; }
MA_FUNC int ma_frag_col(int lane) { return (lane & 3) << 1; }
// Reduce over the four lanes that hold one accumulator row.
MA_FUNC float ma_frag_row_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
MA_FUNC float ma_frag_row_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The whole m16n8k16 with 16-bit operands of PTX type TY ("f16", "bf16") and float
// accumulators: rows 0..7 of A/C in (a0, a2) / (c0, c1), rows 8..15 in (a1, a3) / (c2, c3).
#define MA_MMA_ARGS                                                                              \
  float &c0, float &c1, float &c2, float &c3, unsigned a0, unsigned a1, unsigned a2, unsigned a3, \
      unsigned b0, unsigned b1
#define MA_MMA_M16N8K16(TY)                                                                       \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
      "{%0,%1,%2,%3};\n"                                                                          \
      : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)                                                     \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))

// One 16-bit element type: packing and the tensor-core product.
template <typename U>
struct ma_mma_op;
template <>
struct ma_mma_op<__half> {
  static MA_FUNC unsigned pack(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
  }
  static MA_FUNC float2 unpack(unsigned p) { return __half22float2(*reinterpret_cast<const __half2*>(&p)); }
  static MA_FUNC unsigned bits(__half x) { return __half_as_ushort(x); }
  static MA_FUNC void mma(MA_MMA_ARGS) { MA_MMA_M16N8K16("f16"); }
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
  static MA_FUNC unsigned bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
  static MA_FUNC void mma(MA_MMA_ARGS) { MA_MMA_M16N8K16("bf16"); }
};

template <typename U>
struct ma_opnd {
  unsigned p;
};
template <typename U>
struct ma_popnd {
  unsigned hi;
  unsigned lo;
};
// A left operand from its two elements (accumulator layout = A layout).
template <typename U>
MA_FUNC ma_opnd<U> ma_opnd_pack(float a, float b) {
  return {ma_mma_op<U>::pack(a, b)};
}
// A float left operand (softmax probabilities): a = hi + lo, both in U, to about 16
// significant bits, so that the probabilities are not rounded to U's 8 or 11 bits.
template <typename U>
MA_FUNC ma_popnd<U> ma_popnd_pack(float a, float b) {
  const unsigned hi = ma_mma_op<U>::pack(a, b);
  const float2 h = ma_mma_op<U>::unpack(hi);
  return {hi, ma_mma_op<U>::pack(a - h.x, b - h.y)};
}
// Right operand B(k, n) = p[k * LD + n]: V read from a row-major V tile.
template <int LD, typename U>
MA_FUNC ma_opnd<U> ma_load_b(const U* p, int lane) {
  const U* r = p + ((lane & 3) << 1) * LD + (lane >> 2);
  return {ma_mma_op<U>::bits(r[0]) | (ma_mma_op<U>::bits(r[LD]) << 16)};
}
// Four 8x8 blocks of 16-bit elements with one ldmatrix: lanes 8m..8m+7 give the row addresses
// (`row`, in threadgroup memory) of block m; TRANS transposes each block.
template <bool TRANS, typename U>
MA_FUNC void ma_ldmatrix4(const U* row, ma_opnd<U>* r) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0].p), "=r"(r[1].p), "=r"(r[2].p), "=r"(r[3].p)
                 : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0].p), "=r"(r[1].p), "=r"(r[2].p), "=r"(r[3].p)
                 : "r"(a));
  }
}
// Four right operands: K^T blocks of dims [8m, 8m + 8), m < 4, of the 8 keys at p (lane l
// addresses key l % 8 of block l / 8).
template <int LD, typename U>
MA_FUNC void ma_load_bt4(const U* p, int lane, ma_opnd<U>* r) {
  ma_ldmatrix4<false>(p + (lane & 7) * LD + (lane >> 3) * 8, r);
}
// Four right operands: V blocks of keys [8m, 8m + 8), m < 4, of the 8 dims at p (lane l
// addresses key row l; transposed).
template <int LD, typename U>
MA_FUNC void ma_load_b4(const U* p, int lane, ma_opnd<U>* r) {
  ma_ldmatrix4<true>(p + lane * LD, r);
}
// Four right operands: V blocks of dims [8m, 8m + 8), m < 4, of the 8 keys at p (lane l
// addresses key l % 8 of block l / 8; transposed).
template <int LD, typename U>
MA_FUNC void ma_load_b4d(const U* p, int lane, ma_opnd<U>* r) {
  ma_ldmatrix4<true>(p + (lane & 7) * LD + (lane >> 3) * 8, r);
}
// The same two loads from rows stored XOR-swizzled (the per-token kernel's PA_SWIZZLE): row k of
// the 8 at `rows` (LD elements apart, unpadded) keeps its 16-byte piece c at piece c ^ (k % 8);
// `piece` is the first of the four 8-element pieces read (d of the unswizzled p + d * 8).
template <int LD, typename U>
MA_FUNC void ma_load_bt4_swz(const U* rows, int piece, int lane, ma_opnd<U>* r) {
  ma_ldmatrix4<false>(rows + (lane & 7) * LD + (((piece + (lane >> 3)) ^ (lane & 7)) << 3), r);
}
template <int LD, typename U>
MA_FUNC void ma_load_b4d_swz(const U* rows, int piece, int lane, ma_opnd<U>* r) {
  ma_ldmatrix4<true>(rows + (lane & 7) * LD + (((piece + (lane >> 3)) ^ (lane & 7)) << 3), r);
}
// d += A0 B0 + A1 B1: two 8x8x8 products, exact 16-bit products with float accumulation
// (what Metal's float simdgroup product computes for the same values); rows 8..15 of
// the instruction are zero.
template <typename U>
MA_FUNC void ma_mma2(ma_frag8& d, ma_opnd<U> a0, ma_opnd<U> b0, ma_opnd<U> a1, ma_opnd<U> b1) {
  float z0 = 0.0f, z1 = 0.0f;
  ma_mma_op<U>::mma(d.v[0], d.v[1], z0, z1, a0.p, 0u, a1.p, 0u, b0.p, b1.p);
}
// The same for two 8-row blocks sharing the right operands (top: d, a0, a1; bottom: e,
// c0, c1): one whole m16n8k16.
template <typename U>
MA_FUNC void ma_mma2x2(ma_frag8& d, ma_frag8& e, ma_opnd<U> a0, ma_opnd<U> c0, ma_opnd<U> b0, ma_opnd<U> a1,
                       ma_opnd<U> c1, ma_opnd<U> b1) {
  ma_mma_op<U>::mma(d.v[0], d.v[1], e.v[0], e.v[1], a0.p, c0.p, a1.p, c1.p, b0.p, b1.p);
}
// Float left operands (probabilities): the high parts' products, then the low parts'.
template <typename U>
MA_FUNC void ma_mma2_p(ma_frag8& d, ma_popnd<U> a0, ma_opnd<U> b0, ma_popnd<U> a1, ma_opnd<U> b1) {
  float z0 = 0.0f, z1 = 0.0f;
  ma_mma_op<U>::mma(d.v[0], d.v[1], z0, z1, a0.hi, 0u, a1.hi, 0u, b0.p, b1.p);
  ma_mma_op<U>::mma(d.v[0], d.v[1], z0, z1, a0.lo, 0u, a1.lo, 0u, b0.p, b1.p);
}
template <typename U>
MA_FUNC void ma_mma2x2_p(ma_frag8& d, ma_frag8& e, ma_popnd<U> a0, ma_popnd<U> c0, ma_opnd<U> b0, ma_popnd<U> a1,
                         ma_popnd<U> c1, ma_opnd<U> b1) {
  ma_mma_op<U>::mma(d.v[0], d.v[1], e.v[0], e.v[1], a0.hi, c0.hi, a1.hi, c1.hi, b0.p, b1.p);
  ma_mma_op<U>::mma(d.v[0], d.v[1], e.v[0], e.v[1], a0.lo, c0.lo, a1.lo, c1.lo, b0.p, b1.p);
}

// d += A B for one float left operand: its high and low parts are the two 8-deep halves of
// one m16n8k16 (both against the same right operand).
template <typename U>
MA_FUNC void ma_mma_p(ma_frag8& d, ma_popnd<U> a, ma_opnd<U> b) {
  float z0 = 0.0f, z1 = 0.0f;
  ma_mma_op<U>::mma(d.v[0], d.v[1], z0, z1, a.hi, 0u, a.lo, 0u, b.p, b.p);
}

// Keys as the rows of whole m16n8k16 products (the per-token kernel's PA_MMA == 2, CUDA only; Metal's
// simdgroup matrices are 8x8, so the Metal prelude leaves MA_KEY_ROWS_MMA 0): 16 keys x 8 query heads per
// product. Accumulators (ma_frag16) hold four floats a lane: v[i] at (row lane / 4, column 2 * (lane % 4)
// + i), v[2 + i] at row lane / 4 + 8. Left operands are whole 16x16 tiles (four registers: rows 0..7 and
// 8..15 of k 0..7, then of k 8..15); right operands two registers (k 2 * (lane % 4) + i, then + 8; column
// lane / 4).
#define MA_KEY_ROWS_MMA 1
struct ma_frag16 {
  float v[4];
};
template <typename U>
MA_FUNC void ma_mma16(ma_frag16& d, const ma_opnd<U> (&a)[4], ma_opnd<U> b0, ma_opnd<U> b1) {
  ma_mma_op<U>::mma(d.v[0], d.v[1], d.v[2], d.v[3], a[0].p, a[1].p, a[2].p, a[3].p, b0.p, b1.p);
}
// Reduce over the eight lanes that hold one accumulator column.
MA_FUNC float ma_frag_col_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
MA_FUNC float ma_frag_col_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}
// The transpose of an 8x8 block of 16-bit pairs held as an accumulator row's pair (row lane / 4,
// columns 2 * (lane % 4) + i): the same lane then holds the block's column lane / 4 at rows 2 * (lane %
// 4) + i, which is a right operand's layout (one register of k).
template <typename U>
MA_FUNC ma_opnd<U> ma_transpose8(unsigned x) {
  unsigned y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return {y};
}
// A 16x16 left operand from 16 staged rows stored XOR-swizzled (row k's 16-byte piece c at piece c ^ (k %
// 8), rows LD elements apart): rows are keys, columns the pieces piece, piece + 1 (K: keys x dims). `rows`
// must be a staged row whose index is a multiple of 8 (the swizzle's phase is then lane % 8; the kernel's
// 16-key blocks start at multiples of 16 within a chunk).
template <int LD, typename U>
MA_FUNC void ma_load_a16_swz(const U* rows, int piece, int lane, ma_opnd<U> (&r)[4]) {
  const int row = (lane & 7) + (lane & 8);
  ma_ldmatrix4<false>(rows + row * LD + (((piece + (lane >> 4)) ^ (lane & 7)) << 3), r);
}
// The transposed tile: rows are the dims of pieces piece, piece + 1 and columns the 16 keys (V^T).
template <int LD, typename U>
MA_FUNC void ma_load_at16_swz(const U* rows, int piece, int lane, ma_opnd<U> (&r)[4]) {
  const int row = (lane & 7) + ((lane >> 1) & 8);
  ma_ldmatrix4<true>(rows + row * LD + (((piece + ((lane >> 3) & 1)) ^ (lane & 7)) << 3), r);
}
// Whether any lane of the simdgroup holds true (every lane takes part).
MA_FUNC bool simd_any(bool x) {
  return __any_sync(0xffffffffu, x);
}

// A threadgroup array's memory seen as floats (a region reused once its first use is over).
template <typename U>
MA_FUNC float* ma_tg_floats(U* p) {
  return reinterpret_cast<float*>(p);
}

// Four elements into device memory with one 8- or 16-byte store (``p`` aligned to it).
template <typename U>
MA_FUNC void ma_store_raw4(U* p, ma_raw4<U> r) {
  *reinterpret_cast<decltype(r.bits)*>(p) = r.bits;
}

// Four elements into threadgroup memory with one 8- or 16-byte store.
template <typename U>
MA_FUNC void ma_tg_store4(U* p, ma_raw4<U> r) {
  *reinterpret_cast<decltype(r.bits)*>(p) = r.bits;
}
