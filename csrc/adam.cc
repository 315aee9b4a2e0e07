// The core's entry points (shardadam/adam.h): validate, then hand the call to
// the driver (driver.h) on the kernels of the active SIMD target (targets.cc).
// How one AdamStep call runs: docs/kernel-design.md. Where each job lives:
// plan.cc (per-tensor choices), spans.cc (update pass), block_spans.cc
// (per-block scaled states' one pass), measure.cc (measuring pass),
// work_items.cc (the split between threads; openmp_team.cc and thread_pool.cc
// run it), step.cc (the schedule), convert.cc (Convert, MeasureScale).
#include "driver.h"
#include "float_mode.h"
#include "openmp_team.h"
#include "shardadam/adam.h"
#include "thread_pool.h"
#include "validate.h"

namespace shardadam {

const char* Version() { return SHARDADAM_VERSION_STRING; }

Status AdamStep(const TensorSlot* slots, int64_t count, const StepParams& params,
                int num_threads, Error* error) {
  const internal::ScopedIeeeFloatMode ieee;  // validation compares floats too
  if (!internal::ValidateStep(slots, count, params, error)) {
    return Status::kInvalidArgument;
  }
  if (count == 0) return Status::kOk;
  const StepConstants k = MakeStepConstants(params);
  internal::Step(internal::ActiveKernels(), slots, count, k, params.step, num_threads);
  return Status::kOk;
}

Status CheckStepSlots(const TensorSlot* slots, int64_t count,
                      bool scales_in_device_memory, Error* error) {
  const internal::ScopedIeeeFloatMode ieee;  // scale values are compared
  return internal::ValidateSlots(slots, count, error,
                                 scales_in_device_memory ? internal::ScaleValues::kSkip
                                                         : internal::ScaleValues::kCheck)
             ? Status::kOk
             : Status::kInvalidArgument;
}

Status Convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
               int64_t numel, float scale, int num_threads, Error* error) {
  const internal::ScopedIeeeFloatMode ieee;
  if (!internal::ValidateConvert(src, src_dtype, dst, dst_dtype, numel, scale, error)) {
    return Status::kInvalidArgument;
  }
  if (numel == 0) return Status::kOk;
  internal::ConvertBuffer(internal::ActiveKernels(), src, src_dtype, dst, dst_dtype,
                          numel, scale, num_threads);
  return Status::kOk;
}

float MeasureScale(const float* u, int64_t numel, DType dtype, int num_threads) {
  const internal::ScopedIeeeFloatMode ieee;
  if (!NeedsMeasuringPass(dtype) || u == nullptr || numel <= 0) return 1.0f;
  return internal::MeasureBufferScale(internal::ActiveKernels(), u, numel, dtype,
                                      num_threads);
}

int DefaultThreads() { return internal::HardwareThreads(); }

void SetThreadRuntime(ThreadRuntime runtime) {
  internal::UseLoadedOpenMp(runtime == ThreadRuntime::kAuto);
}

std::string ThreadRuntimeName() {
  const std::string path = internal::LoadedOpenMpPath();
  return path.empty() ? "pool" : "openmp:" + path;
}

}  // namespace shardadam
