// metal-attn: the NaN contract of the sdpa_prefill route, after the fused attention kernel.
// Two kernel bodies, one per `// @kernel NAME` section; MLX writes the signatures.
//
// gather_kv flags every (position, KV head) row holding a non-finite K or V element (and zeroes
// V's, so the fused kernel's masked products stay finite). A query row must be NaN when it attends
// a flagged position of its KV head, or when its own query holds a non-finite element (a fused
// kernel can turn an infinite query into -inf scores everywhere: a silent 0). first_flagged
// reduces the flags to one position per (sequence, KV head); sdpa_finish applies both rules
// while copying the fused kernel's output, in one pass.

// @kernel first_flagged
// Inputs : bad [n * KVH, seq_len] int32 (gather_kv's flags), params int32 [seq_len]
// Outputs: first [n * KVH] int32: the smallest flagged position of each row, seq_len when none.
// Template: THREADS (threads per threadgroup, a multiple of the SIMD width, at most 1024).
// One threadgroup per (sequence, KV head) row; threads stride over the positions.
const int seq_len = params[0];
const int64_t row = int64_t(threadgroup_position_in_grid.x);
const int tid = int(thread_index_in_threadgroup);
int first_here = seq_len;
for (int p = tid; p < seq_len; p += THREADS) {
  if (bad[row * seq_len + p] != 0) {
    first_here = metal::min(first_here, p);
  }
}
first_here = simd_min(first_here);
threadgroup int sg_first[THREADS / MA_SIMD_WIDTH];
if (thread_index_in_simdgroup == 0) {
  sg_first[simdgroup_index_in_threadgroup] = first_here;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid == 0) {
  int m = seq_len;
  for (int i = 0; i < THREADS / MA_SIMD_WIDTH; ++i) {
    m = metal::min(m, sg_first[i]);
  }
  first[row] = m;
}

// @kernel sdpa_finish
// Inputs : o [rows, H, D] (T: the fused kernel's output in packed row order), q [rows, H, D] (T:
//          the same rows' queries), first [n * KVH] int32 (first_flagged),
//          lead [lead_rows, H, D] (T: rows computed elsewhere that go in front, a mixed batch's
//          decode rows; unread when lead_rows is 0),
//          params int32 [q_len, seq_len, n, num_heads, kv_heads, lead_rows, out_row0, in_place,
//          per_simdgroup]
// Outputs: out [out_row0 + lead_rows + rows (at least), H, D] (T): from row out_row0 on, the lead
//          rows as they are, then o, or NaN for every
//          element of a (row, head) that attends a flagged position (first <= seq_len - q_len + r,
//          the row's last key) or whose query holds a non-finite element. (Writing the lead rows
//          here saves a mixed batch the concatenation of the two outputs: two copy launches. With
//          out_row0, launches of several runs write one output: no concatenation either.)
//          in_place = 1 (lead_rows and out_row0 0; a CUDA chain whose output starts as o's values,
//          mostly in o's own buffer): out already holds o, so only the NaN rows are written and o
//          is not read, a third of the bytes.
// Template: T, HEAD_SIZE (a multiple of 4). The head counts are runtime parameters, so the kernel a
// provider compiles ahead for a (dtype, head size) is the one every geometry of it runs.
// (lead + rows) * H (row, head) pairs, rows = n * q_len sequence-major; each simdgroup takes
// per_simdgroup consecutive pairs (so that a big batch is not thousands of waves of simdgroups that
// each move one pair); each lane moves groups of four elements (one 8- or 16-byte access on CUDA).
const int q_len = params[0];
const int seq_len = params[1];
const int num_heads = params[3];
const int kv_heads = params[4];
const int group = num_heads / kv_heads;
const uint lead_pairs = uint(params[5]) * uint(num_heads);
const int64_t out0 = int64_t(params[6]) * num_heads;  // (row, head) pairs of out before this launch's
const bool in_place = params[7] != 0;
const uint per = uint(params[8]);
const int lane = int(thread_index_in_simdgroup);
// (row, head) indices in 32 bits (the grid's thread index is 32-bit); the element offset is 64-bit.
const uint pairs = uint(params[2]) * uint(q_len) * uint(num_heads);
const uint slot0 = uint(thread_position_in_grid.x) / uint(MA_SIMD_WIDTH) * per;
// The simdgroup's own pairs are consecutive: their (sequence, row, head, KV head) is divided out once,
// for the first, then counted on. Dividing per pair by the runtime head count and chunk length (six
// integer divisions) made the in-place finish instruction-bound: it read the queries at about 1.3 TB/s
// on an H100 (forty-third session).
uint pair = (slot0 > lead_pairs ? slot0 : lead_pairs) - lead_pairs;  // (row, head) of o and q
int h = int(pair % uint(num_heads));
const uint t0 = pair / uint(num_heads);
int r = int(t0 % uint(q_len));
int s = int(t0 / uint(q_len));
int kvh = h / group;
int in_group = h - kvh * group;
for (uint slot = slot0; slot < slot0 + per; ++slot) {  // (row, head) of out; uniform per simdgroup
  if (slot < lead_pairs) {  // a lead row: copied as it is
    const int64_t at = (out0 + slot) * HEAD_SIZE;
    for (int d = lane * 4; d < HEAD_SIZE; d += 4 * MA_SIMD_WIDTH) {
      ma_store_raw4(out + at + d, ma_load_raw4(lead + at + d));
    }
  } else if (pair < pairs) {
    const bool reached = first[s * kv_heads + kvh] <= seq_len - q_len + r;
    const int64_t base = int64_t(pair) * HEAD_SIZE;
    const int64_t at = (out0 + slot) * HEAD_SIZE;
    bool bad_q = false;
    for (int d = lane * 4; d < HEAD_SIZE; d += 4 * MA_SIMD_WIDTH) {
      float x[4];
      ma_unpack4(ma_load_raw4(q + base + d), x);
      for (int i = 0; i < 4; ++i) {
        bad_q = bad_q || !ma_isfinite(x[i]);
      }
    }
    const bool nan_row = simd_any(bad_q) || reached;  // every lane of the simdgroup takes part
    for (int d = lane * 4; d < HEAD_SIZE; d += 4 * MA_SIMD_WIDTH) {
      if (nan_row) {
        for (int i = 0; i < 4; ++i) {
          out[at + d + i] = ma_from_float<T>(ma_nan());
        }
      } else if (!in_place) {
        ma_store_raw4(out + at + d, ma_load_raw4(o + base + d));
      }
    }
    // The next pair: the next head, else the next row, else the next sequence.
    ++pair;
    ++h;
    ++in_group;
    if (in_group == group) {
      in_group = 0;
      ++kvh;
    }
    if (h == num_heads) {
      h = 0;
      kvh = 0;
      in_group = 0;
      if (++r == q_len) {
        r = 0;
        ++s;
      }
    }
  }
}
