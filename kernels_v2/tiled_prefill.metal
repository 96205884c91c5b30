// metal-attn: the tiled FlashAttention-2 prefill kernel over a paged KV cache.
// Generated defines (from metal_attn/constants.py via metal_attn/kernels.py):
//   MA_LOG2E, MA_NEG_FLT_MAX, MA_SOFTMAX_EPS, MA_SIMD_WIDTH.

// @kernel tiled_prefill
// One threadgroup per (tile of BQ query rows of one sequence, query head); simdgroup s
// owns rows [8s, 8s + 8) of the tile and keeps its Q rows, scores S, output O and the
// softmax state (m, l) in registers as 8x8 fragments (ma_frag8: two elements a lane).
// The threadgroup walks the keys the tile needs BKV at a time: it gathers the K and V rows
// through the block table into threadgroup memory (pages are scattered: row by row, zeros
// past the end), then each simdgroup computes S = Q K^T with 8x8 matrix products, the
// online softmax in log2 space (a row's maximum and sum reduced over the four lanes that
// hold it), and O += P V with P in float. Causal rule per row as in the per-token kernel;
// tiles left of a sliding window are never loaded, and a simdgroup skips the arithmetic
// of tiles that lie entirely outside its rows' windows.
// Inputs : q [T, H, D], k_cache/v_cache [NB, BS, KVH, D], block_tables [S, MB] int32,
//          seq_lens [S] int32, cu_seqlens_q [S+1] int32,
//          tiles [N, 2] int32 (sequence, first query row of the tile within it),
//          sinks [H] float32,
//          params int32 [num_tiles, num_heads, num_kv_heads, max_blocks, window, use_sinks],
//          fparams float32 [score_scale, softcap]
// Outputs: out [T, H, D] (T dtype); rows of sequences without tiles are not written.
// Template: T (float16 / bfloat16), HEAD_SIZE (multiple of 8), BLOCK_SIZE, BQ (8 x simdgroups),
//           BKV (multiple of 8).
constexpr int NUM_SG = BQ / 8;
constexpr int NUM_THREADS = NUM_SG * MA_SIMD_WIDTH;
constexpr int D8 = HEAD_SIZE / 8;  // 8-column fragments across the head
constexpr int K8 = BKV / 8;        // 8-key fragments across a KV tile
constexpr int LD = HEAD_SIZE + 8;  // padded tile row (elements): spreads fragment reads over banks
constexpr int V4 = HEAD_SIZE / 4;  // 4-element chunks per K/V row

const int num_tiles = params[0];
const int num_heads = params[1];
const int num_kv_heads = params[2];
const int max_blocks = params[3];
const int window = params[4];
const int use_sinks = params[5];
const float score_scale = fparams[0];
const float softcap = fparams[1];

const int tile = int(threadgroup_position_in_grid.x);
const int head = int(threadgroup_position_in_grid.y);
// Both exits depend on the threadgroup only: all of its threads leave together.
if (tile >= num_tiles || head >= num_heads) {
  return;
}
const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int tid = int(thread_position_in_threadgroup.x);

const int seq = tiles[2 * tile];
const int row0 = tiles[2 * tile + 1];
const int q_start = cu_seqlens_q[seq];
const int q_len = cu_seqlens_q[seq + 1] - q_start;
// Causal rule: row i of the chunk attends to [0, ctx0 + i + 1).
const int ctx0 = seq_lens[seq] - q_len;
const int kv_head = head / (num_heads / num_kv_heads);
const int tile_rows = metal::min(BQ, q_len - row0);
// Keys the whole tile needs: up to its last row's causal end, from its first row's
// window start (aligned down to a KV tile).
const int kv_end = ctx0 + row0 + tile_rows;
const int kv_lo = window > 0 ? metal::max(ctx0 + row0 + 1 - window, 0) : 0;
const int kv_begin = (kv_lo / BKV) * BKV;

// This simdgroup's rows: [sg_row0, sg_row0 + 8) of the sequence (some may be past the end).
const int sg_row0 = row0 + sg * 8;
const int sg_rows = metal::max(metal::min(8, q_len - sg_row0), 0);
const int sg_kv_end = ctx0 + sg_row0 + sg_rows;  // exclusive, for its last row
const int sg_kv_lo = window > 0 ? metal::max(ctx0 + sg_row0 + 1 - window, 0) : 0;

// This lane's fragment row and first column.
const int fr = ma_frag_row(lane);
const int fc = ma_frag_col(lane);
const int my_row = sg_row0 + fr;
const bool row_ok = fr < sg_rows;
const int my_end = ctx0 + my_row + 1;
const int my_lo = window > 0 ? metal::max(my_end - window, 0) : 0;
const int64_t q_off = (int64_t(q_start + my_row) * num_heads + head) * HEAD_SIZE;

ma_frag8 qf[D8];
ma_frag8 o[D8];
for (int d = 0; d < D8; ++d) {
  for (int i = 0; i < 2; ++i) {
    qf[d].v[i] = row_ok ? ma_to_float(q[q_off + d * 8 + fc + i]) : 0.0f;
    o[d].v[i] = 0.0f;
  }
}
float m = MA_NEG_FLT_MAX;
float l = 0.0f;

threadgroup T k_tile[BKV * LD];
threadgroup T v_tile[BKV * LD];
const int64_t tok_stride = int64_t(num_kv_heads) * HEAD_SIZE;
const int64_t head_off = int64_t(kv_head) * HEAD_SIZE;
const int bt_row = seq * max_blocks;

for (int kt = kv_begin; kt < kv_end; kt += BKV) {
  threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with the last tile
  for (int c = tid; c < BKV * V4; c += NUM_THREADS) {
    const int t = c / V4;
    const int e = (c % V4) * 4;
    const int key = kt + t;
    if (key < kv_end) {
      const int64_t addr =
          (int64_t(block_tables[bt_row + key / BLOCK_SIZE]) * BLOCK_SIZE + key % BLOCK_SIZE) * tok_stride +
          head_off + e;
      ma_tg_store4(k_tile + t * LD + e, ma_load_raw4(k_cache + addr));
      ma_tg_store4(v_tile + t * LD + e, ma_load_raw4(v_cache + addr));
    } else {
      // Past the tile's keys: zeros, so that masked products stay finite.
      for (int x = 0; x < 4; ++x) {
        k_tile[t * LD + e + x] = ma_from_float<T>(0.0f);
        v_tile[t * LD + e + x] = ma_from_float<T>(0.0f);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Tiles past this simdgroup's last causal key or left of its first row's window hold
  // nothing for its rows (uniform per simdgroup: no divergence inside a product).
  if (sg_rows == 0 || kt >= sg_kv_end || kt + BKV <= sg_kv_lo) {
    continue;
  }

  // S = Q K^T: the right operand is K^T, read transposed from the row-major K tile.
  ma_frag8 s[K8];
  for (int j = 0; j < K8; ++j) {
    s[j].v[0] = 0.0f;
    s[j].v[1] = 0.0f;
    for (int d = 0; d < D8; ++d) {
      ma_frag8 kb;
      for (int i = 0; i < 2; ++i) {
        kb.v[i] = ma_to_float(k_tile[(j * 8 + ma_frag_bn(lane, i)) * LD + d * 8 + ma_frag_bk(lane, i)]);
      }
      ma_mma<T>(s[j], qf[d], kb);
    }
  }

  // Online softmax over this tile, in log2 space.
  float tile_max = MA_NEG_FLT_MAX;
  for (int j = 0; j < K8; ++j) {
    for (int i = 0; i < 2; ++i) {
      const int key = kt + j * 8 + fc + i;
      const bool ok = row_ok && key < my_end && key >= my_lo;
      s[j].v[i] = ok ? ma_score(s[j].v[i], score_scale, softcap) : MA_NEG_FLT_MAX;
      tile_max = metal::max(tile_max, s[j].v[i]);
    }
  }
  const float m_new = metal::max(m, ma_frag_row_max(tile_max));
  float row_sum = 0.0f;
  for (int j = 0; j < K8; ++j) {
    for (int i = 0; i < 2; ++i) {
      const int key = kt + j * 8 + fc + i;
      const bool ok = row_ok && key < my_end && key >= my_lo;
      s[j].v[i] = ok ? metal::exp2(s[j].v[i] - m_new) : 0.0f;
      row_sum += s[j].v[i];
    }
  }
  const float alpha = ma_rescale(m, m_new);
  l = l * alpha + ma_frag_row_sum(row_sum);
  m = m_new;

  // O = alpha * O + P V (P, now in s, in float).
  for (int d = 0; d < D8; ++d) {
    o[d].v[0] *= alpha;
    o[d].v[1] *= alpha;
    for (int j = 0; j < K8; ++j) {
      ma_frag8 vb;
      for (int i = 0; i < 2; ++i) {
        vb.v[i] = ma_to_float(v_tile[(j * 8 + ma_frag_bk(lane, i)) * LD + d * 8 + ma_frag_bn(lane, i)]);
      }
      ma_mma_f<T>(o[d], s[j], vb);
    }
  }
}

if (row_ok) {
  // Sinks are folded once per row, here (no value row), as in the per-token kernel.
  float fold = 1.0f;
  float total = l;
  if (use_sinks) {
    const float sink = sinks[head] * MA_LOG2E;
    const float m_s = metal::max(m, sink);
    fold = ma_rescale(m, m_s);
    total = l * fold + metal::exp2(sink - m_s);
  }
  for (int d = 0; d < D8; ++d) {
    for (int i = 0; i < 2; ++i) {
      out[q_off + d * 8 + fc + i] = ma_from_float<T>(o[d].v[i] * fold / (total + MA_SOFTMAX_EPS));
    }
  }
}
