"""``python -m shardadam demo``: arguments, checks, and the three training phases.

1. ``adamw``: torch's ``AdamW(fused=True)`` on fp32 parameters, ``--ranks`` ranks;
   then each ``--also`` optimizer (another package's, e.g. torchao's ``AdamW8bit``) the
   same way.
2. ``shardadam``: ``shardadam.FusedAdam`` with the ``--state`` preset, same seed, same
   data, same ranks; saves a DCP checkpoint after step ``--steps // 2``.
3. ``resume``: the same shardadam run restarted from that checkpoint on
   ``--resume-ranks`` ranks, checked against phase 2 step by step.

Bad arguments are rejected before anything heavy is imported or started.
"""

import argparse
import importlib.metadata
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time

from .. import peers
from .._arguments import missing_modules, write_error
from .config import DEFAULT_PRESET, PRESETS, SIZES

# A collective that waits longer than this fails instead of hanging the demo.
_COLLECTIVE_TIMEOUT_S = 120
# Per-phase deadline: start-up, then a generous allowance per step (a small-model step
# takes well under a second on 2 cores).
_PHASE_STARTUP_S = 180
_PHASE_PER_STEP_S = 10


class DemoError(Exception):
    """A problem with the demo's input or environment, reported in one line."""


def _int_at_least(minimum, maximum=None):
    """argparse type: a whole number >= ``minimum`` (and <= ``maximum`` if given)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") \
                from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value
    return parse


def _peer_list(text):
    """argparse type: comma-separated names of peers that step DTensor parameters."""
    names = [name for name in text.split(",") if name]
    for name in names:
        if name not in peers.DTENSOR_PEERS:
            raise argparse.ArgumentTypeError(
                f"{name!r} is not one of {', '.join(peers.DTENSOR_PEERS)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a name is given twice in {text!r}")
    return tuple(names)


def _fresh_folder(base):
    """``base``, or ``base-2``, ``base-3``, ... if taken: runs never share a folder."""
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def add_arguments(parser):
    presets = "; ".join(f"{name}: {p.summary}" for name, p in PRESETS.items())
    parser.add_argument("--ranks", type=_int_at_least(1), default=2,
                        help="processes (gloo, CPU mesh) for the two full runs (default 2)")
    parser.add_argument("--resume-ranks", type=_int_at_least(1), default=3,
                        help="processes that resume the shardadam run from its mid-way "
                             "checkpoint; differ from --ranks to reshard (default 3)")
    # 3: the resume check judges a resumed step taken after a resumed update.
    parser.add_argument("--steps", type=_int_at_least(3), default=100,
                        help="training steps of each full run, at least 3; the "
                             "checkpoint is taken after steps // 2 (default 100)")
    parser.add_argument("--state", choices=list(PRESETS), default=DEFAULT_PRESET,
                        metavar="PRESET",
                        help=f"shardadam state preset (default {DEFAULT_PRESET}). {presets}")
    parser.add_argument("--model", choices=list(SIZES), default="small",
                        help="small: 4 layers, width 128, 128-byte context, 16 sequences "
                             "per step; tiny: a few seconds' worth, for tests "
                             "(default small)")
    # The data order's generator is seeded with seed * 1_000_003 + step, which torch
    # takes up to 2**64 - 1.
    parser.add_argument("--seed", type=_int_at_least(0, 2**32 - 1), default=0,
                        help="seed of the initial weights and of the data order, below "
                             "2**32 (default 0)")
    parser.add_argument("--also", type=_peer_list, default=(), metavar="NAMES",
                        help="also train with these optimizers of other packages, on fp32 "
                             "parameters, same data and ranks, for their losses and state "
                             "beside shardadam's (comma-separated: "
                             f"{', '.join(peers.DTENSOR_PEERS)}; they need torchao: "
                             "0.14.1 for torch 2.9, the version a checkout's `make "
                             "bench` installs)")
    parser.add_argument("--out", default=None, type=_folder_name,
                        help="folder for demo.json, demo.png and the rank logs "
                             "(default runs/demo-<date>-<time> under the current folder)")
    # For the tests: make one rank fail at one step (RANK:STEP).
    parser.add_argument("--fail-at", default=None, help=argparse.SUPPRESS)


def _folder_name(text):
    """argparse type: a folder to create or fill (not "", which would be the current
    folder under another name)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a folder name, got an empty one")
    return text


def _torch_version():
    """The installed torch's version, read without importing it; None where its package
    metadata is missing (then nothing is assumed)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _check(args):
    torch_version = _torch_version()
    if torch_version is not None and tuple(
            int(part) for part in re.findall(r"\d+", torch_version)[:2]) < (2, 7):
        # torch 2.6's FSDP2 records events on the CPU's stream, whose class lacks them.
        raise DemoError(f"FSDP2 on CPU ranks needs torch 2.7 or newer, this is "
                        f"{torch_version} (FusedAdam itself takes 2.6)")
    # Checked before a run of minutes: torch's checkpoints gather objects through
    # numpy; the report draws demo.png with matplotlib.
    missing = missing_modules("the demo", ["numpy", "matplotlib"])
    if missing is not None:
        raise DemoError(missing)
    rows = SIZES[args.model].rows
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
    for name in args.also:
        missing = peers.not_installed(name)
        if missing is not None:
            raise DemoError(f"--also {name}: {missing}")
    if args.out is None:
        args.out = _fresh_folder(os.path.join("runs", time.strftime("demo-%Y%m%d-%H%M%S")))
    try:
        os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
        with tempfile.TemporaryFile(dir=args.out):
            pass
        args.replaced = _clear_earlier_run(args.out)
    except OSError as error:
        reason = error.strerror or str(error)
        raise DemoError(f"cannot write to output folder {args.out!r}: {reason}") from None
    for name in ("demo.json", "demo.png"):  # e.g. a folder of that name
        error = write_error(os.path.join(args.out, name))
        if error is not None:
            raise DemoError(f"cannot write the report into {args.out!r}: {error}")


def _clear_earlier_run(out):
    """Removes what an earlier demo wrote into ``out`` (its report and rank files), so
    that a run that fails never leaves them beside its own; returns how many files."""
    logs = os.path.join(out, "logs")
    phases = "|".join(re.escape(name) for name in ("adamw", "shardadam", "resume",
                                                   *peers.DTENSOR_PEERS))
    ours = re.compile(rf"({phases})-rank\d+\.(json|error|log)")  # launcher's names
    paths = [os.path.join(out, name) for name in ("demo.json", "demo.png")]
    paths += [os.path.join(logs, name) for name in os.listdir(logs) if ours.fullmatch(name)]
    found = [path for path in paths if os.path.isfile(path)]
    for path in found:
        os.remove(path)
    return len(found)


def _threads_per_rank(ranks):
    """Cores this process may use, shared out: ranks never oversubscribe the CPU."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    return max(1, cores // ranks)


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


def _phases(args, mid):
    """(phase, ranks, label, config overrides) of the three phases, in order."""
    return [
        ("adamw", args.ranks, f"torch AdamW fp32 x{args.ranks}",
         {"optimizer": "adamw", "preset": "fp32"}),
        *((name, args.ranks, f"{name} x{args.ranks}", {"optimizer": name, "preset": "fp32"})
          for name in args.also),
        ("shardadam", args.ranks, f"shardadam {args.state} x{args.ranks}",
         {"save_at": mid}),
        ("resume", args.resume_ranks, f"resumed x{args.resume_ranks}",
         {"start_step": mid}),
    ]


def _train(args, workdir, corpus_path):
    """Runs the phases one after another; returns their ranks' records and wall times."""
    from . import launcher

    mid = args.steps // 2
    phases, walls = {}, {}
    for phase, ranks, label, extra in _phases(args, mid):
        if phase == "resume":  # shown beside each resumed step
            extra["reference"] = {str(r["step"]): r["loss"]
                                  for r in phases["shardadam"][0]["steps"]}
        config = phase_config(args, workdir, corpus_path, phase, label=label,
                              threads=_threads_per_rank(ranks), **extra)
        print(f"phase {phase}: {label}, {config['threads']} thread(s) per rank"
              + (f", from the checkpoint of step {mid}" if phase == "resume" else ""),
              flush=True)
        began = time.monotonic()
        deadline = _PHASE_STARTUP_S + _PHASE_PER_STEP_S * (args.steps - config["start_step"])
        launcher.run_phase(config, ranks, workdir, deadline)
        walls[phase] = time.monotonic() - began
        phases[phase] = _read_phase(config["results"], phase, ranks)
    return phases, walls


class _Terminated(BaseException):
    """SIGTERM arrived (raised by its handler, caught in ``run``)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _terminated(signum, _frame):
    raise _Terminated(signum)


def run(args):
    """The demo; returns the process exit status."""
    try:
        _check(args)
    except DemoError as error:
        print(f"python -m shardadam demo: error: {error}", file=sys.stderr)
        return 2
    from . import report
    from .corpus import CorpusError, build_corpus
    from .launcher import RankFailure

    if args.replaced:
        print(f"shardadam demo: {args.out} held an earlier run's report and logs "
              f"({args.replaced} files): removed", flush=True)
    began = time.monotonic()
    # SIGTERM (a job runner's, timeout's) ends the run as Ctrl-C does: ranks stopped,
    # the temporary folder removed, a message.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        with tempfile.TemporaryDirectory(prefix="shardadam-demo-") as workdir:
            corpus_path = os.path.join(workdir, "corpus.bin")
            corpus = build_corpus(corpus_path, SIZES[args.model].corpus_bytes)
            print(f"shardadam demo: {args.model} transformer, {args.steps} steps, seed "
                  f"{args.seed}; text: {corpus['bytes'] / 2**20:.1f} MiB of Python source "
                  f"({corpus['files']} files under {corpus['source']})", flush=True)
            phases, walls = _train(args, workdir, corpus_path)
    except (RankFailure, CorpusError) as failure:
        print(f"python -m shardadam demo: error: {failure}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Terminated) as stop:
        print("python -m shardadam demo: interrupted; all ranks stopped", file=sys.stderr)
        return 128 + (stop.signum if isinstance(stop, _Terminated) else signal.SIGINT)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    figures = report.summarize(args, corpus, phases, walls, time.monotonic() - began)
    print(report.table(figures))  # first: a failed write keeps it
    json_path, png_path = report.write(args.out, figures)
    print(f"wrote {json_path}\n      {png_path}\n      rank logs in "
          f"{os.path.join(args.out, 'logs')}")
    return 0 if figures["resume_check"]["passed"] else 1


if __name__ == "__main__":  # the same as `python -m shardadam demo`
    from shardadam.__main__ import main

    sys.exit(main(["demo", *sys.argv[1:]]))
