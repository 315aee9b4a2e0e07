// S2.10's unsigned E4M4 element codec, written once on the integer bits of fp32
// (no rounding-mode or library dependence) and host-device: the scalar reference
// and the CUDA kernels both call these, so the device stores the reference's codes.
#ifndef SHARDADAM_UFLOAT8_H_
#define SHARDADAM_UFLOAT8_H_

#include <cstdint>

#include "host_device.h"
#include "scale_rule.h"  // BitsOf, FloatOf, BlockScaleFromAbsMaxBits
#include "shardadam/formats.h"
#include "stochastic_steps.h"

namespace shardadam {

// |f| as an unsigned E4M4 code: rounded to nearest, ties to the even code; above
// 488 (the tie between 480 and 496, which stays 480), infinity and NaN give 0xFF.
// Zero-free: a non-zero magnitude that rounds to code 0 gives code 1.
SHARDADAM_HOST_DEVICE inline uint8_t EncodeUFloat8E4M4(float f) {
  const uint32_t abs = BitsOf(f) & 0x7FFFFFFFu;
  if (abs > 0x43F40000u) return 0xFF;  // 488.0f
  if (abs == 0) return 0;
  const uint32_t exponent = abs >> 23;  // biased by 127
  uint32_t code;
  if (exponent >= 121) {
    // |f| >= 2^-6: rebias 127 -> 7 and round the mantissa from 23 bits to 4; a
    // carry steps into the next binade, as the code's layout wants.
    code = (abs - (120u << 23)) >> 19;
    const uint32_t rest = abs & 0x7FFFFu;
    code += (rest > 0x40000u || (rest == 0x40000u && (code & 1u))) ? 1u : 0u;
  } else if (exponent >= 109) {
    // Below 2^-6: units of 2^-10, i.e. the mantissa (implicit bit set) shifted
    // right by 140 - exponent, in [20, 31]; may round up to 16 (2^-6's code).
    const int shift = static_cast<int>(140 - exponent);
    const uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;
    const uint32_t half = 1u << (shift - 1);
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    code = mantissa >> shift;
    code += (rest > half || (rest == half && (code & 1u))) ? 1u : 0u;
  } else {
    code = 0;  // below 2^-18: far under half a unit
  }
  return static_cast<uint8_t>(code == 0 ? 1u : code);
}

// |u| / scale as an unsigned E4M4 code rounded stochastically (S2.13) with 19
// of the bits of `random`: from 2^-6 (code 16) up the steps are linear in the
// fp32 bits; below it (steps of 2^-10) the quotient times 2^29 is truncated
// first. From 480 (the largest value) up it is rounded to nearest, as
// EncodeUFloat8E4M4: 480 up to 488, the NaN code above. Zero-free on the true
// value u: a non-zero u whose code is 0 (also where the division underflowed)
// gives code 1.
SHARDADAM_HOST_DEVICE inline uint8_t EncodeUFloat8E4M4Stochastic(float u, float scale,
                                                                  uint32_t random) {
  const float f = u / scale;
  const uint32_t abs = BitsOf(f) & 0x7FFFFFFFu;
  if (abs >= 0x43F00000u) return EncodeUFloat8E4M4(f);  // 480.0f; NaNs' bits are above it
  if (u == 0.0f) return 0;
  // From 2^-6 (code 16) up, at most 0xFE (the value 480); below, steps of 2^-10.
  const uint32_t code = StochasticSteps<0x3C800000u, 16u, 19>(abs, 536870912.0f, random);
  return static_cast<uint8_t>(code == 0 ? 1u : code);
}

// E = 0: M * 2^-10; E >= 1: (16 + M) * 2^(E - 11); 0xFF: the quiet NaN.
SHARDADAM_HOST_DEVICE inline float DecodeUFloat8E4M4(uint8_t q) {
  if (q == 0xFF) return FloatOf(0x7FC00000u);
  const uint32_t exponent = q >> 4;
  const uint32_t mantissa = q & 0xFu;
  if (exponent == 0) return static_cast<float>(mantissa) * 0.0009765625f;  // exact
  return FloatOf(((exponent + 120u) << 23) | (mantissa << 19));
}

// S2.13's canonical blocks for E4M4 (float4.h has the 4-bit ones): a block's
// largest element, in (244, 488] times the scale, rounded stochastically from
// (244, 248) down to 240, would take half the scale when decoded and encoded again.

// The scale a block stored at scale `s` whose largest code is `top` takes when
// its decoded values are encoded again: `s`, or `s / 2` where its largest
// element rounded down to 240 or below.
SHARDADAM_HOST_DEVICE inline float CanonicalUFloat8Scale(uint32_t top, float s) {
  // Exact: a power of two times a code value (a subnormal product keeps its bits).
  const uint32_t bits =
      BitsOf(DecodeUFloat8E4M4(static_cast<uint8_t>(top)) * s) & 0x7FFFFFFFu;
  return BlockScaleFromAbsMaxBits(bits, kUFloat8FiniteBound, 0.0f, kUFloat8OverflowBound);
}

// The code of twice `code`'s value, for a block whose scale CanonicalUFloat8Scale
// halved (no code there is above 240's): E = 0 doubles its M (M 8 and up reach
// E = 1, whose codes continue E = 0's), a normal code moves up a binade.
SHARDADAM_HOST_DEVICE constexpr uint8_t DoubledUFloat8Code(uint8_t code) {
  return static_cast<uint8_t>(code < 16u ? 2u * code : code + 16u);
}

}  // namespace shardadam

#endif  // SHARDADAM_UFLOAT8_H_
