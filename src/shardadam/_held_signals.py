"""Ctrl-C and SIGTERM held back while a step updates state, so they never split a step.

The core releases the GIL, so a Ctrl-C during a long step runs Python's handler, and
raises its ``KeyboardInterrupt``, right after the core returns: between one group's
update and its step counter, or before a strided parameter's copy is written back.
While a step validates and updates state (``FusedAdam._step``, after the closure),
SIGINT and SIGTERM, where their handler is Python code, are recorded instead; once the
step is whole their handlers are put back and the signals raised again, so the handlers
in place then run as CPython runs them (repeats of one signal merged; one handler
raising leaves the others pending). Python runs handlers in the main thread only, so
only a step called there holds them. Other signals' Python handlers (a DataLoader's
SIGCHLD) still run at once.

What Python code cannot close: a second signal whose handler raises, landing in the
few bytecodes between the end of the hold and the first one's raising again, is
delivered and the first is not (storms of both signals, one every 0.3 ms or less
against thousands of steps, found no other loss, no lost handler and no left mask).

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
import threading

_SIGNALS = tuple(int(getattr(signal, name)) for name in ("SIGINT", "SIGTERM")
                 if hasattr(signal, name))
_REDELIVER = hasattr(_signal, "pthread_sigmask") and hasattr(_signal, "pthread_kill")


class held:
    """Context manager: SIGINT and SIGTERM wait until it exits (see the module).

    Python code can be cut short at any bytecode by a handler that raises, so each step
    leaves a state that is safe where it stops: the handler to put back is saved before
    a recorder replaces it; a closed recorder still in place (a put-back cut short)
    puts its handler back when its next signal comes and raises that signal again; a
    later hold takes a closed recorder's handler as the one in place; a handler set
    while a recorder was in place is not overwritten; a hold inside a hold leaves the
    outer one's recorders."""

    __slots__ = ("_saved", "_caught", "_open")

    def __enter__(self):
        self._saved, self._caught, self._open = {}, [], True
        if threading.current_thread() is not threading.main_thread():
            return self
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
        if self._open:
            if signum not in self._caught:
                self._caught.append(signum)
            return
        self._put_back(signum)  # a closed recorder left in place: see the class
        _raise_again([signum])

    def _put_back(self, signum) -> None:
        if _signal.getsignal(signum) == self._record:  # else set meanwhile: it stays
            _signal.signal(signum, self._saved[signum])

    def __exit__(self, *exc_info):
        self._open = False  # from here on a recorder hands its signals on itself
        caught, failure = self._caught, None
        for signum in self._saved:
            if signum in caught:
                continue  # its recorder puts it back as it hands the signal on
            while True:
                try:
                    self._put_back(signum)
                    break
                except BaseException as error:  # a pending handler raised first
                    failure = failure or error
        try:
            _raise_again(caught)
            self._caught = []
        finally:
            if failure is not None:
                raise failure
        return False


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
