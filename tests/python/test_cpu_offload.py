"""FSDP2 with ``CPUOffloadPolicy``: the parameters' shards, their gradients and the
optimizer's states live on the CPU while the device mesh is CUDA's (docs/semantics.md
S2.6: states keep the parameter's mesh and are never moved to the mesh's device).

Each case runs real processes (one per rank) and checks, at every step:

* FusedAdam steps the CPU shards in the C++ CPU core (the torch path refuses to run),
  bitwise equal to a plain FusedAdam on copies of the local shards fed the same local
  gradients, updating FSDP2's storage in place;
* every state is a DTensor on the parameter's mesh and placements with a CPU local
  tensor (scales: CPU tensors);
* under a CUDA mesh, ``step()`` does no device work at all: nothing that synchronises
  (``torch.cuda.set_sync_debug_mode("error")``), no wait for the GPU (a stream kept
  busy is still busy after it), no device allocation, and under the profiler no
  kernel, copy or memset and no CUDA runtime or driver call;

then a DCP save and load (``get_state_dict`` / ``set_state_dict``) into a fresh model
and optimizer restores parameters, states, scales and the step count bitwise, and both
take the next step alike.

On a GPU machine: one GPU (world size 1, NCCL for FSDP2's collectives and gloo for
DCP's), and two where there are two. Without a GPU, the same checks run under a CPU mesh
(gloo) at world sizes 1 and 2: everything but the mesh's device type.
"""

import contextlib
import os
import re
import sys
import traceback
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from _optimizer_testing import assert_bitwise_equal, fused_adam, state_tensors

# (parameter dtype, FusedAdam keywords): FSDP2's fp32 shards with fp32, bf16 and
# per-tensor fp8 moments and block8 moments; bf16 shards with remainders.
PRESETS = {
    "fp32": (torch.float32, {}),
    "fp32-bf16-moments": (torch.float32, dict(exp_avg_dtype=torch.bfloat16,
                                              exp_avg_sq_dtype=torch.bfloat16)),
    "fp32-fp8-moments": (torch.float32, dict(exp_avg_dtype=torch.uint8,
                                             exp_avg_sq_dtype=torch.uint8)),
    "fp32-block8": (torch.float32, dict(moment_format="block8", moment_block_size=128)),
    "bf16-remainder": (torch.bfloat16, dict(master_weights=True, store_param_remainders=True,
                                            exp_avg_dtype=torch.bfloat16,
                                            exp_avg_sq_dtype=torch.bfloat16)),
}
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
STEPS = 3


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 96)
        self.down = nn.Linear(96, 16)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


def _model(device_type, mesh, dtype, seed):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    # Pinned host memory needs a GPU; FSDP2 pins by default.
    policy = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    torch.manual_seed(seed)
    model = _Mlp().to(dtype)
    fully_shard(model.up, mesh=mesh, offload_policy=policy)
    fully_shard(model.down, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model


def _backward(model, device_type, dtype, gen):
    # FSDP2 waits for its gradients' copies to the CPU before backward() returns.
    x = torch.randn(8, 32, generator=gen).to(device=device_type, dtype=dtype)
    model(x).float().square().mean().backward()


@contextlib.contextmanager
def _only_the_cpu_core(device_type, profiled=False):
    """The step runs in the C++ CPU core; under a CUDA mesh it does no device work.
    Unprofiled (the step's plain path): nothing that synchronises through torch (sync
    debug mode "error"), no wait for the GPU (a stream kept busy is still busy after
    it) and no device allocation. Profiled (its hooked path, which profilers take): no
    kernel, copy or memset, and no CUDA runtime or driver call inside the step."""
    from shardadam import _torch_path

    refuse = AssertionError("a CPU-offloaded shard took the torch path, not the C++ core")
    with mock.patch.object(_torch_path, "prepare", side_effect=refuse):
        if device_type != "cuda":
            yield
        elif profiled:
            from torch.profiler import ProfilerActivity, profile, record_function

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with record_function("step under test"):
                    yield
            events = prof.events()
            window = next(e for e in events if e.name == "step under test").time_range
            device = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            assert not device, f"step() did device work: {device[:10]}"
            calls = [e.name for e in events
                     if re.match(r"cu(da)?[A-Z]", e.name)
                     and window.start <= e.time_range.start <= window.end]
            assert not calls, f"step() called CUDA: {calls[:10]}"
        else:
            torch.cuda._sleep(200_000_000)  # about 0.1 s of work queued on the stream
            allocations = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert not torch.cuda.current_stream().query(), "step() waited for the GPU"
            assert torch.cuda.memory_stats().get("allocation.all.allocated", 0) == allocations, \
                "step() allocated device memory"


def _local(value):
    """A state's local tensor (scales are plain tensors)."""
    return value._local_tensor if hasattr(value, "_local_tensor") else value


def _check_layout(model, opt, mesh):
    for name, p in model.named_parameters():
        assert p.device_mesh == mesh and p._local_tensor.device.type == "cpu", \
            f"{name}: expected a CPU shard on {mesh}"
        for sname, value in state_tensors(opt, p).items():
            local = _local(value)
            assert local.device.type == "cpu", f"{name}.{sname} is on {local.device}"
            if sname in ("exp_avg", "exp_avg_sq", "master_param"):
                assert value.device_mesh == mesh and value.placements == p.placements, \
                    f"{name}.{sname}: {value.device_mesh} {value.placements}"


def _raw(model, opt):
    """Every parameter shard and stored state tensor, by name, cloned."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p._local_tensor.detach().clone()
        for sname, value in state_tensors(opt, p).items():
            local = _local(value)
            out[f"{name}.{sname}"] = local.detach().clone()
    return out


def _assert_same(got, want, what):
    assert sorted(got) == sorted(want), f"{what}: {sorted(got)} != {sorted(want)}"
    for key, value in want.items():
        assert_bitwise_equal(got[key], value, f"{what}: {key}")


def _job(rank, world, device_type, workdir, presets):
    """One rank (``_rank``), ended without the interpreter's teardown: torch 2.15's gloo
    thread can release a finished collective's work while Python finalizes, and abort
    the process (std::terminate, its thread taking the GIL as the interpreter exits).
    A failure's traceback goes to stderr and the exit status says it failed."""
    status = 0
    try:
        _rank(rank, world, device_type, workdir, presets)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _rank(rank, world, device_type, workdir, presets):
    """Every preset in turn (one process group: starting ranks costs more than a
    preset's checks), then an error naming each preset that failed."""
    from torch.distributed.device_mesh import init_device_mesh

    if device_type == "cuda":
        torch.cuda.set_device(rank)
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{workdir}/rendezvous", rank=rank,
                            world_size=world)
    failures = []
    try:
        mesh = init_device_mesh(device_type, (world,))
        for preset in presets:
            try:
                _check(rank, device_type, mesh, os.path.join(workdir, preset), preset)
            except Exception:
                failures.append(f"{preset}:\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    assert not failures, "\n".join(failures)


def _check(rank, device_type, mesh, workdir, preset):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dtype, kwargs = PRESETS[preset]
    FusedAdam = fused_adam()
    model = _model(device_type, mesh, dtype, seed=1)
    params = list(model.parameters())
    opt = FusedAdam(params, **HYPER, **kwargs)
    refs = [nn.Parameter(p._local_tensor.detach().clone()) for p in params]
    ref = FusedAdam(refs, **HYPER, **kwargs)
    storage = [p._local_tensor.data_ptr() for p in params]
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(1, STEPS + 1):
        _backward(model, device_type, dtype, gen)
        for p, r in zip(params, refs):
            assert p.grad._local_tensor.device.type == "cpu", "gradient not on the CPU"
            r.grad = p.grad._local_tensor.detach().clone()
        with _only_the_cpu_core(device_type):
            opt.step()
        ref.step()
        for (name, p), r, ptr in zip(model.named_parameters(), refs, storage):
            what = f"rank {rank} step {step}: {name}"
            assert p._local_tensor.data_ptr() == ptr, f"{what}: not updated in place"
            assert_bitwise_equal(p._local_tensor, r.detach(), f"{what} vs plain FusedAdam")
            mine, theirs = state_tensors(opt, p), state_tensors(ref, r)
            assert sorted(mine) == sorted(theirs), f"{what}: {sorted(mine)}"
            for sname, value in mine.items():
                local = _local(value)
                assert_bitwise_equal(local, theirs[sname], f"{what}.{sname}")
        _check_layout(model, opt, mesh)
        opt.zero_grad()
        ref.zero_grad()

    path = os.path.join(workdir, "checkpoint")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = _raw(model, opt)
    steps = [group["step"] for group in opt.param_groups]

    fresh = _model(device_type, mesh, dtype, seed=2)  # other weights: the load must win
    loaded = FusedAdam(list(fresh.parameters()), **HYPER, **kwargs)
    model_sd, optim_sd = get_state_dict(fresh, loaded)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(fresh, loaded, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert [group["step"] for group in loaded.param_groups] == steps, "step count"
    _assert_same(_raw(fresh, loaded), saved, f"rank {rank}: loaded from DCP")
    _check_layout(fresh, loaded, mesh)

    # Both take the next step alike, from the same input, watched by the profiler.
    for m, o in ((model, opt), (fresh, loaded)):
        _backward(m, device_type, dtype, torch.Generator().manual_seed(200 + rank))
        with _only_the_cpu_core(device_type, profiled=True):
            o.step()
    _assert_same(_raw(fresh, loaded), _raw(model, opt), f"rank {rank}: step after the load")


def _run(world, device_type, presets, tmp_path):
    mp.start_processes(_job, args=(world, device_type, str(tmp_path), presets), nprocs=world,
                       start_method="spawn", join=True)


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
def test_fsdp2_cpu_offload_under_a_cuda_mesh(tmp_path):
    _run(1, "cuda", list(PRESETS), tmp_path)


@pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA GPUs")
def test_fsdp2_cpu_offload_under_a_cuda_mesh_on_two_gpus(tmp_path):
    _run(2, "cuda", list(PRESETS), tmp_path)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("preset", ["fp32", "fp32-fp8-moments", "bf16-remainder"])
def test_fsdp2_cpu_offload_under_a_cpu_mesh(preset, world, tmp_path):
    _run(world, "cpu", [preset], tmp_path)
