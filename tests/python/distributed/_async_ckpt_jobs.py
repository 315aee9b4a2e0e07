"""Asynchronous DCP checkpoints, as run on every rank (test_dist_async_checkpoint.py).

``torch.distributed.checkpoint.async_save`` returns while a thread still writes the
checkpoint. ``state_dict()`` exports fp32 states and int16 remainders without a copy
(S5.4), and FSDP2's model state dict holds the live parameter shards, so the steps
taken meanwhile write into the very tensors that were handed to the save; what keeps
them out of the checkpoint is torch's default stager, which copies the state dict
before ``async_save`` returns. These cases hold torch (and this package) to that: every
preset of ``_dist_cases.PRESETS`` saves asynchronously, takes ``STEPS_AFTER`` steps
at once, waits, and the checkpoint must hold bitwise the state at the moment of the
call. The save runs on a process group of its own, as torch asks, so that its
collectives never interleave with FSDP2's on the default group.

``params["fsdp"]`` false runs the same on plain tensors (one rank, no DTensor).
"""

import contextlib
import os
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

import _dist_cases
from _dist_crash_jobs import (_check_metadata_failure, _failed_load, _failures, _load,
                              _model, _save, _snapshot)
from _dist_helpers import (OPT_DEFAULTS, Preset, assert_bitwise,
                           assert_snapshots_bitwise, fused_adam, local_of, seed_of)
from _dist_jobs import _fsdp2_backward, _TinyLM

STEPS_BEFORE, STEPS_AFTER = 2, 3
TAG = "dcp-async"
FAILING_RANK = 1  # its writer fails in the failed-future case (at two ranks)
# Generous: the held writer is released by this job itself, within milliseconds.
_WAIT_S = 20.0


# ------------------------------------------------------------------------------ training


def _build(ctx, preset_id, fsdp):
    """The test model with the preset's dtypes: under FSDP2 on all ranks, or plain."""
    from torch.distributed.fsdp import fully_shard

    preset = Preset(preset_id)
    torch.manual_seed(seed_of(TAG, preset_id, "init"))
    model = _TinyLM().to(preset.param_dtype)
    if fsdp:
        for block in model.blocks:
            fully_shard(block, mesh=ctx.mesh())
        fully_shard(model, mesh=ctx.mesh())
    opt = fused_adam()(model.parameters(), **dict(OPT_DEFAULTS, **preset.kwargs()))
    return model, opt


def _train(ctx, model, opt, steps):
    for step in steps:
        # The batch depends on the rank and step only.
        _fsdp2_backward(model, torch.Generator().manual_seed(seed_of(TAG, ctx.rank, step)))
        opt.step()
        opt.zero_grad(set_to_none=True)


# ------------------------------------------------------------- what a checkpoint holds


def _clone_tree(obj):
    """A copy of a (DCP) state dict: tensors cloned (DTensors stay DTensors), containers
    copied, other leaves kept."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v) for v in obj)
    return obj


def _leaves(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def _same_leaf(a, b):
    if isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(local_of(a).contiguous().view(torch.uint8),
                                local_of(b).contiguous().view(torch.uint8)))
    return a == b


def _assert_trees_bitwise(actual, expected, what):
    got, want = dict(_leaves(actual)), dict(_leaves(expected))
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            if isinstance(value, DTensor):
                assert isinstance(got[key], DTensor) and \
                    got[key].placements == value.placements, f"{what}: {key} layout"
            assert_bitwise(local_of(got[key]), local_of(value), f"{what}: {key}")
        else:
            assert got[key] == value, f"{what}: {key} is {got[key]!r}, saved {value!r}"


def _changed_leaves(now, then):
    want = dict(_leaves(then))
    return [k for k, v in _leaves(now) if not _same_leaf(v, want[k])]


def _read_checkpoint(model, opt, path):
    """What the checkpoint at ``path`` holds, read into a copy of the current state dict
    (the live model and optimizer are not touched)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    template = _clone_tree({"model": model_sd, "optim": optim_sd})
    dcp.load(template, checkpoint_id=path)
    return template


# ------------------------------------------------------------------- writers for faults


class _HeldFileSystem(FileSystem):
    """DCP's file system, whose data files wait for ``release`` before they are opened;
    ``reached`` is set once this rank's save thread is waiting there."""

    def __init__(self):
        super().__init__()
        self.reached, self.release = threading.Event(), threading.Event()

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if str(path).endswith(".distcp"):
            self.reached.set()
            assert self.release.wait(_WAIT_S), "the held write was never released"
        with super().create_stream(path, mode) as stream:
            yield stream


class _NoSpaceFileSystem(FileSystem):
    """DCP's file system, whose data files cannot be written: the disk is full."""

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if str(path).endswith(".distcp"):
            raise OSError(28, "No space left on device", str(path))
        with super().create_stream(path, mode) as stream:
            yield stream


def _writer(path, fs):
    writer = FileSystemWriter(path)
    writer.fs = fs
    return writer


def _async_save(model, opt, path, group, storage_writer=None):
    model_sd, optim_sd = get_state_dict(model, opt)
    return dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path,
                          storage_writer=storage_writer, process_group=group)


# ----------------------------------------------------------------------------------- job


def run(ctx):
    fsdp = ctx.params.get("fsdp", True)
    root = os.path.join(ctx.params["dir"], "fsdp" if fsdp else "plain")
    # DCP's collectives of an async save run in its thread: on their own group.
    group = dist.new_group(backend="gloo")

    def async_then_steps(preset_id):
        def check():
            model, opt = _build(ctx, preset_id, fsdp)
            _train(ctx, model, opt, range(1, STEPS_BEFORE + 1))
            safe = preset_id.replace("=", "_")
            sync_path, async_path = (os.path.join(root, f"{safe}-{kind}")
                                     for kind in ("sync", "async"))
            # The reference: a blocking save of the same moment.
            _save(model, opt, sync_path)
            model_sd, optim_sd = get_state_dict(model, opt)
            at_save = _clone_tree({"model": model_sd, "optim": optim_sd})
            raw_at_save = _snapshot(model, opt)
            future = _async_save(model, opt, async_path, group)
            _train(ctx, model, opt, range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1))
            future.result(timeout=_WAIT_S)
            dist.barrier()
            model_sd, optim_sd = get_state_dict(model, opt)
            changed = _changed_leaves({"model": model_sd, "optim": optim_sd}, at_save)
            # Otherwise the check below could not fail: the steps must have moved
            # parameters and states (the exported tensors the save was handed).
            assert any(k.startswith("/model/") for k in changed) and \
                any("/optim/state/" in k for k in changed), \
                f"the steps after the save changed too little to test it: {changed}"
            _assert_trees_bitwise(_read_checkpoint(model, opt, async_path), at_save,
                                  "async checkpoint vs the state dict at save time")
            # Loaded, it gives what a blocking save of that moment gives (fp16/fp8 states
            # are re-stored at re-derived scales on any load, S5.5), for exact storage
            # the stored state at save time itself.
            _load(model, opt, async_path)
            from_async = _snapshot(model, opt)
            _load(model, opt, sync_path)
            assert_snapshots_bitwise(from_async, _snapshot(model, opt),
                                     "loaded from the async vs the blocking checkpoint")
            if not Preset(preset_id).has_scaled_state:
                assert_snapshots_bitwise(from_async, raw_at_save,
                                         "loaded from the async checkpoint vs at save time")
        return check

    def load_while_in_flight():
        model, opt = _model(ctx, seed_of(TAG, "in-flight"))
        _train(ctx, model, opt, (1,))
        path = os.path.join(root, "in-flight")
        model_sd, optim_sd = get_state_dict(model, opt)
        at_save = _clone_tree({"model": model_sd, "optim": optim_sd})
        fs = _HeldFileSystem()
        future = _async_save(model, opt, path, group, storage_writer=_writer(path, fs))
        try:
            assert fs.reached.wait(_WAIT_S), "the save thread never reached its data file"
            dist.barrier()  # every rank's save is held: the folder has no .metadata
            assert not os.path.exists(os.path.join(path, ".metadata"))
            before = _snapshot(model, opt)
            error = _failed_load(ctx, model, opt, path)
            _check_metadata_failure(ctx, error)
            assert_snapshots_bitwise(_snapshot(model, opt), before,
                                     "after loading a checkpoint still being written")
        finally:
            fs.release.set()
        future.result(timeout=_WAIT_S)
        dist.barrier()
        _assert_trees_bitwise(_read_checkpoint(model, opt, path), at_save,
                              "the released checkpoint vs the state dict at save time")

    def failed_future():
        model, opt = _model(ctx, seed_of(TAG, "no-space"))
        _train(ctx, model, opt, (1,))
        path = os.path.join(root, "no-space")
        fs = _NoSpaceFileSystem() if ctx.rank == FAILING_RANK else FileSystem()
        before = _snapshot(model, opt)
        future = _async_save(model, opt, path, group, storage_writer=_writer(path, fs))
        assert_snapshots_bitwise(_snapshot(model, opt), before, "as async_save returned")
        _train(ctx, model, opt, (2,))  # training goes on while the save fails
        trained = _snapshot(model, opt)
        try:
            future.result(timeout=_WAIT_S)
        except CheckpointException as error:
            print(f"the failed async save's future raised on rank {ctx.rank}:\n{error}",
                  flush=True)
            failures = _failures(error)
            assert failures == {FAILING_RANK: "OSError"}, \
                f"expected rank {FAILING_RANK}'s OSError on every rank, got {failures}"
            assert "No space left on device" in str(error), str(error)
        else:
            raise AssertionError("the future of a save whose write failed returned")
        assert_snapshots_bitwise(_snapshot(model, opt), trained, "after the future raised")
        dist.barrier()
        assert not os.path.exists(os.path.join(path, ".metadata")), \
            "a save that failed on one rank wrote .metadata"
        error = _failed_load(ctx, model, opt, path)
        _check_metadata_failure(ctx, error)
        assert_snapshots_bitwise(_snapshot(model, opt), trained, "after loading it")

    for preset_id in _dist_cases.PRESETS:
        ctx.run_case(f"async-save-then-steps-{preset_id}", async_then_steps(preset_id))
    if ctx.world_size > 1:
        ctx.run_case("load-while-async-save-in-flight", load_while_in_flight)
        ctx.run_case("async-save-whose-write-fails", failed_future)
