// What the CUDA kernels do to one element of one tensor, written as host-device
// code so the C++ tests run exactly these functions on the CPU against the
// scalar reference. The kernels (adam_cuda.cu) only add the launch: which
// block and thread handle which element, the block reduction of the absmax,
// and the ordering of the two passes.
#ifndef SHARDADAM_CUDA_SLOT_MATH_H_
#define SHARDADAM_CUDA_SLOT_MATH_H_

#include <cfloat>
#include <cstdint>

#include "cuda/codecs.h"
#include "element.h"
#include "shardadam/adam.h"

namespace shardadam {
namespace cuda {

// One tensor as the kernels see it: TensorSlot with dtype tags in bytes, so a
// launch's argument block holds many of them.
struct DeviceSlot {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* master;
  float* scale[3];  // kW, kM, kV; null where the state is not scaled
  int64_t numel;
  uint8_t param_dtype, grad_dtype, exp_avg_dtype, exp_avg_sq_dtype, master_dtype;
};

// Index of the three states that may carry a per-tensor scale.
enum StateIndex { kW = 0, kM = 1, kV = 2 };

SHARDADAM_HOST_DEVICE inline bool IsScaledTag(uint8_t dtype) {
  return dtype == static_cast<uint8_t>(DType::kFloat16) ||
         dtype == static_cast<uint8_t>(DType::kFloat8E4M3);
}

inline DeviceSlot MakeDeviceSlot(const TensorSlot& t) {
  DeviceSlot d;
  d.param = t.param;
  d.grad = t.grad;
  d.exp_avg = t.exp_avg;
  d.exp_avg_sq = t.exp_avg_sq;
  d.master = t.master_param;
  d.numel = t.numel;
  d.param_dtype = static_cast<uint8_t>(t.param_dtype);
  d.grad_dtype = static_cast<uint8_t>(t.grad_dtype);
  d.exp_avg_dtype = static_cast<uint8_t>(t.exp_avg_dtype);
  d.exp_avg_sq_dtype = static_cast<uint8_t>(t.exp_avg_sq_dtype);
  d.master_dtype = static_cast<uint8_t>(t.master_dtype);
  d.scale[kW] = IsScaledTag(d.master_dtype) ? t.master_scale : nullptr;
  d.scale[kM] = IsScaledTag(d.exp_avg_dtype) ? t.exp_avg_scale : nullptr;
  d.scale[kV] = IsScaledTag(d.exp_avg_sq_dtype) ? t.exp_avg_sq_scale : nullptr;
  return d;
}

SHARDADAM_HOST_DEVICE inline bool HasScaledState(const DeviceSlot& t) {
  return t.scale[kW] != nullptr || t.scale[kM] != nullptr || t.scale[kV] != nullptr;
}

// Unscaled value of element i of a buffer of fp32/fp16/bf16/fp8 codes.
SHARDADAM_HOST_DEVICE inline float LoadValue(const void* p, uint8_t dtype, int64_t i) {
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat16:
      return DecodeF16(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16:
      return DecodeBF16(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat8E4M3:
      return DecodeF8(static_cast<const uint8_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

SHARDADAM_HOST_DEVICE inline void StoreValue(void* p, uint8_t dtype, int64_t i, float x) {
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat16:
      static_cast<uint16_t*>(p)[i] = EncodeF16(x);
      break;
    case DType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = EncodeBF16(x);
      break;
    case DType::kFloat8E4M3:
      static_cast<uint8_t*>(p)[i] = EncodeF8(x);
      break;
    default:
      static_cast<float*>(p)[i] = x;
      break;
  }
}

// S2.2: true value of a state element, q * scale for scaled dtypes.
SHARDADAM_HOST_DEVICE inline float LoadState(const void* p, uint8_t dtype, float scale,
                                             int64_t i) {
  const float q = LoadValue(p, dtype, i);
  return IsScaledTag(dtype) ? q * scale : q;
}

SHARDADAM_HOST_DEVICE inline void StoreState(void* p, uint8_t dtype, float scale, int64_t i,
                                             float u) {
  StoreValue(p, dtype, i, IsScaledTag(dtype) ? u / scale : u);
}

// S2.3: the scale of a state whose largest magnitude has fp32 bits `bits`
// (1 for zero, infinity or NaN); `dtype` is fp16 or fp8.
SHARDADAM_HOST_DEVICE inline float ScaleFromAbsMaxBits(uint32_t bits, uint8_t dtype) {
  if (bits == 0 || bits >= 0x7F800000u) return 1.0f;
  const float target = dtype == static_cast<uint8_t>(DType::kFloat8E4M3)
                           ? kFloat8ScaleTarget
                           : kFloat16ScaleTarget;
  const float s = FloatOf(bits) / target;
  return s < FLT_MIN ? FLT_MIN : s;
}

// Scale values of one tensor's states (1 where unscaled).
struct Scales {
  float s[3];
};

// Reads the current scales from the slots; called once per thread.
SHARDADAM_HOST_DEVICE inline Scales ReadScales(const DeviceSlot& t) {
  Scales r;
  for (int k = 0; k < 3; ++k) r.s[k] = t.scale[k] != nullptr ? *t.scale[k] : 1.0f;
  return r;
}

// The scales measured on the new state, from the absmax bits of pass 1.
SHARDADAM_HOST_DEVICE inline Scales NewScales(const DeviceSlot& t, const uint32_t* bits) {
  const uint8_t dtypes[3] = {t.master_dtype, t.exp_avg_dtype, t.exp_avg_sq_dtype};
  Scales r;
  for (int k = 0; k < 3; ++k) {
    r.s[k] = t.scale[k] != nullptr ? ScaleFromAbsMaxBits(bits[k], dtypes[k]) : 1.0f;
  }
  return r;
}

// Element i's gradient, fp32 weight and true moments, decoded with the
// current scales.
struct Inputs {
  float g, w, m, v;
};

SHARDADAM_HOST_DEVICE inline Inputs LoadInputs(const DeviceSlot& t, const Scales& old,
                                               int64_t i) {
  Inputs in;
  in.g = LoadValue(t.grad, t.grad_dtype, i);
  if (t.master_dtype == static_cast<uint8_t>(DType::kInt16Remainder)) {
    in.w = MergeMaster(static_cast<const uint16_t*>(t.param)[i],
                       static_cast<const int16_t*>(t.master)[i]);
  } else if (t.master_dtype != static_cast<uint8_t>(DType::kNone)) {
    in.w = LoadState(t.master, t.master_dtype, old.s[kW], i);
  } else {
    in.w = LoadValue(t.param, t.param_dtype, i);
  }
  in.m = LoadState(t.exp_avg, t.exp_avg_dtype, old.s[kM], i);
  in.v = LoadState(t.exp_avg_sq, t.exp_avg_sq_dtype, old.s[kV], i);
  return in;
}

// The updated fp32 weight and moments (SEMANTICS S3.6), in place in `in`.
template <bool kAdamW>
SHARDADAM_HOST_DEVICE inline void Update(const StepConstants& c, Inputs& in) {
  AdamElement<kAdamW>(ScalarOps{}, c, in.g, in.w, in.m, in.v);
}

// Stores element i's new values with the new scales. The param is rounded from
// the fp32 weight itself, independently of the master's encoding (S3.6).
SHARDADAM_HOST_DEVICE inline void StoreElement(const DeviceSlot& t, const Scales& now,
                                               int64_t i, const Inputs& out) {
  if (t.master_dtype == static_cast<uint8_t>(DType::kInt16Remainder)) {
    SplitMaster(out.w, &static_cast<uint16_t*>(t.param)[i],
                &static_cast<int16_t*>(t.master)[i]);
  } else {
    StoreValue(t.param, t.param_dtype, i, out.w);
    if (t.master_dtype != static_cast<uint8_t>(DType::kNone)) {
      StoreState(t.master, t.master_dtype, now.s[kW], i, out.w);
    }
  }
  StoreState(t.exp_avg, t.exp_avg_dtype, now.s[kM], i, out.m);
  StoreState(t.exp_avg_sq, t.exp_avg_sq_dtype, now.s[kV], i, out.v);
}

// |x| as ordered bits: for non-negative floats integer order is value order,
// and every NaN sorts above infinity, so one integer max finds absmax or flags
// a non-finite value.
SHARDADAM_HOST_DEVICE inline uint32_t AbsBits(float x) { return BitsOf(x) & 0x7FFFFFFFu; }

}  // namespace cuda
}  // namespace shardadam

#endif  // SHARDADAM_CUDA_SLOT_MATH_H_
