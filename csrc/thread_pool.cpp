#include "thread_pool.h"

#include <unistd.h>

namespace metal_attn_native {

ThreadPool& ThreadPool::instance() {
  static ThreadPool* pool = new ThreadPool();  // intentionally leaked
  return *pool;
}

int ThreadPool::hardware_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void ThreadPool::work(int thread_id) {
  for (;;) {
    int item = next_.fetch_add(1, std::memory_order_relaxed);
    if (item >= num_items_) return;
    (*fn_)(item, thread_id);
  }
}

void ThreadPool::worker_loop(int worker_id) {
  unsigned long seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (worker_id >= active_workers_) continue;
    }
    work(worker_id + 1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::run(int num_threads, int num_items, const std::function<void(int, int)>& fn) {
  if (num_items <= 0) return;
  if (num_threads > num_items) num_threads = num_items;
  if (num_threads <= 1) {
    for (int i = 0; i < num_items; ++i) fn(i, 0);
    return;
  }
  std::lock_guard<std::mutex> job_lock(run_mutex_);
  const int helpers = num_threads - 1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // After fork() the child has none of the parent's workers: start afresh.
    const long pid = static_cast<long>(getpid());
    if (pid != owner_pid_) {
      workers_.clear();  // detached handles only; the threads do not exist here
      owner_pid_ = pid;
    }
    while (static_cast<int>(workers_.size()) < helpers) {
      int id = static_cast<int>(workers_.size());
      workers_.emplace_back([this, id] { worker_loop(id); });
      workers_.back().detach();
    }
    fn_ = &fn;
    num_items_ = num_items;
    next_.store(0, std::memory_order_relaxed);
    active_workers_ = helpers;
    pending_ = helpers;
    ++generation_;
  }
  wake_.notify_all();
  work(0);
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
  fn_ = nullptr;
}

}  // namespace metal_attn_native
