// Every check the core makes on its inputs, run before anything is written, so
// a rejected call leaves every buffer and scale untouched (SEMANTICS S3.1).
#ifndef SHARDADAM_VALIDATE_H_
#define SHARDADAM_VALIDATE_H_

#include <cstdint>

#include "host_device.h"
#include "shardadam/adam.h"

namespace shardadam {
namespace internal {

// Bytes per element of a storage dtype (0 for kNone and unknown values). Host-device
// like IsScaled: the CUDA kernels size their accesses with it.
SHARDADAM_HOST_DEVICE constexpr int ItemSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16Remainder:
      return 2;
    case DType::kFloat8E4M3:
      return 1;
    default:
      return 0;
  }
}
// Short name for messages: "fp32", "fp16", "bf16", "fp8", "int16 remainder",
// "none", or "unknown".
const char* DTypeName(DType dtype);
// True for the dtypes stored as q with a per-tensor scale (fp16, fp8).
SHARDADAM_HOST_DEVICE constexpr bool IsScaled(DType dtype) {
  return dtype == DType::kFloat16 || dtype == DType::kFloat8E4M3;
}

// Whether validation may read the values held in scale slots: not when they
// live in device memory.
enum class ScaleValues { kCheck, kSkip };

// Checks the hyper-parameters and every slot of an AdamStep call. On failure
// fills `error` (if non-null) with the first broken rule and returns false.
bool ValidateStep(const TensorSlot* slots, int64_t count,
                  const StepParams& params, Error* error,
                  ScaleValues scale_values = ScaleValues::kCheck);

// ValidateStep without the hyper-parameters: every slot and the buffers shared
// between tensors.
bool ValidateSlots(const TensorSlot* slots, int64_t count, Error* error,
                   ScaleValues scale_values);

// Checks a Convert call the same way.
bool ValidateConvert(const void* src, DType src_dtype, const void* dst,
                     DType dst_dtype, int64_t numel, float scale, Error* error);

}  // namespace internal
}  // namespace shardadam

#endif  // SHARDADAM_VALIDATE_H_
