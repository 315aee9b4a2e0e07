"""State access and checkpoints for plain tensors (SEMANTICS S5.1-S5.6).

get_unscaled_state / set_scaled_state are checked bit for bit against S2.2-S2.4
evaluated here with torch ops (decode: float(q) * s in fp32; encode: S2.3's scale and
round(u / s)); state_dict() / load_state_dict() for layout, dtype conversion between
configurations, torch.save round trips and bitwise continuation.
"""

import copy
import io
import math
import re

import pytest
import torch

from _optimizer_testing import (
    FP32_TINY, MASTER_FORMATS, MOMENT_FORMATS, Precision, SCALE_TARGET, SCALED_FORMATS,
    TORCH_DTYPE, assert_bitwise_equal, assert_same_optimizer_state, assert_unchanged,
    clone_params, decode_codes, facts, fused_adam, make_params,
    merge_remainder, near_ties, quantize_like_spec, run_precision_steps, scale_of,
    snapshot, split_master, state_tensors)

# id -> (state name, Precision that stores it in the format named by the id): every
# format in every state it may hold, bf16 parameters (fp32 moments once, beside an fp32
# master).
STORAGE_CASES = {"exp_avg-fp32": ("exp_avg", Precision(param="bf16", master="fp32"))}
STORAGE_CASES.update((f"{name}-{fmt}", (name, Precision(param="bf16", **{name: fmt})))
                     for name in ("exp_avg", "exp_avg_sq")
                     for fmt in MOMENT_FORMATS if fmt != "fp32")
STORAGE_CASES.update((f"master_param-{fmt}", ("master_param",
                                              Precision(param="bf16", master=fmt)))
                     for fmt in MASTER_FORMATS)


def stepped(cfg, shapes=((3, 4), (0,)), steps=3, seed=0):
    params = make_params(cfg.param_dtypes(len(shapes)), shapes, seed=seed)
    opt = fused_adam()(params, lr=1e-2, weight_decay=0.1, **cfg.optimizer_kwargs())
    run_precision_steps(opt, params, cfg, None, steps, 1, seed=seed, what="setup",
                        check=False)
    return opt, params


@pytest.mark.parametrize("case", list(STORAGE_CASES))
def test_get_unscaled_state(case, backend):
    """S5.2: fp32 true values (float(q) * s in fp32 for scaled storage), a copy for
    non-fp32 storage; the raw int16 for remainders; the stored bf16 tensor itself with
    skip_unscale (other formats ignore the flag)."""
    name, cfg = STORAGE_CASES[case]
    opt, params = stepped(cfg)
    p = params[0]
    stored = opt.state[p][name]
    fmt = case.split("-")[1]
    value = opt.get_unscaled_state(p, name)
    if fmt == "rem":
        assert_bitwise_equal(value, stored, "raw remainder")
        return
    assert value.dtype == torch.float32 and value.shape == p.shape
    if fmt in SCALE_TARGET:
        scale = scale_of(opt, p, name)
        expected = decode_codes(stored).float() * scale
    else:
        expected = stored.float()
    assert_bitwise_equal(value, expected, f"get_unscaled_state({name})")
    if fmt != "fp32":
        # a copy: writing to it leaves the state alone
        snapshot_ = stored.clone()
        value.add_(1.0)
        assert_bitwise_equal(opt.state[p][name], snapshot_, "state after editing the copy")
    skipped = opt.get_unscaled_state(p, name, skip_unscale=True)
    if fmt == "bf16":
        assert skipped.dtype == torch.bfloat16 and skipped.data_ptr() == stored.data_ptr()
    else:
        assert_bitwise_equal(skipped, expected, "skip_unscale on a non-bf16 state")
    assert opt.get_unscaled_state(params[1], name).shape == (0,)


def first_elements(shape, count):
    """A mask of the first `count` elements (in memory order) of a tensor of `shape`."""
    return torch.arange(math.prod(shape)).reshape(shape) < count


SET_VALUES = {
    "random": lambda shape: torch.randn(shape) * 3,
    "zeros": lambda shape: torch.zeros(shape),
    "huge": lambda shape: torch.full(shape, 1e30),
    "tiny": lambda shape: torch.full(shape, 1e-40),  # a / R below fp32 tiny: the floor
    "with-inf": lambda shape: torch.where(first_elements(shape, 1), math.inf, 1.0),
    "with-nan": lambda shape: torch.where(first_elements(shape, 2), math.nan, -2.0),
}


@pytest.mark.parametrize("values", list(SET_VALUES))
@pytest.mark.parametrize("case", [c for c in STORAGE_CASES if not c.endswith("rem")])
def test_set_scaled_state_stores_per_s2_3(case, values, backend):
    """S5.3: fp32 values stored with a fresh scale (S2.3) and round to nearest even
    (S2.4), bit for bit as evaluated here; the caller's tensor is neither modified nor
    kept (the state does not alias it)."""
    name, cfg = STORAGE_CASES[case]
    fmt = case.split("-")[1]
    opt, params = stepped(cfg)
    p = params[0]
    value = SET_VALUES[values](p.shape)
    copy = value.clone()
    opt.set_scaled_state(p, name, value)
    assert_bitwise_equal(value, copy, "caller's tensor")
    codes, scale = quantize_like_spec(value, fmt)
    stored = opt.state[p][name]
    assert_bitwise_equal(stored, codes, f"stored {name}")
    if scale is not None:
        assert scale_of(opt, p, name).item() == scale
        if values == "tiny":
            assert scale == FP32_TINY
        if values in ("zeros", "with-inf", "with-nan"):
            assert scale == 1.0
    value.fill_(7.0)
    assert_bitwise_equal(opt.state[p][name], codes,
                         f"{name} after editing the caller's tensor")


@pytest.mark.parametrize("fmt", SCALED_FORMATS)
def test_set_scaled_state_near_ties_bitwise(fmt, backend):
    """S2.3 / S2.4 on values that sit next to rounding midpoints after division by the
    scale: the codes are exactly round_to_nearest_even(fp32(u / s))."""
    values, scale = near_ties(fmt, 1 << 16, seed=1)
    params = [torch.nn.Parameter(torch.zeros(values.shape))]
    opt = fused_adam()(params, exp_avg_dtype=TORCH_DTYPE[fmt])
    opt.set_scaled_state(params[0], "exp_avg", values)
    codes, expected = quantize_like_spec(values, fmt)
    assert scale_of(opt, params[0], "exp_avg").item() == expected == scale
    assert_bitwise_equal(opt.state[params[0]]["exp_avg"], codes, f"{fmt} codes")


def test_set_scaled_state_remainder_and_empty(backend):
    """S5.3: remainders take int16 as they are (the param keeps its bits); empty
    parameters take empty values (scale 1 for scaled storage)."""
    cfg = Precision(param="bf16", exp_avg="fp16", master="rem")
    opt, params = stepped(cfg)
    p, empty = params
    bits = p.detach().clone()
    remainder = torch.randint(-2 ** 15, 2 ** 15, p.shape, dtype=torch.int32).to(torch.int16)
    opt.set_scaled_state(p, "master_param", remainder)
    assert_bitwise_equal(opt.state[p]["master_param"], remainder, "stored remainder")
    assert_bitwise_equal(p.detach(), bits, "param bits after setting a remainder")
    opt.set_scaled_state(empty, "exp_avg", torch.zeros(0))
    assert scale_of(opt, empty, "exp_avg").item() == 1.0


def test_set_scaled_state_non_contiguous_value(backend):
    """A strided (transposed) fp32 value is stored by logical element, not by memory."""
    cfg = Precision(param="bf16", exp_avg="fp16", exp_avg_sq="bf16", master="fp32")
    opt, params = stepped(cfg)
    p = params[0]
    value = (torch.randn(p.shape[1], p.shape[0]) * 5).t()
    assert not value.is_contiguous()
    for name, fmt in (("exp_avg", "fp16"), ("exp_avg_sq", "bf16"),
                      ("master_param", "fp32")):
        opt.set_scaled_state(p, name, value)
        codes, _ = quantize_like_spec(value.contiguous(), fmt)
        assert_bitwise_equal(opt.state[p][name], codes, f"{name} from a transposed value")


@pytest.mark.parametrize("options", [dict(exp_avg_dtype=torch.bfloat16),
                                     dict(exp_avg_dtype=torch.uint8),
                                     dict(moment_format="block8"),
                                     dict(master_weights=True, store_param_remainders=True)],
                         ids=str)
def test_lazily_negated_values_are_stored_by_value(options, backend):
    """A value with torch's neg bit (its memory holds the negated values) is stored by
    value by set_scaled_state and load_state_dict (S3.2's reading), as the same values
    resolved are."""
    p = torch.nn.Parameter(torch.zeros(4, 300, dtype=torch.bfloat16))
    name = "master_param" if options.get("store_param_remainders") else "exp_avg"
    value = (torch.randint(-2 ** 15, 2 ** 15, p.shape, dtype=torch.int32).to(torch.int16)
             if name == "master_param" else torch.randn(p.shape) * 3)
    negated = value.neg()._neg_view()
    assert negated.is_neg()
    opts = [fused_adam()([p], **options) for _ in range(3)]
    opts[0].set_scaled_state(p, name, value)
    opts[1].set_scaled_state(p, name, negated)
    saved = opts[0].state_dict()
    saved["state"][0][name] = saved["state"][0][name].neg()._neg_view()
    opts[2].load_state_dict(saved)
    for opt in opts[1:]:
        assert_bitwise_equal(opt.state[p][name], opts[0].state[p][name], name)
        if opt._scales.get(p, {}).get(name) is not None:
            assert_bitwise_equal(opt._scales[p][name], opts[0]._scales[p][name], "scale")


@pytest.mark.parametrize("fmt", ["fp32", "fp16"])
def test_values_that_require_grad_are_stored_as_data(fmt, backend):
    """A value with autograd history (set_scaled_state, load_state_dict,
    initialize_state seeding from a parameter) becomes plain state: no grad_fn keeping
    the caller's graph alive, and the state dict stays deep-copyable."""
    cfg = Precision(param="bf16", exp_avg=fmt, exp_avg_sq="bf16", master="fp32")
    opt, params = stepped(cfg)
    p = params[0]
    value = torch.randn(p.shape, requires_grad=True) * 2  # has a grad_fn
    opt.set_scaled_state(p, "exp_avg", value)
    saved = opt.state_dict()
    saved["state"][0]["exp_avg_sq"] = torch.rand(p.shape, requires_grad=True)
    opt.load_state_dict(saved)
    opt.initialize_state(params[1])
    for q in params:
        for name, t in state_tensors(opt, q).items():
            assert not t.requires_grad and t.grad_fn is None, f"{name} of {tuple(q.shape)}"
    copy.deepcopy(opt.state_dict())
    codes, _ = quantize_like_spec(value.detach(), fmt)
    assert_bitwise_equal(opt.state[p]["exp_avg"], codes, "exp_avg stored from the value")


def test_state_dict_layout_multi_group_and_param_names(backend):
    """S5.4: torch's layout over several groups (indices continue across groups), the
    group settings and int step, exactly the configured names per parameter, tensors
    only; param_names kept when the optimizer was given named parameters."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model.to(torch.bfloat16)
    named = list(model.named_parameters())
    opt = fused_adam()([dict(params=named[:2]), dict(params=named[2:], lr=0.5)],
                       master_weights=True, exp_avg_dtype=torch.uint8)
    for _, p in named:
        p.grad = torch.randn(p.shape).bfloat16()
    opt.step()
    sd = opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3]]
    assert [g.get("param_names") for g in sd["param_groups"]] == \
        [[n for n, _ in named[:2]], [n for n, _ in named[2:]]]
    assert [g["lr"] for g in sd["param_groups"]] == [1e-3, 0.5]
    assert [g["step"] for g in sd["param_groups"]] == [1, 1]
    for g in sd["param_groups"]:
        assert type(g["step"]) is int
    for index, (_, p) in enumerate(named):
        entry = sd["state"][index]
        assert sorted(entry) == ["exp_avg", "exp_avg_sq", "master_param"]
        for name, value in entry.items():
            assert isinstance(value, torch.Tensor) and value.dtype == torch.float32, name
            assert_bitwise_equal(value, opt.get_unscaled_state(p, name), name)


def test_state_dict_of_fresh_optimizer_changes_nothing(backend):
    """S1.6 / S6.3 for plain tensors: state_dict() right after construction exports the
    initial state and writes nothing."""
    cfg = Precision(param="bf16", exp_avg="fp8", exp_avg_sq="fp16", master="fp16")
    params = make_params(cfg.param_dtypes(2), [(4,), (2, 3)], seed=3)
    opt = fused_adam()(params, **cfg.optimizer_kwargs())
    before = {id(p): dict({k: v.clone() for k, v in state_tensors(opt, p).items()},
                          param=p.detach().clone())
              for p in params}
    sd = opt.state_dict()
    for i, p in enumerate(params):
        now = dict(state_tensors(opt, p), param=p.detach())
        for key, value in before[id(p)].items():
            assert_bitwise_equal(now[key], value, f"param {i} {key}")
        for name in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(sd["state"][i][name], torch.zeros(p.shape),
                                 f"param {i} exported initial {name}")
        codes, scale = quantize_like_spec(p.detach().float(), "fp16")
        assert_bitwise_equal(sd["state"][i]["master_param"],
                             decode_codes(codes).float() * torch.tensor(scale),
                             "exported seeded master")
    assert sd["param_groups"][0]["step"] == 0


CROSS_LOADS = [
    (Precision(param="bf16", master="fp32"),
     Precision(param="bf16", exp_avg="fp8", exp_avg_sq="fp16", master="rem")),
    (Precision(param="bf16", exp_avg="fp8", exp_avg_sq="fp16", master="rem"),
     Precision(param="bf16", master="fp32")),
    (Precision(param="bf16", exp_avg="bf16", exp_avg_sq="bf16", master="fp16"),
     Precision(param="bf16", exp_avg="fp16", exp_avg_sq="fp8", master="fp32")),
    (Precision(param="fp16+bf16", exp_avg="fp16", master="fp32"),
     Precision(param="fp16+bf16", exp_avg="bf16", master="fp16")),
]


@pytest.mark.parametrize("saved_cfg,loaded_cfg", CROSS_LOADS,
                         ids=[f"{a.id}-to-{b.id}" for a, b in CROSS_LOADS])
def test_load_state_dict_converts_to_configured_storage(saved_cfg, loaded_cfg, backend):
    """S5.5: a checkpoint saved under one configuration loads into another: each state
    is stored as configured (S2.3 on the saved fp32 values for scaled storage), never
    as the parameter's dtype; masters move between fp32 and remainders losslessly."""
    opt, params = stepped(saved_cfg, shapes=((5, 3), (7,)), steps=4, seed=4)
    sd = opt.state_dict()
    new_params = clone_params(params)
    new_opt = fused_adam()(new_params, **loaded_cfg.optimizer_kwargs())
    new_opt.load_state_dict(sd)
    assert new_opt.param_groups[0]["step"] == 4
    for i, (p, q) in enumerate(zip(params, new_params)):
        saved = sd["state"][i]
        for name, fmt in loaded_cfg.state_formats(q.dtype).items():
            stored = new_opt.state[q][name]
            value = saved[name]
            if value.dtype == torch.int16:
                value = merge_remainder(p, value)  # the saved fp32 master
            if fmt == "rem":
                # the param holds the master's high half so that the pair is the master
                assert_bitwise_equal(merge_remainder(q, stored), value,
                                     f"param {i}: master rebuilt from the remainder")
                assert_bitwise_equal(q.detach(), split_master(value)[0],
                                     f"param {i}: param bits of the split")
                continue
            codes, scale = quantize_like_spec(value, fmt)
            assert_bitwise_equal(stored, codes, f"param {i} {name} as {fmt}")
            if scale is not None:
                assert scale_of(new_opt, q, name).item() == scale


def test_load_state_dict_restores_group_settings_and_step(backend):
    """torch semantics: the saved hyper-parameters and step are restored."""
    params = make_params([torch.float32], [(4,)], seed=5)
    opt = fused_adam()(params, lr=0.1, betas=(0.8, 0.9), weight_decay=0.2)
    params[0].grad = torch.ones(4)
    opt.step()
    sd = opt.state_dict()
    other = fused_adam()(clone_params(params), lr=0.5)
    other.load_state_dict(sd)
    group = other.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["weight_decay"], group["step"]) == \
        (0.1, (0.8, 0.9), 0.2, 1)


def test_load_state_dict_without_step_restarts_the_counter(backend):
    """A checkpoint group without 'step' (TE's before its first step, whose moments are
    zero) has taken no step: the loaded counter is 0, as when torch replaces the group,
    not the current one. (With moments that are not zero, S5.5 refuses it: see
    test_optimizer_errors' step-0-with-moments.)"""
    params = make_params([torch.float32], [(4,)], seed=6)
    opt = fused_adam()(params, lr=0.1)
    for _ in range(5):
        params[0].grad = torch.ones(4)
        opt.step()
    sd = opt.state_dict()
    del sd["param_groups"][0]["step"]
    for name in ("exp_avg", "exp_avg_sq"):
        sd["state"][0][name] = torch.zeros(4)
    other_params = clone_params(params)
    other = fused_adam()(other_params, lr=0.1)
    for _ in range(3):
        other_params[0].grad = torch.ones(4)
        other.step()
    other.load_state_dict(sd)
    assert other.param_groups[0]["step"] == 0
    other_params[0].grad = torch.ones(4)
    other.step()
    assert other.param_groups[0]["step"] == 1


def test_load_torch_adamw_state_dict_takes_its_per_parameter_step(backend):
    """torch.optim.AdamW keeps a step per parameter and none in the group: the shared
    per-parameter step becomes the group's counter, so the next step's bias correction
    is the uninterrupted run's. Checked bitwise against loading the same moments in
    this optimizer's own layout with that step."""
    params = make_params([torch.float32, torch.float32], [(4, 3), (5,)], seed=8)
    adamw = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    for step in range(5):
        for i, p in enumerate(params):
            generator = torch.Generator().manual_seed(step * 2 + i)
            p.grad = torch.randn(p.shape, generator=generator)
        adamw.step()
    torch_sd = adamw.state_dict()
    assert "step" not in torch_sd["param_groups"][0]
    own_sd = {"state": {key: {name: values[name] for name in ("exp_avg", "exp_avg_sq")}
                        for key, values in torch_sd["state"].items()},
              "param_groups": [dict(torch_sd["param_groups"][0], step=5)]}
    results = []
    for sd in (torch_sd, own_sd):
        copies = clone_params(params)
        opt = fused_adam()(copies, lr=0.5)
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["step"] == 5
        # the per-parameter step became the group's: not kept beside the states (S5.5)
        assert all("step" not in opt.state[p] for p in copies)
        for i, p in enumerate(copies):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(99 + i))
        opt.step()
        results.append((opt, copies))
    (a, params_a), (b, params_b) = results
    assert_same_optimizer_state(a, b, params_a, params_b, "loaded from torch's layout")


def test_state_dict_loads_into_torch_adamw_with_per_parameter_steps(backend):
    """README's recipe for the other way: this optimizer's state dict (fp32 moments, a
    group step) with each parameter given its group's step loads into torch's AdamW:
    its moments and steps are the ones exported (stepping alike from the same state is
    test_optimizer_equivalence's)."""
    params = make_params([torch.float32, torch.float32], [(4, 3), (5,)], seed=10)
    opt = fused_adam()(params, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step + i))
        opt.step()
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        for key in group["params"]:
            sd["state"][key]["step"] = torch.tensor(float(group["step"]))
    copies = clone_params(params)
    adamw = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.1)
    adamw.load_state_dict(sd)
    for p, q in zip(params, copies):
        assert float(adamw.state[q]["step"]) == 3.0
        for name in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(adamw.state[q][name], opt.state[p][name], name)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_optimizer_object_copies_continue_bitwise(how, backend):
    """copy.deepcopy(opt) and pickling the optimizer itself (torch.save(opt)) keep the
    configuration, the storage and the scales: the copy's next steps equal the
    original's bit for bit (parameters copied with it, shared between the three)."""
    cfg = Precision(param="bf16", exp_avg="fp8", exp_avg_sq="fp16", master="rem")
    opt, params = stepped(cfg, shapes=((6, 5), (3,)), steps=2, seed=8)
    if how == "deepcopy":
        twin = copy.deepcopy(opt)
    else:
        buffer = io.BytesIO()
        torch.save(opt, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    twin_params = [p for group in twin.param_groups for p in group["params"]]
    assert all(p is not q for p, q in zip(params, twin_params))
    assert_same_optimizer_state(opt, twin, params, twin_params, f"{how}: as copied")
    for step in range(2):
        generator = torch.Generator().manual_seed(40 + step)
        for p, q in zip(params, twin_params):
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
        assert_same_optimizer_state(opt, twin, params, twin_params,
                                    f"{how}: step {step + 1} after the copy")


def test_shallow_copy_is_refused(backend):
    """copy.copy(opt) would share the state tensors and claim them for the copy, so the
    original would refuse its own state: refused at once, and the original steps on."""
    cfg = Precision(param="bf16", exp_avg="fp8", exp_avg_sq="fp16", master="rem")
    opt, params = stepped(cfg, shapes=((6, 5), (3,)), steps=1, seed=8)
    twin, twin_params = stepped(cfg, shapes=((6, 5), (3,)), steps=1, seed=8)
    with pytest.raises(TypeError, match=r"copy\.copy.*rule S2\.3.*copy\.deepcopy"):
        copy.copy(opt)
    for opt_, params_ in ((opt, params), (twin, twin_params)):
        generator = torch.Generator().manual_seed(40)
        for p in params_:
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        opt_.step()
    assert_same_optimizer_state(opt, twin, params, twin_params, "after a refused copy")


@pytest.mark.parametrize("formats", ["recorded", "not-recorded"])
def test_state_of_an_earlier_configuration_is_read_in_its_own_format(formats, backend):
    """S1.5: state stored under one configuration keeps its format until the next step
    converts it: after the state dtypes changed, get_unscaled_state and state_dict()
    give the values stored before, and the next step equals an optimizer of the new
    configuration loaded from them. An optimizer pickled by a version that recorded no
    formats beside the state ("not-recorded") reads its state by the storage dtypes."""
    cfg = Precision(param="bf16", exp_avg="fp16", exp_avg_sq="fp8", master="fp16")
    opt, params = stepped(cfg, shapes=((5, 3), (4,)), steps=2, seed=9)
    if formats == "not-recorded":
        state = opt.__getstate__()
        del state["_formats"]
        opt = type(opt).__new__(type(opt))
        opt.__setstate__(state)
    names = ("exp_avg", "exp_avg_sq", "master_param")
    before = [{name: opt.get_unscaled_state(p, name).clone() for name in names}
              for p in params]
    new = dict(exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.bfloat16,
               master_weight_dtype=torch.float32)
    for key, value in new.items():
        setattr(opt, key, value)
    sd = opt.state_dict()
    for i, p in enumerate(params):
        for name in names:
            assert_bitwise_equal(opt.get_unscaled_state(p, name), before[i][name],
                                 f"param {i} {name} read after the change")
            assert_bitwise_equal(sd["state"][i][name], before[i][name],
                                 f"param {i} {name} exported after the change")
    loaded_params = clone_params(params)
    loaded = fused_adam()(loaded_params, lr=1e-2, weight_decay=0.1, master_weights=True,
                          **new)
    loaded.load_state_dict(sd)
    generator = torch.Generator().manual_seed(10)
    for p, q in zip(params, loaded_params):
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        q.grad = p.grad.clone()
    opt.step()
    loaded.step()
    assert_same_optimizer_state(loaded, opt, loaded_params, params, "converted by the step")


ROUND_TRIP = [
    Precision(param="bf16", exp_avg="bf16", exp_avg_sq="bf16", master="rem"),
    Precision(param="fp16+bf16", exp_avg="bf16", exp_avg_sq="fp32", master="fp32"),
    Precision(param="bf16", exp_avg="fp8", exp_avg_sq="fp16", master="fp16"),
]


@pytest.mark.parametrize("cfg", ROUND_TRIP, ids=[c.id for c in ROUND_TRIP])
def test_torch_save_load_round_trip(cfg, backend):
    """S5.4 / S5.6: the state dict survives torch.save / torch.load(weights_only=True)
    (tensors and plain values only) and the resumed run continues exactly: bitwise for
    fp32 / bf16 / remainder state; for scaled state the reload is S2.3 of the saved
    values, and when that reproduces the storage the continuation is bitwise too."""
    opt, params = stepped(cfg, shapes=((6, 5), (1,), (0,)), steps=5, seed=6)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    new_params = clone_params(params)
    new_opt = fused_adam()(new_params, lr=1e-2, weight_decay=0.1, **cfg.optimizer_kwargs())
    new_opt.load_state_dict(loaded)
    same = True
    for i, (p, q) in enumerate(zip(params, new_params)):
        for name, fmt in cfg.state_formats(p.dtype).items():
            if fmt in SCALE_TARGET:
                codes, scale = quantize_like_spec(loaded["state"][i][name], fmt)
                assert_bitwise_equal(new_opt.state[q][name], codes, name)
                same = same and torch.equal(codes, opt.state[p][name]) and \
                    scale == scale_of(opt, p, name).item()
            else:
                assert_bitwise_equal(new_opt.state[q][name], opt.state[p][name], name)
    if cfg.bitwise_round_trip:
        assert same
    for opt_, params_ in ((opt, params), (new_opt, new_params)):
        run_precision_steps(opt_, params_, cfg, None, 3, 6, seed=7, what="continued",
                            check=False)
    if same:
        assert_same_optimizer_state(opt, new_opt, params, new_params, "after reload")


def test_load_into_stepped_optimizer_rewinds(backend):
    """Loading an earlier checkpoint into an optimizer that has moved on replaces its
    state (nothing cached from the later steps survives): it then continues exactly as
    the run that was checkpointed."""
    cfg = Precision(param="bf16", exp_avg="fp32", exp_avg_sq="bf16", master="fp32")
    opt, params = stepped(cfg, steps=2, seed=8)
    sd = opt.state_dict()
    twin_params = clone_params(params)
    run_precision_steps(opt, params, cfg, None, 3, 3, seed=9, what="moved on",
                        check=False)
    for p, q in zip(params, twin_params):
        with torch.no_grad():
            p.copy_(q)
    opt.load_state_dict(sd)
    twin = fused_adam()(twin_params, lr=1e-2, weight_decay=0.1, **cfg.optimizer_kwargs())
    twin.load_state_dict(sd)
    for opt_, params_ in ((opt, params), (twin, twin_params)):
        run_precision_steps(opt_, params_, cfg, None, 2, 3, seed=10, what="resumed",
                            check=False)
    assert_same_optimizer_state(twin, opt, twin_params, params, "rewound vs fresh")


def test_initialize_state_resets_remainder(backend):
    """S5.1: initialize_state(param) recreates the state: zero moments, zero remainder
    (the master is then the parameter's bf16 value), the parameter untouched."""
    cfg = Precision(param="bf16", exp_avg="fp16", exp_avg_sq="fp8", master="rem")
    opt, params = stepped(cfg, steps=3, seed=11)
    p = params[0]
    bits = p.detach().clone()
    opt.initialize_state(p)
    assert_bitwise_equal(p.detach(), bits, "param after initialize_state")
    assert bool((opt.state[p]["master_param"] == 0).all())
    for name in ("exp_avg", "exp_avg_sq"):
        assert bool((opt.state[p][name] == 0).all())
        assert scale_of(opt, p, name).item() == 1.0
    assert opt.param_groups[0]["step"] == 3
    opt.initialize_state(p, store_param_remainders=True)  # agrees with the config


def test_replaced_state_is_freed_before_the_next_step(backend):
    """initialize_state replaces a parameter's state tensors and leaves nothing holding
    the old ones: the step's cached plan, which holds the storages it bound, was
    keeping them alive beside their successors until the next step."""
    import gc
    import weakref

    opt, params = stepped(Precision(param="fp32"), steps=2, seed=12)
    old = [weakref.ref(opt.state[params[0]][name]) for name in ("exp_avg", "exp_avg_sq")]
    opt.initialize_state(params[0])
    gc.collect()
    assert [ref() is None for ref in old] == [True, True]


def test_state_dict_records_the_state_layout_and_carries_other_keys(backend):
    """S5.4 / S5.5: every group records its state layout; a key written into
    optimizer.state[p] from outside (Megatron writes "step") is exported as it is and
    comes back from load_state_dict as a copy; the next steps are unchanged by it."""
    cfg = Precision(param="bf16", master="rem", exp_avg="bf16", exp_avg_sq="fp8")
    opt, params = stepped(cfg)
    twin, twin_params = stepped(cfg)
    for i, p in enumerate(params):
        opt.state[p]["step"] = torch.tensor(float(i))
    sd = opt.state_dict()
    layout = "exp_avg=bf16 exp_avg_sq=fp8 master=remainder"
    assert [g["state_layout"] for g in sd["param_groups"]] == [layout]
    assert opt.param_groups[0]["state_layout"] == layout  # where torch's flattening looks
    for i in range(len(params)):
        assert_bitwise_equal(sd["state"][i]["step"], torch.tensor(float(i)), f"step {i}")
    loaded_params = clone_params(params)
    loaded = fused_adam()(loaded_params, lr=1e-2, weight_decay=0.1, **cfg.optimizer_kwargs())
    loaded.load_state_dict(sd)
    for i, p in enumerate(loaded_params):
        kept = loaded.state[p]["step"]
        assert_bitwise_equal(kept, torch.tensor(float(i)), f"loaded step {i}")
        assert kept is not sd["state"][i]["step"], "the loaded key aliases the state dict"
    run_precision_steps(opt, params, cfg, None, 2, 4, seed=5, what="with the key",
                        check=False)
    run_precision_steps(twin, twin_params, cfg, None, 2, 4, seed=5, what="without",
                        check=False)
    for p in params:
        opt.state[p].pop("step")
    assert_same_optimizer_state(opt, twin, params, twin_params, "outside key")


def test_load_takes_remainders_cast_to_floats_exactly(backend):
    """S6.4: DCP loads a checkpoint saved with int16 remainders into this optimizer's
    fp32 master cast to float; with the recorded layout the load turns them back into
    remainders and merges them with the parameter: the master is exact."""
    opt, params = stepped(Precision(param="bf16", master="rem"))
    sd = opt.state_dict()
    for entry in sd["state"].values():
        entry["master_param"] = entry["master_param"].float()  # what DCP's copy_ does
    copies = clone_params(params)
    target = fused_adam()(copies, lr=1e-2, master_weights=True)
    target.load_state_dict(sd)
    for p, q in zip(params, copies):
        assert_bitwise_equal(target.get_unscaled_state(q, "master_param"),
                             merge_remainder(p, opt.get_unscaled_state(p, "master_param")),
                             "master from the float-cast remainders")


@pytest.mark.parametrize("remainders_before", [True, False])
def test_get_unscaled_state_follows_a_changed_setting(remainders_before):
    """S1.5, S5.2: after store_param_remainders changes, get_unscaled_state gives the
    master in the configured form (int16 remainders or fp32), as state_dict() exports
    it, and set_scaled_state takes it back."""
    gen = torch.Generator().manual_seed(2)
    p = torch.nn.Parameter(torch.randn(8, 64, generator=gen).bfloat16())
    opt = fused_adam()([p], lr=1e-2, master_weights=True,
                       store_param_remainders=remainders_before)
    p.grad = torch.randn(p.shape, generator=gen).bfloat16()
    opt.step()
    opt.store_param_remainders = not remainders_before
    value = opt.get_unscaled_state(p, "master_param")
    exported = opt.state_dict()["state"][0]["master_param"]
    assert value.dtype == (torch.float32 if remainders_before else torch.int16)
    assert_bitwise_equal(value, exported, "get_unscaled_state vs state_dict")
    opt.set_scaled_state(p, "master_param", value)


# A master whose low half is exactly 0x8000: round to nearest even (how a bf16 parameter
# beside an fp32 master is rounded) and ties away (how a remainder pairs, S2.5) differ.
TIE_MASTER = torch.tensor([0x3F808000, 0x3F818000, -0x407F8000], dtype=torch.int32)


@pytest.mark.parametrize("master", ["fp32", "fp16"])
def test_masters_made_remainders_are_exported_with_the_bits_they_pair_with(master):
    """S1.5, S2.5, S5.4: after store_param_remainders is switched on, the next step
    re-rounds each parameter to pair it with its remainder; state_dict() and
    get_unscaled_state() before that step give the parameter those bits (once nothing
    can be refused), so a checkpoint of the parameters and the state, or a get/set round
    trip, keeps every master bitwise: the resumed run equals the run that went on."""
    kwargs = dict(lr=1e-2, master_weights=True,
                  master_weight_dtype=torch.float16 if master == "fp16" else torch.float32)
    gen = torch.Generator().manual_seed(41)
    p = torch.nn.Parameter(torch.randn(4, 96, generator=gen).bfloat16())
    opt = fused_adam()([p], **kwargs)
    if master == "fp32":  # ties, where the two roundings of the same master differ
        values = opt.get_unscaled_state(p, "master_param").clone()
        values.view(-1)[:3] = TIE_MASTER.view(torch.float32)
        opt.set_scaled_state(p, "master_param", values)
    grads = [torch.randn(4, 96, generator=gen).bfloat16() for _ in range(3)]
    p.grad = grads[0].clone()
    if master == "fp32":  # the tied masters stay; the parameters are their RNE
        opt.param_groups[0]["lr"] = 0.0
    opt.step()  # an fp16 master's fp32 value has a tied low half for 1 element in 8
    opt.param_groups[0]["lr"] = kwargs["lr"]
    round_trip = copy.deepcopy(opt)  # parameter, state and scales, bitwise
    q = round_trip.param_groups[0]["params"][0]
    for o in (opt, round_trip):
        o.store_param_remainders, o.master_weight_dtype = True, torch.float32
    before = p.detach().clone()
    saved = copy.deepcopy(opt.state_dict())
    assert not torch.equal(p.detach(), before), "no parameter was re-rounded"
    resumed_p = torch.nn.Parameter(p.detach().clone())  # the model's checkpoint
    resumed = fused_adam()([resumed_p], **dict(kwargs, master_weight_dtype=torch.float32,
                                                store_param_remainders=True))
    resumed.load_state_dict(saved)
    round_trip.set_scaled_state(q, "master_param",
                                round_trip.get_unscaled_state(q, "master_param"))
    for grad in grads[1:]:
        for param, o in ((p, opt), (resumed_p, resumed), (q, round_trip)):
            param.grad = grad.clone()
            o.step()
    assert_same_optimizer_state(opt, resumed, [p], [resumed_p], "resumed")
    assert_same_optimizer_state(opt, round_trip, [p], [q], "get/set round trip")


def test_a_frozen_parameters_kept_master_made_a_remainder_pairs_with_it():
    """S5.5: a frozen parameter whose state a load leaves out (torch's
    set_optimizer_state_dict) keeps its state, re-stored as the settings now say: its
    master made a remainder (S1.5) pairs with the bits the load gives the parameter, so
    the master is kept bitwise."""
    gen = torch.Generator().manual_seed(43)
    params = [torch.nn.Parameter(torch.randn(96, generator=gen).bfloat16()) for _ in range(2)]
    opt = fused_adam()(params, lr=0.0, master_weights=True)
    values = opt.get_unscaled_state(params[0], "master_param").clone()
    values[:3] = TIE_MASTER.view(torch.float32)
    opt.set_scaled_state(params[0], "master_param", values)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).bfloat16()
    opt.step()  # lr 0: the masters stay, the parameters are their RNE
    params[0].requires_grad_(False)
    saved = opt.state_dict()
    del saved["state"][0]  # as torch's set_optimizer_state_dict leaves a frozen one out
    opt.store_param_remainders = True
    opt.load_state_dict(saved)
    opt.store_param_remainders = False  # converted back at the next access, exactly
    assert_bitwise_equal(opt.get_unscaled_state(params[0], "master_param"), values,
                         "the frozen parameter's master")


def test_a_refused_state_dict_leaves_the_parameters_unrounded():
    """S8: state_dict() refused for one parameter's state (per-block codes without
    scales) writes no other parameter's paired bits: every parameter stays as it was."""
    gen = torch.Generator().manual_seed(42)
    params = [torch.nn.Parameter(torch.randn(4, 256, generator=gen).bfloat16())
              for _ in range(2)]
    opt = fused_adam()(params, lr=1e-2, master_weights=True, moment_format="block8")
    values = opt.get_unscaled_state(params[0], "master_param").clone()
    values.view(-1)[:3] = TIE_MASTER.view(torch.float32)
    opt.set_scaled_state(params[0], "master_param", values)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).bfloat16()
    opt.step()
    opt.store_param_remainders = True
    del opt._scales[params[1]]["exp_avg"]
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="group 0, param 1"):
        opt.state_dict()
    for p, b in zip(params, before):
        assert_bitwise_equal(p.detach(), b, "a parameter after the refused state_dict()")


@pytest.mark.parametrize("remainders_before", [True, False])
def test_a_step_after_a_changed_setting_records_the_new_layout(remainders_before):
    """S1.5, S5.4: the step that converts the state after a setting changed records the
    new layout in its group (where torch's flattening and DCP read it), as state_dict()
    does; the state is the twin's that never changed setting, switched back."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(8, 64, generator=gen).bfloat16())
              for _ in range(2)]
    opts = [fused_adam()([p], lr=1e-2, master_weights=True,
                         store_param_remainders=remainders_before) for p in params]
    grads = [torch.randn(8, 64, generator=gen).bfloat16() for _ in range(3)]
    params[1].data.copy_(params[0].data)
    layouts = {True: "exp_avg=fp32 exp_avg_sq=fp32 master=remainder",
               False: "exp_avg=fp32 exp_avg_sq=fp32 master=fp32"}
    for step, grad in enumerate(grads):
        if step == 1:
            opts[0].store_param_remainders = not remainders_before
        for p, opt in zip(params, opts):
            p.grad = grad.clone()
            opt.step()
        recorded = opts[0].param_groups[0]["state_layout"]
        assert recorded == layouts[remainders_before if step == 0 else not remainders_before]
        assert recorded == opts[0].state_dict()["param_groups"][0]["state_layout"]
    assert_bitwise_equal(params[0].detach(), params[1].detach(), "parameters")
    opts[0].store_param_remainders = remainders_before
    assert_bitwise_equal(opts[0].get_unscaled_state(params[0], "master_param"),
                         opts[1].get_unscaled_state(params[1], "master_param"), "master")


@pytest.mark.parametrize("master", ["fp32", "fp16", "remainder"])
@pytest.mark.parametrize("route", ["plain", "template", "dcp", "no-layout"])
def test_checkpoint_without_masters_gives_masters_the_loaded_parameters(master, route,
                                                                        tmp_path):
    """A checkpoint saved without masters (state_layout master=none) loads into an
    optimizer that keeps them with each master taken from the loaded parameter (S5.5,
    as initialisation: S1.6), whatever it held: "plain" hands load_state_dict the
    checkpoint itself (no master_param), "template" this optimizer's own state dict
    with the checkpoint's values written in, as DCP leaves a key the checkpoint lacks
    (its master_param is then the template's own, from another model), "dcp" the same
    through torch's DCP in one process: its default planner refuses the template's
    master_param, which the checkpoint lacks, and one that allows a partial load leaves
    it (README), "no-layout" the checkpoint without its state_layout, as torch's and
    TE's (without master weights) hold no master."""
    gen = torch.Generator().manual_seed(12)
    saved_params = [torch.nn.Parameter(torch.randn(4, 8, generator=gen).bfloat16())]
    src = fused_adam()(saved_params, lr=1e-2)
    for _ in range(2):
        saved_params[0].grad = torch.randn(4, 8, generator=gen).bfloat16()
        src.step()
    saved = src.state_dict()
    assert saved["param_groups"][0]["state_layout"].endswith("master=none")
    params = [torch.nn.Parameter(torch.randn(4, 8, generator=gen).bfloat16())]
    kwargs = dict(master_weights=True, store_param_remainders=master == "remainder",
                  master_weight_dtype=torch.float16 if master == "fp16" else torch.float32)
    opt = fused_adam()(params, lr=1e-2, **kwargs)
    params[0].grad = torch.randn(4, 8, generator=gen).bfloat16()
    opt.step()  # its master holds the other model's values, stepped
    opt_before_master = opt.get_unscaled_state(params[0], "master_param")
    loaded = saved
    if route == "template":
        loaded = opt.state_dict()
        for key in ("step", "state_layout"):
            loaded["param_groups"][0][key] = saved["param_groups"][0][key]
        for name in ("exp_avg", "exp_avg_sq"):
            loaded["state"][0][name] = saved["state"][0][name].clone()
    elif route == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner
        from torch.distributed.checkpoint.api import CheckpointException

        dcp.save({"optim": saved}, checkpoint_id=tmp_path, no_dist=True)
        with pytest.raises(CheckpointException, match=r"Missing key.*master_param"):
            dcp.load({"optim": opt.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
        template = {"optim": opt.state_dict()}
        dcp.load(template, checkpoint_id=tmp_path, no_dist=True,
                 planner=DefaultLoadPlanner(allow_partial_load=True))
        loaded = template["optim"]
    elif route == "no-layout":
        del saved["param_groups"][0]["state_layout"]
    params[0].data.copy_(saved_params[0].detach())  # the model's own load
    opt.load_state_dict(loaded)
    value = opt.get_unscaled_state(params[0], "master_param")
    if master == "remainder":  # zero remainders: the parameter alone is the master
        assert_bitwise_equal(value, torch.zeros(4, 8, dtype=torch.int16), "remainder")
    elif master == "fp32":
        assert_bitwise_equal(value, saved_params[0].detach().float(), "master")
    else:  # stored as fp16 codes of value / scale: within half an fp16 ulp (S2.3)
        torch.testing.assert_close(value, saved_params[0].detach().float(),
                                   rtol=2.0**-11 + 2.0**-23, atol=0.0)
        assert not torch.equal(value, opt_before_master), "the template's master stayed"
    assert opt.param_groups[0]["step"] == 2
    for name in ("exp_avg", "exp_avg_sq"):
        assert_bitwise_equal(opt.state[params[0]][name], src.state[saved_params[0]][name],
                             name)


@pytest.mark.parametrize("remainders", [False, True])
def test_a_group_of_fp32_parameters_records_no_master(remainders, backend):
    """S5.4: fp32 parameters are their own masters (S2.1), so their group records
    master=none under master_weights=True as it exports no master_param, and its
    checkpoint loads into bf16 parameters that keep masters, each seeded from the loaded
    parameter (S5.5; the record said fp32 or remainder, and the load refused the
    optimizer's own checkpoint for the master it never saved)."""
    gen = torch.Generator().manual_seed(31)
    kwargs = dict(master_weights=True, store_param_remainders=remainders)
    saved_params = [torch.nn.Parameter(torch.randn(4, 8, generator=gen))]
    src = fused_adam()(saved_params, lr=1e-2, **kwargs)
    saved_params[0].grad = torch.randn(4, 8, generator=gen)
    src.step()
    saved = src.state_dict()
    assert saved["param_groups"][0]["state_layout"] == \
        "exp_avg=fp32 exp_avg_sq=fp32 master=none"
    assert sorted(saved["state"][0]) == ["exp_avg", "exp_avg_sq"]
    params = [torch.nn.Parameter(saved_params[0].detach().bfloat16())]  # the model's load
    opt = fused_adam()(params, lr=1e-2, **kwargs)
    opt.load_state_dict(saved)
    master = opt.get_unscaled_state(params[0], "master_param")
    expected = (torch.zeros(4, 8, dtype=torch.int16) if remainders
                else params[0].detach().float())
    assert_bitwise_equal(master, expected, "seeded master")
    for name in ("exp_avg", "exp_avg_sq"):
        assert_bitwise_equal(opt.get_unscaled_state(params[0], name), saved["state"][0][name],
                             name)


def test_a_missing_master_of_a_mixed_group_is_refused_with_the_way_round():
    """S5.4, S5.5: a group of bf16 and fp32 parameters records its master, which the fp32
    one, its own master, lacks; loaded into parameters that all keep one, that missing
    master_param is refused by name, saying how to load it, and nothing changes."""
    gen = torch.Generator().manual_seed(32)
    saved_params = [torch.nn.Parameter(torch.randn(4, generator=gen).bfloat16()),
                    torch.nn.Parameter(torch.randn(4, generator=gen))]
    src = fused_adam()(saved_params, lr=1e-2, master_weights=True)
    for p in saved_params:
        p.grad = torch.randn(4, generator=gen).to(p.dtype)
    src.step()
    saved = src.state_dict()
    assert saved["param_groups"][0]["state_layout"].endswith("master=fp32")
    params = [torch.nn.Parameter(p.detach().bfloat16()) for p in saved_params]
    opt = fused_adam()(params, lr=1e-2, master_weights=True)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=facts(
            r"group 0, param 1\b", "has no 'master_param'", "rule S5.5",
            "load with the saved parameter dtypes, then change them")):
        opt.load_state_dict(saved)
    assert_unchanged(opt, before)


@pytest.mark.parametrize("route", ["plain", "dcp", "te-shaped"])
def test_moments_set_before_the_first_step_survive_a_checkpoint(route, tmp_path, backend):
    """Moments set with set_scaled_state before the first step (a warm start) are marked
    in the group's recorded layout (moments=set, S5.4), so a checkpoint taken then loads
    (S5.5) and continues bitwise as the run that never stopped (S5.6): "plain" through
    load_state_dict, "dcp" through torch's DCP into a fresh optimizer's template, whose
    own record lacks the mark; "te-shaped" a checkpoint as TE's optimizer leaves one
    before its first step (no group step, no layout, the moments it was given)."""
    gen = torch.Generator().manual_seed(21)
    start = torch.randn(4, 8, generator=gen).bfloat16()
    moments = {"exp_avg": torch.randn(4, 8, generator=gen) * 1e-2,
               "exp_avg_sq": torch.rand(4, 8, generator=gen) * 1e-4}
    grads = [torch.randn(4, 8, generator=gen).bfloat16() for _ in range(2)]
    kwargs = dict(lr=1e-2, master_weights=True, store_param_remainders=True,
                  exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)

    def warm_started():
        param = torch.nn.Parameter(start.clone())
        opt = fused_adam()([param], **kwargs)
        for name, value in moments.items():
            opt.set_scaled_state(param, name, value)
        return opt, param

    opt, param = warm_started()
    saved = opt.state_dict()
    layout = "exp_avg=bf16 exp_avg_sq=bf16 master=remainder"
    assert saved["param_groups"][0]["state_layout"] == layout + " moments=set"
    param2 = torch.nn.Parameter(start.clone())
    fresh = fused_adam()([param2], **kwargs)
    assert fresh.state_dict()["param_groups"][0]["state_layout"] == layout
    if route == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"optim": saved}, checkpoint_id=tmp_path, no_dist=True)
        template = {"optim": fresh.state_dict()}
        dcp.load(template, checkpoint_id=tmp_path, no_dist=True)
        saved = template["optim"]
    elif route == "te-shaped":
        for key in ("step", "state_layout"):
            del saved["param_groups"][0][key]
        saved["state"][0].pop("master_param")
    fresh.load_state_dict(saved)
    for grad in grads:
        for p, o in ((param, opt), (param2, fresh)):
            p.grad = grad.clone()
            o.step()
    assert_bitwise_equal(param2, param, "param")
    for name in ("exp_avg", "exp_avg_sq", "master_param"):
        assert_bitwise_equal(fresh.state[param2][name], opt.state[param][name], name)
    # Stepped, the group is no longer at step 0: the mark is gone from its records.
    assert opt.state_dict()["param_groups"][0]["state_layout"] == layout
    assert fresh.state_dict()["param_groups"][0]["state_layout"] == layout


@pytest.mark.parametrize("record", ["as-recorded", "older-record"])
@pytest.mark.parametrize("remainders", [False, True], ids=["fp32-master", "remainder"])
def test_fp16_parameters_master_under_remainders_loads_into_bf16(remainders, record,
                                                                 backend):
    """S5.4: beside fp16 parameters alone, store_param_remainders keeps an fp32 master
    and the group records master=fp32. Such a checkpoint loads into the same model in
    bf16, and the master arrives exactly: as an fp32 master, or split into the bf16
    parameter and its remainder. A checkpoint that recorded master=remainder for them
    (as before that rule) loads so too: its master, not whole numbers, is no remainder
    code."""
    gen = torch.Generator().manual_seed(25)
    src_params = [torch.nn.Parameter(torch.randn(4, 8, generator=gen).half())]
    src = fused_adam()(src_params, lr=1e-2, master_weights=True, store_param_remainders=True)
    for _ in range(2):
        src_params[0].grad = torch.randn(4, 8, generator=gen).half()
        src.step()
    saved = src.state_dict()
    layout = saved["param_groups"][0]["state_layout"]
    assert layout.endswith("master=fp32"), layout
    if record == "older-record":
        saved["param_groups"][0]["state_layout"] = layout.replace("master=fp32",
                                                                  "master=remainder")
    want = saved["state"][0]["master_param"].clone()
    assert want.dtype == torch.float32 and not torch.equal(want, want.round())
    params = [torch.nn.Parameter(src_params[0].detach().bfloat16())]
    opt = fused_adam()(params, lr=1e-2, master_weights=True,
                       store_param_remainders=remainders)
    opt.load_state_dict(saved)
    got = opt.state[params[0]]["master_param"]
    if remainders:  # the master is the parameter's bits over the remainder's
        got = ((params[0].detach().view(torch.int16).to(torch.int32) << 16)
               + got.to(torch.int32)).view(torch.float32)
    assert_bitwise_equal(got, want, "master")


@pytest.mark.parametrize("master", ["fp32", "fp16"])
def test_step_0_record_says_the_masters_follow(master, backend):
    """S5.4: a group at step 0 whose masters all follow their parameters records
    masters=follow, and a load at step 0 keeps them following whatever their bits (an
    fp16 master exported at another shard's scale, here: loaded before the model's
    weights): weights loaded afterwards are what the first step starts from. A master
    set by hand, or one that stepped, takes the mark away, and so does a step that
    counts the group without stepping it."""
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[master]
    settings = dict(lr=1e-2, master_weights=True, master_weight_dtype=dtype)
    gen = torch.Generator().manual_seed(29)
    saved_params = [torch.nn.Parameter(torch.randn(4, 8, generator=gen).bfloat16())]
    saved = fused_adam()(saved_params, **settings).state_dict()
    assert saved["param_groups"][0]["state_layout"].endswith(" masters=follow")
    params = [torch.nn.Parameter(torch.randn(4, 8, generator=gen).bfloat16())]
    opt = fused_adam()(params, **settings)
    opt.load_state_dict(saved)
    pretrained = torch.randn(4, 8, generator=gen).bfloat16()
    params[0].data.copy_(pretrained)
    grad = torch.randn(4, 8, generator=gen).bfloat16()
    fresh_params = [torch.nn.Parameter(pretrained.clone())]
    fresh = fused_adam()(fresh_params, **settings)
    for p, o in ((params[0], opt), (fresh_params[0], fresh)):
        p.grad = grad.clone()
        o.step()
    assert_bitwise_equal(params[0], fresh_params[0], "param after the first step")
    assert "masters=follow" not in opt.state_dict()["param_groups"][0]["state_layout"]
    idle = fused_adam()(saved_params, **settings)
    idle.step()  # no gradient: counted (S2.8); its masters still follow, but at step 1
    assert idle.param_groups[0]["step"] == 1
    assert "masters=follow" not in idle.state_dict()["param_groups"][0]["state_layout"]
    by_hand = fused_adam()(saved_params, **settings)
    by_hand.set_scaled_state(saved_params[0], "master_param",
                             saved_params[0].detach().float() + 1)
    assert "masters=follow" not in by_hand.state_dict()["param_groups"][0]["state_layout"]


def test_masters_that_followed_load_into_remainders_as_fresh_ones(backend):
    """S1.6 / S5.4: a step-0 checkpoint whose masters followed (masters=follow), loaded
    into an optimizer with remainders, leaves the parameters as they are (the weights
    loaded into the model) with zero remainders: it wrote the checkpoint's weights into
    them, as the split of its fp32 master."""
    gen = torch.Generator().manual_seed(31)
    saved_params = [torch.nn.Parameter(torch.randn(4, 8, generator=gen).bfloat16())]
    saved = fused_adam()(saved_params, lr=1e-2, master_weights=True).state_dict()
    assert saved["param_groups"][0]["state_layout"].endswith(" masters=follow")
    weights = torch.randn(4, 8, generator=gen).bfloat16()
    params = [torch.nn.Parameter(weights.clone())]
    opt = fused_adam()(params, lr=1e-2, master_weights=True, store_param_remainders=True)
    opt.load_state_dict(saved)
    assert_bitwise_equal(params[0], weights, "the parameter after the load")
    assert_bitwise_equal(opt.state[params[0]]["master_param"],
                         torch.zeros(4, 8, dtype=torch.int16), "the remainder")


def test_a_template_record_says_nothing_of_the_checkpoints_masters(backend):
    """S5.5: DCP leaves the template's own state_layout where a checkpoint records none
    (TE's, with masters set by hand before the first step); its masters=follow is this
    optimizer's, not the checkpoint's: the masters written into the template load as
    they are."""
    gen = torch.Generator().manual_seed(32)
    params = [torch.nn.Parameter(torch.randn(4, 8, generator=gen).bfloat16())]
    opt = fused_adam()(params, lr=1e-2, master_weights=True)
    template = opt.state_dict()
    assert template["param_groups"][0]["state_layout"].endswith(" masters=follow")
    given = torch.randn(4, 8, generator=gen)
    template["state"][0]["master_param"].copy_(given)  # as dcp.load writes the saved one
    opt.load_state_dict(template)
    assert_bitwise_equal(opt.get_unscaled_state(params[0], "master_param"), given,
                         "the master written into the template")


def _stepped_bf16_with_masters(seed, steps):
    """Two bf16 parameters of 4 x 8 with fp32 masters, ``steps`` steps in."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 8, generator=gen).bfloat16())
              for _ in range(2)]
    opt = fused_adam()(params, lr=1e-2, master_weights=True)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(4, 8, generator=gen).bfloat16()
        opt.step()
    return opt, params


def test_a_frozen_parameters_master_read_from_the_template_is_the_saved_one(backend):
    """S5.5: a frozen parameter's state read from the template dcp.load filled is the
    checkpoint's, master included: a fresh optimizer's master that followed its
    parameter does not go on following (the checkpoint's master was seeded from the
    parameter again), and the layer unfrozen steps as in the run that never stopped."""
    saved, saved_params = _stepped_bf16_with_masters(33, steps=3)
    checkpoint = copy.deepcopy(saved.state_dict())
    params = [torch.nn.Parameter(p.detach().clone()) for p in saved_params]
    params[1].requires_grad_(False)
    opt = fused_adam()(params, lr=1e-2, master_weights=True)  # its masters follow
    template = opt.state_dict()
    for i, entry in template["state"].items():
        for name, value in entry.items():
            value.copy_(checkpoint["state"][i][name])
    template["param_groups"][0]["step"] = checkpoint["param_groups"][0]["step"]
    del template["state"][1]
    opt.load_state_dict(template)
    params[1].requires_grad_(True)
    gen = torch.Generator().manual_seed(34)
    for p, q in zip(params, saved_params):
        p.grad = torch.randn(4, 8, generator=gen).bfloat16()
        q.grad = p.grad.clone()
    opt.step()
    saved.step()
    for i, (p, q) in enumerate(zip(params, saved_params)):
        assert_bitwise_equal(p, q, f"param {i} after the next step")


def _remainder_checkpoint(seed):
    """A checkpoint of bf16 parameters with int16 remainders, two steps in."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 8, generator=gen).bfloat16())]
    opt = fused_adam()(params, lr=1e-2, master_weights=True, store_param_remainders=True)
    for _ in range(2):
        params[0].grad = torch.randn(4, 8, generator=gen).bfloat16()
        opt.step()
    return opt.state_dict(), params


@pytest.mark.parametrize("arrives", ["as-saved", "cast-to-fp32"])
@pytest.mark.parametrize("remainders", [False, True], ids=["fp32-master", "remainder"])
def test_remainders_loaded_beside_fp16_parameters_are_refused(remainders, arrives,
                                                              backend):
    """S6.4: int16 remainders are half of a master whose other half is the bf16
    parameter they were saved beside; loaded beside an fp16 parameter they are refused,
    as they are (load_state_dict) and as DCP casts them into this optimizer's fp32
    master (whole numbers: they were taken as the master itself, and the next step wrote
    them into the parameter), with nothing changed."""
    saved, src_params = _remainder_checkpoint(26)
    assert saved["param_groups"][0]["state_layout"].endswith("master=remainder")
    if arrives == "cast-to-fp32":
        saved["state"][0]["master_param"] = saved["state"][0]["master_param"].float()
    params = [torch.nn.Parameter(src_params[0].detach().half())]
    opt = fused_adam()(params, lr=1e-2, master_weights=True,
                       store_param_remainders=remainders)
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match=facts(
            r"group 0, param 0", "holds int16 remainders",
            re.escape("(saved with exp_avg=fp32 exp_avg_sq=fp32 master=remainder)"),
            "bf16 parameter", "this one is torch.float16", "rule S6.4")):
        opt.load_state_dict(saved)
    assert_unchanged(opt, before, "after the refused load")


def test_fp16_master_cast_into_remainders_is_refused(backend):
    """S6.4: an fp16 parameter's fp32 master (store_param_remainders on: recorded fp32)
    that DCP cast into a bf16 model's int16 remainders has lost its bits: refused, where
    the record's remainder read them as remainders, truncated."""
    gen = torch.Generator().manual_seed(27)
    src_params = [torch.nn.Parameter(torch.randn(4, 8, generator=gen).half())]
    src = fused_adam()(src_params, lr=1e-2, master_weights=True, store_param_remainders=True)
    src_params[0].grad = torch.randn(4, 8, generator=gen).half()
    src.step()
    saved = src.state_dict()
    saved["state"][0]["master_param"] = saved["state"][0]["master_param"].to(torch.int16)
    params = [torch.nn.Parameter(src_params[0].detach().bfloat16())]
    opt = fused_adam()(params, lr=1e-2, master_weights=True, store_param_remainders=True)
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match=facts(r"group 0, param 0", "arrived as int16",
                                                 "rule S6.4")):
        opt.load_state_dict(saved)
    assert_unchanged(opt, before, "after the refused load")


@pytest.mark.parametrize("record", ["mixed-group", "older-record"])
def test_whole_number_fp16_masters_under_a_remainder_record_load_back(record, backend):
    """S6.4: under a remainder record (a group of bf16 and fp16 parameters, or an fp16
    group's checkpoint saved before fp16-only groups recorded fp32), an fp16 parameter's
    fp32 master of whole numbers (a zero bias, a norm's ones) loads back beside that
    parameter as the master it is: its parameter holds it rounded, which cast remainder
    codes would not (they were refused as remainders beside an fp16 parameter)."""
    def make():
        params = [torch.nn.Parameter(torch.linspace(-1, 1, 8).bfloat16()),
                  torch.nn.Parameter(torch.zeros(8, dtype=torch.float16)),
                  torch.nn.Parameter(torch.ones(8, dtype=torch.float16))]
        if record == "older-record":
            params = params[1:]
        return params, fused_adam()(params, lr=1e-2, master_weights=True,
                                    store_param_remainders=True)

    params, opt = make()
    saved = opt.state_dict()
    if record == "older-record":
        layout = saved["param_groups"][0]["state_layout"]
        saved["param_groups"][0]["state_layout"] = layout.replace("master=fp32",
                                                                  "master=remainder")
    assert " master=remainder" in saved["param_groups"][0]["state_layout"]
    loaded_params, loaded = make()
    loaded.load_state_dict(saved)
    for p, q in zip(loaded_params, params):
        for name, value in state_tensors(opt, q).items():
            assert_bitwise_equal(state_tensors(loaded, p)[name], value, name)


def test_a_frozen_parameter_left_out_keeps_a_master_set_by_hand_at_step_0(backend):
    """S1.6 / S5.5: a frozen parameter that a step-0 checkpoint leaves out keeps its
    state, also a master set by hand: the checkpoint's masters=follow speaks for the
    masters it holds, not for state the load keeps."""
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 4).bfloat16()) for _ in range(2)]
    opt = fused_adam()(params, lr=1e-2, master_weights=True)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["state_layout"].endswith(" masters=follow")
    del saved["state"][1]
    params[1].requires_grad_(False)
    opt.set_scaled_state(params[1], "master_param", torch.full((4,), 3.0))
    opt.load_state_dict(saved)
    assert_bitwise_equal(opt.get_unscaled_state(params[1], "master_param"),
                         torch.full((4,), 3.0), "the kept master")


def test_a_group_of_bf16_and_fp16_parameters_records_remainders():
    """S5.4: remainders are recorded where a bf16 parameter holds them; a group that
    also holds fp16 parameters records them (its fp16 parameters' masters are fp32)."""
    dtypes = (torch.float16, torch.bfloat16, torch.float16, torch.float16, torch.float32)
    params = [torch.nn.Parameter(torch.zeros(3, dtype=dtype)) for dtype in dtypes]
    opt = fused_adam()([dict(params=params[:1]), dict(params=params[1:3]),
                        dict(params=params[3:])], master_weights=True,
                       store_param_remainders=True)
    assert [g["state_layout"].split()[2] for g in opt.state_dict()["param_groups"]] \
        == ["master=fp32", "master=remainder", "master=fp32"]


def test_load_splits_a_master_into_an_inference_tensor_parameter(backend):
    """S1.6 admits a parameter made under torch.inference_mode; a load that turns fp32
    masters into remainders writes such a parameter's bits too (in that mode: torch
    refuses the write outside it, which left the earlier parameters rewritten and the
    state not, with torch's own message)."""
    src, src_params = _stepped_bf16_with_masters(23, steps=2)
    saved = src.state_dict()
    with torch.inference_mode():
        frozen = src_params[1].detach().clone()
    params = [torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16)), frozen]
    opt = fused_adam()(params, lr=1e-2, master_weights=True, store_param_remainders=True)
    opt.load_state_dict(saved)
    for p, q in zip(params, src_params):
        # S2.5: the low 16 bits as a signed remainder, the high half rounded up by one
        # where that remainder is negative (no NaN here).
        bits = src.state[q]["master_param"].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        low = bits & 0xFFFF
        high = ((bits >> 16) + (low >= 0x8000)) & 0xFFFF
        signed = lambda x: (x - ((x >= 0x8000) * 0x10000)).to(torch.int16)  # noqa: E731
        assert_bitwise_equal(p.detach().view(torch.int16), signed(high), "the parameter")
        assert_bitwise_equal(opt.state[p]["master_param"], signed(low), "the remainder")


def test_frozen_parameter_left_out_of_a_load_keeps_following():
    """S1.6 / S5.5: a frozen parameter whose state a checkpoint leaves out (torch's DCP
    helpers do) keeps its master, and a master that followed its parameter still does:
    weights loaded into it afterwards are the master at its first step."""
    params = make_params([torch.bfloat16] * 2, [(4, 8), (4, 8)], seed=38)
    opt = fused_adam()(params, lr=0.0, master_weights=True)
    params[0].grad = torch.ones(4, 8, dtype=torch.bfloat16)
    opt.step()
    saved = opt.state_dict()
    del saved["state"][1]
    params[1].requires_grad_(False)
    opt.load_state_dict(saved)
    params[1].requires_grad_(True)
    params[1].data.copy_(torch.full((4, 8), 2.5, dtype=torch.bfloat16))
    params[1].grad = torch.ones(4, 8, dtype=torch.bfloat16)
    opt.step()
    assert_bitwise_equal(params[1].detach(), torch.full((4, 8), 2.5, dtype=torch.bfloat16),
                         "weights loaded into the frozen parameter")


def test_torch_checkpoint_with_a_parameter_never_stepped_loads_it_fresh():
    """torch's AdamW (and TE's FusedAdam) create a parameter's state at its first
    gradient: a checkpoint (no state_layout) without state for an unused parameter
    loads with that parameter's state fresh (zero moments), the others' as saved
    (S5.5); a shardadam checkpoint missing one is still refused (test_optimizer_errors)."""
    gen = torch.Generator().manual_seed(6)
    used, unused = (torch.nn.Parameter(torch.randn(4, 8, generator=gen)) for _ in range(2))
    adamw = torch.optim.AdamW([used, unused], lr=1e-2)
    for _ in range(2):
        used.grad = torch.randn(used.shape, generator=gen)
        adamw.step()
    saved = adamw.state_dict()
    assert set(saved["state"]) == {0}
    adamw.state[unused]  # torch's state is a defaultdict: a lookup leaves {} behind
    looked_up = adamw.state_dict()
    assert looked_up["state"][1] == {}
    for checkpoint in (saved, looked_up):  # {} is no state, as no entry is
        params = [torch.nn.Parameter(p.detach().clone()) for p in (used, unused)]
        opt = fused_adam()(params, lr=1e-2)
        opt.load_state_dict(checkpoint)
        assert opt.param_groups[0]["step"] == 2
        for name in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(opt.state[params[0]][name], adamw.state[used][name], name)
            assert bool((opt.state[params[1]][name] == 0).all()), name
    # a checkpoint taken before any step (TE's: no state, no step) loads as step 0
    fresh = fused_adam()([torch.nn.Parameter(used.detach().clone())], lr=1e-2)
    fresh.load_state_dict({"state": {}, "param_groups": [
        {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
        | {"params": [0]}]})
    assert fresh.param_groups[0]["step"] == 0


def test_group_keys_that_are_no_strings_load_as_torch_keeps_them():
    """S5.5: saved group keys replace the current ones, whatever their type (torch's
    optimizers keep them; this one refused a non-string key with a bare TypeError)."""
    param = torch.nn.Parameter(torch.randn(4))
    opt = fused_adam()([param], lr=1e-2)
    opt.param_groups[0][5] = "tag"
    saved = opt.state_dict()
    loaded = fused_adam()([torch.nn.Parameter(param.detach().clone())], lr=1e-2)
    loaded.load_state_dict(saved)
    assert loaded.param_groups[0][5] == "tag"


@pytest.mark.parametrize("torch_cls,adam_w_mode", [(torch.optim.Adam, False),
                                                  (torch.optim.AdamW, True)])
def test_torch_checkpoint_loads_into_the_matching_weight_decay(torch_cls, adam_w_mode):
    """torch's Adam (L2) loads into adam_w_mode=False and its AdamW into True (the other
    pairings are refused: test_optimizer_errors' torch-adam-l2). torch's options
    (amsgrad, maximize, foreach, ...) are checked, then dropped from the groups (S5.5):
    this optimizer's own checkpoint then loads back whatever its weight decay became."""
    params = make_params([torch.float32], [(4, 3)], seed=9)
    reference = torch_cls(params, lr=1e-2, weight_decay=0.1)
    params[0].grad = torch.ones(4, 3)
    reference.step()
    opt = fused_adam()(clone_params(params), lr=1e-2, adam_w_mode=adam_w_mode)
    opt.load_state_dict(reference.state_dict())
    assert opt.param_groups[0]["step"] == 1
    assert set(opt.param_groups[0]) == set(fused_adam()(clone_params(params)).param_groups[0])
    opt.param_groups[0]["weight_decay"] = 0.0 if adam_w_mode else 0.2
    twin = fused_adam()(clone_params(params), lr=1e-2, adam_w_mode=not adam_w_mode)
    twin.load_state_dict(opt.state_dict())
    assert twin.param_groups[0]["step"] == 1


def test_saved_group_keys_replace_and_missing_ones_keep_their_values():
    """S5.5: a saved group's keys replace the current ones, those it lacks keep their
    current values (torch replaces each group whole), and keys of others (a scheduler's
    ``initial_lr``, a trainer's tag) load as they are."""
    params = make_params([torch.float32], [(4, 3)], seed=10)
    src = fused_adam()(params, lr=1e-2, weight_decay=0.1)
    src.param_groups[0]["initial_lr"] = 1e-2
    src.param_groups[0]["tag"] = ("layer", 3)
    params[0].grad = torch.ones(4, 3)
    src.step()
    saved = src.state_dict()
    del saved["param_groups"][0]["weight_decay"]
    saved["param_groups"][0]["lr"] = 5e-3
    opt = fused_adam()(clone_params(params), lr=1e-1, weight_decay=0.3, eps=1e-6)
    opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["eps"], group["step"]) == \
        (5e-3, 0.3, 1e-8, 1)
    assert group["initial_lr"] == 1e-2 and group["tag"] == ("layer", 3)


def test_state_dict_post_hooks_get_the_returned_dict():
    """S5.4: a hook registered with register_state_dict_post_hook receives the very
    dict state_dict() returns (attributes it sets on the exported tensors reach whoever
    saves it), and one that returns a dict replaces it, as in torch."""
    params = make_params([torch.float32], [(4,)], seed=11)
    opt = fused_adam()(params)
    params[0].grad = torch.ones(4)
    opt.step()
    seen = []

    def mark(optimizer, state_dict):
        assert optimizer is opt
        state_dict["state"][0]["exp_avg"].chunk_meta = "kept"
        seen.append(state_dict)

    opt.register_state_dict_post_hook(mark)
    sd = opt.state_dict()
    assert len(seen) == 1 and seen[0] is sd and sd["state"][0]["exp_avg"].chunk_meta == "kept"
    opt.register_state_dict_post_hook(lambda optimizer, state_dict: {"replaced": True})
    assert opt.state_dict() == {"replaced": True}


@pytest.mark.parametrize("torch_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_torch_checkpoint_without_weight_decay_loads_into_either_mode(torch_cls):
    """With weight_decay 0 (torch Adam's default) L2 and decoupled decay are the same
    step, so either torch checkpoint loads into either mode (the other pairing is
    refused only with a weight decay: test_optimizer_errors' torch-adam-l2); both
    continue bitwise alike."""
    params = make_params([torch.float32], [(4, 3)], seed=9)
    reference = torch_cls(params, lr=1e-2, weight_decay=0.0)
    params[0].grad = torch.ones(4, 3)
    reference.step()
    results = []
    for adam_w_mode in (True, False):
        copies = clone_params(params)
        opt = fused_adam()(copies, lr=1e-2, adam_w_mode=adam_w_mode)
        opt.load_state_dict(reference.state_dict())
        assert opt.param_groups[0]["step"] == 1
        copies[0].grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
        opt.step()
        results.append((opt, copies))
    (a, params_a), (b, params_b) = results
    assert_same_optimizer_state(a, b, params_a, params_b, "AdamW mode against L2 mode")


def test_a_group_removed_after_its_moments_were_set_leaves_no_mark():
    """S5.4's ``moments=set`` mark belongs to a group at step 0: a group taken out of
    ``param_groups`` by hand after ``set_scaled_state`` leaves no mark behind, and
    ``state_dict()`` exports the groups there are."""
    a, b = (torch.nn.Parameter(torch.randn(4)) for _ in range(2))
    opt = fused_adam()([dict(params=[a]), dict(params=[b])], lr=0.1)
    opt.set_scaled_state(b, "exp_avg", torch.ones(4))
    assert opt.state_dict()["param_groups"][1]["state_layout"].endswith(" moments=set")
    opt.param_groups.pop()
    sd = opt.state_dict()
    assert [g["state_layout"] for g in sd["param_groups"]] == [
        "exp_avg=fp32 exp_avg_sq=fp32 master=none"]


def test_the_moments_set_mark_stays_with_its_group_when_another_is_removed():
    """S5.4, S5.5: ``moments=set`` marks the group whose moments were set, not a
    position: with a group before it removed by hand, the mark goes on describing it,
    and the optimizer's own checkpoint loads back (the mark fell off, and the load was
    refused as a torch checkpoint whose step counter was lost)."""
    a, b, c = (torch.nn.Parameter(torch.randn(4)) for _ in range(3))
    opt = fused_adam()([dict(params=[a]), dict(params=[b]), dict(params=[c])], lr=0.1)
    opt.set_scaled_state(c, "exp_avg", torch.full((4,), 0.5))
    del opt.param_groups[0]
    saved = opt.state_dict()
    assert [g["state_layout"].endswith(" moments=set") for g in saved["param_groups"]] == [
        False, True]
    loaded = fused_adam()([dict(params=[torch.nn.Parameter(p.detach().clone())])
                           for p in (b, c)], lr=0.1)
    loaded.load_state_dict(saved)
    assert torch.equal(loaded.get_unscaled_state(loaded.param_groups[1]["params"][0],
                                                 "exp_avg"), torch.full((4,), 0.5))
    assert loaded.state_dict()["param_groups"][1]["state_layout"].endswith(" moments=set")


def test_a_stepped_group_drops_moments_set_from_its_live_record():
    """S5.4: ``moments=set`` describes a group at step 0; the step that rebinds a group
    (here its first) records the layout without it, as state_dict() does."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = fused_adam()([p], lr=0.1)
    opt.set_scaled_state(p, "exp_avg", torch.ones(4))
    opt._plans = []  # the step rebinds, and rewrites the record
    p.grad = torch.ones(4)
    opt.step()
    assert opt.param_groups[0]["state_layout"] == "exp_avg=fp32 exp_avg_sq=fp32 master=none"
    assert opt.state_dict()["param_groups"][0]["state_layout"] == \
        opt.param_groups[0]["state_layout"]


def test_a_master_put_in_from_outside_is_read_as_it_is():
    """S1.6: a master that followed its parameter, replaced in ``optimizer.state`` from
    outside (as torch's ZeroRedundancyOptimizer loads one), is the truth:
    ``get_unscaled_state`` returns its values and does not re-seed it from the
    parameter."""
    p = torch.nn.Parameter(torch.randn(4).bfloat16())
    opt = fused_adam()([p], lr=0.1, master_weights=True)
    loaded = torch.full((4,), 3.0)
    opt.state[p]["master_param"] = loaded
    got = opt.get_unscaled_state(p, "master_param")
    assert_bitwise_equal(got, torch.full((4,), 3.0), "master read")
    assert_bitwise_equal(loaded, torch.full((4,), 3.0), "the master put in")
    assert opt.state[p]["master_param"] is loaded


def test_a_master_equal_to_the_seeded_one_but_not_bit_for_bit_is_the_truth(backend):
    """S1.6: a master loaded at step 0 without the masters=follow mark follows only where
    it is bit for bit the master seeded from the loaded parameter. One equal as floats
    but not in bits (+0.0 where the parameter holds -0.0) was set by hand: the first
    step starts from it, not from weights put into the model after the load."""
    settings = dict(lr=1e-2, master_weights=True)
    gen = torch.Generator().manual_seed(41)
    x = torch.randn(4, 8, generator=gen).bfloat16()
    x[0, 0] = 0.0
    saver_param = torch.nn.Parameter(x.clone())
    saver = fused_adam()([saver_param], **settings)
    saver.set_scaled_state(saver_param, "master_param", x.float())
    saved = saver.state_dict()
    assert "masters=follow" not in saved["param_groups"][0]["state_layout"]
    loading = x.clone()
    loading[0, 0] = -0.0
    param = torch.nn.Parameter(loading)
    opt = fused_adam()([param], **settings)
    opt.load_state_dict(saved)
    param.data.copy_(torch.randn(4, 8, generator=gen).bfloat16())  # put in after the load
    grad = torch.randn(4, 8, generator=gen).bfloat16()
    param.grad = grad.clone()
    opt.step()
    ref_param = torch.nn.Parameter(x.clone())
    ref = fused_adam()([ref_param], **settings)
    ref_param.grad = grad.clone()
    ref.step()
    assert_bitwise_equal(param.detach(), ref_param.detach(), "the first step from the master")


@pytest.mark.parametrize("master", ["fp32", "fp16", "remainder"])
@pytest.mark.parametrize("stepped", [False, True], ids=["before-first-step", "after-a-step"])
def test_a_round_trip_keeps_a_following_master_following(master, stepped):
    """S1.6, S5.5: a master exported while it followed its parameter (bit for bit its
    seeded value) loads following it: weights loaded into the model after a round trip
    through state_dict() before the first step (accelerate's prepare() makes one) are
    what the first step starts from, as without the round trip. A master that stepped
    is the truth after the round trip, as before it: the parameter takes its value."""
    kwargs = dict(master_weights=True, store_param_remainders=master == "remainder",
                  master_weight_dtype=torch.float16 if master == "fp16" else torch.float32)
    runs = []
    for trip in (False, True):
        gen = torch.Generator().manual_seed(21)
        param = torch.nn.Parameter(torch.randn(4, 64, generator=gen).bfloat16())
        opt = fused_adam()([param], lr=1e-2, **kwargs)
        if stepped:
            param.grad = torch.randn(4, 64, generator=gen).bfloat16()
            opt.step()
        if trip:
            opt.load_state_dict(opt.state_dict())
            assert (param in opt._seeded) == (not stepped and master != "remainder")
        with torch.no_grad():
            param.fill_(1.0)  # weights loaded into the model now
        param.grad = torch.full((4, 64), 0.5).bfloat16()
        opt.step()
        runs.append(param.detach().clone())
    assert_bitwise_equal(runs[1], runs[0], "after the round trip")
    if not stepped:  # Adam's first step moves each weight by about lr from 1.0: to
        # 0.99 within half a bf16 step below 1 (2^-9), which 1.0 is not
        assert torch.allclose(runs[0].float(), torch.full((4, 64), 1.0 - 1e-2), atol=2**-9)
