// How the kernels walk one block's elements of a tensor, as host-device code so
// the C++ tests run the same walk on the CPU, lane after lane, against the reference.
#ifndef SHARDADAM_CUDA_RANGE_H_
#define SHARDADAM_CUDA_RANGE_H_

#include <cstdint>

#include "cuda/quads.h"
#include "cuda/slot_math.h"

namespace shardadam {
namespace cuda {

// A block: kThreads lanes over kChunk consecutive elements of one tensor (32 each).
constexpr int kThreads = 256;
constexpr int64_t kChunk = 8192;
static_assert(kChunk % 4 == 0, "blocks start on a quad");

// Elements a lane loads before it computes any. Loads issued together overlap (the
// step is bound by latency) but hold registers. Measured on an H200 (250M
// elements): one quad per lane beats two (up to 15 % faster, fp8 moments) and four
// (20 to 90 %); single elements go four at a time where the layout is fixed, one
// at a time in the catch-all, whose per-element dtype switches need the registers
// (four there: 20 to 45 % slower).
constexpr int kFixedSingles = 4;
constexpr int kAnySingles = 1;

// Updates elements [begin, end) of `t` (begin a multiple of 4); lane `lane` of
// `lanes` takes every lanes-th group. With a fixed layout and quad-aligned buffers
// the groups are quads, one access per buffer, and the last (end - begin) % 4
// elements go one by one; else every element goes alone. `done(i, n, e)` gets the
// n (4 or 1) updated elements from i, in e[0..n).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // `done` is a device lambda in the kernels
#endif
template <bool kAdamW, class L, class Done>
SHARDADAM_HOST_DEVICE inline void UpdateRange(const DeviceSlot& t, const Scales& old,
                                              const StepConstants& c, int64_t begin,
                                              int64_t end, int lane, int lanes,
                                              Done&& done) {
  int64_t singles = begin;
  if constexpr (L::kFixed) {
    if (t.quad_aligned) {
      singles = begin + ((end - begin) & ~int64_t{3});
      for (int64_t i = begin + int64_t{4} * lane; i < singles; i += int64_t{4} * lanes) {
        Codes codes[4] = {};
        ReadQuadCodes<L>(t, i, codes);
        Inputs e[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          e[k] = DecodeInputs(t, old, codes[k]);
          Update<kAdamW>(c, e[k]);
        }
        done(i, 4, e);
      }
    }
  }
  constexpr int kUnroll = L::kFixed ? kFixedSingles : kAnySingles;
  for (int64_t base = singles + lane; base < end; base += int64_t{lanes} * kUnroll) {
    Inputs e[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t{u} * lanes;
      if (i < end) e[u] = LoadInputs(t, old, i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t{u} * lanes;
      if (i >= end) break;
      Update<kAdamW>(c, e[u]);
      done(i, 1, &e[u]);
    }
  }
}

// What the passes do with UpdateRange's elements. Pass 1: folds |w|, |m|, |v|
// into best[kW, kM, kV] (AbsBits), for the states layout L may scale. With AdamW
// and an unscaled master, the weight's update (its square root and divisions) and
// its loads are then dead code, and pass 1 reads the gradient and moments only.
template <class L>
SHARDADAM_HOST_DEVICE inline void FoldAbsMax(int n, const Inputs* e, uint32_t best[3]) {
  const auto fold = [](uint32_t& into, float x) {
    into = into > AbsBits(x) ? into : AbsBits(x);
  };
#if defined(__CUDA_ARCH__)  // n is a constant there once inlined
#pragma unroll
#endif
  for (int k = 0; k < n; ++k) {
    if constexpr (L::MayScale(L::kMaster)) fold(best[kW], e[k].w);
    if constexpr (L::MayScale(L::kExpAvg)) fold(best[kM], e[k].m);
    if constexpr (L::MayScale(L::kExpAvgSq)) fold(best[kV], e[k].v);
  }
}

// Pass 2: stores n (4 or 1) updated elements from i with the new scales.
template <class L>
SHARDADAM_HOST_DEVICE inline void StoreUpdated(const DeviceSlot& t, const Scales& now,
                                               int64_t i, int n, const Inputs* e) {
  if constexpr (L::kFixed) {
    if (n == 4) {
      Codes out[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) out[k] = EncodeOutputs(t, now, i + k, e[k]);
      WriteQuadCodes<L>(t, i, out);
      return;
    }
  }
  StoreElement(t, now, i, e[0]);
}

}  // namespace cuda
}  // namespace shardadam

#endif  // SHARDADAM_CUDA_RANGE_H_
