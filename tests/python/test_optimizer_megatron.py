"""The contract Megatron's precision-aware optimizer relies on (SEMANTICS S3.7, S1.5,
S3.2, S5.1, S5.2).

Optimizer A steps fp32 parameters (no master). Optimizer B steps the same values held as
bf16 parameters with master weights, reading A's gradients as fp32 ``decoupled_grad``.
An fp32 master runs exactly the arithmetic A runs, so after every step B's master is
bitwise A's parameter and B's parameter is that value rounded to bf16. Large lr and
small betas make every step move every weight, so a single divergent bit would grow
visibly over the run.
"""

import pytest
import torch

from _optimizer_testing import (
    Hyper, assert_bitwise_equal, assert_same_optimizer_state, attach_grads, capture_inputs,
    fused_adam, make_params, merge_remainder, split_master, verify_step)

SHAPES = [(8, 8), (3,), (1,), (0,), (5, 1)]
STEPS = 200


@pytest.mark.parametrize("master", ["fp32", "rem"], ids=["master=fp32", "master=rem"])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_bf16_master_equals_fp32_run_bitwise(master, adam_w_mode, backend):
    FusedAdam = fused_adam()
    start = make_params([torch.bfloat16] * len(SHAPES), SHAPES, seed=11)
    a_params = [torch.nn.Parameter(p.detach().float()) for p in start]
    b_params = [torch.nn.Parameter(p.detach().clone()) for p in start]
    hyper = dict(lr=1.0, betas=(0.1, 0.25), eps=1e-8, weight_decay=0.01,
                 adam_w_mode=adam_w_mode)
    a = FusedAdam(a_params, **hyper)
    b = FusedAdam(b_params, **hyper, master_weights=True, use_decoupled_grad=True,
                  store_param_remainders=master == "rem")
    generator = torch.Generator().manual_seed(12)
    for step in range(1, STEPS + 1):
        for p, q in zip(a_params, b_params):
            grad = torch.randn(p.shape, generator=generator)
            p.grad = grad
            q.decoupled_grad = grad.clone()
        a.step()
        b.step()
        for i, (p, q) in enumerate(zip(a_params, b_params)):
            what = f"step {step} param {i}"
            stored = b.get_unscaled_state(q, "master_param")
            if master == "rem":
                assert stored.dtype == torch.int16  # S5.2: the raw remainder
                master_value = merge_remainder(q, stored)
                # S2.5: the param is the master's high half, rounded half away from 0
                expected_param, _ = split_master(p.detach())
            else:
                master_value = stored
                expected_param = p.detach().bfloat16()
            assert_bitwise_equal(master_value, p.detach(), f"{what}: master vs fp32 run")
            assert_bitwise_equal(q.detach(), expected_param, f"{what}: bf16 param")
            assert q.grad is None  # decoupled grads only; .grad never touched


def test_single_argument_initialize_state_reseeds(backend):
    """S5.1: Megatron calls initialize_state(param) with one argument; it recreates the
    state: zero moments, the master seeded from the parameter's current value, and no
    other key of the entry."""
    params = make_params([torch.bfloat16, torch.bfloat16], [(6,), (2, 2)], seed=13)
    opt = fused_adam()(params, lr=0.1, master_weights=True, use_decoupled_grad=True)
    for p in params:
        p.decoupled_grad = torch.randn(p.shape)
    opt.step()
    opt.state[params[0]]["step"] = torch.tensor(1.0)  # as Megatron writes it
    opt.initialize_state(params[0])
    # other keys go with the entry (TE keeps them), and so out of later checkpoints
    assert sorted(opt.state[params[0]]) == ["exp_avg", "exp_avg_sq", "master_param"]
    assert "step" not in opt.state_dict()["state"][0]
    assert_bitwise_equal(opt.get_unscaled_state(params[0], "master_param"),
                         params[0].detach().float(), "re-seeded master")
    for name in ("exp_avg", "exp_avg_sq"):
        assert bool((opt.get_unscaled_state(params[0], name) == 0).all()), name
        # the other parameter's state is untouched
        assert bool((opt.get_unscaled_state(params[1], name) != 0).any()), name
    assert opt.param_groups[0]["step"] == 1  # S1.6: the step count is not touched


def test_master_weights_attribute_read_at_step(backend):
    """S1.5: Megatron flips `master_weights` after construction; the next step uses the
    new value: the bf16 parameter gets an fp32 master seeded from it, updated by this
    step like any master (checked against the float64 reference), and the parameter is
    that master rounded (S3.7)."""
    params = make_params([torch.bfloat16], [(10,)], seed=14)
    hyper = Hyper(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    opt = fused_adam()(params, **hyper.optimizer_kwargs())
    assert "master_param" not in opt.state[params[0]]
    opt.master_weights = True
    grads = [torch.randn(10).bfloat16()]
    attach_grads(params, grads, decoupled=False)
    inputs = capture_inputs(opt, params)  # the weight is the bf16 parameter's value
    opt.step()
    assert opt.get_unscaled_state(params[0], "master_param").dtype == torch.float32
    verify_step(opt, params, inputs, grads, hyper, 1, "master_weights switched on")


def test_master_weights_attribute_switched_off_at_step(backend):
    """S1.5 the other way: with masters in place, `master_weights = False` makes the
    next step start from the bf16 parameter itself (S3.6: no master, so the weight is
    the parameter) and leave no master in the state (S2.1); the moments carry on."""
    params = make_params([torch.bfloat16], [(10,)], seed=16)
    hyper = Hyper(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    opt = fused_adam()(params, master_weights=True, **hyper.optimizer_kwargs())
    attach_grads(params, [torch.randn(10).bfloat16()], decoupled=False)
    opt.step()
    master = opt.get_unscaled_state(params[0], "master_param")
    assert not torch.equal(master, params[0].detach().float()), \
        "the master must hold more than the parameter for this test to tell them apart"
    # a twin that never had a master, holding the same parameter and moments
    twin_params = [torch.nn.Parameter(params[0].detach().clone())]
    twin = fused_adam()(twin_params, **hyper.optimizer_kwargs())
    for name in ("exp_avg", "exp_avg_sq"):
        twin.set_scaled_state(twin_params[0], name,
                              opt.get_unscaled_state(params[0], name))
    twin.param_groups[0]["step"] = 1
    opt.master_weights = False
    grads = [torch.randn(10).bfloat16()]
    attach_grads(params, grads, decoupled=False)
    attach_grads(twin_params, [grads[0].clone()], decoupled=False)
    inputs = capture_inputs(opt, params)
    inputs[0].w = params[0].detach().double()  # the parameter, not the old master
    opt.step()
    twin.step()
    assert "master_param" not in opt.state[params[0]]
    verify_step(opt, params, inputs, grads, hyper, 2, "master_weights switched off")
    assert_same_optimizer_state(twin, opt, twin_params, params, "master_weights off")


def test_use_decoupled_grad_attribute_read_at_step_and_zero_grad(backend):
    """S1.5 / S3.2 / S4: `use_decoupled_grad` switched after construction decides which
    gradient the next step reads and which one zero_grad clears."""
    params = make_params([torch.float32], [(7,)], seed=15)
    opt = fused_adam()(params, lr=1e-2)
    p = params[0]
    p.grad = torch.zeros(7)  # a step reading .grad would only decay the weights
    p.decoupled_grad = torch.ones(7)
    opt.use_decoupled_grad = True
    before = p.detach().clone()
    opt.step()
    # with g = 1 everywhere the first Adam step moves every weight by about -lr
    assert bool((p.detach() < before).all()), "the step did not read decoupled_grad"
    opt.zero_grad()
    assert getattr(p, "decoupled_grad", None) is None
    assert p.grad is not None and bool((p.grad == 0).all()), ".grad must be left alone"
    opt.use_decoupled_grad = False
    p.grad = torch.ones(7)
    opt.zero_grad()
    assert p.grad is None
