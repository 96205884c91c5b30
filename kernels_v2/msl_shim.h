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

template <typename T, typename U>
T as_type(U);

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
using namespace metal;
