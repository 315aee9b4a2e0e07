"""What torch wraps an optimizer's ``step()`` in, paid for only where it does something:
the profiler range and step hooks, no-grad mode, and dynamo's disable wrapper.

``torch.optim.Optimizer.__init__`` wraps a subclass's ``step`` in
``Optimizer.profile_hook_step``: a profiler range named
``Optimizer.step#<class>.step`` (``record_function``) and the optimizer step hooks
around every call. The range is two dispatcher calls even when no profiler records
it: about 10 µs of the 45 µs a one-tensor ``step()`` took (docs/performance.md).
``FusedAdam.step`` is therefore marked as already wrapped, and calls torch's own
wrapper (``profiled``) only when it has work: a profiler records on this thread, or
a step hook is registered (and while dynamo traces the call: SEMANTICS S3.9).
Otherwise it steps directly. Hooks and profiles behave exactly as with torch's wrapper,
which is what runs whenever they are in use (S3.10).

Gradient mode is switched off for the step as ``torch.no_grad()`` does, by the C
function that context manager ends in. Dynamo cannot trace a step (raw storage pointers
into the core, cached plans): where dynamo evaluates frames (it traces the call, or
runs code with its frame callback set) the step runs inside dynamo's disable wrapper,
so compiled code breaks its graph there and runs the step eagerly; in plain eager code
no callback is set and the wrapper is skipped. Both wrappers are Python frames that
cost ~70 µs of a step that starts with cold caches (docs/performance.md).

Private torch APIs read here (in every torch >= 2.4 unless said), and why:
- the ``hooked`` attribute of a class's ``step``: ``Optimizer._patch_step_function``
  leaves a ``step`` that has it unwrapped;
- ``torch.optim.optimizer._global_optimizer_pre_hooks`` / ``_post_hooks``: the hooks
  ``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook`` add;
- ``Optimizer._optimizer_step_pre_hooks`` / ``_optimizer_step_post_hooks``: the
  optimizer's own (``register_step_pre_hook`` / ``register_step_post_hook``);
- ``torch._C._autograd._profiler_enabled()``: whether a profiler records this thread,
  the condition under which ``record_function`` records anything;
- ``torch._C._set_grad_enabled``: what ``torch.no_grad()`` and ``torch.set_grad_enabled``
  call (dynamo traces it as they);
- ``torch._disable_dynamo``: torch's own lazy form of ``torch.compiler.disable``
  (importing dynamo costs ~1.5 s; the public one where it is gone);
- ``torch._C._dynamo.eval_frame.set_eval_frame``: swaps dynamo's frame callback and
  returns the one set, the call dynamo's disable wrapper starts with; where a torch
  lacks it, every step takes the wrapper.
"""

from __future__ import annotations

import torch
from torch.optim import optimizer as _torch_optimizer

_profiler_enabled = torch._C._autograd._profiler_enabled
is_grad_enabled = torch.is_grad_enabled
set_grad_enabled = torch._C._set_grad_enabled
disable_dynamo = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable
_set_eval_frame = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
                          "set_eval_frame", None)


def dynamo_frames() -> bool:
    """Whether dynamo evaluates the frames a call makes now (its callback is set; also
    its run-only mode, ``False``), or this torch cannot say. Not traceable: called only
    where dynamo does not trace (``needed`` is false)."""
    if _set_eval_frame is None:
        return True
    callback = _set_eval_frame(None)
    try:
        return callback is not None
    finally:  # put back even if a signal's exception lands here
        if callback is not None:
            _set_eval_frame(callback)


def profiled(step):
    """``step`` inside torch's profiler range and step hooks (``profile_hook_step``)."""
    return torch.optim.Optimizer.profile_hook_step(step)


def needed(optimizer) -> bool:
    """Whether a step of ``optimizer`` now needs torch's wrapper: also while dynamo
    traces the call, which traces that wrapper as for torch's own optimizers and
    cannot trace ``_profiler_enabled``."""
    return bool(torch.compiler.is_compiling() or _profiler_enabled()
                or _torch_optimizer._global_optimizer_pre_hooks
                or _torch_optimizer._global_optimizer_post_hooks
                or optimizer._optimizer_step_pre_hooks
                or optimizer._optimizer_step_post_hooks)
