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
