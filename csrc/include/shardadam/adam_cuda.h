// CUDA backend of the shardadam core: AdamStep (adam.h) for buffers in device
// memory. Present only in builds with SHARDADAM_ENABLE_CUDA; the library then
// links the CUDA runtime statically and still needs neither PyTorch nor Python.
// CMake target shardadam::cuda (find_package(shardadam) defines it where the
// installed core was built with CUDA); this header itself needs no CUDA headers.
#ifndef SHARDADAM_ADAM_CUDA_H_
#define SHARDADAM_ADAM_CUDA_H_

#include <cstdint>
#include <string>

#include "shardadam/adam.h"

namespace shardadam {

// Bytes of device scratch an AdamStepCuda call over `count` tensors needs (a few
// words per tensor; 0 for none).
int64_t CudaWorkspaceBytes(int64_t count);

// AdamStep's contract for slots whose buffers and scale slots are in the memory
// of CUDA device `device` (made current for the call, the caller's restored
// after; -1: the current device), with the same bits as the CPU core. Enqueued
// on `stream` (a cudaStream_t of that device; null is the legacy default stream)
// and returns without waiting for the device. `workspace` is device memory of at least
// CudaWorkspaceBytes(count) bytes that the call may use until its work on
// `stream` completes.
//
// Everything is validated on the host first, as for AdamStep, except the values
// held in scale slots (they are on the device; reading them would synchronise).
// Returns kInvalidArgument (nothing enqueued) on bad input, kDeviceError if the
// CUDA runtime refused a launch.
//
// Beyond AdamStep's rules it refuses (kInvalidArgument, nothing enqueued): a data
// buffer not aligned to its element size, a tensor past the backend's element
// limit (message gives it), a moment in a format CudaSupportsFormat says no to,
// a workspace that is null, too small or not 4-byte aligned (tensor_index -1) or
// that shares a byte with a buffer or scale slot of the call (tensor_index: its
// tensor), an lr_in_device_memory that does or lies in the workspace, and a
// device below -1. Not checkable on the host, so the caller's duty: that the
// pointers are device memory of `device` and the scale slots hold finite values
// > 0; and StepParams::lr_in_device_memory, where set, points to an fp64 in
// device memory of `device` that stays unwritten until the call's work on
// `stream` completes (every kernel reads it). The caller owns slots, buffers,
// scale slots and workspace: the slot array is read before the call returns,
// the rest is used by work on `stream` until it completes, and must not be
// touched by other work meanwhile.
// After kDeviceError (Error::message names the runtime call and its error) the
// launches enqueued before the failing one may still run: the call's tensors are
// then in an unspecified state. May be called from any host thread; it uses no
// host threads of its own.
Status AdamStepCuda(const TensorSlot* slots, int64_t count, const StepParams& params,
                    void* workspace, int64_t workspace_bytes, void* stream, int device,
                    Error* error);

// CheckStepSlots for AdamStepCuda: every slot rule of both, and the buffers shared
// between tensors, writing nothing and reading no scale slot (they are on the
// device). A caller that splits one step into several AdamStepCuda calls (one per
// parameter group) checks all their slots with it first, so that a refusal leaves
// every call unenqueued. Returns kOk or kInvalidArgument with `error` filled.
Status CheckCudaStepSlots(const TensorSlot* slots, int64_t count, Error* error);

// Whether AdamStepCuda steps states of format `dtype` (every format the CPU core
// takes, except per-block scaled formats the kernels have no codec for yet, which
// it refuses). Needs no device.
bool CudaSupportsFormat(DType dtype);

// Number of CUDA devices the runtime sees (0 without a driver or GPU).
int CudaDeviceCount();

// Whether the kernels compiled in can run on device `device` (machine code or
// PTX for its architecture). Leaves the current device as it found it.
bool CudaKernelsRunOn(int device);

// The GPU architectures compiled in, space-separated, e.g.
// "80-real 90-real 90-virtual" (a string with static storage).
const char* CudaArchitectures();

}  // namespace shardadam

#endif  // SHARDADAM_ADAM_CUDA_H_
