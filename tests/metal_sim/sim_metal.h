// metal-attn tests: an executable stand-in for the Metal builtins the kernels and
// kernels_v2/prelude_metal.h use, so that the Metal text itself runs on the CPU.
//
// A threadgroup is simulated whole: its threads are cooperative fibers (sim_fiber.h) on one OS
// thread, grouped into simdgroups of 32 lanes; threadgroup memory is the kernel's `threadgroup`
// arrays as `static thread_local` (sim_body_begin.h), which the driver fills with a poison pattern
// before each threadgroup (sim_driver.h: a read of threadgroup memory the threadgroup did not write
// shows); simd_* calls and threadgroup_barrier are barriers of the simdgroup or the threadgroup,
// the values exchanged through slots that alternate between two buffers (no lane can be two
// exchanges ahead of another). Threadgroups run one after another in each of a few worker
// processes. simdgroup_matrix<float, 8, 8> holds two elements a lane in Apple's thread_elements()
// layout, as MLX's steel kernels use it, and simdgroup_multiply_accumulate multiplies in float
// through the slots.
//
// Checks a GPU would not report: a simd_* call or barrier that not every lane or thread reaches
// (a thread leaving early, lanes at different calls, a simdgroup split between a simd_* call and
// a threadgroup barrier) aborts with a message instead of hanging or reading stale slots.
//
// Element types: float16_t and bfloat16_t are 16-bit structs converting to and from float (round to
// nearest even; a NaN stays a NaN, quieted), so sizeof(T) and byte layouts are the real ones and an
// element copied as is keeps its bytes.
// Not modelled: the GPU's arithmetic (float here, IEEE rounding, no fused multiply-add unless
// the compiler contracts), Apple's order of simd_sum's additions, memory races between
// threads (fibers interleave only at synchronisation points, in a ring order the driver may
// shuffle), threadgroup memory limits and device memory ordering.
#pragma once

// Only C headers (the C++ ones would double the compile time of every specialization); the math
// is GCC's builtins.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "sim_fiber.h"

// ---- element types -------------------------------------------------------------------------------
// IEEE half through _Float16's conversions, a signalling NaN quieted on the way in and out as IEEE
// hardware converts (GCC's software conversions keep it: a copy through float would not show).
struct float16_t {
  uint16_t bits;
  float16_t() = default;
  float16_t(float f) {  // NOLINT: implicit, as Metal's float -> half conversion
    const _Float16 h = static_cast<_Float16>(f);
    std::memcpy(&bits, &h, 2);
    if ((bits & 0x7c00u) == 0x7c00u && (bits & 0x03ffu) != 0) bits |= 0x0200u;
  }
  operator float() const {
    uint16_t b = bits;
    if ((b & 0x7c00u) == 0x7c00u && (b & 0x03ffu) != 0) b |= 0x0200u;
    _Float16 h;
    std::memcpy(&h, &b, 2);
    return static_cast<float>(h);
  }
};
typedef float16_t half;

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {  // NOLINT: implicit, as Metal's float -> bfloat conversion
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40u);  // a NaN stays a (quiet) NaN
    } else {
      bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const {
    const bool nan = (bits & 0x7f80u) == 0x7f80u && (bits & 0x007fu) != 0;
    const uint32_t u = uint32_t(nan ? bits | 0x40u : bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static_assert(sizeof(bfloat16_t) == 2 && sizeof(float16_t) == 2, "16-bit element types");

typedef unsigned int uint;
typedef unsigned short ushort;
struct uint3 {
  uint x, y, z;
};

// ---- the simulated threadgroup -------------------------------------------------------------------
constexpr int SIM_SIMD = 32;
constexpr int SIM_MAX_THREADS = 1024;
constexpr int SIM_MAX_SG = SIM_MAX_THREADS / SIM_SIMD;
constexpr int SIM_SLOT_BYTES = 16;  // per lane and exchange: a shuffle's value, or A's and B's two floats
#ifndef SIM_STACK_KIB
#define SIM_STACK_KIB 64  // each fiber's stack
#endif
// The kernel's buffers in signature order (inputs, then outputs), filled by sim_driver.h.
inline unsigned char* sim_bufs[32];

[[noreturn]] inline void sim_fail(const char* what) {
  std::fprintf(stderr, "metal sim: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

struct SimBarrier {
  int arrived = 0;
  unsigned gen = 0;
  int op = 0;  // what the waiting threads called (lanes at different simd_* calls diverged)
};

struct SimFiber {
  SimContext ctx;
  uint3 tg_pos;          // threadgroup_position_in_grid
  uint3 grid_pos;        // thread_position_in_grid
  uint tid;              // thread_position_in_threadgroup.x (thread_index_in_threadgroup)
  int lane;              // thread_index_in_simdgroup
  int sg;                // simdgroup_index_in_threadgroup
  bool done;
  const unsigned* wait_gen;  // blocked while *wait_gen == wait_val
  unsigned wait_val;
};

// What a waiting thread called: the kind of call and the source line of the call (the kernel text's, or the
// prelude helper's), so lanes at two different simd_* calls of one kind are told apart too.
enum SimOp { SIM_OP_TG = 1, SIM_OP_SHUFFLE, SIM_OP_SHUFFLE_XOR, SIM_OP_SUM, SIM_OP_MAX, SIM_OP_MIN, SIM_OP_ANY,
             SIM_OP_MATRIX };
inline int sim_op(SimOp kind, int line) { return int(kind) + 16 * line; }

// A worker's threadgroup: its fibers and everything they synchronise through.
struct SimGroup {
  SimFiber fibers[SIM_MAX_THREADS];
  int order[SIM_MAX_THREADS];  // the ring the scheduler walks (a permutation of the threads)
  int n = 0;
  int pos = 0;                 // the running fiber's place in `order`
  int live = 0;
  int sg_live[SIM_MAX_SG];
  int sg_at_tg[SIM_MAX_SG];    // lanes of each simdgroup waiting at the threadgroup barrier
  SimBarrier tg_bar;
  SimBarrier sg_bar[SIM_MAX_SG];
  alignas(16) unsigned char slots[2][SIM_MAX_SG][SIM_SIMD][SIM_SLOT_BYTES];
  SimContext main_ctx;
  SimFiber* cur = nullptr;
  void (*entry)() = nullptr;   // the kernel call every fiber makes
  size_t stacks_made = 0;
};
// The worker's threadgroup (a process-wide global: each worker is a process with one thread, whose
// thread-local storage holds nothing but the kernel's threadgroup arrays).
inline SimGroup* sim_g = nullptr;

inline SimFiber& sim_cur() { return *sim_g->cur; }

inline bool sim_runnable(const SimFiber& f) { return !f.done && (f.wait_gen == nullptr || *f.wait_gen != f.wait_val); }

// Switch to the next runnable fiber of the ring (or back to the driver when every fiber is done).
inline void sim_schedule() {
  SimGroup& g = *sim_g;
  SimFiber* from = g.cur;
  if (g.live == 0) {
    g.cur = nullptr;
    sim_ctx_switch_to(from->ctx, g.main_ctx);
    sim_fail("a finished fiber was resumed");
  }
  for (int k = 1; k <= g.n; ++k) {
    const int p = (g.pos + k) % g.n;
    SimFiber& f = g.fibers[g.order[p]];
    if (sim_runnable(f)) {
      g.pos = p;
      if (&f == from) return;
      g.cur = &f;
      sim_ctx_switch_to(from->ctx, f.ctx);
      return;
    }
  }
  sim_fail("deadlock: every live thread waits at a barrier that cannot complete");
}

// Arrive at `b`, which completes when `needed` threads arrived; the last one goes on at once.
inline void sim_wait(SimBarrier& b, int needed, int op, const char* what) {
  SimFiber& f = sim_cur();
  if (b.arrived == 0) {
    b.op = op;
  } else if (b.op != op) {
    sim_fail(what);
  }
  if (++b.arrived == needed) {
    b.arrived = 0;
    ++b.gen;
    if (op % 16 == SIM_OP_TG) {
      for (int s = 0; s < SIM_MAX_SG; ++s) sim_g->sg_at_tg[s] = 0;
    }
    return;
  }
  f.wait_gen = &b.gen;
  f.wait_val = b.gen;
  sim_schedule();
  f.wait_gen = nullptr;
}

// Publish `n` bytes of this lane into the simdgroup's slots and wait for all 32 lanes; returns the
// slots of this exchange (lane-major, SIM_SLOT_BYTES each), valid until this lane's next exchange.
inline const unsigned char* sim_exchange(const void* v, size_t n, int op) {
  SimGroup& g = *sim_g;
  SimFiber& f = sim_cur();
  if (g.sg_live[f.sg] != SIM_SIMD) sim_fail("a simd_* call after some lanes of the simdgroup returned");
  if (g.sg_at_tg[f.sg] != 0) sim_fail("lanes of one simdgroup split between a simd_* call and threadgroup_barrier");
  SimBarrier& b = g.sg_bar[f.sg];
  const int par = int(b.gen & 1u);
  std::memcpy(g.slots[par][f.sg][f.lane], v, n);
  sim_wait(b, SIM_SIMD, op, "lanes of one simdgroup at different simd_* calls");
  return &g.slots[par][f.sg][0][0];
}

template <typename U>
inline U sim_slot(const unsigned char* row, int lane) {
  U out;
  std::memcpy(&out, row + size_t(lane) * SIM_SLOT_BYTES, sizeof(U));
  return out;
}

// The fiber body: the kernel, then leave the ring.
inline void sim_fiber_main() {
  SimGroup& g = *sim_g;
  g.entry();
  SimFiber& f = sim_cur();
  f.done = true;
  --g.live;
  --g.sg_live[f.sg];
  if (g.sg_bar[f.sg].arrived != 0) sim_fail("a thread returned while lanes of its simdgroup wait at a simd_* call");
  if (g.tg_bar.arrived != 0) sim_fail("a thread returned while others wait at threadgroup_barrier");
  sim_schedule();
  sim_fail("unreachable");
}

// ---- Metal vocabulary ----------------------------------------------------------------------------
#define device
#define constant
#define thread
#define threadgroup

#define thread_index_in_simdgroup (uint(sim_cur().lane))
#define simdgroup_index_in_threadgroup (uint(sim_cur().sg))
#define thread_position_in_threadgroup (uint3{sim_cur().tid, 0u, 0u})
#define thread_index_in_threadgroup (sim_cur().tid)
#define threadgroup_position_in_grid (sim_cur().tg_pos)
#define thread_position_in_grid (sim_cur().grid_pos)

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

inline void threadgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  SimGroup& g = *sim_g;
  SimFiber& f = sim_cur();
  if (g.live != g.n) sim_fail("threadgroup_barrier after some threads of the threadgroup returned");
  if (g.sg_bar[f.sg].arrived != 0) sim_fail("lanes of one simdgroup split between a simd_* call and threadgroup_barrier");
  ++g.sg_at_tg[f.sg];
  sim_wait(g.tg_bar, g.live, sim_op(SIM_OP_TG, line), "threads of the threadgroup at different threadgroup_barrier calls");
}

template <typename To, typename From>
inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type between types of one size");
  To out;
  std::memcpy(&out, &x, sizeof(To));
  return out;
}

namespace metal {
// Without fast math, as MLX builds Metal kernels: IEEE max/min (fmax/fmin: a NaN argument gives the other one).
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline float min(float a, float b) { return __builtin_fminf(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline float exp2(float x) { return __builtin_exp2f(x); }
inline float exp(float x) { return __builtin_expf(x); }
inline float log2(float x) { return __builtin_log2f(x); }
inline float tanh(float x) { return __builtin_tanhf(x); }
inline float abs(float x) { return __builtin_fabsf(x); }
inline float fabs(float x) { return __builtin_fabsf(x); }
inline float sqrt(float x) { return __builtin_sqrtf(x); }
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
}  // namespace metal

template <typename U>
inline U simd_shuffle_xor(U v, ushort mask, int line = __builtin_LINE()) {
  static_assert(sizeof(U) <= SIM_SLOT_BYTES, "a shuffled value fits a slot");
  const unsigned char* row = sim_exchange(&v, sizeof(U), sim_op(SIM_OP_SHUFFLE_XOR, line));
  return sim_slot<U>(row, (sim_cur().lane ^ int(mask)) & (SIM_SIMD - 1));
}

template <typename U>
inline U simd_shuffle(U v, ushort lane, int line = __builtin_LINE()) {
  static_assert(sizeof(U) <= SIM_SLOT_BYTES, "a shuffled value fits a slot");
  const unsigned char* row = sim_exchange(&v, sizeof(U), sim_op(SIM_OP_SHUFFLE, line));
  return sim_slot<U>(row, int(lane) & (SIM_SIMD - 1));
}

template <typename U>
inline U simd_broadcast(U v, ushort lane, int line = __builtin_LINE()) {
  return simd_shuffle(v, lane, line);
}

// A reduction over the 32 lanes in a fixed pairwise order, the same value on every lane.
template <typename U, typename F>
inline U sim_reduce(U v, int op, F combine) {
  const unsigned char* row = sim_exchange(&v, sizeof(U), op);
  U x[SIM_SIMD];
  for (int i = 0; i < SIM_SIMD; ++i) x[i] = sim_slot<U>(row, i);
  for (int w = SIM_SIMD / 2; w > 0; w >>= 1) {
    for (int i = 0; i < w; ++i) x[i] = combine(x[i], x[i + w]);
  }
  return x[0];
}

#define SIM_REDUCTION(NAME, U, KIND, EXPR)                                  \
  inline U NAME(U v, int line = __builtin_LINE()) {                         \
    return sim_reduce(v, sim_op(KIND, line), [](U a, U b) { return EXPR; }); \
  }
SIM_REDUCTION(simd_sum, float, SIM_OP_SUM, a + b)
SIM_REDUCTION(simd_sum, int, SIM_OP_SUM, a + b)
SIM_REDUCTION(simd_max, float, SIM_OP_MAX, metal::max(a, b))
SIM_REDUCTION(simd_max, int, SIM_OP_MAX, metal::max(a, b))
SIM_REDUCTION(simd_min, float, SIM_OP_MIN, metal::min(a, b))
SIM_REDUCTION(simd_min, int, SIM_OP_MIN, metal::min(a, b))
#undef SIM_REDUCTION
inline bool simd_any(bool v, int line = __builtin_LINE()) {
  return sim_reduce(int(v), sim_op(SIM_OP_ANY, line), [](int a, int b) { return a | b; }) != 0;
}
inline bool simd_all(bool v, int line = __builtin_LINE()) {
  return sim_reduce(int(v), sim_op(SIM_OP_ANY, line), [](int a, int b) { return a & b; }) != 0;
}

// ---- 8x8 simdgroup matrices ------------------------------------------------------------------------
// Apple's thread_elements() layout (MLX steel/attn/mma.h, BaseMMAFrag<float, 8, 8>): lane l holds
// row fm = (qid & 4) + ((l / 2) % 4) and columns fn, fn + 1 with qid = l / 4, fn = (qid & 2) * 2 + (l % 2) * 2.
inline int sim_frag_row(int lane) { return ((lane / 4) & 4) + ((lane / 2) % 4); }
inline int sim_frag_col(int lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }

template <typename U, int R, int C>
struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "the simulation has 8x8 matrices only");
  U e[2];
  U (&thread_elements())[2] { return e; }
};

// D = A B + C for the simdgroup, in float (each lane's two elements of D in its layout place).
template <typename U>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<U, 8, 8>& d, const simdgroup_matrix<U, 8, 8>& a,
                                          const simdgroup_matrix<U, 8, 8>& b, const simdgroup_matrix<U, 8, 8>& c,
                                          int line = __builtin_LINE()) {
  float mine[4] = {float(a.e[0]), float(a.e[1]), float(b.e[0]), float(b.e[1])};
  const unsigned char* row = sim_exchange(mine, sizeof(mine), sim_op(SIM_OP_MATRIX, line));
  float am[8][8], bm[8][8];
  for (int l = 0; l < SIM_SIMD; ++l) {
    float v[4];
    std::memcpy(v, row + size_t(l) * SIM_SLOT_BYTES, sizeof(v));
    const int r = sim_frag_row(l), col = sim_frag_col(l);
    am[r][col] = v[0];
    am[r][col + 1] = v[1];
    bm[r][col] = v[2];
    bm[r][col + 1] = v[3];
  }
  const int lane = sim_cur().lane;
  const int r = sim_frag_row(lane), col = sim_frag_col(lane);
  float out[2];
  for (int i = 0; i < 2; ++i) {
    float acc = 0.0f;
    for (int k = 0; k < 8; ++k) acc += am[r][k] * bm[k][col + i];
    out[i] = acc + float(c.e[i]);
  }
  d.e[0] = U(out[0]);
  d.e[1] = U(out[1]);
}
