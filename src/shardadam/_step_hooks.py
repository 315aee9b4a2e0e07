"""``step()``'s profiler range and step hooks, paid for only when they are used.

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

Private torch APIs read here (in every torch >= 2.4), and why:
- the ``hooked`` attribute of a class's ``step``: ``Optimizer._patch_step_function``
  leaves a ``step`` that has it unwrapped;
- ``torch.optim.optimizer._global_optimizer_pre_hooks`` / ``_post_hooks``: the hooks
  ``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook`` add;
- ``Optimizer._optimizer_step_pre_hooks`` / ``_optimizer_step_post_hooks``: the
  optimizer's own (``register_step_pre_hook`` / ``register_step_post_hook``);
- ``torch._C._autograd._profiler_enabled()``: whether a profiler records this thread,
  the condition under which ``record_function`` records anything.
"""

from __future__ import annotations

import torch
from torch.optim import optimizer as _torch_optimizer

_profiler_enabled = torch._C._autograd._profiler_enabled


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
