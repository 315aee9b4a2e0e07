// Whole-buffer conversions and scale measurements (driver.h): Convert and
// MeasureScale of adam.h after validation.
#include <atomic>
#include <cstring>

#include "driver.h"
#include "plan.h"
#include "scale_rule.h"
#include "spans.h"
#include "work_items.h"

namespace shardadam {
namespace internal {
namespace {

// Codec for one side of a Convert. A scale of exactly 1 makes fp16 a plain
// cast (the same bits without a multiply / divide).
Codec ConvertCodec(DType dtype, float scale) {
  if (dtype == DType::kFloat16 && scale == 1.0f) return kCodecF16;
  return CodecOf(dtype, true);
}

void ConvertSpan(const char* src, int src_size, DecodeFn decode,
                 char* dst, int dst_size, EncodeFn encode, bool dst_f32,
                 const ScaleView& scale, size_t n, Scratch& s) {
  for (size_t done = 0; done < n; done += kBlock) {
    const size_t c = std::min(kBlock, n - done);
    const char* from = src + done * src_size;
    char* to = dst + done * dst_size;
    if (dst_f32) {
      // Decode straight into the destination (never the source's memory:
      // fp32 -> fp32 does not come here).
      decode(from, nullptr, c, scale, reinterpret_cast<float*>(to));
    } else {
      encode(decode(from, nullptr, c, scale, s.g), c, scale, to, nullptr);
    }
  }
}

}  // namespace

void ConvertBuffer(const KernelTable& kt, const void* src, DType src_dtype, void* dst,
                   DType dst_dtype, int64_t numel, float scale, int num_threads) {
  const int src_size = FormatOf(src_dtype).item_bits / 8;  // casts: whole bytes
  const int dst_size = FormatOf(dst_dtype).item_bits / 8;
  if (src_dtype == DType::kFloat32 && dst_dtype == DType::kFloat32) {
    if (src != dst) memcpy(dst, src, static_cast<size_t>(numel) * src_size);
    return;
  }
  // Every other pair goes through fp32 like the reference, so bf16 -> bf16
  // also quiets a signalling NaN.
  const DecodeFn decode = kt.decode[ConvertCodec(src_dtype, scale)];
  const EncodeFn encode = kt.encode[ConvertCodec(dst_dtype, scale)];
  const bool dst_f32 = dst_dtype == DType::kFloat32;
  const char* from = static_cast<const char*>(src);
  char* to = static_cast<char*>(dst);
  const ScaleView view{&scale, 0, 0};
  RunBufferItems<Scratch>(numel, num_threads, [&](const ItemRange& r, Scratch& s) {
    const int64_t begin = r.begin;
    const int64_t end = r.end;
    const size_t n = static_cast<size_t>(end - begin);
    const size_t whole = n / kt.pair * kt.pair;
    ConvertSpan(from + begin * src_size, src_size, decode,
                to + begin * dst_size, dst_size, encode, dst_f32, view,
                whole, s);
    if (whole < n) {
      const size_t t = n - whole;
      alignas(64) char in[kGranule * sizeof(float)] = {};
      alignas(64) char out[kGranule * sizeof(float)];
      memcpy(in, from + (begin + whole) * src_size, t * src_size);
      ConvertSpan(in, src_size, decode, out, dst_size, encode, dst_f32,
                  view, kt.pair, s);
      memcpy(to + (begin + whole) * dst_size, out, t * dst_size);
    }
  });
}

float MeasureBufferScale(const KernelTable& kt, const float* u, int64_t numel,
                         DType dtype, int num_threads) {
  std::atomic<uint32_t> best{0};
  RunBufferItems<Scratch>(numel, num_threads, [&](const ItemRange& r, Scratch&) {
    AtomicMax(best, kt.abs_max_bits(u + r.begin, static_cast<size_t>(r.end - r.begin)));
  });
  return ScaleFromAbsMaxBits(best.load(), FormatOf(dtype).scale_target);
}

}  // namespace internal
}  // namespace shardadam
