// The Highway target table: every SIMD target's kernels (adam-inl.h, compiled
// once per target by foreach_target), the dispatcher's choice for this CPU, and
// the test hooks that pin another one (kernels.h).
#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#undef HWY_TARGET_INCLUDE
// From the project root: a bare "targets.cc" is looked up first beside
// foreach_target.h, and a Highway source tree has its own hwy/targets.cc.
#define HWY_TARGET_INCLUDE "csrc/targets.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "adam-inl.h"
#include "hwy/highway.h"

#if HWY_ONCE

#include "kernels.h"
#include "shardadam/adam.h"

namespace shardadam {

HWY_EXPORT(GetKernelTable);

namespace internal {
namespace {

std::atomic<const KernelTable*> g_pinned{nullptr};

// The entries of a dispatch table with `entries` entries that belong to
// targets this CPU runs, as bits (bit i: entry i). A target's GetKernelTable is
// that target's code (SVE's asks the hardware for its vector length), so it is
// never called for another: on an Arm CPU without SVE that would be an illegal
// instruction. Entry 0 is Highway's first-call trampoline, the last one its
// scalar fallback.
int64_t RunnableEntries(size_t entries) {
  if (entries == 1) return 1;  // static dispatch: only the baseline
  return HWY_CHOSEN_TARGET_SHIFT(hwy::SupportedTargets()) | HWY_CHOSEN_TARGET_MASK_SCALAR;
}

}  // namespace

const KernelTable& ActiveKernels() {
  const KernelTable* pinned = g_pinned.load(std::memory_order_acquire);
  if (pinned != nullptr) return *pinned;
  return *HWY_DYNAMIC_DISPATCH(GetKernelTable)();
}

std::vector<int64_t> CompiledTargets() {
  const auto& table = HWY_DISPATCH_TABLE(GetKernelTable);
  const size_t entries = sizeof(table) / sizeof(table[0]);
  const int64_t supported = hwy::SupportedTargets();
  const int64_t runs = RunnableEntries(entries);
  std::vector<int64_t> targets;
  for (size_t i = 0; i < entries; ++i) {
    if (table[i] == nullptr || ((runs >> i) & 1) == 0) continue;
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
  const int64_t runs = RunnableEntries(entries);
  for (size_t i = 0; i < entries; ++i) {
    if (table[i] == nullptr || ((runs >> i) & 1) == 0) continue;
    const KernelTable* kernels = table[i]();
    if (kernels->target == target) {
      g_pinned.store(kernels, std::memory_order_release);
      return true;
    }
  }
  return false;
}

}  // namespace internal

const char* ChosenTarget() { return hwy::TargetName(internal::ActiveKernels().target); }

std::string SupportedTargets() {
  std::string names;
  for (int64_t target : internal::CompiledTargets()) {
    if (!names.empty()) names += ' ';
    names += hwy::TargetName(target);
  }
  return names;
}

}  // namespace shardadam

#endif  // HWY_ONCE
