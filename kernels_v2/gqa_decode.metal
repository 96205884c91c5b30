// gqa_decode: split-KV decode with the query heads of one KV head co-located.
//
// Grid: one threadgroup per (partition, KV head, sequence) = threadgroup_position_in_grid
// (x, y, z); GROUP simdgroups per threadgroup, simdgroup g computing query head
// kv_head * GROUP + g. Each lane keeps a contiguous HEAD_SIZE / 32 slice of its
// (pre-scaled, log2-space) query in float32 registers and reads the matching
// slices of K and V straight from device memory: no threadgroup staging, no
// barriers. Lane 0 reads page ids ahead (the next page's id is always known
// while a page is processed) and broadcasts them with simd_shuffle. A page is
// read in chunks of CHUNK tokens: every K/V load of a chunk is issued before any
// arithmetic (packed registers), so CHUNK rows are in flight per simdgroup; with
// PREFETCH the next page's rows are requested into L2 (CUDA; a no-op on Metal)
// while this one is computed. Tokens are then taken four at a time (four
// independent dots, one joint max and one rescale), then a scalar tail. Output: the split contract (max_logits in log2 space, exp_sums,
// tmp_out already divided by exp_sums + eps), combined by the shared reducer.
//
// Template parameters: T (q/cache dtype), NUM_KV_HEADS, GROUP, HEAD_SIZE,
// BLOCK_SIZE, PARTITION_SIZE, CHUNK (a multiple of 4 dividing BLOCK_SIZE), PREFETCH (0/1). Inputs: q [num_seqs, NUM_KV_HEADS * GROUP, HEAD_SIZE],
// k_cache / v_cache [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE],
// block_tables [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32,
// scale [1] float32 (softmax scale * log2(e)), dims [2] int32 (max_blocks,
// max_partitions). Outputs: max_logits / exp_sums [num_seqs, heads,
// max_partitions] float32, tmp_out [num_seqs, heads, max_partitions, HEAD_SIZE] float32.

// @kernel gqa_decode

constexpr int LANE_ELEMS = HEAD_SIZE / MA_SIMD_WIDTH;
constexpr int LANE_VECS = LANE_ELEMS / 4;
static_assert(HEAD_SIZE % 128 == 0, "gqa_decode: each lane loads its slice 4 elements at a time");
static_assert(CHUNK % 4 == 0 && BLOCK_SIZE % CHUNK == 0, "gqa_decode: CHUNK is a multiple of 4 dividing BLOCK_SIZE");
constexpr int NUM_HEADS = NUM_KV_HEADS * GROUP;
constexpr int TOKEN_STRIDE = NUM_KV_HEADS * HEAD_SIZE;
constexpr int BLOCK_STRIDE = BLOCK_SIZE * TOKEN_STRIDE;
// L2 prefetch: 128-byte lines per K (or V) row of one KV head, and per page.
constexpr int LINE_ELEMS = 128 / int(sizeof(T));
constexpr int ROW_LINES = HEAD_SIZE / LINE_ELEMS > 0 ? HEAD_SIZE / LINE_ELEMS : 1;
constexpr int PAGE_LINES = BLOCK_SIZE * ROW_LINES;

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
const long head_off = long(kv_head * HEAD_SIZE);

// The page being read and the next one: lane 0 reads, simd_shuffle broadcasts.
int page = 0;
int page_next = 0;
if (lane == 0) {
  page = block_tables[table_base + first_block];
  page_next = first_block < last_block ? block_tables[table_base + first_block + 1] : 0;
}
page = simd_shuffle(page, 0);
page_next = simd_shuffle(page_next, 0);

for (int b = first_block; b <= last_block; ++b) {
  // Lane 0 reads the id two pages ahead while this page is processed.
  int page_after = 0;
  if (lane == 0 && b + 2 <= last_block) {
    page_after = block_tables[table_base + b + 2];
  }
  if (PREFETCH && b < last_block) {
    const long next_base = long(page_next) * long(BLOCK_STRIDE) + head_off;
    for (int i = lane; i < PAGE_LINES; i += MA_SIMD_WIDTH) {
      const long off = next_base + long(i / ROW_LINES) * TOKEN_STRIDE + (i % ROW_LINES) * LINE_ELEMS;
      ma_prefetch(k_cache + off);
      ma_prefetch(v_cache + off);
    }
  }
  const int n = metal::min(BLOCK_SIZE, end - b * BLOCK_SIZE);
  const long base = long(page) * long(BLOCK_STRIDE) + lane_off;

  for (int c = 0; c < n; c += CHUNK) {
    const int nc = metal::min(CHUNK, n - c);
    // Every load of the chunk first (nc is the same on all lanes).
    ma_raw4<T> kr[CHUNK][LANE_VECS];
    ma_raw4<T> vr[CHUNK][LANE_VECS];
#pragma unroll
    for (int t = 0; t < CHUNK; ++t) {
      if (t < nc) {
        const long r = base + long(c + t) * TOKEN_STRIDE;
#pragma unroll
        for (int v = 0; v < LANE_VECS; ++v) {
          kr[t][v] = ma_load_raw4(k_cache + (r + 4 * v));
          vr[t][v] = ma_load_raw4(v_cache + (r + 4 * v));
        }
      }
    }
    // Four tokens per step: four dots, one joint max, one rescale.
#pragma unroll
    for (int t = 0; t < CHUNK; t += 4) {
      if (t + 4 <= nc) {
        float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma unroll
        for (int v = 0; v < LANE_VECS; ++v) {
          float k0[4], k1[4], k2[4], k3[4];
          ma_unpack4(kr[t][v], k0);
          ma_unpack4(kr[t + 1][v], k1);
          ma_unpack4(kr[t + 2][v], k2);
          ma_unpack4(kr[t + 3][v], k3);
          for (int i = 0; i < 4; ++i) {
            d0 += qr[4 * v + i] * k0[i];
            d1 += qr[4 * v + i] * k1[i];
            d2 += qr[4 * v + i] * k2[i];
            d3 += qr[4 * v + i] * k3[i];
          }
        }
        ma_simd_sum4(d0, d1, d2, d3);  // simd_sum of each, all four on every lane
        // A non-finite dot (NaN/Inf in q or K) is a NaN score: the sums turn NaN, the key is not dropped.
        const float s0 = ma_finite_or_nan(d0);
        const float s1 = ma_finite_or_nan(d1);
        const float s2 = ma_finite_or_nan(d2);
        const float s3 = ma_finite_or_nan(d3);
        const float m4 = metal::max(metal::max(s0, s1), metal::max(s2, s3));
        // No sentinel max: the first step takes its own max and rescales nothing.
        const float m_new = first ? m4 : metal::max(m, m4);
        const float alpha = first ? 0.0f : metal::exp2(m - m_new);
        const float p0 = metal::exp2(s0 - m_new);
        const float p1 = metal::exp2(s1 - m_new);
        const float p2 = metal::exp2(s2 - m_new);
        const float p3 = metal::exp2(s3 - m_new);
        l = l * alpha + ((p0 + p1) + (p2 + p3));
#pragma unroll
        for (int v = 0; v < LANE_VECS; ++v) {
          float v0[4], v1[4], v2[4], v3[4];
          ma_unpack4(vr[t][v], v0);
          ma_unpack4(vr[t + 1][v], v1);
          ma_unpack4(vr[t + 2][v], v2);
          ma_unpack4(vr[t + 3][v], v3);
          for (int i = 0; i < 4; ++i) {
            const int e = 4 * v + i;
            acc[e] = acc[e] * alpha + (p0 * v0[i] + p1 * v1[i]) + (p2 * v2[i] + p3 * v3[i]);
          }
        }
        m = m_new;
        first = false;
      }
    }
    // Scalar tail: the last nc % 4 tokens of a short chunk.
#pragma unroll
    for (int t = 0; t < CHUNK; ++t) {
      if (t >= (nc & ~3) && t < nc) {
        float d = 0.0f;
#pragma unroll
        for (int v = 0; v < LANE_VECS; ++v) {
          float kt[4];
          ma_unpack4(kr[t][v], kt);
          for (int i = 0; i < 4; ++i) {
            d += qr[4 * v + i] * kt[i];
          }
        }
        const float s = ma_finite_or_nan(simd_sum(d));
        const float m_new = first ? s : metal::max(m, s);
        const float alpha = first ? 0.0f : metal::exp2(m - m_new);
        const float p = metal::exp2(s - m_new);
        l = l * alpha + p;
#pragma unroll
        for (int v = 0; v < LANE_VECS; ++v) {
          float vt[4];
          ma_unpack4(vr[t][v], vt);
          for (int i = 0; i < 4; ++i) {
            acc[4 * v + i] = acc[4 * v + i] * alpha + p * vt[i];
          }
        }
        m = m_new;
        first = false;
      }
    }
  }
  page = page_next;
  page_next = simd_shuffle(page_after, 0);
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
