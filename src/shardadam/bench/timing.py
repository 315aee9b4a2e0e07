"""Interleaved repetitions (A B C C B A A B C ...) after a warm-up, and their statistics.

On a shared machine the load drifts during a run; interleaving spreads that drift over
every contender alike, so the ratios of medians from one run stay meaningful.

Each timed call starts after a short idle gap (``settle_s``): torch's bundled OpenMP
runtime keeps its workers spinning for a few milliseconds after a parallel region, and
a contender with threads of its own (DeepSpeed's, or shardadam's core on its own pool)
started inside that window shares its cores with them (measured: 7 ms -> 11 ms for a
7M-element fp32 step right after a torch op). The gap lets every contender start on idle
cores; shardadam's core, which runs on torch's threads, is also timed right after
torch's work (``training``). A step
with a ``before()`` (``training.AfterTorchWork``) has it called after the gap, untimed,
right before the timed call.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Optional


SETTLE_S = 0.02


def _nothing():
    pass


def interleaved(steps: dict, reps: int, warmup: int, settle_s: float = SETTLE_S) -> dict:
    """``{name: [seconds per repetition]}`` for ``{name: zero-argument callable}``."""
    for _ in range(warmup):  # first touch, thread pools, lazy state and caches
        for step in steps.values():
            getattr(step, "before", _nothing)()
            step()
    samples = {name: [] for name in steps}
    order = list(steps.items())
    for rep in range(reps):
        # Reversed every other round, so that no contender always follows the same one.
        for name, step in (order if rep % 2 == 0 else order[::-1]):
            time.sleep(settle_s)
            getattr(step, "before", _nothing)()
            start = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - start)
    return samples


def summary(samples: list) -> dict:
    return {"median": statistics.median(samples), "min": min(samples),
            "max": max(samples)}


def paired_ratio(other: list, this: list) -> float:
    """Median over repetitions of ``other[i] / this[i]``. Interleaving puts repetition
    ``i`` of every contender within one round, so a slow stretch of the machine slows
    both terms of a pair alike and cancels in their ratio, where a ratio of medians
    keeps it (the medians may come from different rounds)."""
    return statistics.median(o / t for o, t in zip(other, this))


def paired_ratio_interval(other: list, this: list,
                          confidence: float = 0.95) -> Optional[tuple]:
    """``(low, high)``: an interval that holds the median of ``other[i] / this[i]`` over
    the machine's repetitions with at least ``confidence``, from the ratios' order
    statistics (distribution-free: the count of ratios below the median is
    Binomial(n, 1/2)); None where there are too few repetitions for one. On this
    project's VMs single repetitions spread by a third, so a paired ratio of 15
    repetitions is known to about ±5%: a ratio whose interval holds 1 is a tie."""
    ratios = sorted(o / t for o, t in zip(other, this))
    n = len(ratios)
    # The largest k with P(fewer than k ratios below the median) <= (1 - confidence) / 2;
    # [ratios[k - 1], ratios[n - k]] then covers the median with the asked confidence.
    tail, below, k = (1.0 - confidence) / 2.0, 0.0, 0
    while k < n // 2:
        below += math.comb(n, k) / 2.0 ** n
        if below > tail:
            break
        k += 1
    return (ratios[k - 1], ratios[n - k]) if k > 0 else None
