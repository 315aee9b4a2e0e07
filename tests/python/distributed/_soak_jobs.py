"""One process group of the soak (``_soak.py``), as run on every rank.

The demo's model, data and optimizer (``shardadam.demo``): one FSDP2 model and one
FusedAdam per state preset, trained side by side on the same batches. Each step takes
the step's global batch (a function of the step alone) split over however many ranks
there are, and runs forward, backward and ``step()`` for every preset; every ``every``
steps all presets are saved as one DCP checkpoint into ``<ckpt_root>/step-<step>``.

``ctx.params`` says where to start (a checkpoint, or the seed's initial weights), where
to stop, at which checkpoints the scaled presets reload in place (the reference run),
and at most one way for this rank to die: SIGKILL in the backward of one preset, in its
``step()``, or part way through writing its data file of a checkpoint. The supervisor
may kill any rank from outside as well.

A rank appends JSON lines to its records (one unbuffered write each, so a SIGKILL
loses at most the line being written): after every step its local loss of every
preset, RSS, open file descriptors and threads; after every checkpoint the same and its
live Python objects; when a kill is armed, and whether ``step()`` returned. A rank that
reaches the end saves a snapshot of every preset (parameters, exported and stored
states, scales, steps) for the supervisor to compare.
"""

import ctypes
import gc
import json
import os
import random
import signal
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from shardadam.demo.config import PRESETS, SIZES
from shardadam.demo.data import VOCAB_SIZE, Batches
from shardadam.demo.worker import build_model, build_optimizer, lr_at, memory_figures

from _dist_crash_jobs import _dying_writer, _snapshot


def checkpoint_path(root, step):
    return os.path.join(root, f"step-{step:06d}")


def is_scaled(preset):
    """States stored with a per-tensor scale (fp16 / fp8): a load re-derives the scale
    from the exported fp32 values (S5.5), so it re-stores them, not bitwise."""
    p = PRESETS[preset]
    return any(d in ("float16", "uint8") for d in (p.exp_avg_dtype, p.exp_avg_sq_dtype))


def resources():
    """(resident bytes, open file descriptors, threads) of this process, from /proc."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return rss, len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


class _Records:
    """Append-only JSON lines, each written with one unbuffered write: a SIGKILL loses
    at most the line being written, never one already returned from."""

    def __init__(self, path):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, **record):
        os.write(self._fd, (json.dumps(record) + "\n").encode())


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


class _Runs:
    """Every preset's FSDP2 model and FusedAdam on this rank's mesh."""

    def __init__(self, ctx):
        p = ctx.params
        self.presets = list(p["presets"])
        self.runs = {}
        for name in self.presets:
            config = {"size": p["size"], "seed": p["seed"], "optimizer": "shardadam",
                      "preset": name}
            model = build_model(config, ctx.mesh())
            self.runs[name] = (model, build_optimizer(config, model))

    def state(self, names):
        """The DCP state dict of ``names``: model and optimizer state dicts, whose
        tensors are the live shards and exported states (DCP loads into them)."""
        state = {}
        for name in names:
            model, opt = self.runs[name]
            model_sd, optim_sd = get_state_dict(model, opt)
            state[name] = {"model": model_sd, "optim": optim_sd}
        return state

    def load(self, path, names):
        state = self.state(names)
        dcp.load(state, checkpoint_id=path)
        for name in names:
            model, opt = self.runs[name]
            set_state_dict(model, opt, model_state_dict=state[name]["model"],
                           optim_state_dict=state[name]["optim"])

    def step_counts(self):
        return {name: [g["step"] for g in opt.param_groups]
                for name, (_, opt) in self.runs.items()}


def _payload_bytes(state):
    """Bytes of this rank's tensors in a DCP state dict: its data file holds at least
    this much, so a tripwire below it fires while the file is written."""
    total = 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item
            total += local.numel() * local.element_size()
    return total


class _KillInStep:
    """A thread that SIGKILLs this process once released. Released right before a
    ``step()``, it runs as soon as ``step()`` lets another thread have the GIL (a torch
    op or the C++ core's update releases it) and the system schedules it."""

    def __init__(self):
        self._go = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        self._go.wait()
        _die()

    def release(self):
        self._go.set()


def _fixed_mmap_threshold(nbytes):
    """glibc's M_MMAP_THRESHOLD, fixed (see ``_soak.MMAP_THRESHOLD``)."""
    m_mmap_threshold = -3
    if ctypes.CDLL(None).mallopt(m_mmap_threshold, nbytes) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def run(ctx):
    p = ctx.params
    if p.get("mmap_threshold"):
        _fixed_mmap_threshold(p["mmap_threshold"])
    # The ~250k objects of the imported modules go to the collector's permanent
    # generation: collecting and counting at every save then walks only what this run
    # created (0.4 s less per save on 2 cores).
    gc.freeze()
    rng = random.Random(p.get("kill_seed", 0))
    kill = p.get("kill") if (p.get("kill") or {}).get("rank") == ctx.rank else None
    records = _Records(os.path.join(p["records"], f"rank{ctx.rank}.jsonl"))
    runs = _Runs(ctx)
    start = p["start"]
    if start:
        runs.load(checkpoint_path(p["ckpt_root"], start), runs.presets)
        counts = runs.step_counts()
        assert all(c == [start, start] for c in counts.values()), \
            f"checkpoint of step {start} loaded step counts {counts}"
    # One copy of this rank's shards and states, all presets: the yardstick of RSS growth.
    records.write(event="sizes", bytes=sum(sum(memory_figures(model, opt))
                                           for model, opt in runs.runs.values()))
    size = SIZES[p["size"]]
    batches = Batches(p["corpus"], size.seq_len, size.rows, p["seed"])
    scaled = [name for name in runs.presets if is_scaled(name)]
    reload_at = set(p.get("reload", ()))
    for step in range(start + 1, p["end"] + 1):
        began = time.monotonic()
        rows = batches.local_batch(step, ctx.rank, ctx.world_size)
        lr = lr_at(step, p["steps"], size.lr)
        losses = []
        for index, name in enumerate(runs.presets):
            model, opt = runs.runs[name]
            here = kill is not None and kill["step"] == step and kill["preset"] == index
            if here and kill["phase"] == "backward":
                # Before the forward: a module wires its backward hooks as it runs.
                modules = [*model.blocks, model.norm, model.head]
                target = modules[rng.randrange(len(modules))]
                target.register_full_backward_pre_hook(lambda *_: _die())
                records.write(event="armed", phase="backward", step=step, preset=name)
            loss_sum = F.cross_entropy(model(rows[:, :-1]).reshape(-1, VOCAB_SIZE),
                                       rows[:, 1:].reshape(-1), reduction="sum")
            (loss_sum / batches.tokens_per_step).backward()
            if here and kill["phase"] == "backward":
                records.write(event="backward-returned", step=step)
            for group in opt.param_groups:
                group["lr"] = lr
            if here and kill["phase"] == "step":
                killer = _KillInStep()
                records.write(event="armed", phase="step", step=step, preset=name)
                # Should the killer not have run by the end of the update, it runs in
                # this hook, which step() calls before it returns.
                opt.register_step_post_hook(lambda *_: (
                    records.write(event="update-done", step=step), time.sleep(60)))
                killer.release()
            opt.step()
            if here and kill["phase"] == "step":
                records.write(event="step-returned", step=step)
            opt.zero_grad(set_to_none=True)
            losses.append(loss_sum.item())
        # Written before this step's checkpoint: a complete checkpoint of step k implies
        # this rank's records of every step up to k.
        rss, fds, threads = resources()
        records.write(event="step", step=step, loss=losses, rss=rss, fds=fds,
                      threads=threads, seconds=round(time.monotonic() - began, 4))
        if step % p["every"] == 0:
            _save(ctx, runs, step, kill, rng, records)
            if step in reload_at and scaled:
                runs.load(checkpoint_path(p["ckpt_root"], step), scaled)
    if kill is not None:
        raise AssertionError(f"rank {ctx.rank} was to die ({kill}) but reached step {p['end']}")
    if (p.get("kill") or {}).get("phase") == "external":
        time.sleep(3600)  # the supervisor strikes from outside; never finish before it
    if p.get("snapshot"):
        snap = {name: _snapshot(model, opt) for name, (model, opt) in runs.runs.items()}
        torch.save(snap, os.path.join(p["snapshot"], f"rank{ctx.rank}.pt"))
    dist.barrier()


def _save(ctx, runs, step, kill, rng, records):
    path = checkpoint_path(ctx.params["ckpt_root"], step)
    state = runs.state(runs.presets)
    writer = None
    if kill is not None and kill["phase"] == "save" and kill["step"] == step:
        limit = rng.randrange(1, _payload_bytes(state))
        writer = _dying_writer(path, limit)
        records.write(event="armed", phase="save", step=step, limit=limit)
    began = time.monotonic()
    dcp.save(state, checkpoint_id=path, storage_writer=writer)
    seconds = time.monotonic() - began
    del state
    # Live Python objects (collected first, so that garbage awaiting the collector does
    # not count): plans, scales and containers that leak grow this number.
    gc.collect()
    rss, fds, threads = resources()
    records.write(event="saved", step=step, seconds=round(seconds, 4), rss=rss, fds=fds,
                  threads=threads, objects=len(gc.get_objects()))
