// The Adam/AdamW update of one element (SEMANTICS S3.6), written once for every
// implementation: the scalar reference instantiates it with `float`, the Highway
// kernels with SIMD vectors, the CUDA kernel with `float` on the device.
//
// The order of operations is fixed here and nothing fuses multiply-adds (the build
// uses -ffp-contract=off and the SIMD ops object has no FMA): every target and the
// reference then round identically, so results are bitwise equal everywhere.
#ifndef SHARDADAM_ELEMENT_H_
#define SHARDADAM_ELEMENT_H_

#include <cmath>

#include "host_device.h"
#include "shardadam/adam.h"

// The update's halves are always inlined: the SIMD kernels are compiled per
// target (Highway), these templates for the baseline one. An out-of-line copy
// taking or returning vectors would use the baseline's calling convention
// (clang's sanitizer builds emitted one, which returned garbage); inlined into a
// target's kernel they are that target's code. Vectors come in by reference:
// GCC refuses a function compiled without SVE that takes SVE's sizeless vectors
// by value, even one that is always inlined.
#if defined(__CUDACC__)
#define SHARDADAM_ELEMENT_INLINE __forceinline__
#elif defined(__GNUC__)
#define SHARDADAM_ELEMENT_INLINE inline __attribute__((always_inline))
#else
#define SHARDADAM_ELEMENT_INLINE inline
#endif

namespace shardadam {

// Per-step scalars, computed once per call in double and rounded to fp32 (as
// torch's fused kernels do), so every element sees the same constants.
struct StepConstants {
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float weight_decay;         // L2 coefficient (adam_w_mode == false)
  float decay;                // 1 - lr * weight_decay (adam_w_mode == true)
  float step_size;            // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float eps;
  bool adam_w_mode;
};

// 1 - beta1^t: the divisor of lr in step_size (1 without bias correction).
inline double BiasCorrection1(const StepParams& p) {
  return p.bias_correction ? 1.0 - std::pow(p.beta1, static_cast<double>(p.step)) : 1.0;
}

// The two constants that depend on lr. The CUDA kernels that read lr from device
// memory (StepParams::lr_in_device_memory) call this too: plain double operations
// (the CUDA build passes --fmad=false), so the device rounds as the host does.
SHARDADAM_HOST_DEVICE inline void SetLrTerms(StepConstants& k, double lr, double c1,
                                             double weight_decay) {
  k.decay = static_cast<float>(1.0 - lr * weight_decay);
  k.step_size = static_cast<float>(lr / c1);
}

inline StepConstants MakeStepConstants(const StepParams& p) {
  const double t = static_cast<double>(p.step);
  const double c2 = p.bias_correction ? 1.0 - std::pow(p.beta2, t) : 1.0;
  StepConstants k;
  k.beta1 = static_cast<float>(p.beta1);
  k.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  k.beta2 = static_cast<float>(p.beta2);
  k.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  k.weight_decay = static_cast<float>(p.weight_decay);
  SetLrTerms(k, p.lr, BiasCorrection1(p), p.weight_decay);
  k.bias_correction2_sqrt = static_cast<float>(std::sqrt(c2));
  k.eps = static_cast<float>(p.eps);
  k.adam_w_mode = p.adam_w_mode;
  return k;
}

// Scalar arithmetic for the formula below; the SIMD kernels provide an ops object
// with the same member names over vectors (constants pre-broadcast).
struct ScalarOps {
  using V = float;
  using Consts = StepConstants;  // float members are already "broadcast"
  SHARDADAM_HOST_DEVICE V Add(V a, V b) const { return a + b; }
  SHARDADAM_HOST_DEVICE V Sub(V a, V b) const { return a - b; }
  SHARDADAM_HOST_DEVICE V Mul(V a, V b) const { return a * b; }
  SHARDADAM_HOST_DEVICE V Div(V a, V b) const { return a / b; }
  SHARDADAM_HOST_DEVICE V Sqrt(V a) const { return sqrtf(a); }
};

// An ops object's `Consts`: the StepConstants fields, each broadcast to a V.
template <class V>
struct BroadcastConstants {
  V beta1, one_minus_beta1, beta2, one_minus_beta2, weight_decay, decay, step_size,
      bias_correction2_sqrt, eps;
};

// One update. `g` is the gradient in fp32, `w` the fp32 weight (master or widened
// param), `m`/`v` the true (unscaled) moments. `kAdamW` selects decoupled decay
// at compile time (StepConstants::adam_w_mode picks the instantiation).
//
// Split in two halves so a pipelined kernel can start one element's long
// sqrt / divide chain (AdamMoments) while it finishes another's (AdamWeight).
template <bool kAdamW, class Ops, class V>
SHARDADAM_HOST_DEVICE SHARDADAM_ELEMENT_INLINE void AdamMoments(
    const Ops& o, const typename Ops::Consts& c, const V& grad, V& w, V& m, V& v,
    V& denom) {
  V g = grad;
  if (!kAdamW) g = o.Add(g, o.Mul(c.weight_decay, w));
  m = o.Add(o.Mul(c.beta1, m), o.Mul(c.one_minus_beta1, g));
  v = o.Add(o.Mul(c.beta2, v), o.Mul(o.Mul(c.one_minus_beta2, g), g));
  if (kAdamW) w = o.Mul(w, c.decay);
  denom = o.Add(o.Div(o.Sqrt(v), c.bias_correction2_sqrt), c.eps);
}

template <class Ops, class V>
SHARDADAM_HOST_DEVICE SHARDADAM_ELEMENT_INLINE void AdamWeight(
    const Ops& o, const typename Ops::Consts& c, V& w, const V& m, const V& denom) {
  w = o.Sub(w, o.Div(o.Mul(c.step_size, m), denom));
}

template <bool kAdamW, class Ops, class V>
SHARDADAM_HOST_DEVICE SHARDADAM_ELEMENT_INLINE void AdamElement(
    const Ops& o, const typename Ops::Consts& c, const V& g, V& w, V& m, V& v) {
  // Copied, not default-constructed: Highway's NEON vector constructor is target
  // code, which this baseline template may not inline. AdamMoments sets it.
  V denom = v;
  AdamMoments<kAdamW>(o, c, g, w, m, v, denom);
  AdamWeight(o, c, w, m, denom);
}

// Upper bounds of |new m| and |new v| over elements whose inputs have
// magnitudes at most g, w, m, v (as AdamElement sees them: decoded, unscaled).
// Rounding to nearest is monotone, so AdamElement's own operations on the
// maxima bound its results: |RN(a + b)| <= RN(|a| + |b|) and
// |RN(c * x)| = RN(|c| * |x|). A NaN input gives a NaN bound.
struct MomentBounds {
  float m, v;
};

inline MomentBounds NewMomentBounds(const StepConstants& c, float g, float w, float m,
                                    float v) {
  if (!c.adam_w_mode) g = g + std::fabs(c.weight_decay) * w;
  return {std::fabs(c.beta1) * m + std::fabs(c.one_minus_beta1) * g,
          std::fabs(c.beta2) * v + (std::fabs(c.one_minus_beta2) * g) * g};
}

}  // namespace shardadam

#endif  // SHARDADAM_ELEMENT_H_
