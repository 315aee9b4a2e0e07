// Running one tensor's plan over a range of its elements: the update pass
// (fused kernel, or fp32 blocks), the measuring pass (measure.cc), and the
// staging of a tail shorter than a pair of vectors.
#ifndef SHARDADAM_SPANS_H_
#define SHARDADAM_SPANS_H_

#include <cstddef>
#include <cstdint>

#include "plan.h"

namespace shardadam {
namespace internal {

// One thread's fp32 blocks for the block path.
struct alignas(64) Scratch {
  float g[kBlock];
  float w[kBlock];
  float m[kBlock];
  float v[kBlock];
};

// Either pass over [begin, end): whole pairs directly, the rest staged. With
// `update` false (pass 1) folds the magnitudes of the new measured states into
// max_bits (w, m, v) and stores nothing.
void RunSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
             int64_t begin, int64_t end, bool update, Scratch& s, uint32_t* max_bits);

// Pass 2 (or the only pass) over elements [begin, begin + n); n is a multiple
// of kt.pair.
void UpdateSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                int64_t begin, size_t n, Scratch& s);

// Pass 1 over [begin, begin + n) (a multiple of kt.pair): folds the magnitudes
// of the first `valid` new values into max_bits (w, m, v), skipping the blocks
// that cannot raise them (measure.cc).
void ReduceSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                int64_t begin, size_t n, size_t valid, Scratch& s, uint32_t* max_bits);

}  // namespace internal
}  // namespace shardadam

#endif  // SHARDADAM_SPANS_H_
