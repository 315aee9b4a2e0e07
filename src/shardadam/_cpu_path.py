"""CPU tensors: one call of the C++ core (``shardadam._C.adam_step``) per batch.

The batch's slot rows come from ``_slots``; the core splits the work over
``torch.get_num_threads()`` threads and returns when every tensor is stepped.
"""

from __future__ import annotations

import warnings

import torch

from . import _slots


def available() -> bool:
    """Whether the C++ extension is built and importable."""
    return _slots.extension is not None


_warned_unbuilt = False


def warn_unbuilt(params) -> None:
    """Once per process, before a step whose ``params`` hold a CPU tensor, where the
    extension was never built (one that failed to load was named at import). Before the
    step, so that the warning turned into an error leaves nothing changed."""
    global _warned_unbuilt
    if not _slots.missing or _warned_unbuilt:
        return
    if any(isinstance(p, torch.Tensor) and p.device.type == "cpu" for p in params):
        _warned_unbuilt = True
        warnings.warn("shardadam._C is not built: CPU tensors step on the torch path, many "
                      "times slower than the C++ core; install a wheel or build the "
                      "extension (README, Install)", RuntimeWarning)


prepare = _slots.prepare  # the batch's slot rows, with this step's gradients


def run(work, call, hyper) -> None:
    if call.slots:
        try:
            _slots.extension.adam_step(
                call.slots, hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
                hyper.weight_decay, hyper.adam_w_mode, hyper.bias_correction, hyper.step,
                torch.get_num_threads())
        except ValueError as error:
            raise _slots.refusal(error, call.entries) from None
    if call.write_back:
        call.finish()
