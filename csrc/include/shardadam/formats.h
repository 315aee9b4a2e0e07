// Every storage format of the shardadam core, declared once: the dtype tag a
// buffer carries, and the facts the validation, the CPU kernels, the CUDA
// kernels, the scalar reference and the Python package (through the binding's
// FORMATS) read from it. Host-device, so the CUDA kernels fold it at compile time.
//
// Adding a format: a DType value, one line in MakeFormatTable, its element
// codec in each backend (csrc/convert-inl.h, csrc/cuda/codecs.h, the reference)
// and its tests; the Python registry (src/shardadam/_formats.py) declares the
// same facts and is checked against these when the extension loads.
//
// For a caller of the core (adam.h): tag each buffer of a TensorSlot with its
// DType; FormatOf(tag) says how many bits an element takes (item_bits: a buffer of
// n elements holds BufferBytes(dtype, n) bytes), whether
// a state of that format carries a scale slot (scaling) and which buffers may
// hold it (roles). Everything here is constexpr and needs no library.
#ifndef SHARDADAM_FORMATS_H_
#define SHARDADAM_FORMATS_H_

#include <cstdint>

#if defined(__CUDACC__)
#define SHARDADAM_FORMAT_FN __host__ __device__ constexpr
#else
#define SHARDADAM_FORMAT_FN constexpr
#endif

namespace shardadam {

// Storage format of one buffer. The numeric values are part of the ABI: the
// Python package passes them through the binding as plain integers.
// Encodings: fp32, fp16 and bf16 are the IEEE / bfloat16 bit patterns in the
// machine's byte order. A scaled state's true value is its decoded element times
// its scale (the fp32 in its scale slot). An int16 remainder keeps an fp32 master
// M in two halves: the bf16 param holds M's high 16 bits, plus one when M's low
// 16 bits are >= 0x8000 (so the param is M rounded to nearest, ties away from
// zero), and the remainder holds M's low 16 bits; M is rebuilt exactly from the
// two. A NaN M is split as the quiet NaN with its sign.
enum class DType : int32_t {
  kNone = 0,            // buffer absent (only for master_param)
  kFloat32 = 1,
  kFloat16 = 2,         // moments/master: stored value q, true value float(q) * scale
  kBFloat16 = 3,
  kFloat8E4M3 = 4,      // moments only: uint8 codes of fp8 E4M3 (fn), scaled like fp16
  kInt16Remainder = 5,  // master only: low 16 bits of the fp32 master beside a bf16 param
  kFloat8E4M3Block = 6, // moments only: uint8 E4M3 codes, one power-of-two scale per block
  kUFloat8E4M4Block = 7, // exp_avg_sq only: unsigned E4M4 codes that keep non-zero
                         // values non-zero, one power-of-two scale per block (S2.10)
  // Two codes per byte: the element with index i in the buffer is the low
  // nibble of byte i / 2 when i is even, the high nibble when odd (S2.12).
  kFloat4E2M1Block = 8,  // moments: signed E2M1 codes, one power-of-two scale per block
  kUFloat4E3M1Block = 9, // exp_avg_sq only: unsigned zero-free E3M1 codes, per block
};
inline constexpr int kNumDTypes = 10;

// How the stored bits of one element read as a number (before any scale).
enum class Element : int32_t {
  kNone = 0,
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat8E4M3,       // "fn": no infinities, NaN = 0x7F / 0xFF
  kInt16Remainder,   // the low half of an fp32 whose high half is the bf16 param
  kUFloat8E4M4,      // unsigned: 4 exponent bits (bias 7), 4 mantissa bits, NaN = 0xFF
  kFloat4E2M1,       // sign, 2 exponent bits (bias 1), 1 mantissa bit; NaN = 0x8 (-0)
  kUFloat4E3M1,      // unsigned: 3 exponent bits (bias 3), 1 mantissa bit, NaN = 0xF
};

// Where a format keeps its scales when it stores a state (moment or master):
// none, one fp32 per tensor, or one fp32 per block of `scale_block` elements.
// Parameters and gradients are never scaled, whatever their format.
enum class Scaling : int32_t { kNone = 0, kPerTensor = 1, kPerBlock = 2 };

// Which buffers may hold a format (bit set).
enum FormatRole : uint32_t {
  kRoleValue = 1,     // param, grad
  kRoleExpAvg = 2,    // exp_avg (signed)
  kRoleMaster = 4,    // master_param
  kRoleExpAvgSq = 8,  // exp_avg_sq (never negative: unsigned formats may hold it)
  kRoleMoment = kRoleExpAvg | kRoleExpAvgSq,  // HasRole: either moment
};

struct FormatInfo {
  DType dtype = DType::kNone;
  const char* name = "unknown";  // as messages and recorded state layouts name it
  int32_t item_bits = 0;         // bits per element: 4, 8, 16 or 32
  Element element = Element::kNone;
  Scaling scaling = Scaling::kNone;
  int32_t scale_block = 0;       // elements per scale; 0: TensorSlot::scale_block
  // Per tensor: the largest magnitude a scaled state is encoded to (S2.3). Per
  // block: the largest magnitude that still encodes to a finite code (S2.9).
  float scale_target = 0.0f;
  uint32_t roles = 0;
  // Per block: the largest magnitude that encodes to code 0 (S2.9: a block that
  // is all zeros even at the smallest scale takes scale 1).
  float zero_bound = 0.0f;
  // Per block: the smallest largest magnitude whose code at its scale would decode
  // past FLT_MAX (S2.9: such a block takes scale 1, as a non-finite one does).
  float overflow_bound = 0.0f;
};

// Largest magnitudes of S2.3: fp16 finfo.max / 2 and the largest finite E4M3 value.
inline constexpr float kFloat16ScaleTarget = 32752.0f;
inline constexpr float kFloat8ScaleTarget = 448.0f;
// Magnitudes up to this round to a finite E4M3 code (448); above it, to NaN.
inline constexpr float kFloat8FiniteBound = 464.0f;
// Magnitudes up to this (half the smallest subnormal, 2^-9) round to code 0.
inline constexpr float kFloat8ZeroBound = 0.0009765625f;
// Unsigned E4M4 (S2.10): magnitudes up to this round to a finite code (the
// largest, 480, plus half its step); its zero bound is 0, since no non-zero
// value encodes to code 0.
inline constexpr float kUFloat8FiniteBound = 488.0f;
// Signed E2M1 (S2.12): below 7, the midpoint between the largest value 6 and
// the 8 that rounding to even would give, every magnitude encodes finite (the
// largest float below it); magnitudes up to 0.25 round to code 0.
inline constexpr float kFloat4FiniteBound = 6.99999952f;
inline constexpr float kFloat4ZeroBound = 0.25f;
// Unsigned E3M1 (S2.12): up to 20, the midpoint between the largest value 16
// and the NaN code's place (24), where the tie rounds to 16; zero-free.
inline constexpr float kUFloat4FiniteBound = 20.0f;
// S2.9's overflow bounds: at the largest scales a block's largest magnitude rounds
// to 2^128 (infinite) from the midpoint between 2^128 and the largest code value
// below it, (2 - 2^-(m+1)) * 2^127 for m mantissa bits.
inline constexpr float kFloat8OverflowBound = 1.9375f * 0x1p127f;   // m = 3
inline constexpr float kUFloat8OverflowBound = 1.96875f * 0x1p127f; // m = 4
inline constexpr float kFloat4OverflowBound = 1.75f * 0x1p127f;     // m = 1, both maps

// Elements per scale of per-block scaled states: a power of two in this range.
// The lower bound is a whole number of SIMD vector pairs on every target.
inline constexpr int32_t kMinScaleBlock = 128;
inline constexpr int32_t kMaxScaleBlock = 4096;

// Every format's facts, one line per format, in DType order.
struct FormatTable {
  FormatInfo formats[kNumDTypes];
};
SHARDADAM_FORMAT_FN FormatTable MakeFormatTable() {
  return {{
      {DType::kNone, "none", 0, Element::kNone, Scaling::kNone, 0, 0.0f, kRoleMaster},
      {DType::kFloat32, "fp32", 32, Element::kFloat32, Scaling::kNone, 0, 0.0f,
       kRoleValue | kRoleMoment | kRoleMaster},
      {DType::kFloat16, "fp16", 16, Element::kFloat16, Scaling::kPerTensor, 0,
       kFloat16ScaleTarget, kRoleValue | kRoleMoment | kRoleMaster},
      {DType::kBFloat16, "bf16", 16, Element::kBFloat16, Scaling::kNone, 0, 0.0f,
       kRoleValue | kRoleMoment},
      {DType::kFloat8E4M3, "fp8", 8, Element::kFloat8E4M3, Scaling::kPerTensor, 0,
       kFloat8ScaleTarget, kRoleMoment},
      {DType::kInt16Remainder, "remainder", 16, Element::kInt16Remainder, Scaling::kNone,
       0, 0.0f, kRoleMaster},
      {DType::kFloat8E4M3Block, "fp8-block", 8, Element::kFloat8E4M3, Scaling::kPerBlock,
       0, kFloat8FiniteBound, kRoleMoment, kFloat8ZeroBound, kFloat8OverflowBound},
      {DType::kUFloat8E4M4Block, "ufp8-block", 8, Element::kUFloat8E4M4,
       Scaling::kPerBlock, 0, kUFloat8FiniteBound, kRoleExpAvgSq, 0.0f,
       kUFloat8OverflowBound},
      {DType::kFloat4E2M1Block, "fp4-block", 4, Element::kFloat4E2M1, Scaling::kPerBlock,
       0, kFloat4FiniteBound, kRoleMoment, kFloat4ZeroBound, kFloat4OverflowBound},
      {DType::kUFloat4E3M1Block, "ufp4-block", 4, Element::kUFloat4E3M1,
       Scaling::kPerBlock, 0, kUFloat4FiniteBound, kRoleExpAvgSq, 0.0f,
       kFloat4OverflowBound},
  }};
}
#if !defined(__CUDA_ARCH__)
// Host code reads one table in read-only data; a local table would be copied to the
// stack (480 bytes) at every call whose tag is not a constant.
inline constexpr FormatTable kFormatTable = MakeFormatTable();
#endif

#if defined(__CUDA_ARCH__)
// Device code cannot index a host array at run time, and a table built where it is
// read and indexed by a tag known only at run time is built on the stack at every
// call (480 bytes per element read in the catch-all kernel: 0.01 of copy bandwidth
// on an H200). So the tag is compared with each constant one, whose entry is a
// compile-time constant; a constant tag (every compiled layout) folds to its entry.
template <int kFirst = 0>
__device__ constexpr FormatInfo DeviceFormatOf(int i) {
  if constexpr (kFirst == kNumDTypes) {
    return FormatInfo{};
  } else {
    constexpr FormatInfo kEntry = MakeFormatTable().formats[kFirst];
    return i == kFirst ? kEntry : DeviceFormatOf<kFirst + 1>(i);
  }
}
#endif

// The format of a dtype tag; for a tag no format has, a FormatInfo with no roles
// (so validation refuses it) and name "unknown".
SHARDADAM_FORMAT_FN FormatInfo FormatOf(DType dtype) {
#if defined(__CUDA_ARCH__)
  return DeviceFormatOf(static_cast<int>(dtype));
#else
  const int i = static_cast<int>(dtype);
  return i >= 0 && i < kNumDTypes ? kFormatTable.formats[i] : FormatInfo{};
#endif
}

// Shorthands for the facts the kernels branch on.
// Bytes a buffer of `n` elements of `dtype` takes (a 4-bit one rounds up). Whole
// bytes of eight elements first: exact for every n the core accepts (up to
// INT64_MAX / 8), where n * item_bits would overflow from 2^58 fp32 elements.
SHARDADAM_FORMAT_FN int64_t BufferBytes(DType dtype, int64_t n) {
  const int64_t bits = FormatOf(dtype).item_bits;
  return n / 8 * bits + (n % 8 * bits + 7) / 8;
}
// Byte offset of element `e` in a buffer of `dtype`; for 4-bit formats `e` is
// even (the core splits such buffers only at even elements).
SHARDADAM_FORMAT_FN int64_t ByteOffset(DType dtype, int64_t e) {
  const int64_t bits = FormatOf(dtype).item_bits;
  return e / 8 * bits + e % 8 * bits / 8;
}
// A state of this format carries scales (and a scale slot).
SHARDADAM_FORMAT_FN bool IsScaled(DType dtype) {
  return FormatOf(dtype).scaling != Scaling::kNone;
}
// A state of this format is rescaled from the absmax of the whole new tensor, so a
// step first measures it (pass 1) before storing anything (pass 2).
SHARDADAM_FORMAT_FN bool NeedsMeasuringPass(DType dtype) {
  return FormatOf(dtype).scaling == Scaling::kPerTensor;
}
SHARDADAM_FORMAT_FN bool HasRole(DType dtype, FormatRole role) {
  return (FormatOf(dtype).roles & role) != 0;
}
SHARDADAM_FORMAT_FN bool IsBlockScaled(DType dtype) {
  return FormatOf(dtype).scaling == Scaling::kPerBlock;
}
SHARDADAM_FORMAT_FN bool IsValidScaleBlock(int64_t block) {
  return block >= kMinScaleBlock && block <= kMaxScaleBlock && (block & (block - 1)) == 0;
}

// The fp32 scales a state of `dtype` keeps for `numel` elements whose first has
// flat index `first_index` in the whole parameter: none, one, or one per block of
// `block` elements touched (the first and last may be partial).
SHARDADAM_FORMAT_FN int64_t ScaleCount(DType dtype, int64_t first_index, int64_t numel,
                                       int64_t block) {
  switch (FormatOf(dtype).scaling) {
    case Scaling::kPerTensor:
      return 1;
    case Scaling::kPerBlock:
      return numel <= 0 || block <= 0
                 ? 0
                 : (first_index + numel - 1) / block - first_index / block + 1;
    case Scaling::kNone:
      break;
  }
  return 0;
}

namespace internal {
constexpr bool TableInDTypeOrder() {
  for (int i = 0; i < kNumDTypes; ++i) {
    if (static_cast<int>(FormatOf(static_cast<DType>(i)).dtype) != i) return false;
  }
  return true;
}
static_assert(TableInDTypeOrder(), "MakeFormatTable is indexed by DType value");
}  // namespace internal

}  // namespace shardadam

#undef SHARDADAM_FORMAT_FN

#endif  // SHARDADAM_FORMATS_H_
