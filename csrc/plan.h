// One tensor's plan for one AdamStep call: its buffers, the codec or fused
// kernel of each stream, and its scales, chosen once from the slot's formats
// (formats.h) before any element is touched.
#ifndef SHARDADAM_PLAN_H_
#define SHARDADAM_PLAN_H_

#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "shardadam/adam.h"

namespace shardadam {
namespace internal {

// Element `e` of a buffer whose elements take `bits` bits; `e` is even for a
// 4-bit buffer (runs and blocks start on even elements there).
template <typename T>
inline T* ElementAt(T* buffer, int bits, int64_t e) {
  return buffer + e / 8 * bits + e % 8 * bits / 8;  // e * bits could overflow int64
}
// Bytes holding `n` elements of `bits` bits from an even element.
inline size_t BytesOf(int bits, size_t n) { return (n * bits + 7) / 8; }

// Index 0 / 1 / 2 of a plan's scale arrays: the master (w), exp_avg (m),
// exp_avg_sq (v).
enum StateStream { kStreamW = 0, kStreamM = 1, kStreamV = 2 };

struct TensorPlan {
  int64_t numel = 0;
  char* param = nullptr;
  const char* grad = nullptr;
  char* master = nullptr;  // fp32 / fp16 master or the int16 remainder
  char* exp_avg = nullptr;
  char* exp_avg_sq = nullptr;
  // Bits per element of each buffer (formats.h item_bits).
  int param_bits = 0, grad_bits = 0, master_bits = 0, exp_avg_bits = 0,
      exp_avg_sq_bits = 0;
  // Index in the tensor of element 0 of the buffers above: 0, or where a
  // staged copy of a tail starts (its scales are still the tensor's).
  int64_t first = 0;

  Codec grad_codec = kCodecF32, w_codec = kCodecF32, m_codec = kCodecF32,
        v_codec = kCodecF32;
  DecodeFn decode_grad = nullptr, decode_w = nullptr, decode_m = nullptr,
           decode_v = nullptr;
  bool w_from_master = false;  // else from param (+ remainder as aux)
  // Null where the update already wrote the buffer in place (fp32).
  EncodeFn encode_param = nullptr, encode_master = nullptr, encode_m = nullptr,
           encode_v = nullptr;
  // Set where exp_avg is rounded stochastically (S2.13), then used instead of
  // encode_m; `m_rounding` holds the step's key and the flat index in the whole
  // parameter of element 0 of the buffers above (a staged copy's own).
  StochasticEncodeFn encode_m_stochastic = nullptr;
  RoundingView m_rounding;
  // The same for exp_avg_sq (S2.13), used instead of encode_v.
  StochasticEncodeFn encode_v_stochastic = nullptr;
  RoundingView v_rounding;
  // The same for a bf16 param rounded stochastically (S2.14), used instead of
  // encode_param.
  StochasticEncodeFn encode_param_stochastic = nullptr;
  RoundingView param_rounding;

  // Per-tensor scales (StateStream order): read from the slots before the step,
  // measured on the new state, written back after it.
  float old_scale[3] = {1.0f, 1.0f, 1.0f};
  float new_scale[3] = {1.0f, 1.0f, 1.0f};
  // The format's scale_target where a stream needs a measuring pass, else 0.
  float target[3] = {0.0f, 0.0f, 0.0f};
  float* scale_slot[3] = {nullptr, nullptr, nullptr};

  // Index in FusedLayouts when the layout has a fused kernel, else -1.
  int fused = -1;
  // Index in FusedBlockLayouts for per-block scaled moments, else -1.
  int fused_block = -1;

  // Per-block scaled moments (S2.9): elements per scale (0: none), the position
  // of element 0 in its block, and which moments are per-block scaled (their
  // scale_slot holds one scale per block, the first for element 0's block).
  int64_t block = 0;
  int64_t lead = 0;
  bool block_scaled[3] = {false, false, false};
  DType m_dtype = DType::kNone, v_dtype = DType::kNone;

  bool NeedsMeasuringPass() const {
    return target[kStreamW] != 0 || target[kStreamM] != 0 || target[kStreamV] != 0;
  }
  // The scales of element `e` onwards (an index into the buffers above).
  ScaleView OldScale(int stream, int64_t e) const {
    return {&old_scale[stream], 0, first + e};
  }
  ScaleView NewScale(int stream, int64_t e) const {
    return {&new_scale[stream], 0, first + e};
  }
  // The scale of the `j`th block of this tensor's elements (0: element 0's).
  ScaleView BlockScale(int stream, int64_t j) const {
    return {scale_slot[stream] + j, 0, 0};
  }
  FusedScales FusedScalesAt(int64_t e) const {
    return {OldScale(kStreamM, e), OldScale(kStreamV, e), NewScale(kStreamM, e),
            NewScale(kStreamV, e)};
  }
};

// The plan of a validated slot for step `step` (the stochastic rounding key's);
// reads its old scales.
TensorPlan MakePlan(const KernelTable& kt, const TensorSlot& s, int64_t step = 1);

// The block-path codec of a buffer of `dtype`: a state's (moment, master) or a
// value's (param, grad, which are never scaled).
Codec CodecOf(DType dtype, bool is_state);

// The largest old scale of a moment in `moment`'s format that the fused
// kernels' decoders fold into one multiply: the 8-bit decoders fold a
// power-of-two factor (at most kE4M3OverF16), so a larger scale would overflow
// there and takes the block path; other decoders fold any finite scale
// (infinity). The core's validation admits only finite scales above 0.
float FoldableScale(DType moment);
inline bool FusedDecoderFolds(DType moment, float old_scale) {
  return std::fabs(old_scale) <= FoldableScale(moment);  // false for NaN
}

}  // namespace internal
}  // namespace shardadam

#endif  // SHARDADAM_PLAN_H_
