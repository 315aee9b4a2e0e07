// S2.14's stochastic rounding of fp32 to bf16, written once on the integer bits
// of fp32 and host-device: the scalar reference and the CUDA kernels call it,
// and the SIMD kernels are tested bit for bit against it.
#ifndef SHARDADAM_BF16_STOCHASTIC_H_
#define SHARDADAM_BF16_STOCHASTIC_H_

#include <cstdint>

#include "host_device.h"
#include "scale_rule.h"  // BitsOf

namespace shardadam {

// f as bf16 bits rounded stochastically with the high 16 bits of `random`:
// adding them to fp32's low half carries into the kept half with probability
// (low half) / 2^16, which is |f|'s distance above the bf16 value below it over
// the step, so the stored value is unbiased and a bf16 value stores itself.
// Magnitudes only grow (the sign bit is never reached: the largest non-NaN
// magnitude is inf's 0x7F800000, whose low half is 0); above the largest bf16
// they may round to inf, as to nearest. A NaN stays NaN, made quiet, as
// rounding to nearest stores it.
SHARDADAM_HOST_DEVICE inline uint16_t EncodeBF16Stochastic(float f, uint32_t random) {
  const uint32_t bits = BitsOf(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + (random >> 16)) >> 16);
}

}  // namespace shardadam

#endif  // SHARDADAM_BF16_STOCHASTIC_H_
