// The CUDA kernels' per-element code (csrc/cuda/codecs.h, slot_math.h) run on
// the CPU: their codecs against the scalar reference on every 16-bit and 8-bit
// pattern and on fp32 patterns around every rounding position, and their
// two-pass step (measure the absmax, then store with the new scale), in the
// order the kernels run it, against the reference on every dtype combination.
// What is left to a GPU is the launch itself (tests/python/test_cuda_backend.py).
#include <cmath>
#include <cstdint>
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

// AdamStepCuda's work for one call, in the kernels' order and with their walk
// over the elements (one lane): pass 1 reduces the new state's absmax per scaled
// state, pass 2 recomputes and stores with the scales it gives, then the scale
// slots are written. Each tensor runs its layout's code (layouts.h), four
// elements per access where its buffers allow, unless `quads` is false.
template <bool kAdamW>
void EmulatedCudaStep(const std::vector<TensorSlot>& slots, const StepParams& params,
                      bool quads) {
  const StepConstants c = MakeStepConstants(params);
  for (const TensorSlot& slot : slots) {
    cuda::DeviceSlot t = cuda::MakeDeviceSlot(slot);
    t.quad_aligned = t.quad_aligned && quads;
    cuda::VisitLayout(cuda::LayoutOf(t), [&](auto layout) {
      using L = decltype(layout);
      L::Fix(t);
      const cuda::Scales old = cuda::ReadScales(t);
      uint32_t best[3] = {0, 0, 0};
      cuda::UpdateRange<kAdamW, L>(t, old, c, 0, t.numel, 0, 1,
                                   [&](int64_t, int n, const cuda::Inputs* e) {
                                     cuda::FoldAbsMax<L>(n, e, best);
                                   });
      const cuda::Scales now = cuda::NewScales(t, best);
      cuda::UpdateRange<kAdamW, L>(t, old, c, 0, t.numel, 0, 1,
                                   [&](int64_t i, int n, const cuda::Inputs* e) {
                                     cuda::StoreUpdated<L>(t, now, i, n, e);
                                   });
      for (int k = 0; k < 3; ++k) {
        if (t.scale[k] != nullptr) *t.scale[k] = now.s[k];
      }
    });
  }
}

void EmulatedCudaStep(const std::vector<TensorSlot>& slots, const StepParams& params,
                      bool quads = true) {
  if (params.adam_w_mode) {
    EmulatedCudaStep<true>(slots, params, quads);
  } else {
    EmulatedCudaStep<false>(slots, params, quads);
  }
}

class CudaStepMathTest : public ::testing::TestWithParam<Config> {};

TEST_P(CudaStepMathTest, MatchesReferenceBitwise) {
  std::mt19937 rng(4321);
  std::vector<Tensor> tensors;
  for (int64_t n : {0, 1, 17, 0, 255, 1001, 0}) tensors.push_back(MakeTensor(GetParam(), n, &rng));
  for (const StepParams& params : Schedule(GetParam().adam_w)) {
    SCOPED_TRACE("step " + std::to_string(params.step));
    for (Tensor& t : tensors) FillGrad(&t, &rng);
    std::vector<Tensor> want = tensors;
    std::vector<TensorSlot> want_slots = Slots(&want);
    ref::AdamStep(want_slots.data(), static_cast<int64_t>(want_slots.size()), params);
    for (bool quads : {true, false}) {
      SCOPED_TRACE(quads ? "four elements per access where aligned" : "one element per access");
      std::vector<Tensor> got = tensors;
      EmulatedCudaStep(Slots(&got), params, quads);
      ASSERT_TRUE(SameTensors(want, got));
    }
    tensors = want;
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, CudaStepMathTest, ::testing::ValuesIn(AllConfigs()),
                         [](const ::testing::TestParamInfo<Config>& case_info) {
                           return ConfigName(case_info.param);
                         });

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

}  // namespace
}  // namespace testing
}  // namespace shardadam
