"""block8 moments (S2.11) against a float64 Adam step written here, from the state
actually stored before each step. The bound of each stored moment element follows from
its map's step: E4M3 codes (exp_avg) round to within 2^-4 of the value (3 mantissa
bits) and below the normal range to within half a subnormal step, 2^-10 times the
block scale; unsigned E4M4 codes (exp_avg_sq) to within 2^-5 (4 mantissa bits), with an
absolute floor of one step, 2^-10 times the scale (zero-free: a value that would round
to 0 is stored as 2^-10·s). Before rounding, the fp32 arithmetic adds a few units of
2^-24, covered by a 2^-10 relative margin. The parameter stays fp32 and is held to
16 fp32 units of the step and the weight."""

import pytest
import torch

from shardadam import FusedAdam, _codecs, _formats

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.01
U = 2.0 ** -24
MARGIN = 1.0 + 2.0 ** -10
# (relative half step, absolute floor in units of the block scale) per map
BOUNDS = {"fp8-block": (2.0 ** -4, 2.0 ** -10), "ufp8-block": (2.0 ** -5, 2.0 ** -10)}


def decoded(opt, p, name):
    fmt = opt._formats[p][name]
    return fmt.decode(opt.state[p][name], opt._scales[p][name]).double(), fmt


def per_element_scale(opt, p, name):
    scales = opt._scales[p][name]
    fmt = opt._formats[p][name]
    index = _codecs._block_of_each(p.numel(), 0, fmt.scale_block, p.device)
    return scales[index].double().view(p.shape)


@pytest.mark.parametrize("block", [128, 256])
def test_block8_steps_stay_within_each_maps_rounding(block):
    gen = torch.Generator().manual_seed(block)
    p = torch.nn.Parameter(torch.randn(8, 256, generator=gen))
    opt = FusedAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                    moment_format="block8", moment_block_size=block)
    b1, b2 = BETAS
    for step in range(1, 11):
        # rows of very different magnitudes, and rare large entries
        g = torch.randn(p.shape, generator=gen) * torch.pow(
            2.0, -torch.arange(8.0) * 3).view(8, 1)
        g[torch.rand(p.shape, generator=gen) < 0.01] *= 50.0
        p.grad = g
        m0, _ = decoded(opt, p, "exp_avg")
        v0, _ = decoded(opt, p, "exp_avg_sq")
        w0, g64 = p.detach().double().clone(), g.double()
        m = b1 * m0 + (1 - b1) * g64
        v = b2 * v0 + (1 - b2) * g64 * g64
        c1, c2 = 1 - b1 ** step, 1 - b2 ** step
        update = (m / c1) / ((v / c2).sqrt() + EPS)
        w = w0 * (1 - LR * WD) - LR * update
        opt.step()
        for name, want in (("exp_avg", m), ("exp_avg_sq", v)):
            got, fmt = decoded(opt, p, name)
            rel, floor = BOUNDS[fmt.name]
            bound = (torch.maximum(rel * want.abs(), floor * per_element_scale(opt, p, name))
                     * MARGIN + 8 * U * want.abs())
            err = (got - want).abs()
            worst = (err / bound).max().item()
            assert worst <= 1.0, f"step {step} {name} ({fmt.name}): error {worst:.3f} of bound"
            if fmt.name == "ufp8-block":
                assert bool((got[want > 0] > 0).all()), "a non-zero exp_avg_sq became 0"
        err_w = (p.detach().double() - w).abs()
        bound_w = 16 * U * (w.abs() + LR * update.abs()) + 2.0 ** -149
        assert bool((err_w <= bound_w).all()), f"step {step}: parameter off by " \
            f"{(err_w / bound_w).max().item():.2f} of its bound"


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
