// The CUDA kernels' per-element code (csrc/cuda/codecs.h, slot_math.h) run on
// the CPU: their codecs against the scalar reference on every 16-bit and 8-bit
// pattern and on fp32 patterns around every rounding position, and their
// two-pass step (measure the absmax, then store with the new scale), in the
// order the kernels run it, against the reference on every dtype combination,
// and with a bf16 param without master rounded stochastically (S2.14).
// What is left to a GPU is the launch itself (tests/python/test_cuda_backend.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cuda/codecs.h"
#include "cuda/layouts.h"
#include "cuda/range.h"
#include "cuda/slot_math.h"
#include "gtest/gtest.h"
#include "reference.h"
#include "tensor_fixture.h"
#include "test_util.h"

namespace shardadam {
namespace testing {
namespace {

TEST(CudaCodecsTest, DecodersMatchReferenceOnEveryPattern) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const auto q = static_cast<uint16_t>(h);
    ASSERT_EQ(BitsOf(cuda::DecodeBF16(q)), BitsOf(ref::BFloat16ToFloat(q))) << h;
    ASSERT_EQ(BitsOf(cuda::DecodeF16(q)), BitsOf(ref::Float16ToFloat(q))) << h;
  }
  for (uint32_t q = 0; q <= 0xFF; ++q) {
    ASSERT_EQ(BitsOf(cuda::DecodeF8(static_cast<uint8_t>(q))),
              BitsOf(ref::Float8E4M3ToFloat(static_cast<uint8_t>(q))))
        << q;
  }
}

// fp32 patterns whose low bits sit at and around a tie for every rounding
// position (every exponent and sign), plus random patterns.
std::vector<uint32_t> EncoderInputs() {
  std::vector<uint32_t> inputs;
  std::mt19937 rng(7);
  for (uint32_t top = 0; top < 512; ++top) {  // sign and exponent
    for (int shift = 1; shift <= 23; ++shift) {
      const uint32_t half = 1u << (shift - 1);
      const uint32_t lows[] = {0, 1, half - 1, half, half + 1, (half << 1) - 1};
      for (int r = 0; r < 4; ++r) {
        const uint32_t high = (rng() & 0x7FFFFFu) >> shift << shift;
        for (uint32_t low : lows) inputs.push_back((top << 23) | high | (low & ((1u << shift) - 1)));
      }
    }
  }
  for (int i = 0; i < 1 << 20; ++i) inputs.push_back(static_cast<uint32_t>(rng()));
  // The device's NaN and its negative: splitting their own bits would wrap.
  inputs.insert(inputs.end(), {0x7FFFFFFFu, 0xFFFFFFFFu, 0x7FFF8000u, 0xFFFF8000u});
  return inputs;
}

TEST(CudaCodecsTest, EncodersMatchReference) {
  for (uint32_t bits : EncoderInputs()) {
    const float f = FloatOf(bits);
    ASSERT_EQ(cuda::EncodeBF16(f), ref::FloatToBFloat16(f)) << std::hex << bits;
    ASSERT_EQ(cuda::EncodeF16(f), ref::FloatToFloat16(f)) << std::hex << bits;
    ASSERT_EQ(cuda::EncodeF8(f), ref::FloatToFloat8E4M3(f)) << std::hex << bits;
    uint16_t want_param, got_param;
    int16_t want_rest, got_rest;
    ref::SplitMaster(f, &want_param, &want_rest);
    cuda::SplitMaster(f, &got_param, &got_rest);
    ASSERT_EQ(got_param, want_param) << std::hex << bits;
    ASSERT_EQ(got_rest, want_rest) << std::hex << bits;
    ASSERT_EQ(std::isnan(ref::BFloat16ToFloat(got_param)), std::isnan(f)) << std::hex << bits;
    ASSERT_EQ(BitsOf(cuda::MergeMaster(got_param, got_rest)),
              BitsOf(ref::MergeMaster(want_param, want_rest)))
        << std::hex << bits;
  }
}

// AdamStepCuda's work for one call, in the kernels' order and with their walk:
// per tensor, every block of kChunk elements with its kThreads lanes one after
// another. Pass 1 reduces the new state's absmax per scaled state, pass 2
// recomputes and stores with the scales it gives, then the scale slots are
// written. Each tensor runs its layout's code (layouts.h), four elements per
// access where its buffers allow.
template <bool kAdamW, class L>
void EmulatedTensorStep(cuda::DeviceSlot t, const StepConstants& c) {
  L::Fix(t);
  const auto each_lane = [&](auto&& done) {
    for (int64_t begin = 0; begin < t.numel; begin += cuda::kChunk) {
      const int64_t end = std::min(begin + cuda::kChunk, t.numel);
      for (int lane = 0; lane < cuda::kThreads; ++lane) {
        cuda::UpdateRange<kAdamW, L>(t, cuda::ReadScales(t), c, begin, end, lane,
                                     cuda::kThreads, done);
      }
    }
  };
  uint32_t best[3] = {0, 0, 0};
  each_lane([&](int64_t, int n, const cuda::Inputs* e) { cuda::FoldAbsMax<L>(n, e, best); });
  const cuda::Scales now = cuda::NewScales(t, best);
  each_lane([&](int64_t i, int n, const cuda::Inputs* e) {
    cuda::StoreUpdated<L>(t, now, i, n, e);
  });
  for (int k = 0; k < 3; ++k) {
    if (t.scale[k] != nullptr) *t.scale[k] = now.s[k];
  }
}

// With the step's stochastic rounding keys, as AdamStepCuda makes its slots.
template <bool kAdamW>
void EmulatedCudaStep(const std::vector<TensorSlot>& slots, const StepParams& params) {
  const StepConstants c = MakeStepConstants(params);
  for (const TensorSlot& slot : slots) {
    const cuda::DeviceSlot t = cuda::MakeDeviceSlot(slot, params.step);
    cuda::VisitLayout(cuda::LayoutOf(t), [&](auto layout) {
      using L = decltype(layout);
      // Per-block layouts step in BlockKernel (cuda_block_math_test), never here.
      if constexpr (L::kMayTensor) EmulatedTensorStep<kAdamW, L>(t, c);
    });
  }
}

void EmulatedCudaStep(const std::vector<TensorSlot>& slots, const StepParams& params) {
  if (params.adam_w_mode) {
    EmulatedCudaStep<true>(slots, params);
  } else {
    EmulatedCudaStep<false>(slots, params);
  }
}

// EmulatedCudaStep in layout L whichever layout the tensors would get: a fixed
// layout not among the compiled ones still runs its four-at-a-time path.
template <class L>
void EmulatedCudaStepIn(const std::vector<TensorSlot>& slots, const StepParams& params) {
  const StepConstants c = MakeStepConstants(params);
  for (const TensorSlot& slot : slots) {
    const cuda::DeviceSlot t = cuda::MakeDeviceSlot(slot, params.step);
    ASSERT_TRUE(L::Matches(t));
    if (params.adam_w_mode) {
      EmulatedTensorStep<true, L>(t, c);
    } else {
      EmulatedTensorStep<false, L>(t, c);
    }
  }
}

using EmulatedStep = void (*)(const std::vector<TensorSlot>&, const StepParams&);

// EmulatedCudaStep on copies of the tensors' buffers placed as the device gets
// them: 16-byte aligned, or one element past that where `shifted` says, with
// guard bytes on both sides that must be intact afterwards.
::testing::AssertionResult RelocatedStep(const std::vector<TensorSlot>& slots,
                                         const StepParams& params, unsigned shifted,
                                         EmulatedStep step = EmulatedCudaStep) {
  constexpr size_t kGuard = 16;
  constexpr uint8_t kGuardByte = 0xA5;
  struct Copy {
    std::vector<uint8_t> storage;
    size_t offset, bytes;
    void* host;
  };
  std::vector<std::unique_ptr<Copy>> copies;
  std::vector<TensorSlot> moved = slots;
  const auto relocate = [&](const void* host, DType dtype, int64_t numel, unsigned bit) {
    const size_t item = static_cast<size_t>(cuda::ItemBytes(static_cast<int>(dtype)));
    auto copy = std::make_unique<Copy>();
    copy->bytes = item * static_cast<size_t>(numel);
    copy->storage.assign(2 * kGuard + 16 + item + copy->bytes, kGuardByte);
    const auto base = reinterpret_cast<uintptr_t>(copy->storage.data());
    copy->offset = (16 - base % 16) % 16 + kGuard + ((shifted & bit) ? item : 0);
    copy->host = const_cast<void*>(host);
    if (copy->bytes > 0) std::memcpy(copy->storage.data() + copy->offset, host, copy->bytes);
    copies.push_back(std::move(copy));
    return static_cast<void*>(copies.back()->storage.data() + copies.back()->offset);
  };
  for (TensorSlot& s : moved) {
    s.param = relocate(s.param, s.param_dtype, s.numel, kParamShifted);
    s.grad = relocate(s.grad, s.grad_dtype, s.numel, kGradShifted);
    s.exp_avg = relocate(s.exp_avg, s.exp_avg_dtype, s.numel, kExpAvgShifted);
    s.exp_avg_sq = relocate(s.exp_avg_sq, s.exp_avg_sq_dtype, s.numel, kExpAvgSqShifted);
    if (s.master_dtype != DType::kNone) {
      s.master_param = relocate(s.master_param, s.master_dtype, s.numel, kMasterShifted);
    }
  }
  step(moved, params);
  for (size_t k = 0; k < copies.size(); ++k) {
    const Copy& copy = *copies[k];
    for (size_t b = 0; b < copy.storage.size(); ++b) {
      const bool inside = b >= copy.offset && b < copy.offset + copy.bytes;
      if (!inside && copy.storage[b] != kGuardByte) {
        return ::testing::AssertionFailure() << "buffer " << k << ": byte " << b
                                             << " outside it was written";
      }
    }
    if (copy.bytes > 0) std::memcpy(copy.host, copy.storage.data() + copy.offset, copy.bytes);
  }
  return ::testing::AssertionSuccess();
}

bool HasCompiledLayout(const Config& config) {
  Tensor t;
  t.config = config;
  return cuda::LayoutOf(cuda::MakeDeviceSlot(t.Slot())) != cuda::kAnyLayout;
}

class CudaStepMathTest : public ::testing::TestWithParam<Config> {};

TEST_P(CudaStepMathTest, MatchesReferenceBitwise) {
  std::mt19937 rng(4321);
  std::vector<Tensor> tensors;
  // 8192 elements per block: 8195 spans two, and leaves a tail of three.
  for (int64_t n : {0, 1, 17, 0, 255, 1001, 0, 8195}) {
    tensors.push_back(MakeTensor(GetParam(), n, &rng));
  }
  // Every buffer aligned (quads where the layout is compiled), every buffer
  // shifted, and, where quads are possible, each buffer shifted alone.
  std::vector<unsigned> placements = {kNoneShifted, kAllShifted};
  if (HasCompiledLayout(GetParam())) {
    placements.insert(placements.end(), {kParamShifted, kGradShifted, kExpAvgShifted,
                                         kExpAvgSqShifted, kMasterShifted});
  }
  for (const StepParams& params : Schedule(GetParam().adam_w)) {
    SCOPED_TRACE("step " + std::to_string(params.step));
    for (Tensor& t : tensors) FillGrad(&t, &rng);
    std::vector<Tensor> want = tensors;
    std::vector<TensorSlot> want_slots = Slots(&want);
    ref::AdamStep(want_slots.data(), static_cast<int64_t>(want_slots.size()), params);
    for (unsigned shifted : placements) {
      SCOPED_TRACE("shifted buffers (bits: param grad exp_avg exp_avg_sq master): " +
                   std::to_string(shifted));
      std::vector<Tensor> got = tensors;
      ASSERT_TRUE(RelocatedStep(Slots(&got), params, shifted));
      ASSERT_TRUE(SameTensors(want, got));
    }
    tensors = want;
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, CudaStepMathTest, ::testing::ValuesIn(AllConfigs()),
                         [](const ::testing::TestParamInfo<Config>& case_info) {
                           return ConfigName(case_info.param);
                         });

// S2.14: a bf16 param with no master rounded stochastically stores the CPU
// core's bits, in the layout its dtypes get (the catch-all: no compiled layout
// has such a param) and, where the moments allow, in a fixed layout's
// four-at-a-time path, which passes each element's own index.
class CudaParamRoundingMathTest : public ::testing::TestWithParam<ParamRoundingCase> {};

template <int kGrad, int kExpAvg, int kExpAvgSq>
EmulatedStep FixedLayoutStep() {
  return EmulatedCudaStepIn<cuda::Layout<cuda::kBF16, kGrad, cuda::kNoMaster, kExpAvg, kExpAvgSq>>;
}

// The fixed layout of `config`'s dtypes, where the test instantiates one.
EmulatedStep FixedParamRoundingStep(const Config& config) {
  using D = DType;
  if (config.exp_avg != config.exp_avg_sq) return nullptr;
  const bool f32 = config.grad == D::kFloat32;
  switch (config.exp_avg) {
    case D::kFloat32:
      return f32 ? FixedLayoutStep<cuda::kF32, cuda::kF32, cuda::kF32>()
                 : FixedLayoutStep<cuda::kBF16, cuda::kF32, cuda::kF32>();
    case D::kFloat8E4M3:
      return f32 ? FixedLayoutStep<cuda::kF32, cuda::kF8, cuda::kF8>()
                 : FixedLayoutStep<cuda::kBF16, cuda::kF8, cuda::kF8>();
    default:
      return nullptr;
  }
}

TEST_P(CudaParamRoundingMathTest, MatchesCpuCoreBitwise) {
  const ParamRoundingCase& param_case = GetParam();
  std::mt19937 rng(2468);
  std::vector<Tensor> tensors;
  int k = 0;
  for (int64_t n : {0, 1, 17, 0, 255, 1001, 0, 8195}) {
    tensors.push_back(MakeTensor(param_case.config, n, &rng));
    SetParamRounding(param_case, k++, &tensors.back());
  }
  const EmulatedStep fixed = FixedParamRoundingStep(param_case.config);
  for (const StepParams& params : Schedule(param_case.config.adam_w)) {
    SCOPED_TRACE("step " + std::to_string(params.step));
    for (Tensor& t : tensors) FillGrad(&t, &rng);
    std::vector<Tensor> want = tensors, reference = tensors;
    std::vector<TensorSlot> want_slots = Slots(&want), reference_slots = Slots(&reference);
    Error error;
    ASSERT_EQ(AdamStep(want_slots.data(), static_cast<int64_t>(want_slots.size()), params, 2,
                       &error),
              Status::kOk)
        << error.message;
    ref::AdamStep(reference_slots.data(), static_cast<int64_t>(reference_slots.size()), params);
    ASSERT_TRUE(SameTensors(want, reference)) << "the CPU core and the reference";
    for (unsigned shifted : {kNoneShifted, kAllShifted}) {
      SCOPED_TRACE("shifted buffers: " + std::to_string(shifted));
      std::vector<Tensor> got = tensors;
      ASSERT_TRUE(RelocatedStep(Slots(&got), params, shifted));
      ASSERT_TRUE(SameTensors(want, got));
      if (fixed != nullptr) {
        SCOPED_TRACE("fixed layout");
        got = tensors;
        ASSERT_TRUE(RelocatedStep(Slots(&got), params, shifted, fixed));
        ASSERT_TRUE(SameTensors(want, got));
      }
    }
    // Rounded stochastically: not the bits rounding to nearest stores.
    if (params.lr != 0.0) {
      std::vector<Tensor> nearest = tensors;
      for (Tensor& t : nearest) t.param_rounding = Rounding::kNearest;
      std::vector<TensorSlot> nearest_slots = Slots(&nearest);
      ref::AdamStep(nearest_slots.data(), static_cast<int64_t>(nearest_slots.size()), params);
      EXPECT_NE(nearest.back().param, want.back().param);
    }
    tensors = want;
  }
}

INSTANTIATE_TEST_SUITE_P(BF16ParamNoMaster, CudaParamRoundingMathTest,
                         ::testing::ValuesIn(ParamRoundingCases()),
                         [](const ::testing::TestParamInfo<ParamRoundingCase>& case_info) {
                           return ParamRoundingCaseName(case_info.param);
                         });

TEST(CudaParamRoundingMathTest, SlotCarriesTheParamKey) {
  TensorSlot s;
  s.param_dtype = DType::kBFloat16;
  s.param_rounding = Rounding::kStochastic;
  s.rounding_key = 77;
  s.first_index = int64_t{5} << 32;
  const cuda::DeviceSlot d = cuda::MakeDeviceSlot(s, 9);
  EXPECT_TRUE(d.p_stochastic);
  EXPECT_FALSE(d.m_stochastic);
  EXPECT_EQ(d.p_key, ParamStepKey(77, 9));
  EXPECT_NE(d.p_key, d.m_key);
  EXPECT_EQ(d.first_index, int64_t{5} << 32);
}

TEST(CudaStepMathTest, NonFiniteStateGetsUnitScale) {
  // An fp16 moment whose update overflows or is NaN: scale 1, as S2.3 says.
  uint16_t param = ref::FloatToFloat16(1.0f), m = 0, v = 0;
  const float grad_values[] = {NAN, INFINITY};
  for (float g_value : grad_values) {
    float grad = g_value, m_scale = 2.0f, v_scale = 2.0f;
    TensorSlot s;
    s.numel = 1;
    s.param = &param;
    s.param_dtype = DType::kFloat16;
    s.grad = &grad;
    s.exp_avg = &m;
    s.exp_avg_dtype = DType::kFloat16;
    s.exp_avg_scale = &m_scale;
    s.exp_avg_sq = &v;
    s.exp_avg_sq_dtype = DType::kFloat16;
    s.exp_avg_sq_scale = &v_scale;
    EmulatedCudaStep({s}, StepParams());
    EXPECT_EQ(m_scale, 1.0f);
    EXPECT_EQ(v_scale, 1.0f);
  }
}

// The combinations the kernels are compiled for, spelled out independently of
// layouts.h: each gets its own layout (whose constants are its dtypes), every
// other combination the catch-all.
TEST(CudaLayoutTest, CompiledCombinationsGetTheirLayouts) {
  using D = DType;
  const Config compiled[] = {
      {D::kFloat32, D::kFloat32, D::kFloat32, D::kFloat32, D::kNone, true},
      {D::kBFloat16, D::kBFloat16, D::kFloat32, D::kFloat32, D::kFloat32, true},
      {D::kBFloat16, D::kBFloat16, D::kBFloat16, D::kBFloat16, D::kFloat32, true},
      {D::kBFloat16, D::kBFloat16, D::kBFloat16, D::kBFloat16, D::kInt16Remainder, true},
      {D::kBFloat16, D::kBFloat16, D::kFloat8E4M3, D::kFloat8E4M3, D::kFloat32, true},
      {D::kFloat32, D::kFloat32, D::kBFloat16, D::kBFloat16, D::kNone, true},
      {D::kFloat32, D::kFloat32, D::kFloat8E4M3, D::kFloat8E4M3, D::kNone, true},
      {D::kBFloat16, D::kBFloat16, D::kFloat8E4M3, D::kBFloat16, D::kFloat32, true},
  };
  const auto same = [](const Config& a, const Config& b) {
    return a.param == b.param && a.grad == b.grad && a.exp_avg == b.exp_avg &&
           a.exp_avg_sq == b.exp_avg_sq && a.master == b.master;
  };
  std::vector<int> seen;
  for (const Config& config : AllConfigs()) {
    SCOPED_TRACE(ConfigName(config));
    Tensor t;
    t.config = config;
    const cuda::DeviceSlot slot = cuda::MakeDeviceSlot(t.Slot());
    const int id = cuda::LayoutOf(slot);
    const bool listed = std::any_of(std::begin(compiled), std::end(compiled),
                                    [&](const Config& c) { return same(c, config); });
    EXPECT_EQ(id != cuda::kAnyLayout, listed);
    cuda::VisitLayout(id, [&](auto layout) {
      using L = decltype(layout);
      EXPECT_EQ(L::kFixed, listed);
      cuda::DeviceSlot fixed = slot;
      L::Fix(fixed);
      EXPECT_TRUE(fixed.param_dtype == slot.param_dtype && fixed.grad_dtype == slot.grad_dtype &&
                  fixed.master_dtype == slot.master_dtype &&
                  fixed.exp_avg_dtype == slot.exp_avg_dtype &&
                  fixed.exp_avg_sq_dtype == slot.exp_avg_sq_dtype)
          << "Fix changed a dtype tag";
    });
    if (listed && config.adam_w) seen.push_back(id);
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::unique(seen.begin(), seen.end()) - seen.begin(), std::size(compiled))
      << "one layout each";
}

}  // namespace
}  // namespace testing
}  // namespace shardadam
