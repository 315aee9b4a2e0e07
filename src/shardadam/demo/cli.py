"""``python -m shardadam demo``: arguments, checks, and the three training phases.

1. ``adamw``: torch's ``AdamW(fused=True)`` on fp32 parameters, ``--ranks`` ranks.
2. ``shardadam``: ``shardadam.FusedAdam`` with the ``--state`` preset, same seed, same
   data, same ranks; saves a DCP checkpoint after step ``--steps // 2``.
3. ``resume``: the same shardadam run restarted from that checkpoint on
   ``--resume-ranks`` ranks, checked against phase 2 step by step.

Bad arguments are rejected before anything heavy is imported or started.
"""

import argparse
import json
import os
import sys
import tempfile
import time

from .config import DEFAULT_PRESET, PRESETS, SIZES

# A collective that waits longer than this fails instead of hanging the demo.
_COLLECTIVE_TIMEOUT_S = 120
# Per-phase deadline: start-up, then a generous allowance per step (a small-model step
# takes well under a second on 2 cores).
_PHASE_STARTUP_S = 180
_PHASE_PER_STEP_S = 10


class DemoError(Exception):
    """A problem with the demo's input or environment, reported in one line."""


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser):
    presets = "; ".join(f"{name}: {p.summary}" for name, p in PRESETS.items())
    parser.add_argument("--ranks", type=_positive_int, default=2,
                        help="processes (gloo, CPU mesh) for the two full runs (default 2)")
    parser.add_argument("--resume-ranks", type=_positive_int, default=3,
                        help="processes that resume the shardadam run from its mid-way "
                             "checkpoint; differ from --ranks to reshard (default 3)")
    parser.add_argument("--steps", type=_positive_int, default=120,
                        help="training steps of each full run; the checkpoint is taken "
                             "after steps // 2 (default 120, at least 2)")
    parser.add_argument("--state", choices=list(PRESETS), default=DEFAULT_PRESET,
                        metavar="PRESET",
                        help=f"shardadam state preset (default {DEFAULT_PRESET}). {presets}")
    parser.add_argument("--model", choices=list(SIZES), default="small",
                        help="small: 4 layers, width 128, 128-byte context, 16 sequences "
                             "per step; tiny: a few seconds' worth, for tests "
                             "(default small)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights and of the data order (default 0)")
    parser.add_argument("--out", default=None,
                        help="folder for demo.json, demo.png and the rank logs "
                             "(default runs/demo-<date>-<time> under the current folder)")
    # For the tests: make one rank fail at one step (RANK:STEP).
    parser.add_argument("--fail-at", default=None, help=argparse.SUPPRESS)


def _check(args):
    rows = SIZES[args.model].rows
    if args.steps < 2:
        raise DemoError(f"--steps must be at least 2 (a checkpoint mid-way), got {args.steps}")
    for flag, ranks in (("--ranks", args.ranks), ("--resume-ranks", args.resume_ranks)):
        if ranks > rows:
            raise DemoError(f"{flag} {ranks} exceeds the {rows} sequences of a "
                            f"{args.model} model's global batch")
    if args.fail_at is not None:
        try:
            rank, step = (int(part) for part in args.fail_at.split(":"))
        except ValueError:
            raise DemoError(f"--fail-at expects RANK:STEP, got {args.fail_at!r}") from None
        args.fail_at = (rank, step)
    if args.out is None:
        args.out = os.path.join("runs", time.strftime("demo-%Y%m%d-%H%M%S"))
    try:
        os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
        with tempfile.TemporaryFile(dir=args.out):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise DemoError(f"cannot write to output folder {args.out!r}: {reason}") from None


def _threads_per_rank(ranks):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // ranks)


def phase_config(args, workdir, corpus, phase, **extra):
    """The dict every rank of a phase receives (see ``worker``)."""
    config = {
        "phase": phase, "size": args.model, "seed": args.seed, "steps": args.steps,
        "preset": args.state, "optimizer": "shardadam", "start_step": 0,
        "corpus": corpus, "checkpoint": os.path.join(workdir, "checkpoint"),
        "results": os.path.join(args.out, "logs"),
        "collective_timeout_s": _COLLECTIVE_TIMEOUT_S,
    }
    if args.fail_at is not None:
        config["fail_rank"], config["fail_step"] = args.fail_at
    config.update(extra)
    return config


def _read_phase(results, phase, world_size):
    ranks = []
    for rank in range(world_size):
        with open(os.path.join(results, f"{phase}-rank{rank}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def run(args):
    """The demo; returns the process exit status."""
    try:
        _check(args)
    except DemoError as error:
        print(f"shardadam demo: error: {error}", file=sys.stderr)
        return 2
    from . import launcher, report
    from .corpus import build_corpus

    began = time.monotonic()
    mid = args.steps // 2
    with tempfile.TemporaryDirectory(prefix="shardadam-demo-") as workdir:
        corpus_path = os.path.join(workdir, "corpus.bin")
        corpus = build_corpus(corpus_path, SIZES[args.model].corpus_bytes)
        print(f"shardadam demo: {args.model} transformer, {args.steps} steps, seed "
              f"{args.seed}; corpus: {corpus['bytes'] / 2**20:.1f} MiB of Python source "
              f"from {corpus['files']} files under {corpus['source']}", flush=True)
        plan = [
            ("adamw", args.ranks, f"torch AdamW fp32 x{args.ranks}",
             {"optimizer": "adamw", "preset": "fp32"}),
            ("shardadam", args.ranks, f"shardadam {args.state} x{args.ranks}",
             {"save_at": mid}),
            ("resume", args.resume_ranks, f"resumed x{args.resume_ranks}",
             {"start_step": mid}),
        ]
        phases = {}
        for phase, ranks, label, extra in plan:
            if phase == "resume":
                extra["reference"] = {str(r["step"]): r["loss"]
                                      for r in phases["shardadam"][0]["steps"]}
            config = phase_config(args, workdir, corpus_path, phase, label=label,
                                  threads=_threads_per_rank(ranks), **extra)
            print(f"phase {phase}: {label} ({config['threads']} thread(s) per rank)"
                  + (f", from the checkpoint of step {mid}" if phase == "resume" else ""),
                  flush=True)
            steps_to_run = args.steps - config["start_step"]
            try:
                launcher.run_phase(config, ranks, workdir,
                                   _PHASE_STARTUP_S + _PHASE_PER_STEP_S * steps_to_run)
            except launcher.RankFailure as failure:
                print(f"shardadam demo: error: {failure}", file=sys.stderr)
                return 1
            phases[phase] = _read_phase(config["results"], phase, ranks)
    figures = report.summarize(args, corpus, phases, time.monotonic() - began)
    json_path, png_path = report.write(args.out, figures)
    print(report.table(figures))
    print(f"wrote {json_path}\n      {png_path}\n      (rank logs in "
          f"{os.path.join(args.out, 'logs')})")
    return 0 if figures["resume_check"]["passed"] else 1
