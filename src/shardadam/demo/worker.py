"""One rank of one demo phase: train the FSDP2-sharded transformer, optionally save or
resume a DCP checkpoint, and write this rank's figures as JSON.

``launcher`` starts ``world_size`` of these with the same ``config``, a plain dict
(``cli.phase_config``). Rank 0 prints one line per step.
"""

import json
import math
import os
import resource
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import shardadam

from .. import peers
from .config import PRESETS, SIZES
from .data import VOCAB_SIZE, Batches
from .model import Transformer

BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1


def lr_at(step, steps, peak):
    """Linear warm-up over the first tenth, then cosine down to a tenth of the peak.

    A function of the step alone, so a resumed run needs no scheduler state.
    """
    warmup = max(1, steps // 10)
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def build_model(config, mesh):
    size = SIZES[config["size"]]
    torch.manual_seed(config["seed"])  # every rank builds the same full model first
    model = Transformer(VOCAB_SIZE, size)
    if config["optimizer"] == "shardadam":
        model.to(getattr(torch, PRESETS[config["preset"]].param_dtype))
    # Compute in fp32 whatever the parameters are stored in: CPU bf16 matmuls are
    # far slower than fp32 ones, and both runs then differ only in the optimizer.
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum gradients over ranks; each rank's loss is already divided by the
            # global token count, so the gradient is the same for any rank count.
            if hasattr(module, "set_gradient_divide_factor"):  # torch >= 2.8
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
            else:  # torch 2.7's name for the same
                module.set_reduce_scatter_divide_factor(1.0)
    return model


def build_optimizer(config, model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY},
              {"params": no_decay, "weight_decay": 0.0}]
    if config["optimizer"] == "adamw":
        return torch.optim.AdamW(groups, lr=0.0, betas=BETAS, eps=EPS, fused=True)
    if config["optimizer"] in peers.PEERS:
        return peers.make(config["optimizer"], groups, lr=0.0, betas=BETAS, eps=EPS)
    return shardadam.FusedAdam(groups, lr=0.0, betas=BETAS, eps=EPS, adam_w_mode=True,
                               **PRESETS[config["preset"]].fused_adam_kwargs())


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _step_count(optimizer):
    group = optimizer.param_groups[0]
    if "step" in group:  # FusedAdam keeps it per group
        return int(group["step"])
    first = optimizer.state[group["params"][0]]
    return int(_local(first["step"]).item())


def memory_figures(model, optimizer):
    """Bytes of this rank's parameter shards and optimizer state (``peers.state_bytes``:
    FusedAdam's scales and the codes and scales inside torchao's states included)."""
    param_bytes = sum(_local(p).numel() * _local(p).element_size()
                      for p in model.parameters())
    return param_bytes, peers.state_bytes(optimizer)


def save_checkpoint(path, model, optimizer):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load_checkpoint(path, model, optimizer):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def _progress_line(config, step, loss, tokens_per_s, opt_ms):
    line = (f"  {config['label']:<28} step {step:>4}/{config['steps']}  loss {loss:.4f}"
            f"  {tokens_per_s / 1e3:6.1f}k tok/s  opt {opt_ms:6.2f} ms")
    reference = config.get("reference", {}).get(str(step))
    if reference is not None:
        line += f"  (uninterrupted {reference:.4f}, diff {loss - reference:+.1e})"
    return line


def train(rank, world_size, config):
    mesh = init_device_mesh("cpu", (world_size,))
    model = build_model(config, mesh)
    optimizer = build_optimizer(config, model)
    start = config["start_step"]
    if start:
        load_checkpoint(config["checkpoint"], model, optimizer)
        if _step_count(optimizer) != start:
            raise RuntimeError(f"checkpoint holds step {_step_count(optimizer)}, "
                               f"expected {start}")
    size = SIZES[config["size"]]
    batches = Batches(config["corpus"], size.seq_len, size.rows, config["seed"])
    global_tokens = batches.tokens_per_step
    records = []
    for step in range(start + 1, config["steps"] + 1):
        if rank == config.get("fail_rank") and step == config.get("fail_step"):
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        began = time.perf_counter()
        rows = batches.local_batch(step, rank, world_size)
        logits = model(rows[:, :-1])
        loss_sum = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), rows[:, 1:].reshape(-1),
                                   reduction="sum")
        (loss_sum / global_tokens).backward()
        lr = lr_at(step, config["steps"], size.lr)
        for group in optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # torchao's: a tensor, updated in place
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        opt_began = time.perf_counter()
        optimizer.step()
        opt_s = time.perf_counter() - opt_began
        optimizer.zero_grad(set_to_none=True)
        # One collective per step: the global loss and the ranks' mean optimizer time.
        totals = torch.tensor([loss_sum.item(), opt_s], dtype=torch.float64)
        dist.all_reduce(totals)
        step_s = time.perf_counter() - began
        loss = totals[0].item() / global_tokens
        opt_ms = 1e3 * totals[1].item() / world_size
        records.append({"step": step, "loss": loss, "lr": lr, "opt_ms": opt_ms,
                        "step_s": step_s, "tokens_per_s": global_tokens / step_s})
        if not math.isfinite(loss):
            raise FloatingPointError(f"training diverged: loss is {loss} at step {step}")
        if rank == 0:
            print(_progress_line(config, step, loss, global_tokens / step_s, opt_ms),
                  flush=True)
        if step == config.get("save_at"):
            save_checkpoint(config["checkpoint"], model, optimizer)
    param_bytes, state_bytes = memory_figures(model, optimizer)
    return {
        "label": config["label"],
        "optimizer": config["optimizer"],
        "preset": config["preset"],
        "rank": rank,
        "world_size": world_size,
        "params": sum(p.numel() for p in model.parameters()),
        "param_bytes": param_bytes,
        "state_bytes": state_bytes,
        # Linux reports the high-water mark in KiB.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "start_rss_bytes": config["start_rss_bytes"],
        "steps": records if rank == 0 else [],
    }


def _current_rss():
    """Resident bytes now (Linux), before training: torch and the interpreter alone."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _init_process_group(rank, world_size, store_path, config, log):
    """gloo over a FileStore; gloo's connection notice goes to the log, not stdout."""
    saved_stdout = os.dup(1)
    os.dup2(log.fileno(), 1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=config["collective_timeout_s"]))
    finally:
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)


def main(rank, world_size, store_path, config):
    """Rank entry point; exits non-zero on any failure, with ``<phase>-rank<r>.error``
    holding when it failed (``time.monotonic()``, one clock for every process) and why."""
    results, phase = config["results"], config["phase"]
    log = open(os.path.join(results, f"{phase}-rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 2)
    sys.stderr = log
    if rank != 0:  # only rank 0 reports progress
        os.dup2(log.fileno(), 1)
        sys.stdout = log
    torch.set_num_threads(config["threads"])
    config = dict(config, start_rss_bytes=_current_rss())
    try:
        _init_process_group(rank, world_size, store_path, config, log)
        figures = train(rank, world_size, config)
        with open(os.path.join(results, f"{phase}-rank{rank}.json"), "w") as f:
            json.dump(figures, f)
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - report every way a rank can end
        failed_at = time.monotonic()
        traceback.print_exc()
        with open(os.path.join(results, f"{phase}-rank{rank}.error"), "w") as f:
            f.write(f"{failed_at!r}\n" + f"{type(error).__name__}: {error}".splitlines()[0])
        sys.stderr.flush()
        os._exit(1)  # skip teardown that could wait on peers that are gone
