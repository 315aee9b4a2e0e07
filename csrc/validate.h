// Every check the core makes on its inputs, run before anything is written, so
// a rejected call leaves every buffer and scale untouched (SEMANTICS S3.1).
#ifndef SHARDADAM_VALIDATE_H_
#define SHARDADAM_VALIDATE_H_

#include <cstdint>

#include "shardadam/adam.h"

namespace shardadam {
namespace internal {

// Short name for messages: the format's name (formats.h), or "unknown".
inline const char* DTypeName(DType dtype) { return FormatOf(dtype).name; }

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

// For slots that passed ValidateSlots: whether `bytes` bytes at `region` (named
// `name` in messages) share no byte with any buffer or scale slot a step over them
// reads or writes. Else fills `error` naming both (tensor_index: the tensor).
bool CheckRegionApart(const TensorSlot* slots, int64_t count, const void* region,
                      int64_t bytes, const char* name, Error* error);

// Checks a Convert call the same way.
bool ValidateConvert(const void* src, DType src_dtype, const void* dst,
                     DType dst_dtype, int64_t numel, float scale, Error* error);

}  // namespace internal
}  // namespace shardadam

#endif  // SHARDADAM_VALIDATE_H_
