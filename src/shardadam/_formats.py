"""State storage formats: one declaration each (SEMANTICS S2.2), and the lookups.

A format is how one state tensor (``exp_avg``, ``exp_avg_sq`` or ``master_param``) is
stored. Its declaration holds every fact the package needs about it: its name in
recorded state layouts (S5.4), the C++ core's tag for it, the torch dtype of its
storage and the dtype its stored bits are codes of, its scale (none, one per tensor, or
one per block of elements) and the largest magnitude a scaled value is stored as
(S2.3), the states it may hold (``roles``), the constructor dtype that names it, and for
remainders the parameter dtype that holds the rest of the value (S2.5). Its methods
are its torch codec (with ``_codecs``). The rest of the package asks a format these
things and compares no tags or dtypes of its own.

The C++ core declares the same table (csrc/include/shardadam/formats.h) and exports it
as ``_C.FORMATS``; ``check_extension`` refuses an extension whose table differs.

The constructor names formats by dtype, as Transformer Engine does (``configured``):
``exp_avg_dtype`` / ``exp_avg_sq_dtype`` torch.float32, float16, bfloat16 or uint8 (fp8
E4M3 codes), ``master_weight_dtype`` torch.float32 or float16; remainders are chosen by
``store_param_remainders`` and named by no dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import _codecs

# The core's tag for "no buffer" (a missing master, a skipped gradient).
TAG_NONE = 0
SCALES = ("none", "tensor", "block")
# "moment": either moment; "exp_avg" / "exp_avg_sq": only that one (an unsigned map
# holds exp_avg_sq, which is never negative).
ROLES = ("moment", "exp_avg", "exp_avg_sq", "master")


@dataclasses.dataclass(frozen=True, eq=False)  # one object per format: compared by identity
class Format:
    """One state storage format (see the module docstring)."""

    name: str
    tag: int
    storage: torch.dtype
    codes: torch.dtype  # what the stored bits are: fp8 keeps float8_e4m3fn codes in uint8
    roles: tuple
    scale: str = "none"
    # Elements per scale, for "block": 0 in the registry (the block size is chosen at
    # construction, S2.11); ``with_block`` gives the format at one block size.
    scale_block: int = 0
    scale_target: float = 0.0  # S2.3's R, for a scaled format
    argument: Optional[torch.dtype] = None  # the constructor dtype that names it
    pairs_with: Optional[torch.dtype] = None  # the parameter dtype holding the value's rest
    zero_bound: float = 0.0  # per block: the largest magnitude stored as code 0
    # Bits per element: the storage dtype's, or 4 for codes packed two per byte (S2.12:
    # the element with flat index i in the low nibble of byte i // 2 when i is even).
    item_bits: int = 0

    def __post_init__(self):
        if self.item_bits == 0:
            object.__setattr__(self, "item_bits", 8 * self.storage.itemsize)
        if (self.item_bits not in (4, 8 * self.storage.itemsize)
                or self.scale not in SCALES or not set(self.roles) <= set(ROLES)
                or (self.scale != "block" and self.scale_block != 0)
                or self.scale_block < 0
                or self.scaled != (self.scale_target > 0)
                or self.codes.itemsize != self.storage.itemsize):
            raise ValueError(f"format {self.name!r} is not a consistent declaration")

    def __reduce__(self):
        # Pickles and copies are the registry's object (at this block size).
        if self.scale_block:
            return _blocked, (self.name, self.scale_block)
        return by_name, (self.name,)

    def __repr__(self) -> str:
        return f"<format {self.label}>"

    @property
    def label(self) -> str:
        """The name, with the block size of a per-block format at one (``fp8-block:256``),
        as recorded state layouts write it (S5.4)."""
        return f"{self.name}:{self.scale_block}" if self.scale_block else self.name

    def with_block(self, block: int) -> "Format":
        """This per-block format at ``block`` elements per scale: one object per size,
        so formats still compare by identity."""
        return _blocked(self.name, block)

    def holds(self, state_name: str) -> bool:
        """Whether a state called ``state_name`` may be stored in this format."""
        if state_name == "master_param":
            return "master" in self.roles
        return "moment" in self.roles or state_name in self.roles

    @property
    def packed(self) -> bool:
        """Two codes per byte: stored packed along the last dimension (S2.12)."""
        return self.item_bits == 4

    def storage_shape(self, shape) -> tuple:
        """The shape of the storage of a local tensor of ``shape`` (packed formats: only
        for tensors ``_dtensor`` finds packable)."""
        shape = tuple(shape)
        return shape[:-1] + (shape[-1] // 2,) if self.packed else shape

    def numel_of(self, stored: torch.Tensor) -> int:
        """How many elements storage ``stored`` holds."""
        return stored.numel() * (2 if self.packed else 1)

    @property
    def scaled(self) -> bool:
        return self.scale != "none"

    @property
    def value_dtype(self) -> torch.dtype:
        """What ``state_dict()`` exports and ``set_scaled_state`` takes (S5.4): fp32 true
        values, or a remainder's codes themselves (its true value needs the parameter)."""
        return self.storage if self.pairs_with is not None else torch.float32

    def scale_shape(self, numel: int, first: int = 0) -> Optional[tuple]:
        """The shape of the fp32 scale tensor of ``numel`` stored elements whose first
        has flat index ``first`` in the whole parameter (S2.9: one scale per block the
        range touches); None when the format has no scale."""
        if self.scale == "tensor":
            return ()
        if self.scale == "block":
            return (_codecs.block_count(first, numel, self._block()),)
        return None

    @property
    def overflow_bound(self) -> float:
        """Per block: the smallest largest magnitude whose code would decode past the
        largest fp32 (S2.9; such a block takes scale 1); 0 for other formats."""
        return _codecs.OVERFLOW_BOUNDS.get(self.name, 0.0)

    def row(self) -> tuple:
        """This declaration as the C++ core's table lists it (``check_extension``)."""
        return (self.tag, self.name, self.item_bits, self.scale, self.scale_block,
                float(self.scale_target), tuple(sorted(self.roles)), float(self.zero_bound),
                float(self.overflow_bound))

    # The torch codec. Values pass through fp32; rounding into the codes is torch's
    # `.to()` (copy_ rounds the same way), bit-exact with the C++ core (S2.4).

    def decode(self, stored: torch.Tensor, scale: Optional[torch.Tensor],
               first: int = 0) -> torch.Tensor:
        """The exported value of local storage ``stored`` with its ``scale``: fp32 true
        values (fp32 storage itself, else a new tensor), or a remainder's own codes.
        ``first``: the flat index of its first element in the whole parameter, which
        places per-block scales (S2.9)."""
        if self.pairs_with is not None:
            return stored
        if self.scale == "block":
            out = torch.empty(self.value_shape(stored), dtype=torch.float32,
                              device=stored.device)
            flat, codes = out.view(-1), stored.reshape(-1)
            for begin, end, j, count in self._chunks(flat.numel(), first):
                part = codes[begin // 2:end // 2] if self.packed else codes[begin:end]
                if self.packed:
                    part = _codecs.unpack_nibbles(part)
                flat[begin:end] = _codecs.decode_blocks(self.name, part, scale[j:j + count],
                                                        first + begin, self._block())
            return out
        codes = stored if stored.dtype == self.codes else stored.view(self.codes)
        if not self.scaled:
            return codes.float()
        return codes.to(torch.float32, copy=True).mul_(scale)  # one fp32 tensor, not two

    def encode(self, value: torch.Tensor, stored: torch.Tensor,
               scale: Optional[torch.Tensor], first: int = 0,
               rounding: Optional[int] = None,
               measured: Optional[torch.Tensor] = None) -> None:
        """Store the exported ``value`` (or, for a master, the parameter's own floating
        values, converted a chunk at a time) into ``stored``; a scaled format first measures
        a new ``scale`` over ``value`` (S2.3; per block, S2.9 / S2.10, blocks placed by
        ``first`` as in ``decode``). ``value`` is never modified; when it is ``stored``
        itself (fp32 updated in place) there is nothing to do. ``rounding``: a step key
        to round a per-block moment (``fp4-block``, ``ufp4-block``, ``ufp8-block``)
        stochastically (S2.13), else to nearest. ``measured``: where ``value`` is part
        of a tensor with a per-tensor scale, the scale measured over the whole of it,
        used as given; ``scale`` is then left for the caller to write."""
        if self.scale == "block" and (value.is_meta or stored.is_meta):
            return  # no values to encode (state of meta parameters, S1.6)
        if self.scale == "block":
            flat = value.reshape(-1)
            out = stored.view(-1) if stored.is_contiguous() else stored.reshape(-1).clone()
            for begin, end, j, count in self._chunks(flat.numel(), first):
                part = flat[begin:end]
                where = slice(begin // 2, end // 2) if self.packed else slice(begin, end)
                if not torch.any(part.float().view(torch.int32)):
                    # All +0 (a new entry's moments): code 0, scale 1 (S2.9), no encoding.
                    out[where] = 0
                    scale[j:j + count] = 1.0
                    continue
                codes, scales = _codecs.encode_blocks(self.name, part, first + begin,
                                                      self._block(), self.scale_target,
                                                      self.zero_bound, rounding)
                out[where] = _codecs.pack_nibbles(codes) if self.packed else codes
                scale[j:j + count] = scales
            if not stored.is_contiguous():
                stored.copy_(out.view(stored.shape))
        elif value is not stored:
            new_scale = measured
            if new_scale is None and self.scaled:
                new_scale = _codecs.measure_scale(value, self.scale_target)
            # Chunk by chunk into the storage: the codecs' temporaries (up to 12 bytes
            # per element) stay at _CHUNK elements, not the tensor's size.
            if stored.is_contiguous() and value.numel() > _CHUNK:
                flat, out = value.reshape(-1), stored.view(-1)
                parts = [(flat[b:b + _CHUNK], out[b:b + _CHUNK])
                         for b in range(0, flat.numel(), _CHUNK)]
            else:
                parts = [(value, stored)]
            for part, into in parts:
                if part.dtype != self.value_dtype:
                    part = part.float()  # a parameter's values (a seeded master)
                # A true division by the scale, as the core divides.
                into.copy_(self._to_codes(part if new_scale is None else part / new_scale))
            if new_scale is not None and measured is None:
                scale.copy_(new_scale)

    def true_value(self, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """fp32 true values of an exported ``value`` (remainders: merged with the local
        bf16 ``param``, S2.5)."""
        if self.pairs_with is not None:
            return _codecs.merge_remainder(param, value.to(param.device))
        return value.float()

    def from_true(self, value: torch.Tensor):
        """``(exported value, parameter bits or None)`` holding fp32 true ``value``: a
        remainder splits it, and the parameter must take the high half (S2.5)."""
        if self.pairs_with is not None:
            high, low = _codecs.split_remainder(value)
            return low, high
        return value, None

    def _to_codes(self, values: torch.Tensor) -> torch.Tensor:
        if self.codes == torch.bfloat16:
            return _codecs.bf16_encode(values)  # NaN's sign kept (S2.4)
        if self.codes == torch.float8_e4m3fn:
            return _codecs.e4m3_encode(values)  # overflow stores NaN on any torch (S2.4)
        return values  # fp32, fp16: copy_ into the storage rounds as .to() does

    def _chunks(self, numel: int, first: int):
        """``(begin, end, j, count)`` of each chunk of a local tensor of ``numel``
        elements from flat index ``first``: about ``_CHUNK`` elements, cut on the whole
        parameter's block boundaries, the chunk's blocks ``[j, j + count)`` of the
        tensor's scales. The torch codecs hold up to about 80 bytes per element of
        temporaries: chunked, a tensor of any size needs at most ``_CHUNK`` times that."""
        block = self._block()
        step = max(block, _CHUNK // block * block)
        begin = 0
        while begin < numel:
            end = min(numel, (first + begin) // step * step + step - first)
            j = (first + begin) // block - first // block
            yield begin, end, j, _codecs.block_count(first + begin, end - begin, block)
            begin = end

    def value_shape(self, stored: torch.Tensor) -> tuple:
        """The shape of the local tensor whose storage is ``stored`` (``storage_shape``
        undone)."""
        shape = tuple(stored.shape)
        return shape[:-1] + (2 * shape[-1],) if self.packed else shape

    def _block(self) -> int:
        if not self.scale_block:
            raise ValueError(f"format {self.name!r} has no block size: use with_block()")
        return self.scale_block


# Elements per chunk of a format's torch codecs (Format._chunks).
_CHUNK = _codecs.CHUNK

FP32 = Format("fp32", 1, torch.float32, torch.float32, ("moment", "master"),
              argument=torch.float32)
FP16 = Format("fp16", 2, torch.float16, torch.float16, ("moment", "master"),
              scale="tensor", scale_target=32752.0,  # finfo(float16).max / 2
              argument=torch.float16)
BF16 = Format("bf16", 3, torch.bfloat16, torch.bfloat16, ("moment",),
              argument=torch.bfloat16)
FP8 = Format("fp8", 4, torch.uint8, torch.float8_e4m3fn, ("moment",),
             scale="tensor", scale_target=448.0,  # the largest finite E4M3
             argument=torch.uint8)
REMAINDER = Format("remainder", 5, torch.int16, torch.int16, ("master",),
                   pairs_with=torch.bfloat16)
# Per-block scaled 8-bit moments (S2.9, S2.10), chosen by ``moment_format`` (S2.11)
# and named by no dtype. Bounds: the largest magnitude that still encodes to a finite
# code, and the largest that encodes to code 0 (none for the zero-free map).
FP8_BLOCK = Format("fp8-block", 6, torch.uint8, torch.float8_e4m3fn, ("moment",),
                   scale="block", scale_target=464.0, zero_bound=2.0 ** -10)
UFP8_BLOCK = Format("ufp8-block", 7, torch.uint8, torch.uint8, ("exp_avg_sq",),
                    scale="block", scale_target=488.0)
# Per-block scaled 4-bit moments (S2.12), two codes per byte. Signed E2M1 is finite
# below 7 (the largest fp32 below it is the bound); unsigned E3M1 up to 20, zero-free.
FP4_BLOCK = Format("fp4-block", 8, torch.uint8, torch.uint8, ("moment",), scale="block",
                   scale_target=float.fromhex("0x1.bffffep+2"), zero_bound=0.25,
                   item_bits=4)
UFP4_BLOCK = Format("ufp4-block", 9, torch.uint8, torch.uint8, ("exp_avg_sq",),
                    scale="block", scale_target=20.0, item_bits=4)

FORMATS = (FP32, FP16, BF16, FP8, REMAINDER, FP8_BLOCK, UFP8_BLOCK, FP4_BLOCK, UFP4_BLOCK)
_BY_NAME = {f.name: f for f in FORMATS}
_BY_TAG = {f.tag: f for f in FORMATS}
if len(_BY_NAME) != len(FORMATS) or len(_BY_TAG) != len(FORMATS) or TAG_NONE in _BY_TAG:
    raise ValueError("two formats share a name or a tag")

# ``moment_format`` names (S2.11): each a pair of per-block formats, for exp_avg and
# exp_avg_sq, the block size used when ``moment_block_size`` is None, and the family a
# tensor the pair cannot store uses instead (S2.12: packed 4-bit codes need whole bytes
# per row), at the same block size.
MOMENT_FAMILIES = {"block8": (FP8_BLOCK, UFP8_BLOCK, 256, None),
                   "block4": (FP4_BLOCK, UFP4_BLOCK, 128, "block8")}


def moment_family(name: str, block: Optional[int], packable: bool = True) -> tuple:
    """``(exp_avg format, exp_avg_sq format)`` of ``moment_format=name`` at ``block``
    elements per scale (None: the family's default), for a tensor whose states can be
    stored packed (``packable``: ``_dtensor`` decides) or not. KeyError for an unknown
    name."""
    exp_avg, exp_avg_sq, default, fallback = MOMENT_FAMILIES[name]
    block = default if block is None else block
    if not packable and (exp_avg.packed or exp_avg_sq.packed):
        return moment_family(fallback, block, packable)
    return exp_avg.with_block(block), exp_avg_sq.with_block(block)


def family_of(exp_avg_label: str, exp_avg_sq_label: str) -> tuple:
    """``(moment_format, moment_block_size)`` whose formats a recorded layout names by
    these labels, or ``(None, None)``."""
    try:
        exp_avg, exp_avg_sq = by_label(exp_avg_label), by_label(exp_avg_sq_label)
    except KeyError:
        return None, None
    block = exp_avg.scale_block
    for family, (first, second, _, _) in MOMENT_FAMILIES.items():
        if (block and exp_avg is first.with_block(block)
                and exp_avg_sq is second.with_block(block)):
            return family, block
    return None, None


def family_labels() -> list:
    """How recorded layouts write each ``moment_format`` (block size B)."""
    pairs = {name: moment_family(name, None) for name in MOMENT_FAMILIES}
    return [f"{name}: exp_avg={a.name}:B exp_avg_sq={b.name}:B"
            for name, (a, b) in pairs.items()]


# Parameters and gradients are plain fp32 / fp16 / bf16 tensors (never scaled), which
# the core reads by these formats' tags.
PARAM_TAGS = {f.storage: f.tag for f in (FP32, FP16, BF16)}

# What a storage dtype meant before formats were stored beside the state, when each
# format had a dtype of its own (read in ``_state.stored_format``).
_LEGACY = {f.storage: f for f in (FP32, FP16, BF16, FP8, REMAINDER)}


def by_name(name: str) -> Format:
    """The format a recorded layout calls ``name``; KeyError if there is none."""
    return _BY_NAME[name]


_BLOCKED = {}


def _blocked(name: str, block: int) -> Format:
    """Per-block format ``name`` at ``block`` elements per scale (one object each)."""
    fmt = _BLOCKED.get((name, block))
    if fmt is None:
        base = _BY_NAME[name]
        if base.scale != "block" or block <= 0:
            raise ValueError(f"format {name!r} at {block!r} elements per scale: it must "
                             f"be a per-block format, at a positive block size")
        fmt = _BLOCKED[(name, block)] = dataclasses.replace(base, scale_block=block)
    return fmt


def by_label(label: str) -> Format:
    """The format a recorded layout calls ``label`` (``Format.label``); KeyError if
    there is none."""
    name, _, block = label.partition(":")
    if not block:
        return _BY_NAME[name]
    low, high = SCALE_BLOCK_RANGE
    # Only the label state_dict() writes: ASCII digits, no leading zero ("0256" and
    # other scripts' digits pass str.isdigit and int()).
    if (not (block.isascii() and block.isdigit()) or str(int(block)) != block
            or not low <= int(block) <= high or int(block) & (int(block) - 1)
            or _BY_NAME[name].scale != "block"):
        raise KeyError(label)
    return _blocked(name, int(block))


def by_tag(tag: int) -> Format:
    """The format the C++ core tags ``tag``; KeyError if there is none."""
    return _BY_TAG[tag]


def choices(role: str) -> tuple:
    """The formats the constructor can name for a state of ``role``, in tag order."""
    return tuple(f for f in FORMATS if role in f.roles and f.argument is not None)


def configured(dtype, role: str) -> Optional[Format]:
    """The format that constructor argument ``dtype`` names for a state of ``role``
    (``"moment"``: ``exp_avg_dtype`` / ``exp_avg_sq_dtype``; ``"master"``:
    ``master_weight_dtype``), or None if it names none. dtypes are singletons: compared
    by identity, so any object may be asked about."""
    for fmt in choices(role):
        if fmt.argument is dtype:
            return fmt
    return None


def legacy_format(dtype: torch.dtype) -> Optional[Format]:
    """The format storage of ``dtype`` holds when nothing recorded one: state stored by
    a version that kept no format beside it (a pickled optimizer), or put into
    ``optimizer.state`` from outside in a dtype other than its recorded format's. None
    for a dtype no format ever had."""
    return _LEGACY.get(dtype)


def check_extension(module) -> frozenset:
    """Raise ImportError unless ``module.FORMATS`` (the C++ core's table: tuples ``(tag,
    name, item_bits, scale, scale_block, scale_target, roles, zero_bound,
    overflow_bound)``) declares each of these formats exactly as here: the core and this
    package read the same buffers by these facts. Rows and roles are compared in any
    order. A per-block format the core does not declare at all (an older core) is only
    unavailable (returned: the names of those): nothing selects it by default, and
    ``moment_format`` refuses it.
    Formats of the core this package does not know never cross the boundary, so only
    their tags and names must not collide with these."""
    found = getattr(module, "FORMATS", None)
    missing = set()
    try:
        rows = [(*row[:6], tuple(sorted(row[6])), *row[7:]) for row in found
                if len(row) == 9]
        same = len(rows) == len(found) and len(rows) > 0
        tags = [row[0] for row in rows]
        names = [row[1] for row in rows]
        same = same and len(set(tags)) == len(tags) and len(set(names)) == len(names)
        for fmt in FORMATS:
            mine = [row for row in rows if row[0] == fmt.tag or row[1] == fmt.name]
            if not mine and fmt.scale == "block":
                missing.add(fmt.name)
                continue
            same = same and mine == [fmt.row()]
    except (TypeError, IndexError):  # not a sequence of 9-tuples of comparable values
        same = False
    if not same:
        raise ImportError(f"shardadam._C does not match this package (expected formats "
                          f"{sorted(f.row() for f in FORMATS)}, found {found!r}): "
                          "rebuild the extension")
    return frozenset(missing)


def use_extension(module) -> None:
    """Check the loaded core's table (``check_extension``) and take from it which
    per-block formats it has and its range of block sizes."""
    global _UNAVAILABLE, SCALE_BLOCK_RANGE
    _UNAVAILABLE = check_extension(module)
    SCALE_BLOCK_RANGE = (int(getattr(module, "MIN_SCALE_BLOCK", SCALE_BLOCK_RANGE[0])),
                         int(getattr(module, "MAX_SCALE_BLOCK", SCALE_BLOCK_RANGE[1])))


# Per-block formats the loaded C++ core does not declare (``check_extension``).
_UNAVAILABLE = frozenset()
# Elements per block scale: a power of two in this range (the core's kMinScaleBlock /
# kMaxScaleBlock; read from the extension when it loads).
SCALE_BLOCK_RANGE = (128, 4096)


def available(fmt: Format) -> bool:
    """Whether the loaded C++ core (if any) can step states of ``fmt``."""
    return fmt.name not in _UNAVAILABLE


def unavailable() -> frozenset:
    """The names of the formats ``available`` refuses (one object until the next
    ``use_extension``)."""
    return _UNAVAILABLE
