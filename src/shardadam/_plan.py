"""What step() gathers for one parameter group, cached between steps.

A ``GroupPlan`` holds the group's static picture: its parameters split by device into
``DeviceBatch`` objects, each parameter's local tensor and layout (``_dtensor``), and
(once bound) its local state tensors and scales, with the format of each (``_formats``,
from the configuration). It stays valid while the group holds the same parameters with
the same local storage (pointer, size, strides, dtype), every state and scale it bound
is still the object ``optimizer.state`` / ``optimizer._scales`` hold under its name and
still has the same memory, and the state configuration is unchanged; ``is_current``
checks exactly that, by identity, so a step re-reads only what changes every step: the
gradients (for DTensor parameters, checked against the cached layouts and unwrapped to
local tensors). Once every group's plan has passed that check, ``PlanSet`` makes the same
check for all of them at once.

Building a plan only reads (it is part of validation); ``bind`` is the one place that
creates or converts state, and runs after every group has been validated.
"""

from __future__ import annotations

import itertools
import operator
import os
import sys
import warnings
from typing import Optional

import torch

from . import _dtensor, _state, _validate
from ._formats import PARAM_TAGS

_Tensor = torch.Tensor
_dtype_of = operator.attrgetter("dtype")
_STRIDED = torch.strided
_grad_of = operator.attrgetter("grad")
_local_tensor_of = operator.attrgetter("_local_tensor")


class Entry:
    """One parameter of a batch: its local tensor, layout and local state storage, with
    the format of each state (from the configuration it was bound to; None for no
    master) and its scale."""

    __slots__ = ("index", "place", "param", "local", "layout", "numel", "param_kind",
                 "exp_avg", "exp_avg_format", "exp_avg_scale", "exp_avg_sq",
                 "exp_avg_sq_format", "exp_avg_sq_scale", "master", "master_format",
                 "master_scale", "first_index", "scale_block", "exp_avg_rounding",
                 "rounding_key", "param_rounding", "exp_avg_sq_rounding", "in_place")

    def __init__(self, index: int, param: torch.Tensor, place: str, rounding_key: int,
                 config: _state.StateConfig):
        self.index = index
        self.rounding_key = rounding_key  # S2.13: one per parameter, the same on every rank
        self.place = place  # "group g, param i ('name')", for the core's messages
        self.param = param
        self.local = _dtensor.to_local(param)
        self.layout = _dtensor.layout_of(param)
        self.numel = self.local.numel()
        self.param_kind = PARAM_TAGS[self.local.dtype]
        self.first_index, self.scale_block = 0, 0  # set by bind()
        # Stepped where it lies: contiguous, or its states in its own memory order (S2.6,
        # as the configuration stores them); else through a contiguous copy, written
        # back. Known before binding, for the checks of gradients that precede it.
        self.in_place = self.local.is_contiguous() or any(
            spec.strides for spec in config.specs_of(self.local, self.layout))

    def bind(self, specs: tuple, entry: dict, scales: Optional[dict],
             param_rounding: str) -> None:
        """Remember the local storage of ``entry`` and its ``scales`` (which hold
        exactly ``specs``), and how the parameter is rounded (``param_rounding``)."""
        self.master, self.master_format, self.master_scale = None, None, None
        # Per-block moments (S2.9): where the local tensor's blocks start, and their
        # size (both moments of one configuration share it; 0: none is per block).
        self.first_index, self.scale_block = 0, 0
        self.exp_avg_rounding = self.exp_avg_sq_rounding = 0  # nearest
        # S2.14: a bf16 parameter with no master, its bits keyed like a block's.
        self.param_rounding = int(_state.rounds_stochastically(param_rounding,
                                                               self.local.dtype, specs))
        if self.param_rounding:
            self.first_index = self.layout.first_index(self.local)
        for spec in specs:
            if spec.format.scale == "block":
                self.first_index, self.scale_block = spec.first_index, spec.format.scale_block
            stored = _dtensor.to_local(entry[spec.name])
            scale = scales.get(spec.name) if scales else None
            if spec.name == "exp_avg":
                self.exp_avg, self.exp_avg_format = stored, spec.format
                self.exp_avg_scale = scale
                # A 4-bit exp_avg rounds stochastically (S2.12, S2.13).
                self.exp_avg_rounding = int(spec.format.name == "fp4-block")
            elif spec.name == "exp_avg_sq":
                self.exp_avg_sq, self.exp_avg_sq_format = stored, spec.format
                self.exp_avg_sq_scale = scale
                # So does a per-block exp_avg_sq, 4-bit or 8-bit (S2.10, S2.13).
                self.exp_avg_sq_rounding = int(spec.format.name in ("ufp4-block",
                                                                    "ufp8-block"))
            else:
                self.master, self.master_format = stored, spec.format
                self.master_scale = scale


class DeviceBatch:
    """The parameters of one group that live on one device, in group order."""

    def __init__(self, device: torch.device, entries: list):
        self.device = device
        self.is_cpu = device.type == "cpu"
        self.is_cuda = device.type == "cuda"
        self.entries = entries
        self.params = [e.param for e in entries]
        self.shapes = [e.local.shape for e in entries]
        self.layouts = [e.layout for e in entries]
        self.plain = not any(layout.is_dtensor for layout in self.layouts)
        self.grad_check = None if self.plain else _dtensor.GradCheck(self.layouts)
        # Every gradient is read where it lies if it is contiguous (read_as_is).
        self.contiguous = all(e.local.is_contiguous() for e in entries)
        # Left for the backends to fill (e.g. the C++ paths' slot rows); dropped with
        # the plan, so never stale.
        self.backend_cache = {}


def rounding_key(group_index: int, index: int) -> int:
    """S2.13's per-tensor key of parameter ``index`` of group ``group_index``, from its
    position, which every rank and every resumed run share: ``(group_index ·
    0x9E3779B9 + index) mod 2^32``, distinct for any two parameters of up to 2,048
    groups of up to 2^20 parameters each."""
    return (group_index * 0x9E3779B9 + index) & 0xFFFFFFFF


class GroupPlan:
    """One group's parameters by device, their state once bound, and what it was built
    from (to tell when it is stale)."""

    def __init__(self, group: dict, group_index: int, params: list,
                 config: _state.StateConfig, state, scales, formats):
        self.group = group
        self.params = params
        self.param_ids = frozenset(map(id, params))  # for holds()
        self.plain = not _dtensor.any_dtensor(params)
        self.param_keys = _dtensor.local_storage_keys(params, self.plain)
        self.config = config
        self.state = state
        self.scales = scales
        self.formats = formats
        self.bound = False
        self.held = None  # set by bind(): what the plan rests on, see is_current
        self.entries = [
            Entry(i, p, _validate.place(group_index, i, _validate.param_name(group, i)),
                  rounding_key(group_index, i), config)
            for i, p in enumerate(params)]
        by_device = {}
        for entry in self.entries:
            by_device.setdefault(entry.local.device, []).append(entry)
        self.batches = [DeviceBatch(device, entries) for device, entries in by_device.items()]
        self.has_cuda = any(batch.is_cuda for batch in self.batches)
        # A parameter made under torch.inference_mode, which only a step in that mode
        # may update (checked at each step: the mode may change between steps).
        self.inference_param = next((e for e in self.entries if e.local.is_inference()),
                                    None)

    def is_current(self, group: dict, config, state, scales, formats,
                   listing: Optional["Listing"] = None) -> bool:
        """Whether the plan still holds (see the module docstring); ``listing``: the
        step's listing of the state containers, shared by every group's check."""
        params = group["params"]
        return (self.bound and self.group is group
                and self.state is state and self.scales is scales
                and self.formats is formats
                and self.config == config
                and len(params) == len(self.params)
                and all(map(operator.is_, params, self.params))  # so `plain` still holds
                and _dtensor.local_storage_keys(params, self.plain) == self.param_keys
                and self.held.unchanged(listing))

    def holds(self, param) -> bool:
        """Whether ``param`` is one of the plan's parameters."""
        return id(param) in self.param_ids

    def bind(self, seeded: dict, owner, before_writing=None) -> None:
        """Create or convert each parameter's state to match the configuration, then
        remember the storage. ``seeded``: the optimizer's masters that follow their
        parameter (S1.6), kept current; ``owner``: the optimizer, which the scaled states
        stored are claimed by (``_stored_by``); ``before_writing``: called before the
        first write (a state already settled, e.g. made by ``add_param_group``, needs
        none). Runs after validation: this is a mutation."""
        state, scales, formats = self.state, self.scales, self.formats
        for entry in self.entries:
            specs = self.config.specs_of(entry.local, entry.layout)
            writes = _state.plan_entry(specs, state.get(entry.param), scales.get(entry.param),
                                       formats.get(entry.param), entry.local, entry.layout,
                                       seeded=entry.param in seeded)
            if not writes.empty():  # leave a settled entry alone
                if before_writing is not None:
                    before_writing()
                    before_writing = None
                _state.apply_entry(state, scales, formats, entry.param, writes, entry.local,
                                   entry.layout, owner)
                _state.mark_seeded(seeded, state, entry.param, writes)
            entry.bind(specs, state[entry.param], scales.get(entry.param),
                       self.config.param_rounding)
        self.held = _Held(self.entries, self.config, state, scales)
        self.bound = True
        for batch in self.batches:
            batch.backend_cache.clear()


class _Held:
    """The state objects a bound plan read, where it found them, and the memory the core
    is given: the plan is current while every one is still the object found under its
    name and still has that memory, shape and strides. Objects can be replaced
    (``optimizer.state[p][name] = t``, ``optimizer.state[p] = {...}``,
    ``initialize_state``), memory can move in place (``t.data = ...``, ``share_memory_()``,
    which torch.multiprocessing applies to every CPU tensor it sends), and its geometry
    change in place (``resize_``, ``as_strided_``), scales included.

    This runs at every step, so it is written as C-level ``map``s and looks nothing up by
    parameter (hashing a tensor runs Python code): it remembers where each parameter's
    entry sits in ``optimizer.state`` / ``optimizer._scales`` (dicts keep insertion
    order) and checks that the same parameter still sits there; a container whose keys
    moved (one was deleted) only makes the plan be rebuilt."""

    def __init__(self, entries: list, config, state, scales,
                 listing: Optional["Listing"] = None):
        self.state, self.scales = state, scales
        specs = [{spec.name: spec for spec in config.specs(e.local.dtype)} for e in entries]
        params = [e.param for e in entries]
        scaled = [any(spec.scaled for spec in by_name.values()) for by_name in specs]
        self.params = (params, list(itertools.compress(params, scaled)))
        self.positions = (_positions(state, self.params[0]),
                          _positions(scales, self.params[1]))
        scaled_specs = list(itertools.compress(specs, scaled))
        self.names = ([(name, [name in by_name for by_name in specs])
                       for name in _state.STATE_NAMES],
                      [(name, [name in by_name and by_name[name].scaled
                               for by_name in scaled_specs])
                       for name in _state.STATE_NAMES])
        self.objects = self._found(listing)
        self.storage = [t for e in entries
                        for t in (e.exp_avg, e.exp_avg_sq, e.master, e.exp_avg_scale,
                                  e.exp_avg_sq_scale, e.master_scale) if t is not None]
        self.pointers = list(map(_Tensor.data_ptr, self.storage))
        self.shapes = list(map(_Tensor.size, self.storage))
        self.strides = list(map(_Tensor.stride, self.storage))
        self.kinds = _kinds(self.storage)
        # A DTensor state's local tensor may be swapped inside the same DTensor object.
        self.wrapped = [t for t in self.objects if _dtensor.is_dtensor(t)]
        self.wrapped_locals = list(map(_local_tensor_of, self.wrapped))

    def _found(self, listing: Optional["Listing"] = None) -> Optional[list]:
        """What the containers hold now under every key, or None if a parameter's entry
        is gone or moved, or a name is missing."""
        found = []
        listing = listing or Listing()
        for container, params, positions, names in zip(
                (self.state, self.scales), self.params, self.positions, self.names):
            if not params:  # no scaled state: the scales are not read
                continue
            keys, entries = listing.of(container)
            try:
                if not all(map(operator.is_, map(keys.__getitem__, positions), params)):
                    return None
                dicts = list(map(entries.__getitem__, positions))
                for name, has in names:
                    found += map(operator.getitem, itertools.compress(dicts, has),
                                 itertools.repeat(name))
            except (IndexError, KeyError, TypeError):  # fewer keys, a name gone, no dict
                return None
        return found

    def unchanged(self, listing: Optional["Listing"] = None) -> bool:
        found = self._found(listing)
        return (found is not None and all(map(operator.is_, found, self.objects))
                and all(map(operator.is_, map(_local_tensor_of, self.wrapped),
                            self.wrapped_locals))
                and list(map(_Tensor.data_ptr, self.storage)) == self.pointers
                # Compared one at a time: a list of every torch.Size (a tuple subclass the
                # collector never untracks) would set off full garbage collections.
                and all(map(operator.eq, map(_Tensor.size, self.storage), self.shapes))
                and list(map(_Tensor.stride, self.storage)) == self.strides
                and _kinds(self.storage) == self.kinds)


def _kinds(tensors: list) -> list:
    """Each tensor's dtype and neg bit: a view of another dtype (``t.data =
    t.data.view(torch.bfloat16)``) or a lazily negated one has the same memory, read
    otherwise."""
    return list(zip(map(_dtype_of, tensors), map(_Tensor.is_neg, tensors)))


class PlanSet:
    """Every group's bound plan, checked as one: ``GroupPlan.is_current`` costs about
    10 µs a group whatever its size, most of it fixed costs that a step of thousands of
    groups (one per parameter: layer-wise lr, per-parameter settings) paid thousands of
    times. Built in a step where every group's plan was found current, so what it
    captures is what those checks verified; ``is_current`` is then their conjunction,
    over the groups' concatenated lists at once."""

    def __init__(self, groups: list, plans: list, config, state, scales, formats,
                 listing: "Listing"):
        self.groups = list(groups)
        self.plans = list(plans)
        self.config, self.state, self.scales, self.formats = config, state, scales, formats
        self.counts = [len(plan.params) for plan in plans]
        self.params = [param for plan in plans for param in plan.params]
        self.plain = all(plan.plain for plan in plans)
        self.param_keys = [key for plan in plans for key in plan.param_keys]
        self.held = _Held([entry for plan in plans for entry in plan.entries], config,
                          state, scales, listing)

    def is_current(self, groups: list, plans: list, config, state, scales, formats,
                   listing: "Listing") -> bool:
        """Whether ``plans[i]`` is current for ``groups[i]``, for every group."""
        if not (len(groups) == len(self.groups) and len(plans) >= len(self.plans)
                and self.state is state and self.scales is scales
                and self.formats is formats and self.config == config
                and all(map(operator.is_, groups, self.groups))
                and all(map(operator.is_, plans, self.plans))):
            return False
        try:
            lists = list(map(operator.itemgetter("params"), groups))
            if list(map(len, lists)) != self.counts:
                return False
            params = list(itertools.chain.from_iterable(lists))
        except (KeyError, TypeError):  # malformed groups: each is checked by name
            return False
        return (all(map(operator.is_, params, self.params))  # so `plain` still holds
                and _dtensor.local_storage_keys(params, self.plain) == self.param_keys
                and self.held.unchanged(listing))


class Listing:
    """The keys and values of the state containers (``optimizer.state``, ``_scales``),
    listed once per step for every group's ``_Held`` check: listed per group, a step
    of one group per parameter (layer-wise lr, per-parameter settings) would cost
    O(groups × parameters). Valid while nothing writes the containers: the checks of
    one step, which only read."""

    __slots__ = ("_lists",)

    def __init__(self):
        self._lists = {}

    def of(self, container: dict) -> tuple:
        """``(keys, values)`` of ``container``, as lists."""
        found = self._lists.get(id(container))
        if found is None:
            found = self._lists[id(container)] = (list(container), list(container.values()))
        return found


def _positions(container: dict, params: list) -> list:
    """Where each of ``params`` sits among ``container``'s keys."""
    where = {id(key): i for i, key in enumerate(container)}
    return [where[id(p)] for p in params]


def build_plan(group: dict, group_index: int, config, state, scales, formats,
               owner) -> GroupPlan:
    """A new plan for ``group`` after checking its parameters and existing state
    (``owner``: the optimizer whose state it is).

    Reads only: raises before anything is written.
    """
    params = list(group["params"])
    _validate.check_params(params, group_index, group)
    plan = GroupPlan(group, group_index, params, config, state, scales, formats)
    for entry in plan.entries:
        if config.param_rounding == "stochastic" and entry.local.dtype == torch.float16:
            raise _validate.fail(
                RuntimeError, "is float16, and param_rounding='stochastic' rounds bf16 "
                "parameters only (rule: fp32 or bf16 parameters, S2.14)", group=group_index,
                param=entry.index, name=_validate.param_name(group, entry.index))
        existing = state.get(entry.param)
        error = _state.consistency_error(config.specs_of(entry.local, entry.layout),
                                         existing, entry.local, entry.layout,
                                         scales.get(entry.param), formats.get(entry.param),
                                         owner, entry.param)
        if error is not None:
            raise _validate.fail(RuntimeError, error, group=group_index, param=entry.index,
                                 name=_validate.param_name(group, entry.index))
    return plan


class BatchGrads:
    """One step's gradients of a batch: aligned with ``batch.entries``, None where a
    parameter is skipped, with their dtype tags (0 for None)."""

    __slots__ = ("batch", "grads", "kinds", "dense")

    def __init__(self, batch: DeviceBatch, grads: list, kinds: list, dense: bool):
        self.batch = batch
        self.grads = grads
        self.kinds = kinds
        self.dense = dense  # every gradient present is contiguous


def gather_grads(batch: DeviceBatch, use_decoupled_grad: bool, group: dict,
                 group_index: int) -> BatchGrads:
    """Read and check the batch's gradients (S3.2 - S3.4). Reads only."""
    if use_decoupled_grad:
        grads = [getattr(p, "decoupled_grad", None) for p in batch.params]
    else:
        grads = list(map(_grad_of, batch.params))  # no Python frame per parameter
    local_grads = grads if batch.plain else batch.grad_check.local_grads(grads)
    if local_grads is not None:
        kinds = _fast_kinds(local_grads, batch)
        if kinds is not None:
            return BatchGrads(batch, local_grads, kinds, True)
    kinds, dense, local_grads = [], True, []
    for entry, grad in zip(batch.entries, grads):
        if grad is None:
            kinds.append(0)
            local_grads.append(None)
            continue
        error = _validate.grad_error(entry.param, grad)
        if error is not None:
            raise _validate.fail(RuntimeError, error, group=group_index, param=entry.index,
                                 name=_validate.param_name(group, entry.index))
        grad = _dtensor.to_local(grad)
        if grad.is_neg():
            # A lazily negated view (torch's neg bit: its memory holds -value) is read
            # through a copy of its values, as the core reads raw memory (S3.2).
            grad = grad.resolve_neg()
        elif grad._is_zerotensor():  # torch's memoryless zeros: the core reads memory
            grad = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
        dense = dense and grad.is_contiguous()
        kinds.append(PARAM_TAGS[grad.dtype])
        local_grads.append(grad)
    return BatchGrads(batch, local_grads, kinds, dense)


def warn_unread_decoupled_grads(batches: list) -> None:
    """Warns (S3.2) when a parameter skipped for having no ``.grad`` holds a
    ``decoupled_grad`` tensor, which only ``use_decoupled_grad=True`` reads: Megatron FSDP
    with its own ``use_decoupled_grad=True`` writes only that, and an optimizer left at
    False would train nothing, silently. Once per call; Python's filter shows it once."""
    for grads in batches:
        if 0 not in grads.kinds:  # 0: no gradient
            continue
        for entry, kind in zip(grads.batch.entries, grads.kinds):
            if kind == 0 and isinstance(getattr(entry.param, "decoupled_grad", None),
                                        torch.Tensor):
                warnings.warn(
                    f"{_validate.CLASS_NAME}: {entry.place}: has no .grad but a "
                    "decoupled_grad tensor, which use_decoupled_grad=False does not read: "
                    "it is not stepped (Megatron FSDP's use_decoupled_grad=True needs "
                    "FusedAdam(use_decoupled_grad=True) too; S3.2)", UserWarning,
                    stacklevel=_callers_level())
                return


_OWN_FRAMES = (os.path.dirname(os.path.abspath(__file__)),
               os.path.dirname(os.path.abspath(torch.__file__)))


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside this package and torch (the call of
    ``step()``, whichever of torch's wrappers and hooks run around it)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_FRAMES):
        frame, level = frame.f_back, level + 1
    return level


def read_as_is(entry: Entry, grad: torch.Tensor) -> bool:
    """Whether a step reads ``grad`` where it lies, on every path: laid out as its
    parameter is stepped, contiguous or in the parameter's own order
    (``Entry.in_place``); else it reads a copy taken before any update (``laid_out``).
    Only a gradient read as it is is checked against the memory the step writes."""
    local = entry.local
    if entry.in_place and not local.is_contiguous():
        return grad.stride() == local.stride()
    return grad.is_contiguous()


def laid_out(entry: Entry, grad: torch.Tensor) -> torch.Tensor:
    """``grad``, or a copy of it laid out as its parameter is stepped."""
    if read_as_is(entry, grad):
        return grad
    local = entry.local
    if entry.in_place and not local.is_contiguous():
        return torch.empty_strided(local.shape, local.stride(), dtype=grad.dtype,
                                   device=grad.device).copy_(grad)
    return grad.contiguous()


def _fast_kinds(grads: list, batch: DeviceBatch) -> Optional[list]:
    """Dtype tags when every gradient is a plain, contiguous, well-formed tensor on the
    batch's device (the common case, checked with as few calls as possible); else None,
    and the caller checks each gradient in full."""
    kinds = []
    get_kind = PARAM_TAGS.get
    device = batch.device
    is_cpu = batch.is_cpu
    for grad, shape in zip(grads, batch.shapes):
        if grad is None:
            kinds.append(0)
            continue
        # The layout first: sparse and mkldnn tensors have no is_contiguous or storage;
        # nested ones (strided, some of them) have no shape.
        if (type(grad) is not _Tensor or grad.layout is not _STRIDED or grad.is_nested
                or grad.shape != shape
                or not grad.is_contiguous() or grad.is_neg() or grad._is_zerotensor()
                or not (grad.is_cpu if is_cpu else grad.device == device)):
            return None
        kind = get_kind(grad.dtype)
        if kind is None:
            return None
        kinds.append(kind)
    present = [grad for grad in grads if grad is not None]
    if not _validate.storages_hold(present):  # freed or shrunk: named by the full check
        return None
    return kinds
