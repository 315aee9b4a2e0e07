"""What a steady step re-reads, whatever the number of groups.

A step checks that each group's cached plan still holds (``_plan``): the state
containers are listed once per step for every group's check, not once per group (one
group per parameter would make that O(groups × parameters)); the scales' values are
checked through flat views made once per plan; parameters proved apart when the plan
was bound are not compared again. Timing lives in the bench (the ``groups-2000``
case); these tests pin the structure, and that the shared checks still refuse and
accept what they did.
"""

import pytest
import torch

from shardadam import FusedAdam, _dtensor, _plan, _validate

from _optimizer_testing import assert_unchanged, backend_context, scale_of, snapshot

pytest.importorskip("shardadam._C")

GROUPS = 40


def _groups(count, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(8, 16, generator=gen).to(dtype))
        p.grad = torch.randn(8, 16, generator=gen).to(dtype)
        params.append(p)
    return params


FP8 = dict(master_weights=True, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)


def test_a_step_lists_each_state_container_once(monkeypatch):
    params = _groups(GROUPS)
    opt = FusedAdam([{"params": [p]} for p in params], lr=1e-3, **FP8)
    opt.step()  # plans built and bound
    listed = []
    original = _plan.Listing.of

    def counting(self, container):
        if id(container) not in self._lists:
            listed.append(id(container))
        return original(self, container)

    monkeypatch.setattr(_plan.Listing, "of", counting)
    for _ in range(3):
        listed.clear()
        opt.step()
        # optimizer.state and optimizer._scales (fp8 moments have scales), once each.
        assert sorted(listed) == sorted({id(opt.state), id(opt._scales)}), len(listed)


def test_a_container_changed_between_steps_is_still_seen():
    """The listing lives for one step's checks only: an entry replaced between steps
    still rebuilds the plan (the replaced tensor is then the state that steps)."""
    params = _groups(GROUPS)
    opt = FusedAdam([{"params": [p]} for p in params], lr=1e-3)
    opt.step()
    target = params[GROUPS // 2]
    replacement = torch.zeros_like(opt.state[target]["exp_avg"])
    opt.state[target]["exp_avg"] = replacement
    opt.step()
    assert opt.state[target]["exp_avg"] is replacement
    assert torch.count_nonzero(replacement) > 0  # stepped: (1 - beta1) * grad


def test_a_bad_scale_of_a_parameter_that_steps_is_refused_and_nothing_changes():
    params = _groups(GROUPS)
    opt = FusedAdam([{"params": [p]} for p in params], lr=1e-3, **FP8)
    opt.step()
    scale_of(opt, params[3], "exp_avg").fill_(float("nan"))
    before = snapshot(opt)
    with pytest.raises(ValueError, match="exp_avg_scale"):
        opt.step()
    assert_unchanged(opt, before, "after the refused step")


def test_a_bad_scale_of_a_parameter_without_gradient_does_not_stop_the_step():
    """The core reads only the tensors that step: a parameter without a gradient is
    not read, so its scale's value refuses nothing (the shared check of every scale
    of the plan then falls back to the core's check of the calls)."""
    params = _groups(GROUPS)
    opt = FusedAdam([{"params": [p]} for p in params], lr=1e-3, **FP8)
    opt.step()
    idle = params[3]
    idle.grad = None
    opt.step()  # the same gradients from here on: the checks that passed stand
    scale_of(opt, idle, "exp_avg").fill_(float("nan"))
    idle_before = idle.detach().clone()
    stepping_before = params[4].detach().clone()
    opt.step()
    assert torch.equal(idle.detach().view(torch.int16), idle_before.view(torch.int16))
    assert not torch.equal(params[4].detach(), stepping_before)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_interleaved_parameters_are_not_compared_byte_by_byte_at_every_step(
        monkeypatch, backend):
    """Two parameters that interleave in one matrix (its even and odd columns) were
    proved apart when the plan was bound; a later step compares only gradients with
    the memory it writes, so their bytes are not compared again (a byte comparison
    waits for the device on a GPU). A gradient in a parameter's memory is still
    refused at every step (test_optimizer_errors)."""
    matrix = torch.randn(6, 8)
    params = [torch.nn.Parameter(matrix[:, 0::2]), torch.nn.Parameter(matrix[:, 1::2])]
    opt = FusedAdam(params, lr=1e-3)
    compared = []
    original = _validate.share_bytes

    def counting(a, b):
        compared.append((a.data_ptr(), b.data_ptr()))
        return original(a, b)

    with backend_context(backend):
        for p in params:
            p.grad = torch.ones(6, 4)
        opt.step()  # binds: the parameters are compared here
        monkeypatch.setattr(_validate, "share_bytes", counting)
        for _ in range(2):
            opt.step()
    assert compared == []


def _plan_ids(opt):
    return [id(plan) if plan is not None else None for plan in opt._plans]


@pytest.mark.parametrize("change", ["initialize_state", "add_param_group"])
def test_a_new_state_rebuilds_only_its_own_groups_plan(monkeypatch, change):
    """initialize_state and add_param_group drop the plans that hold the parameter
    (they bound its old storage), not every group's; the next step then binds without
    writing, so the pre-binding check of every gradient is left to the calls' own
    checks. The results are those of an optimizer whose plans were all rebuilt."""
    params, twin_params = _groups(GROUPS, torch.float32), _groups(GROUPS, torch.float32)
    opt, twin = (FusedAdam([{"params": [p]} for p in ps], lr=1e-3)
                 for ps in (params, twin_params))
    opt.step()
    twin.step()
    kept = _plan_ids(opt)
    extra = [torch.nn.Parameter(torch.ones(8, 16)) for _ in range(2)]
    if change == "initialize_state":
        opt.initialize_state(params[5])
        twin.initialize_state(twin_params[5])
        rebuilt = {5}
    else:
        opt.add_param_group({"params": [extra[0]]})
        twin.add_param_group({"params": [extra[1]]})
        rebuilt = set()
    twin._plans = []  # every group's plan rebuilt and bound again
    assert [i for i, plan in enumerate(_plan_ids(opt)[:GROUPS]) if plan != kept[i]] \
        == sorted(rebuilt)
    calls = []
    monkeypatch.setattr("shardadam._backend.check_before_binding",
                        lambda *args: calls.append(args))
    opt.step()
    assert calls == []  # nothing written by binding: nothing to check before it
    monkeypatch.undo()
    twin.step()
    assert [i for i, plan in enumerate(_plan_ids(opt)[:GROUPS]) if plan != kept[i]] \
        == sorted(rebuilt)
    for p, q in zip(params + extra[:1], twin_params + extra[1:]):
        assert torch.equal(p.detach().view(torch.int32), q.detach().view(torch.int32))


def test_a_gradient_in_another_groups_state_is_refused_after_a_new_group():
    """The plans kept after add_param_group still meet the step's check of every call
    together: a gradient reading another group's state is refused, nothing changed."""
    params = _groups(GROUPS, torch.float32)
    opt = FusedAdam([{"params": [p]} for p in params], lr=1e-3)
    opt.step()
    extra = torch.nn.Parameter(torch.ones(8, 16))
    extra.grad = torch.ones(8, 16)
    opt.add_param_group({"params": [extra]})
    params[3].grad = opt.state[params[7]]["exp_avg"]
    before = [t.clone() for t in params + [extra]]
    before += [t.clone() for p in params + [extra] for t in opt.state[p].values()]
    with pytest.raises(ValueError, match=r"(?=.*group 3)(?=.*group 7).*exp_avg.*share"):
        opt.step()
    after = params + [extra] + [t for p in params + [extra] for t in opt.state[p].values()]
    assert all(torch.equal(a.detach().view(torch.int32), b.view(torch.int32))
               for a, b in zip(after, before))
    assert [g["step"] for g in opt.param_groups] == [1] * GROUPS + [0]


@pytest.mark.parametrize("how", ["replaced", "restrided"])
def test_state_that_is_not_contiguous_is_read_by_value(how):
    """A state tensor is read by its logical values, whatever its strides: one put in
    from outside that is not contiguous ("replaced"), or one whose strides changed in
    place (``as_strided_``: same memory, same shape, so only the strides tell the plan
    it changed, "restrided"), steps as a contiguous tensor of the same values does."""
    runs = []
    for variant in (how, "contiguous"):
        gen = torch.Generator().manual_seed(4)
        param = torch.nn.Parameter(torch.randn(4, 4, generator=gen))
        opt = FusedAdam([param], lr=0.1)
        param.grad = torch.randn(4, 4, generator=gen)
        opt.step()
        held = opt.state[param]["exp_avg"]
        transposed = held.t().contiguous()  # the values the variants hold
        if variant == "replaced":
            opt.state[param]["exp_avg"] = transposed.t().contiguous().t()
            assert not opt.state[param]["exp_avg"].is_contiguous()
        elif variant == "restrided":
            held.as_strided_((4, 4), (1, 4))  # held now reads as its transpose
        else:
            opt.state[param]["exp_avg"] = transposed
        assert torch.equal(opt.state[param]["exp_avg"], transposed)
        param.grad = torch.randn(4, 4, generator=gen)
        opt.step()
        runs.append((param.detach().clone(), opt.state[param]["exp_avg"].clone()))
    (p0, m0), (p1, m1) = runs
    assert torch.equal(p0.view(torch.int32), p1.view(torch.int32))
    assert torch.equal(m0.view(torch.int32), m1.view(torch.int32))


def test_a_strided_gradient_viewing_state_steps_from_a_copy_at_a_converting_step():
    """A gradient that is not contiguous is read through a copy taken before anything is
    updated (S3.2), so one viewing another parameter's state is accepted, also at a
    step that converts state first (S1.5: its gradients are checked before the
    conversion), and steps as that copy would."""
    runs = []
    for copied in (False, True):
        gen = torch.Generator().manual_seed(5)
        a = torch.nn.Parameter(torch.randn(8, generator=gen))
        b = torch.nn.Parameter(torch.randn(4, generator=gen))
        opt = FusedAdam([a, b], lr=0.1)
        opt.state[a]["exp_avg"].copy_(torch.randn(8, generator=gen))
        opt.exp_avg_sq_dtype = torch.bfloat16  # converted when this step binds
        a.grad = torch.randn(8, generator=gen)
        view = opt.state[a]["exp_avg"][::2]
        b.grad = view.clone() if copied else view
        opt.step()
        runs.append([t.detach().clone() for t in (a, b, opt.state[a]["exp_avg"],
                                                    opt.state[b]["exp_avg"])])
    for x, y in zip(*runs):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))


# Changes made between steps to an optimizer whose plans are all current: each one that
# a group's own check (GroupPlan.is_current) notices must make the check of every plan at
# once (PlanSet) fail too, and the rest leave it passing.
def _swap_param(opt, params):
    opt.param_groups[2]["params"][0] = torch.nn.Parameter(params[2].detach().clone())


def _new_state_dict(opt, params):
    opt.state[params[1]] = dict(opt.state[params[1]])


def _config(opt, params):
    opt.exp_avg_sq_dtype = torch.bfloat16


CHANGES = {
    "nothing": lambda opt, params: None,
    "a new params list, same tensors": lambda opt, params: opt.param_groups[1].update(
        params=list(opt.param_groups[1]["params"])),
    "a new param_groups list, same groups": lambda opt, params: setattr(
        opt, "param_groups", list(opt.param_groups)),
    "param.data replaced": lambda opt, params: setattr(
        params[3], "data", params[3].detach().clone()),
    "param shrunk in place": lambda opt, params: setattr(
        params[3], "data", params[3].data.view(-1)[:8]),
    "param as another dtype": lambda opt, params: setattr(
        params[0], "data", params[0].data.view(torch.float16)),
    "param lazily negated": lambda opt, params: setattr(
        params[0], "data", params[0].data._neg_view()),
    "param swapped for another": _swap_param,
    "params reordered": lambda opt, params: opt.param_groups[4]["params"].reverse(),
    "a param appended": lambda opt, params: opt.param_groups[4]["params"].append(
        torch.nn.Parameter(torch.ones(3))),
    "a group replaced by its copy": lambda opt, params: opt.param_groups.__setitem__(
        1, dict(opt.param_groups[1])),
    "a group removed": lambda opt, params: opt.param_groups.pop(),
    "a group added": lambda opt, params: opt.add_param_group(
        {"params": [torch.nn.Parameter(torch.ones(3))]}),
    "a state replaced": lambda opt, params: opt.state[params[5]].update(
        exp_avg=opt.state[params[5]]["exp_avg"].clone()),
    "a state's memory shared": lambda opt, params: opt.state[params[5]][
        "exp_avg_sq"].share_memory_(),
    "a state set_ to a copy": lambda opt, params: opt.state[params[5]]["master_param"].set_(
        opt.state[params[5]]["master_param"].detach().clone()),
    "a state restrided": lambda opt, params: opt.state[params[1]]["master_param"]
        .as_strided_((16, 8), (1, 16)),
    "a state as another dtype": lambda opt, params: setattr(
        opt.state[params[5]]["master_param"], "data",
        opt.state[params[5]]["master_param"].data.view(torch.int32)),
    "a state lazily negated": lambda opt, params: setattr(
        opt.state[params[5]]["master_param"], "data",
        opt.state[params[5]]["master_param"].data._neg_view()),
    "a state deleted": lambda opt, params: opt.state[params[1]].pop("exp_avg"),
    "a parameter's state dict replaced": _new_state_dict,
    "a parameter's state removed": lambda opt, params: opt.state.pop(params[6]),
    "a scale replaced": lambda opt, params: opt._scales[params[4]].update(
        exp_avg=opt._scales[params[4]]["exp_avg"].clone()),
    "a scale's memory moved": lambda opt, params: setattr(
        opt._scales[params[4]]["exp_avg_sq"], "data",
        opt._scales[params[4]]["exp_avg_sq"].detach().clone()),
    "a setting changed": _config,
}


# The changes after which every plan is still current (the same tensors, found anew).
CURRENT = ("nothing", "a new params list, same tensors",
           "a new param_groups list, same groups", "a parameter's state dict replaced")


def _every_plan_current(opt, config) -> bool:
    listing = _plan.Listing()
    groups, plans = opt.param_groups, opt._plans
    return len(plans) >= len(groups) and all(
        plan is not None and plan.is_current(group, config, opt.state, opt._scales,
                                             opt._formats, listing)
        for group, plan in zip(groups, plans))


@pytest.mark.parametrize("change", list(CHANGES))
def test_checking_every_plan_at_once_answers_as_each_plans_own_check(change):
    """After two steps every group's plan passed its own check, and the step checks them
    all as one from then on (``_plan.PlanSet``: thousands of groups cost ~10 µs each to
    check one by one). For each change between steps, that check says what the groups'
    own checks say, and the next step then steps as an optimizer that has its plans
    rebuilt (or refuses as it does)."""
    runs = []
    for rebuilt in (False, True):
        gen = torch.Generator().manual_seed(6)
        params = [torch.nn.Parameter(torch.randn(8, 16, generator=gen).bfloat16())
                  for _ in range(8)]
        groups = [[params[0]], [params[1]], [params[2], params[3]], [params[4]],
                  [params[5], params[6]], [params[7]]]
        opt = FusedAdam([{"params": g} for g in groups], lr=1e-2, **FP8)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(8, 16, generator=gen).bfloat16()
            opt.step()
        assert opt._plan_set is not None
        CHANGES[change](opt, params)
        config = opt._config()
        # add_param_group drops it with the plans of the parameters it gives state.
        at_once = opt._plan_set is not None and opt._plan_set.is_current(
            opt.param_groups, opt._plans, config, opt.state, opt._scales, opt._formats,
            _plan.Listing())
        each = _every_plan_current(opt, config)
        assert at_once == (change in CURRENT)
        # Never current where a plan is not; one fewer group is only checked again.
        assert at_once == each or (not at_once and change == "a group removed")
        if rebuilt:
            opt._plans, opt._plan_set = [], None
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        try:
            opt.step()
            outcome = None
        except (RuntimeError, ValueError) as error:
            outcome = str(error)
        runs.append((outcome, [t.detach().clone() for g in opt.param_groups
                               for p in g["params"]
                               for t in [p] + list(opt.state.get(p, {}).values())]))
    (outcome, tensors), (expected_outcome, expected) = runs
    assert outcome == expected_outcome
    assert len(tensors) == len(expected)
    for a, b in zip(tensors, expected):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_parameter_given_another_shape_over_the_same_memory_is_seen(backend):
    """A parameter viewed with another shape that keeps its first address, element count
    and strides (``buf[:6].view(2, 3)`` made ``buf.view(3, 3)[:, :2]``) is another
    parameter to its state: refused as a fresh plan refuses it (S2.6), and nothing else
    in the buffer written (a cached plan stepped the old shape's elements)."""
    from _optimizer_testing import backend_context
    with backend_context(backend):
        buf = torch.zeros(9)
        param = torch.nn.Parameter(buf[:6].view(2, 3))
        opt = FusedAdam([param], lr=1e-2)
        for _ in range(3):
            param.grad = torch.ones(2, 3)
            opt.step()
        param.data = buf.view(3, 3)[:, :2]
        assert param.data_ptr() == buf.data_ptr() and param.stride() == (3, 1)
        param.grad = torch.ones(3, 2)
        before = buf.clone()
        with pytest.raises(RuntimeError, match=r"local shape \(2, 3\).*\(3, 2\).*S2\.6"):
            opt.step()
        assert torch.equal(buf, before)


def test_storage_keys_read_a_plain_tensor_itself_whatever_its_attributes():
    """The plan checks' keys of a parameter list that is not known to be plain (a DTensor
    group's, or every group's at once beside one) read a plain tensor's own storage, even
    when it carries a ``_local_tensor`` attribute (DTensor's local part): read through
    it, ``p.data = ...`` went unseen and the step wrote the old storage."""
    p = torch.nn.Parameter(torch.zeros(4))
    p._local_tensor = torch.ones(8)
    q = torch.nn.Parameter(torch.zeros(3))
    assert _dtensor.local_storage_keys([p, q], False) == _dtensor.local_storage_keys(
        [p, q], True)
    assert _dtensor.local_storage_keys([p], False)[0][:2] == (p.data_ptr(), (4,))
