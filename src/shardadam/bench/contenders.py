"""The optimizers timed, each behind ``make(name, params, preset) -> step callable``.

Every contender runs AdamW with the same hyper-parameters on its own copy of the same
parameters (``cases.make_params`` with one seed). ``Unavailable`` says why one cannot
run here (a package that is not installed, a layout it rejects); the run reports that
reason instead of a time.
"""

from __future__ import annotations

import torch

from .multipass import Multipass

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}

DESCRIPTIONS = {
    "shardadam": "shardadam.FusedAdam (C++ core)",
    "torch-fused": "torch.optim.AdamW(fused=True)",
    "torch-foreach": "torch.optim.AdamW(foreach=True)",
    "deepspeed": "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)",
    "multipass": "multipass: fp32 copies -> torch._fused_adamw_ -> rescale",
    "probe": "bandwidth probe: same arrays, in-place integer adds",
    "dtensor": "shardadam.FusedAdam on DTensor (Shard(0)) parameters",
    "plain": "shardadam.FusedAdam on the same local tensors, plain",
}


class Unavailable(Exception):
    """This contender cannot run here; the message says why."""


def _shardadam(params, preset):
    from shardadam import FusedAdam

    return FusedAdam(params, **HYPER, adam_w_mode=True, **preset.fused_adam_kwargs()).step


def _torch_adamw(params, preset, **flags):
    if preset.master is not None:
        raise Unavailable("torch AdamW keeps no master weights and only param-dtype state")
    return torch.optim.AdamW(params, **HYPER, **flags).step


def _deepspeed(params, preset):
    if preset.master is not None:
        raise Unavailable("DeepSpeedCPUAdam is benchmarked on fp32 parameters only")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as error:  # ImportError, or its op build failing at import
        raise Unavailable(f"deepspeed not importable: {type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}") from None
    try:
        return DeepSpeedCPUAdam(params, **HYPER, adamw_mode=True).step
    except Exception as error:  # the JIT build of its C++ op
        raise Unavailable(f"DeepSpeedCPUAdam failed to build: {error}") from None


def _multipass(params, preset):
    if preset.master is None:
        raise Unavailable("all-fp32 state needs no unscale/rescale passes")
    return Multipass(params, preset, **HYPER).step


_FACTORIES = {
    "shardadam": _shardadam,
    "torch-fused": lambda params, preset: _torch_adamw(params, preset, fused=True),
    "torch-foreach": lambda params, preset: _torch_adamw(params, preset, foreach=True),
    "deepspeed": _deepspeed,
    "multipass": _multipass,
}


def names() -> tuple:
    return tuple(_FACTORIES)


def make(name: str, params: list, preset):
    """A zero-argument callable that performs one optimizer step on ``params``."""
    return _FACTORIES[name](params, preset)
