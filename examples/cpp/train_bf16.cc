// Trains a tiny linear model y = W x + b on std::vector buffers with the
// shardadam core, stored as a memory-lean mixed-precision run keeps it: bf16
// parameters and gradients, int16 remainders (with the bf16 parameter, an exact
// fp32 master weight) and bf16 moments. Needs nothing but the installed package.
//
// Every step is checked against Adam computed here in float64 from the state
// the step started from, within bounds derived below from the storage formats.
// Checking each step from its own starting state keeps those bounds tight: a
// float64 run of its own would drift from the bf16 one by far more than one
// step's rounding. Then one refused call shows what a caller gets back.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "shardadam/adam.h"

namespace {

// --- bf16 and remainder encodings, written out here (formats.h describes them)

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even, as torch's .to(torch.bfloat16) (no NaN arises here).
uint16_t ToBf16(float f) {
  const uint32_t u = Bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float FromBf16(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

// The fp32 master kept as a bf16 parameter and an int16 remainder: the
// parameter is the master's high half, plus one when the low half (the
// remainder) is >= 0x8000.
float Master(uint16_t param, int16_t remainder) {
  const uint16_t low = static_cast<uint16_t>(remainder);
  const uint32_t high = static_cast<uint32_t>(param) - (low >= 0x8000u ? 1u : 0u);
  return FromBits((high << 16) | low);
}

// A deterministic generator, so every run trains the same model.
struct Random {
  uint64_t state = 0x2545F4914F6CDD1Dull;
  double Uniform() {  // in [-1, 1)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(state >> 11) * 0x1.0p-52 - 1.0;
  }
};

// --- the model: one bf16 tensor per parameter, with its optimizer state

constexpr int kIn = 24, kOut = 16, kSamples = 64;

struct Tensor {
  explicit Tensor(size_t n)
      : param(n), grad(n), remainder(n, 0), exp_avg(n, 0), exp_avg_sq(n, 0) {}
  std::vector<uint16_t> param;       // bf16
  std::vector<uint16_t> grad;        // bf16
  std::vector<int16_t> remainder;    // with param: the fp32 master; starts at 0
  std::vector<uint16_t> exp_avg;     // bf16, starts at 0
  std::vector<uint16_t> exp_avg_sq;  // bf16, starts at 0

  shardadam::TensorSlot Slot() {
    shardadam::TensorSlot s;
    s.numel = static_cast<int64_t>(param.size());
    s.param = param.data();
    s.param_dtype = shardadam::DType::kBFloat16;
    s.grad = grad.data();
    s.grad_dtype = shardadam::DType::kBFloat16;
    s.exp_avg = exp_avg.data();
    s.exp_avg_dtype = shardadam::DType::kBFloat16;
    s.exp_avg_sq = exp_avg_sq.data();
    s.exp_avg_sq_dtype = shardadam::DType::kBFloat16;
    s.master_param = remainder.data();
    s.master_dtype = shardadam::DType::kInt16Remainder;
    return s;  // bf16 states are unscaled: no scale slots
  }
};

struct Data {
  std::vector<double> x, y;  // kSamples x kIn inputs, kSamples x kOut targets
};

// Targets from a fixed "teacher" W*, b*: the model can fit them exactly.
Data MakeData(Random& rng) {
  std::vector<double> w(kOut * kIn), b(kOut);
  for (double& v : w) v = rng.Uniform();
  for (double& v : b) v = 0.5 * rng.Uniform();
  Data d{std::vector<double>(kSamples * kIn), std::vector<double>(kSamples * kOut)};
  for (double& v : d.x) v = rng.Uniform();
  for (int s = 0; s < kSamples; ++s) {
    for (int o = 0; o < kOut; ++o) {
      double acc = b[o];
      for (int i = 0; i < kIn; ++i) acc += w[o * kIn + i] * d.x[s * kIn + i];
      d.y[s * kOut + o] = acc;
    }
  }
  return d;
}

// Mean squared error / 2 of the bf16 model; writes the bf16 gradients.
double LossAndGrad(Tensor& w, Tensor& b, const Data& d) {
  std::vector<double> gw(w.param.size(), 0.0), gb(b.param.size(), 0.0);
  double loss = 0.0;
  for (int s = 0; s < kSamples; ++s) {
    for (int o = 0; o < kOut; ++o) {
      double out = FromBf16(b.param[o]);
      for (int i = 0; i < kIn; ++i)
        out += FromBf16(w.param[o * kIn + i]) * d.x[s * kIn + i];
      const double err = out - d.y[s * kOut + o];
      loss += 0.5 * err * err / kSamples;
      gb[o] += err / kSamples;
      for (int i = 0; i < kIn; ++i) gw[o * kIn + i] += err * d.x[s * kIn + i] / kSamples;
    }
  }
  for (size_t i = 0; i < gw.size(); ++i) w.grad[i] = ToBf16(static_cast<float>(gw[i]));
  for (size_t i = 0; i < gb.size(); ++i) b.grad[i] = ToBf16(static_cast<float>(gb[i]));
  return loss;
}

// --- the float64 check of one step

// What a tensor held before the step, decoded.
struct Before {
  std::vector<double> w, m, v, g;
};

Before Decode(const Tensor& t) {
  Before b;
  for (size_t i = 0; i < t.param.size(); ++i) {
    b.w.push_back(Master(t.param[i], t.remainder[i]));
    b.m.push_back(FromBf16(t.exp_avg[i]));
    b.v.push_back(FromBf16(t.exp_avg_sq[i]));
    b.g.push_back(FromBf16(t.grad[i]));
  }
  return b;
}

// Largest |error| / bound seen per quantity (must stay <= 1).
struct Worst {
  double w = 0, m = 0, v = 0;
};

// Compares the step's result with Adam in float64 from `before`. The core
// works in fp32, then stores. A bf16 moment is its fp32 result rounded to 8
// significant bits, at most 2^-8 of its magnitude away; the fp32 arithmetic
// before adds a few units of 2^-24 of the magnitudes summed (bounded here by
// 2^-20 of them, with room to spare). A moment just above a power of two may
// round by nearly all of that 2^-8, so the worst ratio printed for the moments
// is close to 1 by construction. The master is stored in fp32: 2^-24 of |w| per
// rounding, two of them (the decay and the update), and the update's few fp32
// operations are each within 2^-24 (bounded by 2^-19 of its magnitude).
// Returns the number of elements out of bounds.
int CheckStep(const Before& b, const Tensor& t, const shardadam::StepParams& p,
              Worst& worst) {
  const double c1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
  const double c2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
  int bad = 0;
  const auto judge = [&bad](double got, double want, double bound, double& worst_ratio) {
    const double ratio = std::fabs(got - want) / bound;
    if (ratio > worst_ratio) worst_ratio = ratio;
    if (!(ratio <= 1.0)) ++bad;
  };
  for (size_t i = 0; i < b.w.size(); ++i) {
    const double g = b.g[i];
    const double m = p.beta1 * b.m[i] + (1 - p.beta1) * g;
    const double v = p.beta2 * b.v[i] + (1 - p.beta2) * g * g;
    const double denom = std::sqrt(v / c2) + p.eps;
    const double step = p.lr / c1 * m / denom;
    const double w = b.w[i] * (1 - p.lr * p.weight_decay) - step;

    const double m_terms = p.beta1 * std::fabs(b.m[i]) + (1 - p.beta1) * std::fabs(g);
    const double v_terms = p.beta2 * b.v[i] + (1 - p.beta2) * g * g;
    judge(FromBf16(t.exp_avg[i]), m,
          0x1.0p-8 * std::fabs(m) + 0x1.0p-20 * m_terms + 1e-44, worst.m);
    judge(FromBf16(t.exp_avg_sq[i]), v, 0x1.0p-8 * v + 0x1.0p-20 * v_terms + 1e-44,
          worst.v);
    judge(Master(t.param[i], t.remainder[i]), w,
          0x1.0p-22 * std::fabs(b.w[i]) + 0x1.0p-19 * p.lr / c1 * m_terms / denom + 1e-44,
          worst.w);
  }
  return bad;
}

// --- a refused call

// The bias's gradient pointed at the weight's parameters by mistake: the core
// refuses the call, names both tensors, and writes nothing.
bool ShowRefusal(Tensor& w, Tensor& b, const shardadam::StepParams& params) {
  shardadam::TensorSlot slots[2] = {w.Slot(), b.Slot()};
  slots[1].grad = w.param.data();
  const std::vector<uint16_t> w_before = w.param, m_before = w.exp_avg;
  shardadam::Error error;
  const shardadam::Status status = shardadam::AdamStep(slots, 2, params, 0, &error);
  std::printf("refused call: %s\n  tensor_index %lld, other_tensor_index %lld\n",
              error.message.c_str(), static_cast<long long>(error.tensor_index),
              static_cast<long long>(error.other_tensor_index));
  return status == shardadam::Status::kInvalidArgument && error.tensor_index == 1 &&
         error.other_tensor_index == 0 && w.param == w_before && w.exp_avg == m_before;
}

}  // namespace

int main() {
  // Headers and archive from one install (a mixed one could disagree on layouts).
  if (std::strcmp(shardadam::Version(), SHARDADAM_VERSION_STRING) != 0) {
    std::printf("shardadam headers %s, library %s\n", SHARDADAM_VERSION_STRING,
                shardadam::Version());
    return 1;
  }
  std::printf("shardadam %s\n", shardadam::Version());
  Random rng;
  const Data data = MakeData(rng);
  Tensor weight(kOut * kIn), bias(kOut);
  for (uint16_t& v : weight.param) v = ToBf16(static_cast<float>(0.2 * rng.Uniform()));
  for (uint16_t& v : bias.param) v = ToBf16(0.0f);

  shardadam::StepParams params;
  params.lr = 1e-2;
  params.weight_decay = 1e-3;  // AdamW (adam_w_mode defaults to true)

  const int kSteps = 300;
  double first_loss = 0, loss = 0;
  Worst worst;
  int bad = 0;
  for (int step = 1; step <= kSteps; ++step) {
    loss = LossAndGrad(weight, bias, data);
    if (step == 1) first_loss = loss;
    const Before wb = Decode(weight), bb = Decode(bias);

    params.step = step;  // counted from 1: bias correction uses it
    shardadam::TensorSlot slots[2] = {weight.Slot(), bias.Slot()};
    shardadam::Error error;
    if (shardadam::AdamStep(slots, 2, params, /*num_threads=*/0, &error) !=
        shardadam::Status::kOk) {
      std::printf("step %d refused: %s\n", step, error.message.c_str());
      return 1;
    }
    bad += CheckStep(wb, weight, params, worst) + CheckStep(bb, bias, params, worst);
  }
  const double final_loss = LossAndGrad(weight, bias, data);
  std::printf("SIMD target %s; %d steps, loss %.4g -> %.4g\n", shardadam::ChosenTarget(),
              kSteps, first_loss, final_loss);
  std::printf(
      "vs float64 Adam, worst |error| / bound: master %.3f, exp_avg %.3f, "
      "exp_avg_sq %.3f (%d elements out of bounds)\n",
      worst.w, worst.m, worst.v, bad);
  const bool refused = ShowRefusal(weight, bias, params);

  const bool learned = final_loss < 1e-3 * first_loss;
  if (bad != 0 || !learned || !refused) {
    std::printf("FAIL:%s%s%s\n", bad != 0 ? " steps out of bounds" : "",
                learned ? "" : " loss did not fall below 1e-3 of its start",
                refused ? "" : " the bad call was not refused as expected");
    return 1;
  }
  std::printf("PASS\n");
  return 0;
}
