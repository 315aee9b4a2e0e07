// The step count behind S2.13's stochastic encoders of small binary floats (E2M1,
// E3M1, E4M4), written once on the integer bits of fp32. Host-device: float4.h and
// ufloat8.h, so the reference, the SIMD kernels' scalar paths and CUDA share it.
#ifndef SHARDADAM_STOCHASTIC_STEPS_H_
#define SHARDADAM_STOCHASTIC_STEPS_H_

#include <cstdint>

#include "host_device.h"
#include "scale_rule.h"  // FloatOf

namespace shardadam {

// The code of magnitude bits `abs` (below the format's largest value) rounded
// stochastically with the low kDrop bits of `random`, where kDrop is the number
// of fp32 mantissa bits the format drops: from its first normal value (fp32 bits
// kNormal, code kNormalCode) up the fp32 bits are linear between adjacent codes,
// so the bits' distance above it plus the random bits, shifted down by kDrop,
// counts codes exactly; below it (fixed steps) |x| * `units` (2^kDrop over the
// step) is truncated first, which drops at most half an fp32 ulp. A value
// between adjacent codes goes up with probability (x - lo) / (hi - lo), by
// 2^-kDrop steps; a value on the grid encodes to itself.
template <uint32_t kNormal, uint32_t kNormalCode, int kDrop>
SHARDADAM_HOST_DEVICE inline uint32_t StochasticSteps(uint32_t abs, float units,
                                                      uint32_t random) {
  const uint32_t r = random & ((1u << kDrop) - 1u);
  if (abs >= kNormal) return kNormalCode + ((abs - kNormal + r) >> kDrop);
  return (static_cast<uint32_t>(FloatOf(abs) * units) + r) >> kDrop;
}

}  // namespace shardadam

#endif  // SHARDADAM_STOCHASTIC_STEPS_H_
