"""Optimizer state: what each entry stores, how its true value is read and written.

A parameter's state lives in ``optimizer.state[param]`` as storage tensors under
``exp_avg``, ``exp_avg_sq`` and (when SEMANTICS S2.1 gives one) ``master_param``, in
their storage dtype; nothing of the optimizer's own goes there besides (torch's
checkpoint tools iterate those keys and expect a saved value for each), and keys others
write there (Megatron's ``step``) are left alone and carried through checkpoints. For
fp16 / fp8 storage the fp32 scale of each state is a 0-dim tensor in
``optimizer._scales[param][name]`` (S2.2).
Storage is self-describing: its dtype and the presence of a scale say how to decode it,
so state written under one configuration can be converted to another.

Everything here works on local tensors; a DTensor parameter's states are wrapped in its
layout (``_dtensor``) only when they are put into ``optimizer.state``, and unwrapped when
read from it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _dtensor

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
# The param_groups key under which state_dict() records the state layout (S5.4).
LAYOUT_KEY = "state_layout"

# Storage kinds; the numbers are the C++ core's DType tags (csrc/include/shardadam/adam.h).
KIND_NONE = 0
KIND_FLOAT32 = 1
KIND_FLOAT16 = 2
KIND_BFLOAT16 = 3
KIND_FLOAT8_E4M3 = 4
KIND_INT16_REMAINDER = 5

# Tags of parameter and gradient dtypes (the same numbering).
FLOAT_KINDS = {torch.float32: KIND_FLOAT32, torch.float16: KIND_FLOAT16,
               torch.bfloat16: KIND_BFLOAT16}

_STORAGE_DTYPE = {
    KIND_FLOAT32: torch.float32,
    KIND_FLOAT16: torch.float16,
    KIND_BFLOAT16: torch.bfloat16,
    KIND_FLOAT8_E4M3: torch.uint8,
    KIND_INT16_REMAINDER: torch.int16,
}
# The largest magnitude a scaled state is encoded to (S2.3).
_SCALE_TARGET = {KIND_FLOAT16: 32752.0, KIND_FLOAT8_E4M3: 448.0}
_TINY = torch.finfo(torch.float32).tiny
_CONFIGURED_KIND = {torch.float32: KIND_FLOAT32, torch.float16: KIND_FLOAT16,
                    torch.bfloat16: KIND_BFLOAT16, torch.uint8: KIND_FLOAT8_E4M3}
# A configured dtype's name in a recorded state layout (StateConfig.record).
_FORMAT_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.uint8: "fp8"}


class StateSpec(NamedTuple):
    """One state entry of one parameter: its name and storage kind."""

    name: str
    kind: int

    @property
    def dtype(self) -> torch.dtype:
        return _STORAGE_DTYPE[self.kind]

    @property
    def scaled(self) -> bool:
        return self.kind in _SCALE_TARGET


class StateConfig(NamedTuple):
    """The optimizer settings that decide a parameter's state entries (S2.1, S2.2)."""

    exp_avg_dtype: torch.dtype
    exp_avg_sq_dtype: torch.dtype
    master_weights: bool
    master_weight_dtype: torch.dtype
    store_param_remainders: bool

    def specs(self, param_dtype: torch.dtype) -> tuple:
        specs = (StateSpec("exp_avg", _CONFIGURED_KIND[self.exp_avg_dtype]),
                 StateSpec("exp_avg_sq", _CONFIGURED_KIND[self.exp_avg_sq_dtype]))
        if not self.master_weights or param_dtype == torch.float32:
            return specs  # an fp32 parameter is its own master
        return specs + (StateSpec("master_param", self.master_kind(param_dtype)),)

    def master_kind(self, param_dtype: torch.dtype) -> int:
        if self.master_weight_dtype == torch.float16:
            return KIND_FLOAT16
        if self.store_param_remainders and param_dtype == torch.bfloat16:
            return KIND_INT16_REMAINDER
        return KIND_FLOAT32

    def uses_remainders(self, param_dtype: torch.dtype) -> bool:
        return any(s.kind == KIND_INT16_REMAINDER for s in self.specs(param_dtype))

    def record(self) -> str:
        """The state layout in words, as checkpoints record it (S5.4), e.g.
        ``exp_avg=bf16 exp_avg_sq=fp8 master=remainder``."""
        if not self.master_weights:
            master = "none"
        elif self.master_weight_dtype == torch.float16:
            master = "fp16"
        else:
            master = "remainder" if self.store_param_remainders else "fp32"
        return (f"exp_avg={_FORMAT_NAMES[self.exp_avg_dtype]} "
                f"exp_avg_sq={_FORMAT_NAMES[self.exp_avg_sq_dtype]} master={master}")

    @staticmethod
    def from_record(record) -> "StateConfig":
        """The configuration a ``record()`` string describes; ValueError if it is not one."""
        fields = dict(item.partition("=")[::2] for item in str(record).split())
        formats = {name: dtype for dtype, name in _FORMAT_NAMES.items()}
        masters = {"none": (False, torch.float32, False), "fp32": (True, torch.float32, False),
                   "fp16": (True, torch.float16, False),
                   "remainder": (True, torch.float32, True)}
        if (sorted(fields) != ["exp_avg", "exp_avg_sq", "master"]
                or fields["exp_avg"] not in formats or fields["exp_avg_sq"] not in formats
                or fields["master"] not in masters):
            raise ValueError(f"{record!r} is not a state layout (rule: "
                             f"'exp_avg=F exp_avg_sq=F master=M', F one of "
                             f"{sorted(formats)}, M one of {sorted(masters)})")
        return StateConfig(formats[fields["exp_avg"]], formats[fields["exp_avg_sq"]],
                           *masters[fields["master"]])


# ---------------------------------------------------------------------------
# Scales and codecs (torch ops; the C++ core implements the same rules bit for bit).

def measure_scale(value: torch.Tensor, kind: int) -> torch.Tensor:
    """The scale S2.3 gives to fp32 ``value`` stored as ``kind``: a 0-dim fp32 tensor."""
    one = torch.ones((), dtype=torch.float32, device=value.device)
    if value.numel() == 0:
        return one
    absmax = torch.amax(torch.abs(value))  # NaN propagates, and NaN is not finite
    # A device tensor divisor: CUDA would multiply by the reciprocal of a host scalar.
    target = torch.full((), _SCALE_TARGET[kind], dtype=torch.float32, device=value.device)
    scale = torch.clamp_min(absmax / target, _TINY)
    return torch.where(torch.isfinite(absmax) & (absmax > 0), scale, one)


def quantize(value: torch.Tensor, kind: int, scale: torch.Tensor) -> torch.Tensor:
    """``round(value / scale)`` in the storage dtype of ``kind`` (fp16 or fp8 codes)."""
    scaled = value / scale  # a true division, as the C++ core does
    if kind == KIND_FLOAT16:
        return scaled.to(torch.float16)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize(stored: torch.Tensor, kind: int, scale: torch.Tensor) -> torch.Tensor:
    """``float(q) * scale``: a new fp32 tensor."""
    if kind == KIND_FLOAT8_E4M3:
        stored = stored.view(torch.float8_e4m3fn)
    return stored.float() * scale


def merge_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master rebuilt from a bf16 parameter and its int16 remainder (S2.5)."""
    # The split rounded the high half up when the low half was >= 0x8000 (negative as
    # int16); undo that, then lay the halves side by side (little-endian) as one fp32.
    high = param.view(torch.int16) - (remainder < 0).to(torch.int16)
    pair = torch.stack((remainder, high), dim=-1)
    return pair.view(torch.float32).squeeze(-1)


def split_remainder(master: torch.Tensor):
    """The bf16 parameter bits and the int16 remainder of an fp32 master (S2.5)."""
    bits = master.contiguous().reshape(-1).view(torch.int32)
    # A NaN splits as the quiet NaN with its sign, so that the parameter is NaN too:
    # its own bits may round the high half from 0x7FFF to 0x8000 (-0).
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    bits = torch.where(nan, (bits & -0x80000000) | 0x7FC00000, bits)
    halves = bits.view(torch.int16).view(-1, 2)
    low, high = halves[:, 0], halves[:, 1]
    high = high + (low < 0).to(torch.int16)
    return (high.view(torch.bfloat16).reshape(master.shape),
            low.reshape(master.shape))


# ---------------------------------------------------------------------------
# Reading and writing whole entries. ``entry`` is ``optimizer.state[param]`` (storage,
# possibly DTensors), ``scales`` is ``optimizer._scales.get(param)`` (or None).

def storage_kind(stored: torch.Tensor) -> int:
    """The kind a stored tensor holds, from its dtype (the storage is self-describing)."""
    for kind, dtype in _STORAGE_DTYPE.items():
        if stored.dtype == dtype:
            return kind
    return KIND_NONE


def read_value(entry: dict, scales: Optional[dict], name: str) -> torch.Tensor:
    """The true value of ``entry[name]`` as a local tensor: fp32, or the raw int16 for
    remainders. fp32 storage is returned itself; every other kind as a new fp32 tensor.
    """
    stored = _dtensor.to_local(entry[name])
    kind = storage_kind(stored)
    if kind in (KIND_FLOAT32, KIND_INT16_REMAINDER):
        return stored
    if kind in _SCALE_TARGET:
        scale = scales.get(name) if scales else None
        if scale is None:
            scale = torch.ones((), dtype=torch.float32, device=stored.device)
        return dequantize(stored, kind, scale.to(stored.device))
    return stored.float()


def as_fp32(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """fp32 value of an exported entry (int16 remainders are merged with ``param``)."""
    if value.dtype == torch.int16:
        return merge_remainder(param, value.to(param.device))
    return value.float()


def write_value(spec: StateSpec, value: torch.Tensor, stored: torch.Tensor,
                scale: Optional[torch.Tensor]) -> None:
    """Store ``value`` (fp32, int16 for remainders) into existing local ``stored`` /
    ``scale``. The caller's ``value`` is never modified. Scaled kinds get a fresh scale
    (S2.3), measured over this local tensor only.
    """
    value = value.to(stored.device)
    if spec.scaled:
        new_scale = measure_scale(value, spec.kind)
        stored.copy_(quantize(value, spec.kind, new_scale))
        scale.copy_(new_scale)
    else:
        stored.copy_(value)


def new_entry(spec: StateSpec, value: torch.Tensor, like: torch.Tensor):
    """Fresh local storage (and scale) for ``spec`` holding ``value``, allocated like the
    local tensor ``like`` (its shape and device; S2.6)."""
    stored = torch.empty(like.shape, dtype=spec.dtype, device=like.device)
    scale = None
    if spec.scaled:
        scale = torch.ones((), dtype=torch.float32, device=like.device)
    write_value(spec, value, stored, scale)
    return stored, scale


def initial_value(spec: StateSpec, param: torch.Tensor) -> torch.Tensor:
    """What a new entry holds (S1.6): zero moments and remainder, master = parameter."""
    if spec.name != "master_param":
        return torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    if spec.kind == KIND_INT16_REMAINDER:
        return torch.zeros(param.shape, dtype=torch.int16, device=param.device)
    return param.detach().float()


def converted_value(spec: StateSpec, entry: dict, scales: Optional[dict],
                    param: torch.Tensor):
    """``entry[spec.name]``'s true value in the form ``spec`` stores (fp32 or int16),
    plus the bf16 bits the parameter must take when an fp32 master becomes a remainder.
    """
    value = read_value(entry, scales, spec.name)
    if spec.kind != KIND_INT16_REMAINDER:
        return as_fp32(value, param), None
    if value.dtype == torch.int16:
        return value, None
    high, low = split_remainder(value.float())
    return low, high


def entry_matches(spec: StateSpec, entry: dict, scales: Optional[dict],
                  param: torch.Tensor, layout) -> bool:
    """Whether ``entry`` already stores ``spec`` usably for the local tensor ``param``
    whose parameter has ``layout``."""
    stored = entry.get(spec.name)
    if stored is None or layout.state_error(stored) is not None:
        return False
    stored = _dtensor.to_local(stored)
    if stored.dtype != spec.dtype or stored.device != param.device:
        return False
    if stored.shape != param.shape or not stored.is_contiguous():
        return False
    if not spec.scaled:
        return True
    scale = scales.get(spec.name) if scales else None
    return (isinstance(scale, torch.Tensor) and not _dtensor.is_dtensor(scale)
            and scale.dtype == torch.float32 and scale.dim() == 0
            and scale.device == param.device)


class EntryWrites:
    """The changes that make one parameter's state what it must be, prepared before any
    is applied: local storage by name, scales by name (None removes either), and the
    bf16 bits the parameter must take (or None), and entries other than the states,
    stored as they are (``extra``: loaded keys someone else keeps in the state, S5.5)."""

    __slots__ = ("stored", "scales", "param_bits", "extra")

    def __init__(self):
        self.stored = {}
        self.scales = {}
        self.param_bits = None
        self.extra = {}

    def empty(self) -> bool:
        return (not self.stored and not self.scales and self.param_bits is None
                and not self.extra)


def plan_entry(specs: tuple, entry: Optional[dict], scales: Optional[dict],
               param: torch.Tensor, layout) -> EntryWrites:
    """The writes that make ``entry`` / ``scales`` hold exactly ``specs`` for ``param``
    (the local tensor of a parameter with ``layout``). Pure: nothing is written, so
    callers can prepare every change before they apply any.
    """
    entry = entry if entry is not None else {}
    scales = scales if scales is not None else {}
    writes = EntryWrites()
    wanted = {spec.name for spec in specs}
    for spec in specs:
        if entry_matches(spec, entry, scales, param, layout):
            if not spec.scaled and spec.name in scales:
                writes.scales[spec.name] = None  # a stale scale of an unscaled kind
            continue
        stored = entry.get(spec.name)
        if stored is not None and _dtensor.to_local(stored).shape == param.shape:
            value, bits = converted_value(spec, entry, scales, param)
            writes.param_bits = bits if bits is not None else writes.param_bits
        else:
            value = initial_value(spec, param)
        writes.stored[spec.name], writes.scales[spec.name] = new_entry(spec, value, param)
    for name in STATE_NAMES:
        if name not in wanted:
            if name in entry:
                writes.stored[name] = None
            if name in scales:
                writes.scales[name] = None
    return writes


def entry_from_values(specs: tuple, values: dict, param: torch.Tensor) -> EntryWrites:
    """Writes that store exported ``values`` (local tensors) in fresh storage.

    ``values`` hold true values in any floating dtype, or int16 remainders; they pass
    through fp32 (S5.5), so state saved under other dtypes loads. Nothing aliases them.
    """
    writes = EntryWrites()
    for spec in specs:
        value = values[spec.name]
        if spec.kind == KIND_INT16_REMAINDER and value.dtype != torch.int16:
            writes.param_bits, value = split_remainder(value.float())
        elif spec.kind != KIND_INT16_REMAINDER:
            value = as_fp32(value, param)
        writes.stored[spec.name], writes.scales[spec.name] = new_entry(spec, value, param)
    return writes


def apply_entry(state, scales, param, writes: EntryWrites, local: torch.Tensor,
                layout) -> None:
    """Apply what ``plan_entry`` / ``entry_from_values`` prepared for ``param``: storage
    into ``state[param]`` (wrapped in the parameter's layout), scales into
    ``scales[param]`` (dropped when none is left), then the parameter's new bf16 bits
    into its local tensor."""
    entry = state[param]
    for name, stored in writes.stored.items():
        if stored is None:
            entry.pop(name, None)
        else:
            entry[name] = layout.wrap(stored)
    entry.update(writes.extra)
    if writes.scales:
        param_scales = scales.get(param)
        for name, scale in writes.scales.items():
            if scale is not None:
                if param_scales is None:
                    param_scales = scales[param] = {}
                param_scales[name] = scale
            elif param_scales is not None:
                param_scales.pop(name, None)
        if param_scales is not None and not param_scales:
            del scales[param]
    if writes.param_bits is not None:
        with torch.no_grad():  # the parameter is a leaf that requires grad
            local.copy_(writes.param_bits)


def consistency_error(specs: tuple, entry: Optional[dict], param: torch.Tensor, layout):
    """A sentence if ``entry`` holds a state that cannot belong to the local tensor
    ``param`` of a parameter with ``layout`` (S3.3: a DTensor parameter's states are
    DTensors of its layout, a plain one's are plain)."""
    if not entry:
        return None
    for spec in specs:
        stored = entry.get(spec.name)
        if stored is None:
            continue
        error = layout.state_error(stored)
        if error is None:
            local = _dtensor.to_local(stored)
            if tuple(local.shape) != tuple(param.shape):
                error = (f"has local shape {tuple(local.shape)} but the parameter's local "
                         f"shape is {tuple(param.shape)}")
        if error is not None:
            return (f"state {spec.name!r} {error}; call initialize_state(param) to "
                    f"recreate it")
    return None


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
