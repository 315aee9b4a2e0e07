"""The precision matrix: every supported combination of parameter, gradient, moment
and master dtypes, against the float64 reference of _optimizer_testing.py.

Each configuration takes 7 steps, goes through state_dict() into a fresh optimizer
(S5.4, S5.5), and takes 7 more; every step of both runs is checked against the float64
step started from the decoded stored state, with the bound derived in
_optimizer_testing.py from fp32 arithmetic plus the storage format's rounding (for bf16
half a bf16 spacing; for fp16 / fp8 half the format's spacing at value / scale, times the
scale). The reference thus emulates the storage step by step: it starts every step from
the quantised state actually stored. The resumed run is compared with the uninterrupted
one (S5.6): bitwise where every state is fp32, bf16 or a remainder; for scaled states the
reloaded storage must be exactly S2.3 applied to the saved fp32 values, and where that
reproduces the saved storage the continuation must be bitwise too.
"""

import math

import pytest
import torch

from _optimizer_testing import (
    SCALE_TARGET, SCALED_FORMATS, SHAPES, Hyper, Precision, TORCH_DTYPE, adam_reference,
    assert_bitwise_equal, assert_close_bounded, assert_same_optimizer_state,
    backend_context, clone_params, decode_codes, fused_adam, have_core, make_params,
    quantize_like_spec, run_precision_steps, scale_of, storage_format, stored_bound,
    true_state)

MATRIX = [
    # bf16 parameters with an fp32 or fp16 master
    Precision(param="bf16", exp_avg="fp32", exp_avg_sq="fp32", master="fp32"),
    Precision(param="bf16", exp_avg="fp32", exp_avg_sq="fp32", master="fp16"),
    Precision(param="bf16", grad="fp32", exp_avg="fp32", exp_avg_sq="fp32", master="fp32"),
    # fp16 parameters
    Precision(param="fp16", exp_avg="fp32", exp_avg_sq="fp32", master="fp32"),
    Precision(param="fp16", exp_avg="fp16", exp_avg_sq="fp16", master="fp16"),
    Precision(param="fp16", grad="bf16", exp_avg="bf16", exp_avg_sq="fp8", master="none"),
    # low-precision parameters without a master
    Precision(param="bf16", exp_avg="fp32", exp_avg_sq="fp32", master="none"),
    Precision(param="bf16", exp_avg="bf16", exp_avg_sq="bf16", master="none"),
    # one moment at a time in each low precision (fp32 parameters)
    Precision(exp_avg="fp16"),
    Precision(exp_avg="bf16"),
    Precision(exp_avg="fp8"),
    Precision(exp_avg_sq="fp16"),
    Precision(exp_avg_sq="bf16"),
    Precision(exp_avg_sq="fp8"),
    # both moments low precision with a master
    Precision(param="bf16", exp_avg="bf16", exp_avg_sq="bf16", master="fp32"),
    Precision(param="bf16", exp_avg="fp8", exp_avg_sq="fp8", master="fp32"),
    Precision(param="bf16", exp_avg="fp16", exp_avg_sq="fp16", master="fp16"),
    # int16 remainders (S2.5)
    Precision(param="bf16", exp_avg="fp32", exp_avg_sq="fp32", master="rem"),
    Precision(param="bf16", grad="fp32", exp_avg="bf16", exp_avg_sq="bf16", master="rem"),
    Precision(param="bf16", exp_avg="fp8", exp_avg_sq="fp8", master="rem"),
    # fp32 parameters with low-precision gradients (decoupled_grad, S3.4)
    Precision(param="fp32", grad="bf16"),
    Precision(param="fp32", grad="fp16", exp_avg="bf16", exp_avg_sq="fp16"),
    # fp16 and bf16 parameters in one group (S1.4, beyond TE)
    Precision(param="fp16+bf16", exp_avg="fp32", exp_avg_sq="fp32", master="fp32"),
    Precision(param="fp16+bf16", grad="fp32", exp_avg="bf16", exp_avg_sq="fp8",
              master="fp16"),
    Precision(param="fp16+bf16", exp_avg="fp32", exp_avg_sq="fp32", master="none"),
]

# A few rows also run in L2 mode (adam_w_mode=False): the penalty enters the moments.
L2_ROWS = {MATRIX[0].id, MATRIX[4].id, MATRIX[10].id, MATRIX[19].id, MATRIX[23].id}

HYPER = Hyper(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def cases():
    for cfg in MATRIX:
        yield pytest.param(cfg, True, id=f"{cfg.id}-adamw")
        if cfg.id in L2_ROWS:
            yield pytest.param(cfg, False, id=f"{cfg.id}-l2")


def build(cfg, hyper, params):
    return fused_adam()(params, **hyper.optimizer_kwargs(), **cfg.optimizer_kwargs())


def check_initial_state(opt, params, cfg):
    """S1.6 / S2.1 / S2.2: every parameter has its configured state from construction:
    zero moments, the master seeded from the parameter (S2.3 storage for fp16), a zero
    remainder; scales only beside fp16 / fp8 storage; step 0."""
    assert opt.param_groups[0]["step"] == 0
    for i, p in enumerate(params):
        formats = cfg.state_formats(p.dtype)
        state = opt.state[p]
        names = {k for k in state if not k.endswith("_scale")}
        assert names == set(formats), f"param {i} ({p.dtype}): state names {sorted(state)}"
        for name, fmt in formats.items():
            has_scale = scale_of(opt, p, name) is not None
            assert has_scale == (fmt in SCALE_TARGET), \
                f"param {i} {name} ({fmt}): scale {'present' if has_scale else 'missing'}"
        for name, fmt in formats.items():
            stored = state[name]
            expected_dtype = torch.int16 if fmt == "rem" else TORCH_DTYPE[fmt]
            assert stored.dtype == expected_dtype, f"param {i} {name}: {stored.dtype}"
            assert stored.shape == p.shape, f"param {i} {name}: shape {stored.shape}"
            if name != "master_param":
                assert bool((decode_codes(stored) == 0).all()), f"param {i} {name} not zero"
                if fmt in SCALE_TARGET:
                    assert scale_of(opt, p, name).item() == 1.0
            elif fmt == "rem":
                assert bool((stored == 0).all()), f"param {i}: initial remainder not zero"
            else:
                codes, scale = quantize_like_spec(p.detach().float(), fmt)
                assert_bitwise_equal(stored, codes, f"param {i}: seeded master")
                if scale is not None:
                    assert scale_of(opt, p, "master_param").item() == scale


def check_state_dict_layout(opt, params, cfg, sd):
    """S5.4: torch's layout, exactly the configured names, fp32 true values (int16 for
    remainders), equal to get_unscaled_state."""
    assert sorted(sd) == ["param_groups", "state"]
    assert [g["params"] for g in sd["param_groups"]] == [list(range(len(params)))]
    assert sd["param_groups"][0]["step"] == opt.param_groups[0]["step"]
    assert type(sd["param_groups"][0]["step"]) is int
    assert sorted(sd["state"]) == list(range(len(params)))
    for i, p in enumerate(params):
        entry = sd["state"][i]
        formats = cfg.state_formats(p.dtype)
        assert set(entry) == set(formats), f"param {i}: saved names {sorted(entry)}"
        for name, fmt in formats.items():
            value = entry[name]
            assert isinstance(value, torch.Tensor)
            assert value.dtype == (torch.int16 if fmt == "rem" else torch.float32)
            assert_bitwise_equal(value, opt.get_unscaled_state(p, name),
                                 f"param {i}: saved {name} vs get_unscaled_state")


def check_reloaded(opt, new_opt, params, new_params, cfg, sd):
    """S5.5 right after load_state_dict: configured storage, step restored; fp32, bf16
    and remainder storage bitwise as saved; scaled storage is exactly S2.3 applied to
    the saved fp32 values (fresh scale). Returns whether the storage is bitwise that of
    the uninterrupted run."""
    assert new_opt.param_groups[0]["step"] == opt.param_groups[0]["step"]
    same = True
    for i, (p, q) in enumerate(zip(params, new_params)):
        for name, fmt in cfg.state_formats(p.dtype).items():
            old, new = opt.state[p][name], new_opt.state[q][name]
            assert new.dtype == old.dtype, f"param {i} {name}: reloaded as {new.dtype}"
            if fmt in SCALE_TARGET:
                codes, scale = quantize_like_spec(sd["state"][i][name], fmt)
                assert_bitwise_equal(new, codes, f"param {i} {name}: reloaded codes")
                new_scale = scale_of(new_opt, q, name)
                assert new_scale.item() == scale, f"param {i} {name}: reloaded scale"
                same = same and torch.equal(new, old) and torch.equal(
                    new_scale, scale_of(opt, p, name))
            else:
                assert_bitwise_equal(new, old, f"param {i} {name}: reloaded storage")
    return same


@pytest.mark.parametrize("cfg,adam_w_mode", list(cases()))
def test_precision_matrix(cfg, adam_w_mode, backend):
    """7 checked steps, state_dict -> fresh optimizer -> load_state_dict, 7 more checked
    steps on both the resumed and the uninterrupted optimizer (module docstring)."""
    hyper = Hyper(**{**HYPER.__dict__, "adam_w_mode": adam_w_mode})
    params = make_params(cfg.param_dtypes(len(SHAPES)), seed=1)
    opt = build(cfg, hyper, params)
    check_initial_state(opt, params, cfg)
    run_precision_steps(opt, params, cfg, hyper, 7, 1, seed=2, what=cfg.id)

    sd = opt.state_dict()
    check_state_dict_layout(opt, params, cfg, sd)
    new_params = clone_params(params)
    new_opt = build(cfg, hyper, new_params)
    new_opt.load_state_dict(sd)
    same_storage = check_reloaded(opt, new_opt, params, new_params, cfg, sd)
    if cfg.bitwise_round_trip:
        assert same_storage

    run_precision_steps(opt, params, cfg, hyper, 7, 8, seed=2, what=f"{cfg.id} continued")
    run_precision_steps(new_opt, new_params, cfg, hyper, 7, 8, seed=2,
                        what=f"{cfg.id} resumed")
    if same_storage:
        # S5.6: identical storage and gradients give an identical continuation.
        assert_same_optimizer_state(opt, new_opt, params, new_params,
                                    f"{cfg.id}: resumed vs uninterrupted")


@pytest.mark.skipif(not have_core(), reason="C++ extension not built: one backend only")
@pytest.mark.parametrize("cfg,adam_w_mode", list(cases()))
def test_backend_parity(cfg, adam_w_mode):
    """S7.2: the pure-torch path and the C++ path, fed the same gradients from the same
    start, hold bitwise the same params and state after every step (S3.6 fixes the
    order of operations and the fp32 constants, so there is one correct result), and
    their state access agrees bitwise too."""
    hyper = Hyper(**{**HYPER.__dict__, "adam_w_mode": adam_w_mode})
    runs = {}
    for name in ("auto", "torch"):
        with backend_context(name):
            params = make_params(cfg.param_dtypes(len(SHAPES)), seed=3)
            runs[name] = (build(cfg, hyper, params), params)
    (cpp, cpp_params), (ref, ref_params) = runs["auto"], runs["torch"]
    assert_same_optimizer_state(cpp, ref, cpp_params, ref_params, f"{cfg.id}: initial")
    for step in range(1, 8):
        for name in ("auto", "torch"):
            opt, params = runs[name]
            with backend_context(name):
                run_precision_steps(opt, params, cfg, hyper, 1, step, seed=4, what=name,
                                    check=False)
        assert_same_optimizer_state(cpp, ref, cpp_params, ref_params,
                                    f"{cfg.id}: after step {step}")
    for i, (p, q) in enumerate(zip(cpp_params, ref_params)):
        for name in cfg.state_formats(p.dtype):
            with backend_context("auto"):
                a = cpp.get_unscaled_state(p, name)
            with backend_context("torch"):
                b = ref.get_unscaled_state(q, name)
            assert_bitwise_equal(a, b, f"{cfg.id}: param {i} get_unscaled_state({name})")
    sd = {}
    for name in ("auto", "torch"):
        opt, params = runs[name]
        with backend_context(name):
            sd[name] = opt.state_dict()
            fresh = build(cfg, hyper, clone_params(params))
            fresh.load_state_dict(sd["auto"])
            runs[name] = (fresh, [p for p in fresh.param_groups[0]["params"]])
    for index, entry in sd["auto"]["state"].items():
        for key, value in entry.items():
            assert_bitwise_equal(sd["torch"]["state"][index][key], value,
                                 f"{cfg.id}: state_dict param {index} {key}")
    assert_same_optimizer_state(runs["auto"][0], runs["torch"][0], runs["auto"][1],
                                runs["torch"][1], f"{cfg.id}: reloaded")


@pytest.mark.parametrize("fmt", SCALED_FORMATS)
def test_scaled_state_guards(fmt, backend):
    """S2.3's guards on a real step: a moment that is all zero after the step (zero
    gradients from zero state) is stored with scale 1, never NaN; an empty parameter's
    scaled state keeps scale 1."""
    cfg = Precision(exp_avg=fmt, exp_avg_sq=fmt)
    params = [torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.zeros(0))]
    opt = build(cfg, HYPER, params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        for name in ("exp_avg", "exp_avg_sq"):
            assert scale_of(opt, p, name).item() == 1.0
            assert bool((true_state(opt, p, name) == 0).all())
    assert storage_format(opt.state[params[0]]["exp_avg"]) == fmt


@pytest.mark.parametrize("fmt", SCALED_FORMATS)
def test_non_finite_moment_gets_unit_scale(fmt, backend):
    """S2.3: a state whose new values include a non-finite one is stored with scale 1
    (no NaN scale): the infinite element becomes inf (fp16) or NaN (fp8 E4M3 fn has no
    infinity) and the finite elements are stored unscaled, round to nearest."""
    cfg = Precision(exp_avg=fmt, exp_avg_sq=fmt)
    hyper = Hyper(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    params = [torch.nn.Parameter(torch.randn(9))]
    opt = build(cfg, hyper, params)
    grad = torch.randn(9) * 10
    grad[4] = math.inf
    params[0].grad = grad
    opt.step()
    finite = torch.arange(9) != 4
    zero = torch.zeros(8, dtype=torch.float64)
    ref = adam_reference(zero, zero, zero, grad[finite].double(), hyper, 1)
    for name, value, bound in (("exp_avg", ref.m, ref.m_bound),
                               ("exp_avg_sq", ref.v, ref.v_bound)):
        state = opt.state[params[0]]
        assert scale_of(opt, params[0], name).item() == 1.0, f"{name}: scale"
        codes = decode_codes(state[name])
        if fmt == "fp16":
            assert codes[4].item() == math.inf
        else:
            assert math.isnan(codes[4].item())
        stored = codes[finite]
        assert_close_bounded(stored, value, stored_bound(fmt, stored, value, bound, 1.0),
                             f"{name} finite elements")
