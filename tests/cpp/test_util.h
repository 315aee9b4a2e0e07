// Helpers shared by the C++ tests: running a check once per Highway target that
// the core was compiled for and this CPU supports (through kernels.h's test
// hooks), bit access to floats, NaN-aware buffer comparison, dtype names for
// test ids.
#ifndef SHARDADAM_TESTS_CPP_TEST_UTIL_H_
#define SHARDADAM_TESTS_CPP_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels.h"
#include "reference.h"
#include "shardadam/adam.h"
#include "validate.h"

namespace shardadam {
namespace testing {

inline uint32_t BitsOf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

inline float FloatOf(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline std::string DTypeName(DType dtype) { return FormatOf(dtype).name; }

// The stored bits of element i of a buffer of `dtype` (a 4-bit code: its nibble).
inline uint32_t ElementBits(const void* buffer, DType dtype, int64_t i) {
  const int bits = FormatOf(dtype).item_bits;
  const auto* bytes = static_cast<const uint8_t*>(buffer);
  if (bits == 4) return (i % 2 == 0 ? bytes[i / 2] : bytes[i / 2] >> 4) & 0xFu;
  uint32_t value = 0;
  std::memcpy(&value, bytes + i * (bits / 8), static_cast<size_t>(bits / 8));
  return value;
}

// Whether a stored element is NaN. The NaN bit patterns are not part of the
// contract (torch itself writes 0x7FC0 or 0xFFFF for a bf16 NaN depending on
// the code path), so comparisons accept any NaN for any NaN.
inline bool IsNaNElement(uint32_t bits, DType dtype) {
  switch (FormatOf(dtype).element) {
    case Element::kFloat32:
      return (bits & 0x7FFFFFFF) > 0x7F800000;
    case Element::kFloat16:
      return (bits & 0x7FFF) > 0x7C00;
    case Element::kBFloat16:
      return (bits & 0x7FFF) > 0x7F80;
    case Element::kFloat8E4M3:
      return (bits & 0x7F) == 0x7F;
    case Element::kUFloat8E4M4:
      return bits == 0xFF;
    case Element::kFloat4E2M1:
      return bits == 0x8;
    case Element::kUFloat4E3M1:
      return bits == 0xF;
    default:
      return false;  // int16 remainders are plain integers
  }
}

// Compares two buffers of `numel` elements of `dtype` bitwise (NaN matches any
// NaN) and describes the first mismatch, if any.
inline ::testing::AssertionResult SameElements(const void* want,
                                               const void* got, DType dtype,
                                               int64_t numel) {
  // Equal bytes are equal elements: compared at once. The element loop (any NaN
  // equals any NaN; FormatOf per element) runs only where some byte differs,
  // and for a 4-bit buffer's odd last element.
  const int bits = FormatOf(dtype).item_bits;
  const int64_t bytes = numel * bits / 8;
  // (An empty buffer may be a null pointer, which memcmp may not be given.)
  const bool equal_bytes =
      bits > 0 && (bytes == 0 || std::memcmp(want, got, static_cast<size_t>(bytes)) == 0);
  int64_t mismatches = 0, first = -1;
  for (int64_t i = equal_bytes ? bytes * 8 / bits : 0; i < numel; ++i) {
    const uint32_t x = ElementBits(want, dtype, i);
    const uint32_t y = ElementBits(got, dtype, i);
    if (x == y || (IsNaNElement(x, dtype) && IsNaNElement(y, dtype))) continue;
    if (first < 0) first = i;
    ++mismatches;
  }
  if (mismatches == 0) return ::testing::AssertionSuccess();
  const int digits = std::max(1, FormatOf(dtype).item_bits / 4);
  char text[160];
  std::snprintf(
      text, sizeof(text),
      "%lld of %lld %s elements differ; first at %lld: want 0x%0*x got 0x%0*x",
      static_cast<long long>(mismatches), static_cast<long long>(numel),
      DTypeName(dtype).c_str(), static_cast<long long>(first), digits,
      ElementBits(want, dtype, first), digits, ElementBits(got, dtype, first));
  return ::testing::AssertionFailure() << text;
}

// Pins the core's kernels to one target for the scope's lifetime (kernels.h's
// test hook), then restores the dispatcher's own choice.
class ScopedTarget {
 public:
  explicit ScopedTarget(int64_t target)
      : ok_(internal::SetTargetForTest(target)) {}
  ~ScopedTarget() { internal::SetTargetForTest(0); }
  ScopedTarget(const ScopedTarget&) = delete;
  ScopedTarget& operator=(const ScopedTarget&) = delete;
  bool ok() const { return ok_; }

 private:
  bool ok_;
};

// The targets ForEachTarget runs: every one compiled into the core that this
// CPU runs or, where SHARDADAM_TEST_TARGETS names some (Highway's names,
// space-separated), only those. Runs on several emulated CPUs use it to leave
// out a target that another run already covers. A named target this CPU does
// not run fails the test.
inline std::vector<int64_t> TargetsToTest() {
  const std::vector<int64_t> compiled = internal::CompiledTargets();
  const char* names = std::getenv("SHARDADAM_TEST_TARGETS");
  if (names == nullptr) return compiled;
  std::vector<int64_t> chosen;
  std::istringstream words(names);
  for (std::string name; words >> name;) {
    const auto found = std::find_if(compiled.begin(), compiled.end(), [&](int64_t t) {
      return name == hwy::TargetName(t);
    });
    if (found == compiled.end()) {
      ADD_FAILURE() << "SHARDADAM_TEST_TARGETS names " << name
                    << ", which this CPU does not run";
      return {};
    }
    chosen.push_back(*found);
  }
  return chosen;
}

// Runs `check` once per target of TargetsToTest(), with every entry point
// pinned to it, inside a SCOPED_TRACE naming the target.
template <class Check>
void ForEachTarget(const Check& check) {
  const std::vector<int64_t> targets = TargetsToTest();
  ASSERT_FALSE(targets.empty());
  for (int64_t target : targets) {
    ScopedTarget scope(target);
    SCOPED_TRACE(std::string("target ") + hwy::TargetName(target));
    ASSERT_TRUE(scope.ok());
    ASSERT_EQ(internal::ActiveKernels().target, target);
    check();
  }
}

}  // namespace testing
}  // namespace shardadam

#endif  // SHARDADAM_TESTS_CPP_TEST_UTIL_H_
