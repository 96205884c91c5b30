// metal-attn CUDA ops: device memory for a chain's outputs, scratch and input copies.
//
// MLX's CUDA allocator hands `mlx::core::allocator::malloc` unified (managed) memory. When its buffer
// cache answers such a request with a buffer that one of MLX's own kernels allocated in device memory,
// it first moves that buffer into new unified memory with a synchronous cudaMemcpy, which waits for
// everything queued on the GPU: the multi-millisecond stalls of queued calls (thirty-second session,
// docs/cuda-ops.md). MLX's own kernels allocate stream-ordered device memory instead, through a
// function libmlx.so does not export. So a chain takes its buffers from a CUDA memory pool of ours,
// stream-ordered like MLX's (cuMemAllocFromPoolAsync), and MLX never moves them unless the host reads
// one (then the buffer is MLX's unified memory, and its release frees that). A released buffer is
// freed (cuMemFreeAsync) only once every command that could read it has completed, and only on the
// thread that evaluates chains (device_memory.cpp says why).
#pragma once

#include <cuda.h>

#include <cstddef>

#include "mlx/allocator.h"
#include "mlx/backend/cuda/device.h"

namespace metal_attn_cuda {

namespace mx = mlx::core;

// `bytes` of device memory ordered on `enc`'s stream, as MLX array data. Released buffers go back
// to the pool from a completion handler of a later command (see device_memory.cpp). Falls back to
// MLX's allocator (unified memory) when the pool cannot grow (out of device memory) after trimming
// its idle memory.
mx::allocator::Data device_data(size_t bytes, mx::cu::CommandEncoder& enc);

struct PoolStats {
  size_t live_bytes;      // held by arrays now
  size_t live_buffers;
  size_t reserved_bytes;  // the pool's device memory, idle included
  size_t allocations;     // buffers handed out since the process started
  size_t moved_by_mlx;    // of them, moved into unified memory by MLX (the host read them)
  size_t fallbacks;       // requests the pool could not serve (MLX's allocator took them)
};

PoolStats pool_stats();

// Frees the buffers released since the last chain ran and returns the pool's idle device memory to
// the driver (cuMemPoolTrimTo); memory held by arrays stays. Call it with the GPU idle
// (mx.synchronize() first: metal_attn.cuda_ops.trim_pool does).
void trim_pool();

}  // namespace metal_attn_cuda
