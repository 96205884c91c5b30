// nanobind module metal_attn._cuda_ops (NB_DOMAIN mlx, so mx.array and mx.Dtype cross over):
// compile and load kernel texts, and run chains of them as one MLX primitive on MLX's CUDA backend.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <initializer_list>
#include <tuple>
#include <utility>

#include "device_memory.h"
#include "jit.h"
#include "kernel_chain.h"
#include "mlx/backend/cuda/device.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mac = metal_attn_cuda;
namespace mx = mlx::core;

namespace {

using Dims = std::tuple<unsigned, unsigned, unsigned>;
using BufferSpec = std::pair<std::vector<int>, mx::Dtype>;
using LaunchSpec = std::tuple<uintptr_t, Dims, Dims, std::vector<int>, int>;

void make_current() {
  mx::Device d = mx::default_device();
  if (d.type != mx::Device::gpu) throw std::invalid_argument("metal_attn._cuda_ops: the default device is not a GPU");
  mx::cu::device(d).make_current();
}

std::vector<mac::Buffer> buffers(const std::vector<BufferSpec>& specs) {
  std::vector<mac::Buffer> out;
  for (const auto& [shape, dtype] : specs) out.push_back({mx::Shape(shape.begin(), shape.end()), dtype});
  return out;
}

// A Python dict of named counters.
nb::dict counts(std::initializer_list<std::pair<const char*, size_t>> items) {
  nb::dict d;
  for (const auto& [name, value] : items) d[name] = value;
  return d;
}

struct Chain {
  std::shared_ptr<const mac::ChainSpec> spec;
};

Chain make_chain(const std::string& name, const std::vector<mx::Dtype>& input_dtypes,
                 const std::vector<BufferSpec>& outputs, const std::vector<BufferSpec>& scratch,
                 const std::vector<LaunchSpec>& launches, const std::vector<std::vector<int>>& input_shapes,
                 const std::vector<int>& state, bool pooled, const std::vector<std::pair<int, int>>& initial,
                 bool commit_when_idle, int direct_when_idle, const std::vector<std::pair<int, int>>& after) {
  auto spec = std::make_shared<mac::ChainSpec>();
  spec->name = name;
  spec->input_dtypes = input_dtypes;
  for (const auto& s : input_shapes) spec->input_shapes.emplace_back(s.begin(), s.end());
  spec->state = state;
  spec->pooled = pooled;
  spec->initial = initial;
  spec->commit_when_idle = commit_when_idle;
  spec->direct_when_idle = direct_when_idle;
  spec->after = after;
  spec->outputs = buffers(outputs);
  spec->scratch = buffers(scratch);
  for (const auto& [fn, grid, block, args, reads] : launches) {
    mac::Launch l{};
    l.function = reinterpret_cast<CUfunction>(fn);
    l.grid[0] = std::get<0>(grid), l.grid[1] = std::get<1>(grid), l.grid[2] = std::get<2>(grid);
    l.block[0] = std::get<0>(block), l.block[1] = std::get<1>(block), l.block[2] = std::get<2>(block);
    l.args = args;
    l.reads = reads;
    spec->launches.push_back(std::move(l));
  }
  spec->validate();
  make_current();
  mac::prepare_copy_kernels();  // here, so that evaluating a chain never compiles
  return Chain{std::move(spec)};
}

}  // namespace

NB_MODULE(_cuda_ops, m) {
  m.doc() = "metal-attn CUDA ops: NVRTC-compiled kernel texts run as one MLX primitive per chain of launches.";

  m.def("nvrtc_version", &mac::nvrtc_version, "NVRTC's (major, minor) version.");
  m.def("device_architecture", [] { make_current(); return mac::device_architecture(); },
        "The --gpu-architecture value for the default device (e.g. 'sm_90a').");
  m.def("compile", [](const std::string& name, const std::string& source, const std::vector<std::string>& names,
                      const std::vector<std::string>& options) {
          std::pair<std::string, std::vector<std::string>> got;
          {
            nb::gil_scoped_release unlocked;  // NVRTC takes seconds; Python objects only after it
            got = mac::compile_cubin(name, source, names, options);
          }
          return std::make_pair(nb::bytes(got.first.data(), got.first.size()), got.second);
        },
        "name"_a, "source"_a, "name_expressions"_a, "options"_a,
        "Compile a CUDA source with NVRTC: (cubin bytes, the lowered names of name_expressions).");
  m.def("load", [](nb::bytes image, const std::vector<std::string>& symbols) {
          make_current();
          std::vector<uintptr_t> out;
          for (CUfunction f : mac::load_functions(std::string(image.c_str(), image.size()), symbols)) {
            out.push_back(reinterpret_cast<uintptr_t>(f));
          }
          return out;
        },
        "image"_a, "symbols"_a, "Load a cubin into the GPU's context; its functions' handles, in order.");

  m.def("pool_stats", [] {
          mac::PoolStats s = mac::pool_stats();
          return counts({{"live_bytes", s.live_bytes}, {"live_buffers", s.live_buffers},
                         {"reserved_bytes", s.reserved_bytes}, {"allocations", s.allocations},
                         {"moved_by_mlx", s.moved_by_mlx}, {"fallbacks", s.fallbacks}});
        },
        "The chains' device memory pool: bytes and buffers arrays hold now, the pool's reserved bytes (idle "
        "included), buffers handed out, those MLX moved to unified memory (read by the host), requests MLX's "
        "allocator took (the pool out of memory).");
  m.def("trim_pool", &mac::trim_pool,
        "Free the released buffers and return the chains' pool's idle device memory to the driver; call it with "
        "the GPU idle (metal_attn.cuda_ops.trim_pool synchronizes first).");

  m.def("initial_stats", [] {
          mac::InitialStats s = mac::initial_stats();
          return counts({{"donated", s.donated}, {"copied", s.copied}});
        },
        "Chain outputs given an input's values (Chain's initial) since the process started: those that took over "
        "the input's buffer (donated) and those that got a copy (another array held the input).");

  m.def("idle_commits", [] {
          mac::IdleCommits c = mac::idle_commits();
          return counts({{"idle", c.idle}, {"ahead", c.ahead}, {"direct", c.direct}});
        },
        "Graphs chains launched for the GPU (Chain's commit_when_idle) since the process started: because it had "
        "no work left (idle), and ahead of it at the 1st, 3rd, 7th... such chain after one found it idle (ahead); "
        "and the chains launched straight onto MLX's stream instead (Chain's direct_when_idle; direct).");

  m.def("spin_until_idle", [] {
          make_current();
          nb::gil_scoped_release unlocked;
          return mac::spin_until_idle();
        },
        "Spin until the default GPU stream has no launched work left (cuStreamQuery in a loop, the GIL released); "
        "returns the polls made. Work MLX encoded but did not launch is not waited for: queue it first "
        "(mx.async_eval). A measurement tool: benchmarks/probe_step_wait.py's third wait.");

  nb::class_<Chain>(m, "Chain", "A fixed sequence of kernel launches, run as one MLX primitive.")
      .def(nb::new_(&make_chain), "name"_a, "input_dtypes"_a, "outputs"_a, "scratch"_a, "launches"_a,
           "input_shapes"_a = std::vector<std::vector<int>>{}, "state"_a = std::vector<int>{}, "pooled"_a = true,
           "initial"_a = std::vector<std::pair<int, int>>{}, "commit_when_idle"_a = false, "direct_when_idle"_a = 0,
           "after"_a = std::vector<std::pair<int, int>>{},
           "input_shapes: one per input (checked at each call), or none; outputs and scratch: (shape, dtype) pairs; launches: (function, grid, block, args, reads), grid in "
           "threadgroups, args as buffer indices (inputs, then outputs, then scratch), the first `reads` read; state: the input "
           "indices launches may write in place (row-contiguous buffers they leave as they found them); pooled: outputs, "
           "scratch and input copies in our stream-ordered device memory pool (False: MLX's allocator); initial: (output, "
           "input) pairs, the output starting as the input's values (its buffer where no other array holds it, else a "
           "copy), for launches that update it in place; commit_when_idle: after encoding, launch MLX's encoded graph when its "
           "stream has no work left (the GPU is idle); direct_when_idle: with commit_when_idle, the chain that finds the GPU idle "
           "and the next direct_when_idle - 1 after it launch straight onto MLX's stream, after committing what MLX encoded; "
           "after: (launch, input) pairs, the launch waiting for the input's writer without reading it (ordering only).")
      .def("__call__", [](const Chain& c, const std::vector<mx::array>& inputs) { return mac::run_chain(c.spec, inputs); },
           "inputs"_a, "The chain's outputs over inputs (lazy).")
      .def_prop_ro("name", [](const Chain& c) { return c.spec->name; });
}
