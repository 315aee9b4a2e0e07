"""Learning rates and AMP (SEMANTICS S3.8): lr as a 0-dim tensor, lr == 0 as a real
step, torch's lr schedulers (which rewrite group["lr"] / group["betas"] between steps),
and torch.amp.GradScaler, which unscales and skips steps itself (FusedAdam accepts and
ignores `grad_scaler`).
"""

import math

import pytest
import torch

from _optimizer_testing import (
    Hyper, Precision, assert_bitwise_equal, assert_same_optimizer_state, attach_grads,
    capture_inputs, clone_params, fused_adam, make_grads, make_params, snapshot,
    assert_unchanged, verify_step)

CFG = Precision(param="bf16", exp_avg="fp8", exp_avg_sq="bf16", master="fp32")
SHAPES = [(4, 3), (5,), (1,)]


def run(lr_value, steps=4, seed=0, **kwargs):
    params = make_params(CFG.param_dtypes(len(SHAPES)), SHAPES, seed=seed)
    opt = fused_adam()(params, lr=lr_value, weight_decay=0.1, **CFG.optimizer_kwargs(),
                       **kwargs)
    for step in range(1, steps + 1):
        grads = make_grads(params, [p.dtype for p in params], step, seed)
        attach_grads(params, grads, False)
        opt.step()
    return opt, params


@pytest.mark.parametrize("shape", [(), (1,)], ids=["0-dim", "1-element"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lr_as_0_dim_tensor(dtype, shape, backend):
    """S3.8: lr as a one-element tensor (0-dim, as schedulers keep it, or of shape (1,))
    gives exactly the run with the same value as a float."""
    lr = torch.full(shape, 1e-2, dtype=dtype)
    a, pa = run(lr)
    b, pb = run(lr.item())
    assert_same_optimizer_state(b, a, pb, pa,
                                f"lr as {dtype} tensor of shape {shape} vs float")


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_lr_zero_is_a_real_step(adam_w_mode, backend):
    """S3.8: lr == 0 moves the moments and the step count; weights (params and masters)
    stay bitwise, weight decay included."""
    hyper = Hyper(lr=0.0, weight_decay=0.3, adam_w_mode=adam_w_mode)
    params = make_params(CFG.param_dtypes(len(SHAPES)), SHAPES, seed=1)
    opt = fused_adam()(params, **hyper.optimizer_kwargs(), **CFG.optimizer_kwargs())
    start = [p.detach().clone() for p in params]
    masters = [opt.get_unscaled_state(p, "master_param").clone() for p in params]
    for step in (1, 2, 3):
        grads = make_grads(params, [p.dtype for p in params], step, seed=2)
        attach_grads(params, grads, False)
        inputs = capture_inputs(opt, params)
        opt.step()
        verify_step(opt, params, inputs, grads, hyper, step, "lr 0")
        assert opt.param_groups[0]["step"] == step
    for i, p in enumerate(params):
        assert_bitwise_equal(p.detach(), start[i], f"param {i}")
        assert_bitwise_equal(opt.get_unscaled_state(p, "master_param"), masters[i],
                             f"master {i}")
        assert bool((opt.get_unscaled_state(p, "exp_avg_sq") > 0).any())


def scheduled_run(make_scheduler, steps):
    """Steps with a scheduler; every step is checked against the float64 reference with
    the lr / betas the group holds at that step."""
    params = make_params(CFG.param_dtypes(len(SHAPES)), SHAPES, seed=3)
    opt = fused_adam()(params, lr=0.1, betas=(0.9, 0.99), weight_decay=0.05,
                       **CFG.optimizer_kwargs())
    scheduler = make_scheduler(opt)
    seen = []
    for step in range(1, steps + 1):
        group = opt.param_groups[0]
        hyper = Hyper(lr=float(group["lr"]), betas=tuple(group["betas"]), eps=group["eps"],
                      weight_decay=group["weight_decay"])
        seen.append((hyper.lr, hyper.betas))
        grads = make_grads(params, [p.dtype for p in params], step, seed=4)
        attach_grads(params, grads, False)
        inputs = capture_inputs(opt, params)
        opt.step()
        verify_step(opt, params, inputs, grads, hyper, step, "scheduled")
        scheduler.step()
    return seen


SCHEDULERS = {
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e),
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.2, total_steps=8, cycle_momentum=True, base_momentum=0.8,
        max_momentum=0.95),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_schedulers(name, backend):
    seen = scheduled_run(SCHEDULERS[name], 6)
    assert len({lr for lr, _ in seen}) > 1, "the scheduler never changed lr"
    if name == "OneCycleLR":
        assert len({betas for _, betas in seen}) > 1, "OneCycleLR never changed betas"


def make_model(seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 4, generator=generator)),
            torch.nn.Parameter(torch.randn(4, generator=generator))]


def loss_of(params, x):
    return ((x @ params[0] + params[1]) ** 2).mean()


def test_grad_scaler_unscales_and_steps(backend):
    """S3.8: with GradScaler the step sees unscaled gradients (a power-of-two scale
    unscales exactly): identical to the run without AMP, bitwise."""
    plain, scaled = make_model(5), make_model(5)
    opt_plain = fused_adam()(plain, lr=1e-2, weight_decay=0.01)
    opt_scaled = fused_adam()(scaled, lr=1e-2, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=1)
    generator = torch.Generator().manual_seed(6)
    for _ in range(4):
        x = torch.randn(8, 6, generator=generator)
        opt_plain.zero_grad()
        loss_of(plain, x).backward()
        opt_plain.step()
        opt_scaled.zero_grad()
        scaler.scale(loss_of(scaled, x)).backward()
        scaler.step(opt_scaled)
        scaler.update()
    assert_same_optimizer_state(opt_plain, opt_scaled, plain, scaled, "AMP vs plain")


def test_grad_scaler_skips_non_finite_steps(backend):
    """GradScaler skips the step when a gradient is not finite: nothing changes, the
    step count included."""
    params = make_model(7)
    opt = fused_adam()(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    x = torch.randn(8, 6)
    scaler.scale(loss_of(params, x)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    scaler.scale(loss_of(params, x) * math.inf).backward()
    before = snapshot(opt)
    scaler.step(opt)
    assert_unchanged(opt, before, "after a skipped AMP step")
    assert opt.param_groups[0]["step"] == 1


def test_grad_scaler_argument_is_ignored(backend):
    """S3.8: step(grad_scaler=...) behaves exactly as step() on the same gradients."""
    a, b = make_model(8), make_model(8)
    opt_a, opt_b = fused_adam()(a), fused_adam()(b)
    scaler = torch.amp.GradScaler("cpu")
    generator = torch.Generator().manual_seed(9)
    for p, q in zip(a, b):
        p.grad = torch.randn(p.shape, generator=generator) * 1024
        q.grad = p.grad.clone()
    opt_a.step()
    opt_b.step(grad_scaler=scaler)
    assert_same_optimizer_state(opt_a, opt_b, a, b, "grad_scaler argument")


def test_lr_tensor_in_state_dict_round_trip(backend):
    """A tensor lr survives state_dict / load_state_dict and keeps stepping the same."""
    opt, params = run(torch.tensor(1e-2), steps=2, seed=10)
    new_params = clone_params(params)
    new_opt = fused_adam()(new_params, lr=torch.tensor(1e-2), weight_decay=0.1,
                           **CFG.optimizer_kwargs())
    new_opt.load_state_dict(opt.state_dict())
    for o, ps in ((opt, params), (new_opt, new_params)):
        attach_grads(ps, make_grads(ps, [p.dtype for p in ps], 3, 10), False)
        o.step()
    assert_same_optimizer_state(opt, new_opt, params, new_params, "tensor lr reloaded")
