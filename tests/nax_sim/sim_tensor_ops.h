// metal-attn tests: matmul2d on cooperative tensors for the CPU simulation (after nax_layout.h).
namespace mpp {
namespace tensor_ops {
struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right, relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_, bool tl = false, bool tr = false, bool rp = false,
                                mode md = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(tl), transpose_right(tr), relaxed_precision(rp), matmul_mode(md) {}
  constexpr operator unsigned long long() const {
    return (unsigned long long)m | ((unsigned long long)n << 8) | ((unsigned long long)k << 16) |
           ((unsigned long long)transpose_left << 24) | ((unsigned long long)transpose_right << 25) |
           ((unsigned long long)(matmul_mode == mode::multiply_accumulate) << 27);
  }
};
template <typename E, int N, int ROLE>
struct cooperative_tensor {
  E v[N];
  E& operator[](int i) { return v[i]; }
  const E& operator[](int i) const { return v[i]; }
};
template <unsigned long long DESC, typename Scope>
struct matmul2d {
  static_assert((DESC & 0xffffff) == (16 | (32 << 8) | (16 << 16)) && !((DESC >> 24) & 1), "16x32x16, left as is");
  static constexpr bool kTransposeRight = ((DESC >> 25) & 1) != 0;
  static constexpr bool kAccumulate = ((DESC >> 27) & 1) != 0;
  template <typename L, typename R, typename C>
  cooperative_tensor<L, 8, 0> get_left_input_cooperative_tensor() const { return {}; }
  template <typename L, typename R, typename C>
  cooperative_tensor<R, 16, 1> get_right_input_cooperative_tensor() const { return {}; }
  template <typename LT, typename RT, typename C>
  cooperative_tensor<C, 16, 2> get_destination_cooperative_tensor() const { return {}; }
  template <typename L, typename R>
  void run(const cooperative_tensor<L, 8, 0>& a, const cooperative_tensor<R, 16, 1>& b,
           cooperative_tensor<float, 16, 2>& c) const {
    const int lane = sim_lane;
    float* sa = sim_group->scratch;
    float* sb = sa + 16 * 16;
    sim_group->bar.arrive_and_wait();
    for (int e = 0; e < 8; ++e) sa[ma_nax_frag_row(lane, e) * 16 + ma_nax_frag_col(lane, e)] = float(a[e]);
    for (int i = 0; i < 16; ++i) {
      const int r = ma_nax_frag_row(lane, i), col = ma_nax_frag_col(lane, i);
      if (kTransposeRight) {
        sb[col * 32 + 16 * (i >> 3) + r] = float(b[i]);
      } else {
        sb[r * 32 + 16 * (i >> 3) + col] = float(b[i]);
      }
    }
    sim_group->bar.arrive_and_wait();
    float d[16];
    for (int i = 0; i < 16; ++i) {
      const int r = ma_nax_frag_row(lane, i), n = 16 * (i >> 3) + ma_nax_frag_col(lane, i);
      float acc = 0.0f;
      for (int k = 0; k < 16; ++k) acc += sa[r * 16 + k] * sb[k * 32 + n];
      d[i] = acc;
    }
    sim_group->bar.arrive_and_wait();
    for (int i = 0; i < 16; ++i) c[i] = kAccumulate ? c[i] + d[i] : d[i];
  }
};
}  // namespace tensor_ops
}  // namespace mpp
