"""The distributed cases, as run on every rank (``run`` is the job entry point).

Each function takes the ``Context`` and its ``Case`` and raises on failure; the harness
records one outcome per case and rank. Contract rules are cited as in docs/semantics.md.
"""

import copy
import functools
import os
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import _dist_cases
from _dist_helpers import (
    OPT_DEFAULTS, ManualRun, ParamSpec, PlainReference, Preset, assert_bitwise,
    assert_snapshots_bitwise, check_raw_entry, check_state_layout, compare_full,
    count_collectives, full_grad, full_param, fused_adam, layout_specs, local_of,
    local_snapshot, mixed_specs, raw_state, same_on_all_ranks, seed_of, set_raw_state,
    symmetric)
from _optimizer_testing import Hyper, adam_reference, assert_close_bounded


def run(ctx):
    for case_id in ctx.params["cases"]:
        case = _dist_cases.BY_ID[case_id]
        ctx.run_case(case.id, functools.partial(KINDS[case.kind], ctx, case))


# ----------------------------------------------------------------- manual DTensor numerics

STEPS = 3
# The first parameter of group 0 gets no gradient at this step (S3.2: skipped, state kept).
SKIP_STEP = 2


def _one_step_oracle(run, before, grads, skip):
    """The full-tensor reference for one step from the sharded run's gathered state, with
    every scaled state kept in fp32: the sharded run must match its parameters bitwise and
    its states within one rounding (``rounding_bound``). Used where states are fp16/fp8,
    whose per-shard scales make a multi-step full-tensor run drift apart legitimately."""
    teacher = PlainReference(run, before["params"],
                             dict(OPT_DEFAULTS, **run.preset.fp32_state_kwargs()))
    teacher.load(before)
    teacher.step(grads, skip)
    return teacher.snapshot(raw=False)


def _train_and_check(run, steps, *, full_ref, local_ref, before, none_on_empty=False):
    """Step ``run`` and compare after every step with the references:

    * ``full_ref``: the same optimizer on full plain tensors, in lockstep (bitwise), or
      None to use the one-step oracle (presets with fp16/fp8 state);
    * ``local_ref``: the same optimizer on plain copies of this rank's local shards, fed the
      local gradients: bitwise, scales included (optional).
    """
    steps = list(steps)
    first = run.ordered_names()[0]
    for step in steps:
        grads = run.full_grads(step)
        skip = {first} if step == SKIP_STEP else set()
        run.set_grads(grads, skip)
        local_skip = set(skip)
        if none_on_empty:
            # A rank holding nothing of a parameter may have no gradient for it (S3.5).
            for name, p in run.params.items():
                if local_of(p).numel() == 0:
                    setattr(p, run.grad_attr, None)
                    local_skip.add(name)
        calls = run.step(check=False)
        if local_ref is not None:
            local_ref.step(run.local_grads(grads), local_skip)
        if full_ref is not None:
            full_ref.step(grads, skip)
            ref = full_ref.snapshot()
        else:
            ref = _one_step_oracle(run, before, grads, skip)
        # DTensor.full_tensor() itself at the last step, the cheaper assembly before.
        got = run.gather(use_full_tensor=step == steps[-1])
        what = f"after step {step}"

        def checks():
            _no_calls(calls, f"{what}: optimizer.step()")
            compare_full(run, got, ref, what)
            if full_ref is not None:
                run.check_raw_against_full(ref["raw"])
            if local_ref is not None:
                assert_snapshots_bitwise(local_snapshot(run), local_ref.snapshot(),
                                         f"{what}, local shards vs plain FusedAdam on them")
            return got["steps"]

        rank_steps = symmetric(checks)
        assert all(s == rank_steps[0] for s in rank_steps), \
            f"group['step'] differs between ranks: {rank_steps}"
        before = got
    return before


def _fresh_references(run):
    exact = not run.preset.has_scaled_state
    full_ref = PlainReference(run, run.full_params, run.opt_kwargs) if exact else None
    local_ref = PlainReference(run, {n: local_of(p) for n, p in run.params.items()},
                               run.opt_kwargs)
    return full_ref, local_ref


def _check_initial_state(run, full_ref):
    """S1.6 / S2.6: state exists from construction, laid out like the parameters, equal to
    the full-tensor optimizer's (master seeded from the parameter, zero moments)."""
    got = run.gather()
    if full_ref is not None:
        ref = full_ref.snapshot()
    else:
        ref = PlainReference(run, run.full_params,
                             dict(OPT_DEFAULTS, **run.preset.fp32_state_kwargs())).snapshot()

    def checks():
        compare_full(run, got, ref, "at construction")
        if full_ref is not None:
            run.check_raw_against_full(ref["raw"])

    symmetric(checks)
    return got


def numerics(ctx, case):
    """Manual DTensors, one layout, STEPS steps: full_tensor() of parameters and of every
    state equals the single-process run on full tensors (S2.6, S3.3, S3.5, S2.8)."""
    run = ManualRun(ctx, Preset(case.preset), layout_specs(case.detail, ctx.world_size),
                    case.id)
    full_ref, local_ref = _fresh_references(run)
    before = _check_initial_state(run, full_ref)
    _train_and_check(run, range(1, STEPS + 1), full_ref=full_ref, local_ref=local_ref,
                     before=before)


def empty_shard_none_grads(ctx, case):
    """Ranks whose shard of a parameter is empty pass no gradient for it (None) while the
    others do: same results, equal step counters (S3.5, S2.8)."""
    run = ManualRun(ctx, Preset(case.preset), layout_specs("Shard(0)", ctx.world_size),
                    case.id)
    full_ref, local_ref = _fresh_references(run)
    before = _check_initial_state(run, full_ref)
    _train_and_check(run, range(1, STEPS + 1), full_ref=full_ref, local_ref=local_ref,
                     before=before, none_on_empty=True)


# ------------------------------------------------------------------------ no collectives


def _assert_seen(calls):
    kinds = {
        "Python API": any(c == "torch.distributed.all_reduce" for c in calls),
        "dispatcher c10d op": any(c.startswith("dispatch:c10d.allreduce") for c in calls),
        "dispatcher functional collective": any(c.startswith("dispatch:_c10d_functional.")
                                                for c in calls),
        "profiler gloo event": any(c.startswith("profiler:gloo:") for c in calls),
    }
    missing = [k for k, seen in kinds.items() if not seen]
    assert not missing, f"collective witnesses blind to real traffic: {missing}; saw {calls}"


def zero_collectives(ctx, case):
    """S3.3: step() (and zero_grad(), state_dict()) issue no collective, on any layout,
    counted by three witnesses that are first shown to see real collectives."""
    run = ManualRun(ctx, Preset(case.preset), mixed_specs(ctx.world_size), case.id)
    probe = run.params["vec7"].detach()
    with count_collectives(profile=True) as calls:
        dist.all_reduce(torch.ones(2))
        probe.redistribute(probe.device_mesh, [Replicate()]).to_local()
    symmetric(_assert_seen, calls)
    for step in (1, 2):
        run.set_grads(run.full_grads(step))
        with count_collectives(profile=True) as calls:
            run.opt.step()
        symmetric(_no_calls, calls, f"step {step}: optimizer.step()")
        with count_collectives(profile=True) as calls:
            run.opt.state_dict()
            run.opt.zero_grad()
        symmetric(_no_calls, calls, f"step {step}: state_dict() / zero_grad()")
    same_on_all_ranks([g["step"] for g in run.opt.param_groups], "group['step']")


def _no_calls(calls, where):
    assert not calls, f"{where} communicated: {calls}"


# ---------------------------------------------------------------------------- bad layouts


def _names_param(message, group, indices):
    """S8: the message names the group and the parameter (index in group or overall)."""
    assert re.search(rf"\bgroup\W{{0,3}}{group}\b", message, re.I), \
        f"the error does not name group {group}: {message!r}"
    alternatives = "|".join(map(str, indices))
    assert re.search(rf"\bparam(eter)?s?\W{{0,3}}(index\W{{0,3}})?({alternatives})\b",
                     message, re.I), \
        f"the error does not name the parameter (index {' or '.join(map(str, indices))}): " \
        f"{message!r}"


def _check_rejection(error, group, indices, mentions):
    assert error is not None, "the bad input was accepted (expected RuntimeError/ValueError)"
    assert isinstance(error, (RuntimeError, ValueError)), \
        f"expected RuntimeError or ValueError, got {type(error).__name__}: {error}"
    message = str(error)
    _names_param(message, group, indices)
    for words in mentions:
        options = words if isinstance(words, tuple) else (words,)
        assert any(w.lower() in message.lower() for w in options), \
            f"the error does not mention {' or '.join(options)}: {message!r}"


def _attempt(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as error:
        return error
    except Exception as error:  # noqa: BLE001 - a wrong exception type is reported
        return error
    return None


def layout_error(ctx, case):
    """S3.1 / S3.3: a gradient, or a state set between steps, whose layout does not match
    its parameter's is rejected with a RuntimeError/ValueError naming the parameter and
    both layouts, on every rank, and nothing changes (parameters, states, scales, step
    counters bitwise); the optimizer then steps normally with a good gradient (state)."""
    w, what = ctx.world_size, case.detail
    preset = Preset(case.preset)
    n = 2 * w  # divisible: the culprit's local shapes agree on every rank
    culprit = f"mat{n}x3"
    plain = what in ("dtensor-grad-for-plain-param", "state-dtensor-for-plain-param")
    specs = [ParamSpec("vec7", (7,), ("S0",)), ParamSpec("rep4x3", (4, 3), ("R",)),
             ParamSpec("mat3x5", (3, 5), ("S1",), group=1),
             ParamSpec(culprit, (n, 3), ("plain",) if plain else ("S0",), group=1)]
    where = (1, (1, 3))  # group 1; index 1 in the group, 3 overall
    if what in ("partial-param", "local-shape-param"):
        return _bad_param(ctx, case, preset, specs, n)
    # torch refuses these as ``.grad`` (size/type checks); Megatron's decoupled_grad is
    # where the optimizer itself must catch them.
    decoupled = what in ("grad-global-shape", "plain-grad-for-dtensor-param",
                         "dtensor-grad-for-plain-param")
    run = ManualRun(ctx, preset, specs, case.id, opt_kwargs={"use_decoupled_grad": decoupled})
    run.set_grads(run.full_grads(1))
    run.step()  # so that states and scales hold real values
    grads = run.full_grads(2)
    run.set_grads(grads)
    mesh = ctx.mesh()
    if what.startswith("state-"):
        return _bad_state(ctx, run, culprit, where, what, mesh)
    good = grads[culprit]
    if what == "grad-placements":
        bad = distribute_tensor(good, mesh, [Replicate()], src_data_rank=None)
        mentions = ["Shard(dim=0)", "Replicate()"]
    elif what == "grad-mesh":
        from torch.distributed.device_mesh import DeviceMesh

        reversed_mesh = DeviceMesh("cpu", list(reversed(range(w))))
        bad = distribute_tensor(good, reversed_mesh, [Shard(0)], src_data_rank=None)
        mentions = ["mesh"]
    elif what == "grad-global-shape":
        shape = (n - 1, 3)
        bad = distribute_tensor(full_grad(shape, seed_of(case.id, "bad"), good.dtype), mesh,
                                [Shard(0)], src_data_rank=None)
        mentions = [(str([n, 3]), str((n, 3))), (str([n - 1, 3]), str((n - 1, 3)))]
    elif what == "plain-grad-for-dtensor-param":
        bad = good.clone()
        mentions = ["DTensor", "Shard(dim=0)"]
    else:
        bad = distribute_tensor(good, mesh, [Shard(0)], src_data_rank=None)
        mentions = ["DTensor", "Shard(dim=0)"]
    setattr(run.params[culprit], run.grad_attr, bad)
    before = local_snapshot(run)
    error = _attempt(run.opt.step)
    symmetric(_check_rejection, error, *where, mentions)
    symmetric(assert_snapshots_bitwise, local_snapshot(run), before, "after the rejected step()")
    run.set_grads(grads)
    run.step()
    steps = [g["step"] for g in run.opt.param_groups]
    same_on_all_ranks(steps, "group['step']")
    assert steps == [2, 2], f"group steps {steps} after one rejected and two good steps"


def _bad_state(ctx, run, culprit, where, what, mesh):
    """layout_error's states: exp_avg replaced between steps by a tensor of another
    layout holding the same local values."""
    entry = run.opt.state[run.params[culprit]]
    good = entry["exp_avg"]
    if what == "state-plain-for-dtensor-param":
        bad = good.to_local()
        mentions = ["plain", "Shard(dim=0)"]
    elif what == "state-placements":
        bad = DTensor.from_local(good.to_local(), mesh, [Replicate()], run_check=False)
        mentions = ["Shard(dim=0)", "Replicate()"]
    else:  # the parameter is plain
        bad = DTensor.from_local(good, mesh, [Shard(0)], run_check=False)
        mentions = ["DTensor", "plain"]
    entry["exp_avg"] = bad
    before = local_snapshot(run)
    error = _attempt(run.opt.step)
    symmetric(_check_rejection, error, *where, mentions)
    symmetric(assert_snapshots_bitwise, local_snapshot(run), before, "after the rejected step()")
    assert entry["exp_avg"] is bad, "the rejected state was replaced"
    entry["exp_avg"] = good
    run.step()
    steps = [g["step"] for g in run.opt.param_groups]
    same_on_all_ranks(steps, "group['step']")
    assert steps == [2, 2], f"group steps {steps} after one rejected and two good steps"


def _bad_param(ctx, case, preset, specs, n):
    """S1.4: a Partial parameter, or a Shard(0) one whose local rows are shorter than the
    global rows (no run of the global tensor), is refused at construction and by
    add_param_group."""
    run = ManualRun(ctx, preset, specs, case.id)
    run.set_grads(run.full_grads(1))
    run.step()
    seed = seed_of(case.id, "bad", ctx.rank)
    if case.detail == "partial-param":
        local = full_param((n, 3), seed, preset.param_dtype)
        bad = DTensor.from_local(local.clone(), ctx.mesh(), [Partial()])
        mentions = ["Partial"]
    else:
        local = full_param((1, 2), seed, preset.param_dtype)
        bad = DTensor.from_local(local.clone(), ctx.mesh(), [Shard(0)], run_check=False,
                                 shape=(n, 3), stride=(3, 1))
        mentions = ["S1.4", "[1, 2]", f"[{n}, 3]"]
    bad = nn.Parameter(bad)
    groups = [{"params": [run.params["vec7"], run.params["rep4x3"]]},
              {"params": [run.params["mat3x5"], bad]}]
    error = _attempt(lambda: fused_adam()(groups, **run.opt_kwargs))
    symmetric(_check_rejection, error, 1, (1, 3), mentions)
    before = local_snapshot(run)
    groups_before = len(run.opt.param_groups)
    error = _attempt(lambda: run.opt.add_param_group({"params": [bad]}))
    symmetric(_check_rejection, error, 2, (0, 4), mentions)

    def unchanged():
        assert len(run.opt.param_groups) == groups_before, "add_param_group added a group"
        assert_snapshots_bitwise(local_snapshot(run), before, "after the rejected group")
        assert_bitwise(local_of(bad), local, "the refused parameter")

    symmetric(unchanged)


# ---------------------------------------------------------------------------------- FSDP2


class _Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class _TinyLM(nn.Module):
    """Embedding, two attention/MLP blocks, final norm, vocabulary head, and a 1-output
    head whose parameters are empty on every rank but one (dim-0 size 1)."""

    VOCAB, DIM, HEADS = 23, 10, 2

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(self.VOCAB, self.DIM)
        self.blocks = nn.ModuleList(_Block(self.DIM, self.HEADS) for _ in range(2))
        self.ln_f = nn.LayerNorm(self.DIM)
        self.head = nn.Linear(self.DIM, self.VOCAB, bias=False)
        self.score = nn.Linear(self.DIM, 1)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.head(x), self.score(x)


FSDP2_STEPS = 3


def _fsdp2_model(ctx, preset, seed):
    """The model under fully_shard on a 1-D CPU mesh over all ranks (each block, then the
    root), with the preset's parameter dtype; same initial weights on every rank."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = _TinyLM().to(preset.param_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh())
    fully_shard(model, mesh=ctx.mesh())
    return model


def _fsdp2_backward(model, gen):
    """Forward and backward on a small random batch (different on every rank)."""
    ids = torch.randint(_TinyLM.VOCAB, (2, 6), generator=gen)
    logits, score = model(ids)
    next_ids = ids.roll(-1, 1).flatten()
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), next_ids) \
        + 0.01 * score.float().pow(2).mean()
    loss.backward()


# The hyper-parameters of the FSDP2 optimizers (one group, AdamW mode, bias correction).
FSDP2_HYPER = Hyper(lr=OPT_DEFAULTS["lr"], betas=OPT_DEFAULTS["betas"], eps=OPT_DEFAULTS["eps"],
                    weight_decay=OPT_DEFAULTS["weight_decay"], adam_w_mode=True,
                    bias_correction=True)


def _teacher_force_adamw(opt, params, adamw, adamw_refs, local_grads):
    """S3.7 is stated per step: torch's AdamW starts this step from exactly what FusedAdam
    holds (fp32 parameter shards and moments, step count), so neither one's earlier
    rounding carries over. Returns the float64 step inputs (w, m, v, g) per parameter."""
    step_before = opt.param_groups[0]["step"]
    inputs = []
    for p, q, g in zip(params, adamw_refs, local_grads):
        w = local_of(p)
        m, v = (local_of(opt.state[p][name]) for name in ("exp_avg", "exp_avg_sq"))
        assert w.dtype == m.dtype == v.dtype == g.dtype == torch.float32, \
            "the torch AdamW comparison is for fp32 parameters, moments and gradients"
        with torch.no_grad():
            q.copy_(w)
        q.grad = g.clone()
        adamw.state[q] = {"step": torch.tensor(float(step_before)),
                          "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        inputs.append((w.double(), m.double(), v.double(), g.double()))
    return inputs


def _check_against_adamw(step, name, p, opt, q, adamw, inputs, what):
    """From identical inputs, FusedAdam and torch's AdamW are each within the derived fp32
    bound B of the exact step (``adam_reference``), so within 2B of each other; FusedAdam
    alone is held to B (as in test_optimizer_equivalence.py)."""
    w, m, v, g = inputs
    exact = adam_reference(w, m, v, g, FSDP2_HYPER, step)
    theirs = adamw.state[q]
    for label, ours, other, value, bound in (
            ("param", local_of(p), q.detach(), exact.w, exact.w_bound),
            ("exp_avg", local_of(opt.state[p]["exp_avg"]), theirs["exp_avg"], exact.m,
             exact.m_bound),
            ("exp_avg_sq", local_of(opt.state[p]["exp_avg_sq"]), theirs["exp_avg_sq"],
             exact.v, exact.v_bound)):
        assert_close_bounded(ours, other.double(), 2 * bound,
                             f"{what}: {name} {label} vs torch AdamW (same inputs)")
        assert_close_bounded(ours, value, bound, f"{what}: {name} {label} vs float64 step")


def _fsdp2_step_and_check(step, model, opt, ref, refs, preset, adamw=None,
                          adamw_refs=None):
    """One optimizer step after a backward: no collective inside, the plain reference fed
    the same local gradients, everything compared on every rank."""
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    local_grads = [local_of(p.grad).clone() for p in params]
    ptrs = [local_of(p).data_ptr() for p in params]
    adamw_check = None
    if adamw is not None:
        adamw_check = (adamw, adamw_refs,
                       _teacher_force_adamw(opt, params, adamw, adamw_refs, local_grads))
    with count_collectives() as calls:
        opt.step()
    for r, g in zip(refs, local_grads):
        r.grad = g.clone()
    ref.step()
    if adamw is not None:
        adamw.step()

    def checks():
        _no_calls(calls, f"step {step}: optimizer.step() under FSDP2")
        _check_fsdp2_step(step, names, params, opt, refs, ref, adamw_check, ptrs, preset)
        return [g["step"] for g in opt.param_groups]

    steps = symmetric(checks)
    assert all(s == steps[0] for s in steps), f"group['step'] differs between ranks: {steps}"
    opt.zero_grad(set_to_none=True)


def _fsdp2_optimizers(model, preset):
    """FusedAdam over the FSDP2 parameters, and the same optimizer over plain copies of
    the local shards (the reference)."""
    params = list(model.parameters())
    kwargs = dict(OPT_DEFAULTS, **preset.kwargs())
    opt = fused_adam()(params, **kwargs)
    refs = [nn.Parameter(local_of(p).clone()) for p in params]
    return opt, fused_adam()(refs, **kwargs), refs


def fsdp2(ctx, case):
    """FusedAdam on an FSDP2 (fully_shard) model: each rank's parameters after every step
    equal a plain FusedAdam on copies of the local shards fed the same sharded gradients
    (bitwise, states and scales too), updated in place in FSDP2's own storage, with no
    collective inside step(); for fp32 also, step by step from FusedAdam's own state,
    within twice the derived fp32 bound of torch.optim.AdamW (S3.7)."""
    preset = Preset(case.preset)
    model = _fsdp2_model(ctx, preset, seed_of(case.id))
    opt, ref, refs = _fsdp2_optimizers(model, preset)
    adamw_refs = adamw = None
    if preset.param_dtype == torch.float32:
        adamw_refs = [nn.Parameter(local_of(p).clone()) for p in model.parameters()]
        adamw = torch.optim.AdamW(adamw_refs, lr=OPT_DEFAULTS["lr"], betas=OPT_DEFAULTS["betas"],
                                  eps=OPT_DEFAULTS["eps"],
                                  weight_decay=OPT_DEFAULTS["weight_decay"], fused=True)
    gen = torch.Generator().manual_seed(seed_of(case.id, "data", ctx.rank))
    for step in range(1, FSDP2_STEPS + 1):
        _fsdp2_backward(model, gen)
        _fsdp2_step_and_check(step, model, opt, ref, refs, preset, adamw, adamw_refs)


def fsdp2_built_before_sharding(ctx, case):
    """FusedAdam built over the whole model, then handed the FSDP2 parameters in its
    group, as accelerate's ``prepare`` swaps them in: after every step it equals an
    optimizer built over the shards (bitwise, states and scales too), and from the first
    step it holds state for the shards only, the whole parameters' state dropped and
    freed with them (S1.6)."""
    import gc
    import weakref

    from torch.distributed.fsdp import fully_shard

    preset = Preset(case.preset)
    kwargs = dict(OPT_DEFAULTS, **preset.kwargs())
    torch.manual_seed(seed_of(case.id))
    model = _TinyLM().to(preset.param_dtype)
    opt = fused_adam()(list(model.parameters()), **kwargs)
    names = [n for n, _ in model.named_parameters()]
    gone = [weakref.ref(p) for p in model.parameters()]
    gone += [weakref.ref(t) for entry in opt.state.values() for t in entry.values()]
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh())
    fully_shard(model, mesh=ctx.mesh())
    sharded = dict(model.named_parameters())
    params = [sharded[n] for n in names]
    opt.param_groups[0]["params"] = list(params)
    twin = _fsdp2_model(ctx, preset, seed_of(case.id))
    twin_params = list(twin.parameters())
    twin_opt = fused_adam()(twin_params, **kwargs)
    gens = [torch.Generator().manual_seed(seed_of(case.id, "data", ctx.rank))
            for _ in range(2)]
    for step in range(1, FSDP2_STEPS + 1):
        _fsdp2_backward(model, gens[0])
        _fsdp2_backward(twin, gens[1])
        opt.step()
        twin_opt.step()

        def checks():
            what = f"after step {step}"
            for name, p, q in zip(names, params, twin_params):
                assert_bitwise(local_of(p), local_of(q).detach(), f"{what}: {name}")
                raw, twin_raw = raw_state(opt, p), raw_state(twin_opt, q)
                assert sorted(raw) == sorted(twin_raw), f"{what}: {name} state names"
                for k, v in raw.items():
                    assert_bitwise(v, twin_raw[k], f"{what}: raw {name}.{k}")
            held = set(map(id, params))
            for label, container in (("state", opt.state), ("scales", opt._scales),
                                     ("formats", opt._formats)):
                assert set(map(id, container)) <= held, \
                    f"{what}: the optimizer's {label} still have a whole parameter's entry"
        symmetric(checks)
        opt.zero_grad(set_to_none=True)
        twin_opt.zero_grad(set_to_none=True)
    gc.collect()
    alive = sum(ref() is not None for ref in gone)
    assert alive == 0, f"{alive} whole parameters or their states are still alive"


def _fsdp2_gathered(model, opt):
    """Full parameters and full ``state_dict()`` values by parameter name, and steps."""
    from _dist_helpers import gather

    names = [n for n, _ in model.named_parameters()]
    sd = opt.state_dict()
    return {"params": {n: gather(p.detach()) for n, p in model.named_parameters()},
            "state": {n: {k: gather(v) for k, v in sd["state"][i].items()}
                      for i, n in enumerate(names)},
            "steps": [g["step"] for g in sd["param_groups"]]}


def fsdp2_dcp_save(ctx, case):
    """Train the FSDP2 model two steps and save model and optimizer with DCP
    (get_state_dict), keeping the gathered values beside the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    preset = Preset(case.preset)
    model = _fsdp2_model(ctx, preset, seed_of("fsdp2-dcp", case.preset))
    opt, ref, refs = _fsdp2_optimizers(model, preset)
    gen = torch.Generator().manual_seed(seed_of(case.id, "data", ctx.rank))
    for step in (1, 2):
        _fsdp2_backward(model, gen)
        _fsdp2_step_and_check(step, model, opt, ref, refs, preset)
    path = _dist_cases.checkpoint_dir(ctx.params["shared_dir"], "fsdp2", case.preset,
                                      ctx.world_size)
    saved = _fsdp2_gathered(model, opt)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    if ctx.rank == 0:
        torch.save(saved, os.path.join(path, "gathered.pt"))
    dist.barrier()


def fsdp2_dcp_resume(ctx, case):
    """Load the FSDP2 checkpoint saved at another world size into a fresh FSDP2 model and
    FusedAdam (set_state_dict): parameters and states equal the saved ones (fp16/fp8 within
    one rounding at the new per-shard scales), steps restored, then training goes on
    matching a plain FusedAdam on the new local shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from _dist_helpers import assert_within, region_indices, rounding_bound

    preset = Preset(case.preset)
    saved_at = int(case.detail)
    path = _dist_cases.checkpoint_dir(ctx.params["shared_dir"], "fsdp2", case.preset, saved_at)
    expected_file = os.path.join(path, "gathered.pt")
    assert os.path.exists(expected_file), \
        f"no checkpoint at {path}: the case that saves it failed or did not run"
    saved = torch.load(expected_file)
    model = _fsdp2_model(ctx, preset, seed_of(case.id))  # other weights: load must win
    opt, _, _ = _fsdp2_optimizers(model, preset)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loaded = _fsdp2_gathered(model, opt)
    params = dict(model.named_parameters())

    def same_as_saved():
        assert loaded["steps"] == saved["steps"], f"steps {loaded['steps']} != {saved['steps']}"
        for n, value in saved["params"].items():
            assert_bitwise(loaded["params"][n], value, f"loaded param {n}")
        for n, states in saved["state"].items():
            p = params[n]
            for sname, value in states.items():
                got = loaded["state"][n][sname]
                if not preset.is_scaled(sname):
                    assert_bitwise(got, value, f"loaded state {n}.{sname}")
                    continue
                bound = torch.empty(value.numel(), dtype=torch.float64)
                mesh_shape = tuple(p.device_mesh.shape)
                for region in region_indices(p.shape, mesh_shape, p.placements).values():
                    bound[region] = rounding_bound(value.reshape(-1)[region],
                                                   preset.storage_dtype(sname))
                assert_within(got, value, bound.view(value.shape), f"loaded state {n}.{sname}")

    symmetric(same_as_saved)
    # The plain reference starts from this rank's loaded shards and state.
    refs = [nn.Parameter(local_of(p).clone()) for p in model.parameters()]
    ref = fused_adam()(refs, **dict(OPT_DEFAULTS, **preset.kwargs()))
    ref_sd = ref.state_dict()
    sd = opt.state_dict()
    for i in ref_sd["state"]:
        ref_sd["state"][i] = {k: local_of(v).clone() for k, v in sd["state"][i].items()}
    for group, step in zip(ref_sd["param_groups"], loaded["steps"]):
        group["step"] = step
    ref.load_state_dict(ref_sd)
    # Same stored codes and scales too: a scale re-derived from already rounded values
    # may differ by an ulp from the one derived while loading.
    for p, r in zip(model.parameters(), refs):
        set_raw_state(ref, r, raw_state(opt, p))
    gen = torch.Generator().manual_seed(seed_of(case.id, "data", ctx.rank))
    for step in (3, 4):
        _fsdp2_backward(model, gen)
        _fsdp2_step_and_check(step, model, opt, ref, refs, preset)


def fsdp2_step0_save(ctx, case):
    """Save an FSDP2 model and its optimizer before the first step (DCP, get_state_dict):
    its masters still follow their parameters (S1.6)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    preset = Preset(case.preset)
    model = _fsdp2_model(ctx, preset, seed_of("fsdp2-step0", case.preset))
    opt, _, _ = _fsdp2_optimizers(model, preset)
    model_sd, optim_sd = get_state_dict(model, opt)
    path = _dist_cases.checkpoint_dir(ctx.params["shared_dir"], "fsdp2-step0", case.preset,
                                      ctx.world_size)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dist.barrier()


def fsdp2_step0_resume(ctx, case):
    """S1.6 / S5.4 / S6.2: a checkpoint taken before the first step, loaded at another
    world size, then weights loaded into the model (a pretrained load): the first step
    starts from those weights on every rank, as a fresh optimizer's does. Its fp16
    masters were exported at the old shards' scales, so only the group's record
    (masters=follow), not their bits, says they followed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    preset = Preset(case.preset)
    path = _dist_cases.checkpoint_dir(ctx.params["shared_dir"], "fsdp2-step0", case.preset,
                                      int(case.detail))
    assert os.path.isdir(path), f"no checkpoint at {path}: the case that saves it failed"
    model = _fsdp2_model(ctx, preset, seed_of(case.id))
    opt, _, _ = _fsdp2_optimizers(model, preset)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    layouts = [g["state_layout"] for g in opt.state_dict()["param_groups"]]

    def recorded():
        assert all(layout.endswith("masters=follow") for layout in layouts), layouts

    symmetric(recorded)
    pretrained = _fsdp2_model(ctx, preset, seed_of(case.id, "pretrained"))
    with torch.no_grad():
        for p, q in zip(model.parameters(), pretrained.parameters()):
            local_of(p).copy_(local_of(q))
    # The reference: a fresh optimizer over plain copies of the pretrained local shards.
    _, ref, refs = _fsdp2_optimizers(model, preset)
    gen = torch.Generator().manual_seed(seed_of(case.id, "data", ctx.rank))
    _fsdp2_backward(model, gen)
    _fsdp2_step_and_check(1, model, opt, ref, refs, preset)


def fsdp2_frozen_dcp(ctx, case):
    """A parameter frozen (requires_grad=False) but handed to FusedAdam, with moments
    set by hand: torch's set_state_dict leaves its state out of what it hands to
    load_state_dict. Loading
    after a further step restores every other parameter's state and the step count
    bitwise, and the frozen parameter's (which it read from the template dcp.load
    filled, S5.5, S6.1); so does a fresh optimizer, whose own state is the initial one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    preset = Preset(case.preset)
    model = _fsdp2_model(ctx, preset, seed_of("fsdp2-frozen", case.preset))
    named = list(model.named_parameters())
    frozen_name, frozen = named[0]
    frozen.requires_grad_(False)
    opt = fused_adam()([p for _, p in named], **dict(OPT_DEFAULTS, **preset.kwargs()))
    # state unlike the initial one, so that keeping it differs from recreating it
    for name in ("exp_avg", "exp_avg_sq"):
        opt.set_scaled_state(frozen, name, torch.full(local_of(frozen).shape, 0.25))
    gen = torch.Generator().manual_seed(seed_of(case.id, "data", ctx.rank))

    def train_step():
        _fsdp2_backward(model, gen)
        opt.step()
        opt.zero_grad()

    def states():
        return {n: {k: v.clone() for k, v in raw_state(opt, p).items()} for n, p in named}

    train_step()
    model_sd, optim_sd = get_state_dict(model, opt)
    path = _dist_cases.checkpoint_dir(ctx.params["shared_dir"], "fsdp2-frozen", case.preset,
                                      ctx.world_size)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = states()
    train_step()
    kept = states()[frozen_name]
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert [g["step"] for g in opt.param_groups] == [1], "step count not restored"
    loaded = states()
    for name, values in loaded.items():
        expected = kept if name == frozen_name else saved[name]
        assert sorted(values) == sorted(expected), f"{name}: state names"
        for key, value in expected.items():
            assert_bitwise(values[key], value, f"{name}.{key} after the load")
    # A fresh model and optimizer (a resumed process) with the same layer frozen: the
    # template dcp.load filled holds the frozen layer's state, read from there.
    model = _fsdp2_model(ctx, preset, seed_of(case.id, "resumed"))
    named = list(model.named_parameters())
    named[0][1].requires_grad_(False)
    opt = fused_adam()([p for _, p in named], **dict(OPT_DEFAULTS, **preset.kwargs()))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for name, values in states().items():
        for key, value in saved[name].items():
            assert_bitwise(values[key], value, f"{name}.{key} loaded by a fresh optimizer")


def _check_fsdp2_step(step, names, params, opt, refs, ref, adamw_check, ptrs, preset):
    what = f"after step {step}"
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    for i, (name, p, r) in enumerate(zip(names, params, refs)):
        local = local_of(p)
        assert local.data_ptr() == ptrs[i], \
            f"{what}: {name} was not updated in place (local data_ptr changed)"
        assert_bitwise(local, r.detach(), f"{what}: {name} vs plain FusedAdam on the shard")
        for sname in preset.state_names(p.dtype):
            check_state_layout(sd["state"][i][sname], p, preset.true_dtype(sname),
                               f"{what}: state_dict() {name}.{sname}")
            check_state_layout(opt.state[p][sname], p, preset.storage_dtype(sname),
                               f"{what}: optimizer.state {name}.{sname}")
            assert_bitwise(local_of(sd["state"][i][sname]), ref_sd["state"][i][sname],
                           f"{what}: state_dict() {name}.{sname}")
        check_raw_entry(opt, p, preset, f"{what}: {name}")
        raw, ref_raw = raw_state(opt, p), raw_state(ref, r)
        assert sorted(raw) == sorted(ref_raw), \
            f"{what}: {name} raw state names {sorted(raw)} != {sorted(ref_raw)}"
        for k, v in raw.items():
            assert_bitwise(v, ref_raw[k], f"{what}: raw {name}.{k} (scales included)")
        if adamw_check is not None:
            adamw, adamw_refs, inputs = adamw_check
            _check_against_adamw(step, name, p, opt, adamw_refs[i], adamw, inputs[i], what)


# ----------------------------------------------------------------- distributed checkpoints

DCP_STEPS_BEFORE, DCP_STEPS_AFTER = 2, 2


def _dcp_specs(world_size):
    """Same global shapes at every world size (what is saved at N is loaded at M); uneven
    and empty shards at 3 and 4; at 4 the matrices live on a 2x2 mesh, cut along both
    dimensions, so no rank's elements at 4 are a rank's at 2 (a 4 -> 2 load regroups)."""
    two_d = world_size == 4
    return [ParamSpec("vec7", (7,), ("S0",)),
            ParamSpec("mat5x3", (5, 3), ("S0", "S1") if two_d else ("S0",),
                      mesh_shape=(2, 2) if two_d else None),
            ParamSpec("mat3x5", (3, 5), ("S1", "S0") if two_d else ("S1",),
                      mesh_shape=(2, 2) if two_d else None),
            ParamSpec("rep4x3", (4, 3), ("R",)),
            ParamSpec("vec1", (1,), ("S0",), group=1),
            ParamSpec("vec2", (2,), ("S0",), group=1)]


def _dcp_options(api):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=api.endswith("-flatten"))


def _optim_state(run, api):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if api == "dcp+optimizer.state_dict":
        return run.opt.state_dict()
    return get_optimizer_state_dict(run.module, run.opt, options=_dcp_options(api))


def _set_optim_state(run, api, osd):
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if api == "dcp+optimizer.state_dict":
        run.opt.load_state_dict(osd)
    else:
        set_optimizer_state_dict(run.module, run.opt, osd, options=_dcp_options(api))


def _dcp_tag(preset):
    # Independent of the world size: every size builds the same full values.
    return f"dcp-{preset.id}"


def _save(ctx, api, preset, path):
    """Train DCP_STEPS_BEFORE steps, save model + optimizer with DCP, and keep the gathered
    true values beside the checkpoint for the loaders to compare with."""
    import torch.distributed.checkpoint as dcp

    run = ManualRun(ctx, preset, _dcp_specs(ctx.world_size), _dcp_tag(preset))
    for step in range(1, DCP_STEPS_BEFORE + 1):
        run.set_grads(run.full_grads(step))
        run.step()
    saved = run.gather()
    dcp.save({"model": run.module.state_dict(), "optim": _optim_state(run, api)},
             checkpoint_id=path)
    if ctx.rank == 0:
        torch.save(saved, os.path.join(path, "gathered.pt"))
    dist.barrier()


def _load_and_continue(ctx, api, preset, path):
    """Load into a fresh optimizer on this world size's layout, check the loaded values,
    then train DCP_STEPS_AFTER steps against the uninterrupted run (S5.6, S6.1, S6.2)."""
    import torch.distributed.checkpoint as dcp

    expected_file = os.path.join(path, "gathered.pt")
    assert os.path.exists(expected_file), \
        f"no checkpoint at {path}: the case that saves it failed or did not run"
    saved = torch.load(expected_file)
    zeros = {s.name: torch.zeros(s.shape, dtype=preset.param_dtype)
             for s in _dcp_specs(ctx.world_size)}
    run = ManualRun(ctx, preset, _dcp_specs(ctx.world_size), _dcp_tag(preset),
                    full_params=zeros)
    model_sd = run.module.state_dict()
    osd = _optim_state(run, api)  # the template DCP loads into, in place
    dcp.load({"model": model_sd, "optim": osd}, checkpoint_id=path)
    _set_optim_state(run, api, osd)
    loaded = run.gather(use_full_tensor=True)
    # Loaded true values equal the saved ones (scaled states: within one rounding at the
    # scale re-derived for this rank's new shard).
    symmetric(compare_full, run, loaded, saved, "right after loading")
    exact = not preset.has_scaled_state
    full_ref = None
    if exact:
        full_ref = PlainReference(run, saved["params"], run.opt_kwargs)
        full_ref.load(saved)
    local_ref = PlainReference(run, {n: local_of(p) for n, p in run.params.items()},
                               run.opt_kwargs)
    local_ref.load(local_snapshot(run))
    local_ref.copy_raw_from(run)
    steps = range(DCP_STEPS_BEFORE + 1, DCP_STEPS_BEFORE + DCP_STEPS_AFTER + 1)
    _train_and_check(run, steps, full_ref=full_ref, local_ref=local_ref, before=loaded)


def dcp_save(ctx, case):
    preset = Preset(case.preset)
    _save(ctx, case.detail, preset, _dist_cases.checkpoint_dir(ctx.params["shared_dir"],
                                                           case.detail, case.preset,
                                                           ctx.world_size))


def dcp_resume(ctx, case):
    api, saved_at = case.detail.split("|")
    saved_at = int(saved_at)
    preset = Preset(case.preset)
    path = _dist_cases.checkpoint_dir(ctx.params["shared_dir"], api, case.preset, saved_at)
    if saved_at == ctx.world_size:
        _save(ctx, api, preset, path)
    _load_and_continue(ctx, api, preset, path)


def fresh_get_state_dict(ctx, case):
    """S6.3 / S1.6: get_optimizer_state_dict on a fresh optimizer finds state already there
    (no dummy step: step counters stay 0, no gradient left behind), and training afterwards
    is bitwise identical to training without the call."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict)

    preset = Preset(case.preset)
    specs = mixed_specs(ctx.world_size)
    called = ManualRun(ctx, preset, specs, case.id)
    untouched = ManualRun(ctx, preset, specs, case.id)
    osd = get_optimizer_state_dict(called.module, called.opt)
    flat = get_optimizer_state_dict(called.module, called.opt,
                                    options=StateDictOptions(flatten_optimizer_state_dict=True))

    def nothing_happened():
        steps = [g["step"] for g in called.opt.param_groups]
        assert steps == [0] * len(steps), f"group steps moved to {steps} (a dummy step ran)"
        for name, p in called.params.items():
            assert p.grad is None, f"{name}.grad was left set by get_optimizer_state_dict"
            expected = preset.state_names(p.dtype)
            got = sorted(osd["state"][f"params.{name}"])
            assert got == sorted(expected), f"{name}: state {got}, expected {expected}"
            for sname in expected:
                assert f"state.params.{name}.{sname}" in flat, \
                    f"flattened state dict lacks state.params.{name}.{sname}"

    symmetric(nothing_happened)
    for step in (1, 2):
        grads = called.full_grads(step)
        for run in (called, untouched):
            run.set_grads(grads)
            run.step()
    assert_snapshots_bitwise(called.gather(), untouched.gather(),
                             "trained after get_optimizer_state_dict vs without")


def state_access(ctx, case):
    """Transformer Engine's state methods on DTensor parameters (S5.1 - S5.3):
    get_unscaled_state returns this rank's local values (fp32 true values, the raw int16
    remainder, the stored bf16 tensor with skip_unscale); set_scaled_state takes plain
    local or DTensor values and keeps the state a DTensor like its parameter;
    initialize_state(param) with one argument recreates it, still laid out the same."""
    preset = Preset(case.preset)
    run = ManualRun(ctx, preset, mixed_specs(ctx.world_size), case.id)
    run.set_grads(run.full_grads(1))
    run.step()

    def checks():
        sd = run.opt.state_dict()
        for i, name in enumerate(run.ordered_names()):
            p = run.params[name]
            for sname in preset.state_names(p.dtype):
                exported = local_of(sd["state"][i][sname])
                value = run.opt.get_unscaled_state(p, sname)
                what = f"get_unscaled_state({name}, {sname!r})"
                assert not isinstance(value, DTensor), f"{what} returned a DTensor"
                assert_bitwise(value, exported, what)
                if preset.storage_dtype(sname) == torch.bfloat16:
                    raw = run.opt.get_unscaled_state(p, sname, skip_unscale=True)
                    assert_bitwise(raw, local_of(run.opt.state[p][sname]),
                                   f"{what} with skip_unscale")
                # Writing back what was read changes nothing, from a plain or a DTensor.
                for given in (value.clone(), sd["state"][i][sname]):
                    run.opt.set_scaled_state(p, sname, given)
                    check_state_layout(run.opt.state[p][sname], p, preset.storage_dtype(sname),
                                       f"optimizer.state[{name}][{sname!r}] after set")
                    assert_bitwise(run.opt.get_unscaled_state(p, sname), exported,
                                   f"{what} after set_scaled_state")
            check_raw_entry(run.opt, p, preset, f"{name} after set_scaled_state")
            run.opt.initialize_state(p)
            for sname in preset.state_names(p.dtype):
                check_state_layout(run.opt.state[p][sname], p, preset.storage_dtype(sname),
                                   f"optimizer.state[{name}][{sname!r}] after initialize_state")
            check_raw_entry(run.opt, p, preset, f"{name} after initialize_state")
            moments = run.opt.get_unscaled_state(p, "exp_avg")
            assert not moments.any(), f"initialize_state({name}) left exp_avg non-zero"

    symmetric(checks)
    run.set_grads(run.full_grads(2))
    run.step()


def fsdp2_torch_adamw_dcp(ctx, case):
    """A torch AdamW DCP checkpoint of an FSDP2 model (S5.5, S6.4). Loaded through
    FusedAdam's own state dict as the template (DCP with allow_partial_load), AdamW's
    per-parameter step is not read and the fresh template's group step 0 stands in:
    refused on every rank (each holds moments here; the check is per rank), naming the
    rule and the way that works. That way: the checkpoint loaded
    into a torch AdamW of the same model, whose state_dict() FusedAdam then loads: the
    step and every moment carry over bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    preset = Preset(case.preset)
    seed = seed_of("fsdp2-torch-adamw", case.preset)
    model = _fsdp2_model(ctx, preset, seed)
    adamw = torch.optim.AdamW(model.parameters(), **OPT_DEFAULTS)
    gen = torch.Generator().manual_seed(seed_of(case.id, "data", ctx.rank))
    for _ in range(2):
        _fsdp2_backward(model, gen)
        adamw.step()
        adamw.zero_grad()
    model_sd, optim_sd = get_state_dict(model, adamw)
    path = _dist_cases.checkpoint_dir(ctx.params["shared_dir"], "fsdp2-torch-adamw",
                                      case.preset, ctx.world_size)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = {n: {k: local_of(v).clone() for k, v in adamw.state[p].items()}
             for n, p in model.named_parameters()}

    def through_the_template():
        fresh = _fsdp2_model(ctx, preset, seed)
        opt = fused_adam()(fresh.parameters(), **OPT_DEFAULTS)
        model_sd, optim_sd = get_state_dict(fresh, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path,
                 planner=DefaultLoadPlanner(allow_partial_load=True))
        try:
            set_state_dict(fresh, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        except ValueError as error:
            assert "the loaded step is 0" in str(error) and "torch AdamW" in str(error), \
                str(error)
        else:
            raise AssertionError("loaded with step "
                                 f"{[g['step'] for g in opt.param_groups]}, not refused")

    symmetric(through_the_template)
    fresh = _fsdp2_model(ctx, preset, seed)
    loader = torch.optim.AdamW(fresh.parameters(), **OPT_DEFAULTS)
    model_sd, optim_sd = get_state_dict(fresh, loader)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(fresh, loader, model_state_dict=model_sd, optim_state_dict=optim_sd)
    opt = fused_adam()(fresh.parameters(), **OPT_DEFAULTS)
    opt.load_state_dict(loader.state_dict())

    def carried_over():
        assert [g["step"] for g in opt.param_groups] == [2], \
            f"steps {[g['step'] for g in opt.param_groups]}"
        for n, p in fresh.named_parameters():
            for name in ("exp_avg", "exp_avg_sq"):
                assert_bitwise(local_of(raw_state(opt, p)[name]), saved[n][name],
                               f"{n}.{name}")

    symmetric(carried_over)


def zero_redundancy(ctx, case):
    """torch's ZeroRedundancyOptimizer over FusedAdam with FusedAdam's own keyword
    arguments, which ZeRO copies into every group it hands over, and again at every
    step (S1.2: a group may repeat the optimizer's settings). Each rank steps its
    partition: every parameter equals one FusedAdam's over the whole model, bitwise;
    ZeRO's consolidated state dict loads into a fresh ZeRO, which then steps on
    as the uninterrupted one: parameters, every state (int16 remainders as stored)
    and every group's step, bitwise as the one FusedAdam."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    preset = Preset(case.preset)
    gen = torch.Generator().manual_seed(seed_of("zero", case.preset))
    shapes = [(16, 8), (8,), (300,), (4, 4), (33,)]
    values = [torch.randn(shape, generator=gen).to(preset.param_dtype) for shape in shapes]
    grads = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(4)]

    def build(make):
        params = [nn.Parameter(v.clone()) for v in values]
        return params, make(params)

    kwargs = dict(OPT_DEFAULTS, **preset.kwargs())
    ref_params, ref = build(lambda params: fused_adam()(params, **kwargs))

    def zero(params):
        return ZeroRedundancyOptimizer(params, optimizer_class=fused_adam(), **kwargs)

    params, opt = build(zero)

    def step(optimizers, step_grads):
        for group, o in optimizers:
            for p, g in zip(group, step_grads):
                p.grad = g.to(p.dtype)
            o.step()

    for step_grads in grads[:2]:
        step([(ref_params, ref), (params, opt)], step_grads)
    opt.consolidate_state_dict(to=0)
    # As a file holds it: state_dict() hands out fp32 states themselves (S5.4), as
    # torch's optimizers do, and ZeRO's load would put them into the resumed run as is.
    saved = [copy.deepcopy(opt.state_dict()) if ctx.rank == 0 else None]
    dist.broadcast_object_list(saved, src=0)
    resumed_params, resumed = build(zero)
    for p, q in zip(resumed_params, params):
        p.data.copy_(q.detach())
    resumed.load_state_dict(saved[0])
    for step_grads in grads[2:]:
        step([(ref_params, ref), (params, opt), (resumed_params, resumed)], step_grads)

    def same_as_one_optimizer():
        for i, (r, p, q) in enumerate(zip(ref_params, params, resumed_params)):
            assert_bitwise(p.detach(), r.detach(), f"param {i} under ZeRO")
            assert_bitwise(q.detach(), r.detach(), f"param {i} under ZeRO, resumed")
        # Every state (int16 remainders as stored) and every group's step count, on the
        # rank whose partition holds the parameter: the resumed run carries on from the
        # consolidated state, not from parameters that happen to agree.
        owned = set()
        for label, o, ps in (("", opt, params), (", resumed", resumed, resumed_params)):
            local = o.optim
            steps = [g["step"] for g in local.param_groups] + \
                [g["step"] for g in o.param_groups]
            assert steps and all(s == ref.param_groups[0]["step"] for s in steps), \
                f"steps under ZeRO{label}: {steps} != {ref.param_groups[0]['step']}"
            for i, (r, p) in enumerate(zip(ref_params, ps)):
                if p not in local.state:
                    continue
                owned.add(i)
                for name in preset.state_names(p.dtype):
                    assert_bitwise(local.get_unscaled_state(p, name),
                                   ref.get_unscaled_state(r, name),
                                   f"param {i} {name} under ZeRO{label}")
        return sorted(owned)

    owners = symmetric(same_as_one_optimizer)
    assert sorted(i for owned in owners for i in owned) == list(range(len(shapes))), \
        f"states compared per rank {owners}: each parameter must be owned exactly once"


# ------------------------------------------------------------------ tensor parallelism

class _TPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


def tensor_parallel(ctx, case):
    """Tensor parallelism without FSDP (README, Layout rules): SequenceParallel's
    LayerNorm parameters are Replicate and their gradients come back Partial, which
    step() refuses by name with nothing changed (S3.3: the optimizer communicates
    nothing); redistributed to the parameters' placements as the README shows, the step
    equals FusedAdam over the full tensors fed the full gradients, bitwise."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module)

    preset = Preset(case.preset)
    torch.manual_seed(seed_of(case.id))
    model = _TPBlock().to(preset.param_dtype)
    parallelize_module(model, ctx.mesh(), {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1))})
    named = list(model.named_parameters())
    opt = fused_adam()(named, **OPT_DEFAULTS, **preset.kwargs())
    gen = torch.Generator().manual_seed(seed_of(case.id, dist.get_rank()))
    x = torch.randn(2, 3, 16, generator=gen).to(preset.param_dtype)  # this rank's tokens
    model(x).float().pow(2).mean().backward()

    partial = [n for n, p in named if p.grad.placements != p.placements]
    assert partial == ["norm.weight", "norm.bias"], partial
    before = {n: local_of(p).clone() for n, p in named}
    state_before = {n: {k: local_of(v).clone() for k, v in opt.state[p].items()}
                    for n, p in named}
    error = _attempt(opt.step)
    assert isinstance(error, RuntimeError) and "norm.weight" in str(error) \
        and "Partial" in str(error) and "S3.3" in str(error), repr(error)
    for n, p in named:
        assert_bitwise(local_of(p), before[n], f"refused: param {n}")
        for k, v in opt.state[p].items():
            assert_bitwise(local_of(v), state_before[n][k], f"refused: {n} {k}")
    assert [g["step"] for g in opt.param_groups] == [0], "refused: step counted"

    for p in model.parameters():  # the README's recipe
        if p.grad is not None and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    # Copies: a Replicate DTensor's full_tensor() is its local tensor itself.
    full = [nn.Parameter(p.full_tensor().clone()) for _, p in named]
    for q, (_, p) in zip(full, named):
        q.grad = p.grad.full_tensor().clone()
    reference = fused_adam()(full, **OPT_DEFAULTS, **preset.kwargs())
    opt.step()
    reference.step()
    rank = dist.get_rank()

    def shard(tensor, placement):  # this rank's part, as Shard(d) splits (torch.chunk)
        if placement.is_shard():
            return tensor.chunk(ctx.world_size, dim=placement.dim)[rank]
        return tensor

    # Compared shard by shard: gloo gathers no int16 remainders (README).
    for q, (n, p) in zip(full, named):
        assert_bitwise(local_of(p), shard(q.detach(), p.placements[0]), f"param {n}")
        for k, v in opt.state[p].items():
            assert_bitwise(local_of(v), shard(reference.state[q][k], p.placements[0]),
                           f"{n} {k}")


KINDS = {
    "numerics": numerics,
    "empty_shard_none_grads": empty_shard_none_grads,
    "zero_collectives": zero_collectives,
    "layout_error": layout_error,
    "fsdp2": fsdp2,
    "dcp_save": dcp_save,
    "dcp_resume": dcp_resume,
    "fresh_get_state_dict": fresh_get_state_dict,
    "fsdp2_dcp_save": fsdp2_dcp_save,
    "fsdp2_dcp_resume": fsdp2_dcp_resume,
    "fsdp2_frozen_dcp": fsdp2_frozen_dcp,
    "fsdp2_step0_save": fsdp2_step0_save,
    "fsdp2_step0_resume": fsdp2_step0_resume,
    "fsdp2_built_before_sharding": fsdp2_built_before_sharding,
    "zero_redundancy": zero_redundancy,
    "fsdp2_torch_adamw_dcp": fsdp2_torch_adamw_dcp,
    "state_access": state_access,
    "tensor_parallel": tensor_parallel,
}


def _add_megatron_kinds():
    import _block8_jobs
    import _megatron_block_jobs
    import _megatron_jobs  # imports this module: registered after KINDS exists

    KINDS.update(_megatron_jobs.KINDS)
    KINDS.update(_block8_jobs.KINDS)
    KINDS.update(_megatron_block_jobs.KINDS)


_add_megatron_kinds()
