// libFuzzer target for the core's entry points (AdamStep, Convert,
// MeasureScale). The input is decoded into a call: a few tensor slots with
// arbitrary dtype tags (invalid ones included), small element counts, buffers
// and scale slots the harness allocates separately (so ASan sees any access
// past one), some of them null or aliasing each other, and hyper-parameters
// that may be NaN, infinite or negative. Every call must either be rejected
// with every byte of every buffer unchanged, or succeed and agree bit for bit
// with the scalar reference (any NaN matching any NaN). Conversions must also
// round-trip: dtype -> fp32 -> dtype gives back the same values.
#include <fuzzer/FuzzedDataProvider.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "reference.h"
#include "shardadam/adam.h"
#include "validate.h"

namespace shardadam {
namespace {

constexpr int kMaxSlots = 3;
// Small tensors keep each run fast; 300 is above every target's vector pair,
// so the whole-pair body and the staged tail are both exercised.
constexpr int kMaxNumel = 300;
// Now and then a large one: work items are whole chunks of 16384 elements, and
// a second thread wakes from 65536 elements of work (work_items.cc), so these
// split into several items, a shared gradient or three slots on two threads.
constexpr int64_t kMaxLargeNumel = 70000;

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "adam_fuzz: %s\n", what);
  std::abort();
}

bool IsNaNAt(const uint8_t* p, DType dtype) {
  uint32_t bits = 0;
  std::memcpy(&bits, p, static_cast<size_t>(FormatOf(dtype).item_bits / 8));
  switch (dtype) {
    case DType::kFloat32:
      return (bits & 0x7FFFFFFFu) > 0x7F800000u;
    case DType::kFloat16:
      return (bits & 0x7FFFu) > 0x7C00u;
    case DType::kBFloat16:
      return (bits & 0x7FFFu) > 0x7F80u;
    case DType::kFloat8E4M3:
    case DType::kFloat8E4M3Block:
      return (bits & 0x7Fu) == 0x7Fu;
    case DType::kUFloat8E4M4Block:
      return bits == 0xFFu;
    default:  // 4-bit codes compare as bytes (SameValues)
      return false;
  }
}

// Equal bytes, or both NaN element by element when the dtype is known.
bool SameValues(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b,
                DType dtype) {
  if (a.size() != b.size()) return false;
  const int size = FormatOf(dtype).item_bits / 8;
  // Blocks that are not whole elements (aliased scale slots) and 4-bit codes
  // (one NaN code each) compare as bytes.
  if (size == 0 || a.size() % static_cast<size_t>(size) != 0) return a == b;
  for (size_t i = 0; i < a.size(); i += static_cast<size_t>(size)) {
    if (std::memcmp(&a[i], &b[i], static_cast<size_t>(size)) == 0) continue;
    if (!IsNaNAt(&a[i], dtype) || !IsNaNAt(&b[i], dtype)) return false;
  }
  return true;
}

// Dtype tags: mostly one a buffer of this role accepts, sometimes any tag,
// including values outside the enum.
DType PickDType(FuzzedDataProvider& in, std::initializer_list<DType> valid) {
  const uint8_t b = in.ConsumeIntegral<uint8_t>();
  if (b < 192) return valid.begin()[b % valid.size()];
  static const int32_t kAny[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, -1, 255, INT32_MIN};
  return static_cast<DType>(kAny[b % (sizeof(kAny) / sizeof(kAny[0]))]);
}

double PickDouble(FuzzedDataProvider& in, double typical) {
  static const double kTable[] = {0.0,  1e-3, 0.9, 0.999, 1e-8, 0.5, 1.0, -1.0,
                                  -0.0, 1e30, 1e-300, 0.9999999,
                                  std::numeric_limits<double>::quiet_NaN(),
                                  std::numeric_limits<double>::infinity()};
  const uint8_t b = in.ConsumeIntegral<uint8_t>();
  if (b < 128) return typical;
  if (b < 240) return kTable[b % (sizeof(kTable) / sizeof(kTable[0]))];
  return in.ConsumeFloatingPoint<double>();
}

float PickScale(FuzzedDataProvider& in) {
  static const float kTable[] = {1.0f,   0.5f,  2.0f,     1e-3f,  0.0f,   -1.0f,
                                 1e-30f, FLT_MIN, 1e-40f, 3e38f,
                                 std::numeric_limits<float>::quiet_NaN(),
                                 std::numeric_limits<float>::infinity()};
  const uint8_t b = in.ConsumeIntegral<uint8_t>();
  if (b < 240) return kTable[b % (sizeof(kTable) / sizeof(kTable[0]))];
  return in.ConsumeFloatingPoint<float>();
}

// Buffers as separate heap blocks, each tagged with the dtype its bytes hold
// for comparisons. A pointer is (block, byte offset); block -1 is null.
struct Ptr {
  int block = -1;
  size_t offset = 0;
};

struct Arena {
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<DType> dtypes;

  Ptr Add(size_t bytes, DType dtype, FuzzedDataProvider& in) {
    std::vector<uint8_t> block(bytes);
    // Contents from the input while it lasts, then a fixed pattern of small
    // positive and negative values.
    const std::vector<uint8_t> given = in.ConsumeBytes<uint8_t>(bytes);
    if (!given.empty()) std::memcpy(block.data(), given.data(), given.size());
    for (size_t i = given.size(); i < bytes; ++i) {
      block[i] = static_cast<uint8_t>((i % 4 == 3) ? 0x3C + (i & 0x80) : i * 37);
    }
    blocks.push_back(std::move(block));
    dtypes.push_back(dtype);
    return {static_cast<int>(blocks.size()) - 1, 0};
  }

  void* Address(Ptr p) {
    if (p.block < 0) return nullptr;
    return blocks[static_cast<size_t>(p.block)].data() + p.offset;
  }
};

// Offsets are whole elements of the buffer's dtype (a byte for 4-bit codes):
// aligned to their element, as real tensors are, but not to 4 or 16 bytes.
size_t ElementBytes(DType dtype) {
  const int bits = FormatOf(dtype).item_bits;
  return bits >= 8 ? static_cast<size_t>(bits / 8) : 1;
}

// A pointer for one buffer: its own block (at an offset of up to 15 bytes), null,
// or into a block already made.
Ptr PickPtr(FuzzedDataProvider& in, Arena& arena, size_t bytes, DType dtype) {
  const size_t element = ElementBytes(dtype);
  const uint8_t b = in.ConsumeIntegral<uint8_t>();
  if (b < 216 || arena.blocks.empty()) {
    const size_t lead = element * in.ConsumeIntegralInRange<size_t>(0, 15 / element);
    Ptr p = arena.Add(lead + bytes, dtype, in);
    p.offset = lead;
    return p;
  }
  if (b < 228) return {};
  // The alias always has room for `bytes`: a call the core may accept (the
  // block could belong to an empty tensor or an unused scale) must stay in
  // bounds, so that ASan reports only real overruns.
  Ptr p;
  p.block = static_cast<int>(in.ConsumeIntegralInRange<size_t>(0, arena.blocks.size() - 1));
  const size_t size = arena.blocks[static_cast<size_t>(p.block)].size();
  if (size < bytes) return arena.Add(bytes, dtype, in);
  const size_t slack = size - bytes;
  p.offset = element * in.ConsumeIntegralInRange<size_t>(0, slack / element);
  return p;
}

struct SlotSpec {
  TensorSlot slot;  // dtypes and numel; pointers rebuilt from the Ptrs
  Ptr data[5];      // param, grad, exp_avg, exp_avg_sq, master_param
  Ptr scale[3];     // exp_avg_scale, exp_avg_sq_scale, master_scale
};

TensorSlot Bind(const SlotSpec& s, Arena& arena) {
  TensorSlot t = s.slot;
  t.param = arena.Address(s.data[0]);
  t.grad = arena.Address(s.data[1]);
  t.exp_avg = arena.Address(s.data[2]);
  t.exp_avg_sq = arena.Address(s.data[3]);
  t.master_param = arena.Address(s.data[4]);
  t.exp_avg_scale = static_cast<float*>(arena.Address(s.scale[0]));
  t.exp_avg_sq_scale = static_cast<float*>(arena.Address(s.scale[1]));
  t.master_scale = static_cast<float*>(arena.Address(s.scale[2]));
  return t;
}

// -1 and 0 mean all hardware threads (adam.h).
int PickThreads(FuzzedDataProvider& in) { return in.ConsumeIntegralInRange(-1, 4); }

int64_t PickNumel(FuzzedDataProvider& in) {
  if (in.ConsumeIntegralInRange(0, 15) == 0) {
    return in.ConsumeIntegralInRange<int64_t>(kMaxNumel, kMaxLargeNumel);
  }
  return in.ConsumeIntegralInRange<int64_t>(-1, kMaxNumel);
}

// Pins the kernels to one of the targets this CPU runs, picked by the input.
void PickTarget(FuzzedDataProvider& in) {
  static const std::vector<int64_t> targets = internal::CompiledTargets();
  const size_t i = in.ConsumeIntegralInRange<size_t>(0, targets.size());
  internal::SetTargetForTest(i < targets.size() ? targets[i] : 0);
}

// The decoded call, for triaging a failure.
void Describe(const std::vector<SlotSpec>& specs, const StepParams& p) {
  std::fprintf(stderr,
               "lr %g beta1 %g beta2 %g eps %g wd %g adam_w %d bias_correction %d "
               "step %lld\n",
               p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.adam_w_mode,
               p.bias_correction, static_cast<long long>(p.step));
  for (size_t i = 0; i < specs.size(); ++i) {
    const SlotSpec& s = specs[i];
    const TensorSlot& t = s.slot;
    std::fprintf(stderr, "slot %zu numel %lld dtypes p%d g%d m%d v%d w%d\n", i,
                 static_cast<long long>(t.numel), static_cast<int>(t.param_dtype),
                 static_cast<int>(t.grad_dtype), static_cast<int>(t.exp_avg_dtype),
                 static_cast<int>(t.exp_avg_sq_dtype), static_cast<int>(t.master_dtype));
    for (int b = 0; b < 5; ++b) {
      std::fprintf(stderr, "  data %d: block %d + %zu\n", b, s.data[b].block,
                   s.data[b].offset);
    }
    for (int b = 0; b < 3; ++b) {
      std::fprintf(stderr, "  scale %d: block %d + %zu\n", b, s.scale[b].block,
                   s.scale[b].offset);
    }
  }
}

void FuzzStep(FuzzedDataProvider& in) {
  StepParams params;
  params.lr = PickDouble(in, 1e-3);
  params.beta1 = PickDouble(in, 0.9);
  params.beta2 = PickDouble(in, 0.999);
  params.eps = PickDouble(in, 1e-8);
  params.weight_decay = PickDouble(in, 0.01);
  params.adam_w_mode = in.ConsumeBool();
  params.bias_correction = in.ConsumeBool();
  static const int64_t kSteps[] = {1, 2, 10, 0, -1, 1000000, INT64_MAX};
  params.step = kSteps[in.ConsumeIntegralInRange<size_t>(0, 6)];
  const int threads = PickThreads(in);

  Arena arena;
  std::vector<SlotSpec> specs(static_cast<size_t>(in.ConsumeIntegralInRange(0, kMaxSlots)));
  for (size_t i = 0; i < specs.size(); ++i) {
    SlotSpec& s = specs[i];
    TensorSlot& t = s.slot;
    // Gradients alone may be shared between tensors; make that case likely.
    const bool share_grad = i > 0 && in.ConsumeIntegralInRange(0, 3) == 0;
    t.numel = share_grad ? specs[0].slot.numel
                         : PickNumel(in);
    t.param_dtype = PickDType(in, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
    t.grad_dtype = share_grad
                       ? specs[0].slot.grad_dtype
                       : PickDType(in, {DType::kFloat32, DType::kBFloat16, DType::kFloat16});
    t.exp_avg_dtype = PickDType(in, {DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                                     DType::kFloat8E4M3, DType::kFloat8E4M3Block,
                                     DType::kFloat4E2M1Block});
    t.exp_avg_sq_dtype =
        PickDType(in, {DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                       DType::kFloat8E4M3, DType::kFloat8E4M3Block, DType::kUFloat8E4M4Block,
                       DType::kFloat4E2M1Block, DType::kUFloat4E3M1Block});
    // Per-block geometry (S2.9): mostly valid, sometimes not.
    static const int32_t kBlocks[] = {128, 256, 4096, 128, 0, 96, 8192};
    static const int64_t kFirsts[] = {0, 100, 128, 1000, 255, -1};
    t.scale_block = kBlocks[in.ConsumeIntegralInRange<size_t>(0, 6)];
    t.first_index = kFirsts[in.ConsumeIntegralInRange<size_t>(0, 5)];
    t.master_dtype = PickDType(in, {DType::kNone, DType::kFloat32, DType::kFloat16,
                                    DType::kInt16Remainder});
    // Stochastic rounding (S2.13, S2.14): mostly nearest or stochastic, sometimes
    // not a rounding; first indices near 2^32 cross it inside a vector.
    static const int32_t kRoundings[] = {0, 1, 1, 2};
    const auto rounding = [&in] {
      return static_cast<Rounding>(kRoundings[in.ConsumeIntegralInRange<size_t>(0, 3)]);
    };
    t.exp_avg_rounding = rounding();
    t.param_rounding = rounding();
    t.exp_avg_sq_rounding = rounding();
    t.rounding_key = in.ConsumeIntegral<uint32_t>();
    if (in.ConsumeIntegralInRange(0, 7) == 0) t.first_index += (int64_t{1} << 32) - 128;
    const DType dtypes[5] = {t.param_dtype, t.grad_dtype, t.exp_avg_dtype,
                             t.exp_avg_sq_dtype, t.master_dtype};
    const size_t n = t.numel > 0 ? static_cast<size_t>(t.numel) : 0;
    for (int b = 0; b < 5; ++b) {
      if (b == 1 && share_grad) {
        s.data[b] = specs[0].data[1];
        continue;
      }
      s.data[b] = PickPtr(in, arena, static_cast<size_t>(BufferBytes(dtypes[b], n)),
                          dtypes[b]);
    }
    const DType states[3] = {t.exp_avg_dtype, t.exp_avg_sq_dtype, t.master_dtype};
    for (int j = 0; j < 3; ++j) {
      Ptr& scale = s.scale[j];
      // One scale, or as many as a per-block state's valid geometry needs (the
      // caller's side of the contract: the core cannot check an array's length).
      int64_t count = 1;
      if (IsBlockScaled(states[j]) && IsValidScaleBlock(t.scale_block) && t.first_index >= 0) {
        count = std::max<int64_t>(1, ScaleCount(states[j], t.first_index, t.numel,
                                                t.scale_block));
      }
      const size_t scale_bytes = sizeof(float) * static_cast<size_t>(count);
      const uint8_t b = in.ConsumeIntegral<uint8_t>();
      if (b < 200 || arena.blocks.empty()) {
        scale = arena.Add(0, DType::kFloat32, in);
        arena.blocks.back().resize(scale_bytes);
        for (int64_t k = 0; k < count; ++k) {
          const float value = PickScale(in);
          std::memcpy(arena.blocks.back().data() + k * sizeof(float), &value, sizeof(value));
        }
      } else if (b < 215) {
        scale = {};
      } else {
        // Into another block: rejected unless that block is unused.
        scale.block = static_cast<int>(
            in.ConsumeIntegralInRange<size_t>(0, arena.blocks.size() - 1));
        if (arena.blocks[static_cast<size_t>(scale.block)].size() < scale_bytes) scale = {};
      }
    }
  }
  PickTarget(in);

  const Arena before = arena;
  std::vector<TensorSlot> slots;
  for (const SlotSpec& s : specs) slots.push_back(Bind(s, arena));
  Error error;
  const Status status = AdamStep(slots.data(), static_cast<int64_t>(slots.size()),
                                 params, threads, &error);
  internal::SetTargetForTest(0);
  if (status == Status::kInvalidArgument) {
    if (error.message.empty()) Die("rejected without a message");
    if (arena.blocks != before.blocks) Die("a rejected AdamStep wrote to a buffer");
    return;
  }
  if (status != Status::kOk) Die("AdamStep returned an unknown status");

  // Accepted: the reference on the untouched copy must agree.
  Arena want = before;
  std::vector<TensorSlot> want_slots;
  for (const SlotSpec& s : specs) want_slots.push_back(Bind(s, want));
  reference::AdamStep(want_slots.data(), static_cast<int64_t>(want_slots.size()), params);
  // A bf16 param with an int16 remainder holds one fp32 master in two
  // blocks. NaN payloads are not part of the contract, and the split of two
  // NaNs can differ in both halves, so those pairs compare as masters.
  std::vector<bool> as_master(arena.blocks.size(), false);
  for (const SlotSpec& s : specs) {
    if (s.slot.master_dtype != DType::kInt16Remainder || s.slot.numel <= 0) continue;
    const size_t p = static_cast<size_t>(s.data[0].block);
    const size_t r = static_cast<size_t>(s.data[4].block);
    const size_t n = static_cast<size_t>(s.slot.numel);
    for (size_t i = 0; i < n; ++i) {
      uint16_t want_p, got_p;
      int16_t want_r, got_r;
      std::memcpy(&want_p, want.blocks[p].data() + s.data[0].offset + 2 * i, 2);
      std::memcpy(&got_p, arena.blocks[p].data() + s.data[0].offset + 2 * i, 2);
      std::memcpy(&want_r, want.blocks[r].data() + s.data[4].offset + 2 * i, 2);
      std::memcpy(&got_r, arena.blocks[r].data() + s.data[4].offset + 2 * i, 2);
      const float a = reference::MergeMaster(want_p, want_r);
      const float g = reference::MergeMaster(got_p, got_r);
      if (std::memcmp(&a, &g, sizeof(a)) != 0 && !(std::isnan(a) && std::isnan(g))) {
        Describe(specs, params);
        Die("AdamStep's fp32 master (bf16 param + remainder) disagrees with the reference");
      }
    }
    as_master[p] = as_master[r] = true;
  }
  // What each block holds in an accepted call: the dtype of the buffer that
  // uses it (a block may also be named by an empty tensor or by the scale slot
  // of an unscaled state, which nothing reads); blocks nothing uses compare as
  // plain bytes.
  std::vector<DType> holds(arena.blocks.size(), DType::kNone);
  for (const SlotSpec& s : specs) {
    const TensorSlot& t = s.slot;
    const DType data[5] = {t.param_dtype, t.grad_dtype, t.exp_avg_dtype,
                           t.exp_avg_sq_dtype, t.master_dtype};
    for (int b = 0; b < 5 && t.numel > 0; ++b) {
      if (data[b] != DType::kNone) holds[static_cast<size_t>(s.data[b].block)] = data[b];
    }
    const DType states[3] = {t.exp_avg_dtype, t.exp_avg_sq_dtype, t.master_dtype};
    for (int j = 0; j < 3; ++j) {
      // (an empty per-block state needs no scale slot)
      if (IsScaled(states[j]) && s.scale[j].block >= 0) {
        holds[static_cast<size_t>(s.scale[j].block)] = DType::kFloat32;
      }
    }
  }
  for (size_t b = 0; b < arena.blocks.size(); ++b) {
    if (as_master[b]) continue;
    if (!SameValues(want.blocks[b], arena.blocks[b], holds[b])) {
      std::fprintf(stderr, "block %zu (dtype %d) differs from the reference\n", b,
                   static_cast<int>(holds[b]));
      Describe(specs, params);
      const std::vector<uint8_t>* rows[3] = {&before.blocks[b], &want.blocks[b],
                                             &arena.blocks[b]};
      const char* names[3] = {"before", "want", "got"};
      for (int r = 0; r < 3; ++r) {
        std::fprintf(stderr, "%s:", names[r]);
        for (size_t i = 0; i < rows[r]->size() && i < 64; ++i) {
          std::fprintf(stderr, " %02x", (*rows[r])[i]);
        }
        std::fprintf(stderr, "\n");
      }
      for (size_t c = 0; c < arena.blocks.size(); ++c) {
        std::fprintf(stderr, "block %zu before:", c);
        for (size_t i = 0; i < before.blocks[c].size() && i < 16; ++i) {
          std::fprintf(stderr, " %02x", before.blocks[c][i]);
        }
        std::fprintf(stderr, "\n");
      }
      Die("AdamStep disagrees with the reference");
    }
  }
}

void FuzzConvert(FuzzedDataProvider& in) {
  const std::initializer_list<DType> casts = {DType::kFloat32, DType::kBFloat16,
                                              DType::kFloat16, DType::kFloat8E4M3};
  const DType src_dtype = PickDType(in, casts);
  const DType dst_dtype = PickDType(in, casts);
  const int64_t numel = PickNumel(in);
  const float scale = PickScale(in);
  const int threads = PickThreads(in);
  const size_t n = numel > 0 ? static_cast<size_t>(numel) : 0;

  Arena arena;
  const Ptr src = PickPtr(in, arena, BufferBytes(src_dtype, n), src_dtype);
  const Ptr dst = PickPtr(in, arena, BufferBytes(dst_dtype, n), dst_dtype);
  // dst may lie in src's block (in place): the block then ends up as dst_dtype.
  if (dst.block >= 0) arena.dtypes[static_cast<size_t>(dst.block)] = dst_dtype;
  PickTarget(in);

  const Arena before = arena;
  Error error;
  const Status status = Convert(arena.Address(src), src_dtype, arena.Address(dst),
                                dst_dtype, numel, scale, threads, &error);
  if (status == Status::kInvalidArgument) {
    internal::SetTargetForTest(0);
    if (arena.blocks != before.blocks) Die("a rejected Convert wrote to a buffer");
    return;
  }
  Arena want = before;
  if (reference::Convert(want.Address(src), src_dtype, want.Address(dst), dst_dtype,
                         numel, scale) != Status::kOk) {
    Die("Convert accepted what the reference cannot convert");
  }
  for (size_t b = 0; b < arena.blocks.size(); ++b) {
    if (!SameValues(want.blocks[b], arena.blocks[b], arena.dtypes[b])) {
      Die("Convert disagrees with the reference");
    }
  }

  // Round trip of the original source values: dtype -> fp32 -> dtype (copied out of
  // their block, at any offset).
  if (src.block >= 0 && n > 0) {
    const auto first = before.blocks[static_cast<size_t>(src.block)].begin() +
                       static_cast<std::ptrdiff_t>(src.offset);
    const std::vector<uint8_t> original(
        first, first + static_cast<std::ptrdiff_t>(BufferBytes(src_dtype, n)));
    std::vector<float> wide(n);
    std::vector<uint8_t> back(original.size());
    if (Convert(original.data(), src_dtype, wide.data(), DType::kFloat32, numel, 1.0f,
                threads, nullptr) != Status::kOk ||
        Convert(wide.data(), DType::kFloat32, back.data(), src_dtype, numel, 1.0f,
                threads, nullptr) != Status::kOk) {
      Die("a round-trip conversion was rejected");
    }
    if (!SameValues(original, back, src_dtype)) Die("Convert does not round-trip");
    // MeasureScale over the widened values agrees with the reference.
    for (DType d : {DType::kFloat16, DType::kFloat8E4M3}) {
      const float got = MeasureScale(wide.data(), numel, d, threads);
      const float ref = reference::MeasureScale(wide.data(), numel, d);
      if (std::memcmp(&got, &ref, sizeof(got)) != 0) Die("MeasureScale disagrees");
    }
  }
  internal::SetTargetForTest(0);
}

}  // namespace
}  // namespace shardadam

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  if (in.ConsumeBool()) {
    shardadam::FuzzStep(in);
  } else {
    shardadam::FuzzConvert(in);
  }
  return 0;
}
