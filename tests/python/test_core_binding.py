"""The C++ extension ``shardadam._C`` on raw buffers (no optimizer in between).

Covers the binding's constants and info(), the storage codecs against torch's own
``.to()`` (exhaustively for 16-bit and 8-bit formats), the S2.3 scale, and adam_step
against the float64 reference of _optimizer_testing.py for every dtype preset, against
``torch._fused_adamw_`` / ``torch._fused_adam_`` for fp32, across thread counts, and its
validation (ValueError, nothing written).
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardadam
from shardadam import _codecs, _formats
from _optimizer_testing import (
    FP32_TINY, MOMENT_FORMATS, SCALE_TARGET, SCALED_FORMATS, adam_reference,
    assert_bitwise_equal, assert_close_bounded, check_scale, decode_codes, e4m3_codes,
    expected_scale, fp32_emulated_step, Hyper, near_ties, stored_bound)
from _slot_buffers import (
    BAD_HYPER, CODE, COLUMNS, NAMES_TENSOR_1, NULL_CASES, PRESETS, STORAGE, Buffers,
    assert_guards_intact, bad_slots, embed_buffers, embedded, make_bad_call, preset_id)

_C = pytest.importorskip("shardadam._C", reason="C++ extension shardadam._C is not built")


def test_dtype_tags_and_columns():
    assert (_C.DTYPE_NONE, _C.DTYPE_FLOAT32, _C.DTYPE_FLOAT16, _C.DTYPE_BFLOAT16,
            _C.DTYPE_FLOAT8_E4M3, _C.DTYPE_INT16_REMAINDER) == (0, 1, 2, 3, 4, 5)
    assert _C.SLOT_COLUMNS == COLUMNS


def test_slot_columns_are_named_and_the_package_places_values_by_name():
    """The rows these tests write (_slot_buffers.Buffers.row) follow the names the
    extension exports; the package places each value by those names, and refuses an
    extension whose columns or tags it does not know."""
    import types

    from shardadam import _slots

    assert tuple(_C.SLOT_COLUMN_NAMES) == (
        "numel", "param", "param_dtype", "grad", "grad_dtype", "exp_avg", "exp_avg_dtype",
        "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_dtype", "exp_avg_sq_scale",
        "master_param", "master_dtype", "master_scale", "first_index", "scale_block",
        "exp_avg_rounding", "rounding_key", "param_rounding", "exp_avg_sq_rounding")
    tags = {name: getattr(_C, name) for name in dir(_C) if name.startswith("DTYPE_")}
    permuted = tuple(reversed(_C.SLOT_COLUMN_NAMES))
    columns = _slots.columns_of(types.SimpleNamespace(SLOT_COLUMN_NAMES=permuted, **tags))
    assert columns == {name: i for i, name in enumerate(permuted)}
    for names in (_C.SLOT_COLUMN_NAMES[:-1], _C.SLOT_COLUMN_NAMES[:-1] + ("grad",),
                  _C.SLOT_COLUMN_NAMES[:-1] + ("master_scales",)):
        with pytest.raises(ImportError, match="rebuild the extension"):
            _slots.columns_of(types.SimpleNamespace(SLOT_COLUMN_NAMES=names, **tags))
    with pytest.raises(ImportError, match="rebuild the extension"):
        _slots.columns_of(types.SimpleNamespace(SLOT_COLUMN_NAMES=_C.SLOT_COLUMN_NAMES,
                                                **dict(tags, DTYPE_FLOAT16=3)))


def test_info():
    info = _C.info()
    assert {"version", "simd_target", "supported_targets", "default_threads",
            "thread_runtime", "cuda"} <= set(info)
    # One version: the header's (version.h), which the build gives the core, the
    # package's metadata and so shardadam.__version__.
    header = (Path(__file__).resolve().parents[2] / "csrc" / "include" / "shardadam"
              / "version.h").read_text()
    parts = [re.search(rf"^#define SHARDADAM_VERSION_{part} (\d+)$", header, re.M).group(1)
             for part in ("MAJOR", "MINOR", "PATCH")]
    assert info["version"] == ".".join(parts) == shardadam.__version__
    assert info["simd_target"] in info["supported_targets"].split(), info
    assert isinstance(info["default_threads"], int) and info["default_threads"] >= 1
    assert isinstance(info["cuda"], bool)
    runtime = info["thread_runtime"]
    assert runtime == "pool" or runtime.startswith("openmp:"), runtime


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the ELF symbols")
def test_module_exports_none_of_the_core():
    """The core is built with hidden visibility: the module's dynamic symbols hold
    nothing of it, so another copy of the core in the process (a C++ consumer's own
    shared library) never binds to this one, nor this one to it."""
    listed = subprocess.run(["nm", "-D", "--defined-only", _C.__file__],
                            capture_output=True, text=True, check=True).stdout
    exported = [line for line in listed.splitlines() if "9shardadam" in line]
    assert listed.strip() and not exported, exported[:5]


# --------------------------------------------------------------------------------------
# Codecs (S2.4): bit for bit with torch's .to(), NaN stays NaN.

UNSCALED_MOMENTS = [fmt for fmt in MOMENT_FORMATS if fmt not in SCALED_FORMATS]


def convert(src, src_fmt, dst_fmt, scale=1.0, threads=2):
    dst = torch.empty(src.shape, dtype=STORAGE[dst_fmt])
    _C.convert(src.data_ptr(), CODE[src_fmt], dst.data_ptr(), CODE[dst_fmt], src.numel(),
               scale, threads)
    return dst


def assert_same_codes(actual, expected, what, nan_bits_matter=False):
    """Bitwise equality; NaN outputs only need to be NaN unless `nan_bits_matter`
    (torch itself returns different NaN patterns for bf16 depending on the code path,
    so S2.4's "NaN stays NaN" is the rule there)."""
    if not nan_bits_matter and actual.is_floating_point():
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
        actual = torch.where(nan, torch.zeros_like(actual), actual)
        expected = torch.where(nan, torch.zeros_like(expected), expected)
    assert_bitwise_equal(actual, expected, what)


def all_16bit(dtype):
    return torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)


def random_fp32_bits(count, seed):
    """Uniform random 32-bit patterns: every binade, subnormals, Inf and NaN included."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 31, 2 ** 31, (count,), generator=generator,
                         dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_decode_all_16bit_patterns(fmt):
    codes = all_16bit(STORAGE[fmt])
    assert_same_codes(convert(codes, fmt, "fp32"), codes.float(), f"{fmt} -> fp32")


def test_decode_all_fp8_codes():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).float()
    assert_same_codes(convert(codes, "fp8", "fp32"), expected, "fp8 -> fp32")


def bf16_encode_inputs():
    """Every bf16 value widened to fp32 with low halves that round down, tie (to even
    both ways) and round up, plus random fp32 patterns."""
    high = all_16bit(torch.int16).to(torch.int64) & 0xFFFF
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    words = (high[:, None] << 16 | lows[None, :]).reshape(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return torch.cat([words.view(torch.float32), random_fp32_bits(200_000, 1)])


def fp16_encode_inputs():
    """Every fp16 value, the midpoints between neighbours (ties), values one fp32 ulp
    either side of them, beyond-max values, and random fp32 patterns."""
    values = all_16bit(torch.float16).float()
    values = values[torch.isfinite(values)].double().unique()
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32 (one more mantissa bit)
    mids32 = mids.float()
    near = torch.cat([torch.nextafter(mids32, torch.full_like(mids32, math.inf)),
                      torch.nextafter(mids32, torch.full_like(mids32, -math.inf))])
    edge = torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, 1e6, -65520.0, 2.0 ** -25,
                         2.0 ** -24, 3 * 2.0 ** -26, 2.0 ** -26, math.inf, -math.inf,
                         math.nan, -0.0, 0.0])
    return torch.cat([values.float(), mids32, near, edge, random_fp32_bits(200_000, 2)])


def fp8_encode_inputs():
    """All 256 code values, midpoints (ties) and neighbours, the overflow band up to and
    beyond 480 (NaN in E4M3 fn), subnormals, specials, random fp32 patterns, and
    random values in the format's range."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    finite = values[torch.isfinite(values)].double().unique()
    mids = ((finite[1:] + finite[:-1]) / 2).float()
    near = torch.cat([torch.nextafter(mids, torch.full_like(mids, math.inf)),
                      torch.nextafter(mids, torch.full_like(mids, -math.inf))])
    band = torch.linspace(440.0, 520.0, 321)
    edge = torch.tensor([464.0, -464.0, 479.99, 480.0, 1e30, 2.0 ** -10, 2.0 ** -9,
                         3 * 2.0 ** -11, 1e-30, 1e-45, math.inf, -math.inf, math.nan,
                         -math.nan, 0.0, -0.0])
    generator = torch.Generator().manual_seed(3)
    in_range = (torch.rand(100_000, generator=generator) * 2 - 1) * 500
    return torch.cat([values, mids, near, band, -band, edge, in_range,
                      random_fp32_bits(100_000, 4)])


@pytest.mark.parametrize("threads", [1, 3])
def test_encode_bf16_matches_torch(threads):
    x = bf16_encode_inputs()
    assert_same_codes(convert(x, "fp32", "bf16", threads=threads), x.to(torch.bfloat16),
                      "fp32 -> bf16")


@pytest.mark.parametrize("threads", [1, 3])
def test_encode_fp16_matches_torch(threads):
    x = fp16_encode_inputs()
    assert_same_codes(convert(x, "fp32", "fp16", threads=threads), x.to(torch.float16),
                      "fp32 -> fp16")


@pytest.mark.parametrize("threads", [1, 3])
def test_encode_fp8_matches_torch(threads):
    # fp8 E4M3 fn has exactly two NaN codes (0x7F | sign), S2.4.
    x = fp8_encode_inputs()
    expected = e4m3_codes(x)
    assert_same_codes(convert(x, "fp32", "fp8", threads=threads), expected, "fp32 -> fp8",
                      nan_bits_matter=True)


def test_torch_codec_encodes_fp8_as_the_reference():
    """The torch path's E4M3 encoder (S2.4: a tie rounds to even, 464 to 448, past it the
    NaN code with its sign, whatever torch's own conversion does there) on the same
    inputs as the core's."""
    from shardadam import _codecs

    x = fp8_encode_inputs()
    assert_same_codes(_codecs.e4m3_encode(x), e4m3_codes(x), "torch codec fp32 -> fp8",
                      nan_bits_matter=True)


@pytest.mark.parametrize("fmt", SCALED_FORMATS)
@pytest.mark.parametrize("scale", [2.0 ** -7, 0.3, 1e-30, 3.5e4, "near-ties"])
def test_scaled_codecs(fmt, scale):
    """For fp16/fp8 destinations the stored code is round(x / scale) (an fp32 division
    rounded to the format); reading multiplies by the scale in fp32 (adam.h Convert)."""
    if scale == "near-ties":
        x, scale = near_ties(fmt, 1 << 16, seed=5)
    else:
        generator = torch.Generator().manual_seed(5)
        x = torch.randn(5000, generator=generator) * scale * SCALE_TARGET[fmt] / 4
    scale_t = torch.tensor(scale, dtype=torch.float32)
    quotient = x / scale_t
    expected = (quotient.to(torch.float16) if fmt == "fp16"
                else e4m3_codes(quotient))
    stored = convert(x, "fp32", fmt, scale=scale)
    assert_same_codes(stored, expected, f"fp32 -> {fmt} / {scale}", nan_bits_matter=True)
    back = convert(stored, fmt, "fp32", scale=scale)
    assert_same_codes(back, decode_codes(expected).float() * scale_t,
                      f"{fmt} * {scale} -> fp32")


@pytest.mark.parametrize("src_fmt,dst_fmt", [
    ("bf16", "fp16"), ("fp16", "bf16"), ("fp8", "bf16"), ("bf16", "fp8"),
    ("fp16", "fp8"), ("fp8", "fp16"), ("bf16", "bf16"), ("fp32", "fp32")])
def test_cross_conversions_go_through_fp32(src_fmt, dst_fmt):
    """Any storage format to any other equals decoding to fp32 and encoding by S2.4."""
    if src_fmt == "fp8":
        src = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        as_fp32 = src.view(torch.float8_e4m3fn).float()
    elif src_fmt == "fp32":
        src = random_fp32_bits(10_000, 6)
        as_fp32 = src
    else:
        src = all_16bit(STORAGE[src_fmt])
        as_fp32 = src.float()
    if dst_fmt == "fp8":
        expected = e4m3_codes(as_fp32)
    else:
        expected = as_fp32.to(STORAGE[dst_fmt])
    assert_same_codes(convert(src, src_fmt, dst_fmt), expected, f"{src_fmt} -> {dst_fmt}",
                      nan_bits_matter=dst_fmt == "fp8")


# Quiet and signalling NaNs, each with either sign bit: the smallest and largest
# payloads, and the default quiet NaN.
SIGNED_NAN_BITS = (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF)


def assert_nans_with_signs_of(out, src, what):
    """Every element of the 16-bit ``out`` is a NaN whose sign bit is ``src``'s."""
    assert bool(torch.isnan(out.float()).all()), f"{what}: not all NaN: {out.float()}"
    signs = out.view(torch.int16) < 0
    expected = src.view(torch.int32) < 0
    assert torch.equal(signs, expected), \
        f"{what}: sign bits {signs.tolist()} != {expected.tolist()}"


@pytest.mark.parametrize("dst_fmt", ["bf16", "fp16"])
def test_fp32_nan_keeps_its_sign(dst_fmt):
    """S2.4: NaN stays NaN with its sign (its payload is not promised), on fp32 -> bf16
    and fp32 -> fp16, in the core's conversion and in the torch path's codecs. torch's
    own CPU conversion to bf16 turns every NaN negative, so .to() cannot be the oracle
    here: the sign bit of the input is. 37 copies reach the vector loops and the tail."""
    bits = torch.tensor(SIGNED_NAN_BITS, dtype=torch.int64).to(torch.int32)
    for copies in (1, 37):
        src = bits.repeat(copies).view(torch.float32)
        for threads in (1, 2):
            assert_nans_with_signs_of(convert(src, "fp32", dst_fmt, threads=threads), src,
                                      f"_C.convert fp32 -> {dst_fmt}, {threads} threads")
        fmt = _formats.by_name(dst_fmt)
        stored = torch.empty(src.shape, dtype=fmt.storage)
        scale = torch.full((), 2.0) if fmt.scaled else None
        fmt.encode(src, stored, scale)  # the torch path's store of a state (S2.3 too)
        assert_nans_with_signs_of(stored, src, f"torch path {dst_fmt} encode")
        if scale is not None:  # a non-finite value sets the scale to 1 (S2.3)
            assert scale.item() == 1.0
        if dst_fmt == "bf16":
            assert_nans_with_signs_of(_codecs.bf16_encode(src), src, "bf16_encode")
            random = torch.randint(0, 2 ** 32, src.shape, dtype=torch.int64,
                                   generator=torch.Generator().manual_seed(7))
            assert_nans_with_signs_of(_codecs.bf16_encode_stochastic(src, random), src,
                                      "bf16_encode_stochastic")


@pytest.mark.parametrize("fmt", UNSCALED_MOMENTS)
def test_scale_ignored_for_unscaled_formats(fmt):
    """adam.h: the scale applies to fp16 / fp8 ends only."""
    x = torch.randn(100)
    assert_same_codes(convert(x, "fp32", fmt, scale=4.0), x.to(STORAGE[fmt]),
                      f"fp32 -> {fmt} with scale 4")


@pytest.mark.parametrize("scale", [1e-50, 1e40])
def test_convert_names_a_scale_outside_fp32(scale):
    """A positive finite scale that fp32 cannot hold is refused with the value passed,
    not the 0 or inf it would round to; nothing is written."""
    src = torch.randn(8, generator=torch.Generator().manual_seed(0))
    dst = torch.full((8,), 7.0, dtype=torch.float16)
    before = dst.clone()
    with pytest.raises(ValueError, match=re.escape(f"scale {scale:g}") + ".*outside fp32"):
        _C.convert(src.data_ptr(), CODE["fp32"], dst.data_ptr(), CODE["fp16"], 8, scale, 1)
    assert_bitwise_equal(dst, before, "destination after a rejected convert")


def test_convert_empty():
    """numel 0 converts nothing, whatever the pointers (here: one element's buffers,
    which must stay untouched)."""
    src = torch.tensor([1.5])
    out = torch.full((1,), 7.0).bfloat16()
    _C.convert(src.data_ptr(), CODE["fp32"], out.data_ptr(), CODE["bf16"], 0, 1.0, 2)
    assert_bitwise_equal(out, torch.full((1,), 7.0).bfloat16(), "destination")
    assert_bitwise_equal(src, torch.tensor([1.5]), "source")


@pytest.mark.parametrize("src_fmt,dst_fmt", [("rem", "fp32"), ("fp32", "rem"),
                                             ("none", "fp32"), ("fp32", "none"),
                                             ("fp32", _formats.UFP4_BLOCK.tag), ("fp32", 99)])
def test_convert_rejects_non_casts(src_fmt, dst_fmt):
    src = torch.randn(8)
    dst = torch.full((8,), 7, dtype=torch.int16)
    before = dst.clone()
    dst_code = dst_fmt if isinstance(dst_fmt, int) else CODE[dst_fmt]
    named = "src_dtype" if src_fmt in ("rem", "none") else "dst_dtype"
    shown = {_formats.UFP4_BLOCK.tag: "ufp4-block", 99: "unknown"}.get(dst_fmt, ".*")
    with pytest.raises(ValueError,
                       match=rf"\b{named}\b \d+ \({shown}\) is not allowed for a conversion"):
        _C.convert(src.data_ptr(), CODE[src_fmt], dst.data_ptr(), dst_code, 8, 1.0, 1)
    assert_bitwise_equal(dst, before, "destination after a rejected convert")


# --------------------------------------------------------------------------------------
# S2.3 scale


def measure(values, fmt, threads=2):
    values = values.float().contiguous()
    return _C.measure_scale(values.data_ptr(), values.numel(), CODE[fmt], threads)


SCALE_CASES = {
    "random": torch.randn(1000) * 3,
    "negative-absmax": torch.tensor([0.5, -7.25, 3.0]),
    "zeros": torch.zeros(17),
    "empty": torch.zeros(0),
    "with-inf": torch.tensor([1.0, math.inf, 2.0]),
    "with-nan": torch.tensor([1.0, 2.0, math.nan]),
    "subnormal": torch.tensor([1e-40, -3e-41]),  # a / R < tiny: the floor applies
    "huge": torch.tensor([3e38, -1.0]),
    "one-element": torch.tensor([-0.125]),
}


@pytest.mark.parametrize("fmt", SCALED_FORMATS)
@pytest.mark.parametrize("case", list(SCALE_CASES))
def test_measure_scale_follows_s2_3(fmt, case):
    values = SCALE_CASES[case]
    expected = expected_scale(values, fmt)
    got = measure(values, fmt)
    assert got == expected, f"{case}: scale {got!r}, S2.3 gives {expected!r}"
    if case == "subnormal":
        assert got == FP32_TINY


@pytest.mark.parametrize("fmt", UNSCALED_MOMENTS)
def test_measure_scale_unscaled_formats_is_one(fmt):
    assert measure(torch.randn(50) * 1e5, fmt) == 1.0


def test_measure_scale_same_for_any_thread_count():
    values = torch.randn(300_001) * torch.rand(300_001)
    values[123_457] = -1234.5
    results = {measure(values, "fp8", threads) for threads in (1, 2, 3, 7)}
    assert results == {expected_scale(values, "fp8")}


# --------------------------------------------------------------------------------------
# adam_step


def adam_step(buffers, hyper, step, threads=2, lr=None):
    rows = [value for b in buffers for value in b.row()]
    beta1, beta2 = hyper.betas
    _C.adam_step(rows, hyper.lr if lr is None else lr, beta1, beta2, hyper.eps,
                 hyper.weight_decay, hyper.adam_w_mode, hyper.bias_correction, step,
                 threads)


def verify_buffers(b, before, hyper, step, what):
    """The tensor's new state against the float64 reference from `before` (bounds as
    derived in _optimizer_testing.py: fp32 arithmetic plus the storage's rounding)."""
    w, m, v = before
    ref = adam_reference(w, m, v, b.grad.double(), hyper, step)
    for name, value, bound in (("exp_avg", ref.m, ref.m_bound),
                               ("exp_avg_sq", ref.v, ref.v_bound)):
        fmt = b.formats[name]
        scale = b.scales[name].item() if name in b.scales else None
        stored = b.true(name)
        assert_close_bounded(stored, value, stored_bound(fmt, stored, value, bound, scale),
                             f"{what}: {name} ({fmt})")
        if scale is not None:
            check_scale(getattr(b, name), b.scales[name], value, bound, f"{what}: {name}")
    p_fmt = b.formats["param"]
    param = b.param.double()
    assert_close_bounded(param, ref.w, stored_bound(p_fmt, param, ref.w, ref.w_bound),
                         f"{what}: param")
    master_fmt = b.formats["master"]
    if master_fmt != "none":
        master = b.weight()
        scale = b.scales["master"].item() if "master" in b.scales else None
        assert_close_bounded(master, ref.w,
                             stored_bound(master_fmt, master, ref.w, ref.w_bound, scale),
                             f"{what}: master ({master_fmt})")
        if master_fmt == "fp32":
            assert_bitwise_equal(b.param, b.master.to(b.param.dtype),
                                 f"{what}: param vs rounded master")
        # A remainder's param needs no check of its own: every (bf16, int16) pair is
        # the split (S2.5) of exactly one fp32 master, so checking the merged master
        # above checks the param too.
        if scale is not None:
            check_scale(b.master, b.scales["master"], ref.w, ref.w_bound, f"{what}: master")


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("preset", PRESETS, ids=preset_id)
def test_adam_step_matches_float64_reference(preset, adam_w_mode):
    hyper = Hyper(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05,
                  adam_w_mode=adam_w_mode)
    buffers = [Buffers(preset, numel, seed)
               for seed, numel in enumerate((1, 31, 200, 4099))]
    for step in range(1, 7):
        for i, b in enumerate(buffers):
            b.new_grad(10.0 ** (i % 3 - 2))
        before = [(b.weight(), b.true("exp_avg"), b.true("exp_avg_sq")) for b in buffers]
        adam_step(buffers, hyper, step)
        for i, (b, start) in enumerate(zip(buffers, before)):
            verify_buffers(b, start, hyper, step,
                           f"{preset_id(preset)} step {step} tensor {i}")


def test_adam_step_without_bias_correction():
    hyper = Hyper(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0,
                  bias_correction=False)
    buffers = [Buffers(("fp32", "fp32", "fp32", "fp32", "none"), 64, 9),
               Buffers(("bf16", "bf16", "fp16", "fp8", "fp32"), 64, 10)]
    for step in range(1, 6):
        for b in buffers:
            b.new_grad()
        before = [(b.weight(), b.true("exp_avg"), b.true("exp_avg_sq")) for b in buffers]
        adam_step(buffers, hyper, step)
        for b, start in zip(buffers, before):
            verify_buffers(b, start, hyper, step, f"no bias correction step {step}")


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_fp32_step_within_ulps_of_torch_fused(adam_w_mode):
    """S3.7: from identical inputs each side is within the derived fp32 bound B of the
    exact step, so the two are within 2B of each other (a few ulps)."""
    hyper = Hyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                  adam_w_mode=adam_w_mode)
    ours = Buffers(("fp32", "fp32", "fp32", "fp32", "none"), 4099, 11)
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    for step in range(1, 11):
        ours.new_grad(10.0 ** (step % 4 - 2))
        p, m, v = ours.param.clone(), ours.exp_avg.clone(), ours.exp_avg_sq.clone()
        ref = adam_reference(p.double(), m.double(), v.double(), ours.grad.double(),
                             hyper, step)
        fused([p], [ours.grad], [m], [v], [], [torch.tensor(float(step))], lr=hyper.lr,
              beta1=hyper.betas[0], beta2=hyper.betas[1], weight_decay=hyper.weight_decay,
              eps=hyper.eps, amsgrad=False, maximize=False)
        adam_step([ours], hyper, step)
        for name, theirs, bound in (("param", p, ref.w_bound), ("exp_avg", m, ref.m_bound),
                                    ("exp_avg_sq", v, ref.v_bound)):
            assert_close_bounded(getattr(ours, name), theirs.double(), 2 * bound,
                                 f"step {step} {name} vs torch fused")


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("lr,betas,wd,bias_correction", [
    (1e-3, (0.9, 0.999), 0.1, True), (0.3, (0.8, 0.95), 0.01, True),
    (3e-4, (0.5, 0.9999), 0.0, True), (1e-2, (0.9, 0.99), 0.05, False)])
def test_fp32_step_bitwise_equals_emulation_with_exact_constants(lr, betas, wd,
                                                                 bias_correction,
                                                                 adam_w_mode):
    """S3.6 exactly, independently of the core's own constant code: the per-step
    scalars are the float64 formulas rounded once, and the element update rounds once
    per operation in the stated order -- bitwise, over steps up to where beta2^t
    underflows bias correction."""
    hyper = Hyper(lr=lr, betas=betas, eps=1e-8, weight_decay=wd, adam_w_mode=adam_w_mode,
                  bias_correction=bias_correction)
    b = Buffers(("fp32", "fp32", "fp32", "fp32", "none"), 1000, 13)
    for step in (1, 2, 3, 10, 1000, 20000, 10 ** 6):
        b.new_grad()
        want = fp32_emulated_step(b.param.clone(), b.exp_avg.clone(), b.exp_avg_sq.clone(),
                                  b.grad, hyper, step)
        adam_step([b], hyper, step)
        for name, expected in zip(("param", "exp_avg", "exp_avg_sq"), want):
            assert_bitwise_equal(getattr(b, name), expected, f"step {step} {name}")


@pytest.mark.parametrize("master", ["fp32", "rem"])
def test_bf16_master_run_equals_fp32_run_bitwise(master):
    """S3.7 on the core: the master of a bf16 param is bitwise the fp32 no-master run."""
    hyper = Hyper(lr=1.0, betas=(0.1, 0.25), weight_decay=0.01)
    plain = Buffers(("fp32", "fp32", "fp32", "fp32", "none"), 257, 12)
    plain.param = plain.param.to(torch.bfloat16).float()  # start on bf16 values
    mixed = Buffers(("bf16", "fp32", "fp32", "fp32", master), 257, 12)
    mixed.param = plain.param.to(torch.bfloat16)
    if master == "fp32":
        mixed.master = plain.param.clone()
    for step in range(1, 31):
        plain.new_grad()
        mixed.grad = plain.grad.clone()
        adam_step([plain], hyper, step)
        adam_step([mixed], hyper, step)
        assert_bitwise_equal(mixed.weight().float(), plain.param, f"step {step} master")
        if master == "fp32":
            assert_bitwise_equal(mixed.param, plain.param.to(torch.bfloat16),
                                 f"step {step} param")


@pytest.mark.parametrize("preset", [PRESETS[0], PRESETS[13], PRESETS[19], PRESETS[10]],
                         ids=preset_id)
def test_adam_step_bitwise_across_thread_counts(preset):
    """S3.7: bitwise identical for every thread count (sizes not multiples of any
    vector width or cache line, so work splits unevenly)."""
    results = []
    for threads in (1, 2, 3, 7, 0):  # 0: all hardware threads (adam.h)
        buffers = [Buffers(preset, numel, seed) for seed, numel in
                   enumerate((100_003, 7, 33_333))]
        hyper = Hyper()
        for step in range(1, 4):
            for b in buffers:
                b.new_grad()
            adam_step(buffers, hyper, step, threads=threads)
        results.append([t.clone() for b in buffers for t in b.everything()])
    for threads, result in zip((2, 3, 7, 0), results[1:]):
        for i, (a, b) in enumerate(zip(results[0], result)):
            assert_bitwise_equal(b, a, f"{threads} threads vs 1, buffer {i}")


@pytest.mark.parametrize("offset", [1, 3])
@pytest.mark.parametrize("preset", [PRESETS[0], PRESETS[10], PRESETS[13], PRESETS[19],
                                    PRESETS[7]], ids=preset_id)
def test_adam_step_unaligned_buffers_stay_in_bounds(preset, offset):
    """Buffers at addresses that are not vector-aligned (views into larger storage, as
    Megatron's flat buffers give) and of lengths that leave every kind of tail: the
    results equal those of freshly allocated buffers, bitwise, and nothing outside the
    buffers is written."""
    hyper = Hyper()
    numels = (1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 257, 1031)
    plain = [Buffers(preset, n, 40 + i) for i, n in enumerate(numels)]
    moved = [Buffers(preset, n, 40 + i) for i, n in enumerate(numels)]
    guarded = [g for b in moved for g in embed_buffers(b, offset)]
    for step in (1, 2, 3):
        for a, b in zip(plain, moved):
            a.new_grad()
            b.new_grad()
            b.grad, whole = embedded(b.grad, offset)
            guarded.append(("grad", whole, offset + b.grad.numel()))
        adam_step(plain, hyper, step, threads=2)
        adam_step(moved, hyper, step, threads=2)
        assert_guards_intact(guarded, f"step {step}")
        for i, (a, b) in enumerate(zip(plain, moved)):
            for j, (x, y) in enumerate(zip(a.everything(), b.everything())):
                assert_bitwise_equal(y, x, f"step {step} tensor {i} buffer {j}")


@pytest.mark.parametrize("dst_fmt", MOMENT_FORMATS)
def test_convert_unaligned_stays_in_bounds(dst_fmt):
    for numel in (1, 9, 33, 1027):
        src = torch.randn(numel)
        src_view, _ = embedded(src, 1)
        dst = torch.empty(numel, dtype=STORAGE[dst_fmt])
        dst_view, whole = embedded(dst, 3)
        _C.convert(src_view.data_ptr(), CODE["fp32"], dst_view.data_ptr(), CODE[dst_fmt],
                   numel, 0.5, 2)
        assert_guards_intact([("dst", whole, 3 + numel)], f"convert {numel}")
        expected = convert(src, "fp32", dst_fmt, scale=0.5)
        assert_bitwise_equal(dst_view, expected, f"convert {numel} unaligned")


def test_empty_tensor_slot():
    """numel 0 does nothing; the scale of an empty scaled state becomes 1 (S2.3)."""
    empty = Buffers(("bf16", "bf16", "fp16", "fp8", "fp32"), 0, 13)
    empty.scales["exp_avg"].fill_(4.0)
    empty.scales["exp_avg_sq"].fill_(0.25)
    full = Buffers(("fp32", "fp32", "fp32", "fp32", "none"), 10, 14)
    full.new_grad()
    before = (full.weight(), full.true("exp_avg"), full.true("exp_avg_sq"))
    adam_step([empty, full], Hyper(), 1)
    assert empty.scales["exp_avg"].item() == 1.0
    assert empty.scales["exp_avg_sq"].item() == 1.0
    verify_buffers(full, before, Hyper(), 1, "the non-empty tensor beside an empty one")


@pytest.mark.parametrize("preset", [PRESETS[0], PRESETS[6], PRESETS[14]], ids=preset_id)
def test_adam_step_keeps_fp32_subnormals(preset):
    """Gradients of magnitude 1e-20 to 2e-20 put (1 - beta2) * g * g, so the second
    moment, among fp32 subnormals (1e-42 to 4e-42, above the smallest 1.4e-45); with
    eps 0 the update divides by its root. Flushing subnormals to zero (FTZ / DAZ)
    would break the bound (it allows a few units of 2**-149 there) or divide by 0."""
    hyper = Hyper(lr=1e-3, betas=(0.9, 0.99), eps=0.0, weight_decay=0.0)
    b = Buffers(preset, 513, 50)
    for step in range(1, 4):
        magnitude = (1.0 + torch.rand(513, generator=b.generator)) * 1e-20
        sign = torch.where(torch.rand(513, generator=b.generator) < 0.5, -1.0, 1.0)
        b.grad = (sign * magnitude).to(b.grad.dtype)
        before = (b.weight(), b.true("exp_avg"), b.true("exp_avg_sq"))
        adam_step([b], hyper, step)
        verify_buffers(b, before, hyper, step, f"subnormal moments step {step}")
        if b.formats["exp_avg_sq"] == "fp32":
            v = b.exp_avg_sq
            assert bool(((v > 0) & (v < FP32_TINY)).any()), "no subnormal was exercised"


def test_lr_zero_is_a_real_step():
    """S3.8 on the core: lr == 0 leaves the weights alone but moves the moments."""
    b = Buffers(("fp32", "fp32", "fp32", "fp32", "none"), 50, 15)
    b.new_grad()
    param = b.param.clone()
    before = (b.weight(), b.true("exp_avg"), b.true("exp_avg_sq"))
    adam_step([b], Hyper(weight_decay=0.5), 1, lr=0.0)
    assert_bitwise_equal(b.param, param, "param after lr 0")
    verify_buffers(b, before, Hyper(lr=0.0, weight_decay=0.5), 1, "lr 0")


# --------------------------------------------------------------------------------------
# Validation: ValueError naming the tensor and the rule, nothing written (the tables
# are in _slot_buffers.py, shared with the CUDA binding's tests).


@pytest.mark.parametrize("case", bad_slots(), ids=[c[0] for c in bad_slots()])
def test_bad_slot_raises_and_writes_nothing(case):
    _, preset, overrides, pattern = case
    good, bad, rows = make_bad_call(preset, overrides)
    before = [t.clone() for b in (good, bad) for t in b.everything()]
    with pytest.raises(ValueError) as raised:
        _C.adam_step(rows, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1, 2)
    message = str(raised.value)
    # the slots alone (a step split into calls is checked as one list first)
    with pytest.raises(ValueError) as checked:
        _C.check_step_slots(rows, False)
    assert str(checked.value) == message
    # names the offending tensor (index 1 of the call) and the buffer/rule
    assert re.search(NAMES_TENSOR_1, message), message
    assert re.search(pattern, message, flags=re.IGNORECASE), message
    # ... and carries them as fields: the rule alone, the tensor by index
    error = raised.value
    assert (error.tensor_index, error.other_tensor_index) == (1, -1)
    assert message == f"tensor 1: {error.rule}" and "tensor" not in error.rule
    after = [t for b in (good, bad) for t in b.everything()]
    for i, (a, b) in enumerate(zip(after, before)):
        assert_bitwise_equal(a, b, f"buffer {i} after a rejected adam_step")


def test_overlap_refusal_names_both_tensors_by_index():
    """A rule about two tensors carries the second one's index beside the rule, where
    "{other}" stands for it: the package names both without reading the text."""
    first, second = (Buffers(("fp32", "fp32", "fp32", "fp32", "none"), 40, seed)
                     for seed in (31, 32))
    for b in (first, second):
        b.new_grad()
    columns = {name: i for i, name in enumerate(_C.SLOT_COLUMN_NAMES)}
    rows = first.row() + second.row()
    # tensor 1's param is tensor 0's exp_avg: same size, so it meets nothing else
    rows[COLUMNS + columns["param"]] = rows[columns["exp_avg"]]
    with pytest.raises(ValueError) as raised:
        _C.adam_step(rows, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1, 2)
    error = raised.value
    assert (error.tensor_index, error.other_tensor_index) == (1, 0)
    assert re.fullmatch(r"param \[.*\) overlaps \{other\}'s exp_avg \[.*", error.rule), \
        error.rule
    assert str(error) == "tensor 1: " + error.rule.replace("{other}", "tensor 0")


@pytest.mark.parametrize("case", BAD_HYPER, ids=[c[0] for c in BAD_HYPER])
def test_bad_hyper_parameter_raises_and_writes_nothing(case):
    _, change, pattern = case
    good = Buffers(("bf16", "bf16", "fp8", "fp16", "rem"), 40, 23)
    good.new_grad()
    before = [t.clone() for t in good.everything()]
    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                adam_w_mode=True, bias_correction=True, step=1, num_threads=2)
    args.update(change)
    with pytest.raises(ValueError, match=f"(?i){pattern}"):
        _C.adam_step(good.row(), **args)
    for i, (a, b) in enumerate(zip(good.everything(), before)):
        assert_bitwise_equal(a, b, f"buffer {i} after a rejected adam_step")


def test_slots_not_a_multiple_of_columns():
    good = Buffers(("fp32", "fp32", "fp32", "fp32", "none"), 8, 24)
    before = [t.clone() for t in good.everything()]
    with pytest.raises(ValueError, match=rf"not a multiple of {COLUMNS}\b"):
        _C.adam_step(good.row() + [1], 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1, 1)
    for a, b in zip(good.everything(), before):
        assert_bitwise_equal(a, b, "buffer after a rejected adam_step")


# Tags are int32 in the core; a wider int would wrap into a valid one.
TAG_COLUMNS = {"param_dtype": 2, "grad_dtype": 4, "exp_avg_dtype": 6,
               "exp_avg_sq_dtype": 9, "master_dtype": 12}


@pytest.mark.parametrize("tag", [2**32 + 1, -(2**32) + 1])
@pytest.mark.parametrize("column", list(TAG_COLUMNS))
def test_out_of_range_dtype_tag_raises_and_writes_nothing(column, tag):
    good = Buffers(("fp32", "fp32", "fp32", "fp32", "none"), 8, 24)
    good.new_grad()
    before = [t.clone() for t in good.everything()]
    row = good.row()
    row[TAG_COLUMNS[column]] = tag
    with pytest.raises(ValueError, match=f"tensor 0: {column} tag {tag} is out of range"):
        _C.adam_step(row, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1, 1)
    for a, b in zip(good.everything(), before):
        assert_bitwise_equal(a, b, "buffer after a rejected adam_step")


def test_convert_and_measure_scale_reject_unknown_tags():
    src, dst = torch.randn(8), torch.zeros(8)
    with pytest.raises(ValueError, match=r"dst_dtype tag 4294967297 is out of range"):
        _C.convert(src.data_ptr(), CODE["fp32"], dst.data_ptr(), 2**32 + 1, 8, 1.0, 1)
    assert_bitwise_equal(dst, torch.zeros(8), "destination after a rejected convert")
    for tag in (99, -1, 2**32 + 2):
        with pytest.raises(ValueError, match=f"measure_scale: dtype tag {tag} is not a"):
            _C.measure_scale(src.data_ptr(), 8, tag, 1)


# The child loads the extension file directly (no torch, so it starts fast) and owns
# its buffers through the array module.
_NULL_SCRIPT = r"""
import array, importlib.machinery, importlib.util, json, sys
path, column = sys.argv[1], int(sys.argv[2])
loader = importlib.machinery.ExtensionFileLoader("_C", path)
module = importlib.util.module_from_spec(importlib.util.spec_from_loader("_C", loader))
loader.exec_module(module)
bufs = [array.array("f", [1.0] * 16) for _ in range(4)]
ptrs = [b.buffer_info()[0] for b in bufs]
row = [16, ptrs[0], 1, ptrs[1], 1, ptrs[2], 1, 0, ptrs[3], 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
if column == 11:
    row[2], row[12] = 3, 1  # bf16 param (reads half of buffer 0), fp32 master
if column >= 0:
    row[column] = 0
try:
    module.adam_step(row, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1, 1)
    result = {"raised": None}
except Exception as e:
    result = {"raised": type(e).__name__, "message": str(e)}
result["unchanged"] = all(list(b) == [1.0] * 16 for b in bufs)
print(json.dumps(result))
"""


def run_null_child(column):
    done = subprocess.run([sys.executable, "-c", _NULL_SCRIPT, _C.__file__, str(column)],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, \
        f"child crashed (rc {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_null_buffer_harness_runs_a_step():
    """Control for the child process below: with every pointer valid it steps."""
    result = run_null_child(-1)
    assert result["raised"] is None and not result["unchanged"], result


@pytest.mark.parametrize("column", list(NULL_CASES.values()), ids=list(NULL_CASES))
def test_null_buffer_is_rejected_not_dereferenced(column):
    """Run in a child process: an unchecked null pointer would crash the interpreter."""
    result = run_null_child(column)
    assert result["raised"] == "ValueError", result
    assert re.search(r"(?i)null|missing|absent", result["message"]), result
    assert result["unchanged"], result


# S2.9 through the binding: per-block fp8 moments of a shard, keyed to its first_index.
FP8_BLOCK = 6


def s2_9_encode(u: torch.Tensor, first_index: int, block: int):
    """S2.9 written independently: per block of the whole parameter's flat index, the
    smallest power of two s (>= 2^-126) with max|u| / s <= 464, 1 for an all-zero-coding
    block; codes are S2.4's fp32 -> E4M3 of u / s."""
    codes = torch.empty(u.numel(), dtype=torch.uint8)
    scales = []
    start = 0
    while start < u.numel():
        end = min(u.numel(), ((first_index + start) // block + 1) * block - first_index)
        part = u[start:end].double()
        a = part.abs().max().item()
        s = 1.0
        if math.isfinite(a):
            e = -126
            while a / 2.0**e > 464:
                e += 1
            s = 2.0**e
        q = e4m3_codes((part / s).float())
        if bool(((q & 0x7F) == 0).all()):
            s = 1.0
            q = e4m3_codes(part.float())
        codes[start:end] = q
        scales.append(s)
        start = end
    return codes, torch.tensor(scales, dtype=torch.float32)


@pytest.mark.parametrize("first_index,numel,block", [(0, 1000, 128), (77, 3000, 256),
                                                      (4096 * 3 - 5, 9000, 4096)])
def test_per_block_fp8_moments_follow_s2_9(first_index, numel, block):
    """One step from zero moments: exp_avg = (1 - beta1) g and exp_avg_sq = (1 - beta2)
    g^2 in fp32, stored per block as S2.9 says, bit for bit; the fp32 param moves."""
    gen = torch.Generator().manual_seed(first_index + numel)
    # magnitudes over many binades, so blocks get different scales
    g = torch.randn(numel, generator=gen) * torch.pow(2.0, -torch.arange(numel) // 200 % 20)
    param = torch.randn(numel, generator=gen)
    before = param.clone()
    m, v = torch.zeros(numel, dtype=torch.uint8), torch.zeros(numel, dtype=torch.uint8)
    count = ((first_index + numel - 1) // block - first_index // block + 1)
    m_scales, v_scales = torch.ones(count), torch.ones(count)
    row = [numel, param.data_ptr(), CODE["fp32"], g.data_ptr(), CODE["fp32"],
           m.data_ptr(), FP8_BLOCK, m_scales.data_ptr(),
           v.data_ptr(), FP8_BLOCK, v_scales.data_ptr(), 0, 0, 0, first_index, block, 0, 0, 0,
           0]
    _C.adam_step(row, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1, 2)
    # The core's constants: 1 - beta in double, rounded to fp32 (S3.6); products in fp32.
    c1, c2 = torch.tensor(1 - 0.9), torch.tensor(1 - 0.999)
    want_m, want_m_scales = s2_9_encode(c1 * g, first_index, block)
    want_v, want_v_scales = s2_9_encode((c2 * g) * g, first_index, block)
    assert_bitwise_equal(m, want_m, "exp_avg codes")
    assert_bitwise_equal(m_scales, want_m_scales, "exp_avg block scales")
    assert_bitwise_equal(v, want_v, "exp_avg_sq codes")
    assert_bitwise_equal(v_scales, want_v_scales, "exp_avg_sq block scales")
    assert not torch.equal(param, before)


def test_per_block_scale_block_is_checked():
    g, param = torch.randn(256), torch.randn(256)
    m, v, scales = torch.zeros(256, dtype=torch.uint8), torch.zeros(256), torch.ones(2)
    before = [t.clone() for t in (param, m, v, scales)]
    row = [256, param.data_ptr(), CODE["fp32"], g.data_ptr(), CODE["fp32"],
           m.data_ptr(), FP8_BLOCK, scales.data_ptr(), v.data_ptr(), CODE["fp32"], 0,
           0, 0, 0, 0, 2**33,  # wider than int32: must not wrap into a valid size
           0, 0, 0, 0]
    with pytest.raises(ValueError, match=r"scale_block -1 is not a power of two") as raised:
        _C.adam_step(row, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1, 1)
    assert raised.value.tensor_index == 0
    for a, b in zip((param, m, v, scales), before):
        assert_bitwise_equal(a, b, "buffer after a rejected adam_step")


@pytest.mark.parametrize("rounding,key,param_rounding,match", [
    (1, 7, 0, r"exp_avg_rounding 1 \(stochastic\) is not allowed for an exp_avg_dtype"),
    (2, 7, 0, r"exp_avg_rounding 2 is not a rounding"),
    (2**32 + 1, 7, 0, r"exp_avg_rounding -1 is not a rounding"),
    (0, 2**32, 0, r"rounding_key 4294967296 is out of range"),
    (0, -1, 0, r"rounding_key -1 is out of range"),
    (0, 7, 1, r"param_rounding 1 \(stochastic\) is not allowed for a param_dtype 1 \(fp32\)"),
    (0, 7, -2**31 - 1, r"param_rounding -1 is not a rounding"),
    ((0, 1), 7, 0, r"exp_avg_sq_rounding 1 \(stochastic\) is not allowed for an "
                   r"exp_avg_sq_dtype 1 \(fp32\)"),
    ((0, 3), 7, 0, r"exp_avg_sq_rounding 3 is not a rounding"),
])
def test_rounding_columns_are_checked(rounding, key, param_rounding, match):
    """S2.13 and S2.14 through the binding: stochastic rounding only for an fp4-block
    exp_avg, a ufp4-block exp_avg_sq and a bf16 param with no master, known roundings, a
    uint32 key; each refusal names tensor 0 and writes nothing. ``rounding``: exp_avg's,
    or (exp_avg's, exp_avg_sq's)."""
    rounding, square_rounding = rounding if isinstance(rounding, tuple) else (rounding, 0)
    good = Buffers(("fp32", "fp32", "fp32", "fp32", "none"), 8, 25)
    good.new_grad()
    before = [t.clone() for t in good.everything()]
    row = good.row()
    columns = list(_C.SLOT_COLUMN_NAMES)
    for name, value in (("exp_avg_rounding", rounding), ("rounding_key", key),
                        ("param_rounding", param_rounding),
                        ("exp_avg_sq_rounding", square_rounding)):
        row[columns.index(name)] = value
    with pytest.raises(ValueError, match=match) as raised:
        _C.adam_step(row, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1, 1)
    assert raised.value.tensor_index == 0
    for a, b in zip(good.everything(), before):
        assert_bitwise_equal(a, b, "buffer after a rejected adam_step")
