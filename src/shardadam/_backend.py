"""Chooses how a batch is stepped: the C++ core for CPU tensors, torch ops otherwise.

Both implementations take ``(work: BatchGrads, hyper: Hyper)`` and fulfil the same
contract (SEMANTICS S3.6) bit for bit on CPU. ``use_backend("torch")`` forces the
torch path everywhere (tests compare the two; devices without a C++ build use it).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

from . import _cpu_path, _torch_path

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
    extension is importable, torch ops otherwise) or ``"torch"`` (torch ops only)."""
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
    if work.batch.is_cpu and _mode == "auto" and _cpu_path.available():
        _cpu_path.step(work, hyper)
    else:
        _torch_path.step(work, hyper)
