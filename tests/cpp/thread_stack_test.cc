// What a call asks of the threads of the process that links the core (adam.h:
// about 64 KiB of the calling thread's stack, per-thread scratch on the heap):
// the deepest layout steps on a thread of 128 KiB (musl's default), and the
// core adds no static thread-local storage, which glibc carves out of every
// thread's stack, to threads that never call it.

#include <pthread.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "shardadam/adam.h"

namespace shardadam {
namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;  // their instrumentation needs far larger stacks
#else
constexpr bool kSanitized = false;
#endif

// One step of the layout with the deepest frames: bf16 parameters rounded
// stochastically, 4-bit per-block moments, L2 mode, 1,001 elements (its last
// block cut by the tensor's end, so staged).
struct DeepStep {
  static constexpr int64_t kNumel = 1001;
  std::vector<uint16_t> param = std::vector<uint16_t>(kNumel);
  std::vector<float> grad = std::vector<float>(kNumel);
  std::vector<uint8_t> exp_avg = std::vector<uint8_t>((kNumel + 1) / 2, 0);
  std::vector<uint8_t> exp_avg_sq = std::vector<uint8_t>((kNumel + 1) / 2, 0);
  std::vector<float> m_scales = std::vector<float>(4, 1.0f);
  std::vector<float> v_scales = std::vector<float>(4, 1.0f);
  Status status = Status::kInvalidArgument;

  DeepStep() {
    for (int64_t i = 0; i < kNumel; ++i) {
      param[i] = static_cast<uint16_t>(0x3f00 + i % 97);  // bf16 values near 0.5
      grad[i] = 0.01f * static_cast<float>(i % 13 - 6);
    }
  }

  void Run() {
    TensorSlot s;
    s.numel = kNumel;
    s.param = param.data();
    s.param_dtype = DType::kBFloat16;
    s.param_rounding = Rounding::kStochastic;
    s.grad = grad.data();
    s.exp_avg = exp_avg.data();
    s.exp_avg_dtype = DType::kFloat4E2M1Block;
    s.exp_avg_scale = m_scales.data();
    s.exp_avg_sq = exp_avg_sq.data();
    s.exp_avg_sq_dtype = DType::kUFloat4E3M1Block;
    s.exp_avg_sq_scale = v_scales.data();
    s.scale_block = 256;
    StepParams hp;
    hp.adam_w_mode = false;
    hp.weight_decay = 0.01;
    Error error;
    status = AdamStep(&s, 1, hp, 1, &error);
  }
};

// Runs `body(arg)` on a new thread with a stack of `bytes`; pthread_create's result.
int RunOnStack(size_t bytes, void* (*body)(void*), void* arg) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, bytes);
  pthread_t thread;
  const int rc = pthread_create(&thread, &attr, body, arg);
  pthread_attr_destroy(&attr);
  if (rc == 0) pthread_join(thread, nullptr);
  return rc;
}

TEST(ThreadStackTest, TheDeepestLayoutStepsOnA128KiBStack) {
  if (kSanitized) GTEST_SKIP() << "sanitizers' instrumentation needs larger stacks";
  DeepStep here, there;
  here.Run();
  ASSERT_EQ(here.status, Status::kOk);
  ASSERT_EQ(RunOnStack(128 * 1024, [](void* arg) -> void* {
              static_cast<DeepStep*>(arg)->Run();
              return nullptr;
            }, &there), 0);
  ASSERT_EQ(there.status, Status::kOk);
  EXPECT_EQ(there.param, here.param);
  EXPECT_EQ(there.exp_avg, here.exp_avg);
  EXPECT_EQ(there.exp_avg_sq, here.exp_avg_sq);
  EXPECT_EQ(there.m_scales, here.m_scales);
  EXPECT_EQ(there.v_scales, here.v_scales);
}

TEST(ThreadStackTest, AThreadOf64KiBStackStartsBesideTheCore) {
  if (kSanitized) GTEST_SKIP() << "sanitizers' runtimes add their own thread storage";
  DeepStep linked;  // the core's step is linked into this program, and has run
  linked.Run();
  ASSERT_EQ(linked.status, Status::kOk);
  // glibc refuses (EINVAL) a stack that cannot also hold the static TLS.
  EXPECT_EQ(RunOnStack(64 * 1024, [](void*) -> void* { return nullptr; }, nullptr), 0);
}

}  // namespace
}  // namespace shardadam
