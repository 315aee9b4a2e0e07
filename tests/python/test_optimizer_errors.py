"""Bad input, as tables of (input, exception type, message pattern) (SEMANTICS S1.2, S1.4,
S3.1-S3.4, S5.1-S5.5, S8).

Every row also checks that the failed call changed nothing, bitwise: parameters, their
gradients, every state tensor and scale, every group's settings and step count
(S3.1: validate everything first, mutate only after). Step-time rows put the bad input
on the *last* parameter of the *last* group, after valid gradients everywhere else, so
an implementation that updated parameters before validating them all would be caught.

Messages must name the class, and for per-parameter problems the group and parameter
index (S8): patterns below are written as look-aheads, one per required fact.
Exception types the contract leaves open follow its convention (S1.2: RuntimeError for
unsupported dtypes/layouts, TE and torch style; ValueError for values and for torch's
own load_state_dict size checks; KeyError for unknown state names, S5.2).
"""

import collections
import copy
import dataclasses
import functools
import gc
import math
import re
import types
import warnings
import weakref

import numpy as np
import pytest
import torch

from shardadam import _dtensor

from _optimizer_testing import (
    assert_bitwise_equal, assert_same_optimizer_state, assert_unchanged, backend_context,
    facts, fused_adam, have_core, snapshot, state_tensors)


def at(group, param):
    return [r"FusedAdam", rf"group\W*{group}\b", rf"param\w*\W*{param}\b"]


def make_params():
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=generator)),
            torch.nn.Parameter(torch.randn(5, generator=generator).bfloat16())]


# --------------------------------------------------------------------------------------
# Constructor (S1.2, S1.4)

CONSTRUCTOR_ERRORS = [
    ("amsgrad", dict(amsgrad=True), RuntimeError, facts("FusedAdam", "(?i)amsgrad")),
    ("capturable", dict(capturable=True), RuntimeError,
     facts("FusedAdam", "(?i)capturable")),
    ("master-bf16", dict(master_weights=True, master_weight_dtype=torch.bfloat16),
     RuntimeError, facts("FusedAdam", "(?i)master", "bfloat16")),
    ("master-fp64", dict(master_weights=True, master_weight_dtype=torch.float64),
     RuntimeError, facts("FusedAdam", "(?i)master", "float64")),
    ("master-uint8", dict(master_weights=True, master_weight_dtype=torch.uint8),
     RuntimeError, facts("FusedAdam", "(?i)master", "uint8")),
    ("exp_avg-fp64", dict(exp_avg_dtype=torch.float64), RuntimeError,
     facts("FusedAdam", "exp_avg", "float64")),
    ("exp_avg-e4m3-dtype", dict(exp_avg_dtype=torch.float8_e4m3fn), RuntimeError,
     facts("FusedAdam", "exp_avg", "float8_e4m3fn", r"fp8 moments are torch\.uint8")),
    ("exp_avg_sq-e5m2-dtype", dict(exp_avg_sq_dtype=torch.float8_e5m2), RuntimeError,
     facts("FusedAdam", "exp_avg_sq", "float8_e5m2", r"fp8 moments are torch\.uint8")),
    ("exp_avg_sq-int8", dict(exp_avg_sq_dtype=torch.int8), RuntimeError,
     facts("FusedAdam", "exp_avg_sq", "int8")),
    ("lr-negative", dict(lr=-1e-3), ValueError,
     facts("FusedAdam", r"Invalid learning rate.*-0\.001")),
    ("lr-nan", dict(lr=math.nan), ValueError, facts(r"Invalid learning rate.*nan")),
    ("lr-negative-tensor", dict(lr=torch.tensor(-0.5)), ValueError,
     facts(r"Invalid learning rate.*-0\.5")),
    ("lr-inf", dict(lr=math.inf), ValueError, facts(r"Invalid learning rate.*inf")),
    ("lr-int-past-float", dict(lr=10**400), ValueError,
     facts(r"Invalid learning rate.*finite.*10000")),
    ("lr-meta-tensor", dict(lr=torch.tensor(1e-3, device="meta")), ValueError,
     facts(r"Invalid learning rate.*on the meta device")),
    ("eps-negative", dict(eps=-1e-8), ValueError, facts(r"Invalid epsilon value.*-1e-08")),
    ("eps-nan", dict(eps=math.nan), ValueError, facts(r"Invalid epsilon value.*nan")),
    ("beta1-one", dict(betas=(1.0, 0.999)), ValueError,
     facts(r"Invalid beta parameter at index 0.*1\.0")),
    ("beta1-negative", dict(betas=(-0.1, 0.999)), ValueError,
     facts(r"Invalid beta parameter at index 0.*-0\.1")),
    ("beta2-one", dict(betas=(0.9, 1.0)), ValueError,
     facts(r"Invalid beta parameter at index 1.*1\.0")),
    ("beta2-nan", dict(betas=(0.9, math.nan)), ValueError,
     facts(r"Invalid beta parameter at index 1.*nan")),
    ("weight_decay-negative", dict(weight_decay=-0.1), ValueError,
     facts(r"Invalid weight_decay value.*-0\.1")),
    ("weight_decay-inf", dict(weight_decay=math.inf), ValueError,
     facts(r"Invalid weight_decay value.*inf")),
    # float("0.1") would pass, and a scheduler multiplying the stored string would not
    ("lr-string", dict(lr="0.1"), ValueError,
     facts(r"Invalid learning rate \(rule: a real number.*'0\.1'")),
    ("eps-string", dict(eps="1e-8"), ValueError, facts(r"Invalid epsilon value.*'1e-8'")),
    ("weight_decay-bool", dict(weight_decay=True), ValueError,
     facts(r"Invalid weight_decay value.*True")),
    ("beta1-string", dict(betas=("0.9", 0.999)), ValueError,
     facts(r"Invalid beta parameter at index 0.*'0\.9'")),
    # Unordered: which is beta1 would be the container's choice.
    ("betas-set", dict(betas={0.9, 0.999}), ValueError, facts(r"Invalid betas \(rule: a pair")),
    ("betas-dict", dict(betas={0.9: 0, 0.999: 1}), ValueError,
     facts(r"Invalid betas \(rule: a pair")),
    # A flag is read by truth value: the string "False" would switch it on.
    ("bias_correction-string", dict(bias_correction="False"), ValueError,
     facts(r"bias_correction must be a bool.*'False'")),
    ("bias_correction-two", dict(bias_correction=2), ValueError,
     facts(r"bias_correction must be a bool.*\b2\b")),
    ("adam_w_mode-string", dict(adam_w_mode="no"), ValueError,
     facts(r"adam_w_mode must be a bool.*'no'")),
    ("master_weights-string", dict(master_weights="no"), ValueError,
     facts(r"master_weights must be a bool.*'no'")),
    ("use_decoupled_grad-none", dict(use_decoupled_grad=None), ValueError,
     facts(r"use_decoupled_grad must be a bool.*None")),
    ("store_param_remainders-float", dict(master_weights=True, store_param_remainders=0.5),
     ValueError, facts(r"store_param_remainders must be a bool.*0\.5")),
    # A 0-d array can change in place, where settings are re-read by identity (S1.5).
    ("master_weights-0d-numpy-array", dict(master_weights=np.array(True)), ValueError,
     facts(r"master_weights must be a bool.*array\(True\).*pass bool\(x\)")),
    ("bias_correction-0d-numpy-array", dict(bias_correction=np.array(False)), ValueError,
     facts(r"bias_correction must be a bool.*array\(False\)")),
    # torch's optimizers take a 0-d array as a number; the message says what to pass
    ("lr-0d-numpy-array", dict(lr=np.array(1e-3)), ValueError,
     facts(r"Invalid learning rate.*array\(0\.001\).*pass float\(x\)")),
    ("beta2-0d-numpy-array", dict(betas=(0.9, np.array(0.99))), ValueError,
     facts(r"beta parameter at index 1.*array\(0\.99\).*pass float\(x\)")),
    ("amsgrad-string", dict(amsgrad="False"), ValueError,
     facts(r"amsgrad must be a bool.*'False'")),
]


@pytest.mark.parametrize("kwargs,exc,pattern", [c[1:] for c in CONSTRUCTOR_ERRORS],
                         ids=[c[0] for c in CONSTRUCTOR_ERRORS])
def test_constructor_rejects(kwargs, exc, pattern):
    params = make_params()
    before = [p.detach().clone() for p in params]
    with pytest.raises(exc, match=pattern) as raised:
        fused_adam()(params, **kwargs)
    message = str(raised.value)  # S8: the class and the rule, besides the value
    assert message.startswith("FusedAdam") and "(rule: " in message, message
    for i, (p, old) in enumerate(zip(params, before)):
        assert_bitwise_equal(p.detach(), old, f"param {i} after a rejected constructor")
        assert p.grad is None


def test_flags_take_bools_and_the_ints_0_and_1():
    """S1.2: a flag given as 0 / 1 or as a numpy bool steps as the bool would."""
    results = []
    for flags in (dict(bias_correction=False, adam_w_mode=True, master_weights=True),
                  dict(bias_correction=0, adam_w_mode=np.int64(1),
                       master_weights=np.bool_(True))):
        params = make_params()
        opt = fused_adam()(params, lr=1e-2, weight_decay=0.1, **flags)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        results.append((opt, params))
    (a, params_a), (b, params_b) = results
    assert_same_optimizer_state(a, b, params_a, params_b, "flags as 0/1")


def other_group_param(opt, extra):
    return dict(params=[extra, opt.param_groups[0]["params"][1]])


def non_leaf(opt, extra):
    return dict(params=[extra, torch.nn.Parameter(torch.randn(3)) * 2])


@pytest.mark.parametrize("group,pattern", [
    (other_group_param, facts(*at(1, 1), "same tensor as group 0, param 1",
                              "each parameter in one group only")),
    (non_leaf, facts(*at(1, 1), "non-leaf", "rule: ")),
], ids=["param-of-another-group", "non-leaf"])
def test_add_param_group_names_torchs_refusals(group, pattern):
    """What torch's add_param_group refuses with a bare message (a parameter already in
    another group, a non-leaf tensor) is refused first with the group, the parameter and
    the rule, as the same ValueError, and nothing changes."""
    opt = fused_adam()(make_params())
    extra = torch.nn.Parameter(torch.randn(2))
    before = snapshot(opt, [extra])
    with pytest.raises(ValueError, match=pattern):
        opt.add_param_group(group(opt, extra))
    assert_unchanged(opt, before)
    assert extra not in opt.state


def test_constructor_names_a_param_listed_in_two_groups():
    a, b = make_params()
    with pytest.raises(ValueError, match=facts(*at(1, 0), "same tensor as group 0, param 1")):
        fused_adam()([{"params": [a, b]}, {"params": [b]}])


WHOLE_OPTIMIZER = "one setting of the whole optimizer"
NOT_AN_OPTION = "an option of torch's Adam/AdamW that FusedAdam does not have"


@pytest.mark.parametrize("key,value,rule,options", [
    ("moment_format", "block4", WHOLE_OPTIMIZER, {}),
    ("moment_block_size", 128, WHOLE_OPTIMIZER, {}),
    ("exp_avg_dtype", torch.bfloat16, WHOLE_OPTIMIZER, {}),
    ("exp_avg_sq_dtype", torch.bfloat16, WHOLE_OPTIMIZER, {}),
    ("master_weights", True, WHOLE_OPTIMIZER, {}),
    ("master_weight_dtype", torch.float16, WHOLE_OPTIMIZER, {}),
    ("store_param_remainders", True, WHOLE_OPTIMIZER, dict(master_weights=True)),
    ("param_rounding", "stochastic", WHOLE_OPTIMIZER, {}),
    ("adam_w_mode", False, WHOLE_OPTIMIZER, {}), ("adam_w_mode", "True", WHOLE_OPTIMIZER, {}),
    ("use_decoupled_grad", True, WHOLE_OPTIMIZER, {}), ("amsgrad", True, WHOLE_OPTIMIZER, {}),
    ("capturable", True, WHOLE_OPTIMIZER, {}), ("set_grad_none", True, WHOLE_OPTIMIZER, {}),
    ("exp_avg_dtype", "torch.float32", WHOLE_OPTIMIZER, {}),
    # a group ported from torch: maximize=True would descend all the same
    ("maximize", True, NOT_AN_OPTION, {}), ("differentiable", True, NOT_AN_OPTION, {}),
    # a switch takes a bool or an int 0 or 1: torch would read 0.0 as false
    ("maximize", 0.0, NOT_AN_OPTION, {}), ("amsgrad", "", WHOLE_OPTIMIZER, {}),
    ("decoupled_weight_decay", False, NOT_AN_OPTION, dict(weight_decay=0.1)),
    ("decoupled_weight_decay", True, NOT_AN_OPTION, dict(weight_decay=0.1, adam_w_mode=False))])
def test_a_group_cannot_change_what_the_whole_optimizer_sets(key, value, rule, options):
    """Storage and mode settings are the optimizer's, and torch's Adam options that
    FusedAdam lacks are nobody's: given in a group at another value (than the
    optimizer's; than one with which torch steps as FusedAdam does) they would be kept
    there and ignored, so they are refused, in the constructor and in add_param_group,
    and nothing changes."""
    with pytest.raises(ValueError, match=facts(r"FusedAdam: group 1\b", f"sets {key}=",
                                               re.escape(rule))):
        fused_adam()([{"params": make_params()[:1]},
                      {"params": make_params()[1:], key: value}], **options)
    opt = fused_adam()(make_params(), **options)
    extra = torch.nn.Parameter(torch.randn(2))
    before = snapshot(opt, [extra])
    with pytest.raises(ValueError, match=facts(r"group 1\b", f"sets {key}=")):
        opt.add_param_group({"params": [extra], key: value})
    assert_unchanged(opt, before)
    assert extra not in opt.state


# Each optimizer's options, and a group repeating them (or torch's options at values
# with which torch steps alike), as torch's ZeroRedundancyOptimizer hands groups over.
REPEATED_OPTIONS = [
    (dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, master_weights=True,
          store_param_remainders=True, adam_w_mode=True),
     dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, master_weights=1,
          store_param_remainders=True, adam_w_mode=True, amsgrad=False, capturable=False,
          master_weight_dtype=torch.float32, use_decoupled_grad=False)),
    (dict(moment_format="block8", param_rounding="stochastic"),
     dict(moment_format="block8", param_rounding="stochastic", moment_block_size=None,
          set_grad_none=None)),
    # remainders only beside an fp32 master: the constructor turns this one off
    (dict(store_param_remainders=True), dict(store_param_remainders=True)),
    (dict(adam_w_mode=False, weight_decay=0.1),
     dict(adam_w_mode=False, maximize=False, foreach=True, fused=False, differentiable=None,
          decoupled_weight_decay=False)),
    (dict(weight_decay=0.1), dict(decoupled_weight_decay=True, foreach=None)),
    # torch's switches as an int 0 or 1 or a numpy bool, as the optimizer's own flags
    (dict(weight_decay=0.1), dict(maximize=0, differentiable=np.False_, amsgrad=np.int64(0),
                                  decoupled_weight_decay=1)),
    (dict(adam_w_mode=False), dict(decoupled_weight_decay=True, weight_decay=0.0)),
    # equal values of another type: set_grad_none by truth value (not None), numpy's ints
    (dict(set_grad_none=True, moment_format="block8", moment_block_size=np.int64(256)),
     dict(set_grad_none=1, moment_block_size=256))]


@pytest.mark.parametrize("options,repeated", REPEATED_OPTIONS, ids=str)
def test_a_group_may_repeat_what_the_whole_optimizer_sets(options, repeated):
    """S1.2: a group holding the optimizer's own settings at its values, or torch's
    options at values with which torch steps alike, is accepted by the constructor,
    add_param_group and every step (torch's ZeroRedundancyOptimizer copies its keyword
    arguments into the groups at every step), and steps as the group without them."""
    runs = []
    for keys in ({}, repeated):
        generator = torch.Generator().manual_seed(21)
        params = [torch.nn.Parameter(torch.randn(shape, generator=generator).bfloat16())
                  for shape in ((3, 4), (300,))]
        opt = fused_adam()([{"params": params[:1], **keys}], **options)
        opt.add_param_group({"params": params[1:], **keys})
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = torch.full_like(p, 0.5 - step - i)
            opt.step()
        runs.append((opt, params))
    (a, pa), (b, pb) = runs
    assert_same_optimizer_state(a, b, pa, pb, "with repeated settings")
    saved = b.state_dict()
    assert all(key in saved["param_groups"][1] for key in repeated)
    # S5.5: the saver's settings are dropped, its state converts: also into an
    # optimizer configured otherwise, which then steps.
    other = [torch.nn.Parameter(p.detach().clone()) for p in pb]
    loader = fused_adam()([{"params": other[:1]}, {"params": other[1:]}],
                          master_weights=True, master_weight_dtype=torch.float16,
                          adam_w_mode=options.get("adam_w_mode", True))
    loader.load_state_dict(saved)
    dropped = set(repeated) - {"weight_decay"}
    assert not dropped & set(loader.param_groups[1]), loader.param_groups[1]
    for p in other:
        p.grad = torch.ones_like(p)
    loader.step()


def test_a_repeated_setting_is_refused_once_the_optimizer_changes_it():
    """S1.5 lets a setting change between steps; a group still holding the old value
    then holds one the step would ignore: refused, nothing changed."""
    params = make_params()
    opt = fused_adam()([{"params": params, "exp_avg_dtype": torch.float32}])
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.exp_avg_dtype = torch.bfloat16
    before = snapshot(opt)
    with pytest.raises(ValueError, match=facts(r"group 0\b", "sets exp_avg_dtype=",
                                               re.escape(WHOLE_OPTIMIZER))):
        opt.step()
    assert_unchanged(opt, before, "optimizer after a refused step")


def test_master_weight_dtype_only_checked_with_master_weights():
    """S1.2: the master dtype rule applies 'when master_weights': without masters an
    unsupported master dtype is accepted, creates no master, and steps."""
    params = make_params()
    opt = fused_adam()(params, master_weights=False, master_weight_dtype=torch.bfloat16)
    assert all("master_param" not in opt.state[p] for p in params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert all("master_param" not in opt.state[p] for p in params)
    assert opt.param_groups[0]["step"] == 1


def test_set_grad_none_is_deprecated():
    with pytest.warns(DeprecationWarning, match="set_grad_none"):
        fused_adam()(make_params(), set_grad_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        fused_adam()(make_params())  # no warning without it


def bad_param(kind):
    if kind == "int64":
        return torch.zeros(3, dtype=torch.int64)
    if kind == "float64":
        return torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    if kind == "float8_e4m3fn":
        return torch.zeros(3).to(torch.float8_e4m3fn)
    if kind == "complex64":
        return torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    if kind == "sparse":
        return torch.nn.Parameter(torch.zeros(3, 3).to_sparse())
    if kind == "stride-0":
        return torch.nn.Parameter(torch.zeros(1).expand(3))
    if kind == "overlapping-strides":
        return torch.nn.Parameter(torch.zeros(5).as_strided((3, 3), (1, 1)))
    if kind == "overlapping-windows":
        # Offsets 3i + 2j: (0, 3) and (2, 0) share offset 6, though 13 addresses are
        # in reach of 12 elements.
        return torch.nn.Parameter(torch.zeros(16).as_strided((3, 4), (3, 2)))
    if kind == "overlapping-3d":
        # Offsets i + j + 10k: (0, 1, k) and (1, 0, k) share one; 13 addresses in
        # reach of 8 elements.
        return torch.nn.Parameter(torch.zeros(13).as_strided((2, 2, 2), (1, 1, 10)))
    if kind == "lazy":
        return torch.nn.parameter.UninitializedParameter()
    if kind == "negated-view":
        with torch.no_grad():
            return torch.zeros(3)._neg_view().requires_grad_()
    if kind == "storage-freed":  # as FSDP2 frees an unsharded parameter at reshard
        param = torch.nn.Parameter(torch.zeros(3))
        param.untyped_storage().resize_(0)
        return param
    raise AssertionError(kind)


SHARED_ELEMENTS = r"elements of the parameter share memory.*rule: "
FREED = r"storage holds 0 bytes, fewer than its elements span \(12\).*freed.*rule S1.4"
PARAM_KINDS = {"int64": "int64", "float64": "float64", "float8_e4m3fn": "float8_e4m3fn",
               "complex64": "complex64", "sparse": "(?i)sparse",
               "stride-0": SHARED_ELEMENTS + ".*memory of its own",
               "overlapping-strides": SHARED_ELEMENTS + ".*memory of its own",
               "overlapping-windows": SHARED_ELEMENTS + ".*memory of its own",
               "overlapping-3d": SHARED_ELEMENTS + ".*memory of its own",
               "lazy": r"uninitialized lazy.*rule: .*forward pass",
               "negated-view": r"lazily negated view.*rule S1.4: .*resolve_neg",
               "storage-freed": FREED}


@pytest.mark.parametrize("entry", [0, 1, 3])
@pytest.mark.parametrize("call", ["constructor", "add_param_group"])
def test_named_parameters_are_pairs(entry, call):
    """S8: a named parameter is a (name, tensor) pair: a tuple of another length is
    refused by name (it was torch's bare IndexError, or a third item ignored)."""
    param = torch.nn.Parameter(torch.zeros(2))
    bad = (("a", param, "b") if entry == 3 else (param,) if entry == 1 else ())
    pattern = facts(*at(0 if call == "constructor" else 1, 0),
                    rf"a named parameter must be a \(name, tensor\) pair, got a tuple of "
                    rf"{entry}", r"rule S8")
    if call == "constructor":
        with pytest.raises(ValueError, match=pattern):
            fused_adam()([bad])
        return
    opt = fused_adam()([("w", torch.nn.Parameter(torch.ones(3)))])
    before = snapshot(opt)
    with pytest.raises(ValueError, match=pattern):
        opt.add_param_group({"params": [bad]})
    assert_unchanged(opt, before, "optimizer after a refused add_param_group")


def test_zero_grad_checks_the_switch_it_reads():
    """S1.2, S1.5: ``use_decoupled_grad``, read by ``zero_grad`` too, is checked there as
    at a step: "False" would be true, and zero_grad cleared the decoupled gradients and
    left ``grad`` alone."""
    param = torch.nn.Parameter(torch.zeros(4))
    opt = fused_adam()([param])
    param.grad = torch.ones(4)
    opt.use_decoupled_grad = "False"
    with pytest.raises(ValueError, match=facts("use_decoupled_grad must be a bool",
                                               "'False'")):
        opt.zero_grad()
    assert torch.equal(param.grad, torch.ones(4))


@pytest.mark.parametrize("kind", list(PARAM_KINDS))
def test_constructor_rejects_unsupported_params(kind):
    """S1.4: an error naming the parameter index, the group and the rule."""
    good = make_params()
    groups = [dict(params=good[:1]), dict(params=[good[1], bad_param(kind)])]
    before = [p.detach().clone() for p in good]
    with pytest.raises(RuntimeError, match=facts(*at(1, 1), PARAM_KINDS[kind])):
        fused_adam()(groups)
    for p, old in zip(good, before):
        assert_bitwise_equal(p.detach(), old, "param after a rejected constructor")


def test_parameters_sharing_memory_are_refused_when_handed_in():
    """S1.4: two parameters that share a byte are refused by the constructor (in one
    group or two) and by add_param_group, naming both, before any state is made; the
    step refuses one re-pointed there later (below)."""
    buffer = torch.zeros(10)
    first = torch.nn.Parameter(buffer.as_strided((6,), (1,)))
    second = torch.nn.Parameter(buffer.as_strided((6,), (1,), 4))
    single = torch.nn.Parameter(buffer[5:6])  # one element inside the first
    for groups, later in (([first, second], at(0, 1)),
                          ([{"params": [first]}, {"params": [second]}], at(1, 0)),
                          ([first, single], at(0, 1))):
        with pytest.raises(RuntimeError, match=facts(*later, r"shares memory with group 0, "
                                                             r"param 0\b")):
            fused_adam()(groups)
    opt = fused_adam()([first])
    before = snapshot(opt, [second])
    with pytest.raises(RuntimeError, match=facts(*at(1, 0), r"shares memory with group 0, "
                                                            r"param 0\b")):
        opt.add_param_group({"params": [second]})
    assert_unchanged(opt, before)
    assert second not in opt.state and len(opt.param_groups) == 1


def test_step_refuses_a_parameter_whose_storage_was_freed(backend):
    """S1.4: FSDP2 frees the unsharded parameters a forward leaves on its root module;
    an optimizer built from them holds parameters with no memory at its step. The
    step names the cause, not an overlap of the empty storages, and changes nothing."""
    params = [torch.nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(i)))
              for i in range(3)]
    opt = fused_adam()(params, lr=0.1, exp_avg_dtype=torch.bfloat16)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    kept = [p.detach().clone() for p in params[:2]]
    state = {(i, k): v.clone() for i, p in enumerate(params) for k, v in opt.state[p].items()}
    for p in params[1:]:
        p.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=facts(*at(0, 1), FREED)):
        opt.step()
    assert_bitwise_equal(params[0].detach(), kept[0], "param 0 after a refused step")
    after = {(i, k): v.clone() for i, p in enumerate(params) for k, v in opt.state[p].items()}
    assert state.keys() == after.keys()
    for key in state:
        assert_bitwise_equal(after[key], state[key], f"state {key} after a refused step")
    assert [g["step"] for g in opt.param_groups] == [1]


@pytest.mark.parametrize("read", ["state_dict", "get_unscaled_state"])
def test_a_master_seeded_from_a_freed_parameter_is_refused_by_name(read):
    """S1.4: a master that still follows its parameter (S1.6) is exported as seeded
    from it; a parameter whose storage was freed names the cause, not torch's "data is
    not allocated yet", and the optimizer is unchanged. Exports that do not read the
    parameter (its moments) still work."""
    # Six bf16 elements: the 12 bytes FREED names.
    params = [torch.nn.Parameter(torch.randn(2, 3).to(torch.bfloat16)) for _ in range(2)]
    opt = fused_adam()(params, lr=0.1, master_weights=True)
    before = {(i, k): v.clone() for i, p in enumerate(params) for k, v in opt.state[p].items()}
    params[1].untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=facts(*at(0, 1), FREED)):
        if read == "state_dict":
            opt.state_dict()
        else:
            opt.get_unscaled_state(params[1], "master_param")
    after = {(i, k): v for i, p in enumerate(params) for k, v in opt.state[p].items()}
    assert before.keys() == after.keys()
    for key in before:
        assert_bitwise_equal(after[key], before[key], f"state {key} after a refused read")
    assert params[1] in opt._seeded  # still follows its parameter
    assert torch.equal(opt.get_unscaled_state(params[1], "exp_avg"), torch.zeros(2, 3))


def test_step_refuses_a_parameter_whose_storage_was_shrunk():
    """S1.4 "freed or shrunk": a storage resized below the bytes the parameter's
    elements span (not only to 0) is refused by name, nothing changed."""
    params = [torch.nn.Parameter(torch.randn(6, generator=torch.Generator().manual_seed(i)))
              for i in range(2)]
    opt = fused_adam()(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    params[1].untyped_storage().resize_(params[1].nbytes // 2)
    before = snapshot(opt, params[:1])
    with pytest.raises(RuntimeError, match=facts(*at(0, 1), "holds 12 bytes, fewer than its "
                                                 r"elements span \(24\).*freed or shrunk")):
        opt.step()
    assert_unchanged(opt, before)


def test_strided_parameter_whose_elements_are_apart_steps_as_a_copy():
    """S1.4 refuses only elements that share memory: offsets 2i + 3j (shape (3, 2)) are
    all distinct though no ordering of the strides shows it, so the parameter is
    accepted and steps as a contiguous copy of it does."""
    buffer = torch.arange(8, dtype=torch.float32)
    strided = torch.nn.Parameter(buffer.as_strided((3, 2), (2, 3)))
    plain = torch.nn.Parameter(strided.detach().clone())
    grad = torch.linspace(-1, 1, 6).reshape(3, 2)
    for p in (strided, plain):
        opt = fused_adam()([p], lr=0.1, weight_decay=0.01)
        p.grad = grad.clone()
        opt.step()
    assert_bitwise_equal(strided.detach(), plain.detach(), "strided param after a step")


def test_parameters_without_elements_never_share_memory():
    """S1.4 is about elements: an empty expanded parameter (a stride of 0 over no
    elements) is accepted, and a meta view whose reach no storage bounds is not
    counted address by address."""
    fused_adam()([torch.nn.Parameter(torch.empty(0, 1).expand(0, 4))])
    meta = torch.empty(0, device="meta").as_strided((3, 2), (10**10, 2 * 10**10 - 1))
    fused_adam()([torch.nn.Parameter(meta)])


def test_constructor_names_named_parameters():
    """S8: (name, tensor) pairs give the name in a constructor error too, and a tensor
    listed twice (torch only warns) is an error naming the second listing."""
    good, tied = make_params()
    with pytest.raises(RuntimeError, match=facts(*at(0, 1), "'bad.w'", "float64")):
        fused_adam()([("good.w", good), ("bad.w", bad_param("float64"))])
    with pytest.raises(RuntimeError,
                       match=facts(*at(0, 2), "'decoder.w'", "same tensor as param 1")):
        fused_adam()([("good.w", good), ("encoder.w", tied), ("decoder.w", tied)])


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("aliased", ["same-group", "other-group", "exp_avg"])
def test_gradient_sharing_a_written_buffer_changes_nothing(aliased, backend):
    """A gradient that is a buffer the step writes (a parameter's storage in its own
    group or in the group stepped before it, a moment): every group's calls are checked
    first, so nothing is updated and no step counter moves (S3.1), on the C++ path and
    on the torch path alike; the message names the parameters, not positions in a call
    (S8)."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    generator = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(4, generator=generator)) for _ in range(4)]
    opt = fused_adam()([dict(params=params[:2]), dict(params=params[2:], lr=1e-2)])
    for p in params:
        p.grad = torch.randn(4, generator=generator)
    with backend_context(backend):
        opt.step()  # a step that passes: the same gradients would not be checked again
        target = {"same-group": params[3].detach(), "other-group": params[0].detach(),
                  "exp_avg": opt.state[params[0]]["exp_avg"]}[aliased]
        params[2].grad = target  # storage the step writes
        before = snapshot(opt)
        # the later parameter of the two is named first, then the other one
        overlaps = "(overlaps|shares memory with)"
        named = {"same-group": (1, 1, rf"param .*{overlaps} group 1, param 0's grad"),
                 "other-group": (1, 0, rf"grad .*{overlaps} group 0, param 0's param"),
                 "exp_avg": (1, 0, rf"grad .*{overlaps} group 0, param 0's exp_avg")}
        with pytest.raises(ValueError, match=facts(*at(*named[aliased][:2]),
                                                   named[aliased][2])):
            opt.step()
    assert_unchanged(opt, before, "optimizer after a refused step")


# Finite hyper-parameters whose fp32 step constants are not (S3.6): what each sets, in
# the group before a step, and the constant the refusal names.
FP32_RANGE_CASES = {
    "lr": (dict(lr=1e39), r"lr / \(1 - beta1\^step\) is beyond fp32's range at step 2"),
    # 1e38 is finite in fp32; lr / (1 - 0.9^2) = 5.3e38 is not.
    "step-size": (dict(lr=1e38), r"lr / \(1 - beta1\^step\) is beyond fp32's range"),
    "decay": (dict(lr=10.0, weight_decay=1e38), r"1 - lr \* weight_decay is beyond"),
    "l2-weight-decay": (dict(weight_decay=1e39, adam_w_mode=False),
                        r"(?<!\* )weight_decay is beyond fp32's range"),
    "eps": (dict(eps=1e39), r"eps is beyond fp32's range"),
    # A positive eps that fp32 stores as 0 (2^-150 is a tie, to even: 0).
    "eps-zero": (dict(eps=1e-50), r"eps 1e-50 rounds to 0 in fp32"),
    "eps-tie": (dict(eps=2.0**-150), r"rounds to 0 in fp32"),
}


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("case", sorted(FP32_RANGE_CASES))
def test_step_whose_fp32_constants_overflow_is_refused(case, backend):
    """S3.6 (beyond): torch's fused AdamW takes lr = 1e39 and writes inf; a step whose
    fp32 constants are not finite, or whose positive eps fp32 stores as 0, is refused
    before anything is written, naming the group and the constant, on both paths (and
    by the core itself, adam_test)."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    settings, named = FP32_RANGE_CASES[case]
    settings = dict(settings)
    generator = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(6, generator=generator)) for _ in range(2)]
    opt = fused_adam()([dict(params=params[:1]), dict(params=params[1:])],
                       master_weights=False)
    for p in params:
        p.grad = torch.randn(6, generator=generator)
    with backend_context(backend):
        opt.step()
        mode = settings.pop("adam_w_mode", None)
        if mode is not None:
            opt.adam_w_mode = mode
        opt.param_groups[1].update(settings)  # as a scheduler would
        before = snapshot(opt)
        with pytest.raises(ValueError, match=facts(r"group\W*1\b", named, "rule: ")):
            opt.step()
    assert_unchanged(opt, before, "optimizer after a refused step")


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_step_size_is_judged_at_the_step_taken(backend):
    """lr / c1 shrinks towards lr as c1 = 1 - beta1^t grows: an lr refused at step 2
    (5.3e38 in fp32) steps at step 200, and without bias correction from the start."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.zeros(4)
    opt = fused_adam()([param], lr=1e38)
    with backend_context(backend):
        with pytest.raises(ValueError, match="beyond fp32's range at step 1"):
            opt.step()
        opt.param_groups[0]["step"] = 199
        opt.step()
        assert opt.param_groups[0]["step"] == 200
        opt.param_groups[0].update(step=0, bias_correction=False)
        opt.step()
    assert torch.equal(param.detach(), torch.zeros(4))  # zero gradients move nothing


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_constants_up_to_fp32s_largest_value_step(backend):
    """The rule is fp32's own rounding: a double below FLT_MAX + half its ulp rounds to
    FLT_MAX and steps; that tie rounds to 2^128 (even), inf, and is refused."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    flt_max = float(torch.finfo(torch.float32).max)
    half_ulp = 2.0**103
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.zeros(4)
    opt = fused_adam()([param], bias_correction=False)  # lr / c1 is lr
    with backend_context(backend):
        for lr in (flt_max, flt_max + half_ulp / 2):
            opt.param_groups[0]["lr"] = lr
            opt.step()
        opt.param_groups[0]["lr"] = flt_max + half_ulp
        with pytest.raises(ValueError, match=r"lr / \(1 - beta1\^step\) is beyond"):
            opt.step()
    assert opt.param_groups[0]["step"] == 2


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_refused_step_after_a_configuration_change_changes_nothing(backend):
    """S3.1 also when the step would first create state: with `master_weights`
    switched on, a gradient sharing a parameter's memory is refused before the masters
    are created."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    generator = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter(torch.randn(4, generator=generator).bfloat16())
              for _ in range(2)]
    opt = fused_adam()(params)
    for p in params:
        p.grad = torch.randn(4, generator=generator).bfloat16()
    with backend_context(backend):
        opt.step()
        opt.master_weights = True
        params[1].grad = params[0].detach()
        before = snapshot(opt)
        overlaps = "(overlaps|shares memory with)"
        with pytest.raises(ValueError,
                           match=facts(*at(0, 1), rf"grad .*{overlaps} group 0, param 0's")):
            opt.step()
    assert_unchanged(opt, before, "optimizer after a refused step")
    assert all("master_param" not in opt.state[p] for p in params)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("aliased", ["exp_avg", "scale"])
def test_refused_step_that_would_convert_state_converts_nothing(backend, aliased):
    """S3.1 when the step would first convert state (a moment's dtype changed, S1.5): a
    gradient sharing memory with another parameter's existing state, or with its
    per-block scales, is refused before any state is converted: dtypes, storage and
    values as they were."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    generator = torch.Generator().manual_seed(13)
    block = aliased == "scale"
    # With block8 the first has two blocks, so two scales: the second's whole gradient.
    shapes = [(2, 256), (2,)] if block else [(4,), (4,)]
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    opt = fused_adam()(params, lr=0.1, **(dict(moment_format="block8") if block else {}))
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    with backend_context(backend):
        opt.step()
        if block:  # block8 -> fp32 moments: converted
            opt.moment_format = None
            params[1].grad = opt._scales[params[0]]["exp_avg"].view(-1)
        else:  # fp32 -> bf16 exp_avg_sq
            opt.exp_avg_sq_dtype = torch.bfloat16
            params[1].grad = opt.state[params[0]]["exp_avg"]
        before = snapshot(opt)
        dtypes = {(i, k): v.dtype for i, p in enumerate(params) for k, v in opt.state[p].items()}
        with pytest.raises(ValueError, match=facts(*at(0, 1), "grad")):
            opt.step()
    assert_unchanged(opt, before, "optimizer after a refused step")
    assert {(i, k): v.dtype for i, p in enumerate(params)
            for k, v in opt.state[p].items()} == dtypes


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("binds", ["new-param", "state-put-in"])
def test_bad_scale_of_a_standing_plan_is_refused_before_another_group_binds(backend, binds):
    """S3.1, S2.11: a per-block scale made invalid in place in a group whose plan stands
    is refused before another group's plan binds (which creates state for a parameter
    added by hand, or converts a state put in as fp64 true values): the refusal came
    from the last check, after that state had been written."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    generator = torch.Generator().manual_seed(21)
    a, b = (torch.nn.Parameter(torch.randn(4, 256, generator=generator)) for _ in range(2))
    opt = fused_adam()([{"params": [a]}, {"params": [b]}], lr=0.1, moment_format="block8")
    with backend_context(backend):
        a.grad, b.grad = (torch.randn(4, 256, generator=generator) for _ in range(2))
        opt.step()
        if binds == "new-param":
            c = torch.nn.Parameter(torch.randn(4, 256, generator=generator))
            c.grad = torch.randn(4, 256, generator=generator)
            opt.param_groups[1]["params"].append(c)
        else:
            opt.state[b]["exp_avg"] = opt.get_unscaled_state(b, "exp_avg").double()
        opt._scales[a]["exp_avg"][0] = float("nan")
        before = snapshot(opt)
        with pytest.raises(ValueError, match=facts(*at(0, 0), r"exp_avg_scale\[0\] nan",
                                                   "not a valid scale")):
            opt.step()
    assert_unchanged(opt, before, "optimizer after a refused step")
    assert binds != "new-param" or c not in opt.state


@pytest.mark.parametrize("layout", ["strided", "jagged"])
def test_a_nested_gradient_is_refused_by_name(layout):
    """S3.2, S8: a nested gradient is refused naming the parameter and the rule (a
    strided-layout one reached torch's "NestedTensorImpl doesn't support sizes")."""
    p = torch.nn.Parameter(torch.randn(4, 8))
    opt = fused_adam()([p], lr=0.1, use_decoupled_grad=True)
    before = snapshot(opt)  # without the gradient, which a snapshot cannot compare
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype
        p.decoupled_grad = torch.nested.nested_tensor([torch.randn(8)] * 4,
                                                      layout=getattr(torch, layout))
    with pytest.raises(RuntimeError, match=facts(*at(0, 0), "gradient layout must be",
                                                 "rule S3.2")):
        opt.step()
    p.decoupled_grad = None
    assert_unchanged(opt, before, "optimizer after a refused step")


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_gradient_partly_overlapping_a_written_buffer_changes_nothing(backend):
    """Sharing part of a buffer is sharing: a gradient that covers the middle of another
    parameter's exp_avg is refused before anything is updated."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    generator = torch.Generator().manual_seed(9)
    wide = torch.nn.Parameter(torch.randn(8, generator=generator))
    narrow = torch.nn.Parameter(torch.randn(4, generator=generator))
    opt = fused_adam()([dict(params=[wide]), dict(params=[narrow])])
    wide.grad = torch.randn(8, generator=generator)
    narrow.grad = opt.state[wide]["exp_avg"][2:6]
    before = snapshot(opt)
    named = rf"grad .*(overlaps|shares memory with) group 0, param 0's exp_avg"
    with backend_context(backend), pytest.raises(ValueError, match=facts(*at(1, 0), named)):
        opt.step()
    assert_unchanged(opt, before, "optimizer after a refused step")


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_gradient_overlapping_its_own_parameter_is_refused(backend):
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    param = torch.nn.Parameter(torch.randn(6))
    opt = fused_adam()([param])
    param.grad = param.detach()
    before = snapshot(opt)
    with backend_context(backend), pytest.raises(
            ValueError, match=facts(*at(0, 0), "(?i)buffers of one (tensor|parameter) must "
                                               "not share memory")):
        opt.step()
    assert_unchanged(opt, before, "optimizer after a refused step")


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("layout", ["columns", "transposed"])
def test_gradient_in_a_non_contiguous_parameter_is_refused_on_later_steps(layout, groups,
                                                                          backend):
    """A non-contiguous parameter that is not dense (every other column) is stepped
    through a contiguous copy, which is all the C++ core sees; its own memory is still
    written when the copy is written back. A dense one (transposed) is stepped where it
    lies, its states in its memory order (S2.6). Either way a gradient lying in its memory
    is refused on every step, not only on the first (which checks before it creates
    state), on both paths."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    generator = torch.Generator().manual_seed(4)
    base = torch.randn(4, 3 if layout == "transposed" else 6, generator=generator)
    strided = torch.nn.Parameter(base.t() if layout == "transposed" else base[:, ::2].t())
    other = torch.nn.Parameter(torch.randn(12, generator=generator))
    opt = fused_adam()([dict(params=[strided]), dict(params=[other])] if groups == 2
                       else [strided, other])
    strided.grad = torch.randn(3, 4, generator=generator)
    other.grad = torch.randn(12, generator=generator)
    with backend_context(backend):
        opt.step()  # a step that passes, so the next one reuses the plans
        other.grad = torch.as_strided(strided.detach(), (12,), (1,))
        before = snapshot(opt)
        # Read where it lies, the core's check refuses it in its words.
        refusal = (r"grad \[0x[0-9a-f]+, \+48 bytes\) overlaps group 0, param 0's param"
                   if layout == "transposed" and backend == "auto" else
                   r"grad shares memory with group 0, param 0's param")
        rule = ("rule: ",) if "shares" in refusal else ()
        with pytest.raises(ValueError, match=facts(*at(groups - 1, 2 - groups), refusal,
                                                   *rule)):
            opt.step()
    assert_unchanged(opt, before, "optimizer after a refused step")


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("layout", ["columns", "transposed"])
def test_gradient_in_a_skipped_non_contiguous_parameter_is_accepted(layout, backend):
    """A non-contiguous parameter without a gradient is not stepped, so its memory is
    not written (whether it would be stepped through a copy, or where it lies): a
    gradient lying there is accepted on every step, and the step equals one fed the
    same values from memory of their own."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")

    def strided(generator):
        if layout == "transposed":
            return torch.nn.Parameter(torch.randn(4, 3, generator=generator).t())
        return torch.nn.Parameter(torch.randn(4, 6, generator=generator)[:, ::2].t())

    def run(aliased):
        generator = torch.Generator().manual_seed(5)
        skipped = strided(generator)
        stepped = strided(generator)
        other = torch.nn.Parameter(torch.randn(12, generator=generator))
        opt = fused_adam()([skipped, stepped, other])
        with backend_context(backend):
            for _ in range(2):  # the second step reuses the plans
                stepped.grad = torch.ones(3, 4)
                view = torch.as_strided(skipped.detach(), (12,), (1,))
                other.grad = view if aliased else view.clone()
                opt.step()
        return [p.detach().clone() for p in (skipped, stepped, other)]

    for i, (a, b) in enumerate(zip(run(True), run(False))):
        assert_bitwise_equal(a, b, f"param {i}")


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_gradients_that_share_no_written_memory_are_accepted(backend):
    """Only memory the step writes counts: a gradient lying in the buffers of a
    parameter skipped at this step (no gradient), or a strided gradient interleaved
    with its strided parameter, is stepped like a copy of it, bitwise."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    generator = torch.Generator().manual_seed(10)
    skipped = torch.randn(4, generator=generator)
    buffer = torch.randn(4, 2, generator=generator)
    stepped = torch.randn(4, generator=generator)

    def run(aliased):
        data = buffer.clone()
        strided = data[:, 0] if aliased else data[:, 0].clone()
        params = [torch.nn.Parameter(t) for t in (skipped.clone(), strided, stepped.clone())]
        opt = fused_adam()(params)
        if aliased:  # the interleaved column of the strided param's buffer; the skipped param
            params[1].grad = data[:, 1]
            params[2].grad = params[0].detach()
        else:
            params[1].grad = data[:, 1].clone()
            params[2].grad = skipped.clone()
        with backend_context(backend):
            opt.step()
        return opt, params

    copied, copied_params = run(False)
    aliased, aliased_params = run(True)
    assert_same_optimizer_state(copied, aliased, copied_params, aliased_params,
                                "gradients in unwritten memory vs copies")


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_one_gradient_shared_by_parameters_of_two_groups_is_allowed(backend):
    """Gradients are only read, so one tensor may be the gradient of several
    parameters: the step equals one with a copy of it per parameter, bitwise."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    generator = torch.Generator().manual_seed(6)
    shared_params = [torch.nn.Parameter(torch.randn(5, generator=generator))
                     for _ in range(2)]
    copied_params = [torch.nn.Parameter(p.detach().clone()) for p in shared_params]
    grad = torch.randn(5, generator=generator)
    shared = fused_adam()([dict(params=shared_params[:1]), dict(params=shared_params[1:])])
    copied = fused_adam()([dict(params=copied_params[:1]), dict(params=copied_params[1:])])
    for p in shared_params:
        p.grad = grad
    for p in copied_params:
        p.grad = grad.clone()
    with backend_context(backend):
        shared.step()
        copied.step()
    assert_same_optimizer_state(copied, shared, copied_params, shared_params,
                                "one shared gradient vs copies")


@pytest.mark.skipif(not have_core(), reason="the C++ core is not built")
def test_core_message_keeps_parameter_names_as_given():
    """The core's "tensor N" become parameter places in one pass: a name that itself
    reads "tensor 7" is left alone (neither rewritten nor looked up)."""
    generator = torch.Generator().manual_seed(5)
    a, b = (torch.nn.Parameter(torch.randn(4, generator=generator)) for _ in range(2))
    opt = fused_adam()([("tensor 1", a), ("w tensor 7", b)])
    a.grad = torch.randn(4, generator=generator)
    b.grad = torch.randn(4, generator=generator)
    opt.step()  # binds the plan: the next refusal is the core's
    b.grad = opt.state[a]["exp_avg"]
    before = snapshot(opt)
    with pytest.raises(ValueError) as raised:
        opt.step()
    assert_unchanged(opt, before, "optimizer after the core's refusal")
    assert str(raised.value).startswith(
        "FusedAdam: group 0, param 1 ('w tensor 7'): grad "), str(raised.value)
    assert "overlaps group 0, param 0 ('tensor 1')'s exp_avg" in str(raised.value)


@pytest.mark.skipif(not have_core(), reason="the C++ core is not built")
def test_gradient_sharing_a_written_buffer_is_checked_on_every_device():
    """Groups on two devices (a CPU group and, say, a CUDA one): each device's calls are
    checked before the first call runs, so the group stepped first is not updated when
    the other one is refused. The second device is simulated by giving group 1's batch
    its own device key (the check groups calls by it)."""
    generator = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(4, generator=generator)) for _ in range(3)]
    opt = fused_adam()([dict(params=params[:1]), dict(params=params[1:])])
    for p in params:
        p.grad = torch.randn(4, generator=generator)
    opt.step()
    opt._plans[1].batches[0].device = torch.device("cpu", 1)
    params[2].grad = opt.state[params[1]]["exp_avg"]  # a buffer group 1's call writes
    before = snapshot(opt)
    with pytest.raises(ValueError, match=facts(*at(1, 1), "overlaps group 1, param 0's")):
        opt.step()
    assert_unchanged(opt, before, "optimizer after the core refused a step")


@pytest.mark.parametrize("kind", ["int64", "float64", "sparse"])
def test_add_param_group_rejects_unsupported_params(kind):
    opt = fused_adam()(make_params(), master_weights=True, exp_avg_dtype=torch.uint8)
    extra = torch.nn.Parameter(torch.randn(2))
    before = snapshot(opt, [extra])
    with pytest.raises(RuntimeError, match=facts(*at(1, 1), PARAM_KINDS[kind])):
        opt.add_param_group(dict(params=[extra, bad_param(kind)]))
    assert_unchanged(opt, before)
    assert extra not in opt.state


@pytest.mark.parametrize("between", ["refused step", "refused add_param_group",
                                     "state_dict"])
def test_a_following_master_taken_out_and_put_back_still_follows(between, backend):
    """S1.6, S3.1: a master that follows its parameter (none has stepped) and whose
    entry is taken out of ``optimizer.state`` by hand and put back still follows it,
    also when a refused step or add_param_group, or a state_dict(), came in between:
    weights loaded into the parameter meanwhile are what the first step starts from
    (a refused call dropped the mark, and the stale master undid the weights)."""
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = fused_adam()([param], lr=1e-2, master_weights=True)
    held = opt.state.pop(param)
    if between == "refused step":
        opt.param_groups[0]["lr"] = -1.0
        param.grad = torch.zeros(4, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="Invalid learning rate"):
            opt.step()
        opt.param_groups[0]["lr"] = 1e-2
    elif between == "refused add_param_group":
        with pytest.raises(ValueError, match="Invalid learning rate"):
            opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(3))], lr=-1.0))
    else:
        opt.state_dict()
    opt.state[param] = held
    with torch.no_grad():
        param.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # weights loaded meanwhile
    param.grad = torch.zeros(4, dtype=torch.bfloat16)
    opt.step()  # zero gradient, zero moments: the parameter stays what it holds
    assert param.tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("refused_by", ["a value", "names"])
def test_refused_add_param_group_keeps_the_records_of_a_state_taken_out(refused_by):
    """A state taken out of ``optimizer.state`` by hand and put back continues as if it
    never left, also when an ``add_param_group`` in between was refused (a value, or a
    group without names beside named ones, which torch refuses too): the records of
    states no longer held (formats, scales) are dropped only once the group is in."""
    refusals = {"a value": (dict(lr=-1.0), r"Invalid learning rate"),
                "names": (dict(), r"does not name its parameters where")}

    def run(refusal):
        param = torch.nn.Parameter(torch.linspace(-1, 1, 1024).reshape(4, 256))
        opt = fused_adam()([("weight", param)], lr=1e-2, moment_format="block8")
        for _ in range(2):
            param.grad = torch.full((4, 256), 1e-3)
            opt.step()
        held = opt.state.pop(param)
        if refusal is not None:
            extra = torch.nn.Parameter(torch.zeros(3))
            options, message = refusal
            params = [extra] if refused_by == "names" else [("extra", extra)]
            before = snapshot(opt, [extra])
            with pytest.raises(ValueError, match=message):
                opt.add_param_group(dict(params=params, **options))
            assert_unchanged(opt, before)
        opt.state[param] = held
        opt.step()
        return param.detach().clone(), opt.state_dict()["state"][0]

    (want, want_state), (got, got_state) = run(None), run(refusals[refused_by])
    assert_bitwise_equal(got, want, "param")
    for name in ("exp_avg", "exp_avg_sq"):
        assert_bitwise_equal(got_state[name], want_state[name], name)


@pytest.mark.parametrize("preset", ["block8", "block4", "fp8", "fp16"])
def test_state_moved_to_another_parameter_by_hand_is_refused(preset):
    """S2.3 / S2.11: scales and formats are recorded per parameter object; a scaled state
    moved by hand onto a new Parameter arrives without them, and its codes mean nothing.
    Refused (step, state_dict, get_unscaled_state), naming the parameter, the state and
    where its scales stayed, nothing changed; set_scaled_state is the way to move it."""
    options = {"block8": dict(moment_format="block8"), "block4": dict(moment_format="block4"),
               "fp8": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
               "fp16": dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)}
    old = torch.nn.Parameter(torch.linspace(-1, 1, 1024).reshape(4, 256))
    opt = fused_adam()([old], lr=1e-2, **options[preset])
    old.grad = torch.full((4, 256), 1e-3)
    opt.step()
    want = {name: opt.get_unscaled_state(old, name) for name in ("exp_avg", "exp_avg_sq")}
    new = torch.nn.Parameter(old.detach().clone())
    new.grad = old.grad
    opt.param_groups[0]["params"][0] = new
    opt.state[new] = opt.state.pop(old)
    before = snapshot(opt)
    moved = r"stored for another parameter, whose scales stayed there.*rule S2\.3"
    for call in (opt.step, opt.state_dict, lambda: opt.get_unscaled_state(new, "exp_avg")):
        with pytest.raises(RuntimeError, match=facts(*at(0, 0), "state 'exp_avg", moved)):
            call()
        assert_unchanged(opt, before)
    for name, value in want.items():  # the supported way
        opt.set_scaled_state(new, name, value)
    opt.step()
    assert torch.isfinite(new).all() and (new - old).abs().max() < 2e-2  # about lr


_SCALED_PRESETS = {"block8": dict(moment_format="block8"),
                   "block4": dict(moment_format="block4"),
                   "fp8": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
                   "fp16": dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)}


def _stepped_pair(preset):
    """One optimizer over two parameters of different magnitudes, stepped once, so each
    state's scales differ from the other parameter's."""
    a = torch.nn.Parameter(torch.linspace(-1, 1, 1024).reshape(4, 256))
    b = torch.nn.Parameter(torch.linspace(-3, 2, 1024).reshape(4, 256))
    opt = fused_adam()([a, b], lr=1e-2, **_SCALED_PRESETS[preset])
    a.grad = torch.full((4, 256), 1e-3)
    b.grad = torch.linspace(-5, 5, 1024).reshape(4, 256)
    opt.step()
    return opt, a, b


@pytest.mark.parametrize("preset", sorted(_SCALED_PRESETS))
@pytest.mark.parametrize("move", ["another optimizer", "swapped", "another state"])
def test_scaled_state_moved_by_hand_within_or_between_optimizers_is_refused(preset, move):
    """S2.3: scaled codes are read with the scales recorded where they were stored. Moved
    by hand to another optimizer's same parameter (``new.state[p] = old.state[p]``, whose
    fresh record says scale 1), swapped between two parameters, or put under the other
    moment's name, they would be read with the wrong scales (block8 exp_avg 5e-4 read as
    448): refused at step(), state_dict() and get_unscaled_state(), naming the parameter,
    the state and where the scales stayed, nothing changed. state_dict() and
    load_state_dict() then move the state, and the step continues as the source's."""
    opt, a, b = _stepped_pair(preset)
    target, name = opt, "exp_avg"
    if move == "another optimizer":
        target = fused_adam()([a], lr=1e-2, **_SCALED_PRESETS[preset])
        target.state[a] = opt.state[a]
        where = "stored in another optimizer"
    elif move == "swapped":
        opt.state[a], opt.state[b] = opt.state[b], opt.state[a]
        where = "stored for another parameter"
    else:
        entry = opt.state[a]
        entry["exp_avg"], entry["exp_avg_sq"] = entry["exp_avg_sq"], entry["exp_avg"]
        where = "stored as this parameter's 'exp_avg_sq'"
    a.grad = torch.full((4, 256), 1e-3)
    b.grad = torch.full((4, 256), 1e-3)
    before = snapshot(target)
    for call in (target.step, target.state_dict,
                 lambda: target.get_unscaled_state(a, name)):
        with pytest.raises(RuntimeError, match=facts(*at(0, 0), f"state '{name}'",
                                                     re.escape(where),
                                                     "scales stayed there", r"rule S2\.3")):
            call()
        assert_unchanged(target, before)
    # A copy refuses what the original does (it read them where they lay: block8 exp_avg
    # read as exp_avg_sq gave NaN weights), a copy of a copy too.
    import pickle

    once = copy.deepcopy(target)
    for copied in (once, copy.deepcopy(once), pickle.loads(pickle.dumps(target))):
        for p in copied.param_groups[0]["params"]:
            p.grad = torch.full((4, 256), 1e-3)
        with pytest.raises(RuntimeError, match=facts(*at(0, 0), re.escape(where))):
            copied.step()
    if move == "another optimizer":  # the supported way, from the optimizer that stored it
        source = fused_adam()([a], lr=1e-2, **_SCALED_PRESETS[preset])
        source.state[a] = opt.state[a]
        with pytest.raises(RuntimeError, match="stored in another optimizer"):
            source.state_dict()
        target = fused_adam()([a], lr=1e-2, **_SCALED_PRESETS[preset])
        target.load_state_dict(_single_param_dict(opt, 0))
        want = {n: opt.get_unscaled_state(a, n) for n in ("exp_avg", "exp_avg_sq")}
        for n, value in want.items():
            assert_bitwise_equal(target.get_unscaled_state(a, n), value, n)


def _single_param_dict(opt, index):
    """``opt.state_dict()`` cut to its parameter ``index``, as a one-parameter dict."""
    sd = opt.state_dict()
    group = dict(sd["param_groups"][0], params=[0])
    return {"state": {0: sd["state"][index]}, "param_groups": [group]}


@pytest.mark.parametrize("preset", sorted(_SCALED_PRESETS))
def test_scaled_state_replaced_by_its_copy_steps_as_before(preset):
    """README: a state replaced in optimizer.state is used where it now is. A copy of a
    scaled state (no optimizer stored it) is read with the scales recorded at its place,
    so a state replaced by its own clone steps bitwise as the one it copies."""
    runs = []
    for replace in (False, True):
        opt, a, b = _stepped_pair(preset)
        if replace:
            for entry in opt.state.values():
                for name in ("exp_avg", "exp_avg_sq"):
                    entry[name] = entry[name].clone()
        a.grad = torch.full((4, 256), -2e-3)
        b.grad = torch.full((4, 256), 1e-2)
        opt.step()
        runs.append([t.detach().clone() for t in (a, b)]
                    + [opt.state[p][n].clone() for p in (a, b)
                       for n in ("exp_avg", "exp_avg_sq")])
    for i, (want, got) in enumerate(zip(*runs)):
        assert_bitwise_equal(got, want, f"tensor {i}")


@pytest.mark.parametrize("options", [dict(moment_format="block8"), dict()],
                         ids=["block8", "fp32"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.bool])
def test_state_in_a_dtype_no_format_of_it_has_is_refused(options, dtype):
    """S2.2: a state put into optimizer.state in a dtype none of its formats is stored in
    (codes viewed as int8, int32, bool; int16, which only a remainder master holds) has
    no true value to read: refused (it was read as plain numbers, one step then moving
    the parameter by 28 at lr 1e-3), naming the parameter, the state and the dtype,
    nothing changed."""
    param = torch.nn.Parameter(torch.linspace(-1, 1, 1024).reshape(4, 256))
    opt = fused_adam()([param], lr=1e-3, **options)
    param.grad = torch.full((4, 256), 1e-3)
    opt.step()
    opt.state[param]["exp_avg"] = torch.ones(4, 256).to(dtype)
    before = snapshot(opt)
    rule = "only remainder states" if dtype == torch.int16 else "no format of state 'exp_avg'"
    for call in (opt.step, opt.state_dict, lambda: opt.get_unscaled_state(param, "exp_avg")):
        with pytest.raises(RuntimeError, match=facts(*at(0, 0), "state 'exp_avg'",
                                                     re.escape(str(dtype)), rule,
                                                     r"rule S2\.2")):
            call()
        assert_unchanged(opt, before)


@pytest.mark.parametrize("shape", [(256, 4), (4, 256)])
def test_scaled_state_in_another_scaled_format_than_its_record_is_refused(shape):
    """S2.3: an fp16 tensor put where block8 codes were recorded would be decoded with
    the block scales (a vector of one scale per block, broadcast along the last
    dimension, or torch's bare shape error): refused, naming both formats, nothing
    changed; set_scaled_state stores one."""
    param = torch.nn.Parameter(torch.linspace(-1, 1, 1024).reshape(shape))
    opt = fused_adam()([param], lr=1e-3, moment_format="block8")
    param.grad = torch.full(shape, 1e-3)
    opt.step()
    want = opt.get_unscaled_state(param, "exp_avg")
    opt.state[param]["exp_avg"] = want.to(torch.float16)
    before = snapshot(opt)
    for call in (opt.step, opt.state_dict, lambda: opt.get_unscaled_state(param, "exp_avg")):
        with pytest.raises(RuntimeError, match=facts(
                *at(0, 0), "state 'exp_avg'", "holds fp16 values",
                re.escape("recorded for it are those of fp8-block:256"), r"rule S2\.3")):
            call()
        assert_unchanged(opt, before)
    opt.set_scaled_state(param, "exp_avg", want)
    assert_bitwise_equal(opt.get_unscaled_state(param, "exp_avg"), want, "exp_avg")


@pytest.mark.parametrize("before, after, labels", [
    (dict(moment_format="block8", moment_block_size=128), dict(moment_block_size=256),
     ("fp8-block:128", "fp8-block:256")),
    (dict(moment_format="block8", moment_block_size=128),
     dict(moment_format=None, moment_block_size=None, exp_avg_dtype=torch.uint8),
     ("fp8-block:128", "fp8")),
    (dict(exp_avg_dtype=torch.uint8), dict(exp_avg_dtype=torch.float32, moment_format="block8"),
     ("fp8", "fp8-block:256")),
])
def test_state_put_back_after_its_format_changed_is_refused(before, after, labels):
    """S2.3: codes this optimizer stored at this very place, put back by hand after a
    setting change stored the state anew in another format of the same dtype (uint8),
    would be read with the new format's scales: refused, naming both formats, nothing
    changed; set_scaled_state stores the values."""
    param = torch.nn.Parameter(torch.linspace(-1, 1, 1024))
    opt = fused_adam()([param], lr=1e-3, **before)
    param.grad = torch.linspace(-2e-3, 1e-3, 1024)
    opt.step()
    old = opt.state[param]["exp_avg"]
    want = opt.get_unscaled_state(param, "exp_avg")
    for key, value in after.items():
        setattr(opt, key, value)
    opt.step()
    assert opt.state[param]["exp_avg"] is not old
    opt.state[param]["exp_avg"] = old
    before_calls = snapshot(opt)
    copied = copy.deepcopy(opt)  # refuses it too
    for call in (opt.step, opt.state_dict, lambda: opt.get_unscaled_state(param, "exp_avg"),
                 copied.step):
        with pytest.raises(RuntimeError, match=facts(
                *at(0, 0), "state 'exp_avg'", re.escape(f"holds the {labels[0]} values"),
                re.escape(f"became {labels[1]}"), r"rule S2\.3")):
            call()
        assert_unchanged(opt, before_calls)
    opt.set_scaled_state(param, "exp_avg", want)
    opt.step()  # taken now: the values are stored with scales of their own


def test_claims_on_stored_states_go_with_their_tensors():
    """_stored_by holds its claims weakly: an optimizer's scaled states, once freed,
    leave no claim behind (nothing keeps them or their parameters alive)."""
    from shardadam import _stored_by

    gc.collect()
    count = len(_stored_by._CLAIMS)
    opt, a, b = _stepped_pair("block8")
    assert len(_stored_by._CLAIMS) == count + 4  # two moments of two parameters
    refs = [weakref.ref(t) for t in (a, opt.state[a]["exp_avg"])]
    del opt, a, b
    gc.collect()
    assert len(_stored_by._CLAIMS) == count
    assert all(ref() is None for ref in refs)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_state_resized_in_place_after_a_step_is_refused(backend):
    """A step reuses the last one's plan while every state keeps its object and memory;
    resize_ keeps both and changes the shape, so the geometry is compared too: the next
    step checks the state again and refuses it, nothing changed."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    param = torch.nn.Parameter(torch.linspace(-1, 1, 1024).reshape(4, 256))
    opt = fused_adam()([param], lr=1e-2, moment_format="block8")
    with backend_context(backend):
        param.grad = torch.full((4, 256), 1e-3)
        opt.step()
        opt.state[param]["exp_avg_sq"].resize_(2, 256)  # the same memory, half the rows
        before = snapshot(opt)
        with pytest.raises(RuntimeError, match=facts(*at(0, 0), "state 'exp_avg_sq' has "
                                                     r"local shape \(2, 256\)")):
            opt.step()
    assert_unchanged(opt, before)


@pytest.mark.parametrize("preset", ["block8", "fp8"])
def test_meta_scale_put_in_by_hand_is_refused(preset):
    """A scale replaced by a meta tensor has no value to decode with: refused naming the
    parameter, the state and the rule (it was torch's bare "item() on meta tensors")."""
    options = (dict(moment_format="block8") if preset == "block8"
               else dict(exp_avg_dtype=torch.uint8))
    param = torch.nn.Parameter(torch.linspace(-1, 1, 1024).reshape(4, 256))
    opt = fused_adam()([param], lr=1e-2, **options)
    param.grad = torch.full((4, 256), 1e-3)
    opt.step()
    shape = opt._scales[param]["exp_avg"].shape
    opt._scales[param]["exp_avg"] = torch.ones(shape, device="meta")
    before = snapshot(opt)
    for call in (opt.step, opt.state_dict):
        with pytest.raises(RuntimeError, match=facts(*at(0, 0), "state 'exp_avg'",
                                                     "scale is a meta tensor", "rule S2")):
            call()
        assert_unchanged(opt, before)


def test_add_param_group_rejects_bad_hyper_parameters():
    opt = fused_adam()(make_params())
    extra = torch.nn.Parameter(torch.randn(2))
    before = snapshot(opt, [extra])
    with pytest.raises(ValueError, match=facts("FusedAdam", r"group\W*1\b",
                                               r"Invalid learning rate.*-1")):
        opt.add_param_group(dict(params=[extra], lr=-1.0))
    assert_unchanged(opt, before)
    assert extra not in opt.state


@pytest.mark.parametrize("step", [-5, "7", 1.5, True, 2**63 - 1, torch.tensor(3)])
def test_add_param_group_checks_the_groups_step(step):
    """A group's counter is checked where the group comes in, as step() checks it
    (S2.8), not first at the next step; the constructor's groups too."""
    pattern = facts("FusedAdam", r"group\W*1\b", STEP_RANGE)
    opt = fused_adam()(make_params())
    extra = torch.nn.Parameter(torch.randn(2))
    before = snapshot(opt, [extra])
    with pytest.raises(ValueError, match=pattern):
        opt.add_param_group(dict(params=[extra], step=step))
    assert_unchanged(opt, before)
    assert extra not in opt.state
    with pytest.raises(ValueError, match=pattern):
        fused_adam()([dict(params=[torch.nn.Parameter(torch.randn(2))]),
                      dict(params=[extra], step=step)])


@pytest.mark.parametrize("values", [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0),
    dict(lr=0, betas=(0.0, 0.5), eps=0.0, weight_decay=0.1),
    dict(lr=-0.0, betas=(0.5, 0.25), eps=3, weight_decay=2.0),
    dict(lr=1e300, betas=(0.9, 0.95), eps=5e-324, weight_decay=10**20),
])
def test_usual_hyper_parameters_read_as_the_general_check_reads_them(values):
    """step()'s shortcut for groups of Python floats and ints gives the general check's
    floats."""
    from shardadam import _validate
    fast = _validate.hyper_parameters(values, 0)
    general = _validate._checked_hyper_parameters(values, 0)
    assert fast == general
    assert [type(v) for v in fast] == [float] * 5


# --------------------------------------------------------------------------------------
# step() (S3.1 - S3.4)


def stepped_optimizer(decoupled):
    """Two groups of fp32 + bf16 params with scaled state and masters, after two steps,
    with valid gradients set for the next step."""
    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=generator)),
              torch.nn.Parameter(torch.randn(5, generator=generator).bfloat16()),
              torch.nn.Parameter(torch.randn(6, generator=generator)),
              torch.nn.Parameter(torch.randn(2, 2, generator=generator).bfloat16())]
    opt = fused_adam()([dict(params=params[:2]), dict(params=params[2:], lr=1e-2)],
                       master_weights=True, master_weight_dtype=torch.float16,
                       exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.float16,
                       use_decoupled_grad=decoupled, weight_decay=0.1)

    def set_grads():
        for p in params:
            g = torch.randn(p.shape, generator=generator).to(p.dtype)
            if decoupled:
                p.decoupled_grad = g.float()
            else:
                p.grad = g

    for _ in range(2):
        set_grads()
        opt.step()
    set_grads()
    return opt, params


def set_decoupled(value):
    def apply(opt, params):
        params[3].decoupled_grad = value
    return apply


def set_grad(value):
    def apply(opt, params):
        params[3].grad = value
    return apply


def set_group(key, value):
    def apply(opt, params):
        opt.param_groups[1][key] = value
    return apply


def drop_group_key(key):
    def apply(opt, params):
        del opt.param_groups[1][key]
    return apply


def append_group_without(key):
    """A group appended to param_groups by hand (not through add_param_group)."""
    def apply(opt, params):
        group = {k: v for k, v in opt.defaults.items() if k != key}
        opt.param_groups.append(dict(group, params=[torch.nn.Parameter(torch.zeros(2))]))
    return apply


def set_attribute(key, value):
    def apply(opt, params):
        setattr(opt, key, value)
    return apply


def swap_param(value):
    def apply(opt, params):
        opt.param_groups[1]["params"][1] = value
    return apply


def repeat_param(opt, params):
    """A tied weight listed twice: group 1's param 1 becomes its param 0 again."""
    opt.param_groups[1]["params"][1] = params[2]


def share_memory(opt, params):
    """Group 1's param 1 becomes a view of group 0's param 0."""
    opt.param_groups[1]["params"][1] = torch.nn.Parameter(params[0].data.view(-1)[4:8])


def view_with_stride_0(opt, params):
    """Group 1's param 1 re-viewed in place so that all its elements are one."""
    params[3].data = params[3].data.view(-1)[:1].expand(2, 2)


# S2.8: a step counter is an int from 0 to 2**63 - 2 (the step taken is an int64).
STEP_RANGE = r"group\['step'\] must be an int in \[0, 2\*\*63 - 2\]"
# A loaded one may be the count a step from the largest left (its next step is refused).
LOADED_STEP_RANGE = r"in \[0, 2\*\*63 - 1\] \(a signed 64-bit count\)"

STEP_ERRORS = [
    ("decoupled-grad-shape", True, set_decoupled(torch.zeros(3)), RuntimeError,
     facts(*at(1, 1), "(?i)shape")),
    ("decoupled-grad-transposed-shape", True, set_decoupled(torch.zeros(2, 2).reshape(4)),
     RuntimeError, facts(*at(1, 1), "(?i)shape")),
    ("decoupled-grad-float64", True, set_decoupled(torch.zeros(2, 2, dtype=torch.float64)),
     RuntimeError, facts(*at(1, 1), "float64", r"rule S3\.4")),
    ("decoupled-grad-int32", True, set_decoupled(torch.zeros(2, 2, dtype=torch.int32)),
     RuntimeError, facts(*at(1, 1), "int32", r"rule S3\.4")),
    ("decoupled-grad-sparse", True, set_decoupled(torch.zeros(2, 2).to_sparse()),
     RuntimeError, facts(*at(1, 1), "(?i)sparse", r"rule S3\.2")),
    # Layouts without is_contiguous or storage are refused before either is asked for.
    ("decoupled-grad-sparse-csr", True, set_decoupled(torch.zeros(2, 2).to_sparse_csr()),
     RuntimeError, facts(*at(1, 1), "torch.sparse_csr", r"rule S3\.2")),
    ("decoupled-grad-sparse-bsr", True,
     set_decoupled(torch.zeros(2, 2).to_sparse_bsr((1, 1))), RuntimeError,
     facts(*at(1, 1), "torch.sparse_bsr", r"rule S3\.2")),
    ("decoupled-grad-mkldnn", True, set_decoupled(torch.zeros(2, 2).to_mkldnn()),
     RuntimeError, facts(*at(1, 1), "torch._mkldnn", r"rule S3\.2")),
    ("decoupled-grad-on-another-device", True,
     set_decoupled(torch.zeros(2, 2, device="meta")), RuntimeError,
     facts(*at(1, 1), "meta", r"rule S3\.4")),
    ("decoupled-grad-not-a-tensor", True, set_decoupled([[0.0, 0.0], [0.0, 0.0]]),
     RuntimeError, facts(*at(1, 1), "(?i)tensor|list", r"rule S3\.2")),
    ("grad-sparse", False, set_grad(torch.zeros(2, 2).bfloat16().to_sparse()),
     RuntimeError, facts(*at(1, 1), "(?i)sparse", r"rule S3\.2")),
    # S1.2: a torch option put into a group by hand would be ignored
    ("group-maximize-by-hand", True, set_group("maximize", True), ValueError,
     facts("FusedAdam", r"group\W*1\b", "sets maximize=True", "option of torch's Adam")),
    ("group-moment_format-by-hand", True, set_group("moment_format", "block8"), ValueError,
     facts("FusedAdam", r"group\W*1\b", "sets moment_format='block8'",
           "one setting of the whole optimizer")),
    ("group-lr-negative", True, set_group("lr", -1.0), ValueError,
     facts("FusedAdam", r"group\W*1\b", r"Invalid learning rate.*-1")),
    ("group-lr-nan", True, set_group("lr", math.nan), ValueError,
     facts(r"group\W*1\b", r"Invalid learning rate.*nan")),
    ("group-beta2-one", True, set_group("betas", (0.9, 1.0)), ValueError,
     facts(r"group\W*1\b", r"Invalid beta parameter at index 1")),
    ("group-lr-string", True, set_group("lr", "0.1"), ValueError,
     facts(r"group\W*1\b", r"Invalid learning rate.*'0\.1'")),
    ("group-eps-negative", True, set_group("eps", -1.0), ValueError,
     facts(r"group\W*1\b", r"Invalid epsilon value")),
    ("group-weight_decay-negative", True, set_group("weight_decay", -0.5), ValueError,
     facts(r"group\W*1\b", r"Invalid weight_decay value")),
    ("master_weight_dtype-bf16", True, set_attribute("master_weight_dtype", torch.bfloat16),
     RuntimeError, facts("FusedAdam", "(?i)master", "bfloat16")),
    ("capturable-set", True, set_attribute("capturable", True), RuntimeError,
     facts("FusedAdam", "(?i)capturable")),
    # S1.5: flags changed after construction are checked as the constructor checks them
    ("capturable-not-a-flag", True, set_attribute("capturable", []), ValueError,
     facts("FusedAdam", r"capturable must be a bool.*\[\]")),
    ("adam_w_mode-string", True, set_attribute("adam_w_mode", "no"), ValueError,
     facts("FusedAdam", r"adam_w_mode must be a bool.*'no'")),
    ("master_weights-string", True, set_attribute("master_weights", "no"), ValueError,
     facts("FusedAdam", r"master_weights must be a bool.*'no'")),
    ("use_decoupled_grad-string", True, set_attribute("use_decoupled_grad", "False"),
     ValueError, facts("FusedAdam", r"use_decoupled_grad must be a bool.*'False'")),
    ("group-bias_correction-string", True, set_group("bias_correction", "False"),
     ValueError, facts(r"group\W*1\b", r"bias_correction must be a bool.*'False'")),
    ("group-bias_correction-none", True, set_group("bias_correction", None), ValueError,
     facts(r"group\W*1\b", r"bias_correction must be a bool.*None")),
    ("swapped-in-int64-param", True, swap_param(torch.zeros(4, dtype=torch.int64)),
     RuntimeError, facts(*at(1, 1), "int64")),
    ("swapped-in-float64-param", True,
     swap_param(torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))),
     RuntimeError, facts(*at(1, 1), "float64")),
    ("swapped-in-fp8-param", True, swap_param(torch.zeros(4).to(torch.float8_e4m3fn)),
     RuntimeError, facts(*at(1, 1), "float8_e4m3fn")),
    ("group-without-lr", True, drop_group_key("lr"), KeyError,
     facts("FusedAdam", r"group\W*1\b", "has no 'lr'", "add_param_group")),
    ("group-without-bias_correction", True, drop_group_key("bias_correction"), KeyError,
     facts(r"group\W*1\b", "has no 'bias_correction'")),
    ("appended-group-without-betas", True, append_group_without("betas"), KeyError,
     facts(r"group\W*2\b", "has no 'betas'")),
    ("group-step-negative", True, set_group("step", -1), ValueError,
     facts(r"group\W*1\b", STEP_RANGE, "got -1")),
    ("group-step-string", True, set_group("step", "2"), ValueError,
     facts(r"group\W*1\b", STEP_RANGE, "got '2'")),
    ("group-step-bool", True, set_group("step", True), ValueError,
     facts(r"group\W*1\b", STEP_RANGE, "got True")),
    # group 0 would step first: the check comes before any group is updated (S3.1)
    ("group-step-past-int64", True, set_group("step", 2**63 - 1), ValueError,
     facts(r"group\W*1\b", STEP_RANGE, "signed 64-bit", f"got {2**63 - 1}")),
    ("param-listed-twice", True, repeat_param, RuntimeError,
     facts(*at(1, 1), "same tensor as param 0")),
    ("param-shares-memory-with-another-group", True, share_memory, RuntimeError,
     facts(*at(1, 1), r"shares memory with group 0, param 0\b")),
    ("param-re-viewed-with-stride-0", True, view_with_stride_0, RuntimeError,
     facts(*at(1, 1), SHARED_ELEMENTS)),
]


@pytest.mark.parametrize("decoupled,mutate,exc,pattern", [c[1:] for c in STEP_ERRORS],
                         ids=[c[0] for c in STEP_ERRORS])
def test_step_rejects_and_changes_nothing(decoupled, mutate, exc, pattern, backend):
    opt, params = stepped_optimizer(decoupled)
    mutate(opt, params)
    before = snapshot(opt)
    with pytest.raises(exc, match=pattern):
        opt.step()
    assert_unchanged(opt, before, "optimizer after a rejected step")


@pytest.mark.parametrize("held", [0, 4], ids=["freed", "shrunk"])
@pytest.mark.parametrize("decoupled", [False, True], ids=["grad", "decoupled_grad"])
def test_a_gradient_whose_storage_was_freed_or_shrunk_is_refused(held, decoupled, backend):
    """S3.2: a gradient is read by value, so it must hold its values: one whose storage
    was freed or shrunk in place (``untyped_storage().resize_``) is refused by name
    before anything changes (it was read past its storage, or, freed, crashed the
    pure-torch path and was refused by the core only after the state was converted)."""
    opt, params = stepped_optimizer(decoupled)
    opt.exp_avg_dtype = torch.bfloat16  # a setting changed: the step would convert first
    attr = "decoupled_grad" if decoupled else "grad"
    good = getattr(params[3], attr)
    before = snapshot(opt)
    bad = torch.zeros_like(good)
    bad.untyped_storage().resize_(held)
    setattr(params[3], attr, bad)
    with pytest.raises(RuntimeError, match=facts(*at(1, 1), f"storage holds {held} bytes",
                                                 r"rule S3\.2")):
        opt.step()
    setattr(params[3], attr, good)
    assert_unchanged(opt, before, "optimizer after a refused step")


def test_step_recovers_after_a_rejected_call(backend):
    """A rejected step leaves the optimizer usable: fixing the input, the next step
    equals the step of an optimizer that never saw the bad input."""
    opt, params = stepped_optimizer(True)
    twin, twin_params = stepped_optimizer(True)
    good = params[3].decoupled_grad
    params[3].decoupled_grad = torch.zeros(3)
    with pytest.raises(RuntimeError, match=facts(*at(1, 1), "(?i)shape")):
        opt.step()
    params[3].decoupled_grad = good
    opt.step()
    twin.step()
    assert_same_optimizer_state(twin, opt, twin_params, params, "after recovering")
    assert [g["step"] for g in opt.param_groups] == [3, 3]


def test_step_counter_up_to_its_bound(backend):
    """S2.8: the largest counter, 2**63 - 2, loads and still steps (the step taken fits
    an int64; its bias corrections are 1, so it steps as a twin without them), and
    the next step is refused with nothing changed."""
    opts = [stepped_optimizer(False) for _ in range(2)]
    for (opt, _), (step, correct) in zip(opts, ((2**63 - 2, True), (2, False))):
        sd = opt.state_dict()
        for group in sd["param_groups"]:
            group["step"], group["bias_correction"] = step, correct
        opt.load_state_dict(sd)
        opt.step()
    (opt, params), (twin, twin_params) = opts
    assert [g["step"] for g in opt.param_groups] == [2**63 - 1] * 2
    for group in twin.param_groups:
        group["step"] = 2**63 - 1  # the twin counted 3: compare the rest
    assert_same_optimizer_state(twin, opt, twin_params, params, "at the last step")
    before = snapshot(opt)
    with pytest.raises(ValueError, match=facts(r"group\W*0\b", STEP_RANGE)):
        opt.step()
    assert_unchanged(opt, before, "past the last step")
    # Its own checkpoint loads, and the loaded optimizer refuses the next step as well.
    twin.load_state_dict(opt.state_dict())
    assert_same_optimizer_state(twin, opt, twin_params, params, "loaded at the last step")
    with pytest.raises(ValueError, match=facts(r"group\W*0\b", STEP_RANGE)):
        twin.step()


def test_messages_name_the_parameter_when_known(backend):
    """S8: the parameter's name is in the message when the optimizer was given named
    parameters."""
    model = torch.nn.Linear(3, 2)
    opt = fused_adam()(model.named_parameters(), use_decoupled_grad=True)
    model.weight.decoupled_grad = torch.zeros(2, 3)
    model.bias.decoupled_grad = torch.zeros(5)
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match=facts(*at(0, 1), "bias", "(?i)shape")):
        opt.step()
    assert_unchanged(opt, before)


# --------------------------------------------------------------------------------------
# State access (S5.1 - S5.3)


def remainder_optimizer():
    generator = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(4, generator=generator)),
              torch.nn.Parameter(torch.randn(3, generator=generator).bfloat16())]
    opt = fused_adam()(params, master_weights=True, store_param_remainders=True,
                       exp_avg_dtype=torch.float16)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
    opt.step()
    return opt, params


FOREIGN = torch.nn.Parameter(torch.randn(4))


def without_storage(value, nbytes=0):
    """A copy of ``value`` whose storage then holds ``nbytes`` (freed, or shrunk)."""
    value = value.clone()
    value.untyped_storage().resize_(nbytes)
    return value


def call(method, target, *args, **kwargs):
    """`opt.<method>(param, *args, **kwargs)` where `target` is the parameter's index in
    the test's list, or "foreign" for a tensor the optimizer does not hold."""
    def apply(opt, params):
        param = FOREIGN if target == "foreign" else params[target]
        getattr(opt, method)(param, *args, **kwargs)
    return apply


ACCESS_ERRORS = [
    ("get-unknown-name", call("get_unscaled_state", 0, "momentum"), KeyError,
     facts(*at(0, 0), "unknown state name 'momentum'", r"states are \['exp_avg'")),
    ("get-master-of-fp32-param", call("get_unscaled_state", 0, "master_param"), KeyError,
     facts(*at(0, 0), "unknown state name 'master_param'", r"states are \['exp_avg'")),
    ("get-tensor-name", call("get_unscaled_state", 0, torch.full((3,), 12345.0)), KeyError,
     facts(*at(0, 0), r"unknown state name a tensor of dtype torch.float32 and shape \[3\]")),
    ("get-foreign-param", call("get_unscaled_state", "foreign", "exp_avg"), KeyError,
     facts("FusedAdam", "not a parameter of this optimizer")),
    ("set-unknown-name", call("set_scaled_state", 1, "velocity", torch.zeros(3)), KeyError,
     facts(*at(0, 1), "unknown state name 'velocity'", r"states are \['exp_avg'")),
    ("set-foreign-param", call("set_scaled_state", "foreign", "exp_avg", torch.zeros(4)),
     KeyError, facts("FusedAdam", "not a parameter of this optimizer")),
    ("set-bf16-value", call("set_scaled_state", 0, "exp_avg",
                            torch.zeros(4, dtype=torch.bfloat16)),
     RuntimeError, facts(*at(0, 0), "bfloat16")),
    ("set-float64-value", call("set_scaled_state", 0, "exp_avg_sq",
                               torch.zeros(4, dtype=torch.float64)),
     RuntimeError, facts(*at(0, 0), "float64")),
    ("set-fp32-into-remainder", call("set_scaled_state", 1, "master_param", torch.zeros(3)),
     RuntimeError, facts(*at(0, 1), "int16|float32",
                         "switch it off to set an fp32 master")),
    ("set-int16-into-moment", call("set_scaled_state", 1, "exp_avg",
                                   torch.zeros(3, dtype=torch.int16)),
     RuntimeError, facts(*at(0, 1), "int16|float32")),
    ("set-wrong-shape", call("set_scaled_state", 1, "exp_avg", torch.zeros(4)),
     RuntimeError, facts(*at(0, 1), "(?i)shape", r"rule S5\.3")),
    ("set-not-a-tensor", call("set_scaled_state", 1, "exp_avg", [0.0, 0.0, 0.0]),
     RuntimeError, facts(*at(0, 1), "(?i)tensor|list", r"rule S5\.3")),
    # read as S3.2 reads a gradient: one whose storage was freed killed the process
    ("set-freed-value", call("set_scaled_state", 1, "exp_avg", without_storage(torch.ones(3))),
     RuntimeError, facts(*at(0, 1), "storage of 0 bytes", "freed or shrunk", r"rule S5\.3")),
    ("set-shrunk-value", call("set_scaled_state", 0, "exp_avg_sq",
                              without_storage(torch.ones(4), 8)),
     RuntimeError, facts(*at(0, 0), "storage of 8 bytes", "freed or shrunk", r"rule S5\.3")),
    ("initialize-remainders-true-on-fp32-param",
     call("initialize_state", 0, store_param_remainders=True), RuntimeError,
     facts(*at(0, 0), "store_param_remainders")),
    ("initialize-remainders-false-on-remainder-param",
     call("initialize_state", 1, store_param_remainders=False), RuntimeError,
     facts(*at(0, 1), "store_param_remainders")),
    ("initialize-foreign-param", call("initialize_state", "foreign"), KeyError,
     facts("FusedAdam", "not a parameter of this optimizer")),
]


@pytest.mark.parametrize("action,exc,pattern", [c[1:] for c in ACCESS_ERRORS],
                         ids=[c[0] for c in ACCESS_ERRORS])
def test_state_access_rejects_and_changes_nothing(action, exc, pattern, backend):
    opt, params = remainder_optimizer()
    before = snapshot(opt)
    with pytest.raises(exc, match=pattern):
        action(opt, params)
    assert_unchanged(opt, before, "optimizer after a rejected state access")
    assert FOREIGN not in opt.state  # S5.2: no implicit creation


@pytest.mark.parametrize("remainders", [False, True], ids=["fp32-master", "remainder"])
@pytest.mark.parametrize("value", ["wrong-shape", "wrong-dtype", "not-a-tensor", "freed"])
def test_refused_master_keeps_following_its_parameter(value, remainders, backend):
    """S1.6: a master that follows its parameter (none has stepped) stops following only
    when a master is set; a refused set_scaled_state leaves it following: weights loaded
    afterwards are still the master at the first step."""
    param = torch.nn.Parameter(torch.randn(3, 4).bfloat16())
    opt = fused_adam()([param], master_weights=True, store_param_remainders=remainders)
    right = torch.int16 if remainders else torch.float32
    bad = {"wrong-shape": torch.zeros(4, 3, dtype=right),
           "wrong-dtype": torch.zeros(3, 4, dtype=torch.float64),
           "not-a-tensor": [[0.0] * 4] * 3,
           "freed": without_storage(torch.zeros(3, 4, dtype=right))}[value]
    before = snapshot(opt)
    assert before["seeded_keys"] == [id(param)]
    with pytest.raises(RuntimeError, match=facts(*at(0, 0), "master_param")):
        opt.set_scaled_state(param, "master_param", bad)
    assert_unchanged(opt, before, "optimizer after a refused master")
    param.data.copy_(torch.full((3, 4), 0.5))  # weights loaded after the refusal
    param.grad = torch.zeros(3, 4, dtype=torch.bfloat16)
    opt.step()  # zero gradient, zero moments: the master stays what it followed
    want = (torch.zeros(3, 4, dtype=torch.int16) if remainders
            else torch.full((3, 4), 0.5))
    assert_bitwise_equal(opt.get_unscaled_state(param, "master_param"), want, "master")


def test_state_access_to_a_parameter_without_state_creates_none(backend):
    """S5.2: a parameter of the optimizer whose state was removed has no state to read:
    KeyError, and nothing is created."""
    opt, params = remainder_optimizer()
    del opt.state[params[1]]
    before = snapshot(opt)
    with pytest.raises(KeyError, match=facts(*at(0, 1), "no state 'exp_avg' yet")):
        opt.get_unscaled_state(params[1], "exp_avg")
    assert_unchanged(opt, before, "optimizer after reading missing state")
    assert params[1] not in opt.state


def test_initialize_state_contradiction_without_remainders(backend):
    """S5.1: explicit True where the configuration implies no remainder (fp32 master)."""
    params = make_params()
    opt = fused_adam()(params, master_weights=True)
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match=facts(*at(0, 1), "store_param_remainders")):
        opt.initialize_state(params[1], store_param_remainders=True)
    assert_unchanged(opt, before)
    opt.initialize_state(params[1], store_param_remainders=False)  # agrees: accepted


@pytest.mark.parametrize("name", ["exp_avg", "master_param"])
def test_set_scaled_state_into_an_entry_that_is_no_dict_is_refused(name, backend):
    """S5.1, S8: a state entry replaced from outside by something other than a dict is
    refused by name before anything changes: the master keeps following its parameter
    and the group keeps no mark of moments set (it was a bare AttributeError after
    both had changed)."""
    params = [torch.nn.Parameter(torch.randn(3, 4).bfloat16())]
    opt = fused_adam()(params, master_weights=True)
    opt.state[params[0]] = 7
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match=facts(*at(0, 0), "must be a dict",
                                                 r"rule S5\.1", "initialize_state")):
        opt.set_scaled_state(params[0], name, torch.zeros(3, 4))
    assert_unchanged(opt, before, "optimizer after a refused set_scaled_state")


@pytest.mark.parametrize("shape", [(4, 4), (300, 300)], ids=["small", "chunked"])
def test_set_scaled_state_reads_a_view_of_the_state_itself_by_value(shape, backend):
    """S5.3: the value is read as S3.2 reads a gradient, by value, also where it is a
    view of the very state it replaces (``get_unscaled_state`` hands out an fp32 state
    itself): the state becomes the view's values as they were (a small tensor failed
    in torch's copy, after the group was marked)."""
    gen = torch.Generator().manual_seed(5)
    param = torch.nn.Parameter(torch.randn(shape, generator=gen))
    opt = fused_adam()([param])
    param.grad = torch.randn(shape, generator=gen)
    opt.step()
    stored = opt.get_unscaled_state(param, "exp_avg")
    want = stored.t().clone()
    opt.set_scaled_state(param, "exp_avg", stored.t())
    assert_bitwise_equal(opt.get_unscaled_state(param, "exp_avg"), want, "exp_avg")


def test_set_scaled_state_caller_tensor_untouched(backend):
    """S5.3: the caller's tensor is not modified (fp16 storage divides by the scale)."""
    opt, params = remainder_optimizer()
    value = torch.randn(3) * 1e3
    copy = value.clone()
    opt.set_scaled_state(params[1], "exp_avg", value)
    assert_bitwise_equal(value, copy, "caller's tensor")


# --------------------------------------------------------------------------------------
# load_state_dict (S5.5)


def corrupt(edit):
    def apply(sd):
        edit(sd)
        return sd
    return apply


def _drop_group(sd):
    sd["param_groups"] = sd["param_groups"][:1]


def _shrink_group(sd):
    sd["param_groups"][1]["params"] = sd["param_groups"][1]["params"][:1]


def _torch_steps_that_differ(sd):
    """torch.optim.AdamW's layout (a step per parameter, none in the group), with two
    parameters of one group at different steps."""
    del sd["param_groups"][1]["step"]
    sd["state"][2]["step"] = torch.tensor(2.0)
    sd["state"][3]["step"] = torch.tensor(3.0)


def _tensor_keys_at_step_0(sd):
    """State keyed by tensors (a hand-made dict), group 1 at step 0 with its moments."""
    keys = {k: torch.full((2, 2), 0.123 + k) for k in sd["state"]}
    sd["state"] = {keys[k]: v for k, v in sd["state"].items()}
    for group in sd["param_groups"]:
        group["params"] = [keys[k] for k in group["params"]]
    sd["param_groups"][1]["step"] = 0


def _meta_step_per_parameter(sd):
    del sd["param_groups"][1]["step"]
    sd["state"][2]["step"] = torch.empty((), device="meta")


def _moment_at_step_0(kind):
    """Group 0 at step 0 with zero moments, one of them a sparse CSR tensor, or one
    whose storage was freed: refused by name, not by the step-0 check, which cannot read
    one (it read the freed one's memory: a segmentation fault)."""
    def edit(sd):
        sd["param_groups"][0]["step"] = 0
        for key in sd["param_groups"][0]["params"]:
            for name in ("exp_avg", "exp_avg_sq"):
                sd["state"][key][name] = torch.zeros_like(sd["state"][key][name])
        value = sd["state"][0]["exp_avg"]
        sd["state"][0]["exp_avg"] = (value.to_sparse_csr() if kind == "sparse-csr"
                                     else without_storage(value))
    return edit



LOAD_ERRORS = [
    ("fewer-groups", _drop_group, ValueError,
     facts("FusedAdam", "(?i)number of parameter groups")),
    ("group-size", _shrink_group, ValueError,
     facts("FusedAdam", r"group\W*1\b", r"(?i)size|match")),
    ("missing-param-state", lambda sd: sd["state"].pop(3), ValueError,
     facts(*at(1, 1), "no state for this parameter", "requires_grad=False")),
    ("no-state-key", lambda sd: sd.pop("state"), ValueError,
     facts("^FusedAdam", "no 'state'", r"rule: ")),
    ("no-param_groups-key", lambda sd: sd.pop("param_groups"), ValueError,
     facts("^FusedAdam", "no 'param_groups'", r"rule: ")),
    ("missing-exp_avg_sq", lambda sd: sd["state"][2].pop("exp_avg_sq"), ValueError,
     facts(*at(1, 0), "exp_avg_sq")),
    ("missing-master_param", lambda sd: sd["state"][1].pop("master_param"), ValueError,
     facts(*at(0, 1), "master_param")),
    ("wrong-shape", lambda sd: sd["state"][0].__setitem__("exp_avg", torch.zeros(5)),
     RuntimeError, facts(*at(0, 0), "(?i)shape")),
    ("wrong-shape-master", lambda sd: sd["state"][3].__setitem__("master_param",
                                                                 torch.zeros(2, 3)),
     RuntimeError, facts(*at(1, 1), "(?i)shape")),
    ("not-a-tensor", lambda sd: sd["state"][2].__setitem__("exp_avg", 0.0),
     RuntimeError, facts(*at(1, 0), "(?i)tensor|float")),
    # S5.5: what a template's step makes of a torch AdamW checkpoint loaded through it
    ("step-0-with-moments", lambda sd: sd["param_groups"][1].__setitem__("step", 0),
     ValueError, facts("^FusedAdam", r"group\W*1\b", "the loaded step is 0 but exp_avg",
                       "rule S5.5", "torch AdamW")),
    ("step-past-int64", lambda sd: sd["param_groups"][1].__setitem__("step", 2**63),
     ValueError, facts("^FusedAdam", r"group\W*1\b", "loaded step", LOADED_STEP_RANGE,
                       f"got {2**63}")),
    ("step-0-tensor-keys", _tensor_keys_at_step_0, ValueError,
     facts("^FusedAdam", r"group\W*1\b", "the loaded step is 0 but exp_avg",
           r"key a tensor of dtype torch.float32 and shape \[2, 2\] is")),
    ("step-a-meta-tensor", lambda sd: sd["param_groups"][1].__setitem__(
        "step", torch.empty((), device="meta")),
     ValueError, facts("^FusedAdam", r"group\W*1\b", "loaded step", LOADED_STEP_RANGE,
                       "on the meta device")),
    ("step-per-parameter-a-meta-tensor", _meta_step_per_parameter,
     ValueError, facts("^FusedAdam", r"group\W*1\b", "loaded step", "on the meta device")),
    ("step-float-past-int64", lambda sd: sd["param_groups"][1].__setitem__("step", 1e19),
     ValueError, facts("^FusedAdam", r"group\W*1\b", "loaded step", LOADED_STEP_RANGE)),
    ("bad-lr", lambda sd: sd["param_groups"][1].__setitem__("lr", -1.0), ValueError,
     facts(r"group\W*1\b", r"Invalid learning rate")),
    ("torch-amsgrad", lambda sd: sd["param_groups"][1].__setitem__("amsgrad", True),
     ValueError, facts("^FusedAdam", r"group\W*1\b", "amsgrad=True", "rule: ")),
    ("torch-maximize", lambda sd: sd["param_groups"][1].__setitem__("maximize", True),
     ValueError, facts("^FusedAdam", r"group\W*1\b", "maximize=True", "rule: ")),
    # torch's Adam (L2) into this AdamW-mode optimizer
    ("torch-adam-l2", lambda sd: sd["param_groups"][1].__setitem__(
        "decoupled_weight_decay", False),
     ValueError, facts("^FusedAdam", r"group\W*1\b", "decoupled_weight_decay=False",
                       "adam_w_mode=True", "rule: ")),
    ("torch-step-counts-differ", _torch_steps_that_differ, ValueError,
     facts("^FusedAdam", r"group\W*1\b", r"step counts differ \(\[2, 3\]", "rule: ")),
    ("bad-state_layout", lambda sd: sd["param_groups"][1].__setitem__("state_layout",
                                                                      "exp_avg=fp64"),
     ValueError, facts("^FusedAdam", r"group\W*1\b", "state_layout", "rule: ",
                       "loads once that entry is removed")),
    ("state_layout-a-field-twice", lambda sd: sd["param_groups"][1].__setitem__(
        "state_layout", sd["param_groups"][1]["state_layout"] + " exp_avg=bf16"),
     ValueError, facts("^FusedAdam", r"group\W*1\b", "state_layout", "rule: ")),
    # S6.4: an int16 master where the checkpoint recorded an fp16 one, and this
    # optimizer has no remainders DCP could have cast it into
    ("master-cast-to-int16", lambda sd: sd["state"][1].__setitem__(
        "master_param", sd["state"][1]["master_param"].round().to(torch.int16)),
     RuntimeError, facts(*at(0, 1), "recorded a floating-point 'master_param'",
                         "holds int16 values", "rule S6.4")),
    # S8: the loaded dict's parts of the wrong kind, each named
    ("param_groups-a-dict", lambda sd: sd.__setitem__("param_groups", sd["param_groups"][0]),
     ValueError, facts("^FusedAdam", "'param_groups' must be a list of dicts", "rule: ")),
    ("state-a-list", lambda sd: sd.__setitem__("state", list(sd["state"].values())),
     ValueError, facts("^FusedAdam", "'state' must be a dict", "tensors among them")),
    ("params-key-unhashable", lambda sd: sd["param_groups"][1].__setitem__(
        "params", [[2], 3]),
     ValueError, facts("^FusedAdam", r"group\W*1\b", r"lists \[2\], which cannot key")),
    ("params-key-unhashable-inside", lambda sd: sd["param_groups"][1].__setitem__(
        "params", [(2, [0]), 3]),
     ValueError, facts("^FusedAdam", r"group\W*1\b", r"lists \(2, \[0\]\), which cannot")),
    ("param-state-not-a-dict", lambda sd: sd["state"].__setitem__(2, torch.zeros(6)),
     ValueError, facts(*at(1, 0), "must be a dict of its states",
                       r"a tensor of dtype torch.float32 and shape \[6\]")),
    # kept, they broke every later step and load with a bare TypeError (len of a float)
    ("param_names-a-float", lambda sd: sd["param_groups"][1].__setitem__("param_names", 0.1),
     ValueError, facts(r"group\W*1\b", "param_names must list one name per parameter",
                       r"got 0\.1", r"rule S5\.5")),
    ("param_names-one-short", lambda sd: sd["param_groups"][1].__setitem__(
        "param_names", ["a"]),
     ValueError, facts(r"group\W*1\b", r"one name per parameter \(2\)", r"\['a'\]")),
    # its message listed the state's keys sorted: an int beside a str raised TypeError
    ("missing-state-beside-an-int-key", lambda sd: sd["state"][2].update(
        {99: 0}) or sd["state"][2].pop("exp_avg_sq"),
     ValueError, facts(*at(1, 0), r"no 'exp_avg_sq' \(it holds \[99, 'exp_avg'")),
    ("group-without-params", lambda sd: sd["param_groups"][1].pop("params"), ValueError,
     facts("^FusedAdam", r"group\W*1\b", "'params' lists its parameters' keys")),
    ("decoupled_weight_decay-a-tensor", lambda sd: sd["param_groups"][1].__setitem__(
        "decoupled_weight_decay", torch.tensor([1.0, 0.0])),
     ValueError, facts(r"group\W*1\b", "decoupled_weight_decay must be a bool",
                       r"shape \[2\]")),
    ("state_layout-a-tensor", lambda sd: sd["param_groups"][1].__setitem__(
        "state_layout", torch.ones(3)),
     ValueError, facts(r"group\W*1\b", "state_layout must be a str", r"shape \[3\]")),
    ("sparse-csr-moment-at-step-0", _moment_at_step_0("sparse-csr"), RuntimeError,
     facts(*at(0, 0), "'exp_avg' must be dense", "torch.sparse_csr", r"rule S5\.3")),
    ("freed-moment-at-step-0", _moment_at_step_0("freed"), RuntimeError,
     facts(*at(0, 0), "'exp_avg' has a storage of 0 bytes", "freed or shrunk",
           r"rule S5\.3")),
    ("shrunk-state-value", lambda sd: sd["state"][2].__setitem__(
        "exp_avg_sq", without_storage(sd["state"][2]["exp_avg_sq"], 8)),
     RuntimeError, facts(*at(1, 0), "'exp_avg_sq' has a storage of 8 bytes",
                         "freed or shrunk", r"rule S5\.3")),
    ("meta-state-value", lambda sd: sd["state"][2].__setitem__(
        "exp_avg", torch.zeros(6, device="meta")),
     RuntimeError, facts(*at(1, 0), "'exp_avg' is a meta tensor")),
    # S5.4: exported values are told apart by dtype; codes are never exported
    ("int16-moment-of-bf16-param", lambda sd: sd["state"][1].__setitem__(
        "exp_avg", torch.zeros(5, dtype=torch.int16)),
     RuntimeError, facts(*at(0, 1), "'exp_avg' must hold floating point", "rule S5.4")),
    ("int16-moment-of-fp32-param", lambda sd: sd["state"][2].__setitem__(
        "exp_avg_sq", torch.zeros(6, dtype=torch.int16)),
     RuntimeError, facts(*at(1, 0), "'exp_avg_sq' must hold floating point", "rule S5.4")),
    ("uint8-codes", lambda sd: sd["state"][0].__setitem__(
        "exp_avg", torch.zeros(4, 3, dtype=torch.uint8)),
     RuntimeError, facts(*at(0, 0), "'exp_avg' must hold floating point", "uint8")),
]


@pytest.mark.parametrize("edit,exc,pattern", [c[1:] for c in LOAD_ERRORS],
                         ids=[c[0] for c in LOAD_ERRORS])
def test_load_state_dict_rejects_and_changes_nothing(edit, exc, pattern, backend):
    opt, params = stepped_optimizer(False)
    sd = opt.state_dict()
    # the optimizer loading it has moved on: a partial load would be visible
    opt.step()
    edit(sd)
    before = snapshot(opt)
    with pytest.raises(exc, match=pattern):
        opt.load_state_dict(sd)
    assert_unchanged(opt, before, "optimizer after a rejected load_state_dict")


def test_load_state_dict_takes_any_mapping_as_a_dict(backend):
    """S5.5, S8: the loaded dict and its groups may be any Mapping (read-only ones too,
    as check_loaded_dict accepts them): they load as their dict copies do (a Mapping
    without copy() or item assignment, or a mappingproxy group, was a bare error)."""
    import collections.abc
    import types

    class ReadOnly(collections.abc.Mapping):
        def __init__(self, data):
            self._data = data

        def __getitem__(self, key):
            return self._data[key]

        def __iter__(self):
            return iter(self._data)

        def __len__(self):
            return len(self._data)

    opt, params = stepped_optimizer(False)
    sd = opt.state_dict()
    opt.step()
    wrapped = ReadOnly(dict(sd, param_groups=[
        ReadOnly(sd["param_groups"][0]), types.MappingProxyType(sd["param_groups"][1])]))
    other = copy.deepcopy(opt)
    opt.load_state_dict(wrapped)
    other.load_state_dict(sd)
    assert_same_optimizer_state(opt, other, opt.param_groups[0]["params"]
                                + opt.param_groups[1]["params"],
                                other.param_groups[0]["params"]
                                + other.param_groups[1]["params"], "Mapping load")


def test_load_state_dict_refuses_what_is_no_dict(backend):
    """S8: a loaded object that is no dict (here state_dict() inside a list) is named by
    its kind, never by its contents, and loads nothing."""
    opt, params = stepped_optimizer(False)
    sd = opt.state_dict()
    opt.step()
    before = snapshot(opt)
    with pytest.raises(ValueError, match=facts("^FusedAdam", "must be a dict",
                                               "a list of 1 item, tensors among them")):
        opt.load_state_dict([sd])
    assert_unchanged(opt, before, "after loading a list")


def test_load_refuses_a_float_master_cast_into_remainders(backend):
    """S6.4: what DCP makes of an fp32 master loaded into an optimizer with remainders
    (int16 values where the checkpoint recorded fp32 ones) is refused, saying so."""
    opt, params = remainder_optimizer()
    sd = opt.state_dict()
    sd["param_groups"][0]["state_layout"] = "exp_avg=fp16 exp_avg_sq=fp32 master=fp32"
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match=facts(*at(0, 1), "arrived as int16",
                                                 "torch.distributed.checkpoint",
                                                 "store_param_remainders", "rule S6.4")):
        opt.load_state_dict(sd)
    assert_unchanged(opt, before, "after a cast master")


def _stepped_bf16_moments(seed, count):
    """``count`` bf16 parameters of 5 elements with bf16 moments and fp32 masters, two
    steps in: exact storage."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, generator=generator).bfloat16())
              for _ in range(count)]
    opt = fused_adam()(params, lr=1e-2, master_weights=True,
                       exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(5, generator=generator).bfloat16()
        opt.step()
    return opt, params


def test_load_state_dict_keeps_the_state_of_frozen_parameters_left_out(backend):
    """torch's DCP state-dict helpers leave out the state of parameters that do not
    require grad (FSDP2): such a parameter keeps its state, everything else is loaded.
    A trainable parameter left out is still an error (LOAD_ERRORS). Exact storage (bf16
    moments, fp32 master), so "keeps" is bitwise."""
    opt, params = _stepped_bf16_moments(8, 3)
    twin, twin_params = _stepped_bf16_moments(8, 3)
    sd = copy.deepcopy(opt.state_dict())  # fp32 state is exported by reference
    opt.step()  # moved on: the load must rewind every other parameter
    params[1].requires_grad_(False)
    kept = {k: v.clone() for k, v in state_tensors(opt, params[1]).items()}
    del sd["state"][1]
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["step"] == 2
    now = state_tensors(opt, params[1])
    assert sorted(now) == sorted(kept)
    for key, value in kept.items():
        assert_bitwise_equal(now[key], value, f"frozen parameter's {key}")
    for i in (0, 2):  # loaded: as in the twin that never moved on
        expected, actual = state_tensors(twin, twin_params[i]), state_tensors(opt, params[i])
        for key, value in expected.items():
            assert_bitwise_equal(actual[key], value, f"param {i} {key} after the load")


@pytest.mark.parametrize("template", ["last-state_dict", "an-earlier-one"])
def test_a_frozen_parameter_left_out_reads_the_template_its_load_filled(template,
                                                                       backend):
    """S5.5: torch's set_optimizer_state_dict drops a frozen parameter's state after
    dcp.load wrote the checkpoint into the template this optimizer's state_dict()
    exported: the load reads it back from there (a fresh optimizer's own state is the
    initial one); from a template of an earlier state_dict() call, which it no longer
    knows, the parameter keeps its state. bf16 moments: exported as copies."""
    saved, saved_params = _stepped_bf16_moments(9, 2)
    checkpoint = copy.deepcopy(saved.state_dict())
    opt, params = _stepped_bf16_moments(10, 2)
    params[1].requires_grad_(False)
    kept = {k: v.clone() for k, v in state_tensors(opt, params[1]).items()}
    sd = opt.state_dict()
    if template == "an-earlier-one":
        opt.state_dict()  # the export opt knows is another one now
    for i, entry in sd["state"].items():  # as dcp.load writes into the template
        for name, value in entry.items():
            value.copy_(checkpoint["state"][i][name])
    del sd["state"][1]  # as torch's _split_optim_state_dict drops it
    opt.load_state_dict(sd)
    now = state_tensors(opt, params[1])
    expected = state_tensors(saved, saved_params[1])
    if template == "an-earlier-one":  # kept, but for the fp32 master exported by reference,
        expected = dict(kept, master_param=expected["master_param"])  # written in place
    for key, value in expected.items():
        assert_bitwise_equal(now[key], value, f"frozen parameter's {key}")
    for key, value in state_tensors(saved, saved_params[0]).items():
        assert_bitwise_equal(state_tensors(opt, params[0])[key], value, f"param 0 {key}")


# ------------------------------------------------------------------------------------
# No tensor contents in messages (S8): every error of the tables above, raised with
# parameters, gradients and states that all hold a sentinel value, and a tensor given
# where a number belongs, are shown by kind, dtype and shape only.

SENTINEL = 0.4140625  # 53 / 128: exact in fp32, bf16 and fp16, and not a whole number
REMAINDER_SENTINEL = 12345  # what int16 remainders hold instead
SENTINEL_TEXTS = ("0.414", "12345")


def _message_chain(error):
    """The message of ``error`` and of every exception chained to it."""
    texts = []
    while error is not None:
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(texts)


def _attempt(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test reads any error's text
        return error
    return None


def _fill_with_sentinel(opt, params):
    """Every parameter, gradient and state (its true value, S5.3) of ``opt`` set to
    SENTINEL."""
    with torch.no_grad():
        for p in params:
            p.fill_(SENTINEL)
            for attr in ("grad", "decoupled_grad"):
                if getattr(p, attr, None) is not None:
                    getattr(p, attr).fill_(SENTINEL)
            for name, stored in list(opt.state[p].items()):
                value = (torch.full(p.shape, REMAINDER_SENTINEL, dtype=torch.int16)
                         if stored.dtype == torch.int16 else torch.full(p.shape, SENTINEL))
                opt.set_scaled_state(p, name, value)


def _assert_no_contents(error, what):
    assert error is not None, f"{what}: nothing was raised"
    text = _message_chain(error)
    assert not any(t in text for t in SENTINEL_TEXTS), \
        f"{what}: a message shows tensor contents: {text}"


@pytest.mark.parametrize("kwargs", [c[1] for c in CONSTRUCTOR_ERRORS],
                         ids=[c[0] for c in CONSTRUCTOR_ERRORS])
def test_constructor_errors_show_no_tensor_contents(kwargs):
    params = make_params()
    with torch.no_grad():
        for p in params:
            p.fill_(SENTINEL)
    _assert_no_contents(_attempt(lambda: fused_adam()(params, **kwargs)), "constructor")


@pytest.mark.parametrize("decoupled,mutate", [c[1:3] for c in STEP_ERRORS],
                         ids=[c[0] for c in STEP_ERRORS])
def test_step_errors_show_no_tensor_contents(decoupled, mutate, backend):
    opt, params = stepped_optimizer(decoupled)
    _fill_with_sentinel(opt, params)
    mutate(opt, params)
    _assert_no_contents(_attempt(opt.step), "step()")


@pytest.mark.parametrize("action", [c[1] for c in ACCESS_ERRORS],
                         ids=[c[0] for c in ACCESS_ERRORS])
def test_state_access_errors_show_no_tensor_contents(action, backend):
    opt, params = remainder_optimizer()
    _fill_with_sentinel(opt, params)
    _assert_no_contents(_attempt(lambda: action(opt, params)), "state access")


@pytest.mark.parametrize("edit", [c[1] for c in LOAD_ERRORS],
                         ids=[c[0] for c in LOAD_ERRORS])
def test_load_errors_show_no_tensor_contents(edit, backend):
    opt, params = stepped_optimizer(False)
    _fill_with_sentinel(opt, params)
    sd = opt.state_dict()
    edit(sd)
    _assert_no_contents(_attempt(lambda: opt.load_state_dict(sd)), "load_state_dict")


def _misused_number_error(where):
    """The error of a multi-element SENTINEL tensor given where a number belongs."""
    bad = torch.full((2, 3), SENTINEL)
    if where == "constructor-lr":
        return _attempt(lambda: fused_adam()(make_params(), lr=bad))
    opt, _ = stepped_optimizer(False)
    if where in ("group-lr", "group-step"):
        opt.param_groups[1]["lr" if where == "group-lr" else "step"] = bad
        return _attempt(opt.step)
    sd = opt.state_dict()
    sd["param_groups"][1]["lr" if where == "loaded-lr" else "step"] = bad
    return _attempt(lambda: opt.load_state_dict(sd))


@pytest.mark.parametrize("where", ["constructor-lr", "group-lr", "group-step",
                                   "loaded-lr", "loaded-step"])
def test_messages_show_no_tensor_contents(where, backend):
    error = _misused_number_error(where)
    assert isinstance(error, ValueError), f"{where}: {type(error).__name__}: {error}"
    _assert_no_contents(error, where)
    text = _message_chain(error)
    assert "shape [2, 3]" in text and "torch.float32" in text, text


# Groups and state in forms no reader expects: handed in, or edited by hand (S8).

@pytest.mark.parametrize("build, error, pattern", [
    (lambda p, q: fused_adam()([{"lr": 0.1}]), KeyError, r"group 0: the group has no 'params'"),
    (lambda p, q: fused_adam()([{"params": None}]), TypeError,
     r"group 0: 'params' must be a tensor or an ordered collection .*got None"),
    (lambda p, q: fused_adam()([{"params": {p}}]), TypeError,
     r"group 0: 'params' .*a set's order changes between runs.*got a set of 1 item"),
    (lambda p, q: fused_adam()([("a", p), q]), ValueError,
     r"group 0: names some parameters and not others"),
    (lambda p, q: fused_adam()([p]).add_param_group({"params": 3}), TypeError,
     r"group 1: 'params' must be a tensor .*got 3"),
    (lambda p, q: fused_adam()([p]).add_param_group(["x"]), TypeError,
     r"group 1: a parameter group must be a dict, got \['x'\]"),
    (lambda p, q: fused_adam()({"params": [p]}), TypeError,
     r"params must be an iterable of tensors or of parameter groups, got a dict"),
    (lambda p, q: fused_adam()(p), TypeError,
     r"params must be an iterable .* got a tensor of dtype torch.float32 and shape \[3\]"
     r".*a lone tensor goes in a list"),
    (lambda p, q: fused_adam()(3), TypeError,
     r"params must be an iterable of tensors or of parameter groups, got 3"),
    (lambda p, q: fused_adam()([{"params": [("a", p)]}, {"params": [q]}]), ValueError,
     r"group 1: does not name its parameters where the groups before it do"),
    (lambda p, q: fused_adam()([p]).add_param_group({"params": [("b", q)]}), ValueError,
     r"group 1: names its parameters where the groups before it do not"),
], ids=["no-params", "params-none", "params-set", "mixed-names", "apg-int", "apg-list",
        "params-dict", "params-tensor", "params-int", "named-then-unnamed",
        "unnamed-then-named"])
def test_malformed_groups_handed_in_are_refused_by_name(build, error, pattern):
    """S8: a group handed to the constructor or add_param_group that torch's rules refuse
    is refused naming the class, the group and the rule, not with torch's or Python's
    bare message (a KeyError 'params', "NoneType is not iterable")."""
    p, q = (torch.nn.Parameter(torch.randn(3)) for _ in range(2))
    with pytest.raises(error, match=facts("FusedAdam", pattern, "rule S8")):
        build(p, q)


@pytest.mark.parametrize("value, shown", [
    (np.ones(1000), "a numpy array of dtype float64 and shape [1000]"),
    ([0.5] * 1000, "... (list, 5000 characters)"),
], ids=["numpy-array", "long-list"])
def test_messages_show_long_values_cut(value, shown):
    """S8: a value shown in a message is a log line: a numpy array (a model's data, as a
    tensor's) as its dtype and shape, any other long repr cut."""
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=facts("Invalid learning rate")) as raised:
        fused_adam()([p], lr=value)
    assert str(raised.value).endswith(shown) and len(str(raised.value)) < 400, raised.value


@dataclasses.dataclass
class _Fields:
    value: object


@dataclasses.dataclass(slots=True)
class _SlotFields:
    value: object


def _holders(secret):
    """Values that hold ``secret`` (a tensor of SENTINEL values) where a repr prints it."""
    return {"deque": collections.deque([secret]), "frozenset": frozenset({secret}),
            "namespace": types.SimpleNamespace(t=secret),
            "mappingproxy": types.MappingProxyType({"t": secret}),
            "dataclass": _Fields(secret), "slots-dataclass": _SlotFields(secret),
            "partial": functools.partial(max, secret),  # held in C: its repr tells
            "array-in-list": [[1.0, secret.numpy()]], "key": {(1, secret): 2},
            "module": torch.nn.Linear(3, 1)}


@pytest.mark.parametrize("kind", list(_holders(torch.zeros(1))))
def test_values_holding_tensors_anywhere_are_not_shown(kind):
    """S8: no message shows a tensor's contents, whatever holds the tensor (a deque,
    frozenset, SimpleNamespace, read-only mapping, dataclass, a dict's key, an array in
    a list, a module; a partial, whose arguments no scan reaches, by its repr's marks:
    their reprs printed it), only the holder's kind."""
    secret = torch.full((3,), SENTINEL)
    value = _holders(secret)[kind]
    if kind == "module":  # its repr shows no values; its weights are still a model's
        with torch.no_grad():
            value.weight.fill_(SENTINEL)
    error = _attempt(lambda: fused_adam()([torch.nn.Parameter(torch.randn(3))], lr=value))
    assert isinstance(error, ValueError), error
    _assert_no_contents(error, kind)
    why = "its repr could show tensor contents" if kind == "partial" else "tensors among them"
    assert f"a {type(value).__name__}" in str(error) and why in str(error), str(error)


def test_a_loaded_entry_holding_tensors_is_not_shown():
    """S8: a loaded parameter entry that is no dict (a read-only mapping of its states)
    is refused showing its kind, not its tensors' values."""
    p = torch.nn.Parameter(torch.randn(3))
    opt = fused_adam()([p], lr=0.1)
    sd = opt.state_dict()
    secret = torch.full((3,), SENTINEL)
    sd["state"][0] = types.MappingProxyType({"exp_avg": secret, "exp_avg_sq": secret})
    before = snapshot(opt)
    error = _attempt(lambda: opt.load_state_dict(sd))
    assert isinstance(error, ValueError), error
    _assert_no_contents(error, "load_state_dict")
    assert "a mappingproxy of 2 items, tensors among them" in str(error), str(error)
    assert_unchanged(opt, before)


def test_values_too_large_to_look_through_are_not_shown():
    """S8: a value holding more than the message looks through is shown by kind and
    length (a tensor could be past what was looked at)."""
    value = [0.5] * 20_000
    error = _attempt(lambda: fused_adam()([torch.nn.Parameter(torch.randn(3))], lr=value))
    assert str(error).endswith("a list of 20000 items, too large to look through"), error


@pytest.mark.parametrize("call", ["state_dict", "add_param_group", "step", "load_state_dict"])
def test_a_parameter_put_in_by_hand_that_is_no_tensor_is_refused_by_name(call):
    """S8: a parameter put into a group by hand that is no tensor is refused naming it,
    state_dict and add_param_group with TypeError (they failed with a bare
    AttributeError), step and load_state_dict as S1.4 refuses a parameter; nothing
    changes."""
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(5))
    opt = fused_adam()([a, b], lr=0.1, master_weights=True)
    a.grad, b.grad = torch.randn(4), torch.randn(5)
    opt.step()
    saved = opt.state_dict()
    before = snapshot(opt)
    opt.param_groups[0]["params"][1] = 7
    calls = {"state_dict": opt.state_dict, "step": opt.step,
             "load_state_dict": lambda: opt.load_state_dict(saved),
             "add_param_group": lambda: opt.add_param_group(
                 {"params": [torch.nn.Parameter(torch.randn(2))]})}
    error, rule, shown = ((TypeError, "S8", "7") if call in ("state_dict", "add_param_group")
                          else (RuntimeError, "S1.4", "int"))
    with pytest.raises(error, match=facts("FusedAdam", r"group 0, param 1\b",
                                          f"parameters must be tensors, got {shown}",
                                          f"rule {rule}")):
        calls[call]()
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["params"][1] = b
    assert_unchanged(opt, before)


@pytest.mark.parametrize("call", ["step", "state_dict", "zero_grad", "get_unscaled_state",
                                  "load_state_dict", "add_param_group"])
@pytest.mark.parametrize("broken", ["params-tensor", "params-none", "group-str", "groups-tuple"])
def test_param_groups_edited_into_an_unreadable_form_are_refused(call, broken):
    """S8: a group of ``param_groups`` edited by hand into something no reader can take is
    refused by name; a tensor put in as ``params`` was read as its rows, each stepped as
    a parameter of its own, with new state for each. Nothing changes."""
    a = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(torch.randn(5))
    opt = fused_adam()([a, b], lr=0.1)
    a.grad, b.grad = torch.randn(4, 3), torch.randn(5)
    opt.step()
    saved = opt.state_dict()
    before = snapshot(opt)
    groups, group = opt.param_groups, opt.param_groups[0]
    if broken == "group-str":
        opt.param_groups[0] = "x"
        pattern = r"group 0: a parameter group must be a dict, got 'x'"
    elif broken == "groups-tuple":  # step() read it as it was, the others refused it
        opt.param_groups = tuple(groups)
        pattern = r"param_groups must be a list of dicts, got a tuple of 1 item"
    else:
        group["params"] = a if broken == "params-tensor" else None
        shown = "a tensor of dtype torch.float32 and shape \\[4, 3\\]" \
            if broken == "params-tensor" else "None"
        pattern = rf"group 0: 'params' must be a list of parameters, got {shown}"
    calls = {"step": opt.step, "state_dict": opt.state_dict, "zero_grad": opt.zero_grad,
             "get_unscaled_state": lambda: opt.get_unscaled_state(b, "exp_avg"),
             "load_state_dict": lambda: opt.load_state_dict(saved),
             "add_param_group": lambda: opt.add_param_group(
                 {"params": [torch.nn.Parameter(torch.randn(2))]})}
    with pytest.raises(TypeError, match=facts("FusedAdam", pattern, "rule S8")):
        calls[call]()
    opt.param_groups = groups
    groups[0] = group
    group["params"] = [a, b]
    assert len(opt.param_groups) == 1 and len(opt.state) == 2
    assert_unchanged(opt, before)


@pytest.mark.parametrize("bad", ["param-int", "decoupled-grad-list"])
def test_zero_grad_refuses_what_it_cannot_clear_before_clearing_any(bad):
    """S4, S8: a parameter put into a group by hand that is no tensor, or (clearing to
    zero with use_decoupled_grad) a decoupled_grad that is none, is refused by name
    before any gradient is cleared (the first group's were cleared, then a bare
    AttributeError)."""
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(5))
    decoupled = bad == "decoupled-grad-list"
    opt = fused_adam()([a, b], lr=0.1, use_decoupled_grad=decoupled)
    grads = {a: torch.randn(4), b: [1.0] * 5 if decoupled else torch.randn(5)}
    for p, grad in grads.items():
        setattr(p, "decoupled_grad" if decoupled else "grad", grad)
    if decoupled:
        pattern = r"group 0, param 1\b.*decoupled_grad must be a tensor or None, got \[1\.0"
    else:
        opt.param_groups[0]["params"].append(7)
        pattern = r"group 0, param 2\b.*parameters must be tensors, got 7 \(rule S8\)"
    kept = {p: g.clone() if isinstance(g, torch.Tensor) else g for p, g in grads.items()}
    with pytest.raises(TypeError, match=pattern):
        opt.zero_grad(set_to_none=False)
    for p in (a, b):
        now = getattr(p, "decoupled_grad" if decoupled else "grad")
        assert now is grads[p] and (now == kept[p] if decoupled and p is b
                                    else torch.equal(now, kept[p])), p.shape


@pytest.mark.parametrize("call", ["step", "state_dict", "get_unscaled_state"])
@pytest.mark.parametrize("bad", ["float", "list", "entry-int", "meta", "sparse", "freed",
                                 "nested"])
def test_state_put_in_that_holds_no_readable_tensor_is_refused(call, bad):
    """S2.2, S5.1: a state (or a whole entry) put into ``optimizer.state`` from outside
    that is not a dense tensor with values is refused naming the parameter, the state
    and the rule, not with an AttributeError or torch's copy error (and never exported
    as it is); nothing else changes, and initialize_state recreates it."""
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(5))
    opt = fused_adam()([a, b], lr=0.1)
    a.grad, b.grad = torch.randn(4), torch.randn(5)
    opt.step()
    before = snapshot(opt)
    entry = opt.state[b]
    values = {"float": 0.0, "list": [1.0] * 5, "meta": torch.zeros(5, device="meta"),
              "sparse": torch.zeros(5).to_sparse(), "freed": without_storage(entry["exp_avg"])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype
        values["nested"] = torch.nested.nested_tensor([torch.zeros(5)])
    if bad == "entry-int":
        opt.state[b] = 5
        pattern = r"state entry must be a dict of state tensors, got int \(rule S5.1\)"
    else:
        opt.state[b] = dict(entry, exp_avg=values[bad])
        pattern = {"float": r"state 'exp_avg' must be a tensor, got float",
                   "list": r"state 'exp_avg' must be a tensor, got list",
                   "meta": r"state 'exp_avg' is on the meta device",
                   "sparse": r"state 'exp_avg' is a torch.sparse_coo tensor",
                   "freed": r"state 'exp_avg' has a storage of 0 bytes, fewer than its "
                            r"elements span \(20\): its memory was freed",
                   "nested": r"state 'exp_avg' is a nested tensor"}[bad] + ".*S2.2"
    calls = {"step": opt.step, "state_dict": opt.state_dict,
             "get_unscaled_state": lambda: opt.get_unscaled_state(b, "exp_avg")}
    every = ["for every parameter until initialize_state runs for each"] * (bad == "meta")
    with pytest.raises(RuntimeError, match=facts(*at(0, 1), pattern, "initialize_state",
                                                 *every)):
        calls[call]()
    broken = opt.state[b]
    opt.state[b] = entry
    assert_unchanged(opt, before)
    opt.state[b] = broken
    if bad != "entry-int":  # set_scaled_state replaces it (it wrote into freed memory,
        # or failed on it with a bare error after marking the group's moments set)
        opt.set_scaled_state(b, "exp_avg", torch.ones(5))
        assert torch.equal(opt.get_unscaled_state(b, "exp_avg"), torch.ones(5))
    opt.initialize_state(b)
    assert sorted(opt.state[b]) == ["exp_avg", "exp_avg_sq"]
    assert torch.equal(opt.get_unscaled_state(b, "exp_avg"), torch.zeros(5))


def test_a_state_set_to_none_reads_as_cleared():
    """A state set to None reads as one that is not there: the step recreates it (S1.6),
    state_dict() exports what initialisation would hold, get_unscaled_state has none."""
    p = torch.nn.Parameter(torch.randn(5))
    opt = fused_adam()([p], lr=0.1)
    opt.state[p]["exp_avg"] = None
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], torch.zeros(5))
    with pytest.raises(KeyError, match=facts(*at(0, 0), "no state 'exp_avg' yet",
                                             "rule S5.2")):
        opt.get_unscaled_state(p, "exp_avg")


@pytest.mark.parametrize("options", [{}, {"master_weights": True, "moment_format": "block8"}],
                         ids=["fp32", "bf16-master-block8"])
def test_a_state_entry_set_to_none_steps_from_fresh_state(options, backend):
    """S1.6: a whole entry set to None reads as a parameter without state, as for a
    single state: the step creates it and steps as a fresh optimizer would (it was a
    bare AttributeError, where the parameter had a gradient)."""
    dtype = torch.bfloat16 if options else torch.float32
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(4, 256, generator=gen).to(dtype))
    q = torch.nn.Parameter(p.detach().clone())
    p.grad = torch.randn(4, 256, generator=gen).to(dtype)
    q.grad = p.grad.clone()
    opt, fresh = fused_adam()([p], **options), fused_adam()([q], **options)
    opt.state[p] = None
    opt.step()
    fresh.step()
    assert torch.equal(p, q), "the parameter stepped otherwise than a fresh optimizer's"
    for name in fresh.state[q]:
        assert torch.equal(opt.get_unscaled_state(p, name),
                           fresh.get_unscaled_state(q, name)), name


@pytest.mark.parametrize("local, placements, fits", [
    ((2, 4), "S0", True), ((0, 4), "S0", True), ((5, 4), "S0", True), ((6, 4), "S0", False),
    ((2, 3), "S0", False), ((2, 4, 1), "S0", False), ((8,), "S0", False),
    ((5, 2), "S1", True), ((5, 5), "S1", False), ((4, 4), "S1", False),
    ((5, 4), "R", True), ((5, 3), "R", False), ((2, 2), "S0,S1", True),
    ((2, 4), "R,S0", True), ((2, 4), "S0,R", True), ((5, 3), "R,S0", False)])
def test_a_local_tensor_that_is_no_part_of_the_global_shape_is_named(local, placements,
                                                                     fits):
    """S1.4: a DTensor parameter's local tensor has the global tensor's dimensions, each
    as long as the global one where no placement splits it and no longer where one
    does (any run of rows, as Megatron FSDP hands out); anything else would be indexed
    by the global shape past its end (block4's packed rows read the global row)."""
    from torch.distributed.tensor import Replicate, Shard

    kinds = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    chosen = tuple(kinds[k] for k in placements.split(","))
    error = _dtensor._local_shape_error((5, 4), local, chosen)
    if fits:
        assert error is None, error
    else:
        assert error is not None and f"local tensor's shape {list(local)}" in error, error
        assert "global shape [5, 4]" in error and "rule S1.4" in error, error


@pytest.mark.parametrize("junk", [None, 7, [0.0] * 8], ids=["none", "int", "list"])
def test_a_master_put_beside_an_fp32_parameter_by_hand_is_dropped(junk, backend):
    """S2.1, S8: an fp32 parameter has no master; one put into its entry from outside
    that holds no tensor is dropped at the step as a tensor there is (the step failed
    with a bare AttributeError)."""
    p = torch.nn.Parameter(torch.randn(8))
    opt = fused_adam()([p], lr=0.1)
    opt.state[p]["master_param"] = junk
    p.grad = torch.ones(8)
    opt.step()
    assert sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq"]
    assert opt.param_groups[0]["step"] == 1


def test_a_parameter_taken_out_of_every_group_is_not_reseeded(backend):
    """S1.6: a parameter taken out of its group by hand is not stepped; its master,
    which still followed it, is not re-seeded from it either (re-seeded from a value of
    another shape, every later step failed with torch's bare size error), and it loses
    its state while the others step."""
    a = torch.nn.Parameter(torch.randn(3, 6).half())
    b = torch.nn.Parameter(torch.randn(4))
    opt = fused_adam()([a, b], master_weights=True)
    a.data = torch.randn(19).half()
    a.grad = torch.randn(19).half()
    opt.param_groups[0]["params"].remove(a)
    b.grad = torch.ones(4)
    for step in (1, 2):
        before = b.detach().clone()
        opt.step()
        assert not torch.equal(b, before) and a not in opt.state, step


def test_a_parameter_name_that_is_a_tensor_is_shown_without_its_values():
    """S8: a message never shows a tensor's contents, also where a name is expected
    (``param_names`` holding a tensor by mistake)."""
    secret = torch.tensor([3.14159, 2.71828])
    group = {"params": [torch.nn.Parameter(torch.randn(3, dtype=torch.float64))],
             "param_names": [secret]}
    with pytest.raises(RuntimeError) as refused:
        fused_adam()([group])
    message = str(refused.value)
    assert "a tensor of dtype torch.float32 and shape [2]" in message, message
    assert "3.14" not in message and "2.71" not in message, message


def test_lookups_name_what_they_were_given():
    """S5.2, S8: a state name that is not a string, a value that is not a parameter of
    the optimizer: a KeyError naming the value and the rule."""
    p = torch.nn.Parameter(torch.randn(3))
    opt = fused_adam()([p])
    with pytest.raises(KeyError, match=facts(*at(0, 0), r"unknown state name \['exp_avg'\]")):
        opt.get_unscaled_state(p, ["exp_avg"])
    with pytest.raises(KeyError, match=facts("FusedAdam", "'fc.b' is not a parameter of this "
                                             "optimizer", "rule S5.2")):
        opt.get_unscaled_state("fc.b", "exp_avg")


@pytest.mark.parametrize("call", ["zero_grad", "zero_grad-set_grad_none", "initialize_state",
                                  "constructor"])
@pytest.mark.parametrize("value", [torch.ones(3), "False"], ids=["tensor", "string"])
def test_switch_arguments_are_checked(call, value):
    """S1.2's rule for switches also holds for ``zero_grad(set_to_none=)``,
    ``initialize_state(store_param_remainders=)`` and TE's ``set_grad_none``: a bool or
    an int 0/1, not torch's "ambiguous" error, not a string read as true."""
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.ones(3)
    name = {"zero_grad": "set_to_none", "zero_grad-set_grad_none": "set_to_none",
            "initialize_state": "store_param_remainders", "constructor": "set_grad_none"}[call]
    with pytest.raises(ValueError, match=facts("FusedAdam", f"{name} must be a bool")):
        if call == "constructor":
            fused_adam()([p], set_grad_none=value)
        opt = fused_adam()([p], **({"set_grad_none": True} if "set_grad_none" in call else {}))
        if call == "initialize_state":
            opt.initialize_state(p, store_param_remainders=value)
        else:
            opt.zero_grad(set_to_none=value)
    assert torch.equal(p.grad, torch.ones(3))


def test_a_meta_parameters_scaled_state_names_what_helps():
    """A meta parameter's per-tensor scaled state has no scale value (S2.3): refused at
    state_dict() with the step's rule, pointing at materialising the parameters, not at
    initialize_state, which would recreate it on meta."""
    m = torch.nn.Parameter(torch.empty(6, device="meta"))
    opt = fused_adam()([m], exp_avg_dtype=torch.float16)
    with pytest.raises(RuntimeError, match=facts(*at(0, 0), "scale is a meta tensor",
                                                 r"to_empty")) as refused:
        opt.state_dict()
    assert "initialize_state" not in str(refused.value)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("aliased", ["another-param", "own-master"])
@pytest.mark.parametrize("when", ["first-step", "after-add_param_group",
                                  "bound-plan"])
def test_refused_step_leaves_a_following_master_and_its_gradient_alone(backend, aliased,
                                                                       when):
    """S3.1, S3.2: masters that follow their parameters (S1.6) are re-seeded in place
    when the parameter first steps; a step refused for shared memory (a gradient that is
    another parameter's memory, or the master itself) is refused before that, even where
    the whole step is one call (which checks itself only when it runs): the masters'
    bits, and the gradient, stay as they were."""
    if backend == "auto" and not have_core():
        pytest.skip("the C++ core is not built")
    gen = torch.Generator().manual_seed(23)
    p = torch.nn.Parameter(torch.randn(64, generator=gen).bfloat16())
    q = torch.nn.Parameter(torch.randn(64, generator=gen).bfloat16())
    # Decoupled gradients may be fp32 beside bf16 parameters (S3.4): the master's memory.
    kwargs = dict(master_weights=True, use_decoupled_grad=True)
    if when == "after-add_param_group":
        opt = fused_adam()([p], **kwargs)
        opt.add_param_group({"params": [q]})
    else:
        opt = fused_adam()([p, q], **kwargs)
    if when == "bound-plan":  # a step without p's gradient: the plan is bound, p follows
        r = torch.nn.Parameter(torch.randn(64, generator=gen).bfloat16())
        opt.add_param_group({"params": [r]})
        r.decoupled_grad = torch.ones_like(r)
        with backend_context(backend):
            opt.step()
        r.decoupled_grad = None
    with torch.no_grad():
        p.copy_(torch.randn(64, generator=gen).bfloat16())  # weights loaded afterwards
    p.decoupled_grad = torch.ones_like(p)
    if aliased == "another-param":
        q.decoupled_grad = q.detach()
        who = at(1, 0) if when == "after-add_param_group" else at(0, 1)
    else:
        q.decoupled_grad = torch.ones_like(q)
        p.decoupled_grad = opt.state[p]["master_param"]  # the master's own memory
        who = at(0, 0)
    pattern = "(overlaps|shares memory)"
    before = snapshot(opt)
    masters = {name: opt.state[t]["master_param"].clone() for name, t in (("p", p), ("q", q))}
    with backend_context(backend), pytest.raises(ValueError, match=facts(*who, pattern)):
        opt.step()
    assert_unchanged(opt, before, "optimizer after a refused step")
    for name, t in (("p", p), ("q", q)):
        assert_bitwise_equal(opt.state[t]["master_param"], masters[name], f"{name}'s master")
    assert p in opt._seeded and q in opt._seeded


def test_refused_step_leaves_every_groups_state_layout_alone():
    """S3.1, S5.4: a step refused after a setting changed (S1.5) leaves each group's
    recorded state_layout as it was, also of a group that bound its plan before
    another group's check refused the step."""
    a = torch.nn.Parameter(torch.randn(8))
    b = torch.nn.Parameter(torch.randn(8).bfloat16())
    opt = fused_adam()([{"params": [a]}, {"params": [b]}], use_decoupled_grad=True)
    a.decoupled_grad, b.decoupled_grad = torch.ones(8), torch.ones(8).bfloat16()
    opt.step()
    layouts = [g["state_layout"] for g in opt.param_groups]
    opt.master_weights = True
    b.decoupled_grad = b.detach()
    with pytest.raises(ValueError, match=facts(*at(1, 0), "shares memory")):
        opt.step()
    assert [g["state_layout"] for g in opt.param_groups] == layouts
    assert "master_param" not in opt.state[b]


def test_an_empty_non_dict_entry_is_refused_before_anything_converts():
    """S3.1, S8: an entry that is no dict is refused when the plan is built, before a
    setting change converts another parameter's state; falsy ones ([] , 0) too."""
    p, q = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    opt = fused_adam()([p, q])
    p.grad, q.grad = torch.ones(8), torch.ones(8)
    opt.step()
    opt.exp_avg_dtype = torch.bfloat16
    q.grad = None
    for entry in ([], 0, torch.zeros(2)):
        opt.state[q] = entry
        held = opt.state[p]["exp_avg"]
        with pytest.raises(RuntimeError, match=facts(*at(0, 1), "state entry must be a dict")):
            opt.step()
        with pytest.raises(RuntimeError, match=facts(*at(0, 1), "state entry must be a dict")):
            opt.state_dict()
        assert opt.state[p]["exp_avg"] is held and held.dtype == torch.float32
    assert [g["step"] for g in opt.param_groups] == [1]
