// Work-item arithmetic and the thread count of a call (work_items.h).
#include "work_items.h"

#include <algorithm>

#include "openmp_team.h"

namespace shardadam {
namespace internal {
namespace {

// Below this many elements of work per thread, waking another thread costs
// more than it saves.
constexpr int64_t kMinWorkPerThread = 32768;

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

int ResolveThreads(int num_threads) {
  const int threads = num_threads <= 0 ? HardwareThreads() : num_threads;
  return std::clamp(threads, 1, ThreadPool::kMaxThreads);
}

int ThreadsFor(int threads, int64_t work, size_t items) {
  const int64_t useful = std::max<int64_t>(1, work / kMinWorkPerThread);
  return static_cast<int>(
      std::min<int64_t>({threads, useful, static_cast<int64_t>(std::max<size_t>(items, 1))}));
}

void RunTeam(int threads, const std::function<void(int)>& body) {
  if (threads > 1 && RunOnLoadedOpenMp(threads, body)) return;
  ThreadPool::Global().Run(threads, body);
}

void AtomicMax(std::atomic<uint32_t>& target, uint32_t value) {
  uint32_t current = target.load(std::memory_order_relaxed);
  while (value > current &&
         !target.compare_exchange_weak(current, value, std::memory_order_relaxed)) {
  }
}

}  // namespace internal
}  // namespace shardadam
