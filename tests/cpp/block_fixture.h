// Test fixtures of tensors with per-block scaled moments, shared by the CUDA
// kernels' CPU-run test (cuda_block_math_test.cc) and their GPU test
// (cuda/adam_cuda_test.cc): the dtype options the core takes beside per-block
// moments, shards of a parameter owned between guard bytes, gradients whose
// blocks span the scale rule's cases, and the bitwise comparison of two shards.
#ifndef SHARDADAM_TESTS_CPP_BLOCK_FIXTURE_H_
#define SHARDADAM_TESTS_CPP_BLOCK_FIXTURE_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "reference.h"
#include "shardadam/adam.h"
#include "test_util.h"

namespace shardadam {
namespace testing {

constexpr DType kBlock8 = DType::kFloat8E4M3Block;
constexpr DType kUBlock8 = DType::kUFloat8E4M4Block;
constexpr DType kBlock4 = DType::kFloat4E2M1Block;
constexpr DType kUBlock4 = DType::kUFloat4E3M1Block;

// The rounding_key of every shard (a parameter's shards share it), unless its
// config names another.
inline constexpr uint32_t kShardRoundingKey = 0x5EED1234u;

// The dtypes of one tensor with at least one per-block scaled moment, how
// exp_avg (S2.13), the param (S2.14) and exp_avg_sq (S2.13) are rounded, and
// the key of their bits.
struct BlockConfig {
  DType param, grad, master, exp_avg, exp_avg_sq;
  bool adam_w;
  Rounding rounding = Rounding::kNearest;
  Rounding param_rounding = Rounding::kNearest;
  uint32_t rounding_key = kShardRoundingKey;
  Rounding v_rounding = Rounding::kNearest;
};

inline std::string BlockConfigName(const BlockConfig& c) {
  std::string name = "p_" + DTypeName(c.param) + "_g_" + DTypeName(c.grad) + "_master_" +
                     DTypeName(c.master) + "_m_" + DTypeName(c.exp_avg) + "_v_" +
                     DTypeName(c.exp_avg_sq) + (c.adam_w ? "_adamw" : "_l2") +
                     (c.rounding == Rounding::kStochastic ? "_sr" : "") +
                     (c.param_rounding == Rounding::kStochastic ? "_param_sr" : "") +
                     (c.v_rounding == Rounding::kStochastic ? "_v_sr" : "") +
                     (c.rounding_key != kShardRoundingKey
                          ? "_key_" + std::to_string(c.rounding_key)
                          : "");
  for (char& ch : name) {
    if (ch == '-') ch = '_';
  }
  return name;
}

inline void PrintTo(const BlockConfig& c, std::ostream* os) { *os << BlockConfigName(c); }

// Whether a state of `c` holds 4-bit codes (two per byte: an even first_index).
inline bool HasFourBitState(const BlockConfig& c) {
  return FormatOf(c.exp_avg).item_bits == 4 || FormatOf(c.exp_avg_sq).item_bits == 4;
}

// Every param/master option the core takes beside per-block moments (no scaled
// master: per-block and per-tensor scales do not mix), each with every gradient
// dtype, and the moment pairs: FusedAdam's block8, fp8-block for both, and each
// block format beside an unscaled moment; then the same for the 4-bit formats
// (block4, fp4-block for both, each beside an unscaled moment and beside the
// other width's format). The 8-bit configs come first, in their old order (the
// GPU test picks two by index).
inline std::vector<BlockConfig> BlockConfigs() {
  const struct {
    DType param, master;
  } weights[] = {{DType::kFloat32, DType::kNone},     {DType::kFloat16, DType::kNone},
                 {DType::kFloat16, DType::kFloat32},  {DType::kBFloat16, DType::kNone},
                 {DType::kBFloat16, DType::kFloat32}, {DType::kBFloat16, DType::kInt16Remainder}};
  struct Moments {
    DType m, v;
  };
  const std::vector<Moments> widths[] = {{{kBlock8, kUBlock8},
                                          {kBlock8, kBlock8},
                                          {kBlock8, DType::kFloat32},
                                          {DType::kBFloat16, kUBlock8},
                                          {DType::kFloat32, kBlock8}},
                                         {{kBlock4, kUBlock4},
                                          {kBlock4, kBlock4},
                                          {kBlock4, DType::kFloat32},
                                          {DType::kBFloat16, kUBlock4},
                                          {kBlock4, kUBlock8},
                                          {kBlock8, kUBlock4}}};
  const DType grads[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  std::vector<BlockConfig> configs;
  for (const auto& moments : widths) {
    for (bool adam_w : {true, false}) {
      for (const auto& w : weights) {
        for (DType g : grads) {
          for (const auto& m : moments) {
            configs.push_back({w.param, g, w.master, m.m, m.v, adam_w});
          }
        }
      }
    }
  }
  // Then every weight beside block4 with exp_avg rounded stochastically.
  for (bool adam_w : {true, false}) {
    for (const auto& w : weights) {
      for (DType g : grads) {
        configs.push_back(
            {w.param, g, w.master, kBlock4, kUBlock4, adam_w, Rounding::kStochastic});
      }
    }
  }
  // Then a bf16 param with no master rounded stochastically (S2.14) beside each
  // width's block moments, exp_avg of fp4-block rounded either way, with fp32
  // and bf16 gradients and two keys.
  struct ParamRounding {
    DType m, v;
    Rounding m_rounding;
  };
  const ParamRounding param_rounding[] = {{kBlock8, kUBlock8, Rounding::kNearest},
                                          {DType::kFloat32, kBlock8, Rounding::kNearest},
                                          {kBlock4, kUBlock4, Rounding::kNearest},
                                          {kBlock4, kUBlock4, Rounding::kStochastic},
                                          {kBlock4, kUBlock8, Rounding::kStochastic}};
  for (bool adam_w : {true, false}) {
    for (DType g : {DType::kFloat32, DType::kBFloat16}) {
      for (const ParamRounding& m : param_rounding) {
        if (!adam_w && g == DType::kBFloat16) continue;
        for (uint32_t key : {kShardRoundingKey, 0u}) {
          configs.push_back({DType::kBFloat16, g, DType::kNone, m.m, m.v, adam_w, m.m_rounding,
                             Rounding::kStochastic, key});
        }
      }
    }
  }
  // Then block4 as FusedAdam steps it, both moments rounded stochastically, beside
  // every weight (fp32 and bf16 gradients), beside a bf16 param with no master
  // rounded stochastically too, and the unsigned E3M1 exp_avg_sq alone beside an
  // 8-bit exp_avg.
  constexpr Rounding kSR = Rounding::kStochastic, kNear = Rounding::kNearest;
  for (bool adam_w : {true, false}) {
    for (const auto& w : weights) {
      for (DType g : {DType::kFloat32, DType::kBFloat16}) {
        configs.push_back({w.param, g, w.master, kBlock4, kUBlock4, adam_w, kSR, kNear,
                           kShardRoundingKey, kSR});
      }
    }
  }
  configs.push_back({DType::kBFloat16, DType::kBFloat16, DType::kNone, kBlock4, kUBlock4, true,
                     kSR, kSR, kShardRoundingKey, kSR});
  configs.push_back({DType::kFloat32, DType::kFloat32, DType::kNone, kBlock8, kUBlock4, true,
                     kNear, kNear, kShardRoundingKey, kSR});
  // And block8 as FusedAdam steps it (the unsigned E4M4 exp_avg_sq rounded
  // stochastically) beside every weight, and beside a bf16 param with no master
  // rounded stochastically too.
  for (bool adam_w : {true, false}) {
    for (const auto& w : weights) {
      configs.push_back({w.param, DType::kBFloat16, w.master, kBlock8, kUBlock8, adam_w, kNear,
                         kNear, kShardRoundingKey, kSR});
    }
  }
  configs.push_back({DType::kBFloat16, DType::kFloat32, DType::kNone, kBlock8, kUBlock8, true,
                     kNear, kSR, kShardRoundingKey, kSR});
  return configs;
}

// Bytes around every buffer that no step may write.
inline constexpr size_t kGuard = 16;
inline constexpr uint8_t kGuardByte = 0xA5;

// A shard of a parameter owned as a caller would own it, each buffer and scale
// array between guard bytes.
struct Shard {
  BlockConfig config;
  int64_t numel = 0, first_index = 0;
  int32_t block = 0;
  std::vector<uint8_t> param, grad, master, exp_avg, exp_avg_sq, m_scales, v_scales;

  static std::vector<uint8_t> Guarded(size_t bytes) {
    return std::vector<uint8_t>(bytes + 2 * kGuard, kGuardByte);
  }
  static void* At(std::vector<uint8_t>& bytes) { return bytes.data() + kGuard; }

  Shard(const BlockConfig& c, int64_t first, int64_t n, int32_t b)
      : config(c), numel(n), first_index(first), block(b) {
    const auto size = [n](DType d) { return static_cast<size_t>(BufferBytes(d, n)); };
    param = Guarded(size(c.param));
    grad = Guarded(size(c.grad));
    master = Guarded(c.master == DType::kNone ? 0 : size(c.master));
    exp_avg = Guarded(size(c.exp_avg));
    exp_avg_sq = Guarded(size(c.exp_avg_sq));
    const auto scales = [&](DType d) {
      std::vector<uint8_t> s = Guarded(sizeof(float) * ScaleCount(d, first, n, b));
      for (int64_t k = 0; k < ScaleCount(d, first, n, b); ++k) {
        const float one = 1.0f;  // a fresh state: zero moments, scale 1
        std::memcpy(s.data() + kGuard + k * sizeof(float), &one, sizeof(float));
      }
      return s;
    };
    m_scales = scales(c.exp_avg);
    v_scales = scales(c.exp_avg_sq);
    for (auto* buffer : {&exp_avg, &exp_avg_sq}) {
      std::memset(buffer->data() + kGuard, 0, buffer->size() - 2 * kGuard);
    }
    for (int64_t i = 0; i < n; ++i) {
      const float w = std::sin(0.37f * static_cast<float>(first + i));
      if (c.master == DType::kInt16Remainder) {
        reference::SplitMaster(w, static_cast<uint16_t*>(At(param)) + i,
                         static_cast<int16_t*>(At(master)) + i);
      } else {
        reference::StoreElement(At(param), c.param, i, w);
        if (c.master != DType::kNone) reference::StoreElement(At(master), c.master, i, w);
      }
    }
  }

  TensorSlot Slot() {
    TensorSlot s;
    s.numel = numel;
    s.first_index = first_index;
    s.scale_block = block;
    s.param = At(param);
    s.param_dtype = config.param;
    s.grad = At(grad);
    s.grad_dtype = config.grad;
    s.exp_avg = At(exp_avg);
    s.exp_avg_dtype = config.exp_avg;
    s.exp_avg_sq = At(exp_avg_sq);
    s.exp_avg_sq_dtype = config.exp_avg_sq;
    s.exp_avg_rounding = config.rounding;
    s.param_rounding = config.param_rounding;
    s.exp_avg_sq_rounding = config.v_rounding;
    s.rounding_key = config.rounding_key;
    if (IsScaled(config.exp_avg)) s.exp_avg_scale = static_cast<float*>(At(m_scales));
    if (IsScaled(config.exp_avg_sq)) s.exp_avg_sq_scale = static_cast<float*>(At(v_scales));
    if (config.master != DType::kNone) {
      s.master_param = At(master);
      s.master_dtype = config.master;
    }
    return s;
  }
};

// The gradient of step `step`: per scale block, a magnitude class (zero blocks,
// ordinary, tiny enough that the fp8-block scale is 1, subnormal, huge enough
// that v overflows), and at some steps a few NaN and infinite elements.
inline void FillBlockGrad(Shard* t, int step, std::mt19937* rng) {
  static const int kExponents[] = {0, -6, 1000, -40, -70, -131, -149, 66, 3};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < t->numel; ++i) {
    const int64_t global = t->first_index + i;
    const int64_t block = global / t->block;
    const int exponent = kExponents[(block * 7 + step) % 9];
    float g = exponent == 1000 ? 0.0f : std::ldexp(normal(*rng), exponent);
    if (step % 2 == 0 && global % 2003 == 17) g = NAN;
    if (step == 3 && global % 3001 == 5) g = (global & 1) ? INFINITY : -INFINITY;
    reference::StoreElement(Shard::At(t->grad), t->config.grad, i, g);
  }
}

inline ::testing::AssertionResult SameShard(const Shard& want, const Shard& got) {
  const BlockConfig& c = want.config;
  const struct {
    const char* name;
    const std::vector<uint8_t>& a;
    const std::vector<uint8_t>& b;
    DType dtype;
  } buffers[] = {{"param", want.param, got.param, c.param},
                 {"master", want.master, got.master, c.master},
                 {"exp_avg", want.exp_avg, got.exp_avg, c.exp_avg},
                 {"exp_avg_sq", want.exp_avg_sq, got.exp_avg_sq, c.exp_avg_sq}};
  for (const auto& buffer : buffers) {
    for (size_t k = 0; k < kGuard; ++k) {
      if (buffer.b[k] != kGuardByte || buffer.b[buffer.b.size() - 1 - k] != kGuardByte) {
        return ::testing::AssertionFailure() << buffer.name << ": written outside";
      }
    }
    if (buffer.dtype == DType::kNone) continue;
    ::testing::AssertionResult same = SameElements(buffer.a.data() + kGuard,
                                                   buffer.b.data() + kGuard, buffer.dtype,
                                                   want.numel);
    if (!same) return ::testing::AssertionFailure() << buffer.name << ": " << same.message();
  }
  // 4-bit codes have one NaN each: their bytes are compared whole, the padding
  // nibble after an odd count included (S2.12: written 0).
  for (const auto& buffer : buffers) {
    if (FormatOf(buffer.dtype).item_bits == 4 && buffer.a != buffer.b) {
      return ::testing::AssertionFailure() << buffer.name << ": bytes differ";
    }
  }
  // Scales bitwise, guards included.
  if (want.m_scales != got.m_scales) return ::testing::AssertionFailure() << "exp_avg scales";
  if (want.v_scales != got.v_scales) return ::testing::AssertionFailure() << "exp_avg_sq scales";
  return ::testing::AssertionSuccess();
}

// Shards as (first_index, numel, block size): partial first and last blocks, a
// first block of one element, shards spanning several CUDA blocks' chunks, one
// whole block, a first index past 2^32, and an empty shard.
struct ShardShape {
  int64_t first_index, numel;
  int32_t block;
};
inline std::vector<ShardShape> ShardShapes() {
  return {
    {0, 1, 128},          {100, 1000, 128},     {37, 20000, 128},  {768, 513, 256},
    {3 * 512 + 7, 3000, 512}, {(1 << 20) + 5, 9000, 1024}, {2048 * 3 + 2047, 5000, 2048},
    {0, 4096, 4096},      {4095, 8200, 4096},   {(int64_t{1} << 33) + 300, 777, 2048},
    {0, 0, 256},
  };
}

// The same cases for 4-bit states, whose first_index is even (S2.12): a first
// block of two elements (one byte), and odd counts, whose last byte holds a
// padding nibble.
inline std::vector<ShardShape> EvenShardShapes() {
  return {
    {0, 1, 128},          {100, 1001, 128},     {36, 20001, 128},  {768, 513, 256},
    {3 * 512 + 6, 3000, 512}, {(1 << 20) + 4, 9001, 1024}, {2048 * 3 + 2046, 5000, 2048},
    {0, 4096, 4096},      {4094, 8201, 4096},   {(int64_t{1} << 33) + 300, 777, 2048},
    {0, 0, 256},
  };
}

// The shapes a config's shards take.
inline std::vector<ShardShape> ShardShapesFor(const BlockConfig& c) {
  return HasFourBitState(c) ? EvenShardShapes() : ShardShapes();
}

inline std::string ShardName(const Shard& s) {
  return "(first_index " + std::to_string(s.first_index) + ", numel " +
         std::to_string(s.numel) + ", block " + std::to_string(s.block) + ")";
}

// Four steps: lr 0 at the third (a real step, S3.8), no bias correction at the
// fourth, weight decay in both modes.
inline std::vector<StepParams> BlockSchedule(bool adam_w) {
  std::vector<StepParams> steps;
  for (int step = 1; step <= 4; ++step) {
    StepParams p;
    p.step = step;
    p.adam_w_mode = adam_w;
    p.lr = step == 3 ? 0.0 : 1e-2;
    p.weight_decay = 0.05;
    p.bias_correction = step != 4;
    steps.push_back(p);
  }
  return steps;
}

}  // namespace testing
}  // namespace shardadam

#endif  // SHARDADAM_TESTS_CPP_BLOCK_FIXTURE_H_
