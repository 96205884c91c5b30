// metal-attn CUDA ops: KernelChain (see kernel_chain.h).
#include "kernel_chain.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "device_memory.h"
#include "jit.h"
#include "mlx/allocator.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"

namespace metal_attn_cuda {

namespace {

constexpr int kMaxCopyDims = 8;

// Kernel arguments of the strided copy, passed by value.
struct CopyShape {
  long long size;
  int ndim;
  long long shape[kMaxCopyDims];
  long long strides[kMaxCopyDims];
};

// Copies a strided input into a row-contiguous buffer, as MLX's custom kernels do for inputs
// that are not row-contiguous; one kernel per element size.
constexpr const char* kCopySource = R"(
struct CopyShape { long long size; int ndim; long long shape[8]; long long strides[8]; };
template <typename T>
__device__ void strided_copy(const T* in, T* out, CopyShape s) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < s.size;
       i += (long long)gridDim.x * blockDim.x) {
    long long rest = i, at = 0;
    for (int d = s.ndim - 1; d >= 0; --d) {
      at += (rest % s.shape[d]) * s.strides[d];
      rest /= s.shape[d];
    }
    out[i] = in[at];
  }
}
extern "C" __global__ void ma_copy_1(const unsigned char* in, unsigned char* out, CopyShape s) { strided_copy(in, out, s); }
extern "C" __global__ void ma_copy_2(const unsigned short* in, unsigned short* out, CopyShape s) { strided_copy(in, out, s); }
extern "C" __global__ void ma_copy_4(const unsigned int* in, unsigned int* out, CopyShape s) { strided_copy(in, out, s); }
extern "C" __global__ void ma_copy_8(const unsigned long long* in, unsigned long long* out, CopyShape s) { strided_copy(in, out, s); }
)";

std::atomic<size_t> outputs_donated{0};
std::atomic<size_t> outputs_copied{0};
std::atomic<size_t> commits_when_idle{0};
std::atomic<size_t> commits_ahead{0};
std::atomic<size_t> chains_direct{0};

// Per stream (a stream belongs to the thread that made it): chains with commit_when_idle encoded since
// one last found the GPU idle, or -1 before any did.
thread_local std::unordered_map<int, long long> chains_since_idle;

// Whether the encoder's stream has finished all the work launched on it so far (cuStreamQuery). Any
// answer but success counts as busy: the chain's nodes are already encoded, and launching early is only
// an optimisation, so an error here must not abandon them (MLX reports a stream's errors itself).
bool stream_idle(mx::cu::CommandEncoder& enc) {
  using Query = CUresult (*)(CUstream);
  static const Query query = reinterpret_cast<Query>(driver_symbol("cuStreamQuery"));
  return query(static_cast<cudaStream_t>(enc.stream())) == CUDA_SUCCESS;
}

// One kernel of a chain: a node of MLX's graph, its buffers recorded for MLX's ordering, or (direct)
// launched straight onto the encoder's stream, which the caller has ordered by committing the encoder
// first. A direct launch records nothing: stream order covers every later reader and writer, and MLX's
// completion handler for the primitive (after the next commit) keeps the buffers alive.
void launch_kernel(mx::cu::CommandEncoder& enc, bool direct, CUfunction fn, dim3 grid, dim3 block,
                   void** params) {
  if (!direct) {
    enc.add_kernel_node_raw(fn, grid, block, dim3(1, 1, 1), 0, params);
    return;
  }
  using Launch = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void**, void**);
  static const Launch launch = reinterpret_cast<Launch>(driver_symbol("cuLaunchKernel"));
  CUresult rc = launch(fn, grid.x, grid.y, grid.z, block.x, block.y, block.z, 0,
                       static_cast<cudaStream_t>(enc.stream()), params, nullptr);
  if (rc != CUDA_SUCCESS) {
    throw std::runtime_error("metal_attn._cuda_ops: cuLaunchKernel failed (CUresult " + std::to_string(rc) + ")");
  }
}

size_t element_count(const mx::Shape& shape) {
  size_t count = 1;
  for (auto d : shape) count *= static_cast<size_t>(d);
  return count;
}

// Whether `out` may take over `in`'s buffer as it is: no other array holds it (MLX's own test),
// and its bytes are exactly out's, row-contiguous from the buffer's start.
bool takes_over(const mx::array& in, const mx::array& out) {
  return in.is_donatable() && in.flags().row_contiguous && in.offset() == 0 && in.data_size() == in.size() &&
         in.shape() == out.shape() && in.dtype() == out.dtype();
}

std::once_flag copy_once;
std::vector<CUfunction> copy_fns;

CUfunction copy_function(int itemsize) {
  prepare_copy_kernels();
  switch (itemsize) {
    case 1: return copy_fns[0];
    case 2: return copy_fns[1];
    case 4: return copy_fns[2];
    case 8: return copy_fns[3];
    default: throw std::runtime_error("metal_attn._cuda_ops: no strided copy for items of " + std::to_string(itemsize) + " bytes");
  }
}

// Memory for one of a chain's arrays: from our pool, ordered on the encoder's stream, or MLX's allocator.
mx::allocator::Data chain_data(const ChainSpec& spec, mx::cu::CommandEncoder& enc, size_t bytes) {
  if (!spec.pooled) return mx::allocator::malloc(bytes);
  return device_data(bytes, enc);
}

mx::array allocated(const ChainSpec& spec, mx::cu::CommandEncoder& enc, const mx::Shape& shape, mx::Dtype dtype) {
  mx::array a(shape, dtype, nullptr, {});
  a.set_data(chain_data(spec, enc, a.nbytes()));
  return a;
}

void encode_copy(mx::cu::CommandEncoder& enc, const mx::array& in, const mx::array& out, bool direct) {
  if (in.ndim() > kMaxCopyDims) {
    throw std::runtime_error("metal_attn._cuda_ops: a non-contiguous input of " + std::to_string(in.ndim()) +
                             " dimensions (at most " + std::to_string(kMaxCopyDims) + ")");
  }
  CopyShape s{};
  s.size = static_cast<long long>(in.size());
  s.ndim = static_cast<int>(in.ndim());
  for (int d = 0; d < s.ndim; ++d) {
    s.shape[d] = in.shape(d);
    s.strides[d] = in.strides()[d];
  }
  CUfunction fn = copy_function(static_cast<int>(in.itemsize()));  // before the encoder records anything
  CUdeviceptr src = reinterpret_cast<CUdeviceptr>(mx::gpu_ptr<void>(in));
  CUdeviceptr dst = reinterpret_cast<CUdeviceptr>(mx::gpu_ptr<void>(out));
  void* params[] = {&src, &dst, &s};
  unsigned threads = 256;
  long long blocks = (s.size + threads - 1) / threads;
  if (!direct) {
    enc.set_input_array(in);
    enc.set_output_array(out);
  }
  launch_kernel(enc, direct, fn, dim3(static_cast<unsigned>(std::min<long long>(std::max<long long>(blocks, 1), 65535))),
                dim3(threads), params);
}

// ChainSpec::direct_when_idle, before a chain encodes anything: whether it launches straight onto the
// stream (the GPU is idle, or one of the direct_when_idle - 1 chains after one found it idle). A direct
// chain first commits the encoder, so that what MLX encoded before it runs first.
bool launch_direct(const ChainSpec& spec, mx::cu::CommandEncoder& enc, int stream_index) {
  if (!spec.commit_when_idle || spec.direct_when_idle <= 0) return false;
  long long& since = chains_since_idle.try_emplace(stream_index, -1).first->second;
  if (stream_idle(enc)) {
    since = 0;
    commits_when_idle.fetch_add(1, std::memory_order_relaxed);
  } else if (since >= 0 && since + 1 < spec.direct_when_idle) {
    ++since;
  } else {
    return false;
  }
  enc.commit();
  chains_direct.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// ChainSpec::commit_when_idle, after a chain is encoded: launch what the encoder holds when the GPU
// is idle, and then ahead of it at the 1st, 3rd, 7th, 15th... such chain after that, so that each
// graph is about as long as all those before it and the host encodes the next while the GPU runs them.
void commit_for_the_gpu(mx::cu::CommandEncoder& enc, int stream_index) {
  long long& since = chains_since_idle.try_emplace(stream_index, -1).first->second;
  if (stream_idle(enc)) {
    since = 0;
    enc.commit();
    commits_when_idle.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (since < 0) return;
  ++since;
  if (((since + 1) & since) == 0) {  // since + 1 is a power of two
    enc.commit();
    commits_ahead.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace

void prepare_copy_kernels() {
  std::call_once(copy_once, [] {
    auto [image, lowered] = compile_cubin("ma_strided_copy", kCopySource, {}, {"--gpu-architecture=" + device_architecture()});
    copy_fns = load_functions(image, {"ma_copy_1", "ma_copy_2", "ma_copy_4", "ma_copy_8"});
  });
}

void ChainSpec::validate() const {
  const int n_in = static_cast<int>(input_dtypes.size());
  const int n_out = static_cast<int>(outputs.size());
  const int n = static_cast<int>(input_dtypes.size() + outputs.size() + scratch.size());
  if (!input_shapes.empty() && input_shapes.size() != input_dtypes.size()) {
    throw std::invalid_argument("chain " + name + ": " + std::to_string(input_shapes.size()) + " input shapes for " +
                                std::to_string(input_dtypes.size()) + " inputs (one each, or none)");
  }
  if (outputs.empty()) throw std::invalid_argument("chain " + name + ": outputs is empty (at least one)");
  if (direct_when_idle < 0) {
    throw std::invalid_argument("chain " + name + ": direct_when_idle=" + std::to_string(direct_when_idle) +
                                " (allowed: 0 or more)");
  }
  for (int a : state) {
    if (a < 0 || a >= n_in) {
      throw std::invalid_argument("chain " + name + ": state input " + std::to_string(a) +
                                  " (allowed: input indices 0.." + std::to_string(n_in - 1) + ")");
    }
  }
  auto is_state = [this](int a) { return std::find(state.begin(), state.end(), a) != state.end(); };
  std::vector<bool> has_initial(n_out, false);
  for (const auto& [o, i] : initial) {
    if (o < 0 || o >= n_out || i < 0 || i >= n_in) {
      throw std::invalid_argument("chain " + name + ": initial pair (output " + std::to_string(o) + ", input " +
                                  std::to_string(i) + ") (allowed: outputs 0.." + std::to_string(n_out - 1) +
                                  ", inputs 0.." + std::to_string(n_in - 1) + ")");
    }
    if (has_initial[o]) {
      throw std::invalid_argument("chain " + name + ": output " + std::to_string(o) + " has two initial inputs (at most one)");
    }
    has_initial[o] = true;
    if (input_dtypes[i] != outputs[o].dtype) {
      std::ostringstream msg;
      msg << "chain " << name << ": output " << o << " (" << outputs[o].dtype << ") starts as input " << i << " ("
          << input_dtypes[i] << "); they must have one dtype";
      throw std::invalid_argument(msg.str());
    }
    if (!input_shapes.empty()) {
      if (element_count(input_shapes[i]) != element_count(outputs[o].shape)) {
        throw std::invalid_argument("chain " + name + ": output " + std::to_string(o) + " starts as input " +
                                    std::to_string(i) + ", which has another element count");
      }
    }
  }
  if (launches.empty()) throw std::invalid_argument("chain " + name + ": launches is empty (at least one)");
  for (size_t l = 0; l < launches.size(); ++l) {
    const Launch& launch = launches[l];
    if (!launch.function) throw std::invalid_argument("chain " + name + ": launch " + std::to_string(l) + " has no function");
    if (launch.reads < 0 || launch.reads > static_cast<int>(launch.args.size())) {
      throw std::invalid_argument("chain " + name + ": launch " + std::to_string(l) + " reads=" +
                                  std::to_string(launch.reads) + " (allowed: 0.." + std::to_string(launch.args.size()) + ")");
    }
    for (int a : launch.args) {
      if (a < 0 || a >= n) {
        throw std::invalid_argument("chain " + name + ": launch " + std::to_string(l) + " argument " + std::to_string(a) +
                                    " (allowed: buffer indices 0.." + std::to_string(n - 1) + ")");
      }
    }
    for (int i = 0; i < 3; ++i) {
      if (launch.grid[i] == 0 || launch.block[i] == 0) {
        throw std::invalid_argument("chain " + name + ": launch " + std::to_string(l) + " grid (" +
                                    std::to_string(launch.grid[0]) + ", " + std::to_string(launch.grid[1]) + ", " +
                                    std::to_string(launch.grid[2]) + ") block (" + std::to_string(launch.block[0]) +
                                    ", " + std::to_string(launch.block[1]) + ", " + std::to_string(launch.block[2]) +
                                    ") (allowed: every dimension at least 1)");
      }
    }
  }
  for (const auto& [l, i] : after) {
    if (l < 0 || l >= static_cast<int>(launches.size()) || i < 0 || i >= n_in) {
      throw std::invalid_argument("chain " + name + ": after pair (" + std::to_string(l) + ", " + std::to_string(i) +
                                  ") (allowed: a launch index 0.." + std::to_string(launches.size() - 1) +
                                  " and an input index 0.." + std::to_string(n_in - 1) + ")");
    }
  }
  // Data flow: inputs are never written (MLX arrays may share them); scratch is written before it is
  // read; every output is written by some launch.
  std::vector<bool> written(n, false);
  for (size_t l = 0; l < launches.size(); ++l) {
    const Launch& launch = launches[l];
    for (int i = 0; i < launch.reads; ++i) {
      int a = launch.args[i];
      if (a >= n_in + n_out && !written[a]) {
        throw std::invalid_argument("chain " + name + ": launch " + std::to_string(l) + " reads scratch buffer " +
                                    std::to_string(a) + " before any launch writes it");
      }
    }
    for (size_t i = launch.reads; i < launch.args.size(); ++i) {
      int a = launch.args[i];
      if (a < n_in && !is_state(a)) {
        throw std::invalid_argument("chain " + name + ": launch " + std::to_string(l) + " writes input " +
                                    std::to_string(a) + " (allowed: state inputs, outputs and scratch, indices " +
                                    std::to_string(n_in) + ".." + std::to_string(n - 1) + ")");
      }
      written[a] = true;
    }
  }
  for (int o = n_in; o < n_in + n_out; ++o) {
    if (!written[o]) throw std::invalid_argument("chain " + name + ": no launch writes output " + std::to_string(o - n_in));
  }
}

void KernelChain::eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("metal_attn._cuda_ops: " + spec_->name + " runs on the GPU only");
}

bool KernelChain::is_equivalent(const mx::Primitive& other) const {
  auto* o = dynamic_cast<const KernelChain*>(&other);
  return o != nullptr && o->spec_ == spec_;
}

void KernelChain::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const ChainSpec& spec = *spec_;
  auto& enc = mx::cu::get_command_encoder(stream());
  const bool direct = launch_direct(spec, enc, stream().index);
  for (int a : spec.state) {
    if (!inputs[a].flags().row_contiguous) {
      throw std::invalid_argument("chain " + spec.name + ": state input " + std::to_string(a) +
                                  " is not row-contiguous (it is updated in place, so it is never copied)");
    }
  }
  // Outputs first: an output takes over an input's buffer only while no other array (buffers
  // included) holds the input.
  for (size_t o = 0; o < outputs.size(); ++o) {
    mx::array& out = outputs[o];
    int from = -1;  // the input it starts as (validate() allows one), if any
    for (const auto& [io, ii] : spec.initial) {
      if (io == static_cast<int>(o)) from = ii;
    }
    if (from >= 0 && takes_over(inputs[from], out)) {
      out.copy_shared_buffer(inputs[from]);
      outputs_donated.fetch_add(1, std::memory_order_relaxed);
    } else {
      out.set_data(chain_data(spec, enc, out.nbytes()));
      if (from >= 0) {  // run_chain checked the element counts
        encode_copy(enc, inputs[from], out, direct);
        outputs_copied.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  std::vector<mx::array> buffers;
  buffers.reserve(inputs.size() + outputs.size() + spec.scratch.size());
  for (const auto& in : inputs) {
    if (in.flags().row_contiguous) {
      buffers.push_back(in);
    } else {
      mx::array c = allocated(spec, enc, in.shape(), in.dtype());
      encode_copy(enc, in, c, direct);
      enc.add_temporary(c);
      buffers.push_back(c);
    }
  }
  for (const auto& out : outputs) buffers.push_back(out);
  for (const auto& b : spec.scratch) {
    mx::array t = allocated(spec, enc, b.shape, b.dtype);
    enc.add_temporary(t);
    buffers.push_back(t);
  }
  std::vector<CUdeviceptr> pointers;
  std::vector<void*> params;
  for (size_t l = 0; l < spec.launches.size(); ++l) {
    const Launch& launch = spec.launches[l];
    const size_t n = launch.args.size();
    pointers.resize(n);
    params.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const mx::array& b = buffers[launch.args[i]];
      pointers[i] = reinterpret_cast<CUdeviceptr>(mx::gpu_ptr<void>(b));
      params[i] = &pointers[i];
      if (direct) continue;
      if (static_cast<int>(i) < launch.reads) {
        enc.set_input_array(b);
      } else {
        enc.set_output_array(b);  // also a dependency on the buffer's last writer (a state input's)
      }
    }
    if (!direct) {  // stream order already puts a direct launch after every writer
      for (const auto& [al, ai] : spec.after) {
        if (al == static_cast<int>(l)) enc.set_input_array(buffers[ai]);
      }
    }
    launch_kernel(enc, direct, launch.function, dim3(launch.grid[0], launch.grid[1], launch.grid[2]),
                  dim3(launch.block[0], launch.block[1], launch.block[2]), params.data());
  }
  if (spec.commit_when_idle && !direct) commit_for_the_gpu(enc, stream().index);
}

IdleCommits idle_commits() {
  return {commits_when_idle.load(std::memory_order_relaxed), commits_ahead.load(std::memory_order_relaxed),
          chains_direct.load(std::memory_order_relaxed)};
}

size_t spin_until_idle() {
  using Query = CUresult (*)(CUstream);
  static const Query query = reinterpret_cast<Query>(driver_symbol("cuStreamQuery"));
  auto& enc = mx::cu::get_command_encoder(mx::default_stream(mx::default_device()));
  const auto stream = static_cast<cudaStream_t>(enc.stream());
  size_t polls = 1;
  while (query(stream) == CUDA_ERROR_NOT_READY) ++polls;
  return polls;
}

InitialStats initial_stats() {
  return {outputs_donated.load(std::memory_order_relaxed), outputs_copied.load(std::memory_order_relaxed)};
}

std::vector<mx::array> run_chain(const std::shared_ptr<const ChainSpec>& spec, const std::vector<mx::array>& inputs) {
  if (inputs.size() != spec->input_dtypes.size()) {
    throw std::invalid_argument("chain " + spec->name + ": " + std::to_string(inputs.size()) + " inputs (it takes " +
                                std::to_string(spec->input_dtypes.size()) + ")");
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].dtype() != spec->input_dtypes[i]) {
      std::ostringstream msg;
      msg << "chain " << spec->name << ": input " << i << " has dtype " << inputs[i].dtype() << " (it was built for "
          << spec->input_dtypes[i] << ")";
      throw std::invalid_argument(msg.str());
    }
    if (!spec->input_shapes.empty() && inputs[i].shape() != spec->input_shapes[i]) {
      std::ostringstream msg;
      msg << "chain " << spec->name << ": input " << i << " has shape " << inputs[i].shape()
          << " (it was built for " << spec->input_shapes[i] << ")";
      throw std::invalid_argument(msg.str());
    }
  }
  for (const auto& [o, i] : spec->initial) {
    const size_t count = element_count(spec->outputs[o].shape);
    if (inputs[i].size() != count) {
      throw std::invalid_argument("chain " + spec->name + ": output " + std::to_string(o) + " starts as input " +
                                  std::to_string(i) + ", which has " + std::to_string(inputs[i].size()) +
                                  " elements (the output has " + std::to_string(count) + ")");
    }
  }
  auto stream = mx::default_stream(mx::default_device());
  if (stream.device != mx::Device::gpu) {
    throw std::invalid_argument("chain " + spec->name + ": the default device is the CPU (it runs on the GPU)");
  }
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (const auto& b : spec->outputs) {
    shapes.push_back(b.shape);
    dtypes.push_back(b.dtype);
  }
  return mx::array::make_arrays(std::move(shapes), dtypes, std::make_shared<KernelChain>(stream, spec), inputs);
}

}  // namespace metal_attn_cuda
