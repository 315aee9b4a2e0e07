"""The torch codecs of the per-block 4-bit formats (S2.12 fp4-block, ufp4-block): each
map's encode against an exhaustive nearest-value oracle written from the rule's text
(``_optimizer_testing``), the block scale, the nibble packing, the round trip of every code and of random
blocks, and the C++ core's own step stored bitwise as the codec stores it."""

import math

import pytest
import torch

from _optimizer_testing import (
    FP4_ROUNDING, UFP4_ROUNDING, assert_bitwise_equal, backend_context, block4_oracle,
    fp4_oracle, fp4_value, have_core, ufp4_oracle, ufp4_value)
from shardadam import _codecs, _formats

FP4B, UFP4B = _formats.FP4_BLOCK, _formats.UFP4_BLOCK


def spread_values(n: int, seed: int, square: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(n, generator=gen) * torch.pow(2.0, -(torch.arange(n) // 97 % 40.0))
    u[::53] = 0.0
    u[7::211] *= 2.0 ** -30  # far below the block's largest: code 0 / zero-free code 1
    return u * u if square else u


CASES = [(0, 1000, 128), (78, 3000, 256), (4096 * 3 - 6, 9000, 4096), (2, 1, 128),
         (254, 2, 256)]


@pytest.mark.parametrize("fmt", [FP4B, UFP4B], ids=lambda f: f.name)
@pytest.mark.parametrize("first,n,block", CASES)
def test_encode_follows_s2_12(fmt, first, n, block):
    u = spread_values(n, first + n, square=fmt is UFP4B)
    codes, scales = _codecs.encode_blocks(fmt.name, u, first, block, fmt.scale_target,
                                          fmt.zero_bound)
    want_codes, want_scales = block4_oracle(fmt.name, u, first, block)
    assert_bitwise_equal(codes, want_codes, f"{fmt.name} codes")
    assert_bitwise_equal(scales, want_scales, f"{fmt.name} scales")


def test_code_map_edges():
    """Every value, every midpoint and its fp32 neighbours, and the specials."""
    grid = sorted(set(FP4_ROUNDING.values()) | set(UFP4_ROUNDING.values()))
    xs = []
    for lo, hi in zip(grid, grid[1:]):
        mid = torch.tensor((lo + hi) / 2, dtype=torch.float32)
        xs += [lo, mid.item(), torch.nextafter(mid, torch.tensor(0.0)).item(),
               torch.nextafter(mid, torch.tensor(math.inf)).item()]
    xs += [0.0, 2.0 ** -149, 1e-30, 7.0, 20.0, 1e30, math.inf, math.nan]
    x = torch.tensor(xs + [-v for v in xs], dtype=torch.float32)
    assert_bitwise_equal(_codecs.fp4_encode(x),
                         torch.tensor([fp4_oracle(v) for v in x.tolist()], dtype=torch.uint8),
                         "fp4 codes of edge values")
    assert_bitwise_equal(_codecs.ufp4_encode(x, x),
                         torch.tensor([ufp4_oracle(v, v) for v in x.tolist()],
                                      dtype=torch.uint8), "ufp4 codes of edge values")
    # The ties S2.12 names: 7 goes to the even 8 (NaN), 20 to the even 16.
    assert _codecs.fp4_encode(torch.tensor([7.0, -6.99999952])).tolist() == [0x8, 0xF]
    assert _codecs.ufp4_encode(torch.tensor([20.0]), torch.tensor([1.0])).tolist() == [0xE]
    # Zero-free on the true value: x underflowed to 0 while u is not zero.
    assert _codecs.ufp4_encode(torch.tensor([0.0]), torch.tensor([1e-45])).tolist() == [1]


def test_decode_is_the_rule():
    codes = torch.arange(16, dtype=torch.uint8)
    for name, rule in (("fp4-block", fp4_value), ("ufp4-block", ufp4_value)):
        got = _codecs.decode_blocks(name, codes, torch.ones(1), 0, 128)
        want = torch.tensor([rule(c) for c in range(16)], dtype=torch.float32)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), name
        ok = ~torch.isnan(want)
        assert_bitwise_equal(got[ok], want[ok], f"{name} values")
        # the NaN code decodes to the quiet NaN 0x7FC00000 (S2.12)
        assert got[~ok].view(torch.int32).tolist() == [0x7FC00000], name


def test_nibbles_pack_low_first():
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 8, 7]], dtype=torch.uint8)
    packed = _codecs.pack_nibbles(codes)
    assert packed.tolist() == [0x21, 0x43, 0x0F, 0x78]
    assert_bitwise_equal(_codecs.unpack_nibbles(packed.view(2, 2)), codes, "unpacked")


def finite_codes(fmt):
    return [c for c in range(16) if not math.isnan((fp4_value if fmt is FP4B
                                                    else ufp4_value)(c))]


@pytest.mark.parametrize("fmt", [FP4B, UFP4B], ids=lambda f: f.name)
def test_every_code_survives_decode_then_encode(fmt):
    """Every finite code, in blocks holding the map's largest code, at every scale
    encoding can produce: decoding and encoding again gives back codes and scales, and
    the packed storage the format keeps too."""
    block = 128
    top = 0x7 if fmt is FP4B else 0xE
    finite = finite_codes(fmt)
    row = torch.tensor(finite + [top] * (block - len(finite)), dtype=torch.uint8)
    exponents = torch.arange(-126, 124).float()  # the largest value 16 < 2^5: finite
    codes = row.repeat(exponents.numel())
    scales = torch.ldexp(torch.ones(exponents.numel()), exponents)
    for first in (0, 3 * block):
        values = _codecs.decode_blocks(fmt.name, codes, scales, first, block)
        again, again_scales = _codecs.encode_blocks(fmt.name, values, first, block,
                                                    fmt.scale_target, fmt.zero_bound)
        assert_bitwise_equal(again, codes, f"{fmt.name} codes after decode -> encode")
        assert_bitwise_equal(again_scales, scales, f"{fmt.name} scales")
    sized = fmt.with_block(block)
    stored = _codecs.pack_nibbles(codes).view(exponents.numel(), block // 2)
    value = sized.decode(stored, scales)
    assert value.shape == (exponents.numel(), block)
    stored2, scales2 = torch.empty_like(stored), torch.empty_like(scales)
    sized.encode(value, stored2, scales2)
    assert_bitwise_equal(stored2, stored, f"{fmt.name} packed storage")
    assert_bitwise_equal(scales2, scales, f"{fmt.name} packed scales")


@pytest.mark.parametrize("fmt", [FP4B, UFP4B], ids=lambda f: f.name)
@pytest.mark.parametrize("block", [128, 256, 4096])
def test_random_blocks_survive_decode_then_encode(fmt, block):
    gen = torch.Generator().manual_seed(block)
    count = max(2, 8192 // block)
    finite = torch.tensor(finite_codes(fmt), dtype=torch.uint8)
    codes = finite[torch.randint(0, finite.numel(), (count, block), generator=gen)]
    top = torch.tensor([0x6, 0x7] if fmt is FP4B else [0xD, 0xE], dtype=torch.uint8)
    codes[torch.arange(count), torch.randint(0, block, (count,), generator=gen)] = \
        top[torch.randint(0, 2, (count,), generator=gen)]
    codes = codes.view(-1)
    scales = torch.ldexp(torch.ones(count),
                         torch.randint(-126, 124, (count,), generator=gen).float())
    values = _codecs.decode_blocks(fmt.name, codes, scales, 0, block)
    again, again_scales = _codecs.encode_blocks(fmt.name, values, 0, block,
                                                fmt.scale_target, fmt.zero_bound)
    assert_bitwise_equal(again, codes, f"{fmt.name} random codes")
    assert_bitwise_equal(again_scales, scales, f"{fmt.name} random scales")


def canonical_cases(g: torch.Tensor, first: int, block: int, gen) -> torch.Tensor:
    """``g`` with its blocks (of the whole parameter) made into the cases of S2.13's
    canonical rule, one step from zero moments: one element whose exp_avg is in (3.5,
    3.55) times its scale, or whose exp_avg_sq is in (10, 10.2) times its own (each may
    round down out of the top binade, the rest of the block far below), or a lone value
    at 2^-126's scale that may round to 0."""
    g = g.clone()
    c1, c2 = torch.tensor(1 - 0.9).item(), torch.tensor(1 - 0.999).item()
    for b, start in enumerate(range(-(first % block), g.numel(), block)):
        part = g[max(start, 0):start + block]
        u = torch.rand((), generator=gen).item()
        if b % 4 in (0, 2):
            largest = (3.5 + 0.05 * u) / c1 * 2.0 ** -8
        elif b % 4 == 1:
            largest = math.sqrt((10.0 + 0.2 * u) * 2.0 ** -20 / c2)
        else:
            part.zero_()
            part[0] = 3.0e-38
            continue
        part *= 0.5 * largest / part.abs().max()  # the rest of the block far below
        part[0] = largest
    return g


@pytest.mark.skipif(not have_core(), reason="C++ extension is not built")
@pytest.mark.parametrize("rounding,key", [(0, 0), (1, 0x5EED), (1, 2**32 - 1)])
@pytest.mark.parametrize("first,rows,block", [(0, 8, 128), (2 * 96, 31, 256)])
@pytest.mark.parametrize("canonical", [False, True], ids=["spread", "canonical-cases"])
def test_torch_codec_equals_the_core(first, rows, block, rounding, key, canonical):
    """One core step from zero moments stores (1-beta1)g and (1-beta2)g^2 (S3.6) packed:
    bitwise what the torch codec makes of those fp32 values, both moments rounded to
    nearest or stochastically (S2.13) with the slot's rounding_key; also where blocks
    are stored at half their scale, or at 1, by S2.13's canonical rule."""
    from shardadam import _C

    for fmt in (FP4B, UFP4B):
        if not _formats.available(fmt):
            pytest.skip(f"this build of shardadam._C has no {fmt.name}")
    n = rows * 96 * (4 if canonical else 1)  # canonical: enough blocks of each case
    gen = torch.Generator().manual_seed(n)
    g = spread_values(n, n + 1, square=False)
    if canonical:
        g = canonical_cases(g, first, block, gen)
    param = torch.randn(n, generator=gen)
    m, v = torch.zeros(n // 2, dtype=torch.uint8), torch.zeros(n // 2, dtype=torch.uint8)
    count = _codecs.block_count(first, n, block)
    m_scales, v_scales = torch.ones(count), torch.ones(count)
    row = [n, param.data_ptr(), 1, g.data_ptr(), 1, m.data_ptr(), FP4B.tag,
           m_scales.data_ptr(), v.data_ptr(), UFP4B.tag, v_scales.data_ptr(), 0, 0, 0,
           first, block, rounding, key, 0, rounding]
    step = 7
    _C.adam_step(row, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, step, 2)
    # Bias corrections change only the weight; the moments from zero are (1 - beta) g.
    c1, c2 = torch.tensor(1 - 0.9), torch.tensor(1 - 0.999)
    changed = {}
    for stored, scales, f, u in ((m, m_scales, FP4B, c1 * g), (v, v_scales, UFP4B,
                                                              (c2 * g) * g)):
        stream = _codecs.exp_avg_step_key if f is FP4B else _codecs.square_step_key
        codes, want = _codecs.encode_blocks(
            f.name, u, first, block, f.scale_target, f.zero_bound,
            stream(key, step) if rounding else None)
        assert_bitwise_equal(stored, _codecs.pack_nibbles(codes), f"{f.name} from the core")
        assert_bitwise_equal(scales, want, f"{f.name} scales from the core")
        oracle_codes, oracle_scales = block4_oracle(f.name, u, first, block)
        if not rounding:  # the stochastic rules' own oracles: test_*stochastic_encode_*
            assert_bitwise_equal(scales, oracle_scales, f"{f.name} scales: the core vs S2.12")
            assert_bitwise_equal(codes, oracle_codes, f"{f.name} codes: codec vs S2.12")
        else:  # S2.12's scales, or canonical ones: half of them, or 1 where all codes are 0
            ok = (scales == oracle_scales) | (scales == oracle_scales / 2) | (
                (scales == 1) & (oracle_scales == 2.0 ** -126))
            assert bool(ok.all()), f"{f.name} scales: the core vs S2.12 and S2.13"
            if canonical and rounding:
                changed[f.name] = [int((scales == oracle_scales / 2).sum()),
                                   int(((scales == 1) & (oracle_scales != 1)).sum())]
    if canonical and rounding:  # the data reaches both canonical cases (fp4: both)
        assert changed["fp4-block"][0] > 0 and changed["fp4-block"][1] > 0, changed
        assert changed["ufp4-block"][0] > 0, changed


# --------------------------------------------------------------------------- S2.13

def lowbias32(x: int) -> int:
    """S2.13's Mix32 in Python integers."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_generator_follows_s2_13():
    """The torch generator against Python integers, at indices on both sides of 2^32,
    and the values the C++ tests pin (codec_test.cc CounterHashIsPinned)."""
    assert _codecs.mix32(1) == lowbias32(1) == 0x688990C0
    assert _codecs.mix32(0xDEADBEEF) == lowbias32(0xDEADBEEF) == 0xE628C683
    key = _codecs.step_key(0x5EED, 3)
    assert key == lowbias32(lowbias32(0x5EED) ^ 3) == 0xCD4470E2
    assert key == _codecs.step_key(0x5EED, 3 + 2**32)
    # exp_avg's and S2.14's streams of the same tensor and step
    assert _codecs.exp_avg_step_key(0x5EED, 3) == lowbias32(key ^ 0x6C8E9CF5)
    assert _codecs.param_step_key(0x5EED, 3) == lowbias32(key ^ 0x5851F42D)
    for first in (0, 2**32 - 5, (5 << 32) + 17):
        got = _codecs.random_bits(key, first, 10, "cpu").tolist()
        want = [lowbias32(lowbias32((i & 0xFFFFFFFF) ^ lowbias32(i >> 32)) ^ key)
                for i in range(first, first + 10)]
        assert got == want, first
    assert _codecs.random_bits(key, (5 << 32) + 17, 1, "cpu").item() == 0x4F80DC40


def stochastic_oracle(x: float, r: int) -> int:
    """S2.13's rule from its text, in float64 and Python integers: between grid values
    lo <= |x| < hi, hi when r + 2^22 * (|x| - lo) / (hi - lo) reaches 2^22 (below 1:
    |x| * 2^23 truncated first); from 6 up S2.12's nearest (``fp4_oracle``)."""
    a = abs(x)
    if not a < 6:
        return fp4_oracle(x)
    r &= 0x3FFFFF
    if a >= 1:
        grid = [1, 1.5, 2, 3, 4, 6]
        k = max(i for i, value in enumerate(grid) if value <= a)
        f = int((a - grid[k]) / (grid[k + 1] - grid[k]) * 2**22)  # exact: 22 bits
        mag = 2 + k + (1 if f + r >= 2**22 else 0)
    else:
        mag = (math.floor(a * 2**23) + r) >> 22
    return mag | 8 if mag and math.copysign(1, x) < 0 else mag


def test_stochastic_encode_follows_s2_13():
    gen = torch.Generator().manual_seed(13)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    x = torch.cat([
        torch.rand(3000, generator=gen) * 7,
        torch.ldexp(torch.rand(500, generator=gen), torch.randint(-40, 1, (500,), generator=gen)),
        grid, torch.nextafter(grid, torch.tensor(9.0)), torch.nextafter(grid, -grid - 1),
        torch.tensor([6.99999952, 7.0, 2.0**-23, 2.0**-24, math.inf, math.nan])])
    x = torch.cat([x, -x])
    r = torch.randint(0, 2**32, x.shape, generator=gen, dtype=torch.int64)
    r[:16] = torch.tensor([0, 0x3FFFFF] * 8)
    got = _codecs.fp4_encode_stochastic(x, r)
    want = [stochastic_oracle(a, b) for a, b in zip(x.tolist(), r.tolist())]
    assert got.tolist() == want


def unsigned_stochastic_oracle(x: float, u: float, r: int) -> int:
    """S2.13's unsigned rule from its text: between grid values lo <= |x| < hi, hi when
    r + 2^22 * (|x| - lo) / (hi - lo) reaches 2^22 (below 0.25: |x| * 2^25 truncated
    first); from 16 up S2.12's nearest; zero-free on u."""
    a = abs(x)
    if not a < 16:
        return ufp4_oracle(x, u)
    r &= 0x3FFFFF
    if a >= 0.25:
        grid = [0.25, 0.375, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16]
        k = max(i for i, value in enumerate(grid) if value <= a)
        f = int((a - grid[k]) / (grid[k + 1] - grid[k]) * 2**22)  # exact: 22 bits
        code = 2 + k + (1 if f + r >= 2**22 else 0)
    else:
        code = (math.floor(a * 2**25) + r) >> 22
    return 1 if code == 0 and u != 0 else code


def test_unsigned_stochastic_encode_follows_s2_13():
    gen = torch.Generator().manual_seed(31)
    grid = torch.tensor([0, 0.125, 0.25, 0.375, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16])
    x = torch.cat([
        torch.rand(3000, generator=gen) * 21,
        torch.ldexp(torch.rand(500, generator=gen), torch.randint(-40, 1, (500,), generator=gen)),
        grid, torch.nextafter(grid, torch.tensor(30.0)), torch.nextafter(grid, -grid - 1),
        torch.tensor([9.99999905, 10.0, 15.9999990, 16.0, 20.0, 20.0000019, 2.0**-25,
                      2.0**-26, math.inf, math.nan])])
    x = torch.cat([x, -x])
    u = torch.where(torch.arange(x.numel()) % 7 == 0, torch.tensor(1e-3), x)  # x underflowed
    r = torch.randint(0, 2**32, x.shape, generator=gen, dtype=torch.int64)
    r[:16] = torch.tensor([0, 0x3FFFFF] * 8)
    got = _codecs.ufp4_encode_stochastic(x, u, r)
    want = [unsigned_stochastic_oracle(a, b, c)
            for a, b, c in zip(x.tolist(), u.tolist(), r.tolist())]
    assert got.tolist() == want


def test_unsigned_stochastic_rounding_is_unbiased():
    """exp_avg_sq's rule: over 2^14 draws the mean decoded value of each x from 0.125 to
    16 is x within 5 standard errors, also where a value decayed by beta2 = 0.95, which
    rounding to nearest puts back on its code (S2.12), the largest codes' included."""
    values = torch.tensor([ufp4_value(c) for c in range(15)] + [math.nan])
    x = torch.tensor([0.2, 0.3, 0.6, 1.3, 2.5, 5.0, 9.5, 10.5, 13.0]
                     + [0.95 * v for v in (0.25, 1, 3, 8, 12, 16)])
    draws = 2**14
    bits = _codecs.random_bits(_codecs.square_step_key(1, 1), 0, draws * x.numel(), "cpu")
    codes = _codecs.ufp4_encode_stochastic(x.repeat(draws), x.repeat(draws), bits)
    decoded = values[codes.long()].view(draws, -1).double()
    mean, spread = decoded.mean(0), decoded.std(0)
    assert torch.all((mean - x.double()).abs() <= 5 * spread / math.sqrt(draws) + 1e-12)
    nearest = values[_codecs.ufp4_encode(x, x).long()].double()
    assert torch.equal(nearest[-6:], torch.tensor([0.25, 1, 3, 8, 12, 16],
                                                  dtype=torch.float64))


def test_square_stream_is_its_own():
    """exp_avg_sq's key: drawn from the step's key with its own constant (S2.13), so the
    exp_avg, exp_avg_sq and param streams of one tensor and step differ."""
    key = _codecs.square_step_key(0x5EED, 3)
    assert key == lowbias32(_codecs.step_key(0x5EED, 3) ^ 0x2545F491)
    assert key not in (_codecs.step_key(0x5EED, 3), _codecs.exp_avg_step_key(0x5EED, 3),
                       _codecs.param_step_key(0x5EED, 3))
    assert key == _codecs.square_step_key(0x5EED, 3 + 2**32)


def test_stochastic_rounding_is_unbiased():
    """Over 2^14 draws, the mean decoded value of each x below 6 is x within 5 standard
    errors (a rule always rounding toward the nearer value fails this by far)."""
    x = torch.tensor([0.1, 0.3, 0.74, 1.2, 1.7, 2.6, 3.1, 3.4, 3.7, 4.4, 5.4, 5.9, -0.3,
                      -2.6, -3.7])
    draws = 2**14
    bits = _codecs.random_bits(_codecs.exp_avg_step_key(1, 1), 0, draws * x.numel(), "cpu")
    codes = _codecs.fp4_encode_stochastic(x.repeat(draws), bits)
    values = torch.tensor([fp4_value(c) for c in range(16)])[codes.long()].view(draws, -1)
    mean, spread = values.double().mean(0), values.double().std(0)
    assert torch.all((mean - x.double()).abs() <= 5 * spread / math.sqrt(draws) + 1e-12)
    nearest_codes = _codecs.fp4_encode(x.repeat(draws))
    nearest_mean = torch.tensor([fp4_value(c) for c in range(16)])[
        nearest_codes.long()].view(draws, -1).double().mean(0)
    assert torch.any((nearest_mean - x.double()).abs() > 5 * spread / math.sqrt(draws))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_fused_adam_keys_each_parameter_by_its_group_and_position(backend):
    """FusedAdam's rounding_key is (group index · 0x9E3779B9 + the parameter's index in
    its group) mod 2^32 and its step the group's (S2.13), computed here from the text:
    a step from zero moments stores the codes of (1 - beta1) g and (1 - beta2) g^2
    rounded with exactly those keys."""
    from shardadam import FusedAdam

    if backend == "auto" and not have_core():
        pytest.skip("C++ extension is not built")
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(4, 256, generator=gen)) for _ in range(5)]
    groups = [dict(params=params[:2]), dict(params=params[2:])]
    with backend_context(backend):
        opt = FusedAdam(groups, lr=1e-3, betas=(0.9, 0.95), moment_format="block4")
        opt.param_groups[1]["step"] = 2**32 + 6  # the key takes the step modulo 2^32
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    c1, c2 = torch.tensor(1 - 0.9), torch.tensor(1 - 0.95)
    for g, group in enumerate(opt.param_groups):
        step = group["step"] & 0xFFFFFFFF
        assert step == (1 if g == 0 else 7)
        for i, p in enumerate(group["params"]):
            key = (g * 0x9E3779B9 + i) & 0xFFFFFFFF
            grad = p.grad.reshape(-1)
            for name, stream, u in (("exp_avg", _codecs.exp_avg_step_key, c1 * grad),
                                    ("exp_avg_sq", _codecs.square_step_key,
                                     (c2 * grad) * grad)):
                f = opt._formats[p][name]
                codes, scales = _codecs.encode_blocks(f.name, u, 0, f.scale_block,
                                                      f.scale_target, f.zero_bound,
                                                      stream(key, step))
                assert_bitwise_equal(opt.state[p][name].reshape(-1),
                                     _codecs.pack_nibbles(codes),
                                     f"group {g} param {i} {name} codes")
                assert_bitwise_equal(opt._scales[p][name], scales,
                                     f"group {g} param {i} {name} scales")


@pytest.mark.parametrize("fmt,low,high", [(FP4B, 3.5, 4.0), (UFP4B, 10.0, 12.0),
                                           (_formats.UFP8_BLOCK, 244.0, 248.0)],
                         ids=["fp4-block", "ufp4-block", "ufp8-block"])
def test_stochastic_blocks_store_as_their_decoded_values_encode(fmt, low, high):
    """S2.13's canonical blocks: rounded stochastically, a block's largest element in
    (low, high) (just below the top binade at its scale) may round down out of it; the
    block is then stored at half the scale, with codes of twice the values, so that
    decoding and encoding again (a checkpoint's load) gives back its codes and scale."""
    gen = torch.Generator().manual_seed(23)
    blocks, block = 400, 128
    u = torch.randn(blocks, block, generator=gen).abs()
    if fmt is FP4B:
        u = u * torch.where(torch.rand(blocks, block, generator=gen) < 0.5, -1.0, 1.0)
    top = low + (high - low) * torch.rand(blocks, 1, generator=gen)
    u = (u / u.abs().amax(dim=1, keepdim=True) * top).reshape(-1) * 2.0 ** -20
    codes, scales = _codecs.encode_blocks(fmt.name, u, 0, block, fmt.scale_target,
                                          fmt.zero_bound, _codecs.exp_avg_step_key(9, 4))
    rule = 2.0 ** -20  # every block's largest magnitude is in (low, high) · 2^-20
    halved = scales == rule / 2
    assert torch.all(halved | (scales == rule))
    assert 0 < int(halved.sum()) < blocks  # both kinds of block occur
    decoded = _codecs.decode_blocks(fmt.name, codes, scales, 0, block)
    again, again_scales = _codecs.encode_blocks(fmt.name, decoded, 0, block,
                                                fmt.scale_target, fmt.zero_bound)
    assert_bitwise_equal(again, codes, f"{fmt.name} codes encoded again")
    assert_bitwise_equal(again_scales, scales, f"{fmt.name} scales encoded again")


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_block4_moments_of_a_parameter_without_gradient_decay_to_rest(backend):
    """A parameter whose gradient becomes zero (a token that stops occurring, a frozen
    part) stops moving, as with fp32 moments. With the top binade rounded to nearest,
    0.9 · 6 and 0.95 · 16 rounded back to 6 and 16 at the same scale, so exp_avg stayed
    while exp_avg_sq decayed, and every element within 2x of its block's largest moved
    further at every step (up to 23 · lr a step after 1000 steps)."""
    from shardadam import FusedAdam

    if backend == "auto" and not have_core():
        pytest.skip("C++ extension is not built")
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 256, generator=gen))
    with backend_context(backend):
        opt = FusedAdam([p], lr=1e-3, moment_format="block4")
        for _ in range(20):
            p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        p.grad = torch.zeros_like(p)
        for _ in range(300):
            opt.step()
        rested = p.detach().clone()
        for _ in range(100):
            opt.step()
    assert_bitwise_equal(p.detach(), rested, "weights over 100 more steps without gradient")
