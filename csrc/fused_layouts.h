// The layouts the CPU core steps with a fused kernel (adam-inl.h FusedSpan):
// each stream read once and written once, in registers. One line per layout,
// like cuda/layouts.h; a layout not listed takes the block path (decode into
// fp32 blocks, update, encode), which gives the same bits more slowly.
#ifndef SHARDADAM_FUSED_LAYOUTS_H_
#define SHARDADAM_FUSED_LAYOUTS_H_

#include <cstdint>
#include <tuple>
#include <utility>

#include "shardadam/formats.h"

namespace shardadam {
namespace internal {

// How a fused kernel reads and writes the weight.
enum class Weight : int {
  kParamF32,   // fp32 param, no master
  kMasterF32,  // bf16 param + fp32 master
  kRemainder,  // bf16 param + int16 remainder
  // bf16 param, no master (block layouts only): rounded to nearest, or
  // stochastically (S2.14).
  kParamBF16,
  kParamBF16Stochastic,
};

template <DType G, Weight W, DType M, DType V>
struct FusedLayout {
  static constexpr DType kGrad = G, kExpAvg = M, kExpAvgSq = V;
  static constexpr Weight kWeight = W;
};

constexpr DType kF32 = DType::kFloat32;
constexpr DType kBF16 = DType::kBFloat16;
constexpr DType kF16 = DType::kFloat16;
constexpr DType kF8 = DType::kFloat8E4M3;

// fp32 or bf16 gradients; each weight kind; both moments in one format, or fp8
// exp_avg beside bf16 exp_avg_sq (fp8's range is narrow for exp_avg_sq).
using FusedLayouts = std::tuple<
    FusedLayout<kF32, Weight::kParamF32, kF32, kF32>,
    FusedLayout<kF32, Weight::kParamF32, kBF16, kBF16>,
    FusedLayout<kF32, Weight::kParamF32, kF16, kF16>,
    FusedLayout<kF32, Weight::kParamF32, kF8, kF8>,
    FusedLayout<kF32, Weight::kParamF32, kF8, kBF16>,
    FusedLayout<kF32, Weight::kMasterF32, kF32, kF32>,
    FusedLayout<kF32, Weight::kMasterF32, kBF16, kBF16>,
    FusedLayout<kF32, Weight::kMasterF32, kF16, kF16>,
    FusedLayout<kF32, Weight::kMasterF32, kF8, kF8>,
    FusedLayout<kF32, Weight::kMasterF32, kF8, kBF16>,
    FusedLayout<kF32, Weight::kRemainder, kF32, kF32>,
    FusedLayout<kF32, Weight::kRemainder, kBF16, kBF16>,
    FusedLayout<kF32, Weight::kRemainder, kF16, kF16>,
    FusedLayout<kF32, Weight::kRemainder, kF8, kF8>,
    FusedLayout<kF32, Weight::kRemainder, kF8, kBF16>,
    FusedLayout<kBF16, Weight::kParamF32, kF32, kF32>,
    FusedLayout<kBF16, Weight::kParamF32, kBF16, kBF16>,
    FusedLayout<kBF16, Weight::kParamF32, kF16, kF16>,
    FusedLayout<kBF16, Weight::kParamF32, kF8, kF8>,
    FusedLayout<kBF16, Weight::kParamF32, kF8, kBF16>,
    FusedLayout<kBF16, Weight::kMasterF32, kF32, kF32>,
    FusedLayout<kBF16, Weight::kMasterF32, kBF16, kBF16>,
    FusedLayout<kBF16, Weight::kMasterF32, kF16, kF16>,
    FusedLayout<kBF16, Weight::kMasterF32, kF8, kF8>,
    FusedLayout<kBF16, Weight::kMasterF32, kF8, kBF16>,
    FusedLayout<kBF16, Weight::kRemainder, kF32, kF32>,
    FusedLayout<kBF16, Weight::kRemainder, kBF16, kBF16>,
    FusedLayout<kBF16, Weight::kRemainder, kF16, kF16>,
    FusedLayout<kBF16, Weight::kRemainder, kF8, kF8>,
    FusedLayout<kBF16, Weight::kRemainder, kF8, kBF16>>;

inline constexpr int kNumFusedLayouts = static_cast<int>(std::tuple_size_v<FusedLayouts>);

// The layouts with per-block scaled moments (S2.9, S2.10, S2.12) that have a
// fused block kernel (adam-inl.h FusedBlockSpan): FusedAdam's block8 and block4
// moments beside every weight kind and gradient. Others take block_spans.cc's
// fp32 blocks.
constexpr DType kF8Block = DType::kFloat8E4M3Block;
constexpr DType kUF8Block = DType::kUFloat8E4M4Block;
constexpr DType kF4Block = DType::kFloat4E2M1Block;
constexpr DType kUF4Block = DType::kUFloat4E3M1Block;

using FusedBlockLayouts = std::tuple<
    FusedLayout<kF32, Weight::kParamF32, kF8Block, kUF8Block>,
    FusedLayout<kF32, Weight::kMasterF32, kF8Block, kUF8Block>,
    FusedLayout<kF32, Weight::kRemainder, kF8Block, kUF8Block>,
    FusedLayout<kBF16, Weight::kParamF32, kF8Block, kUF8Block>,
    FusedLayout<kBF16, Weight::kMasterF32, kF8Block, kUF8Block>,
    FusedLayout<kBF16, Weight::kRemainder, kF8Block, kUF8Block>,
    FusedLayout<kF32, Weight::kParamBF16, kF8Block, kUF8Block>,
    FusedLayout<kF32, Weight::kParamBF16Stochastic, kF8Block, kUF8Block>,
    FusedLayout<kBF16, Weight::kParamBF16, kF8Block, kUF8Block>,
    FusedLayout<kBF16, Weight::kParamBF16Stochastic, kF8Block, kUF8Block>,
    FusedLayout<kF32, Weight::kParamF32, kF4Block, kUF4Block>,
    FusedLayout<kF32, Weight::kMasterF32, kF4Block, kUF4Block>,
    FusedLayout<kF32, Weight::kRemainder, kF4Block, kUF4Block>,
    FusedLayout<kBF16, Weight::kParamF32, kF4Block, kUF4Block>,
    FusedLayout<kBF16, Weight::kMasterF32, kF4Block, kUF4Block>,
    FusedLayout<kBF16, Weight::kRemainder, kF4Block, kUF4Block>,
    FusedLayout<kF32, Weight::kParamBF16, kF4Block, kUF4Block>,
    FusedLayout<kF32, Weight::kParamBF16Stochastic, kF4Block, kUF4Block>,
    FusedLayout<kBF16, Weight::kParamBF16, kF4Block, kUF4Block>,
    FusedLayout<kBF16, Weight::kParamBF16Stochastic, kF4Block, kUF4Block>>;

inline constexpr int kNumFusedBlockLayouts =
    static_cast<int>(std::tuple_size_v<FusedBlockLayouts>);

inline constexpr int kFusedWeights = 5;

// A lookup key of every (grad, weight, exp_avg, exp_avg_sq), tags in range.
constexpr int FusedLayoutKey(DType g, Weight w, DType m, DType v) {
  return ((static_cast<int>(g) * kFusedWeights + static_cast<int>(w)) * kNumDTypes +
          static_cast<int>(m)) * kNumDTypes + static_cast<int>(v);
}

// The index in FusedLayouts of a tensor's layout, or -1: a lookup table over
// dtype tags, built at compile time, so choosing costs one load per tensor.
struct FusedLayoutIndex {
  int8_t index[kNumDTypes * kFusedWeights * kNumDTypes * kNumDTypes];

  constexpr int Of(DType grad, Weight weight, DType exp_avg, DType exp_avg_sq) const {
    const int g = static_cast<int>(grad), m = static_cast<int>(exp_avg),
              v = static_cast<int>(exp_avg_sq);
    if (g < 0 || g >= kNumDTypes || m < 0 || m >= kNumDTypes || v < 0 || v >= kNumDTypes) {
      return -1;
    }
    return index[FusedLayoutKey(grad, weight, exp_avg, exp_avg_sq)];
  }
};

template <class Layouts, size_t... I>
constexpr FusedLayoutIndex MakeFusedLayoutIndex(std::index_sequence<I...>) {
  FusedLayoutIndex t{};
  for (auto& i : t.index) i = -1;
  ((t.index[FusedLayoutKey(std::tuple_element_t<I, Layouts>::kGrad,
                           std::tuple_element_t<I, Layouts>::kWeight,
                           std::tuple_element_t<I, Layouts>::kExpAvg,
                           std::tuple_element_t<I, Layouts>::kExpAvgSq)] =
        static_cast<int8_t>(I)),
   ...);
  return t;
}

inline constexpr FusedLayoutIndex kFusedLayoutIndex =
    MakeFusedLayoutIndex<FusedLayouts>(std::make_index_sequence<kNumFusedLayouts>());
inline constexpr FusedLayoutIndex kFusedBlockLayoutIndex =
    MakeFusedLayoutIndex<FusedBlockLayouts>(std::make_index_sequence<kNumFusedBlockLayouts>());
static_assert(kNumFusedLayouts <= INT8_MAX && kNumFusedBlockLayouts <= INT8_MAX,
              "indices fit the table's int8_t");

}  // namespace internal
}  // namespace shardadam

#endif  // SHARDADAM_FUSED_LAYOUTS_H_
