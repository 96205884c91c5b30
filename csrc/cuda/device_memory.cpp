// metal-attn CUDA ops: device memory for chains (see device_memory.h).
#include "device_memory.h"

#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "jit.h"
#include "mlx/backend/cuda/allocator.h"
#include "mlx/backend/cuda/device.h"

namespace metal_attn_cuda {

namespace {

// The driver entry points the pool needs, resolved from the driver libmlx.so loaded.
struct PoolDriver {
  CUresult (*ctx_device)(CUdevice*);
  CUresult (*pool_create)(CUmemoryPool*, const CUmemPoolProps*);
  CUresult (*pool_set)(CUmemoryPool, CUmemPool_attribute, void*);
  CUresult (*pool_get)(CUmemoryPool, CUmemPool_attribute, void*);
  CUresult (*pool_trim)(CUmemoryPool, size_t);
  CUresult (*alloc)(CUdeviceptr*, size_t, CUmemoryPool, CUstream);
  CUresult (*free_async)(CUdeviceptr, CUstream);
  CUresult (*pointer_attribute)(void*, CUpointer_attribute, CUdeviceptr);
  CUresult (*free)(CUdeviceptr);
  CUresult (*free_host)(void*);
};

template <typename F>
void bind(F& fn, const char* symbol) {
  fn = reinterpret_cast<F>(driver_symbol(symbol));
}

const PoolDriver& api() {
  static PoolDriver d = [] {
    PoolDriver a{};
    bind(a.ctx_device, "cuCtxGetDevice");
    bind(a.pool_create, "cuMemPoolCreate");
    bind(a.pool_set, "cuMemPoolSetAttribute");
    bind(a.pool_get, "cuMemPoolGetAttribute");
    bind(a.pool_trim, "cuMemPoolTrimTo");
    bind(a.alloc, "cuMemAllocFromPoolAsync");
    bind(a.free_async, "cuMemFreeAsync");
    bind(a.pointer_attribute, "cuPointerGetAttribute");
    bind(a.free, "cuMemFree_v2");
    bind(a.free_host, "cuMemFreeHost");
    return a;
  }();
  return d;
}

// One pool for the process's device (MLX's CUDA backend drives one), created on first use; it keeps freed memory for reuse (release threshold: never) until trim_pool.
struct Pool {
  CUmemoryPool handle = nullptr;
  int device = -1;
};

std::once_flag pool_once;
Pool pool;
std::atomic<size_t> live_bytes{0}, live_buffers{0}, allocations{0}, moved_by_mlx{0}, fallbacks{0};

const Pool& the_pool() {
  std::call_once(pool_once, [] {
    const PoolDriver& d = api();
    CUdevice dev = 0;
    check_cu(d.ctx_device(&dev), "cuCtxGetDevice (no current CUDA context: run an MLX GPU op first)");
    CUmemPoolProps props{};
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = dev;
    check_cu(d.pool_create(&pool.handle, &props), "cuMemPoolCreate");
    cuuint64_t keep = UINT64_MAX;
    check_cu(d.pool_set(pool.handle, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep), "cuMemPoolSetAttribute");
    pool.device = static_cast<int>(dev);
  });
  return pool;
}

// A buffer MLX let go of, waiting to go back to the pool. MLX drops an array as soon as the last
// operation reading it is encoded, which can be before that operation's graph is launched. So a
// released buffer is first `pending`; the next chain call hangs the pending batch on a completion
// handler of its command, which moves it to `ready` once every reader has run; a later chain call
// frees the ready ones. Every driver call is made on the thread that evaluates chains, outside any
// stream capture: MLX captures cuDNN and cuBLAS work on its stream, and a free issued from its
// worker thread could land inside a capture. (A reader on another stream is not waited for; MLX's
// own buffer cache makes the same assumption.)
struct Released {
  void* data;
  size_t size;
  bool device;  // false: MLX moved it into unified memory (the host read it)
};

std::mutex released_mutex;
std::vector<Released> pending, ready;

void free_now(const Released& r, CUstream stream) {
  const PoolDriver& d = api();
  if (r.device) {
    check_cu(d.free_async(reinterpret_cast<CUdeviceptr>(r.data), stream), "cuMemFreeAsync");
    return;
  }
  // Unified memory MLX allocated when it moved the buffer (and freed our device memory itself):
  // managed memory, or pinned host memory where managed memory is missing.
  unsigned managed = 0;
  check_cu(d.pointer_attribute(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, reinterpret_cast<CUdeviceptr>(r.data)),
           "cuPointerGetAttribute");
  check_cu(managed ? d.free(reinterpret_cast<CUdeviceptr>(r.data)) : d.free_host(r.data),
           managed ? "cuMemFree" : "cuMemFreeHost");
}

// The ready and the pending buffers, both lists emptied under one lock.
std::pair<std::vector<Released>, std::vector<Released>> take_released() {
  std::pair<std::vector<Released>, std::vector<Released>> out;
  std::lock_guard<std::mutex> lock(released_mutex);
  out.first.swap(ready);
  out.second.swap(pending);
  return out;
}

// The deleter of our array data: called when the last array holding the buffer lets go of it, on
// whichever thread that is. No exception may leave it, and it makes no driver call.
// The buffer is MLX's CudaBuffer (data, size, device), as MLX's own allocator makes them.
void release(mx::allocator::Buffer b) noexcept {
  auto* buf = static_cast<mx::cu::CudaBuffer*>(b.ptr());
  const bool device = buf->device >= 0;
  if (!device) moved_by_mlx.fetch_add(1);
  if (buf->data != nullptr) {
    std::lock_guard<std::mutex> lock(released_mutex);
    pending.push_back({buf->data, buf->size, device});
  }
  live_bytes.fetch_sub(buf->size);
  live_buffers.fetch_sub(1);
  delete buf;
}

}  // namespace

mx::allocator::Data device_data(size_t bytes, mx::cu::CommandEncoder& enc) {
  const Pool& p = the_pool();
  const PoolDriver& d = api();
  CUstream stream = static_cast<cudaStream_t>(enc.stream());
  auto [ready_now, batch] = take_released();
  for (const Released& r : ready_now) free_now(r, stream);
  if (!batch.empty()) {
    enc.add_completed_handler([batch = std::move(batch)]() mutable {
      std::lock_guard<std::mutex> lock(released_mutex);
      ready.insert(ready.end(), batch.begin(), batch.end());
    });
  }
  const size_t size = bytes == 0 ? 1 : bytes;
  CUdeviceptr ptr = 0;
  CUresult r = d.alloc(&ptr, size, p.handle, stream);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) {
    d.pool_trim(p.handle, 0);
    r = d.alloc(&ptr, size, p.handle, stream);
  }
  if (r == CUDA_ERROR_OUT_OF_MEMORY) {
    fallbacks.fetch_add(1);
    return mx::allocator::malloc(bytes);
  }
  check_cu(r, "cuMemAllocFromPoolAsync(" + std::to_string(size) + " bytes)");
  auto* buf = new mx::cu::CudaBuffer{reinterpret_cast<void*>(ptr), size, p.device};
  live_bytes.fetch_add(size);
  live_buffers.fetch_add(1);
  allocations.fetch_add(1);
  return mx::allocator::Data(mx::allocator::Buffer(buf), release);
}

PoolStats pool_stats() {
  PoolStats s{live_bytes.load(), live_buffers.load(), 0, allocations.load(), moved_by_mlx.load(), fallbacks.load()};
  if (pool.handle != nullptr) {
    cuuint64_t reserved = 0;
    check_cu(api().pool_get(pool.handle, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved), "cuMemPoolGetAttribute");
    s.reserved_bytes = static_cast<size_t>(reserved);
  }
  return s;
}

void trim_pool() {
  if (pool.handle == nullptr) return;
  auto [ready_now, waiting] = take_released();
  for (const Released& r : ready_now) free_now(r, nullptr);
  for (const Released& r : waiting) free_now(r, nullptr);
  check_cu(api().pool_trim(pool.handle, 0), "cuMemPoolTrimTo");
}

}  // namespace metal_attn_cuda
