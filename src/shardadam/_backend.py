"""Chooses how a batch is stepped (SEMANTICS S7): the C++ core for CPU tensors, its
CUDA build for CUDA tensors where the extension has one and sees a device, torch ops
otherwise.

Every implementation takes ``(work: BatchGrads, hyper: Hyper)`` and fulfils the same
contract (S3.6): the C++ core gives the same bits on CPU and on CUDA, and the torch
path gives them too on CPU. ``use_backend("torch")`` forces the torch path everywhere
(tests compare the paths; devices without a C++ build use it).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

from . import _cpu_path, _cuda_path, _torch_path

_BACKENDS = ("auto", "torch")
_mode = "auto"


class Hyper(NamedTuple):
    """One group's step: validated hyper-parameters and the step being taken."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: bool
    bias_correction: bool
    step: int


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, step with ``name``: ``"auto"`` (C++ for CPU tensors when the
    extension is importable and for CUDA tensors when it has CUDA and sees a device,
    torch ops otherwise) or ``"torch"`` (torch ops only)."""
    global _mode
    if name not in _BACKENDS:
        raise ValueError(f"shardadam: unknown backend {name!r}; expected one of {_BACKENDS}")
    previous, _mode = _mode, name
    try:
        yield
    finally:
        _mode = previous


def step(work, hyper: Hyper) -> None:
    """Update one batch (one group's parameters on one device)."""
    if _mode == "auto":
        batch = work.batch
        if batch.is_cpu:
            if _cpu_path.available():
                _cpu_path.step(work, hyper)
                return
        elif batch.is_cuda and _cuda_path.available(batch.device):
            _cuda_path.step(work, hyper)
            return
    _torch_path.step(work, hyper)
