// Scalar reference of the shardadam contract; see reference.h. Codecs work on
// the integer bits of fp32 so their rounding does not depend on the FPU's mode
// or on any SIMD conversion instruction.
#include "reference.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "bf16_stochastic.h"  // shared with the CUDA kernels
#include "counter_hash.h"  // shared with the CUDA kernels
#include "element.h"
#include "float4.h"   // shared with the CUDA kernels
#include "stochastic_blocks.h"  // shared with the CUDA kernels
#include "ufloat8.h"  // shared with the CUDA kernels

namespace shardadam {
namespace reference {
namespace {

uint32_t BitsOf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

float FloatOf(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Rounds `value >> shift` to nearest, ties to even (shift in [1, 31]).
uint32_t ShiftRoundNearestEven(uint32_t value, int shift) {
  const uint32_t kept = value >> shift;
  const uint32_t dropped = value & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (dropped > half || (dropped == half && (kept & 1))) return kept + 1;
  return kept;
}

// Index in the scale slot of element i of `t`'s per-block scaled states (S2.9).
int64_t BlockOf(const TensorSlot& t, int64_t i) {
  return (t.first_index + i) / t.scale_block - t.first_index / t.scale_block;
}

// S2.9: the smallest power of two s in [2^-126, 2^127] with a / s <= bound,
// searched upward; 1 when a block holds a non-finite value or one of at least
// the format's overflow bound, or encodes to zeros only (then it does at scale
// 1 too).
float BlockScale(const float* u, int64_t count, DType dtype) {
  float a = 0.0f;
  for (int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(u[i])) return 1.0f;
    a = std::fmax(a, std::fabs(u[i]));
  }
  if (a >= FormatOf(dtype).overflow_bound) return 1.0f;
  float s = std::ldexp(1.0f, 127);
  for (int e = -126; e < 127; ++e) {
    if (static_cast<double>(a) / std::ldexp(1.0, e) <= FormatOf(dtype).scale_target) {
      s = std::ldexp(1.0f, e);
      break;
    }
  }
  bool all_zero = true;
  for (int64_t i = 0; i < count; ++i) {
    uint8_t code = 0;
    StoreElement(&code, dtype, 0, u[i] / s);
    all_zero = all_zero && LoadElement(&code, dtype, 0) == 0.0f;
  }
  return all_zero ? 1.0f : s;
}

// True value of element i of a moment or master buffer of `t` (S2.2, S2.9).
float LoadState(const TensorSlot& t, const void* buffer, DType dtype, const float* scale,
                int64_t i) {
  const float q = LoadElement(buffer, dtype, i);
  if (IsBlockScaled(dtype)) return q * scale[BlockOf(t, i)];
  return IsScaled(dtype) ? q * *scale : q;
}

// Stores the fp32 values `u` as a moment or master of `t` with fresh scales
// (S2.3, S2.9); a non-null `stochastic_key` (the step's key; fp4-block,
// ufp4-block or ufp8-block only) rounds them stochastically (S2.13).
void StoreState(const TensorSlot& t, const std::vector<float>& u, void* buffer,
                DType dtype, float* scale, const uint32_t* stochastic_key = nullptr) {
  const int64_t numel = static_cast<int64_t>(u.size());
  if (IsBlockScaled(dtype)) {
    for (int64_t begin = 0; begin < numel;) {
      int64_t end = begin + 1;
      while (end < numel && BlockOf(t, end) == BlockOf(t, begin)) ++end;
      float s = BlockScale(u.data() + begin, end - begin, dtype);
      if (stochastic_key == nullptr) {
        for (int64_t i = begin; i < end; ++i) StoreBlockElement(buffer, dtype, i, u[i], s);
      } else {
        uint32_t top = 0;
        for (int64_t i = begin; i < end; ++i) {
          const uint32_t bits =
              RandomBits(*stochastic_key, static_cast<uint64_t>(t.first_index + i));
          const uint8_t code = EncodeStochasticCode(dtype, u[i], s, bits);
          SetCode(buffer, dtype, i, code);
          top = std::max(top, StochasticRank(dtype, code));
        }
        // S2.13: stored as its decoded values would encode again.
        const float canonical = CanonicalBlockScale(dtype, top, s);
        if (canonical < s) {
          for (int64_t i = begin; i < end; ++i) {
            SetCode(buffer, dtype, i, DoubledBlockCode(dtype, CodeAt(buffer, dtype, i)));
          }
        }
        s = canonical;
      }
      scale[BlockOf(t, begin)] = s;
      begin = end;
    }
    // S2.12: the nibble after an odd count of 4-bit codes is padding, written 0.
    if (FormatOf(dtype).item_bits == 4 && numel % 2 == 1) SetCode(buffer, dtype, numel, 0);
    return;
  }
  if (!IsScaled(dtype)) {
    for (int64_t i = 0; i < numel; ++i) StoreElement(buffer, dtype, i, u[i]);
    return;
  }
  const float s = MeasureScale(u.data(), numel, dtype);
  for (int64_t i = 0; i < numel; ++i) StoreElement(buffer, dtype, i, u[i] / s);
  *scale = s;
}

template <bool kAdamW>
void StepTensor(const TensorSlot& t, const StepConstants& c, int64_t step) {
  const int64_t n = t.numel;
  std::vector<float> w(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    const float g = LoadElement(t.grad, t.grad_dtype, i);
    if (t.master_dtype == DType::kInt16Remainder) {
      w[i] = MergeMaster(static_cast<const uint16_t*>(t.param)[i],
                         static_cast<const int16_t*>(t.master_param)[i]);
    } else if (t.master_dtype != DType::kNone) {
      w[i] = LoadState(t, t.master_param, t.master_dtype, t.master_scale, i);
    } else {
      w[i] = LoadElement(t.param, t.param_dtype, i);
    }
    m[i] = LoadState(t, t.exp_avg, t.exp_avg_dtype, t.exp_avg_scale, i);
    v[i] = LoadState(t, t.exp_avg_sq, t.exp_avg_sq_dtype, t.exp_avg_sq_scale, i);
    AdamElement<kAdamW>(ScalarOps{}, c, g, w[i], m[i], v[i]);
  }
  // S3.6: the param is rounded from the updated fp32 w, before (and
  // independently of) the master's re-encoding.
  if (t.master_dtype == DType::kInt16Remainder) {
    for (int64_t i = 0; i < n; ++i) {
      SplitMaster(w[i], &static_cast<uint16_t*>(t.param)[i],
                  &static_cast<int16_t*>(t.master_param)[i]);
    }
  } else if (t.param_rounding == Rounding::kStochastic) {  // S2.14
    const uint32_t key = ParamStepKey(t.rounding_key, step);
    for (int64_t i = 0; i < n; ++i) {
      static_cast<uint16_t*>(t.param)[i] = EncodeBF16Stochastic(
          w[i], RandomBits(key, static_cast<uint64_t>(t.first_index + i)));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      StoreElement(t.param, t.param_dtype, i, w[i]);
    }
    if (t.master_dtype != DType::kNone) {
      StoreState(t, w, t.master_param, t.master_dtype, t.master_scale);
    }
  }
  const uint32_t key = ExpAvgStepKey(t.rounding_key, step);
  StoreState(t, m, t.exp_avg, t.exp_avg_dtype, t.exp_avg_scale,
             t.exp_avg_rounding == Rounding::kStochastic ? &key : nullptr);
  const uint32_t square_key = SquareStepKey(t.rounding_key, step);
  StoreState(t, v, t.exp_avg_sq, t.exp_avg_sq_dtype, t.exp_avg_sq_scale,
             t.exp_avg_sq_rounding == Rounding::kStochastic ? &square_key : nullptr);
}

}  // namespace

uint16_t FloatToBFloat16(float f) {
  const uint32_t bits = BitsOf(f);
  if (std::isnan(f)) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040);  // made quiet
  }
  // Rounding the low half away may carry into the exponent; that is the correct
  // result, up to and including overflow to infinity.
  return static_cast<uint16_t>(ShiftRoundNearestEven(bits, 16));
}

float BFloat16ToFloat(uint16_t h) {
  return FloatOf(static_cast<uint32_t>(h) << 16);
}

uint16_t FloatToFloat16(float f) {
  const uint32_t bits = BitsOf(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const uint32_t abs = bits & 0x7FFFFFFF;
  const int exponent = static_cast<int>(abs >> 23);  // biased by 127
  if (abs > 0x7F800000) {  // NaN: keep the top payload bits, force quiet
    return static_cast<uint16_t>(sign | 0x7E00 | ((abs >> 13) & 0x03FF));
  }
  if (abs >= 0x477FF000) return sign | 0x7C00;  // >= 65520 rounds to infinity
  if (exponent >= 113) {
    // Normal fp16 (|f| >= 2^-14): rebias the exponent from 127 to 15 and round
    // the 23-bit mantissa to 10; a carry correctly bumps the exponent.
    return static_cast<uint16_t>(sign |
                                 ShiftRoundNearestEven(abs - (112u << 23), 13));
  }
  if (exponent < 102) return sign;  // |f| < 2^-25: rounds to zero
  // Subnormal fp16: units of 2^-24. The fp32 value is mantissa *
  // 2^(exponent-150) (implicit bit set), i.e. mantissa >> (126 - exponent)
  // units, shift in [14, 24].
  const uint32_t mantissa = (abs & 0x007FFFFF) | 0x00800000;
  return static_cast<uint16_t>(sign |
                               ShiftRoundNearestEven(mantissa, 126 - exponent));
}

float Float16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F;
  const uint32_t mantissa = h & 0x03FF;
  if (exponent == 0x1F) {  // inf, or NaN made quiet with its payload (as F16C does)
    return FloatOf(sign | 0x7F800000 | (mantissa << 13) | (mantissa ? 0x00400000 : 0));
  }
  if (exponent == 0) {
    const float magnitude =
        std::ldexp(static_cast<float>(mantissa), -24);  // exact
    return sign ? -magnitude : magnitude;
  }
  return FloatOf(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint8_t FloatToFloat8E4M3(float f) {
  const uint32_t bits = BitsOf(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const uint32_t abs = bits & 0x7FFFFFFF;
  // No infinities in E4M3fn: NaN, infinity and anything that rounds past 448
  // (strictly above 464, the tie, which goes to the even code 448) is NaN.
  if (abs > 0x43E80000) return sign | 0x7F;
  const int exponent = static_cast<int>(abs >> 23) - 127;
  if (exponent < -6) {
    // Subnormal E4M3: multiples of 2^-9. |f| * 2^9 < 8 is exact in fp32 and
    // nearbyint rounds it to nearest even; 8 is the smallest normal's code.
    const float units = std::nearbyint(std::ldexp(FloatOf(abs), 9));
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(units));
  }
  // Normal: 4-bit exponent biased by 7, mantissa rounded from 23 bits to 3.
  const uint32_t code =
      (static_cast<uint32_t>(exponent + 7) << 23) | (abs & 0x007FFFFF);
  return static_cast<uint8_t>(sign | ShiftRoundNearestEven(code, 20));
}

float Float8E4M3ToFloat(uint8_t q) {
  const bool negative = (q & 0x80) != 0;
  const int exponent = (q >> 3) & 0x0F;
  const int mantissa = q & 0x07;
  if (exponent == 0x0F && mantissa == 0x07) return negative ? -NAN : NAN;
  const float magnitude =
      exponent == 0
          ? std::ldexp(static_cast<float>(mantissa), -9)
          : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return negative ? -magnitude : magnitude;
}

uint8_t FloatToUFloat8E4M4(float f) { return EncodeUFloat8E4M4(f); }

float UFloat8E4M4ToFloat(uint8_t q) { return DecodeUFloat8E4M4(q); }

uint8_t FloatToFloat4E2M1(float f) { return EncodeFloat4E2M1(f); }

float Float4E2M1ToFloat(uint8_t q) { return DecodeFloat4E2M1(q); }

uint8_t FloatToUFloat4E3M1(float f) { return EncodeUFloat4E3M1(f); }

float UFloat4E3M1ToFloat(uint8_t q) { return DecodeUFloat4E3M1(q); }

void StoreBlockElement(void* buffer, DType dtype, int64_t i, float u, float s) {
  StoreElement(buffer, dtype, i, u / s);
  const bool zero_free =
      dtype == DType::kUFloat8E4M4Block || dtype == DType::kUFloat4E3M1Block;
  if (zero_free && u != 0.0f && CodeAt(buffer, dtype, i) == 0) SetCode(buffer, dtype, i, 1);
}

uint8_t CodeAt(const void* buffer, DType dtype, int64_t i) {
  const uint8_t* bytes = static_cast<const uint8_t*>(buffer);
  if (FormatOf(dtype).item_bits == 8) return bytes[i];
  return (i % 2 == 0 ? bytes[i / 2] : bytes[i / 2] >> 4) & 0xF;
}

void SetCode(void* buffer, DType dtype, int64_t i, uint8_t code) {
  uint8_t* bytes = static_cast<uint8_t*>(buffer);
  if (FormatOf(dtype).item_bits == 8) {
    bytes[i] = code;
  } else if (i % 2 == 0) {
    bytes[i / 2] = static_cast<uint8_t>((bytes[i / 2] & 0xF0) | code);
  } else {
    bytes[i / 2] = static_cast<uint8_t>((bytes[i / 2] & 0x0F) | (code << 4));
  }
}

void SplitMaster(float master, uint16_t* param_bits, int16_t* remainder) {
  // A NaN splits as the quiet NaN with its sign, so that the param is NaN too:
  // its own bits may round the high half from 0x7FFF to 0x8000 (-0).
  const uint32_t bits =
      std::isnan(master) ? (BitsOf(master) & 0x80000000u) | 0x7FC00000u : BitsOf(master);
  uint16_t high = static_cast<uint16_t>(bits >> 16);
  const uint16_t low = static_cast<uint16_t>(bits & 0xFFFF);
  if (low >= 0x8000) ++high;  // never wraps: only NaN high halves reach 0x7FFF
  *param_bits = high;
  *remainder = static_cast<int16_t>(low);
}

float MergeMaster(uint16_t param_bits, int16_t remainder) {
  const uint16_t low = static_cast<uint16_t>(remainder);
  uint16_t high = param_bits;
  if (low >= 0x8000) --high;
  return FloatOf((static_cast<uint32_t>(high) << 16) | low);
}

float MeasureScale(const float* u, int64_t numel, DType dtype) {
  // Only the per-tensor rule exists so far (formats.h).
  if (!IsScaled(dtype) || numel == 0) return 1.0f;
  float absmax = 0.0f;
  for (int64_t i = 0; i < numel; ++i) {
    if (!std::isfinite(u[i])) return 1.0f;
    absmax = std::fmax(absmax, std::fabs(u[i]));
  }
  if (absmax == 0.0f) return 1.0f;
  return std::fmax(absmax / FormatOf(dtype).scale_target, FLT_MIN);
}

float LoadElement(const void* buffer, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(buffer)[i];
    case DType::kFloat16:
      return Float16ToFloat(static_cast<const uint16_t*>(buffer)[i]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(buffer)[i]);
    case DType::kFloat8E4M3:
    case DType::kFloat8E4M3Block:
      return Float8E4M3ToFloat(static_cast<const uint8_t*>(buffer)[i]);
    case DType::kUFloat8E4M4Block:
      return UFloat8E4M4ToFloat(static_cast<const uint8_t*>(buffer)[i]);
    case DType::kFloat4E2M1Block:
      return Float4E2M1ToFloat(CodeAt(buffer, dtype, i));
    case DType::kUFloat4E3M1Block:
      return UFloat4E3M1ToFloat(CodeAt(buffer, dtype, i));
    default:
      return NAN;  // not a value dtype; callers never get here
  }
}

void StoreElement(void* buffer, DType dtype, int64_t i, float value) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(buffer)[i] = value;
      break;
    case DType::kFloat16:
      static_cast<uint16_t*>(buffer)[i] = FloatToFloat16(value);
      break;
    case DType::kBFloat16:
      static_cast<uint16_t*>(buffer)[i] = FloatToBFloat16(value);
      break;
    case DType::kFloat8E4M3:
    case DType::kFloat8E4M3Block:
      static_cast<uint8_t*>(buffer)[i] = FloatToFloat8E4M3(value);
      break;
    case DType::kUFloat8E4M4Block:
      static_cast<uint8_t*>(buffer)[i] = FloatToUFloat8E4M4(value);
      break;
    case DType::kFloat4E2M1Block:
      SetCode(buffer, dtype, i, FloatToFloat4E2M1(value));
      break;
    case DType::kUFloat4E3M1Block:
      SetCode(buffer, dtype, i, FloatToUFloat4E3M1(value));
      break;
    default:
      break;
  }
}

Status Convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
               int64_t numel, float scale) {
  const auto is_cast = [](DType d) { return HasRole(d, kRoleMoment) && !IsBlockScaled(d); };
  if (!is_cast(src_dtype) || !is_cast(dst_dtype)) {
    return Status::kInvalidArgument;
  }
  for (int64_t i = 0; i < numel; ++i) {
    float x = LoadElement(src, src_dtype, i);
    if (IsScaled(src_dtype)) x = x * scale;
    if (IsScaled(dst_dtype)) x = x / scale;
    StoreElement(dst, dst_dtype, i, x);
  }
  return Status::kOk;
}

void AdamStep(const TensorSlot* slots, int64_t count,
              const StepParams& params) {
  const StepConstants c = MakeStepConstants(params);
  for (int64_t k = 0; k < count; ++k) {
    if (c.adam_w_mode) {
      StepTensor<true>(slots[k], c, params.step);
    } else {
      StepTensor<false>(slots[k], c, params.step);
    }
  }
}

}  // namespace reference
}  // namespace shardadam
