// S2.13's stochastically rounded per-block codes, by format: fp4-block exp_avg,
// ufp4-block and ufp8-block exp_avg_sq (float4.h, ufloat8.h). Host-device: the
// scalar reference, the SIMD kernels' driver and the CUDA kernels pick a
// format's encoder, code ranks and canonical block here, so all store the same.
#ifndef SHARDADAM_STOCHASTIC_BLOCKS_H_
#define SHARDADAM_STOCHASTIC_BLOCKS_H_

#include <cstdint>

#include "float4.h"
#include "host_device.h"
#include "shardadam/formats.h"
#include "ufloat8.h"

namespace shardadam {

// Whether a state of `dtype` may be rounded stochastically.
SHARDADAM_HOST_DEVICE constexpr bool RoundsStochastically(DType dtype) {
  return dtype == DType::kFloat4E2M1Block || dtype == DType::kUFloat4E3M1Block ||
         dtype == DType::kUFloat8E4M4Block;
}

// The code of true value u at block scale s, rounded with `random`'s bits.
SHARDADAM_HOST_DEVICE inline uint8_t EncodeStochasticCode(DType dtype, float u, float s,
                                                          uint32_t random) {
  if (dtype == DType::kFloat4E2M1Block) return EncodeFloat4E2M1Stochastic(u / s, random);
  if (dtype == DType::kUFloat4E3M1Block) return EncodeUFloat4E3M1Stochastic(u, s, random);
  return EncodeUFloat8E4M4Stochastic(u, s, random);
}

// A code's rank by magnitude, NaN highest: a block's largest has the top rank.
SHARDADAM_HOST_DEVICE constexpr uint32_t StochasticRank(DType dtype, uint8_t code) {
  return dtype == DType::kUFloat8E4M4Block ? code
                                           : Float4Rank(dtype == DType::kUFloat4E3M1Block, code);
}

// The first rank of the values that keep a block's scale (E2M1 4, E3M1 12, E4M4
// 248): a block whose codes reach it is canonical as it is.
SHARDADAM_HOST_DEVICE constexpr uint32_t KeepsScaleRank(DType dtype) {
  return dtype == DType::kUFloat8E4M4Block ? 0xEFu
         : dtype == DType::kUFloat4E3M1Block ? 13u : 6u;
}

// That rank's value, in units of the scale: a block whose largest element lies
// below it times the scale may round down out of the top binade.
SHARDADAM_HOST_DEVICE inline float KeepsScaleValue(DType dtype) {
  const auto code = static_cast<uint8_t>(KeepsScaleRank(dtype));
  if (dtype == DType::kUFloat8E4M4Block) return DecodeUFloat8E4M4(code);
  return dtype == DType::kUFloat4E3M1Block ? DecodeUFloat4E3M1(code) : DecodeFloat4E2M1(code);
}

// The scale a block stored at `s` whose top rank is `top` takes when its decoded
// values are encoded again: `s`, `s / 2` (its largest rounded down out of the
// top binade), or, for fp4-block codes all 0, 1.
SHARDADAM_HOST_DEVICE inline float CanonicalBlockScale(DType dtype, uint32_t top, float s) {
  if (dtype == DType::kUFloat8E4M4Block) return CanonicalUFloat8Scale(top, s);
  return CanonicalFloat4Scale(dtype == DType::kUFloat4E3M1Block, top, s);
}

// The code of twice `code`'s value, in a block whose canonical scale is half.
SHARDADAM_HOST_DEVICE inline uint8_t DoubledBlockCode(DType dtype, uint8_t code) {
  return dtype == DType::kUFloat8E4M4Block
             ? DoubledUFloat8Code(code)
             : DoubledFloat4Code(dtype == DType::kUFloat4E3M1Block, code);
}

}  // namespace shardadam

#endif  // SHARDADAM_STOCHASTIC_BLOCKS_H_
