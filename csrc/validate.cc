// Input checks for the core's entry points. Each message names the tensor (or
// the hyper-parameter), the buffer, the rule and the offending value, so the
// Python layer can pass it on unchanged.
#include "validate.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "element.h"  // MakeStepConstants

namespace shardadam {
namespace internal {
namespace {

std::string Format(const char* format, ...) {
  char buffer[512];
  va_list args;
  va_start(args, format);
  vsnprintf(buffer, sizeof(buffer), format, args);
  va_end(args);
  return buffer;
}

bool Fail(Error* error, int64_t tensor, const std::string& rule, int64_t other = -1) {
  SetError(error, tensor, rule, other);
  return false;
}

int Code(DType dtype) { return static_cast<int>(dtype); }

// The formats a role allows, for messages: "fp32, fp16, bf16 or fp8";
// `casts_only` leaves out per-block scaled ones (not a Convert dtype).
std::string RoleFormats(FormatRole role, bool casts_only = false) {
  std::vector<const char*> names;
  for (int i = 0; i < kNumDTypes; ++i) {
    const DType d = static_cast<DType>(i);
    if (HasRole(d, role) && !(casts_only && IsBlockScaled(d))) names.push_back(DTypeName(d));
  }
  std::string text;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) text += i + 1 == names.size() ? " or " : ", ";
    text += names[i];
  }
  return text;
}

bool CheckHyper(const char* name, double value, Error* error) {
  if (!std::isfinite(value)) {
    return Fail(error, -1, Format("%s %.9g is not finite", name, value));
  }
  if (value < 0.0) {
    return Fail(error, -1, Format("%s %.9g is negative; expected >= 0", name, value));
  }
  return true;
}

// lr's value where the host holds it; a device-memory lr (read when the kernels run,
// so never here) only where the call's buffers are in device memory.
bool CheckLr(const StepParams& params, ScaleValues values, Error* error) {
  const double* on_device = params.lr_in_device_memory;
  if (on_device == nullptr) return CheckHyper("lr", params.lr, error);
  if (values == ScaleValues::kCheck) {
    return Fail(error, -1,
                "lr_in_device_memory is set, but this call steps host memory (rule: "
                "only the CUDA backend reads lr from device memory)");
  }
  if (reinterpret_cast<uintptr_t>(on_device) % alignof(double) != 0) {
    return Fail(error, -1,
                Format("lr_in_device_memory %p is not aligned to 8 bytes (rule: it "
                       "points to an fp64)", static_cast<const void*>(on_device)));
  }
  return true;
}

bool CheckBeta(const char* name, double value, Error* error) {
  if (!std::isfinite(value) || value < 0.0 || value >= 1.0) {
    return Fail(error, -1,
                Format("%s %.9g is outside [0, 1)", name, value));
  }
  return true;
}

// The fp32 constants the step uses (element.h MakeStepConstants, S3.6) are
// finite: a hyper-parameter past fp32's range (lr = 1e39, or lr / c1 or
// lr * weight_decay beyond FLT_MAX) would turn every weight it touches to inf or
// NaN. A device-memory lr is read when the kernels run: the constants made from
// it are not checked, eps and an L2 weight_decay still are.
bool CheckStepConstants(const StepParams& params, Error* error) {
  const bool lr_known = params.lr_in_device_memory == nullptr;
  const StepConstants k = MakeStepConstants(params);
  const struct {
    const char* name;
    float value;
    bool checked;
  } used[] = {
      {"lr / (1 - beta1^step)", k.step_size, lr_known},
      {params.adam_w_mode ? "1 - lr * weight_decay" : "weight_decay",
       params.adam_w_mode ? k.decay : k.weight_decay, lr_known || !params.adam_w_mode},
      {"eps", k.eps, true},
  };
  for (const auto& c : used) {
    if (!c.checked || !std::isinf(c.value)) continue;
    return Fail(error, -1,
                Format("%s is beyond fp32's range at step %" PRId64 " (lr %s, beta1 "
                       "%.9g, weight_decay %.9g, eps %.9g; rule: each fp32 constant of "
                       "the step is finite)",
                       c.name, params.step,
                       lr_known ? Format("%.9g", params.lr).c_str() : "in device memory",
                       params.beta1, params.weight_decay, params.eps));
  }
  // Below half fp32's smallest subnormal a positive eps would be added as 0: a
  // zero gradient on zero moments would then step 0 / 0 into NaN.
  if (params.eps > 0.0 && k.eps == 0.0f) {
    return Fail(error, -1,
                Format("eps %.9g rounds to 0 in fp32, where the step adds it (rule: a "
                       "positive eps stays positive in fp32, at least 2^-149; 0 means none)",
                       params.eps));
  }
  return true;
}

// One buffer of a slot, for the null and overlap checks.
struct Buffer {
  const char* name;
  const void* data;
  int64_t bytes;
};

// A range that runs past the top of the address space is no real buffer, and
// would wrap the overlap arithmetic below.
bool PastAddressSpace(const void* data, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(data) > UINTPTR_MAX - static_cast<uintptr_t>(bytes);
}

bool FailPastAddressSpace(Error* error, int64_t tensor, const char* name,
                          const void* data, int64_t bytes) {
  return Fail(error, tensor,
              Format("%s [%p, +%" PRId64 " bytes) runs past the end of the address "
                     "space; expected a real buffer",
                     name, data, bytes));
}

bool Overlap(uintptr_t a, int64_t a_bytes, uintptr_t b, int64_t b_bytes) {
  return a < b + static_cast<uintptr_t>(b_bytes) &&
         b < a + static_cast<uintptr_t>(a_bytes);
}

// Bytes of the scale slot a state of `dtype` in slot `s` reads and writes.
int64_t ScaleBytes(const TensorSlot& s, DType dtype) {
  return ScaleCount(dtype, s.first_index, s.numel, s.scale_block) *
         static_cast<int64_t>(sizeof(float));
}

bool CheckScale(int64_t tensor, const char* name, DType dtype, const char* buffer,
                const float* scale, int64_t count, ScaleValues values, Error* error) {
  if (count == 0) return true;
  if (scale == nullptr) {
    return Fail(error, tensor,
                Format("%s is null; an %s %s needs a scale slot", name,
                       DTypeName(dtype), buffer));
  }
  // Float slots: read and written as floats, and two aligned slots either are
  // the same slot or do not overlap at all.
  if (reinterpret_cast<uintptr_t>(scale) % alignof(float) != 0) {
    return Fail(error, tensor,
                Format("%s %p is not aligned to %zu bytes", name,
                       static_cast<const void*>(scale), alignof(float)));
  }
  const int64_t bytes = count * static_cast<int64_t>(sizeof(float));
  if (PastAddressSpace(scale, bytes)) {
    return FailPastAddressSpace(error, tensor, name, scale, bytes);
  }
  if (values == ScaleValues::kSkip) return true;
  for (int64_t j = 0; j < count; ++j) {
    const float value = scale[j];
    if (!std::isfinite(value) || !(value > 0.0f)) {
      const std::string which =
          count == 1 ? std::string(name) : Format("%s[%" PRId64 "]", name, j);
      return Fail(error, tensor,
                  Format("%s %.9g is not a valid scale (rule: a scale is a finite value > 0)",
                         which.c_str(), static_cast<double>(value)));
    }
  }
  return true;
}

// The block geometry of a slot with per-block scaled states (S2.9).
bool CheckBlocks(int64_t i, const TensorSlot& s, Error* error) {
  if (!IsBlockScaled(s.exp_avg_dtype) && !IsBlockScaled(s.exp_avg_sq_dtype) &&
      !IsBlockScaled(s.master_dtype)) {
    return true;
  }
  if (!IsValidScaleBlock(s.scale_block)) {
    return Fail(error, i,
                Format("scale_block %d is not a power of two in [%d, %d]; per-block "
                       "scaled states need one",
                       s.scale_block, kMinScaleBlock, kMaxScaleBlock));
  }
  if (NeedsMeasuringPass(s.exp_avg_dtype) || NeedsMeasuringPass(s.exp_avg_sq_dtype) ||
      NeedsMeasuringPass(s.master_dtype)) {
    return Fail(error, i,
                "per-block and per-tensor scaled states do not mix in one tensor "
                "(exp_avg, exp_avg_sq and master_param); expected per-block scales "
                "beside unscaled states only");
  }
  if (s.first_index < 0 || s.first_index > INT64_MAX / 8 - s.numel) {
    return Fail(error, i,
                Format("first_index %" PRId64 " is outside [0, %" PRId64 "]", s.first_index,
                       INT64_MAX / 8 - s.numel));
  }
  const DType states[3] = {s.exp_avg_dtype, s.exp_avg_sq_dtype, s.master_dtype};
  for (const DType d : states) {
    if (FormatOf(d).item_bits == 4 && s.first_index % 2 != 0) {
      return Fail(error, i,
                  Format("first_index %" PRId64 " is odd; %s states pack two elements "
                         "per byte and need an even first_index",
                         s.first_index, DTypeName(d)));
    }
  }
  return true;
}

// A rounding field's value: 0 (nearest) or 1 (stochastic).
bool CheckRoundingCode(int64_t i, const char* field, Rounding rounding, Error* error) {
  if (rounding == Rounding::kNearest || rounding == Rounding::kStochastic) return true;
  return Fail(error, i,
              Format("%s %d is not a rounding; expected 0 (nearest) or 1 (stochastic)",
                     field, static_cast<int32_t>(rounding)));
}

// The states' roundings: stochastic rounding exists for a signed E2M1 exp_avg
// and an unsigned E3M1 or E4M4 exp_avg_sq (S2.13), and for a bf16 param that is the
// weight's only copy (S2.14), whose bits are keyed by first_index as a block's are.
bool CheckRounding(int64_t i, const TensorSlot& s, Error* error) {
  if (!CheckRoundingCode(i, "exp_avg_rounding", s.exp_avg_rounding, error) ||
      !CheckRoundingCode(i, "exp_avg_sq_rounding", s.exp_avg_sq_rounding, error) ||
      !CheckRoundingCode(i, "param_rounding", s.param_rounding, error)) {
    return false;
  }
  if (s.exp_avg_rounding == Rounding::kStochastic &&
      s.exp_avg_dtype != DType::kFloat4E2M1Block) {
    return Fail(error, i,
                Format("exp_avg_rounding 1 (stochastic) is not allowed for an exp_avg_dtype "
                       "%d (%s) exp_avg; stochastic rounding needs fp4-block",
                       Code(s.exp_avg_dtype), DTypeName(s.exp_avg_dtype)));
  }
  if (s.exp_avg_sq_rounding == Rounding::kStochastic &&
      s.exp_avg_sq_dtype != DType::kUFloat4E3M1Block &&
      s.exp_avg_sq_dtype != DType::kUFloat8E4M4Block) {
    return Fail(error, i,
                Format("exp_avg_sq_rounding 1 (stochastic) is not allowed for an "
                       "exp_avg_sq_dtype %d (%s) exp_avg_sq; stochastic rounding needs "
                       "ufp4-block or ufp8-block",
                       Code(s.exp_avg_sq_dtype), DTypeName(s.exp_avg_sq_dtype)));
  }
  if (s.param_rounding != Rounding::kStochastic) return true;
  if (s.param_dtype != DType::kBFloat16 || s.master_dtype != DType::kNone) {
    return Fail(error, i,
                Format("param_rounding 1 (stochastic) is not allowed for a param_dtype %d "
                       "(%s) param with master_dtype %d (%s); stochastic rounding needs a "
                       "bf16 param with no master",
                       Code(s.param_dtype), DTypeName(s.param_dtype), Code(s.master_dtype),
                       DTypeName(s.master_dtype)));
  }
  if (s.first_index < 0 || s.first_index > INT64_MAX / 8 - s.numel) {
    return Fail(error, i,
                Format("first_index %" PRId64 " is outside [0, %" PRId64 "]", s.first_index,
                       INT64_MAX / 8 - s.numel));
  }
  return true;
}

bool CheckSlot(int64_t i, const TensorSlot& s, ScaleValues values, Error* error) {
  if (s.numel < 0) {
    return Fail(error, i, Format("numel %" PRId64 " is negative; expected >= 0", s.numel));
  }
  // Element sizes are at most 4 bytes: byte counts stay below INT64_MAX / 2.
  if (s.numel > INT64_MAX / 8) {
    return Fail(error, i, Format("numel %" PRId64 " is too large; expected <= %" PRId64,
                                 s.numel, INT64_MAX / 8));
  }
  const struct {
    const char* field;
    DType dtype;
    FormatRole role;
    const char* what;
  } dtypes[] = {
      {"param_dtype", s.param_dtype, kRoleValue, "a parameter"},
      {"grad_dtype", s.grad_dtype, kRoleValue, "a gradient"},
      {"exp_avg_dtype", s.exp_avg_dtype, kRoleExpAvg, "exp_avg"},
      {"exp_avg_sq_dtype", s.exp_avg_sq_dtype, kRoleExpAvgSq, "exp_avg_sq"},
      {"master_dtype", s.master_dtype, kRoleMaster, "a master"},
  };
  for (const auto& d : dtypes) {
    if (!HasRole(d.dtype, d.role)) {
      return Fail(error, i,
                  Format("%s %d (%s) is not allowed for %s; expected %s", d.field,
                         Code(d.dtype), DTypeName(d.dtype), d.what,
                         RoleFormats(d.role).c_str()));
    }
  }
  if (s.param_dtype == DType::kFloat32 && s.master_dtype != DType::kNone) {
    return Fail(error, i,
                Format("master_dtype %d (%s) is not allowed beside an fp32 param; "
                       "an fp32 param is its own master (expected none)",
                       Code(s.master_dtype), DTypeName(s.master_dtype)));
  }
  if (s.master_dtype == DType::kInt16Remainder && s.param_dtype != DType::kBFloat16) {
    return Fail(error, i,
                Format("master_dtype %d (remainder) requires a bf16 param; "
                       "param_dtype is %d (%s)",
                       Code(s.master_dtype), Code(s.param_dtype),
                       DTypeName(s.param_dtype)));
  }
  const bool has_master = s.master_dtype != DType::kNone;

  if (!CheckRounding(i, s, error) || !CheckBlocks(i, s, error) ||
      !CheckScale(i, "exp_avg_scale", s.exp_avg_dtype, "exp_avg", s.exp_avg_scale,
                  ScaleBytes(s, s.exp_avg_dtype) / 4, values, error) ||
      !CheckScale(i, "exp_avg_sq_scale", s.exp_avg_sq_dtype, "exp_avg_sq",
                  s.exp_avg_sq_scale, ScaleBytes(s, s.exp_avg_sq_dtype) / 4, values,
                  error) ||
      !CheckScale(i, "master_scale", s.master_dtype, "master_param", s.master_scale,
                  ScaleBytes(s, s.master_dtype) / 4, values, error)) {
    return false;
  }

  Buffer buffers[5] = {
      {"param", s.param, BufferBytes(s.param_dtype, s.numel)},
      {"grad", s.grad, BufferBytes(s.grad_dtype, s.numel)},
      {"exp_avg", s.exp_avg, BufferBytes(s.exp_avg_dtype, s.numel)},
      {"exp_avg_sq", s.exp_avg_sq, BufferBytes(s.exp_avg_sq_dtype, s.numel)},
      {"master_param", s.master_param, BufferBytes(s.master_dtype, s.numel)},
  };
  const int num_buffers = has_master ? 5 : 4;
  if (s.numel > 0) {
    for (int b = 0; b < num_buffers; ++b) {
      if (buffers[b].data == nullptr) {
        return Fail(error, i,
                    Format("%s is null but numel is %" PRId64, buffers[b].name,
                           s.numel));
      }
      if (PastAddressSpace(buffers[b].data, buffers[b].bytes)) {
        return FailPastAddressSpace(error, i, buffers[b].name, buffers[b].data,
                                    buffers[b].bytes);
      }
    }
    for (int a = 0; a < num_buffers; ++a) {
      for (int b = a + 1; b < num_buffers; ++b) {
        const uintptr_t pa = reinterpret_cast<uintptr_t>(buffers[a].data);
        const uintptr_t pb = reinterpret_cast<uintptr_t>(buffers[b].data);
        if (Overlap(pa, buffers[a].bytes, pb, buffers[b].bytes)) {
          return Fail(error, i,
                      Format("%s [%p, +%" PRId64 " bytes) overlaps %s [%p, +%" PRId64
                             " bytes); the buffers of one tensor must not share memory",
                             buffers[a].name, buffers[a].data, buffers[a].bytes,
                             buffers[b].name, buffers[b].data, buffers[b].bytes));
        }
      }
    }
  }

  // Scale slots are written after the step: they must not alias each other or
  // the tensor's data.
  const struct {
    const char* name;
    const float* slot;
    int64_t bytes;
  } scales[3] = {
      {"exp_avg_scale", s.exp_avg_scale, ScaleBytes(s, s.exp_avg_dtype)},
      {"exp_avg_sq_scale", s.exp_avg_sq_scale, ScaleBytes(s, s.exp_avg_sq_dtype)},
      {"master_scale", s.master_scale, ScaleBytes(s, s.master_dtype)},
  };
  for (int a = 0; a < 3; ++a) {
    if (scales[a].bytes == 0) continue;
    const uintptr_t pa = reinterpret_cast<uintptr_t>(scales[a].slot);
    for (int b = a + 1; b < 3; ++b) {
      if (scales[b].bytes != 0 &&
          Overlap(pa, scales[a].bytes, reinterpret_cast<uintptr_t>(scales[b].slot),
                  scales[b].bytes)) {
        return Fail(error, i,
                    Format("%s [%p, +%" PRId64 " bytes) overlaps %s [%p, +%" PRId64
                           " bytes); each scaled state needs its own slot",
                           scales[a].name, static_cast<const void*>(scales[a].slot),
                           scales[a].bytes, scales[b].name,
                           static_cast<const void*>(scales[b].slot), scales[b].bytes));
      }
    }
    if (s.numel == 0) continue;
    for (int b = 0; b < num_buffers; ++b) {
      const uintptr_t pb = reinterpret_cast<uintptr_t>(buffers[b].data);
      if (Overlap(pa, scales[a].bytes, pb, buffers[b].bytes)) {
        return Fail(error, i,
                    Format("%s [%p, +%" PRId64 " bytes) overlaps %s [%p, +%" PRId64
                           " bytes); a scale slot must not share memory with data",
                           scales[a].name, static_cast<const void*>(scales[a].slot),
                           scales[a].bytes, buffers[b].name, buffers[b].data,
                           buffers[b].bytes));
      }
    }
  }
  return true;
}

// Calls fn(name, begin, bytes, written) for every buffer and scale slot of `s`
// that a step reads or writes: the scale slots in use (4 bytes per scale; an
// empty tensor's per-tensor scales are still written), and the data buffers of a
// tensor that is not empty.
template <class Fn>
void ForEachRegion(const TensorSlot& s, const Fn& fn) {
  const struct {
    const char* name;
    const float* slot;
    DType dtype;
  } scales[3] = {{"exp_avg_scale", s.exp_avg_scale, s.exp_avg_dtype},
                 {"exp_avg_sq_scale", s.exp_avg_sq_scale, s.exp_avg_sq_dtype},
                 {"master_scale", s.master_scale, s.master_dtype}};
  for (const auto& scale : scales) {
    const int64_t bytes = ScaleBytes(s, scale.dtype);
    if (bytes != 0) fn(scale.name, reinterpret_cast<uintptr_t>(scale.slot), bytes, true);
  }
  if (s.numel == 0) return;
  const struct {
    const char* name;
    const void* data;
    DType dtype;
    bool written;
  } buffers[5] = {{"param", s.param, s.param_dtype, true},
                  {"grad", s.grad, s.grad_dtype, false},
                  {"exp_avg", s.exp_avg, s.exp_avg_dtype, true},
                  {"exp_avg_sq", s.exp_avg_sq, s.exp_avg_sq_dtype, true},
                  {"master_param", s.master_param, s.master_dtype, true}};
  for (const auto& b : buffers) {
    if (b.dtype == DType::kNone) continue;
    fn(b.name, reinterpret_cast<uintptr_t>(b.data), BufferBytes(b.dtype, s.numel), b.written);
  }
}

// Buffers of different tensors may not overlap either: work items of
// different tensors run on different threads. Gradients, only ever read, may
// be shared. Scale slots are read before the step and written after it, so
// one lying in another tensor's data (or shared by two tensors) would make the
// result depend on the order of work; they count as written buffers. Sorting by
// address finds any overlap in O(n log n).
bool CheckCrossTensorOverlap(const TensorSlot* slots, int64_t count, Error* error) {
  struct Interval {
    uintptr_t begin, end;
    int64_t tensor;
    const char* name;
    bool written;
  };
  std::vector<Interval> intervals;
  intervals.reserve(static_cast<size_t>(count) * 8);
  for (int64_t i = 0; i < count; ++i) {
    ForEachRegion(slots[i], [&](const char* name, uintptr_t begin, int64_t bytes,
                                bool written) {
      intervals.push_back({begin, begin + static_cast<uintptr_t>(bytes), i, name, written});
    });
  }
  std::sort(intervals.begin(), intervals.end(), [](const Interval& a, const Interval& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.tensor < b.tensor;
  });
  // The earlier interval reaching furthest, among all and among written ones.
  const Interval* reach_all = nullptr;
  const Interval* reach_written = nullptr;
  for (const Interval& cur : intervals) {
    const Interval* hit = cur.written ? reach_all : reach_written;
    if (hit != nullptr && cur.begin < hit->end) {
      // Same-tensor overlaps were rejected per slot, so this pair spans two
      // tensors; blame the later one.
      const Interval& first = hit->tensor < cur.tensor ? *hit : cur;
      const Interval& second = hit->tensor < cur.tensor ? cur : *hit;
      return Fail(error, second.tensor,
                  Format("%s [%p, +%" PRIu64 " bytes) overlaps {other}'s %s [%p, +%" PRIu64
                         " bytes); tensors must not share memory (only gradients "
                         "may be shared)",
                         second.name, reinterpret_cast<void*>(second.begin),
                         static_cast<uint64_t>(second.end - second.begin),
                         first.name, reinterpret_cast<void*>(first.begin),
                         static_cast<uint64_t>(first.end - first.begin)),
                  first.tensor);
    }
    if (reach_all == nullptr || cur.end > reach_all->end) reach_all = &cur;
    if (cur.written && (reach_written == nullptr || cur.end > reach_written->end)) {
      reach_written = &cur;
    }
  }
  return true;
}

// The list itself: a count and, when there are slots, a pointer to them.
bool CheckSlotList(const TensorSlot* slots, int64_t count, Error* error) {
  if (count < 0) {
    return Fail(error, -1, Format("count %" PRId64 " is negative; expected >= 0", count));
  }
  if (count > 0 && slots == nullptr) {
    return Fail(error, -1, Format("slots is null but count is %" PRId64, count));
  }
  return true;
}

// Every slot, then the buffers shared between tensors.
bool CheckSlots(const TensorSlot* slots, int64_t count, ScaleValues values,
                Error* error) {
  for (int64_t i = 0; i < count; ++i) {
    if (!CheckSlot(i, slots[i], values, error)) return false;
  }
  return count < 2 || CheckCrossTensorOverlap(slots, count, error);
}

}  // namespace

bool CheckRegionApart(const TensorSlot* slots, int64_t count, const void* region,
                      int64_t bytes, const char* name, Error* error) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(region);
  for (int64_t i = 0; i < count; ++i) {
    bool apart = true;
    ForEachRegion(slots[i], [&](const char* buffer, uintptr_t at, int64_t size, bool) {
      if (apart && Overlap(begin, bytes, at, size)) {
        apart = Fail(error, i,
                     Format("%s [%p, +%" PRId64 " bytes) overlaps the tensor's %s [%p, +%" PRId64
                            " bytes); it must not share memory with the call's buffers",
                            name, region, bytes, buffer, reinterpret_cast<void*>(at), size));
      }
    });
    if (!apart) return false;
  }
  return true;
}

bool ValidateStep(const TensorSlot* slots, int64_t count, const StepParams& params,
                  Error* error, ScaleValues scale_values) {
  if (!CheckSlotList(slots, count, error)) return false;
  if (!CheckLr(params, scale_values, error) || !CheckBeta("beta1", params.beta1, error) ||
      !CheckBeta("beta2", params.beta2, error) || !CheckHyper("eps", params.eps, error) ||
      !CheckHyper("weight_decay", params.weight_decay, error)) {
    return false;
  }
  if (params.step < 1) {
    return Fail(error, -1,
                Format("step %" PRId64 " is less than 1; steps are counted from 1",
                       params.step));
  }
  if (!CheckStepConstants(params, error)) return false;
  return CheckSlots(slots, count, scale_values, error);
}

bool ValidateSlots(const TensorSlot* slots, int64_t count, Error* error,
                   ScaleValues scale_values) {
  return CheckSlotList(slots, count, error) &&
         CheckSlots(slots, count, scale_values, error);
}

bool ValidateConvert(const void* src, DType src_dtype, const void* dst,
                     DType dst_dtype, int64_t numel, float scale, Error* error) {
  const struct {
    const char* field;
    DType dtype;
  } ends[2] = {{"src_dtype", src_dtype}, {"dst_dtype", dst_dtype}};
  for (const auto& e : ends) {
    // Every moment format with at most one scale is a cast.
    if (!HasRole(e.dtype, kRoleMoment) || IsBlockScaled(e.dtype)) {
      return Fail(error, -1,
                  Format("%s %d (%s) is not allowed for a conversion; expected %s",
                         e.field, Code(e.dtype), DTypeName(e.dtype),
                         RoleFormats(kRoleMoment, true).c_str()));
    }
  }
  if (numel < 0) {
    return Fail(error, -1, Format("numel %" PRId64 " is negative; expected >= 0", numel));
  }
  if (numel > INT64_MAX / 8) {
    return Fail(error, -1, Format("numel %" PRId64 " is too large; expected <= %" PRId64,
                                  numel, INT64_MAX / 8));
  }
  if ((IsScaled(src_dtype) || IsScaled(dst_dtype)) &&
      (!std::isfinite(scale) || !(scale > 0.0f))) {
    return Fail(error, -1,
                Format("scale %.9g is not a valid scale (rule: a scale is a finite value > 0)",
                       static_cast<double>(scale)));
  }
  if (numel == 0) return true;
  if (src == nullptr) {
    return Fail(error, -1, Format("src is null but numel is %" PRId64, numel));
  }
  if (dst == nullptr) {
    return Fail(error, -1, Format("dst is null but numel is %" PRId64, numel));
  }
  const int64_t src_bytes = BufferBytes(src_dtype, numel);
  const int64_t dst_bytes = BufferBytes(dst_dtype, numel);
  if (PastAddressSpace(src, src_bytes)) {
    return FailPastAddressSpace(error, -1, "src", src, src_bytes);
  }
  if (PastAddressSpace(dst, dst_bytes)) {
    return FailPastAddressSpace(error, -1, "dst", dst, dst_bytes);
  }
  const bool in_place = src == dst && FormatOf(src_dtype).item_bits == FormatOf(dst_dtype).item_bits;
  if (!in_place && Overlap(reinterpret_cast<uintptr_t>(src), src_bytes,
                           reinterpret_cast<uintptr_t>(dst), dst_bytes)) {
    return Fail(error, -1,
                Format("src [%p, +%" PRId64 " bytes) overlaps dst [%p, +%" PRId64
                       " bytes); only an in-place conversion between dtypes of one "
                       "size may share memory",
                       src, src_bytes, dst, dst_bytes));
  }
  return true;
}

}  // namespace internal

void SetError(Error* error, int64_t tensor, const std::string& rule, int64_t other_tensor) {
  if (error == nullptr) return;
  error->tensor_index = tensor;
  error->other_tensor_index = other_tensor;
  error->rule = rule;
  std::string text = rule;
  const std::string placeholder = "{other}";
  const size_t at = text.find(placeholder);
  if (at != std::string::npos) {
    text.replace(at, placeholder.size(), other_tensor >= 0
                                             ? "tensor " + std::to_string(other_tensor)
                                             : std::string("another tensor"));
  }
  error->message = tensor >= 0 ? "tensor " + std::to_string(tensor) + ": " + text : text;
}

}  // namespace shardadam
