// Running one tensor's plan over a range of its elements: the update pass
// (fused kernel, or fp32 blocks), the measuring pass (measure.cc), and the
// staging of a tail shorter than a pair of vectors.
#ifndef SHARDADAM_SPANS_H_
#define SHARDADAM_SPANS_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "plan.h"

namespace shardadam {
namespace internal {

// Zero-padded copies of one block cut by a tensor's ends (StageIn's buffers:
// param, master, exp_avg, exp_avg_sq, grad).
struct alignas(64) StagedBlock {
  char buffers[5][kMaxScaleBlock * sizeof(float)];
};

// One thread's fp32 blocks for the block path: kBlock elements at a time, or
// one whole block of per-block scaled states.
struct alignas(64) Scratch {
  float g[kMaxScaleBlock];
  float w[kMaxScaleBlock];
  float m[kMaxScaleBlock];
  float v[kMaxScaleBlock];
  // Made at the thread's first staged block, which most calls never reach:
  // 80 KiB neither on the caller's stack nor in thread-local storage (whose
  // static size every thread of the process would carry on its stack).
  std::unique_ptr<StagedBlock> staged;
};

// A run of elements decoded into fp32 (scratch, or fp32 buffers in place).
struct Decoded {
  const float* g;
  float* w;
  float* m;
  float* v;
};

// Decodes `c` elements (a multiple of kt.pair) from element `e` of the plan's
// buffers, the moments with the given scales.
Decoded DecodeRun(const TensorPlan& p, int64_t e, size_t c, const ScaleView& m_scale,
                  const ScaleView& v_scale, Scratch& s);
// Stores the updated run: param (and master), and the moments with the given scales.
void EncodeRun(const TensorPlan& p, int64_t e, size_t c, const Decoded& d,
               const ScaleView& m_scale, const ScaleView& v_scale);

// A copy of plan `p` whose buffers are zero-padded copies of its `t` elements
// from element `e` (an even one), `padded` elements each, in `buffers` (param,
// master, exp_avg, exp_avg_sq, grad; each large enough): tails shorter than a
// pair, and blocks cut by a tensor's ends. StageOut copies the `t` staged
// elements of the written buffers back (a 4-bit buffer's last byte whole, its
// padding nibble past the tensor's last element written 0).
TensorPlan StageIn(const TensorPlan& p, int64_t e, size_t t, size_t padded,
                   char* const buffers[5]);
void StageOut(const TensorPlan& p, const TensorPlan& q, int64_t e, size_t t);

// Either pass over [begin, end): whole pairs directly, the rest staged. With
// `update` false (pass 1) folds the magnitudes of the new measured states into
// max_bits (w, m, v) and stores nothing.
void RunSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
             int64_t begin, int64_t end, bool update, Scratch& s, uint32_t* max_bits);

// Pass 2 (or the only pass) over elements [begin, begin + n); n is a multiple
// of kt.pair.
void UpdateSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                int64_t begin, size_t n, Scratch& s);

// The only pass of a tensor with per-block scaled moments over [begin, end),
// where begin and end are block boundaries of the whole parameter or the
// tensor's own ends (block_spans.cc).
void UpdateBlockSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                     int64_t begin, int64_t end, Scratch& s);

// Pass 1 over [begin, begin + n) (a multiple of kt.pair): folds the magnitudes
// of the first `valid` new values into max_bits (w, m, v), skipping the blocks
// that cannot raise them (measure.cc).
void ReduceSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                int64_t begin, size_t n, size_t valid, Scratch& s, uint32_t* max_bits);

}  // namespace internal
}  // namespace shardadam

#endif  // SHARDADAM_SPANS_H_
