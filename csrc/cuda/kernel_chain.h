// metal-attn CUDA ops: KernelChain, one MLX primitive that encodes several of our kernels.
//
// A chain is data (ChainSpec): the inputs it takes, the outputs it returns, the scratch buffers
// it allocates for one evaluation, and the launches, each a loaded CUfunction with its grid and
// the buffers it reads and writes. Evaluating the primitive adds one kernel node per launch to
// MLX's command encoder, ordered through the buffers as MLX orders its own kernels.
#pragma once

#include <cuda.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace metal_attn_cuda {

namespace mx = mlx::core;

struct Buffer {
  mx::Shape shape;
  mx::Dtype dtype;
};

struct Launch {
  CUfunction function;
  unsigned grid[3];   // threadgroups, not threads
  unsigned block[3];  // threads per threadgroup
  // Kernel arguments in order, as buffer indices: [0, inputs) the chain's inputs, then its
  // outputs, then its scratch. The first `reads` arguments are read, the rest written.
  std::vector<int> args;
  int reads;
};

struct ChainSpec {
  std::string name;
  std::vector<mx::Dtype> input_dtypes;
  std::vector<mx::Shape> input_shapes;
  // Inputs the launches update in place: persistent buffers the caller owns and the kernels leave
  // as they found them (the fused reducer's arrival counters, zero before and after). They must
  // be row-contiguous (never copied), and each evaluation's launches are ordered after the
  // previous writer of the buffer, so that calls sharing one never overlap.
  std::vector<int> state;
  std::vector<Buffer> outputs;
  // (output, input) pairs: the output starts holding the input's values, so launches may update it
  // in place. The output takes over the input's buffer where MLX allows it (the input is donatable:
  // no other array holds it, as MLX's own element-wise kernels check), else gets a copy of it; the
  // caller's arrays are never written. Same dtype and element count. Launches read the output, not
  // the input: once taken over, the input's buffer is the output's.
  std::vector<std::pair<int, int>> initial;
  std::vector<Buffer> scratch;
  std::vector<Launch> launches;
  // (launch, input) pairs: the launch waits for the input's writer without reading the input (its
  // graph node comes after that writer's, as if it read it). For ordering only: which kernel reaches
  // the GPU's cores first when MLX's graph could start both at once.
  std::vector<std::pair<int, int>> after;
  // Outputs, scratch and input copies from our device memory pool (device_memory.h); false: MLX's
  // allocator (unified memory), for A/B runs.
  bool pooled = true;
  // After encoding, launch what MLX's encoder holds (CommandEncoder::commit) when its stream has no
  // work left (the GPU waits for the host), instead of waiting for MLX's node count
  // (MLX_MAX_OPS_PER_BUFFER); then again, ahead of the GPU, at the 1st, 3rd, 7th, 15th... such chain
  // after it. A blocking step then starts its GPU after its first chain, and each graph is encoded
  // while the GPU runs the ones before; false: MLX decides alone.
  bool commit_when_idle = false;
  // With commit_when_idle: the chain that finds the GPU idle before it encodes anything, and the next
  // direct_when_idle - 1 such chains after it, launch their kernels straight onto MLX's stream
  // (cuLaunchKernel) instead of adding graph nodes, after launching what the encoder holds so that
  // stream order keeps MLX's order. The GPU then starts without a graph's update and launch on the
  // host's path; the ahead schedule goes on counting from there. 0: graph nodes always.
  int direct_when_idle = 0;

  // Checks every index and size, that no launch writes an input other than a state input, that
  // every output is written, that no scratch buffer is read before a launch writes it, that each
  // initial pair names an output once and an input of the output's dtype (and element count, when
  // input shapes are given) and that each after pair names a launch and an input; throws
  // std::invalid_argument naming what is wrong.
  void validate() const;
};

// How chains' outputs with initial values (ChainSpec::initial) got them, since the process started.
struct InitialStats {
  size_t donated;  // took over the input's buffer
  size_t copied;   // a copy of the input (another array held it, or it was not row-contiguous)
};

InitialStats initial_stats();

// Graphs chains launched for the GPU (ChainSpec::commit_when_idle) since the process started.
struct IdleCommits {
  size_t idle;    // the GPU had no work left
  size_t ahead;   // the GPU was busy, at the 1st, 3rd, 7th... such chain after one found it idle
  size_t direct;  // chains launched straight onto the stream (ChainSpec::direct_when_idle)
};

IdleCommits idle_commits();

// Spins (cuStreamQuery in a loop) until the default GPU stream's encoder has no work left on its stream,
// then returns; what MLX has encoded but not launched is not waited for. A stream error ends the spin:
// MLX reports it at the evaluation's own wait. Returns the polls made.
size_t spin_until_idle();

class KernelChain : public mx::Primitive {
 public:
  KernelChain(mx::Stream stream, std::shared_ptr<const ChainSpec> spec)
      : mx::Primitive(stream), spec_(std::move(spec)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return spec_->name.c_str(); }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  std::shared_ptr<const ChainSpec> spec_;
};

// Compiles and loads the strided-copy kernels for the current device now (on the caller's thread,
// so that eval_gpu never compiles); idempotent.
void prepare_copy_kernels();

// The chain's outputs over `inputs` (lazy). Throws std::invalid_argument when the inputs do not
// match the spec (count, dtypes, shapes) or the default device is not a GPU.
std::vector<mx::array> run_chain(const std::shared_ptr<const ChainSpec>& spec, const std::vector<mx::array>& inputs);

}  // namespace metal_attn_cuda
