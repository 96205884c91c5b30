// metal-attn: the CUDA twin's Metal 4 tensor ops (included only by the NAX kernel's CUDA assembly).
//
// Implements the MetalPerformancePrimitives subset the NAX prefill kernel uses, with the same
// names and the same per-lane element layout (nax_layout.h), so that the kernel's text runs on an
// NVIDIA GPU: matmul2d with the 16 x 32 x 16 descriptor, executed by one simdgroup (a 32-lane warp)
// on cooperative tensors, left input not transposed, right input either way, inputs __half or
// __nv_bfloat16 (the left input may be float), float destination, element access with [].
// The Metal source check's shim (msl_shim.h) declares exactly this subset.
//
// run(left, right, dest): each lane puts its elements of the three operands into a per-warp scratch
// in matrix form, at the coordinates nax_layout.h gives them; the warp then computes dest (+)= left x
// right as four mma.sync.m16n8k16 (16-bit operands, the float accumulator fed into the instruction:
// mode multiply_accumulate; mode multiply starts from zero) in the tensor-core fragment layout, and
// each lane takes its destination elements back from the scratch. A float left input is split into
// a high and a low 16-bit part whose products are accumulated in that order (about 16 significant
// bits for bfloat16, 22 for half), as the tiled kernel's CUDA prelude does for its probabilities; so
// a product over the same keys and dims in the same order rounds as the tiled kernel's does.
//
// What this does not reproduce: how Apple's tensor units move the elements (here a scratch in
// shared memory; the Metal kernel itself uses no threadgroup memory), the order and rounding of
// their accumulation, and what relaxed precision lets them round (here: nothing beyond the float
// left input's 16-bit parts). The layout itself is taken from MLX's use of these tensors.

#ifndef MA_NAX_MAX_SIMDGROUPS
#define MA_NAX_MAX_SIMDGROUPS 4
#endif

namespace metal {
struct execution_simdgroup {};
template <typename U>
using remove_addrspace_t = U;
}  // namespace metal

namespace mpp {
namespace tensor_ops {
// The descriptor converts to an integer code, the template argument of matmul2d (NVRTC and nvcc
// compile this as C++17, which has no class-type template arguments; Metal's has one).
struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right, relaxed_precision;
  mode matmul_mode;
  __device__ constexpr matmul2d_descriptor(int m_, int n_, int k_, bool transpose_left_ = false, bool transpose_right_ = false,
                                 bool relaxed_precision_ = false, mode matmul_mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}
  __device__ constexpr operator unsigned long long() const {
    return (unsigned long long)(m & 0xff) | ((unsigned long long)(n & 0xff) << 8) |
           ((unsigned long long)(k & 0xff) << 16) | ((unsigned long long)transpose_left << 24) |
           ((unsigned long long)transpose_right << 25) | ((unsigned long long)relaxed_precision << 26) |
           ((unsigned long long)(matmul_mode == mode::multiply_accumulate) << 27);
  }
};

template <typename A, typename B>
struct ma_same { static constexpr bool value = false; };
template <typename A>
struct ma_same<A, A> { static constexpr bool value = true; };
template <typename E>
struct ma_input_elem {
  static constexpr bool value = ma_same<E, __half>::value || ma_same<E, __nv_bfloat16>::value;
};

// A lane's elements of one operand (ROLE: 0 left input, 1 right input, 2 destination).
template <typename E, int N, int ROLE>
struct cooperative_tensor {
  E v[N];
  MA_FUNC E& operator[](int i) { return v[i]; }
  MA_FUNC const E& operator[](int i) const { return v[i]; }
};

// This warp's scratch: a 16 x 16 left operand, a 16 x 32 right operand and a 16 x 32 accumulator
// (floats, row-major; 5 KiB).
MA_FUNC float* ma_nax_scratch() {
  __shared__ float scratch[MA_NAX_MAX_SIMDGROUPS][16 * 16 + 2 * 16 * 32];
  const unsigned warp = (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) >> 5;
  if (warp >= MA_NAX_MAX_SIMDGROUPS) {
    __trap();  // more simdgroups than the scratch was sized for (MA_NAX_MAX_SIMDGROUPS)
  }
  return scratch[warp];
}

template <typename U>
MA_FUNC unsigned ma_nax_pack(float a, float b) {
  return ma_mma_op<U>::pack(a, b);
}

template <unsigned long long DESC, typename Scope>
struct matmul2d {
  static_assert((DESC & 0xff) == 16 && ((DESC >> 8) & 0xff) == 32 && ((DESC >> 16) & 0xff) == 16,
                "matmul2d: the subset is the 16 x 32 x 16 descriptor");
  static_assert(((DESC >> 24) & 1) == 0, "matmul2d: the subset does not transpose the left input");
  static_assert(ma_same<Scope, metal::execution_simdgroup>::value, "matmul2d: the subset runs on one simdgroup");
  static constexpr bool kTransposeRight = ((DESC >> 25) & 1) != 0;
  static constexpr bool kAccumulate = ((DESC >> 27) & 1) != 0;

  template <typename L, typename R, typename C>
  MA_FUNC cooperative_tensor<L, 8, 0> get_left_input_cooperative_tensor() const {
    static_assert(ma_input_elem<R>::value && (ma_same<L, R>::value || ma_same<L, float>::value) &&
                  ma_same<C, float>::value,
                  "cooperative tensors: inputs half or bfloat16 (the left may be float), destination float");
    return {};
  }
  template <typename L, typename R, typename C>
  MA_FUNC cooperative_tensor<R, 16, 1> get_right_input_cooperative_tensor() const {
    static_assert(ma_input_elem<R>::value && (ma_same<L, R>::value || ma_same<L, float>::value) &&
                  ma_same<C, float>::value,
                  "cooperative tensors: inputs half or bfloat16 (the left may be float), destination float");
    return {};
  }
  template <typename LT, typename RT, typename C>
  MA_FUNC cooperative_tensor<C, 16, 2> get_destination_cooperative_tensor() const {
    static_assert(ma_same<C, float>::value, "cooperative tensors: the destination is float");
    return {};
  }

  // dest (+)= left x right for the whole simdgroup (every lane calls it).
  template <typename L, typename R>
  MA_FUNC void run(const cooperative_tensor<L, 8, 0>& a, const cooperative_tensor<R, 16, 1>& b,
                   cooperative_tensor<float, 16, 2>& c) const {
    const int lane = int(thread_index_in_simdgroup);
    float* sa = ma_nax_scratch();  // A[m][k] at sa[m * 16 + k]
    float* sb = sa + 16 * 16;      // B[k][n] at sb[k * 32 + n]
    float* sc = sb + 16 * 32;      // C[m][n], then D[m][n], at sc[m * 32 + n]
    __syncwarp();                  // the last run's readers are done with the scratch
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      sa[ma_nax_frag_row(lane, e) * 16 + ma_nax_frag_col(lane, e)] = ma_to_float(a[e]);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int r = ma_nax_frag_row(lane, i);
      const int col = 16 * (i >> 3) + ma_nax_frag_col(lane, i);
      if (kTransposeRight) {  // held as stored, N x K: element (n, k) = (16 * (i >> 3) + r, col % 16)
        sb[ma_nax_frag_col(lane, i) * 32 + 16 * (i >> 3) + r] = ma_to_float(b[i]);
      } else {
        sb[r * 32 + col] = ma_to_float(b[i]);
      }
      sc[r * 32 + col] = kAccumulate ? c[i] : 0.0f;
    }
    __syncwarp();
    // The tensor-core fragments: row g = lane / 4, k pair 2t (t = lane % 4); B and D column g / 2t.
    const int g = lane >> 2;
    const int t2 = (lane & 3) << 1;
    const float a00 = sa[g * 16 + t2], a01 = sa[g * 16 + t2 + 1];
    const float a10 = sa[(g + 8) * 16 + t2], a11 = sa[(g + 8) * 16 + t2 + 1];
    const float a20 = sa[g * 16 + t2 + 8], a21 = sa[g * 16 + t2 + 9];
    const float a30 = sa[(g + 8) * 16 + t2 + 8], a31 = sa[(g + 8) * 16 + t2 + 9];
    const unsigned ah0 = ma_nax_pack<R>(a00, a01), ah1 = ma_nax_pack<R>(a10, a11);
    const unsigned ah2 = ma_nax_pack<R>(a20, a21), ah3 = ma_nax_pack<R>(a30, a31);
    unsigned al0 = 0u, al1 = 0u, al2 = 0u, al3 = 0u;
    if (ma_same<L, float>::value) {  // the low parts: a - float(high part)
      const float2 h0 = ma_mma_op<R>::unpack(ah0), h1 = ma_mma_op<R>::unpack(ah1);
      const float2 h2 = ma_mma_op<R>::unpack(ah2), h3 = ma_mma_op<R>::unpack(ah3);
      al0 = ma_nax_pack<R>(a00 - h0.x, a01 - h0.y);
      al1 = ma_nax_pack<R>(a10 - h1.x, a11 - h1.y);
      al2 = ma_nax_pack<R>(a20 - h2.x, a21 - h2.y);
      al3 = ma_nax_pack<R>(a30 - h3.x, a31 - h3.y);
    }
    float d[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int n = nt * 8 + g;
      const unsigned b0 = ma_nax_pack<R>(sb[t2 * 32 + n], sb[(t2 + 1) * 32 + n]);
      const unsigned b1 = ma_nax_pack<R>(sb[(t2 + 8) * 32 + n], sb[(t2 + 9) * 32 + n]);
      // The accumulator enters the instruction (the high part's product, then the low part's).
      d[nt][0] = sc[g * 32 + nt * 8 + t2];
      d[nt][1] = sc[g * 32 + nt * 8 + t2 + 1];
      d[nt][2] = sc[(g + 8) * 32 + nt * 8 + t2];
      d[nt][3] = sc[(g + 8) * 32 + nt * 8 + t2 + 1];
      ma_mma_op<R>::mma(d[nt][0], d[nt][1], d[nt][2], d[nt][3], ah0, ah1, ah2, ah3, b0, b1);
      if (ma_same<L, float>::value) {
        ma_mma_op<R>::mma(d[nt][0], d[nt][1], d[nt][2], d[nt][3], al0, al1, al2, al3, b0, b1);
      }
    }
    __syncwarp();  // every lane has read its operands: the scratch now takes the result D[m][n]
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      sc[g * 32 + nt * 8 + t2] = d[nt][0];
      sc[g * 32 + nt * 8 + t2 + 1] = d[nt][1];
      sc[(g + 8) * 32 + nt * 8 + t2] = d[nt][2];
      sc[(g + 8) * 32 + nt * 8 + t2 + 1] = d[nt][3];
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      c[i] = sc[ma_nax_frag_row(lane, i) * 32 + 16 * (i >> 3) + ma_nax_frag_col(lane, i)];
    }
  }
};
}  // namespace tensor_ops
}  // namespace mpp
