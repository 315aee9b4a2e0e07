// The counter-based generator behind stochastic rounding (S2.13, S2.14): the random
// bits of an element are a hash of (tensor key, step, flat index in the whole
// parameter), so they depend on nothing else: not the SIMD target, the thread
// count, the order of work, nor how the parameter is sharded. Host-device: the
// reference, the SIMD kernels' scalar set-up and the CUDA kernels share it.
#ifndef SHARDADAM_COUNTER_HASH_H_
#define SHARDADAM_COUNTER_HASH_H_

#include <cstdint>

#include "host_device.h"

namespace shardadam {

// lowbias32 (Chris Wellons' 32-bit integer hash): a bijection of uint32 with
// good avalanche, two multiplies. Mix32(0) == 0, so an index below 2^32 hashes
// as its low half alone (see RandomBits).
SHARDADAM_HOST_DEVICE inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The key of one (tensor, step): steps are taken modulo 2^32, so step t and
// t + 2^32 draw the same bits (4 billion steps apart).
SHARDADAM_HOST_DEVICE inline uint32_t StepKey(uint32_t rounding_key, int64_t step) {
  return Mix32(Mix32(rounding_key) ^ static_cast<uint32_t>(step));
}

// The key of one (tensor, step) for its exp_avg's rounding (S2.13), drawn from
// StepKey's as the other streams are. Keyed by StepKey itself, element i at
// step t would draw what element c ^ t draws at step c ^ i (c the hashed
// tensor key): for the key 0, the bits at (i, t) and (t, i) were equal and the
// element whose index is the step drew 0 at every step.
SHARDADAM_HOST_DEVICE inline uint32_t ExpAvgStepKey(uint32_t rounding_key, int64_t step) {
  return Mix32(StepKey(rounding_key, step) ^ 0x6C8E9CF5u);
}

// The key of one (tensor, step) for its param's rounding (S2.14): a second
// stream drawn from StepKey's, so a tensor whose exp_avg and param both round
// stochastically draws unrelated bits for the two.
SHARDADAM_HOST_DEVICE inline uint32_t ParamStepKey(uint32_t rounding_key, int64_t step) {
  return Mix32(StepKey(rounding_key, step) ^ 0x5851F42Du);
}

// The key of one (tensor, step) for its exp_avg_sq's rounding (S2.13): a third
// stream drawn from StepKey's, unrelated to exp_avg's and the param's.
SHARDADAM_HOST_DEVICE inline uint32_t SquareStepKey(uint32_t rounding_key, int64_t step) {
  return Mix32(StepKey(rounding_key, step) ^ 0x2545F491u);
}

// The high half of a flat index as RandomBits mixes it: constant over any run
// of elements that does not cross a multiple of 2^32 (a scale block never does).
SHARDADAM_HOST_DEVICE inline uint32_t IndexHigh(uint64_t index) {
  return Mix32(static_cast<uint32_t>(index >> 32));
}

// 32 random bits of the element at flat index `index` of the whole parameter.
SHARDADAM_HOST_DEVICE inline uint32_t RandomBits(uint32_t step_key, uint64_t index) {
  return Mix32(Mix32(static_cast<uint32_t>(index) ^ IndexHigh(index)) ^ step_key);
}

}  // namespace shardadam

#endif  // SHARDADAM_COUNTER_HASH_H_
