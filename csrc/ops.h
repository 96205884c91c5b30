// MLX custom primitives of the CPU backend: paged attention and reshape_and_cache.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metal_attn_native {

namespace mx = mlx::core;

// Instruction-set builds of the attention kernel, best first.
enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

std::vector<std::string> supported_isas();     // on this CPU, best first
std::string isa_name(Isa isa);
Isa resolve_isa(const std::string& name);      // "auto" -> best supported; raises if unknown/unsupported

struct AttentionParams {
  float scale = 1.0f;
  float softcap = 0.0f;    // 0: none
  int window = 0;          // 0: none
  int partition_size = 0;  // 0: unsplit
  int num_threads = 1;
  Isa isa = Isa::kPortable;
  bool has_sinks = false;

  bool operator==(const AttentionParams&) const = default;
};

class PagedAttention : public mx::Primitive {
 public:
  PagedAttention(mx::Stream stream, AttentionParams params) : mx::Primitive(stream), params_(params) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MetalAttnPagedAttentionCPU"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  AttentionParams params_;
};

class ReshapeAndCache : public mx::Primitive {
 public:
  explicit ReshapeAndCache(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MetalAttnReshapeAndCacheCPU"; }
  bool is_equivalent(const mx::Primitive& other) const override { return typeid(other) == typeid(*this); }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

// The ops (graph construction; validate shapes and dtypes, raise std::invalid_argument).
mx::array paged_attention(const mx::array& q, const mx::array& k_cache, const mx::array& v_cache,
                          const mx::array& block_tables, const mx::array& seq_lens,
                          const mx::array& cu_seqlens_q, const std::optional<mx::array>& sinks, double scale,
                          double softcap, int sliding_window, int partition_size, int num_threads,
                          const std::string& isa);

// Read every byte of `a`'s buffer (evaluated first) with `num_threads` workers of the kernels' pool and
// the widest vector loads `isa` has, returning a checksum: the CPU's read-bandwidth ceiling.
uint64_t read_bytes(const mx::array& a, int num_threads, const std::string& isa);

std::vector<mx::array> reshape_and_cache(const mx::array& key, const mx::array& value, const mx::array& k_cache,
                                         const mx::array& v_cache, const mx::array& slot_mapping);

}  // namespace metal_attn_native
