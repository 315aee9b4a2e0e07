// The update pass over a span of one tensor, and tails staged to whole pairs
// (spans.h).
#include "spans.h"

#include <algorithm>
#include <cstring>

namespace shardadam {
namespace internal {
namespace {

// The last `t` < kt.pair elements of a tensor, staged through zero-padded
// copies one pair long so every kernel sees whole pairs of vectors.
void StagedTail(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                int64_t begin, size_t t, bool update, Scratch& s,
                uint32_t* max_bits) {
  alignas(64) char buffers[5][kGranule * sizeof(float)];
  char* const space[5] = {buffers[0], buffers[1], buffers[2], buffers[3], buffers[4]};
  TensorPlan q = StageIn(p, begin, t, kt.pair, space);
  q.first = p.first + begin;
  if (!update) {
    ReduceSpan(kt, q, k, 0, kt.pair, t, s, max_bits);
    return;
  }
  UpdateSpan(kt, q, k, 0, kt.pair, s);
  StageOut(p, q, begin, t);
}

}  // namespace

TensorPlan StageIn(const TensorPlan& p, int64_t e, size_t t, size_t padded,
                   char* const buffers[5]) {
  // The padding is zero so that nothing depends on stale bytes.
  const auto stage = [&](const char* from, int bits, char* buffer) {
    const size_t held = BytesOf(bits, t);
    memcpy(buffer, ElementAt(from, bits, e), held);
    memset(buffer + held, 0, BytesOf(bits, padded) - held);
    // The high nibble after an odd count of 4-bit codes is padding too.
    if (bits == 4 && t % 2 == 1) buffer[held - 1] &= 0x0F;
    return buffer;
  };
  TensorPlan q = p;
  q.m_rounding.index = p.m_rounding.index + e;
  q.v_rounding.index = p.v_rounding.index + e;
  q.param_rounding.index = p.param_rounding.index + e;
  char** writable[4] = {&q.param, &q.master, &q.exp_avg, &q.exp_avg_sq};
  const int bits[4] = {p.param_bits, p.master_bits, p.exp_avg_bits, p.exp_avg_sq_bits};
  for (int b = 0; b < 4; ++b) {
    if (*writable[b] != nullptr) *writable[b] = stage(*writable[b], bits[b], buffers[b]);
  }
  q.grad = stage(p.grad, p.grad_bits, buffers[4]);
  return q;
}

void StageOut(const TensorPlan& p, const TensorPlan& q, int64_t e, size_t t) {
  char* const originals[4] = {p.param, p.master, p.exp_avg, p.exp_avg_sq};
  const char* const staged[4] = {q.param, q.master, q.exp_avg, q.exp_avg_sq};
  const int bits[4] = {p.param_bits, p.master_bits, p.exp_avg_bits, p.exp_avg_sq_bits};
  for (int b = 0; b < 4; ++b) {
    if (originals[b] == nullptr) continue;
    char* to = ElementAt(originals[b], bits[b], e);
    const size_t bytes = BytesOf(bits[b], t);
    memcpy(to, staged[b], bytes);
    // The padding nibble after an odd count of 4-bit codes is written 0 (S2.12),
    // whatever its zero input updated to (an infinite weight decay makes it NaN).
    if (bits[b] == 4 && t % 2 == 1) to[bytes - 1] &= 0x0F;
  }
}

void UpdateSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                int64_t begin, size_t n, Scratch& s) {
  const int adam_w = k.adam_w_mode ? 1 : 0;
  const int unit_bc2 = k.bias_correction2_sqrt == 1.0f ? 1 : 0;
  if (p.fused >= 0) {
    kt.fused.fn[adam_w][unit_bc2][p.fused](
        k, ElementAt(p.grad, p.grad_bits, begin), ElementAt(p.param, p.param_bits, begin),
        p.master ? ElementAt(p.master, p.master_bits, begin) : nullptr,
        ElementAt(p.exp_avg, p.exp_avg_bits, begin), ElementAt(p.exp_avg_sq, p.exp_avg_sq_bits, begin),
        p.FusedScalesAt(begin), n);
    return;
  }
  const UpdateFn update = kt.update[adam_w][unit_bc2];
  for (size_t done = 0; done < n; done += kBlock) {
    const size_t c = std::min(kBlock, n - done);
    const int64_t e = begin + static_cast<int64_t>(done);
    const Decoded d =
        DecodeRun(p, e, c, p.OldScale(kStreamM, e), p.OldScale(kStreamV, e), s);
    update(k, d.g, d.w, d.m, d.v, c);
    EncodeRun(p, e, c, d, p.NewScale(kStreamM, e), p.NewScale(kStreamV, e));
  }
}

Decoded DecodeRun(const TensorPlan& p, int64_t e, size_t c, const ScaleView& m_scale,
                  const ScaleView& v_scale, Scratch& s) {
  char* master = p.master ? ElementAt(p.master, p.master_bits, e) : nullptr;
  char* param = ElementAt(p.param, p.param_bits, e);
  return {p.decode_grad(ElementAt(p.grad, p.grad_bits, e), nullptr, c, ScaleView(), s.g),
          p.decode_w(p.w_from_master ? master : param, master, c, p.OldScale(kStreamW, e),
                     s.w),
          p.decode_m(ElementAt(p.exp_avg, p.exp_avg_bits, e), nullptr, c, m_scale, s.m),
          p.decode_v(ElementAt(p.exp_avg_sq, p.exp_avg_sq_bits, e), nullptr, c, v_scale, s.v)};
}

void EncodeRun(const TensorPlan& p, int64_t e, size_t c, const Decoded& d,
               const ScaleView& m_scale, const ScaleView& v_scale) {
  char* master = p.master ? ElementAt(p.master, p.master_bits, e) : nullptr;
  // The param is rounded from the updated w before the master is re-stored.
  char* const param = ElementAt(p.param, p.param_bits, e);
  if (p.encode_param_stochastic) {
    RoundingView r = p.param_rounding;
    r.index += e;
    p.encode_param_stochastic(d.w, c, ScaleView(), r, param);
  } else if (p.encode_param) {
    p.encode_param(d.w, c, ScaleView(), param, master);
  }
  if (p.encode_master) p.encode_master(d.w, c, p.NewScale(kStreamW, e), master, nullptr);
  // A moment: rounded stochastically where its plan asks (S2.13), else by its codec
  // (none where the update wrote fp32 in place).
  const auto encode_moment = [&](const float* x, const ScaleView& scale,
                                 StochasticEncodeFn stochastic, RoundingView rounding,
                                 EncodeFn nearest, char* buffer, int bits) {
    char* const at = ElementAt(buffer, bits, e);
    if (stochastic) {
      rounding.index += e;
      stochastic(x, c, scale, rounding, at);
    } else if (nearest) {
      nearest(x, c, scale, at, nullptr);
    }
  };
  encode_moment(d.m, m_scale, p.encode_m_stochastic, p.m_rounding, p.encode_m, p.exp_avg,
                p.exp_avg_bits);
  encode_moment(d.v, v_scale, p.encode_v_stochastic, p.v_rounding, p.encode_v,
                p.exp_avg_sq, p.exp_avg_sq_bits);
}

void RunSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
             int64_t begin, int64_t end, bool update, Scratch& s,
             uint32_t* max_bits) {
  const size_t n = static_cast<size_t>(end - begin);
  const size_t whole = n / kt.pair * kt.pair;
  if (whole > 0) {
    if (update) {
      UpdateSpan(kt, p, k, begin, whole, s);
    } else {
      ReduceSpan(kt, p, k, begin, whole, whole, s, max_bits);
    }
  }
  if (whole < n) {
    StagedTail(kt, p, k, begin + static_cast<int64_t>(whole), n - whole, update, s,
               max_bits);
  }
}

}  // namespace internal
}  // namespace shardadam
