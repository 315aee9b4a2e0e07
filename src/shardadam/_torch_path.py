"""The step with torch ops only (SEMANTICS S7.2): any device torch runs on.

It follows the C++ core's contract bit for bit on CPU: the same fp32 constants
(computed in double, rounded once, as ``MakeStepConstants`` in csrc/element.h), the
same order of operations as ``AdamElement`` (one rounding per op, nothing fused), and
the same codecs (each format's, ``_formats``). The math runs as ``torch._foreach_*``
ops over fp32 working lists: the stored fp32 tensors themselves, fp32 copies of
everything else, for one piece of the group at a time (``PIECE_CPU`` elements on CPU,
``PIECE_DEVICE`` elsewhere), so that they never hold more than a piece's worth.
"""

from __future__ import annotations

import contextlib
import math
from array import array
from typing import Optional

import torch

from . import _codecs, _float_mode, _plan, _validate


def _f32(value: float) -> float:
    """``value`` rounded to fp32 (to nearest even; out of range becomes inf)."""
    return array("f", [value])[0]


def step_constants(hyper) -> dict:
    """The per-step scalars of csrc/element.h ``MakeStepConstants``, as fp32 values."""
    t = float(hyper.step)
    c1 = _validate.bias_correction1(hyper)
    c2 = 1.0 - math.pow(hyper.beta2, t) if hyper.bias_correction else 1.0
    return {
        "beta1": _f32(hyper.beta1), "one_minus_beta1": _f32(1.0 - hyper.beta1),
        "beta2": _f32(hyper.beta2), "one_minus_beta2": _f32(1.0 - hyper.beta2),
        "weight_decay": _f32(hyper.weight_decay),
        "decay": _f32(1.0 - hyper.lr * hyper.weight_decay),
        "step_size": _f32(hyper.lr / c1),
        "bias_correction2_sqrt": _f32(math.sqrt(c2)),
        "eps": _f32(hyper.eps),
    }


def _on_device(value: float, device) -> torch.Tensor:
    """A divisor as a 0-dim tensor on ``device``: CUDA turns division by a host scalar
    into multiplication by its reciprocal, which rounds differently."""
    return torch.full((), value, dtype=torch.float32, device=device)


def _sqrt(values: list) -> list:
    """Correctly rounded fp32 square roots.

    torch's CPU sqrt goes through MKL's vector math, which is not correctly rounded
    (about one result in five is off by an ulp). Rounding the fp64 square root to fp32
    is (checked for every non-negative fp32). Other devices' sqrt is IEEE already, and
    some (MPS) have no fp64.
    """
    if values[0].device.type == "cpu":
        return [v.double().sqrt_().float() for v in values]
    return torch._foreach_sqrt(values)


def _weight(part):
    """fp32 working weight: the master (S2.5 / unscaled fp16 / fp32) or the parameter
    (an fp32 one itself)."""
    fmt = part.entry.master_format
    if fmt is None:
        return part.local.float()
    return fmt.true_value(fmt.decode(part.master, part.master_scale), part.local)


def _store_weight(part, w, step: int, measured) -> None:
    """The parameter from the updated ``w`` first (a remainder's high half, or rounded
    stochastically, S2.14), then the master (S3.6; ``measured``: its per-tensor scale
    measured over the whole tensor, where ``part`` is not all of it)."""
    entry = part.entry
    fmt = entry.master_format
    value, bits = (w, None) if fmt is None else fmt.from_true(w)
    param = w if bits is None else bits
    if entry.param_rounding:
        param = _codecs.bf16_encode_stochastic(w.reshape(-1), _codecs.random_bits(
            _codecs.param_step_key(entry.rounding_key, step), part.first, w.numel(),
            w.device)).view(part.local.shape)
    if param is not part.local:
        if part.local.dtype == torch.bfloat16 and param.dtype == torch.float32:
            param = _codecs.bf16_encode(param)  # NaN's sign kept (S2.4)
        part.local.copy_(param)
    if fmt is not None:
        fmt.encode(value, part.master, part.master_scale, measured=measured)


_WRITTEN = (("param", "local"), ("master_param", "master"), ("exp_avg", "exp_avg"),
            ("exp_avg_sq", "exp_avg_sq"), ("exp_avg_scale", "exp_avg_scale"),
            ("exp_avg_sq_scale", "exp_avg_sq_scale"), ("master_scale", "master_scale"))


def prepare(work):
    """``work`` with each gradient that the C++ paths read through a copy replaced by
    such a copy, taken before any batch of the step runs (``_plan.read_as_is``: the
    same gradients are then checked against the memory the step writes)."""
    if work.dense and work.batch.contiguous:
        return work
    grads = [g if g is None else _plan.laid_out(entry, g)
             for entry, g in zip(work.batch.entries, work.grads)]
    return type(work)(work.batch, grads, work.kinds,
                      all(g is None or g.is_contiguous() for g in grads))


def _written_spans(batch) -> list:
    """Per entry, the spans of the buffers a step writes. They stay while the batch's
    plan stands (binding it again clears ``backend_cache``)."""
    spans = batch.backend_cache.get("torch_written")
    if spans is None:
        spans = [[_validate.memory_span(tensor) + (name, tensor)
                  for name, attribute in _WRITTEN
                  if (tensor := getattr(entry, attribute)) is not None]
                 for entry in batch.entries]
        batch.backend_cache["torch_written"] = spans
    return spans


def check_shared_memory(works: list, passed: dict) -> None:
    """The core's rule on shared memory, for this step's torch-path batches (prepared)
    together: a gradient must not share memory with any buffer the step writes (a
    parameter, a master, a moment, a scale), or the result would depend on the order
    of the updates and a gradient would be written (S3.2). Gradients may share memory
    with each other. ``passed`` remembers the last batches and gradients that passed:
    while the plans stand, the same ones need no check."""
    signature = [(work.batch, [0 if g is None else g.data_ptr() for g in work.grads],
                  work.kinds) for work in works]
    old = passed.get("torch")
    if old is not None and len(old) == len(signature) and all(
            a[0] is b[0] and a[1:] == b[1:] for a, b in zip(old, signature)):
        return
    by_device = {}
    for work in works:
        spans = by_device.setdefault(work.batch.device, [])
        for entry, grad, written in zip(work.batch.entries, work.grads,
                                        _written_spans(work.batch)):
            if grad is None or entry.numel == 0:
                continue  # not stepped: nothing of it is written
            order = len(spans)
            spans.append(_validate.memory_span(grad) + (order, False, "grad", entry.place,
                                                        grad))
            spans.extend((start, end, order, True, name, entry.place, tensor)
                         for start, end, name, tensor in written)
    _validate.refuse_shared_grads(by_device)
    passed["torch"] = signature


def check_scales(works: list) -> None:
    """The CPU core's rule on the scales a step reads, for this step's torch-path
    batches in host memory: each finite and > 0. A plan checked its scales when it was
    built; one changed in place since is refused here, before anything is written, in
    the core's words. Scales in device memory are not read on the host (the CUDA
    kernels do not check them either)."""
    for work in works:
        if work.batch.device.type != "cpu":
            continue
        for entry, grad in zip(work.batch.entries, work.grads):
            if grad is None or entry.numel == 0:
                continue
            for name in ("exp_avg_scale", "exp_avg_sq_scale", "master_scale"):
                scale = getattr(entry, name)
                if scale is None or scale.numel() == 0:
                    continue
                bad = ~(torch.isfinite(scale) & (scale > 0)).view(-1)
                if bool(bad.any()):
                    j = int(bad.nonzero()[0, 0])
                    which = name if scale.numel() == 1 else f"{name}[{j}]"
                    raise ValueError(
                        f"{_validate.CLASS_NAME}: {entry.place}: {which} "
                        f"{scale.view(-1)[j].item():.9g} is not a valid scale (rule: a scale is "
                        f"a finite value > 0)")


def step(work, hyper) -> None:
    active = [(entry, grad) for entry, grad in zip(work.batch.entries, work.grads)
              if grad is not None and entry.numel > 0]
    if not active:
        return
    # On CPU with IEEE subnormals, as the C++ core steps (float_mode.h).
    on_cpu = work.batch.device.type == "cpu"
    with _float_mode.kept() if on_cpu else contextlib.nullcontext():
        _step(active, hyper, _piece_size(work.batch.device))


# Elements per piece of a step (S7.2): its fp32 working copies and temporaries (16
# bytes per element with fp32 state, about 135 with 8- or 4-bit per-block moments)
# live for one piece at a time, not for the whole group. Small tensors share a piece; a
# larger one is cut into parts. On CPU, pieces of 2^20 stepped 16.8M elements as fast
# as one whole group did; other devices take larger ones, for fewer kernel launches
# (the per-block codecs launch theirs per 2^20 elements anyway).
PIECE_CPU, PIECE_DEVICE = 1 << 20, 1 << 22


def _piece_size(device: torch.device) -> int:
    return PIECE_CPU if device.type == "cpu" else PIECE_DEVICE


# A plan entry's states, in _working's order (w, m, v).
_STATES = ("master", "exp_avg", "exp_avg_sq")


class _Part:
    """Elements ``[begin, end)`` of an entry's local tensor, with views of its buffers
    over them (packed codes: their bytes; per-block scales: the blocks the range
    touches). A whole entry is its buffers themselves."""

    __slots__ = ("entry", "grad", "numel", "first", "local", "master",
                 "master_scale", "exp_avg", "exp_avg_scale", "exp_avg_sq",
                 "exp_avg_sq_scale")

    def __init__(self, entry, grad, begin: int = 0, end: Optional[int] = None):
        self.entry = entry
        self.first = entry.first_index + begin  # S2.9's and S2.13's flat index
        whole = end is None
        self.numel = entry.numel if whole else end - begin
        self.grad = grad if whole else grad.reshape(-1)[begin:end]
        self.local = entry.local if whole else entry.local.view(-1)[begin:end]
        for name in _STATES:
            stored, scale = getattr(entry, name), getattr(entry, name + "_scale")
            fmt = getattr(entry, name + "_format")
            if not whole and stored is not None:
                lo, hi = (begin // 2, end // 2) if fmt.packed else (begin, end)
                stored = stored.view(-1)[lo:hi]
                if fmt.scale == "block":
                    block = fmt.scale_block
                    j = self.first // block - entry.first_index // block
                    scale = scale[j:j + _codecs.block_count(self.first, self.numel, block)]
            setattr(self, name, stored)
            setattr(self, name + "_scale", scale)


def _parts(entry, grad, size: int):
    """The entry in parts of about ``size`` elements, cut on multiples of the part
    length in the whole parameter's flat index, so never inside a scale block (S2.9), nor
    between a packed byte's two codes; one part where it is no larger, or where a
    buffer is not contiguous (no flat view)."""
    buffers = (entry.local, entry.master, entry.exp_avg, entry.exp_avg_sq)
    if entry.numel <= size or not all(b is None or b.is_contiguous() for b in buffers):
        return [_Part(entry, grad)]
    block = max(entry.scale_block, 1)
    length = max(block, size // block * block)
    cuts = range(length - entry.first_index % length, entry.numel, length)
    bounds = [0, *cuts, entry.numel]
    return [_Part(entry, grad, b, e) for b, e in zip(bounds, bounds[1:])]


def _pieces(parts, size: int):
    """Consecutive parts gathered into pieces of at most ``size`` elements (a larger
    part, one not cut for want of a flat view, alone)."""
    piece, held = [], 0
    for part in parts:
        if piece and held + part.numel > size:
            yield piece
            piece, held = [], 0
        piece.append(part)
        held += part.numel
    if piece:
        yield piece


def _step(active, hyper, size: int) -> None:
    k = step_constants(hyper)
    parts = [(entry, _parts(entry, grad, size)) for entry, grad in active]
    # A per-tensor scale is measured over the whole tensor's new values before any of
    # them is stored: a tensor in several parts is stepped twice, first only to
    # measure (the C++ core's measuring pass), then for real with those scales.
    measured = _measure([(entry, p) for entry, p in parts if len(p) > 1
                         and any(_tensor_scaled(entry, name) for name in _STATES)],
                        k, hyper, size)
    for piece in _pieces((part for _, p in parts for part in p), size):
        _step_piece(piece, k, hyper, measured)
    for entry, scales in measured.items():
        for name, scale in scales.items():
            getattr(entry, name + "_scale").copy_(scale)


def _tensor_scaled(entry, name: str) -> bool:
    fmt = getattr(entry, name + "_format")
    return fmt is not None and fmt.scale == "tensor"


def _working(piece, private: bool = False, weights: bool = True):
    """fp32 working lists of a piece: gradients, weights and both moments. fp32 storage
    is worked on in place (it is its own working copy) unless ``private``, where
    ``weights`` says whether the weights will be updated too."""
    g = [part.grad.float() for part in piece]
    w = [_weight(part) for part in piece]
    m = [part.entry.exp_avg_format.decode(part.exp_avg, part.exp_avg_scale, part.first)
         for part in piece]
    v = [part.entry.exp_avg_sq_format.decode(part.exp_avg_sq, part.exp_avg_sq_scale,
                                             part.first) for part in piece]
    if private:
        def own(values, stored):
            return [x.clone() if any(x is getattr(part, name) for name in stored) else x
                    for x, part in zip(values, piece)]
        w = own(w, ("local", "master")) if weights else w
        m, v = own(m, ("exp_avg",)), own(v, ("exp_avg_sq",))
    return g, w, m, v


def _measure(entries, k, hyper, size: int) -> dict:
    """The new per-tensor scales of ``entries`` (each with its parts), from their
    updated values, nothing stored: ``{entry: {state: 0-dim scale}}``. The weights are
    updated only where a master has such a scale."""
    absmax = {}
    for piece in _pieces((part for _, parts in entries for part in parts), size):
        weights = any(_tensor_scaled(part.entry, "master") for part in piece)
        g, w, m, v = _working(piece, private=True, weights=weights)
        _adam(g, w, m, v, k, hyper, weights)
        for part, *values in zip(piece, w, m, v):
            found = absmax.setdefault(part.entry, {})
            # A scaled master's exported value is its true value (S2.3).
            for name, value in zip(_STATES, values):
                if _tensor_scaled(part.entry, name):
                    top = torch.amax(torch.abs(value))  # NaN propagates, as in one amax
                    found[name] = top if name not in found else torch.maximum(found[name],
                                                                              top)
    return {entry: {name: _codecs.scale_of_absmax(
                top, getattr(entry, name + "_format").scale_target)
                    for name, top in found.items()}
            for entry, found in absmax.items()}


def _step_piece(piece, k, hyper, measured: dict) -> None:
    g, w, m, v = _working(piece)
    _adam(g, w, m, v, k, hyper)
    for part, w_i, m_i, v_i in zip(piece, w, m, v):
        entry = part.entry
        scales = measured.get(entry, {})
        _store_weight(part, w_i, hyper.step, scales.get("master"))
        rounding = (_codecs.exp_avg_step_key(entry.rounding_key, hyper.step)
                    if entry.exp_avg_rounding else None)
        entry.exp_avg_format.encode(m_i, part.exp_avg, part.exp_avg_scale, part.first,
                                    rounding, scales.get("exp_avg"))
        entry.exp_avg_sq_format.encode(
            v_i, part.exp_avg_sq, part.exp_avg_sq_scale, part.first,
            _codecs.square_step_key(entry.rounding_key, hyper.step)
            if entry.exp_avg_sq_rounding else None, scales.get("exp_avg_sq"))


def _adam(g, w, m, v, k, hyper, weights: bool = True) -> None:
    """csrc/element.h AdamElement, one op at a time, on fp32 lists (``w``, ``m``, ``v``
    updated in place, ``w`` only where ``weights``; ``g`` is read, never written: fp32
    gradients are used as they are, so every op that touches it is out of place)."""
    if not hyper.adam_w_mode:
        g = torch._foreach_add(g, torch._foreach_mul(w, k["weight_decay"]))
    torch._foreach_mul_(m, k["beta1"])
    torch._foreach_add_(m, torch._foreach_mul(g, k["one_minus_beta1"]))
    torch._foreach_mul_(v, k["beta2"])
    g_scaled = torch._foreach_mul(g, k["one_minus_beta2"])
    torch._foreach_mul_(g_scaled, g)
    torch._foreach_add_(v, g_scaled)
    if not weights:
        return
    if hyper.adam_w_mode:
        torch._foreach_mul_(w, k["decay"])
    denom = _sqrt(v)
    torch._foreach_div_(denom, _on_device(k["bias_correction2_sqrt"], v[0].device))
    torch._foreach_add_(denom, k["eps"])
    update = torch._foreach_mul(m, k["step_size"])
    torch._foreach_div_(update, denom)
    torch._foreach_sub_(w, update)
