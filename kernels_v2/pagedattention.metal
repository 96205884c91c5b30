// metal-attn: the classic per-token paged-attention kernel and the split-KV reducer.
// Two kernel bodies, one per `// @kernel NAME` section; MLX writes the signatures.
// Generated defines (from metal_attn/constants.py via metal_attn/kernels.py):
//   MA_LOG2E, MA_NEG_FLT_MAX, MA_SOFTMAX_EPS, MA_SIMD_WIDTH, and per variant PA_SPLIT.

// @kernel paged_attention
// One threadgroup per (group of NUM_THREADS/32 consecutive query heads, query row, partition);
// one simdgroup per query head, so the heads of a GQA group read the same K/V rows together
// (served from L1/the cache, not re-read from memory). No threadgroup memory, no barriers.
// Inputs : q [T, H, D], k_cache/v_cache [NB, BS, KVH, D], block_tables [S, MB] int32,
//          seq_lens [S] int32, cu_seqlens_q [S+1] int32, sinks [H] float32,
//          params int32 [num_seqs, num_heads, num_kv_heads, max_blocks, window, max_parts, use_sinks],
//          fparams float32 [score_scale, softcap]
// Outputs: PA_SPLIT == 0: out [T, H, D] (T dtype)
//          PA_SPLIT == 1: max_logits [T, H, P], exp_sums [T, H, P], tmp_out [T, H, P, D] (float32)
// Template: T, HEAD_SIZE, BLOCK_SIZE, PARTITION_SIZE, NUM_THREADS, TPT (lanes per token), UNROLL,
//           PREFETCH (request the next iteration's rows into L2; CUDA only, a no-op on Metal).
// Each iteration issues all its K/V loads (packed) before any arithmetic and reads the
// next iteration's page ids, so the block-table read is off the critical path.
constexpr int HEADS_PER_GROUP = NUM_THREADS / MA_SIMD_WIDTH;
constexpr int NV = HEAD_SIZE / (4 * TPT);    // 4-element vectors per lane
constexpr int E = 4 * NV;                    // head elements per lane
constexpr int TPP = MA_SIMD_WIDTH / TPT;     // tokens per simdgroup pass
constexpr int STEP = TPP * UNROLL;           // tokens per simdgroup iteration
// L2 prefetch of the next iteration's rows (PREFETCH = 1; a no-op on Metal): 128-byte lines per row.
constexpr int LINE_ELEMS = 128 / int(sizeof(T));
constexpr int ROW_LINES = HEAD_SIZE / LINE_ELEMS > 0 ? HEAD_SIZE / LINE_ELEMS : 1;

const int num_seqs = params[0];
const int num_heads = params[1];
const int num_kv_heads = params[2];
const int max_blocks = params[3];
const int window = params[4];
const int max_parts = params[5];
const int use_sinks = params[6];
const float score_scale = fparams[0];
const float softcap = fparams[1];

const int lane = int(thread_index_in_simdgroup);
const int head = int(threadgroup_position_in_grid.x) * HEADS_PER_GROUP + int(simdgroup_index_in_threadgroup);
const int qtok = int(threadgroup_position_in_grid.y);
const int part = int(threadgroup_position_in_grid.z);
if (head >= num_heads) {
  return;  // a whole simdgroup: the last group of heads may be partial
}

// The sequence of this query row: last s with cu_seqlens_q[s] <= qtok.
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
const int seq = lo;
const int q_start = cu_seqlens_q[seq];
const int q_len = cu_seqlens_q[seq + 1] - q_start;
// Causal rule: row i attends to [0, seq_len - q_len + i + 1).
const int ctx = seq_lens[seq] - q_len + (qtok - q_start) + 1;
const int win_start = window > 0 ? metal::max(ctx - window, 0) : 0;
const int kv_head = head / (num_heads / num_kv_heads);
const int64_t row_head = int64_t(qtok) * num_heads + head;

#if PA_SPLIT
const int p_start = part * PARTITION_SIZE;
if (p_start >= ctx) {
  return;  // past the row: nothing written, the reducer never reads it
}
const int p_end = metal::min(p_start + PARTITION_SIZE, ctx);
const int64_t stat_idx = row_head * max_parts + part;
if (p_end <= win_start) {
  // Entirely left of the sliding window: a neutral partial.
  if (lane == 0) {
    max_logits[stat_idx] = MA_NEG_FLT_MAX;
    exp_sums[stat_idx] = 0.0f;
  }
  for (int d = lane; d < HEAD_SIZE; d += MA_SIMD_WIDTH) {
    tmp_out[stat_idx * HEAD_SIZE + d] = 0.0f;
  }
  return;
}
const int t_begin = metal::max(p_start, win_start);
const int t_end = p_end;
#else
const int t_begin = win_start;
const int t_end = ctx;
#endif

// This lane's slice of the head: vectors (sl + TPT * j), j < NV, of 4 elements.
const int sub = lane / TPT;
const int sl = lane % TPT;
float q_reg[E];
const int64_t q_off = row_head * HEAD_SIZE;
for (int j = 0; j < NV; ++j) {
  ma_load4(q + q_off + (sl + TPT * j) * 4, q_reg + 4 * j);
}

float m = MA_NEG_FLT_MAX;
float l = 0.0f;
float acc[E];
for (int e = 0; e < E; ++e) {
  acc[e] = 0.0f;
}

const int64_t tok_stride = int64_t(num_kv_heads) * HEAD_SIZE;
const int64_t head_off = int64_t(kv_head) * HEAD_SIZE;
const int bt_row = seq * max_blocks;

// Page ids one iteration ahead: blk[u] is the page of token base + u * TPP + sub.
int blk[UNROLL];
for (int u = 0; u < UNROLL; ++u) {
  const int tok = t_begin + u * TPP + sub;
  blk[u] = tok < t_end ? block_tables[bt_row + tok / BLOCK_SIZE] : 0;
}

for (int base = t_begin; base < t_end; base += STEP) {
  // Every K/V load of the iteration first (packed registers), then the next ids.
  ma_raw4<T> kraw[UNROLL][NV];
  ma_raw4<T> vraw[UNROLL][NV];
  bool ok[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int tok = base + u * TPP + sub;
    ok[u] = tok < t_end;
    if (ok[u]) {
      const int64_t addr = (int64_t(blk[u]) * BLOCK_SIZE + tok % BLOCK_SIZE) * tok_stride + head_off;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        kraw[u][j] = ma_load_raw4(k_cache + addr + (sl + TPT * j) * 4);
        vraw[u][j] = ma_load_raw4(v_cache + addr + (sl + TPT * j) * 4);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int tok = base + STEP + u * TPP + sub;
    blk[u] = tok < t_end ? block_tables[bt_row + tok / BLOCK_SIZE] : 0;
    if (PREFETCH && tok < t_end) {
      // The TPT lanes of a token share its K and V rows' 128-byte lines.
      const int64_t addr = (int64_t(blk[u]) * BLOCK_SIZE + tok % BLOCK_SIZE) * tok_stride + head_off;
      for (int i = sl; i < 2 * ROW_LINES; i += TPT) {
        const int64_t off = addr + (i % ROW_LINES) * LINE_ELEMS;
        if (i < ROW_LINES) {
          ma_prefetch(k_cache + off);
        } else {
          ma_prefetch(v_cache + off);
        }
      }
    }
  }
  float s[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    s[u] = 0.0f;
    if (ok[u]) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        float kr[4];
        ma_unpack4(kraw[u][j], kr);
        for (int c = 0; c < 4; ++c) {
          s[u] += q_reg[4 * j + c] * kr[c];
        }
      }
    }
  }
  // Reduce each token's partial dot over its TPT lanes (all 32 lanes take part).
  for (int u = 0; u < UNROLL; ++u) {
    for (int o = TPT / 2; o > 0; o >>= 1) {
      s[u] += simd_shuffle_xor(s[u], ushort(o));
    }
  }
  float m_new = m;
  for (int u = 0; u < UNROLL; ++u) {
    s[u] = ok[u] ? ma_score(s[u], score_scale, softcap) : MA_NEG_FLT_MAX;
    m_new = metal::max(m_new, s[u]);
  }
  if (m_new > m) {
    // Rescale only when the running max grows (alpha would be exactly 1 otherwise):
    // after the first tokens of a row this is rare, and it saves E multiplies a step.
    const float alpha = ma_rescale(m, m_new);
    l *= alpha;
    for (int e = 0; e < E; ++e) {
      acc[e] *= alpha;
    }
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    if (ok[u]) {
      const float p = metal::exp2(s[u] - m_new);
      l += p;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        float vr[4];
        ma_unpack4(vraw[u][j], vr);
        for (int c = 0; c < 4; ++c) {
          acc[4 * j + c] += p * vr[c];
        }
      }
    }
  }
  m = m_new;
}

// Merge the simdgroup's token slots (lanes sl, sl + TPT, ... hold the same slice);
// after the butterfly every slot holds the merged state.
for (int o = TPT; o < MA_SIMD_WIDTH; o <<= 1) {
  const float m_o = simd_shuffle_xor(m, ushort(o));
  const float l_o = simd_shuffle_xor(l, ushort(o));
  const float m_n = metal::max(m, m_o);
  const float a = ma_rescale(m, m_n);
  const float b = ma_rescale(m_o, m_n);
  l = l * a + l_o * b;
  for (int e = 0; e < E; ++e) {
    acc[e] = acc[e] * a + simd_shuffle_xor(acc[e], ushort(o)) * b;
  }
  m = m_n;
}

#if PA_SPLIT
if (lane == 0) {
  max_logits[stat_idx] = m;
  exp_sums[stat_idx] = l;
}
const float inv = 1.0f / (l + MA_SOFTMAX_EPS);
if (sub == 0) {
  for (int j = 0; j < NV; ++j) {
    for (int c = 0; c < 4; ++c) {
      tmp_out[stat_idx * HEAD_SIZE + (sl + TPT * j) * 4 + c] = acc[4 * j + c] * inv;
    }
  }
}
#else
// Sinks are folded once per row, here (no value row).
float fold = 1.0f;
if (use_sinks) {
  const float sink = sinks[head] * MA_LOG2E;
  const float m_s = metal::max(m, sink);
  fold = ma_rescale(m, m_s);
  l = l * fold + metal::exp2(sink - m_s);
}
const float inv = fold / (l + MA_SOFTMAX_EPS);
if (sub == 0) {
  for (int j = 0; j < NV; ++j) {
    for (int c = 0; c < 4; ++c) {
      out[q_off + (sl + TPT * j) * 4 + c] = ma_from_float<T>(acc[4 * j + c] * inv);
    }
  }
}
#endif

// @kernel paged_attention_v2_reduce
// The split-KV reducer, shared by every kernel that writes the split contract:
// max_logits (log2 space), exp_sums (un-normalised) and tmp_out (divided by
// exp_sums + eps) per (query row, head, partition); neutral partials carry
// max = -FLT_MAX, sum = 0. Sinks are folded once, here.
// One threadgroup per (query head, query row); NUM_THREADS threads.
// Inputs : max_logits [T, H, P] f32, exp_sums [T, H, P] f32, tmp_out [T, H, P, D] (TT),
//          seq_lens [S] int32, cu_seqlens_q [S+1] int32, sinks [H] f32,
//          params int32 [num_seqs, num_heads, max_parts, use_sinks]
// Outputs: out [T, H, D] (T)
// Template: T, TT, HEAD_SIZE, PARTITION_SIZE, NUM_THREADS.
const int num_seqs = params[0];
const int num_heads = params[1];
const int max_parts = params[2];
const int use_sinks = params[3];
const int head = int(threadgroup_position_in_grid.x);
const int qtok = int(threadgroup_position_in_grid.y);
const int tid = int(thread_position_in_threadgroup.x);
if (head >= num_heads) {
  return;
}
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
const int q_start = cu_seqlens_q[lo];
const int q_len = cu_seqlens_q[lo + 1] - q_start;
const int ctx = seq_lens[lo] - q_len + (qtok - q_start) + 1;
const int n_parts = (ctx + PARTITION_SIZE - 1) / PARTITION_SIZE;
const int64_t base = (int64_t(qtok) * num_heads + head) * max_parts;

float g_max = MA_NEG_FLT_MAX;
for (int z = 0; z < n_parts; ++z) {
  g_max = metal::max(g_max, max_logits[base + z]);
}
float sink = MA_NEG_FLT_MAX;
if (use_sinks) {
  sink = sinks[head] * MA_LOG2E;
  g_max = metal::max(g_max, sink);
}
float total = use_sinks ? metal::exp2(sink - g_max) : 0.0f;
for (int z = 0; z < n_parts; ++z) {
  total += exp_sums[base + z] * ma_rescale(max_logits[base + z], g_max);
}
const float inv = 1.0f / (total + MA_SOFTMAX_EPS);
for (int d = tid; d < HEAD_SIZE; d += NUM_THREADS) {
  float o = 0.0f;
  for (int z = 0; z < n_parts; ++z) {
    const float w = exp_sums[base + z] * ma_rescale(max_logits[base + z], g_max);
    o += w * ma_to_float(tmp_out[(base + z) * HEAD_SIZE + d]);
  }
  out[(int64_t(qtok) * num_heads + head) * HEAD_SIZE + d] = ma_from_float<T>(o * inv);
}
