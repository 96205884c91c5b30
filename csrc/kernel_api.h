// Plain-data interface between the host code (ops.cpp) and the
// per-ISA kernel translation units (isa_*.cpp). Nothing here uses the STL, so
// the ISA units never instantiate library templates with their -m flags.
#pragma once

#include <cstdint>

namespace metal_attn_native {

// Element type of q, the pools and the output (they always match).
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// One work item: query rows [row_begin, row_end) of sequence `seq`, the query
// heads of KV heads [kvh_begin, kvh_end), and KV partition `part` (-1: the
// whole row, written straight to the output; >= 0: a split partial for the
// reducer). Decode rows take several KV heads per unit so a page's tokens are
// read as whole contiguous rows; prefill tiles take one.
struct Unit {
  int32_t seq;
  int32_t kvh_begin;
  int32_t kvh_end;
  int32_t row_begin;
  int32_t row_end;
  int32_t part;
};

struct Job {
  int dtype;
  // q: [T, H, D], element strides (any layout).
  const void* q;
  int64_t q_st, q_sh, q_sd;
  // Pools [num_blocks, block_size, num_kv_heads, head_size]; the block axis may
  // be strided, the other three are dense.
  const void* k;
  const void* v;
  int64_t k_sb, v_sb;
  // Host copies of the metadata (contiguous int32).
  const int32_t* block_tables;
  int64_t bt_row;
  const int32_t* seq_lens;
  const int32_t* cu_q;
  const int32_t* tok_seq;  // query token -> its sequence
  const float* sinks;      // [H] or null
  void* out;               // [T, H, D] contiguous, dtype
  int H, KVH, D, BS, group;
  float scale;    // softmax scale (natural-log space)
  float softcap;  // 0: none
  int window;     // 0: none
  int part_size;  // 0: unsplit
  int max_parts;
  // Split scratch: [T, H, max_parts] stats and [T, H, max_parts, D] partials.
  float* part_m;
  float* part_l;
  float* part_out;
  const Unit* units;
  int num_units;
  int64_t work_floats;  // per-thread work buffer size (floats)
};

// Entry points every ISA unit defines in its own namespace.
#define MA_DECLARE_ISA(ns)                                          \
  namespace ns {                                                    \
  void attend_unit(const Job& job, int unit, float* work);          \
  void reduce_item(const Job& job, int item);                       \
  uint64_t read_span(const char* p, int64_t n);                     \
  }

MA_DECLARE_ISA(isa_portable)
#if defined(MA_HAVE_X86_ISAS)
MA_DECLARE_ISA(isa_avx2)
MA_DECLARE_ISA(isa_avx512)
#endif

// Largest head size the kernels take (the reducer's stack accumulator is this long).
constexpr int kMaxHeadSize = 512;

// Query heads processed together per row tile (rows * group ~ this many).
constexpr int kQueryVectorsPerTile = 64;

inline int row_tile_for_group(int group) {
  int rt = kQueryVectorsPerTile / (group > 0 ? group : 1);
  return rt < 1 ? 1 : rt;
}

}  // namespace metal_attn_native
