// The fp8 codec the kernels run on GPUs with fp8 conversion instructions
// (cuda/codecs.h, compute capability 8.9 on) against the integer rule, which the
// CPU tests check against the scalar reference: every fp32 pattern encoded and
// every code decoded, on the GPU. Skipped without a GPU, and where the kernels
// this binary was built with use the integer rule (no such instructions).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/codecs.h"
#include "gtest/gtest.h"

namespace shardadam {
namespace testing {
namespace {

// Whether the code running on this GPU was compiled with the instructions.
__global__ void UsesInstructions(int* out) {
#if defined(SHARDADAM_FP8_INSTRUCTIONS)
  *out = 1;
#else
  *out = 0;
#endif
}

// Counts the fp32 patterns whose two encodings differ; keeps the smallest.
__global__ void EncodeMismatches(unsigned long long* count, unsigned int* first) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t x = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       x < (uint64_t{1} << 32); x += stride) {
    const float f = FloatOf(static_cast<uint32_t>(x));
    if (cuda::EncodeF8(f) != cuda::EncodeF8Integer(f)) {
      atomicAdd(count, 1ull);
      atomicMin(first, static_cast<unsigned int>(x));
    }
  }
}

__global__ void DecodeBoth(uint32_t* instructions, uint32_t* integer) {
  const int q = threadIdx.x;
  instructions[q] = BitsOf(cuda::DecodeF8(static_cast<uint8_t>(q)));
  integer[q] = BitsOf(cuda::DecodeF8Integer(static_cast<uint8_t>(q)));
}

class Fp8InstructionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no CUDA device";
    }
    int* flag = nullptr;
    ASSERT_EQ(cudaMalloc(&flag, sizeof(int)), cudaSuccess);
    UsesInstructions<<<1, 1>>>(flag);
    int uses = 0;
    const cudaError_t copied = cudaMemcpy(&uses, flag, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(flag);
    if (copied != cudaSuccess) {
      cudaGetLastError();
      GTEST_SKIP() << "no code for this GPU: " << cudaGetErrorString(copied);
    }
    if (!uses) GTEST_SKIP() << "the code for this GPU uses the integer rule";
  }
};

TEST_F(Fp8InstructionsTest, EncodeEqualsTheIntegerRuleOnEveryFp32Pattern) {
  unsigned long long* count = nullptr;
  unsigned int* first = nullptr;
  ASSERT_EQ(cudaMalloc(&count, sizeof(*count)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&first, sizeof(*first)), cudaSuccess);
  ASSERT_EQ(cudaMemset(count, 0, sizeof(*count)), cudaSuccess);
  ASSERT_EQ(cudaMemset(first, 0xFF, sizeof(*first)), cudaSuccess);
  EncodeMismatches<<<4096, 256>>>(count, first);
  unsigned long long mismatches = 0;
  unsigned int smallest = 0;
  ASSERT_EQ(cudaMemcpy(&mismatches, count, sizeof(mismatches), cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&smallest, first, sizeof(smallest), cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(count);
  cudaFree(first);
  EXPECT_EQ(mismatches, 0u) << "first differing fp32 pattern 0x" << std::hex << smallest
                            << ": the integer rule gives 0x"
                            << static_cast<int>(cuda::EncodeF8Integer(FloatOf(smallest)));
}

TEST_F(Fp8InstructionsTest, DecodeEqualsTheIntegerRuleOnEveryCode) {
  uint32_t* both = nullptr;
  ASSERT_EQ(cudaMalloc(&both, 2 * 256 * sizeof(uint32_t)), cudaSuccess);
  DecodeBoth<<<1, 256>>>(both, both + 256);
  uint32_t host[2 * 256];
  ASSERT_EQ(cudaMemcpy(host, both, sizeof(host), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(both);
  for (int q = 0; q < 256; ++q) {
    EXPECT_EQ(host[q], host[256 + q]) << "code 0x" << std::hex << q;
    EXPECT_EQ(host[256 + q], BitsOf(cuda::DecodeF8Integer(static_cast<uint8_t>(q))))
        << "code 0x" << std::hex << q << ": the device's integer rule differs from the host's";
  }
}

}  // namespace
}  // namespace testing
}  // namespace shardadam
