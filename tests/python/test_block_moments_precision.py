"""block8 and block4 moments (S2.11, S2.12) against a float64 Adam step written here, from
the state actually stored before each step. The bound of each stored moment element
follows from its map's step: E4M3 codes (exp_avg) round to within 2^-4 of the value (3
mantissa bits) and below the normal range to within half a subnormal step, 2^-10 times
the block scale; unsigned E4M4 codes (exp_avg_sq), rounded stochastically (S2.13), to
within one step, 2^-4 of the value (4 mantissa bits), with an absolute floor of one
step, 2^-10 times the scale it was rounded at (zero-free: a value that would round to 0
is stored as 2^-10·s; a block stored at half that scale, S2.13's canonical blocks, was
rounded at twice its stored scale). Before rounding, the fp32 arithmetic adds a few
units of 2^-24, covered by a 2^-10 relative margin. The fp32 weight (an fp32 parameter, or a
bf16 parameter's fp32 master, of which the parameter is the nearest bf16) is held to 16
fp32 units of the step and the weight, in AdamW and in L2 mode.

block4 moments are rounded stochastically (S2.13), so their bound is the map's grid
itself: each stored value, decoded here from the spec's tables, is a grid value times
the block scale and one of the two grid values around the float64 value (to nearest
from the largest value up, which the same bracket holds), zero-free for exp_avg_sq; a
block stored at half its scale (S2.13's canonical blocks) is held to the grid it was
rounded on, and every block encodes again to itself."""

import math

import pytest
import torch

from _optimizer_testing import block8_decode
from shardadam import FusedAdam, _codecs, _formats

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.01
U = 2.0 ** -24
MARGIN = 1.0 + 2.0 ** -10
# (relative error, absolute floor in units of the block scale) per map: half a step
# rounded to nearest (E4M3), one step rounded stochastically (E4M4)
BOUNDS = {"fp8-block": (2.0 ** -4, 2.0 ** -10), "ufp8-block": (2.0 ** -4, 2.0 ** -10)}


def decoded(opt, p, name):
    """The stored block8 moment, decoded in the test, and its format."""
    fmt = opt._formats[p][name]
    values = block8_decode(opt.state[p][name], opt._scales[p][name], 0, fmt.scale_block,
                           unsigned=fmt.name == "ufp8-block")
    return values.double(), fmt


# S2.9, S2.10, S2.12: the largest magnitude over the scale each map stores
TARGETS = {"fp8-block": 464.0, "ufp8-block": 488.0,
           "fp4-block": float.fromhex("0x1.bffffep+2"), "ufp4-block": 20.0}


def assert_scales_are_the_rules(opt, p, name, want, step, canonical=False):
    """Each stored block scale is S2.9's search on the float64 moments: the smallest
    power of two s in [2^-126, 2^127] with max|u| / s <= the map's target. The core
    searches on its fp32 moments, a few units of 2^-24 away, so where max|u| sits that
    close to a boundary either neighbour is its answer. ``canonical``: codes rounded
    stochastically, whose block may be stored at half that scale (S2.13's canonical
    blocks). The bounds below take the stored scale only once it has passed this."""
    fmt = opt._formats[p][name]
    target = TARGETS[fmt.name]
    absmax = want.abs().reshape(-1, fmt.scale_block).amax(dim=1).tolist()
    stored = opt._scales[p][name].tolist()
    assert len(stored) == len(absmax)
    for b, (a, s) in enumerate(zip(absmax, stored)):
        assert a > 2.0 ** -100, "a block of zeros: S2.9's special case, not exercised here"
        allowed = set()
        for x in (a * (1 - 2.0 ** -20), a * (1 + 2.0 ** -20)):
            e = min(max(math.ceil(math.log2(x / target)), -126), 127)
            while e > -126 and x / 2.0 ** (e - 1) <= target:
                e -= 1
            while x / 2.0 ** e > target:
                e += 1
            allowed.add(2.0 ** e)
            if canonical and e > -126:
                allowed.add(2.0 ** (e - 1))
        assert s in allowed, f"step {step} {name} block {b}: scale {s}, the rule gives " \
                             f"{sorted(allowed)} for max {a}"


def per_element_scale(opt, p, name, want=None):
    """Each element's block scale; with ``want`` (the float64 moment), the scale it was
    rounded at: twice the stored one in a block stored at half the rule's (S2.13)."""
    fmt = opt._formats[p][name]
    scales = opt._scales[p][name].double()
    if want is not None:
        absmax = want.abs().reshape(-1, fmt.scale_block).amax(dim=1)
        halved = absmax / scales > TARGETS[fmt.name] * (1 + 2.0 ** -20)
        scales = torch.where(halved, 2 * scales, scales)
    return scales[torch.arange(p.numel()) // fmt.scale_block].view(p.shape)


def grad_rows(shape, gen):
    """Rows of very different magnitudes, and rare large entries."""
    g = torch.randn(shape, generator=gen) * torch.pow(2.0, -torch.arange(8.0) * 3).view(8, 1)
    g[torch.rand(shape, generator=gen) < 0.01] *= 50.0
    return g


def adam64(m0, v0, w0, g, step, adamw=True):
    """One Adam step in float64 from the stored state: m, v, the update and w. AdamW
    decays the weight; L2 mode (adam_w_mode=False) adds WD · w to the gradient."""
    b1, b2 = BETAS
    if not adamw:
        g = g + WD * w0
    m = b1 * m0 + (1 - b1) * g
    v = b2 * v0 + (1 - b2) * g * g
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step
    update = (m / c1) / ((v / c2).sqrt() + EPS)
    decayed = w0 * (1 - LR * WD) if adamw else w0
    return m, v, update, decayed - LR * update


def assert_param_within(p, w, update, step):
    """The fp32 weight within 16 fp32 units of the weight and the step."""
    err_w = (p.detach().double().reshape(w.shape) - w).abs()
    bound_w = 16 * U * (w.abs() + LR * update.abs()) + 2.0 ** -149
    assert bool((err_w <= bound_w).all()), f"step {step}: parameter off by " \
        f"{(err_w / bound_w).max().item():.2f} of its bound"


def weight(opt, p):
    """The fp32 weight: the parameter itself, or its fp32 master."""
    return opt.state[p]["master_param"] if p.dtype == torch.bfloat16 else p.detach()


@pytest.mark.parametrize("params", ["fp32", "bf16-master"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("block", [128, 256])
def test_block8_steps_stay_within_each_maps_rounding(block, adamw, params):
    """Also in L2 mode, and beside a bf16 parameter with an fp32 master (the weight is
    the master; the parameter is the master rounded to nearest bf16, S3.6)."""
    gen = torch.Generator().manual_seed(block)
    bf16 = params == "bf16-master"
    p = torch.nn.Parameter(torch.randn(8, 256, generator=gen).to(
        torch.bfloat16 if bf16 else torch.float32))
    opt = FusedAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adam_w_mode=adamw,
                    master_weights=bf16, moment_format="block8", moment_block_size=block)
    half_steps = [0]  # exp_avg_sq elements stored more than half a step away
    for step in range(1, 11):
        g = grad_rows(p.shape, gen).to(p.dtype)
        p.grad = g
        m0, _ = decoded(opt, p, "exp_avg")
        v0, _ = decoded(opt, p, "exp_avg_sq")
        w0 = weight(opt, p).double().clone()
        m, v, update, w = adam64(m0, v0, w0, g.double(), step, adamw)
        opt.step()
        if bf16:
            assert_param_within(weight(opt, p), w, update, step)
            assert torch.equal(p.detach(), weight(opt, p).bfloat16()), "param vs master"
        for name, want in (("exp_avg", m), ("exp_avg_sq", v)):
            assert_scales_are_the_rules(opt, p, name, want, step,
                                        canonical=name == "exp_avg_sq")
            got, fmt = decoded(opt, p, name)
            rel, floor = BOUNDS[fmt.name]
            bound = (torch.maximum(rel * want.abs(),
                                   floor * per_element_scale(opt, p, name, want))
                     * MARGIN + 8 * U * want.abs())
            err = (got - want).abs()
            worst = (err / bound).max().item()
            assert worst <= 1.0, f"step {step} {name} ({fmt.name}): error {worst:.3f} of bound"
            if fmt.name == "ufp8-block":
                assert bool((got[want > 0] > 0).all()), "a non-zero exp_avg_sq became 0"
                # Rounded stochastically: past half a step in the normal range (from
                # 2^-6 · s), where rounding to nearest never goes.
                normal = want.abs() >= 2.0 ** -6 * per_element_scale(opt, p, name, want)
                past_half = err > 0.5 * rel * want.abs() * MARGIN + 8 * U * want.abs()
                half_steps[0] += int((normal & past_half).sum())
        if not bf16:
            assert_param_within(p, w, update, step)
    assert half_steps[0] > 0, "exp_avg_sq was rounded to nearest"


def test_bounds_are_tight_enough_to_fail():
    """The E4M3 bound is the map's: halving it is exceeded by a real step's rounding."""
    gen = torch.Generator().manual_seed(7)
    u = torch.randn(4096, generator=gen)
    fmt = _formats.FP8_BLOCK
    codes, scales = _codecs.encode_blocks(fmt.name, u, 0, 256, fmt.scale_target,
                                          fmt.zero_bound)
    got = _codecs.decode_blocks(fmt.name, codes, scales, 0, 256).double()
    rel, floor = BOUNDS[fmt.name]
    s = scales.repeat_interleave(256).double()
    bound = torch.maximum(rel * u.double().abs(), floor * s)
    ratio = ((got - u.double()).abs() / bound).max().item()
    assert 0.5 < ratio <= 1.0


# S2.12's magnitudes, in units of the block scale.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E3M1 = [0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0]


def nibble_values(codes, signed):
    """A packed block4 buffer decoded by S2.12, element i the low nibble of byte i // 2
    when i is even; in units of the scale, float64."""
    flat = codes.reshape(-1).to(torch.int64)
    nibbles = torch.stack([flat & 0xF, flat >> 4], dim=1).reshape(-1)
    table = torch.tensor(E2M1 if signed else E3M1, dtype=torch.float64)
    if signed:
        assert not bool((nibbles == 0x8).any()), "NaN code"
        values = table[nibbles & 7]
        return torch.where(nibbles >= 8, -values, values)
    assert not bool((nibbles == 0xF).any()), "NaN code"
    return table[nibbles]


def bracket(x, grid):
    """The grid values just below and just above each magnitude x (the top one past it)."""
    g = torch.tensor(grid, dtype=torch.float64)
    upper = torch.searchsorted(g, x, right=False).clamp(max=len(grid) - 1)
    lower = (torch.searchsorted(g, x, right=True) - 1).clamp(min=0)
    return g[lower], g[upper]


@pytest.mark.parametrize("block", [128, 256])
def test_block4_steps_land_on_the_grid_around_the_value(block):
    gen = torch.Generator().manual_seed(40 + block)
    p = torch.nn.Parameter(torch.randn(8, 256, generator=gen))
    opt = FusedAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                    moment_format="block4", moment_block_size=block)

    def stored(name):
        scales = opt._scales[p][name].double()
        s = scales[torch.arange(p.numel()) // block]
        units = nibble_values(opt.state[p][name], signed=name == "exp_avg")
        return units * s, s

    # per moment: values stored at the grid value above / at the farther of the two
    seen_up = {"exp_avg": 0, "exp_avg_sq": 0}
    seen_far = {"exp_avg": 0, "exp_avg_sq": 0}
    for step in range(1, 11):
        g = grad_rows(p.shape, gen)
        g[:, :16] = 0.0  # absent entries: their moments only decay
        p.grad = g
        m0, v0 = stored("exp_avg")[0], stored("exp_avg_sq")[0]
        m, v, update, w = adam64(m0, v0, p.detach().double().reshape(-1).clone(),
                                 g.double().reshape(-1), step)
        opt.step()
        for name, want, grid in (("exp_avg", m, E2M1), ("exp_avg_sq", v, E3M1)):
            assert_scales_are_the_rules(opt, p, name, want, step, canonical=True)
            got, s = stored(name)
            # Decoded and encoded again (a checkpoint's load): the same codes and scales.
            f = opt._formats[p][name]
            codes, scales = _codecs.encode_blocks(f.name, got.float(), 0, block,
                                                  f.scale_target, f.zero_bound)
            assert torch.equal(_codecs.pack_nibbles(codes).view(opt.state[p][name].shape),
                               opt.state[p][name]), f"step {step} {name}: codes again"
            assert torch.equal(scales, opt._scales[p][name]), f"step {step} {name}: scales"
            # A block stored at half its scale (its largest x past the map's bound) was
            # rounded at twice that: compare on that grid.
            x_max = (want.abs() / s).view(-1, block).amax(dim=1)
            past = x_max > TARGETS[f.name] * (1 + 2.0 ** -20)
            s = s * torch.where(past, 2.0, 1.0).double()[torch.arange(s.numel()) // block]
            x = want.abs() / s
            # the fp32 value the core rounds is within a few units of 2^-24 of x
            lo = bracket(x * (1 - 2.0 ** -20), grid)[0]
            hi = bracket(x * (1 + 2.0 ** -20), grid)[1]
            if name == "exp_avg_sq":
                hi = torch.where(want > 0, torch.maximum(hi, torch.full_like(hi, 0.125)), hi)
            units = got.abs() / s
            ok = (units >= lo) & (units <= hi) & ((got == 0) | (got.sign() == want.sign()))
            assert bool(ok.all()), f"step {step} {name}: " \
                f"{int((~ok).sum())} values off the grid around the float64 value"
            if name == "exp_avg_sq":
                assert bool((got[want > 0] > 0).all()), "a non-zero exp_avg_sq became 0"
            between = lo != hi
            seen_up[name] += int(((units != lo) & between).sum())
            # Stochastic, not nearest (S2.13): some values went to the farther grid
            # value by a clear margin.
            other = torch.where(units == lo, hi, lo)
            farther = (units - x).abs() - (other - x).abs() > 2.0 ** -10 * hi
            seen_far[name] += int((farther & between).sum())
        assert_param_within(p, w, update, step)
    # the bracket was exercised on both sides, and not by nearest rounding
    assert min(seen_up.values()) > 0, seen_up
    assert min(seen_far.values()) > 0, seen_far



@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_block8_exp_avg_sq_decays_at_beta2_near_one(backend):
    """Block8's exp_avg_sq is rounded stochastically (S2.13), so under a zero gradient
    it decays by beta2 = 0.999 per step in expectation, where rounded to nearest
    0.999 · x rounds back to x at every code and it would not decay at all: after
    1,000 steps each element's ratio to its exact decay from the first stored value
    averages 1 within five standard errors of that mean. (Block4's grid is too coarse
    for this check: values that wander down to its smallest code, 1/128 of the
    largest, stay there, zero-free; test_block4_codecs.py checks that its moments
    decay to rest.)"""
    moment_format = "block8"
    from _optimizer_testing import backend_context, have_core

    if backend == "auto" and not have_core():
        pytest.skip("C++ extension is not built")
    gen = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(torch.zeros(32, 256))
    beta2, steps = 0.999, 1000
    with backend_context(backend):
        opt = FusedAdam([p], lr=1e-3, betas=(0.9, beta2), moment_format=moment_format)
        p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        first = opt.get_unscaled_state(p, "exp_avg_sq").double()
        p.grad = torch.zeros_like(p)
        for _ in range(steps - 1):
            opt.step()
        last = opt.get_unscaled_state(p, "exp_avg_sq").double()
    ratio = (last / (first * beta2 ** (steps - 1))).reshape(-1)
    standard_error = ratio.std().item() / ratio.numel() ** 0.5
    assert abs(ratio.mean().item() - 1.0) < 5 * standard_error, \
        f"mean ratio {ratio.mean().item():.4f}, standard error {standard_error:.4f}"
    assert standard_error < 0.05  # a check that can fail: undecayed values give 2.7
