// shardadam._C: turns the Python package's flat lists of pointers, dtype tags and
// element counts into the core's TensorSlot structures and calls it with the GIL
// released. Knows nothing of torch.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardadam/adam.h"
#if defined(SHARDADAM_WITH_CUDA)
#include "shardadam/adam_cuda.h"
#endif

namespace nb = nanobind;

namespace shardadam {
namespace {

// Column order of one tensor in the flat `slots` list given to adam_step. The
// module exports the names in this order (SLOT_COLUMN_NAMES): Python places each
// value by name, so reordering here cannot misplace a pointer.
enum Column : size_t {
  kNumel, kParam, kParamDtype, kGrad, kGradDtype,
  kExpAvg, kExpAvgDtype, kExpAvgScale,
  kExpAvgSq, kExpAvgSqDtype, kExpAvgSqScale,
  kMaster, kMasterDtype, kMasterScale,
  kFirstIndex, kScaleBlock,
  kExpAvgRounding, kRoundingKey, kParamRounding, kExpAvgSqRounding,
  kSlotColumns,
};
constexpr const char* kColumnNames[] = {
    "numel", "param", "param_dtype", "grad", "grad_dtype",
    "exp_avg", "exp_avg_dtype", "exp_avg_scale",
    "exp_avg_sq", "exp_avg_sq_dtype", "exp_avg_sq_scale",
    "master_param", "master_dtype", "master_scale",
    "first_index", "scale_block",
    "exp_avg_rounding", "rounding_key", "param_rounding", "exp_avg_sq_rounding",
};
static_assert(sizeof(kColumnNames) / sizeof(kColumnNames[0]) == kSlotColumns,
              "one name per column");

template <class T>
T* Pointer(int64_t address) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

// A dtype tag as the core's enum. Unknown tags that fit its int32 pass through
// as they are: the core's validation rejects them, naming the tensor and
// buffer. Wider ones would wrap into valid tags, so they are refused here.
// `tensor`: the slot's index, or -1 outside a slot list.
// Raises `type` with the core's sentence as its text and the Error's fields as
// attributes (tensor_index, other_tensor_index, rule): callers that name tensors
// their own way build their message from those, never from the text. Needs the GIL.
[[noreturn]] void Raise(PyObject* type, const Error& error) {
  nb::object exception = nb::steal(PyObject_CallFunction(type, "s", error.message.c_str()));
  if (!exception.is_valid()) throw nb::python_error();
  nb::setattr(exception, "tensor_index", nb::int_(error.tensor_index));
  nb::setattr(exception, "other_tensor_index", nb::int_(error.other_tensor_index));
  nb::setattr(exception, "rule", nb::str(error.rule.c_str()));
  PyErr_SetObject(type, exception.ptr());
  throw nb::python_error();
}

DType Tag(int64_t value, const char* caller, const char* column, int64_t tensor = -1) {
  if (value != static_cast<int32_t>(value)) {
    Error error;
    SetError(&error, tensor,
             std::string(column) + " tag " + std::to_string(value) + " is out of range");
    error.message = std::string(caller) + ": " + error.message;
    Raise(PyExc_ValueError, error);
  }
  return static_cast<DType>(static_cast<int32_t>(value));
}

// Runs `call(Error*)` -> Status with the GIL released, then turns a failure into
// ValueError (bad input, nothing written) or RuntimeError (the CUDA runtime refused).
template <class Call>
void RunReleased(const Call& call) {
  Error error;
  Status status;
  {
    nb::gil_scoped_release release;
    status = call(&error);
  }
  if (status == Status::kDeviceError) Raise(PyExc_RuntimeError, error);
  if (status != Status::kOk) Raise(PyExc_ValueError, error);
}

// The format table (formats.h) for the Python registry to check itself against:
// (tag, name, item_bits, scaling, scale_block, scale_target, roles, zero_bound,
// overflow_bound) per state format, roles among "moment" and "master".
nb::tuple FormatsTuple() {
  nb::list formats;
  for (int i = 0; i < kNumDTypes; ++i) {
    const FormatInfo f = FormatOf(static_cast<DType>(i));
    if ((f.roles & (kRoleMoment | kRoleMaster)) == 0 || f.item_bits == 0) continue;
    nb::list roles;
    // "moment": either moment; a format only one moment may hold names it.
    if ((f.roles & kRoleMoment) == kRoleMoment) {
      roles.append("moment");
    } else if (f.roles & kRoleExpAvg) {
      roles.append("exp_avg");
    } else if (f.roles & kRoleExpAvgSq) {
      roles.append("exp_avg_sq");
    }
    if (f.roles & kRoleMaster) roles.append("master");
    const char* scaling = f.scaling == Scaling::kPerTensor  ? "tensor"
                          : f.scaling == Scaling::kPerBlock ? "block"
                                                            : "none";
    formats.append(nb::make_tuple(static_cast<int>(f.dtype), f.name, f.item_bits,
                                  scaling, f.scale_block, f.scale_target,
                                  nb::tuple(roles), f.zero_bound, f.overflow_bound));
  }
  return nb::tuple(formats);
}

std::vector<TensorSlot> SlotsFromList(const char* caller, const std::vector<int64_t>& slots) {
  if (slots.size() % kSlotColumns != 0) {
    throw nb::value_error((std::string(caller) + ": slots holds " +
                           std::to_string(slots.size()) + " values, not a multiple of " +
                           std::to_string(static_cast<int>(kSlotColumns)))
                              .c_str());
  }
  std::vector<TensorSlot> tensors(slots.size() / kSlotColumns);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t* row = slots.data() + i * kSlotColumns;
    const auto tag = [&](Column column, const char* name) {
      return Tag(row[column], caller, name, static_cast<int64_t>(i));
    };
    TensorSlot& t = tensors[i];
    t.numel = row[kNumel];
    t.param = Pointer<void>(row[kParam]);
    t.param_dtype = tag(kParamDtype, "param_dtype");
    t.grad = Pointer<const void>(row[kGrad]);
    t.grad_dtype = tag(kGradDtype, "grad_dtype");
    t.exp_avg = Pointer<void>(row[kExpAvg]);
    t.exp_avg_dtype = tag(kExpAvgDtype, "exp_avg_dtype");
    t.exp_avg_scale = Pointer<float>(row[kExpAvgScale]);
    t.exp_avg_sq = Pointer<void>(row[kExpAvgSq]);
    t.exp_avg_sq_dtype = tag(kExpAvgSqDtype, "exp_avg_sq_dtype");
    t.exp_avg_sq_scale = Pointer<float>(row[kExpAvgSqScale]);
    t.master_param = Pointer<void>(row[kMaster]);
    t.master_dtype = tag(kMasterDtype, "master_dtype");
    t.master_scale = Pointer<float>(row[kMasterScale]);
    t.first_index = row[kFirstIndex];
    // Wider values would wrap into valid sizes: the core sees an invalid one.
    t.scale_block = row[kScaleBlock] == static_cast<int32_t>(row[kScaleBlock])
                        ? static_cast<int32_t>(row[kScaleBlock])
                        : -1;
    // As the tags: a wider value would wrap into a valid rounding; -1 is refused.
    const auto rounding = [&](Column column) {
      return static_cast<Rounding>(row[column] == static_cast<int32_t>(row[column])
                                       ? static_cast<int32_t>(row[column])
                                       : -1);
    };
    t.exp_avg_rounding = rounding(kExpAvgRounding);
    t.param_rounding = rounding(kParamRounding);
    t.exp_avg_sq_rounding = rounding(kExpAvgSqRounding);
    if (row[kRoundingKey] != static_cast<uint32_t>(row[kRoundingKey])) {
      Error error;
      SetError(&error, static_cast<int64_t>(i),
               "rounding_key " + std::to_string(row[kRoundingKey]) +
                   " is out of range; expected [0, 2^32)");
      error.message = std::string(caller) + ": " + error.message;
      Raise(PyExc_ValueError, error);
    }
    t.rounding_key = static_cast<uint32_t>(row[kRoundingKey]);
  }
  return tensors;
}

StepParams MakeParams(double lr, double beta1, double beta2, double eps,
                      double weight_decay, bool adam_w_mode, bool bias_correction,
                      int64_t step) {
  StepParams params;
  params.lr = lr;
  params.beta1 = beta1;
  params.beta2 = beta2;
  params.eps = eps;
  params.weight_decay = weight_decay;
  params.adam_w_mode = adam_w_mode;
  params.bias_correction = bias_correction;
  params.step = step;
  return params;
}

void AdamStepFromList(const std::vector<int64_t>& slots, double lr, double beta1,
                      double beta2, double eps, double weight_decay, bool adam_w_mode,
                      bool bias_correction, int64_t step, int num_threads) {
  const std::vector<TensorSlot> tensors = SlotsFromList("adam_step", slots);
  const StepParams params = MakeParams(lr, beta1, beta2, eps, weight_decay, adam_w_mode,
                                       bias_correction, step);
  RunReleased([&](Error* error) {
    return AdamStep(tensors.data(), static_cast<int64_t>(tensors.size()), params,
                    num_threads, error);
  });
}

void CheckStepSlotsFromList(const std::vector<int64_t>& slots,
                            bool scales_in_device_memory) {
  const std::vector<TensorSlot> tensors = SlotsFromList("check_step_slots", slots);
  RunReleased([&](Error* error) {
    return CheckStepSlots(tensors.data(), static_cast<int64_t>(tensors.size()),
                          scales_in_device_memory, error);
  });
}

#if defined(SHARDADAM_WITH_CUDA)
void CheckCudaStepSlotsFromList(const std::vector<int64_t>& slots) {
  const std::vector<TensorSlot> tensors = SlotsFromList("check_cuda_step_slots", slots);
  RunReleased([&](Error* error) {
    return CheckCudaStepSlots(tensors.data(), static_cast<int64_t>(tensors.size()), error);
  });
}

void AdamStepCudaFromList(const std::vector<int64_t>& slots, double lr, double beta1,
                          double beta2, double eps, double weight_decay, bool adam_w_mode,
                          bool bias_correction, int64_t step, int64_t workspace,
                          int64_t workspace_bytes, int64_t stream, int device,
                          int64_t lr_in_device_memory) {
  const std::vector<TensorSlot> tensors = SlotsFromList("adam_step_cuda", slots);
  StepParams params = MakeParams(lr, beta1, beta2, eps, weight_decay, adam_w_mode,
                                 bias_correction, step);
  params.lr_in_device_memory = Pointer<const double>(lr_in_device_memory);
  RunReleased([&](Error* error) {
    return AdamStepCuda(tensors.data(), static_cast<int64_t>(tensors.size()), params,
                        Pointer<void>(workspace), workspace_bytes, Pointer<void>(stream),
                        device, error);
  });
}
#endif

void ConvertFromPointers(int64_t src, int64_t src_dtype, int64_t dst, int64_t dst_dtype,
                         int64_t numel, double scale_value, int num_threads) {
  // Scales are fp32: a positive finite value that fp32 cannot hold would reach the
  // core as 0 or inf and be reported as such; name what the caller passed.
  const float scale = static_cast<float>(scale_value);
  const bool representable = std::isfinite(scale) && scale > 0;
  if (std::isfinite(scale_value) && scale_value > 0 && !representable) {
    char text[64];
    std::snprintf(text, sizeof(text), "%.9g", scale_value);
    throw nb::value_error((std::string("convert: scale ") + text +
                           " is outside fp32's range; expected a finite fp32 value > 0")
                              .c_str());
  }
  // Tags are read while the GIL is held: a bad one raises a Python exception.
  const DType src_tag = Tag(src_dtype, "convert", "src_dtype");
  const DType dst_tag = Tag(dst_dtype, "convert", "dst_dtype");
  RunReleased([&](Error* error) {
    return Convert(Pointer<const void>(src), src_tag, Pointer<void>(dst), dst_tag, numel,
                   scale, num_threads, error);
  });
}

float MeasureScaleFromPointer(int64_t src, int64_t numel, int64_t dtype,
                              int num_threads) {
  if (numel < 0) throw nb::value_error("measure_scale: numel must be >= 0");
  if (numel > 0 && src == 0) throw nb::value_error("measure_scale: null buffer");
  // The core gives 1 for any unscaled dtype; an unknown tag is a caller's bug.
  if (dtype < static_cast<int64_t>(DType::kNone) ||
      dtype > static_cast<int64_t>(DType::kInt16Remainder)) {
    throw nb::value_error(
        ("measure_scale: dtype tag " + std::to_string(dtype) + " is not a dtype").c_str());
  }
  nb::gil_scoped_release release;
  return MeasureScale(Pointer<const float>(src), numel, static_cast<DType>(dtype),
                      num_threads);
}

void SetThreadRuntimeByName(const std::string& name) {
  if (name == "auto") {
    SetThreadRuntime(ThreadRuntime::kAuto);
  } else if (name == "pool") {
    SetThreadRuntime(ThreadRuntime::kOwnPool);
  } else {
    throw nb::value_error(("set_thread_runtime: runtime must be \"auto\" or \"pool\", got \"" +
                           name + "\"").c_str());
  }
}

nb::dict Info() {
  nb::dict info;
  info["version"] = Version();
  info["simd_target"] = ChosenTarget();
  info["supported_targets"] = SupportedTargets();
  info["default_threads"] = DefaultThreads();
  info["thread_runtime"] = ThreadRuntimeName();
#if defined(SHARDADAM_WITH_CUDA)
  info["cuda"] = true;
  info["cuda_archs"] = CudaArchitectures();
  info["cuda_devices"] = CudaDeviceCount();
  // The state formats the CUDA kernels step (the package sends the others' batches
  // to the torch path).
  nb::list formats;
  for (int tag = 0; tag < kNumDTypes; ++tag) {
    if (CudaSupportsFormat(static_cast<DType>(tag))) formats.append(tag);
  }
  info["cuda_formats"] = formats;
#else
  info["cuda"] = false;
  info["cuda_archs"] = "";
  info["cuda_devices"] = 0;
  info["cuda_formats"] = nb::list();
#endif
  return info;
}

}  // namespace
}  // namespace shardadam

NB_MODULE(_C, m) {
  using namespace shardadam;
  m.doc() = "shardadam C++ core: fused Adam/AdamW over raw buffers";
  m.attr("DTYPE_NONE") = static_cast<int>(DType::kNone);
  m.attr("DTYPE_FLOAT32") = static_cast<int>(DType::kFloat32);
  m.attr("DTYPE_FLOAT16") = static_cast<int>(DType::kFloat16);
  m.attr("DTYPE_BFLOAT16") = static_cast<int>(DType::kBFloat16);
  m.attr("DTYPE_FLOAT8_E4M3") = static_cast<int>(DType::kFloat8E4M3);
  m.attr("DTYPE_INT16_REMAINDER") = static_cast<int>(DType::kInt16Remainder);
  m.attr("FORMATS") = FormatsTuple();
  m.attr("MIN_SCALE_BLOCK") = kMinScaleBlock;
  m.attr("MAX_SCALE_BLOCK") = kMaxScaleBlock;
  m.attr("SLOT_COLUMNS") = static_cast<int>(kSlotColumns);
  nb::list names;
  for (const char* name : kColumnNames) names.append(name);
  m.attr("SLOT_COLUMN_NAMES") = nb::tuple(names);
  m.def("adam_step", &AdamStepFromList, nb::arg("slots"), nb::arg("lr"),
        nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"), nb::arg("weight_decay"),
        nb::arg("adam_w_mode"), nb::arg("bias_correction"), nb::arg("step"),
        nb::arg("num_threads"),
        "One Adam/AdamW step over tensors given as a flat list of SLOT_COLUMNS ints "
        "each, in the order SLOT_COLUMN_NAMES names them (numel, then "
        "pointer/dtype/scale-pointer per buffer). Validates "
        "everything first; raises ValueError and writes nothing on bad input.");
  m.def("check_step_slots", &CheckStepSlotsFromList, nb::arg("slots"),
        nb::arg("scales_in_device_memory"),
        "adam_step's checks of the slots alone (no hyper-parameters), writing nothing: "
        "raises ValueError as adam_step would. For one step split into several calls.");
  m.def("convert", &ConvertFromPointers, nb::arg("src"), nb::arg("src_dtype"),
        nb::arg("dst"), nb::arg("dst_dtype"), nb::arg("numel"), nb::arg("scale"),
        nb::arg("num_threads"),
        "Element-wise cast between storage dtypes, bit-exact with torch's .to().");
  m.def("measure_scale", &MeasureScaleFromPointer, nb::arg("src"), nb::arg("numel"),
        nb::arg("dtype"), nb::arg("num_threads"),
        "The per-tensor scale for storing fp32 values as `dtype`.");
#if defined(SHARDADAM_WITH_CUDA)
  m.def("adam_step_cuda", &AdamStepCudaFromList, nb::arg("slots"), nb::arg("lr"),
        nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"), nb::arg("weight_decay"),
        nb::arg("adam_w_mode"), nb::arg("bias_correction"), nb::arg("step"),
        nb::arg("workspace"), nb::arg("workspace_bytes"), nb::arg("stream"),
        nb::arg("device") = -1, nb::arg("lr_in_device_memory") = 0,
        "adam_step for tensors in CUDA device `device`'s memory (-1: the current "
        "device), enqueued on `stream` (a cudaStream_t as int) without waiting. "
        "`lr_in_device_memory`, where not 0, points to an fp64 in device memory that "
        "the kernels read as lr when they run (`lr` is then not used; its value is not "
        "checked). `workspace` points to "
        "cuda_workspace_bytes(n) bytes of device scratch. Raises ValueError (nothing "
        "enqueued) on bad input, RuntimeError if the CUDA runtime refuses a launch.");
  m.def("check_cuda_step_slots", &CheckCudaStepSlotsFromList, nb::arg("slots"),
        "adam_step_cuda's checks of the slots alone, writing nothing (check_step_slots' "
        "rules and the CUDA backend's own: alignment, size): raises ValueError as "
        "adam_step_cuda would. For one step split into several calls.");
  m.def("cuda_workspace_bytes", &CudaWorkspaceBytes, nb::arg("count"),
        "Device scratch bytes adam_step_cuda needs for `count` tensors.");
  m.def("cuda_kernels_run_on", &CudaKernelsRunOn, nb::arg("device"),
        "Whether the compiled kernels fit CUDA device `device`'s architecture.");
#endif
  m.def("set_thread_runtime", &SetThreadRuntimeByName, nb::arg("runtime"),
        "Where the core's workers run: \"auto\" (the default: torch's already loaded "
        "OpenMP runtime, else the core's own pool) or \"pool\" (always the pool). "
        "Results are the same either way.");
  m.def("info", &Info, "Version, SIMD target, threads, workers' runtime and built backends.");
}
