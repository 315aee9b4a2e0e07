"""What step() is wrapped in (``_step_hooks``): optimizer step hooks and the profiler
range (SEMANTICS S3.10) behave as torch's own ``Optimizer.profile_hook_step`` makes them
behave for ``torch.optim.AdamW``, and the range is entered only while a profiler records
or a hook is registered; the step runs without autograd, and inside dynamo's disable
wrapper wherever dynamo evaluates frames."""

import warnings

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

from _optimizer_testing import assert_bitwise_equal, assert_unchanged, snapshot
from shardadam import FusedAdam, _step_hooks


def make(optimizer_class=FusedAdam, seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    for p in params:
        p.grad = torch.randn_like(p)
    return optimizer_class(params, lr=1e-2, weight_decay=0.1), params


def record_hooks(opt, calls):
    """Per-optimizer and global pre/post hooks that log what they see; their handles."""
    def hook(kind):
        def record(optimizer, args, kwargs):
            calls.append((kind, optimizer is opt, len(args), args[0] is opt, dict(kwargs)))
        return record
    return [opt.register_step_pre_hook(hook("pre")),
            opt.register_step_post_hook(hook("post")),
            torch_optimizer.register_optimizer_step_pre_hook(hook("global pre")),
            torch_optimizer.register_optimizer_step_post_hook(hook("global post"))]


def test_hooks_run_as_for_torch_adamw():
    """Every kind of step hook runs once per step, in torch's order, with the arguments
    torch's wrapper passes (the optimizer, args with the optimizer first, kwargs)."""
    seen = {}
    for optimizer_class in (torch.optim.AdamW, FusedAdam):
        opt, _ = make(optimizer_class)
        calls = []
        handles = record_hooks(opt, calls)
        try:
            opt.step()
            opt.step(closure=None)
        finally:
            for handle in handles:
                handle.remove()
        opt.step()  # removed: not called
        seen[optimizer_class] = calls
    assert seen[FusedAdam] == seen[torch.optim.AdamW]
    assert [kind for kind, *_ in seen[FusedAdam]] == [
        "global pre", "pre", "post", "global post"] * 2


def test_pre_hook_replaces_the_arguments():
    """A pre-hook returning (args, kwargs) steps with them: here a closure whose loss
    step() returns."""
    opt, _ = make()

    def add_closure(optimizer, args, kwargs):
        return args, {"closure": lambda: torch.tensor(7.0)}

    handle = opt.register_step_pre_hook(add_closure)
    try:
        assert opt.step().item() == 7.0
    finally:
        handle.remove()
    assert opt.step() is None


def test_steps_with_and_without_hooks_store_the_same_bits():
    opt_a, params_a = make(seed=3)
    opt_b, params_b = make(seed=3)
    handle = opt_b.register_step_post_hook(lambda *_: None)
    try:
        for _ in range(3):
            opt_a.step()
            opt_b.step()
    finally:
        handle.remove()
    for a, b in zip(params_a, params_b):
        assert_bitwise_equal(a.detach(), b.detach(), "param")
        for name in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(opt_a.state[a][name], opt_b.state[b][name], name)
    assert opt_a.param_groups[0]["step"] == opt_b.param_groups[0]["step"] == 3


def test_profiler_sees_the_step_range():
    opt, _ = make()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert "Optimizer.step#FusedAdam.step" in {event.name for event in prof.events()}


def test_range_entered_only_when_needed(monkeypatch):
    """Without a profiler or a hook, step() does not enter torch's range (its cost is
    the point of _step_hooks); with a hook it does, once per step."""
    entered = []
    real = torch.autograd.profiler.record_function

    class Counting(real):
        def __enter__(self):
            entered.append(self.name)
            return super().__enter__()

    monkeypatch.setattr(torch.autograd.profiler, "record_function", Counting)
    opt, _ = make()
    opt.step()
    assert entered == []
    handle = opt.register_step_pre_hook(lambda *_: None)
    try:
        opt.step()
    finally:
        handle.remove()
    assert entered == ["Optimizer.step#FusedAdam.step"]


def test_subclass_step_runs_hooks_once():
    """A subclass's own step() is wrapped by torch; calling FusedAdam.step from it does
    not run the hooks a second time."""
    class Logged(FusedAdam):
        def step(self, closure=None, grad_scaler=None):
            return super().step(closure, grad_scaler)

    opt, _ = make(Logged)
    calls = []
    handle = opt.register_step_pre_hook(lambda *args: calls.append(args))
    try:
        opt.step()
    finally:
        handle.remove()
    assert len(calls) == 1
    assert opt.param_groups[0]["step"] == 1


def test_subclass_step_body_runs_on_every_path():
    """A subclass overriding the step's body (_step) has it run whether the step goes
    the plain way or through torch's hooks and dynamo's disable wrapper."""
    class Counted(FusedAdam):
        def _step(self, closure):
            bodies.append(self)
            return super()._step(closure)

    bodies = []
    opt, _ = make(Counted)
    opt.step()
    handle = opt.register_step_pre_hook(lambda *args: None)
    try:
        opt.step()
    finally:
        handle.remove()
    assert bodies == [opt, opt]
    assert opt.param_groups[0]["step"] == 2


def test_lr_scheduler_sees_the_step():
    """torch's schedulers wrap the optimizer's step to check the call order; stepping
    the scheduler after step() gives no warning."""
    opt, _ = make()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)


@pytest.mark.filterwarnings("error:Dynamo does not know how to trace:UserWarning")
def test_compiled_step_runs_hooks_once():
    """torch.compile(opt.step): dynamo traces torch's wrapper, as for torch's own
    optimizers; the hooks still run once per step, and nothing is traced that dynamo
    warns about."""
    torch._dynamo.reset()
    opt, _ = make()
    calls = []
    handle = opt.register_step_pre_hook(lambda *args: calls.append(args))
    try:
        step = torch.compile(opt.step, backend="eager", fullgraph=False)
        step()
        step()
    finally:
        handle.remove()
    assert len(calls) == 2
    assert opt.param_groups[0]["step"] == 2


@pytest.mark.parametrize("grad_mode", [True, False])
def test_step_runs_without_autograd_and_restores_the_mode(grad_mode):
    """The step's in-place updates are invisible to autograd (a non-contiguous
    parameter is written back with copy_, which autograd refuses on a leaf), and the
    caller's gradient mode is restored, also after a refused step."""
    torch.manual_seed(5)
    param = torch.nn.Parameter(torch.randn(3, 8)[:, ::2].t())  # not dense: written back
    param.grad = torch.randn(4, 3)
    opt = FusedAdam([param], lr=1e-2)
    with torch.set_grad_enabled(grad_mode):
        before = param.detach().clone()
        opt.step()
        assert torch.is_grad_enabled() is grad_mode
        assert param.grad_fn is None and param.requires_grad
        assert not torch.equal(param.detach(), before)
        opt.param_groups[0]["lr"] = -1.0  # refused: nothing written back either
        refused = snapshot(opt)
        with pytest.raises(ValueError, match="learning rate"):
            opt.step()
        assert_unchanged(opt, refused)
        assert torch.is_grad_enabled() is grad_mode


def test_step_takes_dynamo_disable_wrapper_where_dynamo_evaluates_frames(monkeypatch):
    """In dynamo's run-only mode (frames evaluated by dynamo, none compiled) the step
    runs inside dynamo's disable wrapper and dynamo's mode is restored after it; in
    plain eager code it runs without the wrapper. The bits are the same."""
    torch._dynamo.reset()
    wrapped = []
    disabled = FusedAdam._undynamic_step

    def counting(self, closure):
        wrapped.append(self)
        return disabled(self, closure)

    monkeypatch.setattr(FusedAdam, "_undynamic_step", counting)
    modes, states = [], []
    for run_only in (False, True):
        opt, params = make(seed=6)

        def caller():
            modes.append(_step_hooks.dynamo_frames())
            opt.step()
            opt.step()
            modes.append(_step_hooks.dynamo_frames())

        (torch._dynamo.run(caller) if run_only else caller)()
        states.append((opt, params))
    assert modes == [False, False, True, True]
    assert wrapped == [states[1][0]] * 2
    assert not _step_hooks.dynamo_frames()
    (eager, eager_params), (run_only, run_params) = states
    for p, q in zip(eager_params, run_params):
        assert_bitwise_equal(p.detach(), q.detach(), "param")
        for name in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(eager.state[p][name], run_only.state[q][name], name)
