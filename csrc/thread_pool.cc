// Blocking thread pool for the core's kernels; see thread_pool.h for why it
// sleeps instead of spinning.
#include "thread_pool.h"

#include "float_mode.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <system_error>

#if defined(__linux__)
#include <sched.h>
#endif
#if !defined(_WIN32)
#include <pthread.h>
#include <unistd.h>
#endif

namespace shardadam {
namespace internal {
namespace {

// The global pool and the process it belongs to. Both are plain pointers /
// ids so that a forked child can simply abandon the parent's pool: its mutexes
// may have been held by threads that do not exist in the child.
std::atomic<ThreadPool*> g_pool{nullptr};
#if !defined(_WIN32)
std::atomic<pid_t> g_pool_pid{0};
#endif
std::mutex* g_create_mutex = new std::mutex;

#if !defined(_WIN32)
void ForgetPoolInChild() {
  g_pool.store(nullptr);  // leaked on purpose: see above
  g_create_mutex = new std::mutex;
}
#endif

}  // namespace

ThreadPool& ThreadPool::Global() {
#if !defined(_WIN32)
  static const bool registered = [] {
    pthread_atfork(nullptr, nullptr, ForgetPoolInChild);
    return true;
  }();
  (void)registered;
  const pid_t pid = getpid();
  ThreadPool* pool = g_pool.load(std::memory_order_acquire);
  if (pool != nullptr && g_pool_pid.load(std::memory_order_acquire) == pid) {
    return *pool;
  }
  std::lock_guard<std::mutex> lock(*g_create_mutex);
  pool = g_pool.load(std::memory_order_acquire);
  if (pool == nullptr || g_pool_pid.load(std::memory_order_acquire) != pid) {
    pool = new ThreadPool;  // never deleted
    g_pool_pid.store(pid, std::memory_order_release);
    g_pool.store(pool, std::memory_order_release);
  }
  return *pool;
#else
  static ThreadPool* pool = new ThreadPool;  // never deleted
  return *pool;
#endif
}

void ThreadPool::Run(int num_threads, const std::function<void(int)>& body) {
  num_threads = std::clamp(num_threads, 1, kMaxThreads);
  if (num_threads == 1) {
    body(0);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  int helpers = num_threads - 1;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    while (static_cast<int>(workers_.size()) < helpers) {
      const int index = static_cast<int>(workers_.size());
      try {
        workers_.emplace_back([this, index] { WorkerLoop(index); });
      } catch (const std::system_error&) {
        break;  // out of threads: run with the workers we have
      }
    }
    helpers = std::min(helpers, static_cast<int>(workers_.size()));
    if (helpers == 0) {
      lock.unlock();
      body(0);
      return;
    }
    body_ = &body;
    active_ = helpers;
    pending_ = helpers;
    ++generation_;
  }
  wake_.notify_all();
  std::exception_ptr error;
  try {
    body(0);
  } catch (...) {
    error = std::current_exception();  // rethrown once the workers are done with body
  }
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [this] { return pending_ == 0; });
  body_ = nullptr;
  active_ = 0;
  if (!error) error = error_;
  error_ = nullptr;
  if (error) std::rethrow_exception(error);
}

void ThreadPool::WorkerLoop(int worker) {
  // For the worker's lifetime: its results must not depend on the mode of the
  // thread that happened to start it.
  const ScopedIeeeFloatMode ieee;
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    // A job is ours if it is new and asks for at least worker + 1 helpers.
    // Run waits for every helper it asked for, so no job can be skipped.
    wake_.wait(lock, [&] { return generation_ != seen && worker < active_; });
    seen = generation_;
    const std::function<void(int)>* body = body_;
    lock.unlock();
    std::exception_ptr error;
    try {
      (*body)(worker + 1);
    } catch (...) {
      error = std::current_exception();  // the job's caller rethrows it
    }
    lock.lock();
    if (error && !error_) error_ = error;
    if (--pending_ == 0) done_.notify_one();
  }
}

int HardwareThreads() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int count = CPU_COUNT(&set);
    if (count > 0) return count;
  }
#endif
  const unsigned count = std::thread::hardware_concurrency();
  return count > 0 ? static_cast<int>(count) : 1;
}

}  // namespace internal
}  // namespace shardadam
