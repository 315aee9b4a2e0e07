// The core's entry points (shardadam/adam.h) and the target-independent driver
// around the per-target kernels of adam-inl.h / convert-inl.h. How one AdamStep
// call runs (validation, fused kernels and fp32 blocks, work items, the two
// passes of per-tensor scaled state and the skipping of pass-1 blocks, why the
// results do not depend on the thread count): docs/kernel-design.md.
//
// Running tests on every SIMD target: see kernels.h (internal::CompiledTargets
// and internal::SetTargetForTest, which pin every entry point of this file to
// one target without touching Highway's global dispatch state).

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "adam.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "adam-inl.h"
#include "hwy/highway.h"

#if HWY_ONCE

#include "float_mode.h"
#include "kernels.h"
#include "shardadam/adam.h"
#include "thread_pool.h"
#include "validate.h"

namespace shardadam {

HWY_EXPORT(GetKernelTable);

namespace internal {
namespace {

std::atomic<const KernelTable*> g_pinned{nullptr};

// Whole tensors up to this size run pass 1 and pass 2 on one thread while
// their inputs are still in L2.
constexpr int64_t kSmallScaledMax = 32768;
// Below this many elements of work per thread, waking another thread costs
// more than it saves.
constexpr int64_t kMinWorkPerThread = 32768;

static_assert(kChunk % kGranule == 0 && kSmallScaledMax % kGranule == 0,
              "work items must start on granule boundaries");
static_assert(kBlock % kGranule == 0, "blocks are whole granules");

float FloatFromBits(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

uint32_t AbsBitsOf(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  return bits & 0x7FFFFFFFu;
}

// Scale of a state whose largest magnitude has fp32 bits `bits` (S2.3).
float ScaleFromAbsMaxBits(uint32_t bits, float target) {
  if (bits == 0 || bits >= 0x7F800000u) return 1.0f;  // zero, inf or NaN
  const float s = FloatFromBits(bits) / target;
  return s < FLT_MIN ? FLT_MIN : s;
}

float ScaleTarget(DType dtype) {
  if (dtype == DType::kFloat16) return kFloat16ScaleTarget;
  if (dtype == DType::kFloat8E4M3) return kFloat8ScaleTarget;
  return 0.0f;
}

// Codec of a buffer. fp16 is scaled for states, a plain cast for params.
Codec CodecOf(DType dtype, bool is_state) {
  switch (dtype) {
    case DType::kFloat16:
      return is_state ? kCodecF16Scaled : kCodecF16;
    case DType::kBFloat16:
      return kCodecBF16;
    case DType::kFloat8E4M3:
      return kCodecF8Scaled;
    case DType::kInt16Remainder:
      return kCodecRemainder;
    default:
      return kCodecF32;
  }
}

// Streams of one tensor, chosen once per call. Index 0 / 1 / 2 of the scale
// arrays is the master (w), exp_avg (m) and exp_avg_sq (v).
struct TensorPlan {
  int64_t numel = 0;
  char* param = nullptr;
  const char* grad = nullptr;
  char* master = nullptr;  // fp32 / fp16 master or the int16 remainder
  char* exp_avg = nullptr;
  char* exp_avg_sq = nullptr;
  int param_size = 0, grad_size = 0, master_size = 0, exp_avg_size = 0,
      exp_avg_sq_size = 0;

  Codec grad_codec = kCodecF32, w_codec = kCodecF32, m_codec = kCodecF32,
        v_codec = kCodecF32;
  DecodeFn decode_grad = nullptr, decode_w = nullptr, decode_m = nullptr,
           decode_v = nullptr;
  bool w_from_master = false;  // else from param (+ remainder as aux)
  // Null where the update already wrote the buffer in place (fp32).
  EncodeFn encode_param = nullptr, encode_master = nullptr, encode_m = nullptr,
           encode_v = nullptr;

  float old_scale[3] = {1.0f, 1.0f, 1.0f};
  float new_scale[3] = {1.0f, 1.0f, 1.0f};
  float target[3] = {0.0f, 0.0f, 0.0f};  // 0: stream not scaled
  float* scale_slot[3] = {nullptr, nullptr, nullptr};

  // KernelTable::fused indices when the layout has a fused kernel.
  bool fused = false;
  int fused_grad = 0, fused_weight = 0, fused_moments = 0;

  bool Scaled() const { return target[0] != 0 || target[1] != 0 || target[2] != 0; }
  FusedScales FusedScalesOf() const {
    return {old_scale[1], old_scale[2], new_scale[1], new_scale[2]};
  }
};

// The fused kernels' moment layout of a pair of moment dtypes, or -1.
int FusedMomentsOf(DType exp_avg, DType exp_avg_sq) {
  if (exp_avg == DType::kFloat8E4M3 && exp_avg_sq == DType::kBFloat16) {
    return kFusedMomentsF8BF16;
  }
  if (exp_avg != exp_avg_sq) return -1;
  switch (exp_avg) {
    case DType::kFloat32: return kFusedMomentsF32;
    case DType::kBFloat16: return kFusedMomentsBF16;
    case DType::kFloat16: return kFusedMomentsF16Scaled;
    default: return kFusedMomentsF8Scaled;  // kFloat8E4M3 (validated)
  }
}

// Sets the plan's fused-kernel indices if the slot's layout has one. Needs the
// plan's old scales.
void ChooseFused(const TensorSlot& s, TensorPlan& p) {
  if (s.grad_dtype != DType::kFloat32 && s.grad_dtype != DType::kBFloat16) return;
  const int moments = FusedMomentsOf(s.exp_avg_dtype, s.exp_avg_sq_dtype);
  if (moments < 0) return;
  if (s.param_dtype == DType::kFloat32 && s.master_dtype == DType::kNone) {
    p.fused_weight = kFusedParamF32;
  } else if (s.param_dtype == DType::kBFloat16 && s.master_dtype == DType::kFloat32) {
    p.fused_weight = kFusedMasterF32;
  } else if (s.param_dtype == DType::kBFloat16 &&
             s.master_dtype == DType::kInt16Remainder) {
    p.fused_weight = kFusedRemainder;
  } else {
    return;
  }
  // The fused fp8 decoder folds a power-of-two factor (at most kE4M3OverF16)
  // into the old scale; an absurdly large scale takes the block path, which
  // does not.
  const auto folds = [](int stream, float old_scale) {
    return stream != kFusedMomentsF8Scaled || std::isfinite(old_scale * kE4M3OverF16);
  };
  if (!folds(ExpAvgStream(moments), p.old_scale[1]) ||
      !folds(ExpAvgSqStream(moments), p.old_scale[2])) {
    return;
  }
  p.fused_grad = s.grad_dtype == DType::kFloat32 ? kFusedGradF32 : kFusedGradBF16;
  p.fused_moments = moments;
  p.fused = true;
}

TensorPlan MakePlan(const KernelTable& kt, const TensorSlot& s) {
  TensorPlan p;
  p.numel = s.numel;
  p.param = static_cast<char*>(s.param);
  p.grad = static_cast<const char*>(s.grad);
  p.exp_avg = static_cast<char*>(s.exp_avg);
  p.exp_avg_sq = static_cast<char*>(s.exp_avg_sq);
  p.param_size = ItemSize(s.param_dtype);
  p.grad_size = ItemSize(s.grad_dtype);
  p.exp_avg_size = ItemSize(s.exp_avg_dtype);
  p.exp_avg_sq_size = ItemSize(s.exp_avg_sq_dtype);
  p.grad_codec = CodecOf(s.grad_dtype, false);
  p.decode_grad = kt.decode[p.grad_codec];

  const Codec param_codec = CodecOf(s.param_dtype, false);
  switch (s.master_dtype) {
    case DType::kNone:
      p.w_codec = param_codec;
      if (param_codec != kCodecF32) p.encode_param = kt.encode[param_codec];
      break;
    case DType::kInt16Remainder:
      p.master = static_cast<char*>(s.master_param);
      p.master_size = 2;
      p.w_codec = kCodecRemainder;
      p.encode_param = kt.encode[kCodecRemainder];
      break;
    default: {  // fp32 or fp16 (scaled) master
      p.master = static_cast<char*>(s.master_param);
      p.master_size = ItemSize(s.master_dtype);
      p.w_from_master = true;
      p.w_codec = CodecOf(s.master_dtype, true);
      p.encode_param = kt.encode[param_codec];
      if (p.w_codec != kCodecF32) p.encode_master = kt.encode[p.w_codec];
      break;
    }
  }
  p.decode_w = kt.decode[p.w_codec];
  p.m_codec = CodecOf(s.exp_avg_dtype, true);
  p.v_codec = CodecOf(s.exp_avg_sq_dtype, true);
  p.decode_m = kt.decode[p.m_codec];
  p.decode_v = kt.decode[p.v_codec];
  if (p.m_codec != kCodecF32) p.encode_m = kt.encode[p.m_codec];
  if (p.v_codec != kCodecF32) p.encode_v = kt.encode[p.v_codec];

  const DType state_dtypes[3] = {s.master_dtype, s.exp_avg_dtype, s.exp_avg_sq_dtype};
  float* const slots[3] = {s.master_scale, s.exp_avg_scale, s.exp_avg_sq_scale};
  for (int i = 0; i < 3; ++i) {
    if (!IsScaled(state_dtypes[i])) continue;
    p.target[i] = ScaleTarget(state_dtypes[i]);
    p.scale_slot[i] = slots[i];
    p.old_scale[i] = *slots[i];  // read before any scale is written
  }
  ChooseFused(s, p);
  return p;
}

struct alignas(64) Scratch {
  float g[kBlock];
  float w[kBlock];
  float m[kBlock];
  float v[kBlock];
};

// Pass 2 (or the only pass) over elements [begin, begin + n); n is a multiple
// of kt.pair.
void UpdateSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                int64_t begin, size_t n, Scratch& s) {
  const int adam_w = k.adam_w_mode ? 1 : 0;
  const int unit_bc2 = k.bias_correction2_sqrt == 1.0f ? 1 : 0;
  if (p.fused) {
    const FusedFn fused =
        kt.fused.fn[adam_w][unit_bc2][p.fused_grad][p.fused_weight][p.fused_moments];
    fused(k, p.grad + begin * p.grad_size, p.param + begin * p.param_size,
          p.master ? p.master + begin * p.master_size : nullptr,
          p.exp_avg + begin * p.exp_avg_size, p.exp_avg_sq + begin * p.exp_avg_sq_size,
          p.FusedScalesOf(), n);
    return;
  }
  const UpdateFn update = kt.update[adam_w][unit_bc2];
  for (size_t done = 0; done < n; done += kBlock) {
    const size_t c = std::min(kBlock, n - done);
    const int64_t e = begin + static_cast<int64_t>(done);
    char* master = p.master ? p.master + e * p.master_size : nullptr;
    char* param = p.param + e * p.param_size;
    char* exp_avg = p.exp_avg + e * p.exp_avg_size;
    char* exp_avg_sq = p.exp_avg_sq + e * p.exp_avg_sq_size;
    const float* g = p.decode_grad(p.grad + e * p.grad_size, nullptr, c, 1.0f, s.g);
    float* w = p.decode_w(p.w_from_master ? master : param, master, c, p.old_scale[0],
                          s.w);
    float* m = p.decode_m(exp_avg, nullptr, c, p.old_scale[1], s.m);
    float* v = p.decode_v(exp_avg_sq, nullptr, c, p.old_scale[2], s.v);
    update(k, g, w, m, v, c);
    // The param is rounded from the updated w before the master is re-stored.
    if (p.encode_param) p.encode_param(w, c, 1.0f, param, master);
    if (p.encode_master) p.encode_master(w, c, p.new_scale[0], master, nullptr);
    if (p.encode_m) p.encode_m(m, c, p.new_scale[1], exp_avg, nullptr);
    if (p.encode_v) p.encode_v(v, c, p.new_scale[2], exp_avg_sq, nullptr);
  }
}

// Pass 1 works in blocks of this many elements (whole granules, so whole
// pairs), each small enough to stay in L1 between the bound and the
// measurement.
constexpr size_t kBoundBlock = 8 * kGranule;
static_assert(kBoundBlock % kBlock == 0, "bound blocks are whole decode blocks");

// An fp16 magnitude (bits <= 0x7FFF) as fp32, exactly.
float HalfMagnitude(uint32_t bits) {
  const int exponent = static_cast<int>(bits >> 10);
  const float mantissa = static_cast<float>(bits & 0x3FFu);
  if (exponent == 31) return mantissa != 0 ? NAN : INFINITY;
  if (exponent == 0) return std::ldexp(mantissa, -24);
  return std::ldexp(mantissa + 1024.0f, exponent - 25);
}

// Largest decoded magnitude of a stream over [begin, begin + n), rounded as
// every decoder rounds: RN(value * scale), the scale 1 for unscaled codecs.
// Not for kCodecRemainder.
float StreamMax(const KernelTable& kt, Codec codec, const char* buffer, int64_t begin,
                size_t n, float scale) {
  const auto bits16 = [&] {
    return kt.abs_max_bits16(reinterpret_cast<const uint16_t*>(buffer) + begin, n);
  };
  float value;
  switch (codec) {
    case kCodecF32:
      return FloatFromBits(
          kt.abs_max_bits(reinterpret_cast<const float*>(buffer) + begin, n));
    case kCodecBF16:
      return FloatFromBits(bits16() << 16);
    case kCodecF8Scaled: {
      const uint32_t code =
          kt.abs_max_code8(reinterpret_cast<const uint8_t*>(buffer) + begin, n);
      value = code == 0x7Fu ? NAN : HalfMagnitude(code << 7) * kE4M3OverF16;
      break;
    }
    default:  // kCodecF16, kCodecF16Scaled
      value = HalfMagnitude(bits16());
      break;
  }
  return value * std::fabs(scale);
}

// Whether the new moments of block [begin, begin + n) may exceed the
// magnitudes in max_bits: NewMomentBounds on the largest input magnitudes,
// found by one masked integer max per stream -- a small fraction of pass 1's
// decoding and update, which a block that cannot raise the maxima skips.
// Exact: blocks are only skipped, never estimated, so max_bits ends as before.
bool BlockMayRaiseMax(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                      int64_t begin, size_t n, const uint32_t* max_bits) {
  if (p.target[0] != 0) return true;  // a scaled master's new w: no cheap bound
  float w = 0.0f;
  if (!k.adam_w_mode) {  // w enters the gradient
    if (p.w_codec == kCodecRemainder) return true;  // no cheap bound
    w = StreamMax(kt, p.w_codec, p.w_from_master ? p.master : p.param, begin, n, 1.0f);
  }
  const float g = StreamMax(kt, p.grad_codec, p.grad, begin, n, 1.0f);
  // An unscaled moment is not measured: its bound is never looked at.
  const bool m_scaled = p.target[1] != 0;
  const bool v_scaled = p.target[2] != 0;
  const float m =
      m_scaled ? StreamMax(kt, p.m_codec, p.exp_avg, begin, n, p.old_scale[1]) : 0.0f;
  const float v =
      v_scaled ? StreamMax(kt, p.v_codec, p.exp_avg_sq, begin, n, p.old_scale[2]) : 0.0f;
  const MomentBounds bound = NewMomentBounds(k, g, w, m, v);
  return (m_scaled && AbsBitsOf(bound.m) > max_bits[1]) ||
         (v_scaled && AbsBitsOf(bound.v) > max_bits[2]);
}

// Folds the magnitudes of the first `valid` new values of [begin, begin + n)
// into max_bits (w, m, v).
void MeasureBlock(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                  int64_t begin, size_t n, size_t valid, Scratch& s,
                  uint32_t* max_bits) {
  if (p.fused && valid == n) {
    // Fused layouts never have a scaled master: only m and v are measured.
    const FusedMeasureFn measure =
        kt.fused.measure[k.adam_w_mode ? 1 : 0][p.fused_grad][p.fused_weight]
                        [p.fused_moments];
    measure(k, p.grad + begin * p.grad_size, p.param + begin * p.param_size,
            p.master ? p.master + begin * p.master_size : nullptr,
            p.exp_avg + begin * p.exp_avg_size, p.exp_avg_sq + begin * p.exp_avg_sq_size,
            p.FusedScalesOf(), n, max_bits);
    return;
  }
  const bool reduce_w = p.target[0] != 0;
  // In AdamW mode m and v do not depend on w: skip decoding it.
  const bool need_w = reduce_w || !k.adam_w_mode;
  const ReduceFn reduce = kt.reduce[k.adam_w_mode ? 1 : 0][reduce_w ? 1 : 0]
                                   [k.bias_correction2_sqrt == 1.0f ? 1 : 0];
  for (size_t done = 0; done < n && done < valid; done += kBlock) {
    const size_t c = std::min(kBlock, n - done);
    const int64_t e = begin + static_cast<int64_t>(done);
    char* master = p.master ? p.master + e * p.master_size : nullptr;
    const float* g = p.decode_grad(p.grad + e * p.grad_size, nullptr, c, 1.0f, s.g);
    const float* w =
        need_w ? p.decode_w(p.w_from_master ? master : p.param + e * p.param_size,
                            master, c, p.old_scale[0], s.w)
               : g;
    const float* m =
        p.decode_m(p.exp_avg + e * p.exp_avg_size, nullptr, c, p.old_scale[1], s.m);
    const float* v = p.decode_v(p.exp_avg_sq + e * p.exp_avg_sq_size, nullptr, c,
                                p.old_scale[2], s.v);
    reduce(k, g, w, m, v, std::min(c, valid - done), max_bits);
  }
}

// Pass 1 over [begin, begin + n): folds the magnitudes of the first `valid`
// new values into max_bits (w, m, v), skipping the blocks that cannot raise
// them.
void ReduceSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                int64_t begin, size_t n, size_t valid, Scratch& s,
                uint32_t* max_bits) {
  if (valid < n) {  // a staged tail, one pair long: its padding is not measured
    MeasureBlock(kt, p, k, begin, n, valid, s, max_bits);
    return;
  }
  for (size_t done = 0; done < n; done += kBoundBlock) {
    const size_t c = std::min(kBoundBlock, n - done);
    const int64_t e = begin + static_cast<int64_t>(done);
    if (BlockMayRaiseMax(kt, p, k, e, c, max_bits)) {
      MeasureBlock(kt, p, k, e, c, c, s, max_bits);
    }
  }
}

// The last `t` < kt.pair elements of a tensor, staged through zero-padded
// copies one pair long so every kernel sees whole pairs of vectors.
void StagedTail(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
                int64_t begin, size_t t, bool update, Scratch& s,
                uint32_t* max_bits) {
  alignas(64) char buffers[5][kGranule * sizeof(float)];
  // Copies t elements into a buffer; the padding is zero so that nothing
  // depends on stale stack bytes.
  const auto stage = [&](const char* from, int size, char* buffer) {
    memcpy(buffer, from + begin * size, t * size);
    memset(buffer + t * size, 0, (kt.pair - t) * size);
    return buffer;
  };
  TensorPlan q = p;
  char** writable[4] = {&q.param, &q.master, &q.exp_avg, &q.exp_avg_sq};
  const int sizes[4] = {p.param_size, p.master_size, p.exp_avg_size,
                        p.exp_avg_sq_size};
  for (int b = 0; b < 4; ++b) {
    if (*writable[b] != nullptr) *writable[b] = stage(*writable[b], sizes[b], buffers[b]);
  }
  q.grad = stage(p.grad, p.grad_size, buffers[4]);
  if (!update) {
    ReduceSpan(kt, q, k, 0, kt.pair, t, s, max_bits);
    return;
  }
  UpdateSpan(kt, q, k, 0, kt.pair, s);
  char* const originals[4] = {p.param, p.master, p.exp_avg, p.exp_avg_sq};
  for (int b = 0; b < 4; ++b) {
    if (originals[b] != nullptr) {
      memcpy(originals[b] + begin * sizes[b], buffers[b], t * sizes[b]);
    }
  }
}

// Either pass over [begin, end): whole pairs directly, the rest staged.
void RunSpan(const KernelTable& kt, const TensorPlan& p, const StepConstants& k,
             int64_t begin, int64_t end, bool update, Scratch& s,
             uint32_t* max_bits) {
  const size_t n = static_cast<size_t>(end - begin);
  const size_t whole = n / kt.pair * kt.pair;
  if (whole > 0) {
    if (update) {
      UpdateSpan(kt, p, k, begin, whole, s);
    } else {
      ReduceSpan(kt, p, k, begin, whole, whole, s, max_bits);
    }
  }
  if (whole < n) {
    StagedTail(kt, p, k, begin + static_cast<int64_t>(whole), n - whole, update, s,
               max_bits);
  }
}

enum class Pass : uint8_t {
  kUpdate,  // the only pass, or pass 2 of a large scaled tensor
  kReduce,  // pass 1 of a large scaled tensor
  kBoth,    // both passes of a small scaled tensor
};

struct WorkItem {
  int64_t tensor;
  int64_t begin;
  int64_t end;
  Pass pass;
};

void AppendItems(int64_t tensor, int64_t numel, int64_t item, Pass pass,
                 std::vector<WorkItem>& items) {
  const int64_t count = NumItems(numel, item);
  for (int64_t c = 0; c < count; ++c) {
    const ItemRange r = ItemAt(numel, item, c);
    items.push_back({tensor, r.begin, r.end, pass});
  }
}

int ResolveThreads(int num_threads) {
  const int threads = num_threads <= 0 ? HardwareThreads() : num_threads;
  return std::clamp(threads, 1, ThreadPool::kMaxThreads);
}

// Threads worth waking for `work` elements spread over `items` work items.
int ThreadsFor(int threads, int64_t work, size_t items) {
  const int64_t useful = std::max<int64_t>(1, work / kMinWorkPerThread);
  return static_cast<int>(
      std::min<int64_t>({threads, useful, static_cast<int64_t>(std::max<size_t>(items, 1))}));
}

// Runs `run(item)` for every item on up to `threads` threads (dynamic
// scheduling; the split never affects results).
template <class Fn>
void RunItems(size_t count, int threads, const Fn& run) {
  if (count == 0) return;
  std::atomic<size_t> next{0};
  const std::function<void(int)> body = [&](int) {
    Scratch scratch;
    for (;;) {
      const size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= count) break;
      run(i, scratch);
    }
  };
  ThreadPool::Global().Run(threads, body);
}

// Runs `run(range, scratch)` over the work items of one buffer of `numel`
// elements (Convert, MeasureScale).
template <class Fn>
void RunBufferItems(int64_t numel, int num_threads, const Fn& run) {
  const int threads = ResolveThreads(num_threads);
  const int64_t item = ItemElements(numel, threads);
  const size_t items = static_cast<size_t>(NumItems(numel, item));
  RunItems(items, ThreadsFor(threads, numel, items), [&](size_t index, Scratch& s) {
    run(ItemAt(numel, item, static_cast<int64_t>(index)), s);
  });
}

void AtomicMax(std::atomic<uint32_t>& target, uint32_t value) {
  uint32_t current = target.load(std::memory_order_relaxed);
  while (value > current &&
         !target.compare_exchange_weak(current, value, std::memory_order_relaxed)) {
  }
}

void Step(const KernelTable& kt, const TensorSlot* slots, int64_t count,
          const StepConstants& k, int num_threads) {
  std::vector<TensorPlan> plans;
  plans.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) plans.push_back(MakePlan(kt, slots[i]));

  // Phase A: every single-pass tensor, every small scaled tensor (both
  // passes), pass 1 of large scaled tensors. Phase B: their pass 2. Each
  // phase sizes its items for its own elements.
  const auto two_pass = [](const TensorPlan& p) {
    return p.Scaled() && p.numel > kSmallScaledMax;
  };
  int64_t elements_a = 0, elements_b = 0;
  for (const TensorPlan& p : plans) {
    elements_a += p.numel;
    if (two_pass(p)) elements_b += p.numel;
  }
  const int threads = ResolveThreads(num_threads);
  const int64_t item_a = ItemElements(elements_a, threads);
  const int64_t item_b = ItemElements(elements_b, threads);
  std::vector<WorkItem> phase_a, phase_b;
  int64_t work_a = 0;  // for ThreadsFor: a small scaled tensor's two passes count twice
  for (int64_t i = 0; i < count; ++i) {
    const TensorPlan& p = plans[static_cast<size_t>(i)];
    if (p.numel == 0) continue;
    if (two_pass(p)) {
      AppendItems(i, p.numel, item_a, Pass::kReduce, phase_a);
      AppendItems(i, p.numel, item_b, Pass::kUpdate, phase_b);
      work_a += p.numel;
    } else if (p.Scaled()) {
      phase_a.push_back({i, 0, p.numel, Pass::kBoth});
      work_a += 2 * p.numel;
    } else {
      AppendItems(i, p.numel, item_a, Pass::kUpdate, phase_a);
      work_a += p.numel;
    }
  }
  // Largest magnitudes of the new w / m / v of each tensor, as fp32 bits.
  std::vector<std::atomic<uint32_t>> max_bits(phase_b.empty() ? 0 : 3 * plans.size());
  for (auto& b : max_bits) b.store(0, std::memory_order_relaxed);

  RunItems(phase_a.size(), ThreadsFor(threads, work_a, phase_a.size()),
           [&](size_t index, Scratch& s) {
             const WorkItem& item = phase_a[index];
             TensorPlan& p = plans[static_cast<size_t>(item.tensor)];
             uint32_t bits[3] = {0, 0, 0};
             switch (item.pass) {
               case Pass::kUpdate:
                 RunSpan(kt, p, k, item.begin, item.end, true, s, bits);
                 break;
               case Pass::kReduce:
                 // From the tensor's maxima so far: pass 1 skips the blocks
                 // that cannot raise them.
                 for (int j = 0; j < 3; ++j) {
                   bits[j] = max_bits[3 * static_cast<size_t>(item.tensor) + j].load(
                       std::memory_order_relaxed);
                 }
                 RunSpan(kt, p, k, item.begin, item.end, false, s, bits);
                 for (int j = 0; j < 3; ++j) {
                   AtomicMax(max_bits[3 * static_cast<size_t>(item.tensor) + j], bits[j]);
                 }
                 break;
               case Pass::kBoth:
                 // This item owns the whole tensor, so it may set its scales.
                 RunSpan(kt, p, k, item.begin, item.end, false, s, bits);
                 for (int j = 0; j < 3; ++j) {
                   if (p.target[j] != 0) {
                     p.new_scale[j] = ScaleFromAbsMaxBits(bits[j], p.target[j]);
                   }
                 }
                 RunSpan(kt, p, k, item.begin, item.end, true, s, bits);
                 break;
             }
           });

  if (!phase_b.empty()) {
    for (const WorkItem& item : phase_b) {
      if (item.begin != 0) continue;  // once per tensor
      TensorPlan& p = plans[static_cast<size_t>(item.tensor)];
      for (int j = 0; j < 3; ++j) {
        if (p.target[j] == 0) continue;
        const uint32_t bits =
            max_bits[3 * static_cast<size_t>(item.tensor) + j].load(std::memory_order_relaxed);
        p.new_scale[j] = ScaleFromAbsMaxBits(bits, p.target[j]);
      }
    }
    RunItems(phase_b.size(), ThreadsFor(threads, elements_b, phase_b.size()),
             [&](size_t index, Scratch& s) {
               const WorkItem& item = phase_b[index];
               uint32_t unused[3] = {0, 0, 0};
               RunSpan(kt, plans[static_cast<size_t>(item.tensor)], k, item.begin,
                       item.end, true, s, unused);
             });
  }

  // Empty tensors keep new_scale == 1, as S2.3 asks.
  for (const TensorPlan& p : plans) {
    for (int j = 0; j < 3; ++j) {
      if (p.scale_slot[j] != nullptr) *p.scale_slot[j] = p.new_scale[j];
    }
  }
}

// Codec for one side of a Convert. A scale of exactly 1 makes fp16 a plain
// cast (the same bits without a multiply / divide).
Codec ConvertCodec(DType dtype, float scale) {
  if (dtype == DType::kFloat16 && scale == 1.0f) return kCodecF16;
  return CodecOf(dtype, true);
}

void ConvertSpan(const char* src, int src_size, DecodeFn decode,
                 char* dst, int dst_size, EncodeFn encode, bool dst_f32, float scale,
                 size_t n, Scratch& s) {
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

int64_t ItemElements(int64_t work, int threads) {
  const int64_t chunks = work / (kChunk * kItemsPerThread * std::max(threads, 1));
  return kChunk * std::clamp<int64_t>(chunks, 1, kMaxChunksPerItem);
}

int64_t NumItems(int64_t numel, int64_t item) {
  // numel / item rounded up, without forming numel + item - 1.
  return numel <= 0 ? 0 : numel / item + (numel % item != 0 ? 1 : 0);
}

ItemRange ItemAt(int64_t numel, int64_t item, int64_t index) {
  const int64_t begin = index * item;
  // Compared as a distance so begin + item is never formed past numel.
  return {begin, numel - begin < item ? numel : begin + item};
}

const KernelTable& ActiveKernels() {
  const KernelTable* pinned = g_pinned.load(std::memory_order_acquire);
  if (pinned != nullptr) return *pinned;
  return *HWY_DYNAMIC_DISPATCH(GetKernelTable)();
}

std::vector<int64_t> CompiledTargets() {
  const auto& table = HWY_DISPATCH_TABLE(GetKernelTable);
  const size_t entries = sizeof(table) / sizeof(table[0]);
  const int64_t supported = hwy::SupportedTargets();
  std::vector<int64_t> targets;
  // With several targets, entry 0 is Highway's first-call trampoline.
  for (size_t i = entries > 1 ? 1 : 0; i < entries; ++i) {
    if (table[i] == nullptr) continue;
    const int64_t target = table[i]()->target;
    if ((target & supported) == 0) continue;
    if (std::find(targets.begin(), targets.end(), target) == targets.end()) {
      targets.push_back(target);
    }
  }
  std::sort(targets.begin(), targets.end());  // lower bit = better target
  return targets;
}

bool SetTargetForTest(int64_t target) {
  if (target == 0) {
    g_pinned.store(nullptr, std::memory_order_release);
    return true;
  }
  const auto& table = HWY_DISPATCH_TABLE(GetKernelTable);
  const size_t entries = sizeof(table) / sizeof(table[0]);
  if ((target & hwy::SupportedTargets()) == 0) return false;
  for (size_t i = entries > 1 ? 1 : 0; i < entries; ++i) {
    if (table[i] == nullptr) continue;
    const KernelTable* kernels = table[i]();
    if (kernels->target == target) {
      g_pinned.store(kernels, std::memory_order_release);
      return true;
    }
  }
  return false;
}

}  // namespace internal

Status AdamStep(const TensorSlot* slots, int64_t count, const StepParams& params,
                int num_threads, Error* error) {
  const internal::ScopedIeeeFloatMode ieee;  // validation compares floats too
  if (!internal::ValidateStep(slots, count, params, error)) {
    return Status::kInvalidArgument;
  }
  if (count == 0) return Status::kOk;
  const StepConstants k = MakeStepConstants(params);
  internal::Step(internal::ActiveKernels(), slots, count, k, num_threads);
  return Status::kOk;
}

Status CheckStepSlots(const TensorSlot* slots, int64_t count,
                      bool scales_in_device_memory, Error* error) {
  const internal::ScopedIeeeFloatMode ieee;  // scale values are compared
  return internal::ValidateSlots(slots, count, error,
                                 scales_in_device_memory ? internal::ScaleValues::kSkip
                                                         : internal::ScaleValues::kCheck)
             ? Status::kOk
             : Status::kInvalidArgument;
}

Status Convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
               int64_t numel, float scale, int num_threads, Error* error) {
  using namespace internal;  // NOLINT(build/namespaces): file-local brevity
  const ScopedIeeeFloatMode ieee;
  if (!ValidateConvert(src, src_dtype, dst, dst_dtype, numel, scale, error)) {
    return Status::kInvalidArgument;
  }
  if (numel == 0) return Status::kOk;
  const int src_size = ItemSize(src_dtype);
  const int dst_size = ItemSize(dst_dtype);
  if (src_dtype == DType::kFloat32 && dst_dtype == DType::kFloat32) {
    if (src != dst) memcpy(dst, src, static_cast<size_t>(numel) * src_size);
    return Status::kOk;
  }
  // Every other pair goes through fp32 like the reference, so bf16 -> bf16
  // also quiets a signalling NaN.
  const KernelTable& kt = ActiveKernels();
  const DecodeFn decode = kt.decode[ConvertCodec(src_dtype, scale)];
  const EncodeFn encode = kt.encode[ConvertCodec(dst_dtype, scale)];
  const bool dst_f32 = dst_dtype == DType::kFloat32;
  const char* from = static_cast<const char*>(src);
  char* to = static_cast<char*>(dst);
  RunBufferItems(numel, num_threads, [&](const ItemRange& r, Scratch& s) {
    const int64_t begin = r.begin;
    const int64_t end = r.end;
    const size_t n = static_cast<size_t>(end - begin);
    const size_t whole = n / kt.pair * kt.pair;
    ConvertSpan(from + begin * src_size, src_size, decode,
                to + begin * dst_size, dst_size, encode, dst_f32, scale,
                whole, s);
    if (whole < n) {
      const size_t t = n - whole;
      alignas(64) char in[kGranule * sizeof(float)] = {};
      alignas(64) char out[kGranule * sizeof(float)];
      memcpy(in, from + (begin + whole) * src_size, t * src_size);
      ConvertSpan(in, src_size, decode, out, dst_size, encode, dst_f32,
                  scale, kt.pair, s);
      memcpy(to + (begin + whole) * dst_size, out, t * dst_size);
    }
  });
  return Status::kOk;
}

float MeasureScale(const float* u, int64_t numel, DType dtype, int num_threads) {
  using namespace internal;  // NOLINT(build/namespaces): file-local brevity
  const ScopedIeeeFloatMode ieee;
  if (!IsScaled(dtype) || u == nullptr || numel <= 0) return 1.0f;
  const KernelTable& kt = ActiveKernels();
  std::atomic<uint32_t> best{0};
  RunBufferItems(numel, num_threads, [&](const ItemRange& r, Scratch&) {
    AtomicMax(best, kt.abs_max_bits(u + r.begin, static_cast<size_t>(r.end - r.begin)));
  });
  return ScaleFromAbsMaxBits(best.load(), ScaleTarget(dtype));
}

const char* ChosenTarget() { return hwy::TargetName(internal::ActiveKernels().target); }

std::string SupportedTargets() {
  std::string names;
  for (int64_t target : internal::CompiledTargets()) {
    if (!names.empty()) names += ' ';
    names += hwy::TargetName(target);
  }
  return names;
}

int DefaultThreads() { return internal::HardwareThreads(); }

}  // namespace shardadam

#endif  // HWY_ONCE
