// A small persistent worker pool for the CPU kernels.
//
// MLX evaluates CPU primitives on one scheduler thread, so a kernel that wants
// every core starts its own workers. Workers are created on first use (grown,
// never shrunk), sleep on a condition variable between jobs, and take items
// from a shared atomic counter (dynamic scheduling: items should be ordered
// most expensive first). The calling thread works too, as thread 0.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace metal_attn_native {

class ThreadPool {
 public:
  // The process-wide pool (never destroyed: workers must not be joined at exit).
  static ThreadPool& instance();

  // Run fn(item, thread_id) for item in [0, num_items) on up to num_threads
  // threads (thread ids 0..num_threads-1; the caller is 0). Jobs from several
  // callers are serialised. Returns after every item finished.
  void run(int num_threads, int num_items, const std::function<void(int, int)>& fn);

  // Threads the hardware offers (at least 1).
  static int hardware_threads();

 private:
  ThreadPool() = default;
  void worker_loop(int worker_id);
  void work(int thread_id);

  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* fn_ = nullptr;
  std::atomic<int> next_{0};
  int num_items_ = 0;
  int active_workers_ = 0;  // workers taking part in the current job
  int pending_ = 0;         // workers still busy with the current job
  unsigned long generation_ = 0;
  long owner_pid_ = -1;  // process that started workers_
};

}  // namespace metal_attn_native
