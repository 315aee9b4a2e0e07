// Codec tests (SEMANTICS S2.2-S2.5, S2.10, S2.12). The reference codecs are checked
// against an oracle built only from each format's definition (nearest value,
// ties to the even code), exhaustively for every 8- and 16-bit code; then the
// SIMD Convert, MeasureScale, remainder split/merge and the per-block E4M4,
// E2M1 and E3M1 codecs are checked against the reference bit for bit on every Highway
// target; so are stochastically rounded E2M1 (S2.13) and bf16 (S2.14), whose
// rules are checked for their generator, their grid and their mean.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "bf16_stochastic.h"
#include "counter_hash.h"
#include "float4.h"
#include "gtest/gtest.h"
#include "kernels.h"
#include "reference.h"
#include "shardadam/adam.h"
#include "stochastic_blocks.h"
#include "test_util.h"
#include "ufloat8.h"

namespace shardadam {
namespace testing {
namespace {

namespace ref = reference;

// A binary floating-point format by its fields. Codes here are magnitudes (sign
// bit clear); `overflow_code` is the first code past the largest finite value
// (infinity, or NaN for E4M3 "fn", which has no infinity).
struct Format {
  DType dtype;
  int mantissa_bits;
  int bias;
  uint32_t overflow_code;
  uint32_t sign_bit;
};
constexpr Format kBFloat16Format{DType::kBFloat16, 7, 127, 0x7F80, 0x8000};
constexpr Format kFloat16Format{DType::kFloat16, 10, 15, 0x7C00, 0x8000};
constexpr Format kFloat8Format{DType::kFloat8E4M3, 3, 7, 0x7F, 0x80};
constexpr Format kFormats[] = {kBFloat16Format, kFloat16Format, kFloat8Format};

// Value of a magnitude code by the textbook definition. The overflow code
// decodes as if it were finite (largest value + one ulp): the point from which,
// rounding to nearest even, a value overflows.
double CodeValue(const Format& f, uint32_t code) {
  const int exponent = static_cast<int>(code >> f.mantissa_bits);
  const uint32_t mantissa = code & ((1u << f.mantissa_bits) - 1);
  if (exponent == 0) {
    return std::ldexp(static_cast<double>(mantissa),
                      1 - f.bias - f.mantissa_bits);
  }
  return std::ldexp(static_cast<double>((1u << f.mantissa_bits) + mantissa),
                    exponent - f.bias - f.mantissa_bits);
}

// The code `x` must narrow to: the nearest value, ties to the even code, and
// the overflow code at or beyond its value. -1 for a NaN input (any NaN
// output).
int64_t NearestCode(const Format& f, float x) {
  if (std::isnan(x)) return -1;
  const double a = std::fabs(static_cast<double>(x));
  uint32_t code;
  if (a >= CodeValue(f, f.overflow_code)) {
    code = f.overflow_code;
  } else {
    uint32_t lo = 0,
             hi = f.overflow_code;  // CodeValue(lo) <= a < CodeValue(hi)
    while (hi - lo > 1) {
      const uint32_t mid = lo + (hi - lo) / 2;
      (CodeValue(f, mid) <= a ? lo : hi) = mid;
    }
    const double below = a - CodeValue(f, lo), above = CodeValue(f, hi) - a;
    code = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
  }
  return std::signbit(x) ? (code | f.sign_bit) : code;
}

uint32_t Encode(const Format& f, float x) {
  switch (f.dtype) {
    case DType::kBFloat16:
      return ref::FloatToBFloat16(x);
    case DType::kFloat16:
      return ref::FloatToFloat16(x);
    default:
      return ref::FloatToFloat8E4M3(x);
  }
}

float Decode(const Format& f, uint32_t code) {
  switch (f.dtype) {
    case DType::kBFloat16:
      return ref::BFloat16ToFloat(static_cast<uint16_t>(code));
    case DType::kFloat16:
      return ref::Float16ToFloat(static_cast<uint16_t>(code));
    default:
      return ref::Float8E4M3ToFloat(static_cast<uint8_t>(code));
  }
}

bool IsNaNCode(const Format& f, uint32_t code) {
  return IsNaNElement(code, f.dtype);
}

// fp32 inputs that exercise narrowing: specials, every value of each format
// with the midpoint to its successor (the ties) and the fp32 neighbours of that
// midpoint, both signs; random bit patterns; random values in the small
// formats' ranges.
const std::vector<float>& NarrowingInputs() {
  static const std::vector<float>* inputs = [] {
    auto* v = new std::vector<float>;
    const uint32_t specials[] = {
        0x00000000, 0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA00000,
        0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x3F800000, 0x7F7F7FFF,
        0x7F7F8000, 0x7F7F8001, 0x477FEFFF, 0x477FF000};
    for (uint32_t bits : specials) {
      v->push_back(FloatOf(bits));
      v->push_back(FloatOf(bits | 0x80000000u));
    }
    for (const Format& f : kFormats) {
      for (uint32_t code = 0; code < f.overflow_code; ++code) {
        const double lo = CodeValue(f, code), hi = CodeValue(f, code + 1);
        const float mid = static_cast<float>((lo + hi) / 2);  // exact in fp32
        for (float x : {static_cast<float>(lo), mid, std::nextafter(mid, 0.0f),
                        std::nextafter(mid, INFINITY)}) {
          v->push_back(x);
          v->push_back(-x);
        }
      }
    }
    std::mt19937 rng(20240611);
    for (int i = 0; i < (1 << 20); ++i) v->push_back(FloatOf(rng()));
    std::uniform_int_distribution<int> exponent(-30, 20);
    for (int i = 0; i < (1 << 19); ++i) {
      const float unit = static_cast<float>(rng() >> 8) / (1 << 24);
      v->push_back(std::ldexp(rng() & 1 ? unit : -unit, exponent(rng)));
    }
    return v;
  }();
  return *inputs;
}

// ---------------------------------------------------------------------------
// Reference codecs against the format definitions.

TEST(ReferenceCodecTest, DecodesEveryCodeByDefinition) {
  for (const Format& f : kFormats) {
    SCOPED_TRACE(DTypeName(f.dtype));
    const uint32_t codes = 2 * f.sign_bit;
    for (uint32_t code = 0; code < codes; ++code) {
      const uint32_t magnitude = code & ~f.sign_bit;
      const float got = Decode(f, code);
      if (magnitude < f.overflow_code) {
        const double want = (code & f.sign_bit) ? -CodeValue(f, magnitude)
                                                : CodeValue(f, magnitude);
        ASSERT_EQ(BitsOf(got), BitsOf(static_cast<float>(want)))
            << "code " << code;
      } else if (f.dtype != DType::kFloat8E4M3 &&
                 magnitude == f.overflow_code) {
        ASSERT_TRUE(std::isinf(got)) << "code " << code;
        ASSERT_EQ(std::signbit(got), (code & f.sign_bit) != 0);
      } else {
        ASSERT_TRUE(std::isnan(got)) << "code " << code;
        ASSERT_TRUE(IsNaNCode(f, code));
      }
    }
  }
}

TEST(ReferenceCodecTest, EveryCodeRoundTrips) {
  for (const Format& f : kFormats) {
    SCOPED_TRACE(DTypeName(f.dtype));
    for (uint32_t code = 0; code < 2 * f.sign_bit; ++code) {
      const uint32_t back = Encode(f, Decode(f, code));
      if (IsNaNCode(f, code)) {
        ASSERT_TRUE(IsNaNCode(f, back)) << "code " << code;
      } else {
        ASSERT_EQ(back, code);
      }
    }
  }
}

TEST(ReferenceCodecTest, NarrowingMatchesNearestValueOracle) {
  for (const Format& f : kFormats) {
    SCOPED_TRACE(DTypeName(f.dtype));
    for (float x : NarrowingInputs()) {
      const int64_t want = NearestCode(f, x);
      const uint32_t got = Encode(f, x);
      if (want < 0) {
        ASSERT_TRUE(IsNaNCode(f, got)) << "fp32 0x" << std::hex << BitsOf(x);
      } else {
        ASSERT_EQ(got, static_cast<uint32_t>(want))
            << "fp32 0x" << std::hex << BitsOf(x);
      }
    }
  }
}

// S2.10's unsigned E4M4 by its fields: no sign bit, NaN at 0xFF (the first
// code past the largest finite value, 480), and zero-free: a non-zero
// magnitude nearest to code 0 takes code 1.
constexpr Format kUFloat8Format{DType::kUFloat8E4M4Block, 4, 7, 0xFF, 0};

int64_t NearestUF8Code(float x) {
  const int64_t code = NearestCode(kUFloat8Format, std::fabs(x));
  return code == 0 && x != 0.0f ? 1 : code;
}

// The shared inputs plus a format's own grid: values, midpoints and their
// neighbours, both signs, and magnitudes far below its smallest code.
std::vector<float> InputsWithGrid(const Format& f) {
  std::vector<float> v = NarrowingInputs();
  for (uint32_t code = 0; code < f.overflow_code; ++code) {
    const double lo = CodeValue(f, code), hi = CodeValue(f, code + 1);
    const float mid = static_cast<float>((lo + hi) / 2);
    for (float x : {static_cast<float>(lo), mid, std::nextafter(mid, 0.0f),
                    std::nextafter(mid, INFINITY)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  for (int e = -149; e < -2; ++e) v.push_back(std::ldexp(1.0f, e));
  return v;
}

TEST(ReferenceCodecTest, UnsignedE4M4DecodesEveryCodeByDefinition) {
  for (uint32_t code = 0; code < 0xFF; ++code) {
    ASSERT_EQ(BitsOf(ref::UFloat8E4M4ToFloat(static_cast<uint8_t>(code))),
              BitsOf(static_cast<float>(CodeValue(kUFloat8Format, code))))
        << "code " << code;
    ASSERT_EQ(ref::FloatToUFloat8E4M4(ref::UFloat8E4M4ToFloat(static_cast<uint8_t>(code))),
              code);
  }
  EXPECT_EQ(ref::UFloat8E4M4ToFloat(0xFE), 480.0f);
  EXPECT_TRUE(std::isnan(ref::UFloat8E4M4ToFloat(0xFF)));
}

TEST(ReferenceCodecTest, UnsignedE4M4NarrowingMatchesOracle) {
  for (float x : InputsWithGrid(kUFloat8Format)) {
    const int64_t want = NearestUF8Code(x);
    const uint32_t got = ref::FloatToUFloat8E4M4(x);
    ASSERT_EQ(got, want < 0 ? 0xFFu : static_cast<uint32_t>(want))
        << "fp32 0x" << std::hex << BitsOf(x);
  }
  // The edges S2.10 names: 488 is the tie that stays finite; 0 alone is code 0.
  EXPECT_EQ(ref::FloatToUFloat8E4M4(488.0f), 0xFE);
  EXPECT_EQ(ref::FloatToUFloat8E4M4(std::nextafter(488.0f, 1e9f)), 0xFF);
  EXPECT_EQ(ref::FloatToUFloat8E4M4(INFINITY), 0xFF);
  EXPECT_EQ(ref::FloatToUFloat8E4M4(0.0f), 0x00);
  EXPECT_EQ(ref::FloatToUFloat8E4M4(-0.0f), 0x00);
  EXPECT_EQ(ref::FloatToUFloat8E4M4(FloatOf(1)), 0x01);
  EXPECT_EQ(ref::FloatToUFloat8E4M4(-2.0f), ref::FloatToUFloat8E4M4(2.0f));
}

// S2.12's 4-bit formats by their fields. Signed E2M1: values 0 .. 6, the
// overflow code 8 (what 7 and above round to) is NaN, and so is 0x8, the code
// -0 would have: a magnitude rounding to 0 is code 0 whatever its sign.
// Unsigned E3M1: values 0 .. 16, NaN at 0xF, zero-free as E4M4.
constexpr Format kFloat4Format{DType::kFloat4E2M1Block, 1, 1, 8, 8};
constexpr Format kUFloat4Format{DType::kUFloat4E3M1Block, 1, 3, 0xF, 0};

int64_t NearestF4Code(float x) {
  const int64_t code = NearestCode(kFloat4Format, std::fabs(x));
  if (code < 0 || code >= 8) return -1;
  return code == 0 || !std::signbit(x) ? code : code | 8;
}

int64_t NearestUF4Code(float x) {
  const int64_t code = NearestCode(kUFloat4Format, std::fabs(x));
  return code == 0 && x != 0.0f ? 1 : code;
}

TEST(ReferenceCodecTest, FourBitFormatsDecodeEveryCodeByDefinition) {
  for (uint32_t code = 0; code < 16; ++code) {
    const float f4 = ref::Float4E2M1ToFloat(static_cast<uint8_t>(code));
    if (code == 8) {
      EXPECT_EQ(BitsOf(f4), 0x7FC00000u);  // the quiet NaN (S2.12)
    } else {
      const double magnitude = CodeValue(kFloat4Format, code & 7);
      ASSERT_EQ(BitsOf(f4), BitsOf(static_cast<float>(code & 8 ? -magnitude : magnitude)))
          << "code " << code;
      ASSERT_EQ(ref::FloatToFloat4E2M1(f4), code);
    }
    const float uf4 = ref::UFloat4E3M1ToFloat(static_cast<uint8_t>(code));
    if (code == 0xF) {
      EXPECT_EQ(BitsOf(uf4), 0x7FC00000u);
    } else {
      ASSERT_EQ(BitsOf(uf4), BitsOf(static_cast<float>(CodeValue(kUFloat4Format, code))))
          << "code " << code;
      ASSERT_EQ(ref::FloatToUFloat4E3M1(uf4), code);
    }
  }
  EXPECT_EQ(ref::Float4E2M1ToFloat(0x7), 6.0f);
  EXPECT_EQ(ref::Float4E2M1ToFloat(0x1), 0.5f);
  EXPECT_EQ(ref::UFloat4E3M1ToFloat(0xE), 16.0f);
  EXPECT_EQ(ref::UFloat4E3M1ToFloat(0x1), 0.125f);
}

TEST(ReferenceCodecTest, FourBitNarrowingMatchesOracle) {
  for (float x : InputsWithGrid(kFloat4Format)) {
    const int64_t want = NearestF4Code(x);
    ASSERT_EQ(ref::FloatToFloat4E2M1(x), want < 0 ? 0x8u : static_cast<uint32_t>(want))
        << "fp32 0x" << std::hex << BitsOf(x);
  }
  for (float x : InputsWithGrid(kUFloat4Format)) {
    const int64_t want = NearestUF4Code(x);
    ASSERT_EQ(ref::FloatToUFloat4E3M1(x), want < 0 ? 0xFu : static_cast<uint32_t>(want))
        << "fp32 0x" << std::hex << BitsOf(x);
  }
  // The edges S2.12 names: 7 rounds to even (8: NaN), 20 to even (16); -0.2
  // rounds to 0 with no sign; 0 alone is the unsigned code 0.
  EXPECT_EQ(ref::FloatToFloat4E2M1(7.0f), 0x8);
  EXPECT_EQ(ref::FloatToFloat4E2M1(std::nextafter(7.0f, 0.0f)), 0x7);
  EXPECT_EQ(ref::FloatToFloat4E2M1(-std::nextafter(7.0f, 0.0f)), 0xF);
  EXPECT_EQ(ref::FloatToFloat4E2M1(-0.25f), 0x0);
  EXPECT_EQ(ref::FloatToFloat4E2M1(-0.0f), 0x0);
  EXPECT_EQ(ref::FloatToFloat4E2M1(-INFINITY), 0x8);
  EXPECT_EQ(ref::FloatToUFloat4E3M1(20.0f), 0xE);
  EXPECT_EQ(ref::FloatToUFloat4E3M1(std::nextafter(20.0f, 1e9f)), 0xF);
  EXPECT_EQ(ref::FloatToUFloat4E3M1(FloatOf(1)), 0x1);
  EXPECT_EQ(ref::FloatToUFloat4E3M1(0.0f), 0x0);
}

// Per-block codecs of the kernels on every target: decoding every code, and
// narrowing every input (u / s, through StoreBlockElement's zero-free rule),
// at scale 1 and at power-of-two scales, codes packed as the format packs them.
void ExpectBlockCodecMatchesReference(DType dtype, internal::Codec codec,
                                      std::vector<float> inputs) {
  const int codes_count = 1 << FormatOf(dtype).item_bits;
  ForEachTarget([&] {
    const internal::KernelTable& kt = internal::ActiveKernels();
    const size_t all = (static_cast<size_t>(codes_count) + kt.pair - 1) / kt.pair * kt.pair;
    std::vector<uint8_t> all_codes(static_cast<size_t>(BufferBytes(dtype, all)), 0);
    for (size_t c = 0; c < all; ++c) {
      ref::SetCode(all_codes.data(), dtype, static_cast<int64_t>(c),
                   static_cast<uint8_t>(c % codes_count));
    }
    const size_t n = (inputs.size() + kt.pair - 1) / kt.pair * kt.pair;
    inputs.resize(n, 0.0f);
    for (float scale : {1.0f, 0.125f, 1024.0f}) {
      SCOPED_TRACE(DTypeName(dtype) + " scale " + std::to_string(scale));
      const internal::ScaleView view{&scale, 0, 0};
      std::vector<float> decoded(all);
      const float* out = kt.decode[codec](all_codes.data(), nullptr, all, view, decoded.data());
      for (size_t c = 0; c < all; ++c) {
        const float want = ref::LoadElement(all_codes.data(), dtype, static_cast<int64_t>(c));
        ASSERT_EQ(BitsOf(out[c]), BitsOf(want * scale)) << "code " << c % codes_count;
      }
      std::vector<uint8_t> codes(static_cast<size_t>(BufferBytes(dtype, n)));
      kt.encode[codec](inputs.data(), n, view, codes.data(), nullptr);
      for (size_t i = 0; i < n; ++i) {
        uint8_t want = 0;
        ref::StoreBlockElement(&want, dtype, 0, inputs[i], scale);
        ASSERT_EQ(ref::CodeAt(codes.data(), dtype, static_cast<int64_t>(i)), want)
            << "fp32 0x" << std::hex << BitsOf(inputs[i]);
      }
    }
  });
}

TEST(SimdCodecTest, UnsignedE4M4MatchesReference) {
  ExpectBlockCodecMatchesReference(DType::kUFloat8E4M4Block, internal::kCodecUF8Scaled,
                                   InputsWithGrid(kUFloat8Format));
}

TEST(SimdCodecTest, SignedE2M1MatchesReference) {
  ExpectBlockCodecMatchesReference(DType::kFloat4E2M1Block, internal::kCodecF4Scaled,
                                   InputsWithGrid(kFloat4Format));
}

TEST(SimdCodecTest, UnsignedE3M1MatchesReference) {
  ExpectBlockCodecMatchesReference(DType::kUFloat4E3M1Block, internal::kCodecUF4Scaled,
                                   InputsWithGrid(kUFloat4Format));
}

// S2.13's generator, pinned: lowbias32, one key per (tensor, step) with steps
// modulo 2^32, and flat indices below 2^32 hashed as their low half alone.
TEST(StochasticRoundingTest, CounterHashIsPinned) {
  EXPECT_EQ(Mix32(0), 0u);
  EXPECT_EQ(Mix32(1), 0x688990C0u);
  EXPECT_EQ(Mix32(0xDEADBEEFu), 0xE628C683u);
  const uint32_t key = StepKey(0x5EED, 3);
  EXPECT_EQ(key, 0xCD4470E2u);
  EXPECT_EQ(StepKey(0x5EED, 3 + (int64_t{1} << 32)), key);
  EXPECT_EQ(RandomBits(key, (uint64_t{5} << 32) + 17), 0x4F80DC40u);
  EXPECT_EQ(RandomBits(key, 17), Mix32(Mix32(17) ^ key));
  EXPECT_EQ(ExpAvgStepKey(0x5EED, 3), Mix32(key ^ 0x6C8E9CF5u));
}

// exp_avg's stream is keyed one hash past StepKey, as the other streams are:
// keyed by StepKey itself, element i at step t drew what element t drew at step
// i under the first tensor's key 0, and the element whose index is the step
// drew 0 at every step.
TEST(StochasticRoundingTest, ExpAvgBitsAreNotSymmetricInIndexAndStep) {
  int mirrored = 0;
  int zeros = 0;
  for (uint32_t t = 1; t < 65; ++t) {
    zeros += RandomBits(ExpAvgStepKey(0, t), t) == 0;
    for (uint32_t i = t + 1; i < 65; ++i) {
      mirrored += RandomBits(ExpAvgStepKey(0, t), i) == RandomBits(ExpAvgStepKey(0, i), t);
    }
  }
  EXPECT_EQ(mirrored, 0);
  EXPECT_EQ(zeros, 0);
}

// S2.13's canonical block: the scale its decoded values would take again, from
// the highest rank of its codes.
TEST(StochasticRoundingTest, CanonicalScaleOfStochasticBlocks) {
  const float s = 0x1p-3f;
  for (uint32_t top : {6u, 7u}) EXPECT_EQ(CanonicalFloat4Scale(false, top, s), s);
  EXPECT_EQ(CanonicalFloat4Scale(false, 5u, s), s / 2);  // 3: rounded down from (3.5, 4)
  EXPECT_EQ(CanonicalFloat4Scale(false, 0xFu, 1.0f), 1.0f);  // a NaN code
  EXPECT_EQ(CanonicalFloat4Scale(false, 0u, 0x1p-126f), 1.0f);  // every code 0
  EXPECT_EQ(CanonicalFloat4Scale(false, 1u, 0x1p-126f), 0x1p-126f);  // the smallest scale
  EXPECT_EQ(CanonicalFloat4Scale(false, 5u, 0x1p-126f), 0x1p-126f);
  for (uint32_t top : {13u, 14u}) EXPECT_EQ(CanonicalFloat4Scale(true, top, s), s);
  EXPECT_EQ(CanonicalFloat4Scale(true, 12u, s), s / 2);  // 8: rounded down from (10, 12)
  EXPECT_EQ(CanonicalFloat4Scale(true, 0xFu, 1.0f), 1.0f);
  // Doubling: every code of a halved block keeps its value at half the scale.
  for (uint8_t code = 0; code < 16; ++code) {
    if (code == 8 || (code & 7) > 5) continue;
    EXPECT_EQ(DecodeFloat4E2M1(DoubledFloat4Code(false, code)), 2 * DecodeFloat4E2M1(code));
  }
  for (uint8_t code = 0; code <= 12; ++code) {
    EXPECT_EQ(DecodeUFloat4E3M1(DoubledFloat4Code(true, code)), 2 * DecodeUFloat4E3M1(code));
  }
}

// Values on the grid encode to their own code whatever the bits (so decoding
// then encoding is the identity), and the edges: from 6 up the nearest code (6),
// 7 and up, inf and NaN the NaN code, zero and magnitudes below 2^-23 code 0.
TEST(StochasticRoundingTest, GridValuesAndEdgesIgnoreTheBits) {
  std::mt19937 rng(1);
  std::vector<uint32_t> bits = {0u, 0x3FFFFFu, 0x400000u, 0xFFFFFFFFu};
  for (int k = 0; k < 64; ++k) bits.push_back(rng());
  for (uint32_t r : bits) {
    for (uint8_t code = 0; code < 16; ++code) {
      if (code == 8) continue;
      ASSERT_EQ(EncodeFloat4E2M1Stochastic(DecodeFloat4E2M1(code), r), code) << r;
    }
    // From 6 up, to nearest: 6 below 7.
    for (float x : {6.0f, 6.5f, std::nextafter(7.0f, 0.0f)}) {
      EXPECT_EQ(EncodeFloat4E2M1Stochastic(x, r), 0x7) << x;
      EXPECT_EQ(EncodeFloat4E2M1Stochastic(-x, r), 0xF) << x;
    }
    // Below 6 a value between two codes stores one of them (3.5: 3 or 4).
    const uint8_t code = EncodeFloat4E2M1Stochastic(3.5f, r);
    EXPECT_TRUE(code == 5 || code == 6) << r;
    const uint8_t top = EncodeFloat4E2M1Stochastic(-std::nextafter(6.0f, 0.0f), r);
    EXPECT_TRUE(top == 0xE || top == 0xF) << r;
    EXPECT_EQ(EncodeFloat4E2M1Stochastic(-std::nextafter(7.0f, 0.0f), r), 0xF);
    EXPECT_EQ(EncodeFloat4E2M1Stochastic(7.0f, r), 0x8);
    EXPECT_EQ(EncodeFloat4E2M1Stochastic(-INFINITY, r), 0x8);
    EXPECT_EQ(EncodeFloat4E2M1Stochastic(NAN, r), 0x8);
    EXPECT_EQ(EncodeFloat4E2M1Stochastic(-0.0f, r), 0x0);
    EXPECT_EQ(EncodeFloat4E2M1Stochastic(-1e-7f, r), 0x0);
    EXPECT_EQ(EncodeFloat4E2M1Stochastic(FloatOf(1), r), 0x0);
  }
}

using F4Encoder = uint8_t (*)(float x, uint32_t random);
using F4Decoder = float (*)(uint8_t code);

// How many standard errors the mean of `n` decoded codes of x lies from x, the
// bits drawn as the core draws them (one tensor and step, indices 0..n-1). x
// lies strictly between two values of `grid` (the map's magnitudes, ascending)
// in the range rounded stochastically.
double BiasInStandardErrors(F4Encoder encode, F4Decoder decode,
                            const std::vector<double>& grid, float x, int n) {
  const double a = std::fabs(x);
  size_t k = 0;
  while (grid[k + 1] <= a) ++k;
  const double step = grid[k + 1] - grid[k];
  const double p = (a - grid[k]) / step;
  const double standard_error = step * std::sqrt(p * (1 - p) / n);
  const uint32_t key = StepKey(0xC0FFEE, 1);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    sum += decode(encode(x, RandomBits(key, static_cast<uint64_t>(i))));
  }
  return std::fabs(sum / n - x) / standard_error;
}

// Stochastic rounding is unbiased in every binade and below 1: the mean of 2^16
// codes within 5 standard errors of x. Rounding to nearest, or with the random
// bits' top bit forced, fails the same check by far.
TEST(StochasticRoundingTest, MeanOfManyCodesIsTheValue) {
  const F4Encoder stochastic = EncodeFloat4E2M1Stochastic;
  const F4Encoder nearest = [](float x, uint32_t) { return EncodeFloat4E2M1(x); };
  const F4Encoder biased = [](float x, uint32_t r) {
    return EncodeFloat4E2M1Stochastic(x, r | 0x200000u);
  };
  const std::vector<double> grid = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  constexpr int kN = 1 << 16;
  for (float x : {0.01f, 0.1f, 0.3f, 0.7f, 0.95f, 1.1f, 1.3f, 1.75f, 2.2f, 2.9f, 3.1f,
                  3.4f, 3.6f, 3.9f, 4.4f, 5.4f, 5.9f}) {
    for (float signed_x : {x, -x}) {
      const auto bias = [&](F4Encoder encode) {
        return BiasInStandardErrors(encode, DecodeFloat4E2M1, grid, signed_x, kN);
      };
      EXPECT_LT(bias(stochastic), 5.0) << signed_x;
      EXPECT_GT(bias(nearest), 5.0) << signed_x;
      EXPECT_GT(bias(biased), 5.0) << signed_x;
    }
  }
}

// The unsigned encoder at scale 1.
uint8_t UnsignedStochastic(float x, uint32_t random) {
  return EncodeUFloat4E3M1Stochastic(x, 1.0f, random);
}

// The unsigned E3M1 exp_avg_sq (S2.13): every code stores itself whatever the
// bits; from 16 up the nearest code (16), above 20, inf and NaN the NaN code; 0
// is code 0 and any other magnitude at least code 1 (zero-free); the sign is
// ignored.
TEST(StochasticRoundingTest, UnsignedGridValuesAndEdgesIgnoreTheBits) {
  std::mt19937 rng(2);
  std::vector<uint32_t> bits = {0u, 0x3FFFFFu, 0x400000u, 0xFFFFFFFFu};
  for (int k = 0; k < 64; ++k) bits.push_back(rng());
  for (uint32_t r : bits) {
    for (uint8_t code = 0; code < 15; ++code) {
      ASSERT_EQ(UnsignedStochastic(DecodeUFloat4E3M1(code), r), code) << r;
      ASSERT_EQ(UnsignedStochastic(-DecodeUFloat4E3M1(code), r), code) << r;
    }
    for (float x : {16.0f, 17.9f, 18.0f, 20.0f}) {
      EXPECT_EQ(UnsignedStochastic(x, r), 14) << x;  // 16
    }
    const uint8_t decayed = UnsignedStochastic(15.2f, r);  // 0.95 * 16: 12 or 16
    EXPECT_TRUE(decayed == 13 || decayed == 14) << r;
    EXPECT_EQ(UnsignedStochastic(std::nextafter(20.0f, 21.0f), r), 0xF);
    EXPECT_EQ(UnsignedStochastic(INFINITY, r), 0xF);
    EXPECT_EQ(UnsignedStochastic(NAN, r), 0xF);
    EXPECT_EQ(UnsignedStochastic(0.0f, r), 0);
    EXPECT_EQ(UnsignedStochastic(-0.0f, r), 0);
    EXPECT_EQ(UnsignedStochastic(FloatOf(1), r), 1);
    EXPECT_EQ(UnsignedStochastic(1e-30f, r), 1);
    EXPECT_EQ(EncodeUFloat4E3M1Stochastic(FloatOf(1), 1024.0f, r), 1);  // underflowed
    // Below 16 a value between two codes stores one of them.
    const uint8_t code = UnsignedStochastic(9.5f, r);
    EXPECT_TRUE(code == 12 || code == 13) << r;  // 8 or 12
  }
}

// Unbiased from the smallest non-zero value up to 16, where rounding to nearest
// is not: under beta2 = 0.95 a value decays in expectation, where rounded to
// nearest 0.95 * x goes back to x at every code (S2.12's reason for S2.13).
TEST(StochasticRoundingTest, UnsignedMeanOfManyCodesIsTheValue) {
  const F4Encoder stochastic = UnsignedStochastic;
  const F4Encoder nearest = [](float x, uint32_t) { return EncodeUFloat4E3M1(x); };
  const F4Encoder biased = [](float x, uint32_t r) {
    return UnsignedStochastic(x, r | 0x200000u);
  };
  const std::vector<double> grid = {0,   0.125, 0.25, 0.375, 0.5, 0.75, 1, 1.5,
                                    2,   3,     4,    6,     8,   12,   16};
  constexpr int kN = 1 << 16;
  for (float x : {0.14f, 0.2f, 0.3f, 0.45f, 0.6f, 0.95f, 1.2f, 1.9f, 2.5f, 3.3f, 5.0f,
                  7.6f, 9.5f, 10.5f, 11.4f, 13.0f, 15.2f}) {
    const auto bias = [&](F4Encoder encode) {
      return BiasInStandardErrors(encode, DecodeUFloat4E3M1, grid, x, kN);
    };
    EXPECT_LT(bias(stochastic), 5.0) << x;
    EXPECT_GT(bias(nearest), 5.0) << x;
    EXPECT_GT(bias(biased), 5.0) << x;
  }
  for (uint8_t code = 2; code < 15; ++code) {  // every decay moves, 16's too
    const float decayed = 0.95f * DecodeUFloat4E3M1(code);
    EXPECT_EQ(EncodeUFloat4E3M1(decayed), code);
    EXPECT_LT(BiasInStandardErrors(stochastic, DecodeUFloat4E3M1, grid, decayed, kN), 5.0)
        << static_cast<int>(code);
  }
}

// A stochastic 4-bit encoder of every target against the reference: the
// grid, its midpoints, the edges and random values of every binade, with
// several keys, flat indices below and above 2^32, and scales (each value in
// some combination: the key and index only reach the hash, the scale only the
// division, so their cross product adds time, not paths).
// `a`, `b`: S2.13's rule below the format's first normal value, code
// `(trunc(|x| · 2^a) + r) >> b` with b random bits.
void ExpectStochasticEncoderMatchesReference(
    DType dtype, const Format& format,
    internal::StochasticEncodeFn internal::KernelTable::*encoder,
    uint8_t (*reference)(float u, float scale, uint32_t random), int a, int b) {
  std::vector<float> inputs = InputsWithGrid(format);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (int i = 0; i < 4096; ++i) {  // every binade of the 4-bit and 8-bit maps
    inputs.push_back(std::ldexp(unit(rng), static_cast<int>(rng() % 24) - 14));
  }
  ForEachTarget([&] {
    const internal::KernelTable& kt = internal::ActiveKernels();
    std::vector<float> x = inputs;
    const size_t n = (x.size() + kt.pair - 1) / kt.pair * kt.pair;
    x.resize(n, 0.0f);
    std::vector<uint8_t> codes(static_cast<size_t>(BufferBytes(dtype, n)));
    const struct {
      float scale;
      uint32_t key;
      uint64_t index;
    } runs[] = {{1.0f, 0u, 0},
                {0.125f, 0x5EEDu, 4096},
                {1024.0f, 0x9E3779B9u, (uint64_t{3} << 32) + 8192},
                {1.0f, 0x5EEDu, (uint64_t{3} << 32) + 8192}};
    for (auto run : runs) {
      SCOPED_TRACE("scale " + std::to_string(run.scale) + " key " + std::to_string(run.key) +
                   " index " + std::to_string(run.index));
      const internal::ScaleView view{&run.scale, 0, 0};
      (kt.*encoder)(x.data(), n, view, {run.key, static_cast<int64_t>(run.index)},
                    codes.data());
      for (size_t i = 0; i < n; ++i) {
        const uint8_t want = reference(x[i], run.scale, RandomBits(run.key, run.index + i));
        ASSERT_EQ(ref::CodeAt(codes.data(), dtype, static_cast<int64_t>(i)), want)
            << "fp32 0x" << std::hex << BitsOf(x[i]);
      }
      // Below the first normal value, each lane's |x| · 2^a is t + 0.5 where its
      // random bits r carry t + r to the next code only if t is rounded up: an
      // encoder that rounds instead of truncating differs in every lane (random
      // inputs meet such a value about once in 2^b).
      std::vector<float> edge(n);
      for (size_t i = 0; i < n; ++i) {
        const uint32_t r = RandomBits(run.key, run.index + i) & ((1u << b) - 1);
        const uint32_t t = (2u << b) - 1 - r;  // t + r = 2^(b+1) - 1: code 1, not 2
        edge[i] = std::ldexp(static_cast<float>(t) + 0.5f, -a) * run.scale *
                  (i % 2 ? -1.0f : 1.0f);
      }
      (kt.*encoder)(edge.data(), n, view, {run.key, static_cast<int64_t>(run.index)},
                    codes.data());
      for (size_t i = 0; i < n; ++i) {
        const uint8_t want =
            reference(edge[i], run.scale, RandomBits(run.key, run.index + i));
        ASSERT_EQ(ref::CodeAt(codes.data(), dtype, static_cast<int64_t>(i)), want)
            << "fp32 0x" << std::hex << BitsOf(edge[i]);
      }
    }
  });
}

TEST(SimdCodecTest, StochasticE2M1MatchesReference) {
  ExpectStochasticEncoderMatchesReference(DType::kFloat4E2M1Block, kFloat4Format,
                                          &internal::KernelTable::encode_f4_stochastic,
                                          [](float u, float scale, uint32_t random) {
                                            return EncodeFloat4E2M1Stochastic(u / scale, random);
                                          },
                                          23, 22);
}

TEST(SimdCodecTest, StochasticUnsignedE3M1MatchesReference) {
  ExpectStochasticEncoderMatchesReference(DType::kUFloat4E3M1Block, kUFloat4Format,
                                          &internal::KernelTable::encode_uf4_stochastic,
                                          EncodeUFloat4E3M1Stochastic, 25, 22);
}

TEST(SimdCodecTest, StochasticUnsignedE4M4MatchesReference) {
  ExpectStochasticEncoderMatchesReference(DType::kUFloat8E4M4Block, kUFloat8Format,
                                          &internal::KernelTable::encode_uf8_stochastic,
                                          EncodeUFloat8E4M4Stochastic, 29, 19);
}

// The unsigned E4M4 encoder at scale 1, rounded stochastically.
uint8_t UnsignedE4M4Stochastic(float x, uint32_t random) {
  return EncodeUFloat8E4M4Stochastic(x, 1.0f, random);
}

// Block8's exp_avg_sq (S2.13): every code stores itself whatever the bits; from
// 480 up the nearest code (480), above 488, inf and NaN the NaN code; 0 is code
// 0 and any other magnitude at least code 1 (zero-free); the sign is ignored.
TEST(StochasticRoundingTest, UnsignedE4M4GridValuesAndEdgesIgnoreTheBits) {
  std::mt19937 rng(3);
  std::vector<uint32_t> bits = {0u, 0x7FFFFu, 0x80000u, 0xFFFFFFFFu};
  for (int k = 0; k < 64; ++k) bits.push_back(rng());
  for (uint32_t r : bits) {
    for (int code = 0; code < 0xFF; ++code) {
      const float x = DecodeUFloat8E4M4(static_cast<uint8_t>(code));
      ASSERT_EQ(UnsignedE4M4Stochastic(x, r), code) << r;
      ASSERT_EQ(UnsignedE4M4Stochastic(-x, r), code) << r;
    }
    for (float x : {std::nextafter(480.0f, 481.0f), 484.0f, 488.0f}) {
      EXPECT_EQ(UnsignedE4M4Stochastic(x, r), 0xFE) << x;  // 480
    }
    EXPECT_EQ(UnsignedE4M4Stochastic(std::nextafter(488.0f, 489.0f), r), 0xFF);
    EXPECT_EQ(UnsignedE4M4Stochastic(INFINITY, r), 0xFF);
    EXPECT_EQ(UnsignedE4M4Stochastic(NAN, r), 0xFF);
    EXPECT_EQ(UnsignedE4M4Stochastic(-0.0f, r), 0);
    EXPECT_EQ(UnsignedE4M4Stochastic(FloatOf(1), r), 1);
    EXPECT_EQ(EncodeUFloat8E4M4Stochastic(FloatOf(1), 1024.0f, r), 1);  // underflowed
    // Below 480 a value between two codes stores one of them.
    const uint8_t top = UnsignedE4M4Stochastic(470.0f, r);  // 464 or 480
    EXPECT_TRUE(top == 0xFD || top == 0xFE) << r;
    const uint8_t low = UnsignedE4M4Stochastic(0.0015f, r);  // 1 or 2 units of 2^-10
    EXPECT_TRUE(low == 1 || low == 2) << r;
  }
}

// Unbiased from the smallest non-zero value up to 480, where rounding to
// nearest is not: under beta2 = 0.999 a value decays in expectation, where
// rounded to nearest 0.999 * x goes back to x at every code (S2.10's limit,
// the reason S2.13 rounds it stochastically).
TEST(StochasticRoundingTest, UnsignedE4M4MeanOfManyCodesIsTheValue) {
  const F4Encoder stochastic = UnsignedE4M4Stochastic;
  const F4Encoder nearest = [](float x, uint32_t) { return EncodeUFloat8E4M4(x); };
  const F4Encoder biased = [](float x, uint32_t r) {
    return UnsignedE4M4Stochastic(x, r | 0x40000u);
  };
  std::vector<double> grid;
  for (int code = 0; code < 0xFF; ++code) {
    grid.push_back(DecodeUFloat8E4M4(static_cast<uint8_t>(code)));
  }
  constexpr int kN = 1 << 16;
  for (float x : {0.0013f, 0.007f, 0.02f, 0.3f, 1.01f, 3.3f, 77.7f, 250.0f, 470.0f}) {
    const auto bias = [&](F4Encoder encode) {
      return BiasInStandardErrors(encode, DecodeUFloat8E4M4, grid, x, kN);
    };
    EXPECT_LT(bias(stochastic), 5.0) << x;
    EXPECT_GT(bias(nearest), 5.0) << x;
    EXPECT_GT(bias(biased), 5.0) << x;
  }
  for (int code = 2; code < 0xFF; code += 7) {  // every decay moves, 480's too
    const float decayed = 0.999f * DecodeUFloat8E4M4(static_cast<uint8_t>(code));
    EXPECT_EQ(EncodeUFloat8E4M4(decayed), code);
    EXPECT_LT(BiasInStandardErrors(stochastic, DecodeUFloat8E4M4, grid, decayed, kN), 5.0)
        << code;
  }
}

// S2.13's canonical E4M4 block: a largest element rounded down to 240 or below
// (from (244, 248)) takes half the scale; every code of the block doubled keeps
// its value at half the scale.
TEST(StochasticRoundingTest, CanonicalScaleOfStochasticE4M4Blocks) {
  const float s = 0x1p-3f;
  for (uint32_t top : {0xEFu, 0xF0u, 0xFEu}) EXPECT_EQ(CanonicalUFloat8Scale(top, s), s);
  EXPECT_EQ(CanonicalUFloat8Scale(0xEEu, s), s / 2);  // 240
  EXPECT_EQ(CanonicalUFloat8Scale(0xFFu, 1.0f), 1.0f);  // a NaN code
  EXPECT_EQ(CanonicalUFloat8Scale(0xEEu, 0x1p-126f), 0x1p-126f);  // the smallest scale
  EXPECT_EQ(KeepsScaleRank(DType::kUFloat8E4M4Block), 0xEFu);
  EXPECT_EQ(KeepsScaleValue(DType::kUFloat8E4M4Block), 248.0f);
  EXPECT_EQ(KeepsScaleValue(DType::kUFloat4E3M1Block), 12.0f);
  EXPECT_EQ(KeepsScaleValue(DType::kFloat4E2M1Block), 4.0f);
  for (int code = 0; code <= 0xEE; ++code) {
    const auto c = static_cast<uint8_t>(code);
    EXPECT_EQ(DecodeUFloat8E4M4(DoubledUFloat8Code(c)), 2 * DecodeUFloat8E4M4(c)) << code;
    EXPECT_EQ(DoubledBlockCode(DType::kUFloat8E4M4Block, c), DoubledUFloat8Code(c));
  }
}

// S2.14: a bf16 param rounded stochastically. The param stream's key is
// pinned, and differs from exp_avg's for the same tensor and step.
TEST(Bf16StochasticTest, ParamKeyIsPinned) {
  const uint32_t key = ParamStepKey(0x5EED, 3);
  EXPECT_EQ(key, 0x14BB4865u);
  EXPECT_NE(key, StepKey(0x5EED, 3));
  EXPECT_EQ(ParamStepKey(0x5EED, 3 + (int64_t{1} << 32)), key);
  EXPECT_EQ(RandomBits(key, (uint64_t{5} << 32) + 17), 0xF0507104u);
}

// exp_avg_sq's stream (S2.13): drawn from the step's key like the param's, with
// another constant, so the three streams of one tensor and step differ.
TEST(StochasticRoundingTest, SquareKeyIsItsOwnStream) {
  const uint32_t key = SquareStepKey(0x5EED, 3);
  EXPECT_EQ(key, Mix32(StepKey(0x5EED, 3) ^ 0x2545F491u));
  EXPECT_NE(key, StepKey(0x5EED, 3));
  EXPECT_NE(key, ParamStepKey(0x5EED, 3));
  EXPECT_EQ(SquareStepKey(0x5EED, 3 + (int64_t{1} << 32)), key);
}

// Every bf16 value stores itself whatever the bits (a checkpoint's params
// come back as they were); every other fp32 value stores one of the two bf16
// values around it, the lower with the bits' high half 0, the upper with it
// all ones; NaN stays NaN as rounding to nearest stores it.
TEST(Bf16StochasticTest, StoresTheValuesAroundX) {
  std::mt19937 rng(11);
  std::vector<uint32_t> bits = {0u, 0xFFFFu, 0x10000u, 0xFFFFFFFFu};
  for (int k = 0; k < 16; ++k) bits.push_back(rng());
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float x = ref::BFloat16ToFloat(static_cast<uint16_t>(h));
    for (uint32_t r : bits) {
      ASSERT_EQ(EncodeBF16Stochastic(x, r), std::isnan(x) ? ref::FloatToBFloat16(x) : h)
          << std::hex << h << " " << r;
    }
  }
  for (int k = 0; k < 100000; ++k) {
    const uint32_t x_bits = rng();
    const float x = FloatOf(x_bits);
    if (std::isnan(x)) {
      ASSERT_EQ(EncodeBF16Stochastic(x, rng()), ref::FloatToBFloat16(x));
      continue;
    }
    const uint32_t down = x_bits >> 16;
    const uint32_t up = down + ((x_bits & 0xFFFFu) != 0 ? 1u : 0u);
    ASSERT_EQ(EncodeBF16Stochastic(x, 0u), down) << std::hex << x_bits;
    ASSERT_EQ(EncodeBF16Stochastic(x, 0xFFFF0000u), up) << std::hex << x_bits;
    const uint16_t got = EncodeBF16Stochastic(x, rng());
    ASSERT_TRUE(got == down || got == up) << std::hex << x_bits;
  }
  // Past the largest bf16 a magnitude may round to inf, as to nearest; inf stays.
  EXPECT_EQ(EncodeBF16Stochastic(FLT_MAX, 0xFFFF0000u), 0x7F80u);
  EXPECT_EQ(EncodeBF16Stochastic(-FLT_MAX, 0u), 0xFF7Fu);
  EXPECT_EQ(EncodeBF16Stochastic(-INFINITY, 0xFFFFFFFFu), 0xFF80u);
}

// Unbiased in normal and subnormal binades, both signs: the mean of 2^16
// stored values, the bits drawn as the core draws them, within 5 standard
// errors of x. Rounding to nearest fails the same check by far.
TEST(Bf16StochasticTest, MeanOfManyValuesIsTheValue) {
  constexpr int kN = 1 << 16;
  const uint32_t key = ParamStepKey(0xC0FFEE, 1);
  for (float x : {1.001f, 1.0039f, 3.14159f, -0.7071f, 1e-3f, 6.1e5f, -2.5e-39f}) {
    const uint32_t low = BitsOf(x) & 0xFFFF0000u;
    const double lo = FloatOf(low), hi = FloatOf(low + 0x10000u);
    const double p = (x - lo) / (hi - lo);
    const double standard_error = std::fabs(hi - lo) * std::sqrt(p * (1 - p) / kN);
    double stochastic = 0, nearest = 0;
    for (int i = 0; i < kN; ++i) {
      const uint32_t r = RandomBits(key, static_cast<uint64_t>(i));
      stochastic += ref::BFloat16ToFloat(EncodeBF16Stochastic(x, r));
      nearest += ref::BFloat16ToFloat(ref::FloatToBFloat16(x));
    }
    EXPECT_LT(std::fabs(stochastic / kN - x), 5 * standard_error) << x;
    EXPECT_GT(std::fabs(nearest / kN - x), 5 * standard_error) << x;
  }
}

// The SIMD encoder of every target against the rule: every binade, the
// specials, keys, and runs whose flat indices cross a multiple of 2^32 inside
// a vector.
TEST(SimdCodecTest, StochasticBF16MatchesReference) {
  std::vector<float> inputs = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, FLT_MAX, -FLT_MAX,
                               FLT_MIN, FloatOf(1), FloatOf(0x7FC00001u),
                               FloatOf(0xFF800001u), FloatOf(0x7F7FFFFFu)};
  std::mt19937 rng(9);
  while (inputs.size() < 4096) inputs.push_back(FloatOf(rng()));
  ForEachTarget([&] {
    const internal::KernelTable& kt = internal::ActiveKernels();
    std::vector<float> x = inputs;
    const size_t n = (x.size() + kt.pair - 1) / kt.pair * kt.pair;
    x.resize(n, 0.5f);
    std::vector<uint16_t> out(n);
    for (uint32_t key : {0u, 0x5EEDu, 0x9E3779B9u}) {
      for (uint64_t index : {uint64_t{0}, uint64_t{4097}, (uint64_t{1} << 32) - 7,
                             (uint64_t{3} << 32) - 1000, (uint64_t{3} << 32) + 8192}) {
        SCOPED_TRACE("key " + std::to_string(key) + " index " + std::to_string(index));
        kt.encode_bf16_stochastic(x.data(), n, internal::ScaleView(),
                                  {key, static_cast<int64_t>(index)}, out.data());
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(out[i], EncodeBF16Stochastic(x[i], RandomBits(key, index + i)))
              << i << ": fp32 0x" << std::hex << BitsOf(x[i]);
        }
      }
    }
  });
}

// The compiler's IEEE half type: _Float16, or on AArch64 the ACLE's __fp16
// (GCC's C++ has no _Float16 there before GCC 13).
#if defined(__aarch64__) && defined(__ARM_FP16_FORMAT_IEEE)
using CompilerF16 = __fp16;
#define SHARDADAM_HAVE_COMPILER_F16 1
#elif defined(__FLT16_MAX__)
using CompilerF16 = _Float16;
#define SHARDADAM_HAVE_COMPILER_F16 1
#endif

#if defined(SHARDADAM_HAVE_COMPILER_F16)
// A second, independent fp16 oracle: the compiler's own conversion.
TEST(ReferenceCodecTest, Float16MatchesCompilerConversion) {
  for (float x : NarrowingInputs()) {
    const auto h = static_cast<CompilerF16>(x);
    uint16_t want;
    std::memcpy(&want, &h, sizeof(want));
    const uint16_t got = ref::FloatToFloat16(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(IsNaNCode(kFloat16Format, got));
    } else {
      ASSERT_EQ(got, want) << "fp32 0x" << std::hex << BitsOf(x);
    }
  }
}

// And for widening, bitwise on every code: a NaN keeps its payload, made quiet.
TEST(ReferenceCodecTest, Float16WideningMatchesCompilerConversion) {
  for (uint32_t code = 0; code <= 0xFFFF; ++code) {
    const uint16_t bits = static_cast<uint16_t>(code);
    CompilerF16 h;
    std::memcpy(&h, &bits, sizeof(h));
    ASSERT_EQ(BitsOf(ref::Float16ToFloat(bits)), BitsOf(static_cast<float>(h)))
        << "fp16 0x" << std::hex << code;
  }
}
#endif

// Values whose torch `.to(torch.float8_e4m3fn)` codes are known (up to torch 2.12;
// later torch saturates, S2.4 does not): past the 448/480 midpoint is NaN, sign kept.
TEST(ReferenceCodecTest, Float8EdgeCasesMatchTorch) {
  const struct {
    float x;
    uint8_t code;
  } cases[] = {
      {0.0f, 0x00},
      {-0.0f, 0x80},
      {1.0f, 0x38},
      {-2.0f, 0xC0},
      {240.0f, 0x77},
      {448.0f, 0x7E},
      {-448.0f, 0xFE},
      {464.0f, 0x7E},
      {std::nextafter(464.0f, 0.0f), 0x7E},
      {std::nextafter(464.0f, INFINITY), 0x7F},
      {480.0f, 0x7F},
      {-500.0f, 0xFF},
      {INFINITY, 0x7F},
      {-INFINITY, 0xFF},
      {NAN, 0x7F},
      {-NAN, 0xFF},
      {std::ldexp(1.0f, -9), 0x01},
      {std::ldexp(1.0f, -10), 0x00},
      {std::ldexp(3.0f, -10), 0x02},
      {std::ldexp(5.0f, -10), 0x02},
      {std::ldexp(15.0f, -10), 0x08},
      {std::ldexp(1.0f, -6), 0x08},
      {1.0625f, 0x38},
      {1.1875f, 0x3A},
      {FLT_TRUE_MIN, 0x00},
      {-FLT_TRUE_MIN, 0x80},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(ref::FloatToFloat8E4M3(c.x), c.code) << c.x;
  }
}

// S2.5 over fp32 patterns: lossless, and the param half is the high 16 bits
// rounded half away from zero in magnitude (plus one when the low half >=
// 0x8000).
TEST(ReferenceCodecTest, RemainderSplitMergeIsLossless) {
  std::vector<uint32_t> patterns;
  for (uint32_t high : {0x0000u, 0x0001u, 0x3F80u, 0x7F7Fu, 0x7F80u, 0x7FFFu,
                        0x8000u, 0xBF80u, 0xFF7Fu, 0xFFFFu}) {
    for (uint32_t low :
         {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) {
      patterns.push_back(high << 16 | low);
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < (1 << 20); ++i) patterns.push_back(rng());
  for (uint32_t bits : patterns) {
    uint16_t param;
    int16_t remainder;
    ref::SplitMaster(FloatOf(bits), &param, &remainder);
    const uint16_t low = static_cast<uint16_t>(remainder);
    // A NaN master is split as the quiet NaN with its sign (S2.5).
    const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    const uint32_t split = nan ? (bits & 0x80000000u) | 0x7FC00000u : bits;
    ASSERT_EQ(low, split & 0xFFFF) << std::hex << bits;
    ASSERT_EQ(param, static_cast<uint16_t>((split >> 16) + (low >= 0x8000 ? 1 : 0)))
        << std::hex << bits;
    ASSERT_EQ(BitsOf(ref::MergeMaster(param, remainder)), split) << std::hex << bits;
    ASSERT_EQ(std::isnan(ref::BFloat16ToFloat(param)), nan) << std::hex << bits;
  }
}

// Every target's remainder stores split NaN masters as the reference does, also
// where their payloads would carry the param's rounding into the sign (the
// all-ones NaN a GPU produces, S2.5). Starting from such splits, an lr = 0 step
// leaves each master as it was, so the stores see these exact bits.
TEST(SimdRemainderTest, NaNMasterKeepsTheParamNaN) {
  std::vector<uint32_t> masters;
  for (uint32_t high : {0x7F80u, 0x7FBFu, 0x7FC0u, 0x7FFFu}) {
    for (uint32_t low : {0x0001u, 0x7FFFu, 0x8000u, 0xFFFFu}) {
      masters.push_back(high << 16 | low);
      masters.push_back(0x80000000u | high << 16 | low);
    }
  }
  const int64_t n = static_cast<int64_t>(masters.size());
  // Raw (param, remainder) pairs that merge to these masters, some of them the
  // wrapped splits (param 0x8000 / 0x0000, remainder -1) that an unguarded
  // split leaves.
  std::vector<uint16_t> param(n);
  std::vector<int16_t> remainder(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = masters[i];
    remainder[i] = static_cast<int16_t>(bits & 0xFFFF);
    param[i] = static_cast<uint16_t>((bits >> 16) + ((bits & 0x8000u) ? 1 : 0));
    ASSERT_EQ(BitsOf(ref::MergeMaster(param[i], remainder[i])), bits);
  }
  StepParams params;
  params.lr = 0.0;
  params.weight_decay = 0.0;
  // Grad and moment dtypes select the kernel: fp32 / fp32 and bf16 / bf16 (the
  // even/odd one) are fused, an fp16 grad takes the block path.
  const DType layouts[3][2] = {{DType::kFloat32, DType::kFloat32},
                               {DType::kBFloat16, DType::kBFloat16},
                               {DType::kFloat16, DType::kFloat32}};
  for (const auto& layout : layouts) {
    ForEachTarget([&] {
      std::vector<uint16_t> p = param;
      std::vector<int16_t> r = remainder;
      std::vector<float> grad(n, 0.0f), m(n, 0.0f), v(n, 0.0f);  // zeros in any dtype
      TensorSlot slot;
      slot.numel = n;
      slot.param = p.data();
      slot.param_dtype = DType::kBFloat16;
      slot.grad = grad.data();
      slot.grad_dtype = layout[0];
      slot.exp_avg = m.data();
      slot.exp_avg_dtype = layout[1];
      slot.exp_avg_sq = v.data();
      slot.exp_avg_sq_dtype = layout[1];
      slot.master_param = r.data();
      slot.master_dtype = DType::kInt16Remainder;
      Error error;
      ASSERT_EQ(AdamStep(&slot, 1, params, 2, &error), Status::kOk) << error.message;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t want_param;
        int16_t want_remainder;
        ref::SplitMaster(FloatOf(masters[i]), &want_param, &want_remainder);
        ASSERT_EQ(p[i], want_param) << std::hex << masters[i];
        ASSERT_EQ(r[i], want_remainder) << std::hex << masters[i];
        ASSERT_TRUE(std::isnan(ref::BFloat16ToFloat(p[i]))) << std::hex << masters[i];
      }
    });
  }
}

TEST(ReferenceScaleTest, FollowsS23) {
  const float zeros[3] = {0.0f, -0.0f, 0.0f};
  const float with_nan[3] = {1.0f, NAN, 2.0f};
  const float with_inf[2] = {-INFINITY, 2.0f};
  const float tiny[2] = {1e-40f, -3e-41f};
  const float mixed[3] = {3.0f, -896.0f, 0.5f};
  const float half_target[1] = {16376.0f};
  EXPECT_EQ(ref::MeasureScale(mixed, 0, DType::kFloat16), 1.0f);
  EXPECT_EQ(ref::MeasureScale(zeros, 3, DType::kFloat8E4M3), 1.0f);
  EXPECT_EQ(ref::MeasureScale(with_nan, 3, DType::kFloat16), 1.0f);
  EXPECT_EQ(ref::MeasureScale(with_inf, 2, DType::kFloat8E4M3), 1.0f);
  EXPECT_EQ(ref::MeasureScale(tiny, 2, DType::kFloat16), FLT_MIN);
  EXPECT_EQ(ref::MeasureScale(mixed, 3, DType::kFloat8E4M3), 2.0f);
  EXPECT_EQ(ref::MeasureScale(mixed, 3, DType::kFloat16), 896.0f / 32752.0f);
  EXPECT_EQ(ref::MeasureScale(half_target, 1, DType::kFloat16), 0.5f);
  EXPECT_EQ(ref::MeasureScale(mixed, 3, DType::kBFloat16), 1.0f);
  EXPECT_EQ(ref::MeasureScale(mixed, 3, DType::kFloat32), 1.0f);
}

// ---------------------------------------------------------------------------
// SIMD codecs against the reference, on every target.

// A typed buffer of `numel` elements holding `values` narrowed by the
// reference.
std::vector<uint8_t> EncodeAll(const std::vector<float>& values, DType dtype,
                               float scale) {
  std::vector<uint8_t> out(BufferBytes(dtype, static_cast<int64_t>(values.size())));
  EXPECT_EQ(ref::Convert(values.data(), DType::kFloat32, out.data(), dtype,
                         static_cast<int64_t>(values.size()), scale),
            Status::kOk);
  return out;
}

// One conversion's input and the reference's output for it.
struct ConvertCase {
  const void* src;
  DType src_dtype;
  DType dst_dtype;
  int64_t numel;
  float scale;
  std::vector<uint8_t> want;
};

ConvertCase ReferenceConvert(const void* src, DType src_dtype, DType dst_dtype,
                             int64_t numel, float scale) {
  ConvertCase c{src, src_dtype, dst_dtype, numel, scale, {}};
  c.want.resize(static_cast<size_t>(BufferBytes(dst_dtype, numel)));
  EXPECT_EQ(
      ref::Convert(src, src_dtype, c.want.data(), dst_dtype, numel, scale),
      Status::kOk);
  return c;
}

// Runs the SIMD Convert on `c` and compares with the reference's output; also
// checks that nothing is written past the end.
void ExpectSimdConvert(const ConvertCase& c, int threads) {
  const size_t bytes = c.want.size();
  std::vector<uint8_t> got(bytes + 1, 0xA5);
  Error error;
  ASSERT_EQ(Convert(c.src, c.src_dtype, got.data(), c.dst_dtype, c.numel,
                    c.scale, threads, &error),
            Status::kOk)
      << error.message;
  EXPECT_TRUE(SameElements(c.want.data(), got.data(), c.dst_dtype, c.numel))
      << DTypeName(c.src_dtype) << " -> " << DTypeName(c.dst_dtype) << " scale "
      << c.scale << " numel " << c.numel << " threads " << threads;
  // E4M3 has exactly two NaN codes and torch keeps the sign (S2.4), and an
  // fp16 NaN widens with its payload, made quiet: there the comparison is
  // strictly bitwise. (Not bf16: the core widens a signalling NaN as it is,
  // and whether the reference's scaling by 1 quiets it is up to the compiler.)
  const bool widens_f16 =
      c.src_dtype == DType::kFloat16 && c.dst_dtype == DType::kFloat32;
  const bool strict = c.dst_dtype == DType::kFloat8E4M3 || widens_f16;
  if (strict && bytes > 0) {  // empty: want.data() may be null
    EXPECT_EQ(std::memcmp(c.want.data(), got.data(), bytes), 0)
        << DTypeName(c.src_dtype) << " -> " << DTypeName(c.dst_dtype)
        << ": NaN codes differ in sign or payload";
  }
  EXPECT_EQ(got[bytes], 0xA5) << "wrote past the end";
}

TEST(SimdConvertTest, WidensEveryCodeAndNarrowsBack) {
  for (const Format& f : kFormats) {
    const uint32_t count = 2 * f.sign_bit;
    std::vector<uint8_t> codes(BufferBytes(f.dtype, count));
    for (uint32_t c = 0; c < count; ++c) {
      if (f.dtype == DType::kFloat8E4M3) {
        codes[c] = static_cast<uint8_t>(c);
      } else {
        const uint16_t h = static_cast<uint16_t>(c);
        std::memcpy(&codes[2 * c], &h, 2);
      }
    }
    std::vector<float> widened(count);
    for (uint32_t c = 0; c < count; ++c) widened[c] = Decode(f, c);
    const ConvertCase widen =
        ReferenceConvert(codes.data(), f.dtype, DType::kFloat32, count, 1.0f);
    ForEachTarget([&] {
      SCOPED_TRACE(DTypeName(f.dtype));
      ExpectSimdConvert(widen, 2);
      // Narrowing the widened values restores every non-NaN code (NaN stays
      // NaN).
      std::vector<uint8_t> back(codes.size());
      Error error;
      ASSERT_EQ(Convert(widened.data(), DType::kFloat32, back.data(), f.dtype,
                        count, 1.0f, 1, &error),
                Status::kOk)
          << error.message;
      EXPECT_TRUE(SameElements(codes.data(), back.data(), f.dtype, count));
    });
  }
}

TEST(SimdConvertTest, NarrowingMatchesReference) {
  const std::vector<float>& inputs = NarrowingInputs();
  const int64_t n = static_cast<int64_t>(inputs.size());
  std::vector<ConvertCase> cases;
  for (DType dst : {DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3}) {
    // Scales only apply to fp16/fp8 destinations; a tiny one drives values into
    // overflow, an awkward one makes the division inexact.
    for (float scale : {1.0f, 0.37f, 3.0e-30f, 12345.678f}) {
      cases.push_back(
          ReferenceConvert(inputs.data(), DType::kFloat32, dst, n, scale));
      if (dst == DType::kBFloat16) break;
    }
  }
  std::vector<ConvertCase> short_cases;  // short, unaligned runs: vector tails
  for (DType dst : {DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3}) {
    for (int64_t offset : {1, 3}) {
      for (int64_t len : {0, 1, 7, 15, 16, 17, 31, 33, 63, 65}) {
        short_cases.push_back(ReferenceConvert(
            inputs.data() + 1000 + offset, DType::kFloat32, dst, len, 0.37f));
      }
    }
  }
  ForEachTarget([&] {
    for (const ConvertCase& c : cases) ExpectSimdConvert(c, 2);
    for (const ConvertCase& c : short_cases) ExpectSimdConvert(c, 1);
  });
}

TEST(SimdConvertTest, EveryDTypePairMatchesReference) {
  const std::vector<float>& all = NarrowingInputs();
  // A slice holding ties, specials and random values alike.
  std::vector<float> values;
  for (size_t i = 0; i < all.size(); i += 7) values.push_back(all[i]);
  const int64_t n = static_cast<int64_t>(values.size());
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                          DType::kFloat8E4M3};
  std::vector<std::vector<uint8_t>> sources;
  std::vector<ConvertCase> cases;
  sources.reserve(2 * 4);
  for (DType src : dtypes) {
    for (float scale : {1.0f, 0.37f}) {
      sources.push_back(EncodeAll(values, src, scale));
      for (DType dst : dtypes) {
        cases.push_back(
            ReferenceConvert(sources.back().data(), src, dst, n, scale));
        cases.push_back(
            ReferenceConvert(sources.back().data(), src, dst, 33, scale));
      }
    }
  }
  ForEachTarget([&] {
    for (const ConvertCase& c : cases) {
      ExpectSimdConvert(c, c.numel > 100 ? 3 : 1);
    }
  });
}

// Between dtypes of one size the conversion may run in place (the caller
// converts a buffer it owns); the result must equal the out-of-place one.
TEST(SimdConvertTest, InPlaceMatchesReference) {
  const std::vector<float>& all = NarrowingInputs();
  const std::vector<float> values(all.begin() + 5000,
                                  all.begin() + 5000 + 1033);
  const int64_t n = static_cast<int64_t>(values.size());
  const struct {
    DType src, dst;
    float scale;
  } pairs[] = {{DType::kBFloat16, DType::kFloat16, 1.0f},
               {DType::kFloat16, DType::kBFloat16, 0.37f},
               {DType::kFloat16, DType::kFloat16, 0.37f},
               {DType::kFloat8E4M3, DType::kFloat8E4M3, 3.0f},
               {DType::kFloat32, DType::kFloat32, 1.0f}};
  for (const auto& pair : pairs) {
    const std::vector<uint8_t> source = EncodeAll(values, pair.src, pair.scale);
    const ConvertCase want =
        ReferenceConvert(source.data(), pair.src, pair.dst, n, pair.scale);
    ForEachTarget([&] {
      std::vector<uint8_t> buffer = source;
      Error error;
      ASSERT_EQ(Convert(buffer.data(), pair.src, buffer.data(), pair.dst, n,
                        pair.scale, 2, &error),
                Status::kOk)
          << error.message;
      EXPECT_TRUE(SameElements(want.want.data(), buffer.data(), pair.dst, n))
          << DTypeName(pair.src) << " -> " << DTypeName(pair.dst);
    });
  }
}

// Every rejected Convert returns kInvalidArgument with a message and writes
// nothing.
TEST(SimdConvertTest, RejectsBadCallsWithoutWriting) {
  const DType unknown = static_cast<DType>(99);
  std::vector<uint8_t> memory(64, 0x5A);
  uint8_t* const a = memory.data();
  uint8_t* const b = memory.data() + 32;
  const struct {
    const char* name;
    const void* src;
    DType src_dtype;
    void* dst;
    DType dst_dtype;
    int64_t numel;
    float scale;
  } cases[] = {
      {"dst remainder", a, DType::kFloat32, b, DType::kInt16Remainder, 4, 1.0f},
      {"dst none", a, DType::kFloat32, b, DType::kNone, 4, 1.0f},
      {"src remainder", a, DType::kInt16Remainder, b, DType::kFloat32, 4, 1.0f},
      {"src unknown", a, unknown, b, DType::kFloat32, 4, 1.0f},
      {"negative numel", a, DType::kFloat32, b, DType::kBFloat16, -1, 1.0f},
      {"null src", nullptr, DType::kFloat32, b, DType::kBFloat16, 4, 1.0f},
      {"null dst", a, DType::kFloat32, nullptr, DType::kBFloat16, 4, 1.0f},
      {"zero scale", a, DType::kFloat32, b, DType::kFloat16, 4, 0.0f},
      {"nan scale", a, DType::kFloat8E4M3, b, DType::kFloat32, 4, NAN},
      {"negative scale", a, DType::kFloat32, b, DType::kFloat8E4M3, 4, -2.0f},
      {"overlap", a, DType::kFloat32, a + 2, DType::kBFloat16, 4, 1.0f},
      {"in place, sizes differ", a, DType::kFloat32, a, DType::kBFloat16, 4,
       1.0f},
  };
  ForEachTarget([&] {
    for (const auto& c : cases) {
      Error error;
      EXPECT_EQ(Convert(c.src, c.src_dtype, c.dst, c.dst_dtype, c.numel,
                        c.scale, 1, &error),
                Status::kInvalidArgument)
          << c.name;
      EXPECT_FALSE(error.message.empty()) << c.name;
      EXPECT_EQ(memory, std::vector<uint8_t>(64, 0x5A)) << c.name;
    }
  });
}

TEST(SimdMeasureScaleTest, MatchesReference) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<std::vector<float>> cases;
  // 300007: several chunks per work item on one thread (ItemElements).
  for (int64_t n : {0, 1, 7, 8, 15, 16, 17, 33, 65, 1000, 100003, 300007}) {
    std::vector<float> u(n);
    for (float& x : u) x = normal(rng);
    cases.push_back(u);
    if (n == 0) continue;
    // The largest magnitude at each end and in the middle (tails and lanes).
    for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
      std::vector<float> peak = u;
      peak[at] = -1e4f;
      cases.push_back(peak);
      std::vector<float> bad = u;
      bad[at] = NAN;
      cases.push_back(bad);
      bad[at] = -INFINITY;
      cases.push_back(bad);
    }
    cases.push_back(std::vector<float>(n, 0.0f));
    cases.push_back(std::vector<float>(n, -1e-41f));  // scale clamps to FLT_MIN
    cases.push_back(std::vector<float>(n, FLT_MAX));
  }
  ForEachTarget([&] {
    for (const std::vector<float>& u : cases) {
      const int64_t n = static_cast<int64_t>(u.size());
      for (DType dtype : {DType::kFloat16, DType::kFloat8E4M3, DType::kBFloat16,
                          DType::kFloat32}) {
        const float want = ref::MeasureScale(u.data(), n, dtype);
        for (int threads : {1, 2, 3}) {
          EXPECT_EQ(BitsOf(MeasureScale(u.data(), n, dtype, threads)),
                    BitsOf(want))
              << DTypeName(dtype) << " numel " << n << " threads " << threads;
        }
      }
    }
  });
}

// The SIMD remainder split/merge is reached through AdamStep: with lr = 0, zero
// weight decay, zero gradient and zero moments the update is w - 0, so a step
// must give back the very param/remainder pair it read, for every finite
// master.
TEST(SimdRemainderTest, StepWithZeroLrRestoresMasterBitwise) {
  std::vector<uint32_t> masters;
  std::mt19937 rng(5);
  for (int i = 0; i < (1 << 18); ++i) {
    const uint32_t bits = rng();
    if ((bits & 0x7F800000) != 0x7F800000) masters.push_back(bits);
  }
  for (uint32_t low : {0x0000u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) {
    for (uint32_t high :
         {0x0000u, 0x3F80u, 0x7F7Fu, 0x8000u, 0xBF80u, 0xFF7Fu}) {
      masters.push_back(high << 16 | low);
    }
  }
  const int64_t n = static_cast<int64_t>(masters.size());
  std::vector<uint16_t> param(n);
  std::vector<int16_t> remainder(n);
  for (int64_t i = 0; i < n; ++i) {
    ref::SplitMaster(FloatOf(masters[i]), &param[i], &remainder[i]);
  }
  const std::vector<float> grad(n, 0.0f);
  StepParams params;
  params.lr = 0.0;
  params.weight_decay = 0.0;
  ForEachTarget([&] {
    std::vector<uint16_t> p = param;
    std::vector<int16_t> r = remainder;
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    TensorSlot slot;
    slot.numel = n;
    slot.param = p.data();
    slot.param_dtype = DType::kBFloat16;
    slot.grad = grad.data();
    slot.exp_avg = m.data();
    slot.exp_avg_sq = v.data();
    slot.master_param = r.data();
    slot.master_dtype = DType::kInt16Remainder;
    Error error;
    ASSERT_EQ(AdamStep(&slot, 1, params, 2, &error), Status::kOk)
        << error.message;
    EXPECT_TRUE(SameElements(param.data(), p.data(), DType::kBFloat16, n));
    EXPECT_TRUE(
        SameElements(remainder.data(), r.data(), DType::kInt16Remainder, n));
  });
}

// The comparison the bitwise tests rest on (test_util.h, which compares whole
// bytes first): one differing element anywhere is found, the odd last code of a
// 4-bit buffer included; a 4-bit buffer's padding nibble is not an element; any
// NaN equals any NaN, and nothing else.
TEST(SameElementsTest, FindsEachDifferenceAndTakesAnyNaNForAnyNaN) {
  constexpr int64_t kNumel = 37;  // odd: a 4-bit buffer ends in half a byte
  for (int d = 1; d < kNumDTypes; ++d) {
    const DType dtype = static_cast<DType>(d);
    SCOPED_TRACE(DTypeName(dtype));
    const int bits = FormatOf(dtype).item_bits;
    const auto set = [&](std::vector<uint8_t>* buffer, int64_t i, uint32_t code) {
      uint8_t* bytes = buffer->data();
      if (bits == 4) {
        const int shift = i % 2 == 0 ? 0 : 4;
        bytes[i / 2] = static_cast<uint8_t>((bytes[i / 2] & ~(0xF << shift)) | (code << shift));
      } else {
        std::memcpy(bytes + i * (bits / 8), &code, static_cast<size_t>(bits / 8));
      }
    };
    // Codes 1-3 and 5-7 are finite numbers in every format.
    std::vector<uint8_t> want(static_cast<size_t>((kNumel * bits + 7) / 8));
    for (int64_t i = 0; i < kNumel; ++i) set(&want, i, static_cast<uint32_t>(1 + i % 3));
    EXPECT_TRUE(SameElements(want.data(), want.data(), dtype, kNumel));
    for (int64_t i = 0; i < kNumel; ++i) {
      std::vector<uint8_t> got = want;
      set(&got, i, ElementBits(want.data(), dtype, i) ^ 4u);
      const ::testing::AssertionResult same = SameElements(want.data(), got.data(), dtype, kNumel);
      EXPECT_FALSE(same) << "element " << i;
      EXPECT_NE(std::string(same.message()).find("first at " + std::to_string(i) + ":"),
                std::string::npos)
          << same.message();
    }
    if (bits == 4) {
      std::vector<uint8_t> got = want;
      got.back() ^= 0xF0;  // the padding nibble after element 36
      EXPECT_TRUE(SameElements(want.data(), got.data(), dtype, kNumel));
    }
    std::vector<uint32_t> nans;
    if (bits == 32) {
      nans = {0x7FC00000u, 0xFFC00001u};
    } else {
      for (uint32_t code = 0; code < (1u << bits); ++code) {
        if (IsNaNElement(code, dtype)) nans.push_back(code);
      }
    }
    if (nans.empty()) continue;  // no NaN (the remainder)
    std::vector<uint8_t> nan = want;
    set(&nan, 5, nans.front());
    std::vector<uint8_t> other = want;
    set(&other, 5, nans.back());
    EXPECT_TRUE(SameElements(nan.data(), other.data(), dtype, kNumel));
    EXPECT_FALSE(SameElements(nan.data(), want.data(), dtype, kNumel));
  }
}

}  // namespace
}  // namespace testing
}  // namespace shardadam
