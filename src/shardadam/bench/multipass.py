"""multipass: the usual multi-pass path for low-precision state, as a contender.

Per parameter: unscale / widen every stored stream to an fp32 copy (grad, moments, the
master rebuilt from bf16 + int16 remainder), run ``torch._fused_adamw_`` on the copies,
then narrow / rescale back into storage. This is what a device without a fused
low-precision kernel does; it moves each stream several times and allocates full-size
fp32 temporaries, which is the cost shardadam's single pass avoids.
"""

from __future__ import annotations

import torch

_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _fp8_encode(value32: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Per-tensor scale so the absolute maximum lands on fp8's largest finite value."""
    scale = value32.abs().max().clamp_min(1e-30) / _FP8_MAX
    codes.copy_(value32.div(scale).to(torch.float8_e4m3fn).view(torch.uint8))
    return scale


def _fp8_decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float().mul_(scale)


def _master_from_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """fp32 bits = bf16 bits (undoing round-to-nearest) << 16 | low 16 bits (TE's scheme:
    a negative remainder means the bf16 value was rounded up)."""
    high = param.view(torch.int16).to(torch.int32)
    low = remainder.to(torch.int32)
    high = high - (low < 0).to(torch.int32)
    return ((high << 16) | (low & 0xFFFF)).view(torch.float32)


def _split_master(master32: torch.Tensor, param: torch.Tensor,
                  remainder: torch.Tensor) -> None:
    bits = master32.view(torch.int32)
    low = (bits & 0xFFFF).to(torch.int16)
    high = (bits >> 16) + (low < 0).to(torch.int32)
    param.view(torch.int16).copy_(high.to(torch.int16))
    remainder.copy_(low)


class Multipass:
    """AdamW over low-precision state, one unscale -> fused kernel -> rescale per tensor."""

    def __init__(self, params, preset, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01):
        self.params = list(params)
        self.preset = preset
        self.hyper = dict(lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay,
                          eps=eps, amsgrad=False, maximize=False)
        self.state = [self._initial_state(p) for p in self.params]

    def _initial_state(self, param):
        flat = param.detach()
        moment = torch.zeros_like(flat, dtype=self.preset.moment_dtype)
        state = {"exp_avg": moment, "exp_avg_sq": moment.clone(),
                 "scales": [torch.ones(()), torch.ones(())],
                 "step": torch.zeros((), dtype=torch.float32)}
        if self.preset.master == "fp32":
            state["master"] = flat.float()
        elif self.preset.master == "remainder":
            state["master"] = torch.zeros_like(flat, dtype=torch.int16)
        return state

    def _moments32(self, state):
        out = []
        for name, scale in zip(("exp_avg", "exp_avg_sq"), state["scales"]):
            stored = state[name]
            out.append(_fp8_decode(stored, scale) if stored.dtype == torch.uint8
                       else stored.float())
        return out

    def _store_moments(self, state, moments32):
        for i, (name, value) in enumerate(zip(("exp_avg", "exp_avg_sq"), moments32)):
            stored = state[name]
            if stored.dtype == torch.uint8:
                state["scales"][i] = _fp8_encode(value, stored)
            elif stored.dtype != torch.float32:
                stored.copy_(value)

    @torch.no_grad()
    def step(self):
        for param, state in zip(self.params, self.state):
            grad32 = param.grad.float()
            if self.preset.master == "remainder":
                master32 = _master_from_remainder(param, state["master"])
            else:
                master32 = state["master"]
            exp_avg32, exp_avg_sq32 = self._moments32(state)
            state["step"] += 1
            torch._fused_adamw_([master32], [grad32], [exp_avg32], [exp_avg_sq32], [],
                                [state["step"]], **self.hyper)
            self._store_moments(state, (exp_avg32, exp_avg_sq32))
            if self.preset.master == "remainder":
                _split_master(master32, param, state["master"])
            else:
                param.copy_(master32)
