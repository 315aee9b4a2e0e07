"""What a run's figures were measured on (the bench's meta, the demo's report): the
CPU, the versions, the SIMD target, the source's commit."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Optional


def cpu_id() -> dict:
    """The first processor's identity in /proc/cpuinfo: a VM's model name is often
    only "AMD EPYC", and family / model / stepping tell its generations apart."""
    fields = ("model name", "vendor_id", "cpu family", "model", "stepping", "flags")
    found = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if not key:  # the first processor's block ends
                    break
                if key in fields:
                    found[key] = value.strip()
    except OSError:
        pass
    if "flags" in found:  # only the SIMD ones
        found["flags"] = " ".join(f for f in found["flags"].split()
                                  if f.startswith(("avx", "sse", "fma", "f16c", "amx")))
    return found


def commit() -> Optional[str]:
    """The source's git commit (with "+changes" where tracked files differ from it),
    or None outside a git checkout (an installed wheel)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def describe() -> dict:
    """``cpu`` (its model name), ``cpu_id`` (the rest of cpu_id()), ``logical_cpus``,
    ``torch``, ``shardadam``, ``simd_target`` (None without the C++ core), ``commit``."""
    import torch

    import shardadam

    try:
        from shardadam import _C

        simd = _C.info()["simd_target"]
    except ImportError:
        simd = None
    cpu = cpu_id()
    return {"cpu": cpu.pop("model name", None) or platform.processor() or platform.machine(),
            "cpu_id": cpu, "logical_cpus": os.cpu_count(), "torch": torch.__version__,
            "shardadam": shardadam.__version__, "simd_target": simd, "commit": commit()}
