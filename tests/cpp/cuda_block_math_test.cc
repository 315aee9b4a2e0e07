// The CUDA kernels' per-block scaled step (csrc/cuda/block_codecs.h,
// block_range.h) run on the CPU, lane after lane in the kernel's order, against
// the CPU core (AdamStep) and the scalar reference, bitwise: every param, grad and
// master option the core takes beside per-block moments, the 8-bit and 4-bit block
// formats, block moments beside unscaled ones and beside the other width's, block
// sizes 128..4096, shards whose first and last blocks are partial (4-bit: even
// first indices, odd counts with a padding nibble), zero, tiny, huge and
// non-finite blocks, block4 with exp_avg and exp_avg_sq rounded stochastically and
// block8 with its exp_avg_sq so (S2.13), bf16 params without master rounded
// stochastically (S2.14). What is left to a GPU
// is the launch (tests/cpp/cuda/adam_cuda_test.cc).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/block_codecs.h"
#include "cuda/block_range.h"
#include "cuda/layouts.h"
#include "cuda/slot_math.h"
#include "gtest/gtest.h"
#include "block_fixture.h"
#include "reference.h"
#include "test_util.h"

namespace shardadam {
namespace testing {
namespace {

namespace ref = reference;

// ---------------------------------------------------------------------- codecs

// Inputs around every rounding position of the 8-bit and 4-bit codes and far
// outside them.
std::vector<float> CodecInputs() {
  std::vector<float> inputs;
  std::mt19937 rng(3);
  for (int i = 0; i < 1 << 19; ++i) inputs.push_back(FloatOf(static_cast<uint32_t>(rng())));
  for (int e = -149; e < 128; ++e) {
    for (float f : {1.0f, 1.03125f, 1.0625f, 1.09375f, 1.5f, 1.96875f}) {
      inputs.push_back(std::ldexp(f, e));
      inputs.push_back(-std::ldexp(f, e));
      inputs.push_back(std::nextafter(std::ldexp(f, e), 0.0f));
      inputs.push_back(std::nextafter(std::ldexp(f, e), INFINITY));
    }
  }
  inputs.insert(inputs.end(), {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 464.0f, 488.0f, 7.0f,
                               -7.0f, 20.0f, 0.25f, -0.25f, 0.0625f, 1.25f, 5.0f, 18.0f});
  return inputs;
}

// The kernels' block codecs against the reference's element store and load, at
// the smallest, a small, unit, a large and the largest power-of-two scale. Both
// call the same scalar codecs for E4M4, E2M1 and E3M1 (checked against their
// definitions in codec_test.cc); what this compares for those is the dispatch
// by dtype, the scaling and the zero-free rule around them, and for E4M3 two
// implementations.
TEST(CudaBlockCodecTest, MatchReferenceAtEveryScale) {
  const std::vector<float> inputs = CodecInputs();
  for (float scale : {std::ldexp(1.0f, -126), std::ldexp(1.0f, -20), 1.0f,
                      std::ldexp(1.0f, 20), std::ldexp(1.0f, 127)}) {
    SCOPED_TRACE("scale " + std::to_string(scale));
    for (DType dtype : {kBlock8, kUBlock8, kBlock4, kUBlock4}) {
      SCOPED_TRACE(DTypeName(dtype));
      const auto tag = static_cast<uint8_t>(dtype);
      for (uint32_t code = 0; code < (1u << FormatOf(dtype).item_bits); ++code) {
        const auto byte = static_cast<uint8_t>(code);
        const float want = ref::LoadElement(&byte, dtype, 0) * scale;
        const float got = cuda::DecodeState(code, tag, scale);
        ASSERT_TRUE(BitsOf(got) == BitsOf(want) || (std::isnan(got) && std::isnan(want)))
            << "code " << code;
      }
      for (float u : inputs) {
        uint8_t want = 0;
        ref::StoreBlockElement(&want, dtype, 0, u, scale);
        ASSERT_EQ(cuda::EncodeState(u, tag, scale), want) << "fp32 0x" << std::hex << BitsOf(u);
      }
    }
  }
}

TEST(CudaBlockCodecTest, EveryBlockFormatOfTheCoreHasACodec) {
  for (int tag = 0; tag < kNumDTypes; ++tag) {
    const auto d = static_cast<DType>(tag);
    if (IsBlockScaled(d)) EXPECT_TRUE(cuda::HasBlockCodec(d)) << DTypeName(d);
  }
  for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3}) {
    EXPECT_FALSE(cuda::HasBlockCodec(d)) << DTypeName(d);
  }
}

// The order an emulated step runs a group's lanes in, phase by phase. On the GPU
// they run at once, so both orders must give the kernel's bits: reversed, with lane 0
// writing the scale slots before the other lanes' canonical step, shows two lanes
// that write one byte (4-bit pairs) or a lane that reads a slot lane 0 wrote.
enum class LaneOrder { kForward, kReversed };

// One step of `t` as the per-block kernel takes it: CUDA block after CUDA block,
// scale block after scale block, its lanes one after another (each updates its
// elements and stores their weights), the group's absmax, then each lane's
// moments with the new scales, the group's highest stochastic codes and each
// lane's canonical block (S2.13), then the scale slots.
template <bool kAdamW>
void EmulatedBlockStep(const TensorSlot& slot, const StepConstants& c, int64_t step,
                       LaneOrder order) {
  cuda::DeviceSlot t = cuda::MakeDeviceSlot(slot, step);
  ASSERT_TRUE(cuda::HasBlockScales(t));
  cuda::VisitLayout(cuda::LayoutOf(t), [&](auto layout) {
    using L = decltype(layout);
    ASSERT_TRUE(L::kMayBlock) << "a block tensor got a per-tensor layout";
    L::Fix(t);
    const int lanes = cuda::LanesPerScaleBlock(t.scale_block);
    std::vector<int> lane_order(static_cast<size_t>(lanes));
    for (int k = 0; k < lanes; ++k) lane_order[k] = order == LaneOrder::kForward ? k : lanes - 1 - k;
    std::vector<cuda::BlockLane> group(static_cast<size_t>(lanes));
    int64_t next = 0;  // the chunks cover the scale blocks once, in order
    for (int64_t chunk = 0; chunk < cuda::ChunksOf(t); ++chunk) {
      const cuda::ScaleBlockRange range = cuda::ChunkScaleBlocks(t, chunk);
      ASSERT_EQ(range.begin, next);
      ASSERT_LT(range.begin, range.end);
      next = range.end;
      for (int64_t j = range.begin; j < range.end; ++j) {
        uint32_t best[2] = {0, 0};
        for (int lane : lane_order) {
          cuda::UpdateBlockLane<kAdamW>(t, c, j, lane, group[lane]);
          for (int k = 0; k < 2; ++k) best[k] = std::max(best[k], group[lane].best[k]);
        }
        const cuda::Scales stored = cuda::NewBlockScales(t, best);
        uint32_t top[2] = {0, 0};
        for (int lane : lane_order) {
          cuda::StoreBlockLane(t, j, lane, stored, group[lane]);
          for (int k = 0; k < 2; ++k) top[k] = std::max(top[k], group[lane].top[k]);
        }
        // Each lane finds the group's scales from the same maxima; lane 0 writes them.
        cuda::Scales written = stored;
        cuda::CanonicalBlockLane(t, j, 0, top, written);
        if (order == LaneOrder::kReversed) cuda::WriteBlockScales(t, j, written);
        for (int lane : lane_order) {
          if (lane == 0) continue;
          cuda::Scales now = stored;
          cuda::CanonicalBlockLane(t, j, lane, top, now);
          for (int k = 0; k < 3; ++k) ASSERT_EQ(BitsOf(now.s[k]), BitsOf(written.s[k])) << lane;
        }
        if (order == LaneOrder::kForward) cuda::WriteBlockScales(t, j, written);
      }
    }
    ASSERT_EQ(next, ScaleCount(DType::kFloat8E4M3Block, slot.first_index, slot.numel,
                               slot.scale_block));
  });
}

void EmulatedBlockStep(const TensorSlot& slot, const StepParams& params,
                       LaneOrder order = LaneOrder::kForward) {
  const StepConstants c = MakeStepConstants(params);
  if (params.adam_w_mode) {
    EmulatedBlockStep<true>(slot, c, params.step, order);
  } else {
    EmulatedBlockStep<false>(slot, c, params.step, order);
  }
}

class CudaBlockStepMathTest : public ::testing::TestWithParam<BlockConfig> {};

TEST_P(CudaBlockStepMathTest, MatchesCpuCoreBitwise) {
  const BlockConfig& config = GetParam();
  std::vector<Shard> shards;
  for (const ShardShape& s : ShardShapesFor(config)) {
    shards.emplace_back(config, s.first_index, s.numel, s.block);
  }
  std::mt19937 rng(17);
  for (const StepParams& params : BlockSchedule(config.adam_w)) {
    SCOPED_TRACE("step " + std::to_string(params.step));
    for (Shard& s : shards) FillBlockGrad(&s, static_cast<int>(params.step), &rng);
    std::vector<Shard> core = shards, reference = shards;
    std::vector<TensorSlot> slots, reference_slots;
    for (Shard& s : core) slots.push_back(s.Slot());
    for (Shard& s : reference) reference_slots.push_back(s.Slot());
    Error error;
    ASSERT_EQ(AdamStep(slots.data(), static_cast<int64_t>(slots.size()), params, 2, &error),
              Status::kOk)
        << error.message;
    ref::AdamStep(reference_slots.data(), static_cast<int64_t>(reference_slots.size()), params);
    for (size_t k = 0; k < shards.size(); ++k) {
      SCOPED_TRACE("shard " + std::to_string(k) + " " + ShardName(shards[k]));
      ASSERT_TRUE(SameShard(core[k], reference[k])) << "the CPU core and the reference";
      for (LaneOrder order : {LaneOrder::kForward, LaneOrder::kReversed}) {
        SCOPED_TRACE(order == LaneOrder::kForward ? "lanes in order" : "lanes reversed");
        Shard got = shards[k];
        EmulatedBlockStep(got.Slot(), params, order);
        ASSERT_TRUE(SameShard(core[k], got));
      }
    }
    shards = core;
  }
}

INSTANTIATE_TEST_SUITE_P(AllOptions, CudaBlockStepMathTest, ::testing::ValuesIn(BlockConfigs()),
                         [](const ::testing::TestParamInfo<BlockConfig>& info) {
                           return BlockConfigName(info.param);
                         });

// Blocks of the rule's edge cases, checked on the emulated kernel's own output:
// all zeros (scale 1); moments at most 2^-136, which fp8-block stores as zeros
// even at 2^-126 (scale 1, S2.9); a v so small that even 2^-126 rounds it to
// code 0, which unsigned E4M4 stores as code 1 (S2.10); an ordinary block.
TEST(CudaBlockStepMathTest, ZeroAndTinyBlocksFollowTheScaleRule) {
  const BlockConfig config{DType::kFloat32, DType::kFloat32, DType::kNone, kBlock8, kUBlock8,
                           true};
  Shard s(config, 0, 512, 128);
  const float grads[4] = {0.0f, std::ldexp(1.0f, -134), std::ldexp(1.0f, -68), 1.0f};
  for (int64_t i = 0; i < 512; ++i) static_cast<float*>(Shard::At(s.grad))[i] = grads[i / 128];
  EmulatedBlockStep(s.Slot(), StepParams{});
  const auto* m_scale = static_cast<const float*>(Shard::At(s.m_scales));
  const auto* v_scale = static_cast<const float*>(Shard::At(s.v_scales));
  const auto* m = static_cast<const uint8_t*>(Shard::At(s.exp_avg));
  const auto* v = static_cast<const uint8_t*>(Shard::At(s.exp_avg_sq));
  EXPECT_EQ(m_scale[0], 1.0f);
  EXPECT_EQ(v_scale[0], 1.0f);
  EXPECT_EQ(m[0], 0);
  EXPECT_EQ(v[0], 0);
  EXPECT_EQ(m_scale[1], 1.0f);  // m = 0.1 * 2^-134 <= 2^-136
  EXPECT_EQ(m[128], 0);
  EXPECT_EQ(v_scale[2], std::ldexp(1.0f, -126));  // v about 2^-146
  EXPECT_EQ(v[256], 1);
  EXPECT_EQ(m_scale[3], std::ldexp(1.0f, -12));   // m = 0.1: 409.6 <= 464 < 819.2
}

// The 4-bit rule's edge cases on the emulated kernel's own output (S2.12), one
// scale block each: all zeros (scale 1); m at most 0.25 * 2^-126, which fp4-block
// stores as zeros even at 2^-126 (scale 1); a v so small that even 2^-126 rounds
// it to code 0, which ufp4-block stores as code 1; an ordinary block.
TEST(CudaBlockStepMathTest, ZeroAndTinyFourBitBlocksFollowTheScaleRule) {
  const BlockConfig config{DType::kFloat32, DType::kFloat32, DType::kNone, kBlock4, kUBlock4,
                           true};
  Shard s(config, 0, 512, 128);
  const float grads[4] = {0.0f, std::ldexp(1.0f, -126), std::ldexp(1.0f, -68), 1.0f};
  for (int64_t i = 0; i < 512; ++i) static_cast<float*>(Shard::At(s.grad))[i] = grads[i / 128];
  EmulatedBlockStep(s.Slot(), StepParams{});
  const auto* m_scale = static_cast<const float*>(Shard::At(s.m_scales));
  const auto* v_scale = static_cast<const float*>(Shard::At(s.v_scales));
  const auto* m = static_cast<const uint8_t*>(Shard::At(s.exp_avg));
  const auto* v = static_cast<const uint8_t*>(Shard::At(s.exp_avg_sq));
  EXPECT_EQ(m_scale[0], 1.0f);
  EXPECT_EQ(v_scale[0], 1.0f);
  EXPECT_EQ(m[0], 0);
  EXPECT_EQ(v[0], 0);
  EXPECT_EQ(m_scale[1], 1.0f);  // m = 0.1 * 2^-126 <= 0.25 * 2^-126
  EXPECT_EQ(m[64], 0);
  EXPECT_EQ(v_scale[2], std::ldexp(1.0f, -126));  // v about 2^-146
  EXPECT_EQ(v[128], 0x11);                         // code 1 in both nibbles
  EXPECT_EQ(m_scale[3], std::ldexp(1.0f, -6));     // m = 0.1: 6.4 < 7 < 12.8
}

// A 4-bit buffer of an odd count: the byte of the last element is written whole,
// its padding nibble 0 as the CPU core writes it, whatever it held before.
TEST(CudaBlockStepMathTest, PaddingNibbleIsWrittenZeroLikeTheCore) {
  const BlockConfig config{DType::kFloat32, DType::kFloat32, DType::kNone, kBlock4, kUBlock4,
                           true};
  Shard s(config, 2, 301, 128);
  std::mt19937 rng(5);
  FillBlockGrad(&s, 1, &rng);
  for (auto* buffer : {&s.exp_avg, &s.exp_avg_sq}) buffer->at(kGuard + 150) = 0xA0;
  Shard core = s, got = s;
  TensorSlot slot = core.Slot();
  Error error;
  ASSERT_EQ(AdamStep(&slot, 1, StepParams{}, 1, &error), Status::kOk) << error.message;
  EmulatedBlockStep(got.Slot(), StepParams{});
  ASSERT_TRUE(SameShard(core, got));
  for (const auto* pair : {&core.exp_avg, &got.exp_avg, &core.exp_avg_sq, &got.exp_avg_sq}) {
    EXPECT_EQ(pair->at(kGuard + 150) & 0xF0, 0);
  }
  EXPECT_EQ(core.exp_avg, got.exp_avg);
  EXPECT_EQ(core.exp_avg_sq, got.exp_avg_sq);
}

// Block layouts are compiled for FusedAdam's block8 and block4 beside the common
// weights; other block combinations take the catch-all, and no per-tensor layout
// is picked for a tensor with block scales.
TEST(CudaBlockLayoutTest, BlockPairCombinationsGetTheirLayouts) {
  for (const BlockConfig& config : BlockConfigs()) {
    SCOPED_TRACE(BlockConfigName(config));
    Shard s(config, 0, 4, 128);
    const cuda::DeviceSlot slot = cuda::MakeDeviceSlot(s.Slot());
    const bool pair = (config.exp_avg == kBlock8 && config.exp_avg_sq == kUBlock8) ||
                      (config.exp_avg == kBlock4 && config.exp_avg_sq == kUBlock4);
    const bool listed = config.grad == config.param && pair &&
                        ((config.param == DType::kFloat32 && config.master == DType::kNone) ||
                         (config.param == DType::kBFloat16 &&
                          (config.master == DType::kFloat32 ||
                           config.master == DType::kInt16Remainder)));
    const int id = cuda::LayoutOf(slot);
    EXPECT_EQ(id != cuda::kAnyLayout, listed);
    cuda::VisitLayout(id, [&](auto layout) {
      using L = decltype(layout);
      EXPECT_TRUE(L::kMayBlock);
      EXPECT_EQ(L::kMayTensor, !listed);
    });
  }
}

}  // namespace
}  // namespace testing
}  // namespace shardadam
