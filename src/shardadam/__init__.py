"""shardadam: fused Adam/AdamW for sharded training, with a C++ core.

``from shardadam import FusedAdam`` gives a drop-in for Transformer Engine's
``FusedAdam`` (same constructor and state methods) that keeps its state in fp32, bf16,
fp16 or fp8 and steps CPU tensors (and CUDA tensors, in a CUDA build) in C++.
"""

from importlib.metadata import version as _version

from .optimizer import FusedAdam

# Written once, in the C++ core's csrc/include/shardadam/version.h; the build puts it
# in the package's metadata.
__version__ = _version("shardadam")

__all__ = ["FusedAdam", "__version__"]
