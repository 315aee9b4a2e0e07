"""Ctrl-C and SIGTERM held back while a step updates state, so they never split a step.

The core releases the GIL, so a Ctrl-C during a long step runs Python's handler, and
raises its ``KeyboardInterrupt``, right after the core returns: between one group's
update and its step counter, or before a strided parameter's copy is written back.
While a step validates and updates state (``FusedAdam._step``, after the closure),
SIGINT and SIGTERM, where their handler is Python code, are recorded instead; once the
step is whole their handlers are put back and called (repeats of one signal merged;
one handler raising leaves the others pending). Python runs handlers in the main
thread only, so only a step called there holds them. Other signals' Python handlers (a
DataLoader's SIGCHLD) still run at once.

A held signal's handler is called as CPython calls one (the signal number and the
calling frame), not raised as a signal again: a signal raised again passes CPython's C
handler once more, which writes to ``signal.set_wakeup_fd``'s file each time, and
asyncio's ``add_signal_handler`` runs its callback once per byte. Signals left pending
by a handler that raised are raised again as signals.

A handler of another signal that raises (a SIGALRM timeout) can cut a hold short at any
bytecode, also before it is undone. What it leaves is undone later: a recorder still
open whose step is no longer on the main thread's stack hands its signals on at the
next one it gets, and the next hold undoes it first; in a child forked while a hold was
open in another thread (which the child does not have), the handlers are put back at
the fork.

What Python code cannot close: a second signal whose handler raises, landing in the
few bytecodes between the end of the hold and the first one's handler, is delivered
and the first is not (storms of both signals, one every 0.3 ms or less against
thousands of steps, found no other loss, no lost handler and no left mask).

Putting a handler in place installs CPython's own C handler for that signal: one that
was installed outside Python's ``signal`` module (``faulthandler.register(SIGINT)``) or
``signal.siginterrupt`` settings for these two signals do not survive the first step.

It calls ``_signal``, the C module that ``signal`` wraps, directly (the same functions,
in every CPython): ``signal``'s Python wrappers turn every handler into an enum (15 µs
per step for six signals), and a wrapper can run a pending handler on entry, before
the signal mask it was to restore is back.
"""

from __future__ import annotations

import _signal
import os
import signal
import sys
import threading

_SIGNALS = tuple(int(getattr(signal, name)) for name in ("SIGINT", "SIGTERM")
                 if hasattr(signal, name))
_REDELIVER = hasattr(_signal, "pthread_sigmask") and hasattr(_signal, "pthread_kill")


# The holds entered and not yet undone, innermost last (the main thread's only).
_LIVE: list = []


class held:
    """Context manager: SIGINT and SIGTERM wait until it exits (see the module).

    Python code can be cut short at any bytecode by a handler that raises, so each step
    leaves a state that is safe where it stops: the handler to put back is saved before
    a recorder replaces it; a closed recorder still in place (a put-back cut short)
    puts its handler back when its next signal comes and raises that signal again; a
    later hold takes a closed recorder's handler as the one in place; a handler set
    while a recorder was in place is not overwritten; a hold inside a hold leaves the
    outer one's recorders; a hold whose exit never ran (its step's frame is gone from
    the stack) is undone by the next hold or its next signal."""

    __slots__ = ("_saved", "_caught", "_open", "_frame")

    def __enter__(self):
        self._saved, self._caught, self._open, self._frame = {}, [], True, None
        if threading.current_thread() is not threading.main_thread():
            return self
        _undo_left(sys._getframe())
        self._frame = sys._getframe(1)
        _LIVE.append(self)
        try:
            for signum in _SIGNALS:
                handler = _signal.getsignal(signum)
                holder = getattr(handler, "__self__", None)
                if isinstance(holder, held):
                    if holder._open:
                        continue  # held already, by a step around this one
                    handler = holder._saved[signum]
                if callable(handler):
                    self._saved[signum] = handler
                    _signal.signal(signum, self._record)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _record(self, signum, frame):
        if self._open and frame is not None and not _on_stack(self._frame, frame):
            self._close()  # left open (its exit cut short): the signal goes on
            _run_handlers([signum], frame)
            return
        if self._open:
            if signum not in self._caught:
                self._caught.append(signum)
            return
        self._put_back(signum)  # a closed recorder left in place: see the class
        _raise_again([signum])

    def _put_back(self, signum) -> None:
        if _signal.getsignal(signum) == self._record:  # else set meanwhile: it stays
            _signal.signal(signum, self._saved[signum])

    def _close(self) -> list:
        """Puts every handler back; returns the signals caught, for the caller to hand
        on (a pending handler that raised first is raised after them)."""
        self._open = False  # from here on a recorder hands its signals on itself
        caught, failure = self._caught, None
        for signum in self._saved:
            while True:
                try:
                    self._put_back(signum)
                    break
                except BaseException as error:  # a pending handler raised first
                    failure = failure or error
        self._caught = []
        if self in _LIVE:
            _LIVE.remove(self)
        if failure is not None:
            _raise_again(caught)  # still delivered, as signals
            raise failure
        return caught

    def __exit__(self, *exc_info):
        _run_handlers(self._close(), sys._getframe(1))
        return False


def _on_stack(frame, top) -> bool:
    """Whether ``frame`` is ``top`` or one of its callers."""
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


def _undo_left(top) -> None:
    """Undoes the holds whose exit never ran: their step's frame is no longer on the
    stack below ``top``. Their caught signals are handed on."""
    for hold in [h for h in _LIVE if h._open and not _on_stack(h._frame, top)]:
        _run_handlers(hold._close(), top)


def _run_handlers(signals, frame) -> None:
    """Calls the handler in place for each of ``signals`` as CPython would, in order;
    one that raises leaves the rest pending, raised again as signals. A signal whose
    handler is no Python callable now (``SIG_DFL`` set meanwhile) is raised again, so
    it acts as it would have."""
    for i, signum in enumerate(signals):
        handler = _signal.getsignal(signum)
        if not callable(handler) or isinstance(getattr(handler, "__self__", None), held):
            _raise_again([signum])
            continue
        try:
            handler(signum, frame)
        except BaseException:
            _raise_again(signals[i + 1:])
            raise


def _forget_in_child() -> None:
    """In a child forked while a hold was open in another thread, which the child does
    not have: that step never ends there, so its handlers are put back now."""
    main = threading.main_thread()
    if threading.current_thread() is not main:
        return
    for hold in list(_LIVE):
        if hold._open and not _on_stack(hold._frame, sys._getframe()):
            hold._close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _raise_again(signals) -> None:
    """Raises ``signals`` again so that each lands as a signal would: blocked in the main
    thread until all are pending, then unblocked at once (CPython then runs the
    handlers in place, one that raises leaving the others pending); one the caller's
    mask blocks goes to the process, as it came."""
    if not signals:
        return
    if not _REDELIVER:  # no thread signal API: each raised, the rest even if one raises
        try:
            signal.raise_signal(signals[0])
        finally:
            _raise_again(signals[1:])
        return
    # The C functions themselves: ``signal``'s Python wrappers could run a pending
    # handler on entry, before the mask is put back.
    main = threading.main_thread().ident
    before = _signal.pthread_sigmask(_signal.SIG_BLOCK, [])  # reads the mask only
    try:
        _signal.pthread_sigmask(_signal.SIG_BLOCK, signals)
        for signum in signals:
            if signum in before:
                os.kill(os.getpid(), signum)
            else:
                _signal.pthread_kill(main, signum)
    finally:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, before)
