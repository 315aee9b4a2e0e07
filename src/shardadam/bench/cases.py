"""What is benchmarked: state presets, parameter lists, and the tensors built for them.

A ``Case`` is a preset plus a list of shapes. Everything is derived from
``(mode, scale)`` and fixed seeds, so a memory subprocess rebuilds exactly the case the
parent timed from its id alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

# Element sizes of the storage dtypes (fp8 moments are stored as uint8 codes).
_SIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.int16: 2,
         torch.uint8: 1}
_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.int16: "int16", torch.uint8: "fp8"}


# FusedAdam's ``moment_format`` values: the core's formats of each moment, and the
# bytes of one element's code.
_MOMENT_FORMATS = {"block8": ("fp8-block", "ufp8-block", 1),
                   "block4": ("fp4-block", "ufp4-block", 0.5)}


@dataclass(frozen=True)
class Preset:
    """One state layout. ``master`` is None, ``"fp32"`` or ``"remainder"`` (int16);
    ``moment_format`` FusedAdam's keyword (per-block moments, stored as 8- or 4-bit
    codes plus one fp32 scale per 256 or 128 elements, left out of the byte counts:
    0.016 and 0.031 bytes per element and moment); ``exp_avg_sq_dtype`` where it
    differs from ``moment_dtype``
    (``exp_avg``'s)."""

    name: str
    param_dtype: torch.dtype
    moment_dtype: torch.dtype
    master: Optional[str]
    moment_format: Optional[str] = None
    exp_avg_sq_dtype: Optional[torch.dtype] = None

    @property
    def _second_dtype(self) -> torch.dtype:
        return self.exp_avg_sq_dtype or self.moment_dtype

    def _moment_names(self) -> tuple:
        if self.moment_format is not None:
            return _MOMENT_FORMATS[self.moment_format][:2]
        return _NAME[self.moment_dtype], _NAME[self._second_dtype]

    def _moment_sizes(self) -> tuple:
        """Bytes of one element of each moment (scales left out)."""
        if self.moment_format is not None:
            return (_MOMENT_FORMATS[self.moment_format][2],) * 2
        return _SIZE[self.moment_dtype], _SIZE[self._second_dtype]

    @property
    def moment_size(self) -> float:
        """Bytes of one element of ``exp_avg`` (scales left out)."""
        return self._moment_sizes()[0]

    @property
    def label(self) -> str:
        """Same spelling as ``kernel_bench``'s presets, so its figures can be matched."""
        p = _NAME[self.param_dtype]
        m, v = self._moment_names()
        master = "" if self.master is None else f" master={self.master}"
        return f"p={p} g={p}{master} m={m} v={v}"

    @property
    def dtypes(self) -> dict:
        master = {None: None, "fp32": "fp32", "remainder": "int16"}[self.master]
        m, v = self._moment_names()
        return {"param": _NAME[self.param_dtype], "grad": _NAME[self.param_dtype],
                "master": master, "exp_avg": m, "exp_avg_sq": v}

    def _master_size(self) -> int:
        return {None: 0, "fp32": 4, "remainder": 2}[self.master]

    @property
    def minimum_bytes(self) -> float:
        """docs/benchmarking.md: bytes per element the step must read and write."""
        p, m, w = _SIZE[self.param_dtype], sum(self._moment_sizes()), self._master_size()
        # The weight read is the master, else the param; a remainder completes the param.
        weight_read = p if self.master in (None, "remainder") else 0
        reads = p + weight_read + w + m
        writes = p + w + m
        return reads + writes

    @property
    def effective_bytes(self) -> float:
        """Minimum plus the write-allocate read of a write-only param
        (docs/benchmarking.md)."""
        extra = _SIZE[self.param_dtype] if self.master == "fp32" else 0
        return self.minimum_bytes + extra

    @property
    def state_bytes_per_element(self) -> float:
        """Resident bytes: param, grad, both moments and the master."""
        return (2 * _SIZE[self.param_dtype] + sum(self._moment_sizes())
                + self._master_size())

    def fused_adam_kwargs(self) -> dict:
        """``shardadam.FusedAdam`` settings that give this layout."""
        if self.moment_format is not None:
            kwargs = {"moment_format": self.moment_format}
        else:
            kwargs = {"exp_avg_dtype": self.moment_dtype,
                      "exp_avg_sq_dtype": self._second_dtype}
        if self.master is not None:
            kwargs.update(master_weights=True, master_weight_dtype=torch.float32,
                          store_param_remainders=self.master == "remainder")
        return kwargs


PRESETS = {p.name: p for p in (
    Preset("fp32", torch.float32, torch.float32, None),
    Preset("bf16-master-fp32", torch.bfloat16, torch.float32, "fp32"),
    Preset("bf16-master-bf16m", torch.bfloat16, torch.bfloat16, "fp32"),
    Preset("bf16-remainder-bf16m", torch.bfloat16, torch.bfloat16, "remainder"),
    Preset("bf16-master-fp8m", torch.bfloat16, torch.uint8, "fp32"),
)}

# Beside the 8-bit and 4-bit optimizers of other packages (the "lowbit" cases), each
# with those of its width.
LOWBIT_CASES = (
    (Preset("bf16-remainder-block8", torch.bfloat16, torch.uint8, "remainder", "block8"),
     ("shardadam", "shardadam-sr", "torchao-adamw8bit", "torchao-adamwfp8",
      "bnb-adamw8bit", "shardadam-torch-path")),
    (Preset("bf16-remainder-block4", torch.bfloat16, torch.uint8, "remainder", "block4"),
     ("shardadam", "shardadam-sr", "torchao-adamw4bit", "shardadam-torch-path")),
)

# Sizes per mode before --scale. Large: not a power of two (buffers spaced by large
# powers of two alias in the caches) and >= 64 MiB of params, grads and state for the
# smallest large preset. The lowbit cases' weight has as many elements, so fewer bytes:
# quick, 53 MiB (block8 + remainders) and 47 MiB (block4), still beyond a 32 MiB L3.
_SIZES = {
    "quick": {"large_numel": 7_000_003, "d_model": 256, "reps": 7, "warmup": 2},
    "full": {"large_numel": 25_000_003, "d_model": 512, "reps": 15, "warmup": 3},
}
_LAYERS = 24
_MANY_TENSORS = 2000
_MANY_SIZES = (256, 8192)  # log-uniform element counts of the many-tensor case


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # "large", "training", "transformer", "many", "groups", "dtensor", "lowbit"
    preset: Preset
    shapes: tuple
    contenders: tuple
    note: str = ""
    numel: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "numel", sum(math.prod(s) for s in self.shapes))


def settings(mode: str) -> dict:
    return dict(_SIZES[mode])


def transformer_shapes(d_model: int) -> list:
    """A GPT-style decoder's parameters: token embedding, per layer two LayerNorms
    (weight, bias), fused QKV, output projection and a 4x MLP (no linear biases), a
    final LayerNorm. 24 layers -> 195 tensors."""
    d, vocab = d_model, 32 * d_model
    shapes = [(vocab, d)]
    for _ in range(_LAYERS):
        shapes += [(d,), (d,), (3 * d, d), (d, d), (d,), (d,), (4 * d, d), (d, 4 * d)]
    return shapes + [(d,), (d,)]


def many_shapes(scale: float) -> list:
    """2,000 one-dimensional tensors with log-uniform sizes (seeded)."""
    gen = torch.Generator().manual_seed(2000)
    low, high = (math.log(s) for s in _MANY_SIZES)
    logs = torch.empty(_MANY_TENSORS, dtype=torch.float64).uniform_(low, high, generator=gen)
    return [(max(1, round(math.exp(x) * scale)),) for x in logs.tolist()]


def _scaled_d_model(d_model: int, scale: float) -> int:
    # Parameter count grows with d^2: scale d by sqrt(scale); keep it even so Shard(0)
    # splits evenly on 2 ranks.
    return max(2, 2 * round(d_model * math.sqrt(scale) / 2))


CPU_FP32_CONTENDERS = ("shardadam", "torch-fused", "torch-foreach", "torch-default",
                       "deepspeed", "shardadam-torch-path")
LOW_PRECISION_CONTENDERS = ("shardadam", "multipass", "shardadam-torch-path")
# The large cases' step as training calls it (bench/training.py).
TRAINING_CONTENDERS = ("shardadam", "after-matmul", "after-backward", "after-backward-pool")
# The large and training cases also time the bare C++ call in process, interleaved
# (bench/core_call.py): the yardstick of FusedAdam.step() from the same run.
BARE = ("core",)


def build_cases(mode: str, scale: float = 1.0, kinds=None) -> list:
    """Every case of a run, in the order they are timed."""
    size = settings(mode)
    numel = max(1000, round(size["large_numel"] * scale))
    d_model = _scaled_d_model(size["d_model"], scale)
    cases = []
    for preset in PRESETS.values():
        contenders = (CPU_FP32_CONTENDERS if preset.master is None
                      else LOW_PRECISION_CONTENDERS)
        cases.append(Case(f"large/{preset.name}", "large", preset, ((numel,),),
                          contenders + BARE))
    for preset in PRESETS.values():
        cases.append(Case(f"training/{preset.name}", "training", preset, ((numel,),),
                          TRAINING_CONTENDERS + BARE, "the step right after torch's work"))
    fp32 = PRESETS["fp32"]
    cases.append(Case(f"transformer-d{d_model}/fp32", "transformer", fp32,
                      tuple(transformer_shapes(d_model)), CPU_FP32_CONTENDERS,
                      f"24-layer decoder, d_model {d_model}"))
    cases.append(Case("many-2000/fp32", "many", fp32, tuple(many_shapes(scale)),
                      CPU_FP32_CONTENDERS, "2,000 tensors, 256..8192 elements"))
    cases.append(Case("groups-2000/fp32", "groups", fp32, tuple(many_shapes(scale)),
                      CPU_FP32_CONTENDERS, "the many case, one parameter group per tensor "
                      "(per-parameter settings, layer-wise lr)"))
    cases.append(Case(f"dtensor-d{d_model}/fp32", "dtensor", fp32,
                      tuple(transformer_shapes(d_model)), ("dtensor", "plain"),
                      "FusedAdam, Shard(0) on 2 gloo ranks, 1 thread each"))
    # One 2-D weight: the other packages quantize per block of a flat tensor too.
    rows = max(1, round(numel / 4096))
    for preset, contenders in LOWBIT_CASES:
        width = preset.moment_format[-1]
        cases.append(Case(f"lowbit/{preset.name}", "lowbit", preset, ((rows, 4096),),
                          contenders, f"{width}-bit optimizer states, bf16 params"))
    if kinds is not None:
        cases = [c for c in cases if c.kind in kinds]
    return cases


def find_case(case_id: str, mode: str, scale: float) -> Case:
    for case in build_cases(mode, scale):
        if case.id == case_id:
            return case
    raise KeyError(case_id)


def optimizer_params(case: Case, seed: int = 0) -> list:
    """What each contender's optimizer is given: ``make_params``'s tensors, in one
    parameter group each for the groups case."""
    params = make_params(case, seed)
    return [{"params": [p]} for p in params] if case.kind == "groups" else params


def make_params(case: Case, seed: int = 0) -> list:
    """Fresh parameters with gradients, identical for every contender (same seed)."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in case.shapes:
        value = torch.randn(shape, generator=gen).mul_(0.02)
        grad = torch.randn(shape, generator=gen).mul_(1e-3)
        param = torch.nn.Parameter(value.to(case.preset.param_dtype))
        param.grad = grad.to(case.preset.param_dtype)
        params.append(param)
    return params
