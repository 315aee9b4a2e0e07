"""A step holds Python's cyclic garbage collector off while it runs (``_collector``): with
thousands of groups, the objects a step keeps until every group is validated were promoted
to the oldest generation and set off a full collection every few steps. These tests pin
that no collection starts inside a step, that the collector's switch is left as it was
found (refused steps and closures included), and that a step makes no reference cycles,
so holding the collector off defers no work."""

import gc
import signal

import pytest
import torch

from shardadam import FusedAdam, _collector

GROUPS = 300  # a step of this many groups made ~4,000 objects, over gen 0's 700


def _optimizer(**options):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 64, generator=gen)) for _ in range(GROUPS)]
    for p in params:
        p.grad = torch.randn(4, 64, generator=gen)
    return FusedAdam([{"params": [p]} for p in params], lr=1e-3, **options), params


@pytest.fixture
def collections_inside_steps(monkeypatch):
    """The generations of the automatic collections that start while a step validates and
    updates its groups (``FusedAdam._step_groups``, where what it makes per group is
    alive). One may still start as the step ends: CPython's count of new objects drifts
    (lists and tuples reused from its free lists are not counted when freed)."""
    started, inside = [], []
    original = FusedAdam._step_groups

    def step_groups(self):
        inside.append(True)
        try:
            return original(self)
        finally:
            inside.pop()

    def record(phase, info):
        if phase == "start" and inside:
            started.append(info["generation"])

    monkeypatch.setattr(FusedAdam, "_step_groups", step_groups)
    gc.callbacks.append(record)
    try:
        yield started
    finally:
        gc.callbacks.remove(record)


def test_no_collection_starts_inside_steps_of_many_groups(collections_inside_steps):
    opt, _ = _optimizer()
    for _ in range(4):  # binds, checks each plan, then all plans as one
        opt.step()
        assert gc.isenabled()
    assert collections_inside_steps == []


def test_the_closure_runs_with_the_collector_as_found():
    opt, params = _optimizer()
    seen = []

    def closure():
        seen.append(gc.isenabled())
        return torch.zeros(())

    opt.step(closure)
    gc.disable()
    try:
        opt.step(closure)
        assert not gc.isenabled()  # a collector the program turned off stays off
    finally:
        gc.enable()
    assert seen == [True, False]


def test_a_refused_step_leaves_the_collector_on():
    opt, params = _optimizer()
    opt.step()
    opt.param_groups[7]["lr"] = float("nan")
    with pytest.raises(ValueError, match="group 7"):
        opt.step()
    assert gc.isenabled()


@pytest.mark.parametrize("options", [dict(), dict(exp_avg_dtype=torch.uint8,
                                                   exp_avg_sq_dtype=torch.uint8),
                                     dict(moment_format="block8")], ids=str)
def test_a_step_leaves_no_reference_cycle(options):
    """What a step makes is freed by reference counting when it returns, first step
    (state created) and steady ones alike: no collection finds anything after it."""
    opt, params = _optimizer(**options)
    gc.collect()
    gc.disable()
    try:
        found = []
        for _ in range(3):
            opt.step()
            found.append(gc.collect())
    finally:
        gc.enable()
    assert found == [0, 0, 0]


@pytest.mark.parametrize("switch", ["_disable", "_enable"])
def test_ctrl_c_at_a_switch_leaves_the_collector_on(monkeypatch, switch):
    """A Ctrl-C whose handler runs right after the collector is switched off (or just
    before it is switched back on) waits for the step's end (S3.1), when the collector is
    on again: raised between the switches, it would leave the collector off for the
    rest of the process."""
    opt, params = _optimizer()
    opt.step()
    original = getattr(_collector, switch)

    def interrupted():
        if switch == "_disable":
            original()
        signal.raise_signal(signal.SIGINT)  # Python's handler runs at the next bytecode
        if switch == "_enable":
            original()

    monkeypatch.setattr(_collector, switch, interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert gc.isenabled()
    assert opt.param_groups[0]["step"] == 2  # and the step was whole
