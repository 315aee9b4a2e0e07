// The floating-point environment the core computes in, whatever the caller's:
// round to nearest even, subnormals kept (no flush-to-zero, no
// denormals-are-zero), every exception masked, NaN payloads propagated. The
// results are specified bit for bit (SEMANTICS S3.7); a caller's mode
// (torch.set_flush_denormal, a library built with -ffast-math) would change
// them, and since pool workers keep the mode they started with, it would
// change them only for the work the calling thread happened to take.
#ifndef SHARDADAM_FLOAT_MODE_H_
#define SHARDADAM_FLOAT_MODE_H_

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#include <xmmintrin.h>
#define SHARDADAM_FLOAT_MODE_SSE 1
#elif defined(__aarch64__)
#define SHARDADAM_FLOAT_MODE_FPCR 1
#endif

namespace shardadam {
namespace internal {

// Sets the environment above on this thread for the object's lifetime, then
// restores the caller's (status flags raised meanwhile are dropped). Elsewhere
// than x86 and AArch64 it does nothing.
class ScopedIeeeFloatMode {
 public:
  ScopedIeeeFloatMode() {
#if defined(SHARDADAM_FLOAT_MODE_SSE)
    saved_ = _mm_getcsr();
    _mm_setcsr(kIeeeCsr);
#elif defined(SHARDADAM_FLOAT_MODE_FPCR)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    // 0: round to nearest, no flush-to-zero, no default NaN, no traps.
    __asm__ __volatile__("msr fpcr, %0" : : "r"(uint64_t{0}));
#endif
  }
  ~ScopedIeeeFloatMode() {
#if defined(SHARDADAM_FLOAT_MODE_SSE)
    _mm_setcsr(static_cast<unsigned int>(saved_));
#elif defined(SHARDADAM_FLOAT_MODE_FPCR)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  ScopedIeeeFloatMode(const ScopedIeeeFloatMode&) = delete;
  ScopedIeeeFloatMode& operator=(const ScopedIeeeFloatMode&) = delete;

#if defined(SHARDADAM_FLOAT_MODE_SSE)
  // MXCSR: all six exceptions masked, round to nearest, FTZ and DAZ off.
  static constexpr unsigned int kIeeeCsr = 0x1F80;
#endif

 private:
  uint64_t saved_ = 0;
};

}  // namespace internal
}  // namespace shardadam

#endif  // SHARDADAM_FLOAT_MODE_H_
