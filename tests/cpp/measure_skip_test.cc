// Pass 1 of a layout with scaled moments skips every block whose new
// moments cannot exceed the magnitudes measured so far (adam.cc,
// BlockMayRaiseMax). The step stays exact only if no block holding a new
// maximum is ever skipped, so this checks the pieces that decision rests on:
// the per-stream maxima kernels on every target, the bound against the
// element formula itself, and whole steps whose largest new moment comes from
// one element late in the tensor, raised by each input in turn.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "element.h"
#include "gtest/gtest.h"
#include "kernels.h"
#include "tensor_fixture.h"
#include "test_util.h"

namespace shardadam {
namespace testing {
namespace {

uint32_t AbsBits(float f) { return BitsOf(f) & 0x7FFFFFFFu; }

// The largest x & mask, one element at a time.
template <typename T>
uint32_t ScalarMaskedMax(const std::vector<T>& x, size_t n, T mask) {
  uint32_t best = 0;
  for (size_t i = 0; i < n; ++i) best = std::max<uint32_t>(best, x[i] & mask);
  return best;
}

TEST(StreamMaximaTest, MatchScalarOnEveryTarget) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits(0, 0xFFFF);
  std::vector<uint16_t> halves(4099);
  std::vector<uint8_t> codes(4099);
  for (auto& h : halves) h = static_cast<uint16_t>(bits(rng) & 0xBFFF);
  for (auto& c : codes) c = static_cast<uint8_t>(bits(rng) & 0xBF);
  // A largest magnitude with the sign bit set, in the scalar tail of some sizes.
  halves[4097] = 0xFFFE;
  codes[4097] = 0xFE;
  const auto check = [&](const std::vector<uint16_t>& h, const std::vector<uint8_t>& c) {
    const internal::KernelTable& kt = internal::ActiveKernels();
    for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{31}, size_t{64},
                     size_t{4097}, size_t{4098}, size_t{4099}}) {
      SCOPED_TRACE("n " + std::to_string(n));
      EXPECT_EQ(kt.abs_max_bits16(h.data(), n), ScalarMaskedMax<uint16_t>(h, n, 0x7FFF));
      EXPECT_EQ(kt.abs_max_code8(c.data(), n), ScalarMaskedMax<uint8_t>(c, n, 0x7F));
    }
  };
  ForEachTarget([&] {
    check(halves, codes);
    // The random values stay below 0x4000 / 0x40: a largest magnitude in
    // every lane position of the widest vector (64 bytes) in turn, each with
    // a runner-up in every other lane, so a reduction that lets one lane
    // shadow another shows.
    for (size_t at = 0; at < 64; ++at) {
      SCOPED_TRACE("largest at " + std::to_string(at));
      std::vector<uint16_t> h = halves;
      std::vector<uint8_t> c = codes;
      for (size_t i = 0; i < 64; ++i) {
        h[i] = i == at ? 0xF000 : 0x4000 + static_cast<uint16_t>(i);
        c[i] = i == at ? 0xF0 : static_cast<uint8_t>(0x40 + i % 32);
      }
      check(h, c);
    }
  });
}

// Every element's new |m| and |v| is within the bound computed from the
// largest input magnitudes, or the bound is not finite (then the block is
// measured unless the maximum already is not finite, and the scale is 1 either
// way). Inputs span every binade, subnormals, infinities and NaN.
TEST(MomentBoundTest, BoundsEveryElementOfTheBlock) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  // Any bit pattern; a third of them with exponents near 1, where most
  // bounds stay finite.
  const auto value = [&] {
    uint32_t b = any_bits(rng);
    if (unit(rng) < 0.3) b = (b & 0x807FFFFFu) | ((120 + any_bits(rng) % 16) << 23);
    return FloatOf(b);
  };
  int checked = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    StepParams p;
    p.adam_w_mode = trial % 2 == 0;
    p.beta1 = unit(rng) < 0.2 ? 0.0 : unit(rng);
    p.beta2 = unit(rng);
    p.weight_decay = unit(rng) < 0.2 ? 0.0 : 10 * unit(rng);
    p.lr = 1e-3;
    p.step = 1 + trial % 50;
    const StepConstants c = MakeStepConstants(p);
    constexpr int kBlock = 16;
    float g[kBlock], w[kBlock], m[kBlock], v[kBlock];
    float max_g = 0, max_w = 0, max_m = 0, max_v = 0;
    for (int i = 0; i < kBlock; ++i) {
      g[i] = value();
      w[i] = value();
      m[i] = value();
      v[i] = value();
      // Largest magnitude by bits, as the kernels find it (NaN above all).
      const auto fold = [](float& best, float x) {
        if (AbsBits(x) > AbsBits(best)) best = std::fabs(x);
      };
      fold(max_g, g[i]);
      fold(max_w, w[i]);
      fold(max_m, m[i]);
      fold(max_v, v[i]);
    }
    const MomentBounds bound = NewMomentBounds(c, max_g, max_w, max_m, max_v);
    const ScalarOps ops;
    for (int i = 0; i < kBlock; ++i) {
      float wi = w[i], mi = m[i], vi = v[i];
      if (p.adam_w_mode) {
        AdamElement<true>(ops, c, g[i], wi, mi, vi);
      } else {
        AdamElement<false>(ops, c, g[i], wi, mi, vi);
      }
      for (const auto& [x, b] : {std::pair<float, float>{mi, bound.m}, {vi, bound.v}}) {
        if (AbsBits(b) >= 0x7F800000u) continue;
        ++checked;
        ASSERT_LE(AbsBits(x), AbsBits(b))
            << "trial " << trial << " element " << i << ": " << x << " above " << b;
      }
    }
  }
  EXPECT_GT(checked, 20000);  // most bounds are finite
}

// A block whose stored moment is an fp16 subnormal code (far below the largest, which set
// the old scale) holds the new maximum, just above a bound that halved subnormal codes
// would give: it must not be skipped. beta1 = 1/2 makes element 0's new m exactly 0 (its
// old m of 1 set the scale) and element 1's exactly 3/8 of the late one's old value,
// whose new one is 1/2 of it; every other input is 0, v's late bound too.
TEST(MeasureSkipTest, SubnormalStoredMomentIsBounded) {
  using D = DType;
  const Config config{D::kFloat32, D::kFloat32, D::kFloat16, D::kFloat16, D::kNone, true};
  StepParams params;
  params.beta1 = 0.5;
  params.step = 3;
  const int64_t n = 30001;
  const float tiny = 1.5f * std::ldexp(1.0f, -31);  // / (1 / 32752): below 2^-14
  std::vector<float> w(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g(n, 0.0f);
  m[0] = 1.0f;
  g[0] = -1.0f;
  g[1] = 0.75f * tiny;
  for (int64_t at : {n - 5, n / 2 + 3}) {
    SCOPED_TRACE("late moment at " + std::to_string(at));
    std::vector<float> late = m;
    late[at] = tiny;
    ExpectStepMatchesReference({TensorFromValues(config, w, late, v, g)}, params, {1, 2});
  }
}

// Whole steps. The base state is quiet (the kernel benchmark's magnitudes);
// one element then raises the largest new moment through one input. Where a
// grad raises one moment, an early element keeps the other moment's maximum
// above it, so that only the first moment's bound can flag the late block.
enum class Spike {
  kGradIntoExpAvg,
  kGradIntoExpAvgSq,
  kExpAvg,
  kExpAvgSq,
  kWeight,  // L2 mode: through the gradient
  kNaNGrad,  // new scales 1
};

std::string SpikeName(Spike s) {
  switch (s) {
    case Spike::kGradIntoExpAvg: return "grad_into_exp_avg";
    case Spike::kGradIntoExpAvgSq: return "grad_into_exp_avg_sq";
    case Spike::kExpAvg: return "exp_avg";
    case Spike::kExpAvgSq: return "exp_avg_sq";
    case Spike::kWeight: return "weight";
    case Spike::kNaNGrad: return "nan_grad";
  }
  return "";
}

// Every magnitude is multiplied by `scale` (v's by its square), so that the
// old scales of the stored moments fall below 1 for scale 1 and above it for
// a large one.
Tensor SpikedTensor(const Config& config, int64_t n, int64_t at, Spike spike,
                    float scale, std::mt19937* rng) {
  std::vector<float> w = Normal(rng, n, scale);
  std::vector<float> g = Normal(rng, n, 1e-3f * scale);
  std::vector<float> m = Normal(rng, n, 1e-4f * scale);
  std::vector<float> v = Normal(rng, n, 1e-4f * scale);
  for (float& x : v) x = x * x;
  const int64_t early = 1;
  switch (spike) {
    case Spike::kGradIntoExpAvg:
      g[at] = 5.0f * scale;
      v[early] = scale * scale;
      break;
    case Spike::kGradIntoExpAvgSq:
      g[at] = scale;
      m[early] = scale;
      break;
    case Spike::kExpAvg: m[at] = scale; break;
    case Spike::kExpAvgSq: v[at] = scale * scale; break;
    case Spike::kWeight: w[at] = 3000.0f * scale; break;
    case Spike::kNaNGrad: g[at] = NAN; break;
  }
  return TensorFromValues(config, w, m, v, g);
}

struct SkipCase {
  Config config;
  Spike spike;
};

void PrintTo(const SkipCase& c, std::ostream* os) {
  *os << ConfigName(c.config) << "_" << SpikeName(c.spike);
}

std::vector<SkipCase> SkipCases() {
  using D = DType;
  const Config configs[] = {
      {D::kBFloat16, D::kBFloat16, D::kFloat8E4M3, D::kFloat8E4M3, D::kFloat32, true},
      {D::kBFloat16, D::kBFloat16, D::kFloat8E4M3, D::kFloat8E4M3, D::kFloat32, false},
      {D::kFloat32, D::kFloat32, D::kFloat8E4M3, D::kFloat8E4M3, D::kNone, false},
      {D::kBFloat16, D::kFloat32, D::kFloat16, D::kFloat16, D::kFloat32, true},
      {D::kFloat32, D::kBFloat16, D::kFloat16, D::kFloat16, D::kNone, false},
      {D::kBFloat16, D::kBFloat16, D::kFloat8E4M3, D::kBFloat16, D::kFloat32, true},
      {D::kBFloat16, D::kBFloat16, D::kFloat8E4M3, D::kFloat8E4M3, D::kInt16Remainder,
       false},
      // Block-path layouts: fp16 params and grads, mixed moments, an unscaled w
      // from a bf16 or fp16 param (L2), a scaled master (always measured).
      {D::kFloat16, D::kFloat16, D::kFloat8E4M3, D::kFloat8E4M3, D::kFloat32, true},
      {D::kFloat16, D::kFloat16, D::kFloat16, D::kFloat16, D::kNone, false},
      {D::kBFloat16, D::kBFloat16, D::kFloat8E4M3, D::kFloat8E4M3, D::kNone, false},
      {D::kBFloat16, D::kBFloat16, D::kBFloat16, D::kFloat8E4M3, D::kFloat32, false},
      {D::kFloat32, D::kFloat32, D::kFloat8E4M3, D::kFloat16, D::kNone, true},
      {D::kBFloat16, D::kBFloat16, D::kFloat8E4M3, D::kFloat8E4M3, D::kFloat16, false},
  };
  std::vector<SkipCase> cases;
  for (const Config& c : configs) {
    for (Spike s : {Spike::kGradIntoExpAvg, Spike::kGradIntoExpAvgSq, Spike::kExpAvg,
                    Spike::kExpAvgSq, Spike::kWeight, Spike::kNaNGrad}) {
      if (s == Spike::kWeight && c.adam_w) continue;  // w does not reach m, v
      cases.push_back({c, s});
    }
  }
  return cases;
}

class MeasureSkipTest : public ::testing::TestWithParam<SkipCase> {};

// The spike sits in the last block or in a middle one; the tensors take both
// pass-1 schedules (one thread per small tensor, threaded chunks for a large
// one), and every result must equal the reference's.
TEST_P(MeasureSkipTest, LateMaximumIsMeasured) {
  const SkipCase& c = GetParam();
  std::mt19937 rng(23);
  StepParams params;
  params.adam_w_mode = c.config.adam_w;
  params.weight_decay = 0.1;
  params.step = 3;
  for (float scale : {1.0f, 1e5f}) {
    for (int64_t n : {int64_t{30001}, int64_t{150001}}) {
      for (int64_t at : {n - 5, n / 2 + 3}) {
        SCOPED_TRACE("scale " + std::to_string(scale) + " numel " + std::to_string(n) +
                     " spike at " + std::to_string(at));
        const std::vector<Tensor> tensors = {
            SpikedTensor(c.config, n, at, c.spike, scale, &rng)};
        ExpectStepMatchesReference(tensors, params, {1, 2});
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ScaledLayouts, MeasureSkipTest,
                         ::testing::ValuesIn(SkipCases()),
                         [](const ::testing::TestParamInfo<SkipCase>& info) {
                           return ConfigName(info.param.config) + "_" +
                                  SpikeName(info.param.spike);
                         });

}  // namespace
}  // namespace testing
}  // namespace shardadam
