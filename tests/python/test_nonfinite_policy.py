"""What a non-finite gradient does, on the C++ path and on the torch path.

Policy, as implemented (there is no skip and no error: S3.8 leaves overflow handling to
the caller, e.g. GradScaler, and the step count advances as for any step, S2.8):

* The update is elementwise (S3.6): a NaN gradient element makes that element's
  exp_avg, exp_avg_sq, fp32 weight (master or parameter) and parameter NaN. A +-inf
  gradient element gives exp_avg = +-inf, exp_avg_sq = +inf and a NaN weight
  (inf / inf). fp8 E4M3 has no infinity: an infinite moment is stored as a NaN code
  (S2.4, as torch's conversion did up to 2.12). The damage is sticky: later finite
  steps keep that element NaN.
* Unscaled storage (fp32 / bf16 moments, fp32 masters, remainders): every other
  element, of that tensor and of every other parameter, is bitwise what it would have
  been had the bad element's gradient been finite.
* Scaled storage (fp16 / fp8 moments, fp16 masters): the absmax is not finite, so the
  whole tensor is stored with scale 1 (S2.3), from then on (the NaN stays). The other
  elements are then stored on the format's unscaled grid: values below its smallest
  subnormal flush to zero, and finite values above its largest finite value become inf
  (fp16, above 65504) or NaN (fp8, above 448). A single bad gradient element can thus
  corrupt finite elements of the same state tensor. This follows S2.3 to the letter;
  it is a hazard of the rule, not of the implementation, and is tested as such below.
  Other tensors keep their own scales and are not affected.
* The NaN bit patterns (sign, payload) are not part of the policy, and only "is NaN"
  is checked for the update's own NaNs. One rule is (S2.4): a NaN rounded to bf16
  keeps its sign, on both paths alike (the last test).
"""

import math
import struct

import pytest
import torch

from _optimizer_testing import (
    MASTER_FORMATS, MOMENT_FORMATS, SCALE_TARGET, SCALED_FORMATS, TORCH_DTYPE, Hyper,
    Precision, adam_reference, assert_close_bounded, capture_inputs, fp32_emulated_step,
    e4m3_codes, fused_adam, quantize_like_spec, scale_of, stored_bound, true_state,
    verify_step)


def _float_of_bits(bits):
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# "nan-ones": the NaN a GPU produces (all payload bits set), as a CUDA-computed
# gradient brings it; a remainder split of its own bits would round the parameter to
# -0 (S2.5 splits a NaN master as the quiet NaN).
BAD_VALUES = {"nan": math.nan, "nan-ones": _float_of_bits(0x7FFFFFFF),
              "-nan-ones": _float_of_bits(0xFFFFFFFF), "inf": math.inf,
              "-inf": -math.inf}
BAD = 3  # flat index of the poisoned gradient element
SHAPE = (7,)

UNSCALED = [
    Precision(),
    Precision(param="fp32", exp_avg="bf16", exp_avg_sq="bf16"),
    Precision(param="bf16", master="fp32"),
    Precision(param="bf16", grad="fp32", master="rem"),
    Precision(param="fp16", exp_avg="bf16", exp_avg_sq="fp32", master="fp32"),
    Precision(param="bf16", master="none"),
]


def hyper(adam_w_mode=True):
    """The settings build() passes (betas and eps are FusedAdam's defaults, S1.1)."""
    return Hyper(lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                 adam_w_mode=adam_w_mode)


def build(cfg, adam_w_mode=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPE[cfg.param]
    params = [torch.nn.Parameter((torch.randn(SHAPE, generator=generator) + 2).to(dtype))
              for _ in range(2)]
    opt = fused_adam()(params, **hyper(adam_w_mode).optimizer_kwargs(),
                       **cfg.optimizer_kwargs())
    return opt, params


def grads_for(cfg, params, step, bad=None, magnitude=1.0):
    """Finite gradients for `step`; with `bad`, element BAD of the first param's
    gradient is replaced by that value."""
    generator = torch.Generator().manual_seed(100 + step)
    grads = []
    for p in params:
        g = torch.randn(p.shape, generator=generator) * magnitude
        grads.append(g)
    if bad is not None:
        grads[0][BAD] = bad
    return [g.to(cfg.grad_dtype(p.dtype)) for g, p in zip(grads, params)]


def take_step(opt, cfg, params, grads):
    for p, g in zip(params, grads):
        if cfg.decoupled:
            p.decoupled_grad = g
        else:
            p.grad = g
    opt.step()


def values(opt, p):
    """Float64 param and true states (decoded, S2.2) of `p`."""
    out = {"param": p.detach().double()}
    for name in opt.state[p]:
        out[name] = true_state(opt, p, name)
    return out


def others(t):
    keep = torch.ones(t.numel(), dtype=torch.bool)
    keep[BAD] = False
    return t.reshape(-1)[keep]


def run_pair(cfg, bad, adam_w_mode=True, steps_after=2):
    """The same run twice, step 2 with and without the bad element; returns both
    optimizers and parameter lists after `steps_after` further finite steps."""
    runs = []
    for value in (bad, None):
        opt, params = build(cfg, adam_w_mode)
        take_step(opt, cfg, params, grads_for(cfg, params, 1))
        take_step(opt, cfg, params, grads_for(cfg, params, 2, bad=value))
        for step in range(3, 3 + steps_after):
            take_step(opt, cfg, params, grads_for(cfg, params, step))
        runs.append((opt, params))
    return runs


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("bad", list(BAD_VALUES), ids=list(BAD_VALUES))
@pytest.mark.parametrize("cfg", UNSCALED, ids=lambda c: c.id)
@pytest.mark.parametrize("steps_after", [0, 2], ids=["at", "after"])
def test_unscaled_storage_confines_the_damage_to_the_element(
        backend, cfg, bad, adam_w_mode, steps_after):
    (opt, params), (clean, clean_params) = run_pair(cfg, BAD_VALUES[bad], adam_w_mode,
                                                    steps_after)
    assert [g["step"] for g in opt.param_groups] == [2 + steps_after]
    hit = values(opt, params[0])
    reference = values(clean, clean_params[0])
    for name, t in hit.items():
        # every other element: bitwise the clean run's (compared through float64,
        # which is exact for every storage format here)
        assert torch.equal(others(t), others(reference[name])), name
    bad_value = BAD_VALUES[bad]
    weight_names = ["param"] + [n for n in ("master_param",) if n in hit]
    for name in weight_names:
        assert math.isnan(hit[name].reshape(-1)[BAD].item()), name
    m = hit["exp_avg"].reshape(-1)[BAD].item()
    v = hit["exp_avg_sq"].reshape(-1)[BAD].item()
    if math.isnan(bad_value) or (steps_after and not adam_w_mode):
        # NaN in, or (L2) a later step adds wd times the NaN weight to the gradient
        assert math.isnan(m) and math.isnan(v)
    else:
        # inf in: beta * inf + finite stays inf at this and later (AdamW) steps
        assert m == bad_value and v == math.inf
    # the other parameter of the group is untouched by the bad element
    for name, t in values(opt, params[1]).items():
        assert torch.equal(t, values(clean, clean_params[1])[name]), f"param 1 {name}"


# Every scaled format in every state it may hold.
SCALED = ([(name, Precision(**{name: fmt})) for name in ("exp_avg", "exp_avg_sq")
           for fmt in SCALED_FORMATS if fmt in MOMENT_FORMATS]
          + [("master_param", Precision(param="bf16", master=fmt))
             for fmt in SCALED_FORMATS if fmt in MASTER_FORMATS])


def first_step_moments(grad):
    """The fp32 values u a first step from zero moments stores (S3.6), computed here."""
    g = grad.float()
    zero = torch.zeros_like(g)
    _, m, v = fp32_emulated_step(zero, zero, zero, g, hyper(), 1)
    return {"exp_avg": m, "exp_avg_sq": v}


def code_of(values32, fmt):
    """S2.4 storage of fp32 values at scale 1."""
    if fmt == "fp16":
        return values32.to(torch.float16)
    return e4m3_codes(values32)


@pytest.mark.parametrize("bad", list(BAD_VALUES), ids=list(BAD_VALUES))
@pytest.mark.parametrize("name,cfg", SCALED, ids=lambda x: x if isinstance(x, str)
                         else x.id)
def test_nonfinite_absmax_stores_the_whole_tensor_at_scale_one(backend, name, cfg, bad):
    # the bad step is the first one, from zero moments (S1.6), so the exact fp32 values
    # u it had to store are first_step_moments (S2.3: q = rne(u / 1))
    fmt = getattr(cfg, "master" if name == "master_param" else name)
    opt, params = build(cfg)
    grads = grads_for(cfg, params, 1, bad=BAD_VALUES[bad])
    inputs = capture_inputs(opt, params)
    take_step(opt, cfg, params, grads)
    stored = opt.state[params[0]][name]
    assert scale_of(opt, params[0], name).item() == 1.0
    if name != "master_param":
        # (the fp16 master starts from a scaled copy of the parameter, so its exact u
        # is not this simple; its scale is checked alone)
        expected = code_of(first_step_moments(grads[0])[name], fmt)
        assert torch.equal(others(stored), others(expected))
    assert math.isnan(true_state(opt, params[0], name).reshape(-1)[BAD].item()) or (
        fmt == "fp16" and name != "master_param"
        and math.isinf(true_state(opt, params[0], name).reshape(-1)[BAD].item()))
    # the other parameter keeps a regular S2.3 scale: its largest code is R exactly,
    # so its largest true value is exactly scale * R (exact in float64: an 11-bit R
    # times a 24-bit fp32 scale), not a neighbouring code
    other = scale_of(opt, params[1], name).item()
    target = SCALE_TARGET[fmt]
    assert other != 1.0
    assert true_state(opt, params[1], name).abs().max().item() == other * target
    if name != "master_param":
        # codes and scale of the exact u as S2.3/S2.4 prescribe
        codes, scale = quantize_like_spec(first_step_moments(grads[1])[name], fmt)
        assert other == scale
        assert torch.equal(opt.state[params[1]][name], codes)
    # and the whole step of the other parameter (moments, master, param, every scale:
    # check_scale / stored_bound) against the float64 reference from its own inputs
    verify_step(opt, params[1:], inputs[1:], grads[1:], hyper(), 1,
                f"{cfg.id} other param")


@pytest.mark.parametrize("fmt", SCALED_FORMATS)
def test_scale_one_lets_large_finite_elements_overflow(backend, fmt):
    """The hazard of S2.3's scale 1: a finite element of the same state tensor whose
    value exceeds the format's range is stored as inf (fp16) or NaN (fp8), and one
    below its smallest subnormal as zero."""
    cfg = Precision(exp_avg=fmt, exp_avg_sq=fmt)
    opt, params = build(cfg)
    grads = grads_for(cfg, params, 1)
    big, small = 0, 1
    grads[0][big] = 3e4  # exp_avg 0.1 * 3e4 = 3e3 (> 448), exp_avg_sq 1e-3 * 9e8
    grads[0][small] = 1e-6  # exp_avg_sq 1e-15: below both formats' subnormals
    grads[0][BAD] = math.nan
    before = capture_inputs(opt, params)[0]
    take_step(opt, cfg, params, grads)
    # the fp32 values u the step had to store
    exact = first_step_moments(grads[0])
    for name in ("exp_avg", "exp_avg_sq"):
        # S2.3 with s = 1, S2.4: every other element is u rounded once to the format,
        # bit for bit (overflow to inf / NaN and flush to zero included)
        u = exact[name]
        assert torch.equal(others(opt.state[params[0]][name]), others(code_of(u, fmt))), \
            name
    m = true_state(opt, params[0], "exp_avg").reshape(-1)
    v = true_state(opt, params[0], "exp_avg_sq").reshape(-1)
    if fmt == "fp16":
        # fits fp16: within half an fp16 spacing at scale 1 (1.0 at 3e3) of the
        # float64 reference
        at = slice(big, big + 1)
        ref = adam_reference(before.w[at], before.m[at], before.v[at],
                             grads[0][at].double(), hyper(), 1)
        assert_close_bounded(m[at], ref.m, stored_bound("fp16", m[at], ref.m,
                                                        ref.m_bound, 1.0),
                             "exp_avg of the big element (fp16, scale 1)")
        assert v[big].item() == math.inf
    else:
        assert math.isnan(m[big].item()) and math.isnan(v[big].item())
    assert v[small].item() == 0.0
    # without the NaN, the same values are stored finitely with a proper S2.3 scale
    clean, clean_params = build(cfg)
    grads[0][BAD] = 0.5
    inputs = capture_inputs(clean, clean_params)
    take_step(clean, cfg, clean_params, grads)
    assert bool(torch.isfinite(true_state(clean, clean_params[0], "exp_avg_sq")).all())
    # v[big] (1e-3 * 9e8) is the absmax: stored as the code R exactly (check_scale),
    # every element within the format's rounding at its scale (stored_bound)
    verify_step(clean, clean_params, inputs, grads, hyper(), 1, f"{fmt} clean run")
    stored = clean.state[clean_params[0]]["exp_avg_sq"]
    big_code = stored.reshape(-1)[big:big + 1]
    assert torch.equal(big_code, code_of(torch.tensor([SCALE_TARGET[fmt]]), fmt))


_NAN_BITS = (0x7FC00000, 0xFFC00000, 0x7FF00000, 0xFFF00000, 0x7F800001, 0xFF800001,
             0x7FFFFFFF, 0xFFFFFFFF)


def test_bf16_rounding_keeps_a_nans_sign():
    """S2.4: NaN stays NaN with its sign. torch's CPU conversion to bf16 stores every NaN
    as 0xFFFF (negative); the torch path's rounding (``_codecs.bf16_encode``) makes it
    quiet with its sign and top payload bits, as the C++ core does (convert-inl.h
    F32ToBF16), and rounds every other value as torch does."""
    from shardadam import _codecs

    finite = torch.tensor([1.0, -2.5, 3.0e38, -1e-40, 0.0, -0.0, math.inf, -math.inf,
                           1.00390625, 1.01171875])
    nans = torch.tensor(_NAN_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([finite, nans]).repeat(5)  # long enough for torch's vectorised loop
    got = _codecs.bf16_encode(x).view(torch.int16).to(torch.int32) & 0xFFFF
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    want = torch.where(torch.isnan(x), (bits | 0x00400000) >> 16,
                       x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF)
    assert torch.equal(got.to(torch.int64), want)
    assert torch.equal(got[torch.isnan(x)] >> 15, (bits[torch.isnan(x)] >> 31).to(got.dtype))


def test_a_nan_master_splits_as_the_quiet_nan_with_its_sign():
    """S2.5 on the torch path (``_codecs.split_remainder``, also what a conversion to
    remainders uses): every NaN master, whatever its payload (0x7F800001's high half
    alone would read as inf), splits into the bf16 quiet NaN with its sign and a zero
    remainder, so the parameter is NaN and the pair rebuilds a NaN."""
    from shardadam import _codecs

    nans = torch.tensor(_NAN_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    high, low = _codecs.split_remainder(nans.repeat(3))
    signs = (torch.tensor(_NAN_BITS) >> 31).repeat(3)
    want = torch.where(signs == 1, 0xFFC0, 0x7FC0)
    assert torch.equal(high.view(torch.int16).to(torch.int64) & 0xFFFF, want)
    assert torch.equal(low, torch.zeros_like(low))
    assert torch.isnan(_codecs.merge_remainder(high, low)).all()


@pytest.mark.parametrize("master", ["fp32", "remainder"])
@pytest.mark.parametrize("moments", ["bf16", "block8"])
@pytest.mark.parametrize("sign", [1, -1], ids=["+nan", "-nan"])
def test_bf16_param_and_moments_keep_a_nans_sign_on_both_paths(sign, moments, master):
    """A NaN loaded into one element's exp_avg is stored with its sign (bf16 moments: it
    was torch's 0xFFFF) and reaches the master; the bf16 parameter (and bf16 moments)
    rounded from an fp32 master, or split from a NaN master with its remainder (S2.5:
    the quiet NaN with the master's sign), store the same bits on the C++ and torch
    paths, a NaN of the master's sign (the torch path stored 0xFFFF for a positive one)."""
    from _optimizer_testing import backend_context, have_core

    if not have_core():
        pytest.skip("the C++ core is not built")
    options = (dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
               if moments == "bf16" else dict(moment_format="block8"))
    runs = {}
    for backend in ("auto", "torch"):
        param = torch.nn.Parameter(torch.linspace(-1, 1, 256).bfloat16())
        opt = fused_adam()([param], lr=1e-2, master_weights=True,
                           store_param_remainders=master == "remainder", **options)
        param.grad = torch.full((256,), 1e-3).bfloat16()
        opt.step()
        state = opt.state_dict()
        state["state"][0]["exp_avg"][BAD] = math.copysign(math.nan, sign)
        opt.load_state_dict(state)
        loaded = opt.get_unscaled_state(param, "exp_avg")[BAD]
        assert math.isnan(loaded.item()) and (loaded.view(torch.int32) < 0) == (sign < 0)
        with backend_context(backend):
            opt.step()
        stored = [param.detach()] + ([opt.state[param]["exp_avg"]] if moments == "bf16"
                                     else [])
        runs[backend] = [t.view(torch.int16).clone() for t in stored]
        if master == "remainder":  # the split NaN: the quiet NaN, sign as the loaded one's
            runs[backend].append(opt.state[param]["master_param"].clone())
            assert runs[backend][0][BAD].item() & 0xFFFF == (0xFFC0 if sign < 0 else 0x7FC0)
            continue
        master_value = opt.state[param]["master_param"][BAD]
        assert math.isnan(master_value.item())
        for t in runs[backend]:
            assert (t[BAD] < 0) == (master_value.view(torch.int32) < 0), backend
    for got, want in zip(runs["torch"], runs["auto"]):
        assert torch.equal(got, want)
