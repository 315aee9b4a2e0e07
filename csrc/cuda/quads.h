// Four consecutive elements of a buffer moved with one 4-, 8- or 16-byte access,
// one load or store instruction per buffer instead of four. The kernels use it
// where a launch's layout fixes every element size (layouts.h) and the tensor's
// buffers are aligned to four elements (DeviceSlot::quad_aligned).
#ifndef SHARDADAM_CUDA_QUADS_H_
#define SHARDADAM_CUDA_QUADS_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda/layouts.h"
#include "cuda/slot_math.h"

namespace shardadam {
namespace cuda {

// Element k of the quad sits at byte k * kBytes (little-endian: the low bits of
// its word come first), as in the buffer.
template <int kBytes>
struct alignas(4 * kBytes) Quad {
  static_assert(kBytes == 1 || kBytes == 2 || kBytes == 4, "element sizes are 1, 2 or 4");
  static constexpr int kPerWord = 4 / kBytes;
  static constexpr uint32_t kMask = kBytes == 4 ? 0xFFFFFFFFu : (1u << (8 * kBytes)) - 1u;
  uint32_t word[kBytes];

  SHARDADAM_HOST_DEVICE uint32_t Get(int k) const {
    return (word[k / kPerWord] >> (8 * kBytes * (k % kPerWord))) & kMask;
  }
  // `word` starts zeroed.
  SHARDADAM_HOST_DEVICE void Set(int k, uint32_t code) {
    word[k / kPerWord] |= code << (8 * kBytes * (k % kPerWord));
  }
};

// Host stand-in for the device's fault on a misaligned vector access, so the
// CPU tests of the kernels' walk catch what the device would.
inline void RequireQuadAlignment(const void* at, size_t bytes) {
  if (reinterpret_cast<uintptr_t>(at) % bytes != 0) std::abort();
}

// The quad of elements i..i+3 (i a multiple of 4) of a buffer of kBytes-byte elements.
template <int kBytes>
SHARDADAM_HOST_DEVICE inline Quad<kBytes> LoadQuad(const void* p, int64_t i) {
  const char* at = static_cast<const char*>(p) + i * kBytes;
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const Quad<kBytes>*>(at);
#else
  RequireQuadAlignment(at, sizeof(Quad<kBytes>));
  Quad<kBytes> q;  // the host's aliasing rules: copy the bytes
  std::memcpy(&q, at, sizeof(q));
  return q;
#endif
}

template <int kBytes>
SHARDADAM_HOST_DEVICE inline void StoreQuad(void* p, int64_t i, const Quad<kBytes>& q) {
  char* at = static_cast<char*>(p) + i * kBytes;
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<Quad<kBytes>*>(at) = q;
#else
  RequireQuadAlignment(at, sizeof(Quad<kBytes>));
  std::memcpy(at, &q, sizeof(q));
#endif
}

template <int kDType>
SHARDADAM_HOST_DEVICE inline void ReadQuadOf(const void* p, int64_t i, Codes* c,
                                             uint32_t Codes::*field) {
  const Quad<ItemBytes(kDType)> q = LoadQuad<ItemBytes(kDType)>(p, i);
#pragma unroll
  for (int k = 0; k < 4; ++k) c[k].*field = q.Get(k);
}

template <int kDType>
SHARDADAM_HOST_DEVICE inline void WriteQuadOf(void* p, int64_t i, const Codes* c,
                                              uint32_t Codes::*field) {
  Quad<ItemBytes(kDType)> q{};
#pragma unroll
  for (int k = 0; k < 4; ++k) q.Set(k, c[k].*field);
  StoreQuad(p, i, q);
}

// ReadCodes and WriteCodes of elements i..i+3, for a fixed layout L.
template <class L>
SHARDADAM_HOST_DEVICE inline void ReadQuadCodes(const DeviceSlot& t, int64_t i, Codes* c) {
  ReadQuadOf<L::kGrad>(t.grad, i, c, &Codes::grad);
  if constexpr (ReadsParam(L::kMaster)) ReadQuadOf<L::kParam>(t.param, i, c, &Codes::param);
  if constexpr (L::kMaster != kNoMaster) ReadQuadOf<L::kMaster>(t.master, i, c, &Codes::master);
  ReadQuadOf<L::kExpAvg>(t.exp_avg, i, c, &Codes::m);
  ReadQuadOf<L::kExpAvgSq>(t.exp_avg_sq, i, c, &Codes::v);
}

template <class L>
SHARDADAM_HOST_DEVICE inline void WriteQuadCodes(const DeviceSlot& t, int64_t i,
                                                 const Codes* c) {
  WriteQuadOf<L::kParam>(t.param, i, c, &Codes::param);
  if constexpr (L::kMaster != kNoMaster) WriteQuadOf<L::kMaster>(t.master, i, c, &Codes::master);
  WriteQuadOf<L::kExpAvg>(t.exp_avg, i, c, &Codes::m);
  WriteQuadOf<L::kExpAvgSq>(t.exp_avg_sq, i, c, &Codes::v);
}

}  // namespace cuda
}  // namespace shardadam

#endif  // SHARDADAM_CUDA_QUADS_H_
