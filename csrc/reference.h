// Scalar reference of the whole shardadam contract (adam.h, SEMANTICS S2/S3.6):
// codecs, scales, remainders, Convert, MeasureScale and the Adam step. It is
// the oracle the tests compare the SIMD kernels against bit for bit, so it
// favours plain, obviously correct code over speed and shares nothing with the
// SIMD kernels except the per-element formula in element.h. With the CUDA
// kernels it also shares the host-device scalar codecs of the block formats and
// stochastic rounding (ufloat8.h, float4.h, counter_hash.h, bf16_stochastic.h),
// which codec_test.cc checks against their definitions code by code. It
// validates nothing: callers pass slots that shardadam::AdamStep would accept.
#ifndef SHARDADAM_REFERENCE_H_
#define SHARDADAM_REFERENCE_H_

#include <cstdint>

#include "shardadam/adam.h"

namespace shardadam {
namespace reference {

// fp32 <-> bf16: round to nearest even; a NaN stays a (quiet) NaN.
uint16_t FloatToBFloat16(float f);
float BFloat16ToFloat(uint16_t h);

// fp32 <-> IEEE fp16: round to nearest even, gradual underflow, overflow to
// infinity, NaN kept (as torch's `.to(torch.float16)`).
uint16_t FloatToFloat16(float f);
float Float16ToFloat(uint16_t h);

// fp32 <-> fp8 E4M3 "fn" (bias 7, no infinities, NaN = 0x7F / 0xFF, max 448),
// by S2.4 (torch's `.to(torch.float8_e4m3fn)` up to 2.12; later torch saturates):
// round to nearest even; magnitudes above 464 (the midpoint between 448 and the
// NaN code), infinities and NaN become NaN.
uint8_t FloatToFloat8E4M3(float f);
float Float8E4M3ToFloat(uint8_t q);

// S2.10: fp32 <-> unsigned E4M4 (bias 7, no infinities, NaN = 0xFF, max 480) of
// |f|: round to nearest even; magnitudes above 488, infinities and NaN become
// NaN; a non-zero magnitude that rounds to 0 becomes the smallest code, 1.
uint8_t FloatToUFloat8E4M4(float f);
float UFloat8E4M4ToFloat(uint8_t q);

// S2.12: fp32 <-> signed E2M1 (bias 1, values 0, 0.5, 1, 1.5, 2, 3, 4, 6; NaN =
// 0x8, the code -0 would have): round to nearest even; magnitudes of 7 and
// above, infinities and NaN become NaN; a magnitude rounding to 0 is code 0.
uint8_t FloatToFloat4E2M1(float f);
float Float4E2M1ToFloat(uint8_t q);

// S2.12: fp32 <-> unsigned E3M1 (bias 3, values 0, 0.125 ... 16; NaN = 0xF) of
// |f|: round to nearest even; magnitudes above 20, infinities and NaN become
// NaN; a non-zero magnitude that rounds to 0 becomes the smallest code, 1.
uint8_t FloatToUFloat4E3M1(float f);
float UFloat4E3M1ToFloat(uint8_t q);

// Code i of an 8-bit or 4-bit (two per byte, low nibble first) code buffer.
uint8_t CodeAt(const void* buffer, DType dtype, int64_t i);
void SetCode(void* buffer, DType dtype, int64_t i, uint8_t code);

// Code of true value u in a per-block scaled buffer with block scale s
// (S2.9, S2.10, S2.12): u / s rounded, and for the unsigned formats at least
// code 1 where u is not zero.
void StoreBlockElement(void* buffer, DType dtype, int64_t i, float u, float s);

// S2.5: an fp32 master stored as a bf16 param (high 16 bits, plus one when the
// low 16 bits are >= 0x8000) and an int16 remainder (the low 16 bits).
void SplitMaster(float master, uint16_t* param_bits, int16_t* remainder);
float MergeMaster(uint16_t param_bits, int16_t remainder);

// S2.3: the scale of `numel` fp32 values u stored as `dtype` (1 for unscaled
// dtypes, an empty tensor, or an absmax that is zero or not finite).
float MeasureScale(const float* u, int64_t numel, DType dtype);

// Value of element i of an unscaled buffer (fp32/fp16/bf16/fp8 codes) as fp32,
// and the store that rounds an fp32 value into such a buffer.
float LoadElement(const void* buffer, DType dtype, int64_t i);
void StoreElement(void* buffer, DType dtype, int64_t i, float value);

// adam.h's Convert, one element at a time; kInvalidArgument for dtypes that are
// not casts (kNone, kInt16Remainder). Writes nothing on failure.
Status Convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
               int64_t numel, float scale);

// adam.h's AdamStep (S3.6), one tensor and one element at a time.
void AdamStep(const TensorSlot* slots, int64_t count, const StepParams& params);

}  // namespace reference
}  // namespace shardadam

#endif  // SHARDADAM_REFERENCE_H_
