// The measuring pass (pass 1) of per-tensor scaled states: the largest
// magnitude of each new state, found without storing it, skipping the blocks
// whose inputs bound their results below the maxima found so far (spans.h).
#include <algorithm>
#include <cmath>

#include "element.h"
#include "scale_rule.h"
#include "spans.h"

namespace shardadam {
namespace internal {
namespace {

// Pass 1 works in blocks of this many elements (whole granules, so whole
// pairs), each small enough to stay in L1 between the bound and the
// measurement.
constexpr size_t kBoundBlock = 8 * kGranule;
static_assert(kBoundBlock % kBlock == 0, "bound blocks are whole decode blocks");

// An fp16 magnitude (bits <= 0x7FFF) as fp32, exactly.
float HalfMagnitude(uint32_t bits) {
  const int exponent = static_cast<int>(bits >> 10);
  const float mantissa = static_cast<float>(bits & 0x3FFu);
  if (exponent == 31) return mantissa != 0 ? NAN : INFINITY;
  if (exponent == 0) return std::ldexp(mantissa, -24);
  return std::ldexp(mantissa + 1024.0f, exponent - 25);
}

// Largest decoded magnitude of a stream over [begin, begin + n), rounded as
// every decoder rounds: RN(value * scale), the scale 1 for unscaled codecs.
// Not for kCodecRemainder.
float StreamMax(const KernelTable& kt, Codec codec, const char* buffer, int64_t begin,
                size_t n, float scale) {
  const auto bits16 = [&] {
    return kt.abs_max_bits16(reinterpret_cast<const uint16_t*>(buffer) + begin, n);
  };
  float value;
  switch (codec) {
    case kCodecF32:
      return FloatOf(
          kt.abs_max_bits(reinterpret_cast<const float*>(buffer) + begin, n));
    case kCodecBF16:
      return FloatOf(bits16() << 16);
    case kCodecF8Scaled: {
      const uint32_t code =
          kt.abs_max_code8(reinterpret_cast<const uint8_t*>(buffer) + begin, n);
      value = code == 0x7Fu ? NAN : HalfMagnitude(code << 7) * kE4M3OverF16;
      break;
    }
    default:  // kCodecF16, kCodecF16Scaled
      value = HalfMagnitude(bits16());
      break;
  }
  return value * std::fabs(scale);
}

// Whether the new moments of block [begin, begin + n) may exceed the
// magnitudes in max_bits: NewMomentBounds on the largest input magnitudes,
// found by one masked integer max per stream -- a small fraction of pass 1's
// decoding and update, which a block that cannot raise the maxima skips.
// Exact: blocks are only skipped, never estimated, so max_bits ends as before.
bool BlockMayRaiseMax(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                      int64_t begin, size_t n, const uint32_t* max_bits) {
  if (p.target[kStreamW] != 0) return true;  // a scaled master's new w: no cheap bound
  float w = 0.0f;
  if (!k.adam_w_mode) {  // w enters the gradient
    if (p.w_codec == kCodecRemainder) return true;  // no cheap bound
    w = StreamMax(kt, p.w_codec, p.w_from_master ? p.master : p.param, begin, n, 1.0f);
  }
  const float g = StreamMax(kt, p.grad_codec, p.grad, begin, n, 1.0f);
  // An unscaled moment is not measured: its bound is never looked at.
  const bool m_scaled = p.target[kStreamM] != 0;
  const bool v_scaled = p.target[kStreamV] != 0;
  const float m = m_scaled ? StreamMax(kt, p.m_codec, p.exp_avg, begin, n,
                                       p.old_scale[kStreamM])
                           : 0.0f;
  const float v = v_scaled ? StreamMax(kt, p.v_codec, p.exp_avg_sq, begin, n,
                                       p.old_scale[kStreamV])
                           : 0.0f;
  const MomentBounds bound = NewMomentBounds(k, g, w, m, v);
  return (m_scaled && (BitsOf(bound.m) & 0x7FFFFFFFu) > max_bits[1]) ||
         (v_scaled && (BitsOf(bound.v) & 0x7FFFFFFFu) > max_bits[2]);
}

// Folds the magnitudes of the first `valid` new values of [begin, begin + n)
// into max_bits (w, m, v).
void MeasureBlock(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                  int64_t begin, size_t n, size_t valid, Scratch& s,
                  uint32_t* max_bits) {
  if (p.fused >= 0 && valid == n) {
    // Fused layouts never have a scaled master: only m and v are measured.
    kt.fused.measure[k.adam_w_mode ? 1 : 0][p.fused](
        k, ElementAt(p.grad, p.grad_bits, begin), ElementAt(p.param, p.param_bits, begin),
        p.master ? ElementAt(p.master, p.master_bits, begin) : nullptr,
        ElementAt(p.exp_avg, p.exp_avg_bits, begin), ElementAt(p.exp_avg_sq, p.exp_avg_sq_bits, begin),
        p.FusedScalesAt(begin), n, max_bits);
    return;
  }
  const bool reduce_w = p.target[kStreamW] != 0;
  // In AdamW mode m and v do not depend on w: skip decoding it.
  const bool need_w = reduce_w || !k.adam_w_mode;
  const ReduceFn reduce = kt.reduce[k.adam_w_mode ? 1 : 0][reduce_w ? 1 : 0]
                                   [k.bias_correction2_sqrt == 1.0f ? 1 : 0];
  for (size_t done = 0; done < n && done < valid; done += kBlock) {
    const size_t c = std::min(kBlock, n - done);
    const int64_t e = begin + static_cast<int64_t>(done);
    char* master = p.master ? ElementAt(p.master, p.master_bits, e) : nullptr;
    const float* g = p.decode_grad(ElementAt(p.grad, p.grad_bits, e), nullptr, c, ScaleView(), s.g);
    const float* w =
        need_w ? p.decode_w(p.w_from_master ? master : ElementAt(p.param, p.param_bits, e),
                            master, c, p.OldScale(kStreamW, e), s.w)
               : g;
    const float* m = p.decode_m(ElementAt(p.exp_avg, p.exp_avg_bits, e), nullptr, c,
                                p.OldScale(kStreamM, e), s.m);
    const float* v = p.decode_v(ElementAt(p.exp_avg_sq, p.exp_avg_sq_bits, e), nullptr, c,
                                p.OldScale(kStreamV, e), s.v);
    reduce(k, g, w, m, v, std::min(c, valid - done), max_bits);
  }
}

}  // namespace

void ReduceSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                int64_t begin, size_t n, size_t valid, Scratch& s,
                uint32_t* max_bits) {
  if (valid < n) {  // a staged tail, one pair long: its padding is not measured
    MeasureBlock(kt, p, k, begin, n, valid, s, max_bits);
    return;
  }
  for (size_t done = 0; done < n; done += kBoundBlock) {
    const size_t c = std::min(kBoundBlock, n - done);
    const int64_t e = begin + static_cast<int64_t>(done);
    if (BlockMayRaiseMax(kt, p, k, e, c, max_bits)) {
      MeasureBlock(kt, p, k, e, c, c, s, max_bits);
    }
  }
}

}  // namespace internal
}  // namespace shardadam
