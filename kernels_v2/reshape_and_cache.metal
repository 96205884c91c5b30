// metal-attn: reshape_and_cache, pool[slot] = kv for every non-negative slot.
// mx.fast kernels cannot write into an input, so this kernel produces the
// updated pools as new arrays in one pass over them: every element is either
// the new token's value (where inv_map[slot] >= 0) or the old pool value.
// Values are copied as raw elements (no conversion): byte-identical to a scatter.

// @kernel reshape_and_cache
// Inputs : key, value [N, KVH, D] (T), k_cache, v_cache [NB, BS, KVH, D] (T),
//          inv_map [NB * BS] int32 (token index writing that slot, or -1),
//          params int64 [total elements, ROW = KVH * D, grid threads]
// Outputs: k_out, v_out [NB, BS, KVH, D] (T)
// Template: T.
const int64_t total = params[0];
const int64_t row = params[1];
const int64_t stride = params[2];
for (int64_t i = int64_t(thread_position_in_grid.x); i < total; i += stride) {
  const int64_t slot = i / row;
  const int src = inv_map[slot];
  if (src >= 0) {
    const int64_t j = int64_t(src) * row + (i - slot * row);
    k_out[i] = key[j];
    v_out[i] = value[j];
  } else {
    k_out[i] = k_cache[i];
    v_out[i] = v_cache[i];
  }
}
