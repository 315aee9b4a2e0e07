"""Peak extra memory of one ``step()``, measured in a fresh subprocess per contender.

The child builds each case, takes one untimed step (torch's optimizers create their
state lazily there; that is state, not transient), resets the kernel's RSS high-water
mark (``/proc/self/clear_refs``), records RSS, takes one step and reports
``VmHWM - RSS``: the bytes the step allocated and touched on top of what already lived,
plus the working buffers a contender keeps between steps beside its state
(``working_bytes``: multipass's fp32 chunk buffers), reported also on their own.

glibc is told to serve every block >= 64 KiB with its own mapping and to return freed
memory at once, so a temporary cannot hide in heap pages freed by the warm-up step.

    python -m shardadam.bench.memory --contender NAME --mode quick --scale 1 --threads 2 \
        --cases ID[,ID...]        # prints one JSON object: {case id: result}
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def _status_kib(field: str):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_extra_bytes(step) -> dict:
    """Run ``step`` once and report what it added to the RSS high-water mark."""
    gc.collect()
    if _reset_high_water_mark() and _status_kib("VmHWM") is not None:
        baseline = _status_kib("VmRSS")
        step()
        peak = _status_kib("VmHWM")
        method = "VmHWM after clear_refs"
    else:  # no /proc: the lifetime maximum only shows growth beyond the old peak
        import resource

        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        method = "ru_maxrss (lower bound)"
    return {"peak_extra_bytes": max(0, peak - baseline) * 1024, "memory_method": method}


def measure(contender: str, case_ids: list, mode: str, scale: float, threads: int,
            timeout_s: float = 900) -> dict:
    """Parent side: ``{case id: {"peak_extra_bytes": n, ...} or {"error": why}}``."""
    env = {**os.environ, **_MALLOC_ENV, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "shardadam.bench.memory", "--contender", contender,
               "--mode", mode, "--scale", repr(scale), "--threads", str(threads),
               "--cases", ",".join(case_ids)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {case_id: {"error": "memory subprocess timed out"} for case_id in case_ids}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {case_id: {"error": f"memory subprocess failed: {tail}"}
                for case_id in case_ids}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(args) -> dict:
    import torch

    from . import cases, contenders

    torch.set_num_threads(args.threads)
    results = {}
    for case_id in args.cases.split(","):
        case = cases.find_case(case_id, args.mode, args.scale)
        params = cases.optimizer_params(case)
        try:
            step = contenders.make(args.contender, lambda: params, case.preset)
        except contenders.Unavailable as error:
            results[case_id] = {"error": str(error)}
            continue
        step()  # lazy state, first touch, thread pool
        result = peak_extra_bytes(step)
        # Working buffers kept between steps (multipass's) are extra memory the step
        # needs, though already resident when it starts.
        held = getattr(getattr(step, "__self__", None), "working_bytes", 0)
        result.update(held_extra_bytes=held,
                      peak_extra_bytes=result["peak_extra_bytes"] + held)
        results[case_id] = result
        del step, params
        gc.collect()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardadam.bench.memory")
    parser.add_argument("--contender", required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--scale", type=float, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--cases", required=True)
    print(json.dumps(_child(parser.parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
