"""The step with torch ops only (SEMANTICS S7.2): any device torch runs on.

It follows the C++ core's contract bit for bit on CPU: the same fp32 constants
(computed in double, rounded once, as ``MakeStepConstants`` in csrc/element.h), the
same order of operations as ``AdamElement`` (one rounding per op, nothing fused), and
the same codecs (each format's, ``_formats``). The math runs as ``torch._foreach_*``
ops over fp32 working lists: the stored fp32 tensors themselves, fp32 copies of
everything else.
"""

from __future__ import annotations

import contextlib
import math
from array import array

import torch

from . import _codecs, _validate


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


def _weight(entry):
    """fp32 working weight: the master (S2.5 / unscaled fp16 / fp32) or the parameter
    (an fp32 one itself)."""
    fmt = entry.master_format
    if fmt is None:
        return entry.local.float()
    return fmt.true_value(fmt.decode(entry.master, entry.master_scale), entry.local)


def _store_weight(entry, w, step: int) -> None:
    """The parameter from the updated ``w`` first (a remainder's high half, or rounded
    stochastically, S2.14), then the master (S3.6)."""
    fmt = entry.master_format
    value, bits = (w, None) if fmt is None else fmt.from_true(w)
    param = w if bits is None else bits
    if entry.param_rounding:
        param = _codecs.bf16_encode_stochastic(w.reshape(-1), _codecs.random_bits(
            _codecs.param_step_key(entry.rounding_key, step), entry.first_index, w.numel(),
            w.device)).view(entry.local.shape)
    if param is not entry.local:
        if entry.local.dtype == torch.bfloat16 and param.dtype == torch.float32:
            param = _codecs.bf16_encode(param)  # NaN's sign kept (S2.4)
        entry.local.copy_(param)
    if fmt is not None:
        fmt.encode(value, entry.master, entry.master_scale)


_WRITTEN = (("param", "local"), ("master_param", "master"), ("exp_avg", "exp_avg"),
            ("exp_avg_sq", "exp_avg_sq"), ("exp_avg_scale", "exp_avg_scale"),
            ("exp_avg_sq_scale", "exp_avg_sq_scale"), ("master_scale", "master_scale"))


def prepare(work):
    """``work`` with each non-contiguous gradient replaced by a contiguous copy, taken
    before any batch of the step runs, as the C++ paths step such a gradient."""
    if work.dense:
        return work
    grads = [g if g is None or g.is_contiguous() else g.contiguous() for g in work.grads]
    return type(work)(work.batch, grads, work.kinds, True)


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


def _flushing_denormals() -> bool:
    """Whether CPU float ops flush subnormals (``torch.set_flush_denormal(True)``, which
    torch offers no getter for): a subnormal times one then reads as zero."""
    return bool(torch.tensor(2.0 ** -140, dtype=torch.float32).mul(1.0) == 0)


@contextlib.contextmanager
def _subnormals_kept(device):
    """IEEE subnormals for the step, as the C++ core sets them for its own (float_mode.h):
    a caller's flush-to-zero mode would change the bits on CPU."""
    flushing = device.type == "cpu" and _flushing_denormals()
    if flushing:
        torch.set_flush_denormal(False)
    try:
        yield
    finally:
        if flushing:
            torch.set_flush_denormal(True)


def step(work, hyper) -> None:
    active = [(entry, grad) for entry, grad in zip(work.batch.entries, work.grads)
              if grad is not None and entry.numel > 0]
    if not active:
        return
    with _subnormals_kept(work.batch.device):
        _step(active, hyper)


def _step(active, hyper) -> None:
    k = step_constants(hyper)
    entries = [entry for entry, _ in active]
    # Gradients are read, never written: fp32 ones are used as they are and every op
    # below that touches `g` is out of place.
    g = [grad.float() for _, grad in active]
    w = [_weight(e) for e in entries]
    # fp32 working copies (the fp32 storage itself), stored back by encode below.
    m = [e.exp_avg_format.decode(e.exp_avg, e.exp_avg_scale, e.first_index)
         for e in entries]
    v = [e.exp_avg_sq_format.decode(e.exp_avg_sq, e.exp_avg_sq_scale, e.first_index)
         for e in entries]

    # csrc/element.h AdamElement, one op at a time.
    if not hyper.adam_w_mode:
        g = torch._foreach_add(g, torch._foreach_mul(w, k["weight_decay"]))
    torch._foreach_mul_(m, k["beta1"])
    torch._foreach_add_(m, torch._foreach_mul(g, k["one_minus_beta1"]))
    torch._foreach_mul_(v, k["beta2"])
    g_scaled = torch._foreach_mul(g, k["one_minus_beta2"])
    torch._foreach_mul_(g_scaled, g)
    torch._foreach_add_(v, g_scaled)
    if hyper.adam_w_mode:
        torch._foreach_mul_(w, k["decay"])
    denom = _sqrt(v)
    torch._foreach_div_(denom, _on_device(k["bias_correction2_sqrt"], v[0].device))
    torch._foreach_add_(denom, k["eps"])
    update = torch._foreach_mul(m, k["step_size"])
    torch._foreach_div_(update, denom)
    torch._foreach_sub_(w, update)

    for entry, w_i, m_i, v_i in zip(entries, w, m, v):
        _store_weight(entry, w_i, hyper.step)
        rounding = (_codecs.exp_avg_step_key(entry.rounding_key, hyper.step)
                    if entry.exp_avg_rounding else None)
        entry.exp_avg_format.encode(m_i, entry.exp_avg, entry.exp_avg_scale,
                                    entry.first_index, rounding)
        entry.exp_avg_sq_format.encode(
            v_i, entry.exp_avg_sq, entry.exp_avg_sq_scale, entry.first_index,
            _codecs.square_step_key(entry.rounding_key, hyper.step)
            if entry.exp_avg_sq_rounding else None)
