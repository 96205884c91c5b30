// The paged-attention kernel body, compiled once per instruction set.
//
// Included by isa_portable.cpp, isa_avx2.cpp and isa_avx512.cpp inside their
// own namespace (MA_ISA_NS) and with their own -m flags; the host picks one at
// run time. The code is written with GCC/Clang vector extensions over 16
// floats, which each unit lowers to its widest registers (SSE2/NEON, AVX2,
// AVX-512). Only the float16 load differs: F16C/AVX-512 conversion
// instructions where the unit has them, a bit-exact integer path otherwise.
//
// Softmax runs in log2 space: q is pre-multiplied by scale*log2(e) (by scale
// alone when a softcap sits between the dot product and the softmax), and every
// exponential is an exp2. States are (m, l, acc) per query vector; a fresh
// state is (-FLT_MAX, 0, 0), or (sink*log2e, 1, 0) when a sink is folded in.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>  // std::integer_sequence only (a type; no code)

#include "kernel_api.h"

#if defined(MA_ISA_X86_VECTOR)
#include <immintrin.h>
#endif

#ifndef MA_ISA_NS
#error "define MA_ISA_NS before including attention_impl.h"
#endif

namespace metal_attn_native {
namespace MA_ISA_NS {

// Floats per vector: the unit's native register width (16 for AVX-512, 8 for
// AVX2, 4 for the baseline SSE2/NEON build), so accumulators stay in registers.
#if defined(MA_ISA_AVX512)
constexpr int W = 16;
#elif defined(MA_ISA_AVX2)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
constexpr int kChunk = 16;      // tokens per scoring chunk (may span pages)
constexpr int kMaxNQ = 4;       // query vectors per micro-kernel
constexpr float kLog2e = static_cast<float>(MA_LOG2E);
constexpr float kEps = static_cast<float>(MA_SOFTMAX_EPS);
constexpr float kNegMax = -FLT_MAX;

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh16 __attribute__((vector_size(W * 2)));

// x - 0 is x for every float (-0 and NaN included), so this is a plain broadcast; `vf{} + x` is not
// (-0 + 0 is +0), and without fast-math it costs a scalar add before every broadcast.
static inline vf splat(float x) { return x - vf{}; }
static inline vf loadu(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
static inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

static inline vf bits_to_f(vu u) {
  vf r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}
static inline vu f_to_bits(vf f) {
  vu r;
  std::memcpy(&r, &f, sizeof(r));
  return r;
}

// ---- loads with conversion to float32 --------------------------------------------------

static inline vf load_bf16(const uint16_t* p) {
#if defined(MA_ISA_AVX512)
  // One zero-extending load and a shift; the generic form below compiles to twice the instructions.
  __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<vf>(u);
#elif defined(MA_ISA_AVX2)
  __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<vf>(u);
#else
  vh16 h;
  std::memcpy(&h, p, sizeof(h));
  vu u = __builtin_convertvector(h, vu) << 16;
  return bits_to_f(u);
#endif
}

static inline vf load_f16(const uint16_t* p) {
#if defined(MA_ISA_AVX512)
  __m512 r = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  vf out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
#elif defined(MA_ISA_AVX2)
  __m256 r = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  vf out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
#else
  // Exponent/mantissa moved into float32 position, then rescaled by 2^112:
  // exact for normals and subnormals; infinities and NaNs are patched.
  vh16 h;
  std::memcpy(&h, p, sizeof(h));
  vu u = __builtin_convertvector(h, vu);
  vu sign = (u & 0x8000u) << 16;
  vu em = (u & 0x7fffu) << 13;
  vf mag = bits_to_f(em) * splat(5.192296858534828e33f);  // 2^112
  vu special = (vu)((u & 0x7c00u) == 0x7c00u);                // all ones where inf/nan
  vu magbits = f_to_bits(mag);
  magbits = (magbits & ~special) | ((em | 0x7f800000u) & special);
  return bits_to_f(magbits | sign);
#endif
}

template <int DT>
static inline vf load_vec(const void* base, int64_t idx) {
  if constexpr (DT == kFloat32) {
    return loadu(static_cast<const float*>(base) + idx);
  } else if constexpr (DT == kFloat16) {
    return load_f16(static_cast<const uint16_t*>(base) + idx);
  } else {
    return load_bf16(static_cast<const uint16_t*>(base) + idx);
  }
}

// ---- scalar conversions (q loads, output stores) ---------------------------------------

static inline float bf16_to_f(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline float f16_to_f(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    float f = std::ldexp(static_cast<float>(man), -24);
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

static inline uint16_t f_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (au >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (au < 0x38800000u) {
    // Subnormal (or zero) half: round |f| * 2^24 to nearest even integer.
    float a;
    std::memcpy(&a, &au, 4);
    float scaled = a * 16777216.0f;
    float r = std::nearbyint(scaled);  // default rounding mode: nearest even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(r));
  }
  uint32_t mant_odd = (au >> 13) & 1u;
  au += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return static_cast<uint16_t>(sign | (au >> 13));
}

template <int DT>
static inline float load_scalar(const void* base, int64_t idx) {
  if constexpr (DT == kFloat32) {
    return static_cast<const float*>(base)[idx];
  } else if constexpr (DT == kFloat16) {
    return f16_to_f(static_cast<const uint16_t*>(base)[idx]);
  } else {
    return bf16_to_f(static_cast<const uint16_t*>(base)[idx]);
  }
}

template <int DT>
static inline void store_scalar(void* base, int64_t idx, float x) {
  if constexpr (DT == kFloat32) {
    static_cast<float*>(base)[idx] = x;
  } else if constexpr (DT == kFloat16) {
    static_cast<uint16_t*>(base)[idx] = f_to_f16(x);
  } else {
    static_cast<uint16_t*>(base)[idx] = f_to_bf16(x);
  }
}

// ---- math ----------------------------------------------------------------------------

static inline float hsum(vf v) {
#if defined(MA_ISA_AVX512)
  return _mm512_reduce_add_ps(v);
#elif defined(MA_ISA_AVX2)
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
#else
  return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

static inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// Folds for horizontal reductions of several vectors at once. Over the 2W lanes of (x, y), taken
// as blocks of H lanes, fold<H> adds every even block to the odd block after it: from two vectors
// of W partial sums each it makes one vector of W/2 partials of x, then W/2 of y, in order. Four
// levels (H = W/2, ..., 1) turn W vectors of one token each into one vector of W token sums in
// token order, for 3 instructions a fold where a horizontal sum per vector costs about 8.
template <int H, int... I>
static inline vf fold_seq(vf x, vf y, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(x, y, ((I / H) * 2 * H + I % H)...) +
         __builtin_shufflevector(x, y, ((I / H) * 2 * H + I % H + H)...);
}
template <int H>
static inline vf fold(vf x, vf y) {
  return fold_seq<H>(x, y, std::make_integer_sequence<int, W>{});
}
template <int H>
static inline void fold_level(vf* v, int count) {
  for (int i = 0; i < count / 2; ++i) v[i] = fold<H>(v[2 * i], v[2 * i + 1]);
}
// W/2 vectors, each fold<W/2> of two tokens' partial sums, into the W tokens' sums (v is clobbered).
static inline vf sum_pairs(vf* v) {
  if constexpr (W == 16) {
    fold_level<4>(v, 8);
    fold_level<2>(v, 4);
    fold_level<1>(v, 2);
  } else if constexpr (W == 8) {
    fold_level<2>(v, 4);
    fold_level<1>(v, 2);
  } else {
    fold_level<1>(v, 2);
  }
  return v[0];
}

// The largest lane (no lane may be NaN): log2(W) swaps of lane blocks.
template <int H, int... I>
static inline vf swap_blocks(vf x, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(x, x, (I ^ H)...);
}
static inline float hmax(vf m) {
  if constexpr (W >= 16) m = vmax(m, swap_blocks<8>(m, std::make_integer_sequence<int, W>{}));
  if constexpr (W >= 8) m = vmax(m, swap_blocks<4>(m, std::make_integer_sequence<int, W>{}));
  m = vmax(m, swap_blocks<2>(m, std::make_integer_sequence<int, W>{}));
  m = vmax(m, swap_blocks<1>(m, std::make_integer_sequence<int, W>{}));
  return m[0];
}

// Lanes that hold a NaN or an infinity (all bits set), and NaN written into them.
static inline vu nonfinite_lanes(vf x) { return (vu)((f_to_bits(x) & 0x7fffffffu) >= 0x7f800000u); }
static inline vf nan_where(vu lanes, vf x) { return bits_to_f((f_to_bits(x) & ~lanes) | (0x7fc00000u & lanes)); }

// 2^x for every lane: round-to-nearest range reduction and a degree-6 Taylor
// polynomial on [-0.5, 0.5] (relative error < 2e-7). Inputs at or below -127
// give exactly 0 (so exp2(-FLT_MAX - m) == 0); inputs above 128 give +inf; NaN
// gives NaN (a NaN score must reach the row's sums, never become a weight of 0).
static inline vf exp2v(vf x) {
  const vu nan_lanes = (vu)(x != x);
  x = vmax(x, splat(-127.0f));
  x = x < splat(129.0f) ? x : splat(129.0f);
  vf xr = x + splat(0.5f);
  vi n = __builtin_convertvector(xr, vi);               // truncation
  vf nf = __builtin_convertvector(n, vf);
  n += (vi)(nf > xr);                                    // -1 where truncation rounded up: floor
  nf = __builtin_convertvector(n, vf);
  vf f = (x - nf) * splat(0.6931471805599453f);          // in [-ln2/2, ln2/2]
  vf p = splat(1.0f / 720.0f);
  p = p * f + splat(1.0f / 120.0f);
  p = p * f + splat(1.0f / 24.0f);
  p = p * f + splat(1.0f / 6.0f);
  p = p * f + splat(0.5f);
  p = p * f + splat(1.0f);
  p = p * f + splat(1.0f);
  // 2^n by exponent bits; n = -127 gives the bit pattern of 0, n >= 128 of inf.
  vi e = n + 127;
  vi zero{};
  e = e < zero ? zero : e;
  vi cap = zero + 255;
  e = e > cap ? cap : e;
  vu bits;
  std::memcpy(&bits, &e, sizeof(bits));
  vf scale2 = bits_to_f(bits << 23);
  vf r = p * scale2;
  // 2^n with n = 128 is inf; inf * p stays inf. Lanes with e == 0 give 0 * p = 0.
  return bits_to_f((f_to_bits(r) & ~nan_lanes) | (0x7fc00000u & nan_lanes));
}

// c * tanh(s / c) * log2(e). Where |s / c| >= 1/4, tanh(y) = 1 - 2 / (exp(2y) + 1); below, that
// cancels (at c >= 1e8 every score became 0), so c * tanh(y) = s * (1 - y^2/3 + 2y^4/15 - 17y^6/315 +
// 62y^8/2835), whose next term is under 1e-9 of it there. Multiplying by c last keeps c * log2(e)
// from overflowing for c near FLT_MAX.
static inline vf softcap_log2(vf s, float c) {
  vf y = s * splat(1.0f / c);
  vf e = exp2v(y * splat(2.0f * kLog2e));
  vf large = (splat(1.0f) - splat(2.0f) / (e + splat(1.0f))) * splat(c);
  vf u = y * y;
  vf poly = splat(62.0f / 2835.0f);
  poly = poly * u - splat(17.0f / 315.0f);
  poly = poly * u + splat(2.0f / 15.0f);
  poly = poly * u - splat(1.0f / 3.0f);
  poly = poly * u + splat(1.0f);
  vf small = s * poly;
  return (u < splat(1.0f / 16.0f) ? small : large) * splat(kLog2e);
}

// ---- micro-kernel: NQ query vectors x up to kChunk tokens of one sequence --------------

struct QState {
  float* q;    // [D] pre-scaled query
  float* acc;  // [D]
  float* m;    // running max (log2 space)
  float* l;    // running sum
};

// Up to kChunk consecutive KV positions of one sequence, which may span pages: the address of each
// token's row (its first KV head; a head's rows start `head * D` elements further) in both pools.
struct ChunkRows {
  const char* k[kChunk];
  const char* v[kChunk];
  int n = 0;
};

// Software prefetch of the next chunk's K/V rows of one KV head (one chunk ahead, spread over the
// score loop): a head's rows sit one token stride apart, a different 4 KiB page each, where
// hardware prefetchers do not follow.
struct Prefetch {
  const ChunkRows* rows = nullptr;
  int64_t head_bytes = 0;  // offset of the KV head in a row
  int row_bytes = 0;       // bytes of one head's row
};

// Always inlined: as a function of its own, GCC's interprocedural analysis finds it free of side
// effects (prefetches and loads only) and deletes every call.
__attribute__((always_inline)) static inline void prefetch_row(const Prefetch& pf, int t) {
  if (pf.rows != nullptr && t < pf.rows->n) {
    const char* pk = pf.rows->k[t] + pf.head_bytes;
    const char* pv = pf.rows->v[t] + pf.head_bytes;
    for (int b = 0; b < pf.row_bytes; b += 64) {
      __builtin_prefetch(pk + b, 0, 3);
      __builtin_prefetch(pv + b, 0, 3);
    }
  }
}

template <int NQ, int DT>
static inline void attend_chunk(const ChunkRows& rows, int64_t head_bytes, int D, float softcap, QState* qs,
                                const Prefetch& pf) {
  alignas(64) float s[NQ][kChunk];
  const int n = rows.n;
  const int nd = D / W;
  // Scores: each K element is loaded once and used by the NQ query vectors; two tokens at a time
  // so 2*NQ independent FMA chains are in flight. Each pair's two vectors of partial sums are folded
  // into one right away, and every W tokens' folds into one vector of their W scores.
  vf pairs[NQ][kChunk / 2];
  int t = 0;
  for (; t < n; t += 2) {
    prefetch_row(pf, t);
    prefetch_row(pf, t + 1);
    const bool two = t + 1 < n;
    const char* k0 = rows.k[t] + head_bytes;
    const char* k1 = two ? rows.k[t + 1] + head_bytes : k0;
    vf a[NQ], b[NQ];
    for (int j = 0; j < NQ; ++j) a[j] = b[j] = splat(0.0f);
    for (int c = 0; c < nd; ++c) {
      const vf kv0 = load_vec<DT>(k0, c * W);
      const vf kv1 = load_vec<DT>(k1, c * W);
      for (int j = 0; j < NQ; ++j) {
        const vf qv = loadu(qs[j].q + c * W);
        a[j] += qv * kv0;
        b[j] += qv * kv1;
      }
    }
    // A lone last token scores its row twice; the copy is a padding lane, overwritten below.
    for (int j = 0; j < NQ; ++j) pairs[j][t / 2] = fold<W / 2>(a[j], b[j]);
  }
  const int groups = (n + W - 1) / W;
  for (int j = 0; j < NQ; ++j) {
    for (int i = t / 2; i < groups * (W / 2); ++i) pairs[j][i] = splat(0.0f);
    for (int g = 0; g < groups; ++g) storeu(&s[j][g * W], sum_pairs(&pairs[j][g * (W / 2)]));
  }

  // Online softmax update, one chunk at a time.
  alignas(64) float p[NQ][kChunk];
  float alpha[NQ];
  constexpr int NV = kChunk / W;
  for (int j = 0; j < NQ; ++j) {
    // A NaN or infinite dot product (a non-finite q or K element) becomes a NaN score, softcap or
    // not: exp2 keeps it NaN, so the row's sums turn NaN instead of dropping the key (-inf) or
    // taking a finite capped value (tanh of +-inf).
    for (int i = 0; i < groups; ++i) {
      vf sv = loadu(&s[j][i * W]);
      const vu bad = nonfinite_lanes(sv);
      if (softcap > 0.0f) sv = softcap_log2(sv, softcap);
      storeu(&s[j][i * W], nan_where(bad, sv));
    }
    for (int i = n; i < groups * W; ++i) s[j][i] = kNegMax;  // padding stays masked (after the softcap)
    // The chunk's maximum ignores NaN scores (x > mv is false for them).
    vf mv = splat(kNegMax);
    for (int i = 0; i < groups; ++i) {
      const vf x = loadu(&s[j][i * W]);
      mv = x > mv ? x : mv;
    }
    const float cmax = hmax(mv);
    const float m_old = *qs[j].m;
    const float m_new = cmax > m_old ? cmax : m_old;
    // m_old == -FLT_MAX (fresh state): exp2 of a huge negative number is 0.
    alpha[j] = m_old == m_new ? 1.0f : std::exp2(m_old - m_new);
    vf sum = splat(0.0f);
    for (int i = 0; i < groups; ++i) {
      const vf pv = exp2v(loadu(&s[j][i * W]) - m_new);
      storeu(&p[j][i * W], pv);
      sum += pv;
    }
    for (int i = groups; i < NV; ++i) storeu(&p[j][i * W], splat(0.0f));
    *qs[j].l = *qs[j].l * alpha[j] + hsum(sum);
    *qs[j].m = m_new;
  }
  // acc = acc * alpha + P V; the accumulators stay in registers across the
  // chunk, two W-float column blocks at a time for independent FMA chains.
  int c = 0;
  for (; c + 1 < nd; c += 2) {
    vf a[NQ], b[NQ];
    for (int j = 0; j < NQ; ++j) {
      a[j] = loadu(qs[j].acc + c * W) * splat(alpha[j]);
      b[j] = loadu(qs[j].acc + (c + 1) * W) * splat(alpha[j]);
    }
    for (int t = 0; t < n; ++t) {
      const char* vr = rows.v[t] + head_bytes;
      const vf v0 = load_vec<DT>(vr, c * W);
      const vf v1 = load_vec<DT>(vr, (c + 1) * W);
      for (int j = 0; j < NQ; ++j) {
        const vf pj = splat(p[j][t]);
        a[j] += pj * v0;
        b[j] += pj * v1;
      }
    }
    for (int j = 0; j < NQ; ++j) {
      storeu(qs[j].acc + c * W, a[j]);
      storeu(qs[j].acc + (c + 1) * W, b[j]);
    }
  }
  for (; c < nd; ++c) {
    vf a[NQ];
    for (int j = 0; j < NQ; ++j) a[j] = loadu(qs[j].acc + c * W) * splat(alpha[j]);
    for (int t = 0; t < n; ++t) {
      vf vv = load_vec<DT>(rows.v[t] + head_bytes, c * W);
      for (int j = 0; j < NQ; ++j) a[j] += splat(p[j][t]) * vv;
    }
    for (int j = 0; j < NQ; ++j) storeu(qs[j].acc + c * W, a[j]);
  }
}

template <int DT>
static void attend_chunk_n(int nq, const ChunkRows& rows, int64_t head_bytes, int D, float softcap, QState* qs,
                           const Prefetch& pf) {
  switch (nq) {
    case 1: attend_chunk<1, DT>(rows, head_bytes, D, softcap, qs, pf); break;
    case 2: attend_chunk<2, DT>(rows, head_bytes, D, softcap, qs, pf); break;
    case 3: attend_chunk<3, DT>(rows, head_bytes, D, softcap, qs, pf); break;
    default: attend_chunk<4, DT>(rows, head_bytes, D, softcap, qs, pf); break;
  }
}

// A NaN or +inf sink makes its head's outputs NaN, as the float64 oracle's softmax does (+inf - +inf);
// without this an infinite sink took all the weight and the output was a finite 0. A -inf sink is
// no sink (exp(-inf) = 0), as in the oracle.
static inline bool sink_poisons(const Job& job, int h) {
  return job.sinks != nullptr && !(job.sinks[h] < INFINITY);
}

// A sink's logit in log2 space: a finite sink past FLT_MAX / log2(e) (about 2.36e38) overflowed to +inf
// there and the split reducer's +inf - +inf made the head NaN; it becomes FLT_MAX, which outweighs every
// score as the sink itself does. (The kernels' text has the same rule: ma_sink_log2 in paged_common.h.)
static inline float sink_log2(float sink) {
  const float l2 = sink * kLog2e;
  return (sink <= FLT_MAX && l2 > FLT_MAX) ? FLT_MAX : l2;
}

// ---- one work unit ---------------------------------------------------------------------

template <int DT>
static void attend_unit_t(const Job& job, const Unit& u, float* work) {
  const int D = job.D, G = job.group, BS = job.BS;
  const int s = u.seq;
  const int q_start = job.cu_q[s];
  const int q_len = job.cu_q[s + 1] - q_start;
  const int seq_len = job.seq_lens[s];
  const int ctx = seq_len - q_len;
  const int nrows = u.row_end - u.row_begin;
  const int nkv = u.kvh_end - u.kvh_begin;
  const int NHU = nkv * G;  // query heads in this unit
  const int nq = nrows * NHU;
  const int64_t tok_stride = static_cast<int64_t>(job.KVH) * D;
  const bool split = u.part >= 0;
  const float qscale = job.softcap > 0.0f ? job.scale : job.scale * kLog2e;

  float* qbuf = work;                 // [nq, D]
  float* acc = qbuf + nq * D;         // [nq, D]
  float* mbuf = acc + nq * D;         // [nq]
  float* lbuf = mbuf + nq;            // [nq]

  // Query vector i = r * NHU + hh holds row r, head kvh_begin * G + hh.
  for (int r = 0; r < nrows; ++r) {
    const int64_t t = q_start + u.row_begin + r;
    for (int hh = 0; hh < NHU; ++hh) {
      const int h = u.kvh_begin * G + hh;
      const int i = r * NHU + hh;
      float* dst = qbuf + i * D;
      const int64_t base = t * job.q_st + h * job.q_sh;
      for (int d = 0; d < D; ++d) dst[d] = load_scalar<DT>(job.q, base + d * job.q_sd) * qscale;
      float* a = acc + i * D;
      for (int d = 0; d < D; ++d) a[d] = 0.0f;
      if (job.sinks != nullptr && !split) {
        mbuf[i] = sink_log2(job.sinks[h]);
        lbuf[i] = 1.0f;
      } else {
        mbuf[i] = kNegMax;
        lbuf[i] = 0.0f;
      }
    }
  }

  // KV range of the unit: the partition (split) or the whole row.
  int64_t kv_lo = 0, kv_hi = seq_len;
  if (split) {
    kv_lo = static_cast<int64_t>(u.part) * job.part_size;
    kv_hi = kv_lo + job.part_size < seq_len ? kv_lo + job.part_size : seq_len;
  }
  // Per-row causal + window ranges; their union bounds the outer loop.
  int64_t union_lo = kv_hi, union_hi = kv_lo;
  for (int r = 0; r < nrows; ++r) {
    const int64_t hi = ctx + u.row_begin + r + 1;
    const int64_t lo = job.window > 0 && hi - job.window > 0 ? hi - job.window : 0;
    const int64_t a = lo > kv_lo ? lo : kv_lo, b = hi < kv_hi ? hi : kv_hi;
    if (a < b) {
      union_lo = a < union_lo ? a : union_lo;
      union_hi = b > union_hi ? b : union_hi;
    }
  }

  const int32_t* table = job.block_tables + static_cast<int64_t>(s) * job.bt_row;
  const char* kb = static_cast<const char*>(job.k);
  const char* vb = static_cast<const char*>(job.v);
  const int64_t isz = DT == kFloat32 ? 4 : 2;
  QState qs[kMaxNQ];
  // The rows of KV positions [from, from + up to kChunk) before `end`, walking the block table.
  auto fill_rows = [&](ChunkRows& cr, int64_t from, int64_t end) {
    int64_t n = end - from < kChunk ? end - from : kChunk;
    cr.n = static_cast<int>(n);
    int64_t page = from / BS;
    int off = static_cast<int>(from - page * BS);
    for (int i = 0; i < cr.n;) {
      const int64_t block = table[page];
      const char* kp = kb + (block * job.k_sb + off * tok_stride) * isz;
      const char* vp = vb + (block * job.v_sb + off * tok_stride) * isz;
      for (; off < BS && i < cr.n; ++off, ++i) {
        cr.k[i] = kp;
        cr.v[i] = vp;
        kp += tok_stride * isz;
        vp += tok_stride * isz;
      }
      ++page;
      off = 0;
    }
  };
  ChunkRows chunk_rows[2];
  // Outer chunks of PARTITION_SIZE tokens keep a prefill tile's K/V in L2 while
  // all of its rows pass over them; then chunks of kChunk tokens (across pages),
  // then KV heads and head blocks, so each K/V chunk is loaded into L1 once for
  // every query head that uses it.
  const int64_t outer = MA_PARTITION_SIZE;
  for (int64_t cs = union_lo; cs < union_hi; cs += outer) {
    const int64_t ce = cs + outer < union_hi ? cs + outer : union_hi;
    for (int r = 0; r < nrows; ++r) {
      const int64_t hi = ctx + u.row_begin + r + 1;
      const int64_t lo = job.window > 0 && hi - job.window > 0 ? hi - job.window : 0;
      int64_t a = lo > cs ? lo : cs;
      const int64_t b = hi < ce ? hi : ce;
      if (a >= b) continue;
      int cur = 0;
      fill_rows(chunk_rows[cur], a, b);
      while (a < b) {
        const ChunkRows& rows = chunk_rows[cur];
        // The next chunk of this row, prefetched while this one is computed.
        ChunkRows& next = chunk_rows[1 - cur];
        next.n = 0;
        if (a + rows.n < b) fill_rows(next, a + rows.n, b);
        for (int kk = 0; kk < nkv; ++kk) {
          const int64_t hoff = static_cast<int64_t>(u.kvh_begin + kk) * D * isz;
          Prefetch pf;
          if (next.n) pf = Prefetch{&next, hoff, static_cast<int>(D * isz)};
          for (int g0 = 0; g0 < G; g0 += kMaxNQ) {
            const int cnt = G - g0 < kMaxNQ ? G - g0 : kMaxNQ;
            for (int j = 0; j < cnt; ++j) {
              const int i = r * NHU + kk * G + g0 + j;
              qs[j] = QState{qbuf + i * D, acc + i * D, mbuf + i, lbuf + i};
            }
            attend_chunk_n<DT>(cnt, rows, hoff, D, job.softcap, qs, g0 == 0 ? pf : Prefetch{});
          }
        }
        a += rows.n;
        cur = 1 - cur;
      }
    }
  }

  // Write the rows: normalised output, or the split contract's three arrays.
  for (int r = 0; r < nrows; ++r) {
    const int64_t t = q_start + u.row_begin + r;
    for (int hh = 0; hh < NHU; ++hh) {
      const int i = r * NHU + hh;
      const int h = u.kvh_begin * G + hh;
      const float inv = 1.0f / (lbuf[i] + kEps);
      const float* a = acc + i * D;
      if (split) {
        const int64_t pi = (t * job.H + h) * job.max_parts + u.part;
        job.part_m[pi] = mbuf[i];
        job.part_l[pi] = lbuf[i];
        float* po = job.part_out + pi * D;
        for (int d = 0; d < D; ++d) po[d] = a[d] * inv;
      } else {
        const int64_t ob = (t * job.H + h) * D;
        if (sink_poisons(job, h)) {
          for (int d = 0; d < D; ++d) store_scalar<DT>(job.out, ob + d, NAN);
          continue;
        }
        for (int d = 0; d < D; ++d) store_scalar<DT>(job.out, ob + d, a[d] * inv);
      }
    }
  }
}

void attend_unit(const Job& job, int unit, float* work) {
  const Unit& u = job.units[unit];
  switch (job.dtype) {
    case kFloat32: attend_unit_t<kFloat32>(job, u, work); break;
    case kFloat16: attend_unit_t<kFloat16>(job, u, work); break;
    default: attend_unit_t<kBFloat16>(job, u, work); break;
  }
}

// ---- the reducer: one (query token, head) per item ---------------------------------------

template <int DT>
static void reduce_item_t(const Job& job, int item) {
  const int64_t t = item / job.H;
  const int h = item % job.H;
  const int D = job.D;
  const int s = job.tok_seq[t];
  const int seq_len = job.seq_lens[s];
  const int nparts = (seq_len + job.part_size - 1) / job.part_size;
  const int64_t base = (t * job.H + h) * job.max_parts;
  float gmax = kNegMax;
  for (int z = 0; z < nparts; ++z) gmax = job.part_m[base + z] > gmax ? job.part_m[base + z] : gmax;
  float sink_l2 = kNegMax;
  if (job.sinks != nullptr) {
    sink_l2 = sink_log2(job.sinks[h]);
    gmax = sink_l2 > gmax ? sink_l2 : gmax;
  }
  alignas(64) float accum[kMaxHeadSize];
  for (int d = 0; d < D; ++d) accum[d] = 0.0f;
  float total = 0.0f;
  for (int z = 0; z < nparts; ++z) {
    const float lz = job.part_l[base + z];
    if (lz <= 0.0f) continue;  // neutral partial (empty or outside the window)
    const float w = std::exp2(job.part_m[base + z] - gmax) * lz;
    total += w;
    const float* po = job.part_out + (base + z) * D;
    for (int c = 0; c < D; c += W) storeu(accum + c, loadu(accum + c) + splat(w) * loadu(po + c));
  }
  if (job.sinks != nullptr) total += std::exp2(sink_l2 - gmax);
  const float inv = 1.0f / (total + kEps);
  const int64_t ob = (t * job.H + h) * D;
  if (sink_poisons(job, h)) {
    for (int d = 0; d < D; ++d) store_scalar<DT>(job.out, ob + d, NAN);
    return;
  }
  for (int d = 0; d < D; ++d) store_scalar<DT>(job.out, ob + d, accum[d] * inv);
}

// ---- the bandwidth probe: read [begin, end) bytes as fast as this unit can ---------------

// Four independent accumulators of W-float vectors (integer adds on the raw bits: no FP latency
// chain, nothing the compiler may drop), one 64-byte line per step; the tail byte by byte.
uint64_t read_span(const char* p, int64_t n) {
  const int64_t step = 4 * static_cast<int64_t>(sizeof(vu));
  vu a{}, b{}, c{}, d{};
  int64_t i = 0;
  for (; i + step <= n; i += step) {
    vu x, y, z, w;
    std::memcpy(&x, p + i, sizeof(vu));
    std::memcpy(&y, p + i + sizeof(vu), sizeof(vu));
    std::memcpy(&z, p + i + 2 * sizeof(vu), sizeof(vu));
    std::memcpy(&w, p + i + 3 * sizeof(vu), sizeof(vu));
    a += x;
    b += y;
    c += z;
    d += w;
  }
  vu t = (a ^ b) + (c ^ d);
  uint64_t sum = 0;
  for (int k = 0; k < W; ++k) sum += t[k];
  for (; i < n; ++i) sum += static_cast<unsigned char>(p[i]);
  return sum;
}

void reduce_item(const Job& job, int item) {
  switch (job.dtype) {
    case kFloat32: reduce_item_t<kFloat32>(job, item); break;
    case kFloat16: reduce_item_t<kFloat16>(job, item); break;
    default: reduce_item_t<kBFloat16>(job, item); break;
  }
}

}  // namespace MA_ISA_NS
}  // namespace metal_attn_native
