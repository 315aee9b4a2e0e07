"""What a steady step re-reads, whatever the number of groups.

A step checks that each group's cached plan still holds (``_plan``): the state
containers are listed once per step for every group's check, not once per group (one
group per parameter would make that O(groups × parameters)); the scales' values are
checked through flat views made once per plan; parameters proved apart when the plan
was bound are not compared again. Timing lives in the bench (the ``groups-2000``
case); these tests pin the structure, and that the shared checks still refuse and
accept what they did.
"""

import pytest
import torch

from shardadam import FusedAdam, _plan, _validate

from _optimizer_testing import backend_context, scale_of

pytest.importorskip("shardadam._C")

GROUPS = 40


def _groups(count, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(8, 16, generator=gen).to(dtype))
        p.grad = torch.randn(8, 16, generator=gen).to(dtype)
        params.append(p)
    return params


FP8 = dict(master_weights=True, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)


def test_a_step_lists_each_state_container_once(monkeypatch):
    params = _groups(GROUPS)
    opt = FusedAdam([{"params": [p]} for p in params], lr=1e-3, **FP8)
    opt.step()  # plans built and bound
    listed = []
    original = _plan.Listing.of

    def counting(self, container):
        if id(container) not in self._lists:
            listed.append(id(container))
        return original(self, container)

    monkeypatch.setattr(_plan.Listing, "of", counting)
    for _ in range(3):
        listed.clear()
        opt.step()
        # optimizer.state and optimizer._scales (fp8 moments have scales), once each.
        assert sorted(listed) == sorted({id(opt.state), id(opt._scales)}), len(listed)


def test_a_container_changed_between_steps_is_still_seen():
    """The listing lives for one step's checks only: an entry replaced between steps
    still rebuilds the plan (the replaced tensor is then the state that steps)."""
    params = _groups(GROUPS)
    opt = FusedAdam([{"params": [p]} for p in params], lr=1e-3)
    opt.step()
    target = params[GROUPS // 2]
    replacement = torch.zeros_like(opt.state[target]["exp_avg"])
    opt.state[target]["exp_avg"] = replacement
    opt.step()
    assert opt.state[target]["exp_avg"] is replacement
    assert torch.count_nonzero(replacement) > 0  # stepped: (1 - beta1) * grad


def test_a_bad_scale_of_a_parameter_that_steps_is_refused_and_nothing_changes():
    params = _groups(GROUPS)
    opt = FusedAdam([{"params": [p]} for p in params], lr=1e-3, **FP8)
    opt.step()
    scale_of(opt, params[3], "exp_avg").fill_(float("nan"))
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="exp_avg_scale"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach().view(torch.int16), b.view(torch.int16))


def test_a_bad_scale_of_a_parameter_without_gradient_does_not_stop_the_step():
    """The core reads only the tensors that step: a parameter without a gradient is
    not read, so its scale's value refuses nothing (the shared check of every scale
    of the plan then falls back to the core's check of the calls)."""
    params = _groups(GROUPS)
    opt = FusedAdam([{"params": [p]} for p in params], lr=1e-3, **FP8)
    opt.step()
    idle = params[3]
    idle.grad = None
    opt.step()  # the same gradients from here on: the checks that passed stand
    scale_of(opt, idle, "exp_avg").fill_(float("nan"))
    idle_before = idle.detach().clone()
    stepping_before = params[4].detach().clone()
    opt.step()
    assert torch.equal(idle.detach().view(torch.int16), idle_before.view(torch.int16))
    assert not torch.equal(params[4].detach(), stepping_before)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_interleaved_parameters_are_not_compared_byte_by_byte_at_every_step(
        monkeypatch, backend):
    """Two parameters that interleave in one matrix (its even and odd columns) were
    proved apart when the plan was bound; a later step compares only gradients with
    the memory it writes, so their bytes are not compared again (a byte comparison
    waits for the device on a GPU). A gradient in a parameter's memory is still
    refused at every step (test_optimizer_errors)."""
    matrix = torch.randn(6, 8)
    params = [torch.nn.Parameter(matrix[:, 0::2]), torch.nn.Parameter(matrix[:, 1::2])]
    opt = FusedAdam(params, lr=1e-3)
    compared = []
    original = _validate.share_bytes

    def counting(a, b):
        compared.append((a.data_ptr(), b.data_ptr()))
        return original(a, b)

    with backend_context(backend):
        for p in params:
            p.grad = torch.ones(6, 4)
        opt.step()  # binds: the parameters are compared here
        monkeypatch.setattr(_validate, "share_bytes", counting)
        for _ in range(2):
            opt.step()
    assert compared == []
