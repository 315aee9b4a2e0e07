"""Other packages' low-bit AdamW optimizers, built by name, and the state bytes of any
optimizer counted one way.

The bench times them (``bench/contenders``), the demo trains beside them (``--also``)
and the rare-token check trains them (``--optimizer``). A package is imported only when
one of its optimizers is asked for; ``Unavailable`` says why one cannot be built here
(not installed, or built for another torch). ``make bench`` installs the pinned versions
of ``requirements-bench.txt``.
"""

from __future__ import annotations

import importlib
import importlib.util

# name: (module, class, what it is)
PEERS = {
    "torchao-adamw8bit": ("torchao.optim", "AdamW8bit",
                          "torchao.optim.AdamW8bit (blocks of 256, torch.compile on CPU)"),
    "torchao-adamw4bit": ("torchao.optim", "AdamW4bit",
                          "torchao.optim.AdamW4bit (blocks of 128, torch.compile on CPU)"),
    "torchao-adamwfp8": ("torchao.optim", "AdamWFp8",
                         "torchao.optim.AdamWFp8 (E4M3, blocks of 256, torch.compile on CPU)"),
    "bnb-adamw8bit": ("bitsandbytes.optim", "AdamW8bit",
                      "bitsandbytes.optim.AdamW8bit (blocks of 256)"),
}
# The ones that step FSDP2's DTensor parameters (bitsandbytes' optimizers do not).
DTENSOR_PEERS = ("torchao-adamw8bit", "torchao-adamw4bit", "torchao-adamwfp8")


class Unavailable(Exception):
    """This optimizer cannot be built here; the message says why."""


def not_installed(name: str):
    """What to install for ``PEERS[name]`` where its package is missing, else None:
    checked before a run, which would otherwise fail after its first phases."""
    package = PEERS[name][0].split(".")[0]
    if importlib.util.find_spec(package) is not None:
        return None
    return (f"{package} is not installed (`pip install {package}`; a checkout's "
            f"requirements-bench.txt pins the version `make bench` installs)")


def make(name: str, params, **hyper):
    """``PEERS[name]``'s optimizer over ``params`` with AdamW's ``lr``, ``betas``,
    ``eps``, ``weight_decay``."""
    module, cls, _ = PEERS[name]
    try:
        found = importlib.import_module(module)
    except Exception as error:  # not installed, or built for another torch
        first = str(error).splitlines()[0] if str(error) else ""
        raise Unavailable(f"{module.split('.')[0]} not importable: "
                          f"{type(error).__name__}: {first}") from None
    return getattr(found, cls)(params, **hyper)


def tensor_bytes(t) -> int:
    """Bytes a state tensor holds: the inner tensors of a wrapper subclass (torchao's
    quantized states keep codes and scales inside one), a DTensor's local shard, else
    its elements."""
    import torch

    to_local = getattr(t, "to_local", None)
    if to_local is not None:
        return tensor_bytes(to_local())
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, n) for n in names)
        return sum(tensor_bytes(i) for i in inner if isinstance(i, torch.Tensor))
    return t.numel() * t.element_size()


def state_bytes(optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (master copies and step counters
    included) and of FusedAdam's scales, which it keeps beside the state as TE does;
    a DTensor counts its local shard."""
    import torch

    held = list(optimizer.state.values()) + list(getattr(optimizer, "_scales", {}).values())
    return sum(tensor_bytes(v) for state in held for v in state.values()
               if isinstance(v, torch.Tensor))
