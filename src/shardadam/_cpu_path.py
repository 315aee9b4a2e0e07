"""CPU tensors: one call of the C++ core (``shardadam._C.adam_step``) per batch.

The batch's slot rows come from ``_slots``; the core splits the work over
``torch.get_num_threads()`` threads and returns when every tensor is stepped.
"""

from __future__ import annotations

import torch

from . import _slots


def available() -> bool:
    """Whether the C++ extension is built and importable."""
    return _slots.extension is not None


def step(work, hyper) -> None:
    call = _slots.prepare(work)
    if call.slots:
        _slots.extension.adam_step(
            call.slots, hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
            hyper.adam_w_mode, hyper.bias_correction, hyper.step, torch.get_num_threads())
    call.finish()
