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

}  // namespace shardadam

#endif  // SHARDADAM_SCALE_RULE_H_
