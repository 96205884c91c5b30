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
