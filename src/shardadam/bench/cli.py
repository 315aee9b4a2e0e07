"""``python -m shardadam bench``: arguments and the order of a run.

1. ``kernel_bench`` (the C++ benchmark, when built) at the large cases' size: its probe
   is a second, C++ ceiling for the same access pattern. For the lowbit cases, their
   presets at their size, and on one thread in cache: the step's own ceiling where
   instructions bind it (``runner.CEILING``).
2. Each case: every contender and the probe, interleaved, on identical tensors.
3. Peak extra memory of one step, one fresh subprocess per contender.
4. Table on stdout, ``--json`` and ``--png``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

from .. import _machine
from .._arguments import (missing_modules, same_file_error, whole_number_at_least,
                          writable_file)
from .timing import SETTLE_S

_KINDS = ("large", "training", "transformer", "many", "groups", "dtensor", "lowbit")
_MEMORY_JOBS = 2  # memory subprocesses at a time
# The lowbit cases' ceiling (runner.CEILING): kernel_bench's block presets on one
# thread over 262,144 elements (3.5 MiB for block8 + remainders: in L3), back to back
# so the core stays busy. On a Zen 3 VM their rate was the same from 32,768 elements
# (in L2) to 262,144; long calls keep the per-call overhead out of it.
_BLOCK_PRESETS = "-block"
_CACHE_NUMEL = 262_144
_CACHE_REPS = 100


def _float_in(low, high, *, low_open=False):
    """argparse type: a finite number in [low, high] ((low, high] with ``low_open``)."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(
                f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {text}")
        return value
    return parse


_positive_int = whole_number_at_least(1)


def _kinds(text):
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(_KINDS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown case kind(s) {unknown or text!r}; choose from {','.join(_KINDS)}")
    return kinds


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true",
                        help="smaller tensors and fewer repetitions (~2 minutes on 2 "
                             "cores): 7M-element large cases, d_model 256, 7 reps. "
                             "Default: full (25M elements, d_model 512, 15 reps)")
    parser.add_argument("--json", metavar="PATH", type=writable_file(),
                        help="write every result as JSON")
    parser.add_argument("--png", metavar="PATH", type=writable_file(".png"),
                        help="draw the results as a PNG chart")
    parser.add_argument("--cases", type=_kinds, default=list(_KINDS), metavar="KINDS",
                        help=f"comma-separated subset of {','.join(_KINDS)} (default all)")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="intra-op threads for every contender and probe "
                             "(default: torch's current setting)")
    parser.add_argument("--reps", type=_positive_int, default=None,
                        help="timed repetitions per contender (default 7 quick, 15 full)")
    parser.add_argument("--scale", type=_float_in(0, 16, low_open=True), default=1.0,
                        help="multiply every tensor size, in (0, 16] (e.g. 0.001 for a "
                             "smoke test; results at other scales are not comparable)")
    parser.add_argument("--settle-ms", type=_float_in(0, 60_000), default=1e3 * SETTLE_S,
                        help="idle gap before each timed call so no contender starts "
                             "while another's thread pool still spins (default "
                             f"{1e3 * SETTLE_S:g})")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory subprocesses")
    parser.add_argument("--no-kernel-bench", action="store_true",
                        help="do not run kernel_bench (a checkout's build/cpp/benchmarks/"
                             "kernel_bench, or $SHARDADAM_KERNEL_BENCH) even if built")


def _meta(args, mode, threads, size):
    return {"mode": mode, "scale": args.scale, "threads": threads, "reps": size["reps"],
            "warmup": size["warmup"], "settle_s": size["settle_s"],
            **_machine.describe(), "load_average_start": list(os.getloadavg()),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "allocation": "every buffer allocated by torch (64-byte aligned, fresh "
                          "mappings for large tensors), one allocation per tensor",
            "probe": "same arrays' dtypes and sizes; grad read, the step's arrays "
                     "updated in place with integer adds, in cache-sized blocks, torch "
                     "intra-op threads as the contenders; interleaved with them"}


_START = time.monotonic()


def _log(message):
    print(f"[{time.monotonic() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


def run(args) -> int:
    import torch

    from . import cases, memory, probe, report, runner

    same = same_file_error({"--json": args.json, "--png": args.png})
    if same is not None:
        print(f"python -m shardadam bench: error: {same}", file=sys.stderr)
        return 2
    mode = "quick" if args.quick else "full"
    selected = cases.build_cases(mode, args.scale, args.cases)
    # Checked before a run of minutes: the dtensor cases' ranks gather their results
    # as objects (torch pickles them through numpy); --png draws with matplotlib.
    for what, names in (("the dtensor cases",
                         ["numpy"] if any(c.kind == "dtensor" for c in selected) else []),
                        ("--png", ["matplotlib"] if args.png else [])):
        missing = missing_modules(what, names)
        if missing is not None:
            print(f"python -m shardadam bench: error: {missing}", file=sys.stderr)
            return 2
    size = cases.settings(mode)
    if args.reps:
        size["reps"] = args.reps
    size["settle_s"] = args.settle_ms / 1e3
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    meta = _meta(args, mode, threads, size)

    kernel_rows, ceiling_rows = {}, {}
    large = [c for c in selected if c.kind in ("large", "training")]
    lowbit = [c for c in selected if c.kind == "lowbit"]
    try:
        path = None if args.no_kernel_bench or not (large or lowbit) else \
            probe.find_kernel_bench()
    except ValueError as error:
        print(f"python -m shardadam bench: error: {error}", file=sys.stderr)
        return 2
    meta["kernel_bench"] = path

    def kernel_bench(rows, numel, reps, threads, settle_s, preset=None):
        _log(f"kernel_bench: {path} --numel {numel} --threads {threads}"
             + (f" --preset {preset}" if preset else ""))
        found = probe.kernel_bench_figures(path, numel, reps, threads, settle_s, preset)
        if "error" in found:  # its rows are missing: say why, not only in the JSON
            _log(f"kernel_bench failed, its rows are left out: {found['error']}")
            meta.setdefault("kernel_bench_errors", []).append(found.pop("error"))
        rows.update(found)

    if path and large:
        kernel_bench(kernel_rows, large[0].numel, size["reps"], threads, size["settle_s"])
    if path and lowbit:
        # The block presets at the lowbit cases' size (they run only there), and their
        # ceiling: one thread on a tensor that stays in cache, back to back.
        kernel_bench(kernel_rows, lowbit[0].numel, size["reps"], threads, size["settle_s"],
                     _BLOCK_PRESETS)
        kernel_bench(ceiling_rows, _CACHE_NUMEL, _CACHE_REPS, 1, 0.0, _BLOCK_PRESETS)

    records = []
    for case in selected:
        _log(f"timing {case.id}: {len(case.shapes)} tensors, {case.numel} elements")
        records += runner.time_case(case, size, threads, kernel_rows, ceiling_rows)

    peaks = {}
    if not args.no_memory:
        # A contender the timing found unavailable (not installed) would be found so
        # again, after a subprocess built the case's tensors: its row already says why.
        unavailable = {(record["case"], record["contender"]) for record in records
                       if record.get("status") == "unavailable"}
        by_contender = {}
        for case in selected:
            # The training cases hold the large cases' state: their timing is the point.
            # The bare core call is shardadam's step without its Python: same memory.
            if case.kind not in ("dtensor", "training"):
                for name in case.contenders:
                    if name not in cases.BARE and (case.id, name) not in unavailable:
                        by_contender.setdefault(name, []).append(case.id)
        _log(f"memory: one fresh subprocess per contender ({', '.join(by_contender)})")
        # After all timing, so they may overlap: each measures only its own RSS.
        with concurrent.futures.ThreadPoolExecutor(_MEMORY_JOBS) as pool:
            jobs = {name: pool.submit(memory.measure, name, case_ids, mode, args.scale,
                                      threads)
                    for name, case_ids in by_contender.items()}
            for name, job in jobs.items():
                for case_id, result in job.result().items():
                    peaks[(case_id, name)] = result
    runner.add_memory(records, peaks)
    for record in records:  # a failed measurement is no measurement: say so
        if "memory_error" in record:
            lines = str(record["memory_error"]).strip().splitlines() or ["no reason given"]
            _log(f"memory of {record['case']} {record['contender']} not measured: "
                 f"{lines[-1]}")

    meta["load_average_end"] = list(os.getloadavg())
    print(f"shardadam bench ({mode}, scale {args.scale}): {meta['cpu']}, {threads} "
          f"threads, SIMD {meta['simd_target']}, torch {meta['torch']}; load average "
          f"{meta['load_average_start'][0]:.2f} at start, "
          f"{meta['load_average_end'][0]:.2f} at end")
    print(report.table(records))
    if args.json:
        report.write_json(args.json, meta, records)
    if args.png:
        report.write_png(args.png, meta, records)
    return 0


if __name__ == "__main__":  # the same as `python -m shardadam bench`
    from shardadam.__main__ import main

    sys.exit(main(["bench", *sys.argv[1:]]))
