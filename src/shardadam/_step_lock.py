"""One step at a time per optimizer (S3.1), and what a fork leaves of a step.

A child forked while another thread of the parent was inside ``step()`` has only the
forking thread: the step it copied never finishes there, some tensors or groups stepped
and others not, the counts maybe not advanced. Its lock would stay held by a thread
that does not exist (every step refused as "another step runs", which none does), so
the child gets a free lock, marked ``torn`` where that step had begun its work, and the
optimizer refuses what would read that half-stepped state as whole until a checkpoint
is loaded.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

_get_ident = threading.get_ident

# Every lock, for a fork to look at: one taken by another thread may be anywhere
# between its acquire and its release when the fork comes.
_ALL = weakref.WeakSet()


class StepLock:
    def __init__(self):
        self._lock = threading.Lock()
        self._owner = None  # the thread holding it, once it has said so
        self._working = False  # the holder is inside the step's work
        self.torn = False  # forked while another thread's step was at work
        _ALL.add(self)

    def busy(self) -> bool:
        return self._lock.locked()

    @contextlib.contextmanager
    def held(self):
        with self._lock:
            self._owner = _get_ident()
            self._working = True
            try:
                yield
            finally:
                self._working = False
                self._owner = None


def _free_in_child() -> None:
    """In a forked child only the forking thread goes on: the steps of the others are
    cut where they were (before their work began, or after it ended, nothing is cut)."""
    me = _get_ident()
    for lock in list(_ALL):
        if lock._lock.locked() and lock._owner != me:
            lock.torn = lock.torn or lock._working
            lock._lock = threading.Lock()
            lock._owner = None
            lock._working = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_free_in_child)
