// metal-attn: the M5 NAX prefill kernel: FlashAttention-2 over a paged KV cache on the tensor
// units of Apple M5-class GPUs, through the Metal 4 tensor ops (MetalPerformancePrimitives'
// matmul2d on cooperative tensors). Generated defines (metal_attn/constants.py via
// metal_attn/kernels.py): MA_LOG2E, MA_NEG_FLT_MAX, MA_SOFTMAX_EPS, MA_NAX_BQ, MA_NAX_TILE_KV.
// Needs nax_tensor_ops_metal.h (Metal) or nax_tensor_ops_cuda.h (the CUDA twin), paged_common.h
// and nax_layout.h before it.

// @kernel nax_prefill
// One threadgroup per (tile of MA_NAX_BQ = 64 query rows of one sequence, query head): four
// simdgroups of 16 rows each, 128 threads, no threadgroup memory and no barrier. Each simdgroup
// walks the keys its own rows need, MA_NAX_TILE_KV = 32 at a time, from its first row's window
// start (aligned down to a tile: fully masked leading tiles are never read) to its last row's
// causal end. Per tile, each lane reads its own K and V elements straight from the paged cache:
// the keys it holds are 8h + ma_nax_row(lane) of the tile (h < 4), so four block-table lookups
// serve a tile (block_size % 8 == 0 keeps each 8-key group inside one block). S = Q K^T is
// HEAD_SIZE / 16 matmul2d runs (16 x 32 x 16, right input transposed) into a float destination,
// masked with a finite sentinel; the online softmax (log2 space) keeps the state (m, l) per row,
// initialised by the sink when there is one; O += P V is two runs per 32 output dims, P a float
// left input. Relaxed precision: the tensor units may round products and sums differently from
// the tiled kernel (upstream bounds it at 2 ULP max, 0.05 ULP mean of the output dtype).
// Non-finite values follow the NaN contract (docs/providers.md): a non-finite q or K element gives
// a NaN score (ma_score); on a tile where some row of the simdgroup does not attend every key, the
// lanes first scan their V elements: a key whose V row is not finite gives the rows that attend it
// a NaN score, and its V elements enter the product as 0 (a masked row would get 0 * NaN).
// Inputs : q [T, H, D], k_cache/v_cache [NB, BS, KVH, D], block_tables [S, MB] int32,
//          seq_lens [S] int32, cu_seqlens_q [S+1] int32,
//          tiles [N, 2] int32 (sequence, first query row of the 64-row tile within it),
//          sinks [H] float32,
//          params int32 [num_tiles, num_heads, num_kv_heads, max_blocks, window, use_sinks],
//          fparams float32 [score_scale, softcap]
// Outputs: out [T, H, D] (T dtype); rows of sequences without tiles are not written.
// Template: T (float16 / bfloat16), HEAD_SIZE (64, 96, 128, 256, 512), BLOCK_SIZE (multiple of 8).
static_assert(MA_NAX_BQ == 4 * 16 && MA_NAX_TILE_KV == 32, "the NAX tile is 4 simdgroups x 16 rows, 32 keys");
static_assert(HEAD_SIZE % 32 == 0 && BLOCK_SIZE % 8 == 0, "NAX: head size a multiple of 32, block size of 8");
constexpr int DK = HEAD_SIZE / 16;  // 16-deep slices of the QK^T product
constexpr int DN = HEAD_SIZE / 32;  // 32-wide chunks of the output

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
if (tile >= num_tiles || head >= num_heads) {
  return;
}
const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int seq = tiles[2 * tile];
const int q_start = cu_seqlens_q[seq];
const int q_len = cu_seqlens_q[seq + 1] - q_start;
// This simdgroup's rows [row0, row0 + rows) of the sequence; it has no barrier to meet, so a
// simdgroup without rows leaves (uniform per simdgroup).
const int row0 = tiles[2 * tile + 1] + sg * 16;
const int rows = metal::min(16, q_len - row0);
if (rows <= 0) {
  return;
}
// Causal rule: row i of the chunk attends to [0, ctx0 + i + 1), the last `window` of them if any.
const int ctx0 = seq_lens[seq] - q_len;
const int kv_head = head / (num_heads / num_kv_heads);
const int kv_end = ctx0 + row0 + rows;  // the last row's causal end
const int kv_lo = window > 0 ? metal::max(ctx0 + row0 + 1 - window, 0) : 0;  // the first row's window start
const int kv_begin = (kv_lo / MA_NAX_TILE_KV) * MA_NAX_TILE_KV;
// Keys every one of 16 rows attends: a tile inside [full_lo, full_end) needs no mask.
const int full_end = ctx0 + row0 + 1;
const int full_lo = window > 0 ? metal::max(ctx0 + row0 + 16 - window, 0) : 0;

// This lane's two rows (fragment rows fm and fm + 8).
const int fm = ma_nax_row(lane);
bool row_ok[2];
int my_end[2];
int my_lo[2];
int64_t q_off[2];
float m[2];
float l[2];
#pragma unroll
for (int r = 0; r < 2; ++r) {
  const int row = row0 + fm + 8 * r;
  row_ok[r] = fm + 8 * r < rows;
  my_end[r] = ctx0 + row + 1;
  my_lo[r] = window > 0 ? metal::max(my_end[r] - window, 0) : 0;
  q_off[r] = (int64_t(q_start + row) * num_heads + head) * HEAD_SIZE;
  // Sinks initialise the state: the sink's logit is the first maximum, its weight 1.
  m[r] = use_sinks ? ma_sink_log2(sinks[head]) : MA_NEG_FLT_MAX;
  l[r] = use_sinks ? 1.0f : 0.0f;
}
float o[DN][16];  // O as destination elements, 32 output dims per chunk
#pragma unroll
for (int e = 0; e < DN; ++e) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    o[e][i] = 0.0f;
  }
}
const T zero = ma_from_float<T>(0.0f);

constexpr auto qk_desc = mpp::tensor_ops::matmul2d_descriptor(
    16, 32, 16, false, true, true, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);
constexpr auto pv_desc = mpp::tensor_ops::matmul2d_descriptor(
    16, 32, 16, false, false, true, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);
mpp::tensor_ops::matmul2d<qk_desc, metal::execution_simdgroup> qk_op;
mpp::tensor_ops::matmul2d<pv_desc, metal::execution_simdgroup> pv_op;
auto ct_q = qk_op.template get_left_input_cooperative_tensor<T, T, float>();
auto ct_k = qk_op.template get_right_input_cooperative_tensor<T, T, float>();
auto ct_s = qk_op.template get_destination_cooperative_tensor<metal::remove_addrspace_t<decltype(ct_q)>,
                                                              metal::remove_addrspace_t<decltype(ct_k)>, float>();
auto ct_p0 = pv_op.template get_left_input_cooperative_tensor<float, T, float>();
auto ct_p1 = pv_op.template get_left_input_cooperative_tensor<float, T, float>();
auto ct_v = pv_op.template get_right_input_cooperative_tensor<float, T, float>();
auto ct_o = pv_op.template get_destination_cooperative_tensor<metal::remove_addrspace_t<decltype(ct_p0)>,
                                                              metal::remove_addrspace_t<decltype(ct_v)>, float>();

const int64_t tok_stride = int64_t(num_kv_heads) * HEAD_SIZE;
const int64_t head_off = int64_t(kv_head) * HEAD_SIZE;
const int bt_row = seq * max_blocks;

for (int kt = kv_begin; kt < kv_end; kt += MA_NAX_TILE_KV) {
  // The four block-table lookups of this tile: key group h covers keys kt + 8h .. kt + 8h + 7.
  int64_t kv_base[4];
  bool kv_ok[4];
#pragma unroll
  for (int h = 0; h < 4; ++h) {
    const int group = kt + 8 * h;
    const int blk = group < kv_end ? block_tables[bt_row + group / BLOCK_SIZE] : 0;
    kv_base[h] = (int64_t(blk) * BLOCK_SIZE + group % BLOCK_SIZE + fm) * tok_stride + head_off;
    kv_ok[h] = group + fm < kv_end;  // keys past the last row's causal end are never read
  }
  const bool full = rows == 16 && kt + MA_NAX_TILE_KV <= full_end && kt >= full_lo;

  // S = Q K^T: the right input is K as stored (keys x dims), transposed by the descriptor.
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    ct_s[i] = 0.0f;
  }
  for (int d = 0; d < DK; ++d) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int r = (e >> 2) & 1;
      ct_q[e] = row_ok[r] ? q[q_off[r] + d * 16 + ma_nax_frag_col(lane, e)] : zero;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int h = (16 * (i >> 3) + ma_nax_frag_row(lane, i)) >> 3;
      ct_k[i] = kv_ok[h] ? k_cache[kv_base[h] + d * 16 + ma_nax_frag_col(lane, i)] : zero;
    }
    qk_op.run(ct_q, ct_k, ct_s);
  }

  // On a tile that not every row fully attends: which of its keys have a non-finite V row.
  uint bad_v = 0u;
  if (!full) {
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      if (kv_ok[h]) {
        for (int c = 0; c < HEAD_SIZE / 16; ++c) {
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            if (!ma_isfinite(ma_to_float(v_cache[kv_base[h] + c * 16 + ma_nax_col(lane) + x]))) {
              bad_v |= 1u << (8 * h + fm);
            }
          }
        }
      }
    }
    bad_v = ma_nax_simd_or(bad_v);
  }

  // Online softmax over this tile, in log2 space; destination element i is (row (i >> 2) & 1 of
  // this lane's two, key 16 * (i >> 3) + ma_nax_frag_col(lane, i) of the tile).
  float s[16];
  float tile_max[2] = {MA_NEG_FLT_MAX, MA_NEG_FLT_MAX};
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int r = (i >> 2) & 1;
    const int kk = 16 * (i >> 3) + ma_nax_frag_col(lane, i);
    const int key = kt + kk;
    const bool ok = full || (row_ok[r] && key < my_end[r] && key >= my_lo[r]);
    float x = ok ? ma_score(ct_s[i], score_scale, softcap) : MA_NEG_FLT_MAX;
    if (ok && ((bad_v >> kk) & 1u) != 0u) {
      x = ma_nan();
    }
    s[i] = x;
    tile_max[r] = metal::max(tile_max[r], x);
  }
  float alpha[2];
  float row_sum[2] = {0.0f, 0.0f};
  float m_new[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m_new[r] = metal::max(m[r], ma_nax_row_max(tile_max[r]));
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int r = (i >> 2) & 1;
    // A masked score is exactly the sentinel: exp2 of it would be 1 when m_new is too.
    const float p = s[i] != MA_NEG_FLT_MAX ? metal::exp2(s[i] - m_new[r]) : 0.0f;
    row_sum[r] += p;
    if (i < 8) {
      ct_p0[i] = p;  // keys 0..15 of the tile: a 16 x 16 left input
    } else {
      ct_p1[i - 8] = p;  // keys 16..31
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    alpha[r] = ma_rescale(m[r], m_new[r]);
    l[r] = l[r] * alpha[r] + ma_nax_row_sum(row_sum[r]);
    m[r] = m_new[r];
  }

  // O = alpha * O + P V, 32 output dims at a time: keys 0..15, then 16..31.
#pragma unroll
  for (int e = 0; e < DN; ++e) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      ct_o[i] = o[e][i] * alpha[(i >> 2) & 1];
    }
#pragma unroll
    for (int half_kv = 0; half_kv < 2; ++half_kv) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int h = (16 * half_kv + ma_nax_frag_row(lane, i)) >> 3;
        T v = kv_ok[h] ? v_cache[kv_base[h] + e * 32 + 16 * (i >> 3) + ma_nax_frag_col(lane, i)] : zero;
        if (!full && !ma_isfinite(ma_to_float(v))) {
          v = zero;  // its key's attending rows already score NaN (bad_v)
        }
        ct_v[i] = v;
      }
      if (half_kv == 0) {
        pv_op.run(ct_p0, ct_v, ct_o);
      } else {
        pv_op.run(ct_p1, ct_v, ct_o);
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      o[e][i] = ct_o[i];
    }
  }
}

float inv[2];
#pragma unroll
for (int r = 0; r < 2; ++r) {
  inv[r] = 1.0f / (l[r] + MA_SOFTMAX_EPS);
}
#pragma unroll
for (int e = 0; e < DN; ++e) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int r = (i >> 2) & 1;
    if (row_ok[r]) {
      out[q_off[r] + e * 32 + 16 * (i >> 3) + ma_nax_frag_col(lane, i)] = ma_from_float<T>(o[e][i] * inv[r]);
    }
  }
}
