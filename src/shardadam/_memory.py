"""What memory a strided tensor covers, and whether its storage still holds it."""

from __future__ import annotations

from typing import Optional


def extent(tensor) -> int:
    """Elements from a non-empty tensor's first element to its last, both included."""
    return 1 + sum((size - 1) * abs(stride)
                   for size, stride in zip(tensor.shape, tensor.stride()))


def short_storage(local) -> Optional[tuple]:
    """``(bytes held, bytes spanned)`` where a tensor's storage holds fewer bytes than
    its elements span (freed or shrunk in place), else None."""
    if local.numel() == 0 or local.is_meta:
        return None
    held = local.untyped_storage().nbytes()
    spanned = (local.storage_offset() + extent(local)) * local.element_size()
    return (held, spanned) if held < spanned else None
