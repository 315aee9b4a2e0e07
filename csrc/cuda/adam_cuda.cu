// The CUDA backend: AdamStepCuda's launches. The per-element work (slot_math.h),
// the four-at-a-time accesses (quads.h) and a block's walk over its elements
// (range.h) are host-device code the CPU tests run too; this file maps blocks to
// tensors, reduces the absmax of scaled states, and orders the passes on the stream.
//
// A call packs up to kMaxSlots tensors of one layout (layouts.h: the dtypes the
// kernels are compiled for) into each launch's argument block (no host-to-device
// copy, so nothing waits on the host). Tensors with a scaled
// state (fp16/fp8 moments, fp16 master) need the new state's absmax before any
// element is stored: pass 1 recomputes the update and only reduces |new value|
// into the workspace, pass 2 recomputes it and stores with the new scale, and a
// last tiny launch writes the scales. The cost is one extra read of the inputs,
// no full-size temporary. Launches without scaled states run pass 2 alone.
// Tensors with per-block scaled moments (S2.9) take one pass of their own
// (block_range.h): each scale block's absmax is reduced within one CUDA block,
// so nothing waits for the rest of the tensor.
#include <cuda_runtime.h>

#include <climits>
#include <cinttypes>
#include <cstdio>
#include <string>

#include "cuda/block_range.h"
#include "cuda/layouts.h"
#include "cuda/range.h"
#include "cuda/slot_math.h"
#include "float_mode.h"
#include "shardadam/adam_cuda.h"
#include "validate.h"

namespace shardadam {
namespace cuda {
namespace {

constexpr int kWarps = kThreads / 32;
// Caps registers at 64 per thread: 4 blocks (half the threads an SM holds). No
// kernel spills at 64; 2 blocks (128 registers) measured slower.
constexpr int kMinBlocksPerSm = 4;
constexpr int kMaxSlots = 32;     // tensors per launch (argument block < 4 KiB)

// Where a call's lr is read from device memory (StepParams::lr_in_device_memory),
// each thread sets lr's two step constants from it as MakeStepConstants does on the
// host (SetLrTerms: the same double arithmetic, so the same bits); the host's
// constants hold the rest.
struct DeviceLr {
  const double* value;  // null: the host's lr is in the constants already
  double bias_correction1, weight_decay;
};

__device__ __forceinline__ StepConstants WithDeviceLr(StepConstants c, const DeviceLr& lr) {
  if (lr.value != nullptr) SetLrTerms(c, *lr.value, lr.bias_correction1, lr.weight_decay);
  return c;
}

// One launch's tensors, all of one layout. Block b works on slot s where
// first_block[s] <= b < first_block[s + 1], chunk b - first_block[s] of it.
struct Launch {
  DeviceSlot slots[kMaxSlots];
  int64_t first_block[kMaxSlots + 1];
  uint32_t* absmax;  // 3 per slot of this launch (kW, kM, kV), zeroed
  int count;
  bool any_scaled;
  bool blocks;  // every tensor has per-block scales (BlockKernel), or none has
  int layout;   // index in CompiledLayouts, or kAnyLayout
  DeviceLr lr;
};
static_assert(sizeof(Launch) + sizeof(StepConstants) < 4000,
              "kernel arguments must fit the portable 4 KiB limit");

// The slot of this block: the last slot starting at or before it (empty slots
// start where the next one does, so they are never chosen).
__device__ __forceinline__ int SlotOfBlock(const Launch& launch, int64_t block) {
  int lo = 0;
  int hi = launch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (launch.first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ __forceinline__ uint32_t BlockMax(uint32_t value, uint32_t* shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value = max(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
  }
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = value;
  __syncthreads();
  uint32_t best = 0;
  for (int w = 0; w < kWarps; ++w) best = max(best, shared[w]);
  __syncthreads();  // `shared` is reused by the next call
  return best;
}

// This block's tensor and element range.
struct BlockWork {
  int s;  // slot index in the launch
  DeviceSlot t;
  int64_t begin, end;
};

template <class L>
__device__ __forceinline__ BlockWork WorkOfBlock(const Launch& launch) {
  const int64_t block = blockIdx.x;
  BlockWork w;
  w.s = SlotOfBlock(launch, block);
  w.t = launch.slots[w.s];
  L::Fix(w.t);
  w.begin = (block - launch.first_block[w.s]) * kChunk;
  w.end = min(w.begin + kChunk, w.t.numel);
  return w;
}

// Pass 1: the new state's absmax per scaled state, nothing stored.
template <bool kAdamW, class L>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    MeasureKernel(const Launch launch, const StepConstants host_constants) {
  const StepConstants c = WithDeviceLr(host_constants, launch.lr);
  const BlockWork w = WorkOfBlock<L>(launch);
  // An unscaled tensor sharing the launch has nothing to measure (whole block).
  if (!HasScaledState(w.t)) return;
  uint32_t best[3] = {0, 0, 0};
  UpdateRange<kAdamW, L>(w.t, ReadScales(w.t), c, w.begin, w.end, threadIdx.x, kThreads,
                         [&](int64_t, int n, const Inputs* e) { FoldAbsMax<L>(n, e, best); });
  __shared__ uint32_t partial[kWarps];
  for (int k = 0; k < 3; ++k) {
    if (w.t.scale[k] == nullptr) continue;  // uniform across the block
    const uint32_t block_best = BlockMax(best[k], partial);
    if (threadIdx.x == 0 && block_best != 0) atomicMax(&launch.absmax[3 * w.s + k], block_best);
  }
}

// Pass 2: the update, stored with the scales measured by pass 1.
template <bool kAdamW, class L>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    StoreKernel(const Launch launch, const StepConstants host_constants) {
  const StepConstants c = WithDeviceLr(host_constants, launch.lr);
  const BlockWork w = WorkOfBlock<L>(launch);
  const Scales now = NewScales(w.t, launch.absmax + 3 * w.s);
  UpdateRange<kAdamW, L>(w.t, ReadScales(w.t), c, w.begin, w.end, threadIdx.x, kThreads,
                         [&](int64_t i, int n, const Inputs* e) {
                           StoreUpdated<L>(w.t, now, i, n, e);
                         });
}

// The maxima of a and b over the lanes of this thread's group (`lanes`, whole
// warps, aligned in the block). Every thread of the block must call it where a
// group spans warps (its barriers); a group of one warp needs none.
__device__ __forceinline__ void GroupMax(uint32_t& a, uint32_t& b, int lanes,
                                         uint32_t (*shared)[kWarps]) {
  for (int offset = 16; offset > 0; offset /= 2) {
    a = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, offset));
    b = max(b, __shfl_xor_sync(0xFFFFFFFFu, b, offset));
  }
  if (lanes == 32) return;
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    shared[0][warp] = a;
    shared[1][warp] = b;
  }
  __syncthreads();
  const int first = threadIdx.x / lanes * (lanes / 32);
  for (int w = first; w < first + lanes / 32; ++w) {
    a = max(a, shared[0][w]);
    b = max(b, shared[1][w]);
  }
  __syncthreads();  // `shared` is reused by the next call
}

// Tensors with per-block scaled moments, one pass: CUDA block b steps scale blocks
// [k * n, (k + 1) * n) of its tensor (k = b - first_block, n = ScaleBlocksPerChunk),
// groups of lanes one scale block each. 128 registers a thread: a lane keeps up
// to kMaxPerLane new moments of each kind until its block's scales are known.
template <bool kAdamW, class L>
__global__ void __launch_bounds__(kThreads, 2)
    BlockKernel(const Launch launch, const StepConstants host_constants) {
  const StepConstants c = WithDeviceLr(host_constants, launch.lr);
  const int64_t block = blockIdx.x;
  const int s = SlotOfBlock(launch, block);
  DeviceSlot t = launch.slots[s];
  L::Fix(t);
  const int lanes = LanesPerScaleBlock(t.scale_block);
  const int group = threadIdx.x / lanes;
  const int lane = threadIdx.x % lanes;
  const ScaleBlockRange range = ChunkScaleBlocks(t, block - launch.first_block[s]);
  __shared__ uint32_t partial[2][kWarps];
  // The same trip count in every thread: GroupMax's barriers.
  for (int64_t base = range.begin; base < range.end; base += kThreads / lanes) {
    const int64_t j = base + group;
    BlockLane mine;
    mine.best[0] = mine.best[1] = 0;
    if (j < range.end) UpdateBlockLane<kAdamW>(t, c, j, lane, mine);
    GroupMax(mine.best[0], mine.best[1], lanes, partial);
    Scales now{};
    mine.top[0] = mine.top[1] = 0;
    if (j < range.end) {
      now = NewBlockScales(t, mine.best);
      StoreBlockLane(t, j, lane, now, mine);
    }
    if (t.m_stochastic || t.v_stochastic) {  // the same in every thread: one tensor
      GroupMax(mine.top[0], mine.top[1], lanes, partial);
      if (j < range.end) CanonicalBlockLane(t, j, lane, mine.top, now);
    }
    // Every lane of the group read the old scales before GroupMax's barrier (in a
    // one-warp group: before its shuffles, which take values those reads gave).
    if (j < range.end && lane == 0) WriteBlockScales(t, j, now);
  }
}

// After pass 2 (stream order): every scaled state's slot gets its new scale,
// empty tensors' too (an absmax of 0 gives 1, as on the CPU).
__global__ void WriteScalesKernel(const Launch launch) {
  const int s = threadIdx.x;
  if (s >= launch.count) return;
  const DeviceSlot& t = launch.slots[s];
  const Scales now = NewScales(t, launch.absmax + 3 * s);
  for (int k = 0; k < 3; ++k) {
    if (t.scale[k] != nullptr) *t.scale[k] = now.s[k];
  }
}

Status DeviceFail(Error* error, const char* what, cudaError_t code) {
  cudaGetLastError();  // read, so the next call does not report it again
  SetError(error, -1,
           std::string(what) + " failed: " + cudaGetErrorName(code) + " (" +
               cudaGetErrorString(code) + ")");
  return Status::kDeviceError;
}

Status InvalidArgument(Error* error, const std::string& rule, int64_t tensor = -1) {
  SetError(error, tensor, rule);
  return Status::kInvalidArgument;
}

int64_t BlocksOf(int64_t numel) { return (numel + kChunk - 1) / kChunk; }

// CUDA blocks a tensor takes: kChunk elements each, or with per-block scales
// ScaleBlocksPerChunk whole scale blocks each.
int64_t BlocksOf(const DeviceSlot& t) {
  return HasBlockScales(t) ? ChunksOf(t) : BlocksOf(t.numel);
}

// The first buffer or scale slot of `t` that the kernels touch and that is not
// aligned to its element size, or null. (The CPU core takes any alignment; the
// device does not.) Never touched (adam.h): an empty tensor's buffers, an unscaled
// state's scale slot, and a per-block one of an empty tensor (no block).
const char* MisalignedBuffer(const TensorSlot& t) {
  const auto off = [](const void* p, int size) {
    return size > 0 && reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(size) != 0;
  };
  if (t.numel > 0) {
    if (off(t.param, ItemBytes(static_cast<int>(t.param_dtype)))) return "param";
    if (off(t.grad, ItemBytes(static_cast<int>(t.grad_dtype)))) return "grad";
    if (off(t.exp_avg, ItemBytes(static_cast<int>(t.exp_avg_dtype)))) return "exp_avg";
    if (off(t.exp_avg_sq, ItemBytes(static_cast<int>(t.exp_avg_sq_dtype)))) return "exp_avg_sq";
    if (off(t.master_param, ItemBytes(static_cast<int>(t.master_dtype)))) return "master_param";
  }
  const auto scale_off = [&](const float* p, DType dtype) {
    return (t.numel > 0 ? IsScaled(dtype) : NeedsMeasuringPass(dtype)) &&
           off(p, static_cast<int>(sizeof(float)));
  };
  if (scale_off(t.exp_avg_scale, t.exp_avg_dtype)) return "exp_avg_scale";
  if (scale_off(t.exp_avg_sq_scale, t.exp_avg_sq_dtype)) return "exp_avg_sq_scale";
  if (scale_off(t.master_scale, t.master_dtype)) return "master_scale";
  return nullptr;
}

template <bool kAdamW, class L>
Status Enqueue(const Launch& launch, const StepConstants& c, cudaStream_t stream,
               Error* error) {
  // Each launch is checked before the next: a store must not run on the scales of
  // a measurement that never launched.
  const auto launched = [&](const char* what) {
    const cudaError_t code = cudaGetLastError();
    return code == cudaSuccess ? Status::kOk : DeviceFail(error, what, code);
  };
  const int64_t blocks = launch.first_block[launch.count];
  if constexpr (L::kMayBlock) {
    if (launch.blocks) {
      if (blocks > 0) {
        BlockKernel<kAdamW, L><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(launch, c);
        return launched("per-block kernel launch");
      }
      return Status::kOk;
    }
  }
  if constexpr (L::kMayTensor) {
    if (launch.any_scaled && blocks > 0) {
      MeasureKernel<kAdamW, L><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(launch, c);
      if (launched("measuring kernel launch") != Status::kOk) return Status::kDeviceError;
    }
    if (blocks > 0) {
      StoreKernel<kAdamW, L><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(launch, c);
      if (launched("update kernel launch") != Status::kOk) return Status::kDeviceError;
    }
    if (launch.any_scaled) {
      WriteScalesKernel<<<1, kMaxSlots, 0, stream>>>(launch);
      return launched("scale kernel launch");
    }
  }
  return Status::kOk;
}

// Makes a device current for one call and restores the caller's afterwards.
class ScopedDevice {
 public:
  ScopedDevice() = default;
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t Enter(int device) {
    int current = -1;
    const cudaError_t got = cudaGetDevice(&current);
    if (got != cudaSuccess) return got;
    if (current == device) return cudaSuccess;
    previous_ = current;
    return cudaSetDevice(device);
  }

 private:
  int previous_ = -1;
};

// The slot rules AdamStepCuda adds to AdamStep's (adam_cuda.h), for slots that
// passed AdamStep's: formats with a kernel, data aligned to its element size, and
// the element limit of one launch.
Status SlotRules(const TensorSlot* slots, int64_t count, Error* error) {
  for (int64_t i = 0; i < count; ++i) {
    const struct {
      const char* field;
      DType dtype;
    } states[2] = {{"exp_avg_dtype", slots[i].exp_avg_dtype},
                   {"exp_avg_sq_dtype", slots[i].exp_avg_sq_dtype}};
    for (const auto& state : states) {
      if (!CudaSupportsFormat(state.dtype)) {
        return InvalidArgument(error,
                               std::string(state.field) + " " +
                                   std::to_string(static_cast<int>(state.dtype)) + " (" +
                                   FormatOf(state.dtype).name +
                                   ") has no CUDA kernel; states of this format step "
                                   "on the CPU",
                               i);
      }
    }
    if (const char* name = MisalignedBuffer(slots[i])) {
      char message[160];
      snprintf(message, sizeof(message),
               "%s is not aligned to its element size (rule: the device faults on "
               "misaligned loads)", name);
      return InvalidArgument(error, message, i);
    }
    if (BlocksOf(MakeDeviceSlot(slots[i])) > INT_MAX) {
      char message[224];
      snprintf(message, sizeof(message),
               "numel %" PRId64 " needs more than INT_MAX CUDA blocks (rule: at most "
               "about %" PRId64 " elements a tensor, less when per-block scales start "
               "mid-block)",
               slots[i].numel, static_cast<int64_t>(INT_MAX) * kChunk);
      return InvalidArgument(error, message, i);
    }
  }
  return Status::kOk;
}

}  // namespace
}  // namespace cuda

Status CheckCudaStepSlots(const TensorSlot* slots, int64_t count, Error* error) {
  const Status common = CheckStepSlots(slots, count, /*scales_in_device_memory=*/true, error);
  if (common != Status::kOk || count <= 0) return common;
  return cuda::SlotRules(slots, count, error);
}

int64_t CudaWorkspaceBytes(int64_t count) {
  return count <= 0 ? 0 : count * 3 * static_cast<int64_t>(sizeof(uint32_t));
}

Status AdamStepCuda(const TensorSlot* slots, int64_t count, const StepParams& params,
                    void* workspace, int64_t workspace_bytes, void* stream, int device,
                    Error* error) {
  using namespace cuda;  // NOLINT(build/namespaces): file-local brevity
  // The step constants are computed here on the host: in the caller's mode an FTZ
  // caller would flush a subnormal eps or weight decay that the CPU core keeps.
  const internal::ScopedIeeeFloatMode ieee;
  if (!internal::ValidateStep(slots, count, params, error, internal::ScaleValues::kSkip)) {
    return Status::kInvalidArgument;
  }
  if (count == 0) return Status::kOk;
  const Status rules = SlotRules(slots, count, error);
  if (rules != Status::kOk) return rules;
  const int64_t needed = CudaWorkspaceBytes(count);
  if (workspace == nullptr || workspace_bytes < needed ||
      reinterpret_cast<uintptr_t>(workspace) % alignof(uint32_t) != 0) {
    char message[160];
    snprintf(message, sizeof(message),
             "workspace holds %" PRId64 " bytes at %p; %" PRId64 " tensors need %" PRId64
             ", 4-byte aligned",
             workspace == nullptr ? 0 : workspace_bytes, workspace, count, needed);
    return InvalidArgument(error, message);
  }
  // Host-checkable duties: the workspace (written) and a device lr (read by every
  // kernel) apart from the tensors' memory and from each other.
  const double* lr = params.lr_in_device_memory;
  if (!internal::CheckRegionApart(slots, count, workspace, needed, "workspace", error) ||
      (lr != nullptr && !internal::CheckRegionApart(slots, count, lr, sizeof(double),
                                                    "lr_in_device_memory", error))) {
    return Status::kInvalidArgument;
  }
  const uintptr_t lr_at = reinterpret_cast<uintptr_t>(lr);
  const uintptr_t workspace_at = reinterpret_cast<uintptr_t>(workspace);
  if (lr != nullptr && lr_at < workspace_at + static_cast<uintptr_t>(needed) &&
      workspace_at < lr_at + sizeof(double)) {
    return InvalidArgument(error, "lr_in_device_memory lies in the workspace, which the call "
                                  "writes");
  }
  if (device < -1) {
    return InvalidArgument(error, "device " + std::to_string(device) +
                                      " is not a device (rule: an index >= 0, or -1 for the "
                                      "current device)");
  }
  const StepConstants c = MakeStepConstants(params);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The runtime's last error is per thread and sticks until read: drop one left
  // by an earlier call so the launch check below reports only this call's.
  cudaGetLastError();
  ScopedDevice scoped_device;
  if (device >= 0) {
    const cudaError_t set = scoped_device.Enter(device);
    if (set != cudaSuccess) return DeviceFail(error, "cudaSetDevice", set);
  }
  uint32_t* absmax = static_cast<uint32_t*>(workspace);
  const cudaError_t zeroed = cudaMemsetAsync(absmax, 0, static_cast<size_t>(needed), s);
  if (zeroed != cudaSuccess) return DeviceFail(error, "cudaMemsetAsync of the workspace", zeroed);

  Launch launch{};
  launch.lr = {params.lr_in_device_memory, BiasCorrection1(params), params.weight_decay};
  launch.count = 0;
  int64_t first = 0;  // index of the launch's first tensor
  for (int64_t i = 0; i <= count; ++i) {
    const DeviceSlot t = i < count ? MakeDeviceSlot(slots[i], params.step) : DeviceSlot{};
    const int layout = LayoutOf(t);
    const bool full = launch.count == kMaxSlots ||
                      (i < count && launch.count > 0 &&
                       (layout != launch.layout || HasBlockScales(t) != launch.blocks ||
                        launch.first_block[launch.count] + BlocksOf(t) > INT_MAX));
    if (launch.count > 0 && (i == count || full)) {
      launch.absmax = absmax + 3 * first;
      const Status status = VisitLayout(launch.layout, [&](auto layout) {
        using L = decltype(layout);
        return c.adam_w_mode ? Enqueue<true, L>(launch, c, s, error)
                             : Enqueue<false, L>(launch, c, s, error);
      });
      if (status != Status::kOk) return status;
      launch.count = 0;
    }
    if (i == count) break;
    if (launch.count == 0) {
      first = i;
      launch.first_block[0] = 0;
      launch.any_scaled = false;
      launch.blocks = HasBlockScales(t);
      launch.layout = layout;
    }
    launch.slots[launch.count] = t;
    launch.any_scaled = launch.any_scaled || HasScaledState(t);
    launch.first_block[launch.count + 1] = launch.first_block[launch.count] + BlocksOf(t);
    ++launch.count;
  }
  return Status::kOk;
}

bool CudaSupportsFormat(DType dtype) {
  return FormatOf(dtype).roles != 0 && (!IsBlockScaled(dtype) || cuda::HasBlockCodec(dtype));
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    return 0;
  }
  return count;
}

bool CudaKernelsRunOn(int device) {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  // Fails (no kernel image for the device) where neither the machine code nor
  // the PTX compiled in fits its architecture.
  cudaFuncAttributes attributes;
  const bool runs =
      cudaFuncGetAttributes(&attributes, cuda::StoreKernel<true, cuda::AnyLayout>) == cudaSuccess;
  cudaGetLastError();
  cudaSetDevice(previous);
  return runs;
}

const char* CudaArchitectures() { return SHARDADAM_CUDA_ARCHITECTURES; }

}  // namespace shardadam
