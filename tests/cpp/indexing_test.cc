// 64-bit index math for tensors of more than 2^31 elements, checked without
// allocating them: the work-item split (kernels.h's ItemElements, NumItems and
// ItemAt) and validation's byte-range and overlap arithmetic, which only
// compares addresses and never touches the memory behind them. A 32-bit
// product or sum anywhere in either would show up here as a wrong range or a
// missed overlap.
#include <cstdint>
#include <limits>

#include "gtest/gtest.h"
#include "kernels.h"
#include "shardadam/adam.h"
#include "validate.h"

namespace shardadam {
namespace {

using internal::ItemAt;
using internal::ItemElements;
using internal::ItemRange;
using internal::kChunk;
using internal::kMaxChunksPerItem;
using internal::NumItems;

constexpr int64_t kHuge = 3000000000;  // 3e9 elements: above 2^31 and 2^32 / 4

// Splits of sizes around 2^31 and 2^32 and the largest numel validation
// accepts, with the smallest and the largest item: the items cover
// [0, numel) exactly, in order, each `item` long but the last.
TEST(ItemSplitTest, CoversHugeTensorsExactly) {
  const int64_t sizes[] = {int64_t{1} << 31,       (int64_t{1} << 31) + 1,
                           kHuge,                  kHuge + 5,
                           (int64_t{1} << 32) + 7, INT64_MAX / 8};
  for (int64_t item : {kChunk, kChunk * kMaxChunksPerItem}) {
    for (int64_t numel : sizes) {
      SCOPED_TRACE("item " + std::to_string(item) + ", numel " + std::to_string(numel));
      const int64_t count = NumItems(numel, item);
      ASSERT_EQ(count, (numel - 1) / item + 1);
      // Every item's begin is index * item; check the first few, those
      // around 2^31 elements, and the last few rather than all of them.
      const int64_t around = (int64_t{1} << 31) / item;
      for (int64_t c : {int64_t{0}, int64_t{1}, around - 1, around, around + 1,
                        count - 2, count - 1}) {
        if (c < 0 || c >= count) continue;
        const ItemRange r = ItemAt(numel, item, c);
        EXPECT_EQ(r.begin, c * item);
        EXPECT_EQ(r.end, c + 1 < count ? r.begin + item : numel);
        EXPECT_LT(r.begin, r.end);
        if (c + 1 < count) EXPECT_EQ(ItemAt(numel, item, c + 1).begin, r.end);
      }
    }
    EXPECT_EQ(NumItems(0, item), 0);
    EXPECT_EQ(NumItems(1, item), 1);
    EXPECT_EQ(NumItems(item, item), 1);
    EXPECT_EQ(NumItems(item + 1, item), 2);
  }
}

// Items are whole chunks, one for small calls, growing with the work per
// thread up to kMaxChunksPerItem, also for work far beyond 2^31 elements.
TEST(ItemSplitTest, ItemSizeGrowsWithWorkPerThread) {
  EXPECT_EQ(ItemElements(0, 1), kChunk);
  EXPECT_EQ(ItemElements(1000, 2), kChunk);
  const int64_t per_item = kChunk * internal::kItemsPerThread;
  EXPECT_EQ(ItemElements(2 * per_item * 3, 2), 3 * kChunk);
  EXPECT_EQ(ItemElements(2 * per_item * 3 - 1, 2), 2 * kChunk);
  EXPECT_EQ(ItemElements(per_item * 3, 1), 3 * kChunk);
  EXPECT_EQ(ItemElements(kHuge, 2), kChunk * kMaxChunksPerItem);
  EXPECT_EQ(ItemElements(INT64_MAX / 8, 1024), kChunk * kMaxChunksPerItem);
  for (int64_t work : {int64_t{0}, int64_t{12345}, int64_t{20000000}, kHuge}) {
    for (int threads : {1, 2, 3, 7, 64}) {
      const int64_t item = ItemElements(work, threads);
      EXPECT_EQ(item % kChunk, 0);
      EXPECT_GE(item, kChunk);
      EXPECT_LE(item, kChunk * kMaxChunksPerItem);
    }
  }
}

// Addresses only: nothing below is ever dereferenced. They sit far apart in
// the user half of the x86-64 / AArch64 address space.
void* At(uint64_t address) { return reinterpret_cast<void*>(address); }
constexpr uint64_t kBase = uint64_t{1} << 44;
constexpr uint64_t kStride = uint64_t{1} << 36;  // 64 GiB > 12e9 bytes

// A 3e9-element fp32 tensor whose five buffers are kStride apart.
TensorSlot HugeSlot(uint64_t first) {
  TensorSlot s;
  s.numel = kHuge;
  s.param_dtype = DType::kFloat32;
  s.grad_dtype = DType::kFloat32;
  s.exp_avg_dtype = DType::kFloat32;
  s.exp_avg_sq_dtype = DType::kFloat32;
  s.param = At(first);
  s.grad = At(first + kStride);
  s.exp_avg = At(first + 2 * kStride);
  s.exp_avg_sq = At(first + 3 * kStride);
  return s;
}

TEST(HugeValidationTest, DisjointHugeBuffersAreAccepted) {
  TensorSlot slots[2] = {HugeSlot(kBase), HugeSlot(kBase + 4 * kStride)};
  Error error;
  EXPECT_TRUE(internal::ValidateStep(slots, 2, StepParams(), &error))
      << error.message;
  // The same with 2-byte states, whose byte counts are also above 2^32.
  slots[0].param_dtype = DType::kBFloat16;
  slots[0].master_dtype = DType::kInt16Remainder;
  slots[0].master_param = At(kBase + 4 * kStride - (uint64_t{1} << 33));
  slots[1].param = At(kBase + 8 * kStride);
  EXPECT_TRUE(internal::ValidateStep(slots, 2, StepParams(), &error))
      << error.message;
}

// Buffers 6e9 bytes apart: disjoint if byte counts were truncated to 32 bits
// (12e9 mod 2^32 is about 3.4e9), overlapping in truth (fp32: 12e9 bytes).
TEST(HugeValidationTest, OverlapBeyondFourGiBIsRejected) {
  TensorSlot slot = HugeSlot(kBase);
  slot.grad = At(kBase + 6000000000ull);
  Error error;
  // AdamStep itself: validation rejects before any kernel could touch memory.
  EXPECT_EQ(AdamStep(&slot, 1, StepParams(), 1, &error), Status::kInvalidArgument);
  EXPECT_NE(error.message.find("overlaps"), std::string::npos) << error.message;

  // The last byte of exp_avg_sq is shared with the next one: off by one.
  slot = HugeSlot(kBase);
  slot.exp_avg_sq = At(kBase + 2 * kStride + 4 * static_cast<uint64_t>(kHuge) - 1);
  EXPECT_EQ(AdamStep(&slot, 1, StepParams(), 1, &error), Status::kInvalidArgument);
  slot.exp_avg_sq = At(kBase + 2 * kStride + 4 * static_cast<uint64_t>(kHuge));
  EXPECT_TRUE(internal::ValidateStep(&slot, 1, StepParams(), &error))
      << error.message;
}

// Across tensors: tensor 1's param starts 11e9 bytes into tensor 0's
// exp_avg (12e9 bytes long).
TEST(HugeValidationTest, CrossTensorOverlapBeyondFourGiBIsRejected) {
  TensorSlot slots[2] = {HugeSlot(kBase), HugeSlot(kBase + 4 * kStride)};
  slots[1].param = At(kBase + 2 * kStride + 11000000000ull);
  Error error;
  EXPECT_EQ(AdamStep(slots, 2, StepParams(), 1, &error), Status::kInvalidArgument);
  EXPECT_EQ(error.tensor_index, 1);
  EXPECT_NE(error.message.find("overlaps"), std::string::npos) << error.message;
  // The typed fields: the other tensor by index, the rule without indices.
  EXPECT_EQ(error.other_tensor_index, 0);
  EXPECT_EQ(error.rule.rfind("param [", 0), 0u) << error.rule;
  EXPECT_NE(error.rule.find("overlaps {other}'s exp_avg ["), std::string::npos)
      << error.rule;
  EXPECT_EQ(error.rule.find("tensor "), std::string::npos) << error.rule;
  EXPECT_EQ(error.message.rfind("tensor 1: param [", 0), 0u) << error.message;
  EXPECT_NE(error.message.find("overlaps tensor 0's exp_avg ["), std::string::npos)
      << error.message;
}

TEST(HugeValidationTest, ConvertRangesAreSixtyFourBit) {
  Error error;
  // fp32 -> bf16 of 3e9 elements: src is 12e9 bytes, dst starts 8e9 in.
  EXPECT_FALSE(internal::ValidateConvert(At(kBase), DType::kFloat32,
                                         At(kBase + 8000000000ull),
                                         DType::kBFloat16, kHuge, 1.0f, &error));
  EXPECT_TRUE(internal::ValidateConvert(At(kBase), DType::kFloat32,
                                        At(kBase + 12000000000ull),
                                        DType::kBFloat16, kHuge, 1.0f, &error))
      << error.message;
  // The largest accepted numel and the first rejected one.
  EXPECT_TRUE(internal::ValidateConvert(At(kBase), DType::kFloat8E4M3,
                                        At(kBase), DType::kFloat8E4M3,
                                        INT64_MAX / 8, 1.0f, &error))
      << error.message;
  EXPECT_FALSE(internal::ValidateConvert(At(kBase), DType::kFloat32, At(kBase),
                                         DType::kFloat32, INT64_MAX / 8 + 1,
                                         1.0f, &error));
  // The refusal names the limit, as AdamStep's does.
  const std::string limit = "expected <= " + std::to_string(INT64_MAX / 8);
  EXPECT_NE(error.message.find(limit), std::string::npos) << error.message;
  TensorSlot slot = HugeSlot(kBase);
  slot.numel = INT64_MAX / 8 + 1;
  EXPECT_EQ(AdamStep(&slot, 1, StepParams(), 1, &error), Status::kInvalidArgument);
  EXPECT_NE(error.message.find(limit), std::string::npos) << error.message;
}

// Byte counts and offsets are exact up to the largest accepted numel at every element
// size (numel * bits would overflow from 2^58 fp32 elements), so fp32 buffers of 2^59 + 1
// elements (2^61 + 4 bytes) starting at 0xF000... are refused as running past the
// address space, not taken for a few bytes.
TEST(HugeValidationTest, ByteCountsOfTheLargestBuffersAreExact) {
  const int64_t n = INT64_MAX / 8;
  EXPECT_EQ(BufferBytes(DType::kFloat32, n), 4 * n);
  EXPECT_EQ(BufferBytes(DType::kBFloat16, n), 2 * n);
  EXPECT_EQ(BufferBytes(DType::kFloat8E4M3, n), n);
  EXPECT_EQ(BufferBytes(DType::kFloat4E2M1Block, n), n / 2 + 1);
  EXPECT_EQ(BufferBytes(DType::kFloat4E2M1Block, 7), 4);
  EXPECT_EQ(ByteOffset(DType::kFloat32, n - 1), 4 * (n - 1));
  EXPECT_EQ(ByteOffset(DType::kFloat4E2M1Block, n - 1), (n - 1) / 2);
  TensorSlot slot = HugeSlot(0xF000000000000000ull);
  slot.numel = (int64_t{1} << 59) + 1;
  Error error;
  EXPECT_EQ(AdamStep(&slot, 1, StepParams(), 1, &error), Status::kInvalidArgument);
  EXPECT_NE(error.message.find("param ["), std::string::npos) << error.message;
  EXPECT_NE(error.message.find("address space"), std::string::npos) << error.message;
  EXPECT_FALSE(internal::ValidateConvert(At(0xF000000000000000ull), DType::kFloat32,
                                         At(kBase), DType::kFloat8E4M3, slot.numel, 1.0f,
                                         &error));
  EXPECT_NE(error.message.find("address space"), std::string::npos) << error.message;
}

// A range that would wrap past the top of the address space (where overlap
// arithmetic wraps too) is refused, naming the buffer; one ending just below
// the top is an ordinary range.
TEST(HugeValidationTest, RangesPastTheAddressSpaceAreRejected) {
  constexpr uint64_t kTop = UINTPTR_MAX;
  TensorSlot slot = HugeSlot(kBase);
  slot.numel = 16;  // 64 bytes per fp32 buffer
  Error error;
  slot.param = At(kTop - 63);
  EXPECT_EQ(AdamStep(&slot, 1, StepParams(), 1, &error), Status::kInvalidArgument);
  EXPECT_EQ(error.tensor_index, 0);
  EXPECT_NE(error.message.find("param ["), std::string::npos) << error.message;
  EXPECT_NE(error.message.find("past the end of the address space"), std::string::npos)
      << error.message;
  slot.param = At(kTop - 64);
  EXPECT_TRUE(internal::ValidateStep(&slot, 1, StepParams(), &error)) << error.message;

  // Two buffers that overlap only modulo 2^64.
  slot.param = At(kTop - 63);
  slot.exp_avg = At(kTop - 127);
  EXPECT_FALSE(internal::ValidateStep(&slot, 1, StepParams(), &error));

  EXPECT_FALSE(internal::ValidateConvert(At(kTop - 7), DType::kFloat32, At(kBase),
                                         DType::kFloat32, 4, 1.0f, &error));
  EXPECT_NE(error.message.find("src ["), std::string::npos) << error.message;
  EXPECT_FALSE(internal::ValidateConvert(At(kBase), DType::kFloat32, At(kTop - 7),
                                         DType::kBFloat16, 8, 1.0f, &error));
  EXPECT_NE(error.message.find("dst ["), std::string::npos) << error.message;
}

}  // namespace
}  // namespace shardadam
