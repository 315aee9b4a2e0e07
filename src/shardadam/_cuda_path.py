"""CUDA tensors: one call of ``shardadam._C.adam_step_cuda`` per batch (SEMANTICS S7.1).

The slot rows are the CPU path's (``_slots``), holding device pointers. The call only
enqueues kernels on the device's current stream and returns, so ``step()`` never waits
for the GPU: its scratch memory comes from torch's caching allocator (which reuses a
block only in that stream's order), and contiguous copies are written back by copies
queued behind the kernels on the same stream. Per-block scaled moments (S2.9) step here
too, in the formats the extension has CUDA codecs for (``steps_formats``).
"""

from __future__ import annotations

import math

import torch

from . import _slots

_usable: dict = {}  # device index -> whether the kernels run there, asked once
_stepped_tags = None  # the format tags the kernels step, asked once


def available(device: torch.device) -> bool:
    """Whether the extension was built with CUDA, its runtime sees devices, and its
    kernels fit ``device``'s architecture (else that device's batches take the torch
    path rather than failing at launch, e.g. on GPUs older than the compiled archs).

    Asked only for a batch of CUDA tensors (torch has initialised CUDA by then), so a
    CPU-only job never starts the CUDA runtime through the extension."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    usable = _usable.get(index)
    if usable is None:
        core = _slots.extension
        usable = _usable[index] = bool(
            core is not None and hasattr(core, "adam_step_cuda")
            and core.info().get("cuda_devices", 0) > 0
            and core.cuda_kernels_run_on(index))
    return usable


def stepped_tags() -> frozenset:
    """The format tags whose states the kernels step (the extension's ``cuda_formats``;
    a per-block format can reach the core before its CUDA codec does)."""
    global _stepped_tags
    if _stepped_tags is None:
        core = _slots.extension
        _stepped_tags = frozenset(core.info().get("cuda_formats", ())
                                  if core is not None else ())
    return _stepped_tags


def steps_formats(batch) -> bool:
    """Whether the kernels step every per-block scaled moment of ``batch`` (S2.9,
    S2.10); other formats they always do. Decided once per plan (its formats are
    fixed while it stands)."""
    steps = batch.backend_cache.get("cuda_formats")
    if steps is None:
        tags = stepped_tags()
        steps = batch.backend_cache["cuda_formats"] = all(
            e.exp_avg_format.tag in tags and e.exp_avg_sq_format.tag in tags
            for e in batch.entries if e.scale_block)
    return steps


def prepare(work) -> _slots.Call:
    # The batch's device is made current for torch's allocations and stream (the
    # contiguous copies of non-contiguous tensors), and named to the extension (whose
    # own CUDA runtime sets it too).
    with torch.cuda.device(work.batch.device):
        return _slots.prepare(work)


def run(work, call, hyper) -> None:
    device = work.batch.device
    core = _slots.extension
    with torch.cuda.device(device):
        if call.slots:
            workspace = torch.empty(core.cuda_workspace_bytes(call.count),
                                    dtype=torch.uint8, device=device)
            lr, lr_fp64, lr_address = hyper.lr, None, 0
            if isinstance(lr, torch.Tensor):
                # Copied on the stream and read by the kernels when they run (S1.2):
                # nothing waits. A copy even where lr is already fp64 here, so that
                # its memory is this stream's: held until the kernels are queued, and
                # once freed, it goes only to work queued behind them.
                lr_fp64 = lr.detach().to(device=device, dtype=torch.float64, copy=True)
                # The host value is then unused and unchecked: NaN, so a use shows.
                lr, lr_address = math.nan, lr_fp64.data_ptr()
            try:
                core.adam_step_cuda(
                    call.slots, lr, hyper.beta1, hyper.beta2, hyper.eps,
                    hyper.weight_decay, hyper.adam_w_mode, hyper.bias_correction,
                    hyper.step, workspace.data_ptr(), workspace.numel(),
                    torch.cuda.current_stream(device).cuda_stream, workspace.device.index,
                    lr_address)
            except ValueError as error:
                raise _slots.refusal(error, call.entries) from None
        call.finish()
