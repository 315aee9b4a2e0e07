// S2.10's unsigned E4M4 element codec, written once on the integer bits of fp32
// (no rounding-mode or library dependence) and host-device: the scalar reference
// and the CUDA kernels both call these, so the device stores the reference's codes.
#ifndef SHARDADAM_UFLOAT8_H_
#define SHARDADAM_UFLOAT8_H_

#include <cstdint>

#include "host_device.h"
#include "scale_rule.h"  // BitsOf, FloatOf

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

// E = 0: M * 2^-10; E >= 1: (16 + M) * 2^(E - 11); 0xFF: the quiet NaN.
SHARDADAM_HOST_DEVICE inline float DecodeUFloat8E4M4(uint8_t q) {
  if (q == 0xFF) return FloatOf(0x7FC00000u);
  const uint32_t exponent = q >> 4;
  const uint32_t mantissa = q & 0xFu;
  if (exponent == 0) return static_cast<float>(mantissa) * 0.0009765625f;  // exact
  return FloatOf(((exponent + 120u) << 23) | (mantissa << 19));
}

}  // namespace shardadam

#endif  // SHARDADAM_UFLOAT8_H_
