// Internal, target-independent view of the per-target SIMD kernels: the table of
// codecs and block kernels each Highway target fills in (adam-inl.h), and the
// hooks tests use to run the core on every target this CPU supports
// (targets.cc).
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
#include "fused_layouts.h"
#include "work_items.h"

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

// Storage codecs of the block path. fp16 appears twice: parameters are plain
// casts, scaled states (fp16 master, fp16 moments) multiply / divide by their
// scale. CodecOf (plan.cc) picks one from a buffer's format and role.
enum Codec : int {
  kCodecF32 = 0,
  kCodecBF16,
  kCodecF16,
  kCodecF16Scaled,
  kCodecF8Scaled,    // uint8 E4M3 "fn" codes, always scaled
  kCodecRemainder,   // bf16 param (src/dst) + int16 remainder (aux)
  kCodecUF8Scaled,   // uint8 unsigned E4M4 codes, always scaled (per block)
  kCodecF4Scaled,    // signed E2M1 codes, two per byte, always scaled (per block)
  kCodecUF4Scaled,   // unsigned E3M1 codes, two per byte, always scaled (per block)
  kNumCodecs,
};

// The scales a codec applies to a run of elements: one for the whole tensor
// (`block` 0) or one per `block` elements, where `first` is the index in its
// tensor of the run's first element (a staged tail keeps its true index).
// Unscaled codecs ignore it.
struct ScaleView {
  const float* scales = nullptr;
  int64_t block = 0;
  int64_t first = 0;
  float PerTensor() const { return scales[0]; }
};

// Reads `n` elements (a multiple of KernelTable::pair) as fp32. Returns the block the
// kernels should use: `scratch`, or for kCodecF32 `src` itself, so that fp32
// buffers are updated in place with no copy. `aux` is the int16 remainder for
// kCodecRemainder and ignored otherwise.
using DecodeFn = float* (*)(const void* src, const void* aux, size_t n,
                            const ScaleView& scale, float* scratch);
// Stores `n` fp32 values (a multiple of KernelTable::pair); scaled codecs store
// round(x / scale). kCodecRemainder writes the bf16 param to `dst` and the
// remainder to `aux`.
using EncodeFn = void (*)(const float* x, size_t n, const ScaleView& scale, void* dst,
                          void* aux);
// Stochastic rounding of a run of exp_avg or exp_avg_sq (S2.13) or of a bf16
// param (S2.14): the step's key (counter_hash.h ExpAvgStepKey, SquareStepKey,
// ParamStepKey) and the flat index in
// the whole parameter of the run's element 0. An exp_avg run lies in one scale
// block, so never crosses a multiple of 2^32 (an exp_avg_sq run neither); a
// param run may.
struct RoundingView {
  uint32_t key = 0;
  int64_t index = 0;
};
// EncodeFn for a signed E2M1 exp_avg or an unsigned E3M1 or E4M4 exp_avg_sq
// rounded stochastically (scaled per block), or for a bf16 param (scale ignored).
using StochasticEncodeFn = void (*)(const float* x, size_t n, const ScaleView& scale,
                                    const RoundingView& rounding, void* dst);
// S2.13's canonical block: the `n` codes at `codes` (4-bit ones packed, elements
// 0 and 1 in its first byte) of one block of `dtype` (fp4-block, ufp4-block or
// ufp8-block) just rounded stochastically at scale `s` from values whose largest
// magnitude is `absmax`. Returns the scale the block is stored with, having
// doubled its codes where that is s / 2 (stochastic_blocks.h
// CanonicalBlockScale). Out of line: most blocks return at its first comparison
// (block_spans.cc).
float CanonicalBlockCodes(DType dtype, float absmax, float s, uint8_t* codes, size_t n);
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

// The moments' scales for a fused kernel: decode with the old ones, encode with
// the new ones (ignored by unscaled moments).
struct FusedScales {
  ScaleView m_old, v_old, m_new, v_new;
};

// The whole step of `n` elements (a multiple of KernelTable::pair) of one
// layout in a single pass over pairs of vectors: decode, update and encode in
// registers, no fp32 blocks in between. Pointers are at the first element;
// `master` is the fp32 master or the int16 remainder (else unused).
using FusedFn = void (*)(const StepConstants& k, const void* grad, void* param,
                         void* master, void* m, void* v, const FusedScales& s,
                         size_t n);
// Pass 1 of a fused layout with per-tensor scaled moments: the new values of
// those moments over all `n` elements, stored nowhere, folded into
// max_bits[1] (m) and max_bits[2] (v) (see ReduceFn). Reads w (param or
// master) only in L2 mode, where m and v depend on it. The driver calls it only
// on the blocks whose bounds say they may raise max_bits (measure.cc).
using FusedMeasureFn = void (*)(const StepConstants& k, const void* grad,
                                const void* param, const void* master,
                                const void* m, const void* v, const FusedScales& s,
                                size_t n, uint32_t* max_bits);

// The whole step of `n` elements, whole blocks of `block` elements (a multiple
// of KernelTable::pair) with per-block scaled moments, each block in one pass:
// decoded with its old scales, updated in registers, the weight stored, the new
// moments kept in L1 while their absmax is taken, then encoded with the new
// scales, which replace the old ones in m_scales / v_scales (one per block).
// Every old scale folds into its decoder (plan.h FusedDecoderFolds).
// A non-null `m_rounding` (signed E2M1 exp_avg only) rounds m stochastically,
// a non-null `v_rounding` (unsigned E3M1 or E4M4 exp_avg_sq only) v, and
// `param_rounding` (the kParamBF16Stochastic layouts' only, never null there)
// the param, each index that of element 0 (the same index in all three).
using FusedBlockFn = void (*)(const StepConstants& k, const void* grad, void* param,
                              void* master, void* m, void* v, float* m_scales,
                              float* v_scales, size_t block, size_t n,
                              const RoundingView* m_rounding,
                              const RoundingView* v_rounding,
                              const RoundingView* param_rounding);

struct FusedTable {
  // [adam_w_mode][unit bias_correction2_sqrt][FusedLayouts index]
  FusedFn fn[2][2][kNumFusedLayouts];
  // [adam_w_mode][FusedLayouts index]; null where no moment needs measuring.
  FusedMeasureFn measure[2][kNumFusedLayouts];
  // [adam_w_mode][unit bias_correction2_sqrt][FusedBlockLayouts index]
  FusedBlockFn block[2][2][kNumFusedBlockLayouts];
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
  StochasticEncodeFn encode_f4_stochastic;
  StochasticEncodeFn encode_uf4_stochastic;
  StochasticEncodeFn encode_uf8_stochastic;
  StochasticEncodeFn encode_bf16_stochastic;
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
