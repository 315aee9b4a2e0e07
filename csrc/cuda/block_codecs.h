// The element codecs of the per-block scaled formats (S2.9, S2.10, S2.12) as the CUDA
// kernels see them: one struct per format, listed once in BlockCodecs. Everything
// else of a block format (its bound, zero bound, roles) is its formats.h line, and
// the kernels' walk, reduction and scale rule (block_range.h) are the same for all.
// A format missing from the list is refused by AdamStepCuda and stepped on the torch
// path by the Python package (CudaSupportsFormat).
//
// Adding one: a struct with the format's tag, its code width (8, or 4: two codes
// per byte, which slot_math.h ReadCode/WriteCode place) and its two scalar codecs
// (host-device, shared with the reference where the reference has them), then
// one line in BlockCodecs.
#ifndef SHARDADAM_CUDA_BLOCK_CODECS_H_
#define SHARDADAM_CUDA_BLOCK_CODECS_H_

#include <cstdint>
#include <tuple>

#include "cuda/codecs.h"
#include "shardadam/formats.h"
#include "float4.h"
#include "ufloat8.h"

namespace shardadam {
namespace cuda {

// Signed E4M3 codes (torch.float8_e4m3fn), one byte each.
struct E4M3BlockCodec {
  static constexpr DType kDType = DType::kFloat8E4M3Block;
  static constexpr int kBits = 8;
  SHARDADAM_HOST_DEVICE static float Decode(uint32_t code) {
    return DecodeF8(static_cast<uint8_t>(code));
  }
  // `u` the true value, `scale` its block's (a power of two: the quotient is exact
  // unless it is subnormal, and then rounded as the reference rounds it).
  SHARDADAM_HOST_DEVICE static uint32_t Encode(float u, float scale) {
    return EncodeF8(u / scale);
  }
};

// Unsigned E4M4 codes, one byte each. Zero-free on the true value: a non-zero u
// whose quotient underflowed to 0 still gets code 1 (S2.10).
struct UE4M4BlockCodec {
  static constexpr DType kDType = DType::kUFloat8E4M4Block;
  static constexpr int kBits = 8;
  SHARDADAM_HOST_DEVICE static float Decode(uint32_t code) {
    return DecodeUFloat8E4M4(static_cast<uint8_t>(code));
  }
  SHARDADAM_HOST_DEVICE static uint32_t Encode(float u, float scale) {
    const uint8_t code = EncodeUFloat8E4M4(u / scale);
    return code == 0 && u != 0.0f ? 1u : code;
  }
};

// Signed E2M1 codes, two per byte (S2.12).
struct E2M1BlockCodec {
  static constexpr DType kDType = DType::kFloat4E2M1Block;
  static constexpr int kBits = 4;
  SHARDADAM_HOST_DEVICE static float Decode(uint32_t code) {
    return DecodeFloat4E2M1(static_cast<uint8_t>(code));
  }
  SHARDADAM_HOST_DEVICE static uint32_t Encode(float u, float scale) {
    return EncodeFloat4E2M1(u / scale);
  }
};

// Unsigned E3M1 codes, two per byte, zero-free on the true value like E4M4.
struct UE3M1BlockCodec {
  static constexpr DType kDType = DType::kUFloat4E3M1Block;
  static constexpr int kBits = 4;
  SHARDADAM_HOST_DEVICE static float Decode(uint32_t code) {
    return DecodeUFloat4E3M1(static_cast<uint8_t>(code));
  }
  SHARDADAM_HOST_DEVICE static uint32_t Encode(float u, float scale) {
    const uint8_t code = EncodeUFloat4E3M1(u / scale);
    return code == 0 && u != 0.0f ? 1u : code;
  }
};

// One line per per-block format the kernels step.
using BlockCodecs =
    std::tuple<E4M3BlockCodec, UE4M4BlockCodec, E2M1BlockCodec, UE3M1BlockCodec>;

// Whether `dtype` has a codec above. Codes of 4 bits share a byte with their
// pair: the element accesses (slot_math.h) and the lanes' pairs (block_range.h)
// handle exactly 8 and 4.
template <int k = 0>
SHARDADAM_HOST_DEVICE constexpr bool HasBlockCodec(DType dtype) {
  if constexpr (k == static_cast<int>(std::tuple_size_v<BlockCodecs>)) {
    return false;
  } else {
    using C = std::tuple_element_t<k, BlockCodecs>;
    static_assert(C::kBits == 8 || C::kBits == 4, "codes are a byte or half of one");
    static_assert(C::kBits == FormatOf(C::kDType).item_bits, "the format's width");
    static_assert(IsBlockScaled(C::kDType), "a block codec's format is per-block scaled");
    return dtype == C::kDType || HasBlockCodec<k + 1>(dtype);
  }
}

// The unscaled value of a code of block format `dtype` (the quiet NaN for a tag
// without a codec, which validation keeps from the kernels).
template <int k = 0>
SHARDADAM_HOST_DEVICE inline float DecodeBlockCode(uint32_t code, uint8_t dtype) {
  if constexpr (k == static_cast<int>(std::tuple_size_v<BlockCodecs>)) {
    return FloatOf(0x7FC00000u);
  } else {
    using C = std::tuple_element_t<k, BlockCodecs>;
    if (dtype == static_cast<uint8_t>(C::kDType)) return C::Decode(code);
    return DecodeBlockCode<k + 1>(code, dtype);
  }
}

// The code of true value `u` in a block of scale `scale`.
template <int k = 0>
SHARDADAM_HOST_DEVICE inline uint32_t EncodeBlockCode(float u, float scale, uint8_t dtype) {
  if constexpr (k == static_cast<int>(std::tuple_size_v<BlockCodecs>)) {
    return 0;
  } else {
    using C = std::tuple_element_t<k, BlockCodecs>;
    if (dtype == static_cast<uint8_t>(C::kDType)) return C::Encode(u, scale);
    return EncodeBlockCode<k + 1>(u, scale, dtype);
  }
}

}  // namespace cuda
}  // namespace shardadam

#endif  // SHARDADAM_CUDA_BLOCK_CODECS_H_
