// The schedule of one AdamStep call (driver.h): plans, work items, and the two
// phases that per-tensor scaled states need (docs/kernel-design.md).
#include <algorithm>
#include <atomic>
#include <vector>

#include "driver.h"
#include "scale_rule.h"
#include "spans.h"
#include "work_items.h"

namespace shardadam {
namespace internal {
namespace {

// Whole tensors up to this size run pass 1 and pass 2 on one thread while
// their inputs are still in L2.
constexpr int64_t kSmallScaledMax = 32768;

static_assert(kChunk % kGranule == 0 && kSmallScaledMax % kGranule == 0,
              "work items must start on granule boundaries");
static_assert(kBlock % kGranule == 0, "blocks are whole granules");
static_assert(kChunk % kMaxScaleBlock == 0, "work items are whole scale blocks");

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

// Work items of `item` elements over a tensor. With per-block scales (`block`
// > 0, element 0 at position `lead` of its block) items start on block
// boundaries of the whole parameter, so no block is split between threads: a
// partial first block is an item of its own. `item` is a multiple of `block`.
void AppendItems(int64_t tensor, int64_t numel, int64_t item, Pass pass,
                 std::vector<WorkItem>& items, int64_t block = 0, int64_t lead = 0) {
  const int64_t head = block > 0 ? std::min(numel, (block - lead) % block) : 0;
  if (head > 0) items.push_back({tensor, 0, head, pass});
  const int64_t rest = numel - head;
  const int64_t count = NumItems(rest, item);
  for (int64_t c = 0; c < count; ++c) {
    const ItemRange r = ItemAt(rest, item, c);
    items.push_back({tensor, head + r.begin, head + r.end, pass});
  }
}

}  // namespace

void Step(const KernelTable& kt, const TensorSlot* slots, int64_t count,
          const StepConstants& k, int64_t step, int num_threads) {
  std::vector<TensorPlan> plans;
  plans.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) plans.push_back(MakePlan(kt, slots[i], step));

  // Phase A: every single-pass tensor, every small scaled tensor (both
  // passes), pass 1 of large scaled tensors. Phase B: their pass 2. Each
  // phase sizes its items for its own elements.
  const auto two_pass = [](const TensorPlan& p) {
    return p.NeedsMeasuringPass() && p.numel > kSmallScaledMax;
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
    } else if (p.NeedsMeasuringPass()) {
      phase_a.push_back({i, 0, p.numel, Pass::kBoth});
      work_a += 2 * p.numel;
    } else {
      AppendItems(i, p.numel, item_a, Pass::kUpdate, phase_a, p.block, p.lead);
      work_a += p.numel;
    }
  }
  // Largest magnitudes of the new w / m / v of each tensor, as fp32 bits.
  std::vector<std::atomic<uint32_t>> max_bits(phase_b.empty() ? 0 : 3 * plans.size());
  for (auto& b : max_bits) b.store(0, std::memory_order_relaxed);

  RunItems<Scratch>(phase_a.size(), ThreadsFor(threads, work_a, phase_a.size()),
           [&](size_t index, Scratch& s) {
             const WorkItem& item = phase_a[index];
             TensorPlan& p = plans[static_cast<size_t>(item.tensor)];
             uint32_t bits[3] = {0, 0, 0};
             switch (item.pass) {
               case Pass::kUpdate:
                 if (p.block > 0) {
                   UpdateBlockSpan(kt, p, k, item.begin, item.end, s);
                 } else {
                   RunSpan(kt, p, k, item.begin, item.end, true, s, bits);
                 }
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
    RunItems<Scratch>(phase_b.size(), ThreadsFor(threads, elements_b, phase_b.size()),
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
      if (p.scale_slot[j] != nullptr && !p.block_scaled[j]) *p.scale_slot[j] = p.new_scale[j];
    }
  }
}

}  // namespace internal
}  // namespace shardadam
