// Per-target Adam kernels: the fp32 block update (AdamElement from element.h
// over SIMD vectors), its store-free twin that measures the new state's absmax
// for per-tensor scales, and the table that hands them and the codecs of
// convert-inl.h to the target-independent driver in adam.cc.
//
// Arithmetic is add / sub / mul / div / sqrt only, each correctly rounded, with
// no FMA (the ops object has none and the build passes -ffp-contract=off), so
// every target and the scalar reference produce the same bits.

#if defined(SHARDADAM_ADAM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SHARDADAM_ADAM_INL_H_
#undef SHARDADAM_ADAM_INL_H_
#else
#define SHARDADAM_ADAM_INL_H_
#endif

#include <stddef.h>
#include <stdint.h>

#include <cmath>
#include <type_traits>
#include <utility>

#include "convert-inl.h"
#include "element.h"
#include "hwy/highway.h"
#include "kernels.h"
#include "scale_rule.h"

HWY_BEFORE_NAMESPACE();
namespace shardadam {
namespace HWY_NAMESPACE {

// Stands for a divisor of exactly 1, which the ops object skips: x / 1 == x
// bit for bit (NaN and -0 included). sqrt(1 - beta2^t) rounds to 1.0f without
// bias correction and once beta2^t < 2^-24 (after ~16.6k steps at
// beta2 = 0.999), which spares one of the update's three divider operations.
struct UnitDivisor {};

// StepConstants' fields as the ops object wants them, with the unit divisor.
template <class Value>
struct ConstantsUnitBc2 {
  Value beta1, one_minus_beta1, beta2, one_minus_beta2, weight_decay, decay,
      step_size;
  UnitDivisor bias_correction2_sqrt;
  Value eps;
};

// The ops object AdamElement expects, over full fp32 vectors.
template <bool kUnitBc2>
struct VecOps {
  using V = VF;
#if HWY_HAVE_SCALABLE
  // Sizeless SVE vectors cannot be struct members: keep the scalars and
  // broadcast at each use (the compiler hoists it out of the loop).
  using Consts = std::conditional_t<kUnitBc2, ConstantsUnitBc2<float>, StepConstants>;
  static V B(float x) { return hn::Set(DF(), x); }
  V Add(V a, float b) const { return hn::Add(a, B(b)); }
  V Mul(float a, V b) const { return hn::Mul(B(a), b); }
  V Mul(V a, float b) const { return hn::Mul(a, B(b)); }
  V Div(V a, float b) const { return hn::Div(a, B(b)); }
#else
  using Consts = std::conditional_t<kUnitBc2, ConstantsUnitBc2<V>, BroadcastConstants<V>>;
#endif
  // Not HWY_INLINE: AdamElement is a template defined outside Highway's
  // per-target region, and forcing target code into it does not compile. The
  // block kernels below are HWY_FLATTEN, which inlines it all into them.
  V Add(V a, V b) const { return hn::Add(a, b); }
  V Sub(V a, V b) const { return hn::Sub(a, b); }
  V Mul(V a, V b) const { return hn::Mul(a, b); }
  V Div(V a, V b) const { return hn::Div(a, b); }
  V Div(V a, UnitDivisor) const { return a; }
  V Sqrt(V a) const { return hn::Sqrt(a); }
};

template <bool kUnitBc2>
HWY_INLINE typename VecOps<kUnitBc2>::Consts MakeConsts(const StepConstants& k) {
#if HWY_HAVE_SCALABLE
  if constexpr (kUnitBc2) {
    return {k.beta1, k.one_minus_beta1, k.beta2, k.one_minus_beta2,
            k.weight_decay, k.decay, k.step_size, UnitDivisor(), k.eps};
  } else {
    return k;
  }
#else
  const DF df;
  if constexpr (kUnitBc2) {
    return {hn::Set(df, k.beta1),        hn::Set(df, k.one_minus_beta1),
            hn::Set(df, k.beta2),        hn::Set(df, k.one_minus_beta2),
            hn::Set(df, k.weight_decay), hn::Set(df, k.decay),
            hn::Set(df, k.step_size),    UnitDivisor(),
            hn::Set(df, k.eps)};
  } else {
    return {hn::Set(df, k.beta1),        hn::Set(df, k.one_minus_beta1),
            hn::Set(df, k.beta2),        hn::Set(df, k.one_minus_beta2),
            hn::Set(df, k.weight_decay), hn::Set(df, k.decay),
            hn::Set(df, k.step_size),    hn::Set(df, k.bias_correction2_sqrt),
            hn::Set(df, k.eps)};
  }
#endif
}

// internal::UpdateFn. `n` is a multiple of the pair size; the blocks are distinct
// buffers (scratch, or the caller's fp32 state updated in place).
template <bool kAdamW, bool kUnitBc2>
HWY_NOINLINE HWY_FLATTEN void UpdateBlock(const StepConstants& k,
                                          const float* HWY_RESTRICT g,
                                          float* HWY_RESTRICT w,
                                          float* HWY_RESTRICT m,
                                          float* HWY_RESTRICT v, size_t n) {
  const DF df;
  const size_t L = hn::Lanes(df);
  const VecOps<kUnitBc2> ops;
  const typename VecOps<kUnitBc2>::Consts c = MakeConsts<kUnitBc2>(k);
  for (size_t i = 0; i < n; i += L) {
    VF wi = hn::LoadU(df, w + i);
    VF mi = hn::LoadU(df, m + i);
    VF vi = hn::LoadU(df, v + i);
    AdamElement<kAdamW>(ops, c, hn::LoadU(df, g + i), wi, mi, vi);
    hn::StoreU(wi, df, w + i);
    hn::StoreU(mi, df, m + i);
    hn::StoreU(vi, df, v + i);
  }
}

// internal::ReduceFn. With kReduceW false and AdamW, w's new value is unused
// and the compiler drops its sqrt / divisions; the caller then passes any
// readable block as `w`.
template <bool kAdamW, bool kReduceW, bool kUnitBc2>
HWY_NOINLINE HWY_FLATTEN void ReduceBlock(const StepConstants& k,
                                          const float* HWY_RESTRICT g,
                                          const float* HWY_RESTRICT w,
                                          const float* HWY_RESTRICT m,
                                          const float* HWY_RESTRICT v,
                                          size_t valid, uint32_t* max_bits) {
  const DF df;
  const DI di;
  const size_t L = hn::Lanes(df);
  const VecOps<kUnitBc2> ops;
  const typename VecOps<kUnitBc2>::Consts c = MakeConsts<kUnitBc2>(k);
  VI acc_w = hn::Zero(di);
  VI acc_m = hn::Zero(di);
  VI acc_v = hn::Zero(di);
  size_t i = 0;
  for (; i + L <= valid; i += L) {
    VF wi = hn::LoadU(df, w + i);
    VF mi = hn::LoadU(df, m + i);
    VF vi = hn::LoadU(df, v + i);
    AdamElement<kAdamW>(ops, c, hn::LoadU(df, g + i), wi, mi, vi);
    if (kReduceW) acc_w = hn::Max(acc_w, AbsBits(wi));
    acc_m = hn::Max(acc_m, AbsBits(mi));
    acc_v = hn::Max(acc_v, AbsBits(vi));
  }
  if (i < valid) {
    // Lanes past `valid` hold padding whose update may be NaN: mask them out.
    // The loads stay in bounds: blocks are whole pairs of vectors.
    const auto keep = hn::RebindMask(di, hn::FirstN(df, valid - i));
    VF wi = hn::LoadU(df, w + i);
    VF mi = hn::LoadU(df, m + i);
    VF vi = hn::LoadU(df, v + i);
    AdamElement<kAdamW>(ops, c, hn::LoadU(df, g + i), wi, mi, vi);
    if (kReduceW) acc_w = hn::Max(acc_w, hn::IfThenElseZero(keep, AbsBits(wi)));
    acc_m = hn::Max(acc_m, hn::IfThenElseZero(keep, AbsBits(mi)));
    acc_v = hn::Max(acc_v, hn::IfThenElseZero(keep, AbsBits(vi)));
  }
  const uint32_t new_bits[3] = {
      static_cast<uint32_t>(hn::GetLane(hn::MaxOfLanes(di, acc_w))),
      static_cast<uint32_t>(hn::GetLane(hn::MaxOfLanes(di, acc_m))),
      static_cast<uint32_t>(hn::GetLane(hn::MaxOfLanes(di, acc_v)))};
  for (int s = 0; s < 3; ++s) {
    if (new_bits[s] > max_bits[s]) max_bits[s] = new_bits[s];
  }
}

// The fused kernels' streams: one load and one store policy per stream of a
// layout (fused_layouts.h), chosen at compile time (the block path's codecs, a
// pair of vectors at a time). The layout whose streams are all 16-bit pairs its
// vectors in even/odd order (convert-inl.h); the others in natural order.
using internal::Weight;
constexpr DType kF32 = DType::kFloat32;
constexpr DType kBF16 = DType::kBFloat16;
constexpr DType kF16 = DType::kFloat16;
constexpr DType kF8 = DType::kFloat8E4M3;

// A bf16 param with no master (block layouts only).
constexpr bool IsBF16Param(Weight w) {
  return w == Weight::kParamBF16 || w == Weight::kParamBF16Stochastic;
}

template <class L>
inline constexpr bool kEvenOdd = L::kGrad == kBF16 && L::kWeight == Weight::kRemainder &&
                                 L::kExpAvg == kBF16 && L::kExpAvgSq == kBF16;

template <DType kGrad, bool kEO>
HWY_INLINE void LoadGradx2(const void* g, size_t i, VF& a, VF& b) {
  static_assert(kGrad == kF32 || kGrad == kBF16, "fused gradients are fp32 or bf16");
  if constexpr (kGrad == kF32) {
    LoadF32x2(static_cast<const float*>(g) + i, a, b);
  } else if constexpr (kEO) {
    LoadBF16EvenOdd(static_cast<const uint16_t*>(g) + i, a, b);
  } else {
    LoadBF16x2(static_cast<const uint16_t*>(g) + i, a, b);
  }
}

template <Weight kWeight, bool kEO>
HWY_INLINE void LoadWx2(const void* param, const void* master, size_t i, VF& a, VF& b) {
  if constexpr (kWeight == Weight::kParamF32) {
    LoadF32x2(static_cast<const float*>(param) + i, a, b);
  } else if constexpr (kWeight == Weight::kMasterF32) {
    LoadF32x2(static_cast<const float*>(master) + i, a, b);
  } else if constexpr (IsBF16Param(kWeight)) {
    if constexpr (kEO) {
      LoadBF16EvenOdd(static_cast<const uint16_t*>(param) + i, a, b);
    } else {
      LoadBF16x2(static_cast<const uint16_t*>(param) + i, a, b);
    }
  } else if constexpr (kEO) {
    LoadRemainderEvenOdd(static_cast<const uint16_t*>(param) + i,
                         static_cast<const int16_t*>(master) + i, a, b);
  } else {
    LoadRemainderx2(static_cast<const uint16_t*>(param) + i,
                    static_cast<const int16_t*>(master) + i, a, b);
  }
}

// The param is rounded from the updated fp32 w, as in the block path.
// kNoNaN: a and b hold no NaN (see FusedStore). Not a stochastically rounded
// param, whose bits the caller draws (FusedBlockSpan).
template <Weight kWeight, bool kEO, bool kNoNaN>
HWY_INLINE void StoreWx2(VF a, VF b, void* param, void* master, size_t i) {
  static_assert(kWeight != Weight::kParamBF16Stochastic, "needs its random bits");
  if constexpr (kWeight == Weight::kParamF32) {
    StoreF32x2(a, b, static_cast<float*>(param) + i);
  } else if constexpr (kWeight == Weight::kMasterF32) {
    StoreBF16x2(a, b, static_cast<uint16_t*>(param) + i);
    StoreF32x2(a, b, static_cast<float*>(master) + i);
  } else if constexpr (kWeight == Weight::kParamBF16) {
    if constexpr (kEO) {
      StoreBF16EvenOdd<kNoNaN>(a, b, static_cast<uint16_t*>(param) + i);
    } else {
      StoreBF16x2<kNoNaN>(a, b, static_cast<uint16_t*>(param) + i);
    }
  } else if constexpr (kEO) {
    StoreRemainderEvenOdd<kNoNaN>(a, b, static_cast<uint16_t*>(param) + i,
                                  static_cast<uint16_t*>(master) + i);
  } else {
    StoreRemainderx2<kNoNaN>(a, b, static_cast<uint16_t*>(param) + i,
                             static_cast<uint16_t*>(master) + i);
  }
}

// A moment stream's decode factor: the old per-tensor scale (fp8 codes decode
// to a fixed fraction of their value, folded in here; the plan only picks the
// fused path when the product is finite, see ScaledLoad).
template <DType kMoment>
HWY_INLINE float MomentDecodeFactor(const internal::ScaleView& old_scale) {
  if constexpr (!IsScaled(kMoment)) {
    return 1.0f;
  } else {
    static_assert(NeedsMeasuringPass(kMoment), "fused moments have per-tensor scales");
    return kMoment == kF8 ? old_scale.PerTensor() * kF8RawFactor : old_scale.PerTensor();
  }
}

template <DType kMoment, bool kEO>
HWY_INLINE void LoadMomentx2(const void* p, size_t i, float factor, VF& a, VF& b) {
  static_assert(kMoment == kF32 || kMoment == kBF16 || kMoment == kF16 || kMoment == kF8,
                "a fused moment format needs its load here");
  if constexpr (kMoment == kF32) {
    LoadF32x2(static_cast<const float*>(p) + i, a, b);
  } else if constexpr (kEO) {
    LoadBF16EvenOdd(static_cast<const uint16_t*>(p) + i, a, b);
  } else if constexpr (kMoment == kBF16) {
    LoadBF16x2(static_cast<const uint16_t*>(p) + i, a, b);
  } else {
    if constexpr (kMoment == kF16) {
      LoadF16x2(static_cast<const uint16_t*>(p) + i, a, b);
    } else {
      LoadF8x2Raw(static_cast<const uint8_t*>(p) + i, a, b);
    }
    const VF f = hn::Set(DF(), factor);
    a = hn::Mul(a, f);
    b = hn::Mul(b, f);
  }
}

// Scaled moments store round(x / new_scale), dividing as the block encoders do.
// kNoNaN: a and b hold no NaN (see FusedStore).
template <DType kMoment, bool kEO, bool kNoNaN>
HWY_INLINE void StoreMomentx2(VF a, VF b, const internal::ScaleView& scale, void* p,
                              size_t i) {
  if constexpr (kMoment == kF32) {
    StoreF32x2(a, b, static_cast<float*>(p) + i);
  } else if constexpr (kEO) {
    StoreBF16EvenOdd<kNoNaN>(a, b, static_cast<uint16_t*>(p) + i);
  } else if constexpr (kMoment == kBF16) {
    StoreBF16x2<kNoNaN>(a, b, static_cast<uint16_t*>(p) + i);
  } else {
    const VF s = hn::Set(DF(), scale.PerTensor());
    if constexpr (kMoment == kF16) {
      StoreF16x2(hn::Div(a, s), hn::Div(b, s), static_cast<uint16_t*>(p) + i);
    } else {
      StoreF8x2(hn::Div(a, s), hn::Div(b, s), static_cast<uint8_t*>(p) + i);
    }
  }
}

// One pair of vectors of a fused layout, decoded (then updated in place): the
// caller's locals, by reference, because SVE's sizeless vectors cannot be
// struct members.
struct FusedPair {
  VF &g0, &g1, &w0, &w1, &m0, &m1, &v0, &v1;
};

HWY_INLINE void CopyPair(const FusedPair& from, const FusedPair& to) {
  to.g0 = from.g0;
  to.g1 = from.g1;
  to.w0 = from.w0;
  to.w1 = from.w1;
  to.m0 = from.m0;
  to.m1 = from.m1;
  to.v0 = from.v0;
  to.v1 = from.v1;
}

template <class L>
HWY_INLINE void FusedLoad(const void* grad, const void* param, const void* master,
                          const void* m, const void* v, float m_factor,
                          float v_factor, size_t i, const FusedPair& p) {
  constexpr bool kEO = kEvenOdd<L>;
  LoadGradx2<L::kGrad, kEO>(grad, i, p.g0, p.g1);
  LoadWx2<L::kWeight, kEO>(param, master, i, p.w0, p.w1);
  LoadMomentx2<L::kExpAvg, kEO>(m, i, m_factor, p.m0, p.m1);
  LoadMomentx2<L::kExpAvgSq, kEO>(v, i, v_factor, p.v0, p.v1);
}

// kMomentsNoNaN / kWeightNoNaN: the moments / w hold no NaN (see FusedStore).
template <class L, bool kMomentsNoNaN, bool kWeightNoNaN>
HWY_INLINE void FusedStoreAll(const FusedPair& p, const internal::FusedScales& s,
                              void* param, void* master, void* m, void* v, size_t i) {
  constexpr bool kEO = kEvenOdd<L>;
  StoreWx2<L::kWeight, kEO, kWeightNoNaN>(p.w0, p.w1, param, master, i);
  StoreMomentx2<L::kExpAvg, kEO, kMomentsNoNaN>(p.m0, p.m1, s.m_new, m, i);
  StoreMomentx2<L::kExpAvgSq, kEO, kMomentsNoNaN>(p.v0, p.v1, s.v_new, v, i);
}

// Two stores need a NaN rule, which costs a few instructions per vector: bf16
// rounding, and a remainder's split (a NaN master is split as the quiet NaN,
// convert-inl.h). A pair that holds no NaN in those streams (their sum is not
// NaN: any NaN makes it NaN, and inf - inf only sends a pair the exact way)
// skips them. Not a bf16-rounded param beside an fp32 master: checking it too
// measured slower.
template <class L>
HWY_INLINE void FusedStore(const FusedPair& p, const internal::FusedScales& s,
                           void* param, void* master, void* m, void* v, size_t i) {
  constexpr bool kCheckMoments = L::kExpAvg == kBF16 && L::kExpAvgSq == kBF16;
  constexpr bool kCheckWeight = L::kWeight == Weight::kRemainder;
  if constexpr (kCheckMoments || kCheckWeight) {
    VF sum = kCheckMoments ? hn::Add(hn::Add(p.m0, p.m1), hn::Add(p.v0, p.v1))
                           : hn::Add(p.w0, p.w1);
    if (kCheckMoments && kCheckWeight) sum = hn::Add(sum, hn::Add(p.w0, p.w1));
    if (HWY_LIKELY(hn::AllFalse(DF(), hn::IsNaN(sum)))) {
      FusedStoreAll<L, kCheckMoments, kCheckWeight>(p, s, param, master, m, v, i);
      return;
    }
  }
  FusedStoreAll<L, false, false>(p, s, param, master, m, v, i);
}

// internal::FusedFn. Each stream is read once and written once, with nothing
// staged in fp32 blocks: for the 16-bit and 8-bit layouts the block path's
// extra L1 stores and reloads cost more than the update's divisions. Software
// pipelined (see the loop) so the core always has independent work beside
// the update's long chain of square root and divisions.
template <bool kAdamW, bool kUnitBc2, class L>
HWY_NOINLINE HWY_FLATTEN void FusedSpan(const StepConstants& k, const void* grad,
                                        void* param, void* master, void* m, void* v,
                                        const internal::FusedScales& s, size_t n) {
  if (n == 0) return;
  const size_t step = 2 * hn::Lanes(DF());
  const VecOps<kUnitBc2> ops;
  const typename VecOps<kUnitBc2>::Consts c = MakeConsts<kUnitBc2>(k);
  const float m_factor = MomentDecodeFactor<L::kExpAvg>(s.m_old);
  const float v_factor = MomentDecodeFactor<L::kExpAvgSq>(s.v_old);
  // The update is split across iterations: pair i + 1 is loaded and its
  // moments and denominators (square root, division) computed before pair i's
  // weight division, encoding and stores, so two halves of the long chain,
  // from different pairs, are in flight at once (in cache, one core: 4.5-10%
  // faster for the 16-bit and fp8 layouts than updating pair i + 1 whole there,
  // fp32 unchanged).
  // The halves are called here, not from a helper: HWY_FLATTEN inlines the ops
  // object's methods only into the function that carries the attribute.
  VF g0, g1, w0, w1, m0, m1, v0, v1;
  const FusedPair cur{g0, g1, w0, w1, m0, m1, v0, v1};
  FusedLoad<L>(grad, param, master, m, v, m_factor, v_factor, 0, cur);
  VF d0, d1;
  AdamMoments<kAdamW>(ops, c, cur.g0, cur.w0, cur.m0, cur.v0, d0);
  AdamMoments<kAdamW>(ops, c, cur.g1, cur.w1, cur.m1, cur.v1, d1);
  size_t i = 0;
  for (; i + step < n; i += step) {
    VF next_g0, next_g1, next_w0, next_w1, next_m0, next_m1, next_v0, next_v1;
    const FusedPair next{next_g0, next_g1, next_w0, next_w1,
                         next_m0, next_m1, next_v0, next_v1};
    FusedLoad<L>(grad, param, master, m, v, m_factor, v_factor, i + step, next);
    VF e0, e1;
    AdamMoments<kAdamW>(ops, c, next.g0, next.w0, next.m0, next.v0, e0);
    AdamMoments<kAdamW>(ops, c, next.g1, next.w1, next.m1, next.v1, e1);
    AdamWeight(ops, c, cur.w0, cur.m0, d0);
    AdamWeight(ops, c, cur.w1, cur.m1, d1);
    FusedStore<L>(cur, s, param, master, m, v, i);
    CopyPair(next, cur);
    d0 = e0;
    d1 = e1;
  }
  AdamWeight(ops, c, cur.w0, cur.m0, d0);
  AdamWeight(ops, c, cur.w1, cur.m1, d1);
  FusedStore<L>(cur, s, param, master, m, v, i);
}

// internal::FusedMeasureFn: FusedSpan's measured moments, reduced instead of
// stored. With AdamW, w's update is unused and the compiler drops it with its
// square root and divisions.
template <bool kAdamW, class L>
HWY_NOINLINE HWY_FLATTEN void FusedMeasure(const StepConstants& k, const void* grad,
                                           const void* param, const void* master,
                                           const void* m, const void* v,
                                           const internal::FusedScales& s, size_t n,
                                           uint32_t* max_bits) {
  constexpr DType kM = L::kExpAvg;
  constexpr DType kV = L::kExpAvgSq;
  const DI di;
  const size_t L2 = 2 * hn::Lanes(DF());
  const VecOps<true> ops;
  const typename VecOps<true>::Consts c = MakeConsts<true>(k);
  const float m_factor = MomentDecodeFactor<kM>(s.m_old);
  const float v_factor = MomentDecodeFactor<kV>(s.v_old);
  VI acc_m = hn::Zero(di);
  VI acc_v = hn::Zero(di);
  for (size_t i = 0; i < n; i += L2) {
    VF g0, g1, w0, w1, m0, m1, v0, v1;
    // Only measured layouts come here: never the even/odd one.
    LoadGradx2<L::kGrad, false>(grad, i, g0, g1);
    if constexpr (kAdamW) {
      w0 = g0;
      w1 = g1;
    } else {
      LoadWx2<L::kWeight, false>(param, master, i, w0, w1);
    }
    LoadMomentx2<kM, false>(m, i, m_factor, m0, m1);
    LoadMomentx2<kV, false>(v, i, v_factor, v0, v1);
    AdamElement<kAdamW>(ops, c, g0, w0, m0, v0);
    AdamElement<kAdamW>(ops, c, g1, w1, m1, v1);
    // A moment that needs no measuring is not (with AdamW its update is then dead).
    if constexpr (NeedsMeasuringPass(kM)) {
      acc_m = hn::Max(acc_m, hn::Max(AbsBits(m0), AbsBits(m1)));
    }
    if constexpr (NeedsMeasuringPass(kV)) {
      acc_v = hn::Max(acc_v, hn::Max(AbsBits(v0), AbsBits(v1)));
    }
  }
  const uint32_t bits_m = static_cast<uint32_t>(hn::GetLane(hn::MaxOfLanes(di, acc_m)));
  const uint32_t bits_v = static_cast<uint32_t>(hn::GetLane(hn::MaxOfLanes(di, acc_v)));
  if (bits_m > max_bits[1]) max_bits[1] = bits_m;
  if (bits_v > max_bits[2]) max_bits[2] = bits_v;
}

// The codes of a per-block moment format, for FusedBlockSpan.
template <DType D>
struct BlockCodesOf;
template <>
struct BlockCodesOf<DType::kFloat8E4M3Block> { using T = F8Codes; };
template <>
struct BlockCodesOf<DType::kUFloat8E4M4Block> { using T = UF8Codes; };
template <>
struct BlockCodesOf<DType::kFloat4E2M1Block> { using T = F4Codes; };
template <>
struct BlockCodesOf<DType::kUFloat4E3M1Block> { using T = UF4Codes; };

// Where element e's code starts (e is even for 4-bit codes: a pair's start).
template <class Codes>
HWY_INLINE uint8_t* CodesAt(void* codes, size_t e) {
  return static_cast<uint8_t*>(codes) + e * Codes::kBits / 8;
}

// FusedBlockSpan's pair at element e, its moments decoded with the block's old scales.
template <class L, bool kEO, class MC, class VC>
HWY_INLINE void LoadBlockPair(const void* grad, const void* param, const void* master,
                              void* m, void* v, size_t e, const ScaledLoad<MC, true>& load_m,
                              const ScaledLoad<VC, true>& load_v, const FusedPair& p) {
  LoadGradx2<L::kGrad, kEO>(grad, e, p.g0, p.g1);
  LoadWx2<L::kWeight, kEO>(param, master, e, p.w0, p.w1);
  load_m.template Load<kEO>(CodesAt<MC>(m, e), p.m0, p.m1);
  load_v.template Load<kEO>(CodesAt<VC>(v, e), p.v0, p.v1);
}

// Stores the pair's weight (a stochastically rounded one with the bits of
// `param_rounding`, whose flat index is element 0's; kKeepHash: the pair's
// PairIndexHash is kept at `index_hash` for the moments' codes), keeps its new
// moments in L1 and folds their magnitudes.
template <class L, bool kEO, bool kKeepHash>
HWY_INLINE void KeepBlockPair(const FusedPair& p, void* param, void* master, size_t e,
                              const internal::RoundingView* param_rounding,
                              uint32_t* index_hash, float* new_m, float* new_v, VI& acc_m,
                              VI& acc_v) {
  if constexpr (L::kWeight == Weight::kParamBF16Stochastic) {
    const DU du;
    VU ha, hb;
    PairIndexHash<kEO>(static_cast<uint64_t>(param_rounding->index) + e, ha, hb);
    if constexpr (kKeepHash) {
      hn::Store(ha, du, index_hash);
      hn::Store(hb, du, index_hash + hn::Lanes(du));
    }
    StoreBF16StochasticPair<kEO>(p.w0, p.w1, KeyedBits(param_rounding->key, ha),
                                 KeyedBits(param_rounding->key, hb),
                                 static_cast<uint16_t*>(param) + e);
  } else if (L::kWeight == Weight::kRemainder &&
             HWY_LIKELY(hn::AllFalse(DF(), hn::IsNaN(hn::Add(p.w0, p.w1))))) {
    StoreWx2<L::kWeight, kEO, true>(p.w0, p.w1, param, master, e);  // as FusedStore
  } else {
    StoreWx2<L::kWeight, kEO, false>(p.w0, p.w1, param, master, e);
  }
  StoreF32x2(p.m0, p.m1, new_m);
  StoreF32x2(p.v0, p.v1, new_v);
  acc_m = hn::Max(acc_m, hn::Max(AbsBits(p.m0), AbsBits(p.m1)));
  acc_v = hn::Max(acc_v, hn::Max(AbsBits(p.v0), AbsBits(p.v1)));
}

// Stores a pair of new moment values as codes of `Codes` given 1 / scale:
// rounded stochastically where `rounding` asks (Codes::kStochastic only; ha, hb:
// the pair's PairIndexHash), else to nearest.
template <class Codes, bool kEO>
HWY_INLINE void StoreMomentPair(VF a, VF b, VF by, const internal::RoundingView* rounding,
                                VU ha, VU hb, uint8_t* HWY_RESTRICT p) {
  if constexpr (Codes::kStochastic) {
    if (rounding != nullptr) {
      Codes::template StoreStochastic<kEO>(a, b, hn::Mul(a, by), hn::Mul(b, by),
                                           KeyedBits(rounding->key, ha),
                                           KeyedBits(rounding->key, hb), p);
      return;
    }
  }
  Codes::template Store<kEO>(a, b, hn::Mul(a, by), hn::Mul(b, by), p);
}

// internal::FusedBlockFn for per-block moments (fused_layouts.h
// FusedBlockLayouts): block8's E4M3 exp_avg and unsigned E4M4 exp_avg_sq, or
// block4's E2M1 and unsigned E3M1, each block's power-of-two scales (S2.9,
// S2.10, S2.12). Per block, one pass reads every stream once, updates in
// registers and stores the weight; only the new moments wait in L1 (their scale
// needs the block's absmax) before they are encoded. The same codecs and
// element formula as block_spans.cc, so the same bits.
template <bool kAdamW, bool kUnitBc2, class L>
HWY_NOINLINE HWY_FLATTEN void FusedBlockSpan(const StepConstants& k, const void* grad,
                                             void* param, void* master, void* m, void* v,
                                             float* m_scales, float* v_scales,
                                             size_t block, size_t n,
                                             const internal::RoundingView* m_rounding,
                                             const internal::RoundingView* v_rounding,
                                             const internal::RoundingView* param_rounding) {
  using MC = typename BlockCodesOf<L::kExpAvg>::T;
  using VC = typename BlockCodesOf<L::kExpAvgSq>::T;
  // Pairs in even/odd order where every stream has it (the moments' L1 copies
  // keep that order too): bf16 gradients and bf16 params (+ remainders).
  constexpr bool kEO = L::kGrad == kBF16 &&
                       (L::kWeight == Weight::kRemainder || IsBF16Param(L::kWeight)) &&
                       MC::kHasEvenOdd && VC::kHasEvenOdd;
  constexpr FormatInfo kM = FormatOf(L::kExpAvg);
  constexpr FormatInfo kV = FormatOf(L::kExpAvgSq);
  const DF df;
  const DI di;
  const size_t step = 2 * hn::Lanes(df);
  const VecOps<kUnitBc2> ops;
  const typename VecOps<kUnitBc2>::Consts c = MakeConsts<kUnitBc2>(k);
  alignas(64) float new_m[kMaxScaleBlock];
  alignas(64) float new_v[kMaxScaleBlock];
  // A stochastically rounded param's PairIndexHash, kept for the moments'
  // random bits (the same flat indices; E4M3 codes round to nearest).
  constexpr bool kKeepHash = L::kWeight == Weight::kParamBF16Stochastic &&
                             (MC::kStochastic || VC::kStochastic);
  alignas(64) uint32_t index_hash[kKeepHash ? kMaxScaleBlock : 1];
  // Where the random bits' flat indices start: both roundings hold the same one.
  const internal::RoundingView* const rounded = m_rounding ? m_rounding : v_rounding;
  for (size_t b = 0; b < n; b += block) {
    const size_t j = b / block;
    // Old scales the decoders fold (the caller's FusedDecoderFolds).
    const ScaledLoad<MC, true> load_m(m_scales[j]);
    const ScaledLoad<VC, true> load_v(v_scales[j]);
    VI acc_m = hn::Zero(di);
    VI acc_v = hn::Zero(di);
    // Pipelined as FusedSpan: pair i + 1's moments and denominators are computed
    // before pair i's weight division, so two halves of the long chain overlap.
    VF g0, g1, w0, w1, m0, m1, v0, v1, d0, d1;
    const FusedPair cur{g0, g1, w0, w1, m0, m1, v0, v1};
    LoadBlockPair<L, kEO>(grad, param, master, m, v, b, load_m, load_v, cur);
    AdamMoments<kAdamW>(ops, c, cur.g0, cur.w0, cur.m0, cur.v0, d0);
    AdamMoments<kAdamW>(ops, c, cur.g1, cur.w1, cur.m1, cur.v1, d1);
    size_t i = 0;
    for (; i + step < block; i += step) {
      VF next_g0, next_g1, next_w0, next_w1, next_m0, next_m1, next_v0, next_v1, e0, e1;
      const FusedPair next{next_g0, next_g1, next_w0, next_w1,
                           next_m0, next_m1, next_v0, next_v1};
      LoadBlockPair<L, kEO>(grad, param, master, m, v, b + i + step, load_m, load_v, next);
      AdamMoments<kAdamW>(ops, c, next.g0, next.w0, next.m0, next.v0, e0);
      AdamMoments<kAdamW>(ops, c, next.g1, next.w1, next.m1, next.v1, e1);
      AdamWeight(ops, c, cur.w0, cur.m0, d0);
      AdamWeight(ops, c, cur.w1, cur.m1, d1);
      KeepBlockPair<L, kEO, kKeepHash>(cur, param, master, b + i, param_rounding,
                                       index_hash + (kKeepHash ? i : 0), new_m + i, new_v + i,
                                       acc_m, acc_v);
      CopyPair(next, cur);
      d0 = e0;
      d1 = e1;
    }
    AdamWeight(ops, c, cur.w0, cur.m0, d0);
    AdamWeight(ops, c, cur.w1, cur.m1, d1);
    KeepBlockPair<L, kEO, kKeepHash>(cur, param, master, b + i, param_rounding,
                                     index_hash + (kKeepHash ? i : 0), new_m + i, new_v + i,
                                     acc_m, acc_v);
    const uint32_t am = static_cast<uint32_t>(hn::GetLane(hn::MaxOfLanes(di, acc_m)));
    const uint32_t av = static_cast<uint32_t>(hn::GetLane(hn::MaxOfLanes(di, acc_v)));
    float sm = BlockScaleFromAbsMaxBits(am, kM.scale_target, kM.zero_bound, kM.overflow_bound);
    float sv = BlockScaleFromAbsMaxBits(av, kV.scale_target, kV.zero_bound, kV.overflow_bound);
    // x / s as the block path divides, without a division: a new scale is a
    // power of two in [2^-126, 2^126] (S2.9: the smallest bound, fp4-block's
    // just below 7, puts FLT_MAX's block at 2^126), so 1 / s is exact and
    // normal, and x * (1 / s) is the same correctly rounded quotient.
    const VF m_by = hn::Set(df, 1.0f / sm);
    const VF v_by = hn::Set(df, 1.0f / sv);
    for (size_t i = 0; i < block; i += step) {
      VF m0, m1, v0, v1;
      LoadF32x2(new_m + i, m0, m1);
      LoadF32x2(new_v + i, v0, v1);
      // Both moments' streams hash the same flat indices once (or reuse the
      // hash a stochastically rounded param drew in the update loop).
      VU ha = hn::Zero(DU()), hb = hn::Zero(DU());
      if constexpr (kKeepHash) {
        ha = hn::Load(DU(), index_hash + i);
        hb = hn::Load(DU(), index_hash + i + hn::Lanes(DU()));
      } else if (rounded != nullptr) {
        PairIndexHash<kEO>(static_cast<uint64_t>(rounded->index) + b + i, ha, hb);
      }
      StoreMomentPair<MC, kEO>(m0, m1, m_by, m_rounding, ha, hb, CodesAt<MC>(m, b + i));
      StoreMomentPair<VC, kEO>(v0, v1, v_by, v_rounding, ha, hb, CodesAt<VC>(v, b + i));
    }
    // S2.13: codes rounded stochastically are stored as a decoded block encodes.
    if constexpr (MC::kStochastic) {
      if (m_rounding != nullptr) {
        sm = internal::CanonicalBlockCodes(L::kExpAvg, FloatOf(am), sm, CodesAt<MC>(m, b), block);
      }
    }
    if constexpr (VC::kStochastic) {
      if (v_rounding != nullptr) {
        sv = internal::CanonicalBlockCodes(L::kExpAvgSq, FloatOf(av), sv, CodesAt<VC>(v, b),
                                           block);
      }
    }
    m_scales[j] = sm;
    v_scales[j] = sv;
  }
}

template <bool kAdamW, class L>
constexpr internal::FusedMeasureFn FusedMeasureOrNull() {
  if constexpr (NeedsMeasuringPass(L::kExpAvg) || NeedsMeasuringPass(L::kExpAvgSq)) {
    return FusedMeasure<kAdamW, L>;
  } else {
    return nullptr;
  }
}

// Every listed layout's kernels, in FusedLayouts order, built at compile time.
template <size_t... I>
constexpr internal::FusedTable MakeFusedTable(std::index_sequence<I...>) {
  using internal::FusedLayouts;
  internal::FusedTable t{};
  ((t.fn[0][0][I] = FusedSpan<false, false, std::tuple_element_t<I, FusedLayouts>>,
    t.fn[0][1][I] = FusedSpan<false, true, std::tuple_element_t<I, FusedLayouts>>,
    t.fn[1][0][I] = FusedSpan<true, false, std::tuple_element_t<I, FusedLayouts>>,
    t.fn[1][1][I] = FusedSpan<true, true, std::tuple_element_t<I, FusedLayouts>>,
    t.measure[0][I] = FusedMeasureOrNull<false, std::tuple_element_t<I, FusedLayouts>>(),
    t.measure[1][I] = FusedMeasureOrNull<true, std::tuple_element_t<I, FusedLayouts>>()),
   ...);
  return t;
}

// And every listed block layout's kernel, in FusedBlockLayouts order.
template <size_t... I>
constexpr internal::FusedTable WithFusedBlockKernels(internal::FusedTable t,
                                                     std::index_sequence<I...>) {
  using internal::FusedBlockLayouts;
  ((t.block[0][0][I] = FusedBlockSpan<false, false, std::tuple_element_t<I, FusedBlockLayouts>>,
    t.block[0][1][I] = FusedBlockSpan<false, true, std::tuple_element_t<I, FusedBlockLayouts>>,
    t.block[1][0][I] = FusedBlockSpan<true, false, std::tuple_element_t<I, FusedBlockLayouts>>,
    t.block[1][1][I] = FusedBlockSpan<true, true, std::tuple_element_t<I, FusedBlockLayouts>>),
   ...);
  return t;
}

// Constant data where the vector size is known at compile time. Scalable
// targets (SVE, RVV) learn it at run time, with their own instructions, so
// targets.cc reads only the tables of targets this CPU runs.
#if HWY_HAVE_SCALABLE
#define SHARDADAM_KERNEL_TABLE static const
#define SHARDADAM_PAIR_LANES (2 * hn::Lanes(DF()))
#else
#define SHARDADAM_KERNEL_TABLE static constexpr
#define SHARDADAM_PAIR_LANES (2 * hn::MaxLanes(DF()))
#endif

const internal::KernelTable* GetKernelTable() {
  static constexpr internal::FusedTable kFused = WithFusedBlockKernels(
      MakeFusedTable(std::make_index_sequence<internal::kNumFusedLayouts>()),
      std::make_index_sequence<internal::kNumFusedBlockLayouts>());
  SHARDADAM_KERNEL_TABLE internal::KernelTable table = {
      HWY_TARGET,
      SHARDADAM_PAIR_LANES,
      {DecodeF32, DecodeBF16, DecodeF16, DecodeF16Scaled, DecodeScaled<F8Codes>,
       DecodeRemainder, DecodeScaled<UF8Codes>, DecodeScaled<F4Codes>,
       DecodeScaled<UF4Codes>},
      {EncodeF32, EncodeBF16, EncodeF16, EncodeF16Scaled, EncodeScaled<F8Codes>,
       EncodeRemainder, EncodeScaled<UF8Codes>, EncodeScaled<F4Codes>,
       EncodeScaled<UF4Codes>},
      EncodeStochastic<F4Codes>,
      EncodeStochastic<UF4Codes>,
      EncodeStochastic<UF8Codes>,
      EncodeBF16Stochastic,
      {{UpdateBlock<false, false>, UpdateBlock<false, true>},
       {UpdateBlock<true, false>, UpdateBlock<true, true>}},
      {{{ReduceBlock<false, false, false>, ReduceBlock<false, false, true>},
        {ReduceBlock<false, true, false>, ReduceBlock<false, true, true>}},
       {{ReduceBlock<true, false, false>, ReduceBlock<true, false, true>},
        {ReduceBlock<true, true, false>, ReduceBlock<true, true, true>}}},
      kFused,
      AbsMaxBits,
      AbsMaxBits16,
      AbsMaxCode8,
  };
  // Tails shorter than a pair are staged in kGranule-float stack buffers
  // (spans.cc), and work items start on multiples of kGranule.
  HWY_ASSERT(table.pair <= internal::kGranule && internal::kGranule % table.pair == 0);
  return &table;
}

#undef SHARDADAM_KERNEL_TABLE
#undef SHARDADAM_PAIR_LANES

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace shardadam
HWY_AFTER_NAMESPACE();

#endif  // SHARDADAM_ADAM_INL_H_
