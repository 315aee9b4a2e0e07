"""Chooses how a batch is stepped (SEMANTICS S7): the C++ core for CPU tensors, its
CUDA build for CUDA tensors where the extension has one and sees a device, torch ops
otherwise.

Every implementation fulfils the same contract (S3.6): the C++ core gives the same bits
on CPU and on CUDA, and the torch path gives them too on CPU. ``use_backend("torch")``
forces the torch path everywhere (tests compare the paths; devices without a C++ build
use it). A step prepares every batch (the C++ paths' slot rows), checks the C++ calls
of each device together (and the torch path's batches together), and only then
runs them, group by group.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from . import _cpu_path, _cuda_path, _dtensor, _plan, _slots, _torch_path, _validate

_BACKENDS = ("auto", "torch")
_mode = "auto"


class Hyper(NamedTuple):
    """One group's step: validated hyper-parameters and the step being taken."""

    lr: object  # a float, or a CUDA tensor that only the CUDA kernels read (S1.2)
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: bool
    bias_correction: bool
    step: int


@contextlib.contextmanager
def use_backend(name: str):
    """Within the block, step with ``name``: ``"auto"`` (C++ for CPU tensors when the
    extension is importable and for CUDA tensors when it has CUDA and sees a device,
    torch ops otherwise) or ``"torch"`` (torch ops only)."""
    global _mode
    if name not in _BACKENDS:
        raise ValueError(f"shardadam: unknown backend {name!r}; expected one of {_BACKENDS}")
    previous, _mode = _mode, name
    try:
        yield
    finally:
        _mode = previous


def path_of(batch):
    """The C++ path module that steps ``batch`` (``_cpu_path`` or ``_cuda_path``), or
    None for the torch path."""
    if _mode == "auto":
        if batch.is_cpu:
            if _cpu_path.available():
                return _cpu_path
        elif (batch.is_cuda and _cuda_path.available(batch.device)
              and _cuda_path.steps_formats(batch)):
            return _cuda_path
    return None


def warn_unbuilt(groups) -> None:
    """Before a step: says once where CPU tensors would take the torch path because the
    C++ extension was never built (``_cpu_path.warn_unbuilt``); groups not yet checked."""
    if _mode == "auto":
        _cpu_path.warn_unbuilt(
            p for group in (groups if isinstance(groups, (list, tuple)) else ())
            if isinstance(group, dict) and isinstance(group.get("params"), (list, tuple))
            for p in group["params"])


def reads_lr_on_device(batches) -> bool:
    """Whether every batch steps in the CUDA kernels, which read an lr held in a CUDA
    tensor where it is (the CPU core and the torch path need its value on the host)."""
    return all(path_of(batch) is _cuda_path for batch in batches)


class Prepared(NamedTuple):
    """One batch's update, ready to run: its path and, for a C++ path, its call."""

    work: object  # _plan.BatchGrads
    path: object  # path_of(work.batch)
    call: object  # _slots.Call, or None on the torch path


def prepare(work) -> Prepared:
    path = path_of(work.batch)
    if path is None:
        return Prepared(_torch_path.prepare(work), None, None)
    return Prepared(work, path, path.prepare(work))


def check_before_binding(works: list, standing: list, state, scales) -> None:
    """Before a step binds plans, which creates or converts state (a change that a
    refused step must not leave, S3.1): each gradient against the parameters and the
    state that exist already (buffers that binding creates are new memory), and the
    scales of the plans that stand (``standing``'s batches: checked when they were
    built, they may have been changed in place since, which ``check_together`` would
    find only after binding wrote)."""
    _torch_path.check_scales(standing)
    def written(entry):
        tensors = [("param", entry.local)]
        stored = state.get(entry.param)
        # Anything but a dict (None put there by hand) is replaced or refused later.
        tensors += stored.items() if isinstance(stored, dict) else ()
        tensors += [(f"{name}_scale", scale)
                    for name, scale in (scales.get(entry.param) or {}).items()]
        return [(name, _dtensor.to_local(tensor)) for name, tensor in tensors
                if isinstance(tensor, torch.Tensor)]

    _refuse_grads_in_written_memory(works, written)


def _refuse_grads_in_written_memory(works: list, written,
                                    written_apart: bool = False) -> None:
    """The core's rule on gradients, checked in Python: for every parameter the step
    updates (one with a gradient), its gradient against ``written(entry)``'s ``(name,
    tensor)`` pairs and every other updated parameter's. A non-contiguous gradient is
    stepped through a copy taken before any update, so it is left out, as the core
    only sees the copy. ``written_apart``: the written tensors are known not to share
    memory (parameters, checked when the plan was bound), so only gradients are
    compared with them (interleaving views' bytes are then not compared at every
    step: on a GPU each comparison waits for the device)."""
    by_device = {}
    for work in works:
        spans = by_device.setdefault(work.batch.device, [])
        for entry, grad in zip(work.batch.entries, work.grads):
            if grad is None or entry.numel == 0:
                continue
            order, place = len(spans), entry.place
            if _plan.read_as_is(entry, grad):
                spans.append(_validate.memory_span(grad) + (order, False, "grad", place,
                                                            grad))
            spans += [_validate.memory_span(tensor) + (order, True, name, place, tensor)
                      for name, tensor in written(entry) if tensor.numel() > 0]
    _validate.refuse_shared_grads(by_device, written_apart)


def check_together(prepared: list, passed: dict, lone_too: bool = False) -> None:
    """A step of several C++ calls (groups, devices) is one step: the slots of each
    device's calls are checked as one list before any call runs, so that a gradient
    sharing memory with a buffer another call writes is refused before anything is
    updated; a lone call too where the torch path writes other batches of the step
    before it. ``passed`` (the optimizer's, per device) remembers the last lists that
    passed: only the gradient columns change while the plans stand, so an unchanged
    set of gradients is not checked again, but for the values of the scales in host
    memory, which may change in place (a refused one is then checked in full, for the
    core's message). The torch path's batches are checked for the same rules by
    ``_torch_path.check_shared_memory`` and ``check_scales``. ``lone_too``: a lone call
    is checked here too (something is written before it runs)."""
    torch_works, calls, count, write_back = [], {}, 0, False
    for item in prepared:
        call = item.call
        if call is None:
            torch_works.append(item.work)
        elif call.slots:
            calls.setdefault(item.work.batch.device, []).append(call)
            count += 1
            write_back = write_back or bool(call.write_back)
    if torch_works:
        _torch_path.check_shared_memory(torch_works, passed)
        _torch_path.check_scales(torch_works)
    if write_back:
        _check_written_back(prepared)
    if count < 2 and not torch_works and not lone_too:
        return  # a lone call checks itself before writing anything
    for device, same_device in calls.items():
        signature = [(call.entries, call.slots[_slots.GRAD::_slots.COLUMNS],
                      call.slots[_slots.GRAD_KIND::_slots.COLUMNS])
                     for call in same_device]
        if (_same_signature(passed.get(device), signature)
                and (device.type != "cpu" or _scales_valid(same_device))):
            continue
        try:
            _check_slots(device, [value for call in same_device for value in call.slots])
        except ValueError as error:
            entries = [entry for call in same_device for entry in call.entries]
            raise _slots.refusal(error, entries) from None
        passed[device] = signature


def _check_slots(device: torch.device, slots: list) -> None:
    """The checks the device's calls make before they write anything, on every call of
    a step at once: a CUDA call's include the CUDA backend's own rules (alignment,
    size), so one that would refuse is refused before another call has run."""
    extension = _slots.extension
    if device.type == "cuda" and hasattr(extension, "check_cuda_step_slots"):
        extension.check_cuda_step_slots(slots)
    else:
        extension.check_step_slots(slots, device.type != "cpu")


def _check_written_back(prepared: list) -> None:
    """The core sees a non-contiguous parameter only as its contiguous copy; the step
    writes the parameter's own memory when the copy is written back. A gradient in that
    memory is refused here, as on a step that binds (check_before_binding) and on the
    torch path. Only steps with such a parameter run this."""
    _refuse_grads_in_written_memory(
        [item.work for item in prepared if item.call is not None],
        lambda entry: [] if entry.in_place else [("param", entry.local)],
        written_apart=True)


def _scales_valid(calls: list) -> bool:
    """Whether every scale these calls read is finite and > 0 (the core's rule), in a
    few torch operations whatever the number of tensors (their batches' flat views,
    made once per plan; a batch's parameters without a gradient count too: a False
    only sends the step to the core's full check)."""
    scales = [scale for call in calls for scale in call.scales]
    if not scales:
        return True
    flat = torch.cat(scales)
    return bool((torch.isfinite(flat) & (flat > 0)).all())


def _same_signature(old, new) -> bool:
    # The entry lists by identity: a rebuilt plan has new ones (and `old` keeps these
    # alive, so an identity cannot be reused).
    return (old is not None and len(old) == len(new)
            and all(a[0] is b[0] and a[1] == b[1] and a[2] == b[2]
                    for a, b in zip(old, new)))


def run(item: Prepared, hyper: Hyper) -> None:
    """Update one prepared batch (one group's parameters on one device)."""
    if item.path is None:
        _torch_path.step(item.work, hyper)
    else:
        item.path.run(item.work, item.call, hyper)
