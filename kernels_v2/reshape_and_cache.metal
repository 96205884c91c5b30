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

// @kernel reshape_and_cache_slots
// The in-place form: one threadgroup per new token, its threads striding over the token's
// KVH * D elements four at a time (raw copies, byte-identical to a scatter); a negative slot
// (padding) or one past the pool (validation off) is skipped. Only the slots' rows are
// written, where they are: on CUDA the kernel runs in a chain whose outputs are the pools updated
// in place (metal_attn.cuda_ops, `updates`: the pools' own buffers when MLX may donate them, else
// copies). On Metal it needs a C++ primitive that binds the pools as its outputs; none is built
// here, so there the text is source-checked only and never executed.
// Inputs : key, value [N, KVH, D] (T), slots [N] int64, params int64 [num_slots, ROW = KVH * D]
// Outputs: k_cache, v_cache [NB, BS, KVH, D] (T): only the rows of the slots in the pool written
// Template: T. ROW is a multiple of 4 (every admitted head size is).
const int64_t num_slots = params[0];
const int64_t row = params[1];
const int64_t tok = int64_t(threadgroup_position_in_grid.x);
const int64_t slot = slots[tok];
if (slot >= 0 && slot < num_slots) {
  for (int64_t i = int64_t(thread_position_in_threadgroup.x) * 4; i < row;
       i += int64_t(threads_per_threadgroup.x) * 4) {
    ma_store_raw4(k_cache + slot * row + i, ma_load_raw4(key + tok * row + i));
    ma_store_raw4(v_cache + slot * row + i, ma_load_raw4(value + tok * row + i));
  }
}
