"""Runs the cases: times every contender and the probe, then turns samples into records.

One record per (case, contender): the JSON's rows (see ``report`` for the fields).
"""

from __future__ import annotations

import gc

from . import cases, contenders, distributed, timing
from .probe import Probe

PROBES = ("probe", "kernel_bench-probe")
KERNEL_BENCH_ROWS = {"kernel_bench-probe": "probe_s", "kernel_bench-kernel": "kernel_s"}
CEILING = "kernel_bench-ceiling"
YARDSTICKS = PROBES + (CEILING,)  # not contenders: nothing is compared with them


def _base_record(case, contender, threads, ranks=1):
    # A contender that keeps no master (shardadam-sr, the other packages' low-bit
    # optimizers) moves and holds its own layout's bytes, not the case's.
    layout = contenders.layout_of(contender, case.preset)
    return {"case": case.id, "kind": case.kind, "note": case.note, "contender": contender,
            "description": contenders.DESCRIPTIONS.get(contender, contender),
            "preset": case.preset.label, "preset_name": case.preset.name,
            "own_layout": layout is not case.preset,
            "dtypes": layout.dtypes, "numel": case.numel,
            "tensors": len(case.shapes), "threads": threads, "ranks": ranks,
            "state_bytes": round(case.numel * layout.state_bytes_per_element),
            "bytes_per_element": {"minimum": layout.minimum_bytes,
                                  "effective": layout.effective_bytes},
            "status": "ok", "reason": None, "seconds": None, "reps": 0,
            "elements_per_s": None, "gb_per_s": None, "fraction_of_probe": None,
            "fraction_of_kernel_bench_probe": None, "ratio_to": {},
            "paired_ratio_to": {}, "paired_ratio_interval_to": {}, "samples": None,
            "peak_extra_bytes": None, "held_extra_bytes": None,
            "peak_extra_fraction_of_state": None}


def _timed(record, samples):
    seconds = timing.summary(samples)
    record.update(seconds=seconds, reps=len(samples), samples=list(samples),
                  elements_per_s=record["numel"] / seconds["median"],
                  gb_per_s=record["numel"] * record["bytes_per_element"]["minimum"]
                  / seconds["median"] / 1e9)
    return record


def _time_local(case, size, threads):
    """Contenders of a single-process case and its probe, interleaved."""
    steps, records = {}, {}
    for name in case.contenders:
        record = _base_record(case, name, threads)
        try:
            steps[name] = contenders.make(name, lambda: cases.optimizer_params(case),
                                          case.preset, steps.get("shardadam"))
        except contenders.Unavailable as error:
            record.update(status="unavailable", reason=str(error))
        records[name] = record
    steps["probe"] = Probe(case)
    records["probe"] = _base_record(case, "probe", threads)
    samples = timing.interleaved(steps, size["reps"], size["warmup"], size["settle_s"])
    for name, times in samples.items():
        _timed(records[name], times)
        held = contenders.state_bytes(steps[name])
        if held is not None:
            records[name]["optimizer_state_bytes_per_param"] = held / case.numel
    del steps
    gc.collect()
    return list(records.values())


def _time_distributed(case, size):
    records = []
    for name, result in distributed.run(case, size["reps"], size["warmup"],
                                                  size["settle_s"]).items():
        record = _base_record(case, name, threads=1, ranks=distributed.WORLD_SIZE)
        if "error" in result:
            record.update(status=result.get("status", "error"), reason=result["error"])
        else:
            _timed(record, result["samples"])
            # Memory is per rank, so the state it is compared with is too.
            record.update(peak_extra_bytes=result["peak_extra_bytes"],
                          held_extra_bytes=0, memory_method=result["memory_method"],
                          local_numel=result["local_numel"],
                          state_bytes=max(result["local_numel"])
                          * case.preset.state_bytes_per_element)
        records.append(record)
    return records


def _kernel_bench_records(case, rows, threads):
    """The C++ benchmark's probe and bare kernel for this preset, as records."""
    row = rows.get(case.preset.label)
    if row is None or row.get("numel") != case.numel:
        return []
    records = []
    for name, key in KERNEL_BENCH_ROWS.items():
        record = _base_record(case, name, row.get("threads", threads))
        record["description"] = ("benchmarks/kernel_bench, separate process, own buffers: "
                                 + ("probe" if key == "probe_s" else "C++ AdamStep alone"))
        stats = row[key]
        record.update(seconds=stats, reps=None,
                      elements_per_s=case.numel / stats["median"],
                      gb_per_s=case.numel * case.preset.minimum_bytes / stats["median"] / 1e9)
        records.append(record)
    return records


def _ceiling_record(case, row, threads):
    """How fast the step could go on this CPU if memory cost nothing: ``threads`` times
    the bare kernel's rate on one thread over a tensor that stays in its caches
    (kernel_bench, the case's preset), as the time the case's elements would take.
    Perfect scaling and no memory traffic make it an upper bound: a fraction of the
    probe above the ceiling's is out of reach here, the step's instructions bind it."""
    record = _base_record(case, CEILING, threads)
    # The case's elements at threads * (row's elements per second), for each statistic.
    factor = case.numel / (threads * row["numel"])
    seconds = {key: row["kernel_s"][key] * factor for key in ("median", "min", "max")}
    record.update(description=(f"{threads} x one thread's rate on {row['numel']} elements "
                               "in cache (kernel_bench): the step's upper bound here"),
                  seconds=seconds, reps=None, cache_numel=row["numel"],
                  cache_seconds=row["kernel_s"],
                  elements_per_s=case.numel / seconds["median"],
                  gb_per_s=case.numel * case.preset.minimum_bytes / seconds["median"] / 1e9)
    return record


def time_case(case, size, threads, kernel_rows=None, ceiling_rows=None) -> list:
    """``kernel_rows``: kernel_bench's figures ({preset label: row}) at the cases'
    sizes; ``ceiling_rows``: the same on one thread over a cache-resident tensor."""
    if case.kind == "dtensor":
        records = _time_distributed(case, size)
    else:
        records = _time_local(case, size, threads)
        if kernel_rows:
            records += _kernel_bench_records(case, kernel_rows, threads)
        if ceiling_rows and case.preset.label in ceiling_rows:
            records.append(_ceiling_record(case, ceiling_rows[case.preset.label], threads))
    _relate(records, with_probe=case.kind in ("large", "lowbit"))
    return records


def _relate(records, with_probe):
    """Fractions of each probe and ratios between contenders of one case. Only large
    tensors (the large and lowbit cases) get probe fractions: over many small tensors
    the probe's own per-tensor overhead, not memory, sets its time, and the fraction
    would mean nothing."""
    timed = {r["contender"]: r for r in records if r["seconds"]}
    for record in timed.values():
        median = record["seconds"]["median"]
        for probe, field in (("probe", "fraction_of_probe"),
                             ("kernel_bench-probe", "fraction_of_kernel_bench_probe")):
            # The probes move the case's bytes: no fraction for another layout's.
            if with_probe and probe in timed and not record["own_layout"]:
                record[field] = timed[probe]["seconds"]["median"] / median
        # ratio_to[other] = other's median / this median: > 1 means this one is faster.
        record["ratio_to"] = {name: other["seconds"]["median"] / median
                              for name, other in timed.items()
                              if name != record["contender"] and name not in YARDSTICKS}
        paired = [name for name, other in timed.items()
                  if name != record["contender"] and name not in YARDSTICKS
                  and _same_repetitions(record, other)]
        record["paired_ratio_to"] = {
            name: timing.paired_ratio(timed[name]["samples"], record["samples"])
            for name in paired}
        record["paired_ratio_interval_to"] = {
            name: timing.paired_ratio_interval(timed[name]["samples"], record["samples"])
            for name in paired}


def _same_repetitions(a, b):
    """Both timed in one interleaved loop (kernel_bench's rows come from another process)."""
    return (a["samples"] is not None and b["samples"] is not None
            and len(a["samples"]) == len(b["samples"]))


def add_memory(records, peaks):
    """Fold ``{(case id, contender): memory result}`` into the records."""
    for record in records:
        result = peaks.get((record["case"], record["contender"]))
        if result is None:
            continue
        if "error" in result:
            record["memory_error"] = result["error"]
            continue
        record.update(peak_extra_bytes=result["peak_extra_bytes"],
                      held_extra_bytes=result.get("held_extra_bytes", 0),
                      memory_method=result["memory_method"])
    for record in records:
        if record["peak_extra_bytes"] is not None and record["state_bytes"]:
            record["peak_extra_fraction_of_state"] = (record["peak_extra_bytes"]
                                                      / record["state_bytes"])
