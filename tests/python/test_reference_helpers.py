"""Checks of the test oracle itself (_optimizer_testing.py), against torch and against
first principles, so that a wrong helper cannot make the other tests pass or fail.
"""

import torch

from _optimizer_testing import (
    FP32_TINY, Hyper, adam_reference, assert_close_bounded, expected_scale, half_spacing,
    merge_remainder, quantize_like_spec, split_master)


def random_fp32(count, seed):
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(-2 ** 31, 2 ** 31, (count,), generator=generator,
                          dtype=torch.int64).to(torch.int32)
    values = words.view(torch.float32)
    return values[torch.isfinite(values)]


def test_remainder_split_and_merge_round_trip():
    """S2.5: split then merge gives back every finite fp32 value bit for bit."""
    master = random_fp32(100_000, 0)
    param, remainder = split_master(master)
    assert param.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    rebuilt = merge_remainder(param, remainder)
    assert torch.equal(rebuilt.view(torch.int32), master.view(torch.int32))


def test_remainder_param_is_round_half_away_of_the_master():
    """S2.5: the bf16 param is the master's high half, plus one when the low half is
    >= 0x8000: round to nearest with ties away from zero. Away from ties (and from the
    overflow to infinity at the top) that is torch's round to nearest even."""
    master = random_fp32(100_000, 1)
    low = master.view(torch.int32) & 0xFFFF
    param, _ = split_master(master)
    rne = master.to(torch.bfloat16)
    comparable = (low != 0x8000) & torch.isfinite(rne.float())
    assert torch.equal(param[comparable].view(torch.int16),
                       rne[comparable].view(torch.int16))
    # Ties, which random words almost never are: high halves even and odd, both signs,
    # a subnormal and the largest finite (whose tie rounds away to infinity). In
    # sign-magnitude bits, away from zero is the high half plus one.
    highs = torch.tensor([0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0001, 0x8001, 0x7F7F, 0xFF7F,
                          0x4049, 0x404A], dtype=torch.int64)
    ties = ((highs << 16) | 0x8000).to(torch.int32).view(torch.float32)
    param, _ = split_master(ties)
    expected = ((highs + 1) & 0xFFFF).to(torch.int32).to(torch.int16)
    assert torch.equal(param.view(torch.int16), expected)


def test_half_spacing_matches_neighbours():
    """Half the gap to the next representable value, for every positive finite value
    of the 16-bit formats and fp8, and for random fp32 values."""
    for fmt, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        values = torch.arange(1, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
        values = values.double()
        finite = torch.isfinite(values)
        values = values[finite]
        gaps = values[1:] - values[:-1]
        assert torch.equal(half_spacing(fmt, values[:-1]), gaps / 2), fmt
    codes = torch.arange(1, 127, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).double()
    assert torch.equal(half_spacing("fp8", values[:-1]), (values[1:] - values[:-1]) / 2)
    x = random_fp32(10_000, 2).abs()
    x = x[x < torch.finfo(torch.float32).max]
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    assert torch.equal(half_spacing("fp32", x), (up.double() - x.double()) / 2)


def test_expected_scale_on_hand_checkable_values():
    """S2.3 with R = 32752 (fp16) and 448 (fp8)."""
    assert expected_scale(torch.tensor([-448.0, 3.0]), "fp8") == 1.0
    assert expected_scale(torch.tensor([32752.0 * 4]), "fp16") == 4.0
    assert expected_scale(torch.tensor([0.0, -0.0]), "fp16") == 1.0
    assert expected_scale(torch.zeros(0), "fp8") == 1.0
    assert expected_scale(torch.tensor([1.0, float("nan")]), "fp8") == 1.0
    assert expected_scale(torch.tensor([1e-40]), "fp16") == FP32_TINY
    codes, scale = quantize_like_spec(torch.tensor([896.0, -1.0]), "fp8")
    assert scale == 2.0
    assert codes.view(torch.float8_e4m3fn).float().tolist() == [448.0, -0.5]


def test_reference_bound_holds_for_torch_fused_kernels():
    """The derived fp32 bound of adam_reference() holds for an independent fp32
    implementation (torch's fused CPU Adam/AdamW), over inputs of many magnitudes."""
    generator = torch.Generator().manual_seed(3)
    n = 20_000
    for adam_w_mode in (True, False):
        hyper = Hyper(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                      adam_w_mode=adam_w_mode)
        fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
        w = torch.randn(n, generator=generator) * 3
        m, v = torch.zeros(n), torch.zeros(n)
        for step in range(1, 21):
            scale = 10.0 ** torch.randint(-6, 3, (n,), generator=generator)
            g = torch.randn(n, generator=generator) * scale
            ref = adam_reference(w.double(), m.double(), v.double(), g.double(), hyper,
                                 step)
            fused([w], [g], [m], [v], [], [torch.tensor(float(step))], lr=hyper.lr,
                  beta1=hyper.betas[0], beta2=hyper.betas[1],
                  weight_decay=hyper.weight_decay, eps=hyper.eps, amsgrad=False,
                  maximize=False)
            what = f"torch fused, adam_w_mode={adam_w_mode}, step {step}"
            assert_close_bounded(w, ref.w, ref.w_bound, f"{what}: param")
            assert_close_bounded(m, ref.m, ref.m_bound, f"{what}: exp_avg")
            assert_close_bounded(v, ref.v, ref.v_bound, f"{what}: exp_avg_sq")
