// metal-attn: Metal prelude.
// MLX's Metal JIT already provides <metal_stdlib>, `using namespace metal`,
// float16_t / bfloat16_t and the simd_* / threadgroup_barrier vocabulary; this
// prelude only adds the few portable helpers that the CUDA prelude defines too.

#define MA_FUNC inline

// Non-finite values (the NaN contract, docs/providers.md): a score that is not finite (a NaN or
// infinite q or K element) becomes NaN, so exp2 keeps it NaN and the row's sums turn NaN, instead
// of exp2(-inf) = 0 silently dropping the key. MLX builds Metal kernels without fast math, so
// isfinite is honoured.
MA_FUNC bool ma_isfinite(float x) {
  return metal::isfinite(x);
}
MA_FUNC float ma_nan() {
  return as_type<float>(0x7fc00000u);
}
MA_FUNC float ma_finite_or_nan(float x) {
  return metal::isfinite(x) ? x : ma_nan();
}

// Element conversions (float16_t, bfloat16_t, float <-> float).
template <typename U>
MA_FUNC float ma_to_float(U x) {
  return static_cast<float>(x);
}

template <typename U>
MA_FUNC U ma_from_float(float x) {
  return static_cast<U>(x);
}

// A partial of the split-KV contract as float (paged_common.h's reducer). The CUDA prelude's
// ma_partial_reader<true> reads past L1 for the fused reducer, a CUDA-only path: Metal has only
// this plain load.
template <bool CG>
struct ma_partial_reader {
  template <typename P>
  MA_FUNC static float read(P p) { return ma_to_float(*p); }
};

// Four elements kept in registers until they are used (the CUDA prelude packs them
// into one 8- or 16-byte load); loading a chunk of tokens before any arithmetic
// keeps many loads in flight.
template <typename U>
struct ma_raw4 {
  U v[4];
};
// The four elements at `p`, whatever its address space (the two loaders below).
template <typename U, typename P>
MA_FUNC ma_raw4<U> ma_read_raw4(P p) {
  ma_raw4<U> r;
  r.v[0] = p[0];
  r.v[1] = p[1];
  r.v[2] = p[2];
  r.v[3] = p[3];
  return r;
}
template <typename U>
MA_FUNC ma_raw4<U> ma_load_raw4(const device U* p) {
  return ma_read_raw4<U>(p);
}
template <typename U>
MA_FUNC void ma_unpack4(ma_raw4<U> r, thread float* out) {
  out[0] = static_cast<float>(r.v[0]);
  out[1] = static_cast<float>(r.v[1]);
  out[2] = static_cast<float>(r.v[2]);
  out[3] = static_cast<float>(r.v[3]);
}

// Load 4 consecutive elements as float (the Metal compiler merges the loads).
template <typename U>
MA_FUNC void ma_load4(const device U* p, thread float* out) {
  ma_unpack4(ma_load_raw4(p), out);
}

// The same four elements read from threadgroup memory (a staged tile).
template <typename U>
MA_FUNC ma_raw4<U> ma_tg_load_raw4(const threadgroup U* p) {
  return ma_read_raw4<U>(p);
}

// 16 bytes from device into threadgroup memory (zeros when `live` is false). The CUDA
// prelude issues these asynchronously and commits/waits on groups of them; here the copy
// is done when the call returns, so commit and wait have nothing to do (the threadgroup
// barrier that follows a wait in the kernels is still what makes the copies visible).
template <typename U>
MA_FUNC void ma_async_copy16(threadgroup U* dst, const device U* src, bool live) {
  for (int i = 0; i < int(16 / sizeof(U)); ++i) {
    dst[i] = live ? src[i] : U(0.0f);
  }
}
MA_FUNC void ma_async_commit() {}
template <int N>
MA_FUNC void ma_async_wait() {}

// An L2 prefetch on CUDA; Metal has no equivalent, so this is a no-op here.
template <typename U>
MA_FUNC void ma_prefetch(const device U* p) {
  (void)p;
}

// Four simdgroup sums, every lane receiving all four (the CUDA prelude fuses the
// butterflies; Apple GPUs reduce each with simd_sum).
MA_FUNC void ma_simd_sum4(thread float& a, thread float& b, thread float& c, thread float& d) {
  a = simd_sum(a);
  b = simd_sum(b);
  c = simd_sum(c);
  d = simd_sum(d);
}

// The per-token kernel's keys-as-rows matrix path (PA_MMA == 2) is written for CUDA's 16x8 tensor-core
// products; Apple's simdgroup matrices are 8x8, so Metal has none (the CUDA prelude defines it as 1).
#define MA_KEY_ROWS_MMA 0

// 8x8 matrices spread over a simdgroup (simdgroup_matrix<float, 8, 8>), kept as plain
// floats between products so that the shared bodies can mask and rescale them: two
// elements a lane, element i at (ma_frag_row, ma_frag_col + i) in every operand (Apple's
// thread_elements() layout, as MLX's steel kernels use it). Operands (ma_opnd, ma_popnd)
// are floats here; the CUDA prelude packs them for its tensor cores behind the same names.
struct ma_frag8 {
  float v[2];
};
MA_FUNC int ma_frag_row(int lane) { return ((lane >> 2) & 4) + ((lane >> 1) & 3); }
MA_FUNC int ma_frag_col(int lane) { return ((lane >> 2) & 2) * 2 + (lane & 1) * 2; }
// Reduce over the four lanes that hold one row (they differ in lane bits 0 and 3).
MA_FUNC float ma_frag_row_max(float x) {
  x = metal::max(x, simd_shuffle_xor(x, ushort(1)));
  return metal::max(x, simd_shuffle_xor(x, ushort(8)));
}
MA_FUNC float ma_frag_row_sum(float x) {
  x += simd_shuffle_xor(x, ushort(1));
  return x + simd_shuffle_xor(x, ushort(8));
}

template <typename U>
struct ma_opnd {
  float v[2];
};
template <typename U>
struct ma_popnd {
  float v[2];
};
template <typename U>
MA_FUNC ma_opnd<U> ma_opnd_pack(float a, float b) {
  return {{a, b}};
}
template <typename U>
MA_FUNC ma_popnd<U> ma_popnd_pack(float a, float b) {
  return {{a, b}};
}
// Right operand B(k, n) = p[n * LD + k]: K^T read from a row-major K tile.
template <int LD, typename U>
MA_FUNC ma_opnd<U> ma_load_bt(const threadgroup U* p, int lane) {
  const int k = ma_frag_row(lane);
  const int n = ma_frag_col(lane);
  return ma_opnd_pack<U>(static_cast<float>(p[n * LD + k]), static_cast<float>(p[(n + 1) * LD + k]));
}
// Right operand B(k, n) = p[k * LD + n]: V read from a row-major V tile.
template <int LD, typename U>
MA_FUNC ma_opnd<U> ma_load_b(const threadgroup U* p, int lane) {
  const int k = ma_frag_row(lane);
  const int n = ma_frag_col(lane);
  return ma_opnd_pack<U>(static_cast<float>(p[k * LD + n]), static_cast<float>(p[k * LD + n + 1]));
}
// Four right operands: K^T blocks of dims [8m, 8m + 8), m < 4, of the 8 keys at p.
template <int LD, typename U>
MA_FUNC void ma_load_bt4(const threadgroup U* p, int lane, thread ma_opnd<U>* r) {
  for (int m = 0; m < 4; ++m) {
    r[m] = ma_load_bt<LD>(p + m * 8, lane);
  }
}
// Four right operands: V blocks of keys [8m, 8m + 8), m < 4, of the 8 dims at p.
template <int LD, typename U>
MA_FUNC void ma_load_b4(const threadgroup U* p, int lane, thread ma_opnd<U>* r) {
  for (int m = 0; m < 4; ++m) {
    r[m] = ma_load_b<LD>(p + m * 8 * LD, lane);
  }
}
// Four right operands: V blocks of dims [8m, 8m + 8), m < 4, of the 8 keys at p.
template <int LD, typename U>
MA_FUNC void ma_load_b4d(const threadgroup U* p, int lane, thread ma_opnd<U>* r) {
  for (int m = 0; m < 4; ++m) {
    r[m] = ma_load_b<LD>(p + m * 8, lane);
  }
}
// d += A0 B0 + A1 B1 on the simdgroup matrix unit, in float.
MA_FUNC void ma_sgmm(thread ma_frag8& d, float a0, float a1, float b0, float b1) {
  simdgroup_matrix<float, 8, 8> am;
  simdgroup_matrix<float, 8, 8> bm;
  simdgroup_matrix<float, 8, 8> dm;
  am.thread_elements()[0] = a0;
  am.thread_elements()[1] = a1;
  bm.thread_elements()[0] = b0;
  bm.thread_elements()[1] = b1;
  dm.thread_elements()[0] = d.v[0];
  dm.thread_elements()[1] = d.v[1];
  simdgroup_multiply_accumulate(dm, am, bm, dm);
  d.v[0] = dm.thread_elements()[0];
  d.v[1] = dm.thread_elements()[1];
}
// d += A0 B0 + A1 B1 for any operand pair (ma_opnd or ma_popnd: both floats here).
template <typename A, typename B>
MA_FUNC void ma_sgmm2(thread ma_frag8& d, A a0, B b0, A a1, B b1) {
  ma_sgmm(d, a0.v[0], a0.v[1], b0.v[0], b0.v[1]);
  ma_sgmm(d, a1.v[0], a1.v[1], b1.v[0], b1.v[1]);
}
template <typename U>
MA_FUNC void ma_mma2(thread ma_frag8& d, ma_opnd<U> a0, ma_opnd<U> b0, ma_opnd<U> a1, ma_opnd<U> b1) {
  ma_sgmm2(d, a0, b0, a1, b1);
}
template <typename U>
MA_FUNC void ma_mma2_p(thread ma_frag8& d, ma_popnd<U> a0, ma_opnd<U> b0, ma_popnd<U> a1, ma_opnd<U> b1) {
  ma_sgmm2(d, a0, b0, a1, b1);
}
// Two 8-row blocks sharing the right operands (top: d, a0, a1; bottom: e, c0, c1).
template <typename U>
MA_FUNC void ma_mma2x2(thread ma_frag8& d, thread ma_frag8& e, ma_opnd<U> a0, ma_opnd<U> c0, ma_opnd<U> b0,
                       ma_opnd<U> a1, ma_opnd<U> c1, ma_opnd<U> b1) {
  ma_sgmm2(d, a0, b0, a1, b1);
  ma_sgmm2(e, c0, b0, c1, b1);
}
template <typename U>
MA_FUNC void ma_mma2x2_p(thread ma_frag8& d, thread ma_frag8& e, ma_popnd<U> a0, ma_popnd<U> c0, ma_opnd<U> b0,
                         ma_popnd<U> a1, ma_popnd<U> c1, ma_opnd<U> b1) {
  ma_sgmm2(d, a0, b0, a1, b1);
  ma_sgmm2(e, c0, b0, c1, b1);
}

// d += A B for one float left operand (the CUDA prelude multiplies its two 16-bit parts).
template <typename U>
MA_FUNC void ma_mma_p(thread ma_frag8& d, ma_popnd<U> a, ma_opnd<U> b) {
  ma_sgmm(d, a.v[0], a.v[1], b.v[0], b.v[1]);
}

// A threadgroup array's memory seen as floats (a region reused once its first use is over).
template <typename U>
MA_FUNC threadgroup float* ma_tg_floats(threadgroup U* p) {
  return reinterpret_cast<threadgroup float*>(p);
}

// Four elements to `p`, whatever its address space (the two stores below).
template <typename U, typename P>
MA_FUNC void ma_write_raw4(P p, ma_raw4<U> r) {
  p[0] = r.v[0];
  p[1] = r.v[1];
  p[2] = r.v[2];
  p[3] = r.v[3];
}

// Four elements into device memory.
template <typename U>
MA_FUNC void ma_store_raw4(device U* p, ma_raw4<U> r) {
  ma_write_raw4<U>(p, r);
}

// Four elements into threadgroup memory.
template <typename U>
MA_FUNC void ma_tg_store4(threadgroup U* p, ma_raw4<U> r) {
  ma_write_raw4<U>(p, r);
}
