// The core's workers on an OpenMP runtime the process has loaded (openmp_team.h):
// found only once loaded, every team thread runs once in IEEE mode, a thrown
// exception comes back to the caller, AdamStep gives the pool's bits on it, and
// a forked child falls back to the pool. The runtime is GNU libgomp, loaded with
// dlopen as torch's import loads it; where the system has none, the tests skip.
// Linux only (fork, dlopen).
#include "openmp_team.h"

#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "gtest/gtest.h"
#include "shardadam/adam.h"
#include "tensor_fixture.h"

namespace shardadam {
namespace {

using internal::LoadedOpenMpPath;
using internal::RunOnLoadedOpenMp;
using testing::Config;
using testing::MakeTensor;
using testing::Schedule;
using testing::Tensor;

// Loads libgomp as a library dependency would; false where there is none, and
// off Linux, where the core does not look for a runtime.
bool LoadLibgomp() {
#if defined(__linux__)
  return dlopen("libgomp.so.1", RTLD_NOW | RTLD_LOCAL) != nullptr;  // kept loaded
#else
  return false;
#endif
}

TEST(OpenMpTeamTest, FoundOnlyOnceLoaded) {
  if (LoadedOpenMpPath().empty()) {
    // Nothing loaded yet (the usual case for this binary): nothing runs.
    bool called = false;
    const std::function<void(int)> body = [&](int) { called = true; };
    EXPECT_FALSE(RunOnLoadedOpenMp(2, body));
    EXPECT_FALSE(called);
    EXPECT_EQ(ThreadRuntimeName(), "pool");
  }
  if (!LoadLibgomp()) GTEST_SKIP() << "no libgomp.so.1 on this system";
  EXPECT_NE(LoadedOpenMpPath().find("libgomp"), std::string::npos) << LoadedOpenMpPath();
  EXPECT_EQ(ThreadRuntimeName(), "openmp:" + LoadedOpenMpPath());
  SetThreadRuntime(ThreadRuntime::kOwnPool);
  EXPECT_EQ(ThreadRuntimeName(), "pool");
  EXPECT_EQ(LoadedOpenMpPath(), "");
  SetThreadRuntime(ThreadRuntime::kAuto);
  EXPECT_NE(LoadedOpenMpPath(), "");
}

TEST(OpenMpTeamTest, EveryTeamThreadRunsOnceTheCallerAsZero) {
  if (!LoadLibgomp()) GTEST_SKIP() << "no libgomp.so.1 on this system";
  for (int width : {2, 4, 3}) {
    std::mutex mutex;
    std::vector<int> hits(static_cast<size_t>(width), 0);
    std::thread::id zero;
    int calls = 0;
    const std::function<void(int)> body = [&](int i) {
      std::lock_guard<std::mutex> lock(mutex);
      ASSERT_GE(i, 0);
      ASSERT_LT(i, width);
      ++hits[static_cast<size_t>(i)];
      ++calls;
      if (i == 0) zero = std::this_thread::get_id();
    };
    ASSERT_TRUE(RunOnLoadedOpenMp(width, body));
    // libgomp with its defaults (no OMP_DYNAMIC, no OMP_THREAD_LIMIT) fields
    // every thread asked for.
    EXPECT_EQ(calls, width);
    for (int i = 0; i < width; ++i) EXPECT_EQ(hits[static_cast<size_t>(i)], 1) << i;
    EXPECT_EQ(zero, std::this_thread::get_id());
  }
}

#if defined(__x86_64__) || defined(__i386__)
TEST(OpenMpTeamTest, TeamThreadsComputeInIeeeMode) {
  if (!LoadLibgomp()) GTEST_SKIP() << "no libgomp.so.1 on this system";
  constexpr unsigned int kFlushBits = 0x8000 | 0x40;  // MXCSR FTZ | DAZ
  std::vector<unsigned int> modes(4, kFlushBits);
  const std::function<void(int)> read = [&](int i) {
    modes[static_cast<size_t>(i)] = _mm_getcsr();
  };
  const unsigned int saved = _mm_getcsr();
  _mm_setcsr(saved | kFlushBits);
  // The runtime's threads start in the mode of whoever created them: here,
  // the flushing caller's.
  ASSERT_TRUE(RunOnLoadedOpenMp(4, read));
  const unsigned int after = _mm_getcsr();
  _mm_setcsr(saved);
  EXPECT_EQ(after & kFlushBits, kFlushBits) << "the caller's mode is restored";
  for (size_t i = 0; i < modes.size(); ++i) EXPECT_EQ(modes[i] & kFlushBits, 0u) << i;
}
#endif

TEST(OpenMpTeamTest, AnExceptionReachesTheCallerAfterTheTeam) {
  if (!LoadLibgomp()) GTEST_SKIP() << "no libgomp.so.1 on this system";
  std::atomic<int> finished{0};
  const std::function<void(int)> body = [&](int i) {
    if (i == 1) throw std::runtime_error("from thread 1");
    finished.fetch_add(1);
  };
  try {
    RunOnLoadedOpenMp(2, body);
    ADD_FAILURE() << "nothing was rethrown";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "from thread 1");
    EXPECT_EQ(finished.load(), 1) << "thread 0 ran to its end first";
  }
}

// One AdamW step of a bf16 tensor with an int16 remainder and bf16 moments,
// `n` elements on `threads` threads, from the same seeded state every time.
Tensor StepOnce(int64_t n, int threads) {
  const Config config{DType::kBFloat16, DType::kBFloat16, DType::kBFloat16,
                      DType::kBFloat16, DType::kInt16Remainder, true};
  std::mt19937 rng(7);
  Tensor t = MakeTensor(config, n, &rng);
  TensorSlot slot = t.Slot();
  Error error;
  EXPECT_EQ(AdamStep(&slot, 1, Schedule(true)[1], threads, &error), Status::kOk)
      << error.message;
  return t;
}

bool SameBits(const Tensor& a, const Tensor& b) {
  return a.param == b.param && a.master == b.master && a.exp_avg == b.exp_avg &&
         a.exp_avg_sq == b.exp_avg_sq;
}

TEST(OpenMpTeamTest, AdamStepGivesThePoolsBits) {
  if (!LoadLibgomp()) GTEST_SKIP() << "no libgomp.so.1 on this system";
  constexpr int64_t kN = 1 << 19;  // enough work for four threads
  SetThreadRuntime(ThreadRuntime::kOwnPool);
  const Tensor pool = StepOnce(kN, 4);
  SetThreadRuntime(ThreadRuntime::kAuto);
  ASSERT_NE(ThreadRuntimeName(), "pool");
  for (int threads : {1, 2, 3, 4}) {
    EXPECT_TRUE(SameBits(StepOnce(kN, threads), pool)) << threads << " threads";
  }
}

TEST(OpenMpTeamTest, AForkedChildStepsOnThePool) {
  if (!LoadLibgomp()) GTEST_SKIP() << "no libgomp.so.1 on this system";
  // The parent's runtime has run a team (its threads exist, in the parent only).
  const Tensor expected = StepOnce(1 << 19, 4);
  ASSERT_NE(ThreadRuntimeName(), "pool");
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(60);  // a hang fails the test instead of stalling the suite
    const bool on_pool = ThreadRuntimeName() == "pool";
    _exit(on_pool && SameBits(StepOnce(1 << 19, 4), expected) ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status)) << "the child hung or crashed";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child did not step on the pool";
}

}  // namespace
}  // namespace shardadam
