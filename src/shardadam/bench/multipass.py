"""multipass: the usual multi-pass path for low-precision state, as a contender.

Per chunk of each parameter: widen every stored stream into fp32 working buffers
(grad, moments, the master rebuilt from bf16 + int16 remainder), run
``torch._fused_adamw_`` on them, then narrow / rescale back into storage. This is what a
device without a fused low-precision kernel does, written with care: the buffers are
one chunk long, allocated once and reused, so a step allocates nothing and its
chunks' copies stay in the caches. Per-tensor fp8 moments need their new scale before
any code is stored, so they take one more pass first, computing the new moments to find
their absolute maxima; their codes decode through a 256-entry table (twice as fast as
torch's fp8 conversion on CPU). What remains is the cost shardadam's single pass
avoids: each stream is converted and copied again around the update, and torch's
kernel is called once per chunk.
"""

from __future__ import annotations

import torch

_FP8_MAX = 448.0  # largest finite float8_e4m3fn
CHUNK = 1 << 18   # elements per chunk: four fp32 buffers of 1 MiB


def _absmax(value32: torch.Tensor) -> torch.Tensor:
    low, high = torch.aminmax(value32)  # one pass; abs() would write a copy
    return torch.maximum(high, low.neg())


# Every E4M3 code's value: a lookup decodes codes twice as fast as torch's conversion.
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _merge_master(param, remainder, out32) -> None:
    """fp32 bits = (bf16 bits << 16) + sign-extended remainder, modulo 2^32 (TE's
    scheme: a negative remainder borrows back the +1 the split rounded into the
    param), built in ``out32``'s memory."""
    bits = out32.view(torch.int32)
    bits.copy_(param.view(torch.int16))
    bits.bitwise_left_shift_(16).add_(remainder)


def _split_master(master32, param, remainder) -> None:
    """remainder = low 16 bits; param = high half, rounded up when the low half is
    >= 0x8000 (``master32``'s memory is used up)."""
    bits = master32.view(torch.int32)
    remainder.copy_(bits)  # int32 -> int16 keeps the low 16 bits
    bits.add_(0x8000).bitwise_right_shift_(16)
    param.view(torch.int16).copy_(bits)


class Multipass:
    """AdamW over low-precision state, chunk by chunk: widen -> fused kernel -> narrow."""

    def __init__(self, params, preset, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01, chunk=CHUNK):
        self.params = list(params)
        self.preset = preset
        self.betas = betas
        self.hyper = dict(lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay,
                          eps=eps, amsgrad=False, maximize=False)
        self.state = [self._initial_state(p) for p in self.params]
        self.chunk = max(1, min(chunk, max((p.numel() for p in self.params), default=1)))
        # grad, both moments and (for remainders) the master: 4 bytes each; fp8 codes'
        # lookup indices: 8.
        self._buffers = torch.empty(4, self.chunk, dtype=torch.float32)
        fp8 = preset.moment_dtype == torch.uint8
        self._codes = torch.empty(self.chunk if fp8 else 0, dtype=torch.int64)

    @property
    def working_bytes(self) -> int:
        """Memory held between steps beyond the state: the working buffers."""
        return self._buffers.nbytes + self._codes.nbytes

    def _initial_state(self, param):
        flat = param.detach().view(-1)
        moment = torch.zeros_like(flat, dtype=self.preset.moment_dtype)
        state = {"exp_avg": moment, "exp_avg_sq": moment.clone(),
                 "scales": [torch.ones(()), torch.ones(())],
                 "step": torch.zeros((), dtype=torch.float32)}
        if self.preset.master == "fp32":
            state["master"] = flat.float()
        elif self.preset.master == "remainder":
            state["master"] = torch.zeros_like(flat, dtype=torch.int16)
        return state

    def _moments32(self, state, span, buffers) -> list:
        """Both moments of ``span`` in fp32: fp32 ones where they are stored, the
        others widened into ``buffers``."""
        out = []
        for name, scale, buffer in zip(("exp_avg", "exp_avg_sq"), state["scales"], buffers):
            stored = state[name][span]
            if stored.dtype == torch.float32:
                out.append(stored)
            elif stored.dtype == torch.uint8:
                codes = self._codes[:stored.numel()].copy_(stored)
                out.append(torch.take(_FP8_VALUES, codes, out=buffer).mul_(scale))
            else:
                out.append(buffer.copy_(stored))
        return out

    def _new_fp8_scales(self, param, state) -> list:
        """The per-tensor scales of the new moments: one pass that computes them."""
        beta1, beta2 = self.betas
        grad = param.grad.view(-1)
        maxima = [torch.zeros(()), torch.zeros(())]
        g32, m32, v32, _ = self._buffers
        for start in range(0, grad.numel(), self.chunk):
            span = slice(start, min(grad.numel(), start + self.chunk))
            k = span.stop - start
            g = g32[:k].copy_(grad[span])
            m, v = self._moments32(state, span, (m32[:k], v32[:k]))
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            for i, value in enumerate((m, v)):
                torch.maximum(maxima[i], _absmax(value), out=maxima[i])
        return [peak.clamp_min(1e-30) / _FP8_MAX for peak in maxima]

    @torch.no_grad()
    def step(self):
        g32, m32, v32, w32 = self._buffers
        for param, state in zip(self.params, self.state):
            fp8 = state["exp_avg"].dtype == torch.uint8
            new_scales = self._new_fp8_scales(param, state) if fp8 else None
            state["step"] += 1
            flat, grad = param.detach().view(-1), param.grad.view(-1)
            for start in range(0, flat.numel(), self.chunk):
                span = slice(start, min(flat.numel(), start + self.chunk))
                k = span.stop - start
                g = g32[:k].copy_(grad[span])
                m, v = self._moments32(state, span, (m32[:k], v32[:k]))
                if self.preset.master == "remainder":
                    w = w32[:k]
                    _merge_master(flat[span], state["master"][span], w)
                else:
                    w = state["master"][span]
                torch._fused_adamw_([w], [g], [m], [v], [], [state["step"]], **self.hyper)
                for i, (name, value) in enumerate((("exp_avg", m), ("exp_avg_sq", v))):
                    stored = state[name][span]
                    if fp8:
                        stored.view(torch.float8_e4m3fn).copy_(value.div_(new_scales[i]))
                    elif stored.dtype != torch.float32:  # fp32 ones were updated in place
                        stored.copy_(value)
                if self.preset.master == "remainder":
                    _split_master(w, flat[span], state["master"][span])
                else:
                    flat[span].copy_(w)
            if fp8:
                state["scales"] = new_scales
