// Which path a tensor's plan picks (plan.h): every layout of the declared list
// (fused_layouts.h) gets its fused kernel and every other layout the block path.
// The bits are the same either way (adam_test checks them against the
// reference), so only the choice, which decides the speed, is checked here.
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "fused_layouts.h"
#include "plan.h"

namespace shardadam {
namespace {

using internal::FusedLayouts;
using internal::Weight;

TensorSlot SlotOf(DType grad, Weight weight, DType exp_avg, DType exp_avg_sq,
                  float* scale) {
  TensorSlot s;
  s.numel = 0;  // MakePlan reads no element
  s.grad_dtype = grad;
  s.param_dtype = weight == Weight::kParamF32 ? DType::kFloat32 : DType::kBFloat16;
  s.master_dtype = weight == Weight::kMasterF32   ? DType::kFloat32
                   : weight == Weight::kRemainder ? DType::kInt16Remainder
                                                  : DType::kNone;
  s.param_rounding = weight == Weight::kParamBF16Stochastic ? Rounding::kStochastic
                                                            : Rounding::kNearest;
  s.exp_avg_dtype = exp_avg;
  s.exp_avg_sq_dtype = exp_avg_sq;
  s.exp_avg_scale = scale;
  s.exp_avg_sq_scale = scale;
  return s;
}

template <class Layouts, size_t... I>
std::vector<TensorSlot> ListedSlots(std::index_sequence<I...>, float* scale) {
  return {SlotOf(std::tuple_element_t<I, Layouts>::kGrad,
                 std::tuple_element_t<I, Layouts>::kWeight,
                 std::tuple_element_t<I, Layouts>::kExpAvg,
                 std::tuple_element_t<I, Layouts>::kExpAvgSq, scale)...};
}

TEST(PlanTest, EveryListedLayoutTakesItsFusedKernel) {
  float scale = 1.0f;
  const auto slots =
      ListedSlots<FusedLayouts>(std::make_index_sequence<internal::kNumFusedLayouts>(), &scale);
  const internal::KernelTable& kt = internal::ActiveKernels();
  for (size_t i = 0; i < slots.size(); ++i) {
    const internal::TensorPlan p = internal::MakePlan(kt, slots[i]);
    EXPECT_EQ(p.fused, static_cast<int>(i)) << "layout " << i;
    EXPECT_NE(kt.fused.fn[1][0][p.fused], nullptr);
    // A measuring kernel exactly where a moment needs a measuring pass.
    const bool measured = NeedsMeasuringPass(slots[i].exp_avg_dtype) ||
                          NeedsMeasuringPass(slots[i].exp_avg_sq_dtype);
    EXPECT_EQ(kt.fused.measure[1][p.fused] != nullptr, measured) << "layout " << i;
  }
}

// Per-block scaled moments: the listed layouts take their fused block kernel,
// the others fp32 blocks; neither takes a per-tensor fused kernel.
TEST(PlanTest, ListedBlockLayoutsTakeTheirFusedBlockKernel) {
  float scales[1] = {1.0f};
  auto slots = ListedSlots<internal::FusedBlockLayouts>(
      std::make_index_sequence<internal::kNumFusedBlockLayouts>(), scales);
  const internal::KernelTable& kt = internal::ActiveKernels();
  for (size_t i = 0; i < slots.size(); ++i) {
    slots[i].scale_block = 256;
    const internal::TensorPlan p = internal::MakePlan(kt, slots[i]);
    EXPECT_EQ(p.fused, -1) << "layout " << i;
    EXPECT_EQ(p.fused_block, static_cast<int>(i)) << "layout " << i;
    EXPECT_NE(kt.fused.block[1][0][p.fused_block], nullptr);
  }
  TensorSlot both_signed = slots[0];
  both_signed.exp_avg_sq_dtype = DType::kFloat8E4M3Block;
  EXPECT_EQ(internal::MakePlan(kt, both_signed).fused_block, -1);
  TensorSlot bf16_exp_avg = slots[0];
  bf16_exp_avg.exp_avg_dtype = DType::kBFloat16;
  EXPECT_EQ(internal::MakePlan(kt, bf16_exp_avg).fused_block, -1);
}

TEST(PlanTest, LayoutsNotListedTakeTheBlockPath) {
  float scale = 1.0f;
  const internal::KernelTable& kt = internal::ActiveKernels();
  const TensorSlot unlisted[] = {
      // fp16 gradients, fp16 params, an fp16 master, mixed moments.
      SlotOf(DType::kFloat16, Weight::kParamF32, DType::kFloat32, DType::kFloat32, &scale),
      SlotOf(DType::kBFloat16, Weight::kMasterF32, DType::kBFloat16, DType::kFloat8E4M3,
             &scale),
      SlotOf(DType::kFloat32, Weight::kParamF32, DType::kFloat32, DType::kBFloat16, &scale),
      // A bf16 param with no master has fused kernels beside block moments only.
      SlotOf(DType::kBFloat16, Weight::kParamBF16, DType::kBFloat16, DType::kBFloat16, &scale),
      SlotOf(DType::kBFloat16, Weight::kParamBF16Stochastic, DType::kBFloat16,
             DType::kBFloat16, &scale),
  };
  for (const TensorSlot& s : unlisted) EXPECT_EQ(internal::MakePlan(kt, s).fused, -1);
  TensorSlot fp16_param =
      SlotOf(DType::kFloat32, Weight::kMasterF32, DType::kFloat32, DType::kFloat32, &scale);
  fp16_param.param_dtype = DType::kFloat16;
  EXPECT_EQ(internal::MakePlan(kt, fp16_param).fused, -1);
  TensorSlot fp16_master = fp16_param;
  fp16_master.param_dtype = DType::kBFloat16;
  fp16_master.master_dtype = DType::kFloat16;
  fp16_master.master_scale = &scale;
  EXPECT_EQ(internal::MakePlan(kt, fp16_master).fused, -1);
}

// The fused fp8 decoder folds a factor into the old scale: a scale too large
// for that product takes the block path, which does not fold.
TEST(PlanTest, AnFp8ScaleTooLargeToFoldTakesTheBlockPath) {
  const internal::KernelTable& kt = internal::ActiveKernels();
  float scale = 1.0f;
  const TensorSlot s = SlotOf(DType::kBFloat16, Weight::kRemainder, DType::kFloat8E4M3,
                              DType::kFloat8E4M3, &scale);
  EXPECT_GE(internal::MakePlan(kt, s).fused, 0);
  scale = 3.0e38f;
  ASSERT_FALSE(std::isfinite(scale * internal::kE4M3OverF16));
  EXPECT_EQ(internal::MakePlan(kt, s).fused, -1);
}

}  // namespace
}  // namespace shardadam
