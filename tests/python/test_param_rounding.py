"""S2.14: bf16 parameters with no master rounded stochastically (``FusedAdam(...,
param_rounding="stochastic")``). Checked against float64 ``torch.optim.AdamW``: the
stored parameters are unbiased where rounding to nearest stalls; the C++ core and the
torch path store the same bits; the bits follow the parameter's position, the step and
the element's index only, so a resumed run continues bitwise; bad settings are refused
with nothing changed."""

import pickle

import pytest
import torch

from _optimizer_testing import (
    assert_bitwise_equal, assert_same_optimizer_state, assert_unchanged, backend_context,
    have_core, snapshot)
from shardadam import FusedAdam, _codecs

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
SHAPES = [(64, 33), (1000,), (3,), (0,)]


def make(seed=0, rounding="stochastic", dtype=torch.bfloat16, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    return FusedAdam(params, param_rounding=rounding, **{**HYPER, **kwargs}), params


def run(opt, params, first, steps, seed=0):
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(seed * 1000 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def bf16_below_and_gap(x: float) -> tuple:
    """The bf16 value at or below positive ``x`` (as fp32) and the step to the next."""
    bits = torch.tensor([x], dtype=torch.float32).view(torch.int32) & ~0xFFFF
    low, high = bits.view(torch.float32).item(), (bits + 0x10000).view(torch.float32).item()
    return low, high - low


@pytest.mark.parametrize("steps", [1, 20])
def test_stochastic_params_track_float64_adamw(steps):
    """2^16 copies of one weight, 1.0, under the same gradient: each Adam step moves it
    by about lr = 1e-3, below half a bf16 step (2^-9). Rounded to nearest the weight
    never moves; rounded stochastically, after one step every stored value is one of
    the two bf16 values around the float64 AdamW weight, and after one or 20 steps
    their mean is that weight within five standard errors of the rounding
    (independent per step and element)."""
    n = 1 << 16
    reference = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
    adamw = torch.optim.AdamW([reference], weight_decay=0.0, **HYPER)
    runs = {}
    for rounding in ("stochastic", "nearest"):
        p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
        runs[rounding] = (FusedAdam([p], param_rounding=rounding, **HYPER), p)
    for _ in range(steps):
        reference.grad = torch.ones(1, dtype=torch.float64)
        adamw.step()
        for opt, p in runs.values():
            p.grad = torch.ones(n, dtype=torch.bfloat16)
            opt.step()
    want = reference.item()
    assert 1.0 - want > steps * 0.9e-3  # the weight moved
    stochastic = runs["stochastic"][1].detach().double()
    low, gap = bf16_below_and_gap(want)
    if steps == 1:  # one rounding: only the two values around the weight
        assert set(stochastic.unique().tolist()) <= {low, low + gap}
    standard_error = gap / 2 * (steps / n) ** 0.5
    assert abs(stochastic.mean().item() - want) < 5 * standard_error
    nearest = runs["nearest"][1].detach().double()
    assert torch.equal(nearest, torch.ones(n, dtype=torch.float64))  # stalled
    assert abs(nearest.mean().item() - want) > 100 * standard_error


@pytest.mark.skipif(not have_core(), reason="C++ extension not built: one backend only")
@pytest.mark.parametrize("moments", [dict(), dict(exp_avg_dtype=torch.bfloat16,
                                                  exp_avg_sq_dtype=torch.bfloat16),
                                     dict(exp_avg_dtype=torch.uint8,
                                          exp_avg_sq_dtype=torch.float16)])
def test_core_and_torch_path_agree_bitwise(moments):
    """The core's kernels and the torch path's rule (``_codecs.bf16_encode_stochastic``)
    store the same bits, step after step (block formats: test_block_moments_api)."""
    runs = {}
    for name in ("auto", "torch"):
        with backend_context(name):
            runs[name] = make(seed=1, **moments)
    for step in range(1, 5):
        for name in ("auto", "torch"):
            with backend_context(name):
                run(*runs[name], step, 1, seed=1)
        assert_same_optimizer_state(runs["auto"][0], runs["torch"][0], runs["auto"][1],
                                    runs["torch"][1], f"step {step}")


def test_bits_follow_position_and_step_only():
    """The same parameters and gradients store the same bits; the parameter's position
    in the optimizer keys them (another position, other bits), and they differ from
    rounding to nearest; an fp32 parameter beside them is stepped as without the
    option."""
    first, first_params = make(seed=2)
    again, again_params = make(seed=2)
    nearest, nearest_params = make(seed=2, rounding="nearest")
    for opt, params in ((first, first_params), (again, again_params),
                        (nearest, nearest_params)):
        run(opt, params, 1, 3, seed=2)
    for p, q, r in zip(first_params, again_params, nearest_params):
        assert_bitwise_equal(q.detach(), p.detach(), "same run")
    assert not torch.equal(first_params[0], nearest_params[0])

    # The first parameter moved to position 1 behind a new one: other keys.
    gen = torch.Generator().manual_seed(2)
    moved = [torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16)),
             torch.nn.Parameter(torch.randn(SHAPES[0], generator=gen).to(torch.bfloat16))]
    opt = FusedAdam(moved, param_rounding="stochastic", **HYPER)
    run(opt, [moved[1]], 1, 3, seed=2)  # the same gradients for it; none for moved[0]
    assert not torch.equal(moved[1], first_params[0])

    fp32 = {}
    for rounding in ("stochastic", "nearest"):
        opt, params = make(seed=3, rounding=rounding, dtype=torch.float32)
        run(opt, params, 1, 2, seed=3)
        fp32[rounding] = params
    for p, q in zip(*fp32.values()):
        assert_bitwise_equal(p.detach(), q.detach(), "fp32 parameter")


@pytest.mark.parametrize("backend_name", ["auto", "torch"])
def test_bits_follow_the_step(backend_name):
    """The step keys the random bits: without bias correction the step changes no
    arithmetic, so the same parameters, moments and gradients stepped from two counters
    round the same fp32 weights with other bits (most of 2,112 elements land alike,
    not all), and from the same counter with the same bits."""
    stored = []
    for counter in (4, 8, 8):
        with backend_context(backend_name):
            opt, params = make(seed=6, bias_correction=False)
            opt.param_groups[0]["step"] = counter
            run(opt, params, 1, 1, seed=6)
        stored.append(params[0].detach().clone())
    assert_bitwise_equal(stored[2], stored[1], "the same counter")
    differ = int((stored[0].view(torch.int16) != stored[1].view(torch.int16)).sum())
    assert 0 < differ < stored[0].numel() // 2, differ


def test_resume_continues_bitwise():
    """The bits depend on no state of the optimizer's own: a run saved after 3 steps
    and loaded into a new optimizer continues bitwise as the run that never stopped;
    so does a pickled one."""
    straight, params = make(seed=4)
    run(straight, params, 1, 6, seed=4)
    first, first_params = make(seed=4)
    run(first, first_params, 1, 3, seed=4)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    resumed = FusedAdam(resumed_params, param_rounding="stochastic", **HYPER)
    resumed.load_state_dict(first.state_dict())
    run(resumed, resumed_params, 4, 3, seed=4)
    assert_same_optimizer_state(straight, resumed, params, resumed_params, "resumed")

    pickled, pickled_params = pickle.loads(pickle.dumps((first, first_params)))
    assert pickled.param_rounding == "stochastic"
    run(pickled, pickled_params, 4, 3, seed=4)
    assert_same_optimizer_state(straight, pickled, params, pickled_params, "pickled")


@pytest.mark.parametrize("kwargs,match", [
    (dict(param_rounding="up"), r"unknown param_rounding 'up' \(rule: param_rounding in "
                                r"\['nearest', 'stochastic'\]\)"),
    (dict(param_rounding=None), r"unknown param_rounding None"),
    (dict(param_rounding="stochastic", master_weights=True),
     r"param_rounding='stochastic' rounds bf16 parameters that have no master, but "
     r"master_weights is True"),
])
def test_bad_options_are_refused(kwargs, match):
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=match):
        FusedAdam([p], **kwargs)


@pytest.mark.parametrize("attribute,value,error,match", [
    ("master_weights", True, ValueError, r"needs master_weights=False"),
    ("param_rounding", "down", ValueError, r"unknown param_rounding 'down'"),
])
def test_bad_setting_at_step_changes_nothing(attribute, value, error, match):
    """Settings changed after construction are checked at step() before anything is
    written (S1.5, S3.1)."""
    opt, params = make(seed=5)
    run(opt, params, 1, 2, seed=5)
    setattr(opt, attribute, value)
    for p in params:
        p.grad = torch.ones_like(p)
    before = snapshot(opt)
    with pytest.raises(error, match=match):
        opt.step()
    assert_unchanged(opt, before)


def test_fp16_parameter_is_refused_with_nothing_changed():
    """fp16 parameters have no stochastic rule: the step names the parameter and writes
    nothing, the bf16 parameter beside it included."""
    bf16 = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
    fp16 = torch.nn.Parameter(torch.randn(8).to(torch.float16))
    opt = FusedAdam([bf16, fp16], param_rounding="stochastic", **HYPER)
    for p in (bf16, fp16):
        p.grad = torch.ones_like(p)
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match=r"group 0, param 1.*is float16, and "
                                           r"param_rounding='stochastic' rounds bf16"):
        opt.step()
    assert_unchanged(opt, before)


def test_torch_rule_is_the_texts_on_random_bits():
    """S2.14's rule written here on Python integers, against ``bf16_encode_stochastic``
    for random values (every binade, both signs, bf16 values, inf, NaNs with payloads)
    and random bits: a NaN stores (b >> 16) | 0x40, anything else (b + (R >> 16)) >> 16."""
    gen = torch.Generator().manual_seed(14)
    bits = torch.randint(0, 2**32, (20000,), generator=gen, dtype=torch.int64)
    bits[:8] = torch.tensor([0x7F800000, 0xFF800000, 0x7FC00000, 0xFF800001, 0x7F800100,
                             0x3F800000, 0x00000000, 0x80000000])
    x = bits.to(torch.int32).view(torch.float32)  # wraps to the same 32 bits
    r = torch.randint(0, 2**32, bits.shape, generator=gen, dtype=torch.int64)
    got = _codecs.bf16_encode_stochastic(x, r).view(torch.int16).to(torch.int64) & 0xFFFF
    want = [((b >> 16) | 0x40) if (b & 0x7F800000) == 0x7F800000 and b & 0x7FFFFF
            else ((b + (k >> 16)) >> 16) & 0xFFFF
            for b, k in zip(bits.tolist(), r.tolist())]
    assert got.tolist() == want


def test_torch_rule_matches_its_definition():
    """``_codecs.bf16_encode_stochastic`` on the edges: a bf16 value keeps itself
    whatever the bits, the bits' high half decides between the two values around
    anything else, NaN stays NaN, inf stays inf."""
    x = torch.tensor([1.0, -2.5, 1.001, -1.001, float("inf"), -float("inf"),
                      float("nan"), 3.4e38, 0.0, -0.0], dtype=torch.float32)
    low = torch.full((x.numel(),), 0, dtype=torch.int64)
    high = torch.full((x.numel(),), 0xFFFF0000, dtype=torch.int64)
    down, up = (_codecs.bf16_encode_stochastic(x, r).float() for r in (low, high))
    assert_bitwise_equal(down[:2], x[:2], "bf16 values, low bits")
    assert_bitwise_equal(up[:2], x[:2], "bf16 values, high bits")
    assert down[2] < 1.001 < up[2] and down[2] == 1.0
    assert up[3] < -1.001 < down[3] and down[3] == -1.0
    assert down[4] == up[4] == float("inf") and down[5] == up[5] == -float("inf")
    assert torch.isnan(down[6]) and torch.isnan(up[6])
    assert up[7] == float("inf") and down[7] < float("inf")  # past bf16's largest
    assert_bitwise_equal(down[8:], x[8:], "zeros")
