// The persistent thread pool under contention: every worker runs its share,
// jobs of different widths follow each other, and several caller threads
// share the process-wide pool (Run serialises them) while AdamStep runs on
// it. Small sizes on purpose: these tests exist mostly for ThreadSanitizer.
#include "thread_pool.h"

#if !defined(_WIN32)
#include <sys/wait.h>
#include <unistd.h>
#endif

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <new>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "gtest/gtest.h"
#include "reference.h"
#include "shardadam/adam.h"
#include "work_items.h"

namespace shardadam {
namespace {

using internal::ThreadPool;

#if defined(__x86_64__) || defined(__i386__)
TEST(ThreadPoolTest, WorkersComputeInIeeeModeWhateverThreadStartedThem) {
  // A new thread inherits its creator's floating-point mode: workers started
  // from a caller in flush-to-zero / denormals-are-zero mode must still
  // compute in IEEE mode (float_mode.h), while the caller's own share runs in
  // the caller's mode. A pool of its own, so that this call starts its workers
  // (leaked: a ThreadPool's workers are never joined).
  static ThreadPool* const pool = new ThreadPool();
  constexpr unsigned int kFlushBits = 0x8000 | 0x40;  // MXCSR FTZ | DAZ
  const unsigned int saved = _mm_getcsr();
  _mm_setcsr(saved | kFlushBits);
  // Starts at the flush bits, so an index that never ran cannot pass for IEEE.
  std::vector<unsigned int> modes(4, kFlushBits);
  const std::function<void(int)> read = [&](int i) {
    modes[static_cast<size_t>(i)] = _mm_getcsr();
  };
  pool->Run(4, read);
  _mm_setcsr(saved);
  EXPECT_EQ(modes[0] & kFlushBits, kFlushBits) << "the caller's share";
  for (size_t i = 1; i < modes.size(); ++i) {
    EXPECT_EQ(modes[i] & kFlushBits, 0u) << "worker " << i;
  }
}
#endif

TEST(ThreadPoolTest, EveryIndexRunsOncePerJob) {
  // The global pool: a ThreadPool's workers are never joined, so one must
  // not be destroyed.
  ThreadPool& pool = ThreadPool::Global();
  for (int width : {4, 1, 7, 2, 7, 3}) {
    std::vector<int> hits(static_cast<size_t>(width), 0);
    const std::function<void(int)> body = [&](int i) { ++hits[static_cast<size_t>(i)]; };
    pool.Run(width, body);
    for (int i = 0; i < width; ++i) EXPECT_EQ(hits[static_cast<size_t>(i)], 1) << i;
  }
}

// A call that throws (a scratch allocation's std::bad_alloc, adam.h) must not
// unwind past the others: Run rethrows it once every call has returned (the
// caller's share first among several), and the pool runs the next job.
TEST(ThreadPoolTest, AThrownExceptionReachesTheCallerOnceEveryCallReturned) {
  ThreadPool& pool = ThreadPool::Global();
  for (int thrower : {0, 2}) {
    std::atomic<int> returned{0};
    std::vector<int> hits(4, 0);
    const std::function<void(int)> body = [&](int i) {
      ++hits[static_cast<size_t>(i)];
      if (i == thrower) throw std::bad_alloc();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // outlive the throw
      ++returned;
    };
    bool caught = false;
    try {
      pool.Run(4, body);
    } catch (const std::bad_alloc&) {
      caught = true;
      EXPECT_EQ(returned.load(), 3) << "thrower " << thrower;
    }
    EXPECT_TRUE(caught) << "thrower " << thrower;
    for (int i = 0; i < 4; ++i) EXPECT_EQ(hits[static_cast<size_t>(i)], 1) << i;
  }
  std::vector<int> hits(3, 0);
  const std::function<void(int)> next = [&](int i) { ++hits[static_cast<size_t>(i)]; };
  pool.Run(3, next);
  EXPECT_EQ(hits, std::vector<int>(3, 1));
}

// The same through RunItems, on whichever runtime the process runs: a thread
// whose scratch cannot be allocated takes no item, the other takes them all,
// and the caller gets the std::bad_alloc.
std::atomic<int> g_refuse{0};  // 1: the caller's scratch, 2: the other thread's
std::thread::id g_caller;

struct RefusedScratch {
  RefusedScratch() {
    const bool caller = std::this_thread::get_id() == g_caller;
    if ((g_refuse == 1 && caller) || (g_refuse == 2 && !caller)) throw std::bad_alloc();
  }
};

TEST(ThreadPoolTest, AScratchThatCannotBeAllocatedReachesTheCaller) {
  g_caller = std::this_thread::get_id();
  for (int refuse : {1, 2}) {
    constexpr size_t kItems = 64;
    std::vector<std::atomic<int>> hits(kItems);
    g_refuse = refuse;
    bool caught = false;
    try {
      internal::RunItems<RefusedScratch>(kItems, 2, [&](size_t i, RefusedScratch&) {
        ++hits[i];
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      });
    } catch (const std::bad_alloc&) {
      caught = true;
    }
    g_refuse = 0;
    EXPECT_TRUE(caught) << "refused on " << (refuse == 1 ? "the caller" : "the worker");
    for (size_t i = 0; i < kItems; ++i) EXPECT_EQ(hits[i].load(), 1) << i;
  }
}

TEST(ThreadPoolTest, ConcurrentCallersShareTheGlobalPool) {
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&total, c] {
      for (int job = 0; job < 20; ++job) {
        const std::function<void(int)> body = [&](int i) { total += i + 1; };
        ThreadPool::Global().Run(2 + (c + job) % 3, body);
      }
    });
  }
  for (std::thread& t : callers) t.join();
  // Widths 2, 3, 4 cycle; each job adds 1 + ... + width.
  int64_t want = 0;
  for (int c = 0; c < 4; ++c) {
    for (int job = 0; job < 20; ++job) {
      const int width = 2 + (c + job) % 3;
      want += width * (width + 1) / 2;
    }
  }
  EXPECT_EQ(total.load(), want);
}

// Several threads each step their own fp32 tensor with 3 pool threads; large
// enough (2^17 elements) that AdamStep really splits the work.
TEST(ThreadPoolTest, ConcurrentAdamStepsMatchReference) {
  constexpr int64_t kNumel = int64_t{1} << 17;
  constexpr int kCallers = 3;
  struct Buffers {
    std::vector<float> p, g, m, v;
  };
  const auto make = [](int seed) {
    Buffers b{std::vector<float>(kNumel), std::vector<float>(kNumel),
              std::vector<float>(kNumel), std::vector<float>(kNumel)};
    for (int64_t i = 0; i < kNumel; ++i) {
      b.p[i] = static_cast<float>((i * 7 + seed) % 101) * 0.01f - 0.5f;
      b.g[i] = static_cast<float>((i * 13 + seed) % 97) * 0.02f - 1.0f;
      b.m[i] = 0.0f;
      b.v[i] = 0.0f;
    }
    return b;
  };
  const auto slot_of = [](Buffers& b) {
    TensorSlot s;
    s.numel = kNumel;
    s.param = b.p.data();
    s.grad = b.g.data();
    s.exp_avg = b.m.data();
    s.exp_avg_sq = b.v.data();
    return s;
  };
  std::vector<Buffers> got, want;
  for (int c = 0; c < kCallers; ++c) {
    got.push_back(make(c));
    want.push_back(make(c));
  }
  std::vector<std::thread> callers;
  std::vector<Status> status(kCallers, Status::kInvalidArgument);
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      TensorSlot s = slot_of(got[static_cast<size_t>(c)]);
      for (int64_t step = 1; step <= 3; ++step) {
        StepParams params;
        params.step = step;
        status[static_cast<size_t>(c)] = AdamStep(&s, 1, params, 3, nullptr);
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) {
    ASSERT_EQ(status[static_cast<size_t>(c)], Status::kOk);
    TensorSlot s = slot_of(want[static_cast<size_t>(c)]);
    for (int64_t step = 1; step <= 3; ++step) {
      StepParams params;
      params.step = step;
      reference::AdamStep(&s, 1, params);
    }
    ASSERT_EQ(got[static_cast<size_t>(c)].p, want[static_cast<size_t>(c)].p);
    ASSERT_EQ(got[static_cast<size_t>(c)].m, want[static_cast<size_t>(c)].m);
    ASSERT_EQ(got[static_cast<size_t>(c)].v, want[static_cast<size_t>(c)].v);
  }
}

// A forked child (a DataLoader worker, a launcher) inherits the pool's memory
// but none of its threads; its first multi-threaded call must start its own
// workers rather than wait for the parent's. ThreadSanitizer does not support
// threads started after a multi-threaded fork, so it skips this test.
#if defined(__SANITIZE_THREAD__)  // GCC
#define SHARDADAM_TEST_TSAN 1
#elif defined(__has_feature)      // Clang
#if __has_feature(thread_sanitizer)
#define SHARDADAM_TEST_TSAN 1
#endif
#endif
#if !defined(_WIN32) && !defined(SHARDADAM_TEST_TSAN)
TEST(ThreadPoolTest, ForkedChildStartsItsOwnWorkers) {
  std::atomic<int> ran{0};
  const std::function<void(int)> count = [&](int) { ++ran; };
  ThreadPool::Global().Run(4, count);  // the parent's workers exist now
  ASSERT_EQ(ran.load(), 4);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(20);  // a child waiting for the parent's workers would hang: kill it
    std::atomic<int> child_ran{0};
    const std::function<void(int)> child_count = [&](int) { ++child_ran; };
    ThreadPool::Global().Run(4, child_count);
    ThreadPool::Global().Run(3, child_count);
    _exit(child_ran.load() == 7 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child did not exit (status " << status << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's jobs did not all run";
  ThreadPool::Global().Run(4, count);  // and the parent's pool still works
  EXPECT_EQ(ran.load(), 8);
}
#endif

}  // namespace
}  // namespace shardadam
