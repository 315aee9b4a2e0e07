"""One step at a time per optimizer (S3.1), and what a fork leaves of a step.

A child forked while another thread of the parent was inside ``step()`` has only the
forking thread: the step it copied never finishes there, some tensors or groups stepped
and others not, the counts maybe not advanced. Its lock would stay held by a thread
that does not exist (every step refused as "another step runs", which none does), so
the child gets a free lock marked ``torn``, and the optimizer refuses what would read
that half-stepped state as whole until a checkpoint is loaded.
"""

from __future__ import annotations

import contextlib
import os
import threading

_get_ident = threading.get_ident

# The locks held now, by id: a fork looks only at these.
_HELD = {}


class StepLock:
    def __init__(self):
        self._lock = threading.Lock()
        self._owner = None  # the thread holding it
        self.torn = False  # forked while another thread stepped

    def busy(self) -> bool:
        return self._lock.locked()

    @contextlib.contextmanager
    def held(self):
        with self._lock:
            self._owner = _get_ident()
            _HELD[id(self)] = self
            try:
                yield
            finally:
                _HELD.pop(id(self), None)
                self._owner = None


def _free_in_child() -> None:
    """In a forked child only the forking thread goes on: the steps of the others are
    cut where they were."""
    for lock in list(_HELD.values()):
        if lock._owner != _get_ident():
            lock._lock = threading.Lock()
            lock._owner = None
            lock.torn = True
            _HELD.pop(id(lock), None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_free_in_child)
