// metal-attn: helpers shared by the paged-attention bodies (both backends).
// Needs a prelude (MA_FUNC, metal:: math) and the generated defines
// (MA_LOG2E, MA_NEG_FLT_MAX, MA_SOFTMAX_EPS, MA_SIMD_WIDTH) before it.

// A raw q.k dot product -> score in log2 space.
// Without softcap, `scale` already carries log2(e); with softcap c > 0 the cap
// is applied to the natural-log score first: c * tanh(s / c), then * log2(e).
// A dot product that is not finite (a NaN or infinity in q or K) gives a NaN score, softcap or
// not: the row's sums then turn NaN instead of the key being dropped (-inf) or capped (+-c).
MA_FUNC float ma_score(float dot, float scale, float softcap) {
  float s = ma_finite_or_nan(dot) * scale;
  if (softcap > 0.0f) {
    s = softcap * metal::tanh(s / softcap) * MA_LOG2E;
  }
  return s;
}

// A sink's logit in log2 space. A finite sink past FLT_MAX / log2(e) (about 2.36e38) would overflow to
// +inf there, and +inf - +inf is NaN in the softmax: it becomes FLT_MAX, which outweighs every score as
// the sink itself does. +inf and NaN stay as they are (their heads turn NaN, as in the float64 oracle).
MA_FUNC float ma_sink_log2(float sink) {
  const float l2 = sink * MA_LOG2E;
  return (sink <= -MA_NEG_FLT_MAX && l2 > -MA_NEG_FLT_MAX) ? -MA_NEG_FLT_MAX : l2;
}

// Weight of a softmax state with max `m` relative to a larger max `m_new`
// (both in log2 space). An empty state (m == -FLT_MAX) weighs 0 unless the
// new max is the sentinel too, in which case its sums are 0 anyway.
MA_FUNC float ma_rescale(float m, float m_new) {
  return metal::exp2(m - m_new);
}

// The sequence of query row `qtok` in a varlen batch: the last s with cu_seqlens_q[s] <= qtok.
template <typename P>
MA_FUNC int ma_seq_of(P cu_seqlens_q, int num_seqs, int qtok) {
  int lo = 0;
  int hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu_seqlens_q[mid] <= qtok) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

