// S2.3, written once for the CPU core and the CUDA kernels: the scale of a
// per-tensor scaled state from the largest magnitude of its new values, taken as
// fp32 bits (an exact maximum, whatever order it was reduced in).
#ifndef SHARDADAM_SCALE_RULE_H_
#define SHARDADAM_SCALE_RULE_H_

#include <cfloat>
#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace shardadam {

SHARDADAM_HOST_DEVICE inline uint32_t BitsOf(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

SHARDADAM_HOST_DEVICE inline float FloatOf(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// `target` is the format's scale_target (formats.h). A zero, infinite or NaN
// maximum gives 1; a scale below the smallest normal fp32 is raised to it.
SHARDADAM_HOST_DEVICE inline float ScaleFromAbsMaxBits(uint32_t bits, float target) {
  if (bits == 0 || bits >= 0x7F800000u) return 1.0f;
  const float s = FloatOf(bits) / target;
  return s < FLT_MIN ? FLT_MIN : s;
}

// S2.9: the scale of one block of a per-block scaled state, from the largest
// magnitude a of its new values as fp32 bits: the smallest power of two s with
// a / s <= `bound` (the format's largest magnitude that encodes finite), within
// [2^-126, 2^127]; 1 for a block that encodes to zeros at every scale (a <=
// `zero_bound` * 2^-126), and for a maximum of at least `overflow_bound` (whose
// code would decode past FLT_MAX), infinite or NaN. A power of two makes
// decoding exact and puts the block's largest code in the top binade, so
// encoding a decoded block gives back its codes and scale (checkpoints).
SHARDADAM_HOST_DEVICE inline float BlockScaleFromAbsMaxBits(uint32_t bits, float bound,
                                                            float zero_bound,
                                                            float overflow_bound) {
  if (bits >= BitsOf(overflow_bound)) return 1.0f;  // also infinite and NaN maxima
  if (FloatOf(bits) <= zero_bound * FloatOf(1u << 23)) return 1.0f;  // 2^-126: exact
  // a / 2^e <= bound is a <= bound * 2^e, both exact for e >= -126 (bound is at
  // least 1). The fp32 bits of bound * 2^e are bound's plus e << 23 (read past
  // FLT_MAX as if the exponent field were wider), and non-negative floats order as
  // their bits, so the smallest such e is ceil((bits(a) - bits(bound)) / 2^23):
  // integer work, where a search by division would wait on its divisions.
  const int32_t diff = static_cast<int32_t>(bits) - static_cast<int32_t>(BitsOf(bound));
  int32_t e = diff >= 0 ? (diff + 0x7FFFFF) / 0x800000 : -(-diff / 0x800000);
  if (e < -126) e = -126;
  if (e > 127) e = 127;
  return FloatOf(static_cast<uint32_t>(e + 127) << 23);
}

}  // namespace shardadam

#endif  // SHARDADAM_SCALE_RULE_H_
