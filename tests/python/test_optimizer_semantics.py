"""Step-level rules of the contract for plain tensors: the constructor signature (S1.1),
state from construction (S1.6), which parameters get a master (S2.1), the step counter
(S2.8), gradient handling (S3.2, S3.4), the closure (S3.1), zero_grad (S4), and state
changes between steps being picked up by the next step.

Numbers are checked with _optimizer_testing.verify_step (float64 reference, derived bounds).
"""

import copy
import inspect
import math
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from _optimizer_testing import (
    Hyper, Precision, StepInputs, assert_bitwise_equal, assert_same_optimizer_state,
    assert_unchanged, attach_grads, capture_inputs, fused_adam, make_grads, make_params,
    scale_of, snapshot, state_tensors, verify_step)

HYPER = Hyper(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def test_constructor_signature():
    """S1.1: names, order, defaults and the keyword-only split, exactly (tools
    introspect them)."""
    sig = inspect.signature(fused_adam().__init__)
    expected = [
        ("params", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("lr", inspect.Parameter.POSITIONAL_OR_KEYWORD, 1e-3),
        ("betas", inspect.Parameter.POSITIONAL_OR_KEYWORD, (0.9, 0.999)),
        ("eps", inspect.Parameter.POSITIONAL_OR_KEYWORD, 1e-8),
        ("weight_decay", inspect.Parameter.POSITIONAL_OR_KEYWORD, 0.0),
        ("amsgrad", inspect.Parameter.POSITIONAL_OR_KEYWORD, False),
        ("bias_correction", inspect.Parameter.KEYWORD_ONLY, True),
        ("adam_w_mode", inspect.Parameter.KEYWORD_ONLY, True),
        ("capturable", inspect.Parameter.KEYWORD_ONLY, False),
        ("master_weights", inspect.Parameter.KEYWORD_ONLY, False),
        ("master_weight_dtype", inspect.Parameter.KEYWORD_ONLY, torch.float32),
        ("exp_avg_dtype", inspect.Parameter.KEYWORD_ONLY, torch.float32),
        ("exp_avg_sq_dtype", inspect.Parameter.KEYWORD_ONLY, torch.float32),
        ("use_decoupled_grad", inspect.Parameter.KEYWORD_ONLY, False),
        ("store_param_remainders", inspect.Parameter.KEYWORD_ONLY, False),
        ("set_grad_none", inspect.Parameter.KEYWORD_ONLY, None),
        # Beyond TE (S2.11, S2.14), after its arguments.
        ("moment_format", inspect.Parameter.KEYWORD_ONLY, None),
        ("moment_block_size", inspect.Parameter.KEYWORD_ONLY, None),
        ("param_rounding", inspect.Parameter.KEYWORD_ONLY, "nearest"),
    ]
    actual = [(p.name, p.kind, p.default) for p in sig.parameters.values()][1:]  # self
    assert actual == expected


def test_docstring_describes_every_argument_in_order():
    """help(FusedAdam) lists each constructor argument under Args, in the signature's
    order, so the text cannot fall behind the signature."""
    cls = fused_adam()
    args = cls.__doc__.split("Args", 1)[1]
    entries = re.findall(r"^ {8}(\w+(?:, \w+)*):", args, flags=re.MULTILINE)
    documented = [name for entry in entries for name in entry.split(", ")]
    assert documented == list(inspect.signature(cls.__init__).parameters)[1:]


def test_method_signatures():
    """The TE methods callers use, with their argument names and defaults."""
    cls = fused_adam()

    def names(method):
        return [(p.name, p.default) for p in
                list(inspect.signature(getattr(cls, method)).parameters.values())[1:]]

    empty = inspect.Parameter.empty
    assert names("step") == [("closure", None), ("grad_scaler", None)]
    assert names("zero_grad") == [("set_to_none", None)]
    assert names("initialize_state") == [("param", empty), ("store_param_remainders", None)]
    assert names("get_unscaled_state") == [("param", empty), ("state_name", empty),
                                           ("skip_unscale", False)]
    assert names("set_scaled_state") == [("param", empty), ("state_name", empty),
                                         ("unscaled_state", empty)]


# --------------------------------------------------------------------------------------
# S1.6 / S2.1: state from construction, who gets a master


MASTER_CASES = [
    # (config, param dtype, expected master storage dtype or None)
    (Precision(master="fp32"), torch.float32, None),  # fp32 params are their own master
    (Precision(master="fp16"), torch.float32, None),
    (Precision(master="rem"), torch.float32, None),
    (Precision(master="none"), torch.bfloat16, None),
    (Precision(master="none"), torch.float16, None),
    (Precision(master="fp32"), torch.bfloat16, torch.float32),
    (Precision(master="fp32"), torch.float16, torch.float32),
    (Precision(master="fp16"), torch.bfloat16, torch.float16),
    (Precision(master="rem"), torch.bfloat16, torch.int16),
    (Precision(master="rem"), torch.float16, torch.float32),  # remainders: bf16 only
]


@pytest.mark.parametrize("cfg,dtype,master", MASTER_CASES,
                         ids=[f"{c.id}-param={str(d)[6:]}" for c, d, _ in MASTER_CASES])
def test_master_only_where_s2_1_gives_one(cfg, dtype, master, backend):
    params = make_params([dtype], [(5,)], seed=1)
    opt = fused_adam()(params, **cfg.optimizer_kwargs())
    state = opt.state[params[0]]
    if master is None:
        assert "master_param" not in state
        with pytest.raises(KeyError, match="unknown state name 'master_param'"):
            opt.get_unscaled_state(params[0], "master_param")
    else:
        assert state["master_param"].dtype == master
    params[0].grad = torch.randn(5).to(dtype)
    opt.step()
    assert ("master_param" in opt.state[params[0]]) == (master is not None)


def test_master_fp16_ignores_store_param_remainders(backend):
    """S2.5: remainders only replace an fp32 master."""
    params = make_params([torch.bfloat16], [(5,)], seed=2)
    opt = fused_adam()(params, master_weights=True, master_weight_dtype=torch.float16,
                       store_param_remainders=True)
    assert opt.state[params[0]]["master_param"].dtype == torch.float16


@pytest.mark.parametrize("master_weights", [False, True])
def test_store_param_remainders_needs_master_weights_at_construction(master_weights,
                                                                      backend):
    """As in TE: the attribute is on only when master weights are on at construction, so
    switching master weights on later (S1.5) makes an fp32 master, not remainders."""
    params = make_params([torch.bfloat16], [(5,)], seed=2)
    opt = fused_adam()(params, master_weights=master_weights, store_param_remainders=True)
    assert opt.store_param_remainders is master_weights
    opt.master_weights = True
    params[0].grad = torch.ones(5, dtype=torch.bfloat16)
    opt.step()
    expected = torch.int16 if master_weights else torch.float32
    assert opt.state[params[0]]["master_param"].dtype == expected


# Each setting that shapes the state, changed after a step, and what the next step then
# stores: (construction keywords, attribute, new value, state name, stored dtype after).
_CHANGED_BETWEEN_STEPS = [
    (dict(master_weights=True, store_param_remainders=True), "store_param_remainders",
     False, "master_param", torch.float32),
    (dict(master_weights=True), "master_weight_dtype", torch.float16, "master_param",
     torch.float16),
    (dict(master_weights=True), "master_weights", False, "master_param", None),
    (dict(), "exp_avg_dtype", torch.bfloat16, "exp_avg", torch.bfloat16),
    (dict(), "exp_avg_sq_dtype", torch.float16, "exp_avg_sq", torch.float16),
    (dict(), "moment_format", "block8", "exp_avg", torch.uint8),
]


@pytest.mark.parametrize("kwargs, name, value, state, dtype", _CHANGED_BETWEEN_STEPS,
                         ids=[case[1] for case in _CHANGED_BETWEEN_STEPS])
def test_setting_changed_between_steps_shapes_the_next_step(kwargs, name, value, state,
                                                            dtype, backend):
    """S1.5: a setting changed after steps (the configuration of the last check is
    reused only while every setting is the same object) decides the state the next step
    stores."""
    params = make_params([torch.bfloat16], [(300,)], seed=2)
    opt = fused_adam()(params, **kwargs)
    for step in (1, 2):
        params[0].grad = torch.full((300,), 0.5 * step, dtype=torch.bfloat16)
        opt.step()
        if step == 1:
            setattr(opt, name, value)
    stored = opt.state[params[0]].get(state)
    assert (stored.dtype if stored is not None else None) == dtype


def test_state_exists_from_construction_and_add_param_group(backend):
    """S1.6: optimizer.state is never empty; add_param_group creates state for the new
    parameters without touching anyone's step."""
    params = make_params([torch.bfloat16, torch.float32], [(3,), (2,)], seed=3)
    opt = fused_adam()(params[:1], master_weights=True, exp_avg_dtype=torch.uint8)
    assert params[0] in opt.state and len(opt.state) == 1
    params[0].grad = torch.randn(3).bfloat16()
    opt.step()
    opt.add_param_group(dict(params=params[1:], lr=0.5))
    assert {k for k in opt.state[params[1]] if not k.endswith("_scale")} == \
        {"exp_avg", "exp_avg_sq"}
    assert scale_of(opt, params[1], "exp_avg").item() == 1.0
    assert scale_of(opt, params[1], "exp_avg_sq") is None
    assert [g["step"] for g in opt.param_groups] == [1, 0]
    assert bool((opt.get_unscaled_state(params[1], "exp_avg") == 0).all())


def test_param_swapped_in_after_construction_is_initialised_at_step(backend):
    """S1.6: a parameter without state at step time (swapped into a group) gets its
    state then: the step starts from zero moments and a master seeded from it."""
    params = make_params([torch.bfloat16, torch.bfloat16], [(6,), (4,)], seed=4)
    cfg = Precision(param="bf16", exp_avg="fp16", exp_avg_sq="bf16", master="fp32")
    opt = fused_adam()(params, **HYPER.optimizer_kwargs(), **cfg.optimizer_kwargs())
    grads = make_grads(params, [torch.bfloat16] * 2, 1, seed=5)
    attach_grads(params, grads, decoupled=False)
    opt.step()
    newcomer = make_params([torch.bfloat16], [(4,)], seed=6)[0]
    opt.param_groups[0]["params"][1] = newcomer
    assert newcomer not in opt.state
    current = [params[0], newcomer]
    grads = make_grads(current, [torch.bfloat16] * 2, 2, seed=5)
    attach_grads(current, grads, decoupled=False)
    inputs = capture_inputs(opt, current[:1])
    # what a fresh parameter starts from: zero moments, the weight is its own value
    zero = torch.zeros(4, dtype=torch.float64)
    inputs.append(StepInputs(w=newcomer.detach().double(), m=zero, v=zero,
                             param_bits=None, state_bits={}))
    opt.step()
    # one step counter per group (S2.8): the newcomer's first step is the group's step 2
    verify_step(opt, current, inputs, grads, HYPER, 2, "after swapping a param in")


def test_param_data_replaced_between_steps(backend):
    """Assigning new storage to a parameter (param.data = ...) between steps: the next
    step reads and writes the new storage."""
    params = make_params([torch.float32, torch.bfloat16], [(5,), (3,)], seed=7)
    opt = fused_adam()(params, **HYPER.optimizer_kwargs(), master_weights=False)
    for step in (1, 2):
        if step == 2:
            params[0].data = torch.randn(5) * 10
            params[1].data = (torch.randn(3) * 10).bfloat16()
        grads = make_grads(params, [p.dtype for p in params], step, seed=8)
        attach_grads(params, grads, decoupled=False)
        inputs = capture_inputs(opt, params)
        opt.step()
        verify_step(opt, params, inputs, grads, HYPER, step, "param.data replaced")


def test_param_shrunk_in_place_between_steps_is_rejected(backend):
    """``param.data = param.data[:n]`` keeps the data pointer but not the size: the next
    step must see a new parameter (its state no longer fits: an error naming it), never
    update the old size through the cached plan (memory past the parameter)."""
    params = make_params([torch.float32], [(8,)], seed=9)
    opt = fused_adam()(params, **HYPER.optimizer_kwargs())
    attach_grads(params, make_grads(params, [torch.float32], 1, seed=10), decoupled=False)
    opt.step()
    storage = params[0].data
    params[0].data = storage[:4]
    params[0].grad = torch.ones(4)
    tail = storage[4:].clone()
    before = snapshot(opt)
    shrunk = (r"group 0, param 0: state 'exp_avg' has local shape \(8,\) but the "
              r"parameter's local shape is \(4,\)")
    with pytest.raises(RuntimeError, match=shrunk):
        opt.step()
    # Nor is the state exported: a checkpoint of it could not be loaded back.
    with pytest.raises(RuntimeError, match=shrunk):
        opt.state_dict()
    with pytest.raises(RuntimeError, match=shrunk):
        opt.get_unscaled_state(params[0], "exp_avg")
    assert_unchanged(opt, before, "shrunk parameter")
    assert_bitwise_equal(storage[4:], tail, "storage past the shrunk parameter")


@pytest.mark.parametrize("change", ["dtype view", "transposed"])
def test_param_reviewed_in_place_between_steps(change, backend):
    """Same storage, same size, another dtype or other strides: the next step updates the
    parameter as it is now (a bf16 view of fp16 bits is bf16; a transposed matrix pairs
    each element with its own gradient)."""
    dtype = torch.float16 if change == "dtype view" else torch.float32
    params = make_params([dtype], [(4, 4)], seed=11)
    opt = fused_adam()(params, **HYPER.optimizer_kwargs(), master_weights=False)
    for step in (1, 2):
        if step == 2:
            p = params[0]
            p.data = p.data.view(torch.bfloat16) if change == "dtype view" else p.data.t()
        grads = make_grads(params, [params[0].dtype], step, seed=12)
        attach_grads(params, grads, decoupled=False)
        inputs = capture_inputs(opt, params)
        opt.step()
        verify_step(opt, params, inputs, grads, HYPER, step, f"param {change}")


# Views of one matrix that share no element though their memory ranges overlap.
INTERLEAVED = {"column halves": (np.s_[:, :4], np.s_[:, 4:]),
               "even and odd columns": (np.s_[:, ::2], np.s_[:, 1::2])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", list(INTERLEAVED))
def test_interleaved_views_of_one_tensor_step_apart(split, dtype, backend):
    """Two parameters that are disjoint views of one matrix (a fused weight split by
    columns) share no byte: they step as separate parameters (each against the float64
    reference), and the matrix between them is exactly the two results."""
    matrix = make_params([dtype], [(6, 8)], seed=15)[0].detach()
    params = [torch.nn.Parameter(matrix[index]) for index in INTERLEAVED[split]]
    opt = fused_adam()(params, **HYPER.optimizer_kwargs(), master_weights=False)
    for step in (1, 2):
        grads = make_grads(params, [dtype] * 2, step, seed=16)
        attach_grads(params, grads, decoupled=False)
        inputs = capture_inputs(opt, params)
        opt.step()
        verify_step(opt, params, inputs, grads, HYPER, step, split)
    for index, param in zip(INTERLEAVED[split], params):
        assert_bitwise_equal(matrix[index], param.detach(), "the matrix's view")


@pytest.mark.parametrize("new_dtype", [torch.float16, torch.float32])
def test_param_dtype_changed_under_remainders(new_dtype, backend):
    """A bf16 parameter with int16 remainders converted to fp16 or fp32 between steps
    (S2.5): the master is its value rounded back to bf16 with the remainder, exactly the
    master an fp32-master twin holds, so the two go on bitwise alike (an fp16 parameter
    keeps an fp32 master; an fp32 one is its own)."""
    params = make_params([torch.bfloat16], [(64,)], seed=13)
    twin = [p.detach().clone().requires_grad_() for p in params]
    opts = [fused_adam()(ps, lr=1e-2, master_weights=True, store_param_remainders=keep)
            for ps, keep in ((params, True), (twin, False))]
    for step in (1, 2, 3):
        if step == 2:
            for p in params + twin:
                p.data = p.data.to(new_dtype)
        grads = make_grads(params, [params[0].dtype], step, seed=14)
        for ps, opt in zip((params, twin), opts):
            attach_grads(ps, [g.clone() for g in grads], decoupled=False)
            opt.step()
        assert_bitwise_equal(params[0].detach(), twin[0].detach(), f"param, step {step}")
    exported = [opt.state_dict()["state"][0] for opt in opts]
    assert set(exported[0]) == set(exported[1])
    for key in exported[1]:
        assert_bitwise_equal(exported[0][key], exported[1][key], key)


def _exported_master(master, param):
    """The fp32 master M an export holds: as exported, or an int16 remainder (M's low
    half) beside the bf16 parameter (its high half, rounded ties away: S2.5)."""
    if master.dtype != torch.int16:
        return master
    high = param.view(torch.int16) - (master < 0).to(torch.int16)
    return torch.stack((master, high), dim=-1).view(torch.float32).squeeze(-1)


@pytest.mark.parametrize("remainders", [True, False], ids=["remainder", "fp32-master"])
def test_param_made_fp32_takes_its_master(remainders, backend):
    """A bf16 parameter converted to fp32 between steps is its own master from then on
    (S2.1): it takes the master's value M (S2.5), not its bf16 rounding, so a step
    that moves no weight (lr 0) leaves it at M bitwise."""
    params = make_params([torch.bfloat16], [(64,)], seed=17)
    opt = fused_adam()(params, lr=1e-2, master_weights=True,
                       store_param_remainders=remainders)
    for step in (1, 2):
        attach_grads(params, make_grads(params, [torch.bfloat16], step, seed=18), False)
        opt.step()
    master = _exported_master(opt.state_dict()["state"][0]["master_param"],
                              params[0].detach())
    assert not torch.equal(master, params[0].detach().float()), "M is its bf16 rounding"
    params[0].data = params[0].data.float()
    opt.param_groups[0]["lr"] = 0.0
    attach_grads(params, make_grads(params, [torch.float32], 3, seed=18), False)
    opt.step()
    assert_bitwise_equal(params[0].detach(), master, "fp32 parameter after the step")
    assert "master_param" not in opt.state[params[0]]


@pytest.mark.parametrize("remainders", [True, False], ids=["remainder", "fp32-master"])
def test_saved_masters_reach_fp32_parameters_only_through_a_dtype_change(remainders,
                                                                          backend):
    """S5.5: a checkpoint's masters loaded beside fp32 parameters (their own master) are
    dropped, the parameters keep the values the model loaded; loaded with the saved
    dtypes and then made fp32 (S2.5), each parameter takes its master at its next step."""
    kwargs = dict(lr=1e-2, master_weights=True, store_param_remainders=remainders)
    params = make_params([torch.bfloat16], [(64,)], seed=31)
    opt = fused_adam()(params, **kwargs)
    for step in (1, 2):
        attach_grads(params, make_grads(params, [torch.bfloat16], step, seed=32), False)
        opt.step()
    saved, saved_param = opt.state_dict(), params[0].detach().clone()
    master = _exported_master(saved["state"][0]["master_param"], saved_param)
    assert not torch.equal(master, saved_param.float()), "M is its bf16 rounding"

    as_fp32 = [torch.nn.Parameter(saved_param.float())]  # the model resumed in fp32
    dropped = fused_adam()(as_fp32, **kwargs)
    dropped.load_state_dict(copy.deepcopy(saved))
    assert "master_param" not in dropped.state[as_fp32[0]]
    assert_bitwise_equal(as_fp32[0].detach(), saved_param.float(), "fp32 parameter, loaded")

    resumed = [torch.nn.Parameter(saved_param.clone())]  # resumed in bf16, then made fp32
    again = fused_adam()(resumed, **kwargs)
    again.load_state_dict(copy.deepcopy(saved))
    resumed[0].data = resumed[0].data.float()
    again.param_groups[0]["lr"] = 0.0
    attach_grads(resumed, make_grads(resumed, [torch.float32], 3, seed=32), False)
    again.step()
    assert_bitwise_equal(resumed[0].detach(), master, "fp32 parameter after the step")


MASTER_KINDS = {"fp32": dict(), "fp16": dict(master_weight_dtype=torch.float16),
                "remainder": dict(store_param_remainders=True)}


def _loaded_weights(params, seed):
    """Weights a model loads after its optimizer was built (pretrained, a DCP model-only
    load): other values than the parameters had."""
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.data.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))


@pytest.mark.parametrize("master", list(MASTER_KINDS))
def test_weights_loaded_after_construction_are_not_undone(master, backend):
    """A master seeded from its parameter follows it until the parameter first steps
    (S1.6), as TE creates state at the first step: weights loaded into the model after
    the optimizer was built train on bitwise as with an optimizer built after the load
    (parameters and state), and state_dict() / get_unscaled_state() before that step
    report the loaded weights' master."""
    params = make_params([torch.bfloat16] * 2, [(6, 8), (5,)], seed=23)
    opt = fused_adam()(params, lr=1e-2, master_weights=True, **MASTER_KINDS[master])
    _loaded_weights(params, seed=24)
    reference_params = [p.detach().clone().requires_grad_() for p in params]
    reference = fused_adam()(reference_params, lr=1e-2, master_weights=True,
                             **MASTER_KINDS[master])
    exported = [o.state_dict()["state"] for o in (opt, reference)]
    for i, q in enumerate(reference_params):
        assert_bitwise_equal(exported[0][i]["master_param"], exported[1][i]["master_param"],
                             f"exported master {i}")
        assert_bitwise_equal(opt.get_unscaled_state(params[i], "master_param"),
                             reference.get_unscaled_state(q, "master_param"), f"master {i}")
    for step in (1, 2, 3):
        grads = make_grads(params, [torch.bfloat16] * 2, step, seed=25)
        for ps, o in ((params, opt), (reference_params, reference)):
            attach_grads(ps, [g.clone() for g in grads], False)
            o.step()
    assert_same_optimizer_state(reference, opt, reference_params, params, "after 3 steps")


@pytest.mark.parametrize("master", list(MASTER_KINDS))
def test_seeded_master_follows_its_parameter_until_it_steps(master, backend):
    """S1.6: a parameter without a gradient at the first step keeps following (its
    weights loaded later are its master at its own first step: with lr 0 it keeps them
    bitwise); once it has stepped, the master is the truth (the parameter is rounded
    from it, as in TE) and a value put into the parameter is overwritten (remainders
    excepted: they pair with the parameter's value, S2.5); a master set
    by set_scaled_state before the first step is kept (Megatron sets its main params
    so)."""
    params = make_params([torch.bfloat16] * 3, [(4, 8), (4, 8), (4, 8)], seed=27)
    opt = fused_adam()(params, lr=0.0, master_weights=True, **MASTER_KINDS[master])
    precise = params[2].detach().float() + 2.0**-12  # not a bf16 value
    if master == "fp32":
        opt.set_scaled_state(params[2], "master_param", precise)
    attach_grads(params, [torch.ones(4, 8, dtype=torch.bfloat16), None,
                          torch.ones(4, 8, dtype=torch.bfloat16)], False)
    opt.step()
    stepped = params[0].detach().clone()
    _loaded_weights(params[:2], seed=28)  # params[0] has stepped, params[1] has not
    loaded = params[1].detach().clone()
    attach_grads(params, [torch.ones(4, 8, dtype=torch.bfloat16)] * 3, False)
    opt.step()
    assert_bitwise_equal(params[1].detach(), loaded, "the unstepped parameter's weights")
    if master != "remainder":  # a remainder pairs with whatever bf16 value is there
        assert_bitwise_equal(params[0].detach(), stepped, "the stepped parameter's master")
    if master == "fp32":
        assert_bitwise_equal(opt.get_unscaled_state(params[2], "master_param"), precise,
                             "the master set by hand")


@pytest.mark.parametrize("master", list(MASTER_KINDS))
@pytest.mark.parametrize("how", ["entry", "tensor"])
def test_master_replaced_in_state_before_the_first_step_is_kept(master, how, backend):
    """S1.6: a master put into ``optimizer.state`` from outside (the whole entry, as
    torch's ZeroRedundancyOptimizer loads a checkpoint, or the tensor alone) no longer
    follows its parameter: the steps go on from it as from the same master loaded with
    load_state_dict, bitwise."""
    params = make_params([torch.bfloat16] * 2, [(4, 8), (300,)], seed=29)
    kwargs = dict(lr=1e-2, master_weights=True, **MASTER_KINDS[master])
    trained = fused_adam()(params, **kwargs)
    for step in (1, 2):
        attach_grads(params, make_grads(params, [torch.bfloat16] * 2, step, seed=30), False)
        trained.step()
    saved = copy.deepcopy(trained.state_dict())
    runs = []
    for replace in (False, True):
        copies = [p.detach().clone().requires_grad_() for p in params]
        opt = fused_adam()(copies, **kwargs)
        if replace:
            opt.param_groups[0]["step"] = saved["param_groups"][0]["step"]
            for i, q in enumerate(copies):
                values = {k: v.clone() for k, v in saved["state"][i].items()}
                if how == "entry":
                    opt.state[q] = values
                else:
                    opt.state[q]["master_param"] = values["master_param"]
                    for name in ("exp_avg", "exp_avg_sq"):
                        opt.set_scaled_state(q, name, values[name])
        else:
            opt.load_state_dict(copy.deepcopy(saved))
        for step in (3, 4):
            attach_grads(copies, make_grads(copies, [torch.bfloat16] * 2, step, seed=30),
                         False)
            opt.step()
        runs.append((opt, copies))
    (loaded, a), (replaced, b) = runs
    assert_same_optimizer_state(loaded, replaced, a, b, "master replaced in state")


# Changes between the load of weights and the first step (S1.5, S2.5): a master that
# follows its parameter is seeded anew, never converted from the weights before.
FOLLOW_CHANGES = {
    "param-made-fp32": (dict(), lambda opt, p: setattr(p, "data", p.data.float())),
    "remainders-on": (dict(), lambda opt, p: setattr(opt, "store_param_remainders", True)),
    "fp16-master-to-remainders": (
        dict(master_weight_dtype=torch.float16),
        lambda opt, p: (setattr(opt, "master_weight_dtype", torch.float32),
                        setattr(opt, "store_param_remainders", True))),
    "remainders-off": (dict(store_param_remainders=True),
                       lambda opt, p: setattr(opt, "store_param_remainders", False)),
}


@pytest.mark.parametrize("change", list(FOLLOW_CHANGES))
def test_following_master_survives_a_setting_change(change, backend):
    """S1.6 with S1.5 / S2.5: weights loaded after construction, then a setting or the
    parameter's dtype changed before the first step: a step that moves no weight (lr 0)
    keeps the loaded weights bitwise (converting the master seeded at construction
    would write the weights before into the parameter)."""
    kwargs, apply_change = FOLLOW_CHANGES[change]
    params = make_params([torch.bfloat16], [(4, 8)], seed=29)
    opt = fused_adam()(params, lr=0.0, master_weights=True, **kwargs)
    _loaded_weights(params, seed=30)
    apply_change(opt, params[0])
    loaded = params[0].detach().clone()
    attach_grads(params, [torch.ones_like(loaded)], False)
    opt.step()
    assert_bitwise_equal(params[0].detach(), loaded, "the loaded weights after the step")


def test_param_made_fp32_keeps_its_value_when_its_master_cannot_decode(backend):
    """S2.5: a parameter made fp32 takes its master's value unless the master's scale
    cannot decode it (an fp16 master's scale set to NaN in place): the parameter then
    keeps its own value, never NaN."""
    params = make_params([torch.bfloat16], [(4, 8)], seed=37)
    opt = fused_adam()(params, lr=0.0, master_weights=True,
                       master_weight_dtype=torch.float16)
    attach_grads(params, [torch.ones(4, 8, dtype=torch.bfloat16)], False)
    opt.step()
    opt._scales[params[0]]["master_param"].fill_(float("nan"))
    params[0].data = params[0].data.float()
    kept = params[0].detach().clone()
    attach_grads(params, [torch.ones(4, 8)], False)
    opt.step()
    assert_bitwise_equal(params[0].detach(), kept, "the fp32 parameter")


def test_master_created_at_a_step_without_gradient_follows(backend):
    """S1.6: master_weights switched on (S1.5) creates masters at the next step; one
    whose parameter has no gradient there follows it until its own first step."""
    params = make_params([torch.bfloat16] * 2, [(4, 8), (4, 8)], seed=31)
    opt = fused_adam()(params, lr=0.0)
    opt.master_weights = True
    attach_grads(params, [torch.ones(4, 8, dtype=torch.bfloat16), None], False)
    opt.step()
    assert "master_param" in opt.state[params[1]]
    _loaded_weights(params[1:], seed=32)
    loaded = params[1].detach().clone()
    attach_grads(params, [None, torch.ones(4, 8, dtype=torch.bfloat16)], False)
    opt.step()
    assert_bitwise_equal(params[1].detach(), loaded, "weights loaded before its first step")


def test_refused_step_leaves_a_master_following(backend):
    """S3.1 with S1.6: a step the core refuses on its own (one call: a gradient in the
    memory of another parameter) leaves a following master following: loaded weights
    after it are still the master's."""
    params = make_params([torch.bfloat16] * 2, [(4,), (4,)], seed=33)
    opt = fused_adam()(params, lr=0.0, master_weights=True)
    attach_grads(params, [torch.ones(4, dtype=torch.bfloat16), None], False)
    opt.step()  # binds the plan; params[1] has not stepped
    params[1].grad = params[0].detach()  # overlaps a parameter the step writes
    with pytest.raises(ValueError, match="overlaps|shares memory"):
        opt.step()
    _loaded_weights(params[1:], seed=34)
    loaded = params[1].detach().clone()
    attach_grads(params, [torch.ones(4, dtype=torch.bfloat16)] * 2, False)
    opt.step()
    assert_bitwise_equal(params[1].detach(), loaded, "weights loaded after the refusal")


def test_get_unscaled_state_hands_out_the_following_master_itself(backend):
    """S1.6 / S5.2: as in TE, get_unscaled_state of an fp32 master is the stored tensor
    itself, seeded from the parameter's value now; what is written into it is then the
    master (with lr 0 the parameter becomes its rounding)."""
    params = make_params([torch.bfloat16], [(4, 8)], seed=35)
    opt = fused_adam()(params, lr=0.0, master_weights=True)
    _loaded_weights(params, seed=36)
    master = opt.get_unscaled_state(params[0], "master_param")
    assert master.data_ptr() == opt.state[params[0]]["master_param"].data_ptr()
    assert_bitwise_equal(master, params[0].detach().float(), "seeded from the loaded weights")
    master.fill_(1.5)
    attach_grads(params, [torch.ones(4, 8, dtype=torch.bfloat16)], False)
    opt.step()
    assert_bitwise_equal(params[0].detach(), torch.full((4, 8), 1.5, dtype=torch.bfloat16),
                         "the parameter rounded from the master written")


# What moves: the state tensors (fp8, bf16 and an fp32 master) or the scales of fp16 /
# fp8 states (optimizer._scales).
MOVED = {"states": Precision(param="bf16", master="fp32", exp_avg="fp8", exp_avg_sq="bf16"),
         "scales": Precision(param="fp32", exp_avg="fp16", exp_avg_sq="fp8")}


@pytest.mark.parametrize("what", list(MOVED))
@pytest.mark.parametrize("move", ["share_memory_", "data", "set_"])
def test_state_memory_moved_in_place_is_followed(move, what, backend):
    """A state tensor or scale whose memory moves in place between steps
    (torch.multiprocessing calls share_memory_() on every CPU tensor it sends, e.g. a
    state_dict() handed to a saving process; `.data =`; `set_`) is read and written
    where it now lives: bitwise as a twin whose state never moved, and state_dict()
    decodes every state with the scale it was stored with."""
    cfg = MOVED[what]
    params = make_params(cfg.param_dtypes(2), [(5,), (3, 2)], seed=21)
    twin_params = [p.detach().clone().requires_grad_() for p in params]
    opts = [fused_adam()(ps, lr=1e-2, **cfg.optimizer_kwargs())
            for ps in (params, twin_params)]
    for step in range(3):
        grads = make_grads(params, [p.dtype for p in params], step, seed=21)
        for ps, opt in zip((params, twin_params), opts):
            attach_grads(ps, [g.clone() for g in grads], decoupled=False)
            opt.step()
        if step == 0:
            moved = opts[0].state if what == "states" else opts[0]._scales
            for value in moved[params[1]].values():
                if move == "share_memory_":
                    value.share_memory_()
                elif move == "data":
                    value.data = value.data.clone()
                else:
                    value.set_(value.detach().clone())
    for p, q in zip(params, twin_params):
        assert_bitwise_equal(p.detach(), q.detach(), "param")
        moved, kept = state_tensors(opts[0], p), state_tensors(opts[1], q)
        for key in kept:
            assert_bitwise_equal(moved[key], kept[key], key)
    exported = [opt.state_dict()["state"] for opt in opts]
    for i in exported[1]:
        for name, value in exported[1][i].items():
            assert_bitwise_equal(exported[0][i][name], value, f"state_dict() {i} {name}")


def test_parameters_without_memory_step_as_a_no_op(backend):
    """Parameters on the meta device have no memory to share: they are not taken for
    overlapping tensors, and a step (a no-op there, as torch's) counts (S2.8)."""
    params = [torch.nn.Parameter(torch.ones(4, device="meta")) for _ in range(2)]
    opt = fused_adam()(params, master_weights=True)
    params[0].grad = torch.ones(4, device="meta")
    opt.step()
    opt.step()
    assert opt.param_groups[0]["step"] == 2
    assert opt.state[params[0]]["exp_avg"].is_meta


@pytest.mark.parametrize("options", [dict(exp_avg_dtype=torch.uint8),
                                     dict(moment_format="block8"),
                                     dict(moment_format="block4")], ids=str)
def test_scaled_state_of_meta_parameters_is_built_on_meta(options):
    """S1.6: state exists from construction, on the parameter's device, for scaled
    formats too: a meta parameter (a model not yet materialized) gets meta state and
    scales, nothing to encode."""
    params = [torch.nn.Parameter(torch.ones(4, 300, device="meta"))]
    opt = fused_adam()(params, **options)
    assert all(value.is_meta for value in opt.state[params[0]].values())
    scales = opt._scales[params[0]]
    assert "exp_avg" in scales and all(scale.is_meta for scale in scales.values())


def test_state_set_between_steps_is_used(backend):
    """set_scaled_state and in-place edits of the state between steps are what the next
    step starts from."""
    cfg = Precision(param="bf16", exp_avg="fp16", exp_avg_sq="fp32", master="fp32")
    params = make_params([torch.bfloat16], [(8,)], seed=9)
    opt = fused_adam()(params, **HYPER.optimizer_kwargs(), **cfg.optimizer_kwargs())
    p = params[0]
    for step in (1, 2, 3):
        if step == 2:
            opt.set_scaled_state(p, "exp_avg", torch.randn(8) * 3)
            opt.set_scaled_state(p, "master_param", torch.randn(8))
        if step == 3:
            opt.state[p]["exp_avg_sq"].mul_(4.0)
        grads = make_grads(params, [torch.bfloat16], step, seed=10)
        attach_grads(params, grads, decoupled=False)
        inputs = capture_inputs(opt, params)
        opt.step()
        verify_step(opt, params, inputs, grads, HYPER, step, "state edited")


def test_state_replaced_or_reinitialized_between_steps_is_used(backend):
    """A state tensor replaced by a new object, or initialize_state, between two steps
    of one optimizer with nothing else in between: the next step starts from them (not
    from the storage the previous step used)."""
    cfg = Precision(param="bf16", exp_avg="bf16", exp_avg_sq="fp32", master="fp32")
    params = make_params([torch.bfloat16, torch.bfloat16], [(8,), (5,)], seed=12)
    opt = fused_adam()(params, **HYPER.optimizer_kwargs(), **cfg.optimizer_kwargs())
    for step in (1, 2, 3):
        if step == 2:
            opt.state[params[0]]["exp_avg_sq"] = torch.full((8,), 0.25)
        if step == 3:
            opt.initialize_state(params[1])  # zero moments, master from the param
        grads = make_grads(params, [torch.bfloat16] * 2, step, seed=13)
        attach_grads(params, grads, decoupled=False)
        inputs = capture_inputs(opt, params)
        opt.step()
        verify_step(opt, params, inputs, grads, HYPER, step, "state replaced")


CONFIG_CHANGES = {
    "master-on": ({}, {"master_weights": True}),
    "master-off": ({"master_weights": True}, {"master_weights": False}),
    "exp_avg-bf16": ({"master_weights": True}, {"exp_avg_dtype": torch.bfloat16}),
    "exp_avg_sq-fp8": ({}, {"exp_avg_sq_dtype": torch.uint8}),
    "decoupled-grad": ({}, {"use_decoupled_grad": True}),
}


@pytest.mark.parametrize("change", list(CONFIG_CHANGES))
def test_configuration_changed_between_steps_is_followed(change, backend):
    """Attributes set between two steps of one optimizer, with nothing else in between
    (no other optimizer built or stepped): the second step runs the new configuration,
    bitwise as an optimizer built with it from the first step's values."""
    before, after = CONFIG_CHANGES[change]
    shapes = [(8,), (3, 2)]

    def step_once(opt, params, step, decoupled):
        grads = make_grads(params, [torch.float32] * 2, step, seed=14)
        # with decoupled gradients set, .grad differs: the configuration picks one
        attach_grads(params, [(g * 3 if decoupled else g).bfloat16() for g in grads],
                     decoupled=False)
        if decoupled:
            attach_grads(params, grads, decoupled=True)
        opt.step()

    # The reference first, so that nothing runs between the two steps of `opt`.
    ref_params = make_params([torch.bfloat16] * 2, shapes, seed=15)
    first = fused_adam()(ref_params, **HYPER.optimizer_kwargs(), **before)
    step_once(first, ref_params, 1, False)
    ref = fused_adam()(ref_params, **HYPER.optimizer_kwargs(), **{**before, **after})
    for p in ref_params:
        for name in ("exp_avg", "exp_avg_sq"):
            ref.set_scaled_state(p, name, first.get_unscaled_state(p, name))
        if "master_param" in first.state[p] and "master_param" in ref.state[p]:
            ref.set_scaled_state(p, "master_param", first.get_unscaled_state(p, "master_param"))
    ref.param_groups[0]["step"] = 1
    step_once(ref, ref_params, 2, after.get("use_decoupled_grad", False))

    params = make_params([torch.bfloat16] * 2, shapes, seed=15)
    opt = fused_adam()(params, **HYPER.optimizer_kwargs(), **before)
    step_once(opt, params, 1, False)
    for key, value in after.items():
        setattr(opt, key, value)
    step_once(opt, params, 2, after.get("use_decoupled_grad", False))
    assert_same_optimizer_state(ref, opt, ref_params, params, change)


@pytest.mark.filterwarnings("error:Dynamo does not know how to trace:UserWarning")
def test_step_called_from_compiled_code_runs_eagerly(backend):
    """torch.compile around code that calls step(): dynamo cannot trace the step (raw
    pointers into the core, cached plans), so the step runs eagerly there -- also the
    steps that build a plan (the first, and the one after load_state_dict) -- and
    gives the eager optimizer's bits."""
    torch._dynamo.reset()
    cfg = Precision(param="bf16", exp_avg="fp8", exp_avg_sq="bf16", master="fp32")
    runs = []
    for compiled in (False, True):
        params = make_params([torch.bfloat16, torch.float32], [(6,), (2, 3)], seed=16)
        opt = fused_adam()(params, **HYPER.optimizer_kwargs(), **cfg.optimizer_kwargs())
        step = torch.compile(opt.step, backend="eager", fullgraph=False) if compiled \
            else opt.step
        for n in (1, 2, 3):
            if n == 3:
                opt.load_state_dict(opt.state_dict())
            attach_grads(params, make_grads(params, [p.dtype for p in params], n, seed=17),
                         decoupled=False)
            step()
        runs.append((opt, params))
    (eager, eager_params), (opt, params) = runs
    assert_same_optimizer_state(eager, opt, eager_params, params, "compiled caller")
    assert [g["step"] for g in opt.param_groups] == [3]


def _inductor_unavailable():
    """Why torch.compile's default backend cannot run here, or None."""
    try:
        torch._dynamo.reset()
        fn = torch.compile(lambda x: x * 2 + 1)
        if not torch.equal(fn(torch.arange(4.0)), torch.arange(4.0) * 2 + 1):
            return "inductor compiled a wrong result for x * 2 + 1"
    except Exception as error:  # noqa: BLE001 - no C++ compiler, no triton, ...
        return f"the inductor backend cannot compile here: {type(error).__name__}: {error}"
    finally:
        torch._dynamo.reset()
    return None


@pytest.mark.filterwarnings("error:Dynamo does not know how to trace:UserWarning")
@pytest.mark.parametrize("compile_backend", ["inductor", "eager"])
def test_compiled_training_step_gives_the_eager_bits(backend, compile_backend):
    """S3.9: a whole training step compiled with torch.compile -- forward,
    loss.backward(), opt.step(), opt.zero_grad() -- gives the eager loop's bits in
    parameters, every stored state and scale, and the step count, over the steps that
    build a plan (the first, and the one after load_state_dict) and steady ones. The
    loss is linear in the parameters, so every gradient is exact whatever the compiler
    fuses, and any difference is the optimizer's."""
    if compile_backend == "inductor":
        reason = _inductor_unavailable()
        if reason is not None:
            pytest.skip(reason)
    cfg = Precision(param="bf16", exp_avg="fp8", exp_avg_sq="bf16", master="fp32")
    shapes = [(6,), (2, 3), (33,)]
    gen = torch.Generator().manual_seed(18)
    weights = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(5)]

    def train(params, opt, step_weights):
        loss = sum((p.float() * w).sum() for p, w in zip(params, step_weights))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        params = make_params([torch.bfloat16, torch.float32, torch.bfloat16], shapes,
                             seed=19)
        opt = fused_adam()(params, **HYPER.optimizer_kwargs(), **cfg.optimizer_kwargs())
        run = torch.compile(train, backend=compile_backend) if compiled else train
        for n, step_weights in enumerate(weights, start=1):
            if n == 3:
                opt.load_state_dict(opt.state_dict())
            run(params, opt, step_weights)
            assert all(p.grad is None for p in params), f"step {n}: zero_grad"
        if compiled:  # the forward and backward did run as compiled graphs
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
        runs.append((opt, params))
    torch._dynamo.reset()
    (eager, eager_params), (opt, params) = runs
    assert_same_optimizer_state(eager, opt, eager_params, params,
                                f"train compiled with backend={compile_backend}")
    assert [g["step"] for g in opt.param_groups] == [len(weights)]


def test_import_leaves_dynamo_unloaded():
    """Marking the step for torch.compile must not import dynamo with the package (it
    costs ~1.5 s); it is imported at the first step."""
    code = ("import sys, torch, shardadam; "
            "sys.exit('torch._dynamo' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# --------------------------------------------------------------------------------------
# S2.8: the step counter


def test_step_advances_for_empty_and_gradient_free_groups(backend):
    params = make_params([torch.float32, torch.bfloat16, torch.float32],
                         [(3,), (2,), (0,)], seed=11)
    opt = fused_adam()([dict(params=params[:1]), dict(params=[]),
                        dict(params=params[1:2]), dict(params=params[2:])],
                       master_weights=True, exp_avg_sq_dtype=torch.float16)
    params[0].grad = torch.ones(3)
    params[2].grad = torch.zeros(0)
    untouched = {key: value.clone() for key, value in state_tensors(opt, params[1]).items()}
    untouched["param"] = params[1].detach().clone()
    for step in (1, 2, 3):
        opt.step()
        assert [g["step"] for g in opt.param_groups] == [step] * 4
        assert all(type(g["step"]) is int for g in opt.param_groups)
    # the group without gradients kept its state bitwise (S3.2)
    now = dict(state_tensors(opt, params[1]), param=params[1].detach())
    for key, value in untouched.items():
        assert_bitwise_equal(now[key], value, f"gradient-free param {key}")


def test_group_without_step_counter_counts_from_zero(backend):
    """A group whose 'step' key is gone (or one appended to param_groups directly) has
    taken no step: its next step is step 1, bitwise as with the counter set to 0."""
    params = make_params([torch.float32], [(6,)], seed=13)
    opt = fused_adam()(params, lr=0.1)
    for _ in range(2):
        params[0].grad = torch.randn(6, generator=torch.Generator().manual_seed(1))
        opt.step()
    twin = copy.deepcopy(opt)
    twin_param = twin.param_groups[0]["params"][0]
    del opt.param_groups[0]["step"]
    twin.param_groups[0]["step"] = 0
    grad = torch.randn(6, generator=torch.Generator().manual_seed(2))
    params[0].grad, twin_param.grad = grad.clone(), grad.clone()
    opt.step()
    twin.step()
    assert opt.param_groups[0]["step"] == twin.param_groups[0]["step"] == 1
    assert_bitwise_equal(params[0].detach(), twin_param.detach(), "param")
    for key, value in state_tensors(opt, params[0]).items():
        assert_bitwise_equal(value, state_tensors(twin, twin_param)[key], key)


def test_a_stepped_group_dict_brings_its_count_to_a_new_optimizer(backend):
    """S2.8: the counter lives in the group dict, which is the dict handed to the
    constructor (as torch's add_param_group keeps it): a new optimizer over a dict
    another one stepped takes its next step from that count (fresh moments, step 3's
    bias corrections), bitwise as a fresh optimizer whose counter was set to 2."""
    params = make_params([torch.float32], [(6,)], seed=14)
    group = {"params": params}
    first = fused_adam()([group], lr=0.1)
    assert first.param_groups[0] is group
    for seed in (1, 2):
        params[0].grad = torch.randn(6, generator=torch.Generator().manual_seed(seed))
        first.step()
    assert group["step"] == 2
    twin_param = torch.nn.Parameter(params[0].detach().clone())
    second = fused_adam()([group], lr=0.1)
    twin = fused_adam()([twin_param], lr=0.1)
    assert second.param_groups[0] is group and group["step"] == 2
    twin.param_groups[0]["step"] = 2
    grad = torch.randn(6, generator=torch.Generator().manual_seed(3))
    params[0].grad, twin_param.grad = grad.clone(), grad.clone()
    second.step()
    twin.step()
    assert group["step"] == twin.param_groups[0]["step"] == 3
    assert_bitwise_equal(params[0].detach(), twin_param.detach(), "param")
    for key, value in state_tensors(second, params[0]).items():
        assert_bitwise_equal(value, state_tensors(twin, twin_param)[key], key)


def test_numpy_numbers_step_as_the_floats_they_hold(backend):
    """S1.2: hyper-parameters may be numpy numbers (np.float32, np.float64, numpy ints),
    read as float(x): the step is bitwise that of the Python floats."""
    numpy_values = dict(lr=np.float32(1e-2), betas=(np.float32(0.9), np.float64(0.99)),
                        eps=np.float64(1e-6), weight_decay=np.int64(0))
    as_floats = dict(lr=float(numpy_values["lr"]),
                     betas=tuple(float(b) for b in numpy_values["betas"]),
                     eps=1e-6, weight_decay=0.0)
    runs = []
    for options in (numpy_values, as_floats):
        params = make_params([torch.float32, torch.bfloat16], [(5,), (3, 4)], seed=15)
        opt = fused_adam()(params, master_weights=True, **options)
        for step in range(2):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(
                    10 * step + i)).to(p.dtype)
            opt.step()
        runs.append((opt, params))
    (a, params_a), (b, params_b) = runs
    assert_same_optimizer_state(a, b, params_a, params_b, "numpy numbers")


def test_step_with_no_gradients_at_all_still_counts(backend):
    params = make_params([torch.float32], [(3,)], seed=12)
    opt = fused_adam()(params)
    before = snapshot(opt)
    opt.step()
    assert opt.param_groups[0]["step"] == 1
    before["groups"][0]["step"] = 1
    assert_unchanged(opt, before, "everything but the step")


# --------------------------------------------------------------------------------------
# S3.2 / S3.4: gradients


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("decoupled", [False, True], ids=["grad", "decoupled_grad"])
def test_none_grads_skipped_and_grads_never_written(adam_w_mode, decoupled, backend):
    """S3.2: a None gradient skips its parameter (state bitwise kept, scales not
    recomputed); gradients are read, never written, also in L2 mode where the penalty
    is added to the gradient (in registers only)."""
    cfg = Precision(param="fp16+bf16", grad="fp32" if decoupled else "same",
                    exp_avg="fp8", exp_avg_sq="fp16", master="fp32")
    hyper = Hyper(**{**HYPER.__dict__, "adam_w_mode": adam_w_mode, "weight_decay": 0.5})
    params = make_params(cfg.param_dtypes(4), [(4, 3), (5,), (2, 2), (1,)], seed=13)
    opt = fused_adam()(params, **hyper.optimizer_kwargs(), **cfg.optimizer_kwargs())
    for step in (1, 2, 3):
        grads = make_grads(params, [cfg.grad_dtype(p.dtype) for p in params], step, seed=14)
        grads[step % 4] = None  # a different parameter sits out each step
        attach_grads(params, grads, decoupled)
        copies = [None if g is None else g.clone() for g in grads]
        inputs = capture_inputs(opt, params)
        opt.step()
        verify_step(opt, params, inputs, grads, hyper, step, "mixed None grads")
        for i, (g, c) in enumerate(zip(grads, copies)):
            if g is not None:
                assert_bitwise_equal(g, c, f"step {step}: gradient {i} was written")
            source = getattr(params[i], "decoupled_grad" if decoupled else "grad")
            assert source is g, "the optimizer replaced a gradient"


def test_decoupled_grad_missing_attribute_means_none(backend):
    """S3.2: with use_decoupled_grad a parameter without the attribute is skipped, even
    if it has a .grad."""
    params = make_params([torch.float32, torch.float32], [(3,), (3,)], seed=15)
    opt = fused_adam()(params, lr=0.1, use_decoupled_grad=True)
    params[0].grad = torch.ones(3)
    params[1].decoupled_grad = torch.ones(3)
    first = params[0].detach().clone()
    opt.step()
    assert_bitwise_equal(params[0].detach(), first, "param without decoupled_grad")
    assert bool((opt.get_unscaled_state(params[0], "exp_avg") == 0).all())
    assert bool((opt.get_unscaled_state(params[1], "exp_avg") != 0).all())


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "step-hook"])
def test_a_skipped_param_holding_a_decoupled_grad_warns(hooked, backend):
    """S3.2: use_decoupled_grad=False beside a parameter with no .grad but a
    decoupled_grad (Megatron FSDP's use_decoupled_grad=True writes only that) skips it,
    as TE does, and warns, naming it, at the caller's line (also through torch's hook
    wrapper); the parameters that have a .grad step. No warning where the skipped
    parameter holds none, or where the optimizer reads it."""
    params = make_params([torch.float32] * 3, [(3,), (4,), (2,)], seed=15)
    opt = fused_adam()([{"params": params[:2], "param_names": ["a", "b"]},
                        {"params": params[2:], "param_names": ["c"]}], lr=0.1)
    if hooked:
        opt.register_step_pre_hook(lambda *_: None)
    params[0].grad = torch.ones(3)
    params[1].decoupled_grad = torch.ones(4)
    params[2].grad = None  # skipped, holding nothing: no warning for it
    before = [p.detach().clone() for p in params]
    with pytest.warns(UserWarning) as caught:
        opt.step()
    ours = [w for w in caught if "decoupled_grad" in str(w.message)]
    messages = [str(w.message) for w in ours]
    assert messages == [
        "FusedAdam: group 0, param 1 ('b'): has no .grad but a decoupled_grad tensor, "
        "which use_decoupled_grad=False does not read: it is not stepped (Megatron "
        "FSDP's use_decoupled_grad=True needs FusedAdam(use_decoupled_grad=True) too; "
        "S3.2)"], messages
    assert ours[0].filename == __file__, "the warning points at the step() call"
    assert not bool((params[0].detach() == before[0]).any()), "a .grad steps"
    assert_bitwise_equal(params[1].detach(), before[1], "skipped: decoupled_grad unread")
    assert_bitwise_equal(params[2].detach(), before[2], "skipped")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params[1].decoupled_grad = None
        opt.step()  # nothing skipped holds a decoupled_grad: silent
        params[1].decoupled_grad = torch.ones(4)
        opt.use_decoupled_grad = True
        opt.step()  # read: silent, and it steps
    assert not bool((params[1].detach() == before[1]).any())


def test_non_contiguous_gradient(backend):
    """A gradient given as a strided view (e.g. a transpose) is read by logical element:
    the step equals the one with the same values laid out contiguously."""
    runs = []
    for contiguous in (True, False):
        params = make_params([torch.float32, torch.bfloat16], [(3, 5), (4, 2)], seed=16)
        opt = fused_adam()(params, lr=0.1, use_decoupled_grad=True, master_weights=True,
                           exp_avg_dtype=torch.bfloat16)
        generator = torch.Generator().manual_seed(17)
        for p in params:
            g = torch.randn(p.shape[1], p.shape[0], generator=generator).t()
            p.decoupled_grad = g.contiguous() if contiguous else g
        opt.step()
        runs.append((opt, params))
    (a, pa), (b, pb) = runs
    assert not pb[0].decoupled_grad.is_contiguous()
    for i, (p, q) in enumerate(zip(pa, pb)):
        assert_bitwise_equal(q.detach(), p.detach(), f"param {i}")
        for key, value in a.state[p].items():
            assert_bitwise_equal(b.state[q][key], value, f"param {i} {key}")


def test_lazily_negated_gradient(backend):
    """A gradient with torch's neg bit (its memory holds the negated values, e.g. the
    imaginary part of a conjugate) is read by value, as torch's optimizers read it: the
    step equals the one with the same values resolved."""
    runs = []
    for negated in (False, True):
        params = make_params([torch.float32, torch.bfloat16], [(3, 5), (4, 2)], seed=18)
        opt = fused_adam()(params, lr=0.1, master_weights=True, exp_avg_dtype=torch.uint8)
        generator = torch.Generator().manual_seed(19)
        for p in params:
            g = torch.randn(p.shape, generator=generator).to(p.dtype)
            p.grad = g.neg()._neg_view() if negated else g
        opt.step()
        runs.append((opt, params))
    (a, pa), (b, pb) = runs
    assert pb[0].grad.is_neg() and pb[0].grad.is_contiguous()
    for i, (p, q) in enumerate(zip(pa, pb)):
        assert_bitwise_equal(q.detach(), p.detach(), f"param {i}")
        for key, value in a.state[p].items():
            assert_bitwise_equal(b.state[q][key], value, f"param {i} {key}")


def test_memoryless_zero_gradient(backend):
    """torch's memoryless zeros (``torch._efficientzerotensor``: no memory, a null data
    pointer) are read by value, as zeros: the step equals the one with ``torch.zeros``
    (the core refused it as a null gradient, the torch path stepped it)."""
    runs = []
    for memoryless in (False, True):
        params = make_params([torch.float32, torch.bfloat16], [(3, 5), (4, 2)], seed=20)
        opt = fused_adam()(params, lr=0.1, master_weights=True, exp_avg_dtype=torch.uint8)
        generator = torch.Generator().manual_seed(21)
        for step in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
            if step == 1:
                params[0].grad = (torch._efficientzerotensor(params[0].shape) if memoryless
                                  else torch.zeros(params[0].shape))
            opt.step()
        runs.append((opt, params))
    (a, pa), (b, pb) = runs
    assert pb[0].grad._is_zerotensor()
    assert_same_optimizer_state(a, b, pa, pb, "memoryless zeros")


FLAT_CASES = [
    Precision(param="bf16", grad="fp32", exp_avg="fp8", exp_avg_sq="fp16", master="rem"),
    Precision(param="fp32", grad="bf16", exp_avg="bf16", exp_avg_sq="fp32"),
]


@pytest.mark.parametrize("cfg", FLAT_CASES, ids=[c.id for c in FLAT_CASES])
def test_params_and_grads_as_views_into_flat_buffers(cfg, backend):
    """Megatron-style: parameters and gradients are views into one flat buffer each, at
    element offsets that leave them unaligned. Results equal those of standalone
    tensors bitwise, and the buffers' bytes between and around the views (filled with
    a sentinel) are never written."""
    shapes = [(3, 7), (1,), (17,), (2, 2, 2)]
    dtypes = cfg.param_dtypes(len(shapes))
    standalone = make_params(dtypes, shapes, seed=30)
    sizes = [math.prod(s) for s in shapes]
    gap = 3  # sentinel elements before, between and after the views
    flat_p = torch.empty(sum(sizes) + gap * (len(sizes) + 1), dtype=dtypes[0])
    flat_g = torch.empty(flat_p.shape, dtype=cfg.grad_dtype(dtypes[0]))
    for flat in (flat_p, flat_g):
        flat.view(torch.uint8).fill_(0x5A)
    sentinel_p, sentinel_g = flat_p.clone(), flat_g.clone()
    views, used = [], torch.zeros(flat_p.shape, dtype=torch.bool)
    start = gap
    for p, n, shape in zip(standalone, sizes, shapes):
        view = flat_p[start:start + n].view(shape)
        view.copy_(p.detach())
        views.append(torch.nn.Parameter(view))  # shares the flat storage
        used[start:start + n] = True
        start += n + gap
    assert views[0].data_ptr() != flat_p.data_ptr()
    runs = {}
    for name, params in (("standalone", standalone), ("views", views)):
        runs[name] = fused_adam()(params, **HYPER.optimizer_kwargs(),
                                  **cfg.optimizer_kwargs())
    for step in (1, 2, 3):
        grads = make_grads(standalone, [cfg.grad_dtype(d) for d in dtypes], step, seed=31)
        attach_grads(standalone, grads, cfg.decoupled)
        start, grad_views = gap, []
        for g, n in zip(grads, sizes):
            view = flat_g[start:start + n].view(g.shape)
            view.copy_(g)
            grad_views.append(view)
            start += n + gap
        attach_grads(views, grad_views, cfg.decoupled)
        for name in runs:
            runs[name].step()
        assert_bitwise_equal(flat_p[~used], sentinel_p[~used], "param buffer outside views")
        assert_bitwise_equal(flat_g[~used], sentinel_g[~used], "grad buffer outside views")
        for i, (p, q) in enumerate(zip(standalone, views)):
            assert_bitwise_equal(q.detach(), p.detach(), f"step {step} param {i}")
            expected = state_tensors(runs["standalone"], p)
            actual = state_tensors(runs["views"], q)
            assert sorted(actual) == sorted(expected), f"step {step} param {i} state names"
            for key, value in expected.items():  # scales included
                assert_bitwise_equal(actual[key], value, f"step {step} param {i} {key}")


@pytest.mark.parametrize("layout", ["transposed", "columns"])
def test_non_contiguous_params(layout, backend):
    """A parameter that is a strided tensor is updated by logical element, exactly like
    its contiguous copy: transposed (dense: stepped where it lies, its states in its
    memory order, S2.6) or every other column of a wider matrix (stepped through a
    copy)."""
    cfg = Precision(param="bf16", exp_avg="fp16", exp_avg_sq="bf16", master="fp32")
    base = make_params([torch.bfloat16], [(5, 3)], seed=32)[0].detach()
    if layout == "transposed":
        strided = [torch.nn.Parameter(base.clone().t())]
    else:
        wide = torch.stack((base.t(), torch.zeros_like(base.t())), dim=-1)
        strided = [torch.nn.Parameter(wide[..., 0])]
    compact = [torch.nn.Parameter(base.clone().t().contiguous())]
    assert not strided[0].is_contiguous()
    opts = [fused_adam()(ps, **HYPER.optimizer_kwargs(), **cfg.optimizer_kwargs())
            for ps in (strided, compact)]
    for step in (1, 2):
        grads = make_grads(compact, [torch.bfloat16], step, seed=33)
        attach_grads(compact, grads, False)
        attach_grads(strided, [g.t().contiguous().t() for g in grads], False)
        inputs = capture_inputs(opts[0], strided)
        for opt in opts:
            opt.step()
        verify_step(opts[0], strided, inputs, grads, HYPER, step, "strided param")
        assert_bitwise_equal(strided[0].detach().contiguous(), compact[0].detach(),
                             f"step {step}: strided vs contiguous")


def test_grad_dtypes_in_any_combination(backend):
    """S3.4: fp32 / fp16 / bf16 gradients for fp32 / fp16 / bf16 parameters."""
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    params, grads = [], []
    generator = torch.Generator().manual_seed(18)
    for p_dtype in dtypes:
        for g_dtype in dtypes:
            values = torch.randn(6, generator=generator).to(p_dtype)
            params.append(torch.nn.Parameter(values))
            grads.append(torch.randn(6, generator=generator).to(g_dtype))
    opt = fused_adam()(params, **HYPER.optimizer_kwargs(), use_decoupled_grad=True)
    attach_grads(params, grads, decoupled=True)
    inputs = capture_inputs(opt, params)
    opt.step()
    verify_step(opt, params, inputs, grads, HYPER, 1, "grad dtype matrix")


# --------------------------------------------------------------------------------------
# S3.1: closure


def test_closure_runs_with_grad_enabled_and_its_loss_is_returned(backend):
    params = make_params([torch.float32], [(4,)], seed=19)
    opt = fused_adam()(params, **HYPER.optimizer_kwargs())
    target = torch.arange(4.0)
    seen = {}

    def closure():
        seen["grad_enabled"] = torch.is_grad_enabled()
        opt.zero_grad()
        loss = ((params[0] - target) ** 2).sum()
        loss.backward()
        seen["grad"] = params[0].grad.clone()
        return loss

    inputs = capture_inputs(opt, params)
    with torch.no_grad():
        loss = opt.step(closure)
    assert seen["grad_enabled"] is True
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    verify_step(opt, params, inputs, [seen["grad"]], HYPER, 1, "closure step")


def test_a_closure_may_step_and_one_that_raises_changes_nothing(backend):
    """S3.1: the closure runs before the step's checks, so it may step itself (two steps,
    each against the reference from the state before it); a closure that raises leaves
    everything as it was."""
    params = make_params([torch.float32, torch.bfloat16], [(4,), (3,)], seed=20)
    opt = fused_adam()(params, master_weights=True, **HYPER.optimizer_kwargs())
    dtypes = [torch.float32, torch.bfloat16]
    first, second = (make_grads(params, dtypes, step, seed=21) for step in (1, 2))
    seen = {}

    def closure():
        attach_grads(params, first, False)
        inputs = capture_inputs(opt, params)
        opt.step()
        verify_step(opt, params, inputs, first, HYPER, 1, "the closure's step")
        seen["after"] = capture_inputs(opt, params)
        attach_grads(params, second, False)
        return torch.tensor(3.0)

    assert opt.step(closure).item() == 3.0
    assert opt.param_groups[0]["step"] == 2
    verify_step(opt, params, seen["after"], second, HYPER, 2, "the step after the closure's")
    before = snapshot(opt)

    def failing():
        raise ZeroDivisionError("the closure failed")

    with pytest.raises(ZeroDivisionError, match="the closure failed"):
        opt.step(failing)
    assert_unchanged(opt, before)


# --------------------------------------------------------------------------------------
# S4: zero_grad


def test_zero_grad_defaults_to_none(backend):
    params = make_params([torch.float32, torch.bfloat16], [(3,), (2,)], seed=20)
    opt = fused_adam()(params)
    for p in params:
        p.grad = torch.ones(p.shape, dtype=p.dtype)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_zero_grad_set_to_none_false_zeroes(backend):
    params = make_params([torch.float32], [(3,)], seed=21)
    opt = fused_adam()(params)
    grad = torch.ones(3)
    params[0].grad = grad
    opt.zero_grad(set_to_none=False)
    assert params[0].grad is grad and bool((grad == 0).all())


def test_zero_grad_uses_deprecated_constructor_value(backend):
    params = make_params([torch.float32], [(3,)], seed=22)
    with pytest.warns(DeprecationWarning):
        opt = fused_adam()(params, set_grad_none=False)
    params[0].grad = torch.ones(3)
    opt.zero_grad()
    assert params[0].grad is not None and bool((params[0].grad == 0).all())


def test_zero_grad_contradicting_the_constructor_is_an_error(backend):
    """S4: set_grad_none given to the constructor and a different set_to_none to
    zero_grad: a ValueError, and the gradient is left as it was."""
    params = make_params([torch.float32], [(3,)], seed=24)
    with pytest.warns(DeprecationWarning):
        opt = fused_adam()(params, set_grad_none=True)
    grad = torch.ones(3)
    params[0].grad = grad
    with pytest.raises(ValueError, match=r"set_to_none=False.*\(rule S4: "):
        opt.zero_grad(set_to_none=False)
    assert params[0].grad is grad and bool((grad == 1).all())
    opt.zero_grad(set_to_none=True)  # agreeing is fine
    assert params[0].grad is None


@pytest.mark.parametrize("set_to_none", [None, True, False])
def test_zero_grad_with_decoupled_grad(set_to_none, backend):
    """S4: with use_decoupled_grad, zero_grad clears decoupled_grad (None, or zeros
    when set_to_none=False) and leaves .grad bitwise alone."""
    params = make_params([torch.float32, torch.bfloat16], [(3,), (2,)], seed=23)
    opt = fused_adam()(params, use_decoupled_grad=True)
    grads = []
    for p in params:
        p.grad = torch.full(p.shape, 2.0, dtype=p.dtype)
        grads.append(p.grad.clone())
        p.decoupled_grad = torch.ones(p.shape)
    opt.zero_grad(set_to_none=set_to_none)
    for p, g in zip(params, grads):
        assert_bitwise_equal(p.grad, g, ".grad after zero_grad")
        if set_to_none is False:
            assert bool((p.decoupled_grad == 0).all())
        else:
            assert getattr(p, "decoupled_grad", None) is None


def test_parameters_dropped_with_their_state_are_not_kept_alive():
    """Megatron FSDP swaps in its shards by clearing the groups and the state and adding
    a new group: the old parameters' scales and formats go too, so nothing keeps them
    (or their storage) alive."""
    import gc
    import weakref

    p = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    opt = fused_adam()([p], lr=1e-2, exp_avg_dtype=torch.uint8)
    old = weakref.ref(p)
    new = torch.nn.Parameter(p.detach().clone())
    opt.param_groups.clear()
    opt.state.clear()
    opt.add_param_group({"params": [new]})
    del p
    gc.collect()
    assert old() is None
    assert list(opt._scales) == [new] and list(opt._formats) == [new]
