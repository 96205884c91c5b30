// gqa_decode: split-KV decode with the query heads of one KV head co-located.
//
// Grid: one threadgroup per (partition, KV head, sequence) = threadgroup_position_in_grid
// (x, y, z); GROUP simdgroups per threadgroup, simdgroup g computing query head
// kv_head * GROUP + g. Each lane keeps a contiguous HEAD_SIZE / 32 slice of its
// (pre-scaled, log2-space) query in float32 registers and reads the matching
// slices of K and V straight from device memory: no threadgroup staging, no
// barriers. Lane 0 reads the next page id while the current page is processed
// and broadcasts it with simd_shuffle at the page end. Tokens are taken four at
// a time (four independent dots, one joint max and one rescale), then a scalar
// tail. Output: the split contract (max_logits in log2 space, exp_sums,
// tmp_out already divided by exp_sums + eps), combined by the shared reducer.
//
// Template parameters: T (q/cache dtype), NUM_KV_HEADS, GROUP, HEAD_SIZE,
// BLOCK_SIZE, PARTITION_SIZE. Inputs: q [num_seqs, NUM_KV_HEADS * GROUP, HEAD_SIZE],
// k_cache / v_cache [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE],
// block_tables [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32,
// scale [1] float32 (softmax scale * log2(e)), dims [2] int32 (max_blocks,
// max_partitions). Outputs: max_logits / exp_sums [num_seqs, heads,
// max_partitions] float32, tmp_out [num_seqs, heads, max_partitions, HEAD_SIZE] float32.

// @kernel gqa_decode

constexpr int LANE_ELEMS = HEAD_SIZE / 32;
static_assert(HEAD_SIZE % 128 == 0, "gqa_decode: each lane loads its slice 4 elements at a time");
constexpr int NUM_HEADS = NUM_KV_HEADS * GROUP;
constexpr int TOKEN_STRIDE = NUM_KV_HEADS * HEAD_SIZE;
constexpr int BLOCK_STRIDE = BLOCK_SIZE * TOKEN_STRIDE;

const int part = int(threadgroup_position_in_grid.x);
const int kv_head = int(threadgroup_position_in_grid.y);
const int seq = int(threadgroup_position_in_grid.z);
const int sg = int(simdgroup_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);

const int seq_len = seq_lens[seq];
const int start = part * PARTITION_SIZE;
// Partitions at or past the row's end write nothing (the reducer recounts them).
if (sg >= GROUP || start >= seq_len) {
  return;
}
const int end = metal::min(start + PARTITION_SIZE, seq_len);
const int head = kv_head * GROUP + sg;
const int max_blocks = dims[0];
const int max_parts = dims[1];
const float scale_log2 = scale[0];

float qr[LANE_ELEMS];
const int q_base = (seq * NUM_HEADS + head) * HEAD_SIZE + lane * LANE_ELEMS;
for (int e = 0; e < LANE_ELEMS; ++e) {
  qr[e] = ma_to_float(q[q_base + e]) * scale_log2;
}

float m = 0.0f;  // running max (log2 space); meaningless until the first token
bool first = true;
float l = 0.0f;
float acc[LANE_ELEMS];
for (int e = 0; e < LANE_ELEMS; ++e) {
  acc[e] = 0.0f;
}

const int table_base = seq * max_blocks;
const int first_block = start / BLOCK_SIZE;
const int last_block = (end - 1) / BLOCK_SIZE;
const long lane_off = long(kv_head * HEAD_SIZE + lane * LANE_ELEMS);

int page = 0;
if (lane == 0) {
  page = block_tables[table_base + first_block];
}
page = simd_shuffle(page, 0);

for (int b = first_block; b <= last_block; ++b) {
  // One page ahead: lane 0 fetches the next id while this page is read.
  int next_page = 0;
  if (lane == 0 && b < last_block) {
    next_page = block_tables[table_base + b + 1];
  }
  const int n = metal::min(BLOCK_SIZE, end - b * BLOCK_SIZE);
  const long base = long(page) * long(BLOCK_STRIDE) + lane_off;

  int t = 0;
  for (; t + 4 <= n; t += 4) {
    const long r0 = base + long(t) * TOKEN_STRIDE;
    float k0[LANE_ELEMS], k1[LANE_ELEMS], k2[LANE_ELEMS], k3[LANE_ELEMS];
    float v0[LANE_ELEMS], v1[LANE_ELEMS], v2[LANE_ELEMS], v3[LANE_ELEMS];
    for (int e = 0; e < LANE_ELEMS; e += 4) {
      ma_load4(k_cache + (r0 + e), k0 + e);
      ma_load4(k_cache + (r0 + TOKEN_STRIDE + e), k1 + e);
      ma_load4(k_cache + (r0 + 2 * TOKEN_STRIDE + e), k2 + e);
      ma_load4(k_cache + (r0 + 3 * TOKEN_STRIDE + e), k3 + e);
    }
    for (int e = 0; e < LANE_ELEMS; e += 4) {
      ma_load4(v_cache + (r0 + e), v0 + e);
      ma_load4(v_cache + (r0 + TOKEN_STRIDE + e), v1 + e);
      ma_load4(v_cache + (r0 + 2 * TOKEN_STRIDE + e), v2 + e);
      ma_load4(v_cache + (r0 + 3 * TOKEN_STRIDE + e), v3 + e);
    }
    float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
    for (int e = 0; e < LANE_ELEMS; ++e) {
      d0 += qr[e] * k0[e];
      d1 += qr[e] * k1[e];
      d2 += qr[e] * k2[e];
      d3 += qr[e] * k3[e];
    }
    const float s0 = simd_sum(d0);
    const float s1 = simd_sum(d1);
    const float s2 = simd_sum(d2);
    const float s3 = simd_sum(d3);
    const float m4 = metal::max(metal::max(s0, s1), metal::max(s2, s3));
    // No sentinel max: the first step takes its own max and rescales nothing.
    const float m_new = first ? m4 : metal::max(m, m4);
    const float alpha = first ? 0.0f : metal::exp2(m - m_new);
    const float p0 = metal::exp2(s0 - m_new);
    const float p1 = metal::exp2(s1 - m_new);
    const float p2 = metal::exp2(s2 - m_new);
    const float p3 = metal::exp2(s3 - m_new);
    l = l * alpha + ((p0 + p1) + (p2 + p3));
    for (int e = 0; e < LANE_ELEMS; ++e) {
      acc[e] = acc[e] * alpha + (p0 * v0[e] + p1 * v1[e]) + (p2 * v2[e] + p3 * v3[e]);
    }
    m = m_new;
    first = false;
  }
  for (; t < n; ++t) {
    const long r = base + long(t) * TOKEN_STRIDE;
    float kt[LANE_ELEMS], vt[LANE_ELEMS];
    for (int e = 0; e < LANE_ELEMS; e += 4) {
      ma_load4(k_cache + (r + e), kt + e);
      ma_load4(v_cache + (r + e), vt + e);
    }
    float d = 0.0f;
    for (int e = 0; e < LANE_ELEMS; ++e) {
      d += qr[e] * kt[e];
    }
    const float s = simd_sum(d);
    const float m_new = first ? s : metal::max(m, s);
    const float alpha = first ? 0.0f : metal::exp2(m - m_new);
    const float p = metal::exp2(s - m_new);
    l = l * alpha + p;
    for (int e = 0; e < LANE_ELEMS; ++e) {
      acc[e] = acc[e] * alpha + p * vt[e];
    }
    m = m_new;
    first = false;
  }
  page = simd_shuffle(next_page, 0);
}

const int stat = (seq * NUM_HEADS + head) * max_parts + part;
if (lane == 0) {
  max_logits[stat] = m;
  exp_sums[stat] = l;
}
const float inv = 1.0f / (l + MA_SOFTMAX_EPS);
const long out_base = long(stat) * HEAD_SIZE + lane * LANE_ELEMS;
for (int e = 0; e < LANE_ELEMS; ++e) {
  tmp_out[out_base + e] = acc[e] * inv;
}
