// AdamStepCuda. Validation runs everywhere (it is host code and touches no
// device); the step itself runs where a GPU is, and must give the CPU core's
// bits on every dtype combination, across the launch boundaries (tensors per
// launch, elements per block) and with empty tensors anywhere in the list;
// per-block scaled moments (S2.9, S2.10) too, on every option the core takes
// beside them, block sizes 128..4096 and shards cut inside blocks; bf16 params
// without master rounded stochastically (S2.14) with either kind of moments.
#include "shardadam/adam_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "block_fixture.h"
#include "gtest/gtest.h"
#include "tensor_fixture.h"
#include "test_util.h"

namespace shardadam {
namespace testing {
namespace {

// Device memory freed on scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&data_, bytes < 1 ? 1 : bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
};

// A Tensor's buffers and scales copied to the device, and back.
struct DeviceTensor {
  std::vector<std::unique_ptr<DeviceBuffer>> owned;
  TensorSlot slot;
  int64_t numel;
  unsigned shifted;

  void* Upload(const void* host, size_t bytes, unsigned buffer = kNoneShifted) {
    const size_t shift =
        (shifted & buffer) != 0 && numel > 0 ? bytes / static_cast<size_t>(numel) : 0;
    owned.push_back(std::make_unique<DeviceBuffer>(bytes + shift));
    void* at = static_cast<char*>(owned.back()->data()) + shift;
    EXPECT_EQ(cudaMemcpy(at, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    return at;
  }

  DeviceTensor(Tensor& t, unsigned shift) : numel(t.numel), shifted(shift) {
    slot = t.Slot();
    slot.param = Upload(t.param.data(), t.param.size(), kParamShifted);
    slot.grad = Upload(t.grad.data(), t.grad.size(), kGradShifted);
    slot.exp_avg = Upload(t.exp_avg.data(), t.exp_avg.size(), kExpAvgShifted);
    slot.exp_avg_sq = Upload(t.exp_avg_sq.data(), t.exp_avg_sq.size(), kExpAvgSqShifted);
    slot.exp_avg_scale = static_cast<float*>(Upload(&t.exp_avg_scale, sizeof(float)));
    slot.exp_avg_sq_scale = static_cast<float*>(Upload(&t.exp_avg_sq_scale, sizeof(float)));
    if (t.config.master != DType::kNone) {
      slot.master_param = Upload(t.master.data(), t.master.size(), kMasterShifted);
      slot.master_scale = static_cast<float*>(Upload(&t.master_scale, sizeof(float)));
    }
  }

  void Download(Tensor* t) const {
    const auto get = [](void* host, const void* device, size_t bytes) {
      EXPECT_EQ(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    };
    get(t->param.data(), slot.param, t->param.size());
    get(t->exp_avg.data(), slot.exp_avg, t->exp_avg.size());
    get(t->exp_avg_sq.data(), slot.exp_avg_sq, t->exp_avg_sq.size());
    get(&t->exp_avg_scale, slot.exp_avg_scale, sizeof(float));
    get(&t->exp_avg_sq_scale, slot.exp_avg_sq_scale, sizeof(float));
    if (t->config.master != DType::kNone) {
      get(t->master.data(), slot.master_param, t->master.size());
      get(&t->master_scale, slot.master_scale, sizeof(float));
    }
  }
};

// Steps `tensors` on the device (on a non-default stream) and on the CPU core
// through the schedule and compares every buffer and scale after each step.
// fresh_grads: a new random gradient before each step, else the tensors' own;
// shifted: ShiftedBuffers bits.
void ExpectCudaMatchesCpu(std::vector<Tensor> tensors, bool adam_w,
                          bool fresh_grads = true, unsigned shifted = kNoneShifted) {
  std::mt19937 rng(11);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (const StepParams& params : Schedule(adam_w)) {
    SCOPED_TRACE("step " + std::to_string(params.step));
    if (fresh_grads) {
      for (Tensor& t : tensors) FillGrad(&t, &rng);
    }
    std::vector<Tensor> want = tensors;
    std::vector<TensorSlot> want_slots = Slots(&want);
    Error error;
    ASSERT_EQ(AdamStep(want_slots.data(), static_cast<int64_t>(want_slots.size()), params, 2,
                       &error),
              Status::kOk)
        << error.message;
    std::vector<Tensor> got = tensors;
    std::vector<std::unique_ptr<DeviceTensor>> device;
    std::vector<TensorSlot> slots;
    for (Tensor& t : got) {
      device.push_back(std::make_unique<DeviceTensor>(t, shifted));
      slots.push_back(device.back()->slot);
    }
    const int64_t count = static_cast<int64_t>(slots.size());
    DeviceBuffer workspace(static_cast<size_t>(CudaWorkspaceBytes(count)));
    ASSERT_EQ(AdamStepCuda(slots.data(), count, params, workspace.data(),
                           CudaWorkspaceBytes(count), stream, /*device=*/0, &error),
              Status::kOk)
        << error.message;
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (size_t k = 0; k < got.size(); ++k) device[k]->Download(&got[k]);
    ASSERT_TRUE(SameTensors(want, got));
    tensors = want;
  }
  cudaStreamDestroy(stream);
}

bool HaveDevice() { return CudaDeviceCount() > 0 && CudaKernelsRunOn(0); }

// One test over every combination (not one per combination): without a GPU it
// is a single skip.
TEST(CudaStepTest, EveryDTypeCombinationMatchesCpuCoreBitwise) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  for (const Config& config : AllConfigs()) {
    SCOPED_TRACE(ConfigName(config));
    std::mt19937 rng(5);
    std::vector<Tensor> tensors;
    // 8192 elements per block: 8193 spans two blocks.
    for (int64_t n : {0, 1, 17, 0, 8193, 1001, 0}) tensors.push_back(MakeTensor(config, n, &rng));
    ExpectCudaMatchesCpu(tensors, config.adam_w);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Tensors of 17 and 8193 elements of each of `configs`, placed once per
// ShiftedBuffers value of `placements`.
void ExpectShiftedMatchCpu(const std::vector<Config>& configs,
                           std::initializer_list<unsigned> placements) {
  for (const Config& config : configs) {
    for (unsigned shifted : placements) {
      SCOPED_TRACE(ConfigName(config) + ", shifted buffer bits " + std::to_string(shifted));
      std::mt19937 rng(9);
      std::vector<Tensor> tensors;
      for (int64_t n : {17, 8193}) tensors.push_back(MakeTensor(config, n, &rng));
      ExpectCudaMatchesCpu(tensors, config.adam_w, true, shifted);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(CudaStepTest, BuffersAlignedOnlyToTheirElementMatchCpuCoreBitwise) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  ExpectShiftedMatchCpu(AllConfigs(), {kAllShifted});
}

TEST(CudaStepTest, OneBufferAlignedOnlyToItsElementMatchesCpuCoreBitwise) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  // A tensor takes four elements per access only if all its buffers allow it.
  ExpectShiftedMatchCpu(RepresentativeConfigs(), {kParamShifted, kGradShifted, kExpAvgShifted,
                                                  kExpAvgSqShifted, kMasterShifted});
}

// S2.14: bf16 params with no master rounded stochastically, their bits keyed by
// rounding_key, the step and first_index + i (tensors crossing a multiple of
// 2^32 included), aligned and shifted.
TEST(CudaStepTest, StochasticParamRoundingMatchesCpuCoreBitwise) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  for (const ParamRoundingCase& param_case : ParamRoundingCases()) {
    SCOPED_TRACE(ParamRoundingCaseName(param_case));
    std::mt19937 rng(5);
    std::vector<Tensor> tensors;
    int k = 0;
    for (int64_t n : {0, 1, 17, 0, 8193, 1001, 0}) {
      tensors.push_back(MakeTensor(param_case.config, n, &rng));
      SetParamRounding(param_case, k++, &tensors.back());
    }
    ExpectCudaMatchesCpu(tensors, param_case.config.adam_w);
    if (::testing::Test::HasFatalFailure()) return;
    ExpectCudaMatchesCpu(tensors, param_case.config.adam_w, true, kAllShifted);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(CudaStepListTest, ManyTensorsAcrossLaunchesMatchCpuCore) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  // 32 tensors per launch, and a new launch wherever the layout changes (layouts.h):
  // runs of 40 tensors of one combination fill a launch and start the next, then
  // 60 of alternating combinations take one launch each; empty ones anywhere.
  std::mt19937 rng(6);
  const std::vector<Config> configs = RepresentativeConfigs();
  std::vector<Tensor> tensors;
  for (int k = 0; k < 180; ++k) {
    const int64_t n = k % 7 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 20000);
    const size_t which = k < 120 ? k / 40 : k;
    tensors.push_back(MakeTensor(configs[which % configs.size()], n, &rng));
  }
  ExpectCudaMatchesCpu(tensors, true);
}

TEST(CudaStepListTest, SeveralMiBMatchCpuCore) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  std::mt19937 rng(8);
  std::vector<Tensor> tensors;
  for (const Config& c : RepresentativeConfigs()) tensors.push_back(MakeTensor(c, 3 << 20, &rng));
  ExpectCudaMatchesCpu(tensors, false);
}

TEST(CudaStepListTest, ZeroAndSubnormalValuesMatchCpuCore) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  // All zero (absmax 0: scale 1, S2.3), and subnormal weights, moments and
  // gradients (scales clamped to FLT_MIN; the device must not flush them).
  const int64_t n = 1001;
  const std::vector<float> zeros(n, 0.0f);
  std::vector<float> tiny(n), tiny_v(n);  // exp_avg_sq >= 0
  for (int64_t i = 0; i < n; ++i) {
    tiny_v[i] = std::ldexp(static_cast<float>(i % 7 + 1), -140);
    tiny[i] = i % 2 ? -tiny_v[i] : tiny_v[i];
  }
  std::vector<Tensor> tensors;
  for (const Config& c : RepresentativeConfigs()) {
    tensors.push_back(TensorFromValues(c, zeros, zeros, zeros, zeros));
    tensors.push_back(TensorFromValues(c, tiny, tiny, tiny_v, tiny));
  }
  ExpectCudaMatchesCpu(tensors, true, /*fresh_grads=*/false);
}

// A Shard's buffers and block scales copied to the device with their guard bytes,
// and back (guards included, so a write outside a buffer shows).
struct DeviceShard {
  std::vector<std::unique_ptr<DeviceBuffer>> owned;
  TensorSlot slot;

  void* Upload(const std::vector<uint8_t>& host) {
    owned.push_back(std::make_unique<DeviceBuffer>(host.size()));
    EXPECT_EQ(cudaMemcpy(owned.back()->data(), host.data(), host.size(),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    return static_cast<char*>(owned.back()->data()) + kGuard;
  }

  explicit DeviceShard(Shard& s) {
    slot = s.Slot();
    slot.param = Upload(s.param);
    slot.grad = Upload(s.grad);
    slot.exp_avg = Upload(s.exp_avg);
    slot.exp_avg_sq = Upload(s.exp_avg_sq);
    void* master = Upload(s.master);
    if (slot.master_param != nullptr) slot.master_param = master;
    float* m_scales = static_cast<float*>(Upload(s.m_scales));
    float* v_scales = static_cast<float*>(Upload(s.v_scales));
    if (slot.exp_avg_scale != nullptr) slot.exp_avg_scale = m_scales;
    if (slot.exp_avg_sq_scale != nullptr) slot.exp_avg_sq_scale = v_scales;
  }

  void Download(Shard* s) const {
    std::vector<uint8_t>* host[] = {&s->param, &s->grad, &s->exp_avg, &s->exp_avg_sq,
                                    &s->master, &s->m_scales, &s->v_scales};
    for (size_t k = 0; k < owned.size(); ++k) {
      EXPECT_EQ(cudaMemcpy(host[k]->data(), owned[k]->data(), host[k]->size(),
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
  }
};

// Steps `shards` and `tensors` (per-tensor states) in one AdamStepCuda call on a
// non-default stream and on the CPU core through BlockSchedule, and compares
// every buffer and scale after each step. lr_on_device: the CUDA call reads lr
// from device memory (StepParams::lr_in_device_memory), its host lr NaN.
void ExpectBlocksMatchCpu(std::vector<Shard> shards, std::vector<Tensor> tensors, bool adam_w,
                          bool lr_on_device = false) {
  std::mt19937 rng(21);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (const StepParams& params : BlockSchedule(adam_w)) {
    SCOPED_TRACE("step " + std::to_string(params.step));
    for (Shard& s : shards) FillBlockGrad(&s, static_cast<int>(params.step), &rng);
    for (Tensor& t : tensors) FillGrad(&t, &rng);
    std::vector<Shard> want = shards, got = shards;
    std::vector<Tensor> want_tensors = tensors, got_tensors = tensors;
    std::vector<TensorSlot> want_slots, slots;
    std::vector<std::unique_ptr<DeviceShard>> device;
    std::vector<std::unique_ptr<DeviceTensor>> device_tensors;
    // Interleaved, so that launches change kind (per-block or not) along the list.
    for (size_t k = 0; k < std::max(want.size(), want_tensors.size()); ++k) {
      if (k < want.size()) {
        want_slots.push_back(want[k].Slot());
        device.push_back(std::make_unique<DeviceShard>(got[k]));
        slots.push_back(device.back()->slot);
      }
      if (k < want_tensors.size()) {
        want_slots.push_back(want_tensors[k].Slot());
        device_tensors.push_back(std::make_unique<DeviceTensor>(got_tensors[k], kNoneShifted));
        slots.push_back(device_tensors.back()->slot);
      }
    }
    Error error;
    ASSERT_EQ(AdamStep(want_slots.data(), static_cast<int64_t>(want_slots.size()), params, 2,
                       &error),
              Status::kOk)
        << error.message;
    const int64_t count = static_cast<int64_t>(slots.size());
    DeviceBuffer workspace(static_cast<size_t>(CudaWorkspaceBytes(count)));
    StepParams cuda_params = params;
    DeviceBuffer lr(sizeof(double));
    if (lr_on_device) {
      ASSERT_EQ(cudaMemcpy(lr.data(), &params.lr, sizeof(double), cudaMemcpyHostToDevice),
                cudaSuccess);
      cuda_params.lr = NAN;  // not used
      cuda_params.lr_in_device_memory = static_cast<const double*>(lr.data());
    }
    ASSERT_EQ(AdamStepCuda(slots.data(), count, cuda_params, workspace.data(),
                           CudaWorkspaceBytes(count), stream, /*device=*/0, &error),
              Status::kOk)
        << error.message;
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (size_t k = 0; k < got.size(); ++k) {
      device[k]->Download(&got[k]);
      ASSERT_TRUE(SameShard(want[k], got[k])) << "shard " << k << " " << ShardName(want[k]);
    }
    for (size_t k = 0; k < got_tensors.size(); ++k) device_tensors[k]->Download(&got_tensors[k]);
    ASSERT_TRUE(SameTensors(want_tensors, got_tensors));
    shards = want;
    tensors = want_tensors;
  }
  cudaStreamDestroy(stream);
}

std::vector<Shard> ShardsOf(const BlockConfig& config) {
  std::vector<Shard> shards;
  for (const ShardShape& s : ShardShapesFor(config)) {
    shards.emplace_back(config, s.first_index, s.numel, s.block);
  }
  return shards;
}

TEST(CudaBlockStepTest, EveryBlockOptionMatchesCpuCoreBitwise) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  for (const BlockConfig& config : BlockConfigs()) {
    SCOPED_TRACE(BlockConfigName(config));
    ExpectBlocksMatchCpu(ShardsOf(config), {}, config.adam_w);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(CudaBlockStepTest, BlockAndPerTensorStatesInOneCallMatchCpuCore) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  // The first shards alternate with tensors of per-tensor fp8 and fp16 states
  // (launches split by kind), then 38 of one block layout (more than a launch's
  // 32), then the catch-all block layout (fp16 params, bf16 gradients), then block4.
  std::vector<Shard> shards;
  const std::vector<BlockConfig> configs = BlockConfigs();
  for (int k = 0; k < 50; ++k) {
    const ShardShape shape = ShardShapes()[k % ShardShapes().size()];
    shards.emplace_back(configs[k < 44 ? 0 : 25], shape.first_index, shape.numel, shape.block);
  }
  // Then block4 shards, of its compiled layout and of the catch-all (fp16 params,
  // bf16 gradients, fp4-block beside ufp8-block).
  const BlockConfig block4s[] = {
      {DType::kFloat32, DType::kFloat32, DType::kNone, kBlock4, kUBlock4, true},
      {DType::kFloat16, DType::kBFloat16, DType::kNone, kBlock4, kUBlock8, true}};
  for (int k = 0; k < 6; ++k) {
    const ShardShape shape = EvenShardShapes()[k];
    shards.emplace_back(block4s[k % 2], shape.first_index, shape.numel, shape.block);
  }
  std::mt19937 rng(12);
  std::vector<Tensor> tensors;
  for (const Config& c : RepresentativeConfigs()) {
    if (c.adam_w) tensors.push_back(MakeTensor(c, 1 + rng() % 20000, &rng));
  }
  ExpectBlocksMatchCpu(shards, tensors, true);
}

// S1.2: an lr in device memory, read by every kind of kernel (per-block, per-tensor
// measure and store, unscaled), gives the bits of the same lr passed by value.
TEST(CudaBlockStepTest, LrInDeviceMemoryMatchesLrByValue) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  for (bool adam_w : {true, false}) {
    SCOPED_TRACE(adam_w ? "adamw" : "l2");
    std::vector<Shard> shards;
    int k = 0;
    for (const BlockConfig& config : BlockConfigs()) {
      if (config.adam_w != adam_w) continue;
      const ShardShape shape = ShardShapesFor(config)[k++ % ShardShapes().size()];
      shards.emplace_back(config, shape.first_index, shape.numel, shape.block);
    }
    std::mt19937 rng(14);
    std::vector<Tensor> tensors;
    for (const Config& c : RepresentativeConfigs()) {
      if (c.adam_w == adam_w) tensors.push_back(MakeTensor(c, 1 + rng() % 20000, &rng));
    }
    ExpectBlocksMatchCpu(shards, tensors, adam_w, /*lr_on_device=*/true);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// S2.14 in one call: shards of block moments and per-tensor tensors whose bf16
// param (no master) rounds stochastically, between ones that round to nearest.
TEST(CudaBlockStepTest, StochasticParamRoundingInOneCallMatchesCpuCore) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  std::vector<Shard> shards;
  int k = 0;
  for (const BlockConfig& config : BlockConfigs()) {
    if (config.param_rounding != Rounding::kStochastic || !config.adam_w) continue;
    const ShardShape shape = ShardShapesFor(config)[k++ % ShardShapes().size()];
    shards.emplace_back(config, shape.first_index, shape.numel, shape.block);
  }
  std::mt19937 rng(13);
  std::vector<Tensor> tensors;
  k = 0;
  for (const ParamRoundingCase& param_case : ParamRoundingCases()) {
    if (!param_case.config.adam_w) continue;
    Tensor nearest = MakeTensor(param_case.config, 1 + rng() % 20000, &rng);
    tensors.push_back(nearest);
    SetParamRounding(param_case, k++, &tensors.back());
    tensors.push_back(nearest);
  }
  ExpectBlocksMatchCpu(shards, tensors, true);
}

TEST(CudaBlockStepTest, LargeBlock8ShardsMatchCpuCore) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  // Millions of elements: many CUDA blocks per tensor, each block size.
  std::vector<Shard> shards;
  const BlockConfig bf16{DType::kBFloat16, DType::kBFloat16, DType::kInt16Remainder, kBlock8,
                         kUBlock8, true};
  for (int32_t block : {128, 256, 1024, 4096}) {
    shards.emplace_back(bf16, 3 * int64_t{block} + 77, (3 << 20) + 5, block);
  }
  ExpectBlocksMatchCpu(shards, {}, true);
}

TEST(CudaBlockStepTest, LargeBlock4ShardsMatchCpuCore) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device the kernels run on";
  // As above for block4: even first indices (S2.12), odd counts (a padding nibble).
  std::vector<Shard> shards;
  const BlockConfig bf16{DType::kBFloat16, DType::kBFloat16, DType::kInt16Remainder, kBlock4,
                         kUBlock4, true};
  for (int32_t block : {128, 256, 1024, 4096}) {
    shards.emplace_back(bf16, 3 * int64_t{block} + 78, (3 << 20) + 5, block);
  }
  ExpectBlocksMatchCpu(shards, {}, true);
}

// An all-fp32 slot of `numel` elements over host buffers (validation only
// compares addresses, so host memory stands in for device memory).
TensorSlot Fp32Slot(float (&buffers)[4][8], int64_t numel = 8, int64_t offset = 0) {
  TensorSlot s;
  s.numel = numel;
  s.param = buffers[0] + offset;
  s.grad = buffers[1] + offset;
  s.exp_avg = buffers[2] + offset;
  s.exp_avg_sq = buffers[3] + offset;
  return s;
}

// Validation is host-side: these run without a GPU and enqueue nothing.
TEST(CudaValidationTest, BadSlotIsRejectedWithItsIndex) {
  float buffers[4][8] = {};
  TensorSlot s = Fp32Slot(buffers);
  s.exp_avg_sq_dtype = static_cast<DType>(42);  // no format has this tag
  Error error;
  EXPECT_EQ(AdamStepCuda(&s, 1, StepParams(), nullptr, 0, nullptr, -1, &error),
            Status::kInvalidArgument);
  EXPECT_EQ(error.tensor_index, 0);
  EXPECT_NE(error.message.find("exp_avg_sq_dtype 42"), std::string::npos) << error.message;
}

TEST(CudaValidationTest, ScaleValuesAreNotRead) {
  // A scale slot in device memory cannot be read on the host: only its
  // presence is checked. An fp16 moment without a scale slot is still refused.
  float buffers[4][8] = {};
  TensorSlot s = Fp32Slot(buffers);
  s.exp_avg_sq_dtype = DType::kFloat16;  // fits in its fp32 buffer
  Error error;
  EXPECT_EQ(AdamStepCuda(&s, 1, StepParams(), nullptr, 0, nullptr, -1, &error),
            Status::kInvalidArgument);
  EXPECT_NE(error.message.find("exp_avg_sq_scale is null"), std::string::npos) << error.message;
  float nan_scale = NAN;  // would be rejected by the CPU core's AdamStep
  s.exp_avg_sq_scale = &nan_scale;
  EXPECT_EQ(AdamStepCuda(&s, 1, StepParams(), nullptr, 0, nullptr, -1, &error),
            Status::kInvalidArgument);
  EXPECT_NE(error.message.find("workspace"), std::string::npos) << error.message;
}

TEST(CudaValidationTest, SmallWorkspaceIsRejected) {
  float buffers[4][8] = {};
  TensorSlot s[2] = {Fp32Slot(buffers, 4, 0), Fp32Slot(buffers, 0, 4)};
  Error error;
  int dummy = 0;
  EXPECT_EQ(AdamStepCuda(s, 2, StepParams(), &dummy, CudaWorkspaceBytes(2) - 1, nullptr, -1, &error),
            Status::kInvalidArgument);
  EXPECT_NE(error.message.find("workspace holds 23 bytes"), std::string::npos) << error.message;
  EXPECT_EQ(CudaWorkspaceBytes(2), 24);
  EXPECT_EQ(CudaWorkspaceBytes(0), 0);
}

// A step split into one call per group is checked whole first: CheckStepSlots
// knows only AdamStep's rules, CheckCudaStepSlots AdamStepCuda's too (here a bf16
// buffer aligned to 1 byte in the second group, which AdamStep takes).
TEST(CudaValidationTest, CheckCudaStepSlotsAppliesTheBackendsOwnRules) {
  alignas(16) uint16_t bf16[4][10] = {};
  float buffers[4][8] = {};
  TensorSlot s[2] = {Fp32Slot(buffers), Fp32Slot(buffers)};
  s[1].numel = 4;
  s[1].param = bf16[0];
  s[1].grad = bf16[1];
  s[1].exp_avg = reinterpret_cast<uint8_t*>(bf16[2]) + 1;  // odd address
  s[1].exp_avg_sq = bf16[3];
  s[1].param_dtype = s[1].grad_dtype = s[1].exp_avg_dtype = s[1].exp_avg_sq_dtype =
      DType::kBFloat16;
  s[1].master_dtype = DType::kNone;
  s[0].numel = 4;  // the first group's buffers: no overlap with the second's
  Error error;
  EXPECT_EQ(CheckStepSlots(s, 2, true, &error), Status::kOk) << error.message;
  EXPECT_EQ(CheckCudaStepSlots(s, 2, &error), Status::kInvalidArgument);
  EXPECT_EQ(error.tensor_index, 1);
  EXPECT_NE(error.message.find("exp_avg is not aligned to its element size"),
            std::string::npos)
      << error.message;
  // AdamStepCuda refuses the same slot for the same reason.
  int workspace[8] = {};
  EXPECT_EQ(AdamStepCuda(s, 2, StepParams(), workspace, sizeof(workspace), nullptr, -1,
                         &error),
            Status::kInvalidArgument);
  EXPECT_EQ(error.tensor_index, 1);
  // Slots AdamStep refuses, CheckCudaStepSlots refuses with AdamStep's message.
  s[1].exp_avg = bf16[2];
  s[0].numel = -1;
  EXPECT_EQ(CheckCudaStepSlots(s, 2, &error), Status::kInvalidArgument);
  EXPECT_EQ(error.tensor_index, 0);
  s[0].numel = 4;
  EXPECT_EQ(CheckCudaStepSlots(s, 2, &error), Status::kOk) << error.message;
}

// Per-block scaled states are stepped (so accepted), and their geometry is
// validated as by AdamStep, before anything is enqueued.
TEST(CudaValidationTest, PerBlockScaledStatesAreValidated) {
  float buffers[4][8] = {};
  float scales[2] = {1.0f, 1.0f};
  int workspace[4] = {};
  TensorSlot s = Fp32Slot(buffers);
  s.exp_avg_sq_dtype = DType::kUFloat8E4M4Block;
  s.exp_avg_sq_scale = scales;
  s.scale_block = 100;
  Error error;
  EXPECT_EQ(AdamStepCuda(&s, 1, StepParams(), workspace, sizeof(workspace), nullptr, -1,
                         &error),
            Status::kInvalidArgument);
  EXPECT_EQ(error.tensor_index, 0);
  EXPECT_NE(error.message.find("scale_block 100 is not a power of two"), std::string::npos)
      << error.message;
  EXPECT_TRUE(CudaSupportsFormat(DType::kFloat8E4M3Block));
  EXPECT_TRUE(CudaSupportsFormat(DType::kUFloat8E4M4Block));
  EXPECT_TRUE(CudaSupportsFormat(DType::kFloat4E2M1Block));
  EXPECT_TRUE(CudaSupportsFormat(DType::kUFloat4E3M1Block));
  EXPECT_TRUE(CudaSupportsFormat(DType::kFloat32));
  EXPECT_FALSE(CudaSupportsFormat(static_cast<DType>(kNumDTypes)));
}

// Stochastic rounding of the param (S2.14) is refused as by AdamStep where the
// param is not bf16 or has a master.
TEST(CudaValidationTest, StochasticParamRoundingNeedsBF16WithoutMaster) {
  float buffers[4][8] = {};
  int workspace[4] = {};
  TensorSlot s = Fp32Slot(buffers);
  s.param_rounding = Rounding::kStochastic;
  Error error;
  EXPECT_EQ(AdamStepCuda(&s, 1, StepParams(), workspace, sizeof(workspace), nullptr, -1,
                         &error),
            Status::kInvalidArgument);
  EXPECT_EQ(error.tensor_index, 0);
  EXPECT_NE(error.message.find("param_rounding 1 (stochastic) is not allowed"),
            std::string::npos)
      << error.message;
  s.param_rounding = static_cast<Rounding>(2);
  EXPECT_EQ(AdamStepCuda(&s, 1, StepParams(), workspace, sizeof(workspace), nullptr, -1,
                         &error),
            Status::kInvalidArgument);
  EXPECT_NE(error.message.find("param_rounding 2 is not a rounding"), std::string::npos)
      << error.message;
  for (int k = 0; k < 4; ++k) {
    for (float x : buffers[k]) EXPECT_EQ(x, 0.0f);
  }
}

TEST(CudaValidationTest, MisalignedBuffersAreRejected) {
  // The device faults on a misaligned element access (and the context is lost):
  // refused up front, where the CPU core takes any alignment.
  float buffers[4][8] = {};
  Error error;
  int workspace[4] = {};
  TensorSlot s = Fp32Slot(buffers, 4, 0);
  s.exp_avg = reinterpret_cast<char*>(buffers[2]) + 2;
  EXPECT_EQ(AdamStepCuda(&s, 1, StepParams(), workspace, sizeof(workspace), nullptr, -1,
                         &error),
            Status::kInvalidArgument);
  EXPECT_NE(error.message.find("tensor 0: exp_avg is not aligned"), std::string::npos)
      << error.message;
  s = Fp32Slot(buffers);
  EXPECT_EQ(AdamStepCuda(&s, 1, StepParams(), reinterpret_cast<char*>(workspace) + 1,
                         sizeof(workspace) - 1, nullptr, -1, &error),
            Status::kInvalidArgument);
  EXPECT_NE(error.message.find("4-byte aligned"), std::string::npos) << error.message;
  for (int k = 0; k < 4; ++k) {
    for (float x : buffers[k]) EXPECT_EQ(x, 0.0f);
  }
}

// Only what the kernels touch must be aligned (adam.h): an empty tensor's data
// pointers and an unscaled state's scale slot may hold anything; an empty
// tensor's per-tensor scale is still written, so its slot is checked.
TEST(CudaValidationTest, PointersTheKernelsNeverTouchMayBeMisaligned) {
  float buffers[4][8] = {};
  TensorSlot s = Fp32Slot(buffers);
  s.exp_avg_scale = reinterpret_cast<float*>(reinterpret_cast<char*>(buffers[0]) + 1);
  Error error;
  EXPECT_EQ(CheckCudaStepSlots(&s, 1, &error), Status::kOk) << error.message;
  TensorSlot empty = Fp32Slot(buffers, 0);
  empty.param = reinterpret_cast<char*>(buffers[0]) + 1;
  empty.grad = reinterpret_cast<char*>(buffers[1]) + 3;
  EXPECT_EQ(CheckCudaStepSlots(&empty, 1, &error), Status::kOk) << error.message;
  alignas(8) float scale_bytes[3] = {1.0f, 1.0f, 1.0f};
  empty.exp_avg_dtype = DType::kFloat16;  // per tensor: its scale is written
  empty.exp_avg_scale = reinterpret_cast<float*>(reinterpret_cast<char*>(scale_bytes) + 2);
  EXPECT_EQ(CheckCudaStepSlots(&empty, 1, &error), Status::kInvalidArgument);
  EXPECT_NE(error.message.find("exp_avg_scale"), std::string::npos) << error.message;
  EXPECT_NE(error.message.find("not aligned"), std::string::npos) << error.message;
  empty.exp_avg_scale = scale_bytes;
  EXPECT_EQ(CheckCudaStepSlots(&empty, 1, &error), Status::kOk) << error.message;
}

// The workspace is written and a device lr read by every kernel: neither may share
// memory with the call's buffers (nor the lr lie in the workspace), and a device
// index below -1 is refused; nothing is enqueued (no GPU needed).
TEST(CudaValidationTest, WorkspaceAndLrApartFromTheBuffersAndDeviceInRange) {
  alignas(8) float buffers[4][8] = {};
  TensorSlot s[2] = {Fp32Slot(buffers, 2, 0), Fp32Slot(buffers, 6, 2)};
  Error error;
  void* workspace = buffers[2] + 2;  // tensor 1's exp_avg, 24 bytes
  EXPECT_EQ(AdamStepCuda(s, 2, StepParams(), workspace, CudaWorkspaceBytes(2), nullptr, -1,
                         &error),
            Status::kInvalidArgument);
  EXPECT_EQ(error.tensor_index, 1);
  EXPECT_NE(error.message.find("workspace"), std::string::npos) << error.message;
  EXPECT_NE(error.message.find("overlaps the tensor's exp_avg"), std::string::npos)
      << error.message;
  alignas(8) int own[8] = {};
  alignas(8) static const double lr_apart = 1e-3;
  StepParams params;
  // In tensor 1's grad, which the step only reads: still refused (adam_cuda.h).
  params.lr_in_device_memory = reinterpret_cast<const double*>(buffers[1] + 2);
  EXPECT_EQ(AdamStepCuda(s, 2, params, own, sizeof(own), nullptr, -1, &error),
            Status::kInvalidArgument);
  EXPECT_EQ(error.tensor_index, 1);
  EXPECT_NE(error.message.find("lr_in_device_memory"), std::string::npos) << error.message;
  params.lr_in_device_memory = reinterpret_cast<const double*>(own + 2);
  EXPECT_EQ(AdamStepCuda(s, 2, params, own, sizeof(own), nullptr, -1, &error),
            Status::kInvalidArgument);
  EXPECT_NE(error.message.find("lies in the workspace"), std::string::npos) << error.message;
  params.lr_in_device_memory = &lr_apart;
  EXPECT_EQ(AdamStepCuda(s, 2, params, own, sizeof(own), nullptr, -7, &error),
            Status::kInvalidArgument);
  EXPECT_NE(error.message.find("device -7 is not a device"), std::string::npos)
      << error.message;
  for (int k = 0; k < 4; ++k) {
    for (float x : buffers[k]) EXPECT_EQ(x, 0.0f);
  }
}

// An lr in device memory is never read on the host: only its alignment is checked,
// and the host lr beside it (NaN here) is not.
TEST(CudaValidationTest, LrInDeviceMemoryIsCheckedForAlignmentOnly) {
  float buffers[4][8] = {};
  TensorSlot s = Fp32Slot(buffers);
  alignas(8) static const double lr[2] = {};  // stands in for device memory
  StepParams params;
  params.lr = NAN;
  params.lr_in_device_memory =
      reinterpret_cast<const double*>(reinterpret_cast<const char*>(lr) + 4);
  Error error;
  EXPECT_EQ(AdamStepCuda(&s, 1, params, nullptr, 0, nullptr, -1, &error),
            Status::kInvalidArgument);
  EXPECT_NE(error.message.find("lr_in_device_memory"), std::string::npos) << error.message;
  EXPECT_NE(error.message.find("not aligned to 8 bytes"), std::string::npos) << error.message;
  params.lr_in_device_memory = lr;  // past the lr checks: the missing workspace is next
  EXPECT_EQ(AdamStepCuda(&s, 1, params, nullptr, 0, nullptr, -1, &error),
            Status::kInvalidArgument);
  EXPECT_NE(error.message.find("workspace"), std::string::npos) << error.message;
  for (int k = 0; k < 4; ++k) {
    for (float x : buffers[k]) EXPECT_EQ(x, 0.0f);
  }
}

// Beside an lr in device memory, the constants made without lr are still checked
// (adam.h StepParams): eps past fp32's range or rounding to 0 in it, an L2
// weight_decay past it; AdamW's 1 - lr * weight_decay, made from the lr, is not.
TEST(CudaValidationTest, LrInDeviceMemoryLeavesTheOtherConstantsChecked) {
  float buffers[4][8] = {};
  TensorSlot s = Fp32Slot(buffers);
  alignas(8) static const double lr = 1e-3;  // stands in for device memory
  const struct {
    double eps, weight_decay;
    bool adam_w_mode;
    const char* rule;  // nullptr: accepted by these checks
  } cases[] = {
      {1e39, 0.0, true, "eps is beyond fp32's range"},
      {1e-46, 0.0, true, "eps 1e-46 rounds to 0 in fp32"},
      {1e-8, 1e39, false, "weight_decay is beyond fp32's range"},
      {1e-8, 1e39, true, nullptr},
  };
  for (const auto& c : cases) {
    StepParams params;
    params.lr_in_device_memory = &lr;
    params.eps = c.eps;
    params.weight_decay = c.weight_decay;
    params.adam_w_mode = c.adam_w_mode;
    Error error;
    // Without a workspace: a call past the hyper-parameters' checks is refused for it.
    EXPECT_EQ(AdamStepCuda(&s, 1, params, nullptr, 0, nullptr, -1, &error),
              Status::kInvalidArgument);
    const std::string expected = c.rule != nullptr ? c.rule : "workspace";
    EXPECT_NE(error.message.find(expected), std::string::npos) << error.message;
    if (expected.find("beyond") != std::string::npos) {  // the lr is not a host value
      EXPECT_NE(error.message.find("(lr in device memory,"), std::string::npos)
          << error.message;
    }
  }
  for (int k = 0; k < 4; ++k) {
    for (float x : buffers[k]) EXPECT_EQ(x, 0.0f);
  }
}

TEST(CudaValidationTest, WithoutDeviceAValidCallReportsTheRuntimeError) {
  if (HaveDevice()) GTEST_SKIP() << "a CUDA device is present";
  float buffers[4][8] = {};
  TensorSlot s = Fp32Slot(buffers);
  Error error;
  int dummy[4] = {};
  EXPECT_EQ(AdamStepCuda(&s, 1, StepParams(), dummy, sizeof(dummy), nullptr, -1, &error),
            Status::kDeviceError);
  EXPECT_NE(error.message.find("failed: cuda"), std::string::npos) << error.message;
  EXPECT_EQ(AdamStepCuda(&s, 1, StepParams(), dummy, sizeof(dummy), nullptr, 0, &error),
            Status::kDeviceError);
  EXPECT_NE(error.message.find("cudaSetDevice failed"), std::string::npos) << error.message;
  EXPECT_FALSE(CudaKernelsRunOn(0));
  for (int k = 0; k < 4; ++k) {
    for (float x : buffers[k]) EXPECT_EQ(x, 0.0f);
  }
}

}  // namespace
}  // namespace testing
}  // namespace shardadam
