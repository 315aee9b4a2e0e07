// Per-block scaled moments (S2.9, S2.10, S2.12): the core against the scalar reference on
// every target and thread count, blocks keyed to the whole parameter (so shards
// cut on block boundaries step exactly like the whole tensor), the block scale
// rule's round trip (decoding a block and encoding it again gives back its codes
// and scale), and the validation of the block geometry; the same for an fp4-block
// exp_avg rounded stochastically (S2.13), whose codes follow the key and step,
// and a bf16 param with no master rounded stochastically beside it (S2.14).
#include <gtest/gtest.h>
#include <pthread.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "reference.h"
#include "scale_rule.h"
#include "shardadam/adam.h"
#include "test_util.h"

namespace shardadam {
namespace testing {
namespace {

namespace ref = reference;

constexpr DType kBlock8 = DType::kFloat8E4M3Block;
constexpr DType kUBlock8 = DType::kUFloat8E4M4Block;
constexpr DType kBlock4 = DType::kFloat4E2M1Block;
constexpr DType kUBlock4 = DType::kUFloat4E3M1Block;

bool HasFourBit(DType a, DType b) {
  return FormatOf(a).item_bits == 4 || FormatOf(b).item_bits == 4;
}

// The dtypes of one layout with at least one per-block scaled moment, and how
// exp_avg, exp_avg_sq (S2.13) and a bf16 param with no master (S2.14) are rounded.
struct BlockConfig {
  DType param, grad, master, exp_avg, exp_avg_sq;
  bool adam_w;
  Rounding rounding = Rounding::kNearest;
  Rounding param_rounding = Rounding::kNearest;
  Rounding v_rounding = Rounding::kNearest;
};

// The rounding_key of the tensors below (any constant: shards share it).
constexpr uint32_t kRoundingKey = 0x5EED1234u;

std::string Name(const BlockConfig& c) {
  std::string name = "p_" + DTypeName(c.param) + "_g_" + DTypeName(c.grad) + "_master_" +
                     DTypeName(c.master) + "_m_" + DTypeName(c.exp_avg) + "_v_" +
                     DTypeName(c.exp_avg_sq) + (c.adam_w ? "_adamw" : "_l2") +
                     (c.rounding == Rounding::kStochastic ? "_sr" : "") +
                     (c.param_rounding == Rounding::kStochastic ? "_param_sr" : "") +
                     (c.v_rounding == Rounding::kStochastic ? "_v_sr" : "");
  for (char& ch : name) {
    if (ch == '-') ch = '_';
  }
  return name;
}

// A tensor (or one shard of a parameter) owned as a caller would own it.
struct BlockTensor {
  BlockConfig config;
  int64_t numel = 0, first_index = 0;
  int32_t block = 0;
  std::vector<uint8_t> param, grad, master, exp_avg, exp_avg_sq;
  std::vector<float> exp_avg_scales, exp_avg_sq_scales;

  TensorSlot Slot() {
    TensorSlot s;
    s.numel = numel;
    s.first_index = first_index;
    s.scale_block = block;
    s.param = param.data();
    s.param_dtype = config.param;
    s.grad = grad.data();
    s.grad_dtype = config.grad;
    s.exp_avg = exp_avg.data();
    s.exp_avg_dtype = config.exp_avg;
    s.exp_avg_scale = exp_avg_scales.data();
    s.exp_avg_sq = exp_avg_sq.data();
    s.exp_avg_sq_dtype = config.exp_avg_sq;
    s.exp_avg_sq_scale = exp_avg_sq_scales.data();
    s.exp_avg_rounding = config.rounding;
    s.param_rounding = config.param_rounding;
    s.exp_avg_sq_rounding = config.v_rounding;
    s.rounding_key = kRoundingKey;
    if (config.master != DType::kNone) {
      s.master_param = master.data();
      s.master_dtype = config.master;
    }
    return s;
  }
};

std::vector<uint8_t> Bytes(DType dtype, int64_t n) {
  return std::vector<uint8_t>(std::max<int64_t>(1, BufferBytes(dtype, n)), 0);
}

// Elements [first_index, first_index + numel) of a parameter whose element
// i has weight w(i), zero moments (every scale 1) and gradient g(i, step).
BlockTensor MakeShard(const BlockConfig& c, int64_t first_index, int64_t numel,
                      int32_t block) {
  BlockTensor t;
  t.config = c;
  t.numel = numel;
  t.first_index = first_index;
  t.block = block;
  t.param = Bytes(c.param, numel);
  t.grad = Bytes(c.grad, numel);
  t.master = Bytes(c.master == DType::kNone ? DType::kFloat32 : c.master, numel);
  t.exp_avg = Bytes(c.exp_avg, numel);
  t.exp_avg_sq = Bytes(c.exp_avg_sq, numel);
  // Two extra scales guard against writes past the last block's.
  t.exp_avg_scales.assign(ScaleCount(c.exp_avg, first_index, numel, block) + 2, 1.0f);
  t.exp_avg_sq_scales.assign(ScaleCount(c.exp_avg_sq, first_index, numel, block) + 2, 1.0f);
  for (int64_t i = 0; i < numel; ++i) {
    const int64_t global = first_index + i;
    const float w = std::sin(0.37f * static_cast<float>(global)) * 0.5f;
    if (c.master == DType::kInt16Remainder) {
      ref::SplitMaster(w, reinterpret_cast<uint16_t*>(t.param.data()) + i,
                       reinterpret_cast<int16_t*>(t.master.data()) + i);
    } else {
      ref::StoreElement(t.param.data(), c.param, i, w);
      if (c.master == DType::kFloat32) reinterpret_cast<float*>(t.master.data())[i] = w;
    }
  }
  return t;
}

// The gradient of step `step`: magnitudes spread over many binades, a few
// blocks' worth apart, so that block scales differ from block to block.
void FillGrad(BlockTensor* t, int step) {
  for (int64_t i = 0; i < t->numel; ++i) {
    const int64_t global = t->first_index + i;
    const float mag = std::ldexp(1.0f, -static_cast<int>((global / 97 + step) % 24));
    const float g = mag * std::cos(1.3f * static_cast<float>(global) + static_cast<float>(step));
    ref::StoreElement(t->grad.data(), t->config.grad, i, g);
  }
}

::testing::AssertionResult SameBytes(const std::vector<uint8_t>& a,
                                     const std::vector<uint8_t>& b, const char* what) {
  if (a == b) return ::testing::AssertionSuccess();
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) {
      return ::testing::AssertionFailure()
             << what << " differs at byte " << i << ": " << int{a[i]} << " against "
             << int{b[i]};
    }
  }
  return ::testing::AssertionFailure() << what << " differs in size";
}

::testing::AssertionResult SameTensor(const BlockTensor& a, const BlockTensor& b) {
  const struct {
    const std::vector<uint8_t>*a, *b;
    const char* name;
  } buffers[] = {{&a.param, &b.param, "param"},
                 {&a.master, &b.master, "master"},
                 {&a.exp_avg, &b.exp_avg, "exp_avg"},
                 {&a.exp_avg_sq, &b.exp_avg_sq, "exp_avg_sq"}};
  for (const auto& buffer : buffers) {
    ::testing::AssertionResult same = SameBytes(*buffer.a, *buffer.b, buffer.name);
    if (!same) return same;
  }
  if (std::memcmp(a.exp_avg_scales.data(), b.exp_avg_scales.data(),
                  a.exp_avg_scales.size() * sizeof(float)) != 0 ||
      std::memcmp(a.exp_avg_sq_scales.data(), b.exp_avg_sq_scales.data(),
                  a.exp_avg_sq_scales.size() * sizeof(float)) != 0) {
    return ::testing::AssertionFailure() << "the block scales differ";
  }
  return ::testing::AssertionSuccess();
}

std::vector<BlockConfig> Configs() {
  std::vector<BlockConfig> configs;
  for (bool adam_w : {true, false}) {
    // The pair FusedAdam selects: signed E4M3 exp_avg, unsigned E4M4 exp_avg_sq.
    configs.push_back({DType::kFloat32, DType::kFloat32, DType::kNone, kBlock8, kUBlock8, adam_w});
    configs.push_back(
        {DType::kBFloat16, DType::kBFloat16, DType::kInt16Remainder, kBlock8, kUBlock8, adam_w});
    configs.push_back(
        {DType::kBFloat16, DType::kFloat32, DType::kFloat32, kBlock8, kUBlock8, adam_w});
    configs.push_back({DType::kFloat32, DType::kBFloat16, DType::kNone, DType::kBFloat16,
                       kUBlock8, adam_w});
    configs.push_back({DType::kFloat32, DType::kFloat32, DType::kNone, kBlock8, kBlock8, adam_w});
    configs.push_back(
        {DType::kBFloat16, DType::kBFloat16, DType::kInt16Remainder, kBlock8, kBlock8, adam_w});
    configs.push_back(
        {DType::kBFloat16, DType::kFloat32, DType::kFloat32, kBlock8, kBlock8, adam_w});
    configs.push_back(
        {DType::kFloat32, DType::kBFloat16, DType::kNone, kBlock8, DType::kBFloat16, adam_w});
    configs.push_back({DType::kBFloat16, DType::kBFloat16, DType::kInt16Remainder,
                       DType::kFloat32, kBlock8, adam_w});
    // 4-bit: the pair FusedAdam selects (signed E2M1, unsigned E3M1) beside each
    // weight, and mixed with 8-bit and unscaled moments.
    configs.push_back({DType::kFloat32, DType::kFloat32, DType::kNone, kBlock4, kUBlock4, adam_w});
    configs.push_back(
        {DType::kBFloat16, DType::kBFloat16, DType::kInt16Remainder, kBlock4, kUBlock4, adam_w});
    configs.push_back(
        {DType::kBFloat16, DType::kFloat32, DType::kFloat32, kBlock4, kUBlock4, adam_w});
    configs.push_back({DType::kFloat32, DType::kFloat32, DType::kNone, kBlock8, kUBlock4, adam_w});
    configs.push_back({DType::kFloat32, DType::kBFloat16, DType::kNone, kBlock4, kBlock4, adam_w});
    configs.push_back(
        {DType::kFloat32, DType::kFloat32, DType::kNone, DType::kBFloat16, kUBlock4, adam_w});
    // Stochastically rounded E2M1 exp_avg: block4 beside fp32 params, bf16 params +
    // fp32 master, and bf16 params + remainders with bf16 gradients (the fused
    // kernel's even/odd order); fp4-block for both (no fused kernel).
    constexpr Rounding kSR = Rounding::kStochastic;
    configs.push_back(
        {DType::kFloat32, DType::kFloat32, DType::kNone, kBlock4, kUBlock4, adam_w, kSR});
    configs.push_back(
        {DType::kBFloat16, DType::kFloat32, DType::kFloat32, kBlock4, kUBlock4, adam_w, kSR});
    configs.push_back({DType::kBFloat16, DType::kBFloat16, DType::kInt16Remainder, kBlock4,
                       kUBlock4, adam_w, kSR});
    configs.push_back(
        {DType::kFloat32, DType::kBFloat16, DType::kNone, kBlock4, kBlock4, adam_w, kSR});
    // A bf16 param with no master rounded stochastically (S2.14), beside block8
    // and beside block4 with its exp_avg rounded stochastically too: the two
    // streams of bits of one tensor, keyed to the whole parameter.
    configs.push_back({DType::kBFloat16, DType::kFloat32, DType::kNone, kBlock8, kUBlock8,
                       adam_w, Rounding::kNearest, kSR});
    configs.push_back({DType::kBFloat16, DType::kBFloat16, DType::kNone, kBlock4, kUBlock4,
                       adam_w, kSR, kSR});
    // Stochastically rounded unsigned E3M1 exp_avg_sq: block4 as FusedAdam steps it
    // (both moments rounded stochastically) beside fp32 params, bf16 params +
    // remainders with bf16 gradients (fused, even/odd) and bf16 params with no
    // master (all three streams of one tensor); alone beside an 8-bit exp_avg.
    constexpr Rounding kNear = Rounding::kNearest;
    configs.push_back({DType::kFloat32, DType::kFloat32, DType::kNone, kBlock4, kUBlock4,
                       adam_w, kSR, kNear, kSR});
    configs.push_back({DType::kBFloat16, DType::kBFloat16, DType::kInt16Remainder, kBlock4,
                       kUBlock4, adam_w, kSR, kNear, kSR});
    configs.push_back({DType::kBFloat16, DType::kBFloat16, DType::kNone, kBlock4, kUBlock4,
                       adam_w, kSR, kSR, kSR});
    configs.push_back({DType::kFloat32, DType::kFloat32, DType::kNone, kBlock8, kUBlock4,
                       adam_w, kNear, kNear, kSR});
    // A bf16 param with no master rounded to nearest beside block8 and block4
    // (bf16 gradients: natural order, and even/odd for block4), and rounded
    // stochastically beside block4 with fp32 gradients (natural order).
    configs.push_back({DType::kBFloat16, DType::kBFloat16, DType::kNone, kBlock8, kUBlock8,
                       adam_w});
    configs.push_back({DType::kBFloat16, DType::kBFloat16, DType::kNone, kBlock4, kUBlock4,
                       adam_w, kSR, kNear, kSR});
    configs.push_back({DType::kBFloat16, DType::kFloat32, DType::kNone, kBlock4, kUBlock4,
                       adam_w, kSR, kSR, kSR});
    // Block8 as FusedAdam steps it (its unsigned E4M4 exp_avg_sq rounded
    // stochastically) beside fp32 params, bf16 params + fp32 master, bf16 params
    // + remainders with bf16 gradients and bf16 params with no master rounded
    // stochastically (the param's index hash kept for the moment's bits).
    configs.push_back({DType::kFloat32, DType::kFloat32, DType::kNone, kBlock8, kUBlock8,
                       adam_w, kNear, kNear, kSR});
    configs.push_back({DType::kBFloat16, DType::kFloat32, DType::kFloat32, kBlock8, kUBlock8,
                       adam_w, kNear, kNear, kSR});
    configs.push_back({DType::kBFloat16, DType::kBFloat16, DType::kInt16Remainder, kBlock8,
                       kUBlock8, adam_w, kNear, kNear, kSR});
    configs.push_back({DType::kBFloat16, DType::kBFloat16, DType::kNone, kBlock8, kUBlock8,
                       adam_w, kNear, kSR, kSR});
  }
  return configs;
}

class BlockStepTest : public ::testing::TestWithParam<BlockConfig> {};

// Steps `state` `steps` times by the reference and by the core on every target
// at each thread count of `threads`: every byte and scale equal after each step.
// The last step without bias correction: the kernels that skip dividing by 1.
// `poison`, where given, then changes a step's gradients.
void ExpectCoreMatchesReference(
    std::vector<BlockTensor> state, bool adam_w, std::initializer_list<int> threads,
    int steps, const std::function<void(int step, BlockTensor*)>& poison = nullptr) {
  for (int step = 1; step <= steps; ++step) {
    StepParams params;
    params.adam_w_mode = adam_w;
    params.lr = 1e-2;
    params.weight_decay = 0.05;
    params.step = step;
    params.bias_correction = step < steps;
    for (BlockTensor& t : state) {
      FillGrad(&t, step);
      if (poison) poison(step, &t);
    }
    std::vector<BlockTensor> want = state;
    std::vector<TensorSlot> want_slots;
    for (BlockTensor& t : want) want_slots.push_back(t.Slot());
    ref::AdamStep(want_slots.data(), static_cast<int64_t>(want_slots.size()), params);
    ForEachTarget([&] {
      for (int count : threads) {
        std::vector<BlockTensor> got = state;
        std::vector<TensorSlot> slots;
        for (BlockTensor& t : got) slots.push_back(t.Slot());
        Error error;
        ASSERT_EQ(AdamStep(slots.data(), static_cast<int64_t>(slots.size()), params, count,
                           &error),
                  Status::kOk)
            << error.message;
        for (size_t k = 0; k < got.size(); ++k) {
          ASSERT_TRUE(SameTensor(want[k], got[k]))
              << "shard " << k << ", step " << step << ", threads " << count;
        }
      }
    });
    state = want;
  }
}

struct ShardShape {
  int64_t first_index, numel;
  int32_t block;
};

// Shards of `c` at `shapes` (a 4-bit state's first index made even: two codes a byte).
std::vector<BlockTensor> MakeShards(const BlockConfig& c, std::initializer_list<ShardShape> shapes) {
  const int64_t parity = HasFourBit(c.exp_avg, c.exp_avg_sq) ? ~int64_t{1} : ~int64_t{0};
  std::vector<BlockTensor> shards;
  for (const ShardShape& s : shapes) {
    shards.push_back(MakeShard(c, s.first_index & parity, s.numel, s.block));
  }
  return shards;
}

// Three steps of several shards of odd sizes and offsets, by the reference and
// by the core on every target with 1 and 2 threads (whole blocks of the listed
// layouts through the fused block kernel, the rest through fp32 blocks).
TEST_P(BlockStepTest, MatchesReferenceOnEveryTarget) {
  const BlockConfig c = GetParam();
  ExpectCoreMatchesReference(
      MakeShards(c, {{0, 1, 128}, {0, 127, 128}, {5, 300, 128}, {253, 1000, 256},
                     {3 * 256, 777, 256}, {4095, 70001, 4096}, {1, 2 * 16384 + 5, 128},
                     // Across flat index 2^32, where the index's high half starts to count.
                     {(int64_t{1} << 32) - 300, 1000, 128}}),
      c.adam_w, {1, 2}, 3);
}

// A random code of `dtype` in every byte of `codes`, NaN codes left out: a NaN
// decoded into a finite parameter leaves it NaN with a payload that is not part of
// the contract (S2.4), so NaN codes are stepped by the tests of non-finite values.
void FillFiniteCodes(DType dtype, std::vector<uint8_t>* codes, std::mt19937* rng) {
  const auto finite = [dtype](uint32_t code) {  // one code, 4 or 8 bits
    if (dtype == kBlock8 && (code & 0x7F) == 0x7F) return code ^ 1;  // +-NaN -> +-448
    if (dtype == kUBlock8 && code == 0xFF) return 0xFEu;
    if (dtype == kBlock4 && code == 0x8) return 0x9u;
    if (dtype == kUBlock4 && code == 0xF) return 0xEu;
    return code;
  };
  for (uint8_t& byte : *codes) {
    const uint32_t r = (*rng)();
    byte = static_cast<uint8_t>(FormatOf(dtype).item_bits == 4
                                    ? finite(r & 0xF) | finite((r >> 4) & 0xF) << 4
                                    : finite(r & 0xFF));
  }
}

// A tensor's moments with per-block scales: their format, codes and scales.
struct BlockMoment {
  DType dtype;
  std::vector<uint8_t>* codes;
  std::vector<float>* scales;
};

std::vector<BlockMoment> BlockMoments(BlockTensor* t) {
  std::vector<BlockMoment> moments;
  for (const BlockMoment& m : {BlockMoment{t->config.exp_avg, &t->exp_avg, &t->exp_avg_scales},
                               BlockMoment{t->config.exp_avg_sq, &t->exp_avg_sq,
                                           &t->exp_avg_sq_scales}}) {
    if (FormatOf(m.dtype).scaling == Scaling::kPerBlock) moments.push_back(m);
  }
  return moments;
}

// The same from any stored state the core accepts: random codes under random
// scales that are not powers of two (the core's own are), at the block sizes
// between the ends, beside an empty shard, with 3 threads too.
TEST_P(BlockStepTest, MatchesReferenceFromAnyStoredState) {
  const BlockConfig c = GetParam();
  std::vector<BlockTensor> state =
      MakeShards(c, {{7, 0, 512}, {1000, 5000, 512}, {3000, 9001, 1024},
                     {2 * 2048 + 6, 3 * 16384 + 3, 2048}, {4096, 64, 128}});
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-40, 40);
  for (BlockTensor& t : state) {
    for (const BlockMoment& m : BlockMoments(&t)) {
      FillFiniteCodes(m.dtype, m.codes, &rng);
      for (float& scale : *m.scales) scale = std::ldexp(mantissa(rng), exponent(rng));
    }
  }
  ExpectCoreMatchesReference(state, c.adam_w, {1, 2, 3}, 2);
}

// Old scales too large for the fused kernels' 8-bit decoders to fold (plan.h
// FusedDecoderFolds) send two blocks in three through the block path, which
// cuts the runs of whole blocks there; the 4-bit decoders take them in the
// fused kernel. Either way the reference's bits. Those blocks' codes are at
// most 1 in magnitude, so their values stay finite.
TEST_P(BlockStepTest, ScalesTooLargeToFoldStepLikeTheReference) {
  const BlockConfig c = GetParam();
  std::vector<BlockTensor> state =
      MakeShards(c, {{0, 9 * 256, 256}, {3 * 128 + 64, 7 * 128 + 9, 128}});
  std::mt19937 rng(29);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(120, 127);
  // `code` made one of magnitude at most 1 (E4M3's 0x38, E4M4's 0x70, E2M1's
  // 0x2 and E3M1's 0x6 are 1), a signed code keeping its sign but for zero
  // (E2M1's -0 is its NaN code).
  const auto at_most_one = [](DType dtype, uint32_t code) {
    if (dtype == kBlock8) return (code & 0x80u) | (code & 0x7Fu) % 0x39u;
    if (dtype == kUBlock8) return code % 0x71u;
    if (dtype == kBlock4) return (code & 0x7u) % 3u == 0 ? 0u : (code & 0x8u) | (code & 0x7u) % 3u;
    return code % 7u;
  };
  for (BlockTensor& t : state) {
    for (const BlockMoment& m : BlockMoments(&t)) {
      FillFiniteCodes(m.dtype, m.codes, &rng);
      const int64_t lead = t.first_index % t.block;
      // exp_avg's in blocks 1, 4, 7, ..., exp_avg_sq's in 2, 5, 8, ...: each
      // stream's scales are checked.
      for (int64_t j = m.codes == &t.exp_avg ? 1 : 2; j * t.block - lead < t.numel; j += 3) {
        (*m.scales)[j] = std::ldexp(mantissa(rng), exponent(rng));
        ASSERT_FALSE(std::isfinite((*m.scales)[j] * 256.0f));
        for (int64_t i = j * t.block - lead; i < std::min(t.numel, (j + 1) * t.block - lead);
             ++i) {
          uint8_t& byte = (*m.codes)[FormatOf(m.dtype).item_bits == 4 ? i / 2 : i];
          if (FormatOf(m.dtype).item_bits == 8) {
            byte = static_cast<uint8_t>(at_most_one(m.dtype, byte));
          } else {
            const int shift = i % 2 == 0 ? 0 : 4;
            const uint32_t code = at_most_one(m.dtype, (byte >> shift) & 0xFu);
            byte = static_cast<uint8_t>((byte & ~(0xF << shift)) | code << shift);
          }
        }
      }
    }
  }
  ExpectCoreMatchesReference(state, c.adam_w, {1, 2}, 2);
}

// Non-finite gradients (NaNs with every payload bit set, as a GPU makes them,
// of either sign; infinities) in some blocks: every byte and scale as the
// reference's, where the fused kernels' stores that skip the NaN rules for
// NaN-free pairs must take them (S2.5 splits a NaN master as the quiet NaN).
// At the last step: a later step would add two NaNs (a NaN code's value and a
// NaN weight's decay), whose result takes either one's sign: the contract
// fixes NaN signs through conversions only (S2.4).
TEST_P(BlockStepTest, NonFiniteGradientsStepLikeTheReference) {
  const BlockConfig c = GetParam();
  const auto poison = [](int step, BlockTensor* t) {
    if (step != 3) return;
    const uint32_t bad[] = {0x7FFFFFFFu, 0xFFFFFFFFu, 0x7F800000u, 0xFF800000u};
    for (int k = 0; k < 4; ++k) {
      const int64_t i = 5 + 301 * k;  // in different blocks of 128 or 256
      if (i >= t->numel) continue;
      if (t->config.grad == DType::kFloat32) {
        std::memcpy(t->grad.data() + 4 * i, &bad[k], 4);
      } else {
        const uint16_t high = static_cast<uint16_t>(bad[k] >> 16);  // bf16
        std::memcpy(t->grad.data() + 2 * i, &high, 2);
      }
    }
  };
  ExpectCoreMatchesReference(MakeShards(c, {{0, 4 * 256 + 9, 256}, {128, 10 * 128, 128}}),
                             c.adam_w, {1, 2}, 3, poison);
}

// A parameter stepped whole and as shards cut on block boundaries stores the
// same codes and scales: blocks are keyed to the whole parameter.
TEST_P(BlockStepTest, ShardsCutOnBlockBoundariesStepLikeTheWhole) {
  const BlockConfig c = GetParam();
  constexpr int32_t kB = 256;
  constexpr int64_t kNumel = 11 * kB + 45;  // the last block partial
  BlockTensor whole = MakeShard(c, 0, kNumel, kB);
  const int64_t cuts[] = {0, 3 * kB, 4 * kB, 10 * kB, kNumel};
  std::vector<BlockTensor> shards;
  for (int s = 0; s + 1 < 5; ++s) shards.push_back(MakeShard(c, cuts[s], cuts[s + 1] - cuts[s], kB));
  for (int step = 1; step <= 4; ++step) {
    StepParams params;
    params.adam_w_mode = c.adam_w;
    params.step = step;
    FillGrad(&whole, step);
    for (BlockTensor& t : shards) FillGrad(&t, step);
    TensorSlot slot = whole.Slot();
    ASSERT_EQ(AdamStep(&slot, 1, params, 2, nullptr), Status::kOk);
    std::vector<TensorSlot> slots;
    for (BlockTensor& t : shards) slots.push_back(t.Slot());
    ASSERT_EQ(AdamStep(slots.data(), 4, params, 2, nullptr), Status::kOk);
  }
  for (int s = 0; s < 4; ++s) {
    const int64_t at = cuts[s];
    const BlockTensor& shard = shards[static_cast<size_t>(s)];
    const auto same = [&](const std::vector<uint8_t>& all, const std::vector<uint8_t>& part,
                          DType dtype) {
      for (int64_t i = 0; i < shard.numel; ++i) {
        if (ElementBits(all.data(), dtype, at + i) != ElementBits(part.data(), dtype, i)) {
          return false;
        }
      }
      return true;
    };
    EXPECT_TRUE(same(whole.param, shard.param, c.param)) << "shard " << s;
    EXPECT_TRUE(same(whole.exp_avg, shard.exp_avg, c.exp_avg)) << "shard " << s;
    EXPECT_TRUE(same(whole.exp_avg_sq, shard.exp_avg_sq, c.exp_avg_sq)) << "shard " << s;
    if (c.master != DType::kNone) {
      EXPECT_TRUE(same(whole.master, shard.master, c.master)) << "shard " << s;
    }
    for (const auto& [dtype, all, part] :
         {std::make_tuple(c.exp_avg, &whole.exp_avg_scales, &shard.exp_avg_scales),
          std::make_tuple(c.exp_avg_sq, &whole.exp_avg_sq_scales, &shard.exp_avg_sq_scales)}) {
      if (!IsBlockScaled(dtype)) continue;
      for (int64_t j = 0; j < ScaleCount(dtype, at, shard.numel, kB); ++j) {
        EXPECT_EQ(BitsOf((*all)[at / kB + j]), BitsOf((*part)[j]))
            << "shard " << s << " block " << j;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, BlockStepTest, ::testing::ValuesIn(Configs()),
                         [](const auto& info) { return Name(info.param); });

// S2.9 / S2.10's encoding of true values u: the block scale, then each code.
// Codes packed as the format packs them, in a buffer of at least u.size() bytes.
float EncodeBlock(DType dtype, const std::vector<float>& u, std::vector<uint8_t>* codes) {
  uint32_t max_bits = 0;
  for (float x : u) max_bits = std::max(max_bits, BitsOf(x) & 0x7FFFFFFFu);
  const FormatInfo f = FormatOf(dtype);
  const float s =
      BlockScaleFromAbsMaxBits(max_bits, f.scale_target, f.zero_bound, f.overflow_bound);
  codes->assign(u.size(), 0);
  for (size_t i = 0; i < u.size(); ++i) ref::StoreBlockElement(codes->data(), dtype, i, u[i], s);
  return s;
}

std::vector<float> DecodeBlock(DType dtype, const std::vector<uint8_t>& codes, size_t n,
                               float s) {
  std::vector<float> u;
  for (size_t i = 0; i < n; ++i) {
    u.push_back(ref::LoadElement(codes.data(), dtype, i) * s);
  }
  return u;
}

// Decoding a block and encoding it again gives back every code and the scale:
// each finite code beside the largest (the block's normal form), at scales from
// the smallest to large ones.
TEST(BlockRoundTripTest, EveryCodeSurvivesDecodeThenEncode) {
  const struct {
    DType dtype;
    uint8_t largest, other;  // the largest finite code, and one more
    int top;                 // the largest scale 2^top at which the largest decodes finite
  } formats[] = {{kBlock8, 0x7E, 0x80, 119}, {kUBlock8, 0xFE, 0x01, 119},
                 {kBlock4, 0x7, 0x9, 125}, {kUBlock4, 0xE, 0x1, 123}};
  for (const auto& f : formats) {
    SCOPED_TRACE(DTypeName(f.dtype));
    const int count = 1 << FormatOf(f.dtype).item_bits;
    uint8_t top = 0;
    ref::SetCode(&top, f.dtype, 0, f.largest);
    EXPECT_TRUE(std::isfinite(ref::LoadElement(&top, f.dtype, 0) * std::ldexp(1.0f, f.top)));
    EXPECT_TRUE(std::isinf(ref::LoadElement(&top, f.dtype, 0) * std::ldexp(1.0f, f.top + 1)));
    for (int e : {-126, -100, -20, -1, 0, 1, 30, 100, 118, f.top}) {
      const float s = std::ldexp(1.0f, e);
      for (int code = 0; code < count; ++code) {
        uint8_t one = 0;
        ref::SetCode(&one, f.dtype, 0, static_cast<uint8_t>(code));
        if (std::isnan(ref::LoadElement(&one, f.dtype, 0))) continue;  // the NaN codes
        std::vector<uint8_t> codes(4, 0);
        const uint8_t block[4] = {f.largest, static_cast<uint8_t>(code), f.other, 0};
        for (int i = 0; i < 4; ++i) ref::SetCode(codes.data(), f.dtype, i, block[i]);
        std::vector<uint8_t> again;
        const float s2 = EncodeBlock(f.dtype, DecodeBlock(f.dtype, codes, 4, s), &again);
        ASSERT_EQ(BitsOf(s2), BitsOf(s)) << "code " << code << " scale 2^" << e;
        ASSERT_EQ(again, codes) << "code " << code << " scale 2^" << e;
      }
    }
  }
}

// Any block, once encoded, is in normal form: encoding its decoded values again
// changes nothing.
TEST(BlockRoundTripTest, RandomBlocksAreStableAfterOneEncoding) {
  for (DType dtype : {kBlock8, kUBlock8, kBlock4, kUBlock4}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::mt19937 rng(7);
    std::uniform_int_distribution<int> exponent(-140, 120);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int trial = 0; trial < 2000; ++trial) {
      const float spread = std::ldexp(1.0f, exponent(rng));
      std::vector<float> u(256);
      for (float& x : u) {
        x = normal(rng) * spread * std::ldexp(1.0f, -(trial % 17));
        if (!HasRole(dtype, kRoleExpAvg)) x = x * x;  // a second moment's spread
      }
      std::vector<uint8_t> codes, again;
      const float s = EncodeBlock(dtype, u, &codes);
      const float s2 = EncodeBlock(dtype, DecodeBlock(dtype, codes, u.size(), s), &again);
      ASSERT_EQ(BitsOf(s2), BitsOf(s)) << "trial " << trial;
      ASSERT_EQ(again, codes) << "trial " << trial;
    }
  }
}

// S2.9's overflow rule: a block whose largest magnitude reaches the format's
// overflow bound (its code would decode past FLT_MAX) takes scale 1, as a
// non-finite block does: that element stores the NaN code, the others their codes
// at scale 1, and the block round-trips. Just below the bound every code decodes
// finite.
TEST(BlockRoundTripTest, BlocksPastTheOverflowBoundStoreNaNNotInfinity) {
  for (DType dtype : {kBlock8, kUBlock8, kBlock4, kUBlock4}) {
    SCOPED_TRACE(DTypeName(dtype));
    const float over = FormatOf(dtype).overflow_bound;
    std::vector<uint8_t> codes, again;
    const float below = EncodeBlock(dtype, {std::nextafter(over, 0.0f), 1.0f}, &codes);
    EXPECT_GT(below, std::ldexp(1.0f, 118));
    EXPECT_TRUE(std::isfinite(DecodeBlock(dtype, codes, 2, below)[0]));
    for (float a : {over, FLT_MAX}) {
      const float s = EncodeBlock(dtype, {a, 1.0f}, &codes);
      EXPECT_EQ(s, 1.0f);
      const std::vector<float> back = DecodeBlock(dtype, codes, 2, s);
      EXPECT_TRUE(std::isnan(back[0]));
      EXPECT_EQ(back[1], 1.0f);
      EXPECT_EQ(EncodeBlock(dtype, back, &again), 1.0f);
      EXPECT_EQ(again, codes);
    }
  }
}

// S2.10, S2.12: no non-zero value of exp_avg_sq is stored as 0, however far
// below the block's largest it is, and a block of zeros keeps scale 1.
TEST(BlockRoundTripTest, UnsignedBlocksKeepEveryNonZeroValueNonZero) {
  for (DType dtype : {kUBlock8, kUBlock4}) {
    SCOPED_TRACE(DTypeName(dtype));
    for (int e : {-149, -140, -126, -60, -20, 0}) {
      const std::vector<float> u = {std::ldexp(1.0f, e), 1.0e30f, 0.0f, FloatOf(1)};
      std::vector<uint8_t> codes;
      const float s = EncodeBlock(dtype, u, &codes);
      const std::vector<float> back = DecodeBlock(dtype, codes, u.size(), s);
      EXPECT_GT(back[0], 0.0f) << "2^" << e;
      EXPECT_GT(back[3], 0.0f);
      EXPECT_EQ(back[2], 0.0f);
      EXPECT_GE(ref::CodeAt(codes.data(), dtype, 0), 1);
      EXPECT_GE(ref::CodeAt(codes.data(), dtype, 3), 1);
    }
    std::vector<uint8_t> codes;
    EXPECT_EQ(EncodeBlock(dtype, {0.0f, 0.0f}, &codes), 1.0f);
    // The smallest non-zero block still takes the smallest scale, not 1.
    EXPECT_EQ(EncodeBlock(dtype, {FloatOf(1), 0.0f}, &codes), std::ldexp(1.0f, -126));
    EXPECT_EQ(ref::CodeAt(codes.data(), dtype, 0), 1);
  }
}

// The scale is the smallest power of two that keeps every element finite.
TEST(BlockScaleRuleTest, SmallestPowerOfTwoKeepingTheBlockFinite) {
  const float bound = FormatOf(kBlock8).scale_target;
  const float zero = FormatOf(kBlock8).zero_bound;
  const float over = FormatOf(kBlock8).overflow_bound;
  EXPECT_EQ(bound, 464.0f);
  // The bounds are where E4M3 rounding changes: to NaN above one, to 0 at the other.
  EXPECT_EQ(ref::FloatToFloat8E4M3(bound), 0x7E);
  EXPECT_EQ(ref::FloatToFloat8E4M3(std::nextafter(bound, 1e9f)) & 0x7F, 0x7F);
  EXPECT_EQ(ref::FloatToFloat8E4M3(zero), 0x00);
  EXPECT_EQ(ref::FloatToFloat8E4M3(std::nextafter(zero, 1.0f)), 0x01);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(464.0f), bound, zero, over), 1.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(std::nextafter(464.0f, 1e9f)), bound, zero, over), 2.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(232.0f), bound, zero, over), 0.5f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(std::nextafter(232.0f, 1e9f)), bound, zero, over), 1.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(0, bound, zero, over), 1.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(0x7F800000u, bound, zero, over), 1.0f);  // inf
  EXPECT_EQ(BlockScaleFromAbsMaxBits(0x7FC00000u, bound, zero, over), 1.0f);  // NaN
  // All zeros even at the smallest scale: scale 1. Just above: the smallest scale.
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(std::ldexp(1.0f, -136)), bound, zero, over), 1.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(std::ldexp(1.0f, -136)) + 1, bound, zero, over),
            std::ldexp(1.0f, -126));
  // Below the overflow bound the largest scales; from it (FLT_MAX too) scale 1.
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(std::nextafter(over, 0.0f)), bound, zero, over),
            std::ldexp(1.0f, 120));
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(over), bound, zero, over), 1.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(FLT_MAX), bound, zero, over), 1.0f);
}

// S2.10: the same rule with the unsigned E4M4 bound 488, and scale 1 only for a
// block of zeros (or a non-finite one).
TEST(BlockScaleRuleTest, UnsignedBoundAndNoZeroRule) {
  const float bound = FormatOf(kUBlock8).scale_target;
  const float zero = FormatOf(kUBlock8).zero_bound;
  const float over = FormatOf(kUBlock8).overflow_bound;
  EXPECT_EQ(bound, 488.0f);
  EXPECT_EQ(zero, 0.0f);
  EXPECT_EQ(ref::FloatToUFloat8E4M4(bound), 0xFE);
  EXPECT_EQ(ref::FloatToUFloat8E4M4(std::nextafter(bound, 1e9f)), 0xFF);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(488.0f), bound, zero, over), 1.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(std::nextafter(488.0f, 1e9f)), bound, zero, over), 2.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(244.0f), bound, zero, over), 0.5f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(0, bound, zero, over), 1.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(1, bound, zero, over), std::ldexp(1.0f, -126));
  EXPECT_EQ(BlockScaleFromAbsMaxBits(0x7F800000u, bound, zero, over), 1.0f);
}

// S2.12: the same rule with the 4-bit bounds: signed E2M1 finite below 7
// (the tie at 7 rounds to the even 8, past the largest value 6), code 0 up to
// 0.25; unsigned E3M1 finite up to 20 (the tie rounds to the even 16), zero-free.
TEST(BlockScaleRuleTest, FourBitBounds) {
  const FormatInfo f4 = FormatOf(kBlock4);
  EXPECT_EQ(f4.scale_target, std::nextafter(7.0f, 0.0f));
  EXPECT_EQ(f4.zero_bound, 0.25f);
  EXPECT_EQ(ref::FloatToFloat4E2M1(f4.scale_target), 0x7);
  EXPECT_EQ(ref::FloatToFloat4E2M1(7.0f), 0x8);
  EXPECT_EQ(ref::FloatToFloat4E2M1(f4.zero_bound), 0x0);
  EXPECT_EQ(ref::FloatToFloat4E2M1(std::nextafter(f4.zero_bound, 1.0f)), 0x1);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(6.5f), f4.scale_target, f4.zero_bound, f4.overflow_bound), 1.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(7.0f), f4.scale_target, f4.zero_bound, f4.overflow_bound), 2.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(3.5f), f4.scale_target, f4.zero_bound, f4.overflow_bound), 1.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(std::nextafter(3.5f, 0.0f)), f4.scale_target,
                                     f4.zero_bound, f4.overflow_bound),
            0.5f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(std::ldexp(1.0f, -128)), f4.scale_target,
                                     f4.zero_bound, f4.overflow_bound),
            1.0f);  // 2^-128 / 2^-126 = 0.25: code 0 at every scale
  const FormatInfo u4 = FormatOf(kUBlock4);
  EXPECT_EQ(u4.scale_target, 20.0f);
  EXPECT_EQ(u4.zero_bound, 0.0f);
  EXPECT_EQ(ref::FloatToUFloat4E3M1(20.0f), 0xE);
  EXPECT_EQ(ref::FloatToUFloat4E3M1(std::nextafter(20.0f, 1e9f)), 0xF);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(20.0f), u4.scale_target, u4.zero_bound, u4.overflow_bound), 1.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(BitsOf(std::nextafter(20.0f, 1e9f)), u4.scale_target,
                                     u4.zero_bound, u4.overflow_bound),
            2.0f);
  EXPECT_EQ(BlockScaleFromAbsMaxBits(1, u4.scale_target, u4.zero_bound, u4.overflow_bound), std::ldexp(1.0f, -126));
}

// The rule against its definition, S2.9, worked out here in double precision:
// the smallest power of two 2^k, k in [-126, 127], with a / 2^k <= bound, for
// every binade of every block format, mantissas at both ends, random ones, and
// the quotient's edges around the bound in each binade.
TEST(BlockScaleRuleTest, MatchesItsDefinitionInEveryBinade) {
  // ... and scale 1 where the largest element's code at that scale decodes past
  // FLT_MAX (S2.9's overflow rule), found here by encoding it.
  const auto expected = [](float a, DType dtype) {
    const FormatInfo f = FormatOf(dtype);
    if (!std::isfinite(a) || a <= f.zero_bound * std::ldexp(1.0f, -126)) return 1.0f;
    float s = std::ldexp(1.0f, 127);
    for (int k = -126; k < 127; ++k) {
      if (static_cast<double>(a) / std::ldexp(1.0, k) <= f.scale_target) {
        s = std::ldexp(1.0f, k);
        break;
      }
    }
    uint8_t code = 0;
    ref::StoreBlockElement(&code, dtype, 0, a, s);
    return std::isinf(ref::LoadElement(&code, dtype, 0) * s) ? 1.0f : s;
  };
  std::mt19937 rng(7);
  for (DType dtype : {kBlock8, kUBlock8, kBlock4, kUBlock4}) {
    const FormatInfo f = FormatOf(dtype);
    for (uint32_t exponent = 0; exponent <= 0xFF; ++exponent) {
      std::vector<uint32_t> all_bits;
      for (uint32_t mantissa : {0u, 1u, 0x400000u, 0x7FFFFFu}) {
        all_bits.push_back(exponent << 23 | mantissa);
      }
      for (int r = 0; r < 16; ++r) all_bits.push_back(exponent << 23 | (rng() & 0x7FFFFFu));
      // bound * 2^(exponent - 127) and its neighbours: the quotient's edge.
      const float edge = std::ldexp(f.scale_target, static_cast<int>(exponent) - 127);
      if (std::isfinite(edge) && edge > 0.0f) {
        for (float x : {std::nextafter(edge, 0.0f), edge, std::nextafter(edge, INFINITY)}) {
          all_bits.push_back(BitsOf(x));
        }
      }
      if (exponent == 0xFE) {  // the overflow bound and its neighbours
        for (float x : {std::nextafter(f.overflow_bound, 0.0f), f.overflow_bound,
                        std::nextafter(f.overflow_bound, INFINITY)}) {
          all_bits.push_back(BitsOf(x));
        }
      }
      for (uint32_t bits : all_bits) {
        const float a = FloatOf(bits);
        ASSERT_EQ(BlockScaleFromAbsMaxBits(bits, f.scale_target, f.zero_bound, f.overflow_bound),
                  expected(a, dtype))
            << "dtype " << static_cast<int>(dtype) << " bits 0x" << std::hex << bits;
      }
    }
  }
}

// S2.12: after an odd count of 4-bit codes the last byte's high nibble is
// padding, written 0 by the core as by the reference, also when the element
// beside it updates to NaN (an infinite gradient: m and v inf, inf / inf).
TEST(BlockPaddingTest, PaddingNibbleIsWrittenZero) {
  const BlockConfig c = {DType::kBFloat16, DType::kBFloat16, DType::kFloat32, kBlock4, kUBlock4,
                         false};
  for (bool infinite : {false, true}) {
    BlockTensor t = MakeShard(c, 0, 43, 128);
    FillGrad(&t, 1);
    if (infinite) {
      t.grad[84] = 0x80;  // element 42's bf16 gradient: +inf, 0x7F80
      t.grad[85] = 0x7F;
    }
    t.exp_avg.back() = 0xA0;  // junk in the padding nibbles
    t.exp_avg_sq.back() = 0xB0;
    StepParams params;
    params.adam_w_mode = false;
    params.weight_decay = 0.01;
    BlockTensor want = t;
    TensorSlot want_slot = want.Slot();
    ref::AdamStep(&want_slot, 1, params);
    // The case is what it says: element 42's weight (bf16) became NaN beside the padding.
    const int bits42 = want.param[84] | want.param[85] << 8;
    EXPECT_EQ((bits42 & 0x7FFF) > 0x7F80, infinite) << std::hex << bits42;
    ForEachTarget([&] {
      BlockTensor got = t;
      TensorSlot slot = got.Slot();
      ASSERT_EQ(AdamStep(&slot, 1, params, 1, nullptr), Status::kOk);
      EXPECT_EQ(got.exp_avg[21] >> 4, 0) << "infinite " << infinite;
      EXPECT_EQ(got.exp_avg_sq[21] >> 4, 0) << "infinite " << infinite;
      EXPECT_TRUE(SameTensor(want, got)) << "infinite " << infinite;
    });
  }
}

// The calling thread runs work items too, so a step must fit a small thread stack
// (musl gives threads 128 KiB): the per-thread scratch is on the heap, and the
// block kernel keeps only one block of moments (largest blocks here) on the stack.
// Sanitizers' instrumented frames are far larger: skipped there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SHARDADAM_SANITIZED_STACK 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define SHARDADAM_SANITIZED_STACK 1
#endif
#endif
TEST(BlockThreadTest, StepsOnAThreadWithA128KiBStack) {
#if defined(SHARDADAM_SANITIZED_STACK)
  GTEST_SKIP() << "sanitizer frames do not fit a 128 KiB stack";
#else
  // block8 as FusedAdam stores it: exp_avg_sq rounded stochastically (S2.13).
  const BlockConfig c = {DType::kBFloat16, DType::kBFloat16, DType::kInt16Remainder, kBlock8,
                         kUBlock8, true, Rounding::kNearest, Rounding::kNearest,
                         Rounding::kStochastic};
  BlockTensor t = MakeShard(c, 0, 3 * 4096, 4096);
  FillGrad(&t, 1);
  StepParams params;
  BlockTensor want = t;
  TensorSlot want_slot = want.Slot();
  ASSERT_EQ(AdamStep(&want_slot, 1, params, 1, nullptr), Status::kOk);
  struct Call {
    BlockTensor tensor;
    StepParams params;
    Status status = Status::kInvalidArgument;
  } call{t, params};
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, 128 * 1024), 0);
  pthread_t thread;
  ASSERT_EQ(pthread_create(
                &thread, &attr,
                [](void* arg) -> void* {
                  auto* call = static_cast<Call*>(arg);
                  TensorSlot slot = call->tensor.Slot();
                  call->status = AdamStep(&slot, 1, call->params, 1, nullptr);
                  return nullptr;
                },
                &call),
            0);
  ASSERT_EQ(pthread_join(thread, nullptr), 0);
  pthread_attr_destroy(&attr);
  ASSERT_EQ(call.status, Status::kOk);
  EXPECT_TRUE(SameTensor(want, call.tensor));
#endif
}

// Geometry and scale slots are checked before anything is written.
TEST(BlockValidationTest, BadGeometryAndScalesAreRefusedNamingTheRule) {
  const BlockConfig c = {DType::kFloat32, DType::kFloat32, DType::kNone, kBlock8, kBlock8, true};
  const struct {
    const char* what;
    void (*edit)(BlockTensor*, TensorSlot*);
    const char* mentions;
  } cases[] = {
      {"block 0", [](BlockTensor*, TensorSlot* s) { s->scale_block = 0; }, "scale_block 0"},
      {"block 96", [](BlockTensor*, TensorSlot* s) { s->scale_block = 96; }, "scale_block 96"},
      {"block 8192", [](BlockTensor*, TensorSlot* s) { s->scale_block = 8192; },
       "power of two in [128, 4096]"},
      {"negative first index", [](BlockTensor*, TensorSlot* s) { s->first_index = -1; },
       "first_index -1"},
      {"null scales", [](BlockTensor*, TensorSlot* s) { s->exp_avg_sq_scale = nullptr; },
       "exp_avg_sq_scale is null"},
      {"bad scale", [](BlockTensor* t, TensorSlot*) { t->exp_avg_scales[2] = -1.0f; },
       "exp_avg_scale[2] -1 is not a valid scale"},
      {"scales overlap", [](BlockTensor* t, TensorSlot* s) {
         s->exp_avg_sq_scale = t->exp_avg_scales.data() + 1; }, "overlaps exp_avg_sq_scale"},
      {"scales in data", [](BlockTensor* t, TensorSlot* s) {
         // Valid scale values, inside the gradient (which the step never writes).
         float* grad = reinterpret_cast<float*>(t->grad.data());
         for (int j = 0; j < 9; ++j) grad[j] = 1.0f;
         s->exp_avg_scale = grad; }, "share memory with data"},
      {"mixed with per-tensor", [](BlockTensor*, TensorSlot* s) {
         s->exp_avg_sq_dtype = DType::kFloat8E4M3; }, "do not mix"},
      {"unsigned exp_avg", [](BlockTensor*, TensorSlot* s) {
         s->exp_avg_dtype = kUBlock8; },
       "exp_avg_dtype 7 (ufp8-block) is not allowed for exp_avg; expected fp32, fp16, bf16, "
       "fp8, fp8-block or fp4-block"},
      {"unsigned 4-bit exp_avg", [](BlockTensor*, TensorSlot* s) {
         s->exp_avg_dtype = kUBlock4; },
       "exp_avg_dtype 9 (ufp4-block) is not allowed for exp_avg"},
      {"4-bit at an odd first index", [](BlockTensor*, TensorSlot* s) {
         s->exp_avg_sq_dtype = kUBlock4; s->first_index = 301; },
       "first_index 301 is odd; ufp4-block states pack two elements per byte"},
      {"stochastic fp8-block exp_avg", [](BlockTensor*, TensorSlot* s) {
         s->exp_avg_rounding = Rounding::kStochastic; },
       "exp_avg_rounding 1 (stochastic) is not allowed for an exp_avg_dtype 6 (fp8-block) "
       "exp_avg; stochastic rounding needs fp4-block"},
      {"unknown rounding", [](BlockTensor*, TensorSlot* s) {
         s->exp_avg_dtype = kBlock4; s->exp_avg_rounding = static_cast<Rounding>(2); },
       "exp_avg_rounding 2 is not a rounding; expected 0 (nearest) or 1 (stochastic)"},
      {"stochastic fp8-block exp_avg_sq", [](BlockTensor*, TensorSlot* s) {
         s->exp_avg_sq_rounding = Rounding::kStochastic; },
       "exp_avg_sq_rounding 1 (stochastic) is not allowed for an exp_avg_sq_dtype 6 "
       "(fp8-block) exp_avg_sq; stochastic rounding needs ufp4-block or ufp8-block"},
      {"unknown exp_avg_sq rounding", [](BlockTensor*, TensorSlot* s) {
         s->exp_avg_sq_dtype = kUBlock4; s->exp_avg_sq_rounding = static_cast<Rounding>(-1); },
       "exp_avg_sq_rounding -1 is not a rounding; expected 0 (nearest) or 1 (stochastic)"},
  };
  for (const auto& bad : cases) {
    BlockTensor t = MakeShard(c, 300, 1000, 128);
    FillGrad(&t, 1);
    TensorSlot slot = t.Slot();
    bad.edit(&t, &slot);
    // What the refused step must leave as it is: every buffer and scale as edited
    // (the bad scale itself, a scale slot inside the gradient), the gradient too.
    const BlockTensor edited = t;
    Error error;
    EXPECT_EQ(AdamStep(&slot, 1, StepParams(), 2, &error), Status::kInvalidArgument) << bad.what;
    EXPECT_EQ(error.tensor_index, 0) << bad.what;
    EXPECT_NE(error.message.find(bad.mentions), std::string::npos)
        << bad.what << ": " << error.message;
    EXPECT_TRUE(SameTensor(edited, t)) << bad.what;
    EXPECT_EQ(edited.grad, t.grad) << bad.what;
  }
}

// One step of a block4 tensor (fp32 params) from zero moments with rounding key
// `key`, step `step_number` and these roundings of exp_avg and exp_avg_sq.
BlockTensor StepBlock4(uint32_t key, int64_t step_number, Rounding m_rounding,
                       Rounding v_rounding) {
  const BlockConfig c = {DType::kFloat32, DType::kFloat32, DType::kNone, kBlock4, kUBlock4,
                         true, m_rounding, Rounding::kNearest, v_rounding};
  BlockTensor t = MakeShard(c, 0, 4096 + 6, 256);
  FillGrad(&t, 1);
  TensorSlot slot = t.Slot();
  slot.rounding_key = key;
  StepParams params;
  params.step = step_number;
  EXPECT_EQ(AdamStep(&slot, 1, params, 2, nullptr), Status::kOk);
  return t;
}

// The random bits depend on the rounding key and the step: changing either
// changes exp_avg's codes (and only them), and rounding to nearest differs too.
TEST(BlockStochasticTest, KeyAndStepChangeTheCodes) {
  constexpr Rounding kSR = Rounding::kStochastic, kNear = Rounding::kNearest;
  const auto step = [](uint32_t key, int64_t step_number, Rounding rounding) {
    return StepBlock4(key, step_number, rounding, kNear);
  };
  const BlockTensor base = step(kRoundingKey, 7, kSR);
  EXPECT_TRUE(SameTensor(base, step(kRoundingKey, 7, kSR)));
  for (const BlockTensor& other : {step(kRoundingKey + 1, 7, kSR), step(kRoundingKey, 8, kSR),
                                   step(kRoundingKey, 7, kNear)}) {
    EXPECT_NE(base.exp_avg, other.exp_avg);
    EXPECT_EQ(base.exp_avg_sq, other.exp_avg_sq);
    EXPECT_EQ(base.exp_avg_scales, other.exp_avg_scales);
  }
}

// The same for exp_avg_sq's own stream: its key and the step change its codes
// (and only them), and with exp_avg rounded stochastically too, exp_avg's codes
// are those it stores alone (the two streams draw unrelated bits).
TEST(BlockStochasticTest, KeyAndStepChangeTheSquareCodes) {
  const auto step = StepBlock4;
  constexpr Rounding kSR = Rounding::kStochastic, kNear = Rounding::kNearest;
  const BlockTensor base = step(kRoundingKey, 7, kNear, kSR);
  EXPECT_TRUE(SameTensor(base, step(kRoundingKey, 7, kNear, kSR)));
  for (const BlockTensor& other : {step(kRoundingKey + 1, 7, kNear, kSR),
                                   step(kRoundingKey, 8, kNear, kSR),
                                   step(kRoundingKey, 7, kNear, kNear)}) {
    EXPECT_NE(base.exp_avg_sq, other.exp_avg_sq);
    EXPECT_EQ(base.exp_avg, other.exp_avg);
    EXPECT_EQ(base.exp_avg_sq_scales, other.exp_avg_sq_scales);
  }
  const BlockTensor both = step(kRoundingKey, 7, kSR, kSR);
  EXPECT_EQ(both.exp_avg_sq, base.exp_avg_sq);
  EXPECT_EQ(both.exp_avg, step(kRoundingKey, 7, kSR, kNear).exp_avg);
  EXPECT_NE(both.exp_avg, base.exp_avg);
}

// Convert is a cast with at most one scale: per-block formats are refused.
TEST(BlockValidationTest, ConvertRefusesPerBlockFormats) {
  std::vector<float> src(8, 1.0f);
  std::vector<uint8_t> dst(8, 0);
  Error error;
  EXPECT_EQ(Convert(src.data(), DType::kFloat32, dst.data(), kBlock8, 8, 1.0f, 1, &error),
            Status::kInvalidArgument);
  EXPECT_NE(error.message.find("dst_dtype 6 (fp8-block)"), std::string::npos) << error.message;
  EXPECT_EQ(error.message.find("fp8-block", error.message.find("expected")), std::string::npos)
      << error.message;
}

}  // namespace
}  // namespace testing
}  // namespace shardadam
