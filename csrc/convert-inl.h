// Per-target codecs between the storage dtypes and fp32 (SEMANTICS S2.2-S2.5)
// and the absmax reduction behind the per-tensor scales. Included once per SIMD
// target through adam-inl.h (Highway's foreach_target), so everything here is
// compiled for SSE4, AVX2, AVX-512, NEON, SVE...
//
// Every target produces the same bits, and every number converts exactly as
// torch 2.x does on CPU (`tensor.to(dtype)`); NaN encodings are fixed below:
// - bf16: round to nearest even. A NaN keeps its sign and top payload bits and
//   is made quiet (the AVX512-BF16 / Arm BFCVT convention, and the
//   reference's); torch is not consistent here (0xFFFF from its vectorised
//   path, 0x7FC0 from its scalar one). Highway 1.0.3's DemoteTo truncates, so
//   the rounding is integer code here.
// - fp16: round to nearest even with subnormals, overflow to +-inf; a NaN keeps
//   its sign and top payload bits and is made quiet, both ways (the F16C /
//   AArch64 FCVT result, which torch stores). Hardware converts where the
//   target has it; integer code reproduces it bit for bit elsewhere (SSE4).
// - fp8 E4M3 "fn" (uint8 codes): as c10's fp8e4m3fn_from_fp32_value: round to
//   nearest even; a magnitude that rounds above 448 (anything above 464),
//   inf and NaN all become NaN (0x7F with the sign). No saturation to 448.
//   Decoding gives torch's bits, 0x7FF00000 / 0xFFF00000 for the NaN codes.
// - int16 remainder beside a bf16 param (S2.5): the fp32 master w is
//   (param << 16) + sign-extended remainder, exactly; the split stores
//   param = (w + 0x8000) >> 16 and remainder = low 16 bits of w.
//
// Element order is natural (a decoded block lines up with every other stream's
// block), except in the even/odd codecs that only the all-16-bit fused layout
// uses for all of its streams. Everything works on pairs of vectors: narrowing packs two
// vectors at once where the target has pack instructions (one pack + one lane
// fix-up per 16 bf16 on AVX2) instead of Highway's one-vector DemoteTo, which
// pays that fix-up per 8 lanes; 8-bit float codes (E4M3, and block8's unsigned E4M4)
// decode through the fp16 converter.

#if defined(SHARDADAM_CONVERT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SHARDADAM_CONVERT_INL_H_
#undef SHARDADAM_CONVERT_INL_H_
#else
#define SHARDADAM_CONVERT_INL_H_
#endif

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "counter_hash.h"
#include "hwy/highway.h"
#include "kernels.h"

// Per-target switches (redefined on every pass of foreach_target).
#undef SHARDADAM_PACK_AVX2
#undef SHARDADAM_PACK_AVX3
#undef SHARDADAM_PACK_SSE4
#undef SHARDADAM_HARDWARE_F16
#undef SHARDADAM_LOOP_CONSTANT_TABLE
#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX2
#define SHARDADAM_PACK_AVX2 1
#elif HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
#define SHARDADAM_PACK_AVX3 1
#elif HWY_ARCH_X86 && HWY_TARGET == HWY_SSE4
#define SHARDADAM_PACK_SSE4 1
#endif
// F16C on AVX2 / AVX-512 and FCVT on AArch64 round to nearest even and treat
// NaN as described above; other targets use the integer codec.
#if (defined(SHARDADAM_PACK_AVX2) || defined(SHARDADAM_PACK_AVX3)) && \
    !defined(HWY_DISABLE_F16C)
#define SHARDADAM_HARDWARE_F16 1
#elif HWY_ARCH_ARM_A64 && HWY_TARGET != HWY_EMU128 && HWY_TARGET != HWY_SCALAR
#define SHARDADAM_HARDWARE_F16 1
#endif

HWY_BEFORE_NAMESPACE();
namespace shardadam {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;
using DI = hn::RebindToSigned<DF>;
using DU16 = hn::Rebind<uint16_t, DF>;  // as many u16 lanes as fp32 lanes
using DI16 = hn::Rebind<int16_t, DF>;
using DU8 = hn::Rebind<uint8_t, DF>;
using DU16Pairs = hn::Repartition<uint16_t, DF>;  // 2 * Lanes u16 lanes
using VF = hn::Vec<DF>;
using VU = hn::Vec<DU>;
using VI = hn::Vec<DI>;

// hn::Set for the constants of the 4-bit encoders and the counter hash, whose
// loops run out of vector registers on AVX-512: GCC then rebuilds a Set
// constant at every use (mov + vpbroadcastd, on the vector ports that bind
// those loops), where a spilled value would be a memory operand (a load port).
// An empty asm hides the value, so it is built once, outside the loop, and kept
// or spilled: block4's fused step +7-10%, the same bits. Other targets take
// hn::Set: with 16 registers the asm made AVX2 and SSE4 about 2% slower.
template <class D>
HWY_INLINE hn::VFromD<D> SetOnce(D d, hn::TFromD<D> c) {
  hn::VFromD<D> v = hn::Set(d, c);
#if defined(SHARDADAM_PACK_AVX3) && defined(__GNUC__)  // GCC and clang: GNU asm
  asm("" : "+v"(v.raw));
#endif
  return v;
}

#if (defined(SHARDADAM_PACK_AVX2) || defined(SHARDADAM_PACK_SSE4)) && defined(__GNUC__)
#define SHARDADAM_LOOP_CONSTANT_TABLE 1
// Every LoopConstant, as lane bits: adding one is one entry here.
constexpr uint32_t kLoopConstantBits[] = {
    0x7FFFFFFFu, 0x3FFFFFu, 1u, 7u, 8u, 14u,               // masks, increments, codes
    0x3E000000u, 0x3E7FFFFFu, 0x3F000000u, 0x3F7FFFFFu,    // the 4-bit steps' origins
    0x40DFFFFFu, 0x41A00000u,                              // the NaN codes' bounds
    0x4B000000u, 0x4C000000u,                              // 2^23, 2^25
    0x7FEB352Du, 0x846CA68Bu,                              // Mix32's multipliers
    0x7FFFFu, 0xFEu, 0x3C000000u, 0x3C7FFFFFu, 0x43F40000u, 0x4E000000u};  // E4M4's
constexpr size_t kNumLoopConstants = sizeof(kLoopConstantBits) / sizeof(uint32_t);
constexpr size_t kLoopConstantLanes = HWY_MAX_BYTES / sizeof(uint32_t);
struct LoopConstantTable {
  alignas(HWY_MAX_BYTES) uint32_t lanes[kNumLoopConstants][kLoopConstantLanes];
};
constexpr LoopConstantTable MakeLoopConstantTable() {
  LoopConstantTable t{};
  for (size_t i = 0; i < kNumLoopConstants; ++i) {
    for (size_t j = 0; j < kLoopConstantLanes; ++j) t.lanes[i][j] = kLoopConstantBits[i];
  }
  return t;
}
inline constexpr LoopConstantTable kLoopConstantTable = MakeLoopConstantTable();
template <uint32_t kBits>
constexpr size_t LoopConstantIndex() {
  size_t i = 0;
  while (i < kNumLoopConstants && kLoopConstantBits[i] != kBits) ++i;
  return i;
}
#endif

// A vector of lanes with bits kBits, for the loops SetOnce describes. On AVX2
// and SSE4 GCC rebuilds those constants at every use too (mov + vmovd +
// vpbroadcastd: three instructions; the asm did not help there). Read from a
// table whose address an empty asm hides, so GCC cannot fold the values back
// into Set constants, each use is a memory operand (a load port) instead:
// AVX2 block4 +21%, bf16 (stochastic) + block4 +15%, SSE4 block4 +4%, the same
// bits. ZeroFree keeps SetOnce: from the table, AVX2 block8 was 1.5% slower.
template <uint32_t kBits>
HWY_INLINE VU LoopConstant() {
#if defined(SHARDADAM_LOOP_CONSTANT_TABLE)
  constexpr size_t i = LoopConstantIndex<kBits>();
  static_assert(i < kNumLoopConstants, "add kBits to kLoopConstantBits");
  const uint32_t* table = &kLoopConstantTable.lanes[0][0];
  asm("" : "+r"(table));
  return hn::Load(DU(), table + i * kLoopConstantLanes);
#else
  return SetOnce(DU(), kBits);
#endif
}

// ---------------------------------------------------------------------------
// Widening loads and narrowing stores (natural element order).

HWY_INLINE VU LoadWideU16(const uint16_t* HWY_RESTRICT p) {
  return hn::PromoteTo(DU(), hn::LoadU(DU16(), p));
}

HWY_INLINE VU LoadWideI16(const int16_t* HWY_RESTRICT p) {
  return hn::BitCast(DU(), hn::PromoteTo(DI(), hn::LoadU(DI16(), p)));
}

HWY_INLINE VU LoadWideU8(const uint8_t* HWY_RESTRICT p) {
  return hn::PromoteTo(DU(), hn::LoadU(DU8(), p));
}

// Stores the low 16 bits of every lane of `a` then `b` (each lane holds a value
// in [0, 0xFFFF]) to 2 * Lanes consecutive u16.
HWY_INLINE void StoreNarrowU16(VU a, VU b, uint16_t* HWY_RESTRICT p) {
#if defined(SHARDADAM_PACK_AVX2)
  // packus interleaves 128-bit halves; one qword permute restores the order.
  const __m256i packed = _mm256_packus_epi32(a.raw, b.raw);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_permute4x64_epi64(packed, 0xD8));
#elif defined(SHARDADAM_PACK_AVX3)
  const __m512i packed = _mm512_packus_epi32(a.raw, b.raw);
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  _mm512_storeu_si512(p, _mm512_permutexvar_epi64(order, packed));
#elif defined(SHARDADAM_PACK_SSE4)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(a.raw, b.raw));
#else
  const DU16 d16;
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(DI(), a)), d16, p);
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(DI(), b)), d16, p + hn::Lanes(d16));
#endif
}

// Stores the low byte of every lane of `a` (values in [0, 0xFF]) to Lanes
// consecutive bytes: one narrowing move on AVX-512 (Highway 1.0.3's DemoteTo
// packs twice and permutes).
HWY_INLINE void StoreLowBytes(VU a, uint8_t* HWY_RESTRICT p) {
#if defined(SHARDADAM_PACK_AVX3)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a.raw));
#else
  const DU8 d8;
  hn::StoreU(hn::DemoteTo(d8, hn::BitCast(DI(), a)), d8, p);
#endif
}

// Stores the low byte of every lane of `a` then `b` (values in [0, 0xFF]) to
// 2 * Lanes consecutive bytes.
HWY_INLINE void StoreNarrowU8(VU a, VU b, uint8_t* HWY_RESTRICT p) {
#if defined(SHARDADAM_PACK_AVX2)
  // Dwords after the two packs: [a0-3 b0-3 a0-3 b0-3 | a4-7 b4-7 a4-7 b4-7].
  const __m256i words = _mm256_packus_epi32(a.raw, b.raw);
  const __m256i bytes = _mm256_packus_epi16(words, words);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(bytes, order)));
#elif defined(SHARDADAM_PACK_SSE4)
  const __m128i words = _mm_packus_epi32(a.raw, b.raw);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(words, words));
#else
  StoreLowBytes(a, p);
  StoreLowBytes(b, p + hn::Lanes(DU()));
#endif
}

// ---------------------------------------------------------------------------
// Bit-level conversions of one vector.

HWY_INLINE VF BF16ToF32(VU h) { return hn::BitCast(DF(), hn::ShiftLeft<16>(h)); }

// fp32 -> bf16 bits in the HIGH half of each lane (the low half is not
// specified): round to nearest even; a NaN keeps its sign and top payload bits
// and is made quiet (what AVX512-BF16 and Arm BFCVT store); rounding could
// otherwise carry a NaN into inf. IsNaN, not Ne(x, x): Highway 1.0.3's Ne is
// ordered on AVX2 but not on SSE4. kNoNaN: the caller has checked that `x`
// holds no NaN, and the NaN rule is skipped.
template <bool kNoNaN = false>
HWY_INLINE VU F32ToBF16High(VF x) {
  const DU du;
  const VU bits = hn::BitCast(du, x);
  const VU odd = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const VU rounded = hn::Add(bits, hn::Add(odd, hn::Set(du, 0x7FFFu)));
  if constexpr (kNoNaN) return rounded;
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(x)),
                        hn::Or(bits, hn::Set(du, 0x00400000u)), rounded);
}

// fp32 -> bf16 bits in the low half of each lane.
template <bool kNoNaN = false>
HWY_INLINE VU F32ToBF16(VF x) {
  return hn::ShiftRight<16>(F32ToBF16High<kNoNaN>(x));
}

// fp16 bits (zero-extended) -> fp32, the hardware result without hardware.
HWY_INLINE VF F16BitsToF32(VU h) {
  const DF df;
  const DU du;
  const DI di;
  const VU abs = hn::And(h, hn::Set(du, 0x7FFFu));
  const VI abs_i = hn::BitCast(di, abs);
  const VU sign = hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u)));
  const VU shifted = hn::ShiftLeft<13>(abs);
  const VU normal = hn::Add(shifted, hn::Set(du, 0x38000000u));  // rebias 112
  // inf / NaN: all-ones exponent, payload kept, NaN made quiet.
  VU special = hn::Or(shifted, hn::Set(du, 0x7F800000u));
  special = hn::IfThenElse(hn::RebindMask(du, hn::Gt(abs_i, hn::Set(di, 0x7C00))),
                           hn::Or(special, hn::Set(du, 0x00400000u)), special);
  // Subnormals are mantissa * 2^-24, exact in fp32 arithmetic.
  const VF sub = hn::Mul(hn::ConvertTo(df, abs_i), hn::Set(df, 1.0f / 16777216.0f));
  VU r = hn::IfThenElse(hn::RebindMask(du, hn::Gt(abs_i, hn::Set(di, 0x7BFF))),
                        special, normal);
  r = hn::IfThenElse(hn::RebindMask(du, hn::Lt(abs_i, hn::Set(di, 0x400))),
                     hn::BitCast(du, sub), r);
  return hn::BitCast(df, hn::Or(r, sign));
}

// fp32 -> fp16 bits (low half of each lane), the hardware result without it.
HWY_INLINE VU F32ToF16Bits(VF x) {
  const DF df;
  const DU du;
  const DI di;
  const VU bits = hn::BitCast(du, x);
  const VU abs = hn::And(bits, hn::Set(du, 0x7FFFFFFFu));
  const VI abs_i = hn::BitCast(di, abs);
  const VU sign = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 0x8000u));
  // Normal results: rebias the exponent, round the 13 dropped bits to even.
  const VU odd = hn::And(hn::ShiftRight<13>(abs), hn::Set(du, 1u));
  const VU normal = hn::ShiftRight<13>(hn::Add(
      hn::Sub(abs, hn::Set(du, 0x38000000u)), hn::Add(odd, hn::Set(du, 0xFFFu))));
  // Below 2^-14: adding 0.5 (ulp 2^-24) rounds to the subnormal step, to even.
  const VU sub = hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(df, abs),
                                                 hn::Set(df, 0.5f))),
                         hn::Set(du, 0x3F000000u));
  VU r = hn::IfThenElse(
      hn::RebindMask(du, hn::Lt(abs_i, hn::Set(di, 0x38800000))), sub, normal);
  // From 65520 up (and inf): rounds to inf.
  r = hn::IfThenElse(hn::RebindMask(du, hn::Gt(abs_i, hn::Set(di, 0x477FEFFF))),
                     hn::Set(du, 0x7C00u), r);
  const VU nan = hn::Or(hn::And(hn::ShiftRight<13>(abs), hn::Set(du, 0x3FFu)),
                        hn::Set(du, 0x7E00u));
  r = hn::IfThenElse(hn::RebindMask(du, hn::Gt(abs_i, hn::Set(di, 0x7F800000))),
                     nan, r);
  return hn::Or(r, sign);
}

// E4M3 "fn" code (zero-extended) -> fp32, integer version.
HWY_INLINE VF F8ToF32(VU c) {
  const DF df;
  const DU du;
  const DI di;
  const VU mag = hn::And(c, hn::Set(du, 0x7Fu));
  const VI mag_i = hn::BitCast(di, mag);
  const VU sign = hn::ShiftLeft<24>(hn::And(c, hn::Set(du, 0x80u)));
  VU normal = hn::Add(hn::ShiftLeft<20>(mag), hn::Set(du, 0x3C000000u));  // +120
  normal = hn::IfThenElse(hn::RebindMask(du, hn::Eq(mag, hn::Set(du, 0x7Fu))),
                          hn::Or(normal, hn::Set(du, 0x7F800000u)), normal);
  // Subnormals are mantissa * 2^-9, exact.
  const VF sub = hn::Mul(hn::ConvertTo(df, mag_i), hn::Set(df, 1.0f / 512.0f));
  const VU r = hn::IfThenElse(hn::RebindMask(du, hn::Lt(mag_i, hn::Set(di, 8))),
                              hn::BitCast(du, sub), normal);
  return hn::BitCast(df, hn::Or(r, sign));
}

// The small-float code of magnitudes `abs` (fp32 bits, sign clear) by one float
// addition: with M = the power of two `kOffset` exponents above the binade of |x|
// (binades below `kLowest`, fp32 bits of a power of two, step like it), the ulp of
// |x| + M is the format's step at |x|, so the sum rounds |x| to nearest even and its
// low bits count steps above M; `1 << kShift` codes per binade above kLowest are
// added. Meaningful only where |x| rounds to a finite code (callers clamp the rest).
template <uint32_t kLowest, uint32_t kOffset, int kShift>
HWY_INLINE VU SmallFloatCode(VU abs) {
  const DF df;
  const DU du;
  const DI di;
  const VI binade = hn::Max(hn::BitCast(di, hn::And(abs, hn::Set(du, 0x7F800000u))),
                            hn::Set(di, static_cast<int32_t>(kLowest)));
  const VU magic = hn::Add(hn::BitCast(du, binade), hn::Set(du, kOffset));
  const VU sum = hn::BitCast(du, hn::Add(hn::BitCast(df, abs), hn::BitCast(df, magic)));
  const VU base = hn::ShiftRight<kShift>(hn::Sub(magic, hn::Set(du, kLowest + kOffset)));
  return hn::Add(hn::Sub(sum, magic), base);
}

// fp32 -> E4M3 "fn" code in the low byte of each lane. One float addition
// does the rounding: with M = 2^(e + 20) for |x| in [2^e, 2^(e+1)) (e >= -6;
// M = 2^14 below), the ulp of |x| + M is exactly the E4M3 step at |x|, so the
// sum rounds |x| to nearest even and its low bits count steps above M. The
// code is that count plus 8 per binade above 2^-6. Anything that rounds past
// 448 (and inf / NaN, whose M is garbage) ends above 0x7F and is clamped to
// NaN, as torch does; no saturation to 448.
HWY_INLINE VU F32ToF8(VF x) {
  const DU du;
  const VU bits = hn::BitCast(du, x);
  const VU abs = hn::And(bits, hn::Set(du, 0x7FFFFFFFu));
  // Binades from 2^-6, M = 2^(e + 20): 8 codes per binade.
  const VU code = hn::Min(SmallFloatCode<0x3C800000u, 0x0A000000u, 20>(abs),
                          hn::Set(du, 0x7Fu));  // unsigned
  return hn::Or(code, hn::And(hn::ShiftRight<24>(bits), hn::Set(du, 0x80u)));
}

// Unsigned E4M4 code (zero-extended) -> fp32 (S2.10): (16 + M) * 2^(E - 11)
// for E >= 1 is the fp32 whose bits are the code shifted into place plus 120
// in the exponent; E = 0 is M * 2^-10, exact. Code 0xFF is NaN.
HWY_INLINE VF UF8ToF32(VU c) {
  const DF df;
  const DU du;
  const DI di;
  const VU normal = hn::Add(hn::ShiftLeft<19>(c), hn::Set(du, 0x3C000000u));
  const VF sub = hn::Mul(hn::ConvertTo(df, hn::BitCast(di, c)), hn::Set(df, 1.0f / 1024.0f));
  VU r = hn::IfThenElse(hn::RebindMask(du, hn::Lt(hn::BitCast(di, c), hn::Set(di, 16))),
                        hn::BitCast(du, sub), normal);
  r = hn::IfThenElse(hn::RebindMask(du, hn::Eq(c, hn::Set(du, 0xFFu))),
                     hn::Set(du, 0x7FC00000u), r);
  return hn::BitCast(df, r);
}

// An unsigned code made zero-free (S2.10, S2.12): code 0 becomes 1 where the
// true value u is not zero (as an integer, min(|u| bits, 1) is 1 exactly then).
HWY_INLINE VU ZeroFree(VU code, VF u) {
  const DU du;
  const VU u_abs = hn::And(hn::BitCast(du, u), SetOnce(du, 0x7FFFFFFFu));
  return hn::Max(code, hn::Min(u_abs, SetOnce(du, 1u)));
}

// fp32 -> unsigned E4M4 code (S2.10) of |x| = |u| / s, by F32ToF8's one
// addition with one more mantissa bit: M = 2^(e + 19) for |x| in [2^e, 2^(e+1))
// (e >= -6; 2^13 below), whose ulp is the E4M4 step at |x|; 16 codes per binade
// above 2^-6. Anything rounding past 480, inf and NaN end at or above 0xFF, the
// NaN code. Zero-free: where the true value u is not zero, code 0 (x rounded,
// or the division underflowed) becomes code 1.
HWY_INLINE VU F32ToUF8(VF x, VF u) {
  const DU du;
  const VU abs = hn::And(hn::BitCast(du, x), hn::Set(du, 0x7FFFFFFFu));
  // Binades from 2^-6, M = 2^(e + 19): 16 codes per binade.
  const VU code = hn::Min(SmallFloatCode<0x3C800000u, 0x09800000u, 19>(abs),
                          hn::Set(du, 0xFFu));  // unsigned
  return ZeroFree(code, u);
}

// Signed E2M1 code (S2.12; zero-extended, the sign in bit 3) -> fp32: for
// magnitude code c >= 2, (2 + M) * 2^(E - 2) is the fp32 whose bits are c
// shifted into place plus 126 in the exponent; c < 2 is c * 0.5. Code 0x8 is NaN.
HWY_INLINE VF F4ToF32(VU c) {
  const DF df;
  const DU du;
  const DI di;
  const VU mag = hn::And(c, hn::Set(du, 7u));
  const VU normal = hn::Add(hn::ShiftLeft<22>(mag), hn::Set(du, 0x3F000000u));
  const VF sub = hn::Mul(hn::ConvertTo(df, hn::BitCast(di, mag)), hn::Set(df, 0.5f));
  VU r = hn::IfThenElse(hn::RebindMask(du, hn::Lt(hn::BitCast(di, mag), hn::Set(di, 2))),
                        hn::BitCast(du, sub), normal);
  r = hn::Or(r, hn::ShiftLeft<28>(hn::And(c, hn::Set(du, 8u))));
  return hn::BitCast(df, hn::IfThenElse(hn::Eq(c, hn::Set(du, 8u)),
                                        hn::Set(du, 0x7FC00000u), r));
}

// trunc(x) as int32 where the caller uses only lanes in [0, 2^31) (the others
// are unspecified). x86's conversion gives 0x80000000 out of range, which
// Highway's ConvertTo fixes up with four more instructions per vector; the
// bare instruction is enough here.
HWY_INLINE VI TruncateInRange(VF x) {
#if defined(SHARDADAM_PACK_AVX3)
  return VI{_mm512_cvttps_epi32(x.raw)};
#elif defined(SHARDADAM_PACK_AVX2)
  return VI{_mm256_cvttps_epi32(x.raw)};
#elif defined(SHARDADAM_PACK_SSE4)
  return VI{_mm_cvttps_epi32(x.raw)};
#else
  return hn::ConvertTo(DI(), x);
#endif
}

// Lanes whose magnitude bits `abs` (below 2^31) exceed `bound`'s, as a mask of DU.
template <uint32_t kBound>
HWY_INLINE auto AbsAbove(VU abs) {
  const DI di;
  const VI bound = hn::BitCast(di, LoopConstant<kBound>());
  return hn::RebindMask(DU(), hn::Gt(hn::BitCast(di, abs), bound));
}

// v + 1 in the lanes of `mask`: masked arithmetic on AVX-512 (one instruction
// after the compare, where a mask turned into a vector costs two), elsewhere
// v minus the mask as a vector (all ones: -1), one instruction either way.
template <class M>
HWY_INLINE VU IncrementWhere(M mask, VU v) {
#if defined(SHARDADAM_PACK_AVX3)
  return hn::IfThenElse(mask, hn::Add(v, LoopConstant<1u>()), v);
#else
  return hn::Sub(v, hn::VecFromMask(DU(), mask));
#endif
}

// A signed E2M1 code from magnitude code `mag` of x (`bits`, `abs` its fp32 bits
// and magnitude's): x's sign unless mag is 0 (no -0); |x| >= 7, inf and NaN give
// the NaN code 0x8.
HWY_INLINE VU SignedF4(VU bits, VU abs, VU mag) {
  const DU du;
  const VU sign = hn::And(hn::ShiftRight<28>(bits), LoopConstant<8u>());
  const VU code = hn::IfThenElse(hn::Eq(mag, hn::Zero(du)), mag, hn::Or(mag, sign));
  return hn::IfThenElse(AbsAbove<0x40DFFFFFu>(abs), LoopConstant<8u>(), code);  // >= 7
}

// fp32 -> signed E2M1 code (S2.12) by F32ToF8's one addition: M = 2^(e + 22)
// for |x| in [2^e, 2^(e+1)) (e >= 0; 2^22 below 1), whose ulp is the E2M1 step
// at |x|; the sum's low bits count steps, two codes per binade above 1.
// |x| >= 7 (rounding to 8 or more), inf and NaN are the NaN code 0x8; a
// magnitude rounding to 0 is code 0 whatever its sign (0x8 is no -0).
HWY_INLINE VU F32ToF4(VF x) {
  const DU du;
  const VU bits = hn::BitCast(du, x);
  const VU abs = hn::And(bits, hn::Set(du, 0x7FFFFFFFu));
  // Binades from 1, M = 2^(e + 22): 2 codes per binade.
  return SignedF4(bits, abs, SmallFloatCode<0x3F800000u, 0x0B000000u, 22>(abs));
}

// stochastic_steps.h StochasticSteps on every lane, for a format whose first
// normal value has fp32 bits kNormal and code kNormalCode, which drops kDrop
// mantissa bits, and whose fixed steps below kNormal are counted by |x| times the
// fp32 with bits kUnits (2^kDrop over the step), truncated: under 2^23, so the
// conversion truncates exactly as the reference's cast.
template <uint32_t kNormal, uint32_t kNormalCode, int kDrop, uint32_t kUnits>
HWY_INLINE VU StochasticStepsV(VU abs, VU random) {
  const DF df;
  const DU du;
  // Steps of 2^kDrop from 0: the bits above kNormal plus its code's steps.
  const VU normal = hn::Sub(abs, LoopConstant<kNormal - (kNormalCode << kDrop)>());
  const VF units = hn::BitCast(df, LoopConstant<kUnits>());
  const VU small = hn::BitCast(du, TruncateInRange(hn::Mul(hn::BitCast(df, abs), units)));
  const VU steps = hn::IfThenElse(AbsAbove<kNormal - 1>(abs), normal, small);
  return hn::ShiftRight<kDrop>(hn::Add(steps, hn::And(random, LoopConstant<(1u << kDrop) - 1>())));
}

// F32ToF4 rounded stochastically with 22 of the bits of `random`, as
// float4.h EncodeFloat4E2M1Stochastic (S2.13): from 1 up the fp32 bits above
// 1.0 plus the random bits count codes; below 1, |x| * 2^23 truncated does;
// from 6 up F32ToF4's nearest (6, then the NaN code from 7).
HWY_INLINE VU F32ToF4Stochastic(VF x, VU random) {
  const DU du;
  const VU bits = hn::BitCast(du, x);
  const VU abs = hn::And(bits, LoopConstant<0x7FFFFFFFu>());
  // From 1.0 (code 2) up, at most code 7 below 6; below 1, |x| * 2^23.
  const VU mag = StochasticStepsV<0x3F800000u, 2u, 22, 0x4B000000u>(abs, random);
  // From 6 up the code of 6 (what [6, 7) rounds to), and SignedF4 makes 7 and up
  // the NaN code.
  return SignedF4(bits, abs, hn::Min(mag, LoopConstant<7u>()));
}

// Unsigned E3M1 code (S2.12) -> fp32: (2 + M) * 2^(E - 4) for c >= 2 is c
// shifted into place plus 124 in the exponent; c < 2 is c * 0.125. Code 0xF is NaN.
HWY_INLINE VF UF4ToF32(VU c) {
  const DF df;
  const DU du;
  const DI di;
  const VU normal = hn::Add(hn::ShiftLeft<22>(c), hn::Set(du, 0x3E000000u));
  const VF sub = hn::Mul(hn::ConvertTo(df, hn::BitCast(di, c)), hn::Set(df, 0.125f));
  VU r = hn::IfThenElse(hn::RebindMask(du, hn::Lt(hn::BitCast(di, c), hn::Set(di, 2))),
                        hn::BitCast(du, sub), normal);
  r = hn::IfThenElse(hn::Eq(c, hn::Set(du, 0xFu)), hn::Set(du, 0x7FC00000u), r);
  return hn::BitCast(df, r);
}

// fp32 -> unsigned E3M1 code (S2.12) of |x| = |u| / s: F32ToF4's addition with
// M = 2^(e + 22) for e >= -2 (2^20 below 2^-2). Magnitudes above 20 (the tie
// between 16 and 24 rounds to 16), inf and NaN are the NaN code 0xF.
// Zero-free as F32ToUF8: code 0 where u is not zero becomes code 1.
HWY_INLINE VU F32ToUF4(VF x, VF u) {
  const DU du;
  const VU abs = hn::And(hn::BitCast(du, x), hn::Set(du, 0x7FFFFFFFu));
  // Binades from 2^-2, M = 2^(e + 22): 2 codes per binade.
  VU code = SmallFloatCode<0x3E800000u, 0x0B000000u, 22>(abs);
  code = hn::IfThenElse(AbsAbove<0x41A00000u>(abs), hn::Set(du, 0xFu), code);  // > 20
  return ZeroFree(code, u);
}

// F32ToUF4 rounded stochastically with 22 of the bits of `random`, as
// float4.h EncodeUFloat4E3M1Stochastic (S2.13): from 0.25 up the fp32 bits
// above 0.25 plus the random bits count codes; below 0.25, |x| * 2^25
// truncated does; from 16 up F32ToUF4's nearest (16 up to 20, then the NaN
// code). Zero-free on u as F32ToUF4.
HWY_INLINE VU F32ToUF4Stochastic(VF x, VF u, VU random) {
  const DU du;
  const VU abs = hn::And(hn::BitCast(du, x), LoopConstant<0x7FFFFFFFu>());
  // From 0.25 (code 2) up, at most code 14 below 16; below 0.25, |x| * 2^25.
  VU code = StochasticStepsV<0x3E800000u, 2u, 22, 0x4C000000u>(abs, random);
  code = hn::Min(ZeroFree(code, u), LoopConstant<14u>());  // from 16 up: 16
  return IncrementWhere(AbsAbove<0x41A00000u>(abs), code);  // > 20, inf, NaN: 15
}

// F32ToUF8 rounded stochastically with 19 of the bits of `random`, as
// ufloat8.h EncodeUFloat8E4M4Stochastic (S2.13): from 2^-6 up the fp32 bits
// above 2^-6 plus the random bits count codes, 16 a binade; below 2^-6, |x| *
// 2^29 truncated does; from 480 up F32ToUF8's nearest (480 up to 488, then the
// NaN code). Zero-free on u as F32ToUF8.
HWY_INLINE VU F32ToUF8Stochastic(VF x, VF u, VU random) {
  const DU du;
  const VU abs = hn::And(hn::BitCast(du, x), LoopConstant<0x7FFFFFFFu>());
  // From 2^-6 (code 16) up, at most code 0xFE below 480; below 2^-6, |x| * 2^29.
  VU code = StochasticStepsV<0x3C800000u, 16u, 19, 0x4E000000u>(abs, random);
  code = hn::Min(ZeroFree(code, u), LoopConstant<0xFEu>());  // from 480 up: 480
  return IncrementWhere(AbsAbove<0x43F40000u>(abs), code);  // > 488, inf, NaN: 0xFF
}

// counter_hash.h's Mix32 on every lane, in two parts: MixOpen stops before the
// final x ^= x >> 16 and MixClose starts after the first one. That shift is
// its own inverse on 32 bits (applied twice, x >> 32 is 0), and it is linear
// over XOR, so Mix32(Mix32(i) ^ k) = MixClose(MixOpen(i) ^ k ^ (k >> 16)):
// RandomBits' two hashes meet without those two steps.
HWY_INLINE VU XorShift16(VU x) { return hn::Xor(x, hn::ShiftRight<16>(x)); }
HWY_INLINE VU MixOpen(VU x) {
  const DU du;
  x = hn::Mul(XorShift16(x), LoopConstant<0x7FEB352Du>());
  x = hn::Xor(x, hn::ShiftRight<15>(x));
  return hn::Mul(x, LoopConstant<0x846CA68Bu>());
}
HWY_INLINE VU MixClose(VU x) {
  const DU du;
  x = hn::Mul(x, LoopConstant<0x7FEB352Du>());
  x = hn::Xor(x, hn::ShiftRight<15>(x));
  return XorShift16(hn::Mul(x, LoopConstant<0x846CA68Bu>()));
}

// The key-independent half of counter_hash.h RandomBits (the inner Mix32 of
// the flat index, opened: MixOpen) of a pair of vectors of elements from flat
// index `index` (the pair's element 0) in the order the pair holds them:
// natural (a = index + lane, b = index + Lanes + lane), or even/odd (kEO: a =
// index + 2 lane, b = a + 1). The pair does not cross a multiple of 2^32.
// Streams of the same elements (exp_avg's, exp_avg_sq's, the param's) share it.
template <bool kEO>
HWY_INLINE void PairIndexHash(uint64_t index, VU& a, VU& b) {
  const DU du;
  VU low = hn::Iota(du, 0);
  if constexpr (kEO) low = hn::ShiftLeft<1>(low);
  low = hn::Add(low, hn::Set(du, static_cast<uint32_t>(index)));
  const VU other =
      hn::Add(low, hn::Set(du, kEO ? 1u : static_cast<uint32_t>(hn::Lanes(du))));
  const VU high = hn::Set(du, IndexHigh(index));
  a = MixOpen(hn::Xor(low, high));
  b = MixOpen(hn::Xor(other, high));
}

// RandomBits of a stream with step key `key`, from PairIndexHash's lanes.
HWY_INLINE VU KeyedBits(uint32_t key, VU index_hash) {
  return MixClose(hn::Xor(index_hash, hn::Set(DU(), key ^ (key >> 16))));
}

// counter_hash.h RandomBits of one vector of elements from flat index `index`
// (lane j: index + j), which may cross a multiple of 2^32: the lanes past it
// mix the next high half.
HWY_INLINE VU VectorBits(uint32_t key, uint64_t index) {
  const DU du;
  const uint32_t low0 = static_cast<uint32_t>(index);
  const VU low = hn::Add(hn::Iota(du, 0), hn::Set(du, low0));
  const uint64_t before_wrap = (uint64_t{1} << 32) - low0;  // lanes below the multiple
  const VU high = hn::IfThenElse(
      // Clamped: FirstN's count must fit a lane.
      hn::FirstN(du, static_cast<size_t>(HWY_MIN(before_wrap, uint64_t{hn::Lanes(du)}))),
      hn::Set(du, IndexHigh(index)), hn::Set(du, IndexHigh(index + before_wrap)));
  return KeyedBits(key, MixOpen(hn::Xor(low, high)));
}

// fp32 -> bf16 bits in the HIGH half of each lane (the low half is not
// specified) rounded stochastically with the high 16 bits of `random`, as
// bf16_stochastic.h EncodeBF16Stochastic (S2.14); a NaN as F32ToBF16's.
HWY_INLINE VU F32ToBF16StochasticHigh(VF x, VU random) {
  const DU du;
  const VU bits = hn::BitCast(du, x);
  const VU rounded = hn::Add(bits, hn::ShiftRight<16>(random));
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(x)),
                        hn::Or(bits, hn::Set(du, 0x00400000u)), rounded);
}

// The same in the low half of each lane.
HWY_INLINE VU F32ToBF16Stochastic(VF x, VU random) {
  return hn::ShiftRight<16>(F32ToBF16StochasticHigh(x, random));
}

HWY_INLINE VI AbsBits(VF x) {
  const DU du;
  return hn::BitCast(DI(), hn::And(hn::BitCast(du, x), hn::Set(du, 0x7FFFFFFFu)));
}

// ---------------------------------------------------------------------------
// Pair codecs: 2 * Lanes elements as two fp32 vectors, the unit every block
// codec and fused kernel works in (16-bit and 8-bit stores pack two vectors at
// once).

HWY_INLINE void LoadF32x2(const float* HWY_RESTRICT p, VF& a, VF& b) {
  const DF df;
  a = hn::LoadU(df, p);
  b = hn::LoadU(df, p + hn::Lanes(df));
}

HWY_INLINE void StoreF32x2(VF a, VF b, float* HWY_RESTRICT p) {
  const DF df;
  hn::StoreU(a, df, p);
  hn::StoreU(b, df, p + hn::Lanes(df));
}

HWY_INLINE void LoadBF16x2(const uint16_t* HWY_RESTRICT p, VF& a, VF& b) {
  a = BF16ToF32(LoadWideU16(p));
  b = BF16ToF32(LoadWideU16(p + hn::Lanes(DF())));
}

template <bool kNoNaN = false>
HWY_INLINE void StoreBF16x2(VF a, VF b, uint16_t* HWY_RESTRICT p) {
  StoreNarrowU16(F32ToBF16<kNoNaN>(a), F32ToBF16<kNoNaN>(b), p);
}

HWY_INLINE void LoadF16x2(const uint16_t* HWY_RESTRICT p, VF& a, VF& b) {
  const size_t L = hn::Lanes(DF());
#if defined(SHARDADAM_HARDWARE_F16)
  const DF df;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const hwy::float16_t* h = reinterpret_cast<const hwy::float16_t*>(p);
  a = hn::PromoteTo(df, hn::LoadU(dh, h));
  b = hn::PromoteTo(df, hn::LoadU(dh, h + L));
#else
  a = F16BitsToF32(LoadWideU16(p));
  b = F16BitsToF32(LoadWideU16(p + L));
#endif
}

HWY_INLINE void StoreF16x2(VF a, VF b, uint16_t* HWY_RESTRICT p) {
#if defined(SHARDADAM_HARDWARE_F16)
  const hn::Rebind<hwy::float16_t, DF> dh;
  hwy::float16_t* h = reinterpret_cast<hwy::float16_t*>(p);
  hn::StoreU(hn::DemoteTo(dh, a), dh, h);
  hn::StoreU(hn::DemoteTo(dh, b), dh, h + hn::Lanes(dh));
#else
  StoreNarrowU16(F32ToF16Bits(a), F32ToF16Bits(b), p);
#endif
}

// E4M3 (and unsigned E4M4, LoadUF8x2Raw) codes -> fp32 values divided by
// kF8RawFactor (exact). Multiplying by kF8RawFactor * s gives float(q) * s with
// the same single rounding as the reference's float(q) * s whenever
// kF8RawFactor * s is finite (it is then exact: a power-of-two factor).
#if defined(SHARDADAM_HARDWARE_F16)
inline constexpr float kF8RawFactor = internal::kE4M3OverF16;
#else
inline constexpr float kF8RawFactor = 1.0f;
#endif

#if defined(SHARDADAM_HARDWARE_F16)
// 2 * Lanes bytes from p, each zero-extended to a u16 lane.
HWY_INLINE hn::Vec<DU16Pairs> LoadWideBytes(const uint8_t* HWY_RESTRICT p) {
  return hn::PromoteTo(DU16Pairs(), hn::LoadU(hn::Rebind<uint8_t, DU16Pairs>(), p));
}

// fp16 bits in the u16 lanes of y -> the pair's fp32 values (a: the lower half).
HWY_INLINE void WidenF16Pair(hn::Vec<DU16Pairs> y, VF& a, VF& b) {
  const DF df;
  const hn::Half<DU16Pairs> dwh;
  const hn::Rebind<hwy::float16_t, DF> dh;
  a = hn::PromoteTo(df, hn::BitCast(dh, hn::LowerHalf(dwh, y)));
  b = hn::PromoteTo(df, hn::BitCast(dh, hn::UpperHalf(dwh, y)));
}
#endif

HWY_INLINE void LoadF8x2Raw(const uint8_t* HWY_RESTRICT p, VF& a, VF& b) {
#if defined(SHARDADAM_HARDWARE_F16)
  // Every E4M3 value is an fp16 value times 2^8 with the code shifted into
  // place (E4M3 subnormals land on fp16 subnormals), so the fp16 converter
  // does the decoding; only the sign bit and the NaN code need moving.
  const DU16Pairs dw;
  const auto k4000 = hn::Set(dw, 0x4000);
  auto y = hn::ShiftLeft<7>(LoadWideBytes(p));
  y = hn::Add(y, hn::And(y, k4000));  // sign: bit 14 -> bit 15
  // Code 0x7F (fp16 0x3F80) -> fp16 NaN 0x7F80, which widens to 0x7FF00000.
  y = hn::Add(y, hn::And(hn::Add(y, hn::Set(dw, 0x0080)), k4000));
  WidenF16Pair(y, a, b);
#else
  a = F8ToF32(LoadWideU8(p));
  b = F8ToF32(LoadWideU8(p + hn::Lanes(DF())));
#endif
}

HWY_INLINE void StoreF8x2(VF a, VF b, uint8_t* HWY_RESTRICT p) {
  StoreNarrowU8(F32ToF8(a), F32ToF8(b), p);
}

// Unsigned E4M4 codes -> fp32 values divided by kF8RawFactor (exact), as
// LoadF8x2Raw: every E4M4 value is an fp16 value times 2^8 with the code shifted
// into place (E4M4's subnormals land on fp16's), and the NaN code 0xFF becomes
// the fp16 NaN that widens to UF8ToF32's 0x7FC00000.
HWY_INLINE void LoadUF8x2Raw(const uint8_t* HWY_RESTRICT p, VF& a, VF& b) {
#if defined(SHARDADAM_HARDWARE_F16)
  const DU16Pairs dw;
  auto y = hn::ShiftLeft<6>(LoadWideBytes(p));
  y = hn::IfThenElse(hn::Eq(y, hn::Set(dw, 0x3FC0)), hn::Set(dw, 0x7E00), y);  // 0xFF << 6
  WidenF16Pair(y, a, b);
#else
  a = UF8ToF32(LoadWideU8(p));
  b = UF8ToF32(LoadWideU8(p + hn::Lanes(DF())));
#endif
}

// Stores the codes of a / s and b / s (S2.10), given those quotients.
HWY_INLINE void StoreUF8x2(VF a, VF b, VF a_over_s, VF b_over_s, uint8_t* HWY_RESTRICT p) {
  StoreNarrowU8(F32ToUF8(a_over_s, a), F32ToUF8(b_over_s, b), p);
}

// 2 * Lanes 4-bit codes (Lanes bytes; element 2i the low nibble of byte i)
// as two vectors of codes (each lane in [0, 15]), and back. In natural element
// order each byte widens to a u16 lane that becomes the bytes (low nibble, high
// nibble), which then widen as 8-bit codes do: through L1, since Highway 1.0.3
// has no portable byte interleave across 128-bit blocks. In the even/odd order
// of the 16-bit layouts' codecs below (kEO), byte i widens to lane i and its
// nibbles are the pair's lane i: no shuffles.
template <bool kEO>
HWY_INLINE void LoadNibbles(const uint8_t* HWY_RESTRICT p, VU& a, VU& b) {
  if constexpr (kEO) {
    const VU w = LoadWideU8(p);
    a = hn::And(w, hn::Set(DU(), 0x0Fu));
    b = hn::ShiftRight<4>(w);
  } else {
    const DU16 d16;
    const auto w = hn::PromoteTo(d16, hn::LoadU(DU8(), p));
    const auto split = hn::And(hn::Or(w, hn::ShiftLeft<4>(w)), hn::Set(d16, 0x0F0F));
    alignas(64) uint8_t bytes[HWY_MAX_BYTES];
    hn::StoreU(split, d16, reinterpret_cast<uint16_t*>(bytes));
    a = LoadWideU8(bytes);
    b = LoadWideU8(bytes + hn::Lanes(DF()));
  }
}

template <bool kEO>
HWY_INLINE void StoreNibbles(VU a, VU b, uint8_t* HWY_RESTRICT p) {
  if constexpr (kEO) {
    StoreLowBytes(hn::Or(a, hn::ShiftLeft<4>(b)), p);
  } else {
    const DU16 d16;
    alignas(64) uint8_t bytes[HWY_MAX_BYTES];
    StoreNarrowU8(a, b, bytes);
    const auto w = hn::LoadU(d16, reinterpret_cast<const uint16_t*>(bytes));
    const auto packed = hn::Or(hn::And(w, hn::Set(d16, 0x000F)),
                               hn::And(hn::ShiftRight<4>(w), hn::Set(d16, 0x00F0)));
    hn::StoreU(hn::DemoteTo(DU8(), hn::BitCast(DI16(), packed)), DU8(), p);
  }
}

// fp32 master = (param << 16) + sign-extended remainder, modulo 2^32: a
// negative remainder borrows back the +1 the split rounded into the param.
HWY_INLINE void LoadRemainderx2(const uint16_t* HWY_RESTRICT param,
                                const int16_t* HWY_RESTRICT rem, VF& a, VF& b) {
  const DF df;
  const size_t L = hn::Lanes(df);
  a = hn::BitCast(df, hn::Add(hn::ShiftLeft<16>(LoadWideU16(param)),
                              LoadWideI16(rem)));
  b = hn::BitCast(df, hn::Add(hn::ShiftLeft<16>(LoadWideU16(param + L)),
                              LoadWideI16(rem + L)));
}

// A NaN master's bits for the split: the quiet NaN with its sign (S2.5). Its
// own bits could carry the rounding past the top of the high half (0x7FFF ->
// 0x8000, a param of -0), and the param must stay NaN.
HWY_INLINE VU SplittableMaster(VF x) {
  const DU du;
  const VU bits = hn::BitCast(du, x);
  const VU quiet =
      hn::Or(hn::And(bits, hn::Set(du, 0x80000000u)), hn::Set(du, 0x7FC00000u));
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(x)), quiet, bits);
}

// The bits a remainder store splits; kNoNaN: the caller knows x holds no NaN.
template <bool kNoNaN>
HWY_INLINE VU MasterBits(VF x) {
  return kNoNaN ? hn::BitCast(DU(), x) : SplittableMaster(x);
}

// param = high half rounded up when the low half is >= 0x8000 (S2.5),
// remainder = low half.
template <bool kNoNaN = false>
HWY_INLINE void StoreRemainderx2(VF a, VF b, uint16_t* HWY_RESTRICT param,
                                 uint16_t* HWY_RESTRICT rem) {
  const DU du;
  const VU ua = MasterBits<kNoNaN>(a);
  const VU ub = MasterBits<kNoNaN>(b);
  const VU half = hn::Set(du, 0x8000u);
  const VU low = hn::Set(du, 0xFFFFu);
  StoreNarrowU16(hn::ShiftRight<16>(hn::Add(ua, half)),
                 hn::ShiftRight<16>(hn::Add(ub, half)), param);
  StoreNarrowU16(hn::And(ua, low), hn::And(ub, low), rem);
}

// ---------------------------------------------------------------------------
// Even/odd pair codecs, for the fused kernel of the layout whose streams are
// all 16-bit (bf16 grad, bf16 param + int16 remainder, bf16 moments): 2 * Lanes
// elements load as one vector of u32 lanes, element 2i in the low half of lane
// i (little-endian), and the pair is (even elements, odd elements). Every
// stream of that layout uses this order, so elements still line up; it needs
// no widening shuffles or narrowing packs, only shifts, masks and 16-bit blends.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the even/odd codecs assume little-endian lanes"
#endif

HWY_INLINE VU LoadU16Pairs(const void* HWY_RESTRICT p) {
  return hn::LoadU(DU(), static_cast<const uint32_t*>(p));
}

// Stores the high halves of `even`'s lanes to the even elements and those of
// `odd`'s lanes to the odd ones.
HWY_INLINE void StoreHighHalvesEvenOdd(VU even, VU odd, void* HWY_RESTRICT p) {
  const DU16Pairs d16;
  const auto halves =
      hn::OddEven(hn::BitCast(d16, odd), hn::BitCast(d16, hn::ShiftRight<16>(even)));
  hn::StoreU(hn::BitCast(DU(), halves), DU(), static_cast<uint32_t*>(p));
}

HWY_INLINE void LoadBF16EvenOdd(const uint16_t* HWY_RESTRICT p, VF& even, VF& odd) {
  const VU raw = LoadU16Pairs(p);
  even = hn::BitCast(DF(), hn::ShiftLeft<16>(raw));
  odd = hn::BitCast(DF(), hn::And(raw, hn::Set(DU(), 0xFFFF0000u)));
}

template <bool kNoNaN = false>
HWY_INLINE void StoreBF16EvenOdd(VF even, VF odd, uint16_t* HWY_RESTRICT p) {
  StoreHighHalvesEvenOdd(F32ToBF16High<kNoNaN>(even), F32ToBF16High<kNoNaN>(odd), p);
}

// A pair rounded to bf16 stochastically (S2.14) with its random bits ra, rb,
// stored in the pair's order: natural, or even/odd (kEO).
template <bool kEO>
HWY_INLINE void StoreBF16StochasticPair(VF a, VF b, VU ra, VU rb, uint16_t* HWY_RESTRICT p) {
  if constexpr (kEO) {
    StoreHighHalvesEvenOdd(F32ToBF16StochasticHigh(a, ra), F32ToBF16StochasticHigh(b, rb), p);
  } else {
    StoreNarrowU16(F32ToBF16Stochastic(a, ra), F32ToBF16Stochastic(b, rb), p);
  }
}

// LoadRemainderx2 / StoreRemainderx2 in even/odd order.
HWY_INLINE void LoadRemainderEvenOdd(const uint16_t* HWY_RESTRICT param,
                                     const int16_t* HWY_RESTRICT rem, VF& even,
                                     VF& odd) {
  const DU du;
  const DI di;
  const VU p = LoadU16Pairs(param);
  const VI r = hn::BitCast(di, LoadU16Pairs(rem));
  const VU r_even = hn::BitCast(du, hn::ShiftRight<16>(hn::ShiftLeft<16>(r)));
  const VU r_odd = hn::BitCast(du, hn::ShiftRight<16>(r));
  even = hn::BitCast(DF(), hn::Add(hn::ShiftLeft<16>(p), r_even));
  odd = hn::BitCast(DF(), hn::Add(hn::And(p, hn::Set(du, 0xFFFF0000u)), r_odd));
}

template <bool kNoNaN = false>
HWY_INLINE void StoreRemainderEvenOdd(VF even, VF odd, uint16_t* HWY_RESTRICT param,
                                      uint16_t* HWY_RESTRICT rem) {
  const DU du;
  const DU16Pairs d16;
  const VU e = MasterBits<kNoNaN>(even);
  const VU o = MasterBits<kNoNaN>(odd);
  const VU half = hn::Set(du, 0x8000u);
  StoreHighHalvesEvenOdd(hn::Add(e, half), hn::Add(o, half), param);
  const auto low_halves =
      hn::OddEven(hn::BitCast(d16, hn::ShiftLeft<16>(o)), hn::BitCast(d16, e));
  hn::StoreU(hn::BitCast(du, low_halves), du, reinterpret_cast<uint32_t*>(rem));
}

// ---------------------------------------------------------------------------
// Block codecs with the signatures of internal::DecodeFn / EncodeFn. `n` is
// always a multiple of 2 * Lanes (internal::KernelTable::pair).

float* DecodeF32(const void* src, const void* /*aux*/, size_t /*n*/,
                 const internal::ScaleView& /*scale*/, float* /*scratch*/) {
  // No copy: the kernels read (and for states, update) the buffer in place.
  return const_cast<float*>(static_cast<const float*>(src));
}

float* DecodeBF16(const void* src, const void* /*aux*/, size_t n,
                  const internal::ScaleView& /*scale*/, float* HWY_RESTRICT out) {
  const size_t step = 2 * hn::Lanes(DF());
  const uint16_t* HWY_RESTRICT in = static_cast<const uint16_t*>(src);
  for (size_t i = 0; i < n; i += step) {
    VF a, b;
    LoadBF16x2(in + i, a, b);
    StoreF32x2(a, b, out + i);
  }
  return out;
}

float* DecodeF16(const void* src, const void* /*aux*/, size_t n,
                 const internal::ScaleView& /*scale*/, float* HWY_RESTRICT out) {
  const size_t step = 2 * hn::Lanes(DF());
  const uint16_t* HWY_RESTRICT in = static_cast<const uint16_t*>(src);
  for (size_t i = 0; i < n; i += step) {
    VF a, b;
    LoadF16x2(in + i, a, b);
    StoreF32x2(a, b, out + i);
  }
  return out;
}

float* DecodeF16Scaled(const void* src, const void* /*aux*/, size_t n,
                       const internal::ScaleView& scale, float* HWY_RESTRICT out) {
  const size_t step = 2 * hn::Lanes(DF());
  const VF s = hn::Set(DF(), scale.PerTensor());
  const uint16_t* HWY_RESTRICT in = static_cast<const uint16_t*>(src);
  for (size_t i = 0; i < n; i += step) {
    VF a, b;
    LoadF16x2(in + i, a, b);
    StoreF32x2(hn::Mul(a, s), hn::Mul(b, s), out + i);
  }
  return out;
}

// The 8- and 4-bit scaled formats' codes (S2.3, S2.9, S2.10, S2.12), for one
// decode loop, one encode loop and the fused block kernel: a format names its
// pair load / store, its bits per code, and the factor its loaded values still
// need (E4M3's fp16 decoding leaves one, folded into the scale).
struct F8Codes {
  static constexpr size_t kBits = 8;
  static constexpr bool kHasEvenOdd = false;
  static constexpr bool kStochastic = false;  // no StoreStochastic
  static constexpr float kRawFactor = kF8RawFactor;
  template <bool kEO = false>
  static void Load(const uint8_t* HWY_RESTRICT p, VF& a, VF& b) { LoadF8x2Raw(p, a, b); }
  template <bool kEO = false>
  static void Store(VF, VF, VF a_over_s, VF b_over_s, uint8_t* HWY_RESTRICT p) {
    StoreF8x2(a_over_s, b_over_s, p);
  }
};
struct UF8Codes {
  static constexpr size_t kBits = 8;
  static constexpr bool kHasEvenOdd = false;
  static constexpr bool kStochastic = true;
  static constexpr float kRawFactor = kF8RawFactor;
  template <bool kEO = false>
  static void Load(const uint8_t* HWY_RESTRICT p, VF& a, VF& b) { LoadUF8x2Raw(p, a, b); }
  template <bool kEO = false>
  static void Store(VF a, VF b, VF a_over_s, VF b_over_s, uint8_t* HWY_RESTRICT p) {
    StoreUF8x2(a, b, a_over_s, b_over_s, p);
  }
  // Rounded stochastically (S2.13) with the pair's random bits ra, rb.
  template <bool kEO = false>
  static void StoreStochastic(VF a, VF b, VF a_over_s, VF b_over_s, VU ra, VU rb,
                              uint8_t* HWY_RESTRICT p) {
    StoreNarrowU8(F32ToUF8Stochastic(a_over_s, a, ra), F32ToUF8Stochastic(b_over_s, b, rb), p);
  }
};
// The 4-bit ones also pair their codes in even/odd order (kEO); `Map` names
// the decoder of codes and the encoder of (x / s, x).
template <class MapT>
struct NibbleCodes {
  using Map = MapT;
  static constexpr size_t kBits = 4;
  static constexpr bool kHasEvenOdd = true;
  static constexpr bool kStochastic = true;  // F4Codes and UF4Codes: StoreStochastic
  static constexpr float kRawFactor = 1.0f;
  template <bool kEO = false>
  static void Load(const uint8_t* HWY_RESTRICT p, VF& a, VF& b) {
    VU ca, cb;
    LoadNibbles<kEO>(p, ca, cb);
    a = Map::Decode(ca);
    b = Map::Decode(cb);
  }
  template <bool kEO = false>
  static void Store(VF a, VF b, VF a_over_s, VF b_over_s, uint8_t* HWY_RESTRICT p) {
    StoreNibbles<kEO>(Map::Encode(a_over_s, a), Map::Encode(b_over_s, b), p);
  }
};
struct F4Map {
  static VF Decode(VU c) { return F4ToF32(c); }
  static VU Encode(VF x_over_s, VF /*x: signed codes need no zero-free test*/) {
    return F32ToF4(x_over_s);
  }
};
struct UF4Map {
  static VF Decode(VU c) { return UF4ToF32(c); }
  static VU Encode(VF x_over_s, VF x) { return F32ToUF4(x_over_s, x); }
};
struct F4Codes : NibbleCodes<F4Map> {
  // Rounded stochastically (S2.13) with the pair's random bits ra, rb.
  template <bool kEO = false>
  static void StoreStochastic(VF /*a*/, VF /*b*/, VF a_over_s, VF b_over_s, VU ra, VU rb,
                              uint8_t* HWY_RESTRICT p) {
    StoreNibbles<kEO>(F32ToF4Stochastic(a_over_s, ra), F32ToF4Stochastic(b_over_s, rb), p);
  }
};
struct UF4Codes : NibbleCodes<UF4Map> {
  // Rounded stochastically (S2.13) with the pair's random bits ra, rb.
  template <bool kEO = false>
  static void StoreStochastic(VF a, VF b, VF a_over_s, VF b_over_s, VU ra, VU rb,
                              uint8_t* HWY_RESTRICT p) {
    StoreNibbles<kEO>(F32ToUF4Stochastic(a_over_s, a, ra),
                      F32ToUF4Stochastic(b_over_s, b, rb), p);
  }
};

// Decodes with scale s: kRawFactor * s in one multiply, which rounds like the
// reference's value * s whenever that product is finite (it is then exact: a
// power-of-two factor); else the factor first (exact), then s. kFolds: the
// caller knows the product is finite (FusedDecoderFolds), so no load tests it.
template <class Codes, bool kFolds = false, class Enable = void>
struct ScaledLoad {
  float first, second;
  bool twice;
  explicit ScaledLoad(float s) {
    const float folded = s * Codes::kRawFactor;
    twice = Codes::kRawFactor != 1.0f && !std::isfinite(folded);
    first = twice ? Codes::kRawFactor : folded;
    second = s;
  }
  // The pair of elements whose codes start at p.
  template <bool kEO = false>
  HWY_INLINE void Load(const uint8_t* HWY_RESTRICT p, VF& a, VF& b) const {
    const DF df;
    Codes::template Load<kEO>(p, a, b);
    a = hn::Mul(a, hn::Set(df, first));
    b = hn::Mul(b, hn::Set(df, first));
    if (!kFolds && twice) {
      a = hn::Mul(a, hn::Set(df, second));
      b = hn::Mul(b, hn::Set(df, second));
    }
  }
};

// 4-bit codes where a vector holds 16 fp32 lanes (AVX-512) or 8 (AVX2): the
// 16 codes' values times s are one or two vectors, built once per scale, and
// a code loads by a permute (two and a blend on 8 lanes) instead of decoding
// and multiplying. A lane holds Map::Decode(code) * s, the product above
// (kRawFactor is 1): the same bits.
#if !HWY_HAVE_SCALABLE && (HWY_MAX_BYTES == 64 || HWY_MAX_BYTES == 32)
template <class Codes, bool kFolds>
struct ScaledLoad<Codes, kFolds, std::enable_if_t<Codes::kBits == 4>> {
  static constexpr size_t kTables = HWY_MAX_BYTES == 64 ? 1 : 2;
  VF values[kTables];
  explicit ScaledLoad(float s) {
    const DU du;
    for (size_t t = 0; t < kTables; ++t) {
      const uint32_t first = static_cast<uint32_t>(t * hn::Lanes(du));
      values[t] = hn::Mul(Codes::Map::Decode(hn::Iota(du, first)), hn::Set(DF(), s));
    }
  }
  template <bool kEO = false>
  HWY_INLINE void Load(const uint8_t* HWY_RESTRICT p, VF& a, VF& b) const {
    VU ca, cb;
    LoadNibbles<kEO>(p, ca, cb);
    a = Lookup(ca);
    b = Lookup(cb);
  }

 private:
  HWY_INLINE VF Lookup(VU code) const {
    const DF df;
    const DI di;
    if constexpr (kTables == 1) {
      return hn::TableLookupLanes(values[0], hn::IndicesFromVec(df, hn::BitCast(di, code)));
    } else {
      const auto lane = hn::IndicesFromVec(df, hn::BitCast(di, hn::And(code, hn::Set(DU(), 7u))));
      return hn::IfThenElse(hn::RebindMask(df, hn::Gt(hn::BitCast(di, code), hn::Set(di, 7))),
                            hn::TableLookupLanes(values[1], lane),
                            hn::TableLookupLanes(values[0], lane));
    }
  }
};
#endif

template <class Codes>
float* DecodeScaled(const void* src, const void* /*aux*/, size_t n,
                    const internal::ScaleView& view, float* HWY_RESTRICT out) {
  const size_t step = 2 * hn::Lanes(DF());
  const uint8_t* HWY_RESTRICT in = static_cast<const uint8_t*>(src);
  const ScaledLoad<Codes> load(view.PerTensor());
  for (size_t i = 0; i < n; i += step) {
    VF a, b;
    load.Load(in + i * Codes::kBits / 8, a, b);
    StoreF32x2(a, b, out + i);
  }
  return out;
}

float* DecodeRemainder(const void* src, const void* aux, size_t n,
                       const internal::ScaleView& /*scale*/, float* HWY_RESTRICT out) {
  const size_t step = 2 * hn::Lanes(DF());
  const uint16_t* HWY_RESTRICT param = static_cast<const uint16_t*>(src);
  const int16_t* HWY_RESTRICT rem = static_cast<const int16_t*>(aux);
  for (size_t i = 0; i < n; i += step) {
    VF a, b;
    LoadRemainderx2(param + i, rem + i, a, b);
    StoreF32x2(a, b, out + i);
  }
  return out;
}

void EncodeF32(const float* HWY_RESTRICT x, size_t n, const internal::ScaleView& /*scale*/,
               void* dst, void* /*aux*/) {
  if (x != dst) memcpy(dst, x, n * sizeof(float));
}

void EncodeBF16(const float* HWY_RESTRICT x, size_t n, const internal::ScaleView& /*scale*/,
                void* dst, void* /*aux*/) {
  const size_t step = 2 * hn::Lanes(DF());
  uint16_t* HWY_RESTRICT out = static_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; i += step) {
    VF a, b;
    LoadF32x2(x + i, a, b);
    StoreBF16x2(a, b, out + i);
  }
}

void EncodeF16(const float* HWY_RESTRICT x, size_t n, const internal::ScaleView& /*scale*/,
               void* dst, void* /*aux*/) {
  const size_t step = 2 * hn::Lanes(DF());
  uint16_t* HWY_RESTRICT out = static_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; i += step) {
    VF a, b;
    LoadF32x2(x + i, a, b);
    StoreF16x2(a, b, out + i);
  }
}

// Scaled encoders divide (u / s, never u * (1 / s)), so every target and the
// reference round the same quotient.
void EncodeF16Scaled(const float* HWY_RESTRICT x, size_t n, const internal::ScaleView& scale,
                     void* dst, void* /*aux*/) {
  const size_t step = 2 * hn::Lanes(DF());
  const VF s = hn::Set(DF(), scale.PerTensor());
  uint16_t* HWY_RESTRICT out = static_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; i += step) {
    VF a, b;
    LoadF32x2(x + i, a, b);
    StoreF16x2(hn::Div(a, s), hn::Div(b, s), out + i);
  }
}

// As the other scaled encoders.
template <class Codes>
void EncodeScaled(const float* HWY_RESTRICT x, size_t n, const internal::ScaleView& scale,
                  void* dst, void* /*aux*/) {
  const size_t step = 2 * hn::Lanes(DF());
  const VF s = hn::Set(DF(), scale.PerTensor());
  uint8_t* HWY_RESTRICT out = static_cast<uint8_t*>(dst);
  for (size_t i = 0; i < n; i += step) {
    VF a, b;
    LoadF32x2(x + i, a, b);
    Codes::Store(a, b, hn::Div(a, s), hn::Div(b, s), out + i * Codes::kBits / 8);
  }
}

// internal::StochasticEncodeFn: EncodeScaled<Codes> rounded stochastically
// (F4Codes, UF4Codes, UF8Codes).
template <class Codes>
void EncodeStochastic(const float* HWY_RESTRICT x, size_t n,
                      const internal::ScaleView& scale,
                      const internal::RoundingView& rounding, void* dst) {
  const size_t step = 2 * hn::Lanes(DF());
  const VF s = hn::Set(DF(), scale.PerTensor());
  uint8_t* HWY_RESTRICT out = static_cast<uint8_t*>(dst);
  for (size_t i = 0; i < n; i += step) {
    VF a, b;
    LoadF32x2(x + i, a, b);
    VU ha, hb;
    PairIndexHash<false>(static_cast<uint64_t>(rounding.index) + i, ha, hb);
    Codes::StoreStochastic(a, b, hn::Div(a, s), hn::Div(b, s), KeyedBits(rounding.key, ha),
                           KeyedBits(rounding.key, hb), out + i * Codes::kBits / 8);
  }
}

// internal::StochasticEncodeFn for a bf16 param (S2.14): EncodeBF16 rounded
// stochastically; a run may cross a multiple of 2^32 (VectorBits).
void EncodeBF16Stochastic(const float* HWY_RESTRICT x, size_t n,
                          const internal::ScaleView& /*scale*/,
                          const internal::RoundingView& rounding, void* dst) {
  const size_t lanes = hn::Lanes(DF());
  uint16_t* HWY_RESTRICT out = static_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; i += 2 * lanes) {
    const uint64_t index = static_cast<uint64_t>(rounding.index) + i;
    VF a, b;
    LoadF32x2(x + i, a, b);
    StoreNarrowU16(F32ToBF16Stochastic(a, VectorBits(rounding.key, index)),
                   F32ToBF16Stochastic(b, VectorBits(rounding.key, index + lanes)), out + i);
  }
}

void EncodeRemainder(const float* HWY_RESTRICT x, size_t n, const internal::ScaleView& /*scale*/,
                     void* dst, void* aux) {
  const size_t step = 2 * hn::Lanes(DF());
  uint16_t* HWY_RESTRICT param = static_cast<uint16_t*>(dst);
  uint16_t* HWY_RESTRICT rem = static_cast<uint16_t*>(aux);
  for (size_t i = 0; i < n; i += step) {
    VF a, b;
    LoadF32x2(x + i, a, b);
    StoreRemainderx2(a, b, param + i, rem + i);
  }
}

uint32_t AbsMaxBits(const float* HWY_RESTRICT x, size_t n) {
  const DF df;
  const DI di;
  const size_t L = hn::Lanes(df);
  VI acc = hn::Zero(di);
  size_t i = 0;
  for (; i + L <= n; i += L) acc = hn::Max(acc, AbsBits(hn::LoadU(df, x + i)));
  uint32_t best = static_cast<uint32_t>(hn::GetLane(hn::MaxOfLanes(di, acc)));
  for (; i < n; ++i) {
    uint32_t bits;
    memcpy(&bits, x + i, sizeof(bits));
    bits &= 0x7FFFFFFFu;
    if (bits > best) best = bits;
  }
  return best;
}

// Largest lane of an unsigned 8- or 16-bit vector. Highway 1.0.3 has no 8-bit
// MaxOfLanes on every target, but every target has a 32-bit one, so the narrow
// lanes are folded into 32-bit lanes first, in registers.
template <class D>
HWY_INLINE uint32_t MaxLane(D /*d*/, hn::Vec<D> v) {
  const hn::Repartition<uint16_t, D> d16;
  const hn::Repartition<uint32_t, D> d32;
  auto h = hn::BitCast(d16, v);
  if constexpr (sizeof(hn::TFromD<D>) == 1) {
    // Each 16-bit lane holds two bytes: keep the larger.
    h = hn::Max(hn::And(h, hn::Set(d16, 0xFF)), hn::ShiftRight<8>(h));
  }
  // Each 32-bit lane holds two 16-bit values: keep the larger.
  const auto w = hn::BitCast(d32, h);
  const auto wide = hn::Max(hn::And(w, hn::Set(d32, 0xFFFFu)), hn::ShiftRight<16>(w));
  return hn::GetLane(hn::MaxOfLanes(d32, wide));
}

// Largest x[i] & mask over any n: for bf16 / fp16 bit patterns (mask 0x7FFF)
// and E4M3 codes (0x7F) the largest magnitude, since both order magnitudes as
// their bits.
template <typename T>
HWY_INLINE uint32_t MaskedMax(const T* HWY_RESTRICT x, size_t n, T mask) {
  const hn::ScalableTag<T> d;
  const size_t L = hn::Lanes(d);
  const auto m = hn::Set(d, mask);
  auto acc = hn::Zero(d);
  size_t i = 0;
  for (; i + L <= n; i += L) acc = hn::Max(acc, hn::And(hn::LoadU(d, x + i), m));
  uint32_t best = MaxLane(d, acc);
  for (; i < n; ++i) best = std::max<uint32_t>(best, x[i] & mask);
  return best;
}

uint32_t AbsMaxBits16(const uint16_t* HWY_RESTRICT x, size_t n) {
  return MaskedMax<uint16_t>(x, n, 0x7FFF);
}

uint32_t AbsMaxCode8(const uint8_t* HWY_RESTRICT x, size_t n) {
  return MaskedMax<uint8_t>(x, n, 0x7F);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace shardadam
HWY_AFTER_NAMESPACE();

#endif  // SHARDADAM_CONVERT_INL_H_
