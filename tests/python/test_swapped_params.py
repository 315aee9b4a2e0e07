"""State of parameters that left every group (S1.6).

State exists from construction, so an optimizer built over whole parameters whose groups
are then handed the sharded ones (accelerate's FSDP2 ``prepare`` swaps them in
``param_groups``) holds state for tensors it no longer steps. The next step that
completes drops it, with its scales, formats and following masters, so neither it nor the
old parameters (its keys) stay alive; a refused step keeps it. The distributed twin
(FSDP2 on gloo ranks) is ``distributed/test_dist_fsdp2.py``'s built-before-sharding case.
"""

import gc
import operator
import weakref

import pytest
import torch

from _optimizer_testing import (assert_same_optimizer_state, assert_unchanged,
                                backend_context, fused_adam, snapshot)

PRESETS = {
    "fp32": dict(),
    "bf16-fp8-master": dict(master_weights=True, exp_avg_dtype=torch.uint8,
                            exp_avg_sq_dtype=torch.uint8),
    "bf16-remainder-block8": dict(master_weights=True, store_param_remainders=True,
                                  moment_format="block8"),
}
BACKENDS = ["auto", "torch"]


def _whole(preset, seed=0):
    dtype = torch.float32 if preset == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
            for shape in ((16, 256), (256,), (8, 256))]


def _shards(params):
    """The first rows of each parameter, as new tensors (a shard's shape and values)."""
    return [torch.nn.Parameter(p.detach()[: max(1, p.shape[0] // 2)].clone())
            for p in params]


def _set_grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_state_of_swapped_out_parameters_is_dropped(preset, backend):
    kwargs = dict(lr=1e-2, weight_decay=0.01, **PRESETS[preset])
    with backend_context(backend):
        whole = _whole(preset)
        opt = fused_adam()(whole, **kwargs)
        shards = _shards(whole)
        twin_params = [torch.nn.Parameter(p.detach().clone()) for p in shards]
        twin = fused_adam()(twin_params, **kwargs)  # built over the shards themselves
        opt.param_groups[0]["params"] = list(shards)  # as accelerate's prepare does
        gone = [weakref.ref(p) for p in whole]
        left = [opt.state[p] for p in whole]  # their full-size state, held here only
        gone += [weakref.ref(t) for entry in left for t in entry.values()
                 if isinstance(t, torch.Tensor)]
        del whole, left
        for step in range(3):
            _set_grads(shards, step)
            _set_grads(twin_params, step)
            opt.step()
            twin.step()
            assert_same_optimizer_state(twin, opt, twin_params, shards, f"step {step}")
            kept = [id(p) for p in shards]
            for name, container in (("state", opt.state), ("_scales", opt._scales),
                                    ("_formats", opt._formats), ("_seeded", opt._seeded)):
                assert all(id(key) in kept for key in container), \
                    f"step {step}: {name} still holds a swapped-out parameter"
        gc.collect()
        assert all(ref() is None for ref in gone), \
            "the swapped-out parameters or their state are still alive"


def test_a_refused_step_keeps_the_state_of_swapped_out_parameters():
    whole = _whole("bf16-fp8-master")
    opt = fused_adam()(whole, lr=1e-2, **PRESETS["bf16-fp8-master"])
    shards = _shards(whole)
    opt.param_groups[0]["params"] = list(shards)
    _set_grads(shards, 0)
    shards[1].grad = shards[1].detach()  # in the memory the step writes: refused
    before = snapshot(opt, whole)
    with pytest.raises(ValueError, match="shares memory"):
        opt.step()
    assert_unchanged(opt, before, "after the refused step")
    assert all(p in opt.state for p in whole)


def test_a_parameter_moved_between_groups_keeps_its_state():
    params = _whole("fp32")
    opt = fused_adam()([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    _set_grads(params, 0)
    opt.step()
    moved = opt.state[params[1]]["exp_avg"].clone()
    opt.param_groups[0]["params"] = [params[0]]
    opt.param_groups[1]["params"] = [params[2], params[1]]
    opt.step()  # re-planned: every parameter is still held
    assert all(p in opt.state for p in params)
    assert torch.equal(opt.state[params[1]]["exp_avg"],
                       0.9 * moved + 0.1 * params[1].grad)  # stepped from its moments


@pytest.mark.parametrize("preset", sorted(PRESETS) + ["bf16-sr-block4"])
def test_parameters_swapped_in_place_step_on(preset):
    """``nn.Module._apply`` swaps a parameter's contents in place with
    ``torch.utils.swap_tensors`` (always for DTensors, so FSDP2's ``to_empty`` and
    ``model.to``), which refuses a tensor anything holds a weak reference to: the
    optimizer holds none, for any state format, and the swapped parameter, the same
    object, steps on bitwise as one never swapped (its scaled state still its own)."""
    kwargs = dict(lr=1e-2, weight_decay=0.01,
                  **(PRESETS.get(preset) or dict(param_rounding="stochastic",
                                                  moment_format="block4")))
    dtype_of = "fp32" if preset == "fp32" else "bf16"
    params, twin_params = _whole(dtype_of), _whole(dtype_of)
    opt, twin = fused_adam()(params, **kwargs), fused_adam()(twin_params, **kwargs)
    for step in (1, 2, 3):
        _set_grads(params, step)
        _set_grads(twin_params, step)
        opt.step()
        twin.step()
        assert all(weakref.getweakrefs(p) == [] for p in params), \
            f"step {step}: the optimizer holds a weak reference to a parameter"
        if step == 1:  # what nn.Module._apply does under swap_module_params_on_conversion
            for p in params:
                torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().clone()))
    assert_same_optimizer_state(twin, opt, twin_params, params, f"{preset}, swapped")


def test_module_to_with_swapping_steps_on():
    """``model.to(dtype)`` under ``torch.__future__.set_swap_module_params_on_conversion``
    (how torch converts DTensor parameters) with block moments alive: the parameters
    change dtype in place, and the steps after it (S1.5, S2.5) are bitwise those after
    torch's other way, ``param.data = ...``."""
    models, opts = [], []
    for swap in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 8).to(torch.bfloat16)
        opt = fused_adam()(model.parameters(), lr=1e-2, master_weights=True,
                           moment_format="block8")
        model(torch.ones(4, 256, dtype=torch.bfloat16)).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
        params = list(model.parameters())
        swapping = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(swap)
        try:
            model.to(torch.float32)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swapping)
        assert all(map(operator.is_, params, model.parameters()))
        assert all(p.dtype == torch.float32 for p in params)
        for _ in range(2):
            model(torch.ones(4, 256)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        models.append(params)
        opts.append(opt)
    assert_same_optimizer_state(opts[1], opts[0], models[1], models[0],
                                "model.to(float32), swapped and set")


@pytest.mark.parametrize("which", ["last", "first", "added-never-stepped"])
def test_state_of_a_removed_group_is_dropped(which):
    """S1.6: a group removed from ``param_groups`` takes its parameters out of every
    group: the next step drops their state (the last group's too, whose removal leaves
    every other group's plan current, also one added and removed before it stepped),
    and one put back later starts afresh."""
    params = _whole("fp32")
    opt = fused_adam()([{"params": [p]} for p in params], lr=1e-2, moment_format="block8")
    for step in (1, 2, 3):
        _set_grads(params, step)
        opt.step()
    if which == "added-never-stepped":
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(4, 256))]})
    removed = opt.param_groups.pop(0 if which == "first" else -1)["params"][0]
    for step in (4, 5):
        _set_grads(params, step)
        opt.step()
    assert removed not in opt.state and removed not in opt._scales
    assert removed not in opt._formats
    opt.add_param_group({"params": [removed]})
    assert all(bool((opt.state[removed][name] == 0).all())
               for name in ("exp_avg", "exp_avg_sq"))
