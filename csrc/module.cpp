// nanobind module metal_attn._native (NB_DOMAIN mlx, so mx.array crosses over).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "kernel_api.h"
#include "ops.h"
#include "thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace ma = metal_attn_native;

NB_MODULE(_native, m) {
  m.doc() = "metal-attn native CPU kernels: paged attention and reshape_and_cache as MLX primitives.";

  m.def("paged_attention", &ma::paged_attention, "q"_a, "k_cache"_a, "v_cache"_a, "block_tables"_a, "seq_lens"_a,
        "cu_seqlens_q"_a, "sinks"_a = nb::none(), nb::kw_only(), "scale"_a, "softcap"_a = 0.0,
        "sliding_window"_a = 0, "partition_size"_a = 0, "num_threads"_a = 0, "isa"_a = "auto",
        R"doc(Paged attention on the CPU (lazy; returns [total_q_tokens, num_heads, head_size] in q's dtype).

softcap=0 and sliding_window=0 mean none; partition_size=0 computes each row in one
pass, a positive value splits rows into KV partitions merged by the reducer;
num_threads=0 uses every hardware thread; isa is auto, avx512, avx2 or portable.)doc");

  m.def("reshape_and_cache", &ma::reshape_and_cache, "key"_a, "value"_a, "k_cache"_a, "v_cache"_a,
        "slot_mapping"_a,
        "Scatter key/value rows into the pools at slot_mapping (negative slots skipped); returns the new pools.");

  m.def("read_bytes", &ma::read_bytes, "a"_a, "num_threads"_a = 0, "isa"_a = "auto",
        "Read every byte of a's buffer (evaluated first) with num_threads workers (0: every hardware thread) "
        "and the widest vector loads; returns a checksum. Timed, it is the CPU's read-bandwidth ceiling.");
  m.def("supported_isas", &ma::supported_isas, "Kernel instruction sets this CPU can run, best first.");
  m.def("resolve_isa", [](const std::string& name) { return ma::isa_name(ma::resolve_isa(name)); }, "name"_a = "auto",
        "The instruction set a given choice runs ('auto': the best supported).");
  m.def("hardware_threads", &ma::ThreadPool::hardware_threads, "Threads the hardware offers.");
  m.def("row_tile", &ma::row_tile_for_group, "group"_a, "Query rows per work unit for a GQA group size.");

  nb::dict c;
  c["PARTITION_SIZE"] = MA_PARTITION_SIZE;
  c["SOFTMAX_EPS"] = MA_SOFTMAX_EPS;
  c["LOG2E"] = MA_LOG2E;
  c["SCRATCH_CAP_BYTES"] = static_cast<long long>(MA_SCRATCH_CAP_BYTES);
  c["MAX_HEAD_SIZE"] = ma::kMaxHeadSize;
  c["QUERY_VECTORS_PER_TILE"] = ma::kQueryVectorsPerTile;
  m.attr("constants") = c;
}
