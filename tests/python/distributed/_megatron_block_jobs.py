"""Per-block moments (S2.11, S2.12) under ``megatron_fsdp.fully_shard`` itself
(``_megatron_cpu``, ``_megatron_jobs._RealRun``), block8 and block4, saved with DCP at
world size 2 and resumed at 2 and 3, as run on every rank (dispatched from
``_dist_jobs.KINDS``).

What S2.11's mesh rule promises here. Megatron FSDP hands the optimizer runs of whole
rows as ``[Shard(0)]`` DTensors on a 1-D mesh, uneven, each parameter marked with the flat
range of the whole parameter its shard holds (``megatron_fsdp_slice``). A rank holding
rows ``[o, o + n)`` of a parameter with rows of ``L`` elements keys its blocks, and
block4's random bits (S2.13), at its true offset ``f = o·L`` (worked out here by
Megatron's own collective, ``_megatron_jobs._row_offset``). Its blocks then cover the
global flat elements ``o·L + [max(0, k·B - f mod B), min(n·L, (k+1)·B - f mod B))``: the
whole tensor's blocks, cut by the shard's ends; call such a set a block's *extent*.
Everything below follows from S2.9 (each block is encoded from its own elements alone;
encoding a decoded block is the identity), from S2.13 (an element's bits depend on its
global index, the step and the parameter) and from Adam being elementwise:

* ``rows=whole-blocks`` (rows of 256 and 128 elements, B = 128): every extent is a block
  of the whole tensor: the stored codes and scales are those of one process stepping the
  full tensors, and a checkpoint continues bitwise at the same and at another world size.
* ``rows=partial-blocks`` (rows of 96 and 10 elements, 1-D biases): shard ends cut
  blocks. At the same world size the extents are the same, so resuming is bitwise. At
  another one some extents differ (blocks cut elsewhere); loading re-encodes the saved
  true values, so each block loaded is exactly S2.9/S2.10/S2.12's encode of the saved
  values over its extent (for an extent the saved run had: its saved codes and scale),
  and afterwards every element of an extent present in both layouts continues bitwise as
  the run that never stopped. The blocks cut elsewhere get no such promise (S2.11: one
  rounding at the load, then their own rounding history); the test checks nothing more
  of them than the per-rank reference below.

Throughout, each rank's codes, scales and parameters after every step are bitwise those
of a plain FusedAdam over copies of its local shards fed its local gradients, each shard
preceded by ``o`` rows of zeros (a plain tensor keys blocks and bits at 0; zeros change
no block's largest magnitude and stay zero). block4 stores S2.12's pair for parameters
of two or more dimensions with an even last one, block8's pair for the others (here the
1-D biases).
"""

import math
import os

import torch
import torch.distributed as dist

import _dist_cases
from _dist_helpers import (
    OPT_DEFAULTS, assert_bitwise, full_grad, fused_adam, raw_state, seed_of, set_raw_state,
    symmetric)
from _megatron_jobs import STEPS_AFTER, STEPS_BEFORE, _RealRun, _real_train_and_check
from _optimizer_testing import (
    fp4_block_oracle, fp8_block_oracle, ufp4_block_oracle, ufp8_block_oracle)

BLOCK = 128
STATES = ("exp_avg", "exp_avg_sq")
# S2.9 / S2.10 / S2.12's encode of true values, block by block, written in the tests.
ORACLES = {"fp8-block": fp8_block_oracle, "ufp8-block": ufp8_block_oracle,
           "fp4-block": fp4_block_oracle, "ufp4-block": ufp4_block_oracle}
# (in, out, bias) per nn.Linear. Real fully_shard cuts the weights' rows at W=2 | W=3 into
# 64/64 | 43/43/42 and 6/4 | 4/4/2 (whole blocks; 6/4 is not torch's 5/5 chunk); 6/4 |
# 4/4/2, 53/43 | 36/36/24 and 2/1 | 2/1/0 (partial blocks); each bias whole on one rank.
SHAPES = {"rows=whole-blocks": ((256, 128, False), (128, 10, True)),
          "rows=partial-blocks": ((96, 10, True), (10, 96, True), (96, 3, True))}
SAVED_AT = 2


def _moment_format(case):
    """``moment_format`` of a case: its preset's ``m=``."""
    return case.preset.split("m=")[-1]


def _kwargs(fmt):
    return dict(moment_format=fmt, moment_block_size=BLOCK)


def _state_formats(fmt, shape):
    """S2.11's formats of each moment of a parameter of global ``shape``: block4's 4-bit
    pair where its states pack by rows (two or more dimensions, an even last one),
    else block8's pair."""
    if fmt == "block4" and len(shape) >= 2 and shape[-1] % 2 == 0:
        return {"exp_avg": "fp4-block", "exp_avg_sq": "ufp4-block"}
    return {"exp_avg": "fp8-block", "exp_avg_sq": "ufp8-block"}


def _grad(name, shape, step):
    # Magnitudes spread over decades: blocks get different scales, some small values
    # reach the bottom of each map's range.
    return full_grad(shape, seed_of("megatron-block-grad", name, step), torch.float32)


def _run(ctx, case, seed):
    return _RealRun(ctx, None, seed, layers=SHAPES[case.detail],
                    opt_kwargs=_kwargs(_moment_format(case)), grad=_grad)


def _row_length(shape):
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def _extents(f, n):
    """``[lo, hi)`` of each block of a local tensor of ``n`` elements keyed at ``f``."""
    lead = f % BLOCK
    count = -(-(lead + n) // BLOCK) if n else 0
    return [(max(0, k * BLOCK - lead), min(n, (k + 1) * BLOCK - lead)) for k in range(count)]


# ------------------------------------------------------------------ snapshots and blocks


def _element_codes(stored, fmt):
    """One code per element of stored codes: 4-bit codes unpacked, the low nibble first
    (S2.12)."""
    flat = stored.reshape(-1)
    if fmt in ("fp4-block", "ufp4-block"):
        return torch.stack([flat & 0xF, flat >> 4], dim=1).reshape(-1)
    return flat.clone()


def _snapshot(run):
    """``run.gather()`` (full parameters, decoded moments, group steps) plus every rank's
    stored codes (one per element) and scales with the rows they cover: ``raw[name] =
    [(row offset, rows, f, {state: codes, "scale:" + state: scales}) per rank]``, and
    each parameter's formats (``_state_formats``)."""
    out = run.gather()
    fmt = run.opt_kwargs["moment_format"]
    out["formats"] = {name: _state_formats(fmt, p.shape)
                      for name, p in zip(run.names, run.params)}
    mine = {}
    for name, p, offset in zip(run.names, run.params, run.offsets):
        raw = raw_state(run.opt, p)
        assert sorted(raw) == sorted(STATES + tuple("scale:" + s for s in STATES)), \
            f"{name}: stored state {sorted(raw)}"
        raw = {k: v.clone() if k.startswith("scale:") else
               _element_codes(v, out["formats"][name][k]) for k, v in raw.items()}
        first = offset * _row_length(p.shape)  # the true offset: Megatron's collective
        mine[name] = (offset, p._local_tensor.shape[0], first, raw)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    out["raw"] = {name: [part[name] for part in per_rank] for name in run.names}
    out["shapes"] = {name: tuple(p.shape) for name, p in zip(run.names, run.params)}
    return out


def _blocks(snapshot, name):
    """``{(start, end) global flat extent: {state: (codes, scale)}}`` of every block stored
    by any rank, each rank's keyed at its ``f`` (module docstring)."""
    row = _row_length(snapshot["shapes"][name])
    out = {}
    for offset, rows, f, raw in snapshot["raw"][name]:
        start, n = offset * row, rows * row
        extents = _extents(f, n)
        for state in STATES:
            assert raw[state].numel() == n and raw["scale:" + state].numel() == len(extents), \
                f"{name} {state}: {raw[state].numel()} codes and " \
                f"{raw['scale:' + state].numel()} scales for {n} elements at f = {f}"
        for k, (lo, hi) in enumerate(extents):
            extent = (start + lo, start + hi)
            assert extent not in out, f"{name}: two ranks hold the block {extent}"
            out[extent] = {s: (raw[s][lo:hi], raw["scale:" + s][k:k + 1]) for s in STATES}
    return out


def _check_loaded(loaded, saved):
    """Right after the load: parameters and steps as saved; each block exactly S2.9 /
    S2.10 / S2.12's encode of the saved true values over its extent, and a block whose
    extent the saved run had holds its saved codes and scale. Returns the extents kept
    and regrouped per parameter."""
    assert loaded["steps"] == saved["steps"], f"steps {loaded['steps']} != {saved['steps']}"
    kept, regrouped = {}, {}
    for name in saved["raw"]:
        assert_bitwise(loaded[name], saved[name], f"{name} right after loading")
        now, before = _blocks(loaded, name), _blocks(saved, name)
        kept[name] = sorted(set(now) & set(before))
        regrouped[name] = sorted(set(now) - set(before))
        for (lo, hi), stored in now.items():
            for state in STATES:
                values = saved[f"{name}.{state}"].reshape(-1)[lo:hi]
                # worked out in the test, not by the codec the load itself runs
                want = ORACLES[saved["formats"][name][state]](values, 0, BLOCK)
                what = f"{name} {state} block [{lo}, {hi}) loaded"
                assert_bitwise(stored[state][0], want[0], f"{what}: codes (re-encoded)")
                assert_bitwise(stored[state][1], want[1], f"{what}: scale (re-encoded)")
                if (lo, hi) in before:
                    assert_bitwise(stored[state][0], before[(lo, hi)][state][0],
                                   f"{what}: codes (saved)")
                    assert_bitwise(stored[state][1], before[(lo, hi)][state][1],
                                   f"{what}: scale (saved)")
    return kept, regrouped


def _check_kept(final, uninterrupted, kept):
    """After the resumed steps: on every element of a kept extent, parameters, decoded
    moments, codes and scales are bitwise the uninterrupted run's."""
    assert final["steps"] == uninterrupted["steps"], \
        f"steps {final['steps']} != {uninterrupted['steps']}"
    for name, extents in kept.items():
        now, ref = _blocks(final, name), _blocks(uninterrupted, name)
        index = torch.cat([torch.arange(lo, hi) for lo, hi in extents]) if extents \
            else torch.empty(0, dtype=torch.long)
        for key in (name,) + tuple(f"{name}.{s}" for s in STATES):
            assert_bitwise(final[key].reshape(-1)[index], uninterrupted[key].reshape(-1)[index],
                           f"{key} on the {len(extents)} kept blocks, against the "
                           f"uninterrupted run")
        for extent in extents:
            for state in STATES:
                for i, part in enumerate(("codes", "scale")):
                    assert_bitwise(now[extent][state][i], ref[extent][state][i],
                                   f"{name} {state} {part} of block {extent}, against the "
                                   f"uninterrupted run")


# ------------------------------------------------------------- the local-shard reference


class _LocalReference:
    """A plain FusedAdam over copies of this rank's local shards, each preceded by ``o``
    rows of zeros (parameter, gradient and moments; a shard's ``o`` is its first global
    row), so that its blocks and random bits (keyed at 0) are the run's (keyed at
    ``f = o·L``); it starts from the run's stored state (codes, scales, step) and is fed
    this rank's rows of each gradient."""

    def __init__(self, run):
        from torch import nn

        self.run = run
        # Leading zero rows, and the leading blocks they fill; none for an empty shard.
        self.leads = [offset if p._local_tensor.numel() else 0
                      for p, offset in zip(run.params, run.offsets)]
        self.lead_blocks = [lead * _row_length(p.shape) // BLOCK
                            for p, lead in zip(run.params, self.leads)]
        self.params = [nn.Parameter(self._padded(p._local_tensor.detach(), lead))
                       for p, lead in zip(run.params, self.leads)]
        self.opt = fused_adam()(self.params, **OPT_DEFAULTS, **run.opt_kwargs)
        for p, q, lead, blocks in zip(run.params, self.params, self.leads, self.lead_blocks):
            # All-zero blocks have scale 1 (S2.9, S2.10, S2.12), zero values code 0.
            set_raw_state(self.opt, q, {
                k: torch.cat([v.new_ones(blocks), v]) if k.startswith("scale:") else
                self._padded(v, lead) for k, v in raw_state(run.opt, p).items()})
        self.opt.param_groups[0]["step"] = run.opt.param_groups[0]["step"]

    @staticmethod
    def _padded(local, lead):
        return torch.cat([local.new_zeros((lead,) + tuple(local.shape[1:])), local])

    def step(self, step):
        for name, p, q, lead, offset in zip(self.run.names, self.run.params, self.params,
                                            self.leads, self.run.offsets):
            rows = p._local_tensor.shape[0]
            # None where the shard is empty, as Megatron's gradient there (S3.2).
            q.grad = self._padded(_grad(name, p.shape, step)[offset:offset + rows], lead) \
                if p._local_tensor.numel() else None
        self.opt.step()

    def check(self, what):
        def same():
            for name, p, q, lead, blocks in zip(self.run.names, self.run.params, self.params,
                                                self.leads, self.lead_blocks):
                assert_bitwise(p._local_tensor.detach(), q.detach()[lead:], f"{what}: {name}")
                mine, ref = raw_state(self.run.opt, p), raw_state(self.opt, q)
                assert sorted(mine) == sorted(ref), f"{what}: {name} keys {sorted(mine)}"
                for key in ref:
                    want = ref[key][blocks:] if key.startswith("scale:") else ref[key][lead:]
                    assert_bitwise(mine[key], want, f"{what}: {name} {key}")
            assert self.run.opt.param_groups[0]["step"] == self.opt.param_groups[0]["step"]

        symmetric(same)


def _train_against_local(run, steps):
    ref = _LocalReference(run)
    for step in steps:
        run.train([step])
        ref.step(step)
        ref.check(f"after step {step}, against a plain FusedAdam on the local shards")


# ------------------------------------------------------------------------------ cases


def _checkpoint(ctx, case):
    return _dist_cases.checkpoint_dir(ctx.params["shared_dir"],
                                      f"megatron-{_moment_format(case)}", case.detail,
                                      SAVED_AT)


def megatron_block_save(ctx, case):
    """fully_shard at world size 2, the case's block moments: two steps (whole-block
    rows: each bitwise the full-tensor run of one process), DCP save, two more steps (the
    uninterrupted run the resumes are compared with); every step also against the
    local-shard reference."""
    import torch.distributed.checkpoint as dcp

    from _megatron_cpu import megatron_on_cpu

    whole = case.detail == "rows=whole-blocks"
    with megatron_on_cpu():
        run = _run(ctx, case, seed=0)
        start = run.gather()
        assert start["steps"] == [1], f"fully_shard_optimizer's init step: {start['steps']}"
        before, after = range(1, STEPS_BEFORE + 1), \
            range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1)
        if whole:
            _real_train_and_check(run, before, start)
        else:
            _train_against_local(run, before)
        saved = _snapshot(run)
        path = _checkpoint(ctx, case)
        dcp.save({"model": run.model.state_dict(), "optim": run.opt.state_dict()},
                 checkpoint_id=path)
        if whole:
            _real_train_and_check(run, after, run.gather())
        else:
            _train_against_local(run, after)
        final = _snapshot(run)
    if ctx.rank == 0:
        torch.save({"saved": saved, "final": final}, os.path.join(path, "gathered.pt"))
    dist.barrier()


def megatron_block_resume(ctx, case):
    """fully_shard at this world size from another initialisation, DCP load of the
    world-size-2 checkpoint, two steps: see the module docstring for what must hold."""
    import torch.distributed.checkpoint as dcp

    from _megatron_cpu import megatron_on_cpu

    path = _checkpoint(ctx, case)
    expected = os.path.join(path, "gathered.pt")
    assert os.path.exists(expected), f"no checkpoint at {path}: its save case failed"
    gathered = torch.load(expected)
    with megatron_on_cpu():
        run = _run(ctx, case, seed=1)
        template = {"model": run.model.state_dict(), "optim": run.opt.state_dict()}
        dcp.load(template, checkpoint_id=path)
        run.model.load_state_dict(template["model"], strict=False)
        run.opt.load_state_dict(template["optim"])
        loaded = _snapshot(run)
        kept, regrouped = _check_loaded(loaded, gathered["saved"])
        # Which regime the shapes put this case in (module docstring): all extents kept
        # for whole-block rows or the same world size, else some regrouped.
        n_regrouped = sum(len(v) for v in regrouped.values())
        if case.detail == "rows=whole-blocks" or ctx.world_size == SAVED_AT:
            assert n_regrouped == 0, f"blocks regrouped by the resharding: {regrouped}"
        else:
            assert n_regrouped and sum(len(v) for v in kept.values()), \
                f"expected both kept and regrouped blocks: kept {kept}, regrouped {regrouped}"
        if case.detail == "rows=partial-blocks":  # a shard keyed off the block grid
            assert any(f % BLOCK for raws in loaded["raw"].values() for _, _, f, _ in raws)
        _train_against_local(run, range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1))
        final = _snapshot(run)
    _check_kept(final, gathered["final"], kept)
    if not n_regrouped:  # every element kept: the whole run is the uninterrupted one
        for key, value in gathered["final"].items():
            if key not in ("raw", "shapes", "steps", "formats"):
                assert_bitwise(final[key], value, f"{key}, against the uninterrupted run")


KINDS = {"megatron_block_save": megatron_block_save,
         "megatron_block_resume": megatron_block_resume}
