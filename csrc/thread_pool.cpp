#include "thread_pool.h"

#include <pthread.h>

namespace metal_attn_native {

namespace {
// The current pool; replaced (the old one leaked) in a forked child.
std::atomic<ThreadPool*> g_pool{nullptr};
std::once_flag g_pool_once;
}  // namespace

ThreadPool& ThreadPool::instance() {
  std::call_once(g_pool_once, [] {
    g_pool.store(new ThreadPool(), std::memory_order_release);  // intentionally leaked
    pthread_atfork(&ThreadPool::before_fork, &ThreadPool::after_fork_in_parent, &ThreadPool::after_fork_in_child);
  });
  return *g_pool.load(std::memory_order_acquire);
}

// fork() with a job in flight would leave the child a pool whose mutexes are
// held by threads that do not exist there: the forking thread waits for the
// job, holds both locks across the fork, and the child replaces the pool.
void ThreadPool::before_fork() {
  ThreadPool* p = g_pool.load(std::memory_order_acquire);
  p->run_mutex_.lock();
  p->mutex_.lock();
}

void ThreadPool::after_fork_in_parent() {
  ThreadPool* p = g_pool.load(std::memory_order_acquire);
  p->mutex_.unlock();
  p->run_mutex_.unlock();
}

void ThreadPool::after_fork_in_child() {
  // The old pool (locked mutexes, handles of threads that are gone) is leaked;
  // destroying it would touch state owned by the parent's threads.
  g_pool.store(new ThreadPool(), std::memory_order_release);
}

int ThreadPool::hardware_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void ThreadPool::work(int thread_id) {
  for (;;) {
    int item = next_.fetch_add(1, std::memory_order_relaxed);
    if (item >= num_items_) return;
    try {
      (*fn_)(item, thread_id);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      next_.store(num_items_, std::memory_order_relaxed);  // skip the rest
      return;
    }
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
  int helpers = num_threads - 1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (static_cast<int>(workers_.size()) < helpers) {
      int id = static_cast<int>(workers_.size());
      try {
        workers_.emplace_back([this, id] { worker_loop(id); });
      } catch (...) {
        break;  // no more threads (std::system_error) or memory: run on those there are
      }
      workers_.back().detach();
    }
    if (helpers > static_cast<int>(workers_.size())) helpers = static_cast<int>(workers_.size());
    fn_ = &fn;
    num_items_ = num_items;
    next_.store(0, std::memory_order_relaxed);
    active_workers_ = helpers;
    pending_ = helpers;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  work(0);
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    fn_ = nullptr;
    error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace metal_attn_native
