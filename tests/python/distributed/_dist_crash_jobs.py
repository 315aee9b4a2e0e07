"""Crash-safe checkpoints, as run on every rank (test_dist_checkpoint_crash.py).

Two jobs over a shared folder, each a fresh set of processes:

* ``save_then_crash``: FSDP2 training with FusedAdam saves checkpoint A, reloads it and
  trains on (keeping each rank's state as the reference), then rank 1 is killed half way
  through writing its data file of checkpoint B.
* ``resume_and_damage``: a new process group loads A and trains on, bitwise like the
  reference; loading B, or A with a damaged file, fails on every rank within seconds.
"""

import contextlib
import hashlib
import os
import re
import shutil
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from _dist_helpers import (OPT_DEFAULTS, assert_bitwise, assert_snapshots_bitwise,
                           fused_adam, local_of, raw_state, seed_of)
from _dist_jobs import _fsdp2_backward, _TinyLM

# The demo's "remainder-fp8": every kind of stored state in one optimizer -- an int16
# remainder beside each bf16 parameter, an fp8 exp_avg with its per-tensor scale, a bf16
# exp_avg_sq.
OPT_KWARGS = dict(OPT_DEFAULTS, master_weights=True, store_param_remainders=True,
                  exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.bfloat16)
STEPS_BEFORE_A, STEPS_AFTER_A = 2, 2
DYING_RANK = 1
TAG = "dcp-crash"


# ------------------------------------------------------------------------------ training


def _model(ctx, seed):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = _TinyLM().to(torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=ctx.mesh())
    fully_shard(model, mesh=ctx.mesh())
    return model, fused_adam()(model.parameters(), **OPT_KWARGS)


def _train_step(ctx, model, opt, step):
    # The batch depends on the step only: a resumed run sees what the first one saw.
    _fsdp2_backward(model, torch.Generator().manual_seed(seed_of(TAG, ctx.rank, step)))
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snapshot(model, opt):
    """This rank's parameters, state_dict() values and stored tensors (scales included)."""
    sd = opt.state_dict()
    out = {"params": {}, "state": {}, "raw": {},
           "steps": [g["step"] for g in sd["param_groups"]]}
    # state_dict() numbers parameters in the order of the optimizer's groups.
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    for name, p in model.named_parameters():
        out["params"][name] = local_of(p).clone()
        out["state"][name] = {k: local_of(v).clone()
                              for k, v in sd["state"][index[id(p)]].items()}
        out["raw"][name] = {k: v.clone() for k, v in raw_state(opt, p).items()}
    return out


def _load(model, opt, path):
    """Load a DCP checkpoint in place: DCP reads into the state dict templates (for FSDP2
    the model's are the live parameter shards), then the optimizer takes its part."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _save(model, opt, path, storage_writer=None):
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path,
             storage_writer=storage_writer)


def _check_round_trip(saved, loaded):
    """S5.6 for the save/load round trip itself: parameters, remainders, the bf16
    exp_avg_sq and the steps bitwise; the fp8 exp_avg, re-encoded with a re-derived
    scale, within half an E4M3 step of the saved values (2^-4 of a normal value, 2^-10
    of the new scale below)."""
    assert loaded["steps"] == saved["steps"], f"steps {loaded['steps']} != {saved['steps']}"
    for name in saved["params"]:
        assert_bitwise(loaded["params"][name], saved["params"][name], f"{name} param")
        for key, value in saved["raw"][name].items():
            if key not in ("exp_avg", "scale:exp_avg"):
                assert_bitwise(loaded["raw"][name][key], value, f"{name} {key} reloaded")
        was = saved["state"][name]["exp_avg"].double()
        now = loaded["state"][name]["exp_avg"].double()
        scale = loaded["raw"][name]["scale:exp_avg"].double()
        bound = torch.maximum(was.abs() * 2.0 ** -4, scale * 2.0 ** -10)
        assert bool(((now - was).abs() <= bound).all()), \
            f"{name} exp_avg moved by more than half an E4M3 step when reloaded"


def _ref_file(ctx, what):
    return os.path.join(ctx.params["dir"], "ref", f"rank{ctx.rank}-{what}.pt")


def _digests(path):
    digests = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            digests[name] = hashlib.sha256(f.read()).hexdigest()
    return digests


# -------------------------------------------------------------------- a rank that dies


class _Tripwire:
    """A write stream that kills this process once ``limit`` bytes have been written,
    after making them durable: SIGKILL, so nothing of DCP or Python gets to clean up."""

    def __init__(self, stream, limit):
        self._stream = stream
        self._left = limit

    def write(self, data):
        data = memoryview(data).cast("B")
        if len(data) >= self._left:
            self._stream.write(data[:self._left])
            self._stream.flush()
            os.fsync(self._stream.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        self._left -= len(data)
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _DiesMidWrite(FileSystem):
    """DCP's local file system, except that data files (.distcp) are tripwired."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _Tripwire(stream, self.limit) if str(path).endswith(".distcp") else stream


def _dying_writer(path, limit):
    writer = FileSystemWriter(path)
    writer.fs = _DiesMidWrite(limit)
    return writer


# ---------------------------------------------------------------------------- job one


def save_then_crash(ctx):
    root = ctx.params["dir"]
    path_a, path_b = os.path.join(root, "A"), os.path.join(root, "B")
    state = {}

    def train_save_a_reload_and_train():
        model, opt = _model(ctx, seed_of(TAG, "init"))
        for step in range(1, STEPS_BEFORE_A + 1):
            _train_step(ctx, model, opt, step)
        _save(model, opt, path_a)
        dist.barrier()
        state["digests"] = _digests(path_a)
        # The uninterrupted run the resumed one must equal: the same save/load round
        # trip, without a crash anywhere (fp8 state is re-encoded on load, S5.6).
        saved = _snapshot(model, opt)
        _load(model, opt, path_a)
        loaded = _snapshot(model, opt)
        _check_round_trip(saved, loaded)
        os.makedirs(os.path.join(root, "ref"), exist_ok=True)
        torch.save(loaded, _ref_file(ctx, "loaded"))
        for step in range(STEPS_BEFORE_A + 1, STEPS_BEFORE_A + STEPS_AFTER_A + 1):
            _train_step(ctx, model, opt, step)
            torch.save(_snapshot(model, opt), _ref_file(ctx, f"step{step}"))
        state["model"], state["opt"] = model, opt

    def killed_while_saving_b():
        own_file = f"__{ctx.rank}_0.distcp"
        full_size = os.path.getsize(os.path.join(path_a, own_file))
        writer = None
        if ctx.rank == DYING_RANK:
            # Half of this rank's data file reaches the disk, then the process dies.
            writer = _dying_writer(path_b, full_size // 2)
        start = time.monotonic()
        try:
            _save(state["model"], state["opt"], path_b, storage_writer=writer)
        except RuntimeError as error:
            seconds = time.monotonic() - start
            print(f"dcp.save with a dead peer raised after {seconds:.2f}s: {error!r}",
                  flush=True)
            # gloo sees the dead peer's sockets close (how depends on which call notices).
            assert re.search(r"Connection (closed|reset) by peer|Broken pipe", str(error)), \
                f"unexpected error from dcp.save with a dead peer: {error!r}"
        else:
            raise AssertionError("dcp.save returned although a rank died while writing")
        assert seconds < ctx.pg_timeout_s, \
            f"the survivors waited {seconds:.1f}s, as long as a collective timeout"
        dying_file = f"__{DYING_RANK}_0.distcp"
        files = sorted(os.listdir(path_b))
        assert ".metadata" not in files, f"the interrupted checkpoint has .metadata: {files}"
        assert ".metadata" in state["digests"], "checkpoint A has no .metadata"
        size = os.path.getsize(os.path.join(path_b, dying_file))
        full_dying = os.path.getsize(os.path.join(path_a, dying_file))
        assert 0 < size < full_dying, \
            f"{dying_file} of B holds {size} bytes; complete it would hold {full_dying}"
        assert os.path.getsize(os.path.join(path_b, own_file)) == full_size, \
            f"the surviving rank's {own_file} of B is not complete"
        assert _digests(path_a) == state["digests"], "checkpoint A changed while saving B"

    ctx.run_case("train-save-A-reload-and-train", train_save_a_reload_and_train)
    ctx.run_case("rank-killed-while-saving-B", killed_while_saving_b, dies=(DYING_RANK,))


# ---------------------------------------------------------------------------- job two


def _failed_load(ctx, model, opt, path):
    """Load ``path``; return the CheckpointException it raised (a BaseException, not an
    Exception), after checking that it came well within the collective timeout."""
    start = time.monotonic()
    try:
        _load(model, opt, path)
    except CheckpointException as error:
        seconds = time.monotonic() - start
        print(f"loading {os.path.basename(path)} raised after {seconds:.2f}s:\n{error}",
              flush=True)
        assert seconds < ctx.pg_timeout_s, \
            f"the load failed only after {seconds:.1f}s, as long as a collective timeout"
        return error
    raise AssertionError(f"loading {path} succeeded")


def _failures(error):
    return {rank: type(exc).__name__ for rank, (exc, _) in error.failures.items()}


def _damaged_copy(ctx, name, damage):
    """A copy of checkpoint A with ``damage(path)`` applied, made by rank 0."""
    copy = os.path.join(ctx.params["dir"], name)
    if ctx.rank == 0:
        shutil.copytree(os.path.join(ctx.params["dir"], "A"), copy)
        damage(copy)
    dist.barrier()
    return copy


def _truncate(path, name):
    size = os.path.getsize(os.path.join(path, name))
    os.truncate(os.path.join(path, name), size // 2)


def resume_and_damage(ctx):
    root = ctx.params["dir"]
    path_a, path_b = os.path.join(root, "A"), os.path.join(root, "B")
    state = {}

    def resume_from_a():
        # Other initial weights than the saved run's: the load must win.
        model, opt = _model(ctx, seed_of(TAG, "other-init"))
        _load(model, opt, path_a)
        assert_snapshots_bitwise(_snapshot(model, opt), torch.load(_ref_file(ctx, "loaded")),
                                 "right after loading A")
        for step in range(STEPS_BEFORE_A + 1, STEPS_BEFORE_A + STEPS_AFTER_A + 1):
            _train_step(ctx, model, opt, step)
            assert_snapshots_bitwise(_snapshot(model, opt),
                                     torch.load(_ref_file(ctx, f"step{step}")),
                                     f"after step {step}, resumed vs uninterrupted")
        state["model"], state["opt"] = model, opt

    def load_interrupted_b():
        # No .metadata: every rank fails while reading it, before anything is written.
        model, opt = state["model"], state["opt"]
        before = _snapshot(model, opt)
        error = _failed_load(ctx, model, opt, path_b)
        _check_metadata_failure(ctx, error)
        assert_snapshots_bitwise(_snapshot(model, opt), before, "after the failed load of B")

    def load_damaged_metadata(damage):
        def check():
            model, opt = state["model"], state["opt"]
            path = _damaged_copy(ctx, f"A-{damage.__name__}", damage)
            before = _snapshot(model, opt)
            error = _failed_load(ctx, model, opt, path)
            _check_metadata_failure(ctx, error)
            assert_snapshots_bitwise(_snapshot(model, opt), before,
                                     f"after the failed load ({damage.__name__})")
        return check

    def load_truncated_data():
        model, opt = state["model"], state["opt"]
        dying_file = f"__{DYING_RANK}_0.distcp"
        path = _damaged_copy(ctx, "A-truncated-data", lambda p: _truncate(p, dying_file))
        before = _snapshot(model, opt)
        error = _failed_load(ctx, model, opt, path)
        _check_truncated_data_failure(ctx, error)
        _check_partial_load(ctx, model, opt, before, torch.load(_ref_file(ctx, "loaded")))
        # The recipe's way out: load the newest complete checkpoint again.
        _load(model, opt, path_a)
        assert_snapshots_bitwise(_snapshot(model, opt), torch.load(_ref_file(ctx, "loaded")),
                                 "after loading A again")

    ctx.run_case("resume-from-A-equals-uninterrupted-run", resume_from_a)
    ctx.run_case("load-interrupted-B-fails", load_interrupted_b)
    ctx.run_case("load-garbage-metadata-fails", load_damaged_metadata(_garbage_metadata))
    ctx.run_case("load-truncated-metadata-fails", load_damaged_metadata(_truncated_metadata))
    ctx.run_case("load-truncated-data-file-fails", load_truncated_data)


def _garbage_metadata(path):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(os.urandom(512))


def _truncated_metadata(path):
    _truncate(path, ".metadata")


def _check_metadata_failure(ctx, error):
    """DCP swallows why .metadata could not be read (missing, not a pickle, cut short; it
    logs that at INFO level) and fails its own ``assert metadata is not None``: on every
    rank, while planning, before anything is read."""
    failures = _failures(error)
    assert failures == {r: "AssertionError" for r in range(ctx.world_size)}, \
        f"expected every rank to fail reading .metadata, got {failures}:\n{error}"
    assert "metadata" in str(error), f"the error does not mention the metadata: {error}"


def _check_truncated_data_failure(ctx, error):
    """The rank whose data file was cut fails in torch.load; the others learn it from the
    CheckpointException, which names that rank."""
    failures = _failures(error)
    assert failures == {DYING_RANK: "RuntimeError"}, \
        f"expected only rank {DYING_RANK} to fail, with a RuntimeError; got {failures}"
    assert "PytorchStreamReader failed reading zip archive" in str(error), \
        f"unexpected message for a truncated data file: {error}"


def _same(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _check_partial_load(ctx, model, opt, before, loaded):
    """What a load that fails while reading data leaves behind. DCP reads into the state
    dict templates in place, tensor by tensor: the templates share the parameter shards
    with FSDP2 and the int16 remainders with the optimizer (state_dict() exports them
    without a copy), so those were overwritten -- each tensor wholly, none half: on the
    rank whose file was intact all of them, on the rank whose file was cut only those
    before the cut. The converted states (fp8 exp_avg, bf16 exp_avg_sq), their scales and
    the steps are unchanged: set_state_dict never ran."""
    after = _snapshot(model, opt)
    assert after["steps"] == before["steps"], f"steps {after['steps']} != {before['steps']}"
    overwritten, kept = [], []
    for name in before["params"]:
        for what, part, key in (("param", "params", None), ("remainder", "raw", "master_param")):
            a, b, new = (snap[part][name] if key is None else snap[part][name][key]
                         for snap in (after, before, loaded))
            is_old, is_new = _same(a, b), _same(a, new)
            assert is_old or is_new, f"{what} of {name} is neither the old nor A's value"
            if is_new and not is_old:
                overwritten.append(f"{what} {name}")
            elif is_old and not is_new:
                kept.append(f"{what} {name}")
        for key in ("exp_avg", "exp_avg_sq", "scale:exp_avg"):
            assert_bitwise(after["raw"][name][key], before["raw"][name][key],
                           f"optimizer {name}.{key} after the failed load")
    if ctx.rank == DYING_RANK:
        assert overwritten and kept, \
            f"expected part of rank {ctx.rank}'s tensors overwritten: {overwritten=}, {kept=}"
    else:
        assert not kept and overwritten, f"rank {ctx.rank} read an intact file, yet kept {kept}"
