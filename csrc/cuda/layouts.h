// The dtype combinations the CUDA kernels are compiled for with every dtype a
// constant. The codecs switch on a tensor's dtypes per element; with constants
// the switches fold away, the kernel is straight-line code, and element sizes are
// known (quads.h). On an H200 that took the fp32 step from 0.54 to 0.95 of copy
// bandwidth and bf16 moments from 0.23 to 0.92 (docs/performance.md, CUDA).
// Combinations not listed run the kernels that read the dtypes per tensor.
// Same functions, same values: only where the dtypes come from differs, so the
// bits stored are the same either way.
#ifndef SHARDADAM_CUDA_LAYOUTS_H_
#define SHARDADAM_CUDA_LAYOUTS_H_

#include <cstdint>
#include <tuple>

#include "cuda/slot_math.h"

namespace shardadam {
namespace cuda {

constexpr int kAnyDType = -1;  // read from the tensor

// Dtypes of param, grad, master, exp_avg and exp_avg_sq.
template <int P, int G, int W, int M, int V>
struct Layout {
  static constexpr int kParam = P, kGrad = G, kMaster = W, kExpAvg = M, kExpAvgSq = V;
  // Every element size known: the kernels may move four elements per access.
  static constexpr bool kFixed =
      P != kAnyDType && G != kAnyDType && W != kAnyDType && M != kAnyDType && V != kAnyDType;
  // Which kernels its tensors may need: the per-block one (a moment with per-block
  // scales) or the per-tensor passes (none); the catch-all both.
  static constexpr bool kMayBlock = M == kAnyDType || V == kAnyDType ||
                                    IsBlockScaled(static_cast<DType>(M)) ||
                                    IsBlockScaled(static_cast<DType>(V));
  static constexpr bool kMayTensor =
      !IsBlockScaled(static_cast<DType>(M)) && !IsBlockScaled(static_cast<DType>(V));

  SHARDADAM_HOST_DEVICE static bool Matches(const DeviceSlot& t) {
    return Is<P>(t.param_dtype) && Is<G>(t.grad_dtype) && Is<W>(t.master_dtype) &&
           Is<M>(t.exp_avg_dtype) && Is<V>(t.exp_avg_sq_dtype);
  }
  // Whether a buffer of dtype `d` (a constant of this layout) may carry a scale.
  SHARDADAM_HOST_DEVICE static constexpr bool MayScale(int d) {
    return d == kAnyDType || IsScaledTag(static_cast<uint8_t>(d));
  }
  // Replaces the tensor's dtype tags by the constants (equal where Matches).
  SHARDADAM_HOST_DEVICE static void Fix(DeviceSlot& t) {
    Set<P>(t.param_dtype);
    Set<G>(t.grad_dtype);
    Set<W>(t.master_dtype);
    Set<M>(t.exp_avg_dtype);
    Set<V>(t.exp_avg_sq_dtype);
  }

 private:
  template <int D>
  SHARDADAM_HOST_DEVICE static bool Is(uint8_t tag) {
    return D == kAnyDType || tag == D;
  }
  template <int D>
  SHARDADAM_HOST_DEVICE static void Set(uint8_t& tag) {
    if constexpr (D != kAnyDType) tag = static_cast<uint8_t>(D);
  }
};

constexpr int kF32 = static_cast<int>(DType::kFloat32);
constexpr int kBF16 = static_cast<int>(DType::kBFloat16);
constexpr int kF8 = static_cast<int>(DType::kFloat8E4M3);
constexpr int kNoMaster = static_cast<int>(DType::kNone);
constexpr int kRemainder = static_cast<int>(DType::kInt16Remainder);
constexpr int kF8Block = static_cast<int>(DType::kFloat8E4M3Block);
constexpr int kUF8Block = static_cast<int>(DType::kUFloat8E4M4Block);
constexpr int kF4Block = static_cast<int>(DType::kFloat4E2M1Block);
constexpr int kUF4Block = static_cast<int>(DType::kUFloat4E3M1Block);

// The compiled layouts: the benchmark's state presets; fp32 params (as FSDP2 shards
// them) with 16-bit or fp8 moments; an fp8 exp_avg beside a bf16 exp_avg_sq;
// FusedAdam's block8 and block4 moments (S2.11) beside fp32 params, bf16 params
// with an fp32 master and bf16 params with remainders. Adding one is one line here.
using CompiledLayouts = std::tuple<Layout<kF32, kF32, kNoMaster, kF32, kF32>,
                                   Layout<kBF16, kBF16, kF32, kF32, kF32>,
                                   Layout<kBF16, kBF16, kF32, kBF16, kBF16>,
                                   Layout<kBF16, kBF16, kRemainder, kBF16, kBF16>,
                                   Layout<kBF16, kBF16, kF32, kF8, kF8>,
                                   Layout<kF32, kF32, kNoMaster, kBF16, kBF16>,
                                   Layout<kF32, kF32, kNoMaster, kF8, kF8>,
                                   Layout<kBF16, kBF16, kF32, kF8, kBF16>,
                                   Layout<kF32, kF32, kNoMaster, kF8Block, kUF8Block>,
                                   Layout<kBF16, kBF16, kF32, kF8Block, kUF8Block>,
                                   Layout<kBF16, kBF16, kRemainder, kF8Block, kUF8Block>,
                                   Layout<kF32, kF32, kNoMaster, kF4Block, kUF4Block>,
                                   Layout<kBF16, kBF16, kF32, kF4Block, kUF4Block>,
                                   Layout<kBF16, kBF16, kRemainder, kF4Block, kUF4Block>>;
using AnyLayout = Layout<kAnyDType, kAnyDType, kAnyDType, kAnyDType, kAnyDType>;

// A layout's index in CompiledLayouts; the catch-all's is one past the last.
constexpr int kAnyLayout = static_cast<int>(std::tuple_size_v<CompiledLayouts>);

// Calls visit(L{}) with the Layout type of index `id`.
template <int kFirst = 0, class Visit>
decltype(auto) VisitLayout(int id, Visit&& visit) {
  if constexpr (kFirst == kAnyLayout) {
    return visit(AnyLayout{});
  } else {
    if (id == kFirst) return visit(std::tuple_element_t<kFirst, CompiledLayouts>{});
    return VisitLayout<kFirst + 1>(id, visit);
  }
}

// The first compiled layout `t` matches, else kAnyLayout.
inline int LayoutOf(const DeviceSlot& t) {
  for (int id = 0; id < kAnyLayout; ++id) {
    if (VisitLayout(id, [&](auto l) { return decltype(l)::Matches(t); })) return id;
  }
  return kAnyLayout;
}

}  // namespace cuda
}  // namespace shardadam

#endif  // SHARDADAM_CUDA_LAYOUTS_H_
