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

#include <type_traits>

#include "convert-inl.h"
#include "element.h"
#include "hwy/highway.h"
#include "kernels.h"

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

const internal::KernelTable* GetKernelTable() {
  static const internal::KernelTable table = {
      HWY_TARGET,
      2 * hn::Lanes(DF()),
      {DecodeF32, DecodeBF16, DecodeF16, DecodeF16Scaled, DecodeF8Scaled,
       DecodeRemainder},
      {EncodeF32, EncodeBF16, EncodeF16, EncodeF16Scaled, EncodeF8Scaled,
       EncodeRemainder},
      {{UpdateBlock<false, false>, UpdateBlock<false, true>},
       {UpdateBlock<true, false>, UpdateBlock<true, true>}},
      {{{ReduceBlock<false, false, false>, ReduceBlock<false, false, true>},
        {ReduceBlock<false, true, false>, ReduceBlock<false, true, true>}},
       {{ReduceBlock<true, false, false>, ReduceBlock<true, false, true>},
        {ReduceBlock<true, true, false>, ReduceBlock<true, true, true>}}},
      AbsMaxBits,
  };
  return &table;
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace shardadam
HWY_AFTER_NAMESPACE();

#endif  // SHARDADAM_ADAM_INL_H_
