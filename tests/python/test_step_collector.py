"""A step holds Python's cyclic garbage collector off while it runs (``_collector``): with
thousands of groups, the objects a step keeps until every group is validated were promoted
to the oldest generation and set off a full collection every few steps. These tests pin
that no collection starts inside a step, that the collector's switch is left as it was
found (refused steps and closures included), and that a step makes no reference cycles,
so holding the collector off defers no work."""

import gc

import pytest
import torch

from shardadam import FusedAdam

GROUPS = 300  # a step of this many groups made ~4,000 objects, over gen 0's 700


def _optimizer(**options):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 64, generator=gen)) for _ in range(GROUPS)]
    for p in params:
        p.grad = torch.randn(4, 64, generator=gen)
    return FusedAdam([{"params": [p]} for p in params], lr=1e-3, **options), params


@pytest.fixture
def collections():
    """The generations of the automatic collections started while the test runs."""
    started = []

    def record(phase, info):
        if phase == "start":
            started.append(info["generation"])

    gc.collect()
    gc.callbacks.append(record)
    try:
        yield started
    finally:
        gc.callbacks.remove(record)


def test_no_collection_starts_in_steady_steps_of_many_groups(collections):
    """The first two steps keep what they made (state, plans: collected once the
    collector is back, as objects made anywhere else); the steps after them keep
    nothing, and start no collection."""
    opt, _ = _optimizer()
    opt.step()  # binds: state and plans made
    opt.step()  # checks each plan, then keeps their check as one
    for _ in range(3):
        gc.collect()  # every generation's count back to 0
        collections.clear()
        opt.step()
        assert collections == []
        assert gc.isenabled()


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
