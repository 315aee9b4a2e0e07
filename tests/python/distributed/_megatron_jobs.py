"""Megatron FSDP cases, as run on every rank (dispatched from ``_dist_jobs.KINDS``).

``megatron_layout``: every state preset on Megatron FSDP's flat-buffer layout
(``_megatron_layout``) for each mesh kind: bitwise equal to one process over the full
tensors (scaled states within one rounding, as for FSDP2), bitwise equal to a plain
FusedAdam on this rank's local shards, updates in the flat buffer, padding untouched.

``megatron_fsdp_save`` / ``megatron_fsdp_resume``: the optimizer driven by the real
``megatron_fsdp`` package's optimizer code on that layout (``fully_shard_optimizer``: its
init step, its wrapped ``step()`` / ``zero_grad()``, its ``state_dict`` post-hook for
uneven DTensors), after ``fully_shard``'s parameter-group clear / re-add; saved with DCP
at world size 2 and loaded at 3 and 4, then trained on: bitwise the uninterrupted run.

``megatron_real_save`` / ``megatron_real_resume``: ``megatron_fsdp.fully_shard`` itself
(``_megatron_cpu``) with FusedAdam, against one process over the full tensors, and its
DCP checkpoint resumed at 3 and 4 ranks.

``megatron_handling``: what Megatron does to an optimizer beyond stepping it (keys
written into ``optimizer.state[p]`` from outside, groups cleared and re-added) on a world
size where one rank owns nothing; ``megatron_error``: bad gradients and meshes on this
layout; ``state_layout_mismatch``: a DCP checkpoint loaded into an optimizer with the
other ``store_param_remainders``.
"""

import os

import torch
import torch.distributed as dist

import _dist_cases
from _dist_helpers import (
    OPT_DEFAULTS, PlainReference, Preset, assert_bitwise, assert_snapshots_bitwise,
    compare_full, fused_adam, local_of, local_snapshot, raw_state, same_on_all_ranks,
    seed_of, symmetric)
from _dist_jobs import (
    STEPS, _attempt, _check_initial_state, _check_rejection, _fresh_references,
    _train_and_check)
from _megatron_layout import SPECS, MegatronRun
from _optimizer_testing import merge_remainder


def layout_run(ctx, case, **kwargs):
    """A ``MegatronRun`` for the case: fp32 parameters read bf16 ``decoupled_grad`` and
    bf16 ones fp32 ``decoupled_grad`` (Megatron's main grads) on the sharded kinds; the
    parameter's own dtype through ``.grad`` on the replicated ones."""
    preset = Preset(case.preset)
    kind = case.detail.split("|")[0]  # "kind" or "kind|what"
    if kind in ("dp", "hfsdp"):
        import torch

        other = torch.bfloat16 if preset.param_dtype == torch.float32 else torch.float32
        kwargs.setdefault("grad_dtype", other)
        kwargs.setdefault("decoupled", True)
    else:
        kwargs.setdefault("decoupled", False)
    return MegatronRun(ctx, preset, kind, case.id, **kwargs)


def megatron_layout(ctx, case):
    run = layout_run(ctx, case)
    full_ref, local_ref = _fresh_references(run)
    before = _check_initial_state(run, full_ref)
    _train_and_check(run, range(1, STEPS + 1), full_ref=full_ref, local_ref=local_ref,
                     before=before, none_on_empty=True)
    run.check_buffers(f"after {STEPS} steps")


# ---------------------------------------------------------------- the real megatron_fsdp

STEPS_BEFORE, STEPS_AFTER = 2, 2


class _ModelStandIn:
    """What ``fully_shard_optimizer`` reads from ``param._megatron_fsdp_model`` (a
    ``MegatronFSDP`` module): gradients already reduced (``model_auto_sync``), the
    main -> compute weight copy after ``step()``, and the gradient buffer reset in
    ``zero_grad()``. ``fully_shard_model`` itself needs CUDA (README: Megatron FSDP)."""

    model_auto_sync = True

    def __init__(self, run):
        self.run = run
        self.compute = run.buffer.to(torch.bfloat16)  # Megatron's bf16 compute weights
        self.installs = 0

    def finish_grad_sync(self):
        raise AssertionError("not called while model_auto_sync is set")

    def install_optimized_model_weights(self):
        self.compute.copy_(self.run.buffer)
        self.installs += 1

    def zero_grad_buffer(self):
        for buffer in self.run.grad_buffers:
            buffer.zero_()


def _megatron_run(ctx, preset, **kwargs):
    """A MegatronRun handed to Megatron FSDP's optimizer code as ``fully_shard`` does."""
    from megatron_fsdp.fully_shard import fully_shard_optimizer

    run = MegatronRun(ctx, preset, "dp", f"megatron-fsdp-{preset.id}", **kwargs)
    model = _ModelStandIn(run)
    for p in run.params.values():
        p._megatron_fsdp_model = model
    # fully_shard(): clear and re-add the groups on an optimizer built earlier.
    groups = run.groups(run.params)
    run.opt.param_groups.clear()
    run.opt.state.clear()
    for group in groups:
        run.opt.add_param_group(group)
    fully_shard_optimizer(run.opt)  # one step on zero .grad, its state_dict post-hook
    return run, model


def _set_outside_steps(run, value):
    """Megatron-LM's version of the init step then resets a "step" of each parameter's
    own in optimizer.state (0.6.1 does not): a key of someone else's, which DCP must
    carry. Set around the checkpoint only: the comparisons check the states alone."""
    for p in run.params.values():
        run.opt.state[p]["step"] = torch.tensor(value)


def _references_after_init(run):
    """Full and local references that took fully_shard_optimizer's init step too: with
    decoupled gradients it reads no gradient (every parameter skipped, S3.2) and only
    moves the step counters."""
    full_ref, local_ref = _fresh_references(run)
    for ref in (full_ref, local_ref):
        if ref is not None:
            ref.step({}, skip=set(ref.names))
    return full_ref, local_ref


def _uneven(state_dict):
    """Megatron FSDP's preparation of uneven DTensors for DCP (each local tensor's
    chunk offsets; DCP's own assume torch's chunking)."""
    from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    return preprocess_state_dict_for_uneven_dtensor(state_dict)


def _model_state_dict(run):
    return _uneven(dict(run.params))


def _checkpoint(ctx, preset):
    return _dist_cases.checkpoint_dir(ctx.params["shared_dir"], "megatron-fsdp", preset.id, 2)


def megatron_fsdp_save(ctx, case):
    preset = Preset(case.preset)
    run, model = _megatron_run(ctx, preset)
    full_ref, local_ref = _references_after_init(run)
    before = run.gather()
    same_on_all_ranks(before["steps"], "group steps after the init step")
    assert before["steps"] == [1, 1], f"init step left group steps {before['steps']}"
    before = _train_and_check(run, range(1, STEPS_BEFORE + 1), full_ref=full_ref,
                              local_ref=local_ref, before=before)
    path = _checkpoint(ctx, preset)
    _set_outside_steps(run, 0.0)
    dcp_save({"model": _model_state_dict(run), "optim": run.opt.state_dict()}, path)
    for p in run.params.values():
        del run.opt.state[p]["step"]
    steps = range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1)
    final = _train_and_check(run, steps, full_ref=full_ref, local_ref=local_ref,
                             before=before)
    run.check_buffers("after training")
    assert model.installs == STEPS_BEFORE + STEPS_AFTER, \
        f"Megatron's step() installed the weights {model.installs} times"
    assert_bitwise(model.compute, run.buffer.to(torch.bfloat16), "compute weights")
    if ctx.rank == 0:
        torch.save({"saved": before, "final": final}, os.path.join(path, "gathered.pt"))
    dist.barrier()


def dcp_save(state_dict, path):
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dict, checkpoint_id=path)


def megatron_fsdp_resume(ctx, case):
    """Load the world-size-2 checkpoint here (other packing, other rows per rank) through
    Megatron's hooks, then train on: bitwise the uninterrupted run for exact presets."""
    import torch.distributed.checkpoint as dcp

    preset = Preset(case.preset)
    path = _checkpoint(ctx, preset)
    expected = os.path.join(path, "gathered.pt")
    assert os.path.exists(expected), f"no checkpoint at {path}: its save case failed"
    gathered = torch.load(expected)
    zeros = {s.name: torch.zeros(s.shape, dtype=preset.param_dtype) for s in SPECS}
    run, _ = _megatron_run(ctx, preset, full_params=zeros)
    _set_outside_steps(run, -1.0)  # what DCP must overwrite
    target = {"model": _model_state_dict(run), "optim": run.opt.state_dict()}
    dcp.load(target, checkpoint_id=path)
    run.opt.load_state_dict(target["optim"])
    for name, p in run.params.items():
        assert_bitwise(run.opt.state[p]["step"], torch.tensor(0.0), f"{name}'s own step")
        del run.opt.state[p]["step"]  # gather() checks the states alone
    loaded = run.gather()
    symmetric(compare_full, run, loaded, gathered["saved"], "right after loading")
    exact = not preset.has_scaled_state
    full_ref = None
    if exact:
        full_ref = PlainReference(run, gathered["saved"]["params"], run.opt_kwargs)
        full_ref.load(gathered["saved"])
    local_ref = PlainReference(run, {n: local_of(p) for n, p in run.params.items()},
                               run.opt_kwargs)
    local_ref.load(local_snapshot(run))
    local_ref.copy_raw_from(run)
    steps = range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1)
    final = _train_and_check(run, steps, full_ref=full_ref, local_ref=local_ref,
                             before=loaded)
    if exact:
        symmetric(compare_full, run, final, gathered["final"], "the uninterrupted run")
    run.check_buffers("after the resumed steps")


# -------------------------------------------------- megatron_fsdp.fully_shard, end to end

REAL_MOMENTS = {"m=fp32": torch.float32, "m=bf16": torch.bfloat16}


class _RealRun:
    """``megatron_fsdp.fully_shard`` of a stack of Linear layers (two by default) with
    FusedAdam built before it, on a (W, 1) mesh (``_megatron_cpu``). Every step runs
    Megatron's forward, backward and gradient reduction, then the test writes its own
    gradient values into Megatron's gradient tensors (the same at every world size, so
    runs at different sizes stay comparable bitwise) and calls Megatron's wrapped
    ``step()`` / ``zero_grad()``."""

    def __init__(self, ctx, moments, seed, *, layers=((8, 6, True), (6, 3, True)),
                 opt_kwargs=None, grad=None):
        """``layers``: (in, out, bias) of each ``nn.Linear``; ``opt_kwargs``: FusedAdam's
        moment keywords (default: ``REAL_MOMENTS[moments]`` for both moments); ``grad``:
        ``(name, shape, step) -> full gradient`` (default ``_real_grad``)."""
        from megatron_fsdp import fully_shard
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh

        self.ctx = ctx
        self.in_features = layers[0][0]
        torch.manual_seed(seed)
        model = nn.Sequential(*(nn.Linear(i, o, bias=b) for i, o, b in layers))
        if opt_kwargs is None:
            dtype = REAL_MOMENTS[moments]
            opt_kwargs = dict(exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
        self.opt_kwargs = dict(opt_kwargs)
        self.grad = grad or _real_grad
        opt = fused_adam()(model.parameters(), **OPT_DEFAULTS, **self.opt_kwargs)
        mesh = init_device_mesh("cpu", (ctx.world_size, 1), mesh_dim_names=("dp", "tp"))
        self.model, self.opt = fully_shard(
            model, opt, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp",
            fsdp_unit_modules=[nn.Linear], zero_dp_strategy=3, device=torch.device("cpu"))
        assert self.opt is opt, "fully_shard returned another optimizer"
        named = {id(p): n for n, p in self.model.param_and_grad_buffer.optimizer_named_parameters}
        self.params = self.opt.param_groups[0]["params"]
        self.names = [named[id(p)] for p in self.params]
        self.offsets = [_row_offset(p) for p in self.params]

    def train(self, steps):
        x = torch.randn(4, self.in_features, generator=torch.Generator().manual_seed(7))
        for step in steps:
            self.model(x).pow(2).mean().backward()
            for name, p, offset in zip(self.names, self.params, self.offsets):
                grad, local = p.grad, p._local_tensor
                assert (grad is None) == (local.numel() == 0), \
                    f"{name}: Megatron's gradient is {grad} on a local shard of {local.numel()}"
                if grad is not None:
                    full = self.grad(name, p.shape, step)
                    grad._local_tensor.copy_(full[offset:offset + local.shape[0]])
            self.opt.step()
            self.opt.zero_grad()

    def gather(self):
        """Full parameters and state_dict() values, assembled from every rank's rows."""
        sd = self.opt.state_dict()
        mine = {}
        for i, (name, p, offset) in enumerate(zip(self.names, self.params, self.offsets)):
            mine[name] = (offset, p._local_tensor.detach().clone())
            for key in ("exp_avg", "exp_avg_sq"):
                mine[f"{name}.{key}"] = (offset, sd["state"][i][key]._local_tensor.clone())
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        out = {"steps": [g["step"] for g in sd["param_groups"]]}
        for key in mine:
            shape = self.params[self.names.index(key.split(".exp")[0])].shape
            full = torch.full(shape, float("nan"))
            for part in per_rank:
                offset, local = part[key]
                full[offset:offset + local.shape[0]] = local
            out[key] = full
        return out


def _row_offset(param):
    """The first global row of this rank's shard (Megatron's own chunk metadata)."""
    from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata

    return gather_and_compute_chunk_metadata(param).offsets[0]


def _real_grad(name, shape, step):
    g = torch.Generator().manual_seed(seed_of("megatron-real-grad", name, step))
    return torch.randn(shape, generator=g)


def _same_snapshot(actual, expected, what):
    assert actual["steps"] == expected["steps"], \
        f"{what}: group steps {actual['steps']} != {expected['steps']}"
    for key, value in expected.items():
        if key != "steps":
            assert_bitwise(actual[key], value, f"{what}: {key}")


def _real_reference(run, snapshot):
    """The same FusedAdam on the full tensors, starting from ``snapshot``."""
    from torch import nn

    params = [nn.Parameter(snapshot[n].clone()) for n in run.names]
    ref = fused_adam()(params, **{k: v for k, v in run.opt.defaults.items()
                                  if k in OPT_DEFAULTS}, **run.opt_kwargs)
    sd = ref.state_dict()
    for i, n in enumerate(run.names):
        sd["state"][i] = {k: snapshot[f"{n}.{k}"].clone() for k in ("exp_avg", "exp_avg_sq")}
    sd["param_groups"][0]["step"] = snapshot["steps"][0]
    ref.load_state_dict(sd)
    return ref, params


def _real_train_and_check(run, steps, snapshot):
    """Train ``steps`` through Megatron, after each compared with the full-tensor
    FusedAdam fed the same gradients: bitwise."""
    ref, params = _real_reference(run, snapshot)
    for step in steps:
        run.train([step])
        for name, p in zip(run.names, params):
            p.grad = run.grad(name, p.shape, step)
        ref.step()
        got = run.gather()
        expected = {"steps": [g["step"] for g in ref.param_groups]}
        sd = ref.state_dict()
        for i, (name, p) in enumerate(zip(run.names, params)):
            expected[name] = p.detach()
            for key in ("exp_avg", "exp_avg_sq"):
                expected[f"{name}.{key}"] = sd["state"][i][key]
        _same_snapshot(got, expected, f"after step {step}, against one process")
    return got


def _real_checkpoint(ctx, case):
    return _dist_cases.checkpoint_dir(ctx.params["shared_dir"], "megatron-fully-shard",
                                      case.detail, 2)


def megatron_real_save(ctx, case):
    """fully_shard at world size 2: train against the full-tensor run, save with DCP
    (model and optimizer, Megatron's hooks), train on: the uninterrupted run."""
    import torch.distributed.checkpoint as dcp

    from _megatron_cpu import megatron_on_cpu

    with megatron_on_cpu():
        run = _RealRun(ctx, case.detail, seed=0)
        start = run.gather()
        assert start["steps"] == [1], f"fully_shard_optimizer's init step: {start['steps']}"
        saved = _real_train_and_check(run, range(1, STEPS_BEFORE + 1), start)
        path = _real_checkpoint(ctx, case)
        dcp.save({"model": run.model.state_dict(), "optim": run.opt.state_dict()},
                 checkpoint_id=path)
        steps = range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1)
        final = _real_train_and_check(run, steps, saved)
    if ctx.rank == 0:
        torch.save({"saved": saved, "final": final}, os.path.join(path, "gathered.pt"))
    dist.barrier()


def megatron_real_resume(ctx, case):
    """fully_shard at world size 3 or 4 from another initialisation, DCP load of the
    size-2 checkpoint (Megatron's README recipe), then training: bitwise the uninterrupted
    run, parameters, moments and step."""
    import torch.distributed.checkpoint as dcp

    from _megatron_cpu import megatron_on_cpu

    path = _real_checkpoint(ctx, case)
    expected = os.path.join(path, "gathered.pt")
    assert os.path.exists(expected), f"no checkpoint at {path}: its save case failed"
    gathered = torch.load(expected)
    with megatron_on_cpu():
        run = _RealRun(ctx, case.detail, seed=1)
        template = {"model": run.model.state_dict(), "optim": run.opt.state_dict()}
        dcp.load(template, checkpoint_id=path)
        run.model.load_state_dict(template["model"], strict=False)
        run.opt.load_state_dict(template["optim"])
        loaded = run.gather()
        symmetric(_same_snapshot, loaded, gathered["saved"], "right after loading")
        steps = range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1)
        final = _real_train_and_check(run, steps, loaded)
    symmetric(_same_snapshot, final, gathered["final"], "against the uninterrupted run")


# ------------------------------------------------------------ what Megatron does besides


def megatron_handling(ctx, case):
    """Keys written into optimizer.state[p] from outside (Megatron's "step"), groups
    cleared and re-added: stepping, state_dict() and load_state_dict() carry on, every
    rank holds the same state keys and group steps, the rank that owns nothing included."""
    preset = Preset(case.preset)
    run = layout_run(ctx, case)
    local_ref = PlainReference(run, {n: local_of(p) for n, p in run.params.items()},
                               run.opt_kwargs)
    grads = run.full_grads(1)
    run.set_grads(grads)
    run.step()
    local_ref.step(run.local_grads(grads))
    names = run.ordered_names()
    for i, name in enumerate(names):  # as Megatron's optimizer code resets it
        run.opt.state[run.params[name]]["step"] = torch.tensor(float(i))

    def keys():
        sd = run.opt.state_dict()
        return ([sorted(run.opt.state[run.params[n]]) for n in names],
                [sorted(sd["state"][i]) for i in range(len(names))],
                [g["step"] for g in sd["param_groups"]])

    per_rank = symmetric(keys)
    assert all(k == per_rank[0] for k in per_rank), f"state keys differ by rank: {per_rank}"
    assert all("step" in k for k in per_rank[0][1]), f"'step' not exported: {per_rank[0]}"
    sd = run.opt.state_dict()
    for i, name in enumerate(names):
        assert_bitwise(sd["state"][i]["step"], torch.tensor(float(i)), f"{name} step")
    # A second optimizer loads it: the outside key comes back, a copy.
    twin = MegatronRun(ctx, preset, case.detail, case.id, grad_dtype=run.grad_dtype,
                       decoupled=run.grad_attr == "decoupled_grad")
    twin.opt.load_state_dict(sd)
    for i, name in enumerate(names):
        kept = twin.opt.state[twin.params[name]]["step"]
        assert_bitwise(kept, torch.tensor(float(i)), f"loaded {name} step")
        assert kept is not sd["state"][i]["step"], "the loaded step aliases the state dict"
    # Steps go on with the outside key in place, as without it.
    grads = run.full_grads(2)
    run.set_grads(grads)
    run.step()
    local_ref.step(run.local_grads(grads))
    symmetric(_same_but_step, local_snapshot(run), local_ref.snapshot(), "after step 2")
    # fully_shard's clear / re-add: fresh state for every parameter, even empty ones.
    run.opt.param_groups.clear()
    run.opt.state.clear()
    for group in run.groups(run.params):
        run.opt.add_param_group(group)
    fresh = PlainReference(run, {n: local_of(p) for n, p in run.params.items()},
                           run.opt_kwargs)
    for step in (3, 4):
        run.set_grads(run.full_grads(step))
        run.step()
        fresh.step(run.local_grads(run.full_grads(step)))
        symmetric(assert_snapshots_bitwise, local_snapshot(run), fresh.snapshot(),
                  f"step {step} after the groups were cleared and re-added")
    same_on_all_ranks(keys(), "state keys and group steps after the re-add")


def _same_but_step(actual, expected, what):
    """Snapshots equal once the outside "step" key is set aside."""
    for part in ("state", "raw"):
        for states in actual[part].values():
            states.pop("step", None)
    assert_snapshots_bitwise(actual, expected, what)


def state_layout_mismatch(ctx, case):
    """S6.4: a DCP checkpoint saved with int16 remainders loads exactly into an
    optimizer with an fp32 master; one saved with an fp32 master is refused by an
    optimizer with remainders, on every rank, its own state unchanged by the refusal."""
    import torch.distributed.checkpoint as dcp

    remainder = Preset("p=bf16-master=remainder-m=bf16")
    fp32 = Preset("p=bf16-master=fp32-m=bf16")
    saved_with, loaded_with = (remainder, fp32) if case.detail == "remainder-to-fp32" \
        else (fp32, remainder)
    tag = f"layout-{case.id}"
    source = MegatronRun(ctx, saved_with, "dp", tag)
    for step in (1, 2):
        source.set_grads(source.full_grads(step))
        source.step()
    path = os.path.join(ctx.params["shared_dir"], f"ckpt-{case.id}".replace("=", "_"))
    dcp_save({"model": _model_state_dict(source), "optim": _uneven(source.opt.state_dict())},
             path)
    target = MegatronRun(ctx, loaded_with, "dp", tag)
    template = {"model": _model_state_dict(target), "optim": _uneven(target.opt.state_dict())}
    dcp.load(template, checkpoint_id=path)
    if saved_with is remainder:
        target.opt.load_state_dict(template["optim"])
        for name, p in target.params.items():
            master = target.opt.get_unscaled_state(p, "master_param")
            expected = merge_remainder(local_of(source.params[name]),
                                       source.opt.get_unscaled_state(
                                           source.params[name], "master_param"))
            assert_bitwise(master, expected, f"{name}: master from the remainders")
        return
    # DCP itself wrote into the tensors it was given: the parameters and the live int16
    # remainders (state_dict() exports them without a copy); the rest is the optimizer's.
    before = {n: {k: v.clone() for k, v in raw_state(target.opt, p).items()
                  if k != "master_param"} for n, p in target.params.items()}
    steps = [g["step"] for g in target.opt.param_groups]
    error = _attempt(lambda: target.opt.load_state_dict(template["optim"]))
    symmetric(_check_rejection, error, 0, (0,), ["store_param_remainders", "int16"])

    def unchanged():
        assert [g["step"] for g in target.opt.param_groups] == steps
        for n, p in target.params.items():
            for k, v in before[n].items():
                assert_bitwise(raw_state(target.opt, p)[k], v, f"{n} {k} after the refusal")

    symmetric(unchanged)


def megatron_error(ctx, case):
    """S3.1 / S3.3 / S3.4 / S1.4 on Megatron's layout: a gradient whose local shape or
    placements differ from its parameter's, one whose DTensor stays but whose local
    tensor is swapped for one of a dtype no kernel reads (as Megatron swaps them), and a
    mesh whose ``_shard_order`` names no order of its dims, are refused on every rank
    naming the parameter and the rule, and nothing changes; with the right gradient the
    step then goes through."""
    from torch.distributed.tensor import DTensor, Replicate

    run = layout_run(ctx, case)
    what = case.detail.split("|")[1]
    index = run.ordered_names().index("embed")
    if what == "shard-order":
        # The attribute lives on the mesh object each DTensor spec holds (torch may hand
        # a new DTensor an equal mesh object from an earlier one, not the one given).
        meshes = list({id(p.device_mesh): p.device_mesh for p in run.params.values()}.values())
        before = {n: local_of(p).clone() for n, p in run.params.items()}
        for mesh in meshes:
            mesh._shard_order = [1]  # a 1-D mesh has only dim 0
        try:
            error = _attempt(lambda: fused_adam()(run.groups(run.params), **run.opt_kwargs))
        finally:
            for mesh in meshes:
                mesh._shard_order = None
        symmetric(_check_rejection, error, 0, (0,), ["_shard_order"])
        for n, p in run.params.items():
            assert_bitwise(local_of(p), before[n], f"{n} after the refused constructor")
        return
    run.set_grads(run.full_grads(1))
    run.step()
    grads = run.full_grads(2)
    run.set_grads(grads)
    p = run.params["embed"]
    good = getattr(p, run.grad_attr)
    local = torch.zeros(local_of(p).shape[0] + 1, *p.shape[1:], dtype=run.grad_dtype)
    good_local = good._local_tensor if good is not None else None
    if what == "grad-local-dtype":  # the same DTensor, its local tensor swapped
        if good is None:  # a rank that holds none of it has no gradient to swap in
            bad = DTensor.from_local(torch.zeros(local_of(p).shape, dtype=torch.float64),
                                     p.device_mesh, p.placements, run_check=False,
                                     shape=p.shape, stride=p.stride())
        else:
            bad = good
            bad._local_tensor = good_local.to(torch.float64)
        mentions = ["gradient dtype", "torch.float64", "S3.4"]
    elif what == "grad-local-shape":  # one row more than this rank holds
        bad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                 shape=p.shape, stride=p.stride())
        mentions = ["local shape", "S3.4"]
    else:
        bad = DTensor.from_local(local[1:], p.device_mesh, [Replicate()], run_check=False,
                                 shape=p.shape, stride=p.stride())
        mentions = ["Shard(dim=0)", "Replicate()"]
    setattr(p, run.grad_attr, bad)
    before = local_snapshot(run)
    error = _attempt(run.opt.step)
    symmetric(_check_rejection, error, 0, (index,), mentions)
    symmetric(assert_snapshots_bitwise, local_snapshot(run), before, "after the refusal")
    if good is not None:
        good._local_tensor = good_local
    setattr(p, run.grad_attr, good)
    run.step()
    steps = [g["step"] for g in run.opt.param_groups]
    same_on_all_ranks(steps, "group['step']")
    assert steps == [2, 2], f"group steps {steps} after one refused and two good steps"


KINDS = {"megatron_layout": megatron_layout, "megatron_error": megatron_error,
         "megatron_fsdp_save": megatron_fsdp_save,
         "megatron_fsdp_resume": megatron_fsdp_resume,
         "megatron_handling": megatron_handling,
         "state_layout_mismatch": state_layout_mismatch,
         "megatron_real_save": megatron_real_save,
         "megatron_real_resume": megatron_real_resume}
