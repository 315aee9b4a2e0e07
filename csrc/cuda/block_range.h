// How the CUDA kernels step a tensor with per-block scaled moments (S2.9, S2.10, S2.12),
// as host-device code so the C++ tests run the same lane work on the CPU against
// the CPU core. One pass: a group of lanes takes one scale block, each lane every
// lanes-th pair of adjacent elements of it (a warp's accesses are consecutive; in
// pairs so that a format of two codes per byte gives each byte to one lane: an even
// first_index, so the pairs are the bytes).
// A lane decodes with the block's old scales, updates, stores the weight at once
// and keeps the new moments in registers; the group reduces their absmax (exact:
// a maximum of fp32 bits), derives the block's new scales (scale_rule.h) and
// encodes. The kernel (adam_cuda.cu) adds the group reduction and the barriers.
#ifndef SHARDADAM_CUDA_BLOCK_RANGE_H_
#define SHARDADAM_CUDA_BLOCK_RANGE_H_

#include <cstdint>

#include "cuda/range.h"  // kThreads
#include "cuda/slot_math.h"
#include "scale_rule.h"

namespace shardadam {
namespace cuda {

// Elements per CUDA block of the per-block kernel: a whole number of scale blocks
// of every allowed size, so the CUDA blocks split a tensor on scale block bounds.
constexpr int64_t kBlockChunk = 8192;
static_assert(kBlockChunk % kMaxScaleBlock == 0, "a chunk holds whole scale blocks");
// Elements one lane keeps in registers: the largest block over the lanes.
constexpr int kMaxPerLane = kMaxScaleBlock / kThreads;
static_assert(kMaxPerLane * kThreads == kMaxScaleBlock && kMaxPerLane % 2 == 0, "pairs");
static_assert(kMinScaleBlock / 32 % 2 == 0, "a warp's lanes take whole pairs");
// Elements a lane loads before it stores any: as far as the compiler knows a store
// may alias the next load, so loads issued element by element would each wait for
// the store before them (the kernel is bound by memory latency).
constexpr int kBlockBatch = 4;
// A lane's elements (a power of two, kMinScaleBlock / 32 at least) are whole batches.
static_assert(kMinScaleBlock / 32 % kBlockBatch == 0 && kBlockBatch % 2 == 0,
              "whole batches of pairs");

// Lanes that share one scale block: one warp up to 32 * kMaxPerLane elements (its
// absmax needs no barrier), else as many whole warps as keep kMaxPerLane elements
// each (then the group spans warps); the CUDA block steps kThreads / lanes at once.
SHARDADAM_HOST_DEVICE inline int LanesPerScaleBlock(int32_t scale_block) {
  return scale_block / kMaxPerLane > 32 ? scale_block / kMaxPerLane : 32;
}

// Scale blocks that elements [0, numel) of `t` touch (formats.h ScaleCount).
SHARDADAM_HOST_DEVICE inline int64_t ScaleBlocksOf(const DeviceSlot& t) {
  return t.numel <= 0 ? 0 : (t.lead + t.numel - 1) / t.scale_block + 1;
}

// Scale blocks per CUDA block.
SHARDADAM_HOST_DEVICE inline int64_t ScaleBlocksPerChunk(const DeviceSlot& t) {
  return kBlockChunk / t.scale_block;
}

// CUDA blocks that step `t`, and the scale blocks [begin, end) CUDA block
// `chunk` of them steps.
SHARDADAM_HOST_DEVICE inline int64_t ChunksOf(const DeviceSlot& t) {
  const int64_t per_chunk = ScaleBlocksPerChunk(t);
  return (ScaleBlocksOf(t) + per_chunk - 1) / per_chunk;
}

struct ScaleBlockRange {
  int64_t begin, end;
};

SHARDADAM_HOST_DEVICE inline ScaleBlockRange ChunkScaleBlocks(const DeviceSlot& t,
                                                              int64_t chunk) {
  const int64_t begin = chunk * ScaleBlocksPerChunk(t);
  const int64_t end = begin + ScaleBlocksPerChunk(t);
  const int64_t count = ScaleBlocksOf(t);
  return {begin, end < count ? end : count};
}

// Local index of element k of lane `lane` in scale block j (maybe outside the
// tensor, for its partial first and last blocks): elements k and k + 1 (k even)
// are a pair, adjacent.
SHARDADAM_HOST_DEVICE inline int64_t BlockElement(const DeviceSlot& t, int64_t j, int lane,
                                                  int k) {
  const int64_t pair = int64_t{k / 2} * LanesPerScaleBlock(t.scale_block) + lane;
  return j * t.scale_block - t.lead + 2 * pair + k % 2;
}

// A lane's part of one scale block: its new moments, and their absmax bits.
struct BlockLane {
  float m[kMaxPerLane];
  float v[kMaxPerLane];
  uint32_t best[2];  // AbsBits maxima of the new m and v over the lane's elements
  // The highest StochasticRank of the lane's m and v codes rounded stochastically
  // (S2.13; 0 for a stream rounded to nearest), set by StoreBlockLane.
  uint32_t top[2];
};

// The block scales in effect for scale block j (1 for unscaled states; a tensor
// with per-block scales has no per-tensor scaled state).
SHARDADAM_HOST_DEVICE inline Scales BlockScales(const DeviceSlot& t, int64_t j) {
  Scales r;
  r.s[kW] = 1.0f;
  r.s[kM] = t.scale[kM] != nullptr ? t.scale[kM][j] : 1.0f;
  r.s[kV] = t.scale[kV] != nullptr ? t.scale[kV][j] : 1.0f;
  return r;
}

// Updates lane `lane`'s elements of scale block j, stores their weights (param,
// master: independent of the moments' scales) and keeps their moments in `out`.
template <bool kAdamW>
SHARDADAM_HOST_DEVICE inline void UpdateBlockLane(const DeviceSlot& t, const StepConstants& c,
                                                  int64_t j, int lane, BlockLane& out) {
  const Scales old = BlockScales(t, j);
  const int per_lane = t.scale_block / LanesPerScaleBlock(t.scale_block);
  out.best[0] = 0;
  out.best[1] = 0;
#pragma unroll
  for (int first = 0; first < kMaxPerLane; first += kBlockBatch) {
    if (first >= per_lane) break;
    Inputs e[kBlockBatch];
    bool inside[kBlockBatch];
#pragma unroll
    for (int b = 0; b < kBlockBatch; ++b) {
      const int64_t i = BlockElement(t, j, lane, first + b);
      inside[b] = i >= 0 && i < t.numel;
      if (inside[b]) e[b] = LoadInputs(t, old, i);
    }
#pragma unroll
    for (int b = 0; b < kBlockBatch; ++b) {
      if (!inside[b]) continue;
      const int k = first + b;
      const int64_t i = BlockElement(t, j, lane, k);
      Update<kAdamW>(c, e[b]);
      Codes codes{};
      EncodeWeight(t, old, i, e[b].w, codes);  // old.s[kW] is 1: no scaled master here
      WriteWeightCodes(t, i, codes);
      out.m[k] = e[b].m;
      out.v[k] = e[b].v;
      out.best[0] = out.best[0] > AbsBits(e[b].m) ? out.best[0] : AbsBits(e[b].m);
      out.best[1] = out.best[1] > AbsBits(e[b].v) ? out.best[1] : AbsBits(e[b].v);
    }
  }
}

// The new scales of a block whose new moments have absmax bits best[0] (m) and
// best[1] (v) over its elements in this tensor: S2.9's search, with the bounds
// of each state's format.
SHARDADAM_HOST_DEVICE inline Scales NewBlockScales(const DeviceSlot& t, const uint32_t best[2]) {
  const auto scale = [](uint8_t dtype, uint32_t bits) {
    const FormatInfo f = FormatOf(static_cast<DType>(dtype));
    return BlockScaleFromAbsMaxBits(bits, f.scale_target, f.zero_bound, f.overflow_bound);
  };
  Scales r;
  r.s[kW] = 1.0f;
  r.s[kM] = t.scale[kM] != nullptr ? scale(t.exp_avg_dtype, best[0]) : 1.0f;
  r.s[kV] = t.scale[kV] != nullptr ? scale(t.exp_avg_sq_dtype, best[1]) : 1.0f;
  return r;
}

// Stores lane `lane`'s moments of scale block j with the block's new scales.
SHARDADAM_HOST_DEVICE inline void StoreBlockLane(const DeviceSlot& t, int64_t j, int lane,
                                                 const Scales& now, BlockLane& in) {
  const int per_lane = t.scale_block / LanesPerScaleBlock(t.scale_block);
  in.top[0] = in.top[1] = 0;
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int64_t i = BlockElement(t, j, lane, k);
    if (k >= per_lane || i < 0 || i >= t.numel) continue;
    Codes codes{};
    EncodeBlockMoments(t, now, i, in.m[k], in.v[k], codes);
    WriteMomentCodes(t, i, codes);
    if (t.m_stochastic) {
      const uint32_t rank =
          StochasticRank(static_cast<DType>(t.exp_avg_dtype), static_cast<uint8_t>(codes.m));
      in.top[0] = in.top[0] > rank ? in.top[0] : rank;
    }
    if (t.v_stochastic) {
      const uint32_t rank = StochasticRank(static_cast<DType>(t.exp_avg_sq_dtype),
                                           static_cast<uint8_t>(codes.v));
      in.top[1] = in.top[1] > rank ? in.top[1] : rank;
    }
  }
}

// S2.13's canonical block, after the group's `top` (the maxima of its lanes'
// BlockLane::top): where a stochastically rounded block's largest element rounded
// down out of the top binade, lane `lane` doubles its codes of that stream, and
// `now` gets the scale the block is stored with (stochastic_blocks.h
// CanonicalBlockScale).
SHARDADAM_HOST_DEVICE inline void CanonicalBlockLane(const DeviceSlot& t, int64_t j, int lane,
                                                     const uint32_t top[2], Scales& now) {
  const bool stochastic[2] = {t.m_stochastic, t.v_stochastic};
  void* const buffers[2] = {t.exp_avg, t.exp_avg_sq};
  const uint8_t dtypes[2] = {t.exp_avg_dtype, t.exp_avg_sq_dtype};
  const int per_lane = t.scale_block / LanesPerScaleBlock(t.scale_block);
  for (int s = 0; s < 2; ++s) {
    if (!stochastic[s]) continue;
    const DType dtype = static_cast<DType>(dtypes[s]);
    float& scale = now.s[s == 0 ? kM : kV];
    const float canonical = CanonicalBlockScale(dtype, top[s], scale);
    if (canonical < scale) {
      // A pair at a time: for 4-bit codes WriteCode's even element clears its odd
      // one's nibble.
      for (int k = 0; k < per_lane; k += 2) {
        const int64_t i = BlockElement(t, j, lane, k);  // even; i + 1 its pair
        uint32_t code[2] = {0, 0};
        for (int h = 0; h < 2; ++h) {
          if (i + h >= 0 && i + h < t.numel) code[h] = ReadCode(buffers[s], dtypes[s], i + h);
        }
        for (int h = 0; h < 2; ++h) {
          if (i + h < 0 || i + h >= t.numel) continue;
          WriteCode(buffers[s], dtypes[s], i + h,
                    DoubledBlockCode(dtype, static_cast<uint8_t>(code[h])));
        }
      }
    }
    scale = canonical;
  }
}

// After every lane of block j has read its old scales: the new ones.
SHARDADAM_HOST_DEVICE inline void WriteBlockScales(const DeviceSlot& t, int64_t j,
                                                   const Scales& now) {
  if (t.scale[kM] != nullptr) t.scale[kM][j] = now.s[kM];
  if (t.scale[kV] != nullptr) t.scale[kV][j] = now.s[kV];
}

}  // namespace cuda
}  // namespace shardadam

#endif  // SHARDADAM_CUDA_BLOCK_RANGE_H_
