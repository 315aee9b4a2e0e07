"""Megatron Core builds its optimizer with shardadam.FusedAdam as its Adam (README recipe),
on one CPU rank: ``get_megatron_optimizer`` with the distributed optimizer and the
precision-aware options (bf16 moments, fp32 main parameters, decoupled gradients).

Run as its own process by test_megatron_core.py: the recipe must come before anything
imports megatron.core, and the CPU stand-ins below change torch for the whole process.
Every step of the inner optimizer is checked against the float64 Adam reference of
_optimizer_testing (tolerances from the storage dtypes); one JSON line reports what
Megatron built.
"""

import json
import os
import sys
import tempfile
import types

import torch
import torch.distributed as dist

import shardadam

# The recipe (README "Megatron Core"): Megatron imports TE's FusedAdam from this module.
sys.modules["transformer_engine.pytorch.optimizers"] = types.SimpleNamespace(
    FusedAdam=shardadam.FusedAdam, FusedSGD=torch.optim.SGD)

import megatron.core.utils as megatron_utils  # noqa: E402
from packaging.version import Version  # noqa: E402

# The precision-aware options check TE's version (optimizer_config.py:383), None here.
megatron_utils._te_version = Version("2.9.0")

# CPU stand-ins for Megatron Core's CUDA-only lines (docs/guarantees.md): the device it
# allocates on (distributed/param_and_grad_buffer.py:800, 806; optimizer/optimizer.py:485;
# clip_grads.py:103; utils.py:1207) and the tensor type names it accepts
# (distrib_optimizer.py:361, 582).
torch.cuda.current_device = lambda: "cpu"
_tensor, _zeros, _type = torch.tensor, torch.zeros, torch.Tensor.type


def _on_cpu(kwargs):
    return dict(kwargs, device="cpu") if kwargs.get("device") == "cuda" else kwargs


torch.tensor = lambda *args, **kwargs: _tensor(*args, **_on_cpu(kwargs))
torch.zeros = lambda *args, **kwargs: _zeros(*args, **_on_cpu(kwargs))


def _cuda_type_name(self, *args, **kwargs):
    name = _type(self, *args, **kwargs)
    if not (args or kwargs) and name in ("torch.HalfTensor", "torch.BFloat16Tensor",
                                         "torch.FloatTensor"):
        return name.replace("torch.", "torch.cuda.", 1)
    return name


torch.Tensor.type = _cuda_type_name

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel, DistributedDataParallelConfig)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402

from _optimizer_testing import Hyper, capture_inputs, verify_step  # noqa: E402

STEPS = 3


class _Tiny(MegatronModule):
    def __init__(self, config):
        super().__init__(config=config)
        self.fc1 = torch.nn.Linear(16, 12)
        self.fc2 = torch.nn.Linear(12, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _checked_steps(inner, hyper):
    """Wrap the inner optimizer's step: every one checked against the float64 reference
    from what it read (parameters, masters, moments, Megatron's decoupled gradients)."""
    step_once, count = inner.step, [0]

    def step(*args, **kwargs):
        params = [p for group in inner.param_groups for p in group["params"]]
        grads = [getattr(p, "decoupled_grad", None) for p in params]
        grads = [None if g is None else g.clone() for g in grads]
        inputs = capture_inputs(inner, params)
        result = step_once(*args, **kwargs)
        count[0] += 1
        verify_step(inner, params, inputs, grads, hyper, count[0], "megatron-core")
        return result

    inner.step = step
    return count


def main():
    store = tempfile.mktemp(prefix="megatron-core-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1,
                                   bf16=True, params_dtype=torch.bfloat16)
        torch.manual_seed(0)
        model = _Tiny(config).to(torch.bfloat16)
        chunk = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-2, weight_decay=0.01, bf16=True, clip_grad=0.0,
            use_distributed_optimizer=True, use_precision_aware_optimizer=True,
            exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
            main_params_dtype=torch.float32), [chunk])
        inner = optimizer.chained_optimizers[0].optimizer
        assert type(inner) is shardadam.FusedAdam, f"Megatron built {type(inner)}"
        group = inner.param_groups[0]
        hyper = Hyper(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                      weight_decay=group["weight_decay"], adam_w_mode=bool(inner.adam_w_mode))
        steps = _checked_steps(inner, hyper)
        before = model.fc1.weight.detach().clone()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
        losses = []
        for _ in range(STEPS):
            chunk.zero_grad_buffer()
            optimizer.zero_grad()
            loss = chunk(x).float().pow(2).mean()
            loss.backward()
            chunk.finish_grad_sync()
            ok, _, _ = optimizer.step()
            assert ok, "Megatron skipped the step"
            losses.append(loss.item())
        state = inner.state[group["params"][0]]
        print(json.dumps({
            "inner_steps": steps[0], "losses": losses,
            "moved": bool((model.fc1.weight.detach() != before).any()),
            "config": inner.state_dict()["param_groups"][0]["state_layout"],
            "decoupled": bool(inner.use_decoupled_grad),
            "state_dtypes": {k: str(v.dtype) for k, v in state.items()}}))
    finally:
        dist.destroy_process_group()
        os.unlink(store)


if __name__ == "__main__":
    main()
