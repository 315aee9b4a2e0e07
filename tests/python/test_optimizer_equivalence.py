"""fp32 parameters: FusedAdam against torch.optim.AdamW(fused=True) / Adam(fused=True)
(SEMANTICS S3.7) and against the float64 reference of _optimizer_testing.py.

S3.7 asks for agreement "within a few fp32 ulps per step". Each step therefore starts
torch's optimizer from FusedAdam's current params and moments: from identical inputs,
each implementation is within the derived fp32 bound B of the exact step
(_optimizer_testing.adam_reference), so the two are within 2B of each other. FusedAdam
alone is held to B against the float64 reference. bias_correction=False (S1.3) has no
torch counterpart and is checked against the float64 reference only.
"""

import pytest
import torch

from _optimizer_testing import (
    Hyper, adam_reference, assert_close_bounded, attach_grads, capture_inputs,
    fused_adam, make_grads, verify_step)

# Three groups with different hyper-parameters; shapes include 0-size, 0-dim and
# 1-element parameters.
GROUPS = [
    (dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
     [(5, 7), (1,), (0,), ()]),
    (dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
     [(33,), (2, 3, 4), (0, 3)]),
    (dict(lr=0.1, betas=(0.0, 0.5), eps=1e-4, weight_decay=1.0), [(17,), (1, 1)]),
]
STEPS = 20


def make_groups(seed):
    generator = torch.Generator().manual_seed(seed)
    groups = []
    for options, shapes in GROUPS:
        params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
        groups.append(dict(options, params=params))
    return groups


def all_params(groups):
    return [p for g in groups for p in g["params"]]


def group_hyper(options, adam_w_mode, bias_correction=True):
    return Hyper(lr=options["lr"], betas=options["betas"], eps=options["eps"],
                 weight_decay=options["weight_decay"], adam_w_mode=adam_w_mode,
                 bias_correction=bias_correction)


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["AdamW", "Adam-L2"])
def test_fp32_matches_torch_fused_per_step(adam_w_mode, backend):
    ours_groups, theirs_groups = make_groups(0), make_groups(0)
    ours = fused_adam()(ours_groups, adam_w_mode=adam_w_mode)
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    theirs = torch_cls(theirs_groups, fused=True)
    ours_params, theirs_params = all_params(ours_groups), all_params(theirs_groups)
    for step in range(1, STEPS + 1):
        grads = make_grads(ours_params, [torch.float32] * len(ours_params), step, seed=1)
        attach_grads(ours_params, grads, decoupled=False)
        attach_grads(theirs_params, [g.clone() for g in grads], decoupled=False)
        # torch starts this step from exactly what FusedAdam holds
        for p, q in zip(ours_params, theirs_params):
            with torch.no_grad():
                q.copy_(p)
            theirs.state[q] = {
                "step": torch.tensor(float(step - 1)),
                "exp_avg": ours.get_unscaled_state(p, "exp_avg").clone(),
                "exp_avg_sq": ours.get_unscaled_state(p, "exp_avg_sq").clone(),
            }
        inputs = capture_inputs(ours, ours_params)
        ours.step()
        theirs.step()
        start = 0
        for g, (options, shapes) in enumerate(GROUPS):
            hyper = group_hyper(options, adam_w_mode)
            count = len(shapes)
            params = ours_params[start:start + count]
            verify_step(ours, params, inputs[start:start + count],
                        grads[start:start + count], hyper, step, f"group {g}")
            for i in range(start, start + count):
                p, q, before = ours_params[i], theirs_params[i], inputs[i]
                ref = adam_reference(before.w, before.m, before.v, grads[i].double(), hyper,
                                     step)
                what = f"step {step} group {g} param {i} vs torch {torch_cls.__name__}"
                assert_close_bounded(p.detach(), q.detach().double(), 2 * ref.w_bound,
                                     f"{what}: param")
                assert_close_bounded(ours.get_unscaled_state(p, "exp_avg"),
                                     theirs.state[q]["exp_avg"].double(), 2 * ref.m_bound,
                                     f"{what}: exp_avg")
                assert_close_bounded(ours.get_unscaled_state(p, "exp_avg_sq"),
                                     theirs.state[q]["exp_avg_sq"].double(),
                                     2 * ref.v_bound, f"{what}: exp_avg_sq")
            start += count
        assert [group["step"] for group in ours.param_groups] == [step] * len(GROUPS)


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["AdamW", "Adam-L2"])
def test_without_bias_correction_matches_float64(adam_w_mode, backend):
    """S1.3: both corrections are 1."""
    groups = make_groups(2)
    params = all_params(groups)
    opt = fused_adam()(groups, adam_w_mode=adam_w_mode, bias_correction=False)
    for step in range(1, STEPS + 1):
        grads = make_grads(params, [torch.float32] * len(params), step, seed=3)
        attach_grads(params, grads, decoupled=False)
        inputs = capture_inputs(opt, params)
        opt.step()
        start = 0
        for g, (options, shapes) in enumerate(GROUPS):
            count = len(shapes)
            verify_step(opt, params[start:start + count], inputs[start:start + count],
                        grads[start:start + count],
                        group_hyper(options, adam_w_mode, bias_correction=False), step,
                        f"group {g}")
            start += count


def test_bias_correction_is_per_group(backend):
    """bias_correction is a group option (TE keeps it in the defaults): one group with
    and one without, each checked against its own reference."""
    generator = torch.Generator().manual_seed(4)
    a = [torch.nn.Parameter(torch.randn(9, generator=generator))]
    b = [torch.nn.Parameter(torch.randn(9, generator=generator))]
    opt = fused_adam()([dict(params=a), dict(params=b, bias_correction=False)], lr=1e-2)
    for step in range(1, 6):
        grads = make_grads(a + b, [torch.float32] * 2, step, seed=5)
        attach_grads(a + b, grads, decoupled=False)
        inputs = capture_inputs(opt, a + b)
        opt.step()
        verify_step(opt, a, inputs[:1], grads[:1], Hyper(lr=1e-2, weight_decay=0.0,
                                                         betas=(0.9, 0.999)), step, "bc on")
        verify_step(opt, b, inputs[1:], grads[1:],
                    Hyper(lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999),
                          bias_correction=False), step, "bc off")


def test_group_hyper_parameters_are_read_every_step(backend):
    """Changing a group's lr, betas, eps or weight_decay between steps takes effect at
    the next step (torch semantics; schedulers rely on it)."""
    generator = torch.Generator().manual_seed(6)
    params = [torch.nn.Parameter(torch.randn(12, generator=generator))]
    opt = fused_adam()(params, lr=1e-3, weight_decay=0.01)
    settings = [dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
                dict(lr=5e-2, betas=(0.5, 0.9), eps=1e-3, weight_decay=0.3),
                dict(lr=2e-2, betas=(0.99, 0.9999), eps=1e-8, weight_decay=0.0)]
    for step, options in enumerate(settings, start=1):
        opt.param_groups[0].update(options)
        grads = make_grads(params, [torch.float32], step, seed=7)
        attach_grads(params, grads, decoupled=False)
        inputs = capture_inputs(opt, params)
        opt.step()
        verify_step(opt, params, inputs, grads, Hyper(**options), step, f"settings {step}")
