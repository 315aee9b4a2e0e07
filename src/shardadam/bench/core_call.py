"""The bare C++ kernel, timed in the bench's own process: one ``_C.adam_step`` call.

kernel_bench's bare kernel runs in a process of its own at the start of a run, so its
figures and the steps compared with them are minutes apart; on a shared machine the
speed of the whole machine moves more than that between them (medians 25% apart in
two runs here). ``CoreCall`` is the same C++ call, on the slots the shardadam
contender's FusedAdam prepared for its own tensors (``contenders.SHARING``),
interleaved with the other contenders like one of them: what ``FusedAdam.step()``
costs on top of it (its Python, torch's optimizer wrapper) is then a ratio from one
run. It reads FusedAdam's private plan once
(``_prepare_group``, ``_backend.prepare``) and runs it as ``step()`` does
(``_backend.run``), with the hyper-parameters of the first step, the step counter
advancing.
"""

from __future__ import annotations

from shardadam import FusedAdam, _backend
from shardadam.peers import Unavailable


class CoreCall:
    """Callable: the one extension call that steps every tensor of ``optimizer``'s
    single group, as its ``step()`` would, without the checks and plans around it."""

    def __init__(self, optimizer: FusedAdam):
        optimizer.step()  # creates the state and the plan whose slots are reused
        (group,) = optimizer.param_groups
        _, self.hyper, batches = optimizer._prepare_group(0, group,
                                                           optimizer._config())
        (item,) = [_backend.prepare(batch) for batch in batches]
        if item.call is None:  # reported as a contender that cannot run here
            raise Unavailable("the C++ core does not step these tensors (not built, or "
                              "not for their device)")
        self.item = item
        self.step_count = self.hyper.step - 1  # the step just taken; the next is hyper's
        self.__self__ = optimizer  # for contenders.state_bytes

    def __call__(self):
        self.step_count += 1
        _backend.run(self.item, self.hyper._replace(step=self.step_count))
