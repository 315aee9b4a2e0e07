// How the core splits its work between threads: element ranges of whole
// chunks ("work items") that the thread pool hands out dynamically. The split
// never changes a result (docs/kernel-design.md, determinism).
#ifndef SHARDADAM_WORK_ITEMS_H_
#define SHARDADAM_WORK_ITEMS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "thread_pool.h"

namespace shardadam {
namespace internal {

// Work items are whole chunks: at least one, at most kMaxChunksPerItem. Each
// item a thread takes starts its streams afresh, and the hardware prefetchers
// retrain on every one: with one-chunk items alternating between two threads,
// up to 14% of a step at 20M elements on 2 Zen 5 cores (fp8 moments' measuring
// pass alone: 2.4 ms, against 1.8 ms with 16-chunk items); the gain flattened
// out from 16 chunks up. Below the cap every thread gets at least
// kItemsPerThread items (dynamic scheduling evens out a thread the machine
// slows down).
inline constexpr int64_t kChunk = 16384;
inline constexpr int64_t kMaxChunksPerItem = 16;
inline constexpr int64_t kItemsPerThread = 8;

// Elements per work item for a call that covers `work` elements on
// `threads` threads: a multiple of kChunk (hence of kGranule).
int64_t ItemElements(int64_t work, int threads);

// The element range [begin, end) of one work item.
struct ItemRange {
  int64_t begin;
  int64_t end;
};

// How a buffer of `numel` elements is split into work items of `item`
// elements: the item count, and item `index`'s range. Declared here so that a
// test can check the 64-bit index math for numel above 2^31 without
// allocating such a buffer.
int64_t NumItems(int64_t numel, int64_t item);
ItemRange ItemAt(int64_t numel, int64_t item, int64_t index);

// `num_threads` as the entry points take it (<= 0: every hardware thread),
// clamped to what the pool runs.
int ResolveThreads(int num_threads);
// Threads worth waking for `work` elements spread over `items` work items.
int ThreadsFor(int threads, int64_t work, size_t items);

// Calls body(i) on each of up to `threads` threads, i == 0 the caller's: on the
// OpenMP runtime the process has already loaded (openmp_team.h), else on the
// core's own pool. Bodies must not depend on how many threads there are.
void RunTeam(int threads, const std::function<void(int)>& body);

// Raises `target` to `value` if larger (relaxed: the maxima are read after
// the pool's barrier).
void AtomicMax(std::atomic<uint32_t>& target, uint32_t value);

// Runs `run(index, scratch)` for every index below `count` on up to `threads`
// threads (dynamic scheduling; the split never affects results). Each thread
// gets its own `Scratch`, on the heap: the caller's thread runs items too, and its
// stack may be small (musl's threads get 128 KiB; a Scratch is 64 KiB).
template <class Scratch, class Fn>
void RunItems(size_t count, int threads, const Fn& run) {
  if (count == 0) return;
  std::atomic<size_t> next{0};
  const std::function<void(int)> body = [&](int) {
    // Left uninitialised (`new Scratch`, not make_unique's zeroing of 64 KiB,
    // 0.6 us of each call on a quiet machine): every pass writes what it reads.
    const std::unique_ptr<Scratch> scratch(new Scratch);
    for (;;) {
      const size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= count) break;
      run(i, *scratch);
    }
  };
  RunTeam(threads, body);
}

// Runs `run(range, scratch)` over the work items of one buffer of `numel`
// elements (Convert, MeasureScale).
template <class Scratch, class Fn>
void RunBufferItems(int64_t numel, int num_threads, const Fn& run) {
  const int threads = ResolveThreads(num_threads);
  const int64_t item = ItemElements(numel, threads);
  const size_t items = static_cast<size_t>(NumItems(numel, item));
  RunItems<Scratch>(items, ThreadsFor(threads, numel, items),
                    [&](size_t index, Scratch& s) {
                      run(ItemAt(numel, item, static_cast<int64_t>(index)), s);
                    });
}

}  // namespace internal
}  // namespace shardadam

#endif  // SHARDADAM_WORK_ITEMS_H_
