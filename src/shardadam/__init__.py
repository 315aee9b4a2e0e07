"""shardadam: fused Adam/AdamW for sharded training, with a C++ core.

``from shardadam import FusedAdam`` gives a drop-in for Transformer Engine's
``FusedAdam`` (same constructor and state methods) that keeps its state in fp32, bf16,
fp16 or fp8, or (beyond TE) in 8- or 4-bit codes with one scale per block, and steps
CPU tensors (and CUDA tensors, in a CUDA build) in C++.
"""

import re as _re
from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version
from pathlib import Path as _Path

from .optimizer import FusedAdam


def _own_version() -> str:
    """Written once, in the C++ core's csrc/include/shardadam/version.h; the build puts
    it in the package's metadata. A source tree that was never installed (``PYTHONPATH=
    src``) has no metadata: its header is read instead ("0+unknown" where there is none)."""
    try:
        return _version("shardadam")
    except _PackageNotFoundError:
        pass
    header = _Path(__file__).resolve().parents[2] / "csrc/include/shardadam/version.h"
    try:
        text = header.read_text()
    except OSError:
        return "0+unknown"
    parts = [_re.search(rf"#define SHARDADAM_VERSION_{part} (\d+)", text)
             for part in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "0+unknown"


__version__ = _own_version()

__all__ = ["FusedAdam", "__version__"]
