// Internal, target-independent view of the per-target SIMD kernels: the table of
// codecs and block kernels each Highway target fills in (adam-inl.h), and the
// hooks tests use to run the core on every target this CPU supports.
//
// The dtype matrix is large, so nothing here is specialised per dtype
// combination: a tensor picks one decoder and one encoder per stream from the
// table once, and every block runs the same fp32 update body.
#ifndef SHARDADAM_KERNELS_H_
#define SHARDADAM_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "element.h"

namespace shardadam {
namespace internal {

// Work items start on multiples of this, which is a multiple of every
// target's KernelTable::pair (two vectors: up to 2 x 64 fp32 lanes on the
// widest SVE) and of 64 elements, so every buffer's work items start on a cache
// line for every dtype.
inline constexpr size_t kGranule = 128;

// An E4M3 code shifted left by 7 is the fp16 bit pattern of its value / 256:
// the factor the fp16-based fp8 decoders fold into a scale (convert-inl.h
// kF8RawFactor), and the largest any target folds.
inline constexpr float kE4M3OverF16 = 256.0f;

// Elements per cache-resident fp32 block of the layouts without a fused kernel,
// decoded, updated and encoded in turn. Short, so that the out-of-order core
// overlaps one block's update (divisions, square root) with the next block's
// loads (with 512-element blocks memory sat idle during each update: 20% slower
// at 20M elements on 2 Zen cores). The smallest whole number of granules, so a pair of
// vectors of any target divides it.
inline constexpr size_t kBlock = 128;

// Work items are whole chunks: at least one, at most kMaxChunksPerItem. Each
// item a thread takes starts its streams afresh, and the hardware prefetchers
// retrain on every one: with one-chunk items alternating between two threads,
// up to 14% of a step at 20M elements on 2 Zen 5 cores (fp8 moments' measuring
// pass alone: 2.4 ms, against 1.8 ms with 16-chunk items); the gain flattened
// out from 16 chunks up. Below the cap every thread gets at least
// kItemsPerThread items (dynamic scheduling evens out a thread the machine
// slows down).
inline constexpr int64_t kChunk = 16384;
inline constexpr int64_t kMaxChunksPerItem = 16;
inline constexpr int64_t kItemsPerThread = 8;

// Elements per work item for a call that covers `work` elements on
// `threads` threads: a multiple of kChunk (hence of kGranule).
int64_t ItemElements(int64_t work, int threads);

// The element range [begin, end) of one work item.
struct ItemRange {
  int64_t begin;
  int64_t end;
};

// How a buffer of `numel` elements is split into work items of `item`
// elements: the item count, and item `index`'s range. Declared here rather
// than kept file-local in adam.cc so that a test can check the 64-bit index
// math for numel above 2^31 without allocating such a buffer.
int64_t NumItems(int64_t numel, int64_t item);
ItemRange ItemAt(int64_t numel, int64_t item, int64_t index);

// Storage codecs. fp16 appears twice: parameters are plain casts, scaled states
// (fp16 master, fp16 moments) multiply / divide by their per-tensor scale.
enum Codec : int {
  kCodecF32 = 0,
  kCodecBF16,
  kCodecF16,
  kCodecF16Scaled,
  kCodecF8Scaled,    // uint8 E4M3 "fn" codes, always scaled
  kCodecRemainder,   // bf16 param (src/dst) + int16 remainder (aux)
  kNumCodecs,
};

// Reads `n` elements (a multiple of KernelTable::pair) as fp32. Returns the block the
// kernels should use: `scratch`, or for kCodecF32 `src` itself, so that fp32
// buffers are updated in place with no copy. `aux` is the int16 remainder for
// kCodecRemainder and ignored otherwise; `scale` is ignored by unscaled codecs.
using DecodeFn = float* (*)(const void* src, const void* aux, size_t n,
                            float scale, float* scratch);
// Stores `n` fp32 values (a multiple of KernelTable::pair); scaled codecs store
// round(x / scale). kCodecRemainder writes the bf16 param to `dst` and the
// remainder to `aux`.
using EncodeFn = void (*)(const float* x, size_t n, float scale, void* dst,
                          void* aux);
// One Adam step over `n` elements of fp32 blocks, written back in place.
using UpdateFn = void (*)(const StepConstants& k, const float* g, float* w,
                          float* m, float* v, size_t n);
// The same arithmetic, storing nothing: folds the magnitudes of the first
// `valid` new values of w (only for the reduce_w variants), m and v into
// max_bits[0..2] as fp32 bit patterns. Comparing magnitudes as integers keeps
// the maximum exact and ranks inf and NaN above every finite value.
using ReduceFn = void (*)(const StepConstants& k, const float* g,
                          const float* w, const float* m, const float* v,
                          size_t valid, uint32_t* max_bits);

// Per-tensor scales of the moments for a fused kernel: decode with the old
// scales, encode with the new ones (ignored by unscaled moments).
struct FusedScales {
  float m_old, v_old, m_new, v_new;
};

// The whole step of `n` elements (a multiple of KernelTable::pair) of one
// layout in a single pass over pairs of vectors: decode, update and encode in
// registers, no fp32 blocks in between. Pointers are at the first element;
// `master` is the fp32 master or the int16 remainder (else unused).
using FusedFn = void (*)(const StepConstants& k, const void* grad, void* param,
                         void* master, void* m, void* v, const FusedScales& s,
                         size_t n);
// Pass 1 of a fused layout with scaled moments: the new values of its scaled
// moments over all `n` elements, stored nowhere, folded into max_bits[1] (m)
// and max_bits[2] (v) (see ReduceFn). Reads w (param or master) only in L2
// mode, where m and v depend on it. The driver calls it only on the blocks
// whose bounds say they may raise max_bits (adam.cc, BlockMayRaiseMax).
using FusedMeasureFn = void (*)(const StepConstants& k, const void* grad,
                                const void* param, const void* master,
                                const void* m, const void* v, const FusedScales& s,
                                size_t n, uint32_t* max_bits);

// The layouts with a fused kernel, by stream. A scaled (fp16) master, fp16
// params or grads, and other pairs of moment dtypes take the block path.
enum FusedGrad : int { kFusedGradF32 = 0, kFusedGradBF16, kNumFusedGrad };
enum FusedWeight : int {
  kFusedParamF32 = 0,   // fp32 param, no master
  kFusedMasterF32,      // bf16 param + fp32 master
  kFusedRemainder,      // bf16 param + int16 remainder
  kNumFusedWeight,
};
// Moment layouts with a fused kernel: both moments in one dtype, or fp8 exp_avg
// beside bf16 exp_avg_sq (fp8's range is narrow for exp_avg_sq).
enum FusedMoments : int {
  kFusedMomentsF32 = 0,
  kFusedMomentsBF16,
  kFusedMomentsF16Scaled,
  kFusedMomentsF8Scaled,
  kFusedMomentsF8BF16,
  kNumFusedMoments,
};
// The codec of each moment stream of a layout, as the FusedMoments value of a
// layout with both moments in that codec.
inline constexpr int ExpAvgStream(int moments) {
  return moments == kFusedMomentsF8BF16 ? kFusedMomentsF8Scaled : moments;
}
inline constexpr int ExpAvgSqStream(int moments) {
  return moments == kFusedMomentsF8BF16 ? kFusedMomentsBF16 : moments;
}
inline constexpr bool IsScaledStream(int stream) {
  return stream == kFusedMomentsF16Scaled || stream == kFusedMomentsF8Scaled;
}
inline constexpr bool IsScaledMoments(int moments) {
  return IsScaledStream(ExpAvgStream(moments)) || IsScaledStream(ExpAvgSqStream(moments));
}

struct FusedTable {
  // [adam_w_mode][unit bias_correction2_sqrt][grad][weight][moments]
  FusedFn fn[2][2][kNumFusedGrad][kNumFusedWeight][kNumFusedMoments];
  // [adam_w_mode][grad][weight][moments]; null for unscaled moments.
  FusedMeasureFn measure[2][kNumFusedGrad][kNumFusedWeight][kNumFusedMoments];
};

// Largest |x[i]| over any `n`, as an fp32 bit pattern (see ReduceFn).
using AbsMaxBitsFn = uint32_t (*)(const float* x, size_t n);
// The same for bf16 / fp16 bit patterns (x & 0x7FFF) and E4M3 codes (x & 0x7F):
// each format orders magnitudes as its bits.
using AbsMaxBits16Fn = uint32_t (*)(const uint16_t* x, size_t n);
using AbsMaxCode8Fn = uint32_t (*)(const uint8_t* x, size_t n);

struct KernelTable {
  int64_t target;  // HWY_* bit of the target that filled the table
  // Element counts the codecs and kernels accept are multiples of this (two
  // vectors of fp32 lanes; divides kGranule). Only tensor tails smaller than
  // it need staging.
  size_t pair;
  DecodeFn decode[kNumCodecs];
  EncodeFn encode[kNumCodecs];
  // [adam_w_mode][bias_correction2_sqrt == 1: that division is skipped]
  UpdateFn update[2][2];
  ReduceFn reduce[2][2][2];  // [adam_w_mode][reduce_w][same]
  FusedTable fused;
  AbsMaxBitsFn abs_max_bits;
  AbsMaxBits16Fn abs_max_bits16;
  AbsMaxCode8Fn abs_max_code8;
};

// The table every entry point uses now: the dispatcher's choice for this CPU,
// or the target pinned by SetTargetForTest.
const KernelTable& ActiveKernels();

// Test hooks. A test runs every case once per target:
//
//   for (int64_t t : shardadam::internal::CompiledTargets()) {
//     shardadam::internal::SetTargetForTest(t);
//     ...  // AdamStep / Convert / MeasureScale now run on target t
//   }
//   shardadam::internal::SetTargetForTest(0);
//
// HWY_* bits of every target compiled into the core that this CPU can run,
// best first (hwy::TargetName names them). Unaffected by SetTargetForTest;
// Highway's own SetSupportedTargetsForTest mock does narrow it.
std::vector<int64_t> CompiledTargets();
// Pins every entry point to `target` (one of CompiledTargets()); 0 restores
// the dispatcher's choice. Returns false, changing nothing, for any other value.
bool SetTargetForTest(int64_t target);

}  // namespace internal
}  // namespace shardadam

#endif  // SHARDADAM_KERNELS_H_
