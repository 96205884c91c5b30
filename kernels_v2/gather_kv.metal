// metal-attn: gather_kv, the pages of a run of equal-length sequences copied into contiguous K/V
// for a fused attention kernel (the sdpa_prefill provider), with the NaN contract's bookkeeping
// in the same pass: a fused kernel multiplies the zero probabilities of masked keys with V, and
// 0 * NaN is NaN, so V's non-finite elements are written as 0 and every (position, KV head) row
// holding a non-finite K or V element is flagged; first_flagged and sdpa_finish
// (sdpa_finish.metal) make the query rows that attend a flagged position NaN.
//
// @kernel gather_kv
// Inputs : k_cache, v_cache [NB, BS, KVH, D] (T), block_tables [S, W] int32,
//          params int32 [first_seq, n, seq_len, num_blocks, width, block_size, kv_heads]
// Outputs: k_out, v_out [n, KVH, seq_len, D] (T; the layout of a fused kernel's K/V, each head's
//          keys contiguous), V's non-finite elements as 0;
//          bad [n, KVH, seq_len] int32: 1 where that K or V row holds a non-finite element; at
//          position 0 also where the sequence's table holds a block id outside the pool (only
//          with validation off: such a page is never read, and every row attends position 0).
// Template: T, HEAD_SIZE. The block size and KV head count are runtime parameters, so the kernel a
// provider compiles ahead for a (dtype, head size) is the one every geometry of it runs.
// One simdgroup per (sequence, position, KV head) row; lanes stride over the head dimension in
// groups of four (HEAD_SIZE a multiple of 4).
const int first_seq = params[0];
const int seq_len = params[2];
const int num_blocks = params[3];
const int width = params[4];
const int block_size = params[5];
const int kv_heads = params[6];
const int lane = int(thread_index_in_simdgroup);
// Row indices in 32 bits (the grid's thread index is 32-bit): the divisions by the runtime head
// count and length stay cheap; byte offsets below are 64-bit.
const uint row = uint(thread_position_in_grid.x) / uint(MA_SIMD_WIDTH);
const uint rows = uint(params[1]) * uint(seq_len) * uint(kv_heads);
if (row < rows) {
  const int h = int(row % uint(kv_heads));
  const uint t = row / uint(kv_heads);
  const int pos = int(t % uint(seq_len));
  const int s = int(t / uint(seq_len));
  const device int* table = block_tables + int64_t(first_seq + s) * width;
  const int page = int(uint(pos) / uint(block_size));
  const int blk = table[page];
  const bool in_pool = blk >= 0 && blk < num_blocks;
  const int64_t src = ((int64_t(in_pool ? blk : 0) * block_size + (pos - page * block_size)) * kv_heads + h) * HEAD_SIZE;
  const int64_t out_row = (int64_t(s) * kv_heads + h) * seq_len + pos;
  const int64_t dst = out_row * HEAD_SIZE;
  float bad_here = in_pool ? 0.0f : 1.0f;
  // Groups of four elements per lane: one 8- or 16-byte load and store each on CUDA. A page
  // outside the pool is never read: its rows are written as zeros and flagged.
  for (int d = lane * 4; d < HEAD_SIZE; d += 4 * MA_SIMD_WIDTH) {
    if (in_pool) {
      const ma_raw4<T> kr = ma_load_raw4(k_cache + src + d);
      const ma_raw4<T> vr = ma_load_raw4(v_cache + src + d);
      float kf[4], vf[4];
      ma_unpack4(kr, kf);
      ma_unpack4(vr, vf);
      bool all_ok = true;
      bool v_ok = true;
      for (int i = 0; i < 4; ++i) {
        v_ok = v_ok && ma_isfinite(vf[i]);
        all_ok = all_ok && ma_isfinite(kf[i]) && ma_isfinite(vf[i]);
      }
      ma_store_raw4(k_out + dst + d, kr);
      if (v_ok) {
        ma_store_raw4(v_out + dst + d, vr);
      } else {
        for (int i = 0; i < 4; ++i) {
          v_out[dst + d + i] = ma_isfinite(vf[i]) ? v_cache[src + d + i] : T(0);
        }
      }
      if (!all_ok) {
        bad_here = 1.0f;
      }
    } else {
      for (int i = 0; i < 4; ++i) {
        k_out[dst + d + i] = T(0);
        v_out[dst + d + i] = T(0);
      }
    }
  }
  if (pos == 0) {  // the table's block ids, checked once per (sequence, KV head)
    const int pages = (seq_len + block_size - 1) / block_size;
    for (int p = lane; p < pages; p += MA_SIMD_WIDTH) {
      if (table[p] < 0 || table[p] >= num_blocks) {
        bad_here = 1.0f;
      }
    }
  }
  const float any_bad = simd_sum(bad_here);
  if (lane == 0) {
    bad[out_row] = any_bad > 0.0f ? 1 : 0;
  }
}
