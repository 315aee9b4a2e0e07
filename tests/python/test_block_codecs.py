"""The torch codecs of the per-block 8-bit formats (S2.9 fp8-block, S2.10 ufp8-block):
encode follows each rule bit for bit (against oracles written here from the rules'
text, and against the C++ core's own step), and encoding a decoded state gives back
the same codes and scales, for every code of each map and for random blocks."""

import math

import pytest
import torch

from _optimizer_testing import (
    UFP8_VALUES as UFP8_TABLE, assert_bitwise_equal, fp4_block_oracle, fp8_block_oracle,
    have_core, ufp4_block_oracle, ufp8_block_oracle, ufp8_codes)
from shardadam import _codecs, _formats

FP8B, UFP8B = _formats.FP8_BLOCK, _formats.UFP8_BLOCK
ORACLES = {"fp8-block": fp8_block_oracle, "ufp8-block": ufp8_block_oracle,
           "fp4-block": fp4_block_oracle, "ufp4-block": ufp4_block_oracle}


def ufp8_value(code: int) -> float:
    """S2.10's decode of one code, as the rule states it."""
    e, m = code >> 4, code & 15
    if code == 0xFF:
        return math.nan
    return m * 2.0 ** -10 if e == 0 else (16 + m) * 2.0 ** (e - 11)


UFP8_VALUES = [ufp8_value(c) for c in range(255)]  # the finite codes, increasing


def ufp8_oracle(x: float) -> int:
    """S2.10's encode of |x| by exhaustive search: the nearest finite code, ties to the
    even M; beyond 488 (half a step above 480), inf, NaN -> 0xFF; zero-free."""
    a = abs(x)
    if not a <= 488.0:
        return 0xFF
    best = min(range(255), key=lambda c: (abs(UFP8_VALUES[c] - a), c & 1))
    return 1 if best == 0 and a > 0 else best


def spread_values(n: int, seed: int) -> torch.Tensor:
    """Signed values over many binades, with zeros, so blocks get different scales and
    elements land on subnormal codes and on code 0."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(n, generator=gen) * torch.pow(2.0, -(torch.arange(n) // 97 % 40.0))
    u[::53] = 0.0
    u[7::211] *= 2.0 ** -30  # far below the block's largest: code 0 / zero-free code 1
    return u


CASES = [(0, 1000, 128), (77, 3000, 256), (4096 * 3 - 5, 9000, 4096), (1, 1, 128),
         (255, 2, 256)]


@pytest.mark.parametrize("first,n,block", CASES)
def test_fp8_block_encode_follows_s2_9(first, n, block):
    u = spread_values(n, first + n)
    codes, scales = _codecs.encode_blocks("fp8-block", u, first, block, FP8B.scale_target,
                                          FP8B.zero_bound)
    want_codes, want_scales = fp8_block_oracle(u, first, block)
    assert_bitwise_equal(codes, want_codes, "fp8-block codes")
    assert_bitwise_equal(scales, want_scales, "fp8-block scales")


@pytest.mark.parametrize("first,n,block", CASES)
def test_ufp8_block_encode_follows_s2_10(first, n, block):
    u = spread_values(n, first + n).abs()
    codes, scales = _codecs.encode_blocks("ufp8-block", u, first, block,
                                          UFP8B.scale_target, UFP8B.zero_bound)
    want_codes, want_scales = ufp8_block_oracle(u, first, block)
    assert_bitwise_equal(codes, want_codes, "ufp8-block codes")
    assert_bitwise_equal(scales, want_scales, "ufp8-block scales")
    assert not bool(((codes == 0) & (u != 0)).any()), "a non-zero value became code 0"


@pytest.mark.parametrize("fmt", [FP8B, UFP8B, _formats.FP4_BLOCK, _formats.UFP4_BLOCK],
                         ids=lambda f: f.name)
def test_block_encode_at_the_scale_rules_edges(fmt):
    """The torch codec against its format's oracle on blocks spread_values never makes:
    a largest magnitude at, just below and just above the format's zero bound times
    2^-126 (scale 1 up to it: every code 0 at any scale; 2^-126 above), and a block
    whose scale is above 1 beside fp32 subnormals, whose quotient underflows to 0 (an
    unsigned format still stores code 1 for them, S2.10 / S2.12)."""
    edge = fmt.zero_bound * 2.0 ** -126
    below, above = (torch.nextafter(torch.tensor(edge), torch.tensor(d)).item()
                    for d in (0.0, 1.0))
    tiny = 2.0 ** -149
    blocks = [[edge, tiny, -edge / 2], [below, 0.0, tiny], [above, tiny, 0.0],
              [1000.0, tiny, -tiny, 2.0 ** -140, 0.0, 3.0]]
    block = 8
    u = torch.cat([torch.tensor(b + [0.0] * (block - len(b))) for b in blocks])
    if not fmt.holds("exp_avg"):  # unsigned formats take magnitudes
        u = u.abs()
    codes, scales = _codecs.encode_blocks(fmt.name, u, 0, block, fmt.scale_target,
                                          fmt.zero_bound)
    want_codes, want_scales = ORACLES[fmt.name](u, 0, block)
    assert_bitwise_equal(scales, want_scales, f"{fmt.name} scales")
    assert_bitwise_equal(codes, want_codes, f"{fmt.name} codes")
    if fmt.zero_bound > 0:  # the rule's edge is where the scale changes
        assert scales[:2].tolist() == [1.0, 1.0] and scales[2].item() == 2.0 ** -126
    assert scales[3].item() > 1.0
    if not fmt.holds("exp_avg"):
        last = codes[3 * block:3 * block + 4]
        assert last[1:4].tolist() == [1, 1, 1], "a non-zero value's quotient underflowed to 0"


def test_ufp8_code_map_edges():
    """Ties to even M, the carry into the next binade, the NaN code, zero-freedom, the
    sign ignored, and the linear step 2^-10 below 2^-6 (S2.10)."""
    x = torch.tensor([0.0, -0.0, 2.0 ** -11, 2.0 ** -12, 2.0 ** -149, 1.5 * 2.0 ** -10,
                      2.0 ** -6, 17.5 * 2.0 ** -10, 31.75 * 2.0 ** -10, 1.0, 1.03125,
                      1.09375, -3.0, 480.0, 487.0, 488.0, 488.0001, 1e30, math.inf,
                      -math.inf, math.nan])
    got = _codecs.ufp8_encode(x)
    want = torch.tensor([ufp8_oracle(v) for v in x.tolist()], dtype=torch.uint8)
    assert_bitwise_equal(got, want, "ufp8 codes of edge values")
    assert got[0] == 0 and got[2] == 1 and got[4] == 1 and got[13] == 0xFE
    assert got[-1] == 0xFF and got[-2] == 0xFF and got[16] == 0xFF


def test_vectorised_ufp8_oracle_is_the_exhaustive_one():
    """The block oracle's vectorised search (shared with the distributed jobs) gives
    the scalar search's code for every code's value, midpoints, the ties and their
    neighbours, and spread values."""
    values = [ufp8_value(c) for c in range(255)]
    assert UFP8_TABLE.tolist() == values  # the shared table is the rule's too
    mids = [(a + b) / 2 for a, b in zip(values, values[1:])]
    edges = [488.0, 488.0001, 480.0, 1e30, math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-30]
    x = torch.tensor(values + mids + edges, dtype=torch.float32)
    x = torch.cat([x, torch.nextafter(x, torch.tensor(0.0)), -x, spread_values(4000, 3)])
    want = torch.tensor([ufp8_oracle(v) for v in x.tolist()], dtype=torch.uint8)
    assert_bitwise_equal(ufp8_codes(x), want, "vectorised E4M4 codes")


def test_ufp8_decode_is_the_rule():
    codes = torch.arange(256, dtype=torch.uint8)
    values = _codecs.ufp8_decode(codes)
    assert values[:255].double().tolist() == UFP8_VALUES
    assert values[255].view(torch.int32).item() == 0x7FC00000
    assert values[254].item() == 480.0 and values[1].item() == 2.0 ** -10


def codes_with_top(name: str, count: int, block: int, gen) -> torch.Tensor:
    """Random codes of ``name`` (no NaN), each block holding one code of its top
    binade, where S2.9's scale puts a block's largest element."""
    if name == "fp8-block":
        codes = torch.randint(0, 256, (count * block,), generator=gen, dtype=torch.uint8)
        codes = torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)  # no NaN
        top = torch.randint(0x77, 0x7F, (count,), generator=gen, dtype=torch.uint8)  # 240..448
    else:
        codes = torch.randint(0, 255, (count * block,), generator=gen, dtype=torch.uint8)
        top = torch.randint(0xEF, 0xFF, (count,), generator=gen, dtype=torch.uint8)  # 248..480
    codes = codes.view(count, block).clone()
    where = torch.randint(0, block, (count,), generator=gen)
    codes[torch.arange(count), where] = top
    return codes.view(-1)


# The scales encoding can produce: 2^-126 up to where a block's largest code (448 or
# 480, just under 2^9) times the scale is still a finite fp32 (below 2^128).
EXPONENTS = (-126, 119)


def exact_scales(count: int, gen) -> torch.Tensor:
    """Powers of two over the range encoding can produce."""
    low, high = EXPONENTS
    return torch.ldexp(torch.ones(count), torch.randint(low, high + 1, (count,),
                                                        generator=gen).float())


@pytest.mark.parametrize("fmt", [FP8B, UFP8B], ids=lambda f: f.name)
def test_every_code_survives_decode_then_encode(fmt):
    """Every finite code of the map, in blocks whose scale is each power of two encoding
    can produce (EXPONENTS) and whose largest code is the map's largest: decoding and
    encoding again gives back the same codes and scales."""
    block = 256
    finite = [c for c in range(256) if (c & 0x7F) != 0x7F] if fmt is FP8B \
        else list(range(255))
    top = 0x7E if fmt is FP8B else 0xFE
    row = torch.tensor(finite + [top] * (block - len(finite)), dtype=torch.uint8)
    exponents = torch.arange(EXPONENTS[0], EXPONENTS[1] + 1).float()
    codes = row.repeat(exponents.numel())
    scales = torch.ldexp(torch.ones(exponents.numel()), exponents)
    for first in (0, 3 * block):
        values = _codecs.decode_blocks(fmt.name, codes, scales, first, block)
        again, again_scales = _codecs.encode_blocks(fmt.name, values, first, block,
                                                    fmt.scale_target, fmt.zero_bound)
        assert_bitwise_equal(again, codes, f"{fmt.name} codes after decode -> encode")
        assert_bitwise_equal(again_scales, scales, f"{fmt.name} scales")


@pytest.mark.parametrize("fmt", [FP8B, UFP8B], ids=lambda f: f.name)
@pytest.mark.parametrize("block", [128, 256, 4096])
def test_random_blocks_survive_decode_then_encode(fmt, block):
    gen = torch.Generator().manual_seed(block)
    count = max(2, 8192 // block)
    codes = codes_with_top(fmt.name, count, block, gen)
    scales = exact_scales(count, gen)
    values = _codecs.decode_blocks(fmt.name, codes, scales, 0, block)
    again, again_scales = _codecs.encode_blocks(fmt.name, values, 0, block,
                                                fmt.scale_target, fmt.zero_bound)
    assert_bitwise_equal(again, codes, f"{fmt.name} random codes")
    assert_bitwise_equal(again_scales, scales, f"{fmt.name} random scales")


@pytest.mark.parametrize("fmt", [FP8B, UFP8B], ids=lambda f: f.name)
def test_partial_blocks_and_empty_ranges(fmt):
    """A range cut inside blocks at both ends holds one scale per block it touches; an
    empty one holds none; an all-zero block has scale 1 (S2.9)."""
    u = torch.zeros(400)  # flat indices 200..599: blocks 0 (part), 1, 2 (part)
    u[0], u[399] = 3.0, 5.0
    codes, scales = _codecs.encode_blocks(fmt.name, u, 200, 256, fmt.scale_target,
                                          fmt.zero_bound)
    assert scales.shape == (3,) and codes.shape == (400,)
    # 3 / 2^-7 = 384 and 5 / 2^-6 = 320 fit under both bounds, twice that does not;
    # block 1 is all zeros.
    assert scales.tolist() == [2.0 ** -7, 1.0, 2.0 ** -6]
    codes, scales = _codecs.encode_blocks(fmt.name, torch.zeros(0), 17, 256,
                                          fmt.scale_target, fmt.zero_bound)
    assert codes.numel() == 0 and scales.numel() == 0


@pytest.mark.skipif(not have_core(), reason="C++ extension is not built")
@pytest.mark.parametrize("name", ["fp8-block", "ufp8-block"])
@pytest.mark.parametrize("first,n,block", [(0, 1000, 128), (77, 3000, 256)])
def test_torch_codec_equals_the_core(name, first, n, block):
    """One core step from zero moments stores (1-beta1)g and (1-beta2)g^2 (S3.6): the
    core's codes and scales are bitwise what the torch codec makes of those fp32
    values."""
    from shardadam import _C

    fmt = _formats.by_name(name)
    if not _formats.available(fmt):
        pytest.skip(f"this build of shardadam._C has no {name}")
    gen = torch.Generator().manual_seed(n)
    g = spread_values(n, n + 1)
    param = torch.randn(n, generator=gen)
    m_fmt = fmt if fmt.holds("exp_avg") else FP8B
    m, v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    count = _codecs.block_count(first, n, block)
    m_scales, v_scales = torch.ones(count), torch.ones(count)
    row = [n, param.data_ptr(), 1, g.data_ptr(), 1, m.data_ptr(), m_fmt.tag,
           m_scales.data_ptr(), v.data_ptr(), fmt.tag, v_scales.data_ptr(), 0, 0, 0,
           first, block, 0, 0, 0, 0]  # exp_avg, the param, exp_avg_sq to nearest
    _C.adam_step(row, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1, 2)
    c1, c2 = torch.tensor(1 - 0.9), torch.tensor(1 - 0.999)
    for stored, scales, f, u in ((m, m_scales, m_fmt, c1 * g), (v, v_scales, fmt,
                                                               (c2 * g) * g)):
        codes, want = _codecs.encode_blocks(f.name, u, first, block, f.scale_target,
                                            f.zero_bound)
        assert_bitwise_equal(stored, codes, f"{f.name} codes from the core")
        assert_bitwise_equal(scales, want, f"{f.name} scales from the core")
        # and the rule's own text, independently of the codec
        oracle = fp8_block_oracle if f is FP8B else ufp8_block_oracle
        oracle_codes, oracle_scales = oracle(u, first, block)
        assert_bitwise_equal(stored, oracle_codes, f"{f.name} codes: the core vs S2.9/10")
        assert_bitwise_equal(scales, oracle_scales, f"{f.name} scales: the core vs S2.9/10")
        decoded = f.with_block(block).decode(stored, scales, first)
        assert_bitwise_equal(decoded, _codecs.decode_blocks(f.name, codes, want, first,
                                                            block), "decode")


@pytest.mark.skipif(not have_core(), reason="C++ extension is not built")
@pytest.mark.parametrize("key", [0x5EED, 2**32 - 1])
@pytest.mark.parametrize("first,n,block", [(0, 1024 * 16, 128), (77, 3000 * 8, 256)])
def test_stochastic_exp_avg_sq_torch_codec_equals_the_core(first, n, block, key):
    """Block8's exp_avg_sq as FusedAdam rounds it (stochastically, S2.13), one core
    step from zero moments: bitwise what the torch codec makes of (1-beta2)g^2 with
    the slot's rounding_key, also in blocks whose largest element lies in (244, 248)
    times its scale, which may round down out of the top binade and then are stored
    at half the scale (S2.13's canonical blocks): both kinds occur."""
    from shardadam import _C

    gen = torch.Generator().manual_seed(n)
    c2 = torch.tensor(1 - 0.999)
    g = spread_values(n, n + 1)
    for start in range(-(first % block), n, 2 * block):  # every other block: a case
        part = g[max(start, 0):start + block]
        top = math.sqrt((244.0 + 4.0 * torch.rand((), generator=gen).item()) * 2.0 ** -20
                        / c2.item())
        part *= 0.5 * top / part.abs().max()
        part[0] = top
    param = torch.randn(n, generator=gen)
    m, v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    count = _codecs.block_count(first, n, block)
    m_scales, v_scales = torch.ones(count), torch.ones(count)
    row = [n, param.data_ptr(), 1, g.data_ptr(), 1, m.data_ptr(), FP8B.tag,
           m_scales.data_ptr(), v.data_ptr(), UFP8B.tag, v_scales.data_ptr(), 0, 0, 0,
           first, block, 0, key, 0, 1]  # exp_avg_sq rounded stochastically
    step = 5
    _C.adam_step(row, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, step, 2)
    u = (c2 * g) * g
    codes, want = _codecs.encode_blocks(UFP8B.name, u, first, block, UFP8B.scale_target,
                                        UFP8B.zero_bound, _codecs.square_step_key(key, step))
    assert_bitwise_equal(v, codes, "ufp8-block codes from the core")
    assert_bitwise_equal(v_scales, want, "ufp8-block scales from the core")
    _, rule = ufp8_block_oracle(u, first, block)  # S2.10's scales, or half of them
    assert bool(((v_scales == rule) | (v_scales == rule / 2)).all())
    assert 0 < int((v_scales == rule / 2).sum()) < count, "both kinds of block"
    nearest, _ = _codecs.encode_blocks(UFP8B.name, u, first, block, UFP8B.scale_target,
                                       UFP8B.zero_bound)
    assert not torch.equal(v, nearest), "rounded to nearest"
