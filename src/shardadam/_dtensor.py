"""Every DTensor concern of the optimizer, in one place.

The arithmetic only ever sees local tensors: ``to_local`` gives the local view of a
parameter, gradient or state, ``wrap_like`` gives a local tensor back the parameter's
distributed layout, and the ``*_layout_error`` checks say (as a sentence, or None) why a
layout cannot be used. For plain tensors every helper is the identity or finds nothing
wrong. This build accepts plain tensors only: a DTensor parameter is rejected with a
clear error until the DTensor path lands here.
"""

from __future__ import annotations

from typing import Optional

import torch

_dtensor_type = None


def _dtensor_class():
    """``torch.distributed.tensor.DTensor``, imported on first use (or a stand-in)."""
    global _dtensor_type
    if _dtensor_type is None:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # a torch build without torch.distributed
            class DTensor:  # noqa: D401 - nothing is ever an instance of it
                """No DTensor support in this torch build."""
        _dtensor_type = DTensor
    return _dtensor_type


def is_dtensor(tensor) -> bool:
    return isinstance(tensor, _dtensor_class())


def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor the kernels work on (the tensor itself when plain)."""
    if type(tensor) is torch.Tensor or not is_dtensor(tensor):
        return tensor
    return tensor.to_local()


def wrap_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` with ``param``'s distributed layout (``local`` itself when plain).

    The global shape and stride come from the parameter, never from the local shard,
    whose size differs between ranks when the parameter is sharded unevenly.
    """
    if not is_dtensor(param):
        return local
    return _dtensor_class().from_local(
        local, device_mesh=param.device_mesh, placements=param.placements,
        shape=param.shape, stride=param.stride(), run_check=False)


def any_dtensor(tensors) -> bool:
    dtensor = _dtensor_class()
    return any(isinstance(t, dtensor) for t in tensors)


def local_data_ptrs(params, plain: bool) -> list:
    """Data pointers of the parameters' local tensors (they change when storage is
    replaced). ``plain``: the caller knows none is a DTensor (the per-step fast path)."""
    if plain:
        return list(map(torch.Tensor.data_ptr, params))
    return [to_local(p).data_ptr() for p in params]


def param_layout_error(param: torch.Tensor) -> Optional[str]:
    if is_dtensor(param):
        return (f"DTensor parameters are not supported by this build yet (placements "
                f"{tuple(param.placements)}); pass plain tensors")
    return None


def grad_layout_error(param: torch.Tensor, grad: torch.Tensor) -> Optional[str]:
    if is_dtensor(grad) and not is_dtensor(param):
        return (f"the gradient is a DTensor (placements {tuple(grad.placements)}) but the "
                f"parameter is a plain tensor")
    return None


def value_layout_error(param: torch.Tensor, value: torch.Tensor) -> Optional[str]:
    """Why ``value`` cannot be stored as ``param``'s state (a DTensor for a plain one)."""
    if is_dtensor(value) and not is_dtensor(param):
        return "a DTensor value was given for a plain-tensor parameter"
    return None
