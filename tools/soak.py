"""The long soak: ``python tools/soak.py`` from the repository root (defaults: every
demo preset, 600 steps, a checkpoint every 10, 16 ranks SIGKILLed, world sizes 2 and 3;
about 10 minutes on 2 cores for the four presets of docs/guarantees.md's record).

FSDP2 on gloo CPU ranks with the demo's model; ranks are killed at random moments
(backward, ``step()``, a checkpoint write, from outside), the job is restarted from the
newest complete checkpoint, sometimes at another world size, and the end is compared
bitwise with the same run never killed; RSS, open file descriptors, threads and live
Python objects of every rank process are judged after warm-up. The machinery is the
test suite's (tests/python/distributed/_soak.py, which CI runs in a short variant,
test_dist_soak.py): it starts ranks through the distributed tests' harness and reuses
their checkpoint-crash tripwire and bitwise comparisons.

Prints one line per attempt and per reference run, then a summary; writes
``report.json`` into ``--out``. Exits 1 when anything differs or grows.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests", "python", "distributed"),
                os.path.join(ROOT, "tests", "python")]


def _parse(argv):
    from shardadam.demo.config import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="steps of the run")
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--kills", type=int, default=16,
                        help="attempts that lose a rank (phases in turn, shuffled)")
    parser.add_argument("--kill-window", type=float, default=3.0,
                        help="a rank dies within this many checkpoint intervals of its "
                             "attempt's start")
    parser.add_argument("--world-sizes", default="2,3",
                        help="two or more different world sizes, comma-separated")
    parser.add_argument("--presets", default=",".join(PRESETS),
                        help=f"demo presets, comma-separated, each once (default all: "
                             f"{', '.join(PRESETS)})")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the data, the model and where kills strike (>= 0)")
    parser.add_argument("--out", default=None,
                        help="fresh folder for everything (default runs/soak-<date>-<time>)")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    unknown = set(args.presets.split(",")) - set(PRESETS)
    if unknown:
        parser.error(f"unknown preset(s) {sorted(unknown)}; choose from {list(PRESETS)}")
    try:
        args.world_sizes = tuple(int(w) for w in args.world_sizes.split(","))
    except ValueError:
        parser.error(f"--world-sizes: expected comma-separated whole numbers, got "
                     f"{args.world_sizes!r}")
    import _soak

    args.plan = _soak.Plan(presets=tuple(args.presets.split(",")), steps=args.steps,
                           every=args.every, kills=args.kills, world_sizes=args.world_sizes,
                           kill_window=args.kill_window, seed=args.seed)
    error = _soak.plan_error(args.plan)  # before --out is made
    if error is not None:
        parser.error(error)
    args.out = args.out or os.path.join("runs", time.strftime("soak-%Y%m%d-%H%M%S"))
    if os.path.exists(args.out):
        parser.error(f"{args.out} exists; give a fresh folder")
    try:  # made now, so a folder that cannot be made is a usage error, not a traceback
        os.makedirs(args.out)
    except OSError as error:
        parser.error(f"--out: cannot make {args.out!r}: {error.strerror or error}")
    return args


def _cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor() or "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    get = lambda key: fields.get(key, "?").strip()  # noqa: E731
    return (f"{get('Model name')} (family {get('CPU family')}, model {get('Model')}), "
            f"{get('CPU(s)')} CPUs")


def _summary(report):
    plan = report["plan"]
    lines = [
        f"steps {plan['steps']} (checkpoint every {plan['every']}), presets "
        f"{', '.join(plan['presets'])}",
        f"kills survived {sum(report['kills'].values())}: " + ", ".join(
            f"{n} {phase}" for phase, n in report["kills"].items()),
        "  where they struck: " + ", ".join(
            f"{report['kills_landed'].count(x)}x {x}" for x in sorted(set(report["kills_landed"]))),
        f"restarts {report['restarts']}, world sizes visited {report['world_sizes_visited']}, "
        f"steps run {report['steps_run']} (redone after kills: "
        f"{report['steps_run'] - plan['steps']})",
        "lineage of the final state: " + ", ".join(
            f"{s['from']}-{s['to']} at W={s['world_size']}" for s in report["lineage"]),
        f"compared bitwise with the run never killed: losses of every rank and preset at "
        f"all {report['compared_steps']} steps; final parameters, exported and stored "
        f"states, scales, step counts",
        f"time {report['seconds']:.0f} s (soak {report['soak_seconds']:.0f} s, reference "
        f"{report['seconds'] - report['soak_seconds']:.0f} s)",
        "resources after warm-up (per judged rank process):",
    ]
    for label, f in sorted(report["resources"].items()):
        lines.append(
            f"  {label:<22} steps {f['warm_step']:>4}+{f['judged_steps']:<4} RSS "
            f"{f['rss_warm'] / 2**20:7.2f} MiB {f['rss_growth'] / 1024:+6.0f} KiB "
            f"(bound {f['rss_bound'] / 1024:6.0f} KiB)  fds {f['fds']}  threads "
            f"{f['threads']}  objects {f['objects_warm']} -> {f['objects'][-1]}")
    return "\n".join(lines)


def main(argv=None):
    args = _parse(argv)
    import _soak

    try:
        report = _soak.soak(args.plan, os.path.abspath(args.out),
                            log=lambda m: print(m, flush=True))
    except _soak.SoakError as error:
        print(f"SOAK FAILED: {error}\n(everything is in {args.out})", file=sys.stderr)
        return 1
    report["cpu"] = _cpu_model()
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print()
    print(_summary(report))
    print(f"cpu: {report['cpu']}")
    if report["resource_problems"]:
        print("SOAK FAILED: resources grew after warm-up:\n  "
              + "\n  ".join(report["resource_problems"]), file=sys.stderr)
        return 1
    print(f"PASS  (report: {os.path.join(args.out, 'report.json')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
