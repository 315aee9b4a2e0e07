// S2.12's 4-bit element codecs (signed E2M1, unsigned zero-free E3M1), written
// once on the integer bits of fp32 (no rounding-mode or library dependence) and
// host-device: the scalar reference and the CUDA kernels both call these, so the
// device stores the reference's codes. Codes are the low 4 bits of a byte; where
// two share a byte is the caller's business (reference CodeAt/SetCode, the
// kernels' ReadCode/WriteCode).
#ifndef SHARDADAM_FLOAT4_H_
#define SHARDADAM_FLOAT4_H_

#include <cstdint>

#include "host_device.h"
#include "scale_rule.h"  // BitsOf, FloatOf, BlockScaleFromAbsMaxBits
#include "shardadam/formats.h"
#include "stochastic_steps.h"

namespace shardadam {

// Rounds `mantissa >> shift` to nearest, ties to the even result (shift >= 1).
SHARDADAM_HOST_DEVICE inline uint32_t ShiftRoundEven4(uint32_t mantissa, int shift) {
  const uint32_t half = 1u << (shift - 1);
  const uint32_t rest = mantissa & ((1u << shift) - 1u);
  const uint32_t q = mantissa >> shift;
  return q + ((rest > half || (rest == half && (q & 1u))) ? 1u : 0u);
}

// The code of magnitude code `magnitude` with f's sign (`bits`), none on zero.
SHARDADAM_HOST_DEVICE inline uint8_t SignedFloat4E2M1(uint32_t bits, uint32_t magnitude) {
  if (magnitude == 0) return 0;
  return static_cast<uint8_t>(((bits >> 28) & 0x8u) | magnitude);
}

// f as a signed E2M1 code: magnitude rounded to nearest, ties to the even code; a
// magnitude of 7 or more (7 ties 6 and 8 and goes to the even 8), infinity and
// NaN give 0x8; a magnitude that rounds to 0 gives 0x0 whatever the sign.
SHARDADAM_HOST_DEVICE inline uint8_t EncodeFloat4E2M1(float f) {
  const uint32_t bits = BitsOf(f);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs >= 0x40E00000u) return 0x8;  // 7.0f; NaNs' bits are above it too
  const uint32_t exponent = abs >> 23;  // biased by 127
  uint32_t magnitude;
  if (exponent >= 127) {
    // |f| >= 1: rebias so that 1.0 is code 2 and keep one mantissa bit; a carry
    // steps into the next binade, as the code's layout wants (below 7: no NaN).
    magnitude = (abs - (126u << 23)) >> 22;
    const uint32_t rest = abs & 0x3FFFFFu;
    magnitude += (rest > 0x200000u || (rest == 0x200000u && (magnitude & 1u))) ? 1u : 0u;
  } else if (exponent >= 125) {
    // [0.25, 1): units of 0.5, the implicit bit set; 0.25 ties to 0.
    magnitude = ShiftRoundEven4((abs & 0x7FFFFFu) | 0x800000u, static_cast<int>(149 - exponent));
  } else {
    magnitude = 0;  // below 0.25: under half a unit
  }
  return SignedFloat4E2M1(bits, magnitude);
}

// f as a signed E2M1 code rounded stochastically (S2.13) with 22 of the bits of
// `random` (StochasticSteps: from 1 up the steps are linear in the fp32 bits;
// below 1 |f| * 2^23 is truncated first, so magnitudes below 2^-23 always give
// 0; a value on the grid encodes to itself). From 6 (the largest value) up f is
// rounded to nearest, as EncodeFloat4E2M1: 6 below 7, the NaN code from 7. A
// block's largest element may round down out of the top binade;
// CanonicalFloat4Scale says how the block is then stored.
SHARDADAM_HOST_DEVICE inline uint8_t EncodeFloat4E2M1Stochastic(float f, uint32_t random) {
  const uint32_t bits = BitsOf(f);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs >= 0x40C00000u) return EncodeFloat4E2M1(f);  // 6.0f; NaNs' bits are above it
  // From 1.0 (code 2) up, at most 7 (the value 6); below, steps of 0.5: 2^22 / 0.5.
  return SignedFloat4E2M1(bits, StochasticSteps<0x3F800000u, 2u, 22>(abs, 8388608.0f, random));
}

// E = (c >> 1) & 3, M = c & 1: E = 0 is M * 0.5, E >= 1 is (2 + M) * 2^(E - 2);
// sign bit 3; 0x8 is the quiet NaN.
SHARDADAM_HOST_DEVICE inline float DecodeFloat4E2M1(uint8_t q) {
  q &= 0xF;
  if (q == 0x8) return FloatOf(0x7FC00000u);
  const uint32_t exponent = (q >> 1) & 3u;
  const uint32_t mantissa = q & 1u;
  uint32_t magnitude;
  if (exponent == 0) {
    magnitude = mantissa != 0 ? 0x3F000000u : 0u;  // 0.5 or 0
  } else {
    magnitude = ((exponent + 126u) << 23) | (mantissa << 22);
  }
  return FloatOf((static_cast<uint32_t>(q & 0x8u) << 28) | magnitude);
}

// |f| as an unsigned E3M1 code: rounded to nearest, ties to the even code; above
// 20 (the tie between 16 and 24, which stays 16), infinity and NaN give 0xF.
// Zero-free: a non-zero magnitude that rounds to code 0 gives code 1.
SHARDADAM_HOST_DEVICE inline uint8_t EncodeUFloat4E3M1(float f) {
  const uint32_t abs = BitsOf(f) & 0x7FFFFFFFu;
  if (abs > 0x41A00000u) return 0xF;  // 20.0f; NaNs' bits are above it too
  if (abs == 0) return 0;
  const uint32_t exponent = abs >> 23;  // biased by 127
  uint32_t code;
  if (exponent >= 125) {
    // |f| >= 2^-2: rebias so that 0.25 is code 2 and keep one mantissa bit.
    code = (abs - (124u << 23)) >> 22;
    const uint32_t rest = abs & 0x3FFFFFu;
    code += (rest > 0x200000u || (rest == 0x200000u && (code & 1u))) ? 1u : 0u;
  } else if (exponent >= 123) {
    // [2^-4, 2^-2): units of 2^-3, the implicit bit set; may round up to 2.
    code = ShiftRoundEven4((abs & 0x7FFFFFu) | 0x800000u, static_cast<int>(147 - exponent));
  } else {
    code = 0;  // below 2^-4: under half a unit
  }
  return static_cast<uint8_t>(code == 0 ? 1u : code);
}

// |u| / scale as an unsigned E3M1 code rounded stochastically (S2.13) with 22
// of the bits of `random`, as EncodeFloat4E2M1Stochastic: from 0.25 (code 2)
// up the steps are linear in the fp32 bits; below it (steps of 0.125) the
// quotient times 2^25 is truncated first. From 16 (the largest value) up it is
// rounded to nearest, as EncodeUFloat4E3M1: 16 up to 20, the NaN code above.
// Zero-free on the true value u, as the nearest encoders' callers: a non-zero u
// whose code is 0 (also where the division underflowed) gives code 1.
SHARDADAM_HOST_DEVICE inline uint8_t EncodeUFloat4E3M1Stochastic(float u, float scale,
                                                                  uint32_t random) {
  const float f = u / scale;
  const uint32_t abs = BitsOf(f) & 0x7FFFFFFFu;
  if (abs >= 0x41800000u) return EncodeUFloat4E3M1(f);  // 16.0f; NaNs' bits are above it
  if (u == 0.0f) return 0;
  // From 0.25 (code 2) up, at most 14 (the value 16); below, steps of 0.125.
  const uint32_t code = StochasticSteps<0x3E800000u, 2u, 22>(abs, 33554432.0f, random);
  return static_cast<uint8_t>(code == 0 ? 1u : code);
}

// E = c >> 1, M = c & 1: E = 0 is M * 0.125, E >= 1 is (2 + M) * 2^(E - 4); 0xF
// is the quiet NaN.
SHARDADAM_HOST_DEVICE inline float DecodeUFloat4E3M1(uint8_t q) {
  q &= 0xF;
  if (q == 0xF) return FloatOf(0x7FC00000u);
  const uint32_t exponent = q >> 1;
  const uint32_t mantissa = q & 1u;
  if (exponent == 0) return FloatOf(mantissa != 0 ? 0x3E000000u : 0u);  // 0.125 or 0
  return FloatOf(((exponent + 124u) << 23) | (mantissa << 22));
}

// S2.13's canonical blocks. Rounded stochastically, a block's largest element
// can round down out of the top binade (an E2M1 value in (3.5, 4) to 3, an E3M1
// one in (10, 12) to 8); decoded and encoded again, such a block would take half
// the scale and codes of twice the values. It is stored that way at once, so
// that encoding a decoded block always gives back its codes and scale.

// A code's rank among its format's codes by magnitude, NaN highest: the code of
// a block's largest decoded magnitude is the one of highest rank.
SHARDADAM_HOST_DEVICE constexpr uint32_t Float4Rank(bool is_unsigned, uint8_t code) {
  code &= 0xF;
  if (is_unsigned) return code;           // 0xF, NaN, is already the highest
  return code == 0x8 ? 0xFu : code & 7u;  // sign dropped; NaN above 6's 7
}

// The scale a block stored at scale `s` whose codes' highest rank is `top`
// (Float4Rank) takes when its decoded values are encoded again (S2.12's scale,
// BlockScaleFromAbsMaxBits with the format's bounds): `s`; `s / 2` where its
// largest element rounded down out of the top binade; 1 where every code is 0
// (only an fp4-block at the smallest scale).
SHARDADAM_HOST_DEVICE inline float CanonicalFloat4Scale(bool is_unsigned, uint32_t top,
                                                        float s) {
  const float largest = is_unsigned ? DecodeUFloat4E3M1(static_cast<uint8_t>(top))
                                    : DecodeFloat4E2M1(top == 0xFu ? uint8_t{0x8}
                                                                   : static_cast<uint8_t>(top));
  // Exact: a power of two times a code value (a subnormal product keeps its bits).
  const uint32_t bits = BitsOf(largest * s) & 0x7FFFFFFFu;
  return is_unsigned
             ? BlockScaleFromAbsMaxBits(bits, kUFloat4FiniteBound, 0.0f, kFloat4OverflowBound)
             : BlockScaleFromAbsMaxBits(bits, kFloat4FiniteBound, kFloat4ZeroBound,
                                        kFloat4OverflowBound);
}

// The code of twice `code`'s value, for a block whose scale CanonicalFloat4Scale
// halved (no code there is NaN or above 3 (E2M1) or 8 (E3M1)): 0 stays 0, the
// subnormal 1 becomes 2 (the binade's first), a normal code moves up a binade.
SHARDADAM_HOST_DEVICE inline uint8_t DoubledFloat4Code(bool is_unsigned, uint8_t code) {
  const uint32_t magnitude = is_unsigned ? code & 0xFu : code & 7u;
  const uint32_t doubled = magnitude == 0 ? 0u : magnitude == 1 ? 2u : magnitude + 2u;
  return static_cast<uint8_t>(is_unsigned ? doubled : (code & 0x8u) | doubled);
}

}  // namespace shardadam

#endif  // SHARDADAM_FLOAT4_H_
