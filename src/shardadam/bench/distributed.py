"""DTensor parameters (Shard(0) on a 2-rank gloo CPU mesh) vs the same local tensors.

Each rank builds the case's full tensors from one seed, keeps its Shard(0) part twice --
once as DTensors (``distribute_tensor`` with ``src_data_rank=None``: no communication;
torch before 2.7 broadcasts rank 0's instead, the same values),
once as plain tensors -- and times ``shardadam.FusedAdam`` on both, interleaved, one
thread per rank. Every repetition starts behind a barrier so both ranks step together;
a repetition's time is the slower rank's. If FusedAdam rejects DTensor parameters the
case reports "unsupported" with the reason rather than failing the run.
"""

from __future__ import annotations

import datetime
import inspect
import os
import tempfile
import time
import traceback

WORLD_SIZE = 2
_TIMEOUT_S = 600


def _local_params(case, mesh, rank):
    """(DTensor parameters, plain parameters) holding the same local values."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from . import cases

    # Every rank holds the same full values: None (torch >= 2.7) skips the broadcast
    # from rank 0 that older torch makes.
    local_only = ({"src_data_rank": None}
                  if "src_data_rank" in inspect.signature(distribute_tensor).parameters
                  else {})
    dtensors, plain = [], []
    for full in cases.make_params(case):
        value = distribute_tensor(full.detach(), mesh, [Shard(0)], **local_only)
        grad = distribute_tensor(full.grad, mesh, [Shard(0)], **local_only)
        param = torch.nn.Parameter(value)
        param.grad = grad
        dtensors.append(param)
        local = torch.nn.Parameter(value.to_local().clone())
        local.grad = grad.to_local().clone()
        plain.append(local)
    return dtensors, plain


def _rank_main(rank, store, case, reps, warmup, settle_s, queue):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from . import contenders, memory

    os.dup2(2, 1)  # gloo's connection messages go to stdout: keep the table clean
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=_TIMEOUT_S))
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        dtensors, plain = _local_params(case, mesh, rank)
        local_numel = sum(p.numel() for p in plain)
        steps, errors = {}, {}
        for name, params in (("dtensor", dtensors), ("plain", plain)):
            try:
                step = contenders.make("shardadam", lambda: params, case.preset)
                step()  # rejects unsupported parameters before anything else
                steps[name] = step
            except Exception as error:  # noqa: BLE001 - reported, not hidden
                errors[name] = f"{type(error).__name__}: {error}".splitlines()[0]
        peaks = {name: memory.peak_extra_bytes(step) for name, step in steps.items()}

        # Interleaved like timing.interleaved (settle gap included), with a barrier
        # before (outside) each timed call so both ranks start it together.
        samples = {name: [] for name in steps}
        for _ in range(warmup):
            for step in steps.values():
                step()
        for _ in range(reps):
            for name, step in steps.items():
                dist.barrier()
                time.sleep(settle_s)
                start = time.perf_counter()
                step()
                samples[name].append(time.perf_counter() - start)
        gathered = [None] * WORLD_SIZE
        dist.all_gather_object(gathered, {"samples": samples, "peaks": peaks,
                                          "errors": errors, "local_numel": local_numel})
        if rank == 0:
            queue.put({"ok": gathered})
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the parent reports it
        queue.put({"error": traceback.format_exc().strip().splitlines()[-1], "rank": rank})


def run(case, reps: int, warmup: int, settle_s: float) -> dict:
    """``{contender: {"samples": [s], "peak_extra_bytes": n} | {"error": why}}``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fresh interpreters: no forked torch thread pools
    queue = ctx.Queue()
    # A file store in a private folder: a free port picked here could be taken before
    # the ranks, seconds of imports later, bind it.
    with tempfile.TemporaryDirectory(prefix="shardadam-bench-") as folder:
        store = os.path.join(folder, "store")
        ranks = [ctx.Process(target=_rank_main,
                             args=(r, store, case, reps, warmup, settle_s, queue))
                 for r in range(WORLD_SIZE)]
        for p in ranks:
            p.start()
        try:
            message = queue.get(timeout=_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - queue.Empty, or a rank that died silently
            message = {"error": "ranks did not report in time"}
        for p in ranks:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if "error" in message:
        return {name: {"error": message["error"]} for name in case.contenders}
    gathered = message["ok"]
    out = {}
    for name in case.contenders:
        errors = [g["errors"][name] for g in gathered if name in g["errors"]]
        if errors:
            out[name] = {"error": errors[0], "status": "unsupported"}
            continue
        # A repetition lasts as long as its slower rank.
        per_rank = [g["samples"][name] for g in gathered]
        out[name] = {"samples": [max(s) for s in zip(*per_rank)],
                     "peak_extra_bytes": max(g["peaks"][name]["peak_extra_bytes"]
                                             for g in gathered),
                     "memory_method": gathered[0]["peaks"][name]["memory_method"],
                     "local_numel": [g["local_numel"] for g in gathered]}
    return out
