"""The formats' codecs in torch ops: the scale rule (SEMANTICS S2.3) and the remainder
split (S2.5), bit for bit what the C++ core does.

``_formats`` declares which format uses what; the rounding of a value into a 16-bit
format's codes is torch's own ``.to()`` (S2.4), so only these rules are written here.
"""

from __future__ import annotations

from typing import Optional

import torch

_TINY = torch.finfo(torch.float32).tiny
# Elements a codec works on at a time: its temporaries stay at this many, not the
# tensor's size (S1.6).
CHUNK = 1 << 20
_NAN = torch.tensor(0x7FC00000, dtype=torch.int32).view(torch.float32)  # NaN codes' value


def measure_scale(value: torch.Tensor, target: float) -> torch.Tensor:
    """S2.3: the scale of fp32 ``value`` stored with largest magnitude ``target``, as a
    0-dim fp32 tensor: ``max(max|value| / target, tiny)``, or 1 for an empty tensor or a
    zero or non-finite maximum."""
    if value.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=value.device)
    # The largest magnitude from the extremes: no |value| temporary of the tensor's size
    # (amin / amax rather than aminmax: every backend has them). NaN propagates.
    return scale_of_absmax(torch.maximum(-torch.amin(value), torch.amax(value)), target)


def scale_of_absmax(absmax: torch.Tensor, target: float) -> torch.Tensor:
    """``measure_scale`` of values whose largest magnitude is the 0-dim ``absmax``
    (NaN where one is NaN)."""
    one = torch.ones((), dtype=torch.float32, device=absmax.device)
    # A device tensor divisor: CUDA would multiply by the reciprocal of a host scalar.
    target = torch.full((), target, dtype=torch.float32, device=absmax.device)
    scale = torch.clamp_min(absmax / target, _TINY)
    return torch.where(torch.isfinite(absmax) & (absmax > 0), scale, one)


def merge_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master rebuilt from a bf16 parameter and its int16 remainder (S2.5). A
    parameter whose dtype changed since (``param.data = param.data.half()``) pairs its
    value rounded to bf16, the bf16 parameter it was converted from."""
    if param.numel() <= CHUNK:  # the torch path's pieces: no copy into an output
        return _merged(param, remainder)
    out = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    flat, params, remainders = out.view(-1), param.reshape(-1), remainder.reshape(-1)
    for b in range(0, flat.numel(), CHUNK):
        flat[b:b + CHUNK] = _merged(params[b:b + CHUNK], remainders[b:b + CHUNK])
    return out


def _merged(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    # The split rounded the high half up when the low half was >= 0x8000 (negative as
    # int16); undo that, then lay the halves side by side (little-endian) as one fp32.
    high = param.to(torch.bfloat16).view(torch.int16) - (remainder < 0).to(torch.int16)
    pair = torch.stack((remainder, high), dim=-1)
    return pair.view(torch.float32).squeeze(-1)


def split_remainder(master: torch.Tensor):
    """The bf16 parameter bits and the int16 remainder of an fp32 master (S2.5)."""
    if master.numel() <= CHUNK:
        return _split(master)
    high = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
    low = torch.empty(master.shape, dtype=torch.int16, device=master.device)
    flat, highs, lows = master.reshape(-1), high.view(-1), low.view(-1)
    for b in range(0, flat.numel(), CHUNK):
        highs[b:b + CHUNK], lows[b:b + CHUNK] = _split(flat[b:b + CHUNK])
    return high, low


def _split(master: torch.Tensor):
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
# Per-block scaled codes (S2.9 signed E4M3 "fp8-block", S2.10 unsigned zero-free E4M4
# "ufp8-block", S2.12 signed E2M1 "fp4-block" and unsigned zero-free E3M1
# "ufp4-block"), bit for bit what the C++ core stores. A local tensor whose first
# element has flat index ``first`` in the whole parameter holds the blocks its range
# touches; its scales are one fp32 per such block, in order.

_UFP8_NAN = 0xFF


def block_count(first: int, numel: int, block: int) -> int:
    """How many blocks of ``block`` elements the flat range ``[first, first+numel)``
    touches (the core's ScaleCount; 0 for an empty range)."""
    if numel == 0:
        return 0
    return (first + numel - 1) // block - first // block + 1


def _block_of_each(numel: int, first: int, block: int, device) -> torch.Tensor:
    """The position in the scale tensor of each of ``numel`` local elements."""
    return (torch.arange(numel, device=device) + first % block) // block


def _ufp8_table() -> torch.Tensor:
    """fp32 value of every unsigned E4M4 code (S2.10): E = 0 is M·2^-10, E ≥ 1 is
    (16+M)·2^(E-11), 0xFF is NaN (0x7FC00000)."""
    code = torch.arange(256, dtype=torch.float64)
    e, m = torch.div(code, 16, rounding_mode="floor"), code % 16
    value = torch.where(e == 0, m * 2.0 ** -10, (16 + m) * torch.pow(2.0, e - 11))
    table = value.float()
    table[_UFP8_NAN] = _NAN
    return table


_UFP8_VALUES = _ufp8_table()


def ufp8_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of unsigned E4M4 ``codes`` (uint8), unscaled."""
    return _UFP8_VALUES.to(codes.device)[codes.long()]


def ufp8_encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 unsigned E4M4 codes of fp32 ``|x|`` (S2.10): nearest, ties to even M; above
    the largest finite code's half step (488), inf and NaN: 0xFF; a non-zero magnitude
    that rounds to code 0 takes code 1."""
    ax = x.abs().double()  # exact; products by powers of two below stay exact
    # Binade e of ax (2^e <= ax < 2^(e+1)), at least -6: below 2^-6 the step is 2^-10.
    _, k = torch.frexp(ax)
    e = torch.clamp_min(k - 1, -6)
    # Code index: 16 per binade above 2^-6; rounding to even steps is ties-to-even M,
    # and a round up to 2^(e+1) carries into the next binade's first code.
    steps = torch.round(torch.ldexp(ax, (4 - e).to(ax.dtype)))
    code = 16 * (e.double() + 6) + steps
    code = torch.where(ax > 0, torch.clamp_min(code, 1), 0)
    code = torch.where(ax <= 488, torch.clamp_max(code, _UFP8_NAN - 1), _UFP8_NAN)
    return code.to(torch.uint8)


# S2.12's 4-bit codes, one per uint8 here (``pack_nibbles`` puts two in a byte).
_FP4_NAN, _UFP4_NAN = 0x8, 0xF


def _fp4_table() -> torch.Tensor:
    """fp32 value of every signed E2M1 code: magnitude E = 0 is M·0.5, E ≥ 1 is
    (2+M)·2^(E-2); bit 3 the sign; 0x8 (-0) is NaN."""
    code = torch.arange(16, dtype=torch.float64)
    mag = code % 8
    e, m = torch.div(mag, 2, rounding_mode="floor"), mag % 2
    value = torch.where(e == 0, m * 0.5, (2 + m) * torch.pow(2.0, e - 2))
    table = torch.where(code >= 8, -value, value).float()
    table[_FP4_NAN] = _NAN
    return table


def _ufp4_table() -> torch.Tensor:
    """fp32 value of every unsigned E3M1 code: E = 0 is M·0.125, E ≥ 1 is
    (2+M)·2^(E-4); 0xF is NaN."""
    code = torch.arange(16, dtype=torch.float64)
    e, m = torch.div(code, 2, rounding_mode="floor"), code % 2
    table = torch.where(e == 0, m * 0.125, (2 + m) * torch.pow(2.0, e - 4)).float()
    table[_UFP4_NAN] = _NAN
    return table


_FP4_VALUES, _UFP4_VALUES = _fp4_table(), _ufp4_table()


def _steps(ax: torch.Tensor, lowest: int, mantissa_bits: int):
    """``(e, q)``: the binade ``e`` of float64 magnitudes ``ax`` (2^e <= ax < 2^(e+1)),
    at least ``lowest`` (below it the step stays the lowest binade's), and ``ax`` in
    steps of that binade rounded to nearest, ties to even (exact: a power-of-two
    scaling, and a round up to the next binade carries through the code's addition)."""
    _, k = torch.frexp(ax)
    e = torch.clamp_min(torch.where(ax > 0, k - 1, lowest), lowest)  # frexp(0): k = 0
    return e.double(), torch.round(torch.ldexp(ax, (mantissa_bits - e).to(ax.dtype)))


def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """Signed E2M1 codes of fp32 ``x`` (S2.12): nearest, ties to even; 7 and above, inf
    and NaN: 0x8; a magnitude rounding to 0 is code 0 whatever its sign."""
    ax = x.abs().double()
    e, q = _steps(ax, 0, 1)
    mag = 2 * e + q
    code = torch.where(torch.signbit(x) & (mag > 0), mag + 8, mag)
    return torch.where(ax < 7, code, _FP4_NAN).to(torch.uint8)


def ufp4_encode(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Unsigned E3M1 codes of fp32 ``|x|`` (S2.12): nearest, ties to even; above 20, inf
    and NaN: 0xF; where the true value ``u`` is not zero, at least code 1."""
    ax = x.abs().double()
    e, q = _steps(ax, -2, 1)
    code = torch.where(u != 0, torch.clamp_min(2 * (e + 2) + q, 1), 0)
    return torch.where(ax <= 20, torch.clamp_max(code, _UFP4_NAN - 1),
                       _UFP4_NAN).to(torch.uint8)


# S2.13's generator, on uint32 values held in int64 (torch has no uint32 arithmetic):
# each product is split at 16 bits so none leaves int64.
_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """lowbias32 of ``x`` (a Python int or an int64 tensor, values in [0, 2^32))."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def step_key(rounding_key: int, step: int) -> int:
    """The key of one tensor's stochastic rounding at ``step`` (S2.13)."""
    return mix32(mix32(rounding_key & _M32) ^ (step & _M32))


def exp_avg_step_key(rounding_key: int, step: int) -> int:
    """The key of one exp_avg's stochastic rounding at ``step`` (S2.13): a stream drawn
    from ``step_key`` as the others are (keyed by ``step_key`` itself, the bits of
    element i at step t were those of element t at step i under the key 0)."""
    return mix32(step_key(rounding_key, step) ^ 0x6C8E9CF5)


def param_step_key(rounding_key: int, step: int) -> int:
    """The key of one bf16 parameter's stochastic rounding at ``step`` (S2.14): another
    stream than its exp_avg's."""
    return mix32(step_key(rounding_key, step) ^ 0x5851F42D)


def square_step_key(rounding_key: int, step: int) -> int:
    """The key of one exp_avg_sq's stochastic rounding at ``step`` (S2.13): a third
    stream, unrelated to its exp_avg's and its parameter's."""
    return mix32(step_key(rounding_key, step) ^ 0x2545F491)


def random_bits(key: int, first: int, n: int, device) -> torch.Tensor:
    """32 random bits (int64) of each element of flat indices ``[first, first + n)``."""
    index = torch.arange(first, first + n, dtype=torch.int64, device=device)
    return mix32(mix32((index & _M32) ^ mix32(index >> 32)) ^ key)


def fp4_encode_stochastic(x: torch.Tensor, random: torch.Tensor) -> torch.Tensor:
    """Signed E2M1 codes of fp32 ``x`` rounded stochastically with 22 of the ``random``
    bits (S2.13): from 1 up the fp32 bits above 1.0 plus the random bits count codes;
    below 1, ``|x| · 2^23`` truncated does; from 6 up ``fp4_encode``'s nearest (6, and
    for 7 and above, inf and NaN the NaN code). A magnitude code 0 is code 0."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    magnitude_bits = bits & 0x7FFFFFFF
    r = random & 0x3FFFFF
    normal = 2 + ((magnitude_bits - 0x3F800000 + r) >> 22)
    below_one = torch.nan_to_num(x.abs(), nan=0.0).clamp(max=1.0)
    small = ((below_one * 8388608.0).to(torch.int64) + r) >> 22
    mag = torch.where(magnitude_bits >= 0x3F800000, normal, small)
    code = torch.where(mag == 0, 0, mag | ((bits >> 28) & 8)).to(torch.uint8)
    return torch.where(magnitude_bits >= 0x40C00000, fp4_encode(x), code)


def ufp4_encode_stochastic(x: torch.Tensor, u: torch.Tensor,
                           random: torch.Tensor) -> torch.Tensor:
    """Unsigned E3M1 codes of fp32 ``|x|`` rounded stochastically with 22 of the
    ``random`` bits (S2.13): from 0.25 up the fp32 bits above 0.25 plus the random bits
    count codes; below 0.25, ``|x| · 2^25`` truncated does; from 16 up ``ufp4_encode``'s
    nearest (16, and above 20, inf and NaN the NaN code). Zero-free on ``u`` as
    ``ufp4_encode``."""
    magnitude_bits = x.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    r = random & 0x3FFFFF
    normal = 2 + ((magnitude_bits - 0x3E800000 + r) >> 22)
    below_quarter = torch.nan_to_num(x.abs(), nan=0.0).clamp(max=0.25)
    small = ((below_quarter * 33554432.0).to(torch.int64) + r) >> 22
    code = torch.where(magnitude_bits >= 0x3E800000, normal, small)
    code = torch.where((code == 0) & (u != 0), 1, code).to(torch.uint8)
    return torch.where(magnitude_bits >= 0x41800000, ufp4_encode(x, u), code)


def ufp8_encode_stochastic(x: torch.Tensor, u: torch.Tensor,
                           random: torch.Tensor) -> torch.Tensor:
    """Unsigned E4M4 codes of fp32 ``|x|`` rounded stochastically with 19 of the
    ``random`` bits (S2.13): from 2^-6 up the fp32 bits above 2^-6 plus the random
    bits count codes, 16 a binade; below 2^-6, ``|x| · 2^29`` truncated does; from 480
    up ``ufp8_encode``'s nearest (480 up to 488, and above it, inf and NaN the NaN
    code). Zero-free on ``u`` as ``ufp8_encode``'s callers."""
    magnitude_bits = x.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    r = random & 0x7FFFF
    normal = 16 + ((magnitude_bits - 0x3C800000 + r) >> 19)
    below = torch.nan_to_num(x.abs(), nan=0.0).clamp(max=2.0 ** -6)
    small = ((below * 536870912.0).to(torch.int64) + r) >> 19
    code = torch.where(magnitude_bits >= 0x3C800000, normal, small)
    code = torch.where((code == 0) & (u != 0), 1, code).to(torch.uint8)
    return torch.where(magnitude_bits >= 0x43F00000, ufp8_encode(x), code)


# Past this magnitude fp32 rounds beyond E4M3's largest finite value, 448 (464, the tie
# between 448 and 480, rounds to the even 448).
_E4M3_ROUNDS_TO_448 = 464.0


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (uint8) of fp32 ``x`` by S2.4: rounded to nearest even, and a value
    past 464 or infinite stores the NaN code with its sign, as torch's conversion did up
    to 2.12; from 2.13 torch saturates them to ±448 instead."""
    codes = x.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(x.abs() > _E4M3_ROUNDS_TO_448, codes | 0x7F, codes)


def bf16_encode(x: torch.Tensor) -> torch.Tensor:
    """bf16 of fp32 ``x`` rounded to nearest even (S2.4), a NaN made quiet with its sign
    and top payload bits, as the core stores it: torch's CPU conversion stores every NaN
    as 0xFFFF, a NaN of the other sign for a positive one."""
    quiet = ((x.contiguous().view(torch.int32) | 0x00400000) >> 16).to(torch.int16)
    return torch.where(torch.isnan(x), quiet.view(torch.bfloat16), x.to(torch.bfloat16))


def bf16_encode_stochastic(x: torch.Tensor, random: torch.Tensor) -> torch.Tensor:
    """bf16 of fp32 ``x`` rounded stochastically with the high 16 of the ``random`` bits
    (S2.14): they are added to the fp32 bits, whose high half is kept; a NaN is made
    quiet, as rounding to nearest stores it."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    rounded = (bits + (random >> 16)) >> 16
    quiet = (bits >> 16) | 0x40
    high = torch.where(torch.isnan(x), quiet, rounded)
    return (high - ((high & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit ``codes`` (uint8, one each, an even count) two per byte: element 2i in the
    low nibble of byte i (S2.12)."""
    pairs = codes.reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(stored: torch.Tensor) -> torch.Tensor:
    """The codes of packed ``stored`` (uint8), one per element, its last dimension
    doubled."""
    codes = torch.stack((stored & 0xF, stored >> 4), dim=-1)
    return codes.reshape(*stored.shape[:-1], 2 * stored.shape[-1])


def _codes_of(name: str, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Codes of ``x = u / s`` (the true values ``u`` decide the zero-free rule)."""
    if name == "fp8-block":
        return e4m3_encode(x)
    if name == "ufp8-block":
        codes = ufp8_encode(x)
        # Zero-free on u: a division that underflowed to 0 still takes code 1.
        return torch.where((codes == 0) & (u != 0), 1, codes).to(torch.uint8)
    if name == "fp4-block":
        return fp4_encode(x)
    if name == "ufp4-block":
        return ufp4_encode(x, u)
    raise ValueError(f"no torch codec for per-block format {name!r}")


def _values_of(name: str, codes: torch.Tensor) -> torch.Tensor:
    if name == "fp8-block":
        return codes.view(torch.float8_e4m3fn).float()
    if name == "ufp8-block":
        return ufp8_decode(codes)
    if name == "fp4-block":
        return _FP4_VALUES.to(codes.device)[codes.long()]
    if name == "ufp4-block":
        return _UFP4_VALUES.to(codes.device)[codes.long()]
    raise ValueError(f"no torch codec for per-block format {name!r}")


def decode_blocks(name: str, stored: torch.Tensor, scales: torch.Tensor, first: int,
                  block: int) -> torch.Tensor:
    """fp32 true values of per-block format ``name``'s codes ``stored`` (uint8) with
    their ``scales``: each code's value times its block's scale (a power of two: exact
    unless it leaves fp32's range)."""
    flat = stored.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(stored.shape, dtype=torch.float32, device=stored.device)
    per_element = scales.to(stored.device)[
        _block_of_each(flat.numel(), first, block, stored.device)]
    return (_values_of(name, flat) * per_element).view(stored.shape)


# S2.9's overflow bounds: the smallest largest magnitude of a block whose code at its
# scale would decode past the largest fp32 (to 2^128), the midpoint between 2^128 and
# the largest code value below it, (2 - 2^-(m+1)) · 2^127 for m mantissa bits. Such a
# block takes scale 1, as a non-finite one does.
OVERFLOW_BOUNDS = {"fp8-block": 1.9375 * 2.0 ** 127, "ufp8-block": 1.96875 * 2.0 ** 127,
                   "fp4-block": 1.75 * 2.0 ** 127, "ufp4-block": 1.75 * 2.0 ** 127}


def block_scales(absmax: torch.Tensor, target: float, zero_bound: float,
                 overflow_bound: float) -> torch.Tensor:
    """S2.9's scale of each block from its fp32 largest magnitude ``absmax``: the
    smallest power of two s in [2^-126, 2^127] with absmax / s <= ``target``; 1 for a
    non-finite absmax, one <= ``zero_bound`` · 2^-126 (every code would be 0) and one
    >= ``overflow_bound`` (its code would decode past the largest fp32)."""
    a = absmax.double()
    # A first guess from frexp of a / target, then exact comparisons (target · 2^e is
    # exact in float64) settle it whichever way the division rounded.
    _, k = torch.frexp(a / target)
    e = k.double()
    e = torch.where(a > torch.ldexp(torch.full_like(a, target), e), e + 1, e)
    e = torch.where(a <= torch.ldexp(torch.full_like(a, target), e - 1), e - 1, e)
    scale = torch.ldexp(torch.ones_like(a), torch.clamp(e, -126, 127))
    one = ~torch.isfinite(a) | (a <= zero_bound * 2.0 ** -126) | (a >= overflow_bound)
    return torch.where(one, 1.0, scale).float()


def encode_blocks(name: str, value: torch.Tensor, first: int, block: int, target: float,
                  zero_bound: float, rounding: Optional[int] = None):
    """``(codes, scales)`` of fp32 ``value`` (any shape) in per-block format ``name``
    (S2.9 / S2.10): codes uint8 flat, scales fp32 one per block touched. ``rounding``:
    a step key (``exp_avg_step_key``, ``square_step_key``) to round ``fp4-block``,
    ``ufp4-block`` or ``ufp8-block`` codes stochastically (S2.13)."""
    flat = value.reshape(-1).float()
    n = flat.numel()
    count = block_count(first, n, block)
    if n == 0:
        return (torch.empty(0, dtype=torch.uint8, device=value.device),
                torch.empty(0, dtype=torch.float32, device=value.device))
    lead = first % block
    # Zeros around the range do not change a block's largest magnitude.
    padded = flat.new_zeros(count * block)
    padded[lead:lead + n] = flat
    absmax = torch.amax(padded.view(count, block).abs(), dim=1)  # NaN propagates
    scales = block_scales(absmax, target, zero_bound, OVERFLOW_BOUNDS[name])
    # A true division by a power of two, as the core's: exact but for fp32 subnormals.
    where = _block_of_each(n, first, block, value.device)
    x = flat / scales[where]
    if rounding is None:
        return _codes_of(name, x, flat), scales
    bits = random_bits(rounding, first, n, x.device)
    if name == "fp4-block":
        codes = fp4_encode_stochastic(x, bits)
    elif name == "ufp4-block":
        codes = ufp4_encode_stochastic(x, flat, bits)
    elif name == "ufp8-block":
        codes = ufp8_encode_stochastic(x, flat, bits)
    else:
        raise ValueError(f"no stochastic rounding for per-block format {name!r}")
    return _canonical(name, codes, scales, where, lead, count, block, target, zero_bound)


def _canonical(name, codes, scales, where, lead, count, block, target, zero_bound):
    """S2.13: stochastically rounded ``codes`` and their ``scales`` as encoding their
    decoded values again would store them: a block whose largest element rounded down
    out of the top binade takes half its scale and codes of twice the values
    (``fp4-block`` 3 becomes 6, ``ufp4-block`` 8 becomes 16, ``ufp8-block`` 240 becomes
    480); one whose codes are all 0 (an ``fp4-block`` at the smallest scale) takes
    scale 1."""
    magnitude = _values_of(name, codes).abs()  # NaN codes stay NaN
    padded = magnitude.new_zeros(count * block)
    padded[lead:lead + codes.numel()] = magnitude
    largest = torch.amax(padded.view(count, block), dim=1) * scales  # exact
    canonical = block_scales(largest, target, zero_bound, OVERFLOW_BOUNDS[name])
    halved = (canonical < scales)[where]
    if name == "ufp8-block":  # E = 0 doubles M (reaching E = 1 from 8), else E + 1
        doubled = torch.where(codes < 16, 2 * codes.long(), codes.long() + 16)
        return torch.where(halved, doubled.to(torch.uint8), codes), canonical
    mag = codes & (0xF if name == "ufp4-block" else 0x7)
    doubled = torch.where(mag == 0, 0, torch.where(mag == 1, 2, mag + 2)) | (codes - mag)
    return torch.where(halved, doubled.to(torch.uint8), codes), canonical
