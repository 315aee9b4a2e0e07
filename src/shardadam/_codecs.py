"""The formats' codecs in torch ops: the scale rule (SEMANTICS S2.3) and the remainder
split (S2.5), bit for bit what the C++ core does.

``_formats`` declares which format uses what; the rounding of a value into a format's
codes is torch's own ``.to()`` (S2.4), so only these rules are written here.
"""

from __future__ import annotations

import torch

_TINY = torch.finfo(torch.float32).tiny


def measure_scale(value: torch.Tensor, target: float) -> torch.Tensor:
    """S2.3: the scale of fp32 ``value`` stored with largest magnitude ``target``, as a
    0-dim fp32 tensor: ``max(max|value| / target, tiny)``, or 1 for an empty tensor or a
    zero or non-finite maximum."""
    one = torch.ones((), dtype=torch.float32, device=value.device)
    if value.numel() == 0:
        return one
    absmax = torch.amax(torch.abs(value))  # NaN propagates, and NaN is not finite
    # A device tensor divisor: CUDA would multiply by the reciprocal of a host scalar.
    target = torch.full((), target, dtype=torch.float32, device=value.device)
    scale = torch.clamp_min(absmax / target, _TINY)
    return torch.where(torch.isfinite(absmax) & (absmax > 0), scale, one)


def merge_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master rebuilt from a bf16 parameter and its int16 remainder (S2.5)."""
    # The split rounded the high half up when the low half was >= 0x8000 (negative as
    # int16); undo that, then lay the halves side by side (little-endian) as one fp32.
    high = param.view(torch.int16) - (remainder < 0).to(torch.int16)
    pair = torch.stack((remainder, high), dim=-1)
    return pair.view(torch.float32).squeeze(-1)


def split_remainder(master: torch.Tensor):
    """The bf16 parameter bits and the int16 remainder of an fp32 master (S2.5)."""
    bits = master.contiguous().reshape(-1).view(torch.int32)
    # A NaN splits as the quiet NaN with its sign, so that the parameter is NaN too:
    # its own bits may round the high half from 0x7FFF to 0x8000 (-0).
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    bits = torch.where(nan, (bits & -0x80000000) | 0x7FC00000, bits)
    halves = bits.view(torch.int16).view(-1, 2)
    low, high = halves[:, 0], halves[:, 1]
    high = high + (low < 0).to(torch.int16)
    return (high.view(torch.bfloat16).reshape(master.shape),
            low.reshape(master.shape))
