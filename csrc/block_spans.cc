// The only pass of a tensor with per-block scaled moments (S2.9): each block
// is decoded with its old scale, updated in L1, measured there, and encoded
// with its new scale, so no pass over memory is repeated (spans.h). Runs of
// whole blocks of a listed layout go to its fused block kernel instead
// (fused_layouts.h FusedBlockLayouts), which gives the same bits.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "scale_rule.h"
#include "spans.h"
#include "stochastic_blocks.h"

namespace shardadam {
namespace internal {
namespace {

// The highest Float4Rank of a byte's two codes, per map (unsigned E3M1 second).
struct ByteRanks {
  uint8_t rank[2][256];
};
constexpr ByteRanks MakeByteRanks() {
  ByteRanks t{};
  for (int u = 0; u < 2; ++u) {
    for (int b = 0; b < 256; ++b) {
      const uint32_t lo = Float4Rank(u == 1, static_cast<uint8_t>(b & 0xF));
      const uint32_t hi = Float4Rank(u == 1, static_cast<uint8_t>(b >> 4));
      t.rank[u][b] = static_cast<uint8_t>(lo > hi ? lo : hi);
    }
  }
  return t;
}
constexpr ByteRanks kByteRanks = MakeByteRanks();

// The top StochasticRank of a block's n codes, or any rank from `enough` up.
uint32_t TopRank(DType dtype, const uint8_t* codes, size_t n, uint32_t enough) {
  uint32_t top = 0;
  if (FormatOf(dtype).item_bits == 8) {  // E4M4: a code is its rank
    for (size_t i = 0; i < n && top < enough; ++i) top = std::max<uint32_t>(top, codes[i]);
    return top;
  }
  const bool is_unsigned = dtype == DType::kUFloat4E3M1Block;
  const size_t pairs = n / 2;  // an odd n's last code is a low nibble alone
  if (n % 2 == 1) top = Float4Rank(is_unsigned, codes[pairs] & 0xF);
  for (size_t i = 0; i < pairs && top < enough; ++i) {
    top = std::max<uint32_t>(top, kByteRanks.rank[is_unsigned][codes[i]]);
  }
  return top;
}

// Every code of the block doubled in value (DoubledBlockCode).
void DoubleCodes(DType dtype, uint8_t* codes, size_t n) {
  if (FormatOf(dtype).item_bits == 8) {
    for (size_t i = 0; i < n; ++i) codes[i] = DoubledBlockCode(dtype, codes[i]);
    return;
  }
  const size_t pairs = n / 2;
  for (size_t i = 0; i < pairs; ++i) {
    const uint8_t b = codes[i];
    codes[i] = static_cast<uint8_t>(DoubledBlockCode(dtype, b & 0xF) |
                                    (DoubledBlockCode(dtype, b >> 4) << 4));
  }
  if (n % 2 == 1) {
    codes[pairs] = static_cast<uint8_t>((codes[pairs] & 0xF0) |
                                        DoubledBlockCode(dtype, codes[pairs] & 0xF));
  }
}

}  // namespace

float CanonicalBlockCodes(DType dtype, float absmax, float s, uint8_t* codes, size_t n) {
  // Only a block whose largest element lies below the first value that keeps its
  // scale can round down out of the top binade (a NaN compares false).
  if (!(absmax < KeepsScaleValue(dtype) * s)) return s;
  const uint32_t top = TopRank(dtype, codes, n, KeepsScaleRank(dtype));
  const float canonical = CanonicalBlockScale(dtype, top, s);
  if (canonical < s) DoubleCodes(dtype, codes, n);
  return canonical;
}

namespace {

// Steps the `c` elements (a multiple of kt.pair) from element `e`, which hold
// the first `valid` elements of block `j`; the maxima are taken over those
// only (zero padding updates to zero, or to NaN under an infinite decay).
void StepBlock(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
               int64_t e, size_t c, size_t valid, int64_t j, Scratch& s) {
  const ScaleView m_old = p.block_scaled[kStreamM] ? p.BlockScale(kStreamM, j)
                                                   : p.OldScale(kStreamM, e);
  const ScaleView v_old = p.block_scaled[kStreamV] ? p.BlockScale(kStreamV, j)
                                                   : p.OldScale(kStreamV, e);
  const Decoded d = DecodeRun(p, e, c, m_old, v_old, s);
  kt.update[k.adam_w_mode ? 1 : 0][k.bias_correction2_sqrt == 1.0f ? 1 : 0](
      k, d.g, d.w, d.m, d.v, c);
  // The new scales, from the block's new values while they are in L1.
  float scale[3] = {1.0f, 1.0f, 1.0f};
  uint32_t absmax[3] = {0, 0, 0};
  const float* values[3] = {d.w, d.m, d.v};
  const DType dtypes[3] = {DType::kNone, p.m_dtype, p.v_dtype};
  for (int stream = kStreamM; stream <= kStreamV; ++stream) {
    if (!p.block_scaled[stream]) continue;
    const FormatInfo f = FormatOf(dtypes[stream]);
    absmax[stream] = kt.abs_max_bits(values[stream], valid);
    scale[stream] = BlockScaleFromAbsMaxBits(absmax[stream], f.scale_target, f.zero_bound,
                                             f.overflow_bound);
  }
  EncodeRun(p, e, c, d,
            p.block_scaled[kStreamM] ? ScaleView{&scale[kStreamM], 0, 0}
                                     : p.NewScale(kStreamM, e),
            p.block_scaled[kStreamV] ? ScaleView{&scale[kStreamV], 0, 0}
                                     : p.NewScale(kStreamV, e));
  // S2.13: codes rounded stochastically are stored as a decoded block encodes.
  if (p.block_scaled[kStreamM] && p.encode_m_stochastic != nullptr) {
    scale[kStreamM] = CanonicalBlockCodes(
        p.m_dtype, FloatOf(absmax[kStreamM]), scale[kStreamM],
        reinterpret_cast<uint8_t*>(ElementAt(p.exp_avg, p.exp_avg_bits, e)), valid);
  }
  if (p.block_scaled[kStreamV] && p.encode_v_stochastic != nullptr) {
    scale[kStreamV] = CanonicalBlockCodes(
        p.v_dtype, FloatOf(absmax[kStreamV]), scale[kStreamV],
        reinterpret_cast<uint8_t*>(ElementAt(p.exp_avg_sq, p.exp_avg_sq_bits, e)), valid);
  }
  // Each block is this item's alone: its scale is read above and written here.
  for (int stream = kStreamM; stream <= kStreamV; ++stream) {
    if (p.block_scaled[stream]) p.scale_slot[stream][j] = scale[stream];
  }
}

// A block that is not a whole number of pairs (cut by the tensor's ends),
// staged through zero-padded copies.
void StepStagedBlock(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                     int64_t e, size_t t, int64_t j, Scratch& s) {
  if (s.staged == nullptr) s.staged.reset(new StagedBlock);  // uninitialised: StageIn fills it
  const size_t padded = (t + kt.pair - 1) / kt.pair * kt.pair;
  auto& buffers = s.staged->buffers;
  char* const space[5] = {buffers[0], buffers[1], buffers[2], buffers[3], buffers[4]};
  const TensorPlan q = StageIn(p, e, t, padded, space);
  StepBlock(kt, q, k, 0, padded, t, j, s);
  StageOut(p, q, e, t);
}

}  // namespace

// The whole blocks of [e, end) from element e, which starts block j, through
// the layout's fused block kernel, up to the first whose old scales its
// decoders cannot fold (FusedDecoderFolds). Returns where they end.
int64_t StepWholeBlocks(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                        int64_t e, int64_t end, int64_t j) {
  const int64_t whole = (end - e) / p.block;
  int64_t blocks = whole;
  const float m_limit = FoldableScale(p.m_dtype), v_limit = FoldableScale(p.v_dtype);
  if (!std::isinf(m_limit) || !std::isinf(v_limit)) {
    const float* m_scales = p.scale_slot[kStreamM] + j;
    const float* v_scales = p.scale_slot[kStreamV] + j;
    blocks = 0;
    while (blocks < whole && std::fabs(m_scales[blocks]) <= m_limit &&
           std::fabs(v_scales[blocks]) <= v_limit) {
      ++blocks;
    }
  }
  const int64_t n = blocks * p.block;
  if (n == 0) return e;
  RoundingView m_rounding = p.m_rounding;
  m_rounding.index += e;
  RoundingView v_rounding = p.v_rounding;
  v_rounding.index += e;
  RoundingView param_rounding = p.param_rounding;
  param_rounding.index += e;
  const auto at = [e](auto* buffer, int bits) {
    return buffer == nullptr ? nullptr : ElementAt(buffer, bits, e);
  };
  kt.fused.block[k.adam_w_mode ? 1 : 0][k.bias_correction2_sqrt == 1.0f ? 1 : 0]
                [p.fused_block](k, at(p.grad, p.grad_bits), at(p.param, p.param_bits),
                                at(p.master, p.master_bits), at(p.exp_avg, p.exp_avg_bits),
                                at(p.exp_avg_sq, p.exp_avg_sq_bits),
                                p.scale_slot[kStreamM] + j, p.scale_slot[kStreamV] + j,
                                static_cast<size_t>(p.block), static_cast<size_t>(n),
                                p.encode_m_stochastic ? &m_rounding : nullptr,
                                p.encode_v_stochastic ? &v_rounding : nullptr,
                                p.encode_param_stochastic ? &param_rounding : nullptr);
  return e + n;
}

void UpdateBlockSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                     int64_t begin, int64_t end, Scratch& s) {
  for (int64_t e = begin; e < end;) {
    // Block j of this tensor holds elements [j * block - lead, (j + 1) * block - lead).
    const int64_t j = (e + p.lead) / p.block;
    if (p.fused_block >= 0 && (e + p.lead) % p.block == 0 &&
        static_cast<size_t>(p.block) % kt.pair == 0) {
      const int64_t next = StepWholeBlocks(kt, p, k, e, end, j);
      if (next != e) {
        e = next;
        continue;
      }
    }
    const int64_t next = std::min(end, (j + 1) * p.block - p.lead);
    const size_t c = static_cast<size_t>(next - e);
    if (c % kt.pair == 0) {
      StepBlock(kt, p, k, e, c, c, j, s);
    } else {
      StepStagedBlock(kt, p, k, e, c, j, s);
    }
    e = next;
  }
}

}  // namespace internal
}  // namespace shardadam
