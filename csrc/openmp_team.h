// The core's threads on an OpenMP runtime the process has already loaded.
//
// PyTorch's wheels bundle libgomp, whose workers keep spinning for a while after
// each parallel region (GOMP_SPINCOUNT). A step called right after backward()
// found them spinning on the very cores its own pool's workers were woken on,
// and lost a quarter of its time to them. Run on those same threads, the step
// turns their spinning into its work, and torch's next op finds them where it
// left them.
//
// Nothing is linked: the runtime is looked up among the objects already loaded
// (dl_iterate_phdr) and entered through GOMP_parallel, which GNU libgomp, LLVM's
// libomp and Intel's libiomp5 all export. A process without one (a plain C++
// program, the C++ tests) keeps the core's own pool (thread_pool.h).
#ifndef SHARDADAM_OPENMP_TEAM_H_
#define SHARDADAM_OPENMP_TEAM_H_

#include <functional>
#include <string>

namespace shardadam {
namespace internal {

// Calls body(i) once on each thread of a team of the loaded OpenMP runtime, i in
// [0, team size), the team at most `num_threads` strong (the runtime may give
// fewer; i == 0 is the calling thread), each in the IEEE mode of float_mode.h,
// and returns true once every call has returned; an exception thrown by a call
// is rethrown here, after the team has finished. Returns false without calling
// anything where no runtime is loaded, in a child forked from this process
// (libgomp's threads are not forked with it), or after UseLoadedOpenMp(false).
bool RunOnLoadedOpenMp(int num_threads, const std::function<void(int)>& body);

// Whether RunOnLoadedOpenMp may use a loaded runtime (true by default).
void UseLoadedOpenMp(bool use);

// Path of the runtime RunOnLoadedOpenMp would use now, or "" for none.
std::string LoadedOpenMpPath();

}  // namespace internal
}  // namespace shardadam

#endif  // SHARDADAM_OPENMP_TEAM_H_
