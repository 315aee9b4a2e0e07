"""FusedAdam(moment_format="block8" / "block4", moment_block_size=B) (S2.11, S2.12): the
keywords and their errors, the stored layout (uint8 codes shaped like the local
parameter, 4-bit ones packed along the last dimension, one fp32 scale per block
touched), every parameter / master option, the C++ core against the torch path, and
checkpoints: state_dict -> load gives back the same codes and scales, and a resumed run
continues bitwise like the one that never stopped."""

import re

import numpy as np
import pytest
import torch

from _optimizer_testing import (
    assert_bitwise_equal, assert_same_optimizer_state, assert_unchanged, backend_context,
    block4_oracle, block8_decode, fp4_value, fp8_block_oracle, have_core, snapshot,
    ufp4_value)
from shardadam import FusedAdam, _formats

# Partial blocks, tiny, empty; for block4 also rows that cannot be packed (1-D, odd).
SHAPES = [(6, 300), (1000,), (3,), (0,), (2, 128), (5, 7), (4, 0)]
FAMILIES = ["block8", "block4"]
# parameter dtype, master options
OPTIONS = {
    "fp32": (torch.float32, {}),
    "bf16-master": (torch.bfloat16, dict(master_weights=True)),
    "bf16-remainder": (torch.bfloat16, dict(master_weights=True,
                                            store_param_remainders=True)),
    # No master: the parameter rounded stochastically (S2.14).
    "bf16-stochastic": (torch.bfloat16, dict(param_rounding="stochastic")),
}


def make(option="fp32", seed=0, shapes=SHAPES, **kwargs):
    dtype, extra = OPTIONS[option]
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    kwargs = {"moment_format": "block8", **extra, **kwargs}
    return FusedAdam(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, **kwargs), params


def blocks_touched(first: int, n: int, block: int) -> int:
    """S2.11's scale count, from its text: (f + n - 1) // B - f // B + 1, 0 when n = 0."""
    return 0 if n == 0 else (first + n - 1) // block - first // block + 1


def grads(params, step, seed=0):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    for i, p in enumerate(params):
        # magnitudes differing by row, so blocks get different scales
        scale = torch.pow(2.0, -(torch.arange(p.numel()) // 100 % 12).float())
        p.grad = (torch.randn(p.numel(), generator=gen) * scale).view(p.shape).to(p.dtype)


def run(opt, params, first, steps, seed=0):
    for step in range(first, first + steps):
        grads(params, step, seed)
        opt.step()


# --------------------------------------------------------------------------- API

def test_defaults_and_layout():
    """block8: exp_avg fp8-block, exp_avg_sq the zero-free map, 256 elements per scale;
    codes uint8 shaped like the parameter, scales 1-D, one per block."""
    opt, params = make()
    sq = _formats.moment_family("block8", None)[1]
    for p in params:
        formats = opt._formats[p]
        assert formats["exp_avg"] is _formats.FP8_BLOCK.with_block(256)
        assert formats["exp_avg_sq"] is sq and sq.scale_block == 256
        for name in ("exp_avg", "exp_avg_sq"):
            stored, scale = opt.state[p][name], opt._scales[p][name]
            assert stored.dtype == torch.uint8 and stored.shape == p.shape
            assert scale.dtype == torch.float32
            assert scale.shape == (blocks_touched(0, p.numel(), 256),)
    layout = opt.state_dict()["param_groups"][0]["state_layout"]
    assert layout == f"exp_avg=fp8-block:256 exp_avg_sq={sq.label} master=none"


def test_block4_packs_rows_and_falls_back_to_block8():
    """block4: tensors of two or more dimensions with an even last one hold fp4-block /
    ufp4-block codes packed two per byte along the last dimension, 128 per scale; the
    others hold block8's formats at the same block size (S2.11, S2.12)."""
    opt, params = make(moment_format="block4")
    for p in params:
        packable = p.dim() >= 2 and p.shape[-1] % 2 == 0
        formats = opt._formats[p]
        want = ((_formats.FP4_BLOCK, _formats.UFP4_BLOCK) if packable
                else (_formats.FP8_BLOCK, _formats.UFP8_BLOCK))
        for name, fmt in zip(("exp_avg", "exp_avg_sq"), want):
            assert formats[name] is fmt.with_block(128), (p.shape, name)
            stored, scale = opt.state[p][name], opt._scales[p][name]
            shape = (*p.shape[:-1], p.shape[-1] // 2) if packable else tuple(p.shape)
            assert stored.dtype == torch.uint8 and tuple(stored.shape) == shape
            assert scale.shape == (blocks_touched(0, p.numel(), 128),)
    layout = opt.state_dict()["param_groups"][0]["state_layout"]
    assert layout == "exp_avg=fp4-block:128 exp_avg_sq=ufp4-block:128 master=none"
    run(opt, params, 1, 2)
    state = opt.state_dict()["state"]
    for i, p in enumerate(params):  # exported as fp32 true values of the parameter's shape
        assert state[i]["exp_avg"].dtype == torch.float32
        assert state[i]["exp_avg"].shape == p.shape


@pytest.mark.parametrize("block", [128, 4096])
@pytest.mark.parametrize("moment_format", ["block8", "block4"])
def test_block_size_keyword(block, moment_format):
    """S2.11: both ends of [128, 4096] are taken, and a step goes through."""
    opt, params = make(moment_block_size=block, moment_format=moment_format)
    # 1800 / block, rounded up
    assert opt._scales[params[0]]["exp_avg"].shape == (blocks_touched(0, 1800, block),)
    assert opt._formats[params[0]]["exp_avg"].scale_block == block
    run(opt, params, 1, 2)
    assert opt.param_groups[0]["step"] == 2


@pytest.mark.parametrize("block", [0, 64, 100, 255, 8192, -256, np.int64(100)])
def test_bad_block_size_is_refused(block):
    with pytest.raises(ValueError, match=r"moment_block_size must be a power of two in "
                                         r"\[128, 4096\]"):
        make(moment_block_size=block)


@pytest.mark.parametrize("block", [256.0, True, "256", torch.tensor(256)])
def test_block_size_that_is_no_int_is_refused(block):
    with pytest.raises(ValueError, match=r"moment_block_size must be an int \(rule S2.11: "
                                         r"an int power of two in \[128, 4096\]"):
        make(moment_block_size=block)


def test_block_size_may_be_a_numpy_int():
    """As lr may be a numpy float: the blocks are the int's."""
    opt, params = make(moment_block_size=np.int64(128))
    assert opt._scales[params[0]]["exp_avg"].shape == (15,)
    assert opt._formats[params[0]]["exp_avg"].scale_block == 128


@pytest.mark.parametrize("kwargs,match", [
    (dict(moment_format="block2"), "unknown moment_format 'block2'"),
    (dict(moment_format=torch.uint8), "unknown moment_format"),
    (dict(moment_format="block8", exp_avg_dtype=torch.bfloat16),
     "exp_avg_dtype and exp_avg_sq_dtype"),
    (dict(moment_format="block8", exp_avg_sq_dtype=torch.uint8),
     "exp_avg_dtype and exp_avg_sq_dtype"),
    (dict(moment_format=None, moment_block_size=256), "needs a moment_format"),
    (dict(moment_format="block8", master_weights=True, master_weight_dtype=torch.float16),
     r"master_weight_dtype=torch.float16 is scaled per tensor .* \(rule S2.11"),
    (dict(moment_format="block4", master_weights=True, master_weight_dtype=torch.float16),
     r"moment_format='block4' steps in one pass per block"),
])
def test_bad_keywords_are_refused(kwargs, match):
    params = [torch.nn.Parameter(torch.randn(4))]
    with pytest.raises(ValueError, match=match):
        FusedAdam(params, **kwargs)


@pytest.mark.parametrize("missing", ["fp4-block", "ufp4-block", "ufp8-block"])
def test_format_the_build_lacks_is_refused(monkeypatch, missing):
    """A core built without a format block4 needs (its own pair, or block8's for the
    tensors it cannot pack) is refused by name at construction, and at step() of an
    optimizer made before, with nothing changed (S2.11)."""
    opt, params = make(moment_format="block4")
    run(opt, params, 1, 1)
    grads(params, 2)
    before = snapshot(opt, params)
    monkeypatch.setattr(_formats, "_UNAVAILABLE", frozenset({missing}))
    match = f"needs the '{missing}' format, which this build"
    with pytest.raises(ValueError, match=match):
        make(moment_format="block4")
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert_unchanged(opt, before)


def test_te_meanings_unchanged():
    """Without moment_format, torch.uint8 still means per-tensor fp8 (S2.2)."""
    p = torch.nn.Parameter(torch.randn(300))
    opt = FusedAdam([p], exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    assert opt._formats[p]["exp_avg"] is _formats.FP8
    assert opt._scales[p]["exp_avg"].shape == ()


@pytest.mark.parametrize("attribute,value,message", [
    ("moment_block_size", 100, r"moment_block_size must be a power of two in \[128, 4096\]"),
    ("moment_format", "block3", r"unknown moment_format 'block3' \(rule: moment_format in"),
    ("exp_avg_dtype", torch.bfloat16,
     r"exp_avg_dtype and exp_avg_sq_dtype must stay at their default"),
    ("master_weight_dtype", torch.float16,
     r"master_weight_dtype=torch.float16 is scaled per tensor"),
])
def test_bad_setting_at_step_changes_nothing(attribute, value, message):
    """Settings changed after construction are checked at step() before anything is
    written (S3.1); an fp16 master beside block moments on bf16 parameters too."""
    opt, params = make("bf16-master", moment_format="block8")
    run(opt, params, 1, 2)
    grads(params, 3)
    setattr(opt, attribute, value)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert_unchanged(opt, before)


# Every method that creates, converts or exports state, called as a user would.
STATE_METHODS = {
    "state_dict": lambda opt, params, sd: opt.state_dict(),
    "load_state_dict": lambda opt, params, sd: opt.load_state_dict(sd),
    "add_param_group": lambda opt, params, sd: opt.add_param_group(
        {"params": [torch.nn.Parameter(torch.randn(300))]}),
    "initialize_state": lambda opt, params, sd: opt.initialize_state(params[0]),
    "get_unscaled_state": lambda opt, params, sd: opt.get_unscaled_state(params[0],
                                                                         "exp_avg"),
    "set_scaled_state": lambda opt, params, sd: opt.set_scaled_state(
        params[0], "exp_avg", torch.zeros(6, 300)),
}


@pytest.mark.parametrize("method", list(STATE_METHODS))
@pytest.mark.parametrize("attribute,value,message", [
    ("moment_block_size", 3, r"moment_block_size must be a power of two in \[128, 4096\]"),
    ("moment_block_size", 8192, r"moment_block_size must be a power of two"),
    ("moment_format", "block3", r"unknown moment_format 'block3' \(rule: moment_format in"),
])
def test_bad_setting_is_refused_by_every_state_method(method, attribute, value, message):
    """A setting changed after construction is checked by every method that would
    shape state by it, as by step(), before anything changes (S1.5, S2.11)."""
    opt, params = make()
    run(opt, params, 1, 2)
    sd = opt.state_dict()
    setattr(opt, attribute, value)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=message):
        STATE_METHODS[method](opt, params, sd)
    assert_unchanged(opt, before)


def test_bad_load_changes_nothing():
    opt, params = make()
    run(opt, params, 1, 2)
    sd = opt.state_dict()
    del sd["state"][1]["exp_avg_sq"]
    before = snapshot(opt)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        opt.load_state_dict(sd)
    assert_unchanged(opt, before)


# --------------------------------------------------------------------------- stepping

@pytest.mark.skipif(not have_core(), reason="C++ extension not built: one backend only")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_core_and_torch_path_agree_bitwise(option, family):
    """The core (S2.9 / S2.12 kernels) and the torch path (this package's codecs around
    torch ops) hold bitwise the same parameters, codes and scales after every step."""
    runs = {}
    for name in ("auto", "torch"):
        with backend_context(name):
            runs[name] = make(option, seed=1, moment_format=family)
    for step in range(1, 6):
        for name in ("auto", "torch"):
            with backend_context(name):
                run(*runs[name], step, 1, seed=1)
        assert_same_optimizer_state(runs["auto"][0], runs["torch"][0], runs["auto"][1],
                                    runs["torch"][1], f"{option}: step {step}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_state_dict_round_trip_restores_codes_and_scales(option, family):
    """state_dict() exports fp32 true values; loading them re-encodes exactly the codes
    and scales the core's steps stored."""
    opt, params = make(option, seed=2, moment_format=family)
    run(opt, params, 1, 4, seed=2)
    sd = opt.state_dict()
    for entry in sd["state"].values():
        assert entry["exp_avg"].dtype == torch.float32
        assert entry["exp_avg_sq"].dtype == torch.float32
    new_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    new_opt = FusedAdam(new_params, moment_format=family, **OPTIONS[option][1])
    new_opt.load_state_dict(sd)
    assert_same_optimizer_state(opt, new_opt, params, new_params, f"{option}: reloaded")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_save_load_continue_is_the_uninterrupted_run(option, family):
    straight, params = make(option, seed=3, moment_format=family)
    run(straight, params, 1, 8, seed=3)
    first, first_params = make(option, seed=3, moment_format=family)
    run(first, first_params, 1, 4, seed=3)
    sd = first.state_dict()
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    resumed = FusedAdam(resumed_params, moment_format=family, **OPTIONS[option][1])
    resumed.load_state_dict(sd)
    run(resumed, resumed_params, 5, 4, seed=3)
    assert_same_optimizer_state(straight, resumed, params, resumed_params,
                                f"{option}: resumed vs uninterrupted")


def test_other_layouts_convert_to_block8_and_back():
    """A checkpoint of another layout loads into block8 (its values re-encoded by S2.9),
    and a block8 one into fp32 moments (its decoded values, exactly); the expected
    codes and values are worked out here."""
    plain, params = make(moment_format=None, exp_avg_dtype=torch.bfloat16)
    run(plain, params, 1, 3)
    opt, _ = make(seed=0)
    opt.load_state_dict(plain.state_dict())
    p = opt.param_groups[0]["params"][0]
    want = plain.state[params[0]]["exp_avg"].float().reshape(-1)  # bf16: exact in fp32
    codes, scales = fp8_block_oracle(want, 0, 256)
    assert_bitwise_equal(opt.state[p]["exp_avg"].reshape(-1), codes, "re-encoded codes")
    assert_bitwise_equal(opt._scales[p]["exp_avg"], scales, "re-encoded scales")
    fp32, _ = make(moment_format=None)
    fp32.load_state_dict(opt.state_dict())
    q = fp32.param_groups[0]["params"][0]
    for name, unsigned in (("exp_avg", False), ("exp_avg_sq", True)):
        decoded = block8_decode(opt.state[p][name], opt._scales[p][name], 0, 256, unsigned)
        assert_bitwise_equal(fp32.state[q][name], decoded, f"decoded {name}")


def test_non_finite_gradient_gives_a_unit_scale_in_its_block_only():
    """S2.9: a block whose new values are not finite takes scale 1; the others keep
    theirs (the rest of the tensor is not thrown off)."""
    opt, params = make(shapes=[(1024,)])
    p = params[0]
    p.grad = torch.full((1024,), 1e-3)
    p.grad[600] = float("inf")
    opt.step()
    scales = opt._scales[p]["exp_avg"]
    assert scales[2].item() == 1.0
    assert all(s != 1.0 for i, s in enumerate(scales.tolist()) if i != 2)


@pytest.mark.parametrize("family,name", [("block8", "exp_avg"), ("block8", "exp_avg_sq"),
                                         ("block4", "exp_avg"), ("block4", "exp_avg_sq")])
@pytest.mark.parametrize("damage", ["missing", "nan", "inf", "zero", "short", "fp16",
                                    "strided"])
def test_codes_without_usable_scales_are_refused(damage, family, name):
    """Per-block codes whose scales are missing, non-finite, not positive, of the wrong
    shape or dtype, or not one contiguous array (the core writes them from their first)
    cannot be decoded: step() refuses them, naming the state and the rule, and changes
    nothing; so does every method that would read them."""
    opt, params = make(moment_format=family)
    run(opt, params, 1, 2)
    p = params[0]
    label = opt._formats[p][name].label
    scales = opt._scales[p]
    if damage == "missing":
        del scales[name]
    elif damage == "short":
        scales[name] = scales[name][:-1].clone()
    elif damage == "fp16":
        scales[name] = scales[name].half()
    elif damage == "strided":  # every block reading the first one's scale
        scales[name] = scales[name][:1].expand(scales[name].numel())
    else:
        value = {"nan": float("nan"), "inf": float("inf"), "zero": 0.0}[damage]
        scales[name] = scales[name].clone()
        scales[name][1] = value
    grads(params, 3)
    message = rf"group 0, param 0: state '{name}' holds {re.escape(label)} codes"
    if damage in ("nan", "inf", "zero"):
        message += (r" with scales that are not finite and positive \(rule S2.11: a scale "
                    r"is a finite value > 0\)")
    before = snapshot(opt)
    # Nor are they read: exported, they would be wrong values in a valid-looking
    # checkpoint. state_dict() after a settings change leaves the groups' recorded
    # layout as it was.
    opt.moment_block_size = 512
    for refused in (opt.state_dict, lambda: opt.get_unscaled_state(p, name)):
        with pytest.raises(RuntimeError, match=message):
            refused()
    opt.moment_block_size = None
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    assert_unchanged(opt, before)
    # A parameter that left its group and is added again keeps its state, read back.
    opt.param_groups.pop()
    before = snapshot(opt, params)
    with pytest.raises(RuntimeError, match=message):
        opt.add_param_group({"params": params})
    assert_unchanged(opt, before)


# Scaled moments per block and per tensor, for the tests of scales changed in place.
SCALED = {"block8": dict(moment_format="block8"),
          "fp8": dict(moment_format=None, exp_avg_dtype=torch.uint8,
                      exp_avg_sq_dtype=torch.uint8)}


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -0.5])
@pytest.mark.parametrize("family", ["block8", "fp8"])
def test_scale_changed_in_place_is_refused_on_every_cpu_path(family, value, backend):
    """A scale the optimizer holds, changed in place after a step (its plan stands):
    the CPU core checks every scale it reads, and the torch path does the same, in the
    same words, before anything is written (S2.11)."""
    if backend == "auto" and not have_core():
        pytest.skip("C++ extension not built")
    kwargs = SCALED[family]
    with backend_context(backend):
        opt, params = make(**kwargs)
        run(opt, params, 1, 2)
        p = params[1]
        scale = opt._scales[p]["exp_avg_sq"]
        which = "exp_avg_sq_scale[2]" if family == "block8" else "exp_avg_sq_scale"
        scale.view(-1)[2 if family == "block8" else 0] = value
        grads(params, 3)
        before = snapshot(opt)
        with pytest.raises(ValueError, match=(
                rf"group 0, param 1: {re.escape(which)} {value:.9g} is not a valid scale "
                rf"\(rule: a scale is a finite value > 0\)")):
            opt.step()
        assert_unchanged(opt, before)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("family", ["block8", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0], ids=["nan", "zero", "negative"])
def test_scale_changed_in_place_in_a_later_group_changes_no_group(family, backend, bad):
    """A step of several groups is one step (S3.1): with the gradients at the same
    addresses as at the last step (grad buffers), a scale of the second group changed
    in place to one that is not finite and positive (S2.3) is refused before the first
    group is stepped."""
    if backend == "auto" and not have_core():
        pytest.skip("C++ extension not built")
    kwargs = SCALED[family]
    with backend_context(backend):
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(2, 256, generator=gen)) for _ in range(2)]
        opt = FusedAdam([dict(params=params[:1]), dict(params=params[1:])], lr=1e-2,
                        **kwargs)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        for _ in range(2):
            opt.step()  # the same gradient tensors each time
        opt._scales[params[1]]["exp_avg"].view(-1)[0] = bad
        before = snapshot(opt)
        with pytest.raises(ValueError, match=rf"group 1, param 0: exp_avg_scale(\[0\])? "
                                             rf"{bad:g} is not a valid scale"):
            opt.step()
        assert_unchanged(opt, before)


def test_per_tensor_scale_changed_in_place_is_refused_before_a_conversion():
    """A setting changed after construction converts state when the next step binds its
    plan (S1.5); a per-tensor scale changed in place is refused before that, naming the
    state and the rule, and nothing is converted (S3.1)."""
    opt, params = make(moment_format=None, exp_avg_dtype=torch.uint8)
    run(opt, params, 1, 2)
    opt._scales[params[0]]["exp_avg"].fill_(float("nan"))
    opt.exp_avg_sq_dtype = torch.bfloat16  # converts every exp_avg_sq at the next step
    grads(params, 3)
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match=r"group 0, param 0: state 'exp_avg' holds fp8 "
                                           r"values with a scale of nan, which is not "
                                           r"finite and positive \(rule S2.3: a scale is a "
                                           r"finite value > 0\)"):
        opt.step()
    assert_unchanged(opt, before)


def test_other_layouts_load_into_block4_rounded_to_nearest():
    """A checkpoint of another layout loads into block4 re-encoded to nearest (S2.12;
    S2.13 rounds only a step's new moments stochastically): codes and scales are those
    of the test's own oracle, packed here. Exported again, block4's state holds the
    values S2.12's tables give its codes, decoded here."""
    plain, params = make(moment_format=None, exp_avg_dtype=torch.bfloat16)
    run(plain, params, 1, 3)
    opt, _ = make(moment_format="block4")
    opt.load_state_dict(plain.state_dict())
    p = opt.param_groups[0]["params"][0]  # 6 x 300: packed by rows, blocks of 128
    fp32, _ = make(moment_format=None)
    fp32.load_state_dict(opt.state_dict())
    q = fp32.param_groups[0]["params"][0]
    for name, fmt, value in (("exp_avg", "fp4-block", fp4_value),
                             ("exp_avg_sq", "ufp4-block", ufp4_value)):
        assert opt._formats[p][name].label == f"{fmt}:128"
        want = plain.state[params[0]][name].float().reshape(-1)  # bf16, fp32: exact
        codes, scales = block4_oracle(fmt, want, 0, 128)
        packed = codes[0::2] | (codes[1::2] << 4)  # element 2i in the low nibble
        assert_bitwise_equal(opt.state[p][name].reshape(-1), packed, f"{name} codes")
        assert_bitwise_equal(opt._scales[p][name], scales, f"{name} scales")
        table = torch.tensor([value(c) for c in range(16)], dtype=torch.float64)
        decoded = table[codes.long()] * scales.double().repeat_interleave(128)[:codes.numel()]
        assert_bitwise_equal(fp32.state[q][name].reshape(-1), decoded.float(),
                             f"{name} exported")


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_past_the_overflow_bound_take_scale_one(family):
    """S2.9's overflow rule at the top of fp32: a block whose new largest magnitude
    reaches its format's overflow bound (its code would decode past the largest fp32)
    takes scale 1 and stores the NaN code there, as a non-finite block does; a block
    just below keeps its power-of-two scale, and decodes finite. The C++ core and the
    torch path store the same bits, and the scales are the test's oracle's."""
    if not have_core():
        pytest.skip("C++ extension not built")
    over = {"block8": 1.9375, "block4": 1.75}[family] * 2.0 ** 127  # exp_avg's map
    g = torch.randn(3, 256, generator=torch.Generator().manual_seed(9))
    g[0, 5] = over  # reaches the bound
    g[1, 7] = -torch.nextafter(torch.tensor(over), torch.tensor(0.0)).item()  # just below
    runs = []
    for backend in ("auto", "torch"):
        with backend_context(backend):
            p = torch.nn.Parameter(torch.zeros(3, 256))
            # beta1 = 0: exp_avg is the gradient itself, exactly
            opt = FusedAdam([p], lr=1e-3, betas=(0.0, 0.95), moment_format=family,
                            moment_block_size=256 if family == "block8" else 128)
            p.grad = g.clone()
            opt.step()
            runs.append((opt, p))
    (core, p), (torch_path, q) = runs
    assert_same_optimizer_state(core, torch_path, [p], [q], "core vs torch path")
    fmt = core._formats[p]["exp_avg"]
    oracle = fp8_block_oracle if family == "block8" else (
        lambda u, first, block: block4_oracle("fp4-block", u, first, block))
    _, scales = oracle(g.reshape(-1), 0, fmt.scale_block)
    assert_bitwise_equal(core._scales[p]["exp_avg"], scales, "exp_avg scales")
    per_row = 256 // fmt.scale_block
    assert core._scales[p]["exp_avg"][0].item() == 1.0  # row 0's first block: the bound
    assert core._scales[p]["exp_avg"][per_row].item() > 2.0 ** 118  # row 1: just below
    value = core.get_unscaled_state(p, "exp_avg")
    assert torch.isnan(value[0, 5]) and bool(torch.isfinite(value[1]).all())


def test_te_state_methods_round_trip():
    """get_unscaled_state gives the decoded fp32 values; set_scaled_state of those
    values stores the same codes and scales again (S5.2, S5.3)."""
    opt, params = make()
    run(opt, params, 1, 3)
    for p in params:
        for name in ("exp_avg", "exp_avg_sq"):
            codes = opt.state[p][name].clone()
            scales = opt._scales[p][name].clone()
            value = opt.get_unscaled_state(p, name)
            assert_bitwise_equal(value, block8_decode(codes, scales, 0, 256,
                                                      name == "exp_avg_sq"), f"{name} decoded")
            opt.set_scaled_state(p, name, value)
            assert_bitwise_equal(opt.state[p][name], codes, f"{name} codes")
            assert_bitwise_equal(opt._scales[p][name], scales, f"{name} scales")


def test_pickled_optimizer_continues_bitwise():
    """A pickled optimizer keeps its block formats (at their block size) and goes on
    exactly like the original."""
    import pickle

    opt, params = make(moment_block_size=512)
    run(opt, params, 1, 2)
    copy_opt = pickle.loads(pickle.dumps(opt))
    copy_params = [p for group in copy_opt.param_groups for p in group["params"]]
    assert copy_opt._formats[copy_params[0]]["exp_avg"] is \
        _formats.FP8_BLOCK.with_block(512)
    run(opt, params, 3, 2)
    run(copy_opt, copy_params, 3, 2)
    assert_same_optimizer_state(opt, copy_opt, params, copy_params, "pickled")


def test_pickled_optimizer_keeps_its_scales_beside_a_loaded_extra_key():
    """A loaded state may keep a key of its own (S5.5), even one named like a scale;
    pickling the optimizer keeps it as that key and leaves the scales alone (only a
    pickle from before the optimizer kept its scales apart moves such keys)."""
    import pickle

    source, source_params = make()
    run(source, source_params, 1, 2)
    sd = source.state_dict()
    sd["state"][0]["exp_avg_scale"] = torch.full((8,), 0.5)
    opt, params = make()
    opt.load_state_dict(sd)
    copy_opt = pickle.loads(pickle.dumps(opt))
    copy_params = [p for group in copy_opt.param_groups for p in group["params"]]
    assert_bitwise_equal(copy_opt._scales[copy_params[0]]["exp_avg"],
                         opt._scales[params[0]]["exp_avg"], "scales after pickling")
    assert_bitwise_equal(copy_opt.state[copy_params[0]]["exp_avg_scale"],
                         torch.full((8,), 0.5), "the extra key")
    assert_bitwise_equal(copy_opt.get_unscaled_state(copy_params[0], "exp_avg"),
                         source.get_unscaled_state(source_params[0], "exp_avg"),
                         "exp_avg after pickling")


def test_recorded_layouts_read_back():
    """A recorded block8 layout reads back as block8 at its block size; a mismatched
    or block-less one is no layout."""
    from shardadam._state import StateConfig

    config = StateConfig.from_record("exp_avg=fp8-block:512 exp_avg_sq=ufp8-block:512 "
                                     "master=remainder")
    assert (config.moment_format, config.moment_block_size) == ("block8", 512)
    assert config.store_param_remainders and config.master_weights
    for bad in ("exp_avg=fp8-block:512 exp_avg_sq=ufp8-block:256 master=none",
                "exp_avg=fp8-block exp_avg_sq=ufp8-block master=none",
                "exp_avg=ufp8-block:256 exp_avg_sq=ufp8-block:256 master=none",
                "exp_avg=fp8-block:0 exp_avg_sq=ufp8-block:0 master=none",
                # block sizes the optimizer cannot be set to (S2.11)
                "exp_avg=fp8-block:3 exp_avg_sq=ufp8-block:3 master=none",
                "exp_avg=fp8-block:64 exp_avg_sq=ufp8-block:64 master=none",
                "exp_avg=fp8-block:8192 exp_avg_sq=ufp8-block:8192 master=none",
                "exp_avg=fp8-block:384 exp_avg_sq=ufp8-block:384 master=none",
                "exp_avg=fp8-block:512 exp_avg_sq=fp8-block:512 master=none",
                # not as state_dict() writes them: a leading zero, other digits
                "exp_avg=fp8-block:0256 exp_avg_sq=ufp8-block:0256 master=none",
                "exp_avg=fp8-block:\u0662\u0665\u0666 exp_avg_sq=ufp8-block:\u0662\u0665\u0666 "
                "master=none"):
        with pytest.raises(ValueError, match=r"is not a state layout \(rule: .*B a power "
                                             r"of two in \[128, 4096\].*S5\.4\)"):
            StateConfig.from_record(bad)


def test_lone_refused_call_counts_no_group():
    """One C++ call refuses the step (a scale changed in place): the group stepped
    without gradients before it is not counted either (S2.8, S3.1)."""
    gen = torch.Generator().manual_seed(4)
    idle, busy = (torch.nn.Parameter(torch.randn(2, 256, generator=gen)) for _ in range(2))
    opt = FusedAdam([dict(params=[idle]), dict(params=[busy])], lr=1e-2,
                    moment_format="block8")
    busy.grad = torch.randn(busy.shape, generator=gen)
    opt.step()
    opt._scales[busy]["exp_avg"].view(-1)[0] = float("nan")
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"group 1, param 0: exp_avg_scale\[0\] nan"):
        opt.step()
    assert_unchanged(opt, before)
    assert [g["step"] for g in opt.param_groups] == [1, 1]
