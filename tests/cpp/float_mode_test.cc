// The caller's floating-point mode does not reach the results: a thread with
// flush-to-zero and denormals-are-zero set (torch.set_flush_denormal, a
// library built with -ffast-math) gets the reference's bits, for any thread
// count, and gets its own mode back. Pool workers keep the mode of the thread
// that started them; the first multi-threaded call here starts them from a
// caller in FTZ/DAZ mode, and later calls come from a caller in each mode. The
// values are chosen so that the step reads and produces subnormals (squared
// gradients, the moments), which either mode would flush.
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "reference.h"
#include "shardadam/adam.h"
#include "tensor_fixture.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace shardadam {
namespace testing {
namespace {

// The caller's floating-point control register: MXCSR on x86, FPCR on AArch64.
#if defined(__x86_64__) || defined(__i386__)
#define SHARDADAM_TEST_FLOAT_MODE 1
using Mode = unsigned int;
constexpr char kModeName[] = "MXCSR";
constexpr Mode kIeee = 0x1F80;               // exceptions masked, RN
constexpr Mode kFlush = kIeee | 0x8000 | 0x40;  // + flush-to-zero + DAZ
Mode GetMode() { return _mm_getcsr(); }
void SetMode(Mode mode) { _mm_setcsr(mode); }
#elif defined(__aarch64__)
#define SHARDADAM_TEST_FLOAT_MODE 1
using Mode = uint64_t;
constexpr char kModeName[] = "FPCR";
constexpr Mode kIeee = 0;                   // RN, no flush, no default NaN
constexpr Mode kFlush = uint64_t{1} << 24;  // FZ: subnormal inputs and results flush
Mode GetMode() {
  uint64_t mode;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(mode));
  return mode;
}
void SetMode(Mode mode) { __asm__ __volatile__("msr fpcr, %0" : : "r"(mode)); }
#endif

#if defined(SHARDADAM_TEST_FLOAT_MODE)
// Caller modes in order: the first multi-threaded call starts the workers.
constexpr Mode kCallerModes[] = {kFlush, kIeee};

TEST(FloatModeTest, StepIgnoresTheCallersMode) {
  std::mt19937 rng(5);
  StepParams params;
  params.step = 3;
  params.weight_decay = 0.1;
  const int64_t n = 100003;  // several work items, so threads share the tensor
  for (const Config& config : RepresentativeConfigs()) {
    SCOPED_TRACE(ConfigName(config));
    params.adam_w_mode = config.adam_w;
    const std::vector<float> w = Normal(&rng, n, 1.0f);
    const std::vector<float> g = Normal(&rng, n, 1e-19f);  // g * g is subnormal
    const std::vector<float> m = Normal(&rng, n, 1e-39f);  // subnormal
    std::vector<float> v = Normal(&rng, n, 1e-20f);
    for (float& x : v) x = x * x;  // subnormal
    const std::vector<Tensor> start = {TensorFromValues(config, w, m, v, g)};
    std::vector<Tensor> want = start;
    std::vector<TensorSlot> want_slots = Slots(&want);
    ref::AdamStep(want_slots.data(), 1, params);
    for (Mode mode : kCallerModes) {
      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE(::testing::Message() << "caller " << kModeName << " 0x" << std::hex
                                          << mode << std::dec << ", " << threads
                                          << " threads");
        std::vector<Tensor> got = start;
        std::vector<TensorSlot> slots = Slots(&got);
        Error error;
        SetMode(mode);
        const Status status = AdamStep(slots.data(), 1, params, threads, &error);
        const Mode after = GetMode();
        SetMode(kIeee);
        ASSERT_EQ(status, Status::kOk) << error.message;
        EXPECT_EQ(after, mode) << "the caller's mode is restored";
        EXPECT_TRUE(SameTensors(want, got));
      }
    }
  }
}

TEST(FloatModeTest, ConvertIgnoresTheCallersMode) {
  std::mt19937 rng(6);
  const int64_t n = 100003;
  std::vector<float> src = Normal(&rng, n, 1e-39f);  // subnormal
  const float scale = 0x1p-126f;  // dividing by it makes the values normal again
  std::vector<uint16_t> want(static_cast<size_t>(n));
  ASSERT_EQ(Convert(src.data(), DType::kFloat32, want.data(), DType::kFloat16, n, scale, 1,
                    nullptr),
            Status::kOk);
  size_t nonzero = 0;
  for (uint16_t h : want) nonzero += (h & 0x7FFF) != 0;
  ASSERT_GT(nonzero, static_cast<size_t>(n) / 2) << "the inputs must matter";
  for (Mode mode : kCallerModes) {
    for (int threads : {1, 3}) {
      std::vector<uint16_t> got(static_cast<size_t>(n));
      SetMode(mode);
      const Status status = Convert(src.data(), DType::kFloat32, got.data(),
                                    DType::kFloat16, n, scale, threads, nullptr);
      const Mode after = GetMode();
      SetMode(kIeee);
      ASSERT_EQ(status, Status::kOk);
      EXPECT_EQ(after, mode);
      EXPECT_EQ(got, want) << "caller " << kModeName << " 0x" << std::hex << mode
                           << std::dec << ", " << threads << " threads";
    }
  }
}
#else
TEST(FloatModeTest, StepIgnoresTheCallersMode) {
  GTEST_SKIP() << "caller modes are set for x86 and AArch64 only";
}
#endif

}  // namespace
}  // namespace testing
}  // namespace shardadam
