"""The demo's figures: summary table, resume check, ``demo.json`` and ``demo.png``.

Works on what the ranks wrote (``worker.train``'s dicts), nothing else.
"""

import json
import os
import statistics

# Resume check. Phase 3 restarts from the checkpoint with the parameters and optimizer
# state restored exactly (bf16 parameters, bf16 moments and int16 remainders round-trip
# bitwise; fp8 moments within a rounding of the re-derived per-shard scale) and trains on
# the same tokens at every step; what changes with the rank count is only the order of
# floating-point sums (each rank's partial loss and gradient sums, and the gradient
# reduce-scatter). Such round-off differences start near fp32's epsilon (~1e-7) and
# grow step by step as training amplifies them, yet stay far below the per-step loss
# noise of different batches. A broken resume (wrong data order, lost or reset state,
# parameters not restored) instead moves the loss by at least that batch noise.
# Measured on the small model over 60 resumed steps: at most ~1e-3 (fp32 / bf16 /
# remainder presets). Tolerance: the first resumed step within FIRST_STEP_TOL (only the
# summation order of one forward pass differs), every step within SEGMENT_TOL.
FIRST_STEP_TOL = 1e-3
SEGMENT_TOL = 2e-2


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
        "state_bytes_per_param": sum(r["state_bytes"] for r in ranks) / params,
        "param_bytes_per_param": sum(r["param_bytes"] for r in ranks) / params,
        "peak_rss_mib": max(r["peak_rss_bytes"] for r in ranks) / 2**20,
        "opt_ms_mean": statistics.fmean(timed),
        "opt_ms_median": statistics.median(timed),
        "tokens_per_s_median": statistics.median(s["tokens_per_s"] for s in steps),
    }


def resume_check(uninterrupted, resumed):
    """Compares the resumed segment with the same steps of the uninterrupted run."""
    reference = dict(zip(uninterrupted["step"], uninterrupted["loss"]))
    diffs = [loss - reference[step] for step, loss in zip(resumed["step"], resumed["loss"])]
    first, worst = abs(diffs[0]), max(abs(d) for d in diffs)
    return {
        "from_step": resumed["step"][0] - 1,
        "ranks": [uninterrupted["ranks"], resumed["ranks"]],
        "diff": diffs,
        "first_step_abs_diff": first, "max_abs_diff": worst,
        "first_step_tolerance": FIRST_STEP_TOL, "tolerance": SEGMENT_TOL,
        "passed": first <= FIRST_STEP_TOL and worst <= SEGMENT_TOL,
    }


def summarize(args, corpus, phases, wall_s):
    runs = {name: _run_figures(ranks) for name, ranks in phases.items()}
    return {
        "config": {"ranks": args.ranks, "resume_ranks": args.resume_ranks,
                   "steps": args.steps, "state": args.state, "model": args.model,
                   "seed": args.seed},
        "corpus": corpus,
        "runs": runs,
        "resume_check": resume_check(runs["shardadam"], runs["resume"]),
        "wall_s": wall_s,
    }


def table(figures):
    runs, check = figures["runs"], figures["resume_check"]
    header = (f"{'run':<30} {'ranks':>5} {'loss':>15} {'state B/param':>13} "
              f"{'param B/param':>13} {'peak RSS':>10} {'opt step':>9}")
    lines = [header, "-" * len(header)]
    for run in runs.values():
        loss = f"{run['first_loss']:.3f} -> {run['final_loss']:.3f}"
        lines.append(f"{run['label']:<30} {run['ranks']:>5} {loss:>15} "
                     f"{run['state_bytes_per_param']:>13.2f} "
                     f"{run['param_bytes_per_param']:>13.2f} "
                     f"{run['peak_rss_mib']:>6.0f} MiB {run['opt_ms_mean']:>6.2f} ms")
    verdict = "PASS" if check["passed"] else "FAIL"
    lines.append(
        f"resume check ({check['ranks'][0]} -> {check['ranks'][1]} ranks at step "
        f"{check['from_step']}): {verdict}: first step |diff| "
        f"{check['first_step_abs_diff']:.1e} (<= {check['first_step_tolerance']:.0e}), "
        f"max |diff| {check['max_abs_diff']:.1e} (<= {check['tolerance']:.0e})")
    lines.append("loss: first -> final step; state: optimizer state tensors summed over "
                 "ranks; peak RSS: highest rank; opt step: mean per step after the first, "
                 "mean over ranks")
    lines.append(f"wall time {figures['wall_s']:.0f} s")
    return "\n".join(lines)


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
        top.plot(run["step"], run["loss"], label=run["label"], linewidth=1.2,
                 **styles.get(name, {}))
        bottom.plot(run["step"], run["opt_ms"], label=run["label"], linewidth=1.0,
                    **styles.get(name, {}))
    for axis in (top, bottom):
        axis.axvline(check["from_step"], color="gray", linewidth=0.8, linestyle=":")
        axis.grid(alpha=0.3)
    verdict = "pass" if check["passed"] else "FAIL"
    top.set_title(f"{figures['config']['model']} transformer, FSDP2 on CPU: loss "
                  f"(checkpoint at step {check['from_step']}, resume {verdict}, "
                  f"max |diff| {check['max_abs_diff']:.1e})", fontsize=10)
    top.set_ylabel("training loss (nats/byte)")
    top.legend()
    bottom.set_ylabel("optimizer step (ms)")
    bottom.set_xlabel("step")
    bottom.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
