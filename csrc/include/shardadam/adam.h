// Public contract of the shardadam C++ core: one Adam/AdamW step over a list of
// tensors whose buffers the caller owns. No dependency on PyTorch or Python, so a
// C++ training loop (or the nanobind module) can call it directly.
//
// In short (docs/cpp.md walks through one step):
// - The caller owns every buffer. The core never allocates, frees or keeps a
//   pointer it is given; each must stay valid until the call returns, and no
//   other thread may meanwhile write it, or read a buffer the call writes.
// - Every call validates all its input first. A refused call returns
//   Status::kInvalidArgument, describes the first broken rule in `Error` and has
//   written nothing: no buffer, no scale slot.
// - Bad input never throws. Only std::bad_alloc can leave a call, when memory
//   runs out (a call allocates a few words per tensor and 64 KiB of scratch per
//   thread, 80 KiB more at a thread's first block of per-block moments cut by a
//   tensor's end), and only once every thread of the call has stopped: the tensors
//   may then be partly updated.
// - The update runs on the calling thread plus up to num_threads - 1 workers
//   (num_threads is clamped to 256; pool threads, once started, stay for reuse):
//   those of the OpenMP runtime already loaded into the process (PyTorch's),
//   else of one process-wide pool, started on first use and recreated after
//   fork() (SetThreadRuntime). Entry points may be called from any thread, also
//   concurrently: calls share the pool one at a time. Results never depend on
//   the thread count, the workers' runtime, the SIMD
//   target or the caller's floating-point mode (flush-to-zero and
//   denormals-are-zero are switched off for the call, then restored).
// - Linking: CMake target shardadam::core (find_package(shardadam)); the CUDA
//   backend is shardadam::cuda (adam_cuda.h).
#ifndef SHARDADAM_ADAM_H_
#define SHARDADAM_ADAM_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "shardadam/formats.h"
#include "shardadam/version.h"

namespace shardadam {

// How a state is rounded to its format: to nearest (ties to even), or
// stochastically (SEMANTICS S2.13: up or down with probability by distance, so
// the stored value is unbiased; the bits are a hash of the slot's rounding_key,
// the step and the element's flat index in the whole parameter).
enum class Rounding : int32_t {
  kNearest = 0,
  kStochastic = 1,
};

// TensorSlot: one tensor of a step, as raw pointers, dtype tags and a count.
// - `numel` counts elements, not bytes. Every buffer of the slot holds `numel`
//   elements of its own format, contiguous, BufferBytes(dtype, numel) bytes
//   (formats.h), aligned at least to the element size (as an array of that
//   element type is; a 4-bit format: a byte array of codes). A slot with
//   numel == 0 is an empty tensor: its data pointers may be null; the scale slots
//   of its per-tensor scaled states are still checked and written (a per-block
//   state has no block then, so no scale to read or write).
// - param, exp_avg, exp_avg_sq, master_param and the used scale slots are read
//   and written in place; grad is only read. The dtype tags say how each buffer
//   is encoded (formats.h: DType). Which tags a buffer accepts is FormatOf(tag)'s
//   `roles`: param and grad fp32/fp16/bf16 (any combination); moments fp32,
//   bf16, fp16, fp8 or a per-block scaled format; master_param kNone (no master: the pointer is ignored),
//   fp32 or fp16 beside an fp16/bf16 param, or kInt16Remainder beside a bf16
//   param. An fp32 param is its own master (master_dtype must be kNone).
// - No byte may be shared between a written buffer (any buffer but grad, and
//   the scale slots in use) and any other buffer of the call, of this tensor or
//   another. Gradients may share memory with each other.
// - A fresh state is zero moments with scale 1; a master starts as the param's
//   value (an fp16 master scaled by MeasureScale of it), a remainder as 0.
// - The scale slot of a scaled state must hold a finite value > 0; slots of
//   unscaled states are neither read nor written.
//
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
  // parameter is sharded. Ignored when no state is per-block scaled (and no
  // param is rounded stochastically). In [0, INT64_MAX / 8 - numel]; with a
  // 4-bit state, even (block boundaries fall between bytes).
  int64_t first_index = 0;
  int32_t scale_block = 0;
  // exp_avg's rounding: kStochastic only with exp_avg_dtype kFloat4E2M1Block,
  // where rounding to nearest flushes most small values to 0. Its random bits
  // come from rounding_key (a per-tensor constant the caller picks, e.g. a hash
  // of the parameter's name; the same for every shard of a parameter), the
  // step and first_index + i, so shards round as the whole parameter would.
  Rounding exp_avg_rounding = Rounding::kNearest;
  uint32_t rounding_key = 0;
  // The param's rounding from the updated fp32 weight: kStochastic only for a
  // bf16 param with no master (master_dtype kNone), which is then the weight's
  // only copy (S2.14). Its bits come from rounding_key (another stream than
  // exp_avg's), the step and first_index + i, as exp_avg's; first_index is
  // then read even when no state is per-block scaled.
  Rounding param_rounding = Rounding::kNearest;
  // exp_avg_sq's rounding: kStochastic only with exp_avg_sq_dtype
  // kUFloat4E3M1Block or kUFloat8E4M4Block, where rounding to nearest never
  // lets a value decay by beta2 near 1 (E3M1: 0.95 * x rounds back to x at
  // every code; E4M4 from about 0.97 up). Its bits come from rounding_key (a
  // third stream), the step and first_index + i.
  Rounding exp_avg_sq_rounding = Rounding::kNearest;
};

// Hyper-parameters of one step, shared by every tensor of the call (one param group).
// Validated before anything is written: every value finite, lr, eps and
// weight_decay >= 0, both betas in [0, 1), step >= 1, and the fp32 constants the
// step uses finite: lr / (1 - beta1^step), eps, and 1 - lr * weight_decay
// (adam_w_mode) or weight_decay (L2), each computed in double and rounded; a
// positive eps must not round to 0 in fp32 (at most 2^-150 does).
struct StepParams {
  double lr = 1e-3;             // 0 is a real step: the moments still move
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;            // added to sqrt(v / c2), outside the square root
  double weight_decay = 0.0;    // decoupled (AdamW) or L2, by adam_w_mode
  bool adam_w_mode = true;      // false: L2 penalty added to the gradient
  bool bias_correction = true;  // false: both corrections are 1
  int64_t step = 1;             // the step being taken, counted from 1
  // AdamStepCuda only: where non-null, lr is read from this fp64 in device memory
  // when the kernels run (the `lr` above is then not used), so a learning rate held
  // in a GPU tensor never waits for the device; its value is not validated, nor
  // the constants made from it (eps and an L2 weight_decay still are). 8-byte
  // aligned. The CPU core refuses it.
  const double* lr_in_device_memory = nullptr;
};

// The result of every call that can refuse its input.
enum class Status : int32_t {
  kOk = 0,
  kInvalidArgument = 1,  // a slot or a hyper-parameter broke a rule; nothing written
  kDeviceError = 2,      // CUDA backend only: the runtime refused a call (message names it)
};

// Filled on failure (left as it was on success). The fields name the tensors by
// their index in the call, so a caller with its own names for them (the Python
// package) builds its own text from `rule` instead of parsing `message`.
// Example, a gradient lying in another tensor's param: tensor_index 1,
// other_tensor_index 0, rule "grad [0x..., +8 bytes) overlaps {other}'s param
// [...]; tensors must not share memory (only gradients may be shared)", message
// the same sentence starting "tensor 1: " with "{other}" written as "tensor 0".
// Error holds std::string, laid out differently under libstdc++'s two string ABIs
// (_GLIBCXX_USE_CXX11_ABI). Tagged with the ABI, every function taking an Error*
// carries it in its linker name: a consumer built with the other ABI than the core
// fails to link rather than crashing on the first refused call.
#if defined(_GLIBCXX_USE_CXX11_ABI) && _GLIBCXX_USE_CXX11_ABI
#define SHARDADAM_STRING_ABI_TAG __attribute__((abi_tag("cxx11")))
#else
#define SHARDADAM_STRING_ABI_TAG
#endif
struct SHARDADAM_STRING_ABI_TAG Error {
  int64_t tensor_index = -1;        // the tensor the rule concerns; -1: the call itself
                                    // or a hyper-parameter
  int64_t other_tensor_index = -1;  // the second tensor of a rule about two, else -1
  // The broken rule: the buffer or hyper-parameter, the rule and the offending
  // number or address (never buffer contents), without the tensor's index;
  // "{other}" stands for the second tensor.
  std::string rule;
  // The whole sentence: "tensor 3: " + rule, "{other}" written as "tensor 1"
  // ("another tensor" where there is none).
  std::string message;
};

// Fills every field of `error` (if non-null) from a rule and its tensors, as the
// core does; for callers that add checks of their own in the same form.
void SetError(Error* error, int64_t tensor, const std::string& rule,
              int64_t other_tensor = -1);

// Updates every tensor of `slots` in place (SEMANTICS S3.6). Validates every slot and
// hyper-parameter first; on any failure returns kInvalidArgument, fills `error`
// (if non-null) and writes nothing. `num_threads` <= 0 means "all hardware threads".
// Results are bitwise identical for every thread count and every SIMD target.
//
// `slots` points to `count` slots (may be null when count is 0), read during the
// call only. Per element, in fp32 with c1 = 1 - beta1^step and c2 = 1 - beta2^step
// (both 1 without bias_correction; computed in double, rounded to fp32), `w` the
// master (or the param) and `g` the gradient, both decoded to fp32:
//   L2 mode:  g += weight_decay * w
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
//   AdamW:    w *= 1 - lr * weight_decay
//   w -= (lr / c1) * m / (sqrt(v) / sqrt(c2) + eps)
// then the param is w rounded to its dtype (or split with the remainder) and
// every state is stored in its format; a scaled state's new scale is measured on
// the whole new tensor first (fp16/fp8: max|u| / target, see formats.h).
// A NaN or infinite gradient element makes that element's results non-finite and
// is not an error; beside a scaled moment it also makes the new scale of what it
// shares one with (per tensor: the tensor; per block: its block) 1, as any
// non-finite absmax does (MeasureScale), so the others there are stored at scale
// 1, small ones as 0 (docs/semantics.md S2.3, S2.9).
// Checked, in this order, the first failure reported: the list
// (count >= 0, slots non-null), the hyper-parameters, each slot by index (numel
// in range, tags and their roles, master beside param, rounding and block size,
// per-block scaled moments beside unscaled states only,
// scale slots present, 4-byte aligned, finite and > 0, data pointers non-null
// when numel > 0, buffers inside the address space, no overlap within the slot),
// then overlaps between tensors. Not checkable
// and so the caller's duty: that each pointer addresses as many bytes as numel
// says. The data alignment above is not checked here (the CUDA backend checks it).
// A call needs about 64 KiB of the calling thread's stack (it fits the 128 KiB a
// musl thread gets): per-thread scratch is on the heap.
Status AdamStep(const TensorSlot* slots, int64_t count, const StepParams& params,
                int num_threads, Error* error);

// AdamStep's checks of `slots` alone, writing nothing: every slot rule and the
// buffers shared between tensors, not the hyper-parameters. A caller that splits
// one logical step into several AdamStep calls (one per parameter group) checks
// all their slots together first, so that a refusal leaves every call undone.
// With `scales_in_device_memory` the scale slots' values are not read (CUDA).
// Returns kOk or kInvalidArgument with `error` filled, as AdamStep would.
Status CheckStepSlots(const TensorSlot* slots, int64_t count,
                      bool scales_in_device_memory, Error* error);

// Element-wise conversion between storage dtypes, bit-exact with torch's `.to()`
// (round to nearest even) except for NaN, which keeps its sign and top payload
// bits and is made quiet (torch's CPU conversion to bf16 stores every NaN as
// 0xFFFF). For fp16/fp8 destinations the value stored is round(src / scale);
// for fp16/fp8 sources the value read is float(src) * scale.
// Supported: any of fp32/fp16/bf16/fp8 to any other. kInt16Remainder is not a cast.
// `numel` elements from `src` to `dst`; `scale` must be finite and > 0 when either
// end is scaled (ignored otherwise). src and dst may be the same buffer when both
// formats have the same size, and must not overlap otherwise. Validated first,
// like AdamStep (tensor_index is -1); threads as for AdamStep.
Status Convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
               int64_t numel, float scale, int num_threads, Error* error);

// The scale SEMANTICS S2.3 gives to fp32 values `u` stored as `dtype`
// (1 for an empty tensor, a zero or non-finite absmax, an unscaled dtype, or a
// per-block one: its scales are per block, which neither this nor Convert makes).
// Reads `numel` floats at `u` (null with numel <= 0 gives 1); refuses nothing.
// Pair it with Convert to store fp32 values as a scaled state.
float MeasureScale(const float* u, int64_t numel, DType dtype, int num_threads);

// The version this library was built as: SHARDADAM_VERSION_STRING of the headers
// it was compiled with (a string with static storage). A program that compares it
// with its own headers' SHARDADAM_VERSION_STRING catches a mixed install.
const char* Version();

// Name of the SIMD target the dispatcher picked on this CPU, e.g. "AVX2" (a
// string with static storage: never free it).
const char* ChosenTarget();
// Space-separated names of every target compiled in and supported by this CPU.
std::string SupportedTargets();
// Number of hardware threads used when num_threads <= 0.
int DefaultThreads();

// Where a call's workers come from. kAuto (the default): the threads of an
// OpenMP runtime the process has already loaded (PyTorch's bundled libgomp, or
// the program's own; found at run time, never linked), which right after a
// parallel region of its own still spin on the cores a step needs; in a
// process without one, or in a child forked after the runtime was loaded, the
// core's own pool. kOwnPool: always the pool. Results are the same either way.
enum class ThreadRuntime { kAuto, kOwnPool };
void SetThreadRuntime(ThreadRuntime runtime);
// What a call would run on now: "openmp:" and the runtime's path, or "pool".
std::string ThreadRuntimeName();

}  // namespace shardadam

#endif  // SHARDADAM_ADAM_H_
