// A small persistent thread pool whose idle workers sleep on a condition
// variable. PyTorch wheels bundle their own OpenMP runtime, whose threads spin
// for a while after each parallel region; a second pool that also spun would
// steal those cores, so ours blocks instead and wakes only the workers a job
// asks for.
#ifndef SHARDADAM_THREAD_POOL_H_
#define SHARDADAM_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace shardadam {
namespace internal {

class ThreadPool {
 public:
  // Most threads one job may use; larger requests are clamped (results never
  // depend on the thread count, only speed does).
  static constexpr int kMaxThreads = 256;

  // The process-wide pool: created on first use, never destroyed (workers
  // blocked at exit must not run destructors), and recreated in a forked
  // child, which inherits the pool's memory but none of its threads.
  static ThreadPool& Global();

  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Calls body(i) for every i in [0, num_threads): i == 0 on the calling
  // thread, the others on pool workers (started on demand). Returns once every
  // call has returned, then rethrows the first exception a call threw (the
  // caller's first: a scratch allocation's std::bad_alloc), as the OpenMP team
  // does. Concurrent Run calls are serialised. `body` must not call Run.
  // Workers compute in the IEEE mode of float_mode.h,
  // set once when each starts, whatever the mode of the thread that started it;
  // the calling thread's share runs in the caller's mode (the core's entry
  // points set it).
  void Run(int num_threads, const std::function<void(int)>& body);

 private:
  void WorkerLoop(int worker);

  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;      // guards everything below
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int)>* body_ = nullptr;
  uint64_t generation_ = 0;  // bumped for every job
  int active_ = 0;           // workers [0, active_) take part in the job
  int pending_ = 0;          // of those, how many have not finished yet
  std::exception_ptr error_;  // the first a worker's call threw in this job
  std::vector<std::thread> workers_;
};

// Hardware threads this process may run on (its CPU affinity mask where the
// OS reports one), at least 1.
int HardwareThreads();

}  // namespace internal
}  // namespace shardadam

#endif  // SHARDADAM_THREAD_POOL_H_
