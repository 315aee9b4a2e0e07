"""The optimizers timed, each behind ``make(name, params, preset) -> step callable``.

Every contender runs AdamW with the same hyper-parameters on its own copy of the same
parameters (``cases.make_params`` with one seed), except those that time the
shardadam contender's own step under other conditions (``SHARING``). ``Unavailable``
says why one cannot run here (a package that is not installed, a layout it rejects);
the run reports that reason instead of a time.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import peers
from ..peers import Unavailable  # noqa: F401 - the runner catches it from here
from .multipass import Multipass

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}

DESCRIPTIONS = {
    "shardadam": "shardadam.FusedAdam (C++ core)",
    "shardadam-sr": "shardadam.FusedAdam, the same moments, bf16 params rounded "
                    "stochastically with no master (the peers' state)",
    "shardadam-torch-path": "shardadam.FusedAdam on its pure-torch path (S7.2: devices "
                            "without a C++ build), forced on CPU",
    "torch-fused": "torch.optim.AdamW(fused=True)",
    "torch-foreach": "torch.optim.AdamW(foreach=True)",
    "torch-default": "torch.optim.AdamW() (on CPU tensors torch picks its for-loop step)",
    "deepspeed": "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)",
    "multipass": "multipass: per chunk, fp32 buffers -> torch._fused_adamw_ -> rescale",
    **{name: what for name, (_, _, what) in peers.PEERS.items()},
    "probe": "bandwidth probe: same arrays, in-place integer adds",
    "dtensor": "shardadam.FusedAdam on DTensor (Shard(0)) parameters",
    "plain": "shardadam.FusedAdam on the same local tensors, plain",
    "after-matmul": "shardadam.FusedAdam right after a 512x512 matmul",
    "after-backward": "shardadam.FusedAdam right after a small MLP's forward + backward",
    "after-backward-pool": "the same, workers on the core's own pool, not torch's OpenMP",
    "core": "the C++ core alone: one _C.adam_step call on FusedAdam's prepared slots",
}


# Contenders that keep bf16 params and their moments only, whatever the case's master:
# their bytes moved and held are the case's layout without it.
NO_MASTER = ("shardadam-sr", *peers.PEERS)


def layout_of(name: str, preset):
    """The layout contender ``name`` steps in a case of ``preset``: its byte counts."""
    if name in NO_MASTER and preset.master is not None:
        return dataclasses.replace(preset, master=None)
    return preset


def _shardadam(params, preset):
    from shardadam import FusedAdam

    return FusedAdam(params, **HYPER, adam_w_mode=True, **preset.fused_adam_kwargs()).step


def _shardadam_sr(params, preset):
    # The low-bit peers keep bf16 params and their moments only: the same state.
    if preset.moment_format is None or preset.param_dtype is not torch.bfloat16:
        raise Unavailable("for per-block moments beside bf16 params only")
    from shardadam import FusedAdam

    return FusedAdam(params, **HYPER, adam_w_mode=True, moment_format=preset.moment_format,
                     param_rounding="stochastic").step


def _shardadam_torch_path(params, preset):
    from shardadam import _backend

    step = _shardadam(params, preset)

    def on_torch_path():
        with _backend.use_backend("torch"):
            step()

    on_torch_path.__self__ = step.__self__  # the optimizer, as a bound step's (state_bytes)
    return on_torch_path


def _torch_adamw(params, preset, **flags):
    if preset.master is not None:
        raise Unavailable("torch AdamW keeps no master weights and only param-dtype state")
    return torch.optim.AdamW(params, **HYPER, **flags).step


def _deepspeed(params, preset):
    if preset.master is not None:
        # Its bf16/fp16 params are updated in place, with no fp32 master: ZeRO-Offload
        # steps an fp32 copy on the CPU, which is the fp32 case.
        raise Unavailable("DeepSpeedCPUAdam keeps no master weights (it rounds bf16/fp16 "
                          "params in place each step); its fp32 step is the fp32 cases")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as error:  # ImportError, or its op build failing at import
        raise Unavailable(f"deepspeed not importable: {type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}") from None
    try:
        return DeepSpeedCPUAdam(params, **HYPER, adamw_mode=True).step
    except Exception as error:  # the JIT build of its C++ op
        raise Unavailable(f"DeepSpeedCPUAdam failed to build: {error}") from None


def _peer(name):
    return lambda params, preset: peers.make(name, params, **HYPER).step


def _after(work, runtime="auto"):
    def make(params, preset, shardadam=None):
        try:
            from .training import AfterTorchWork
        except ImportError as error:  # no C++ core: nothing runs threads of its own
            raise Unavailable(f"the C++ core is not importable: {error}") from None
        return AfterTorchWork(shardadam or _shardadam(params(), preset), work, runtime)
    return make


def _core(params, preset, shardadam=None):
    try:
        from .core_call import CoreCall
    except ImportError as error:
        raise Unavailable(f"the C++ core is not importable: {error}") from None
    return CoreCall((shardadam or _shardadam(params(), preset)).__self__)


def _multipass(params, preset):
    if preset.master is None:
        raise Unavailable("all-fp32 state needs no unscale/rescale passes")
    return Multipass(params, preset, **HYPER).step


_FACTORIES = {
    "shardadam": _shardadam,
    "shardadam-sr": _shardadam_sr,
    "shardadam-torch-path": _shardadam_torch_path,
    "torch-fused": lambda params, preset: _torch_adamw(params, preset, fused=True),
    "torch-foreach": lambda params, preset: _torch_adamw(params, preset, foreach=True),
    "torch-default": _torch_adamw,
    "deepspeed": _deepspeed,
    "multipass": _multipass,
    **{name: _peer(name) for name in peers.PEERS},
    "after-matmul": _after("matmul"),
    "after-backward": _after("backward"),
    "after-backward-pool": _after("backward", "pool"),
    "core": _core,
}


def state_bytes(step) -> Optional[int]:
    """Bytes of optimizer state behind a contender's step (every tensor in
    ``optimizer.state``, master copies included, and FusedAdam's scales, which it keeps
    beside the state as TE does), or None where the step is not a torch optimizer's."""
    optimizer = getattr(step, "__self__", None)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    return peers.state_bytes(optimizer)


def names() -> tuple:
    return tuple(_FACTORIES)


# Contenders that time the shardadam contender's own step under other conditions (the
# bare core call, the step after torch's work): given that step, they use its optimizer
# and tensors, so what they measure differs from it only by those conditions. With
# copies of their own, where the memory of each copy landed moved their ratios to it by
# up to 9% from one process to the next (docs/benchmarking.md).
SHARING = ("core", "after-matmul", "after-backward", "after-backward-pool")


def make(name: str, params, preset, shardadam=None):
    """A zero-argument callable that performs one optimizer step on the tensors
    ``params()`` makes, or, for a contender in ``SHARING`` given the shardadam
    contender's step (``shardadam``), on that step's optimizer."""
    if name in SHARING:
        return _FACTORIES[name](params, preset, shardadam)
    return _FACTORIES[name](params(), preset)
