// Trains a torch::nn::Linear with AdamW steps taken by the shardadam core on the
// parameters' own fp32 memory, and compares with torch::optim::AdamW stepping a
// copy of the model fed the same gradients. Then one refused call shows what a
// caller gets back.
//
// Tolerance: with equal inputs, the core's fp32 update and torch's differ by a
// few units in the last place (2^-24 relative): both compute the same formula
// in fp32, but in a different order (torch divides m by the denominator before
// scaling by the step size, the core scales first). Equal gradients keep such
// differences from feeding back through the loss, so over `kSteps` steps they
// add up at most linearly: every value is compared within kSteps * 4 * 2^-24 of
// its scale (|value| plus lr for the weights; the tensor's largest value for
// the moments, whose near-zero elements come from cancelling sums).
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "shardadam/adam.h"

namespace {

constexpr int kSteps = 20;

// The core's fp32 moments of one parameter, shaped like it. fp32 states are
// unscaled: no scale slots.
struct Moments {
  torch::Tensor exp_avg, exp_avg_sq;
};

// One slot per parameter: fp32 param, gradient and moments, no master (an fp32
// parameter is its own). The core reads and writes the tensors' memory, so
// each must be a contiguous fp32 CPU tensor.
std::vector<shardadam::TensorSlot> Slots(const std::vector<torch::Tensor>& params,
                                         std::vector<Moments>& moments) {
  std::vector<shardadam::TensorSlot> slots;
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i];
    const torch::Tensor& g = p.grad();
    const torch::Tensor* tensors[] = {&p, &g, &moments[i].exp_avg,
                                      &moments[i].exp_avg_sq};
    for (const torch::Tensor* t : tensors) {
      TORCH_CHECK(t->defined() && t->is_cpu() && t->is_contiguous() &&
                      t->scalar_type() == torch::kFloat32,
                  "the core steps contiguous fp32 CPU tensors");
    }
    shardadam::TensorSlot s;  // dtype tags default to fp32, master to none
    s.numel = p.numel();
    s.param = p.data_ptr<float>();
    s.grad = g.data_ptr<float>();
    s.exp_avg = moments[i].exp_avg.data_ptr<float>();
    s.exp_avg_sq = moments[i].exp_avg_sq.data_ptr<float>();
    slots.push_back(s);
  }
  return slots;
}

// Largest |got - want| / (kSteps * 4 * 2^-24 * scale); must stay <= 1.
double WorstRatio(const torch::Tensor& got, const torch::Tensor& want,
                  const torch::Tensor& scale) {
  const torch::Tensor bound = scale * (kSteps * 4 * 0x1.0p-24);
  return ((got - want).abs() / bound).max().item<double>();
}

}  // namespace

int main() {
  torch::manual_seed(0);
  torch::nn::Linear model(16, 4), twin(16, 4), teacher(16, 4);
  const std::vector<torch::Tensor> params = model->parameters();
  const std::vector<torch::Tensor> twin_params = twin->parameters();
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) twin_params[i].copy_(params[i]);
  }
  const torch::Tensor x = torch::randn({64, 16});
  const torch::Tensor y = teacher(x).detach();

  shardadam::StepParams hp;
  hp.lr = 1e-2;
  hp.weight_decay = 1e-2;
  torch::optim::AdamW reference(twin_params, torch::optim::AdamWOptions(hp.lr)
                                                 .betas({hp.beta1, hp.beta2})
                                                 .eps(hp.eps)
                                                 .weight_decay(hp.weight_decay));

  std::vector<Moments> moments;
  for (const torch::Tensor& p : params) {
    moments.push_back({torch::zeros_like(p), torch::zeros_like(p)});
  }

  double first_loss = 0, loss = 0;
  for (int step = 1; step <= kSteps; ++step) {
    model->zero_grad();
    torch::Tensor l = (model(x) - y).pow(2).mean();
    l.backward();
    loss = l.item<double>();
    if (step == 1) first_loss = loss;

    for (size_t i = 0; i < params.size(); ++i) {
      twin_params[i].mutable_grad() = params[i].grad().clone();
    }
    reference.step();

    hp.step = step;
    std::vector<shardadam::TensorSlot> slots = Slots(params, moments);
    shardadam::Error error;
    if (shardadam::AdamStep(slots.data(), static_cast<int64_t>(slots.size()), hp, 0,
                            &error) != shardadam::Status::kOk) {
      std::printf("step %d refused: %s\n", step, error.message.c_str());
      return 1;
    }
  }

  double worst_w = 0, worst_m = 0, worst_v = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& want = twin_params[i];
    const auto& state = static_cast<const torch::optim::AdamWParamState&>(
        *reference.state().at(want.unsafeGetTensorImpl()));
    worst_w = std::max(worst_w, WorstRatio(params[i], want, want.abs() + hp.lr));
    worst_m = std::max(worst_m, WorstRatio(moments[i].exp_avg, state.exp_avg(),
                                           state.exp_avg().abs().max()));
    worst_v = std::max(worst_v, WorstRatio(moments[i].exp_avg_sq, state.exp_avg_sq(),
                                           state.exp_avg_sq().abs().max()));
  }
  std::printf("%d steps, loss %.4g -> %.4g\n", kSteps, first_loss, loss);
  std::printf(
      "vs torch::optim::AdamW, worst |difference| / tolerance: weights %.3f, "
      "exp_avg %.3f, exp_avg_sq %.3f\n",
      worst_w, worst_m, worst_v);

  // A step counter started at 0: refused (steps count from 1), nothing written.
  const torch::Tensor weight_before = params[0].clone();
  hp.step = 0;
  std::vector<shardadam::TensorSlot> slots = Slots(params, moments);
  shardadam::Error error;
  const shardadam::Status status = shardadam::AdamStep(
      slots.data(), static_cast<int64_t>(slots.size()), hp, 0, &error);
  std::printf("refused call: %s\n  tensor_index %lld (a hyper-parameter)\n",
              error.message.c_str(), static_cast<long long>(error.tensor_index));
  const bool refused = status == shardadam::Status::kInvalidArgument &&
                       error.tensor_index == -1 && torch::equal(params[0], weight_before);

  const bool close = worst_w <= 1 && worst_m <= 1 && worst_v <= 1;
  const bool learned = loss < 0.5 * first_loss;
  if (!close || !learned || !refused) {
    std::printf("FAIL:%s%s%s\n", close ? "" : " beyond the tolerance",
                learned ? "" : " loss did not halve",
                refused ? "" : " the bad call was not refused as expected");
    return 1;
  }
  std::printf("PASS\n");
  return 0;
}
