"""Ctrl-C and SIGTERM held back while a step updates state, so they never split a step.

The core releases the GIL, so a Ctrl-C during a long step runs Python's handler, and
raises its ``KeyboardInterrupt``, right after the core returns: between one group's
update and its step counter, or before a strided parameter's copy is written back.
While a step mutates state (``FusedAdam._step``), SIGINT and SIGTERM, where their
handler is Python code, are recorded instead; once the step is whole their handlers
are put back and the signals raised again, so the handlers in place then run as
CPython runs them (repeats of one signal merged; one handler raising leaves the others
pending). Python runs handlers in the main thread only, so only a step called there
holds them. Other signals' Python handlers (a DataLoader's SIGCHLD) still run at once.

Putting a handler in place installs CPython's own C handler for that signal: one that
was installed outside Python's ``signal`` module (``faulthandler.register(SIGINT)``) or
``signal.siginterrupt`` settings for these two signals do not survive the first step.

It calls ``_signal``, the C module that ``signal`` wraps, directly: ``signal``'s
wrappers turn every handler into an enum, which cost 15 µs per step for six signals
(``_signal``'s ``getsignal`` / ``signal`` are the same functions, in every CPython).
"""

from __future__ import annotations

import _signal
import signal
import threading

_SIGNALS = tuple(int(getattr(signal, name)) for name in ("SIGINT", "SIGTERM")
                 if hasattr(signal, name))
_REDELIVER = hasattr(signal, "pthread_sigmask") and hasattr(signal, "pthread_kill")


class held:
    """Context manager: SIGINT and SIGTERM wait until it exits (see the module).

    Python code can be cut short at any bytecode by a handler that raises, so a
    recorder may be left in place after ``__exit__`` (a signal landing between two put
    backs): such a recorder puts the handler it stood for back when its next signal
    comes, and raises that signal again for it; a later ``held`` takes the left
    recorder's handler as the one in place."""

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
                    # CPython runs pending handlers (which may raise) before it
                    # replaces one: it counts as replaced only once this returns.
                    _signal.signal(signum, self._record)
                    self._saved[signum] = handler
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _record(self, signum, frame):
        if self._open:
            if signum not in self._caught:
                self._caught.append(signum)
            return
        _signal.signal(signum, self._saved[signum])  # left in place: see the class
        _raise_again([signum])

    def _put_back(self):
        """Every replaced handler back in place, also where a pending handler raises
        meanwhile; returns the first such exception (or None)."""
        failure = None
        for signum, handler in self._saved.items():
            while True:
                try:
                    _signal.signal(signum, handler)
                    break
                except BaseException as error:
                    failure = failure or error
        return failure

    def __exit__(self, *exc_info):
        self._open = False
        failure = self._put_back()
        caught, self._caught = self._caught, []
        try:
            _raise_again(caught)
        finally:
            if failure is not None:
                raise failure
        return False


def _raise_again(signals) -> None:
    """Raises ``signals`` again in the main thread, blocked until all are pending, so
    that each lands as a signal would: CPython runs the handlers in place now."""
    if not signals:
        return
    if not _REDELIVER:  # no thread signal API: the handlers in place, called in turn
        for signum in signals:
            handler = _signal.getsignal(signum)
            if callable(handler):
                handler(signum, None)
        return
    main = threading.main_thread().ident
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        for signum in signals:
            signal.pthread_kill(main, signum)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
