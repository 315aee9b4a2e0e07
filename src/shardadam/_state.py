"""Optimizer state: what each entry stores, how its true value is read and written.

A parameter's state lives in ``optimizer.state[param]`` as storage tensors under
``exp_avg``, ``exp_avg_sq`` and (when SEMANTICS S2.1 gives one) ``master_param``, in
their storage dtype; nothing of the optimizer's own goes there besides (torch's
checkpoint tools iterate those keys and expect a saved value for each), and keys others
write there (Megatron's ``step``) are left alone and carried through checkpoints. For
scaled formats (fp16 / fp8) the fp32 scale of each state is a tensor in
``optimizer._scales[param][name]`` (0-dim: one scale per tensor, S2.2), and the format
each state was stored in (``_formats``) is kept in ``optimizer._formats[param][name]``,
so state written under one configuration is read in its own format and converted to
another (S1.5).

Everything here works on local tensors; a DTensor parameter's states are wrapped in its
layout (``_dtensor``) only when they are put into ``optimizer.state``, and unwrapped when
read from it.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional

import torch

from . import _dtensor, _formats, _stored_by
from ._formats import Format
from ._memory import short_storage

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
# The param_groups key under which state_dict() records the state layout (S5.4).
LAYOUT_KEY = "state_layout"
# The field a group's record gains while it is at step 0 with moments set by hand (S5.4):
# moments at step 0 are otherwise taken for those of a lost counter (S5.5).
MOMENTS_SET_FIELD = "moments=set"
# A group at step 0 whose masters all still follow their parameters (S1.6): loaded at
# step 0 they follow again, whatever shard each rank now holds (S5.4).
MASTERS_FOLLOW_FIELD = "masters=follow"


class StateSpec(NamedTuple):
    """One state entry of one parameter: its name and storage format, and for a
    per-block format the flat index in the whole parameter of the local tensor's first
    element, which keys its blocks (S2.11)."""

    name: str
    format: Format
    first_index: int = 0
    # The storage's strides where they are the local tensor's own (a dense tensor that is
    # not contiguous, e.g. channels_last: the core then steps every buffer in that one
    # memory order, with no copies; S2.6); None: contiguous.
    strides: Optional[tuple] = None

    @property
    def scaled(self) -> bool:
        return self.format.scaled


class StateConfig(NamedTuple):
    """The optimizer settings that decide a parameter's state entries (S2.1, S2.2)."""

    exp_avg_dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype
    master_weights: bool
    master_weight_dtype: torch.dtype
    store_param_remainders: bool
    moment_format: Optional[str] = None  # S2.11: "block8" / "block4", or None: the dtypes
    moment_block_size: Optional[int] = None
    # S2.14: how a bf16 parameter with no master is rounded, "nearest" or "stochastic".
    # Not part of the state's layout (record() leaves it out).
    param_rounding: str = "nearest"

    def moment_formats(self, packable: bool = True) -> tuple:
        """``(exp_avg format, exp_avg_sq format)`` of a tensor whose states can be
        stored packed or not (``_formats.moment_family``)."""
        if self.moment_format is not None:
            return _formats.moment_family(self.moment_format, self.moment_block_size,
                                          packable)
        return _moment(self.exp_avg_dtype), _moment(self.exp_avg_sq_dtype)

    def specs(self, param_dtype: torch.dtype, first_index: int = 0,
              packable: bool = True) -> tuple:
        """The state entries of a parameter of ``param_dtype`` whose local tensor starts
        at flat index ``first_index`` of the whole parameter (``_dtensor.first_index``)
        and whose states can be stored packed or not (``_dtensor.packable``)."""
        exp_avg, exp_avg_sq = self.moment_formats(packable)
        specs = (StateSpec("exp_avg", exp_avg, first_index),
                 StateSpec("exp_avg_sq", exp_avg_sq, first_index))
        master = self.master_format()
        if master is None or param_dtype == torch.float32:
            return specs  # an fp32 parameter is its own master
        if master.pairs_with is not None and master.pairs_with != param_dtype:
            master = _formats.FP32  # remainders stand for an fp32 master (S2.5)
        return specs + (StateSpec("master_param", master),)

    def master_format(self) -> Optional[Format]:
        """The master's format as the layout records it (None: no master); remainders
        are used beside bf16 parameters and stand for an fp32 master elsewhere."""
        if not self.master_weights:
            return None
        # A dtype that names no master format is refused at the next step; until then
        # it reads as the default, fp32.
        chosen = _formats.configured(self.master_weight_dtype, "master") or _formats.FP32
        if chosen is _formats.FP32 and self.store_param_remainders:
            return _formats.REMAINDER
        return chosen

    def specs_of(self, local: torch.Tensor, layout) -> tuple:
        """``specs`` of a parameter's local tensor ``local`` with ``layout``; their
        storage takes ``local``'s strides where it is dense but not contiguous and
        no state depends on the elements' order (S2.6)."""
        specs = self.specs(local.dtype, layout.first_index(local), layout.packable(local))
        if local.is_contiguous() or not is_dense(local) or rounds_stochastically(
                self.param_rounding, local.dtype, specs) \
                or any(spec.format.scale == "block" for spec in specs):
            return specs
        strides = tuple(local.stride())
        return tuple(spec._replace(strides=strides) for spec in specs)

    def uses_remainders(self, param_dtype: torch.dtype) -> bool:
        return any(s.format.pairs_with is not None for s in self.specs(param_dtype))

    def record(self, moments_set: bool = False, params: Iterable = (),
               masters_follow: bool = False) -> str:
        """The state layout in words, as checkpoints record it (S5.4), e.g.
        ``exp_avg=bf16 exp_avg_sq=fp8 master=remainder``, of a group holding ``params``;
        ``moments_set`` adds MOMENTS_SET_FIELD, ``masters_follow`` MASTERS_FOLLOW_FIELD.
        The master is recorded as the group's parameters keep it, for a checkpoint's
        reader knows no parameter's saved dtype (S6.4): none where they are all fp32
        (each its own master, S2.1: none is exported), and remainders only where a bf16
        parameter may hold them (beside fp16 parameters alone they are fp32 masters)."""
        master = self.master_format()
        dtypes = {p.dtype for p in params}
        if dtypes == {torch.float32}:
            master = None
        elif master is _formats.REMAINDER:
            if master.pairs_with not in dtypes and torch.float16 in dtypes:
                master = _formats.FP32
        exp_avg, exp_avg_sq = self.moment_formats()
        return (f"exp_avg={exp_avg.label} exp_avg_sq={exp_avg_sq.label} "
                f"master={'none' if master is None else master.name}"
                + (f" {MOMENTS_SET_FIELD}" if moments_set else "")
                + (f" {MASTERS_FOLLOW_FIELD}" if masters_follow else ""))

    @staticmethod
    def moments_set_in(record) -> bool:
        """Whether a ``record()`` string says its moments were set at step 0 (S5.4)."""
        return isinstance(record, str) and MOMENTS_SET_FIELD in record.split()

    @staticmethod
    def masters_follow_in(record) -> bool:
        """Whether a ``record()`` string says its masters followed their parameters."""
        return isinstance(record, str) and MASTERS_FOLLOW_FIELD in record.split()

    @staticmethod
    def from_record(record) -> "StateConfig":
        """The configuration a ``record()`` string describes; ValueError if it is not one."""
        items = [item.partition("=")[::2] for item in str(record).split()
                 if item not in (MOMENTS_SET_FIELD, MASTERS_FOLLOW_FIELD)]
        fields = dict(items)
        if len(fields) != len(items):  # a field named twice is no layout
            fields = {}
        formats = {f.name: f for f in _formats.choices("moment")}
        masters = {f.name: f for f in _formats.FORMATS if "master" in f.roles}
        masters["none"] = None
        family = (None, None)
        if sorted(fields) == ["exp_avg", "exp_avg_sq", "master"]:
            family = _formats.family_of(fields["exp_avg"], fields["exp_avg_sq"])
        if (sorted(fields) != ["exp_avg", "exp_avg_sq", "master"]
                or fields["master"] not in masters
                or (family[0] is None and (fields["exp_avg"] not in formats
                                           or fields["exp_avg_sq"] not in formats))):
            low, high = _formats.SCALE_BLOCK_RANGE
            raise ValueError(f"{record!r} is not a state layout (rule: "
                             f"'exp_avg=F exp_avg_sq=F master=M', F one of "
                             f"{sorted(formats)} or a moment_format's pair "
                             f"{_formats.family_labels()} with B a power of two in "
                             f"[{low}, {high}] in decimal digits (S2.11), M one of "
                             f"{sorted(masters)}; S5.4)")
        master = masters[fields["master"]]
        # Remainders are chosen with an fp32 master dtype (S2.5); no master: the default.
        master_dtype = getattr(master, "argument", None) or _formats.FP32.argument
        if family[0] is not None:
            default = _formats.FP32.argument  # the dtypes a moment_format leaves alone
            return StateConfig(default, default, master is not None, master_dtype,
                               master is _formats.REMAINDER, *family)
        return StateConfig(formats[fields["exp_avg"]].argument,
                           formats[fields["exp_avg_sq"]].argument, master is not None,
                           master_dtype, master is _formats.REMAINDER)


def _moment(dtype) -> Format:
    """The format a moment's configured ``dtype`` names (checked by ``_validate``
    before any state is made; KeyError if it names none)."""
    fmt = _formats.configured(dtype, "moment")
    if fmt is None:
        raise KeyError(dtype)
    return fmt


# ---------------------------------------------------------------------------
# Reading and writing whole entries. ``entry`` is ``optimizer.state[param]`` (storage,
# possibly DTensors); ``scales`` is ``optimizer._scales.get(param)`` and ``formats``
# ``optimizer._formats.get(param)`` (each may be None): each state's scale, and the
# format it was stored in.

def stored_format(stored: torch.Tensor, formats: Optional[dict],
                  name: str) -> Optional[Format]:
    """The format of local storage ``stored`` (``entry[name]``): the one recorded when
    it was stored, while the tensor there has that format's storage dtype; else, for a
    tensor put there from outside or state of an optimizer pickled before formats were
    recorded, the one its dtype has always meant (``_formats.legacy_format``; None for a
    dtype no format has)."""
    recorded = formats.get(name) if formats else None
    if recorded is not None and stored.dtype == recorded.storage:
        return recorded
    return _formats.legacy_format(stored.dtype)


def read_value(entry: dict, scales: Optional[dict], formats: Optional[dict],
               name: str, first: int = 0) -> torch.Tensor:
    """The true value of ``entry[name]`` as a local tensor: fp32, or the raw int16 for
    remainders. fp32 storage is returned itself; every other format as a new fp32
    tensor. ``first``: the local tensor's first flat index (per-block formats).
    """
    stored = _dtensor.to_local(entry[name])
    fmt = stored_format(stored, formats, name)
    if fmt is None:
        return stored.float()
    scale = scales.get(name) if scales else None
    if fmt.scaled:  # a missing scale reads as 1
        scale = (torch.ones(fmt.scale_shape(fmt.numel_of(stored), first),
                            dtype=torch.float32, device=stored.device)
                 if scale is None else scale.to(stored.device))
    return fmt.decode(stored, scale, first)


def true_value(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """fp32 true values of an exported value. Exported values are told apart by dtype
    (S5.4): int16 ones are remainder codes, merged here with the local ``param``."""
    codes = _formats.REMAINDER
    if value.dtype == codes.value_dtype:
        return codes.true_value(value, param)
    return value.float()


def value_for(fmt: Format, value: torch.Tensor, param: torch.Tensor):
    """The exported ``value`` in the form ``fmt`` stores (fp32 true values or remainder
    codes), plus the bf16 bits the parameter must take when a master becomes a
    remainder (else None)."""
    if value.dtype == fmt.value_dtype:
        return value, None
    return fmt.from_true(true_value(value, param))


def write_value(spec: StateSpec, value: torch.Tensor, stored: torch.Tensor,
                scale: Optional[torch.Tensor]) -> None:
    """Store ``value`` (fp32, int16 for remainders) into existing local ``stored`` /
    ``scale``. The caller's ``value`` is never modified. Scaled formats get a fresh
    scale (S2.3), measured over this local tensor only.
    """
    spec.format.encode(value.to(stored.device), stored, scale, spec.first_index)


def rounds_stochastically(param_rounding: str, param_dtype: torch.dtype,
                          specs: tuple) -> bool:
    """Whether a parameter of ``param_dtype`` with state ``specs`` is rounded
    stochastically under ``param_rounding`` (S2.14: a bf16 parameter with no master)."""
    return (param_rounding == "stochastic" and param_dtype == torch.bfloat16
            and all(spec.name != "master_param" for spec in specs))


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill its memory span exactly, in some order of its
    dimensions (a permutation of a contiguous tensor's strides)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride
                               in zip(tensor.shape, tensor.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def new_entry(spec: StateSpec, value: torch.Tensor, like: torch.Tensor):
    """Fresh local storage (and scale) for ``spec`` holding ``value``, allocated like the
    local tensor ``like`` (its shape and device, and its strides where ``spec`` says;
    S2.6)."""
    shape = spec.format.storage_shape(like.shape)
    if spec.strides is not None:
        stored = torch.empty_strided(shape, spec.strides, dtype=spec.format.storage,
                                     device=like.device)
    else:
        stored = torch.empty(shape, dtype=spec.format.storage, device=like.device)
    scale_shape = spec.format.scale_shape(like.numel(), spec.first_index)
    scale = None
    if scale_shape is not None:
        scale = torch.ones(scale_shape, dtype=torch.float32, device=like.device)
    write_value(spec, value, stored, scale)
    return stored, scale


def initial_value(spec: StateSpec, param: torch.Tensor, to_store: bool = False
                  ) -> torch.Tensor:
    """What a new entry holds (S1.6): zero moments and remainder, master = parameter.
    ``to_store``: the value is only encoded into new storage (``Format.encode`` reads it
    a chunk at a time), so it needs no full-size fp32 tensor: zeros are one 0 broadcast
    to the parameter's shape, a master is the parameter itself."""
    if seeds_from_param(spec):
        return param.detach() if to_store else param.detach().float()
    # A zero remainder: the parameter alone is then the master (S2.5).
    if to_store:
        zero = torch.zeros((), dtype=spec.format.value_dtype, device=param.device)
        return zero.expand(param.shape)
    return torch.zeros(param.shape, dtype=spec.format.value_dtype, device=param.device)


def seeds_from_param(spec: StateSpec) -> bool:
    """Whether a new ``spec`` state takes the parameter's values (a master; a remainder
    starts at 0, the parameter alone being the master)."""
    return spec.name == "master_param" and spec.format.pairs_with is None


def seeded_value(spec: StateSpec, param: torch.Tensor) -> torch.Tensor:
    """The true value of state ``spec`` seeded from the local ``param`` (S1.6), as its
    storage holds it (a scaled fp16 master rounds): what a master that follows its
    parameter is."""
    stored, scale = new_entry(spec, initial_value(spec, param, to_store=True), param)
    return read_value({spec.name: stored}, {spec.name: scale}, {spec.name: spec.format},
                      spec.name, spec.first_index)


def is_seeded_value(spec: StateSpec, value: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether a master's true value ``value`` (fp32) is bit for bit what seeding it from
    the local ``param`` stores (S1.6): at step 0, a master exported while it followed its
    parameter."""
    seeded = seeded_value(spec, param)
    return (value.shape == seeded.shape and value.dtype == seeded.dtype
            and torch.equal(value.contiguous().view(torch.int32),
                            seeded.contiguous().view(torch.int32)))


def converted_value(spec: StateSpec, entry: dict, scales: Optional[dict],
                    formats: Optional[dict], param: torch.Tensor):
    """``entry[spec.name]``'s true value in the form ``spec`` stores (fp32 or int16),
    plus the bf16 bits the parameter must take when an fp32 master becomes a remainder.
    """
    return value_for(spec.format,
                     read_value(entry, scales, formats, spec.name, spec.first_index), param)


def entry_matches(spec: StateSpec, entry: dict, scales: Optional[dict],
                  formats: Optional[dict], param: torch.Tensor, layout) -> bool:
    """Whether ``entry`` already stores ``spec`` usably for the local tensor ``param``
    whose parameter has ``layout``: in its format, with the scale its granularity
    gives (a plain local fp32 tensor; 0-dim for a per-tensor scale)."""
    stored = entry.get(spec.name)
    if not holds_values(stored) or layout.of(spec.format).state_error(stored) is not None:
        return False
    stored = _dtensor.to_local(stored)
    if stored_format(stored, formats, spec.name) is not spec.format \
            or stored.device != param.device:
        return False
    if stored.shape != spec.format.storage_shape(param.shape) or not (
            stored.is_contiguous() if spec.strides is None
            else tuple(stored.stride()) == spec.strides):
        return False
    scale_shape = spec.format.scale_shape(param.numel(), spec.first_index)
    if scale_shape is None:
        return True
    scale = scales.get(spec.name) if scales else None
    return (isinstance(scale, torch.Tensor) and not _dtensor.is_dtensor(scale)
            and scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape
            and scale.device == param.device)


class EntryWrites:
    """The changes that make one parameter's state what it must be, prepared before any
    is applied: local storage by name (None removes it) with the format each new one
    holds, scales by name (None removes one), the value the parameter must take (or
    None: bf16 bits when a master becomes a remainder, the master when the parameter
    became fp32), and entries other than the states, stored as they are (``extra``: loaded
    keys someone else keeps in the state, S5.5)."""

    __slots__ = ("stored", "formats", "scales", "param_bits", "extra", "seeded")

    def __init__(self):
        self.stored = {}
        self.formats = {}
        self.scales = {}
        self.param_bits = None
        self.extra = {}
        self.seeded = set()  # names stored with their initial value (S1.6)

    def put(self, spec: StateSpec, value: torch.Tensor, like: torch.Tensor) -> None:
        """Fresh storage for ``spec`` holding ``value``, allocated like ``like``."""
        self.stored[spec.name], self.scales[spec.name] = new_entry(spec, value, like)
        self.formats[spec.name] = spec.format

    def empty(self) -> bool:
        return (not self.stored and not self.scales and self.param_bits is None
                and not self.extra)


def plan_entry(specs: tuple, entry: Optional[dict], scales: Optional[dict],
               formats: Optional[dict], param: torch.Tensor, layout,
               seeded: bool = False) -> EntryWrites:
    """The writes that make ``entry`` / ``scales`` hold exactly ``specs`` for ``param``
    (the local tensor of a parameter with ``layout``). Pure: nothing is written, so
    callers can prepare every change before they apply any. ``seeded``: the master
    follows the parameter (S1.6), so a new one is seeded from it, never converted, and
    the parameter never takes its value.
    """
    entry = entry if entry is not None else {}
    scales = scales if scales is not None else {}
    writes = EntryWrites()
    wanted = {spec.name for spec in specs}
    for spec in specs:
        if entry_matches(spec, entry, scales, formats, param, layout):
            if not spec.scaled and spec.name in scales:
                writes.scales[spec.name] = None  # a stale scale of an unscaled format
            continue
        stored = entry.get(spec.name)
        if seeded and spec.name == "master_param":
            stored = None
        if stored is not None and _holds_tensor_of(stored, formats, spec.name, param):
            value, bits = converted_value(spec, entry, scales, formats, param)
            writes.param_bits = bits if bits is not None else writes.param_bits
        else:
            value = initial_value(spec, param, to_store=True)
            writes.seeded.add(spec.name)
        writes.put(spec, value, param)
        del value  # a converted state's fp32 values: one state's at a time
    for name in STATE_NAMES:
        if name not in wanted:
            if name in entry:
                writes.stored[name] = None
                if (name == "master_param" and param.dtype == torch.float32 and not seeded
                        and _holds_tensor_of(entry[name], formats, name, param)
                        and _scale_error(_dtensor.to_local(entry[name]),
                                         StateSpec(name, None), scales, formats) is None):
                    # A parameter made fp32 is its own master (S2.1): it takes the
                    # master's value, which it was rounded from (S2.5).
                    writes.param_bits = true_value(
                        read_value(entry, scales, formats, name), param)
            if name in scales:
                writes.scales[name] = None
    return writes


def mark_seeded(seeded: dict, state, param, writes: EntryWrites) -> None:
    """Keeps ``seeded`` (the masters that follow their parameter, S1.6, each marked by
    the tensor it was seeded into) current once ``writes`` are applied to ``param``'s
    entry of ``state``."""
    if "master_param" in writes.seeded:
        seeded[param] = state[param]["master_param"]
    elif "master_param" in writes.stored:  # another master, or none
        seeded.pop(param, None)


def master_of(entry):
    """``entry["master_param"]``, or None (no entry, or one that is no dict: refused
    where it is read, S5.1)."""
    return entry.get("master_param") if isinstance(entry, dict) else None


def follows(seeded: dict, state, param) -> bool:
    """Whether ``param``'s master follows it (S1.6): it is still the tensor in ``state``
    it was seeded into. One put there from outside (a replaced entry, as torch's
    ZeroRedundancyOptimizer loads a checkpoint) is the truth, as one set with
    set_scaled_state is; while an entry is out of ``state`` (taken out by hand, to be
    put back), its master does not follow, and does again once it is back."""
    mark = seeded.get(param)
    return mark is not None and master_of(state.get(param)) is mark


def drop_replaced_masters(seeded: dict, state) -> dict:
    """Unmarks the masters in ``seeded`` that do not follow their parameter (``follows``)
    and returns their marks, for a refused call to put back."""
    dropped = {p: mark for p, mark in seeded.items() if master_of(state.get(p)) is not mark}
    for param in dropped:
        del seeded[param]
    return dropped


def holds_values(stored) -> bool:
    """Whether ``stored`` (``entry[name]``) is a dense tensor whose storage holds its
    elements: not a number or list put there by hand, not sparse, mkldnn or nested, not
    freed (a meta tensor passes: beside a meta parameter it is the state)."""
    if not isinstance(stored, torch.Tensor):
        return False
    local = _dtensor.to_local(stored)
    return (local.layout is torch.strided and not local.is_nested
            and short_storage(local) is None)


def _holds_tensor_of(stored, formats: Optional[dict], name: str,
                     param: torch.Tensor) -> bool:
    """Whether storage ``stored`` (``entry[name]``) holds a value of ``param``'s shape."""
    if not holds_values(stored):
        return False
    local = _dtensor.to_local(stored)
    fmt = stored_format(local, formats, name)
    shape = fmt.storage_shape(param.shape) if fmt is not None else tuple(param.shape)
    return tuple(local.shape) == shape


def entry_from_values(specs: tuple, values: dict, param: torch.Tensor) -> EntryWrites:
    """Writes that store exported ``values`` (local tensors) in fresh storage.

    ``values`` hold true values in any floating dtype, or int16 remainders; they pass
    through fp32 (S5.5), so state saved under other dtypes loads. Nothing aliases them.
    """
    writes = EntryWrites()
    for spec in specs:
        value, bits = value_for(spec.format, values[spec.name], param)
        if bits is not None:
            writes.param_bits = bits
        writes.put(spec, value, param)
    return writes


def apply_entry(state, scales, formats, param, writes: EntryWrites, local: torch.Tensor,
                layout, owner) -> None:
    """Apply what ``plan_entry`` / ``entry_from_values`` prepared for ``param``: storage
    into ``state[param]`` (wrapped in the parameter's layout; a scaled one claimed as
    ``owner``'s, ``_stored_by``) and its format into ``formats[param]``, scales into
    ``scales[param]``, then the parameter's new bf16 bits into its local tensor."""
    entry = state[param]
    if not isinstance(entry, dict):  # put there from outside; initialize_state replaces it
        entry = state[param] = {}
    for name, stored in writes.stored.items():
        if stored is None:
            entry.pop(name, None)
        else:
            fmt = writes.formats[name]
            entry[name] = layout.of(fmt).wrap(stored)
            if fmt.scaled:
                _stored_by.claim(entry[name], owner, param, name, fmt.label)
    entry.update(writes.extra)
    _update(formats, param, {name: writes.formats.get(name) for name in writes.stored})
    _update(scales, param, writes.scales)
    if writes.param_bits is not None:
        write_param_bits(local, writes.param_bits)


def write_param_bits(local: torch.Tensor, bits: torch.Tensor) -> None:
    """A parameter's local tensor takes ``bits``, the bf16 rounding of its master that
    a remainder pairs with (S2.5)."""
    # A leaf that requires grad takes it without autograd; an inference tensor (a
    # frozen parameter made under inference_mode) only in that mode.
    with (torch.inference_mode() if local.is_inference() else torch.no_grad()):
        local.copy_(bits)


def _update(container: dict, param, changes: dict) -> None:
    """``container[param][name] = value`` for each change (None removes it); a
    parameter left with nothing has no dict there."""
    if not changes:
        return
    held = container.get(param)
    for name, value in changes.items():
        if value is not None:
            if held is None:
                held = container[param] = {}
            held[name] = value
        elif held is not None:
            held.pop(name, None)
    if held is not None and not held:
        del container[param]


def claim_all(state, formats: dict, owner, moved=()) -> None:
    """Claims every scaled state in ``state`` as ``owner``'s (``_stored_by``): an
    optimizer restored from its pickled state (or ``deepcopy``) holds them with the
    scales restored beside them, each where it lies, but for those ``moved_claims``
    found moved by hand: claimed where they were, they are refused in the copy as in
    the original."""
    places = {(id(param), name): rest for param, name, *rest in moved}
    for param, entry in state.items():
        if not isinstance(param, torch.Tensor) or not isinstance(entry, dict):
            continue
        for name in STATE_NAMES:
            stored = entry.get(name)
            if not isinstance(stored, torch.Tensor):
                continue
            if (id(param), name) in places:
                ours, claimed, claimed_name, label = places[id(param), name]
                _stored_by.claim(stored, owner if ours else _stored_by.ELSEWHERE, claimed,
                                 claimed_name, label)
                continue
            fmt = stored_format(_dtensor.to_local(stored), formats.get(param), name)
            if fmt is not None and fmt.scaled:
                _stored_by.claim(stored, owner, param, name, fmt.label)


def moved_claims(state, formats: dict, owner) -> list:
    """``(param, name, claimed by owner, claimed param, claimed name, format label)``
    for each state of ``state`` claimed at another place (moved by hand, within
    ``owner`` or from another optimizer) or in a format other than the one ``formats``
    records there now (put back after a setting change); the claimed parameter is
    ``_stored_by.ELSEWHERE`` where ``state`` does not hold it."""
    params = {id(param): param for param in state if isinstance(param, torch.Tensor)}
    moved = []
    for param, entry in state.items():
        if not isinstance(param, torch.Tensor) or not isinstance(entry, dict):
            continue
        for name in STATE_NAMES:
            stored = entry.get(name)
            held = (_stored_by.claim_of(stored, owner)
                    if isinstance(stored, torch.Tensor) else None)
            if held is None:
                continue
            ours, param_id, claimed_name, label = held
            recorded = (formats.get(param) or {}).get(name)
            if (not ours or (param_id, claimed_name) != (id(param), name)
                    or (recorded is not None and recorded.label != label)):
                claimed = params.get(param_id, _stored_by.ELSEWHERE) if ours else \
                    _stored_by.ELSEWHERE
                moved.append((param, name, ours, claimed, claimed_name, label))
    return moved


def entry_type_error(entry) -> str:
    return (f"state entry must be a dict of state tensors, got {type(entry).__name__} "
            f"(rule S5.1); call initialize_state(param) to recreate it")


def origin_error(specs: tuple, entry: Optional[dict], formats: Optional[dict], owner,
                 key) -> Optional[str]:
    """A sentence if a state of ``entry`` (``key``'s in ``owner``) holds what cannot be
    read as its values: scaled values an optimizer stored at another place (their scales
    stayed there, ``_stored_by``), a dtype no format of that state has, or a scaled
    format other than the one whose scales are recorded for it (S2.2, S2.3)."""
    if entry is not None and not isinstance(entry, dict):
        return entry_type_error(entry)
    for spec in specs:
        stored = (entry or {}).get(spec.name)
        if stored is None:
            continue
        error = _form_error(stored, key) or _origin_error(stored, spec.name, formats,
                                                          owner, key)
        if error is not None:
            return _to_recreate(spec, error)
    return None


def _form_error(stored, param) -> Optional[str]:
    """Why ``stored`` (put into the state from outside) holds no values a step can read
    for ``param``, or None: not a tensor, not dense, or on the meta device beside a
    parameter with values (S2.2)."""
    if not isinstance(stored, torch.Tensor):
        return f"must be a tensor, got {type(stored).__name__} (rule S2.2)"
    local = _dtensor.to_local(stored)
    if local.layout is not torch.strided or local.is_nested:
        kind = "nested" if local.is_nested else local.layout
        return f"is a {kind} tensor; states are dense (torch.strided, rule S2.2)"
    if local.is_meta and not _dtensor.to_local(param).is_meta:
        return ("is on the meta device, without values (rule S2.2; an optimizer built "
                "over a model on meta holds such state for every parameter until "
                "initialize_state runs for each)")
    short = short_storage(local)
    if short is not None:
        return (f"has a storage of {short[0]} bytes, fewer than its elements span "
                f"({short[1]}): its memory was freed or shrunk (rule S2.2: a state holds "
                f"its values)")
    return None


def _origin_error(stored, name: str, formats: Optional[dict], owner, key) -> Optional[str]:
    recorded = formats.get(name) if formats else None
    moved = _stored_by.moved_error(stored, owner, key, name,
                                   recorded.label if recorded is not None else None)
    if moved is not None:
        return moved
    local = _dtensor.to_local(stored)
    fmt = stored_format(local, formats, name)
    if fmt is None:  # true values in a floating dtype no format has (fp64) pass
        if local.is_floating_point():
            return None
        return (f"holds {local.dtype} values, a dtype no format of state {name!r} is "
                f"stored in (rule S2.2)")
    if not fmt.holds(name):
        return (f"holds {local.dtype} values, which only {fmt.name} states are stored in, "
                f"and state {name!r} is not one (rule S2.2)")
    if fmt.scaled and recorded is not None and recorded.scaled and recorded is not fmt:
        return (f"holds {fmt.label} values, but the scales recorded for it are those of "
                f"{recorded.label} values (rule S2.3: scaled values mean nothing without "
                f"their own scales; set a replaced state with set_scaled_state)")
    return None


def consistency_error(specs: tuple, entry: Optional[dict], param: torch.Tensor, layout,
                      scales: Optional[dict], formats: Optional[dict], owner, key):
    """A sentence if ``entry`` holds a state that cannot belong to the local tensor
    ``param`` of a parameter with ``layout`` (S3.3: a DTensor parameter's states are
    DTensors of its layout, a plain one's are plain): one origin_error refuses (``key``:
    the parameter, ``owner``: its optimizer), or per-block codes whose scales (in
    ``scales``) are missing or unusable: without them the codes mean nothing."""
    if entry is None:
        return None
    error = origin_error(specs, entry, formats, owner, key)
    if error is not None:
        return error
    for spec in specs:
        stored = entry.get(spec.name)
        if stored is None:
            continue
        fmt = stored_format(_dtensor.to_local(stored), formats, spec.name)
        error = layout.of(fmt).state_error(stored) or _shape_error(stored, fmt, param)
        if error is not None:
            return _to_recreate(spec, error)
    return undecodable_error(specs, entry, scales, formats, param)


def misshapen_error(specs: tuple, entry: Optional[dict], param: torch.Tensor,
                    formats: Optional[dict] = None) -> Optional[str]:
    """consistency_error's rule on local shapes alone: a sentence if a state of
    ``entry`` no longer has the shape of the local tensor ``param`` (``param.data``
    given another shape), else None."""
    for spec in specs:
        stored = (entry or {}).get(spec.name)
        if stored is not None:
            fmt = stored_format(_dtensor.to_local(stored), formats, spec.name)
            error = _shape_error(stored, fmt, param)
            if error is not None:
                return _to_recreate(spec, error)
    return None


def _shape_error(stored, fmt: Optional[Format], param: torch.Tensor) -> Optional[str]:
    local = _dtensor.to_local(stored)
    want = fmt.storage_shape(param.shape) if fmt is not None else tuple(param.shape)
    if tuple(local.shape) == want:
        return None
    return (f"has local shape {tuple(local.shape)} but the parameter's local shape is "
            f"{tuple(param.shape)}"
            + (f" ({fmt.name} stores {want})" if fmt is not None and fmt.packed else "")
            + " (rule S2.6: a state has its parameter's local shape)")


def undecodable_error(specs: tuple, entry: dict, scales: Optional[dict],
                      formats: Optional[dict], param: torch.Tensor) -> Optional[str]:
    """A sentence if a state of ``entry`` cannot be read as values: per-block codes whose
    scales (in ``scales``) are missing or unusable, or a per-tensor scaled state whose
    scale is not finite and positive (consistency_error's last rule). ``param``: the
    parameter's local tensor; where it is on meta too, initialize_state would make the
    state on meta again."""
    for spec in specs:
        stored = entry.get(spec.name)
        if stored is None:
            continue
        local = _dtensor.to_local(stored)
        error = _scale_error(local, spec, scales, formats)
        if error is not None and param.is_meta:
            return (f"state {spec.name!r} {error}; build the optimizer once the parameters "
                    f"hold values (e.g. after module.to_empty(device=...))")
        if error is not None:
            return _to_recreate(spec, error)
    return None


def _to_recreate(spec: StateSpec, error: str) -> str:
    return f"state {spec.name!r} {error}; call initialize_state(param) to recreate it"


def _scale_error(stored: torch.Tensor, spec: StateSpec, scales: Optional[dict],
                 formats: Optional[dict]) -> Optional[str]:
    """Why the scales of per-block codes ``stored`` cannot decode them, or None; for a
    per-tensor scaled state (S2.3), why its scale cannot (a scale changed in place: its
    values are read when a plan converts the state, before the core would see it)."""
    fmt = stored_format(stored, formats, spec.name)
    if fmt is None or not fmt.scaled:
        return None
    scale = scales.get(spec.name) if scales else None
    if isinstance(scale, torch.Tensor) and scale.is_meta:
        return (f"holds {fmt.label} values whose scale is a meta tensor (rule S2.3, S2.11: "
                f"a scale is a finite value > 0, and a meta tensor holds none)")
    if fmt.scale == "tensor":
        if scale is None:
            # Scales and formats are recorded per parameter object, beside its state:
            # a state moved to another parameter by hand leaves them behind.
            return (f"holds {fmt.label} values but no scale was recorded for them "
                    f"(rule S2.3: scaled values mean nothing without their scale; set "
                    f"a moved state with set_scaled_state or load_state_dict)")
        # Read where the host holds it (device scales are the kernels', unchecked).
        if (isinstance(scale, torch.Tensor) and scale.numel() == 1
                and not _dtensor.is_dtensor(scale) and scale.device.type == "cpu"
                and not bool(torch.isfinite(scale).all() & (scale > 0).all())):
            return (f"holds {fmt.label} values with a scale of {scale.item():.9g}, which "
                    f"is not finite and positive (rule S2.3: a scale is a finite value > 0)")
        return None
    shape = fmt.scale_shape(fmt.numel_of(stored), spec.first_index)
    if (not isinstance(scale, torch.Tensor) or _dtensor.is_dtensor(scale)
            or scale.dtype != torch.float32 or tuple(scale.shape) != shape):
        return (f"holds {fmt.label} codes, whose scales must be a plain fp32 tensor of "
                f"shape {shape} (rule S2.11), got {_shown(scale)}")
    if not scale.is_contiguous():  # the core reads and writes them as one array
        return (f"holds {fmt.label} codes, whose scales must be one contiguous array "
                f"(rule S2.11), got strides {scale.stride()}")
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        return (f"holds {fmt.label} codes with scales that are not finite and positive "
                f"(rule S2.11: a scale is a finite value > 0)")
    return None


def _shown(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return "nothing" if value is None else type(value).__name__


def migrate_scales(state, scales) -> None:
    """Move scales kept beside their state under ``<name>_scale`` (an older layout of
    ``optimizer.state``, e.g. in a pickled optimizer) into ``scales``."""
    for param, entry in state.items():
        for name in STATE_NAMES:
            scale = entry.get(name + "_scale") if isinstance(entry, dict) else None
            if scale is None:
                continue
            entry.pop(name + "_scale")
            if name in entry:
                param_scales = scales.get(param)
                if param_scales is None:
                    param_scales = scales[param] = {}
                param_scales[name] = scale
