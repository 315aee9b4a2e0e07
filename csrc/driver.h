// The core's target-independent driver, below the public entry points
// (adam.cc): each runs validated input on the kernels of `kt` (targets.cc).
#ifndef SHARDADAM_DRIVER_H_
#define SHARDADAM_DRIVER_H_

#include <cstdint>

#include "element.h"
#include "kernels.h"
#include "shardadam/adam.h"

namespace shardadam {
namespace internal {

// One step (number `step`) over validated slots (step.cc).
void Step(const KernelTable& kt, const TensorSlot* slots, int64_t count,
          const StepConstants& k, int64_t step, int num_threads);

// A validated Convert of numel > 0 elements (convert.cc).
void ConvertBuffer(const KernelTable& kt, const void* src, DType src_dtype, void* dst,
                   DType dst_dtype, int64_t numel, float scale, int num_threads);

// The per-tensor scale of `numel` > 0 fp32 values stored as `dtype`, a format
// that needs a measuring pass (convert.cc).
float MeasureBufferScale(const KernelTable& kt, const float* u, int64_t numel,
                         DType dtype, int num_threads);

}  // namespace internal
}  // namespace shardadam

#endif  // SHARDADAM_DRIVER_H_
