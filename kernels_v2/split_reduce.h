// metal-attn: the split-KV reduction, shared by the standalone reducer and the per-token kernel's
// fused reducer (kernels_v2/pagedattention.metal). Needs a prelude (MA_FUNC, metal:: math, the
// simd_* and threadgroup_barrier vocabulary, ma_partial_reader), paged_common.h (ma_rescale) and
// the generated defines (MA_NEG_FLT_MAX, MA_SOFTMAX_EPS, MA_LOG2E, MA_SIMD_WIDTH) before it.

// The split-KV reduction of one (query row, head): its partials at [base, base + n_parts) of
// max_logits / exp_sums (and rows of tmp_out) -> out_row[0, HEAD_SIZE). All NUM_THREADS threads
// of a threadgroup call it together (it has barriers); sg_part (NUM_THREADS / MA_SIMD_WIDTH
// floats) and w_block (NUM_THREADS floats) are threadgroup scratch. `sink`: the sink's logit in
// log2 space when use_sinks. CG: read the partials past L1 (ma_partial_reader; the fused reducer,
// CUDA only).
// Partitions are independent loads: the maximum takes one per thread (then a simdgroup
// butterfly and the simdgroups' values through threadgroup memory); the weights of a block of
// NUM_THREADS partitions are computed once, one per thread, into threadgroup memory, and every
// thread sums its head elements over the block UNROLL_Z partitions at a time (the loads of all
// its DPT elements issued together), so a row's reduction is a few load latencies, not one per
// partition. A thread's first partition's statistics are read once, and the first UNROLL_Z
// partitions' rows, which need no statistics, are loaded before the maximum, so their latency
// overlaps its rounds.
// ZS (partition slices, a divisor of NUM_THREADS / MA_SIMD_WIDTH): the threads form ZS slices of
// NUM_THREADS / ZS, slice s summing the s-th contiguous share of each block's partitions into its
// own partial outputs, which slice 0 then adds in slice order through `slice_out` (threadgroup
// scratch of (ZS - 1) * HEAD_SIZE floats; unused when ZS == 1). So a row of many partitions takes
// about 1/ZS of the load rounds: what a launch of few rows and heads waits for. With ZS == 1 the
// sums run over the partitions in order (the fused heads variant below agrees with it bit for bit).
template <typename T, int HEAD_SIZE, int NUM_THREADS, bool CG, int UNROLL_Z, int ZS, typename PF, typename PT,
          typename PO, typename PS, typename PC>
MA_FUNC void ma_reduce_partials(PF max_logits, PF exp_sums, PT tmp_out, PO out_row, int64_t base, int n_parts,
                                bool use_sinks, float sink, PS sg_part, PS w_block, PC slice_out, int tid) {
  constexpr int NUM_SG = NUM_THREADS / MA_SIMD_WIDTH;
  constexpr int ST = NUM_THREADS / ZS;                // threads per slice
  constexpr int DPT = (HEAD_SIZE + ST - 1) / ST;      // head elements per thread
  static_assert(ZS >= 1 && NUM_SG % ZS == 0, "partition slices of whole simdgroups");
  const int lane = tid % MA_SIMD_WIDTH;
  const int sg = tid / MA_SIMD_WIDTH;
  // This thread's head elements (dt, dt + ST, ...) and its slice; spelled out for one slice, where
  // nothing tells the compiler that tid < ST.
  const int dt = ZS == 1 ? tid : tid % ST;
  const int zs = ZS == 1 ? 0 : tid / ST;

  const bool live0 = tid < n_parts;
  const float m0 = live0 ? ma_partial_reader<CG>::read(&max_logits[base + tid]) : MA_NEG_FLT_MAX;
  const float e0 = live0 ? ma_partial_reader<CG>::read(&exp_sums[base + tid]) : 0.0f;
  // One round of this thread's tmp_out loads into t, for each of its DPT head elements: partitions
  // z0 + y + k of the row for k < UNROLL_Z, those with y + k < ye read (the rest 0). The arguments
  // are pasted unparenthesized, so the index sums in one order at both uses (nvcc: the same PTX as
  // the two loops this replaced). The parameter list has no spaces, as preprocessors print it
  // (tests/test_kernel_loader.py compares our comment stripping with g++'s tokens).
#define MA_REDUCE_LOAD_ROUND(z0,y,ye)                                                                \
  for (int j = 0; j < DPT; ++j) {                                                                    \
    const int d = dt + j * ST;                                                                       \
    for (int k = 0; k < UNROLL_Z; ++k) {                                                             \
      t[j][k] = (DPT * ST == HEAD_SIZE || d < HEAD_SIZE) && y + k < ye                               \
                    ? ma_partial_reader<CG>::read(&tmp_out[(base + z0 + y + k) * HEAD_SIZE + d])     \
                    : 0.0f;                                                                          \
    }                                                                                                \
  }
  float t[DPT][UNROLL_Z];
  // This slice's share of a block of nz partitions: [ys, ye).
  const int nz0 = metal::min(NUM_THREADS, n_parts);
  const int share0 = (nz0 + ZS - 1) / ZS;
  const int ys0 = ZS == 1 ? 0 : metal::min(nz0, zs * share0);
  const int ye0 = ZS == 1 ? n_parts : metal::min(nz0, ys0 + share0);  // one slice: its loads test k < n_parts
  MA_REDUCE_LOAD_ROUND(0, ys0, ye0)
  float g_max = m0;
  for (int z = tid + NUM_THREADS; z < n_parts; z += NUM_THREADS) {
    g_max = metal::max(g_max, ma_partial_reader<CG>::read(&max_logits[base + z]));
  }
  for (int x = MA_SIMD_WIDTH / 2; x > 0; x >>= 1) {
    g_max = metal::max(g_max, simd_shuffle_xor(g_max, ushort(x)));
  }
  if (lane == 0) {
    sg_part[sg] = g_max;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int w = 0; w < NUM_SG; ++w) {
    g_max = metal::max(g_max, sg_part[w]);
  }
  if (use_sinks) {
    g_max = metal::max(g_max, sink);
  }

  float part_sum = 0.0f;  // this thread's partitions' weights
  float o[DPT];
  for (int j = 0; j < DPT; ++j) {
    o[j] = 0.0f;
  }
  for (int z0 = 0; z0 < n_parts; z0 += NUM_THREADS) {
    const int z = z0 + tid;
    const float w = z >= n_parts ? 0.0f
                    : z0 == 0    ? e0 * ma_rescale(m0, g_max)
                                 : ma_partial_reader<CG>::read(&exp_sums[base + z]) *
                                    ma_rescale(ma_partial_reader<CG>::read(&max_logits[base + z]), g_max);
    part_sum += w;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous block's weights (and sg_part) are read
    w_block[tid] = w;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int nz = metal::min(NUM_THREADS, n_parts - z0);
    const int share = (nz + ZS - 1) / ZS;
    const int ys = ZS == 1 ? 0 : metal::min(nz, zs * share);
    const int ye = ZS == 1 ? nz : metal::min(nz, ys + share);
    for (int y = ys; y < ye; y += UNROLL_Z) {
      if (z0 + y > ys0) {  // the slice's first round was loaded above
        MA_REDUCE_LOAD_ROUND(z0, y, ye)
      }
      for (int j = 0; j < DPT; ++j) {
        for (int k = 0; k < UNROLL_Z; ++k) {
          o[j] += (y + k < ye ? w_block[y + k] : 0.0f) * t[j][k];
        }
      }
    }
  }
#undef MA_REDUCE_LOAD_ROUND
  // The slices' partial outputs, added in slice order by slice 0.
  if (ZS > 1) {
    if (zs > 0) {
      for (int j = 0; j < DPT; ++j) {
        const int d = dt + j * ST;
        if (DPT * ST == HEAD_SIZE || d < HEAD_SIZE) {
          slice_out[(zs - 1) * HEAD_SIZE + d] = o[j];
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (zs == 0) {
      for (int s = 1; s < ZS; ++s) {
        for (int j = 0; j < DPT; ++j) {
          const int d = dt + j * ST;
          if (DPT * ST == HEAD_SIZE || d < HEAD_SIZE) {
            o[j] += slice_out[(s - 1) * HEAD_SIZE + d];
          }
        }
      }
    }
  }
  // The total weight: the threads' sums, then the simdgroups' (sg_part is free again: every
  // thread read it before the first block's barriers).
  part_sum = simd_sum(part_sum);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) {
    sg_part[sg] = part_sum;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = use_sinks ? metal::exp2(sink - g_max) : 0.0f;
  for (int w = 0; w < NUM_SG; ++w) {
    total += sg_part[w];
  }
  const float inv = 1.0f / (total + MA_SOFTMAX_EPS);
  if (zs == 0) {
    for (int j = 0; j < DPT; ++j) {
      const int d = dt + j * ST;
      if (DPT * ST == HEAD_SIZE || d < HEAD_SIZE) {
        out_row[d] = ma_from_float<T>(o[j] * inv);
      }
    }
  }
}

// The split-KV reduction of HPS consecutive heads of one query row at once (the fused reducer's
// tail: one threadgroup reduces them all, so its dependent load rounds are what the call waits
// for). Threads are laid out ZT = NUM_THREADS / HPS per head, thread z of head h holding partition
// z's statistics, so the statistics take one round of loads and every (head, element) output its
// partitions' tmp_out loads issued together. Same arithmetic, in the same order, as
// ma_reduce_partials (maxima by butterflies, the total weight by the same butterfly and then the
// simdgroups' sums in order, the outputs summed over partitions in order), so the two agree bit for
// bit. Needs n_parts <= ZT (the caller falls back to ma_reduce_partials per head otherwise);
// `stats`: the first head's statistics row; `out_rows`: its output row (heads HEAD_SIZE apart,
// statistics max_parts apart); `sinks_log2`: the heads' sink logits in log2 space (read when
// use_sinks). Threadgroup scratch: red_w (NUM_THREADS floats), red_sg (NUM_THREADS / MA_SIMD_WIDTH),
// red_tot (HPS).
template <typename T, int HEAD_SIZE, int NUM_THREADS, int HPS, typename PF, typename PT, typename PO, typename PK,
          typename PS>
MA_FUNC void ma_reduce_partials_heads(PF max_logits, PF exp_sums, PT tmp_out, PO out_rows, int64_t stats, int max_parts,
                                      int n_parts, bool use_sinks, PK sinks, PS red_w, PS red_sg, PS red_tot, int tid) {
  constexpr int ZT = NUM_THREADS / HPS;                 // threads (partitions) per head
  constexpr int ZW = ZT < MA_SIMD_WIDTH ? ZT : MA_SIMD_WIDTH;  // butterfly width
  constexpr int SG_PER_HEAD = ZT / ZW;
  constexpr int PAIRS = (HPS * HEAD_SIZE + NUM_THREADS - 1) / NUM_THREADS;  // outputs per thread
  constexpr int UNROLL_Z = PAIRS >= 16 ? 2 : PAIRS >= 8 ? 4 : 8;  // loads in flight, not the order
  static_assert(NUM_THREADS % HPS == 0 && (ZT & (ZT - 1)) == 0, "a power-of-two thread block per head");
  const int h1 = tid / ZT;
  const int z1 = tid % ZT;
  const int sg = tid / MA_SIMD_WIDTH;
  const int64_t at = stats + int64_t(h1) * max_parts + z1;
  const bool live = z1 < n_parts;
  const float m = live ? ma_partial_reader<true>::read(&max_logits[at]) : MA_NEG_FLT_MAX;
  const float e = live ? ma_partial_reader<true>::read(&exp_sums[at]) : 0.0f;
  float g_max = m;
  for (int x = ZW / 2; x > 0; x >>= 1) {
    g_max = metal::max(g_max, simd_shuffle_xor(g_max, ushort(x)));
  }
  if (SG_PER_HEAD > 1) {
    if (tid % MA_SIMD_WIDTH == 0) {
      red_sg[sg] = g_max;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int w = 0; w < SG_PER_HEAD; ++w) {
      g_max = metal::max(g_max, red_sg[h1 * SG_PER_HEAD + w]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // red_sg is reused below
  }
  const float sink = use_sinks ? ma_sink_log2(sinks[h1]) : MA_NEG_FLT_MAX;
  if (use_sinks) {
    g_max = metal::max(g_max, sink);
  }
  const float w = live ? e * ma_rescale(m, g_max) : 0.0f;
  red_w[tid] = w;
  float part = w;
  for (int x = ZW / 2; x > 0; x >>= 1) {
    part += simd_shuffle_xor(part, ushort(x));
  }
  float total = use_sinks ? metal::exp2(sink - g_max) : 0.0f;
  if (SG_PER_HEAD > 1) {
    if (tid % MA_SIMD_WIDTH == 0) {
      red_sg[sg] = part;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int s = 0; s < SG_PER_HEAD; ++s) {
      total += red_sg[h1 * SG_PER_HEAD + s];
    }
  } else {
    total += part;
  }
  if (z1 == 0) {
    red_tot[h1] = total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float o[PAIRS];
  for (int k = 0; k < PAIRS; ++k) {
    o[k] = 0.0f;
  }
  for (int z0 = 0; z0 < n_parts; z0 += UNROLL_Z) {
    float t[PAIRS][UNROLL_Z];
    for (int k = 0; k < PAIRS; ++k) {
      const int i = tid + k * NUM_THREADS;
      const int h = i / HEAD_SIZE;
      const int d = i % HEAD_SIZE;
      for (int u = 0; u < UNROLL_Z; ++u) {
        t[k][u] = i < HPS * HEAD_SIZE && z0 + u < n_parts
                      ? ma_partial_reader<true>::read(&tmp_out[(stats + int64_t(h) * max_parts + z0 + u) * HEAD_SIZE + d])
                      : 0.0f;
      }
    }
    for (int k = 0; k < PAIRS; ++k) {
      const int h = (tid + k * NUM_THREADS) / HEAD_SIZE;
      for (int u = 0; u < UNROLL_Z; ++u) {
        o[k] += (z0 + u < n_parts && h < HPS ? red_w[h * ZT + z0 + u] : 0.0f) * t[k][u];
      }
    }
  }
  for (int k = 0; k < PAIRS; ++k) {
    const int i = tid + k * NUM_THREADS;
    if (i < HPS * HEAD_SIZE) {
      const int h = i / HEAD_SIZE;
      const float inv = 1.0f / (red_tot[h] + MA_SOFTMAX_EPS);
      out_rows[int64_t(h) * HEAD_SIZE + i % HEAD_SIZE] = ma_from_float<T>(o[k] * inv);
    }
  }
}
