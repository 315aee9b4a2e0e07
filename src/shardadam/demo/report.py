"""The demo's figures: summary table, resume check, ``demo.json`` and ``demo.png``.

Works on what the ranks wrote (``worker.train``'s dicts), nothing else.
"""

import json
import os
import statistics

from .. import _machine
from .config import PRESETS

# Resume check: the resumed curve against the same steps of the uninterrupted run.
#
# The resumed run restores parameters and optimizer state from the checkpoint (fp32,
# bf16 and int16-remainder state round-trip bitwise; fp8 state is re-quantized with
# scales re-derived over each new, differently sized local shard) and trains on the
# same tokens at every step. With the rank count only the order of floating-point sums
# changes (each rank's share of the loss and gradient sums, the reduce-scatter). The
# loss is an fp32 mean of 3 nats over >= 256 tokens: its ulp is 2.4e-7, so summation
# order shows as a few 1e-7 at first, and grows as training compounds it.
#
# The check judges the first EARLY_STEPS resumed steps, before that growth, against the
# state preset's bound (config.StatePreset.resume_tolerance); later steps are reported,
# not judged: the difference compounds chaotically with the length of the run (tiny
# model, remainder-bf16: 2.2e-5 after 80 steps, 7.5e-4 to 8.5e-3 after 200 to 300).
# Measured, 2 -> 3 ranks (small model, seed 0; tiny model, seeds 0-7):
#   legitimate    exact state (fp32, bf16, remainders): first steps <= 3.6e-7: bound 2e-6
#                 fp8 exp_avg (re-quantized, up to half an E4M3 step per value): first
#                 steps <= 1e-4 (small), 6.2e-4 (tiny): bound 2e-3
#                 block8 presets (cut blocks re-scaled; tiny seeds 0-5 and small seed 0,
#                 2026-12-07): remainder-block8 <= 1.1e-6, bf16-block8 <= 2.4e-7,
#                 bf16-sr-block8 <= 2.0e-6: bound 1e-5
#                 block4 (its stochastic codes flip where a block is cut): <= 9.2e-5
#                 (tiny), 6e-8 (small): bound 5e-4
#   broken        remainders' low byte lost on load: 1.1e-5 (tiny); block8 6.3e-6 to
#                 1.2e-4, block4 2.5e-5 to 9.8e-5 (tiny seeds 0-2: block4's bound cannot
#                 tell it from a legitimate resume)
#                 remainders zeroed on load: block8 2.1e-4 to 5.1e-4, block4 2.1e-4 to
#                 6.9e-4 (tiny seeds 0-2); before 2026-12-07 the block presets' bound was
#                 fp8's 2e-3, which passed all of these
#                 exp_avg through an fp8 round trip on load: 4.9e-4 (tiny)
#                 step count reset (bias correction restarts): 6.5e-3 after one update
#                 moments lost: 5.4e-2 after one update
#                 data order shifted: 0.25 at once
EARLY_STEPS = 5
# The README's accuracy figure: the mean loss of a run's last steps.
LAST_STEPS = 10


def _run_figures(ranks):
    """One phase's curve and summary from its ranks' records."""
    head = ranks[0]
    steps = head["steps"]
    params = head["params"]
    opt_ms = [s["opt_ms"] for s in steps]
    timed = opt_ms[1:] or opt_ms  # the first step also builds state and caches
    return {
        "label": head["label"], "optimizer": head["optimizer"], "preset": head["preset"],
        "ranks": head["world_size"], "params": params,
        "step": [s["step"] for s in steps],
        "loss": [s["loss"] for s in steps],
        "opt_ms": opt_ms,
        "tokens_per_s": [s["tokens_per_s"] for s in steps],
        "first_loss": steps[0]["loss"], "final_loss": steps[-1]["loss"],
        "last_mean_loss": statistics.fmean(s["loss"] for s in steps[-LAST_STEPS:]),
        "last_mean_steps": len(steps[-LAST_STEPS:]),
        "state_bytes_per_param": sum(r["state_bytes"] for r in ranks) / params,
        "param_bytes_per_param": sum(r["param_bytes"] for r in ranks) / params,
        "peak_rss_mib": max(r["peak_rss_bytes"] for r in ranks) / 2**20,
        # Growth of the highest rank over its RSS before training (torch alone).
        "training_rss_mib": max(r["peak_rss_bytes"] - (r["start_rss_bytes"] or 0)
                                for r in ranks) / 2**20,
        "opt_ms_steps": len(opt_ms) - 1,  # 0: a one-step run times its first step
        "opt_ms_mean": statistics.fmean(timed),
        "opt_ms_median": statistics.median(timed),
        "tokens_per_s_median": statistics.median(s["tokens_per_s"] for s in steps),
    }


def resume_check(uninterrupted, resumed):
    """Compares the resumed segment with the same steps of the uninterrupted run."""
    reference = dict(zip(uninterrupted["step"], uninterrupted["loss"]))
    diffs = [loss - reference[step] for step, loss in zip(resumed["step"], resumed["loss"])]
    early = max(abs(d) for d in diffs[:EARLY_STEPS])
    worst = max(abs(d) for d in diffs)
    tolerance = PRESETS[resumed["preset"]].resume_tolerance
    return {
        "from_step": resumed["step"][0] - 1,
        "ranks": [uninterrupted["ranks"], resumed["ranks"]],
        "diff": diffs,
        "early_steps": min(EARLY_STEPS, len(diffs)),
        "early_max_abs_diff": early, "early_tolerance": tolerance,
        "max_abs_diff": worst,
        "passed": early <= tolerance,
    }


def summarize(args, corpus, phases, phase_wall_s, wall_s):
    runs = {name: _run_figures(ranks) for name, ranks in phases.items()}
    for name, seconds in phase_wall_s.items():
        runs[name]["wall_s"] = seconds
    return {
        "config": {"ranks": args.ranks, "resume_ranks": args.resume_ranks,
                   "steps": args.steps, "state": args.state, "model": args.model,
                   "seed": args.seed, "also": list(args.also)},
        "corpus": corpus,
        "runs": runs,
        "resume_check": resume_check(runs["shardadam"], runs["resume"]),
        "machine": _machine.describe(),
        "wall_s": wall_s,
    }


def table(figures):
    runs, check = figures["runs"], figures["resume_check"]
    width = max([28] + [len(run["label"]) for run in runs.values()])  # block presets: 29
    header = (f"{'run':<{width}} {'ranks':>5} {'loss first -> final':>19} "
              f"{f'last {LAST_STEPS} mean':>12} "
              f"{'state B/param':>13} {'param B/param':>13} {'peak RSS MiB':>14} "
              f"{'opt step ms':>11} {'(median)':>8}")
    lines = [header, "-" * len(header)]
    for run in runs.values():
        loss = f"{run['first_loss']:.3f} -> {run['final_loss']:.3f}"
        rss = f"{run['peak_rss_mib']:.0f} (+{run['training_rss_mib']:.0f})"
        lines.append(f"{run['label']:<{width}} {run['ranks']:>5} {loss:>19} "
                     f"{run['last_mean_loss']:>12.3f} "
                     f"{run['state_bytes_per_param']:>13.2f} "
                     f"{run['param_bytes_per_param']:>13.2f} {rss:>14} "
                     f"{run['opt_ms_mean']:>11.2f} {run['opt_ms_median']:>8.2f}")
    verdict, within = ("PASS", "<=") if check["passed"] else ("FAIL", ">")
    machine = figures["machine"]
    lines += [
        f"resume check, {check['ranks'][0]} -> {check['ranks'][1]} ranks from step "
        f"{check['from_step']}: {verdict}  (max |loss diff| first {check['early_steps']} "
        f"steps {check['early_max_abs_diff']:.1e} {within} {check['early_tolerance']:.0e}; "
        f"all {len(check['diff'])} steps {check['max_abs_diff']:.1e}, not judged)",
        f"machine: {machine['cpu']}, {machine['logical_cpus']} logical CPUs; torch "
        f"{machine['torch']}, shardadam {machine['shardadam']} ({machine['simd_target']})",
        "state B/param: optimizer state bytes, all ranks, per model parameter.",
        "peak RSS: highest rank (+ its growth while training: at this model size mostly "
        "torch's working memory; the shardadam run also saves the checkpoint).",
        "opt step: optimizer.step() time, mean (median) over the steps after the first, "
        "ranks averaged.",
        *_short_runs(runs),
        f"wall time {figures['wall_s']:.0f} s after the argument check",
    ]
    return "\n".join(lines)


def _short_runs(runs):
    """Footnotes for runs too short for a column's rule (a resumed run of few steps)."""
    notes = []
    for run in runs.values():
        if run["last_mean_steps"] < LAST_STEPS:
            count = run["last_mean_steps"]
            notes.append(f"{run['label']}: last {LAST_STEPS} mean over its {count} "
                         f"step{'s' if count > 1 else ''}.")
        if run["opt_ms_steps"] == 0:
            notes.append(f"{run['label']}: opt step times its only step, the first.")
    return notes


def write(out, figures):
    """Writes demo.json and demo.png into ``out``; returns both paths."""
    json_path = os.path.join(out, "demo.json")
    with open(json_path, "w") as f:
        json.dump(figures, f, indent=1)
    png_path = os.path.join(out, "demo.png")
    plot(png_path, figures)
    return json_path, png_path


def plot(path, figures):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot as plt

    runs, check = figures["runs"], figures["resume_check"]
    styles = {"adamw": {"color": "tab:blue"},
              "shardadam": {"color": "tab:orange"},
              "resume": {"color": "tab:green", "linestyle": "--"}}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    for name, run in runs.items():
        label = f"{run['label']} ({run['state_bytes_per_param']:.0f} B/param state)"
        top.plot(run["step"], run["loss"], label=label, linewidth=1.2,
                 **styles.get(name, {}))
        bottom.plot(run["step"], run["opt_ms"], label=run["label"], linewidth=1.0,
                    **styles.get(name, {}))
    for axis in (top, bottom):
        axis.axvline(check["from_step"], color="gray", linewidth=0.8, linestyle=":")
        axis.grid(alpha=0.3)
    verdict = "pass" if check["passed"] else "FAIL"
    top.set_title(f"{figures['config']['model']} transformer, FSDP2 on CPU; checkpoint "
                  f"at step {check['from_step']} resumed on {check['ranks'][1]} ranks: "
                  f"{verdict}, max |loss diff| first {check['early_steps']} steps "
                  f"{check['early_max_abs_diff']:.1e}", fontsize=10)
    top.set_ylabel("training loss (nats/byte)")
    top.legend()
    bottom.set_ylabel("optimizer step (ms)")
    bottom.set_xlabel("step")
    bottom.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
