// Storage codecs of the CUDA kernels, one element at a time, on the integer bits
// of fp32 only (no rounding-mode or intrinsic dependence). Host-device code: the
// C++ tests compile this header for the CPU and check it against the scalar
// reference on every bf16/fp16/fp8 pattern, so what runs on the GPU is verified
// even where no GPU is. The one exception: on GPUs with fp8 conversion
// instructions (compute capability 8.9 on) the fp8 codec uses them, with the
// integer rule's results where they differ (non-finite and out-of-range values);
// the GPU test checks them against the integer rule on every fp32 pattern and
// every code.
#ifndef SHARDADAM_CUDA_CODECS_H_
#define SHARDADAM_CUDA_CODECS_H_

#include <cstdint>
#include <cstring>

#include "scale_rule.h"  // BitsOf, FloatOf

namespace shardadam {
namespace cuda {

// `value >> shift` rounded to nearest, ties to even; shift in [1, 31].
SHARDADAM_HOST_DEVICE inline uint32_t RoundShift(uint32_t value, int shift) {
  const uint32_t kept = value >> shift;
  const uint32_t rest = value & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

// fp32 -> bf16, round to nearest even; NaN stays NaN (made quiet), as torch.
SHARDADAM_HOST_DEVICE inline uint16_t EncodeBF16(float f) {
  const uint32_t bits = BitsOf(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>(RoundShift(bits, 16));
}

SHARDADAM_HOST_DEVICE inline float DecodeBF16(uint16_t h) {
  return FloatOf(static_cast<uint32_t>(h) << 16);
}

// fp32 -> IEEE fp16: round to nearest even, gradual underflow, overflow to
// infinity, NaN kept quiet with its top payload bits.
SHARDADAM_HOST_DEVICE inline uint16_t EncodeF16(float f) {
  const uint32_t bits = BitsOf(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504
  const uint32_t exponent = abs >> 23;
  if (exponent >= 113) return static_cast<uint16_t>(sign | RoundShift(abs - (112u << 23), 13));
  if (exponent < 102) return static_cast<uint16_t>(sign);  // below half the least subnormal
  // Subnormal: units of 2^-24; mantissa (implicit bit set) >> (126 - exponent).
  const uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;
  return static_cast<uint16_t>(sign | RoundShift(mantissa, static_cast<int>(126 - exponent)));
}

SHARDADAM_HOST_DEVICE inline float DecodeF16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) {  // inf, or NaN made quiet with its payload (as the CPU core)
    return FloatOf(sign | 0x7F800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0u));
  }
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24, exact
    return FloatOf(sign | BitsOf(magnitude));
  }
  return FloatOf(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// fp32 -> fp8 E4M3 "fn" by S2.4 (torch.float8_e4m3fn up to torch 2.12): round to
// nearest even; above 464 (the tie between 448 and the NaN code), infinity and NaN
// give NaN.
SHARDADAM_HOST_DEVICE inline uint8_t EncodeF8Integer(float f) {
  const uint32_t bits = BitsOf(f);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x43E80000u) return static_cast<uint8_t>(sign | 0x7Fu);
  const uint32_t exponent = abs >> 23;  // biased by 127
  if (exponent < 121) {
    // Subnormal E4M3 (|f| < 2^-6): units of 2^-9, i.e. mantissa >> (141 - e).
    // Shifts past 31 leave less than half a unit; fp32 subnormals are far below.
    if (exponent == 0) return static_cast<uint8_t>(sign);
    const int shift = static_cast<int>(141 - exponent);
    if (shift > 31) return static_cast<uint8_t>(sign);
    const uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;
    return static_cast<uint8_t>(sign | RoundShift(mantissa, shift));  // may carry to 2^-6
  }
  // Normal: rebias 127 -> 7 and round the mantissa from 23 bits to 3.
  return static_cast<uint8_t>(sign | RoundShift(abs - (120u << 23), 20));
}

SHARDADAM_HOST_DEVICE inline float DecodeF8Integer(uint8_t q) {
  const uint32_t sign = static_cast<uint32_t>(q & 0x80u) << 24;
  const uint32_t exponent = (q >> 3) & 0xFu;
  const uint32_t mantissa = q & 0x7u;
  if (exponent == 0xF && mantissa == 0x7) return FloatOf(sign | 0x7FC00000u);
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0.001953125f;  // 2^-9, exact
    return FloatOf(sign | BitsOf(magnitude));
  }
  return FloatOf(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// The fp8 codec the kernels use: the instructions where the GPU has them (one
// instead of about fifteen integer operations to encode, ten to decode: fp8
// moments are bound by instruction issue), else the integer rule. The
// instructions round to nearest even as the rule does; the rule's NaN (above 464,
// infinities and NaN) replaces their saturation, and a NaN code decodes to the
// rule's quiet NaN rather than theirs.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define SHARDADAM_FP8_INSTRUCTIONS 1
#endif

SHARDADAM_HOST_DEVICE inline uint8_t EncodeF8(float f) {
#if defined(SHARDADAM_FP8_INSTRUCTIONS)
  const uint32_t bits = BitsOf(f);
  if ((bits & 0x7FFFFFFFu) > 0x43E80000u) return static_cast<uint8_t>(((bits >> 24) & 0x80u) | 0x7Fu);
  uint16_t pair;  // low byte: f's code
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(f));
  return static_cast<uint8_t>(pair);
#else
  return EncodeF8Integer(f);
#endif
}

SHARDADAM_HOST_DEVICE inline float DecodeF8(uint8_t q) {
#if defined(SHARDADAM_FP8_INSTRUCTIONS)
  if ((q & 0x7Fu) == 0x7Fu) return FloatOf((static_cast<uint32_t>(q & 0x80u) << 24) | 0x7FC00000u);
  uint32_t halves;  // low half: q's value in fp16 (exact)
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(static_cast<uint16_t>(q)));
  float value;
  asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(static_cast<uint16_t>(halves)));
  return value;
#else
  return DecodeF8Integer(q);
#endif
}

// S2.5: an fp32 master as a bf16 param (high half, plus one when the low half
// is >= 0x8000) and an int16 remainder (the low half); Merge undoes Split. A
// NaN splits as the quiet NaN with its sign: the device's NaN 0x7FFFFFFF would
// round its param to 0x8000 (-0).
SHARDADAM_HOST_DEVICE inline void SplitMaster(float master, uint16_t* param_bits,
                                              int16_t* remainder) {
  const uint32_t raw = BitsOf(master);
  const bool nan = (raw & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t bits = nan ? (raw & 0x80000000u) | 0x7FC00000u : raw;
  const uint16_t low = static_cast<uint16_t>(bits & 0xFFFFu);
  *param_bits = static_cast<uint16_t>((bits >> 16) + (low >= 0x8000u ? 1u : 0u));
  *remainder = static_cast<int16_t>(low);
}

SHARDADAM_HOST_DEVICE inline float MergeMaster(uint16_t param_bits, int16_t remainder) {
  const uint16_t low = static_cast<uint16_t>(remainder);
  const uint16_t high = static_cast<uint16_t>(param_bits - (low >= 0x8000u ? 1u : 0u));
  return FloatOf((static_cast<uint32_t>(high) << 16) | low);
}

}  // namespace cuda
}  // namespace shardadam

#endif  // SHARDADAM_CUDA_CODECS_H_
