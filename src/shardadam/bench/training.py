"""The step as a training loop calls it: right after torch's own parallel work.

In training every ``step()`` follows ``backward()``. torch's bundled OpenMP runtime
keeps its threads spinning for a while after each parallel region, so a step that woke
threads of its own then would share its cores with them. The ``training`` cases time
the same step (one optimizer on one set of tensors, ``contenders.SHARING``) after an
idle gap (the other cases' way), right after a matmul, and right after a small model's
forward and backward, each untimed; and, for comparison, after the backward with the
core's own thread pool instead of torch's OpenMP threads
(``_C.set_thread_runtime("pool")``). kernel_bench's bare C++ kernel is the yardstick.
"""

from __future__ import annotations

import torch

from shardadam import _C


def _matmul():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(512, 512, generator=gen)
    b = torch.randn(512, 512, generator=gen)
    return lambda: torch.mm(a, b)


def _backward():
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512))
    x = torch.randn(64, 512)

    def work():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
    return work


WORK = {"matmul": _matmul, "backward": _backward}


class AfterTorchWork:
    """A step that ``timing.interleaved`` times right after ``before()``: torch's work,
    untimed, with the core's workers on ``runtime`` ("auto" or "pool")."""

    def __init__(self, step, work: str, runtime: str = "auto"):
        self.step = step
        self.work = WORK[work]()
        self.runtime = runtime
        self.__self__ = getattr(step, "__self__", None)  # for contenders.state_bytes

    def before(self):
        _C.set_thread_runtime(self.runtime)
        self.work()

    def __call__(self):
        try:
            self.step()
        finally:
            _C.set_thread_runtime("auto")
