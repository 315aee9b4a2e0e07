// Finds an OpenMP runtime already loaded into the process and runs teams on it;
// see openmp_team.h for why.
#include "openmp_team.h"

#include "float_mode.h"

#include <atomic>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#if defined(__linux__)
#include <dlfcn.h>
#include <link.h>
#include <unistd.h>

#include <cstddef>  // offsetof
#include <cstring>
#define SHARDADAM_FIND_OPENMP 1
#endif

namespace shardadam {
namespace internal {
namespace {

std::atomic<bool> g_use{true};

#if defined(SHARDADAM_FIND_OPENMP)

// GOMP's entry point: fn(data) on each thread of a team of num_threads (0: the
// runtime's default), the caller being thread 0; returns when all have returned.
using ParallelFn = void (*)(void (*fn)(void*), void* data, unsigned num_threads,
                            unsigned flags);
using ThreadNumFn = int (*)();

struct Runtime {
  ParallelFn parallel;
  ThreadNumFn thread_num;
  std::string path;
};

// Found once and kept (never freed, its dlopen handle never closed): a runtime
// torch loaded stays loaded.
std::atomic<const Runtime*> g_runtime{nullptr};
std::mutex g_search_mutex;
// The loader's count of objects ever loaded (dl_phdr_info::dlpi_adds) when a
// search last found nothing: no need to search again until it changes.
unsigned long long g_searched_adds = 0;
bool g_searched = false;

// The process this library was loaded into. In a forked child libgomp's team
// threads do not exist, and entering it may wait for them forever.
const pid_t g_loaded_pid = getpid();

bool IsOpenMpRuntime(const char* path) {
  const char* slash = std::strrchr(path, '/');
  const char* base = slash != nullptr ? slash + 1 : path;
  // libgomp.so.1, torch's own copy, auditwheel's libgomp-<hash>.so.1,
  // libomp.so, libiomp5.so.
  return std::strncmp(base, "libgomp", 7) == 0 || std::strncmp(base, "libomp", 6) == 0 ||
         std::strncmp(base, "libiomp5", 8) == 0;
}

struct Search {
  unsigned long long adds = 0;
  bool first = true;
  bool only_count = false;  // stop after reading the counter
  std::vector<std::string> candidates;  // OpenMP runtimes' paths, opened afterwards
};

// dl_iterate_phdr's callback runs holding a loader lock, so it only reads: a
// dlopen here would take the loader's other lock, which a dlopen on another
// thread takes first, and the two threads could wait on each other forever.
int VisitObject(dl_phdr_info* info, size_t size, void* data) {
  Search& search = *static_cast<Search*>(data);
  if (search.first) {
    search.first = false;
    // dlpi_adds exists where the loader's struct is large enough to hold it.
    if (size >= offsetof(dl_phdr_info, dlpi_adds) + sizeof(info->dlpi_adds)) {
      search.adds = info->dlpi_adds;
    }
    if (search.only_count) return 1;
  }
  if (info->dlpi_name != nullptr && IsOpenMpRuntime(info->dlpi_name)) {
    search.candidates.emplace_back(info->dlpi_name);
  }
  return 0;
}

// The first candidate with GOMP's entry points, outside the loader's iteration.
// RTLD_NOLOAD: a handle to the object already there, never a second copy (one
// unloaded since the iteration is skipped).
Runtime* OpenRuntime(const std::vector<std::string>& candidates) {
  for (const std::string& path : candidates) {
    void* handle = dlopen(path.c_str(), RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
    if (handle == nullptr) continue;
    auto parallel = reinterpret_cast<ParallelFn>(dlsym(handle, "GOMP_parallel"));
    auto thread_num = reinterpret_cast<ThreadNumFn>(dlsym(handle, "omp_get_thread_num"));
    if (parallel != nullptr && thread_num != nullptr) {
      return new Runtime{parallel, thread_num, path};
    }
    dlclose(handle);
  }
  return nullptr;
}

const Runtime* FindRuntime() {
  const Runtime* runtime = g_runtime.load(std::memory_order_acquire);
  if (runtime != nullptr) return runtime;
  std::lock_guard<std::mutex> lock(g_search_mutex);
  runtime = g_runtime.load(std::memory_order_acquire);
  if (runtime != nullptr) return runtime;
  if (g_searched) {
    Search count;
    count.only_count = true;
    dl_iterate_phdr(VisitObject, &count);
    if (count.adds == g_searched_adds) return nullptr;  // nothing loaded since
  }
  Search search;
  dl_iterate_phdr(VisitObject, &search);
  Runtime* found = OpenRuntime(search.candidates);
  g_searched = true;
  g_searched_adds = search.adds;
  g_runtime.store(found, std::memory_order_release);
  return found;
}

const Runtime* UsableRuntime() {
  if (!g_use.load(std::memory_order_relaxed) || getpid() != g_loaded_pid) return nullptr;
  return FindRuntime();
}

// One team's call, shared by its threads.
struct TeamCall {
  const std::function<void(int)>* body;
  ThreadNumFn thread_num;
  std::mutex error_mutex;
  std::exception_ptr error;
};

// Runs on every thread of the team. An exception must not unwind through the
// runtime's C frames: it is kept and rethrown by the caller.
void TeamEntry(void* data) {
  TeamCall& call = *static_cast<TeamCall*>(data);
  try {
    const ScopedIeeeFloatMode ieee;
    (*call.body)(call.thread_num());
  } catch (...) {
    std::lock_guard<std::mutex> lock(call.error_mutex);
    if (!call.error) call.error = std::current_exception();
  }
}

#endif  // SHARDADAM_FIND_OPENMP

}  // namespace

bool RunOnLoadedOpenMp(int num_threads, const std::function<void(int)>& body) {
#if defined(SHARDADAM_FIND_OPENMP)
  const Runtime* runtime = UsableRuntime();
  if (runtime == nullptr) return false;
  TeamCall call;
  call.body = &body;
  call.thread_num = runtime->thread_num;
  runtime->parallel(TeamEntry, &call, static_cast<unsigned>(num_threads < 1 ? 1 : num_threads),
                    0);
  if (call.error) std::rethrow_exception(call.error);
  return true;
#else
  (void)num_threads;
  (void)body;
  return false;
#endif
}

void UseLoadedOpenMp(bool use) { g_use.store(use, std::memory_order_relaxed); }

std::string LoadedOpenMpPath() {
#if defined(SHARDADAM_FIND_OPENMP)
  const Runtime* runtime = UsableRuntime();
  return runtime != nullptr ? runtime->path : std::string();
#else
  return std::string();
#endif
}

}  // namespace internal
}  // namespace shardadam
