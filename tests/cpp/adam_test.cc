// AdamStep tests (SEMANTICS S2, S3.6, S3.7). The SIMD step must equal the
// scalar reference bit for bit: both evaluate element.h's formula in the same
// order with no FMA, and both round with round-to-nearest-even codecs. Checked
// over every dtype combination, every Highway target, thread counts and sizes
// around the vector width, and a bf16 param rounded stochastically (S2.14);
// then every error status (nothing written), and the
// reference itself against a float64 Adam so that the oracle is right, not only
// consistent.
#include "shardadam/adam.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels.h"
#include "reference.h"
#include "tensor_fixture.h"
#include "test_util.h"

namespace shardadam {
namespace testing {
namespace {

// Steps `tensors` through the schedule, each step checked as above.
void ExpectStepsMatchReference(std::vector<Tensor> tensors, bool adam_w,
                               int threads, uint32_t seed) {
  std::mt19937 rng(seed);
  for (const StepParams& params : Schedule(adam_w)) {
    SCOPED_TRACE("step " + std::to_string(params.step));
    for (Tensor& t : tensors) FillGrad(&t, &rng);
    std::vector<Tensor> want = ExpectStepMatchesReference(tensors, params, threads);
    if (::testing::Test::HasFatalFailure()) return;
    tensors = want;
  }
}

// Sizes around every vector width (4, 8, 16 lanes of fp32; 16/32 of 16-bit),
// with empty tensors first, in the middle and last.
const int64_t kListSizes[] = {0, 1, 15, 16, 17, 0, 31, 33, 63, 65, 7, 1001, 0};

class AdamDTypeTest : public ::testing::TestWithParam<Config> {};

TEST_P(AdamDTypeTest, MatchesReferenceOnEveryTarget) {
  std::mt19937 rng(1234);
  std::vector<Tensor> tensors;
  for (int64_t n : kListSizes) {
    tensors.push_back(MakeTensor(GetParam(), n, &rng));
  }
  ExpectStepsMatchReference(tensors, GetParam().adam_w, 2, 99);
}

// Non-finite gradients, every dtype combination: S2.3 gives the poisoned states
// scale 1 and the NaNs propagate; the kernels (also the fused ones' shortcut
// for pairs without NaN) must still agree with the reference.
TEST_P(AdamDTypeTest, NonFiniteGradientsMatchReference) {
  const Config config = GetParam();
  std::mt19937 rng(3);
  std::vector<Tensor> tensors = {MakeTensor(config, 40, &rng),
                                 MakeTensor(config, 17, &rng),
                                 MakeTensor(config, 300, &rng)};
  ref::StoreElement(tensors[0].grad.data(), config.grad, 3, NAN);
  ref::StoreElement(tensors[0].grad.data(), config.grad, 38, INFINITY);
  ref::StoreElement(tensors[1].grad.data(), config.grad, 16, -INFINITY);
  // A NaN whose low payload bits would carry into the exponent (or vanish into
  // inf) if a bf16 rounding skipped the NaN rule.
  ref::StoreElement(tensors[2].grad.data(), config.grad, 257, FloatOf(0xFFFFFFFFu));
  StepParams params;
  params.adam_w_mode = config.adam_w;
  const std::vector<Tensor> want = ExpectStepMatchesReference(tensors, params, 1);
  if (IsScaled(config.exp_avg)) {
    EXPECT_EQ(want[0].exp_avg_scale, 1.0f);
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, AdamDTypeTest,
                         ::testing::ValuesIn(AllConfigs()),
                         [](const ::testing::TestParamInfo<Config>& case_info) {
                           return ConfigName(case_info.param);
                         });

class AdamLargeTest : public ::testing::TestWithParam<Config> {};

// A few MiB per buffer, all hardware threads: the threaded split of a long
// tensor.
TEST_P(AdamLargeTest, MultiMiBTensorMatchesReference) {
  std::mt19937 rng(77);
  std::vector<Tensor> tensors;
  for (int64_t n : {int64_t{(1 << 20) + 3}, int64_t{0}, int64_t{4099}}) {
    tensors.push_back(MakeTensor(GetParam(), n, &rng));
  }
  ExpectStepsMatchReference(tensors, GetParam().adam_w, 0, 5);
}

// Bitwise equal results for any thread count (S3.7), and equal to the
// reference. The thread count also changes the work items' size
// (ItemElements): here two chunks each on one thread, one on more.
TEST_P(AdamLargeTest, ThreadCountDoesNotChangeBits) {
  std::mt19937 rng(31);
  std::vector<Tensor> start;
  int64_t total = 0;
  for (int64_t n : {int64_t{100003}, int64_t{0}, int64_t{33},
                    int64_t{(1 << 18) + 5}, int64_t{4097}}) {
    start.push_back(MakeTensor(GetParam(), n, &rng));
    total += n;
  }
  ASSERT_EQ(internal::ItemElements(total, 1), 2 * internal::kChunk);
  ASSERT_EQ(internal::ItemElements(total, 2), internal::kChunk);
  StepParams params;
  params.adam_w_mode = GetParam().adam_w;
  params.weight_decay = 0.05;
  params.step = 7;
  std::vector<Tensor> want = start;
  std::vector<TensorSlot> want_slots = Slots(&want);
  ref::AdamStep(want_slots.data(), static_cast<int64_t>(want_slots.size()),
                params);
  ForEachTarget([&] {
    for (int threads : {1, 2, 3, 7, 1}) {
      SCOPED_TRACE("threads " + std::to_string(threads));
      std::vector<Tensor> got = start;
      std::vector<TensorSlot> slots = Slots(&got);
      Error error;
      ASSERT_EQ(AdamStep(slots.data(), static_cast<int64_t>(slots.size()),
                         params, threads, &error),
                Status::kOk)
          << error.message;
      ASSERT_TRUE(SameTensors(want, got));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Representative, AdamLargeTest,
                         ::testing::ValuesIn(RepresentativeConfigs()),
                         [](const ::testing::TestParamInfo<Config>& case_info) {
                           return ConfigName(case_info.param);
                         });

// ---------------------------------------------------------------------------
// A bf16 param with no master rounded stochastically (S2.14): the core on every
// target and thread count against the reference, its bits keyed by the
// rounding_key, the step and each element's flat index only.

// The layouts of tensor_fixture.h's ParamRoundingCases (which the CUDA tests
// step with their own keys and offsets).
std::vector<Config> ParamRoundingConfigs() {
  std::vector<Config> configs;
  for (const ParamRoundingCase& c : ParamRoundingCases()) configs.push_back(c.config);
  return configs;
}

Tensor StochasticTensor(const Config& c, int64_t numel, uint32_t key, int64_t first_index,
                        std::mt19937* rng) {
  Tensor t = MakeTensor(c, numel, rng);
  t.param_rounding = Rounding::kStochastic;
  t.rounding_key = key;
  t.first_index = first_index;
  return t;
}

class ParamRoundingTest : public ::testing::TestWithParam<Config> {};

// Sizes around every vector width with their own keys and offsets, and runs
// whose flat indices cross a multiple of 2^32.
TEST_P(ParamRoundingTest, MatchesReferenceOnEveryTarget) {
  std::mt19937 rng(4321);
  std::vector<Tensor> tensors;
  uint32_t key = 1;
  for (int64_t n : kListSizes) {
    tensors.push_back(StochasticTensor(GetParam(), n, key * 0x9E3779B9u, 1000 * key, &rng));
    ++key;
  }
  tensors.push_back(StochasticTensor(GetParam(), 1001, 7, (int64_t{1} << 32) - 501, &rng));
  tensors.push_back(StochasticTensor(GetParam(), 100, 7, (int64_t{5} << 32) - 3, &rng));
  ExpectStepsMatchReference(tensors, GetParam().adam_w, 2, 99);
}

// Bitwise equal for any thread count, and equal to the reference; another key
// or step stores other params, the same ones the same.
TEST_P(ParamRoundingTest, BitsFollowKeyAndStepOnly) {
  std::mt19937 rng(32);
  std::vector<Tensor> start;
  // 70k elements: enough work for a second thread (work_items.cc).
  for (int64_t n : {int64_t{70001}, int64_t{33}}) {
    start.push_back(StochasticTensor(GetParam(), n, 0xABCDu, 12345, &rng));
  }
  StepParams params;
  params.adam_w_mode = GetParam().adam_w;
  params.lr = 1e-4;  // below half a bf16 step for most weights: rounding decides
  params.step = 9;
  std::vector<Tensor> want = start;
  std::vector<TensorSlot> want_slots = Slots(&want);
  ref::AdamStep(want_slots.data(), static_cast<int64_t>(want_slots.size()), params);
  ForEachTarget([&] {
    for (int threads : {1, 2, 3, 7}) {
      SCOPED_TRACE("threads " + std::to_string(threads));
      std::vector<Tensor> got = start;
      std::vector<TensorSlot> slots = Slots(&got);
      Error error;
      ASSERT_EQ(AdamStep(slots.data(), static_cast<int64_t>(slots.size()), params, threads,
                         &error),
                Status::kOk)
          << error.message;
      ASSERT_TRUE(SameTensors(want, got));
    }
  });
  const auto params_after = [&](uint32_t key, int64_t step, Rounding rounding,
                                bool bias_correction = true) {
    std::vector<Tensor> got = start;
    for (Tensor& t : got) {
      t.rounding_key = key;
      t.param_rounding = rounding;
    }
    std::vector<TensorSlot> slots = Slots(&got);
    StepParams p = params;
    p.step = step;
    p.bias_correction = bias_correction;
    EXPECT_EQ(AdamStep(slots.data(), static_cast<int64_t>(slots.size()), p, 2, nullptr),
              Status::kOk);
    return got[0].param;
  };
  const std::vector<uint8_t> base = params_after(0xABCDu, 9, Rounding::kStochastic);
  EXPECT_EQ(base, want[0].param);
  EXPECT_NE(base, params_after(0xABCEu, 9, Rounding::kStochastic));
  EXPECT_NE(base, params_after(0xABCDu, 10, Rounding::kStochastic));
  EXPECT_NE(base, params_after(0xABCDu, 9, Rounding::kNearest));
  // Without bias correction the step changes no arithmetic, only the bits' key.
  const std::vector<uint8_t> uncorrected = params_after(0xABCDu, 9, Rounding::kStochastic, false);
  EXPECT_EQ(uncorrected, params_after(0xABCDu, 9, Rounding::kStochastic, false));
  EXPECT_NE(uncorrected, params_after(0xABCDu, 10, Rounding::kStochastic, false));
}

INSTANTIATE_TEST_SUITE_P(BF16NoMaster, ParamRoundingTest,
                         ::testing::ValuesIn(ParamRoundingConfigs()),
                         [](const ::testing::TestParamInfo<Config>& case_info) {
                           return ConfigName(case_info.param);
                         });

// An fp8 state whose old scale is so large that scale * 256 overflows: the
// fused fp8 decoder cannot fold its factor into it, so the step takes the
// block path, which must still agree with the reference. Both fused layouts
// with fp8 moments.
TEST(AdamSpecialValuesTest, HugeOldFp8ScaleMatchesReference) {
  for (DType exp_avg_sq : {DType::kFloat8E4M3, DType::kBFloat16}) {
    const Config config = {DType::kBFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                           exp_avg_sq,       DType::kFloat32,  true};
    SCOPED_TRACE(ConfigName(config));
    std::mt19937 rng(6);
    std::vector<Tensor> tensors = {MakeTensor(config, 1000, &rng),
                                   MakeTensor(config, 70001, &rng)};
    for (Tensor& t : tensors) {
      // Finite scales that 256 times over overflow; most decoded moments become
      // inf, which the reference handles as well (S2.3: the new scale is 1).
      t.exp_avg_scale = 3e38f / 448.0f * 200.0f;
      if (exp_avg_sq == DType::kFloat8E4M3) t.exp_avg_sq_scale = FLT_MAX / 448.0f;
    }
    ExpectStepMatchesReference(tensors, StepParams(), 2);
  }
}

// Zero gradients and zero moments: the new moments are all zero and their scale
// is 1 (S2.3), not 0 or NaN.
TEST(AdamSpecialValuesTest, AllZeroStateGetsUnitScale) {
  const Config config = {DType::kFloat32,    DType::kFloat32, DType::kFloat16,
                         DType::kFloat8E4M3, DType::kNone,    true};
  std::mt19937 rng(4);
  Tensor t = MakeTensor(config, 50, &rng);
  std::fill(t.grad.begin(), t.grad.end(), 0);
  std::fill(t.exp_avg.begin(), t.exp_avg.end(), 0);
  std::fill(t.exp_avg_sq.begin(), t.exp_avg_sq.end(), 0);
  t.exp_avg_scale = 0.25f;
  t.exp_avg_sq_scale = 8.0f;
  ForEachTarget([&] {
    Tensor got = t;
    TensorSlot slot = got.Slot();
    ASSERT_EQ(AdamStep(&slot, 1, StepParams(), 1, nullptr), Status::kOk);
    EXPECT_EQ(got.exp_avg_scale, 1.0f);
    EXPECT_EQ(got.exp_avg_sq_scale, 1.0f);
    EXPECT_EQ(got.param, t.param);  // zero update, zero decay
  });
}

// lr = 0 is a real step (S3.8): moments move, the weights do not.
TEST(AdamSemanticsTest, ZeroLrMovesMomentsOnly) {
  const Config config = {DType::kFloat32, DType::kFloat32, DType::kFloat32,
                         DType::kFloat32, DType::kNone,    true};
  std::mt19937 rng(8);
  Tensor t = MakeTensor(config, 64, &rng);
  StepParams params;
  params.lr = 0.0;
  params.weight_decay = 0.1;
  ForEachTarget([&] {
    Tensor got = t;
    TensorSlot slot = got.Slot();
    ASSERT_EQ(AdamStep(&slot, 1, params, 1, nullptr), Status::kOk);
    EXPECT_EQ(got.param, t.param);
    EXPECT_NE(got.exp_avg, t.exp_avg);
    EXPECT_NE(got.exp_avg_sq, t.exp_avg_sq);
  });
}

// S3.6: the step's fp32 constants may reach FLT_MAX; the first double that rounds
// past it (FLT_MAX plus half its ulp, a tie that rounds to the even 2^128) is
// refused, and lr / c1 is judged at the step it is taken.
TEST(AdamSemanticsTest, StepConstantsUpToFp32sLargestArePassed) {
  const Config config = {DType::kFloat32, DType::kFloat32, DType::kFloat32,
                         DType::kFloat32, DType::kNone,    true};
  std::mt19937 rng(31);
  const Tensor t = MakeTensor(config, 16, &rng);
  const double half_ulp = std::ldexp(1.0, 103);
  const auto status = [&](double lr, bool bias_correction, int64_t step) {
    Tensor got = t;
    TensorSlot slot = got.Slot();
    StepParams params;
    params.lr = lr;
    params.bias_correction = bias_correction;
    params.step = step;
    return AdamStep(&slot, 1, params, 1, nullptr);
  };
  EXPECT_EQ(status(FLT_MAX, false, 1), Status::kOk);
  EXPECT_EQ(status(FLT_MAX + half_ulp / 2, false, 1), Status::kOk);  // rounds down
  EXPECT_EQ(status(FLT_MAX + half_ulp, false, 1), Status::kInvalidArgument);
  // 1e38 / (1 - 0.9^t): past FLT_MAX at step 1, about 1e38 by step 200.
  EXPECT_EQ(status(1e38, true, 1), Status::kInvalidArgument);
  EXPECT_EQ(status(1e38, true, 200), Status::kOk);
}

// S3.7: a bf16 param with an fp32 master (or a remainder) carries exactly the
// fp32 run's weights, and the param is the master rounded to bf16.
TEST(AdamSemanticsTest, Bf16WithMasterTracksFp32RunBitwise) {
  const int64_t n = 333;
  std::mt19937 rng(9);
  const std::vector<float> w0 = Normal(&rng, n, 1.0f);
  ForEachTarget([&] {
    std::vector<float> fp32_param = w0, fp32_master = w0;
    std::vector<uint16_t> bf16_param(n), bf16_split(n);
    std::vector<int16_t> remainder(n, 0);
    for (int64_t i = 0; i < n; ++i) {
      bf16_param[i] = ref::FloatToBFloat16(w0[i]);
      ref::SplitMaster(w0[i], &bf16_split[i], &remainder[i]);
    }
    std::vector<float> m[3], v[3];
    for (int k = 0; k < 3; ++k) {
      m[k].assign(n, 0.0f);
      v[k].assign(n, 0.0f);
    }
    std::mt19937 grads(10);
    for (int64_t step = 1; step <= 5; ++step) {
      // One copy of the gradient per tensor: buffers of a call never alias.
      const std::vector<float> g = Normal(&grads, n, 0.5f);
      const std::vector<float> g_copies[3] = {g, g, g};
      TensorSlot slots[3];
      for (int k = 0; k < 3; ++k) {
        slots[k].numel = n;
        slots[k].grad = g_copies[k].data();
        slots[k].exp_avg = m[k].data();
        slots[k].exp_avg_sq = v[k].data();
      }
      slots[0].param = fp32_param.data();
      slots[1].param = bf16_param.data();
      slots[1].param_dtype = DType::kBFloat16;
      slots[1].master_param = fp32_master.data();
      slots[1].master_dtype = DType::kFloat32;
      slots[2].param = bf16_split.data();
      slots[2].param_dtype = DType::kBFloat16;
      slots[2].master_param = remainder.data();
      slots[2].master_dtype = DType::kInt16Remainder;
      StepParams params;
      params.lr = 1e-2;
      params.weight_decay = 0.1;
      params.step = step;
      Error error;
      ASSERT_EQ(AdamStep(slots, 3, params, 2, &error), Status::kOk)
          << error.message;
    }
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(BitsOf(fp32_master[i]), BitsOf(fp32_param[i])) << i;
      ASSERT_EQ(bf16_param[i], ref::FloatToBFloat16(fp32_master[i])) << i;
      ASSERT_EQ(BitsOf(ref::MergeMaster(bf16_split[i], remainder[i])),
                BitsOf(fp32_param[i]))
          << i;
    }
  });
}

// ---------------------------------------------------------------------------
// The oracle against float64 Adam: each step starts both from the same state;
// the fp32 results must lie within a few fp32 roundings of the exact ones.
// Rounding error is bounded relative to the sum of the magnitudes of each sum's
// terms, which stays tight where terms cancel.

constexpr double kFewRoundings = 0x1p-20;  // ~16 fp32 roundings

// One exact Adam update with its error scales.
struct Exact {
  double w, m, v;
  double w_terms, m_terms, v_terms;  // sums of |terms|
};

Exact ExactAdam(const StepParams& p, double w, double g, double m, double v) {
  const double c1 = p.bias_correction ? 1.0 - std::pow(p.beta1, p.step) : 1.0;
  const double c2 = p.bias_correction ? 1.0 - std::pow(p.beta2, p.step) : 1.0;
  Exact e;
  double g_terms = std::fabs(g);
  if (!p.adam_w_mode) {
    g_terms += p.weight_decay * std::fabs(w);
    g += p.weight_decay * w;
  }
  e.m = p.beta1 * m + (1.0 - p.beta1) * g;
  e.v = p.beta2 * v + (1.0 - p.beta2) * g * g;
  e.m_terms = p.beta1 * std::fabs(m) + (1.0 - p.beta1) * g_terms;
  e.v_terms = p.beta2 * v + (1.0 - p.beta2) * g_terms * g_terms;
  const double decayed = p.adam_w_mode ? w * (1.0 - p.lr * p.weight_decay) : w;
  const double denom = std::sqrt(e.v / c2) + p.eps;
  e.w = decayed - p.lr * (e.m / c1) / denom;
  e.w_terms = std::fabs(w) + p.lr * (e.m_terms / c1) / denom;
  return e;
}

TEST(ReferenceOracleTest, AgreesWithFloat64Adam) {
  const int64_t n = 2000;
  std::mt19937 rng(12);
  const Config config = {DType::kFloat32,    DType::kFloat32, DType::kFloat16,
                         DType::kFloat8E4M3, DType::kNone,    true};
  for (bool adam_w : {true, false}) {
    SCOPED_TRACE(adam_w ? "adamw" : "l2");
    std::vector<float> w = Normal(&rng, n, 1.0f), m(n, 0.0f), v(n, 0.0f);
    for (const StepParams& p : Schedule(adam_w)) {
      SCOPED_TRACE("step " + std::to_string(p.step));
      const std::vector<float> g = Normal(&rng, n, 0.5f);
      // fp32 state through the reference.
      std::vector<float> w32 = w, m32 = m, v32 = v;
      TensorSlot slot;
      slot.numel = n;
      slot.param = w32.data();
      slot.grad = g.data();
      slot.exp_avg = m32.data();
      slot.exp_avg_sq = v32.data();
      ref::AdamStep(&slot, 1, p);
      for (int64_t i = 0; i < n; ++i) {
        const Exact e = ExactAdam(p, w[i], g[i], m[i], v[i]);
        ASSERT_LE(std::fabs(w32[i] - e.w), kFewRoundings * e.w_terms) << i;
        ASSERT_LE(std::fabs(m32[i] - e.m), kFewRoundings * e.m_terms) << i;
        ASSERT_LE(std::fabs(v32[i] - e.v), kFewRoundings * e.v_terms) << i;
      }
      // The same state with fp16 / fp8 moments: the stored true values must be
      // the exact moments quantised with the S2.3 scale (within half a code
      // step: relative 2^-11 for fp16, 2^-4 for E4M3, or the subnormal step).
      Tensor scaled;
      scaled.config = config;
      scaled.numel = n;
      scaled.param = Buffer(DType::kFloat32, n);
      scaled.grad = Buffer(DType::kFloat32, n);
      scaled.exp_avg = Buffer(DType::kFloat16, n);
      scaled.exp_avg_sq = Buffer(DType::kFloat8E4M3, n);
      std::memcpy(scaled.param.data(), w.data(), n * sizeof(float));
      std::memcpy(scaled.grad.data(), g.data(), n * sizeof(float));
      StoreState(m, DType::kFloat16, &scaled.exp_avg, &scaled.exp_avg_scale);
      StoreState(v, DType::kFloat8E4M3, &scaled.exp_avg_sq,
                 &scaled.exp_avg_sq_scale);
      const auto true_m = [&](int64_t i) {
        return ref::LoadElement(scaled.exp_avg.data(), DType::kFloat16, i) *
               scaled.exp_avg_scale;
      };
      const auto true_v = [&](int64_t i) {
        return ref::LoadElement(scaled.exp_avg_sq.data(), DType::kFloat8E4M3,
                                i) *
               scaled.exp_avg_sq_scale;
      };
      std::vector<Exact> exact(n);
      double m_max = 0.0, v_max = 0.0, m_terms = 0.0, v_terms = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        exact[i] = ExactAdam(p, w[i], g[i], true_m(i), true_v(i));
        m_max = std::max(m_max, std::fabs(exact[i].m));
        v_max = std::max(v_max, std::fabs(exact[i].v));
        m_terms = std::max(m_terms, exact[i].m_terms);
        v_terms = std::max(v_terms, exact[i].v_terms);
      }
      TensorSlot scaled_slot = scaled.Slot();
      ref::AdamStep(&scaled_slot, 1, p);
      // The scale is the fp32 absmax over the target, rounded once: off by the
      // largest moment's fp32 error, then half an fp32 ulp.
      EXPECT_NEAR(scaled.exp_avg_scale, m_max / kFloat16ScaleTarget,
                  2 * kFewRoundings * m_terms / kFloat16ScaleTarget +
                      0x1p-24 * scaled.exp_avg_scale);
      EXPECT_NEAR(scaled.exp_avg_sq_scale, v_max / kFloat8ScaleTarget,
                  2 * kFewRoundings * v_terms / kFloat8ScaleTarget +
                      0x1p-24 * scaled.exp_avg_sq_scale);
      // Half a step of the storage format: relative for normals (fp16 2^-11,
      // E4M3 2^-4), absolute for subnormals (fp16 2^-25, E4M3 2^-10, times
      // the scale), beside the fp32 error of the moment itself.
      for (int64_t i = 0; i < n; ++i) {
        const Exact& e = exact[i];
        ASSERT_LE(std::fabs(true_m(i) - e.m),
                  0x1p-11 * std::fabs(e.m) + 2 * kFewRoundings * e.m_terms +
                      0x1p-25 * scaled.exp_avg_scale)
            << i;
        ASSERT_LE(std::fabs(true_v(i) - e.v),
                  0x1p-4 * std::fabs(e.v) + 2 * kFewRoundings * e.v_terms +
                      0x1p-10 * scaled.exp_avg_sq_scale)
            << i;
        const float w_scaled =
            reinterpret_cast<const float*>(scaled.param.data())[i];
        ASSERT_LE(std::fabs(w_scaled - e.w), kFewRoundings * e.w_terms) << i;
      }
      w = w32;
      m = m32;
      v = v32;
    }
  }
}

// ---------------------------------------------------------------------------
// Errors: every rule violation returns kInvalidArgument, names the tensor and
// the rule, and leaves every buffer and scale bitwise unchanged (S3.1, S8).

// The bad values the scale-slot cases point their slots at (a refused step must
// not have written them either), and their bits.
float nan_scale = NAN;
float zero_scale = 0.0f;
float negative_scale = -1.0f;
const uint32_t kBadScaleBits[3] = {0x7FC00000u, 0x00000000u, 0xBF800000u};

void ExpectBadScalesUntouched() {
  const float* scales[3] = {&nan_scale, &zero_scale, &negative_scale};
  for (int i = 0; i < 3; ++i) {
    uint32_t bits;
    std::memcpy(&bits, scales[i], sizeof(bits));
    EXPECT_EQ(bits, kBadScaleBits[i]) << "bad scale " << i << " was written";
  }
}

struct ErrorCase {
  std::string name;
  int64_t tensor_index;  // expected Error::tensor_index
  std::string mentions;  // a word the message must contain
  std::function<void(std::vector<TensorSlot>*, StepParams*,
                     std::vector<Tensor>*)>
      breaks;
};

std::vector<ErrorCase> ErrorCases() {
  using Slots = std::vector<TensorSlot>;
  using Tensors = std::vector<Tensor>;
  std::vector<ErrorCase> cases;
  auto slot_case = [&](std::string name, int64_t index, std::string mentions,
                       std::function<void(TensorSlot*)> f) {
    cases.push_back(
        {name, index, mentions,
         [index, f](Slots* s, StepParams*, Tensors*) { f(&(*s)[index]); }});
  };
  auto param_case = [&](std::string name, std::string mentions,
                        std::function<void(StepParams*)> f) {
    cases.push_back(
        {name, -1, mentions, [f](Slots*, StepParams* p, Tensors*) { f(p); }});
  };
  const DType bad = static_cast<DType>(42);
  // Dtypes, per buffer.
  slot_case("param_dtype_fp8", 1, "param",
            [](TensorSlot* s) { s->param_dtype = DType::kFloat8E4M3; });
  slot_case("param_dtype_none", 0, "param",
            [](TensorSlot* s) { s->param_dtype = DType::kNone; });
  slot_case("param_dtype_unknown", 2, "param",
            [bad](TensorSlot* s) { s->param_dtype = bad; });
  slot_case("grad_dtype_fp8", 1, "grad",
            [](TensorSlot* s) { s->grad_dtype = DType::kFloat8E4M3; });
  slot_case("grad_dtype_remainder", 2, "grad",
            [](TensorSlot* s) { s->grad_dtype = DType::kInt16Remainder; });
  slot_case("exp_avg_dtype_none", 2, "exp_avg",
            [](TensorSlot* s) { s->exp_avg_dtype = DType::kNone; });
  slot_case("exp_avg_dtype_remainder", 0, "exp_avg",
            [](TensorSlot* s) { s->exp_avg_dtype = DType::kInt16Remainder; });
  slot_case("exp_avg_sq_dtype_unknown", 1, "exp_avg_sq",
            [bad](TensorSlot* s) { s->exp_avg_sq_dtype = bad; });
  // Stochastic rounding (S2.13) exists for an fp4-block exp_avg and a ufp4-block
  // exp_avg_sq only.
  slot_case("exp_avg_rounding_stochastic_fp32", 0,
            "exp_avg_rounding 1 (stochastic) is not allowed for an exp_avg_dtype",
            [](TensorSlot* s) { s->exp_avg_rounding = Rounding::kStochastic; });
  slot_case("exp_avg_rounding_unknown", 1, "exp_avg_rounding -1 is not a rounding",
            [](TensorSlot* s) { s->exp_avg_rounding = static_cast<Rounding>(-1); });
  slot_case("exp_avg_sq_rounding_stochastic_fp32", 2,
            "exp_avg_sq_rounding 1 (stochastic) is not allowed for an exp_avg_sq_dtype",
            [](TensorSlot* s) { s->exp_avg_sq_rounding = Rounding::kStochastic; });
  // ... and for a bf16 param with no master (S2.14), its first_index checked.
  slot_case("param_rounding_stochastic_fp32", 0,
            "param_rounding 1 (stochastic) is not allowed for a param_dtype 1 (fp32)",
            [](TensorSlot* s) { s->param_rounding = Rounding::kStochastic; });
  slot_case("param_rounding_stochastic_fp16_master", 1,
            "stochastic rounding needs a bf16 param with no master",
            [](TensorSlot* s) { s->param_rounding = Rounding::kStochastic; });
  slot_case("param_rounding_stochastic_remainder", 2,
            "param_rounding 1 (stochastic) is not allowed",
            [](TensorSlot* s) { s->param_rounding = Rounding::kStochastic; });
  slot_case("param_rounding_unknown", 0, "param_rounding 2 is not a rounding",
            [](TensorSlot* s) { s->param_rounding = static_cast<Rounding>(2); });
  slot_case("param_rounding_negative_first_index", 2, "first_index -1 is outside",
            [](TensorSlot* s) {
              s->master_param = nullptr;
              s->master_dtype = DType::kNone;
              s->param_rounding = Rounding::kStochastic;
              s->first_index = -1;
            });
  slot_case("master_dtype_bf16", 1, "master",
            [](TensorSlot* s) { s->master_dtype = DType::kBFloat16; });
  slot_case("master_dtype_fp8", 1, "master",
            [](TensorSlot* s) { s->master_dtype = DType::kFloat8E4M3; });
  slot_case("master_dtype_unknown", 2, "master",
            [bad](TensorSlot* s) { s->master_dtype = bad; });
  // Master rules (S2.1, S2.5).
  cases.push_back({"master_with_fp32_param", 0, "master",
                   [](Slots* s, StepParams*, Tensors* t) {
                     (*s)[0].master_param = (*t)[0].master.data();
                     (*s)[0].master_dtype = DType::kFloat32;
                     (*s)[0].master_scale = &(*t)[0].master_scale;
                   }});
  slot_case("remainder_beside_fp16_param", 1, "remainder",
            [](TensorSlot* s) { s->master_dtype = DType::kInt16Remainder; });
  // Pointers.
  slot_case("null_param", 1, "param",
            [](TensorSlot* s) { s->param = nullptr; });
  slot_case("null_grad", 0, "grad", [](TensorSlot* s) { s->grad = nullptr; });
  slot_case("null_exp_avg", 2, "exp_avg",
            [](TensorSlot* s) { s->exp_avg = nullptr; });
  slot_case("null_exp_avg_sq", 1, "exp_avg_sq",
            [](TensorSlot* s) { s->exp_avg_sq = nullptr; });
  slot_case("null_master", 2, "master",
            [](TensorSlot* s) { s->master_param = nullptr; });
  slot_case("negative_numel", 1, "numel", [](TensorSlot* s) { s->numel = -3; });
  slot_case("missing_exp_avg_scale", 1, "exp_avg",
            [](TensorSlot* s) { s->exp_avg_scale = nullptr; });
  slot_case("missing_exp_avg_sq_scale", 1, "exp_avg_sq",
            [](TensorSlot* s) { s->exp_avg_sq_scale = nullptr; });
  slot_case("missing_master_scale", 1, "master",
            [](TensorSlot* s) { s->master_scale = nullptr; });
  // Scale slots: a scaled state's current scale must be a finite value > 0,
  // and two states may not share one slot.
  slot_case("exp_avg_scale_nan", 1, "exp_avg_scale",
            [](TensorSlot* s) { s->exp_avg_scale = &nan_scale; });
  slot_case("exp_avg_sq_scale_zero", 1, "exp_avg_sq_scale",
            [](TensorSlot* s) { s->exp_avg_sq_scale = &zero_scale; });
  slot_case("master_scale_negative", 1, "master_scale",
            [](TensorSlot* s) { s->master_scale = &negative_scale; });
  slot_case("scale_slots_shared", 1, "exp_avg_sq_scale",
            [](TensorSlot* s) { s->exp_avg_sq_scale = s->exp_avg_scale; });
  // Never dereferenced: rejected first (it would also half-overlap its
  // neighbour slot).
  slot_case("scale_slot_misaligned", 1, "not aligned", [](TensorSlot* s) {
    s->exp_avg_sq_scale =
        reinterpret_cast<float*>(reinterpret_cast<uintptr_t>(s->exp_avg_scale) + 2);
  });
  // Overlapping buffers, within a tensor and across tensors.
  slot_case("exp_avg_aliases_exp_avg_sq", 0, "overlap",
            [](TensorSlot* s) { s->exp_avg_sq = s->exp_avg; });
  slot_case("param_aliases_exp_avg", 0, "overlap",
            [](TensorSlot* s) { s->exp_avg = s->param; });
  cases.push_back({"param_overlaps_other_tensor", 2, "overlap",
                   [](Slots* s, StepParams*, Tensors* t) {
                     // Tensor 2's exp_avg (40 fp8 bytes) lies in the second
                     // half of tensor 1's param (40 fp16 elements, 80 bytes).
                     (*s)[2].exp_avg = (*t)[1].param.data() + 40;
                   }});
  // A scale slot is written after the step: it may not lie in another
  // tensor's data or be another tensor's scale slot.
  cases.push_back({"scale_slot_in_other_tensor_data", 2, "overlap",
                   [](Slots* s, StepParams*, Tensors* t) {
                     (*s)[2].exp_avg_scale =
                         reinterpret_cast<float*>((*t)[0].param.data() + 8);
                   }});
  cases.push_back({"scale_slot_shared_across_tensors", 2, "overlap",
                   [](Slots* s, StepParams*, Tensors*) {
                     (*s)[2].exp_avg_scale = (*s)[1].exp_avg_scale;
                   }});
  // Hyper-parameters (tensor index -1).
  param_case("negative_lr", "lr", [](StepParams* p) { p->lr = -1e-3; });
  param_case("nan_lr", "lr", [](StepParams* p) { p->lr = NAN; });
  // Only the CUDA backend reads lr from device memory (never dereferenced here).
  static const double device_lr = 1e-3;
  param_case("lr_in_device_memory_on_the_cpu", "lr_in_device_memory",
             [](StepParams* p) { p->lr_in_device_memory = &device_lr; });
  param_case("negative_eps", "eps", [](StepParams* p) { p->eps = -1e-8; });
  param_case("negative_weight_decay", "weight_decay",
             [](StepParams* p) { p->weight_decay = -0.1; });
  param_case("inf_weight_decay", "weight_decay",
             [](StepParams* p) { p->weight_decay = INFINITY; });
  // Each refused by its own rule, named (beta1 = 1 would also make lr / (1 - beta1^t)
  // infinite; beta2 = 1 a zero bias correction, dividing by zero).
  param_case("beta1_one", "beta1 1 is outside [0, 1)", [](StepParams* p) { p->beta1 = 1.0; });
  param_case("beta1_negative", "beta1", [](StepParams* p) { p->beta1 = -0.1; });
  param_case("beta2_one", "beta2 1 is outside [0, 1)", [](StepParams* p) { p->beta2 = 1.0; });
  param_case("beta2_above_one", "beta2", [](StepParams* p) { p->beta2 = 1.5; });
  param_case("beta2_nan", "beta2", [](StepParams* p) { p->beta2 = NAN; });
  // Finite hyper-parameters whose fp32 step constants are not (S3.6).
  param_case("lr_beyond_fp32", "lr / (1 - beta1^step) is beyond fp32's range",
             [](StepParams* p) { p->lr = 1e39; });
  param_case("step_size_beyond_fp32", "lr / (1 - beta1^step) is beyond fp32's range",
             [](StepParams* p) {
               p->lr = 1e38;  // finite in fp32, but not lr / (1 - 0.9)
               p->step = 1;
             });
  param_case("decay_beyond_fp32", "1 - lr * weight_decay is beyond fp32's range",
             [](StepParams* p) {
               p->lr = 10.0;
               p->weight_decay = 1e38;  // finite in fp32, but not 1 - lr * weight_decay
             });
  param_case("l2_weight_decay_beyond_fp32", "weight_decay is beyond fp32's range",
             [](StepParams* p) {
               p->adam_w_mode = false;
               p->weight_decay = 1e39;
             });
  param_case("eps_beyond_fp32", "eps is beyond fp32's range",
             [](StepParams* p) { p->eps = 1e39; });
  param_case("eps_rounding_to_zero_in_fp32", "eps 1e-50 rounds to 0 in fp32",
             [](StepParams* p) { p->eps = 1e-50; });
  param_case("eps_at_half_the_smallest_fp32", "rounds to 0 in fp32",  // a tie, to even: 0
             [](StepParams* p) { p->eps = std::ldexp(1.0, -150); });
  // Not only through step 0's infinite lr / (1 - beta1^0): by its own rule.
  param_case("step_zero", "step 0 is less than 1", [](StepParams* p) { p->step = 0; });
  param_case("step_negative", "step", [](StepParams* p) { p->step = -2; });
  return cases;
}

void PrintTo(const ErrorCase& c, std::ostream* os) { *os << c.name; }

class AdamErrorTest : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(AdamErrorTest, RejectsAndWritesNothing) {
  const ErrorCase& c = GetParam();
  using D = DType;
  std::mt19937 rng(21);
  // Three valid tensors with every kind of scale in play.
  std::vector<Tensor> tensors = {
      MakeTensor(
          {D::kFloat32, D::kBFloat16, D::kFloat32, D::kFloat16, D::kNone, true},
          40, &rng),
      MakeTensor({D::kFloat16, D::kFloat16, D::kFloat16, D::kFloat8E4M3,
                  D::kFloat16, true},
                 40, &rng),
      MakeTensor({D::kBFloat16, D::kFloat32, D::kFloat8E4M3, D::kBFloat16,
                  D::kInt16Remainder, true},
                 40, &rng),
  };
  const std::vector<Tensor> before = tensors;
  ForEachTarget([&] {
    tensors = before;  // each target starts clean, even after a failure
    std::vector<TensorSlot> slots = Slots(&tensors);
    StepParams params;
    c.breaks(&slots, &params, &tensors);
    Error error;
    EXPECT_EQ(AdamStep(slots.data(), 3, params, 2, &error),
              Status::kInvalidArgument);
    EXPECT_EQ(error.tensor_index, c.tensor_index) << error.message;
    EXPECT_NE(error.message.find(c.mentions), std::string::npos)
        << "message does not mention '" << c.mentions << "': " << error.message;
    // Also without an Error to fill.
    EXPECT_EQ(AdamStep(slots.data(), 3, params, 1, nullptr),
              Status::kInvalidArgument);
    // The slots alone: AdamStep's verdict and message for a slot rule; a
    // hyper-parameter is not theirs to check.
    Error slot_error;
    const Status slot_status = CheckStepSlots(slots.data(), 3, false, &slot_error);
    if (c.tensor_index < 0) {
      EXPECT_EQ(slot_status, Status::kOk) << slot_error.message;
    } else {
      EXPECT_EQ(slot_status, Status::kInvalidArgument);
      EXPECT_EQ(slot_error.message, error.message);
    }
    ASSERT_TRUE(SameTensors(before, tensors));
    ExpectBadScalesUntouched();
    for (size_t k = 0; k < before.size(); ++k) {
      // Bitwise, NaN payloads included: nothing may have been touched.
      ASSERT_EQ(before[k].param, tensors[k].param);
      ASSERT_EQ(before[k].exp_avg, tensors[k].exp_avg);
      ASSERT_EQ(before[k].exp_avg_sq, tensors[k].exp_avg_sq);
      ASSERT_EQ(before[k].master, tensors[k].master);
    }
  });
}

// Two buffers of one tensor that share one byte, at either end, overlap; two that
// only touch do not (an fp16 param of 80 bytes beside an fp8 exp_avg_sq of 40).
TEST(CheckStepSlotsTest, OneSharedByteIsAnOverlapAndTouchingBuffersAreNot) {
  std::mt19937 rng(23);
  std::vector<Tensor> tensors = {MakeTensor(
      {DType::kFloat16, DType::kFloat16, DType::kFloat16, DType::kFloat8E4M3,
       DType::kFloat16, true},
      40, &rng)};
  alignas(64) uint8_t arena[256] = {};
  const struct {
    int param, exp_avg_sq;  // byte offsets in the arena
    bool overlap;
  } cases[] = {{0, 80, false}, {0, 79, true}, {40, 0, false}, {40, 1, true}};
  for (const auto& c : cases) {
    SCOPED_TRACE("param at " + std::to_string(c.param) + ", exp_avg_sq at " +
                 std::to_string(c.exp_avg_sq));
    std::vector<TensorSlot> slots = Slots(&tensors);
    slots[0].param = arena + c.param;
    slots[0].exp_avg_sq = arena + c.exp_avg_sq;
    Error error;
    const Status status = CheckStepSlots(slots.data(), 1, false, &error);
    if (c.overlap) {
      EXPECT_EQ(status, Status::kInvalidArgument);
      EXPECT_NE(error.message.find("overlap"), std::string::npos) << error.message;
    } else {
      EXPECT_EQ(status, Status::kOk) << error.message;
    }
  }
}

// Scale slots in device memory are checked for presence and alignment, never
// read: a NaN there is the device's business, not a host read.
TEST(CheckStepSlotsTest, DeviceScalesAreNotRead) {
  std::mt19937 rng(22);
  std::vector<Tensor> tensors = {MakeTensor(
      {DType::kBFloat16, DType::kBFloat16, DType::kFloat8E4M3, DType::kFloat16,
       DType::kFloat32, true},
      40, &rng)};
  std::vector<TensorSlot> slots = Slots(&tensors);
  float nan_scale = NAN;
  slots[0].exp_avg_scale = &nan_scale;
  Error error;
  EXPECT_EQ(CheckStepSlots(slots.data(), 1, false, &error), Status::kInvalidArgument);
  EXPECT_NE(error.message.find("exp_avg_scale"), std::string::npos) << error.message;
  EXPECT_EQ(CheckStepSlots(slots.data(), 1, true, &error), Status::kOk) << error.message;
  slots[0].exp_avg_scale = nullptr;
  EXPECT_EQ(CheckStepSlots(slots.data(), 1, true, &error), Status::kInvalidArgument);
  EXPECT_EQ(CheckStepSlots(slots.data(), -1, false, &error), Status::kInvalidArgument);
  EXPECT_EQ(CheckStepSlots(nullptr, 0, false, &error), Status::kOk);
}

INSTANTIATE_TEST_SUITE_P(
    Rules, AdamErrorTest, ::testing::ValuesIn(ErrorCases()),
    [](const ::testing::TestParamInfo<ErrorCase>& case_info) {
      return case_info.param.name;
    });

// An empty tensor may come with null buffers (torch's empty tensors can have no
// storage); its scaled states still need a scale slot, which the step sets to 1
// (S2.3: the scale of an empty tensor).
TEST(AdamEmptyTest, EmptyTensorsMayHaveNullBuffers) {
  std::mt19937 rng(6);
  const Config config = {DType::kBFloat16,   DType::kFloat16, DType::kFloat16,
                         DType::kFloat8E4M3, DType::kFloat16, true};
  std::vector<Tensor> start = {MakeTensor(config, 0, &rng),
                               MakeTensor(config, 17, &rng)};
  start[0].exp_avg_scale = 0.5f;
  start[0].exp_avg_sq_scale = 4.0f;
  start[0].master_scale = 0.25f;
  StepParams params;
  std::vector<Tensor> want = start;
  std::vector<TensorSlot> want_slots = Slots(&want);
  ref::AdamStep(want_slots.data(), 2, params);
  EXPECT_EQ(want[0].exp_avg_scale, 1.0f);
  ForEachTarget([&] {
    std::vector<Tensor> got = start;
    std::vector<TensorSlot> slots = Slots(&got);
    slots[0].param = nullptr;
    slots[0].grad = nullptr;
    slots[0].exp_avg = nullptr;
    slots[0].exp_avg_sq = nullptr;
    slots[0].master_param = nullptr;
    Error error;
    ASSERT_EQ(AdamStep(slots.data(), 2, params, 2, &error), Status::kOk)
        << error.message;
    EXPECT_TRUE(SameTensors(want, got));
  });
}

// The version the library reports is its headers' and CMake's project version
// (which CMakeLists.txt parses from version.h).
TEST(AdamVersionTest, OneVersionEverywhere) {
  EXPECT_STREQ(Version(), SHARDADAM_VERSION_STRING);
  EXPECT_STREQ(Version(), SHARDADAM_PROJECT_VERSION);
  char composed[32];
  std::snprintf(composed, sizeof(composed), "%d.%d.%d", SHARDADAM_VERSION / 10000,
                SHARDADAM_VERSION / 100 % 100, SHARDADAM_VERSION % 100);
  EXPECT_STREQ(Version(), composed);
}

// The core reports the targets it runs on consistently with its test hooks.
TEST(AdamTargetsTest, ReportsCompiledTargets) {
  const std::string supported = " " + SupportedTargets() + " ";
  for (int64_t target : internal::CompiledTargets()) {
    EXPECT_NE(supported.find(std::string(" ") + hwy::TargetName(target) + " "),
              std::string::npos)
        << hwy::TargetName(target) << " missing from '" << SupportedTargets()
        << "'";
  }
  EXPECT_NE(supported.find(std::string(" ") + ChosenTarget() + " "),
            std::string::npos)
      << ChosenTarget();
  EXPECT_GE(DefaultThreads(), 1);
}

// Every target the tests run on, with its vector width, best first, e.g.
// "SVE2/512 SVE/512 NEON/128" (a fused pair is two vectors of fp32 lanes). A
// run on an emulated CPU names the targets it chose the CPU for in
// SHARDADAM_EXPECT_TARGETS, so that an emulator or Highway offering fewer (or
// other widths) fails the run instead of testing less.
TEST(AdamTargetsTest, RunsTheExpectedTargets) {
  std::string got;
  for (int64_t target : internal::CompiledTargets()) {
    ScopedTarget scope(target);
    ASSERT_TRUE(scope.ok());
    const size_t bits = internal::ActiveKernels().pair / 2 * 32;
    if (!got.empty()) got += ' ';
    got += std::string(hwy::TargetName(target)) + "/" + std::to_string(bits);
  }
  std::printf("targets: %s\n", got.c_str());
  if (const char* want = std::getenv("SHARDADAM_EXPECT_TARGETS")) {
    EXPECT_EQ(got, want);
  }
}

// SetError, for callers' own checks: "{other}" names the other tensor, or says
// "another tensor" where the rule was given none.
TEST(AdamCallErrorTest, SetErrorWritesTheOtherTensor) {
  Error error;
  SetError(&error, 3, "grad overlaps {other}'s param", 1);
  EXPECT_EQ(error.message, "tensor 3: grad overlaps tensor 1's param");
  EXPECT_EQ(error.other_tensor_index, 1);
  SetError(&error, 3, "grad overlaps {other}'s param");
  EXPECT_EQ(error.message, "tensor 3: grad overlaps another tensor's param");
  EXPECT_EQ(error.other_tensor_index, -1);
}

// The call itself: a negative count or a null list with a positive count.
TEST(AdamCallErrorTest, BadListIsRejected) {
  Error error;
  EXPECT_EQ(AdamStep(nullptr, 2, StepParams(), 1, &error),
            Status::kInvalidArgument);
  EXPECT_FALSE(error.message.empty());
  TensorSlot slot;
  EXPECT_EQ(AdamStep(&slot, -1, StepParams(), 1, &error),
            Status::kInvalidArgument);
  EXPECT_EQ(AdamStep(nullptr, 0, StepParams(), 1, &error), Status::kOk);
}

}  // namespace
}  // namespace testing
}  // namespace shardadam
