// metal-attn: a small C++ stand-in for the subset of the Metal Shading Language
// (and of MLX's Metal JIT preamble) that our kernels use. It lets
// `clang++ -x c++ -std=c++17 -fsyntax-only` parse and type-check the generated
// MSL on Linux. It declares; it never executes anything. Used by metal_attn.msl_check.
#include <cstdint>

#define device
#define constant
#define thread
#define threadgroup

typedef unsigned int uint;
typedef unsigned short ushort;

struct uint3 {
  uint x, y, z;
};

// Class types (x86 clang has no usable _Float16 here): convertible to and from float.
struct half {
  unsigned short bits;  // 16 bits, as in MSL (the kernels' sizeof checks)
  half();
  half(float);
  operator float() const;
};
struct bfloat16_t {
  unsigned short bits;
  bfloat16_t();
  bfloat16_t(float);
  operator float() const;
};
typedef half float16_t;

// Metal's as_type reinterprets the bits of a value of the same size (anything else fails to compile).
template <typename T, typename U>
T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: the source and destination types have the same size");
  return *reinterpret_cast<T*>(&u);
}

namespace metal {
bool isfinite(float);
enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
float exp2(float);
float tanh(float);
float abs(float);
float max(float, float);
float min(float, float);
int max(int, int);
int min(int, int);
namespace fast {
float exp2(float);
}
template <typename T>
T simd_sum(T);
template <typename T>
T simd_min(T);
bool simd_any(bool);
template <typename T>
T simd_shuffle_xor(T, ushort);
template <typename T>
T simd_shuffle(T, ushort);
// simdgroup matrices: declared with the members the kernels use (thread_elements()
// hands a lane its two elements).
template <typename T, int R, int C>
struct simdgroup_matrix {
  struct elements {
    T& operator[](int);
  };
  simdgroup_matrix();
  elements thread_elements();
};
template <typename T, int R, int C>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, R, C>&, const simdgroup_matrix<T, R, C>&,
                                   const simdgroup_matrix<T, R, C>&, const simdgroup_matrix<T, R, C>&);
}  // namespace metal

// -- Metal 4 tensor ops (MetalPerformancePrimitives): the subset the NAX prefill kernel uses ------
// Declared exactly as far as the CUDA twin (nax_tensor_ops_cuda.h) implements it, so that a use
// outside it fails here too: matmul2d with the 16 x 32 x 16 descriptor (left input not transposed,
// right input either way), run by one simdgroup on cooperative tensors; inputs of half or
// bfloat16_t (the left input may also be float), a float destination; element access with [].
// Metal passes the descriptor as a class-type template argument; C++17 has none, so here it
// converts to an integer code (constexpr), which the template takes and checks.
#define MA_MSL_SHIM_MPP 1
namespace metal {
struct execution_simdgroup {};
template <typename U>
using remove_addrspace_t = U;
}  // namespace metal
namespace mpp {
namespace tensor_ops {
struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right, relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_, bool transpose_left_ = false, bool transpose_right_ = false,
                                bool relaxed_precision_ = false, mode matmul_mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}
  constexpr operator unsigned long long() const {
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
  static constexpr bool value = ma_same<E, half>::value || ma_same<E, bfloat16_t>::value;
};
// ROLE: 0 left input, 1 right input, 2 destination.
template <typename E, int N, int ROLE>
struct cooperative_tensor {
  E& operator[](int);
  const E& operator[](int) const;
};
template <unsigned long long DESC, typename Scope>
struct matmul2d {
  static_assert((DESC & 0xff) == 16 && ((DESC >> 8) & 0xff) == 32 && ((DESC >> 16) & 0xff) == 16,
                "matmul2d: the subset is the 16 x 32 x 16 descriptor");
  static_assert(((DESC >> 24) & 1) == 0, "matmul2d: the subset does not transpose the left input");
  static_assert(ma_same<Scope, metal::execution_simdgroup>::value, "matmul2d: the subset runs on one simdgroup");
  template <typename L, typename R, typename C>
  cooperative_tensor<L, 8, 0> get_left_input_cooperative_tensor() const {
    static_assert(ma_input_elem<R>::value && (ma_same<L, R>::value || ma_same<L, float>::value) &&
                  ma_same<C, float>::value,
                  "cooperative tensors: inputs half or bfloat16_t (the left may be float), destination float");
    return {};
  }
  template <typename L, typename R, typename C>
  cooperative_tensor<R, 16, 1> get_right_input_cooperative_tensor() const {
    static_assert(ma_input_elem<R>::value && (ma_same<L, R>::value || ma_same<L, float>::value) &&
                  ma_same<C, float>::value,
                  "cooperative tensors: inputs half or bfloat16_t (the left may be float), destination float");
    return {};
  }
  template <typename LT, typename RT, typename C>
  cooperative_tensor<C, 16, 2> get_destination_cooperative_tensor() const {
    static_assert(ma_same<C, float>::value, "cooperative tensors: the destination is float");
    return {};
  }
  template <typename L, typename R>
  void run(const cooperative_tensor<L, 8, 0>&, const cooperative_tensor<R, 16, 1>&,
           cooperative_tensor<float, 16, 2>&) const;
};
}  // namespace tensor_ops
}  // namespace mpp
using namespace metal;
