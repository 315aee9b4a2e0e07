"""The demo's named choices: optimizer-state presets (``--state``) and model sizes
(``--model``).

Kept free of torch imports so that the command line can reject a bad choice at once;
dtypes are spelled as ``torch`` attribute names and resolved in the worker.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class StatePreset:
    name: str
    summary: str
    param_dtype: str            # dtype of the sharded parameters the model trains
    exp_avg_dtype: str          # "uint8" means fp8 E4M3 codes with a per-tensor scale
    exp_avg_sq_dtype: str
    master_weights: bool = False
    store_param_remainders: bool = False
    moment_format: str = ""     # FusedAdam moment_format (S2.11) instead of the dtypes
    param_rounding: str = "nearest"  # FusedAdam param_rounding (S2.14)
    # Resume check (report.resume_check): largest |loss difference| allowed over the
    # first report.EARLY_STEPS resumed steps.
    resume_tolerance: float = 2e-6

    def fused_adam_kwargs(self):
        """Keyword arguments for ``shardadam.FusedAdam`` (dtypes resolved here)."""
        import torch

        kwargs = {"master_weights": self.master_weights,
                  "master_weight_dtype": torch.float32,
                  "store_param_remainders": self.store_param_remainders,
                  "exp_avg_dtype": getattr(torch, self.exp_avg_dtype),
                  "exp_avg_sq_dtype": getattr(torch, self.exp_avg_sq_dtype)}
        if self.moment_format:
            kwargs["moment_format"] = self.moment_format
        if self.param_rounding != "nearest":
            kwargs["param_rounding"] = self.param_rounding
        return kwargs


PRESETS = {p.name: p for p in (
    StatePreset("remainder-bf16",
                "bf16 params + int16 remainders (exact fp32 master), bf16 moments",
                "bfloat16", "bfloat16", "bfloat16", master_weights=True,
                store_param_remainders=True),
    StatePreset("master-bf16", "bf16 params + fp32 master, bf16 moments",
                "bfloat16", "bfloat16", "bfloat16", master_weights=True),
    # fp8 for exp_avg only: |exp_avg| / sqrt(exp_avg_sq) stays near 1, so an element
    # flushed to zero by the per-tensor scale just skips an update. fp8 exp_avg_sq
    # (squared gradients span far more than E4M3's range) flushes small entries to zero
    # and blows their updates up: the small model diverges within 15 steps.
    StatePreset("remainder-fp8",
                "bf16 params + int16 remainders, fp8 E4M3 exp_avg (per-tensor scale), "
                "bf16 exp_avg_sq",
                "bfloat16", "uint8", "bfloat16", master_weights=True,
                store_param_remainders=True, resume_tolerance=2e-3),
    # 8-bit moments with one power-of-two scale per 256 elements: a block holds the
    # range of its own elements, so exp_avg_sq trains in 8 bits too. The 2 -> 3 rank
    # resume re-scales the blocks a new shard boundary cuts (the 1-D parameters', some
    # matrices'); measured, that moves the first resumed losses as little as the exact
    # presets' summation order does (report.py), so block8's bound is 1e-5.
    StatePreset("remainder-block8",
                "bf16 params + int16 remainders, 8-bit moments with a scale per block of "
                "256 (moment_format='block8')",
                "bfloat16", "float32", "float32", master_weights=True,
                store_param_remainders=True, moment_format="block8",
                resume_tolerance=1e-5),
    # 4-bit moments (signed E2M1 exp_avg, unsigned zero-free E3M1 exp_avg_sq) with one
    # power-of-two scale per 128 elements, packed two codes per byte; the 1-D
    # parameters (norms) cannot be packed by rows and keep block8 (S2.12).
    StatePreset("remainder-block4",
                "bf16 params + int16 remainders, 4-bit moments with a scale per block of "
                "128 (moment_format='block4')",
                "bfloat16", "float32", "float32", master_weights=True,
                store_param_remainders=True, moment_format="block4",
                resume_tolerance=5e-4),
    # No master at all: the bf16 parameters are the weights. Rounded to nearest, an
    # update below half a bf16 step is lost; rounded stochastically (S2.14) it moves
    # the weight by a full step with the matching probability. 2 + 2.03 bytes per
    # parameter with the parameters themselves.
    StatePreset("bf16-block8",
                "bf16 params without master (rounded to nearest), 8-bit moments with a "
                "scale per block of 256",
                "bfloat16", "float32", "float32", moment_format="block8",
                resume_tolerance=1e-5),
    StatePreset("bf16-sr-block8",
                "bf16 params without master, rounded stochastically "
                "(param_rounding='stochastic'), 8-bit moments with a scale per block of 256",
                "bfloat16", "float32", "float32", moment_format="block8",
                param_rounding="stochastic", resume_tolerance=1e-5),
    StatePreset("fp32", "fp32 params, fp32 moments (same state as torch's AdamW)",
                "float32", "float32", "float32"),
)}

# bf16 moments keep fp32's exponent range (no per-tensor scale to under- or overflow),
# and the remainder makes the fp32 master exact for 2 bytes: 6 state bytes per
# parameter, 8 with the bf16 parameter itself, against 12 for fp32 + AdamW.
DEFAULT_PRESET = "remainder-bf16"


@dataclass(frozen=True)
class ModelSize:
    dim: int
    layers: int
    heads: int
    seq_len: int
    rows: int            # sequences in the global batch of one step
    lr: float            # peak learning rate
    corpus_bytes: int    # how much standard-library source to train on


SIZES = {
    "small": ModelSize(dim=128, layers=4, heads=4, seq_len=128, rows=16, lr=3e-3,
                       corpus_bytes=8 << 20),
    "tiny": ModelSize(dim=32, layers=2, heads=2, seq_len=32, rows=8, lr=1e-2,
                      corpus_bytes=1 << 20),
}
