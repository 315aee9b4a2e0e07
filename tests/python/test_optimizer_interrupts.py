"""A step is whole or not taken (S3.1) when a signal or an error lands in the middle of
it, and state made under ``torch.inference_mode`` steps outside it."""

import signal

import pytest
import torch

from _optimizer_testing import assert_bitwise_equal, attach_grads, fused_adam, make_params

SETTINGS = dict(lr=1e-2, weight_decay=0.05, master_weights=True)
SHAPES = [(64, 33), (33, 64), (17,)]


def _grads(params):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _two_groups(params):
    return [dict(params=params[:1]), dict(params=params[1:])]


def _strided(params):
    """params[1] as a transposed view: the C++ path steps a copy and writes it back."""
    base = torch.nn.Parameter(params[1].detach().t().contiguous())
    params[1] = torch.nn.Parameter(base.detach().t())
    return params


def _assert_same(params, ref, opt, ref_opt, where):
    for p, q in zip(params, ref):
        assert_bitwise_equal(p.detach(), q.detach(), f"param {where}")
        for name, value in ref_opt.state[q].items():
            got = opt.state[p][name]
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(got, value, f"{name} {where}")
    assert [g["step"] for g in opt.param_groups] == [g["step"] for g in ref_opt.param_groups]


@pytest.mark.parametrize("at_call", [1, 2])
def test_ctrl_c_during_a_step_waits_until_the_step_is_whole(backend, monkeypatch, at_call):
    """A SIGINT that arrives while the groups' batches run (the core releases the GIL,
    so Python's handler runs right after a batch) raises its KeyboardInterrupt once
    every group is stepped, counted and written back: the state is the uninterrupted
    step's, and the handler is back in place."""
    from shardadam import _backend

    params = _strided(make_params([torch.bfloat16] * 3, SHAPES, seed=3))
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = fused_adam()(_two_groups(params), **SETTINGS)
    ref_opt = fused_adam()(_two_groups(ref), **SETTINGS)
    attach_grads(params, _grads(params), False)
    attach_grads(ref, _grads(ref), False)
    ref_opt.step()
    run, calls = _backend.run, []

    def interrupted(item, hyper):
        calls.append(item)
        if len(calls) == at_call:
            signal.raise_signal(signal.SIGINT)  # as Ctrl-C during this batch
        return run(item, hyper)

    monkeypatch.setattr(_backend, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert len(calls) == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _assert_same(params, ref, opt, ref_opt, "after the interrupted step")


def test_a_signal_handler_of_the_users_runs_after_the_step(monkeypatch):
    """The held signals keep their own handlers: one that records runs once, after the
    step, and the step's result is the uninterrupted one's."""
    from shardadam import _backend

    params = make_params([torch.bfloat16] * 3, SHAPES, seed=4)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref_opt = (fused_adam()(_two_groups(ps), **SETTINGS) for ps in (params, ref))
    attach_grads(params, _grads(params), False)
    attach_grads(ref, _grads(ref), False)
    ref_opt.step()
    seen = []

    def handler(signum, frame):
        seen.append((signum, len(calls)))

    run, calls = _backend.run, []

    def signalled(item, hyper):
        signal.raise_signal(signal.SIGUSR1)
        calls.append(item)
        return run(item, hyper)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        monkeypatch.setattr(_backend, "run", signalled)
        opt.step()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert seen == [(signal.SIGUSR1, 2), (signal.SIGUSR1, 2)]  # both, after both calls
    _assert_same(params, ref, opt, ref_opt, "after the signalled step")


def test_a_failed_reseed_keeps_the_masters_following(backend, monkeypatch):
    """S1.6 with S3.1: an error while the first step re-seeds the masters of weights
    loaded after construction leaves every master following (the re-seeded ones hold
    the loaded values; the failed one keeps its mark), so the next step trains from
    the loaded weights, as a step that never failed."""
    from shardadam import FusedAdam

    params = make_params([torch.bfloat16] * 3, SHAPES, seed=5)
    opt = fused_adam()(params, **SETTINGS)
    gen = torch.Generator().manual_seed(6)
    for p in params:  # a model-only load after the optimizer was built
        p.data.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref_opt = fused_adam()(ref, **SETTINGS)
    attach_grads(params, _grads(params), False)
    attach_grads(ref, _grads(ref), False)
    ref_opt.step()
    reseed, calls = FusedAdam._reseed_master, []

    def failing(self, param):
        calls.append(param)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return reseed(self, param)

    monkeypatch.setattr(FusedAdam, "_reseed_master", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        opt.step()
    monkeypatch.setattr(FusedAdam, "_reseed_master", reseed)
    opt.step()
    _assert_same(params, ref, opt, ref_opt, "after a failed first step and a retry")


@pytest.mark.parametrize("settings", [
    dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16,
         exp_avg_sq_dtype=torch.bfloat16),
    dict(master_weight_dtype=torch.float16, exp_avg_dtype=torch.uint8,
         exp_avg_sq_dtype=torch.uint8),
    dict(store_param_remainders=True, moment_format="block8"),
], ids=["remainders", "fp16-master-fp8", "block8"])
def test_state_made_under_inference_mode_steps_outside_it(backend, settings):
    """State exists from construction (S1.6): an optimizer built, extended or loaded
    under ``torch.inference_mode`` makes normal tensors, which later steps update."""
    params = make_params([torch.bfloat16] * 3, SHAPES, seed=8)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kwargs = {**SETTINGS, **settings}
    with torch.inference_mode():
        opt = fused_adam()(params[:2], **kwargs)
        opt.add_param_group(dict(params=params[2:]))
    ref_opt = fused_adam()(ref[:2], **kwargs)
    ref_opt.add_param_group(dict(params=ref[2:]))
    for _ in range(2):
        attach_grads(params, _grads(params), False)
        attach_grads(ref, _grads(ref), False)
        opt.step()
        ref_opt.step()
    _assert_same(params, ref, opt, ref_opt, "built under inference_mode")
    with torch.inference_mode():
        opt.load_state_dict(ref_opt.state_dict())
        opt.initialize_state(params[0])
    ref_opt.initialize_state(ref[0])
    attach_grads(params, _grads(params), False)
    attach_grads(ref, _grads(ref), False)
    opt.step()
    ref_opt.step()
    _assert_same(params, ref, opt, ref_opt, "loaded under inference_mode")
