// A small persistent worker pool for the CPU kernels.
//
// MLX evaluates CPU primitives on one scheduler thread per stream, so a kernel
// that wants every core starts its own workers. Workers are created on first
// use (grown, never shrunk), sleep on a condition variable between jobs, and
// take items from a shared atomic counter (dynamic scheduling: items should be
// ordered most expensive first). The calling thread works too, as thread 0.
//
// Safety: jobs from several callers (two streams evaluated from two Python
// threads) are serialised; an exception thrown by an item stops the job and is
// rethrown to the caller once every worker has left it (never std::terminate);
// fork() waits for a running job to finish, and the child starts with a fresh
// pool (its copy of the parent's workers does not exist).
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
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
  // callers are serialised. Returns after every item finished; rethrows the
  // first exception an item threw (the remaining items are then skipped).
  // If the system refuses new threads, the job runs on the threads it has.
  void run(int num_threads, int num_items, const std::function<void(int, int)>& fn);

  // Threads the hardware offers (at least 1).
  static int hardware_threads();

 private:
  ThreadPool() = default;
  void worker_loop(int worker_id);
  void work(int thread_id);
  static void before_fork();
  static void after_fork_in_parent();
  static void after_fork_in_child();

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
  std::exception_ptr error_;  // first exception of the current job
};

}  // namespace metal_attn_native
