"""``optimizer.state`` containers that count their writes.

step() caches the pointers of each group's state and scales between steps (``_plan``).
The cache must notice when an entry is added, replaced or removed, by the optimizer or
by anyone holding ``optimizer.state`` or ``optimizer._scales``; these dict types advance
``state_epoch()`` on every write while reads stay native dict reads.
"""

from __future__ import annotations

from collections import defaultdict

_epoch = [0]


def state_epoch() -> int:
    """A number that changes whenever any optimizer state entry is added or replaced."""
    return _epoch[0]


def _touch() -> None:
    _epoch[0] += 1


class _CountsWrites:
    """Mixin for dict types: every write advances ``state_epoch`` (reads stay native)."""

    def __setitem__(self, key, value):
        _touch()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        _touch()
        super().__delitem__(key)

    def __ior__(self, other):
        _touch()
        return super().__ior__(other)

    def clear(self):
        _touch()
        super().clear()

    def pop(self, *args):
        _touch()
        return super().pop(*args)

    def popitem(self):
        _touch()
        return super().popitem()

    def setdefault(self, key, default=None):
        _touch()
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        _touch()
        super().update(*args, **kwargs)


class ParamState(_CountsWrites, dict):
    """``optimizer.state[param]``: a dict that counts its writes."""


class OptimizerState(_CountsWrites, defaultdict):
    """``optimizer.state``: torch's ``defaultdict(dict)``, counting its writes."""

    def __init__(self, *args, **kwargs):
        super().__init__(ParamState, *args, **kwargs)

    def __reduce__(self):
        return (type(self), (), None, None, iter(self.items()))

    def __copy__(self):
        return type(self)(self)


class Scales(_CountsWrites, dict):
    """``optimizer._scales``: ``{param: ParamState(state name -> 0-dim fp32 scale)}``,
    counting its writes (a plain dict: reading a missing parameter creates nothing)."""

    def __copy__(self):
        return type(self)(self)


def tracked_scales(scales) -> Scales:
    """``scales`` as a ``Scales`` whose entries count their writes (a copy if foreign)."""
    if not isinstance(scales, Scales):
        _touch()
        scales = Scales(scales or {})
    for key, entry in list(scales.items()):
        if not isinstance(entry, ParamState):
            scales[key] = ParamState(entry)
    return scales


def tracked(state, param=None) -> OptimizerState:
    """``state`` as a container that counts writes: itself, converted in place, or (for
    a foreign mapping) a counting copy. With ``param`` only that entry is converted,
    which keeps per-parameter calls O(1)."""
    if not isinstance(state, OptimizerState):
        _touch()
        return OptimizerState(
            (k, v if isinstance(v, ParamState) else ParamState(v)) for k, v in state.items())
    keys = [param] if param is not None else list(state)
    for key in keys:
        entry = dict.get(state, key)
        if entry is not None and not isinstance(entry, ParamState):
            state[key] = ParamState(entry)
    return state
