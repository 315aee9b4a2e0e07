"""Which optimizer stored each scaled state tensor, for which parameter and state name.

A scaled state's codes mean something only with the scales recorded beside them
(``optimizer._scales[param][name]``, S2.3). Those records stay where they were written,
so codes moved by hand (``new.state[p] = old.state[p]``, two parameters' states swapped,
``exp_avg`` put under ``exp_avg_sq``) would be read with the scales of whatever was
recorded at their new place. Every scaled tensor a FusedAdam stores is claimed here
(weakly, by identity: tensors compare elementwise, so no ``WeakKeyDictionary``); one found
at a place other than its claim's is refused. A tensor nobody claimed (a copy, one built
by hand, one restored by pickle or ``deepcopy``) is read with the scales recorded where it
now is, as before.

The parameter is recorded by ``id``, not by a weak reference: ``torch.utils.swap_tensors``
refuses a tensor that has one, and ``nn.Module._apply`` swaps parameters (always for
DTensors, so FSDP2's ``to_empty`` and ``model.to(dtype)``). While its optimizer holds it (as
a key of ``state``), no other object can take its ``id``; a claim outlives that only if
its tensor was kept after the parameter left the optimizer and was freed, and then a new
parameter at the same address would accept it.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch

# id(tensor) -> (weak reference to it and to its optimizer, id of its parameter, state
# name, format label)
_CLAIMS: dict = {}


def _release(key: int, ref: weakref.ref) -> None:
    claim = _CLAIMS.get(key)
    if claim is not None and claim[0] is ref:  # not a newer tensor at the same address
        del _CLAIMS[key]


def claim(stored: torch.Tensor, owner, param: torch.Tensor, name: str, label: str) -> None:
    """Records that ``owner`` stored ``stored`` as ``param``'s ``name``, in the format
    labelled ``label``."""
    key = id(stored)
    ref = weakref.ref(stored, functools.partial(_release, key))
    _CLAIMS[key] = (ref, weakref.ref(owner), id(param), name, label)


class _Elsewhere:
    """In a copy (deepcopy, pickle) of an optimizer, the stand-in for what a moved
    state's claim named and the copy does not hold: the parameter (one the optimizer no
    longer holds) or the optimizer (another one, or one since freed). One object, also
    through pickle and deepcopy: a claim names it by ``id``."""

    def __reduce__(self):
        return "ELSEWHERE"


ELSEWHERE = _Elsewhere()


def claim_of(stored: torch.Tensor, owner) -> Optional[tuple]:
    """``(claimed by owner, id of the parameter, state name, format label)`` of the claim
    on ``stored``, or None where nobody claimed it."""
    held = _CLAIMS.get(id(stored))
    if held is None or held[0]() is not stored:
        return None
    return held[1]() is owner, held[2], held[3], held[4]


def moved_error(stored: torch.Tensor, owner, param: torch.Tensor, name: str,
                recorded: Optional[str]) -> Optional[str]:
    """A sentence if ``stored`` (found as ``param``'s ``name`` in ``owner``, whose
    recorded format there is labelled ``recorded``) was stored by an optimizer at another
    place, or at this place in a format since replaced; else None."""
    held = _CLAIMS.get(id(stored))
    if held is None or held[0]() is not stored:
        return None
    by, for_param, for_name, label = held[1](), held[2], held[3], held[4]
    if by is owner and for_param == id(param) and for_name == name:
        if recorded is None or recorded == label:
            return None
        # Put back by hand after a setting change stored this state anew: the scales
        # recorded here are the new format's (a dtype both share would read it as that).
        return (f"holds the {label} values stored here before this state became "
                f"{recorded}, whose scales were replaced (rule S2.3: scaled values mean "
                f"nothing without their own scales; set a replaced state with "
                f"set_scaled_state)")
    if by is not owner:
        where = "in another optimizer" if by is not None else "in an optimizer since freed"
    elif for_param != id(param):
        where = "for another parameter"
    else:
        where = f"as this parameter's {for_name!r}"
    return (f"holds the {label} values stored {where}, whose scales stayed there (rule "
            f"S2.3: scaled values mean nothing without their own scales; move a state with "
            f"state_dict() and load_state_dict(), or get_unscaled_state() and "
            f"set_scaled_state())")
