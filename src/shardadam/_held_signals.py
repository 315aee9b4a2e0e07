"""Signals held back while a step updates state, so an interrupt never splits a step.

The core releases the GIL, so a Ctrl-C during a long step runs Python's handler, and
raises its ``KeyboardInterrupt``, right after the core returns: between one group's
update and its step counter, or before a strided parameter's copy is written back.
While a step mutates state (``FusedAdam._step``), each signal whose handler is Python
code is recorded instead, and its handler runs once the step is whole. Python runs
handlers in the main thread only, so only a step called there needs this.

It calls ``_signal``, the C module that ``signal`` wraps, directly: ``signal``'s
wrappers turn every handler into an enum, which made holding six signals cost 15 µs
per step (``_signal``'s ``getsignal`` / ``signal`` are the same functions, in every
CPython).
"""

from __future__ import annotations

import _signal
import signal
import threading

# The signals a training script commonly handles in Python (Ctrl-C, a scheduler's
# SIGTERM, a timeout's alarm); others keep their handlers.
_SIGNALS = tuple(int(getattr(signal, name)) for name in
                 ("SIGINT", "SIGTERM", "SIGALRM", "SIGHUP", "SIGUSR1", "SIGUSR2")
                 if hasattr(signal, name))


class held:
    """Context manager: the Python handlers of ``_SIGNALS`` wait until it exits, then
    run in the order their signals came (an exception they raise propagates)."""

    __slots__ = ("_saved", "_caught")

    def __enter__(self):
        self._saved, self._caught = {}, []
        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNALS:
                handler = _signal.getsignal(signum)
                if callable(handler):
                    self._saved[signum] = handler
                    _signal.signal(signum, self._record)
        return self

    def _record(self, signum, frame):
        self._caught.append((signum, frame))

    def __exit__(self, *exc_info):
        for signum, handler in self._saved.items():
            _signal.signal(signum, handler)
        for signum, frame in self._caught:
            self._saved[signum](signum, frame)
        return False
