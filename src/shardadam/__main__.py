"""Command line: ``python -m shardadam demo | bench | rare-tokens | info``."""

import argparse
import os
import sys

from shardadam import rare_tokens
from shardadam.bench import cli as bench_cli
from shardadam.demo import cli as demo_cli


def _info(_args):
    import torch

    import shardadam

    print(f"shardadam {shardadam.__version__}  (torch {torch.__version__})")
    try:
        from shardadam import _C
    except ImportError as error:
        from shardadam import _slots
        state = "not built" if _slots.missing else "built, but it does not load"
        print(f"C++ core:       {state} ({error})")
        print("backends:       torch")
        return 0
    info = _C.info()
    print(f"C++ core:       {info['version']}")
    print(f"SIMD target:    {info['simd_target']} (supported: {info['supported_targets']})")
    print(f"threads:        {torch.get_num_threads()} used by step() "
          f"({info['default_threads']} hardware threads)")
    runtime = info["thread_runtime"]
    print("workers:        " + (f"the loaded OpenMP runtime, {runtime[len('openmp:'):]}"
                                if runtime.startswith("openmp:") else "the core's own pool"))
    print(f"CUDA backend:   {_cuda_line(info)}")
    cuda_steps = info.get("cuda", False) and info.get("cuda_devices", 0) > 0
    backends = (["cpu (C++)"] + (["cuda (C++)"] if cuda_steps else [])
                + ["torch (other devices)"])
    print(f"backends:       {', '.join(backends)}")
    return 0


def _cuda_line(info: dict) -> str:
    """Whether the extension has CUDA kernels, for which GPUs, and whether step()
    uses them here (it needs a device the CUDA runtime sees)."""
    if not info.get("cuda", False):
        return "not compiled (CUDA tensors take the torch path)"
    devices = info.get("cuda_devices", 0)
    archs = info.get("cuda_archs", "?")
    if devices == 0:
        return f"compiled (archs {archs}), no device visible (CUDA tensors: torch path)"
    return f"compiled (archs {archs}), {devices} device(s) visible, used for CUDA tensors"


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument in one line on stderr (exit status 2), not usage + error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv=None):
    parser = _Parser(
        prog="python -m shardadam",
        description="shardadam: fused Adam/AdamW for sharded training with a C++ core.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = commands.add_parser(
        "demo", help="train a small transformer with FSDP2 on CPU ranks: torch AdamW vs "
                     "FusedAdam, checkpoint, resume on another rank count, report",
        description="Trains a small decoder-only transformer (byte tokens, the Python "
                    "standard library's source as text) with FSDP2 on gloo CPU ranks, "
                    "twice from the same seed: torch.optim.AdamW(fused=True) with fp32 "
                    "state, and shardadam.FusedAdam with small state. The shardadam run "
                    "saves a DCP checkpoint mid-way, which is resumed on another number "
                    "of ranks and checked against the uninterrupted run. Writes demo.json "
                    "and demo.png to --out.")
    demo_cli.add_arguments(demo)
    demo.set_defaults(run=demo_cli.run)
    bench = commands.add_parser(
        "bench", help="time one Adam step on CPU: FusedAdam vs torch, DeepSpeed and the "
                      "multi-pass path, with a bandwidth probe; table, JSON, PNG",
        description="Times one optimizer step side by side (interleaved repetitions, "
                    "medians with min/max) for each state preset on large tensors (also "
                    "right after a forward and backward, as training calls it), a "
                    "transformer's parameter list, 2,000 small tensors (in one group, "
                    "and one group each), DTensor parameters on 2 gloo ranks, and 8- and "
                    "4-bit states beside torchao and bitsandbytes (--cases picks them); "
                    "reports elements/s, GB/s, the fraction "
                    "of a bandwidth probe with the step's access pattern, ratios between "
                    "contenders and each step's peak extra memory (docs/benchmarking.md).")
    bench_cli.add_arguments(bench)
    bench.set_defaults(run=bench_cli.run)
    rare = commands.add_parser(
        "rare-tokens", help="train an embedding and head on Zipf-distributed tokens with "
                            "one optimizer; the mean loss of the last 20 steps",
        description="Trains a 16,384 x 128 embedding and a head of the same size to "
                    "predict a fixed permutation of tokens drawn from a Zipf(1.2) "
                    "distribution (4,096 tokens per step, lr 3e-3, betas (0.9, 0.95), "
                    "300 steps, one process, fixed seed; smaller with --vocab, --dim, "
                    "--batch, --steps) with torch's AdamW or FusedAdam in the state "
                    "format given, and reports the mean loss of the last 20 steps, or "
                    "the step where the loss diverged. Rare tokens' moments lie decades "
                    "below the frequent ones' in the same tensor: a format that cannot "
                    "hold that range fails here.")
    rare_tokens.add_arguments(rare)
    rare.set_defaults(run=rare_tokens.run)
    commands.add_parser("info", help="version, SIMD target, threads, CUDA backend and "
                                     "built backends") \
        .set_defaults(run=_info)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        # argparse would only say that a command is missing, not name the flag.
        parser.error(f"unrecognized argument {argv[0]}: the command comes first "
                     f"({', '.join(commands.choices)})")
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader of our output left (`| head`): stop quietly, as a shell tool does.
        # Later writes, the interpreter's final flush among them, go nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
