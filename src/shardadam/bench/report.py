"""The run's outputs: a text table, the JSON file and the PNG chart.

JSON: ``{"meta": {...}, "results": [record, ...]}``, one record per (case, contender):
case, kind, contender, description, preset (the case's dtype combo), own_layout (True
where the contender steps another layout, its bytes and dtypes then its own: the
contenders that keep no master beside the low-bit cases' remainders), dtypes, numel, tensors,
threads, ranks, status ("ok", "unavailable", "unsupported", "error") and reason,
seconds {median, min, max}, reps, elements_per_s, gb_per_s (at docs/benchmarking.md's
minimum bytes), bytes_per_element {minimum, effective}, state_bytes, fraction_of_probe
(probe median / this median), fraction_of_kernel_bench_probe, ratio_to {contender: its
median / this median; > 1 means this one is faster}, paired_ratio_to {contender: median
over repetitions of its time / this one's in the same interleaved round},
paired_ratio_interval_to {contender: [low, high] holding that median with 95%
confidence, or None for fewer than 6 repetitions (``timing.paired_ratio_interval``)},
samples (seconds per repetition; None for kernel_bench's rows), peak_extra_bytes (what
one step allocates and touches beyond what lived before it, plus held_extra_bytes: the
working buffers a contender keeps between steps beside its state) and
peak_extra_fraction_of_state (peak_extra_bytes / state_bytes, the case's resident bytes:
params, grads, moments and master); optimizer_state_bytes_per_param where the contender
is a torch optimizer (every tensor in its ``state``: moments, codes, scales, master
copies). The lowbit cases' ``kernel_bench-ceiling`` (``runner.CEILING``) adds
cache_numel and cache_seconds: kernel_bench's one-thread time over that many elements,
which its seconds scale to the case's elements and threads. ``meta``: the run's
settings, the CPU (model name, and in cpu_id its vendor, family, model, stepping and
SIMD flags), the source's git commit, torch's version.
"""

from __future__ import annotations

import json

_MIB = 1 << 20


def _reference(case_records):
    names = {r["contender"] for r in case_records if r["seconds"]}
    return "plain" if "plain" in names else "shardadam" if "shardadam" in names else None


def _fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def _interval(bounds) -> str:
    return "-" if bounds is None else f"{bounds[0]:.2f}-{bounds[1]:.2f}"


def table(records) -> str:
    """One line per record, grouped by case. "/probe": fraction of the torch probe on
    the same arrays; "/cpp": of kernel_bench's C++ probe; "t/ref": this median over the
    reference contender's (shardadam; plain for the DTensor case), above 1 is slower;
    "/core": the bare core call's time over this one's, paired by repetition (the large
    and training cases), and "(95%)" the interval that holds it with 95% confidence;
    "extra MiB": peak extra memory of a step, "%resid" the same as a percentage of the
    case's resident bytes (params, grads, moments, master); "state B/p": optimizer state
    bytes per parameter."""
    header = (f"{'case':<28} {'contender':<20} {'tensors':>7} {'numel':>11} "
              f"{'median ms':>10} {'(min-max)':>17} {'Gelem/s':>8} {'GB/s':>7} "
              f"{'/probe':>6} {'/cpp':>5} {'t/ref':>6} {'/core':>5} {'(95%)':>9} "
              f"{'extra MiB':>9} {'%resid':>7} {'state B/p':>9}")
    lines = [header, "-" * len(header)]
    case_ids = list(dict.fromkeys(r["case"] for r in records))
    for case_id in case_ids:
        rows = [r for r in records if r["case"] == case_id]
        ref = _reference(rows)
        ref_median = next((r["seconds"]["median"] for r in rows
                           if r["contender"] == ref and r["seconds"]), None)
        lines.append(f"{case_id}   [{rows[0]['preset']}]")
        for r in rows:
            if not r["seconds"]:
                lines.append(f"{'':<28} {r['contender']:<20} {r['status']}: {r['reason']}")
                continue
            s = r["seconds"]
            spread = f"({s['min'] * 1e3:.2f}-{s['max'] * 1e3:.2f})"
            vs_ref = s["median"] / ref_median if ref_median else None
            extra = r["peak_extra_bytes"]
            fraction = r["peak_extra_fraction_of_state"]
            missing = "failed" if "memory_error" in r else "-"  # its reason: the JSON
            lines.append(
                f"{'':<28} {r['contender']:<20} {r['tensors']:>7} {r['numel']:>11} "
                f"{s['median'] * 1e3:>10.2f} {spread:>17} "
                f"{r['elements_per_s'] / 1e9:>8.3f} {r['gb_per_s']:>7.2f} "
                f"{_fmt(r['fraction_of_probe'], '6.2f'):>6} "
                f"{_fmt(r['fraction_of_kernel_bench_probe'], '5.2f'):>5} "
                f"{_fmt(vs_ref, '6.2f'):>6} "
                f"{_fmt(r['paired_ratio_to'].get('core'), '5.2f'):>5} "
                f"{_interval(r['paired_ratio_interval_to'].get('core')):>9} "
                f"{_fmt(None if extra is None else extra / _MIB, '9.2f', missing):>9} "
                f"{_fmt(None if fraction is None else 100 * fraction, '7.3f'):>7} "
                f"{_fmt(r.get('optimizer_state_bytes_per_param'), '9.3f'):>9}")
    return "\n".join(lines)


def write_json(path, meta, records) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": records}, f, indent=1)
        f.write("\n")


_COLORS = {"shardadam": "tab:blue", "torch-fused": "tab:orange",
           "torch-foreach": "tab:green", "deepspeed": "tab:purple",
           "multipass": "tab:red", "probe": "0.55", "kernel_bench-probe": "0.75",
           "kernel_bench-kernel": "tab:cyan", "kernel_bench-ceiling": "0.35",
           "dtensor": "tab:blue", "plain": "tab:olive",
           "torchao-adamw8bit": "tab:brown", "torchao-adamw4bit": "tab:pink",
           "torchao-adamwfp8": "goldenrod", "bnb-adamw8bit": "tab:gray"}


def write_png(path, meta, records) -> None:
    """Left: GB/s (minimum bytes) per contender, grouped by case, min-max as
    error bars. Right: peak extra bytes of one step as % of the state bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in records if r["seconds"]]
    labels = [f"{r['case']}  {r['contender']}" for r in timed]
    fig, (speed, mem) = plt.subplots(
        1, 2, figsize=(14, 0.28 * len(timed) + 1.8), sharey=True,
        gridspec_kw={"width_ratios": [3, 1]})
    y = list(range(len(timed)))[::-1]
    colors = [_COLORS.get(r["contender"], "tab:gray") for r in timed]
    gbs = [r["gb_per_s"] for r in timed]
    bytes_ = [r["numel"] * r["bytes_per_element"]["minimum"] / 1e9 for r in timed]
    # Clamped: rounding can put a median a hair outside [min, max] in GB/s.
    low = [max(0.0, g - b / r["seconds"]["max"]) for g, b, r in zip(gbs, bytes_, timed)]
    high = [max(0.0, b / r["seconds"]["min"] - g) for g, b, r in zip(gbs, bytes_, timed)]
    speed.barh(y, gbs, color=colors, xerr=[low, high], error_kw={"elinewidth": 0.8})
    speed.set_yticks(y, labels, fontsize=7)
    speed.set_xlabel("GB/s (the minimum bytes the step must move); bars: median, "
                     "whiskers: min-max")
    peak = [100 * (r["peak_extra_fraction_of_state"] or 0) for r in timed]
    mem.barh(y, peak, color=colors)
    for row, record in zip(y, timed):  # a failed measurement is no bar at 0
        if "memory_error" in record:
            mem.text(0, row, " not measured", va="center", fontsize=6, color="tab:red")
    # On two lines: the quarter-width panel cut one line short.
    mem.set_xlabel("peak extra memory of a step,\n% of params + grads + state")
    title = (f"shardadam bench ({meta['mode']}, scale {meta['scale']}): "
             f"{meta['threads']} threads, {meta['cpu']}, load avg at start "
             f"{meta['load_average_start'][0]:.2f}")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
