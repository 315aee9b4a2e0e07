"""shardadam: fused Adam/AdamW for sharded training, with a C++ core.

``from shardadam import FusedAdam`` gives a drop-in for Transformer Engine's
``FusedAdam`` (same constructor and state methods) that keeps its state in fp32, bf16,
fp16 or fp8 and steps CPU tensors (and CUDA tensors, in a CUDA build) in C++.
"""

from .optimizer import FusedAdam

__version__ = "0.1.0"

__all__ = ["FusedAdam", "__version__"]
