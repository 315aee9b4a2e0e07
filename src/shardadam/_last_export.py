"""What the last ``state_dict()`` exported, held weakly (S5.5).

torch's ``set_optimizer_state_dict`` leaves a frozen parameter's state out of what it
hands to ``load_state_dict`` (``_split_optim_state_dict`` keeps only parameters that
require grad), after ``dcp.load`` wrote the checkpoint into the very tensors this
optimizer's ``state_dict()`` exported as its template. A load given other tensors of
that export reads the frozen parameters' states back from it, instead of keeping states
that a fresh process has only just initialised. Held by ``id`` and weak reference: the
export is the caller's, freed with it, and a parameter with a weak reference could not
be swapped in place (``torch.utils.swap_tensors``, as FSDP2's ``to_empty`` does).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch


# Trainable parameters whose exported tensors witness that a loaded dict is the export:
# a few suffice, and every weak reference to a new tensor costs microseconds.
WITNESSES = 4


class LastExport:
    def __init__(self):
        self._witnesses = {}  # id(tensor) -> weak reference, a few trainable ones'
        self._frozen = {}  # id(param) -> {state name: weak reference}
        self._records = ()  # the groups' state_layout strings

    def record(self, exported, records) -> None:
        """``exported``: (parameter, its exported entry) for every parameter, and the
        groups' ``records``. No tensor is kept where no parameter is frozen."""
        self._records = tuple(records)
        witnesses, frozen = {}, {}
        if any(not param.requires_grad for param, _ in exported):
            trainable = 0
            for param, entry in exported:
                if param.requires_grad and trainable == WITNESSES:
                    continue
                refs = {name: weakref.ref(value) for name, value in entry.items()
                        if isinstance(value, torch.Tensor)}
                if param.requires_grad:
                    trainable += 1
                    witnesses.update((id(ref()), ref) for ref in refs.values())
                else:
                    frozen[id(param)] = refs
        self._witnesses, self._frozen = witnesses, frozen

    def holds_any(self, loaded_state: dict) -> bool:
        """Whether a loaded dict's ``state`` holds a tensor of this export (it is the
        template ``state_dict()`` made, filled in place)."""
        if not self._frozen:
            return False
        for entry in loaded_state.values():
            for value in entry.values() if isinstance(entry, dict) else ():
                ref = self._witnesses.get(id(value))
                if ref is not None and ref() is value:
                    return True
        return False

    def made(self, record) -> bool:
        """Whether ``record`` is a state_layout string this export made (the object
        itself: one loaded from a checkpoint is a new string)."""
        return any(record is mine for mine in self._records)

    def frozen_entry(self, param) -> Optional[dict]:
        """The entry exported for frozen ``param``, while every tensor of it lives."""
        refs = self._frozen.get(id(param))
        entry = {name: ref() for name, ref in (refs or {}).items()}
        return entry if refs and all(v is not None for v in entry.values()) else None
