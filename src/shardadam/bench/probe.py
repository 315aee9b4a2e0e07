"""The machine's ceiling for one step's access pattern, measured beside the contenders.

``Probe`` owns arrays of the preset's dtypes and sizes (allocated by torch, like every
contender's) and, per call, reads the grad once and updates in place exactly the arrays
the step updates (bytewise integer adds: same bytes, no conversions, so the probe is
never compute-bound), and only writes the param where a master is the read copy. Every
stream is walked in cache-sized blocks so each element crosses the memory bus once per
call, as in a fused step; a whole-array op per stream would re-read the grad once per
stream. It is timed interleaved with the contenders like one of them. Each op is a
separate OpenMP region, so on a loaded machine this probe suffers more than a kernel
with one parallel region: read it beside the C++ probe.

``kernel_bench_figures`` folds in the C++ probe of ``benchmarks/kernel_bench`` (same
pattern, own buffers, separate process, same thread count, same idle gap before each
timed call) when that binary is built. The gap matters: on a VM here the bare kernel
took 2.1 ms back to back and 3.4-3.8 ms after 20 ms idle (7M elements, bf16 params with
remainders, bf16 moments), so a yardstick timed back to back would flatter it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile

import torch

# Elements per block: a block of every stream (<= 16 MiB for 16 bytes per element)
# stays inside the 32 MiB last-level cache of the machines here, and the Python cost per
# block (a few op launches) stays small beside moving it; measured best of 64K-1M.
BLOCK = 1 << 20


class Probe:
    """Callable: one pass of the preset's access pattern over the case's arrays."""

    def __init__(self, case, block=BLOCK):
        preset = case.preset
        self.block = block
        master_dtype = {None: None, "fp32": torch.float32,
                        "remainder": torch.int16}[preset.master]
        self.tensors = []
        for shape in case.shapes:
            numel = math.prod(shape)
            grad = torch.zeros(numel, dtype=preset.param_dtype)
            param = torch.zeros(numel, dtype=preset.param_dtype)
            # Per-block moments: their codes' bytes (4-bit codes pack two per byte).
            moment_bytes = math.ceil(numel * preset.moment_size)
            moments = [torch.zeros(moment_bytes, dtype=torch.uint8)
                       if preset.moment_format is not None
                       else torch.zeros(numel, dtype=preset.moment_dtype) for _ in range(2)]
            master = None if master_dtype is None else torch.zeros(numel, dtype=master_dtype)
            if preset.master == "fp32":
                # The param is only written; the master is read and written.
                updated, written = [master, *moments], [param]
            else:
                updated, written = [param, *moments] + ([master] if master is not None
                                                        else []), []
            self.tensors.append((numel, grad, [(t, _per_element(t, numel)) for t in updated],
                                 [(t, _per_element(t, numel)) for t in written]))

    def __call__(self):
        for numel, grad, updated, written in self.tensors:
            for start in range(0, numel, self.block):
                end = min(numel, start + self.block)
                g = _bytes(grad, grad.element_size(), start, end)
                # The grad's bytes are added into the first updated stream (read once);
                # everything else is a trivial byte add (read + write) or a fill (write).
                first = _bytes(*updated[0], start, end)
                first[:g.numel()].add_(g)
                if first.numel() > g.numel():
                    first[g.numel():].add_(1)
                for stream in updated[1:]:
                    _bytes(*stream, start, end).add_(1)
                for stream in written:
                    _bytes(*stream, start, end).fill_(1)


def _per_element(tensor, numel):
    """Bytes of ``tensor`` per element of its parameter (1/2 for 4-bit codes)."""
    return tensor.numel() * tensor.element_size() / numel


def _bytes(tensor, per_element, start, end):
    """The raw bytes of elements [start, end) of a 1-D stream."""
    return tensor.view(torch.uint8)[math.floor(start * per_element):
                                    math.floor(end * per_element)]


def find_kernel_bench():
    """``$SHARDADAM_KERNEL_BENCH`` (ValueError where it names no executable: a run
    would otherwise time another build's), else ``build/cpp/benchmarks/kernel_bench`` of
    a source checkout, if built."""
    chosen = os.environ.get("SHARDADAM_KERNEL_BENCH", "")
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise ValueError(f"SHARDADAM_KERNEL_BENCH={chosen!r} is no executable file "
                             f"(rule: it names a kernel_bench binary; unset it to use the "
                             f"checkout's build/cpp/benchmarks/kernel_bench)")
        return os.path.normpath(chosen)
    candidates = [os.path.join(os.getcwd(), "build/cpp/benchmarks/kernel_bench")]
    here = os.path.dirname(os.path.abspath(__file__))
    candidates.append(os.path.join(here, "../../../build/cpp/benchmarks/kernel_bench"))
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.normpath(path)
    return None


def kernel_bench_figures(path, numel, reps, threads, settle_s, preset=None, timeout_s=600):
    """``{preset label: row}`` from one kernel_bench run (probe and bare C++ kernel
    seconds, each after ``settle_s`` idle; only the presets whose label contains
    ``preset`` when given), or ``{"error": why}``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "kernel_bench.json")
        command = [path, "--numel", str(numel), "--reps", str(reps), "--threads",
                   str(threads), "--settle-ms", repr(settle_s * 1e3), "--json", out]
        if preset is not None:
            command += ["--preset", preset]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=timeout_s)
            with open(out) as f:
                rows = json.load(f)
        except (OSError, subprocess.SubprocessError, ValueError) as error:
            return {"error": f"{' '.join(command)}: {error}"}
    return {row["preset"]: row for row in rows}
