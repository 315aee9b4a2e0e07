// Test fixtures shared by the C++ suites that step whole tensors: dtype
// configurations, caller-owned tensor buffers (mid-training or from given
// values), the bitwise (NaN-tolerant) comparison of two sets of tensors, and
// the check that one step on every target equals the reference.
#ifndef SHARDADAM_TESTS_CPP_TENSOR_FIXTURE_H_
#define SHARDADAM_TESTS_CPP_TENSOR_FIXTURE_H_

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "reference.h"
#include "shardadam/adam.h"
#include "test_util.h"

namespace shardadam {
namespace testing {

namespace ref = reference;

// One tensor's dtypes and the update mode.
struct Config {
  DType param;
  DType grad;
  DType exp_avg;
  DType exp_avg_sq;
  DType master;
  bool adam_w;
};

inline std::string ConfigName(const Config& c) {
  return "p_" + DTypeName(c.param) + "_g_" + DTypeName(c.grad) + "_m_" +
         DTypeName(c.exp_avg) + "_v_" + DTypeName(c.exp_avg_sq) + "_master_" +
         DTypeName(c.master) + (c.adam_w ? "_adamw" : "_l2");
}

// gtest prints a failing case's parameter with this (ADL) instead of raw bytes.
inline void PrintTo(const Config& c, std::ostream* os) { *os << ConfigName(c); }

// Every legal combination (S1.4, S2.1, S2.5): masters only beside fp16/bf16
// params, remainders only beside bf16 params.
inline std::vector<Config> AllConfigs() {
  const DType params[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  const DType moments[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                           DType::kFloat8E4M3};
  std::vector<Config> configs;
  for (bool adam_w : {true, false}) {
    for (DType p : params) {
      std::vector<DType> masters = {DType::kNone};
      if (p != DType::kFloat32) {
        masters.push_back(DType::kFloat32);
        masters.push_back(DType::kFloat16);
      }
      if (p == DType::kBFloat16) masters.push_back(DType::kInt16Remainder);
      for (DType g : params) {
        for (DType m : moments) {
          for (DType v : moments) {
            for (DType master : masters) {
              configs.push_back({p, g, m, v, master, adam_w});
            }
          }
        }
      }
    }
  }
  return configs;
}

// A few configurations that together touch every codec and every kind of
// kernel (block path; fused with unscaled, fp8, fp16 and fp8 + bf16 moments,
// in AdamW and L2 mode; the even/odd all-16-bit layout), for the costlier tests.
inline std::vector<Config> RepresentativeConfigs() {
  using D = DType;
  return {
      {D::kFloat32, D::kFloat32, D::kFloat32, D::kFloat32, D::kNone, true},
      {D::kBFloat16, D::kBFloat16, D::kFloat8E4M3, D::kFloat16, D::kFloat32,
       true},
      {D::kBFloat16, D::kFloat32, D::kBFloat16, D::kFloat8E4M3,
       D::kInt16Remainder, false},
      {D::kFloat16, D::kFloat16, D::kFloat16, D::kBFloat16, D::kFloat16, true},
      {D::kFloat16, D::kBFloat16, D::kFloat8E4M3, D::kFloat8E4M3, D::kNone,
       false},
      {D::kBFloat16, D::kBFloat16, D::kFloat8E4M3, D::kFloat8E4M3, D::kFloat32,
       true},
      {D::kBFloat16, D::kFloat32, D::kFloat16, D::kFloat16, D::kInt16Remainder,
       false},
      {D::kFloat32, D::kFloat32, D::kFloat8E4M3, D::kFloat8E4M3, D::kNone, false},
      {D::kBFloat16, D::kBFloat16, D::kBFloat16, D::kBFloat16, D::kInt16Remainder,
       true},
      {D::kBFloat16, D::kBFloat16, D::kFloat8E4M3, D::kBFloat16, D::kFloat32, true},
      {D::kBFloat16, D::kFloat32, D::kFloat8E4M3, D::kBFloat16, D::kInt16Remainder,
       false},
  };
}

// Tensors whose bf16 param has no master and is rounded stochastically (S2.14):
// fp32 and bf16 gradients, unscaled, fp8 (per-tensor scaled) and mixed moments,
// each with its rounding_key and the first_index of its first tensor (the
// others follow it; the last key's tensors cross a multiple of 2^32).
struct ParamRoundingCase {
  Config config;
  uint32_t rounding_key;
  int64_t first_index;
};

inline std::string ParamRoundingCaseName(const ParamRoundingCase& c) {
  return ConfigName(c.config) + "_key_" + std::to_string(c.rounding_key) + "_first_" +
         std::to_string(c.first_index);
}

inline void PrintTo(const ParamRoundingCase& c, std::ostream* os) {
  *os << ParamRoundingCaseName(c);
}

inline std::vector<ParamRoundingCase> ParamRoundingCases() {
  using D = DType;
  const struct {
    DType m, v;
  } moments[] = {{D::kFloat32, D::kFloat32},
                 {D::kBFloat16, D::kBFloat16},
                 {D::kFloat8E4M3, D::kFloat8E4M3},
                 {D::kFloat8E4M3, D::kBFloat16}};
  const struct {
    uint32_t key;
    int64_t first;
  } keys[] = {{0u, 0}, {0x5EED1234u, 12345}, {0xFFFFFFFFu, (int64_t{1} << 32) - 4000}};
  std::vector<ParamRoundingCase> cases;
  int k = 0;
  for (bool adam_w : {true, false}) {
    for (DType g : {D::kFloat32, D::kBFloat16}) {
      for (const auto& m : moments) {
        const auto& key = keys[k++ % 3];
        cases.push_back({{D::kBFloat16, g, m.m, m.v, D::kNone, adam_w}, key.key, key.first});
      }
    }
  }
  return cases;
}

// The buffers of one tensor, owned here as a caller would own them. Copies are
// deep, so one starting state can be stepped by two implementations.
// Which buffers a test places one element past a 16-byte boundary: not aligned
// to four elements, so the CUDA kernels move those tensors' elements one at a
// time (else four per access where the layout allows).
enum ShiftedBuffers : unsigned {
  kNoneShifted = 0,
  kParamShifted = 1,
  kGradShifted = 2,
  kExpAvgShifted = 4,
  kExpAvgSqShifted = 8,
  kMasterShifted = 16,
  kAllShifted = 31,
};

struct Tensor {
  Config config;
  int64_t numel = 0;
  std::vector<uint8_t> param, grad, exp_avg, exp_avg_sq, master;
  float exp_avg_scale = 1.0f, exp_avg_sq_scale = 1.0f, master_scale = 1.0f;
  // A bf16 param with no master may round stochastically (S2.14), its bits keyed
  // by rounding_key and first_index.
  Rounding param_rounding = Rounding::kNearest;
  uint32_t rounding_key = 0;
  int64_t first_index = 0;

  TensorSlot Slot() {
    TensorSlot s;
    s.numel = numel;
    s.param_rounding = param_rounding;
    s.rounding_key = rounding_key;
    s.first_index = first_index;
    s.param = param.data();
    s.param_dtype = config.param;
    s.grad = grad.data();
    s.grad_dtype = config.grad;
    s.exp_avg = exp_avg.data();
    s.exp_avg_dtype = config.exp_avg;
    s.exp_avg_scale = &exp_avg_scale;
    s.exp_avg_sq = exp_avg_sq.data();
    s.exp_avg_sq_dtype = config.exp_avg_sq;
    s.exp_avg_sq_scale = &exp_avg_sq_scale;
    if (config.master != DType::kNone) {
      s.master_param = master.data();
      s.master_dtype = config.master;
      s.master_scale = &master_scale;
    }
    return s;
  }
};

// Sets `t` (the k-th tensor of a case) to round its param as the case says.
inline void SetParamRounding(const ParamRoundingCase& c, int k, Tensor* t) {
  t->param_rounding = Rounding::kStochastic;
  t->rounding_key = c.rounding_key;
  t->first_index = c.first_index + 3 * int64_t{k};
}

// A buffer of n elements of `dtype`; never empty, so that even an empty tensor
// has a distinct, non-null address.
inline std::vector<uint8_t> Buffer(DType dtype, int64_t n) {
  return std::vector<uint8_t>(std::max<size_t>(1, BufferBytes(dtype, n)), 0);
}

// Stores true values u as a state of `dtype` with the S2.3 scale.
inline void StoreState(const std::vector<float>& u, DType dtype,
                std::vector<uint8_t>* buffer, float* scale) {
  const int64_t n = static_cast<int64_t>(u.size());
  *scale = ref::MeasureScale(u.data(), n, dtype);
  for (int64_t i = 0; i < n; ++i) {
    ref::StoreElement(buffer->data(), dtype, i,
                      IsScaled(dtype) ? u[i] / *scale : u[i]);
  }
}

inline std::vector<float> Normal(std::mt19937* rng, int64_t n, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> out(n);
  for (float& x : out) x = dist(*rng);
  return out;
}

// Writes a fresh gradient (as a training loop would before each step).
inline void FillGrad(Tensor* t, std::mt19937* rng) {
  const std::vector<float> g = Normal(rng, t->numel, 0.5f);
  for (int64_t i = 0; i < t->numel; ++i) {
    ref::StoreElement(t->grad.data(), t->config.grad, i, g[i]);
  }
}

// A tensor holding the true values w (weights), m, v (moments) and g (grad),
// each stored as its dtype rounds it (scaled states with the S2.3 scale, the
// master consistent with the param as S2.5 / S3.6 leave it).
inline Tensor TensorFromValues(const Config& config, const std::vector<float>& w,
                               const std::vector<float>& m, const std::vector<float>& v,
                               const std::vector<float>& g) {
  const int64_t numel = static_cast<int64_t>(w.size());
  Tensor t;
  t.config = config;
  t.numel = numel;
  t.param = Buffer(config.param, numel);
  t.grad = Buffer(config.grad, numel);
  t.exp_avg = Buffer(config.exp_avg, numel);
  t.exp_avg_sq = Buffer(config.exp_avg_sq, numel);
  t.master = Buffer(
      config.master == DType::kNone ? DType::kFloat32 : config.master, numel);
  if (config.master == DType::kInt16Remainder) {
    for (int64_t i = 0; i < numel; ++i) {
      ref::SplitMaster(w[i], reinterpret_cast<uint16_t*>(t.param.data()) + i,
                       reinterpret_cast<int16_t*>(t.master.data()) + i);
    }
  } else {
    for (int64_t i = 0; i < numel; ++i) {
      ref::StoreElement(t.param.data(), config.param, i, w[i]);
    }
    if (config.master != DType::kNone) {
      StoreState(w, config.master, &t.master, &t.master_scale);
    }
  }
  StoreState(m, config.exp_avg, &t.exp_avg, &t.exp_avg_scale);
  StoreState(v, config.exp_avg_sq, &t.exp_avg_sq, &t.exp_avg_sq_scale);
  for (int64_t i = 0; i < numel; ++i) {
    ref::StoreElement(t.grad.data(), config.grad, i, g[i]);
  }
  return t;
}

// A tensor mid-training: weights, non-zero moments and a fresh gradient.
inline Tensor MakeTensor(const Config& config, int64_t numel, std::mt19937* rng) {
  const std::vector<float> w = Normal(rng, numel, 1.0f);
  std::vector<float> m = Normal(rng, numel, 0.05f),
                     v = Normal(rng, numel, 0.02f);
  for (float& x : v) x = x * x;
  const std::vector<float> g = Normal(rng, numel, 0.5f);
  return TensorFromValues(config, w, m, v, g);
}

inline std::vector<TensorSlot> Slots(std::vector<Tensor>* tensors) {
  std::vector<TensorSlot> slots;
  for (Tensor& t : *tensors) slots.push_back(t.Slot());
  return slots;
}

// Every buffer and scale of `got` equals `want` (NaN matches any NaN).
inline ::testing::AssertionResult SameTensors(const std::vector<Tensor>& want,
                                       const std::vector<Tensor>& got) {
  for (size_t k = 0; k < want.size(); ++k) {
    const Tensor& a = want[k];
    const Tensor& b = got[k];
    const Config& c = a.config;
    const struct {
      const char* name;
      const std::vector<uint8_t>& x;
      const std::vector<uint8_t>& y;
      DType dtype;
    } buffers[] = {
        {"param", a.param, b.param, c.param},
        {"grad", a.grad, b.grad, c.grad},
        {"exp_avg", a.exp_avg, b.exp_avg, c.exp_avg},
        {"exp_avg_sq", a.exp_avg_sq, b.exp_avg_sq, c.exp_avg_sq},
        {"master_param", a.master, b.master, c.master},
    };
    for (const auto& buffer : buffers) {
      if (buffer.dtype == DType::kNone) continue;
      ::testing::AssertionResult same =
          SameElements(buffer.x.data(), buffer.y.data(), buffer.dtype, a.numel);
      if (!same) {
        return ::testing::AssertionFailure()
               << "tensor " << k << " (numel " << a.numel << ") " << buffer.name
               << ": " << same.message();
      }
    }
    const struct {
      const char* name;
      float x, y;
    } scales[] = {{"exp_avg_scale", a.exp_avg_scale, b.exp_avg_scale},
                  {"exp_avg_sq_scale", a.exp_avg_sq_scale, b.exp_avg_sq_scale},
                  {"master_scale", a.master_scale, b.master_scale}};
    for (const auto& scale : scales) {
      if (BitsOf(scale.x) != BitsOf(scale.y)) {
        return ::testing::AssertionFailure()
               << "tensor " << k << " (numel " << a.numel << ") " << scale.name
               << ": want " << scale.x << " got " << scale.y;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// Hyper-parameters of successive steps: every call is independent, so varying
// them from step to step covers bias correction off and lr = 0 in one run.
inline std::vector<StepParams> Schedule(bool adam_w) {
  std::vector<StepParams> steps;
  StepParams p;
  p.adam_w_mode = adam_w;
  p.lr = 1e-3;
  p.weight_decay = 0.01;
  p.step = 1;
  steps.push_back(p);
  p.lr = 3e-2;
  p.weight_decay = 0.1;
  p.step = 2;
  steps.push_back(p);
  p.lr = 0.0;  // a real step: the moments still move (S3.8)
  p.step = 3;
  steps.push_back(p);
  p.lr = 1e-2;
  p.beta1 = 0.8;
  p.beta2 = 0.99;
  p.eps = 1e-6;
  p.weight_decay = 0.0;
  p.bias_correction = false;
  p.step = 4;
  steps.push_back(p);
  return steps;
}

// One step of `tensors` by the reference and, from the same starting state, by
// the SIMD kernels on every target with each of `thread_counts` threads: all
// must agree. Returns the reference's result (computed once for all of them).
inline std::vector<Tensor> ExpectStepMatchesReference(
    const std::vector<Tensor>& tensors, const StepParams& params,
    std::initializer_list<int> thread_counts) {
  std::vector<Tensor> want = tensors;
  std::vector<TensorSlot> want_slots = Slots(&want);
  ref::AdamStep(want_slots.data(), static_cast<int64_t>(want_slots.size()), params);
  ForEachTarget([&] {
    for (int threads : thread_counts) {
      SCOPED_TRACE("threads " + std::to_string(threads));
      std::vector<Tensor> got = tensors;
      std::vector<TensorSlot> slots = Slots(&got);
      Error error;
      ASSERT_EQ(AdamStep(slots.data(), static_cast<int64_t>(slots.size()), params,
                         threads, &error),
                Status::kOk)
          << error.message;
      ASSERT_TRUE(SameTensors(want, got));
    }
  });
  return want;
}

inline std::vector<Tensor> ExpectStepMatchesReference(
    const std::vector<Tensor>& tensors, const StepParams& params, int threads) {
  return ExpectStepMatchesReference(tensors, params, {threads});
}

}  // namespace testing
}  // namespace shardadam

#endif  // SHARDADAM_TESTS_CPP_TENSOR_FIXTURE_H_
