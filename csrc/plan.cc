// Tensor plans (plan.h): every choice that depends only on a slot's formats.
#include "plan.h"

#include <cmath>
#include <limits>

#include "counter_hash.h"

namespace shardadam {
namespace internal {
namespace {

// How the fused kernels read the weight of this slot, if any of them can.
bool FusedWeightOf(const TensorSlot& s, Weight& weight) {
  if (s.param_dtype == DType::kFloat32 && s.master_dtype == DType::kNone) {
    weight = Weight::kParamF32;
  } else if (s.param_dtype == DType::kBFloat16 && s.master_dtype == DType::kFloat32) {
    weight = Weight::kMasterF32;
  } else if (s.param_dtype == DType::kBFloat16 &&
             s.master_dtype == DType::kInt16Remainder) {
    weight = Weight::kRemainder;
  } else if (s.param_dtype == DType::kBFloat16 && s.master_dtype == DType::kNone) {
    weight = s.param_rounding == Rounding::kStochastic ? Weight::kParamBF16Stochastic
                                                      : Weight::kParamBF16;
  } else {
    return false;
  }
  return true;
}

// FusedLayouts index of the slot's layout, or -1. Needs the plan's old scales.
int ChooseFused(const TensorSlot& s, const TensorPlan& p) {
  Weight weight;
  if (!FusedWeightOf(s, weight)) return -1;
  const int index =
      kFusedLayoutIndex.Of(s.grad_dtype, weight, s.exp_avg_dtype, s.exp_avg_sq_dtype);
  if (index < 0 || !FusedDecoderFolds(s.exp_avg_dtype, p.old_scale[kStreamM]) ||
      !FusedDecoderFolds(s.exp_avg_sq_dtype, p.old_scale[kStreamV])) {
    return -1;
  }
  return index;
}

}  // namespace

float FoldableScale(DType moment) {
  const Element e = FormatOf(moment).element;
  return e == Element::kFloat8E4M3 || e == Element::kUFloat8E4M4
             ? std::numeric_limits<float>::max() / kE4M3OverF16  // exact: divided by 2^8
             : std::numeric_limits<float>::infinity();
}

Codec CodecOf(DType dtype, bool is_state) {
  const FormatInfo f = FormatOf(dtype);
  const bool scaled = is_state && f.scaling != Scaling::kNone;
  switch (f.element) {
    case Element::kFloat16:
      return scaled ? kCodecF16Scaled : kCodecF16;
    case Element::kBFloat16:
      return kCodecBF16;
    case Element::kFloat8E4M3:
      return kCodecF8Scaled;
    case Element::kInt16Remainder:
      return kCodecRemainder;
    case Element::kUFloat8E4M4:
      return kCodecUF8Scaled;
    case Element::kFloat4E2M1:
      return kCodecF4Scaled;
    case Element::kUFloat4E3M1:
      return kCodecUF4Scaled;
    default:
      return kCodecF32;
  }
}

TensorPlan MakePlan(const KernelTable& kt, const TensorSlot& s, int64_t step) {
  TensorPlan p;
  p.numel = s.numel;
  p.param = static_cast<char*>(s.param);
  p.grad = static_cast<const char*>(s.grad);
  p.exp_avg = static_cast<char*>(s.exp_avg);
  p.exp_avg_sq = static_cast<char*>(s.exp_avg_sq);
  p.param_bits = FormatOf(s.param_dtype).item_bits;
  p.grad_bits = FormatOf(s.grad_dtype).item_bits;
  p.exp_avg_bits = FormatOf(s.exp_avg_dtype).item_bits;
  p.exp_avg_sq_bits = FormatOf(s.exp_avg_sq_dtype).item_bits;
  p.grad_codec = CodecOf(s.grad_dtype, false);
  p.decode_grad = kt.decode[p.grad_codec];

  const Codec param_codec = CodecOf(s.param_dtype, false);
  if (s.master_dtype == DType::kNone) {
    p.w_codec = param_codec;
    if (param_codec != kCodecF32) p.encode_param = kt.encode[param_codec];
  } else {
    p.master = static_cast<char*>(s.master_param);
    p.master_bits = FormatOf(s.master_dtype).item_bits;
    p.w_codec = CodecOf(s.master_dtype, true);
    if (p.w_codec == kCodecRemainder) {
      // w is rebuilt from the param and the remainder, and split back.
      p.encode_param = kt.encode[kCodecRemainder];
    } else {
      p.w_from_master = true;
      p.encode_param = kt.encode[param_codec];
      if (p.w_codec != kCodecF32) p.encode_master = kt.encode[p.w_codec];
    }
  }
  p.decode_w = kt.decode[p.w_codec];
  p.m_dtype = s.exp_avg_dtype;
  p.v_dtype = s.exp_avg_sq_dtype;
  p.m_codec = CodecOf(s.exp_avg_dtype, true);
  p.v_codec = CodecOf(s.exp_avg_sq_dtype, true);
  p.decode_m = kt.decode[p.m_codec];
  p.decode_v = kt.decode[p.v_codec];
  if (p.m_codec != kCodecF32) p.encode_m = kt.encode[p.m_codec];
  if (p.v_codec != kCodecF32) p.encode_v = kt.encode[p.v_codec];
  // All three roundings index from s.first_index (S2.13): FusedBlockSpan hands the
  // param's index hashes to the moments' encoders (kKeepHash) on that ground.
  if (s.exp_avg_rounding == Rounding::kStochastic) {
    p.encode_m_stochastic = kt.encode_f4_stochastic;
    p.m_rounding = {ExpAvgStepKey(s.rounding_key, step), s.first_index};
  }
  if (s.exp_avg_sq_rounding == Rounding::kStochastic) {
    p.encode_v_stochastic = s.exp_avg_sq_dtype == DType::kUFloat8E4M4Block
                                ? kt.encode_uf8_stochastic
                                : kt.encode_uf4_stochastic;
    p.v_rounding = {SquareStepKey(s.rounding_key, step), s.first_index};
  }
  if (s.param_rounding == Rounding::kStochastic) {
    p.encode_param_stochastic = kt.encode_bf16_stochastic;
    p.param_rounding = {ParamStepKey(s.rounding_key, step), s.first_index};
  }

  const DType state_dtypes[3] = {s.master_dtype, s.exp_avg_dtype, s.exp_avg_sq_dtype};
  float* const slots[3] = {s.master_scale, s.exp_avg_scale, s.exp_avg_sq_scale};
  for (int i = 0; i < 3; ++i) {
    if (IsBlockScaled(state_dtypes[i])) {
      p.block_scaled[i] = true;
      p.block = s.scale_block;
      p.lead = s.first_index % s.scale_block;
      p.scale_slot[i] = slots[i];
      continue;
    }
    if (!NeedsMeasuringPass(state_dtypes[i])) continue;
    p.target[i] = FormatOf(state_dtypes[i]).scale_target;
    p.scale_slot[i] = slots[i];
    p.old_scale[i] = *slots[i];  // read before any scale is written
  }
  // Per-block scales take the block path (block_spans.cc), fused where listed.
  p.fused = p.block > 0 ? -1 : ChooseFused(s, p);
  Weight weight;
  if (p.block > 0 && FusedWeightOf(s, weight)) {
    p.fused_block = kFusedBlockLayoutIndex.Of(s.grad_dtype, weight, s.exp_avg_dtype,
                                              s.exp_avg_sq_dtype);
  }
  return p;
}

}  // namespace internal
}  // namespace shardadam
