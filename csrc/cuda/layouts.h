// The dtype combinations the CUDA kernels are compiled for with every dtype a
// constant. The codecs switch on a tensor's dtypes per element; with constants
// the switches fold away, the kernel is straight-line code, and element sizes are
// known (quads.h). On an H200 that took the fp32 step from 0.54 to 0.95 of copy
// bandwidth and bf16 moments from 0.23 to 0.92 (README, CUDA). Combinations not
// listed run the kernels that read the dtypes per tensor.
// Same functions, same values: only where the dtypes come from differs, so the
// bits stored are the same either way.
#ifndef SHARDADAM_CUDA_LAYOUTS_H_
#define SHARDADAM_CUDA_LAYOUTS_H_

#include <cstdint>

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

// The benchmark's state presets; fp32 params (as FSDP2 shards them) with 16-bit or
// fp8 moments; fp8 exp_avg beside a bf16 exp_avg_sq. Then the catch-all.
using Fp32Layout = Layout<kF32, kF32, kNoMaster, kF32, kF32>;
using Bf16MasterLayout = Layout<kBF16, kBF16, kF32, kF32, kF32>;
using Bf16MomentsLayout = Layout<kBF16, kBF16, kF32, kBF16, kBF16>;
using RemainderLayout = Layout<kBF16, kBF16, kRemainder, kBF16, kBF16>;
using Fp8MomentsLayout = Layout<kBF16, kBF16, kF32, kF8, kF8>;
using Fp32Bf16MomentsLayout = Layout<kF32, kF32, kNoMaster, kBF16, kBF16>;
using Fp32Fp8MomentsLayout = Layout<kF32, kF32, kNoMaster, kF8, kF8>;
using Fp8ExpAvgLayout = Layout<kBF16, kBF16, kF32, kF8, kBF16>;
using AnyLayout = Layout<kAnyDType, kAnyDType, kAnyDType, kAnyDType, kAnyDType>;

enum class LayoutId : uint8_t {
  kFp32,
  kBf16Master,
  kBf16Moments,
  kRemainder,
  kFp8Moments,
  kFp32Bf16Moments,
  kFp32Fp8Moments,
  kFp8ExpAvg,
  kAny
};

// Calls visit(L{}) with the Layout type of `id`.
template <class Visit>
decltype(auto) VisitLayout(LayoutId id, Visit&& visit) {
  switch (id) {
    case LayoutId::kFp32:
      return visit(Fp32Layout{});
    case LayoutId::kBf16Master:
      return visit(Bf16MasterLayout{});
    case LayoutId::kBf16Moments:
      return visit(Bf16MomentsLayout{});
    case LayoutId::kRemainder:
      return visit(RemainderLayout{});
    case LayoutId::kFp8Moments:
      return visit(Fp8MomentsLayout{});
    case LayoutId::kFp32Bf16Moments:
      return visit(Fp32Bf16MomentsLayout{});
    case LayoutId::kFp32Fp8Moments:
      return visit(Fp32Fp8MomentsLayout{});
    case LayoutId::kFp8ExpAvg:
      return visit(Fp8ExpAvgLayout{});
    default:
      return visit(AnyLayout{});
  }
}

// The first listed layout `t` matches (kAny, which matches everything, last).
inline LayoutId LayoutOf(const DeviceSlot& t) {
  for (int id = 0; id < static_cast<int>(LayoutId::kAny); ++id) {
    const LayoutId layout = static_cast<LayoutId>(id);
    if (VisitLayout(layout, [&](auto l) { return decltype(l)::Matches(t); })) return layout;
  }
  return LayoutId::kAny;
}

}  // namespace cuda
}  // namespace shardadam

#endif  // SHARDADAM_CUDA_LAYOUTS_H_
