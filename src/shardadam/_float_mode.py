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
both back after, also when the section is interrupted. torch's thread count is also
what a thread takes at its first parallel op: one that starts using torch while a
section runs narrowed keeps one thread (threads already running keep theirs).
Nothing is done, beyond a one-element probe, where the caller does not flush.

Private torch API used: ``torch.utils._python_dispatch._disable_current_modes``, so
that the probes are real CPU tensors under a caller's dispatch mode (``FakeTensorMode``,
whose tensors hold no value, or a mode that counts ops); they are made on the CPU
whatever the default device (an optimizer may be made under
``with torch.device("meta")``).
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
    with torch.utils._python_dispatch._disable_current_modes():
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
    threads = torch.get_num_threads()
    narrowed = False
    # Every switch inside the try, so that an interrupt anywhere gives both back.
    try:
        torch.set_flush_denormal(False)
        if threads > 1 and _flushes(threads * _GRAIN):
            narrowed = True  # set first: giving the count back twice is harmless
            torch.set_num_threads(1)
        yield
    finally:
        try:
            if narrowed:
                torch.set_num_threads(threads)
        finally:
            torch.set_flush_denormal(True)
