"""Does a small second moment still decay in a long run at TE's default beta2 = 0.999?

One 256 x 256 weight, pulled towards a fixed random target by noisy gradients that
shrink tenfold after the first 500 steps (as a run's gradients do after its early
phase), trained for 6,000 steps at lr 1e-3, betas (0.9, 0.999), no weight decay. An
``exp_avg_sq`` that stops decaying keeps the early, large second moment, and every
later update is that much smaller: the mean squared distance to the target, printed
every 1,000 steps, stays high. Each optimizer starts from the same weight and draws
the same gradients:

    python tools/shrinking_gradient_study.py adamw block8 block4 bf16 [peer ...]

``adamw``: torch AdamW, fp32. ``fp32``: FusedAdam with fp32 state. ``bf16``: bf16
params + int16 remainders with bf16 moments (TE's ``exp_avg_sq_dtype=torch.bfloat16``
rounds to nearest). ``block8`` / ``block4``: bf16 params + int16 remainders with
``moment_format`` so. A peer name of ``shardadam.peers`` (``torchao-adamw8bit``,
``bnb-adamw8bit``, ...) runs that optimizer on an fp32 weight.
"""

import argparse
import time

import torch

import shardadam
from shardadam import peers

SHAPE, SHRINK_AT = (256, 256), 500
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def make(name, p):
    if name == "adamw":
        return torch.optim.AdamW([p], **HYPER)
    if name == "fp32":
        return shardadam.FusedAdam([p], **HYPER)
    if name == "bf16":
        return shardadam.FusedAdam([p], master_weights=True, store_param_remainders=True,
                                   exp_avg_dtype=torch.bfloat16,
                                   exp_avg_sq_dtype=torch.bfloat16, **HYPER)
    if name in ("block8", "block4"):
        return shardadam.FusedAdam([p], master_weights=True, store_param_remainders=True,
                                   moment_format=name, **HYPER)
    return peers.make(name, [p], **HYPER)


def run(name, steps):
    fp32 = name in ("adamw", "fp32") or name in peers.PEERS
    target = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    noise = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.zeros(SHAPE, dtype=torch.float32 if fp32 else torch.bfloat16))
    opt = make(name, p)
    errors = []
    for t in range(steps):
        late = t >= SHRINK_AT
        w = p.detach().float()
        g = (w - target) * (0.1 if late else 1.0) + torch.randn(SHAPE, generator=noise) * (
            0.1 if late else 1.0)
        p.grad = g.to(p.dtype)
        opt.step()
        if (t + 1) % 1000 == 0:
            errors.append(((p.detach().float() - target) ** 2).mean().item())
    return errors


OWN = ("adamw", "fp32", "bf16", "block8", "block4")


def _optimizer(text):
    if text not in OWN and text not in peers.PEERS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not one of {', '.join(OWN + tuple(peers.PEERS))}")
    return text


def _thousands(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1000 or value % 1000:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 1,000, got {value}")
    return value


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("optimizers", nargs="+", type=_optimizer,
                        help=f"any of {', '.join(OWN)} and the peers' names")
    parser.add_argument("--steps", type=_thousands, default=6000,
                        help="a positive multiple of 1,000 (default 6000)")
    args = parser.parse_args()
    for name in args.optimizers:
        start = time.perf_counter()
        errors = run(name, args.steps)
        print(f"{name:24s} " + " ".join(f"{e:.4g}" for e in errors)
              + f"   ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
