// metal-attn tests: a CPU simulation of one Apple simdgroup, to execute the NAX kernel's text here.
//
// 32 std::threads play the 32 lanes of one simdgroup; shuffles go through a shared slot array and a
// barrier; matmul2d's cooperative tensors use the per-lane layout of kernels_v2/nax_layout.h and
// `run` multiplies in float through a shared scratch. Simdgroups run one after another (the kernel
// has no threadgroup memory and no barrier, so they never interact). Test code only: it checks the
// kernel's logic (indexing, page lookups, masks, softmax, sinks, window skip) on the CPU; the
// numerics of the real hardware are not modelled (float products, float accumulation).
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

// Standard names the Metal address-space words below would otherwise break.
using sim_thread = std::thread;

#define MA_FUNC inline
#define device
#define constant
#define thread

typedef unsigned int uint;
typedef unsigned short ushort;
struct uint3 {
  uint x, y, z;
};

struct SimGroup {
  std::barrier<> bar{32};
  uint64_t slot[32];
  float scratch[16 * 16 + 16 * 32];
};
inline SimGroup* sim_group = nullptr;
inline thread_local int sim_lane = 0;
inline thread_local int sim_sg = 0;
inline thread_local uint3 sim_tg = {0, 0, 0};
#define thread_index_in_simdgroup (uint(sim_lane))
#define simdgroup_index_in_threadgroup (uint(sim_sg))
#define threadgroup_position_in_grid (sim_tg)

template <typename U>
inline U simd_shuffle_xor(U v, ushort mask) {
  static_assert(sizeof(U) <= 8, "shuffle of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(U));
  sim_group->slot[sim_lane] = bits;
  sim_group->bar.arrive_and_wait();
  bits = sim_group->slot[sim_lane ^ mask];
  sim_group->bar.arrive_and_wait();
  U out;
  std::memcpy(&out, &bits, sizeof(U));
  return out;
}

namespace metal {
inline float exp2(float x) { return std::exp2(x); }
inline float tanh(float x) { return std::tanh(x); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
struct execution_simdgroup {};
template <typename U>
using remove_addrspace_t = U;
}  // namespace metal

inline bool ma_isfinite(float x) { return std::isfinite(x); }
inline float ma_nan() { return std::nanf(""); }
inline float ma_finite_or_nan(float x) { return std::isfinite(x) ? x : std::nanf(""); }
template <typename U>
inline float ma_to_float(U x) { return static_cast<float>(x); }
template <typename U>
inline U ma_from_float(float x) { return static_cast<U>(x); }
