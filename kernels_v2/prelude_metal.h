// metal-attn: Metal prelude.
// MLX's Metal JIT already provides <metal_stdlib>, `using namespace metal`,
// float16_t / bfloat16_t and the simd_* / threadgroup_barrier vocabulary; this
// prelude only adds the few portable helpers that the CUDA prelude defines too.

#define MA_FUNC inline

// Element conversions (float16_t, bfloat16_t, float <-> float).
template <typename U>
MA_FUNC float ma_to_float(U x) {
  return static_cast<float>(x);
}

template <typename U>
MA_FUNC U ma_from_float(float x) {
  return static_cast<U>(x);
}

// Load 4 consecutive elements as float (the Metal compiler merges the loads).
template <typename U>
MA_FUNC void ma_load4(const device U* p, thread float* out) {
  out[0] = static_cast<float>(p[0]);
  out[1] = static_cast<float>(p[1]);
  out[2] = static_cast<float>(p[2]);
  out[3] = static_cast<float>(p[3]);
}

// Four elements kept in registers until they are used (the CUDA prelude packs them
// into one 8- or 16-byte load); loading a chunk of tokens before any arithmetic
// keeps many loads in flight.
template <typename U>
struct ma_raw4 {
  U v[4];
};
template <typename U>
MA_FUNC ma_raw4<U> ma_load_raw4(const device U* p) {
  ma_raw4<U> r;
  r.v[0] = p[0];
  r.v[1] = p[1];
  r.v[2] = p[2];
  r.v[3] = p[3];
  return r;
}
template <typename U>
MA_FUNC void ma_unpack4(ma_raw4<U> r, thread float* out) {
  out[0] = static_cast<float>(r.v[0]);
  out[1] = static_cast<float>(r.v[1]);
  out[2] = static_cast<float>(r.v[2]);
  out[3] = static_cast<float>(r.v[3]);
}

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

// 8x8 float matrices spread over a simdgroup (simdgroup_matrix<float, 8, 8>), two
// elements a lane, kept as plain floats between products so that the shared bodies
// can mask and rescale them. Element i of a lane sits at (ma_frag_row, ma_frag_col + i)
// in every operand (Apple's thread_elements() layout, as MLX's steel kernels use it);
// the CUDA prelude has its own layouts behind the same names.
struct ma_frag8 {
  float v[2];
};
MA_FUNC int ma_frag_row(int lane) { return ((lane >> 2) & 4) + ((lane >> 1) & 3); }
MA_FUNC int ma_frag_col(int lane) { return ((lane >> 2) & 2) * 2 + (lane & 1) * 2; }
MA_FUNC int ma_frag_bk(int lane, int i) { return ma_frag_row(lane); }
MA_FUNC int ma_frag_bn(int lane, int i) { return ma_frag_col(lane) + i; }
// Reduce over the four lanes that hold one row (they differ in lane bits 0 and 3).
MA_FUNC float ma_frag_row_max(float x) {
  x = metal::max(x, simd_shuffle_xor(x, ushort(1)));
  return metal::max(x, simd_shuffle_xor(x, ushort(8)));
}
MA_FUNC float ma_frag_row_sum(float x) {
  x += simd_shuffle_xor(x, ushort(1));
  return x + simd_shuffle_xor(x, ushort(8));
}

// d += a * b on the simdgroup matrix unit, in float.
template <typename U>
MA_FUNC void ma_mma(thread ma_frag8& d, thread const ma_frag8& a, thread const ma_frag8& b) {
  simdgroup_matrix<float, 8, 8> am;
  simdgroup_matrix<float, 8, 8> bm;
  simdgroup_matrix<float, 8, 8> dm;
  am.thread_elements()[0] = a.v[0];
  am.thread_elements()[1] = a.v[1];
  bm.thread_elements()[0] = b.v[0];
  bm.thread_elements()[1] = b.v[1];
  dm.thread_elements()[0] = d.v[0];
  dm.thread_elements()[1] = d.v[1];
  simdgroup_multiply_accumulate(dm, am, bm, dm);
  d.v[0] = dm.thread_elements()[0];
  d.v[1] = dm.thread_elements()[1];
}
// The same product where a holds arbitrary floats (the CUDA prelude splits them; the
// float product here needs no split).
template <typename U>
MA_FUNC void ma_mma_f(thread ma_frag8& d, thread const ma_frag8& a, thread const ma_frag8& b) {
  ma_mma<U>(d, a, b);
}

// Four elements into threadgroup memory.
template <typename U>
MA_FUNC void ma_tg_store4(threadgroup U* p, ma_raw4<U> r) {
  p[0] = r.v[0];
  p[1] = r.v[1];
  p[2] = r.v[2];
  p[3] = r.v[3];
}
