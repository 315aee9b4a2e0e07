// Public contract of the shardadam C++ core: one Adam/AdamW step over a list of
// tensors whose buffers the caller owns. No dependency on PyTorch or Python, so a
// C++ training loop (or the nanobind module) can call it directly.
#ifndef SHARDADAM_ADAM_H_
#define SHARDADAM_ADAM_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "shardadam/formats.h"

namespace shardadam {

// One tensor's buffers. All buffers hold `numel` elements, contiguous, in the dtype
// given beside them (formats.h). A state whose format is scaled needs its scale
// slot: ScaleCount(...) fp32 values (one for Scaling::kPerTensor, one per block
// for Scaling::kPerBlock), read as the current scales before the step and
// overwritten with the scales of the new state after it. Scale slots of
// unscaled states are ignored.
struct TensorSlot {
  int64_t numel = 0;
  void* param = nullptr;
  DType param_dtype = DType::kFloat32;  // fp32 / fp16 / bf16
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;  // fp32 / fp16 / bf16
  void* exp_avg = nullptr;
  DType exp_avg_dtype = DType::kFloat32;  // fp32 / fp16 / bf16 / fp8
  float* exp_avg_scale = nullptr;
  void* exp_avg_sq = nullptr;
  DType exp_avg_sq_dtype = DType::kFloat32;  // fp32 / fp16 / bf16 / fp8
  float* exp_avg_sq_scale = nullptr;
  // Optional fp32 master of a fp16/bf16 param: fp32, fp16 (scaled), or the int16
  // remainder of a bf16 param (the fp32 master is rebuilt from param + remainder).
  void* master_param = nullptr;
  DType master_dtype = DType::kNone;
  float* master_scale = nullptr;
  // Per-block scaled states (Scaling::kPerBlock, S2.9): elements per scale, a
  // power of two in [kMinScaleBlock, kMaxScaleBlock], and the flat index of
  // element 0 in the whole parameter (0 unless this tensor is a shard of one).
  // Block b covers flat indices [b * scale_block, (b + 1) * scale_block); the
  // scale slot holds ScaleCount(...) fp32 values, the first for the block of
  // element 0. Blocks are keyed to the whole parameter, so shards that start and
  // end on block boundaries store the same codes and scales however the
  // parameter is sharded. Ignored when no state is per-block scaled.
  int64_t first_index = 0;
  int32_t scale_block = 0;
};

// Hyper-parameters of one step, shared by every tensor of the call (one param group).
struct StepParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adam_w_mode = true;      // false: L2 penalty added to the gradient
  bool bias_correction = true;  // false: both corrections are 1
  int64_t step = 1;             // the step being taken, counted from 1
};

enum class Status : int32_t {
  kOk = 0,
  kInvalidArgument = 1,  // a slot or a hyper-parameter broke a rule; nothing written
  kDeviceError = 2,      // CUDA backend only: the runtime refused a call (message names it)
};

// Filled on failure. The fields name the tensors by their index in the call, so
// a caller with its own names for them (the Python package) builds its own text
// from `rule` instead of parsing `message`.
struct Error {
  int64_t tensor_index = -1;        // the tensor the rule concerns; -1: the call itself
                                    // or a hyper-parameter
  int64_t other_tensor_index = -1;  // the second tensor of a rule about two, else -1
  // The broken rule: the buffer or hyper-parameter, the rule and the offending
  // number or address (never buffer contents), without the tensor's index;
  // "{other}" stands for the second tensor.
  std::string rule;
  // The whole sentence: "tensor 3: " + rule, "{other}" written as "tensor 1".
  std::string message;
};

// Fills every field of `error` (if non-null) from a rule and its tensors.
void SetError(Error* error, int64_t tensor, const std::string& rule,
              int64_t other_tensor = -1);

// Updates every tensor of `slots` in place (SEMANTICS S3.6). Validates every slot and
// hyper-parameter first; on any failure returns kInvalidArgument, fills `error`
// (if non-null) and writes nothing. `num_threads` <= 0 means "all hardware threads".
// Results are bitwise identical for every thread count and every SIMD target.
Status AdamStep(const TensorSlot* slots, int64_t count, const StepParams& params,
                int num_threads, Error* error);

// AdamStep's checks of `slots` alone, writing nothing: every slot rule and the
// buffers shared between tensors, not the hyper-parameters. A caller that splits
// one logical step into several AdamStep calls (one per parameter group) checks
// all their slots together first, so that a refusal leaves every call undone.
// With `scales_in_device_memory` the scale slots' values are not read (CUDA).
Status CheckStepSlots(const TensorSlot* slots, int64_t count,
                      bool scales_in_device_memory, Error* error);

// Element-wise conversion between storage dtypes, bit-exact with torch's `.to()`
// (round to nearest even, NaN kept). For fp16/fp8 destinations the value stored is
// round(src / scale); for fp16/fp8 sources the value read is float(src) * scale.
// Supported: any of fp32/fp16/bf16/fp8 to any other. kInt16Remainder is not a cast.
Status Convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
               int64_t numel, float scale, int num_threads, Error* error);

// The scale SEMANTICS S2.3 gives to fp32 values `u` stored as `dtype`
// (1 for an empty tensor, a zero or non-finite absmax, or an unscaled dtype).
float MeasureScale(const float* u, int64_t numel, DType dtype, int num_threads);

// Name of the SIMD target the dispatcher picked on this CPU, e.g. "AVX2".
const char* ChosenTarget();
// Space-separated names of every target compiled in and supported by this CPU.
std::string SupportedTargets();
// Number of hardware threads used when num_threads <= 0.
int DefaultThreads();

}  // namespace shardadam

#endif  // SHARDADAM_ADAM_H_
