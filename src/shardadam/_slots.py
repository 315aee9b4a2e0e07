"""The slot rows the C++ extension reads, shared by its CPU and CUDA entry points.

``shardadam._C.adam_step`` and ``adam_step_cuda`` take one flat list of integers per
tensor: its numel, then the data pointer and dtype tag of every buffer (a format's
``tag``, ``_formats``) and the pointer of each scale, in the order the extension names
them (``_C.SLOT_COLUMN_NAMES``, bindings/module.cc ``Column``): each value is placed by
name, never by an assumed position. Everything but the gradient is fixed while the plan
is valid, so each batch keeps its rows and a step only writes the gradients' pointers
and tags.
"""

from __future__ import annotations

import importlib
import itertools
import warnings

from . import _formats, _plan, _validate
from ._formats import TAG_NONE

try:
    # By its full name: `from . import _C`, run while the package itself is still
    # importing, reports a missing module as a circular import.
    extension = importlib.import_module(f"{__package__}._C")
except ImportError as _error:
    extension = None  # every batch takes the torch path
    # Not built (a source tree on PYTHONPATH): said before the first step of CPU
    # parameters (_cpu_path.warn_unbuilt), so a package used only on other devices is
    # quiet.
    # Built but not loadable (an undefined symbol, another Python's build): said now.
    missing = isinstance(_error, ModuleNotFoundError) and _error.name == f"{__package__}._C"
    if not missing:
        warnings.warn(f"shardadam._C could not be loaded ({_error}); every step takes "
                      f"the torch path, much slower on CPU: rebuild the extension",
                      RuntimeWarning)
else:
    missing = False

# What a slot row holds, in the order _row() lists it.
NAMES = ("numel", "param", "param_dtype", "grad", "grad_dtype",
         "exp_avg", "exp_avg_dtype", "exp_avg_scale",
         "exp_avg_sq", "exp_avg_sq_dtype", "exp_avg_sq_scale",
         "master_param", "master_dtype", "master_scale",
         "first_index", "scale_block", "exp_avg_rounding", "rounding_key",
         "param_rounding", "exp_avg_sq_rounding")

# The extension's names of the formats' tags.
_TAG_NAMES = {"DTYPE_NONE": None, "DTYPE_FLOAT32": "fp32", "DTYPE_FLOAT16": "fp16",
              "DTYPE_BFLOAT16": "bf16", "DTYPE_FLOAT8_E4M3": "fp8",
              "DTYPE_INT16_REMAINDER": "remainder"}


def columns_of(module) -> dict:
    """``{name: position}`` of the extension's slot columns, after checking that it
    reads exactly ``NAMES`` and the formats' tags (``_formats``): raw pointers cross
    this boundary, so an extension that differs is refused."""
    names = tuple(getattr(module, "SLOT_COLUMN_NAMES", ()))
    expected = {name: TAG_NONE if fmt is None else _formats.by_name(fmt).tag
                for name, fmt in _TAG_NAMES.items()}
    found = {name: getattr(module, name, None) for name in expected}
    if found != expected or sorted(names) != sorted(NAMES) or len(set(names)) != len(names):
        raise ImportError(f"shardadam._C does not match this package (expected columns "
                          f"{sorted(NAMES)} and tags {expected}, found {list(names)} and "
                          f"{found}): rebuild the extension")
    return {name: position for position, name in enumerate(names)}


_COLUMN = columns_of(extension) if extension is not None \
    else {name: position for position, name in enumerate(NAMES)}
if extension is not None:
    _formats.use_extension(extension)  # the core's own table of the formats
COLUMNS = len(NAMES)
GRAD, GRAD_KIND, _PARAM = _COLUMN["grad"], _COLUMN["grad_dtype"], _COLUMN["param"]
# Where each of _row()'s values goes.
_PLACES = [_COLUMN[name] for name in NAMES]


def _ptr(tensor) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def _tag(fmt) -> int:
    return TAG_NONE if fmt is None else fmt.tag


def _row(entry) -> list:
    values = (entry.numel,
              entry.local.data_ptr(), entry.param_kind,
              0, 0,  # the gradient, filled in at every step
              entry.exp_avg.data_ptr(), entry.exp_avg_format.tag, _ptr(entry.exp_avg_scale),
              entry.exp_avg_sq.data_ptr(), entry.exp_avg_sq_format.tag,
              _ptr(entry.exp_avg_sq_scale),
              _ptr(entry.master), _tag(entry.master_format), _ptr(entry.master_scale),
              entry.first_index, entry.scale_block,  # per-block moments (S2.9, S2.11)
              entry.exp_avg_rounding, entry.rounding_key,  # S2.13
              entry.param_rounding,  # S2.14
              entry.exp_avg_sq_rounding)  # S2.13
    row = [0] * COLUMNS
    for place, value in zip(_PLACES, values):
        row[place] = value
    return row


def _tensors(entry) -> tuple:
    return (entry.local, entry.exp_avg, entry.exp_avg_scale, entry.exp_avg_sq,
            entry.exp_avg_sq_scale, entry.master, entry.master_scale)


class _Rows:
    """A batch's static slot rows (non-empty tensors only) and their concatenation."""

    def __init__(self, batch):
        self.positions = [i for i, e in enumerate(batch.entries) if e.numel > 0]
        self.entries = [batch.entries[i] for i in self.positions]
        self.rows = [_row(entry) for entry in self.entries]
        self.flat = [value for row in self.rows for value in row]
        self.every_position = len(self.positions) == len(batch.entries)
        # The rows hold raw pointers: keep their memory alive even if a tensor's storage
        # is swapped behind the optimizer's back (`t.data = ...` is not seen by the plan).
        self.storages = [t.untyped_storage() for i in self.positions
                         for t in _tensors(batch.entries[i]) if t is not None]
        # Every scale the rows point at, flat, for the step's check of their values.
        self.scales = [scale.view(-1) for entry in self.entries
                       for scale in (entry.exp_avg_scale, entry.exp_avg_sq_scale,
                                     entry.master_scale) if scale is not None]


class Call:
    """One step's slots for one extension call, the plan entries they come from, the
    temporaries they point into, and the non-contiguous parameters to update from their
    copies once the call is made."""

    __slots__ = ("slots", "entries", "keep_alive", "write_back", "scales")

    def __init__(self, slots: list, entries: list, keep_alive: list, write_back: list,
                 scales: list):
        self.slots = slots
        self.entries = entries
        self.keep_alive = keep_alive
        self.write_back = write_back
        self.scales = scales  # the batch's scales, flat views (those of `entries` and more)

    @property
    def count(self) -> int:
        return len(self.slots) // COLUMNS

    def finish(self) -> None:
        """Copy stepped parameter copies back (queued behind the call on a device)."""
        for local, copy in self.write_back:
            local.copy_(copy)


def prepare(work) -> Call:
    """The slots of the tensors of ``work`` (a ``_plan.BatchGrads``) that step now."""
    batch = work.batch
    rows = batch.backend_cache.get("slots")
    if rows is None:
        rows = batch.backend_cache["slots"] = _Rows(batch)
    kinds = work.kinds
    if work.dense and batch.contiguous:
        if rows.every_position and 0 not in kinds:
            # Every tensor steps: patch the gradient columns of the cached rows.
            slots = rows.flat.copy()
            slots[GRAD::COLUMNS] = [g.data_ptr() for g in work.grads]
            slots[GRAD_KIND::COLUMNS] = kinds
            return Call(slots, rows.entries, [], [], rows.scales)
        # Empty shards (left out of the rows) and None gradients (kind 0: skipped,
        # S3.2): the cached rows of the rest, picked without a Python loop.
        kinds = list(map(kinds.__getitem__, rows.positions))
        grads = list(itertools.compress(map(work.grads.__getitem__, rows.positions), kinds))
        slots = list(itertools.chain.from_iterable(itertools.compress(rows.rows, kinds)))
        slots[GRAD::COLUMNS] = [g.data_ptr() for g in grads]
        slots[GRAD_KIND::COLUMNS] = list(itertools.compress(kinds, kinds))
        return Call(slots, list(itertools.compress(rows.entries, kinds)), [], [],
                    rows.scales)
    keep_alive, write_back, slots, entries = [], [], [], []
    for position, entry, row in zip(rows.positions, rows.entries, rows.rows):
        grad = work.grads[position]
        if grad is None:
            continue
        entries.append(entry)
        row = row.copy()
        local = entry.local
        read = _plan.laid_out(entry, grad)
        if read is not grad:
            keep_alive.append(read)
        row[GRAD], row[GRAD_KIND] = read.data_ptr(), kinds[position]
        if not entry.in_place:
            copy = local.contiguous()
            write_back.append((local, copy))
            row[_PARAM] = copy.data_ptr()
        slots.extend(row)
    return Call(slots, entries, keep_alive, write_back, rows.scales)


def refusal(error: ValueError, entries: list) -> ValueError:
    """The core's refusal with its tensors (positions in one call's slots) named as the
    parameters they are, built from the error's fields (``tensor_index``,
    ``other_tensor_index``, ``rule``; bindings/module.cc): ``"param [...] overlaps
    {other}'s grad"`` about tensors 1 and 0 becomes ``"FusedAdam: group 0, param 3
    ('b'): param [...] overlaps group 0, param 1 ('a')'s grad"``."""
    tensor = getattr(error, "tensor_index", -1)
    other = getattr(error, "other_tensor_index", -1)
    rule = getattr(error, "rule", str(error))
    if other >= 0:
        rule = rule.replace("{other}", entries[other].place, 1)
    text = f"{entries[tensor].place}: {rule}" if tensor >= 0 else rule
    return ValueError(f"{_validate.CLASS_NAME}: {text}")
