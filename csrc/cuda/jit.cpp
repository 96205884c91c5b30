// metal-attn CUDA ops: NVRTC and driver entry points resolved at run time (see jit.h).
#include "jit.h"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>

namespace metal_attn_cuda {

namespace {

// NVRTC's C API, declared here: its header is not part of the toolkit's runtime wheels.
using nvrtcResult = int;
using nvrtcProgram = struct _nvrtcProgram*;

struct Nvrtc {
  nvrtcResult (*version)(int*, int*);
  nvrtcResult (*create)(nvrtcProgram*, const char*, const char*, int, const char* const*, const char* const*);
  nvrtcResult (*add_name)(nvrtcProgram, const char*);
  nvrtcResult (*compile)(nvrtcProgram, int, const char* const*);
  nvrtcResult (*log_size)(nvrtcProgram, size_t*);
  nvrtcResult (*log)(nvrtcProgram, char*);
  nvrtcResult (*cubin_size)(nvrtcProgram, size_t*);
  nvrtcResult (*cubin)(nvrtcProgram, char*);
  nvrtcResult (*lowered)(nvrtcProgram, const char*, const char**);
  nvrtcResult (*destroy)(nvrtcProgram*);
  const char* (*error)(nvrtcResult);
};

struct Driver {
  CUresult (*load)(CUmodule*, const void*);
  CUresult (*function)(CUfunction*, CUmodule, const char*);
  CUresult (*error)(CUresult, const char**);
  CUresult (*ctx_device)(CUdevice*);
  CUresult (*attribute)(int*, CUdevice_attribute, CUdevice);
};

void* open_first(const std::vector<const char*>& names, const char* what) {
  for (auto* n : names) {
    // An already loaded copy first (libmlx.so's), then the loader's search path.
    if (void* h = dlopen(n, RTLD_NOW | RTLD_NOLOAD)) return h;
  }
  for (auto* n : names) {
    if (void* h = dlopen(n, RTLD_NOW)) return h;
  }
  throw std::runtime_error(std::string("metal_attn._cuda_ops: cannot open ") + what + " (" + names.front() +
                           "): import mlx.core with its CUDA backend first");
}

template <typename F>
void bind(void* lib, F& fn, const char* symbol) {
  fn = reinterpret_cast<F>(dlsym(lib, symbol));
  if (!fn) throw std::runtime_error(std::string("metal_attn._cuda_ops: missing symbol ") + symbol);
}

const Nvrtc& nvrtc() {
  static Nvrtc api = [] {
    Nvrtc a{};
    void* lib = open_first({"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}, "NVRTC");
    bind(lib, a.version, "nvrtcVersion");
    bind(lib, a.create, "nvrtcCreateProgram");
    bind(lib, a.add_name, "nvrtcAddNameExpression");
    bind(lib, a.compile, "nvrtcCompileProgram");
    bind(lib, a.log_size, "nvrtcGetProgramLogSize");
    bind(lib, a.log, "nvrtcGetProgramLog");
    bind(lib, a.cubin_size, "nvrtcGetCUBINSize");
    bind(lib, a.cubin, "nvrtcGetCUBIN");
    bind(lib, a.lowered, "nvrtcGetLoweredName");
    bind(lib, a.destroy, "nvrtcDestroyProgram");
    bind(lib, a.error, "nvrtcGetErrorString");
    return a;
  }();
  return api;
}

void* driver_library() {
  static void* lib = open_first({"libcuda.so.1", "libcuda.so"}, "the CUDA driver");
  return lib;
}

const Driver& driver() {
  static Driver api = [] {
    Driver a{};
    void* lib = driver_library();
    bind(lib, a.load, "cuModuleLoadData");
    bind(lib, a.function, "cuModuleGetFunction");
    bind(lib, a.error, "cuGetErrorString");
    bind(lib, a.ctx_device, "cuCtxGetDevice");
    bind(lib, a.attribute, "cuDeviceGetAttribute");
    return a;
  }();
  return api;
}

void check_nvrtc(nvrtcResult r, const char* what) {
  if (r != 0) throw std::runtime_error(std::string("metal_attn._cuda_ops: ") + what + ": " + nvrtc().error(r));
}

std::mutex load_mutex;

}  // namespace

void* driver_symbol(const char* symbol) {
  void* fn = nullptr;
  bind(driver_library(), fn, symbol);
  return fn;
}

void check_cu(CUresult r, const std::string& what) {
  if (r != CUDA_SUCCESS) {
    const char* msg = nullptr;
    driver().error(r, &msg);
    throw std::runtime_error("metal_attn._cuda_ops: " + what + ": " + (msg ? msg : "unknown CUDA error"));
  }
}

std::pair<int, int> nvrtc_version() {
  int major = 0, minor = 0;
  check_nvrtc(nvrtc().version(&major, &minor), "nvrtcVersion");
  return {major, minor};
}

std::pair<std::string, std::vector<std::string>> compile_cubin(
    const std::string& name, const std::string& source, const std::vector<std::string>& name_expressions,
    const std::vector<std::string>& options) {
  const Nvrtc& api = nvrtc();
  nvrtcProgram prog = nullptr;
  check_nvrtc(api.create(&prog, source.c_str(), (name + ".cu").c_str(), 0, nullptr, nullptr), "nvrtcCreateProgram");
  struct Free {
    nvrtcProgram* p;
    ~Free() { nvrtc().destroy(p); }
  } free_prog{&prog};
  for (const auto& n : name_expressions) check_nvrtc(api.add_name(prog, n.c_str()), "nvrtcAddNameExpression");
  std::vector<const char*> opts;
  for (const auto& o : options) opts.push_back(o.c_str());
  nvrtcResult r = api.compile(prog, static_cast<int>(opts.size()), opts.data());
  if (r != 0) {
    size_t size = 0;
    api.log_size(prog, &size);
    std::string log(size, '\0');
    if (size) api.log(prog, log.data());
    while (!log.empty() && log.back() == '\0') log.pop_back();
    throw std::runtime_error("metal_attn._cuda_ops: NVRTC could not compile " + name + ": " + log);
  }
  std::vector<std::string> lowered;
  for (const auto& n : name_expressions) {
    const char* low = nullptr;
    check_nvrtc(api.lowered(prog, n.c_str(), &low), "nvrtcGetLoweredName");
    lowered.emplace_back(low);
  }
  size_t size = 0;
  check_nvrtc(api.cubin_size(prog, &size), "nvrtcGetCUBINSize");
  std::string image(size, '\0');
  check_nvrtc(api.cubin(prog, image.data()), "nvrtcGetCUBIN");
  return {std::move(image), std::move(lowered)};
}

std::vector<CUfunction> load_functions(const std::string& image, const std::vector<std::string>& symbols) {
  std::lock_guard<std::mutex> lock(load_mutex);
  CUmodule module = nullptr;
  check_cu(driver().load(&module, image.data()), "cuModuleLoadData");
  std::vector<CUfunction> fns;
  for (const auto& s : symbols) {
    CUfunction f = nullptr;
    check_cu(driver().function(&f, module, s.c_str()), "cuModuleGetFunction(" + s + ")");
    fns.push_back(f);
  }
  return fns;
}

std::string device_architecture() {
  CUdevice dev = 0;
  check_cu(driver().ctx_device(&dev), "cuCtxGetDevice (no current CUDA context: run an MLX GPU op first)");
  int major = 0, minor = 0;
  check_cu(driver().attribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute");
  check_cu(driver().attribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute");
  // Hopper and later take the architecture-specific target ("a"), as MLX's own JIT does.
  return "sm_" + std::to_string(major) + std::to_string(minor) + (major >= 9 ? "a" : "");
}

}  // namespace metal_attn_cuda
