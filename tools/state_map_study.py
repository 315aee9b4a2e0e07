"""Which code maps and block sizes should block-scaled 8-bit and 4-bit moments use?

A torch emulation of AdamW whose moments are stored block-quantized, run on the
rare-token workload (``shardadam.rare_tokens``) beside torch's AdamW with fp32 state,
plus a cheaper measure: each map's one-step update error on the fp32 moments of a real
run (``--snapshots``, then ``--analyse``).

Storage of one moment of one tensor: the tensor's flat elements split into blocks of
``B`` consecutive flat indices (the last block may be shorter); per block one fp32 scale
``s`` and one code per element. A step decodes the stored moments (``value(code) * s``),
computes the new moments and the weight in fp32 exactly as the C++ core's element
formula does (csrc/element.h: no fused multiply-adds, the weight updated from the new,
unrounded moments), then encodes each block of the new moments with a scale taken from
that block's largest magnitude ``a``. Two scale rules:

1. Largest-magnitude scales (the maps named plainly: ``e4m3``, ``int8``, ``dyn8``,
   ``e2m1``, ``int4``, ``sqrt8``, ``ue5m3``, ``lin8``, ``dyn8u``, ``sqrt4``, ``log4``,
   ``ue3m1``). ``s = max(a, s_min)``: every map's largest entry is 1 (E4M3 codes stand
   for E4M3 values / 448, linear int8 codes for k / 127), so the block's largest
   element decodes to itself exactly and re-encoding a decoded block finds the same
   scale (a scale ``a / R`` would not: ``(R * s) / R`` differs from ``s`` in the last
   bit for about 12% of fp32 values with R = 448). ``s_min``, a power of two per map,
   keeps every decoded non-zero value a normal fp32 number. ``x = u / s`` (an fp32
   division by the scale, never a multiplication by 1/s), then the entry nearest to
   ``|x|`` compared exactly (the fp32 value against the exact midpoint of two
   entries), a tie going to the even entry index; for signed maps the sign in the
   code's top bit (sign-magnitude), a magnitude of entry 0 always code 0. The
   companded maps (``sqrt8``, ``sqrt4``) round ``sqrt(x) * L`` to the nearest integer,
   ties to even, in fp32 arithmetic. Decode: ``value[code] * s``, ``value`` a table of
   fp32 numbers, each the one nearest to the map's exact real value.
2. Power-of-two scales as the C++ core's ``fp8-block`` has them (S2.9): ``e4m3s29`` is
   that format itself (torch's E4M3 rounding; values below half the block's smallest
   step become 0, for ``exp_avg_sq`` too); ``fe4m3``, ``fe2m1`` (signed) and ``ufe5m3``,
   ``ufe4m4``, ``ufe4m0``, ``ufe3m1`` (unsigned, zero-free) are small binary floats
   whose scale is the smallest power of two ``s`` with ``a / s <= T``, ``T`` the
   largest value plus half a step of its binade: division and decoding are exact, and
   the block's largest element lands in the top binade, so re-encoding is exact too.
   ``name@p2`` is a rule-1 map with the smallest power of two at least ``a`` instead
   (its re-encoding is not exact for every map: ``--check`` lists which).
   ``name@sr`` (any of these small binary floats, e.g. ``m=fe2m1@sr:128``) keeps the
   scale and rounds ``x`` stochastically between its two neighbouring entries,
   unbiased, from a counter-based hash of (seed, step, tensor, flat index): no torch
   RNG (``StochasticFloatP2``; FusedAdam's block4 values since 2026-12-05, S2.13);
   ``name@srt`` rounds as block4 did before: to nearest from ``T / 2`` up, so the
   block's largest element keeps its scale's binade, stochastically below.

Either rule: ``a`` not finite -> ``s`` = NaN, codes 0 (the whole block decodes to NaN:
most maps have no NaN code to keep one element's); unsigned maps keep code 0 for an
exact zero only (a non-zero ``u`` whose code would be 0 takes code 1), except
``e4m3s29``. Codes are held in int16 tensors here; the byte counts reported are those of
packed storage (8 or 4 bits per element plus 4 bytes per block).

Usage (results are appended to --out as JSON lines, one per run, so a long study can be
interrupted and resumed; --table prints what is there). One torch thread by default:
on a shared 2-core machine two threads spent most of their time waiting for each other.

    python tools/state_map_study.py --check
    python tools/state_map_study.py --workload proxy --runs refs,fused,8bit-m,8bit-v
    python tools/state_map_study.py --workload full --runs "m=fe4m3:256,v=ufe5m3:256"
    python tools/state_map_study.py --workload full --snapshots 1,10,50,150,300
    python tools/state_map_study.py --workload full --analyse 1,10,50,150,300
    python tools/state_map_study.py --table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from fractions import Fraction

import torch

from shardadam import rare_tokens
from shardadam._arguments import whole_number_at_least



# --- exact fp32 values ------------------------------------------------------------------

def fp32_nearest(value: Fraction) -> float:
    """The fp32 number nearest to an exact rational (ties to even), without the double
    rounding of going through float64 first."""
    guess = float(value)  # within one fp64 rounding of the true value
    below = torch.tensor(guess, dtype=torch.float32).item()
    candidates = {below}
    for direction in (math.inf, -math.inf):
        candidates.add(torch.nextafter(torch.tensor(below, dtype=torch.float32),
                                       torch.tensor(direction, dtype=torch.float32)).item())
    best = min(candidates, key=lambda c: (abs(Fraction(c) - value),
                                          _fp32_bits(c) & 1))
    return best


def _fp32_bits(f: float) -> int:
    return int(torch.tensor(f, dtype=torch.float32).view(torch.int32).item())


def smallest_scale(values):
    """The power of two ``s_min`` with ``t * s_min`` a normal fp32 number for every
    non-zero entry ``t``: with scales at least this, no stored non-zero code decodes to
    a subnormal or to 0, and decoding then re-encoding gives the same codes."""
    t_min = values[values > 0].min().item()
    return 2.0 ** (-126 - math.floor(math.log2(t_min)))


# --- maps --------------------------------------------------------------------------------

class TableMap:
    """Codes for the magnitudes ``exact_values / max(exact_values)`` (ascending, the first
    0, the last 1), each held as the nearest fp32 number; signed maps add a sign bit
    above the magnitude's index."""

    companded = False

    def __init__(self, name, bits, exact_values, signed, describe, normalize=True):
        self.name, self.bits, self.signed, self.describe = name, bits, signed, describe
        exact = [Fraction(v) for v in exact_values]
        values = [fp32_nearest(v / exact[-1] if normalize else v) for v in exact]
        assert values[0] == 0 and (values[-1] == 1 or not normalize), name
        assert all(a < b for a, b in zip(values, values[1:])), name
        assert len(values) <= 2 ** (bits - 1 if signed else bits), (name, len(values))
        self.values = torch.tensor(values, dtype=torch.float32)
        # Midpoints of neighbouring fp32 entries are exact in float64.
        self._mid = (self.values[:-1].double() + self.values[1:].double()) / 2
        self._build_buckets()
        table = self.values
        if signed:
            half = 1 << (bits - 1)
            table = torch.zeros(2 * half)
            table[:self.values.numel()] = self.values
            table[half:half + self.values.numel()] = -self.values
            table[half] = 0.0  # never stored (a zero magnitude is code 0)
        self._decode_table = table
        self.s_min = smallest_scale(self.values)

    _BUCKET_SHIFT = 13  # buckets of 2**10 per binade: fp32 bits >> 13

    def _build_buckets(self):
        """For the fp32 numbers in [0, 1] sharing their top bits (a bucket), the count of
        midpoints below the bucket: the nearest entry is that index or the next, decided
        by one exact comparison, as long as no bucket holds two midpoints (checked)."""
        shift = self._BUCKET_SHIFT
        # every fp32 number up to twice the largest entry
        top = _fp32_bits(2 * float(self.values[-1]))
        buckets = (top >> shift) + 1
        low = (torch.arange(buckets, dtype=torch.int32) << shift).view(torch.float32)
        high = ((torch.arange(buckets, dtype=torch.int32) << shift)
                + ((1 << shift) - 1)).view(torch.float32)
        below = torch.searchsorted(self._mid, low.double(), side="left")
        inside = torch.searchsorted(self._mid, high.double(), side="right") - below
        assert int(inside.max()) <= 1, f"{self.name}: buckets too coarse"
        self._bucket = below
        self._mid_ext = torch.cat([self._mid,
                                   torch.tensor([math.inf], dtype=torch.float64)])

    def encode(self, x, nonzero):
        """Codes of the fp32 tensor ``x`` (already divided by the scale, |x| at most
        twice the largest entry);
        ``nonzero``: where the value before division was not 0. The entry nearest to
        |x| (exact comparison with the midpoints), ties to the even index."""
        ax = x.abs()
        below = self._bucket[ax.view(torch.int32) >> self._BUCKET_SHIFT]
        mid = self._mid_ext[below]
        axd = ax.double()
        index = below + (axd > mid).long()
        index = index + ((axd == mid) & (below % 2 == 1)).long()
        if self.signed:  # sign-magnitude; a magnitude of 0 is always code 0 (+0)
            negative = torch.signbit(x) & (index > 0)
            return index + negative.long() * (1 << (self.bits - 1))
        return torch.where((index == 0) & nonzero, 1, index)  # no non-zero becomes 0

    def encode_reference(self, x, nonzero):
        """The same rule by binary search over all midpoints (for the self-check)."""
        ax = x.abs().double()
        index = torch.searchsorted(self._mid, ax, side="left")  # midpoints below |x|
        inner = index.clamp(max=self._mid.numel() - 1)
        tie = (ax == self._mid[inner]) & (index < self._mid.numel())
        index = torch.where(tie & (index % 2 == 1), index + 1, index)
        if self.signed:
            negative = torch.signbit(x) & (index > 0)
            return index + negative.long() * (1 << (self.bits - 1))
        return torch.where((index == 0) & nonzero, 1, index)

    def decode(self, codes):
        return self._decode_table[codes]


class CompandedMap:
    """Unsigned: code ``k`` holds ``(k / L) ** 2``; encode ``round(sqrt(x) * L)`` in fp32,
    ties to even, a non-zero value at least code 1."""

    companded = True
    signed = False

    def __init__(self, name, bits):
        self.name, self.bits = name, bits
        self.levels = 2 ** bits - 1
        self.describe = (f"sqrt-companded: code k holds (k/{self.levels})^2; "
                         f"round(sqrt(x)*{self.levels}), ties to even, non-zero >= 1")
        self.values = torch.tensor([fp32_nearest(Fraction(k * k, self.levels ** 2))
                                    for k in range(self.levels + 1)], dtype=torch.float32)
        self.s_min = smallest_scale(self.values)

    def encode(self, x, nonzero):
        codes = torch.round(torch.sqrt(x) * torch.tensor(float(self.levels))).long()
        return torch.where((codes == 0) & nonzero, 1, codes)

    def decode(self, codes):
        return self.values[codes]


def _float_magnitudes(exponent_bits, mantissa_bits, bias, reserve_top=0):
    """Non-negative values of a float format without sign (subnormals, no infinities);
    ``reserve_top`` codes at the top dropped (E4M3's NaN)."""
    values = []
    for e in range(2 ** exponent_bits):
        for m in range(2 ** mantissa_bits):
            if e == 0:
                values.append(Fraction(m, 2 ** mantissa_bits) * Fraction(2) ** (1 - bias))
            else:
                values.append((1 + Fraction(m, 2 ** mantissa_bits))
                              * Fraction(2) ** (e - bias))
    return values[:len(values) - reserve_top]


def _dynamic_magnitudes(total_bits, signed):
    """A dynamic (decimal-exponent) map, from its published description: after the sign
    bit, a run of e zero bits says the decade 10^-e, a one bit ends the run and the rest
    are a linear fraction over (0.1, 1] of that decade. Here each decade's 2^f values
    are the right ends of its f-bit linear steps, so the largest is 1 exactly; the last
    decade has a single value, 10^-(levels-1)."""
    bits = total_bits - 1 if signed else total_bits
    values = [Fraction(0)]
    for e in range(bits):
        fraction_bits = bits - 1 - e
        count = 2 ** fraction_bits
        decade = Fraction(1, 10 ** e)
        values += [decade * (Fraction(1, 10) + Fraction(9, 10) * Fraction(k, count))
                   for k in range(1, count + 1)]
    return sorted(values)


def build_maps():
    maps = {}
    for m in (
        TableMap("e4m3", 8, _float_magnitudes(4, 3, 7, reserve_top=1), True,
                 "E4M3 values / 448 (sign-magnitude, 0x7F unused)"),
        TableMap("int8", 8, range(128), True, "signed linear k/127"),
        TableMap("dyn8", 8, _dynamic_magnitudes(8, True), True,
                 "signed dynamic (decimal exponent + linear fraction), 1e-6 .. 1"),
        TableMap("e2m1", 4, _float_magnitudes(2, 1, 1), True,
                 "signed E2M1 (fp4) / 6: 0, 1/12, 1/6, 1/4, 1/3, 1/2, 2/3, 1"),
        TableMap("int4", 4, range(8), True, "signed linear k/7"),
        TableMap("dyn4", 4, _dynamic_magnitudes(4, True), True,
                 "signed dynamic, 4 bits: 0, 0.01, 0.055, 0.1, 0.325, 0.55, 0.775, 1"),
        CompandedMap("sqrt8", 8),
        TableMap("ue5m3", 8, _float_magnitudes(5, 3, 15), False,
                 "unsigned E5M3 (bias 15, subnormals, no inf/NaN) / 122880; 0 only for 0"),
        TableMap("lin8", 8, range(256), False, "unsigned linear k/255; 0 only for 0"),
        TableMap("dyn8u", 8, _dynamic_magnitudes(8, False), False,
                 "unsigned dynamic, 1e-7 .. 1; 0 only for 0"),
        CompandedMap("sqrt4", 4),
        TableMap("log4", 4, [0] + [Fraction(2) ** (k - 15) for k in range(1, 16)], False,
                 "unsigned log: 0, 2^-14 .. 2^0 (ratio 2); 0 only for 0"),
        TableMap("ue3m1", 4, _float_magnitudes(3, 1, 3), False,
                 "unsigned E3M1 (bias 3) / 24; 0 only for 0"),
        TableMap("ue3m1n", 4, _float_magnitudes(3, 1, 3, reserve_top=1), False,
                 "unsigned E3M1 (bias 3) / 16, code 15 kept for NaN; 0 only for 0"),
    ):
        maps[m.name] = m
    return maps


MAPS = build_maps()


# --- block quantization ---------------------------------------------------------------

def _blocks(flat, block):
    """``flat`` as rows of ``block`` elements, the last row padded with zeros (which
    change no block's largest magnitude)."""
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block)


def block_scales(rows, s_min):
    """One fp32 scale per row of ``_blocks``: the block's largest magnitude, raised to
    the map's ``s_min`` (so an all-zero block has scale ``s_min``); NaN for a block
    holding NaN or +-Inf. Every map's largest entry is 1, so the largest element
    decodes to itself exactly and re-encoding a decoded block finds the same scale."""
    absmax = rows.abs().amax(dim=1)
    scale = torch.clamp(absmax, min=s_min)
    return torch.where(torch.isfinite(absmax), scale, math.nan)


def power_of_two_scales(rows, s_min):
    """The smallest power of two at least the block's largest magnitude (so the largest
    element encodes to (1/2, 1]), at least ``s_min``; NaN for a non-finite block."""
    absmax = torch.clamp(rows.abs().amax(dim=1), min=s_min)
    mantissa, exponent = torch.frexp(absmax)  # absmax = mantissa * 2**exponent, [0.5, 1)
    scale = torch.ldexp(torch.ones_like(absmax),
                        torch.where(mantissa == 0.5, exponent - 1, exponent))
    return torch.where(torch.isfinite(absmax), scale, math.nan)


def quantize(u, qmap, block, key=None):
    """(codes, scales) of the fp32 tensor ``u``. ``key``: the stochastic maps' (``@sr``)
    per-tensor, per-step counter key (``sr_key``); the other maps ignore it."""
    n = u.numel()
    rows = _blocks(u.reshape(-1), block)
    if isinstance(qmap, StochasticFloatP2):
        return qmap.quantize(rows, n, key)
    if not isinstance(qmap, (TableMap, CompandedMap)):
        return qmap.quantize(rows, n)
    scales = block_scales(rows, qmap.s_min)
    finite = torch.isfinite(scales)[:, None]
    x = torch.where(finite, rows / torch.where(finite, scales[:, None], 1.0), 0.0)
    codes = torch.where(finite, qmap.encode(x, rows != 0), 0)
    return codes.reshape(-1)[:n].to(torch.int16), scales


class PowerOfTwoScaled:
    """A map of ``MAPS`` with power-of-two block scales (``power_of_two_scales``) instead
    of the block's largest magnitude: exact division and decoding, at the cost of the
    block's largest element landing anywhere in (1/2, 1] of the map's range."""

    def __init__(self, base):
        self.base = base
        self.name, self.bits, self.signed = base.name + "@p2", base.bits, base.signed
        self.values, self.s_min = base.values, base.s_min

    def quantize(self, rows, n):
        scales = power_of_two_scales(rows, self.s_min)
        finite = torch.isfinite(scales)[:, None]
        x = torch.where(finite, rows / torch.where(finite, scales[:, None], 1.0), 0.0)
        codes = torch.where(finite, self.base.encode(x, rows != 0), 0)
        return codes.reshape(-1)[:n].to(torch.int16), scales

    def decode(self, codes):
        return self.base.decode(codes)


class CoreFp8Block:
    """The C++ core's ``fp8-block`` moments as S2.9 states them: E4M3 codes (torch's
    float8_e4m3fn rounding), per block the smallest power of two ``s`` in
    [2^-126, 2^127] with ``a / s <= 464``; ``s = 1`` when ``a`` is not finite or
    ``a <= 2^-136``. Values below half the smallest E4M3 step of their block become 0
    (for ``exp_avg_sq`` too: this format has no zero-free rule)."""

    name, bits, signed = "e4m3s29", 8, True
    values = MAPS["e4m3"].values * 448

    def quantize(self, rows, n):
        absmax = rows.abs().amax(dim=1)
        # smallest power of two s with absmax / s <= 464 = 29 * 2**4
        mantissa, exponent = torch.frexp(absmax / 464)
        e = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(-126, 127)
        scales = torch.ldexp(torch.ones_like(absmax), e)
        special = ~torch.isfinite(absmax) | (absmax <= 2.0 ** -136)
        scales = torch.where(special, 1.0, scales)
        q = (rows / scales[:, None]).to(torch.float8_e4m3fn)
        return q.view(torch.uint8).reshape(-1)[:n].to(torch.int16), scales

    def decode(self, codes):
        return codes.to(torch.uint8).view(torch.float8_e4m3fn).float()


def dequantize(codes, scales, qmap, block, shape):
    n = codes.numel()
    rows = _blocks(qmap.decode(codes.long()), block)
    return (rows * scales[:, None]).reshape(-1)[:n].view(shape)


class FloatP2:
    """A small float format (``e`` exponent bits, ``m`` mantissa bits, subnormals, no
    infinities; optional sign bit) with S2.9's kind of block scale: the smallest power
    of two ``s`` in [2^-126, 2^127] with ``a / s <= T``, ``T`` the largest value plus
    half the step of its binade (where rounding would leave the format). The block's
    largest element then encodes into the top binade, so decoding (exact: a power of
    two) and encoding again gives the same scale and codes. Unsigned formats are
    zero-free: a non-zero value that rounds to 0 takes the smallest code."""

    def __init__(self, name, e, m, bias, signed, reserve_top=0):
        self.name, self.bits, self.signed = name, e + m + (1 if signed else 0), signed
        grid = _float_magnitudes(e, m, bias, reserve_top)
        self.table = TableMap(name + "-grid", self.bits, grid, signed, "",
                              normalize=False)
        self.values = self.table.values
        largest = grid[-1]
        top_binade = Fraction(2) ** math.floor(math.log2(largest))
        # T / 2 is then exactly the midpoint below the top binade's first value, so
        # any a / s in (T / 2, T] rounds into the top binade. Exact in fp32 here.
        self.target = float(largest + top_binade / 2 ** (m + 1))
        self.describe = (f"{'signed' if signed else 'unsigned zero-free'} E{e}M{m} "
                         f"(bias {bias}), power-of-two scale, a/s <= {self.target:g}")

    def quantize(self, rows, n):
        scales, x = self.scaled(rows)
        finite = torch.isfinite(scales)[:, None]
        codes = torch.where(finite, self.table.encode(x, rows != 0), 0)
        return codes.reshape(-1)[:n].to(torch.int16), scales

    def scaled(self, rows):
        """(scales, x): the blocks' scales and ``x = u / s`` (0 in a non-finite block)."""
        absmax = rows.abs().amax(dim=1)
        mantissa, exponent = torch.frexp(absmax / self.target)  # exact: both fp32,
        # and only the binade of the quotient matters unless it is a power of two
        e = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp(-126, 127)
        scales = torch.ldexp(torch.ones_like(absmax), e)
        # the division's rounding could put a just above T on a power of two: check
        too_big = rows.abs().amax(dim=1) / scales > self.target
        scales = torch.where(too_big, scales * 2, scales)
        scales = torch.where(torch.isfinite(absmax), scales, math.nan)
        finite = torch.isfinite(scales)[:, None]
        x = torch.where(finite, rows / torch.where(finite, scales[:, None], 1.0), 0.0)
        return scales, x

    def decode(self, codes):
        return self.table.decode(codes)


# --- stochastic rounding -----------------------------------------------------------------

_M32 = 0xFFFFFFFF


def mix32(x: int) -> int:
    """lowbias32 (Chris Wellons' 32-bit integer hash: xorshift-multiply, two rounds), on a
    Python int in [0, 2^32)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return x


def _mul32(x, c):
    """``x * c mod 2^32`` for an int64 tensor ``x`` in [0, 2^32) and a 32-bit constant,
    with no int64 product past 2^49 (no reliance on wrap-around)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32_tensor(x):
    """``mix32`` elementwise on an int64 tensor of values in [0, 2^32)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


SR_SALT = 0x5352A5E1  # keeps seed 0 off mix32's fixed point 0


def sr_key(seed: int, step: int, tensor_id: int) -> int:
    """The 32-bit key of one tensor's one step: ``mix32(mix32(mix32(seed ^ SALT) ^
    tensor_id) ^ step)``, every argument taken mod 2^32."""
    return mix32(mix32(mix32((seed ^ SR_SALT) & _M32) ^ (tensor_id & _M32))
                 ^ (step & _M32))


def sr_uniform24(key: int, index):
    """The 24-bit uniform integers (in [0, 2^24)) of the flat element indices ``index``
    (an int64 tensor, each < 2^32) under ``key``: ``mix32(mix32(index) ^ key) >> 8``.
    Hashing the index before mixing in the key keeps two keys from handing out the same
    numbers to shifted indices (as ``mix32(index ^ key)`` would: ``i ^ k == j ^ k'``)."""
    assert int(index.max()) <= _M32 if index.numel() else True
    return mix32_tensor(mix32_tensor(index) ^ key) >> 8


class StochasticFloatP2:
    """A ``FloatP2`` map (``name@sr``) whose codes are rounded stochastically: the same
    scale (so the block's largest magnitude still fits: ``a / s <= T``), then for
    ``x = u / s`` the two neighbouring table magnitudes ``lo <= |x| < hi`` (``lo`` the
    largest table entry at most ``|x|``), ``hi`` taken iff ``r < (|x| - lo) / (hi -
    lo)``, ``r = sr_uniform24(key, flat index) / 2^24``. Within a float grid ``hi - lo``
    is a power of two and ``|x| - lo`` is exact (Sterbenz), so ``p`` is an exact fp32
    number; for ``lo > 0`` it has at most 23 fractional bits and the comparison of two
    exact fp32 numbers takes ``hi`` with probability exactly ``p``: unbiased (for
    ``lo = 0`` with probability ``ceil(p * 2^24) / 2^24``). ``|x|`` on a table entry (p = 0, exact
    midpoints included: p = 1/2) stays / is rounded with its probability, never a tie
    rule; ``|x|`` above the top entry (up to ``T``) takes the top entry (never rounded
    past it); a magnitude 0 is code 0 (no -0); unsigned maps stay zero-free (a non-zero
    ``u`` whose magnitude rounds to 0 takes code 1, as the nearest rounding does: a
    bias upwards for values below the smallest entry's neighbourhood only). Values on
    the grid encode to themselves, so decoding and encoding again gives the same values
    (codes and scale too, except where the rounding took the block's largest element
    below ``T / 2``: then the smaller scale holds the same values)."""

    def __init__(self, base: FloatP2, nearest_top=False):
        self.base = base
        # ``@srt``: as FusedAdam's block4 rounded before 2026-12-05: |x| from T / 2 up
        # (what rounds to nearest into the top binade) to nearest, so a block's largest
        # element kept its scale's binade. ``@sr`` is its rule since (S2.13's canonical
        # blocks store a block at half its scale, with the same values).
        self.nearest_from = base.target / 2 if nearest_top else math.inf
        suffix = "@srt" if nearest_top else "@sr"
        self.name, self.bits, self.signed = base.name + suffix, base.bits, base.signed
        self.values = base.values
        self.describe = base.describe + ", stochastic rounding" + (
            " below T / 2" if nearest_top else "")

    def encode(self, x, nonzero, key, index):
        values = self.values
        ax = x.abs()
        lo_index = torch.searchsorted(values, ax, right=True) - 1  # values[0] = 0 <= ax
        top = values.numel() - 1
        lo_index = lo_index.clamp(0, top)
        hi_index = (lo_index + 1).clamp(max=top)
        lo, hi = values[lo_index], values[hi_index]
        step = torch.where(hi_index > lo_index, hi - lo, 1.0)
        p = torch.where(hi_index > lo_index, (ax - lo) / step, 0.0)  # exact, in [0, 1)
        r = sr_uniform24(key, index).to(torch.float32) * 2.0 ** -24  # exact
        index_code = torch.where(r < p, hi_index, lo_index)
        index_code = torch.where(ax >= self.nearest_from,
                                 self.base.table.encode(ax, nonzero), index_code)
        if self.signed:
            negative = torch.signbit(x) & (index_code > 0)
            return index_code + negative.long() * (1 << (self.bits - 1))
        return torch.where((index_code == 0) & nonzero, 1, index_code)

    def quantize(self, rows, n, key=None):
        if key is None:
            key = sr_key(0, 0, 0)
        scales, x = self.base.scaled(rows)
        finite = torch.isfinite(scales)[:, None]
        index = torch.arange(rows.numel(), dtype=torch.int64).view(rows.shape)
        codes = torch.where(finite, self.encode(x, rows != 0, key, index), 0)
        return codes.reshape(-1)[:n].to(torch.int16), scales

    def decode(self, codes):
        return self.base.decode(codes)


MAPS["e4m3s29"] = CoreFp8Block()
for _map in (FloatP2("fe4m3", 4, 3, 7, True, reserve_top=1),
             FloatP2("fe2m1", 2, 1, 1, True),
             FloatP2("fe3m0", 3, 0, 1, True),
             FloatP2("ufe5m3", 5, 3, 15, False),
             FloatP2("ufe4m4", 4, 4, 7, False),
             FloatP2("ufe4m0", 4, 0, 15, False),
             FloatP2("ufe3m1", 3, 1, 3, False),
             FloatP2("ufe3m1n", 3, 1, 3, False, reserve_top=1)):
    MAPS[_map.name] = _map
    MAPS[_map.name + "@sr"] = StochasticFloatP2(_map)
    MAPS[_map.name + "@srt"] = StochasticFloatP2(_map, nearest_top=True)
for _name in list(MAPS):
    if isinstance(MAPS[_name], (TableMap, CompandedMap)):
        MAPS[_name + "@p2"] = PowerOfTwoScaled(MAPS[_name])


# --- the emulated optimizer -------------------------------------------------------------

class BlockAdamW(torch.optim.Optimizer):
    """AdamW (fp32 parameters) with each moment stored in a block format, or in fp32
    when its spec is None. ``spec`` = (map name, block size)."""

    def __init__(self, params, lr, betas, eps, weight_decay, exp_avg=None, exp_avg_sq=None,
                 sr_seed=0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.specs = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        self.step_count = 0
        # Stochastic maps (``@sr``): key (sr_seed, step, tensor id), the tensor id
        # 2 * (the parameter's position in the param groups) + (0 exp_avg, 1 exp_avg_sq).
        self.sr_seed = sr_seed
        self._position = {}
        for group in self.param_groups:
            for p in group["params"]:
                self._position[p] = len(self._position)
                for name in self.specs:
                    self._store(p, name, torch.zeros_like(p, dtype=torch.float32))

    def _store(self, p, name, value):
        spec = self.specs[name]
        if spec is None:
            self.state[p][name] = value
        else:
            key = None
            if isinstance(MAPS[spec[0]], StochasticFloatP2):
                key = sr_key(self.sr_seed, self.step_count,
                             2 * self._position[p] + (name == "exp_avg_sq"))
            codes, scales = quantize(value, MAPS[spec[0]], spec[1], key)
            self.state[p][name + ".codes"] = codes
            self.state[p][name + ".scales"] = scales

    def _load(self, p, name):
        spec = self.specs[name]
        if spec is None:
            return self.state[p][name]
        return dequantize(self.state[p][name + ".codes"], self.state[p][name + ".scales"],
                          MAPS[spec[0]], spec[1], p.shape)

    def packed_bytes(self):
        total = 0
        for group in self.param_groups:
            for p in group["params"]:
                for name, spec in self.specs.items():
                    if spec is None:
                        total += 4 * p.numel()
                    else:
                        qmap, block = MAPS[spec[0]], spec[1]
                        total += math.ceil(p.numel() * qmap.bits / 8)
                        total += 4 * math.ceil(p.numel() / block)
        return total

    @torch.no_grad()
    def step(self):
        self.step_count += 1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            t = self.step_count
            c1 = 1.0 - beta1 ** t
            c2 = 1.0 - beta2 ** t
            f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
            # The core's per-step constants (element.h), each rounded once to fp32.
            k_b1, k_1b1 = f32(beta1), f32(1.0 - beta1)
            k_b2, k_1b2 = f32(beta2), f32(1.0 - beta2)
            k_decay = f32(1.0 - group["lr"] * group["weight_decay"])
            k_step = f32(group["lr"] / c1)
            k_c2sqrt = f32(math.sqrt(c2))
            k_eps = f32(group["eps"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                m = self._load(p, "exp_avg")
                v = self._load(p, "exp_avg_sq")
                m = k_b1 * m + k_1b1 * g
                v = k_b2 * v + (k_1b2 * g) * g
                w = p.float() * k_decay
                denom = torch.sqrt(v) / k_c2sqrt + k_eps
                w = w - (k_step * m) / denom
                p.copy_(w)
                self._store(p, "exp_avg", m)
                self._store(p, "exp_avg_sq", v)


# --- self-checks -------------------------------------------------------------------------

def check():
    """Exactness a kernel will be held to: the E4M3 table's rounding is E4M3's own
    (torch's float8_e4m3fn) where the two coincide, and encoding a decoded block
    reproduces its codes and scale, for every code of every map, at scales from
    subnormal to large, and for random blocks."""
    e4m3 = MAPS["e4m3"]
    # On the unnormalised grid (x * 448) our nearest-entry rule must be E4M3's RNE.
    grid = torch.tensor([float(v) for v in _float_magnitudes(4, 3, 7, reserve_top=1)])
    mids = (grid[:-1] + grid[1:]) / 2
    x = torch.cat([torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 448,
                   grid, mids, torch.nextafter(mids, grid[1:]),
                   torch.nextafter(mids, grid[:-1])])
    x = torch.cat([x, -x])
    ours = e4m3.decode(e4m3.encode(x / 448, x != 0)) * 448
    theirs = x.to(torch.float8_e4m3fn).float()
    mismatch = (ours != theirs).sum().item()
    # Entries are fp32 roundings of E4M3 / 448, so a value within an ulp or so of an
    # exact E4M3 midpoint may round the other way; count, don't require.
    print(f"E4M3 table vs torch float8_e4m3fn over {x.numel()} values "
          f"(midpoints and their neighbours included): {mismatch} differ")
    generator = torch.Generator().manual_seed(1)
    for qmap in MAPS.values():
        if isinstance(qmap, TableMap):
            # Every midpoint, its fp32 neighbours, and random values of every binade.
            mids = qmap._mid.float()
            x = torch.cat([mids, torch.nextafter(mids, torch.tensor(0.0)),
                           torch.nextafter(mids, torch.tensor(2.0)), qmap.values,
                           torch.rand(100_000, generator=generator)
                           * torch.exp2(-torch.randint(0, 150, (100_000,),
                                                       generator=generator).float())])
            x = torch.cat([x, -x]) if qmap.signed else x
            assert torch.equal(qmap.encode(x, x != 0), qmap.encode_reference(x, x != 0)), \
                qmap.name
        codes = torch.arange(2 ** qmap.bits)
        magnitudes = codes % (1 << (qmap.bits - 1)) if qmap.signed else codes
        codes = codes[magnitudes < qmap.values.numel()]  # E4M3's NaN code unused
        if qmap.signed:
            codes = codes[codes != 1 << (qmap.bits - 1)]  # -0 is never stored
        power_of_two = isinstance(qmap, (PowerOfTwoScaled, CoreFp8Block, FloatP2,
                                         StochasticFloatP2))
        scale_choices = ((1.0, 2.0 ** -100, 2.0 ** 70) if power_of_two
                         else (1.0, qmap.s_min, 2.0 ** -100, 3.0e-30, 0.37, 7.5e20))
        for block in (64, 128, 256):
            top = codes[qmap.decode(codes) == qmap.decode(codes).max()][:1]
            for scale in scale_choices:
                if scale < getattr(qmap, "s_min", 0):
                    continue
                # Each block starts with the top code (so its scale is ``scale``),
                # then a share of all codes; the last block is shorter.
                body = codes[torch.randperm(codes.numel(), generator=generator)]
                n = block - 1
                stored = torch.cat([torch.cat([top, body[i:i + n]])
                                    for i in range(0, body.numel(), n)])
                if stored.numel() % block == 0:
                    stored = torch.cat([stored, top, body[:5]])
                s = torch.full((math.ceil(stored.numel() / block),), scale)
                values = dequantize(stored, s, qmap, block, stored.shape)
                again, s2 = quantize(values, qmap, block)
                ok = torch.equal(again.long(), stored) and torch.equal(s2, s)
                if not ok:
                    bad = (again.long() != stored).sum().item()
                    print(f"  {qmap.name} block {block} scale {scale:g}: {bad} codes "
                          f"change on re-encoding"
                          + ("" if torch.equal(s2, s) else ", scales change"))
        for block in (64, 128, 256):
            u = torch.randn(10 * block + 37, generator=generator) * torch.exp(
                torch.randn(10 * block + 37, generator=generator) * 8)
            if not qmap.signed:
                u = u.abs()
            c, s = quantize(u, qmap, block)
            c2, s2 = quantize(dequantize(c, s, qmap, block, u.shape), qmap, block)
            if isinstance(qmap, StochasticFloatP2):
                # the block's largest element may have been rounded below T / 2: the
                # scale may halve, the values may not change
                if not torch.equal(dequantize(c, s, qmap, block, u.shape),
                                   dequantize(c2, s2, qmap, block, u.shape)):
                    print(f"  {qmap.name} block {block}, random block: decoded values "
                          f"change on re-encoding")
            elif not (torch.equal(c, c2) and torch.equal(s, s2)):
                print(f"  {qmap.name} block {block}, random block: "
                      f"{(c != c2).sum().item()} codes and "
                      f"{(s != s2).sum().item()} scales change on re-encoding")
            if not qmap.signed and ((c == 0) & (u != 0)).any():
                print(f"  {qmap.name}: a non-zero value encodes to 0")
            if isinstance(qmap, CoreFp8Block) or (isinstance(qmap, FloatP2)
                                                  and qmap.signed):
                flushed = ((c == 0) & (u != 0)).sum().item()
                print(f"  {qmap.name} block {block}: {flushed} of {u.numel()} non-zero "
                      f"values of a wide random block encode to 0 (no zero-free rule)")
    print(f"re-encoding checked for {len(MAPS)} maps (lines above list any failures)")
    sr_check()


def sr_check(draws=2000):
    """Stochastic rounding (``@sr`` maps): the torch hash equals the integer one; the
    same counters give the same codes, other steps other codes; and unbiasedness: for
    random blocks (each with a fixed largest element, so the scale stays fixed) the
    mean over ``draws`` steps of each decoded element is within 6 standard errors of
    the input, the standard error from the exact variance ``p (1 - p) (hi - lo)^2 s^2``
    of one rounding (elements on the grid: exactly the input), the z-scores' mean
    within 6 / sqrt(count) of 0, and no decoded element is ever further than one grid
    step from its input. Elements outside the unbiased range (above the top entry;
    for unsigned maps below the smallest entry, zero-free) are left out."""
    generator = torch.Generator().manual_seed(7)
    index = torch.randint(0, 2 ** 32, (10_000,), generator=generator)
    expected = torch.tensor([mix32(mix32(int(i)) ^ 0x12345678) >> 8 for i in index])
    assert torch.equal(sr_uniform24(0x12345678, index), expected), "torch hash != int hash"
    assert len({sr_key(s, t, i) for s in range(3) for t in range(50) for i in range(20)}) \
        == 3 * 50 * 20, "key collision"
    for qmap in MAPS.values():
        if not isinstance(qmap, StochasticFloatP2):
            continue
        block, blocks = 128, 8
        top = float(qmap.values[-1])
        u = torch.randn(blocks * block, generator=generator) * torch.exp(
            torch.randn(blocks * block, generator=generator))
        if not qmap.signed:
            u = u.abs()
        rows = u.view(blocks, block)
        rows[:, 0] = rows.abs().amax(dim=1) * 1.01  # the block's largest, positive
        c0, s0 = quantize(u, qmap, block, sr_key(1, 1, 0))
        c1, s1 = quantize(u, qmap, block, sr_key(1, 1, 0))
        c2, _ = quantize(u, qmap, block, sr_key(1, 2, 0))
        assert torch.equal(c0, c1) and torch.equal(s0, s1), qmap.name
        assert not torch.equal(c0, c2), qmap.name
        # With largest elements themselves on the grid's top entry, scales don't move.
        rows[:, 0] = s0 * top
        x = (rows / s0[:, None]).reshape(-1)
        ax = x.abs()
        lo_i = (torch.searchsorted(qmap.values, ax, right=True) - 1).clamp(
            max=qmap.values.numel() - 2)
        lo, hi = qmap.values[lo_i].double(), qmap.values[lo_i + 1].double()
        scale = s0.repeat_interleave(block).double()
        p = (ax.double() - lo) / (hi - lo)
        # Only what is rounded stochastically: @srt maps round |x| >= T / 2 to nearest.
        keep = (ax <= top) & (ax < qmap.nearest_from)
        if not qmap.signed:
            keep &= ax >= qmap.values[1]
        total = torch.zeros(u.numel(), dtype=torch.float64)
        for step in range(draws):
            c, s = quantize(u, qmap, block, sr_key(1, step, 3))
            assert torch.equal(s, s0), qmap.name
            d = dequantize(c, s, qmap, block, u.shape).double()
            assert ((d - u.double()).abs() <= (hi - lo) * scale)[keep].all(), qmap.name
            total += d
        mean = total / draws
        sd = (p * (1 - p)).sqrt() * (hi - lo) * scale / math.sqrt(draws)
        err = (mean - u.double())[keep]
        exact = sd[keep] == 0
        assert torch.equal(err[exact], torch.zeros_like(err[exact])), qmap.name
        z = err[~exact] / sd[keep][~exact]
        print(f"  {qmap.name}: {int(keep.sum())} elements, {draws} draws: "
              f"largest |z| {z.abs().max().item():.2f}, mean z {z.mean().item():+.3f} "
              f"(bound 6 and {6 / math.sqrt(z.numel()):.3f})")
        assert z.abs().max() < 6 and abs(z.mean().item()) < 6 / math.sqrt(z.numel()), \
            qmap.name
    print("stochastic rounding: deterministic per counter, unbiased within the bounds")


# --- runs --------------------------------------------------------------------------------

WORKLOADS = {
    "full": rare_tokens.FULL,
    # A quarter of the vocabulary and of the batch, same width (so blocks sit on the
    # embedding's rows as at full size), 300 steps: about 1/16 of the full compute. Each
    # token's expected count in the run is about the full workload's (tail ~3 vs ~2).
    "proxy": replace(rare_tokens.FULL, vocab=4096, batch=1024),
    # Half that again (1/64 of the full compute), for screening every candidate.
    "small": replace(rare_tokens.FULL, vocab=2048, batch=512),
}

SPEC_GROUPS = {
    "refs": ["ref"],
    "fused": ["fused:bf16/bf16", "fused:fp8/fp8", "fused:fp8/bf16"],
    "8bit-m": [f"m={m}:{b}" for m in ("e4m3", "int8", "dyn8") for b in (256, 128)],
    "8bit-v": [f"v={v}:{b}" for v in ("sqrt8", "ue5m3", "lin8", "dyn8u")
               for b in (256, 128)],
    "4bit-m": [f"m={m}:{b}" for m in ("e2m1", "int4") for b in (128, 64)],
    "4bit-v": [f"v={v}:{b}" for v in ("sqrt4", "log4", "ue3m1") for b in (128, 64)],
}


def parse_spec(text):
    """``ref`` (torch AdamW fp32) or ``m=MAP:B,v=MAP:B`` (either part may be absent:
    that moment stays fp32)."""
    if text == "ref":
        return None
    spec = {"exp_avg": None, "exp_avg_sq": None}
    for part in text.split(","):
        key, _, value = part.partition("=")
        name, _, block = value.partition(":")
        if key not in ("m", "v") or name not in MAPS or not block.isdigit():
            raise SystemExit(f"bad spec {text!r}")
        if (key == "m") != MAPS[name].signed and name != "e4m3s29":
            raise SystemExit(f"{name} is a {'signed' if MAPS[name].signed else 'unsigned'} "
                             f"map: not for {'exp_avg' if key == 'm' else 'exp_avg_sq'}")
        spec["exp_avg" if key == "m" else "exp_avg_sq"] = (name, int(block))
    return spec


# FusedAdam's existing formats beside the emulated ones: "fused:M/V" with M, V in
# fp32 / bf16 / fp8 (per-tensor E4M3).
_FUSED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.uint8}


def torchao_factory(name):
    """``make_optimizer`` for torchao's low-bit AdamW ``name`` (AdamW8bit, AdamW4bit,
    AdamWFp8: block-scaled moments, fp32 for tensors too small to quantize)."""
    import torchao.optim

    def make(params, **hyper):
        return getattr(torchao.optim, name)(params, **hyper)
    return make


def torchao_state_bytes(opt) -> float:
    """Bytes of torchao's optimizer state: its quantized subclasses count their codes
    and scales (``__tensor_flatten__``), plain tensors themselves."""
    total = 0
    for state in opt.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if hasattr(value, "__tensor_flatten__"):
                names, _ = value.__tensor_flatten__()
                total += sum(getattr(value, n).numel() * getattr(value, n).element_size()
                             for n in names)
            else:
                total += value.numel() * value.element_size()
    return total


def run_one(text, workload, progress_every):
    if text.startswith("torchao:"):
        return rare_tokens.train(torchao_factory(text[len("torchao:"):]), workload,
                                 label=text, state_bytes_of=torchao_state_bytes)
    if text.startswith("fused:"):
        m, _, v = text[len("fused:"):].partition("/")
        make = rare_tokens.fused_adam_factory(exp_avg_dtype=_FUSED_DTYPES[m],
                                              exp_avg_sq_dtype=_FUSED_DTYPES[v])
        return rare_tokens.train(make, workload, label=text)
    spec = parse_spec(text)

    def progress(step, loss):
        if progress_every and (step % progress_every == 0 or not loss <= 100):
            print(f"    {text} step {step} loss {loss:.4f}", flush=True)

    if spec is None:
        result = rare_tokens.train(rare_tokens.adamw_factory, workload, label=text,
                                   progress=progress)
    else:
        def make(params, **hyper):
            return BlockAdamW(params, **hyper, **spec)
        result = rare_tokens.train(make, workload, label=text, progress=progress,
                                   state_bytes_of=lambda opt: opt.packed_bytes())
    return result


# --- one-step error of each map on real moments ---------------------------------------

def snapshot_path(folder, workload_name, step):
    return os.path.join(folder, f"moments-{workload_name}-step{step}.pt")


def run_with_snapshots(workload, workload_name, steps, folder):
    """torch AdamW fp32 on the workload, saving its moments (and the bias corrections
    of the step) after each step in ``steps``."""
    holder = {}

    def make(params, **hyper):
        holder["opt"] = rare_tokens.adamw_factory(params, **hyper)
        holder["params"] = params
        return holder["opt"]

    def progress(step, loss):
        if step in steps:
            opt = holder["opt"]
            beta1, beta2 = workload.betas
            saved = {"step": step, "c1": 1 - beta1 ** step, "c2": 1 - beta2 ** step,
                     "eps": workload.eps, "lr": workload.lr, "tensors": {}}
            for name, p in zip(("embed", "head"), holder["params"]):
                saved["tensors"][name] = {"exp_avg": opt.state[p]["exp_avg"].clone(),
                                          "exp_avg_sq": opt.state[p]["exp_avg_sq"].clone()}
            torch.save(saved, snapshot_path(folder, workload_name, step))
            print(f"    saved the moments of step {step}", flush=True)

    return rare_tokens.train(make, workload, label="ref", progress=progress)


def update_ratios(m, v, c1, c2, eps, m_spec=None, v_spec=None):
    """Each element's Adam update computed from the stored (quantized) moments divided
    by the update from the exact ones; elements whose exact update is 0 are left out."""
    mq = m if m_spec is None else dequantize(*quantize(m, MAPS[m_spec[0]], m_spec[1]),
                                              MAPS[m_spec[0]], m_spec[1], m.shape)
    vq = v if v_spec is None else dequantize(*quantize(v, MAPS[v_spec[0]], v_spec[1]),
                                              MAPS[v_spec[0]], v_spec[1], v.shape)
    exact = (m.double() / c1) / ((v.double() / c2).sqrt() + eps)
    stored = (mq.double() / c1) / ((vq.double() / c2).sqrt() + eps)
    keep = exact != 0
    return stored[keep] / exact[keep], exact[keep]


def per_tensor_fp8(u):
    """FusedAdam's per-tensor fp8 (S2.3) of ``u``, decoded."""
    a = u.abs().max()
    s = torch.clamp(a / 448.0, min=torch.finfo(torch.float32).tiny) if a > 0 else 1.0
    return (u / s).to(torch.float8_e4m3fn).float() * s


def analyse(folder, workload_name, steps, only=None):
    """For every map and block size, on the saved moments of each step: how far one
    step's update moves from the exact one when only that moment is stored in the map.
    Reported, the worst over tensors and steps: the fraction of elements whose update
    grows more than 2x (the dangerous way: a moment rounded down, ``exp_avg_sq`` most of
    all), the fraction shrunk below half (an update lost or slowed: ``exp_avg`` rounded
    to 0, ``exp_avg_sq`` rounded up), the largest growth factor, and the relative L2
    error of the whole update.
    """
    snaps = [torch.load(snapshot_path(folder, workload_name, k)) for k in steps]
    rows = []
    candidates = ([("m", name, b) for name in ("e4m3", "int8", "dyn8") for b in (256, 128)]
                  + [("v", name, b) for name in ("sqrt8", "ue5m3", "lin8", "dyn8u")
                     for b in (256, 128)]
                  + [("m", name, b) for name in ("e2m1", "int4") for b in (128, 64)]
                  + [("v", name, b) for name in ("sqrt4", "log4", "ue3m1")
                     for b in (128, 64)]
                  + [("m", "e4m3s29", 256), ("v", "e4m3s29", 256),
                     ("m", "e4m3s29", 128), ("v", "e4m3s29", 128),
                     ("v", "ufe5m3", 256), ("v", "ufe5m3", 128),
                     ("v", "ufe4m4", 256), ("v", "ufe4m4", 128),
                     ("m", "fe2m1", 128), ("m", "fe2m1", 64),
                     ("v", "ufe4m0", 128), ("v", "ufe4m0", 64),
                     ("v", "ufe3m1", 128), ("v", "ufe3m1", 64)]
                  + [("m", "fp8-tensor", 0), ("v", "fp8-tensor", 0)])
    if only:
        candidates = [c for c in candidates if c[1] in only]
    for moment, name, block in candidates:
        worst = {"grow2": 0.0, "shrink2": 0.0, "up": 0.0, "l2": 0.0}
        for snap in snaps:
            for tensor, state in snap["tensors"].items():
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if name == "fp8-tensor":
                    mq = per_tensor_fp8(m) if moment == "m" else m
                    vq = per_tensor_fp8(v) if moment == "v" else v
                    exact = (m.double() / snap["c1"]) / ((v.double() / snap["c2"]).sqrt()
                                                        + snap["eps"])
                    stored = (mq.double() / snap["c1"]) / (
                        (vq.double() / snap["c2"]).sqrt() + snap["eps"])
                    keep = exact != 0
                    ratio, ex = stored[keep] / exact[keep], exact[keep]
                else:
                    spec = (name, block)
                    ratio, ex = update_ratios(m, v, snap["c1"], snap["c2"], snap["eps"],
                                              spec if moment == "m" else None,
                                              spec if moment == "v" else None)
                found = {"grow2": (ratio > 2).double().mean().item(),
                         "shrink2": (ratio < 0.5).double().mean().item(),
                         "up": ratio.max().item(),
                         "l2": ((ex * (ratio - 1)).norm() / ex.norm()).item()}
                worst = {key: max(worst[key], found[key]) for key in worst}
        rows.append((moment, name, block, worst))
        print(f"| {'exp_avg' if moment == 'm' else 'exp_avg_sq'} | {name} | "
              f"{block or 'tensor'} | {100 * worst['grow2']:.3f}% | "
              f"{100 * worst['shrink2']:.3f}% | {worst['up']:.3g} | {worst['l2']:.3g} |",
              flush=True)
    return rows


# --- moments that stop receiving gradient ----------------------------------------------

def decay_check(steps=60):
    """A moment whose elements get no gradient should decay by beta every step. Stored
    in a block format it is decoded, multiplied by beta and encoded again each step;
    where ``beta * x`` rounds back to ``x`` it stops decaying. Prints, after ``steps``
    such steps of blocks of random magnitudes (spread e^N(0, 4)), the stored value over
    the exact one: median, largest, and the fraction stored at over 1.5x. Twice: every
    element decaying (a row no token touched: the block's largest decays too), and only
    the second half of each block decaying while the first half is set back to its
    first value every step (a block shared with a row that keeps being trained: its
    largest element stays)."""
    generator = torch.Generator().manual_seed(0)
    n = 256 * 64
    spread = torch.exp(torch.randn(n, generator=generator) * 2)
    v0 = torch.rand(n, generator=generator) * spread
    m0 = torch.randn(n, generator=generator) * spread
    cases = ([("exp_avg", m0, 0.9, name, b) for name, b in
              (("e4m3", 256), ("e4m3", 128), ("int8", 256), ("dyn8", 256), ("e2m1", 128),
               ("int4", 128), ("e4m3s29", 256), ("fe4m3", 256), ("fe2m1", 128))]
             + [("exp_avg_sq", v0, 0.95, name, b) for name, b in
                (("ue5m3", 256), ("sqrt8", 256), ("dyn8u", 256), ("lin8", 256),
                 ("log4", 128), ("sqrt4", 128), ("ue3m1", 128), ("e4m3s29", 256),
                 ("ufe5m3", 256), ("ufe4m0", 128))])
    print(f"| moment | beta | map | block | decaying | stored / exact after {steps} "
          f"steps: median | largest | > 1.5x |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: |")
    for moment, u0, beta, name, block in cases:
        qmap = MAPS[name]
        for held in (False, True):
            kept = (torch.arange(n) % block < block // 2) if held else torch.zeros(n, dtype=bool)
            u = dequantize(*quantize(u0, qmap, block), qmap, block, u0.shape)
            factor = torch.tensor(beta, dtype=torch.float32)
            for _ in range(steps):
                u = torch.where(kept, u0, factor * u)
                u = dequantize(*quantize(u, qmap, block), qmap, block, u0.shape)
            exact = u0.double() * beta ** steps
            ratio = (u.double() / exact)[(exact != 0) & ~kept]
            print(f"| {moment} | {beta} | {name} | {block} | "
                  f"{'half of each block' if held else 'all'} | "
                  f"{ratio.median().item():.3g} | {ratio.max().item():.3g} | "
                  f"{100 * (ratio > 1.5).double().mean().item():.1f}% |", flush=True)


def expand(runs):
    out = []
    for item in runs.split(";") if ";" in runs else [runs]:
        for token in ([item] if "=" in item else item.split(",")):
            out.extend(SPEC_GROUPS.get(token, [token]))
    return out


def print_table(path):
    rows = [json.loads(line) for line in open(path)]
    by_workload = {}
    for row in rows:
        by_workload.setdefault((row["workload_name"], row["steps"]), {})[row["spec"]] = row
    for (name, steps), runs in by_workload.items():
        ref = runs.get("ref")
        print(f"\nworkload {name}, {steps} steps"
              + (f": torch AdamW fp32 {ref['final_loss']:.4f}" if ref else ""))
        print(f"| {'exp_avg':<11} | {'exp_avg_sq':<11} | state B/param | final loss "
              f"| vs fp32 | diverged |")
        print("| --- | --- | ---: | ---: | ---: | --- |")
        for spec_text, row in runs.items():
            if spec_text.startswith("fused:"):
                m, _, v = (f"{part} (FusedAdam)" for part in
                           spec_text[len("fused:"):].partition("/"))
            else:
                spec = parse_spec(spec_text)
                m = "fp32 (torch)" if spec is None else _spec_name(spec["exp_avg"])
                v = "fp32 (torch)" if spec is None else _spec_name(spec["exp_avg_sq"])
            if row["diverged_at"]:
                loss, rel, div = "-", "-", f"step {row['diverged_at']}"
            else:
                loss = f"{row['final_loss']:.4f}"
                rel = (f"{100 * (row['final_loss'] / ref['final_loss'] - 1):+.2f}%"
                       if ref else "?")
                div = "no"
            print(f"| {m:<11} | {v:<11} | {row['bytes_per_param']:.3f} | {loss} | {rel} "
                  f"| {div} |")


def _spec_name(part):
    return "fp32" if part is None else f"{part[0]}/{part[1]}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="run the self-checks")
    parser.add_argument("--decay", action="store_true",
                        help="how each map stores moments that stop receiving gradient")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="proxy")
    parser.add_argument("--steps", type=whole_number_at_least(1), default=None)
    parser.add_argument("--runs", default="refs",
                        help="comma-separated group names or specs; separate specs "
                             "holding commas with ';' (m=e4m3:256,v=sqrt8:256;ref)")
    # One thread: on a shared 2-core machine two threads spent most of their time
    # waiting for each other (elementwise ops 100x slower than with one).
    parser.add_argument("--threads", type=whole_number_at_least(1), default=1)
    parser.add_argument("--out", default="runs/state_map_study.jsonl")
    parser.add_argument("--progress", type=whole_number_at_least(1), default=50,
                        help="print every N steps")
    parser.add_argument("--table", action="store_true", help="print the table of --out")
    parser.add_argument("--snapshots", default=None,
                        help="comma-separated steps: run torch AdamW and save its moments "
                             "after them (into the folder of --out)")
    parser.add_argument("--maps", default=None,
                        help="with --analyse: only these maps (comma-separated)")
    parser.add_argument("--analyse", default=None,
                        help="comma-separated steps whose saved moments to measure every "
                             "map's one-step update error on")
    args = parser.parse_args(argv)
    if args.table and not os.path.isfile(args.out):
        parser.error(f"--table reads --out, and there is no file {args.out!r}")
    torch.set_num_threads(args.threads)
    if args.check:
        check()
        return 0
    if args.decay:
        decay_check()
        return 0
    if args.table:
        print_table(args.out)
        return 0
    workload = WORKLOADS[args.workload]
    if args.steps:
        workload = replace(workload, steps=args.steps)
    folder = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(folder, exist_ok=True)
    if args.analyse:
        print("| moment | map | block | update > 2x | update < 1/2 | largest factor "
              "| rel. L2 error |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
        analyse(folder, args.workload, [int(k) for k in args.analyse.split(",")],
                args.maps.split(",") if args.maps else None)
        return 0
    if args.snapshots:
        began = time.time()
        result = run_with_snapshots(workload, args.workload,
                                    {int(k) for k in args.snapshots.split(",")}, folder)
        row = {"spec": "ref", "workload_name": args.workload, "steps": workload.steps,
               "workload": asdict(workload), "final_loss": result.last_mean_loss,
               "diverged_at": result.diverged_at,
               "bytes_per_param": result.state_bytes_per_param,
               "losses": result.losses, "seconds": time.time() - began,
               "threads": args.threads}
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{args.workload} ref: final {result.last_mean_loss:.4f}", flush=True)
        return 0
    for text in expand(args.runs):
        began = time.time()
        result = run_one(text, workload, args.progress)
        row = {"spec": text, "workload_name": args.workload, "steps": workload.steps,
               "workload": asdict(workload), "final_loss": result.last_mean_loss
               if result.diverged_at is None else None,
               "diverged_at": result.diverged_at,
               "bytes_per_param": result.state_bytes_per_param,
               "losses": result.losses, "seconds": time.time() - began,
               "threads": args.threads}
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{args.workload} {text}: "
              + (f"DIVERGED at step {result.diverged_at}" if result.diverged_at
                 else f"final {result.last_mean_loss:.4f}")
              + f"  {result.state_bytes_per_param:.3f} B/param  {result.seconds:.0f} s",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
