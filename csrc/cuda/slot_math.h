// What the CUDA kernels do to one element of one tensor, written as host-device
// code so the C++ tests run exactly these functions on the CPU against the
// scalar reference: read its codes, decode, update, encode, write. The kernels
// (adam_cuda.cu) add the launch: which block handles which elements (the walk
// itself is range.h, host-device too), the block reduction of the absmax, and
// the ordering of the two passes.
#ifndef SHARDADAM_CUDA_SLOT_MATH_H_
#define SHARDADAM_CUDA_SLOT_MATH_H_

#include <cfloat>
#include <cstdint>

#include "bf16_stochastic.h"
#include "cuda/block_codecs.h"
#include "counter_hash.h"
#include "cuda/codecs.h"
#include "element.h"
#include "shardadam/adam.h"
#include "scale_rule.h"
#include "stochastic_blocks.h"

namespace shardadam {
namespace cuda {

// The core's dtype rules (validate.h) on the kernels' byte-sized dtype tags: bytes
// per element (the int16 remainder: 2; no buffer, and 4-bit codes, whose
// alignment is a byte's: 0), and whether the stored value
// carries a scale (per tensor or per block).
SHARDADAM_HOST_DEVICE constexpr int ItemBytes(int dtype) {
  return FormatOf(static_cast<DType>(dtype)).item_bits / 8;
}

// Bits per element: 32, 16, 8 or 4 (two codes per byte); 0 for no buffer.
SHARDADAM_HOST_DEVICE constexpr int ItemBits(int dtype) {
  return FormatOf(static_cast<DType>(dtype)).item_bits;
}

SHARDADAM_HOST_DEVICE constexpr bool IsScaledTag(uint8_t dtype) {
  return IsScaled(static_cast<DType>(dtype));
}

SHARDADAM_HOST_DEVICE constexpr bool IsBlockScaledTag(uint8_t dtype) {
  return IsBlockScaled(static_cast<DType>(dtype));
}

// One tensor as the kernels see it: TensorSlot with dtype tags in bytes, so a
// launch's argument block holds many of them.
struct DeviceSlot {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* master;
  // kW, kM, kV; null where the state is not scaled. A per-block scaled state's
  // points to its ScaleCount(...) block scales.
  float* scale[3];
  int64_t numel;
  // Per-block scaled states (S2.9): elements per scale, and how many elements of
  // the first block precede this tensor (first_index % scale_block), so block j
  // of its scale slots holds local elements [j * scale_block - lead,
  // (j + 1) * scale_block - lead). Both 0 where no state is per-block scaled.
  int32_t scale_block, lead;
  uint8_t param_dtype, grad_dtype, exp_avg_dtype, exp_avg_sq_dtype, master_dtype;
  // Every buffer aligned to four of its elements: moved four at a time (quads.h).
  bool quad_aligned;
  // exp_avg rounded stochastically (S2.13, an fp4-block exp_avg only), with the
  // step's key (counter_hash.h ExpAvgStepKey) and the flat index of element 0 in the
  // whole parameter.
  bool m_stochastic;
  // The param rounded stochastically (S2.14, a bf16 param with no master only),
  // with its own key (ParamStepKey); first_index as above, read even when no
  // state is per-block scaled. In the padding after the flags: the slot's size,
  // and so the launch's argument block, is unchanged.
  bool p_stochastic;
  // exp_avg_sq rounded stochastically (S2.13, a ufp4-block exp_avg_sq only),
  // with its own key (SquareStepKey).
  bool v_stochastic;
  uint32_t m_key, p_key, v_key;
  int64_t first_index;
};

// Index of the three states that may carry a scale.
enum StateIndex { kW = 0, kM = 1, kV = 2 };

// The kernels' view of `t` for step `step` (the stochastic rounding key's).
inline DeviceSlot MakeDeviceSlot(const TensorSlot& t, int64_t step = 1) {
  DeviceSlot d;
  d.param = t.param;
  d.grad = t.grad;
  d.exp_avg = t.exp_avg;
  d.exp_avg_sq = t.exp_avg_sq;
  d.master = t.master_param;
  d.numel = t.numel;
  d.param_dtype = static_cast<uint8_t>(t.param_dtype);
  d.grad_dtype = static_cast<uint8_t>(t.grad_dtype);
  d.exp_avg_dtype = static_cast<uint8_t>(t.exp_avg_dtype);
  d.exp_avg_sq_dtype = static_cast<uint8_t>(t.exp_avg_sq_dtype);
  d.master_dtype = static_cast<uint8_t>(t.master_dtype);
  d.scale[kW] = IsScaledTag(d.master_dtype) ? t.master_scale : nullptr;
  d.scale[kM] = IsScaledTag(d.exp_avg_dtype) ? t.exp_avg_scale : nullptr;
  d.scale[kV] = IsScaledTag(d.exp_avg_sq_dtype) ? t.exp_avg_sq_scale : nullptr;
  const bool blocks = IsBlockScaledTag(d.exp_avg_dtype) || IsBlockScaledTag(d.exp_avg_sq_dtype);
  d.scale_block = blocks ? t.scale_block : 0;
  d.lead = blocks ? static_cast<int32_t>(t.first_index % t.scale_block) : 0;
  d.m_stochastic = t.exp_avg_rounding == Rounding::kStochastic;
  d.m_key = ExpAvgStepKey(t.rounding_key, step);
  d.p_stochastic = t.param_rounding == Rounding::kStochastic;
  d.p_key = ParamStepKey(t.rounding_key, step);
  d.v_stochastic = t.exp_avg_sq_rounding == Rounding::kStochastic;
  d.v_key = SquareStepKey(t.rounding_key, step);
  d.first_index = t.first_index;
  const auto aligned = [](const void* p, uint8_t dtype) {
    const auto quad = static_cast<uintptr_t>(4 * ItemBytes(dtype));
    return quad == 0 || reinterpret_cast<uintptr_t>(p) % quad == 0;
  };
  d.quad_aligned = aligned(d.param, d.param_dtype) && aligned(d.grad, d.grad_dtype) &&
                   aligned(d.exp_avg, d.exp_avg_dtype) &&
                   aligned(d.exp_avg_sq, d.exp_avg_sq_dtype) &&
                   aligned(d.master, d.master_dtype);
  return d;
}

// Whether `t` steps in the per-block kernel (block_range.h) rather than the
// per-tensor passes: validation keeps the two kinds of scale out of one tensor.
SHARDADAM_HOST_DEVICE inline bool HasBlockScales(const DeviceSlot& t) { return t.scale_block > 0; }

SHARDADAM_HOST_DEVICE inline bool HasScaledState(const DeviceSlot& t) {
  return t.scale[kW] != nullptr || t.scale[kM] != nullptr || t.scale[kV] != nullptr;
}

// Element i's storage code: fp32 bits, or a 16-, 8- or 4-bit code in the low bits.
// 4-bit codes: element i is the low nibble of byte i / 2 when i is even, the high
// one when odd (S2.12).
SHARDADAM_HOST_DEVICE inline uint32_t ReadCode(const void* p, uint8_t dtype, int64_t i) {
  switch (ItemBits(dtype)) {
    case 4:
      return (static_cast<const uint8_t*>(p)[i / 2] >> (4 * (i & 1))) & 0xFu;
    case 8:
      return static_cast<const uint8_t*>(p)[i];
    case 16:
      return static_cast<const uint16_t*>(p)[i];
    default:
      return static_cast<const uint32_t*>(p)[i];
  }
}

// 4-bit codes: the even element of a pair stores its whole byte, high nibble 0,
// and the odd one then fills that nibble in. So the one lane that owns a pair
// (block_range.h) writes its even element first, no other lane touches the byte,
// and a last, unpaired element leaves its padding nibble 0 as the CPU core does.
SHARDADAM_HOST_DEVICE inline void WriteCode(void* p, uint8_t dtype, int64_t i, uint32_t code) {
  switch (ItemBits(dtype)) {
    case 4: {
      uint8_t* byte = static_cast<uint8_t*>(p) + i / 2;
      *byte = (i & 1) == 0 ? static_cast<uint8_t>(code & 0xFu)
                           : static_cast<uint8_t>((*byte & 0x0Fu) | ((code & 0xFu) << 4));
      break;
    }
    case 8:
      static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(code);
      break;
    case 16:
      static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(code);
      break;
    default:
      static_cast<uint32_t*>(p)[i] = code;
      break;
  }
}

// Unscaled value of a code of fp32/fp16/bf16/fp8 or a block format, and back
// (block formats: EncodeState, whose codec may need the true value).
SHARDADAM_HOST_DEVICE inline float DecodeValue(uint32_t code, uint8_t dtype) {
  // HasBlockCodec compares tags, where FormatOf would index a table at run time.
  if (HasBlockCodec(static_cast<DType>(dtype))) return DecodeBlockCode(code, dtype);
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat16:
      return DecodeF16(static_cast<uint16_t>(code));
    case DType::kBFloat16:
      return DecodeBF16(static_cast<uint16_t>(code));
    case DType::kFloat8E4M3:
      return DecodeF8(static_cast<uint8_t>(code));
    default:
      return FloatOf(code);
  }
}

SHARDADAM_HOST_DEVICE inline uint32_t EncodeValue(float x, uint8_t dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat16:
      return EncodeF16(x);
    case DType::kBFloat16:
      return EncodeBF16(x);
    case DType::kFloat8E4M3:
      return EncodeF8(x);
    default:
      return BitsOf(x);
  }
}

// S2.2, S2.9: true value of a state code, q * scale for scaled dtypes (the
// element's block scale for block formats), and back.
SHARDADAM_HOST_DEVICE inline float DecodeState(uint32_t code, uint8_t dtype, float scale) {
  const float q = DecodeValue(code, dtype);
  return IsScaledTag(dtype) ? q * scale : q;
}

SHARDADAM_HOST_DEVICE inline uint32_t EncodeState(float u, uint8_t dtype, float scale) {
  if (HasBlockCodec(static_cast<DType>(dtype))) return EncodeBlockCode(u, scale, dtype);
  return EncodeValue(IsScaledTag(dtype) ? u / scale : u, dtype);
}

// S2.3: the scale of a state whose largest magnitude has fp32 bits `bits`
// (1 for zero, infinity or NaN); `dtype` is fp16 or fp8.
SHARDADAM_HOST_DEVICE inline float ScaleFromAbsMaxBits(uint32_t bits, uint8_t dtype) {
  return shardadam::ScaleFromAbsMaxBits(bits, FormatOf(static_cast<DType>(dtype)).scale_target);
}

// Scale values of one tensor's states (1 where unscaled).
struct Scales {
  float s[3];
};

// Reads the current scales from the slots; called once per thread.
SHARDADAM_HOST_DEVICE inline Scales ReadScales(const DeviceSlot& t) {
  Scales r;
  for (int k = 0; k < 3; ++k) r.s[k] = t.scale[k] != nullptr ? *t.scale[k] : 1.0f;
  return r;
}

// The scales measured on the new state, from the absmax bits of pass 1.
SHARDADAM_HOST_DEVICE inline Scales NewScales(const DeviceSlot& t, const uint32_t* bits) {
  const uint8_t dtypes[3] = {t.master_dtype, t.exp_avg_dtype, t.exp_avg_sq_dtype};
  Scales r;
  for (int k = 0; k < 3; ++k) {
    r.s[k] = t.scale[k] != nullptr ? ScaleFromAbsMaxBits(bits[k], dtypes[k]) : 1.0f;
  }
  return r;
}

// One element's codes in each buffer the update reads or writes.
struct Codes {
  uint32_t param, grad, master, m, v;
};

// Whether, beside a master of `master_dtype`, the param holds the weight (no
// master) or half of it (the remainder's): only then is it read.
SHARDADAM_HOST_DEVICE constexpr bool ReadsParam(int master_dtype) {
  return master_dtype == static_cast<int>(DType::kNone) ||
         master_dtype == static_cast<int>(DType::kInt16Remainder);
}

SHARDADAM_HOST_DEVICE inline Codes ReadCodes(const DeviceSlot& t, int64_t i) {
  Codes c{};
  c.grad = ReadCode(t.grad, t.grad_dtype, i);
  if (ReadsParam(t.master_dtype)) c.param = ReadCode(t.param, t.param_dtype, i);
  if (t.master_dtype != static_cast<uint8_t>(DType::kNone)) {
    c.master = ReadCode(t.master, t.master_dtype, i);
  }
  c.m = ReadCode(t.exp_avg, t.exp_avg_dtype, i);
  c.v = ReadCode(t.exp_avg_sq, t.exp_avg_sq_dtype, i);
  return c;
}

// The weight's codes (param, master) and the moments' apart: the per-block kernel
// stores the weight before its block's moment scales are known.
SHARDADAM_HOST_DEVICE inline void WriteWeightCodes(const DeviceSlot& t, int64_t i,
                                                   const Codes& c) {
  WriteCode(t.param, t.param_dtype, i, c.param);
  if (t.master_dtype != static_cast<uint8_t>(DType::kNone)) {
    WriteCode(t.master, t.master_dtype, i, c.master);
  }
}

SHARDADAM_HOST_DEVICE inline void WriteMomentCodes(const DeviceSlot& t, int64_t i,
                                                   const Codes& c) {
  WriteCode(t.exp_avg, t.exp_avg_dtype, i, c.m);
  WriteCode(t.exp_avg_sq, t.exp_avg_sq_dtype, i, c.v);
}

SHARDADAM_HOST_DEVICE inline void WriteCodes(const DeviceSlot& t, int64_t i, const Codes& c) {
  WriteWeightCodes(t, i, c);
  WriteMomentCodes(t, i, c);
}

// An element's gradient, fp32 weight and true moments, decoded with the
// current scales.
struct Inputs {
  float g, w, m, v;
};

SHARDADAM_HOST_DEVICE inline Inputs DecodeInputs(const DeviceSlot& t, const Scales& old,
                                                 const Codes& c) {
  Inputs in;
  in.g = DecodeValue(c.grad, t.grad_dtype);
  if (t.master_dtype == static_cast<uint8_t>(DType::kInt16Remainder)) {
    in.w = MergeMaster(static_cast<uint16_t>(c.param),
                       static_cast<int16_t>(static_cast<uint16_t>(c.master)));
  } else if (t.master_dtype != static_cast<uint8_t>(DType::kNone)) {
    in.w = DecodeState(c.master, t.master_dtype, old.s[kW]);
  } else {
    in.w = DecodeValue(c.param, t.param_dtype);
  }
  in.m = DecodeState(c.m, t.exp_avg_dtype, old.s[kM]);
  in.v = DecodeState(c.v, t.exp_avg_sq_dtype, old.s[kV]);
  return in;
}

// The codes of local element i's new values with the new scales. The param is
// rounded from the fp32 weight itself, independently of the master's encoding
// (S3.6); stochastically where the slot asks (S2.14), with bits drawn from the
// element's flat index. Validation allows that for a bf16 param with no master
// only; testing the dtypes too folds the branch away in the compiled layouts
// where it cannot apply (their tags are constants, layouts.h).
SHARDADAM_HOST_DEVICE inline void EncodeWeight(const DeviceSlot& t, const Scales& now,
                                                int64_t i, float w, Codes& c) {
  if (t.param_dtype == static_cast<uint8_t>(DType::kBFloat16) &&
      t.master_dtype == static_cast<uint8_t>(DType::kNone) && t.p_stochastic) {
    c.param = EncodeBF16Stochastic(
        w, RandomBits(t.p_key, static_cast<uint64_t>(t.first_index + i)));
  } else if (t.master_dtype == static_cast<uint8_t>(DType::kInt16Remainder)) {
    uint16_t param_bits;
    int16_t remainder;
    SplitMaster(w, &param_bits, &remainder);
    c.param = param_bits;
    c.master = static_cast<uint16_t>(remainder);
  } else {
    c.param = EncodeValue(w, t.param_dtype);
    if (t.master_dtype != static_cast<uint8_t>(DType::kNone)) {
      c.master = EncodeState(w, t.master_dtype, now.s[kW]);
    }
  }
}

SHARDADAM_HOST_DEVICE inline void EncodeMoments(const DeviceSlot& t, const Scales& now,
                                                 float m, float v, Codes& c) {
  c.m = EncodeState(m, t.exp_avg_dtype, now.s[kM]);
  c.v = EncodeState(v, t.exp_avg_sq_dtype, now.s[kV]);
}

// EncodeMoments for local element i of a tensor with per-block scales, its
// exp_avg and exp_avg_sq each rounded stochastically where the slot asks (S2.13).
SHARDADAM_HOST_DEVICE inline void EncodeBlockMoments(const DeviceSlot& t, const Scales& now,
                                                      int64_t i, float m, float v, Codes& c) {
  const uint64_t index = static_cast<uint64_t>(t.first_index + i);
  c.m = t.m_stochastic ? EncodeStochasticCode(static_cast<DType>(t.exp_avg_dtype), m,
                                               now.s[kM], RandomBits(t.m_key, index))
                       : EncodeState(m, t.exp_avg_dtype, now.s[kM]);
  c.v = t.v_stochastic ? EncodeStochasticCode(static_cast<DType>(t.exp_avg_sq_dtype), v,
                                               now.s[kV], RandomBits(t.v_key, index))
                       : EncodeState(v, t.exp_avg_sq_dtype, now.s[kV]);
}

// Local element i's codes.
SHARDADAM_HOST_DEVICE inline Codes EncodeOutputs(const DeviceSlot& t, const Scales& now,
                                                 int64_t i, const Inputs& out) {
  Codes c{};
  EncodeWeight(t, now, i, out.w, c);
  EncodeMoments(t, now, out.m, out.v, c);
  return c;
}

SHARDADAM_HOST_DEVICE inline Inputs LoadInputs(const DeviceSlot& t, const Scales& old,
                                               int64_t i) {
  return DecodeInputs(t, old, ReadCodes(t, i));
}

SHARDADAM_HOST_DEVICE inline void StoreElement(const DeviceSlot& t, const Scales& now,
                                               int64_t i, const Inputs& out) {
  WriteCodes(t, i, EncodeOutputs(t, now, i, out));
}

// The updated fp32 weight and moments (SEMANTICS S3.6), in place in `in`.
template <bool kAdamW>
SHARDADAM_HOST_DEVICE inline void Update(const StepConstants& c, Inputs& in) {
  AdamElement<kAdamW>(ScalarOps{}, c, in.g, in.w, in.m, in.v);
}

// |x| as ordered bits: for non-negative floats integer order is value order,
// and every NaN sorts above infinity, so one integer max finds absmax or flags
// a non-finite value.
SHARDADAM_HOST_DEVICE inline uint32_t AbsBits(float x) { return BitsOf(x) & 0x7FFFFFFFu; }

}  // namespace cuda
}  // namespace shardadam

#endif  // SHARDADAM_CUDA_SLOT_MATH_H_
