"""``python -m shardadam rare-tokens``: the rare-token workload, a check of whether an
optimizer state format trains an embedding whose rows see very different amounts of
gradient.

An embedding (``vocab`` x ``dim``) and a linear head of the same size, no bias, learn to
map each token to a fixed random permutation of itself; tokens are drawn from a
truncated Zipf distribution (``P(token = k) ~ (k + 1) ** -exponent`` over the whole
vocabulary, token 0 the most frequent, as tokenizers number frequent tokens first). At
the default size most rows of the embedding are seen a few times in a run and many not
at all, and the head's rows of rare targets get only the softmax's small gradients, so
the moments of one tensor span many decades. A state format with one scale per tensor
cannot hold that range: ``exp_avg_sq`` entries far below the tensor's largest become
zero while ``exp_avg`` survives, and ``m / (sqrt(0) + eps)`` throws those weights far
off (fp8 E4M3 for both moments diverges here; bf16 moments train like fp32).

One process, fixed seed, bitwise repeatable for a given thread count: initial weights,
the permutation and every step's batch come from seeded generators alone, and the loss
of a step is the mean cross-entropy of its batch before the update. The result is the
mean loss of the last ``last`` steps. ``train`` takes any optimizer factory (the study
in ``tools/state_map_study.py`` passes emulated formats); the command builds
``torch.optim.AdamW`` or ``shardadam.FusedAdam`` from its flags.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

from . import peers
from ._arguments import whole_number_at_least, writable_file


@dataclass(frozen=True)
class Workload:
    vocab: int = 16384
    dim: int = 128
    exponent: float = 1.2      # Zipf exponent of the token distribution
    batch: int = 4096          # tokens per step
    steps: int = 300
    lr: float = 3e-3
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0  # the same for every optimizer compared (torch's AdamW
    #                            defaults to 0.01, FusedAdam to 0)
    seed: int = 0
    last: int = 20             # the result: mean loss of this many final steps
    # A loss above this (or a non-finite one) ends the run as diverged: the first loss
    # is ln(vocab) (9.7 at the default size; the initial logits are ~0), so a loss of
    # 100 nats is a run thrown far off its weights, not a slow one.
    diverged_above: float = 100.0


FULL = Workload()
INIT_STD = 0.02


def token_probabilities(workload: Workload):
    import torch

    ranks = torch.arange(1, workload.vocab + 1, dtype=torch.float64)
    weights = ranks.pow(-workload.exponent)
    return weights / weights.sum()


class Model:
    """The two weight tensors, in the dtype the optimizer trains (fp32 or bf16); the
    forward pass always computes in fp32, so runs differ only in the optimizer."""

    def __init__(self, workload: Workload, param_dtype):
        import torch

        generator = torch.Generator().manual_seed(workload.seed)
        # N(0, 0.02) for both, as GPT-style models (and the demo's transformer) start.
        # Each row then moves only as its token is trained, so rare tokens stay hard to
        # the end. (With torch's defaults, N(0, 1) embedding rows make every token
        # separable from the first step and the loss falls to 0.18 in 300 steps.)
        self.embed, self.head = (
            torch.nn.Parameter((torch.randn(workload.vocab, workload.dim,
                                            generator=generator) * INIT_STD)
                               .to(param_dtype)) for _ in range(2))
        self.target = torch.randperm(workload.vocab, generator=generator)

    def parameters(self):
        return [self.embed, self.head]

    def loss(self, tokens):
        import torch.nn.functional as F

        x = F.embedding(tokens, self.embed.float())
        logits = F.linear(x, self.head.float())
        return F.cross_entropy(logits, self.target[tokens])


def batches(workload: Workload):
    """Every step's tokens, from a generator seeded apart from the weights'."""
    import torch

    generator = torch.Generator().manual_seed(workload.seed * 1_000_003 + 1)
    probabilities = token_probabilities(workload)
    for _ in range(workload.steps):
        yield torch.multinomial(probabilities, workload.batch, replacement=True,
                                generator=generator)


@dataclass
class Result:
    label: str
    losses: list           # one per step taken (a diverged run stops early)
    diverged_at: Optional[int]  # the step whose loss was non-finite or too large
    seconds: float
    state_bytes: int       # bytes of the optimizer's state tensors (scales included)
    params: int
    last: int              # steps averaged by last_mean_loss

    @property
    def last_mean_loss(self):
        """Mean loss of the last ``last`` steps; inf for a diverged run."""
        if self.diverged_at is not None:
            return math.inf
        tail = self.losses[-self.last:]
        return sum(tail) / len(tail)

    @property
    def state_bytes_per_param(self):
        return self.state_bytes / self.params


def train(make_optimizer: Callable, workload: Workload = FULL, *, param_dtype=None,
          label: str = "", progress: Optional[Callable] = None,
          state_bytes_of: Optional[Callable] = None) -> Result:
    """Trains the workload with ``make_optimizer(params, lr=, betas=, eps=,
    weight_decay=)``; returns every step's loss. ``progress(step, loss)`` is called
    after each step."""
    import torch

    model = Model(workload, param_dtype or torch.float32)
    params = model.parameters()
    optimizer = make_optimizer(params, lr=workload.lr, betas=workload.betas,
                               eps=workload.eps, weight_decay=workload.weight_decay)
    losses, diverged_at = [], None
    began = time.perf_counter()
    for step, tokens in enumerate(batches(workload), start=1):
        loss = model.loss(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        losses.append(value)
        if progress is not None:
            progress(step, value)
        if not value <= workload.diverged_above:  # also catches NaN
            diverged_at = step
            break
    seconds = time.perf_counter() - began
    return Result(label, losses, diverged_at, seconds,
                  (state_bytes_of or peers.state_bytes)(optimizer),
                  sum(p.numel() for p in params), workload.last)


# --- the command ---------------------------------------------------------------------

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "uint8"}


def fused_adam_factory(**kwargs):
    """``make_optimizer`` for ``shardadam.FusedAdam`` with the given constructor keywords
    (AdamW mode)."""
    import shardadam

    def make(params, **hyper):
        return shardadam.FusedAdam(params, adam_w_mode=True, **hyper, **kwargs)
    return make


def adamw_factory(params, **hyper):
    """``make_optimizer`` for torch's AdamW with fp32 state (fused, as the demo runs it)."""
    import torch

    return torch.optim.AdamW(params, fused=True, **hyper)


def peer_factory(name):
    """``make_optimizer`` for another package's optimizer (``peers.PEERS``)."""
    return lambda params, **hyper: peers.make(name, params, **hyper)


def add_arguments(parser):
    parser.add_argument("--optimizer", choices=("adamw", "shardadam", *peers.PEERS),
                        default="shardadam",
                        help="adamw: torch.optim.AdamW(fused=True), fp32 state and "
                             "parameters; shardadam: FusedAdam with the flags below "
                             "(default shardadam); the others: that package's optimizer "
                             "on fp32 parameters, its own state format")
    parser.add_argument("--exp-avg", choices=list(_DTYPES), default="fp32",
                        help="FusedAdam exp_avg_dtype (fp8: E4M3 codes, one scale per "
                             "tensor; default fp32)")
    parser.add_argument("--exp-avg-sq", choices=list(_DTYPES), default="fp32",
                        help="FusedAdam exp_avg_sq_dtype (default fp32)")
    parser.add_argument("--moment-format", choices=("block8", "block4"), default=None,
                        help="FusedAdam moment_format, instead of --exp-avg / "
                             "--exp-avg-sq: block8 / block4 store both moments in 8-bit / "
                             "4-bit codes with one power-of-two scale per block "
                             "(docs/semantics.md S2.11, S2.12)")
    parser.add_argument("--moment-block-size", type=_positive_int, default=None,
                        help="FusedAdam moment_block_size: elements per block scale "
                             "(default 256 for block8, 128 for block4)")
    parser.add_argument("--params", choices=("fp32", "bf16"), default="fp32",
                        help="parameter dtype (default fp32; bf16 with --master, or without one "
                             "rounded by --param-rounding)")
    parser.add_argument("--master", choices=("none", "fp32", "fp16", "remainder"),
                        default="none",
                        help="master weights for bf16 parameters: an fp32 or fp16 copy, "
                             "or int16 remainders (default none)")
    parser.add_argument("--param-rounding", choices=("nearest", "stochastic"),
                        default="nearest",
                        help="rounding of bf16 parameters without master (S2.14; "
                             "default nearest)")
    parser.add_argument("--steps", type=_positive_int, default=FULL.steps,
                        help=f"training steps (default {FULL.steps})")
    parser.add_argument("--vocab", type=_positive_int, default=FULL.vocab,
                        help=f"tokens in the vocabulary: rows of the embedding and the "
                             f"head (default {FULL.vocab}; smaller for a quick look)")
    parser.add_argument("--dim", type=_positive_int, default=FULL.dim,
                        help=f"embedding width (default {FULL.dim})")
    parser.add_argument("--batch", type=_positive_int, default=FULL.batch,
                        help=f"tokens per step (default {FULL.batch})")
    parser.add_argument("--beta2", type=_beta, default=FULL.betas[1],
                        help=f"the second moment's decay (default {FULL.betas[1]}; e.g. "
                             f"0.999, torch's and TE's default, where a second moment "
                             f"rounded to nearest in 8 or fewer bits stops decaying)")
    parser.add_argument("--seed", type=_seed, default=FULL.seed,
                        help=f"seed of the weights, the permutation and the batches, below "
                             f"2**32 (default {FULL.seed})")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="torch threads (default: torch's); results are bitwise "
                             "repeatable for a given count")
    parser.add_argument("--json", default=None, type=writable_file(),
                        help="also write the result here")
    parser.add_argument("--quiet", action="store_true", help="no per-step lines")


_positive_int = whole_number_at_least(1)
_positive_int_or_zero = whole_number_at_least(0)


def _beta(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _seed(text):
    # The batches' generator is seeded with seed * 1_000_003 + 1, which torch takes up
    # to 2**64 - 1.
    value = _positive_int_or_zero(text)
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"must be below 2**32, got {value}")
    return value


def describe(args) -> str:
    if args.optimizer == "adamw":
        return "torch AdamW fp32"
    if args.optimizer in peers.PEERS:
        return peers.PEERS[args.optimizer][2]
    text = f"FusedAdam {args.params} params"
    if args.master != "none":
        text += f" + {args.master} master"
    if args.param_rounding == "stochastic":
        text += " rounded stochastically"
    if args.moment_format is not None:
        from shardadam import _formats

        block = args.moment_block_size or _formats.MOMENT_FAMILIES[args.moment_format][2]
        return text + f", moments {args.moment_format} (blocks of {block})"
    return text + f", exp_avg {args.exp_avg}, exp_avg_sq {args.exp_avg_sq}"


def _least_bytes(args) -> int:
    """A floor of what a run holds at once: both tables as drawn (fp32) and one batch's
    fp32 logits (the step's gradients and states come on top)."""
    return 4 * (2 * args.vocab * args.dim + args.batch * args.vocab)


def _physical_memory():
    """This machine's memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _error(message: str, status: int = 2) -> int:
    """Says why the command stops, on stderr; returns its exit status."""
    print(f"python -m shardadam rare-tokens: error: {message}", file=sys.stderr)
    return status


def run(args):
    import torch

    if args.optimizer != "shardadam" and (
            args.params, args.master, args.exp_avg, args.exp_avg_sq, args.moment_format,
            args.moment_block_size, args.param_rounding) != (
                "fp32", "none", "fp32", "fp32", None, None, "nearest"):
        return _error(f"--optimizer {args.optimizer} takes no state or parameter flags (it "
                      "keeps its own state on fp32 parameters)")
    if args.params == "fp32" and (args.master, args.param_rounding) != ("none", "nearest"):
        return _error("--master and --param-rounding apply to bf16 parameters only (fp32 "
                      "parameters are their own master, S2.1): add --params bf16")
    missing = peers.not_installed(args.optimizer) if args.optimizer in peers.PEERS else None
    if missing is not None:  # refused before the run, as the demo's --also
        return _error(f"--optimizer {args.optimizer}: {missing}")
    needed = _least_bytes(args)
    memory = _physical_memory()
    if memory is not None and needed > memory:
        return _error(f"--vocab {args.vocab}, --dim {args.dim} and --batch {args.batch} need "
                      f"at least {needed / 2**30:.3g} GiB (two fp32 tables and one batch's "
                      f"logits); this machine has {memory / 2**30:.3g} GiB")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    workload = replace(FULL, steps=args.steps, seed=args.seed, vocab=args.vocab,
                       dim=args.dim, batch=args.batch, last=min(FULL.last, args.steps),
                       betas=(FULL.betas[0], args.beta2))
    if args.optimizer == "adamw":
        make = adamw_factory
    elif args.optimizer in peers.PEERS:
        make = peer_factory(args.optimizer)
    else:
        kwargs = {"exp_avg_dtype": getattr(torch, _DTYPES[args.exp_avg]),
                  "exp_avg_sq_dtype": getattr(torch, _DTYPES[args.exp_avg_sq])}
        if args.moment_format is not None or args.moment_block_size is not None:
            kwargs.update(moment_format=args.moment_format,
                          moment_block_size=args.moment_block_size)
        if args.master != "none":
            kwargs.update(master_weights=True,
                          master_weight_dtype=torch.float16 if args.master == "fp16"
                          else torch.float32,
                          store_param_remainders=args.master == "remainder")
        if args.param_rounding != "nearest":
            kwargs.update(param_rounding=args.param_rounding)
        make = fused_adam_factory(**kwargs)
        try:  # the constructor's own checks, before minutes of training
            dtype = getattr(torch, _DTYPES[args.params])
            make([torch.nn.Parameter(torch.zeros(2, 2, dtype=dtype))], lr=workload.lr)
        except (ValueError, RuntimeError) as error:
            return _error(str(error))
    label = describe(args)
    print(f"rare tokens: embedding + head {workload.vocab} x {workload.dim}, Zipf "
          f"{workload.exponent}, {workload.batch} tokens/step, {workload.steps} steps, "
          f"lr {workload.lr:g}, betas {workload.betas}, seed {workload.seed}, "
          f"{torch.get_num_threads()} thread(s); {label}", flush=True)

    def progress(step, loss):
        if not args.quiet and (step % 10 == 0 or step == 1 or not loss <= 100):
            print(f"  step {step:>4}  loss {loss:.4f}", flush=True)

    try:
        result = train(make, workload, label=label, progress=progress,
                       param_dtype=getattr(torch, _DTYPES[args.params]))
    except peers.Unavailable as error:
        return _error(f"{args.optimizer}: {error}", status=1)
    if result.diverged_at is not None:
        print(f"{label}: DIVERGED at step {result.diverged_at} (loss "
              f"{result.losses[-1]:.4g}); {result.seconds:.0f} s")
    else:
        print(f"{label}: mean loss of the last {workload.last} steps "
              f"{result.last_mean_loss:.4f}; state {result.state_bytes_per_param:.2f} "
              f"B/param; {result.seconds:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": asdict(workload), "label": label,
                       "last_mean_loss": (None if result.diverged_at
                                          else result.last_mean_loss),
                       "diverged_at": result.diverged_at, "losses": result.losses,
                       "state_bytes_per_param": result.state_bytes_per_param,
                       "threads": torch.get_num_threads(),
                       "seconds": result.seconds}, f, indent=1)
    return 0


if __name__ == "__main__":  # the same as `python -m shardadam rare-tokens`
    from shardadam.__main__ import main

    sys.exit(main(["rare-tokens", *sys.argv[1:]]))
