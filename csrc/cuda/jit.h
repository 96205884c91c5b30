// metal-attn CUDA ops: run-time compilation (NVRTC) and loading (the driver API) of kernel texts.
//
// Neither library is linked: libmlx.so has already loaded both into the process when this module
// is imported after mlx.core, and they are opened by their sonames, so the same copies are used.
#pragma once

#include <cuda.h>

#include <string>
#include <utility>
#include <vector>

namespace metal_attn_cuda {

// NVRTC's version (major, minor) as the loaded library reports it.
std::pair<int, int> nvrtc_version();

// Compile `source` (file name `name`.cu) with `options` to a cubin; `name_expressions` are the
// kernels' qualified names, returned lowered (mangled) in the same order. Throws
// std::runtime_error with NVRTC's log on failure.
std::pair<std::string, std::vector<std::string>> compile_cubin(
    const std::string& name, const std::string& source, const std::vector<std::string>& name_expressions,
    const std::vector<std::string>& options);

// Load `image` (a cubin or PTX) into the current context and return its functions `symbols`.
// The module stays loaded for the process's life.
std::vector<CUfunction> load_functions(const std::string& image, const std::vector<std::string>& symbols);

// A symbol of the CUDA driver library (the copy libmlx.so loaded); throws std::runtime_error naming
// it when the driver lacks it.
void* driver_symbol(const char* symbol);

// Throws std::runtime_error("metal_attn._cuda_ops: <what>: <the driver's message>") unless `r` is
// CUDA_SUCCESS.
void check_cu(CUresult r, const std::string& what);

// The architecture option NVRTC needs for the current device ("sm_90a" on an H100/H200).
std::string device_architecture();

}  // namespace metal_attn_cuda
