"""IEEE subnormals for the optimizer's own torch ops on CPU tensors (S3.7).

The C++ core sets IEEE mode on every thread it steps on (csrc/float_mode.h). Where the
package steps, makes, converts, reads or writes state with torch ops instead (the torch
path, state made at binding, masters seeded, ``state_dict``, ``load_state_dict``,
``get_unscaled_state``, ``set_scaled_state``), a caller's
``torch.set_flush_denormal(True)`` would flush subnormal values to 0: a non-zero second
moment stored as code 0, a subnormal weight zeroed by a step of ``lr=0``. torch offers
no getter for that mode and sets it on the calling thread only; a worker thread of
torch's OpenMP pool keeps the mode of the thread that started it, so a pool started
while the caller flushed keeps flushing after the caller's thread is switched back.
``kept()`` switches the calling thread to IEEE mode and, where the pool's workers still
flush, runs the section on that one thread (``torch.set_num_threads(1)``); it gives
both back after (the thread count is the process's: another thread's torch ops run on
one thread meanwhile, as the caller's do). Nothing is done, beyond a one-element
probe, where the caller does not flush. The probes are CPU tensors whatever the
default device (an optimizer may be made under ``with torch.device("meta")``).
"""

from __future__ import annotations

import contextlib

import torch

# torch's elementwise ops give each thread at least this many elements
# (at::internal::GRAIN_SIZE): a probe of threads times as many reaches every worker.
_GRAIN = 32768
_SUBNORMAL_BITS = 8  # the fp32 bits of 2^-146


def _flushes(numel: int) -> bool:
    """Whether a product over ``numel`` subnormal elements loses any: read through the
    integer bits, which no flush mode changes."""
    probe = torch.full((numel,), _SUBNORMAL_BITS, dtype=torch.int32, device="cpu")
    probe = probe.view(torch.float32)
    return bool(probe.mul(1.0).view(torch.int32).ne(_SUBNORMAL_BITS).any())


def flushing() -> bool:
    """Whether the calling thread's CPU float ops flush subnormals."""
    return _flushes(1)


@contextlib.contextmanager
def kept():
    """CPU float ops with IEEE subnormals inside (see the module docstring). Nested
    uses cost one probe each."""
    if not flushing():
        yield
        return
    torch.set_flush_denormal(False)
    threads = torch.get_num_threads()
    narrowed = threads > 1 and _flushes(threads * _GRAIN)
    if narrowed:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if narrowed:
            torch.set_num_threads(threads)
        torch.set_flush_denormal(True)
