// metal-attn: the tiled FlashAttention-2 prefill kernel over a paged KV cache.
// Generated defines (from metal_attn/constants.py via metal_attn/kernels.py):
//   MA_LOG2E, MA_NEG_FLT_MAX, MA_SOFTMAX_EPS, MA_SIMD_WIDTH.

// @kernel tiled_prefill
// One threadgroup per (tile of BQ query rows of one sequence, query head); each simdgroup
// owns RB consecutive 8-row blocks of the tile and keeps their Q rows, scores S, output O
// and softmax states (m, l) in registers as 8x8 fragments (ma_frag8: two elements a lane);
// with RB = 2 the two blocks share every right operand (one whole 16-row tensor-core
// product on CUDA).
// The threadgroup walks the keys the tile needs BKV at a time: it gathers the K and V rows
// through the block table into threadgroup memory (pages are scattered: row by row, zeros
// past the end), then each simdgroup computes S = Q K^T with 8x8 matrix products, the
// online softmax in log2 space (a row's maximum and sum reduced over the four lanes that
// hold it), and O += P V with P in float. Sinks initialise each row's state (its logit the first
// maximum, its weight 1), as in the NAX kernel, so the two walk a row in the same order of
// operations and differ by the tensor ops' rounding only. Causal rule per row as in the per-token kernel;
// tiles left of a sliding window are never loaded, and a simdgroup skips the arithmetic
// of tiles that lie entirely outside its rows' windows. Non-finite values follow the NaN
// contract (docs/providers.md): a non-finite q or K element gives a NaN score (ma_score); on a
// tile where some row of the tile does not attend every key, a non-finite V element is replaced
// by 0 and its key's K elements by NaN, so the rows attending that key get a NaN score and the
// others, whose masked scores are replaced, nothing (the V row would reach them as 0 * NaN).
// Split-KV (TP_SPLIT): the grid's z is a partition of PARTITION_SIZE keys; each threadgroup walks
// the tile's keys inside its partition only and writes the split contract's partials for every row
// of the tile that reads the partition (the per-token kernel's, reduced by
// paged_attention_v2_reduce): its maximum m (log2 space), its sum l relative to m, and O / (l + eps);
// a row none of whose keys lie in the partition (a window) writes the neutral (-FLT_MAX, 0, 0). The
// reducer folds the sinks, so a split launch passes use_sinks = 0. It puts more threadgroups on short
// chunks after long context (one 128-row tile per head is 32 threadgroups at 32 heads).
// Inputs : q [T, H, D], k_cache/v_cache [NB, BS, KVH, D], block_tables [S, MB] int32,
//          seq_lens [S] int32, cu_seqlens_q [S+1] int32,
//          tiles [N, 2] int32 (sequence, first query row of the tile within it),
//          sinks [H] float32,
//          params int32 [num_tiles, num_heads, num_kv_heads, max_blocks, window, use_sinks, max_parts],
//          fparams float32 [score_scale, softcap]
// Outputs: out [T, H, D] (T dtype); rows of sequences without tiles are not written.
//          TP_SPLIT: max_logits, exp_sums [T, H, max_parts] f32, tmp_out [T, H, max_parts, D] f32
//          (entries of partitions past a row's causal end are not written; the reducer reads none).
// Template: T (float16 / bfloat16), HEAD_SIZE (multiple of 32), BLOCK_SIZE, BQ (8 * RB * simdgroups),
//           BKV (multiple of 16), RB (8-row blocks per simdgroup: 1 or 2);
//           TP_SPLIT: PARTITION_SIZE (a multiple of BKV, so that no KV tile straddles two partitions).
constexpr int NUM_SG = BQ / (8 * RB);
constexpr int NUM_THREADS = NUM_SG * MA_SIMD_WIDTH;
constexpr int SG_ROWS = 8 * RB;    // query rows per simdgroup
constexpr int D8 = HEAD_SIZE / 8;  // 8-column fragments across the head
constexpr int K8 = BKV / 8;        // 8-key fragments across a KV tile
constexpr int LD = HEAD_SIZE + 8;  // padded tile row (elements): spreads fragment reads over banks
constexpr int V4 = HEAD_SIZE / 4;  // 4-element chunks per K/V row
constexpr int CH = (BKV * V4 + NUM_THREADS - 1) / NUM_THREADS;  // chunks of a tile per thread

const int num_tiles = params[0];
const int num_heads = params[1];
const int num_kv_heads = params[2];
const int max_blocks = params[3];
const int window = params[4];
const int use_sinks = params[5];
#if TP_SPLIT
const int max_parts = params[6];
#endif
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
const int kv_lo = window > 0 ? metal::max(ctx0 + row0 + 1 - window, 0) : 0;
#if TP_SPLIT
// This threadgroup's partition: the tile's keys inside [part_lo, part_lo + PARTITION_SIZE). No row of
// the tile reads a partition from the tile's last causal key on (uniform: the whole threadgroup leaves).
const int part = int(threadgroup_position_in_grid.z);
const int part_lo = part * PARTITION_SIZE;
if (part_lo >= ctx0 + row0 + tile_rows) {
  return;
}
const int kv_end = metal::min(ctx0 + row0 + tile_rows, part_lo + PARTITION_SIZE);
const int kv_begin = metal::max((kv_lo / BKV) * BKV, part_lo);
#else
const int kv_end = ctx0 + row0 + tile_rows;
const int kv_begin = (kv_lo / BKV) * BKV;
#endif

// This simdgroup's rows: [sg_row0, sg_row0 + SG_ROWS) of the sequence (some may be past the end).
const int sg_row0 = row0 + sg * SG_ROWS;
const int sg_rows = metal::max(metal::min(SG_ROWS, q_len - sg_row0), 0);
const int sg_kv_end = ctx0 + sg_row0 + sg_rows;  // exclusive, for its last row
const int sg_kv_lo = window > 0 ? metal::max(ctx0 + sg_row0 + 1 - window, 0) : 0;
// Keys every row of the simdgroup sees (a tile inside [full_lo, full_end) needs no mask).
const int full_end = ctx0 + sg_row0 + 1;
const int full_lo = window > 0 ? metal::max(ctx0 + sg_row0 + SG_ROWS - window, 0) : 0;

// This lane's fragment row and first column, in each of its RB row blocks.
const int fr = ma_frag_row(lane);
const int fc = ma_frag_col(lane);
bool row_ok[RB];
int my_end[RB];
int my_lo[RB];
int64_t q_off[RB];
ma_opnd<T> qf[RB][D8];  // Q as left operands, loaded once
ma_frag8 o[RB][D8];
float m[RB];
float l[RB];
#pragma unroll
for (int b = 0; b < RB; ++b) {
  const int row = sg_row0 + b * 8 + fr;
  row_ok[b] = b * 8 + fr < sg_rows;
  my_end[b] = ctx0 + row + 1;
  my_lo[b] = window > 0 ? metal::max(my_end[b] - window, 0) : 0;
  q_off[b] = (int64_t(q_start + row) * num_heads + head) * HEAD_SIZE;
  // Sinks initialise the state (the NAX kernel's order): the sink's logit is the first maximum,
  // its weight 1, and it counts once per row (each row's state lives in one simdgroup).
  m[b] = use_sinks ? ma_sink_log2(sinks[head]) : MA_NEG_FLT_MAX;
  l[b] = use_sinks ? 1.0f : 0.0f;
#pragma unroll
  for (int d = 0; d < D8; ++d) {
    const float q0 = row_ok[b] ? ma_to_float(q[q_off[b] + d * 8 + fc]) : 0.0f;
    const float q1 = row_ok[b] ? ma_to_float(q[q_off[b] + d * 8 + fc + 1]) : 0.0f;
    qf[b][d] = ma_opnd_pack<T>(q0, q1);
    o[b][d].v[0] = 0.0f;
    o[b][d].v[1] = 0.0f;
  }
}

threadgroup T k_tile[BKV * LD];
#if TP_KV_SERIAL
#define v_tile k_tile  // one buffer: K, then V (see the staging below)
#else
threadgroup T v_tile[BKV * LD];
#endif
// Keys from which every row of the tile is inside its window (the last row's window start).
const int tile_full_lo = window > 0 ? metal::max(ctx0 + row0 + tile_rows - window, 0) : 0;
const int64_t tok_stride = int64_t(num_kv_heads) * HEAD_SIZE;
const int64_t head_off = int64_t(kv_head) * HEAD_SIZE;
const int bt_row = seq * max_blocks;

for (int kt = kv_begin; kt < kv_end; kt += BKV) {
#if TP_KV_SERIAL
  // One buffer for the tile's K rows, then its V rows (TP_KV_SERIAL: heads whose K and V tiles do
  // not fit in threadgroup memory together walk the same BKV-key tiles, so the softmax moves its
  // maximum at the same keys). Once every simdgroup is done with the last tile's V, each thread
  // copies some 4-element chunks of K straight from the pool (zeros past the tile's keys). The NaN
  // contract as below: unless every row of the tile attends every key of this tile, a chunk whose
  // V chunk is not finite is stored as NaN in K (and as 0 in V, after the scores).
  const bool some_masked = !(kt + BKV <= ctx0 + row0 + 1 && kt >= tile_full_lo);
  threadgroup_barrier(mem_flags::mem_threadgroup);
#pragma unroll 1
  for (int c = tid; c < BKV * V4; c += NUM_THREADS) {
    const int t = c / V4;
    const int e = (c % V4) * 4;
    if (kt + t < kv_end) {
      const int key = kt + t;
      const int64_t addr = (int64_t(block_tables[bt_row + key / BLOCK_SIZE]) * BLOCK_SIZE + key % BLOCK_SIZE) *
                               tok_stride + head_off + e;
      ma_tg_store4(k_tile + t * LD + e, ma_load_raw4(k_cache + addr));
      if (some_masked && !(ma_isfinite(ma_to_float(v_cache[addr])) && ma_isfinite(ma_to_float(v_cache[addr + 1])) &&
                           ma_isfinite(ma_to_float(v_cache[addr + 2])) && ma_isfinite(ma_to_float(v_cache[addr + 3])))) {
        for (int z = 0; z < 4; ++z) {
          k_tile[t * LD + e + z] = ma_from_float<T>(ma_nan());
        }
      }
    } else {
      for (int z = 0; z < 4; ++z) {
        k_tile[t * LD + e + z] = ma_from_float<T>(0.0f);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
#else
  // This tile's K/V rows into registers (CH 4-element chunks of K and of V per thread),
  // then, once every simdgroup is done with the last tile, into threadgroup memory.
  ma_raw4<T> k_reg[CH];
  ma_raw4<T> v_reg[CH];
#pragma unroll
  for (int x = 0; x < CH; ++x) {
    const int c = tid + x * NUM_THREADS;
    const int key = kt + c / V4;
    if (c < BKV * V4 && key < kv_end) {
      const int64_t addr = (int64_t(block_tables[bt_row + key / BLOCK_SIZE]) * BLOCK_SIZE + key % BLOCK_SIZE) *
                               tok_stride + head_off + (c % V4) * 4;
      k_reg[x] = ma_load_raw4(k_cache + addr);
      v_reg[x] = ma_load_raw4(v_cache + addr);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
#pragma unroll
  for (int x = 0; x < CH; ++x) {
    const int c = tid + x * NUM_THREADS;
    if (c < BKV * V4) {
      const int t = c / V4;
      const int e = (c % V4) * 4;
      if (kt + t < kv_end) {
        ma_tg_store4(k_tile + t * LD + e, k_reg[x]);
        ma_tg_store4(v_tile + t * LD + e, v_reg[x]);
      } else {
        // Past the tile's keys: zeros, so that masked products stay finite.
        for (int z = 0; z < 4; ++z) {
          k_tile[t * LD + e + z] = ma_from_float<T>(0.0f);
          v_tile[t * LD + e + z] = ma_from_float<T>(0.0f);
        }
      }
    }
  }
  // Unless every row of the tile attends every key of this tile (uniform over the threadgroup;
  // then a non-finite V element reaches them all through the product itself), each thread
  // re-reads the V chunks it just stored: a non-finite one becomes 0 and the key's K chunk NaN.
  if (!(kt + BKV <= ctx0 + row0 + 1 && kt >= tile_full_lo)) {
    // (Keys past the tile's end hold zeros: finite, so no bound check is needed.)
#pragma unroll 1
    for (int c = tid; c < BKV * V4; c += NUM_THREADS) {
      const int i = (c / V4) * LD + (c % V4) * 4;
      if (!(ma_isfinite(ma_to_float(v_tile[i])) && ma_isfinite(ma_to_float(v_tile[i + 1])) &&
            ma_isfinite(ma_to_float(v_tile[i + 2])) && ma_isfinite(ma_to_float(v_tile[i + 3])))) {
        for (int z = 0; z < 4; ++z) {
          k_tile[i + z] = ma_from_float<T>(ma_nan());
          v_tile[i + z] = ma_from_float<T>(0.0f);
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
#endif
  // Tiles past this simdgroup's last causal key or left of its first row's window hold
  // nothing for its rows (uniform per simdgroup: no divergence inside a product).
  // (With one buffer the simdgroup still takes the barriers of the V staging, so it skips the
  // arithmetic only.)
  const bool skip = sg_rows == 0 || kt >= sg_kv_end || kt + BKV <= sg_kv_lo;
#if !TP_KV_SERIAL
  if (skip) {
    continue;
  }
#endif
  // Inside every row's causal and window range (and all rows real): no per-element mask.
  const bool full = sg_rows == SG_ROWS && kt + BKV <= full_end && kt >= full_lo;
  ma_popnd<T> pf[RB][K8];
  float alpha[RB];

  if (!skip) {
    // S = Q K^T: the right operands are K^T, read transposed from the row-major K tile.
    ma_frag8 s[RB][K8];
#pragma unroll
    for (int j = 0; j < K8; ++j) {
#pragma unroll
      for (int b = 0; b < RB; ++b) {
        s[b][j].v[0] = 0.0f;
        s[b][j].v[1] = 0.0f;
      }
#pragma unroll
      for (int d = 0; d < D8; d += 4) {
        ma_opnd<T> kb[4];
        ma_load_bt4<LD>(k_tile + j * 8 * LD + d * 8, lane, kb);
#pragma unroll
        for (int h = 0; h < 4; h += 2) {
          if (RB == 2) {
            ma_mma2x2<T>(s[0][j], s[RB - 1][j], qf[0][d + h], qf[RB - 1][d + h], kb[h], qf[0][d + h + 1],
                         qf[RB - 1][d + h + 1], kb[h + 1]);
          } else {
            ma_mma2<T>(s[0][j], qf[0][d + h], kb[h], qf[0][d + h + 1], kb[h + 1]);
          }
        }
      }
    }

    // Online softmax over this tile, in log2 space, per row block.
#pragma unroll
    for (int b = 0; b < RB; ++b) {
      float tile_max = MA_NEG_FLT_MAX;
#pragma unroll
      for (int j = 0; j < K8; ++j) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int key = kt + j * 8 + fc + i;
          const bool ok = full || (row_ok[b] && key < my_end[b] && key >= my_lo[b]);
          s[b][j].v[i] = ok ? ma_score(s[b][j].v[i], score_scale, softcap) : MA_NEG_FLT_MAX;
          tile_max = metal::max(tile_max, s[b][j].v[i]);
        }
      }
      const float m_new = metal::max(m[b], ma_frag_row_max(tile_max));
      float row_sum = 0.0f;
#pragma unroll
      for (int j = 0; j < K8; ++j) {
        float p[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          // A masked score is exactly the sentinel: exp2 of it would be 1 when m_new is too.
          p[i] = s[b][j].v[i] != MA_NEG_FLT_MAX ? metal::exp2(s[b][j].v[i] - m_new) : 0.0f;
          row_sum += p[i];
        }
        pf[b][j] = ma_popnd_pack<T>(p[0], p[1]);
      }
      alpha[b] = ma_rescale(m[b], m_new);
      l[b] = l[b] * alpha[b] + ma_frag_row_sum(row_sum);
      m[b] = m_new;
    }
  }

#if TP_KV_SERIAL
  // The tile's V rows into the same buffer, once every simdgroup is done with its K (zeros past
  // the tile's keys; a non-finite chunk as 0 where its K chunk went in as NaN).
  threadgroup_barrier(mem_flags::mem_threadgroup);
#pragma unroll 1
  for (int c = tid; c < BKV * V4; c += NUM_THREADS) {
    const int t = c / V4;
    const int e = (c % V4) * 4;
    const int i = t * LD + e;
    if (kt + t < kv_end) {
      const int key = kt + t;
      const int64_t addr = (int64_t(block_tables[bt_row + key / BLOCK_SIZE]) * BLOCK_SIZE + key % BLOCK_SIZE) *
                               tok_stride + head_off + e;
      ma_tg_store4(v_tile + i, ma_load_raw4(v_cache + addr));
      if (some_masked && !(ma_isfinite(ma_to_float(v_tile[i])) && ma_isfinite(ma_to_float(v_tile[i + 1])) &&
                           ma_isfinite(ma_to_float(v_tile[i + 2])) && ma_isfinite(ma_to_float(v_tile[i + 3])))) {
        for (int z = 0; z < 4; ++z) {
          v_tile[i + z] = ma_from_float<T>(0.0f);
        }
      }
    } else {
      for (int z = 0; z < 4; ++z) {
        v_tile[i + z] = ma_from_float<T>(0.0f);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
#endif
  if (!skip) {
    // O = alpha * O + P V (P in float precision).
#pragma unroll
    for (int d = 0; d < D8; ++d) {
#pragma unroll
      for (int b = 0; b < RB; ++b) {
        o[b][d].v[0] *= alpha[b];
        o[b][d].v[1] *= alpha[b];
      }
      if (K8 % 4 == 0) {
        // V operands four key blocks at a time.
#pragma unroll
        for (int j = 0; j < K8; j += 4) {
          ma_opnd<T> vb[4];
          ma_load_b4<LD>(v_tile + j * 8 * LD + d * 8, lane, vb);
#pragma unroll
          for (int h = 0; h < 4; h += 2) {
            if (RB == 2) {
              ma_mma2x2_p<T>(o[0][d], o[RB - 1][d], pf[0][j + h], pf[RB - 1][j + h], vb[h], pf[0][j + h + 1],
                             pf[RB - 1][j + h + 1], vb[h + 1]);
            } else {
              ma_mma2_p<T>(o[0][d], pf[0][j + h], vb[h], pf[0][j + h + 1], vb[h + 1]);
            }
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < K8; j += 2) {
          const ma_opnd<T> v0 = ma_load_b<LD>(v_tile + j * 8 * LD + d * 8, lane);
          const ma_opnd<T> v1 = ma_load_b<LD>(v_tile + (j + 1) * 8 * LD + d * 8, lane);
          if (RB == 2) {
            ma_mma2x2_p<T>(o[0][d], o[RB - 1][d], pf[0][j], pf[RB - 1][j], v0, pf[0][j + 1], pf[RB - 1][j + 1], v1);
          } else {
            ma_mma2_p<T>(o[0][d], pf[0][j], v0, pf[0][j + 1], v1);
          }
        }
      }
    }
  }
}
#if TP_KV_SERIAL
#undef v_tile
#endif

#if TP_SPLIT
// The partials of every row that reads this partition (part_lo below its causal end). A row that
// attended no key here kept m = -FLT_MAX and l = 0: the neutral partial, with O = 0.
#pragma unroll
for (int b = 0; b < RB; ++b) {
  if (row_ok[b] && part_lo < my_end[b]) {
    const int64_t pidx = (q_off[b] / HEAD_SIZE) * max_parts + part;  // (row, head, partition)
    if (fc == 0) {  // the four lanes of a fragment row hold the same m and l
      max_logits[pidx] = m[b];
      exp_sums[pidx] = l[b];
    }
    const float inv = 1.0f / (l[b] + MA_SOFTMAX_EPS);
#pragma unroll
    for (int d = 0; d < D8; ++d) {
      tmp_out[pidx * HEAD_SIZE + d * 8 + fc] = o[b][d].v[0] * inv;
      tmp_out[pidx * HEAD_SIZE + d * 8 + fc + 1] = o[b][d].v[1] * inv;
    }
  }
}
#else
#pragma unroll
for (int b = 0; b < RB; ++b) {
  if (row_ok[b]) {
    const float inv = 1.0f / (l[b] + MA_SOFTMAX_EPS);  // the sink is in l[b] from the start
#pragma unroll
    for (int d = 0; d < D8; ++d) {
      out[q_off[b] + d * 8 + fc] = ma_from_float<T>(o[b][d].v[0] * inv);
      out[q_off[b] + d * 8 + fc + 1] = ma_from_float<T>(o[b][d].v[1] * inv);
    }
  }
}
#endif
