"""Small jobs that exercise the harness itself (test_dist_harness.py)."""

import os
import signal
import time

import torch
import torch.distributed as dist


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    expected = sum(range(dist.get_world_size()))
    assert t.item() == expected, f"all_reduce gave {t.item()}, expected {expected}"


def _one_thread():
    assert os.environ.get("OMP_NUM_THREADS") == "1", os.environ.get("OMP_NUM_THREADS")
    assert torch.get_num_threads() == 1, torch.get_num_threads()


def _fails_on_last_rank_before_collective():
    # The last rank leaves before the collective its peers enter: they must time out,
    # and the next case must still work (the group is rebuilt).
    if dist.get_rank() == dist.get_world_size() - 1:
        raise ValueError("deliberate failure on the last rank")
    _sum_of_ranks()


class _NotAnException(BaseException):
    """As torch's CheckpointException (torch 2.9), which derives from BaseException."""


def _raises_a_base_exception():
    raise _NotAnException("deliberate BaseException")


def isolation(ctx):
    ctx.run_case("passes", _sum_of_ranks)
    ctx.run_case("one-thread-per-rank", _one_thread)
    ctx.run_case("fails", _fails_on_last_rank_before_collective)
    ctx.run_case("raises-a-base-exception", _raises_a_base_exception)
    ctx.run_case("passes-after-failure", _sum_of_ranks)
    ctx.run_case("uses-a-2d-mesh-after-failure", lambda: ctx.mesh((1, ctx.world_size)))


def hang(ctx):
    def stuck():
        if ctx.rank == 1:
            time.sleep(3600)

    ctx.run_case("hangs", stuck)


def crash(ctx):
    def die():
        dist.barrier()  # both ranks are in the case (and done with the one before)
        if ctx.rank == 1:
            print("rank 1 exits with status 3", flush=True)
            os._exit(3)
        # The survivor waits where it cannot notice the death: in a collective, gloo
        # sometimes sees the closed socket and raises before the harness looks, which
        # makes the report's wording a race (planned_death tests that path).
        time.sleep(3600)

    if ctx.params.get("cases_around"):
        ctx.run_case("passes", _sum_of_ranks)
    ctx.run_case("dies", die)
    if ctx.params.get("cases_around"):
        for name in ("queued-1", "queued-2"):
            ctx.run_case(name, _sum_of_ranks)


def raise_outside_case(ctx):
    ctx.run_case("passes", _sum_of_ranks)
    if ctx.rank == 0:
        raise RuntimeError("boom outside any case")


def planned_death(ctx):
    """Rank 1 kills itself inside a case (unless ``params["die"]`` is false); rank 0's
    collective against the dead peer must raise promptly, not hang."""
    def die_or_reach_a_dead_peer():
        if ctx.rank == 1:
            if ctx.params.get("die", True):
                os.kill(os.getpid(), signal.SIGKILL)
            return
        start = time.monotonic()
        try:
            _sum_of_ranks()
        except RuntimeError as error:
            print(f"all_reduce with a dead peer raised after {time.monotonic() - start:.2f}s: "
                  f"{error}", flush=True)
        else:
            raise AssertionError("all_reduce with a dead peer returned")

    ctx.run_case("passes", _sum_of_ranks)
    ctx.run_case("dies", die_or_reach_a_dead_peer, dies=(1,))
    if ctx.params.get("case_after"):
        ctx.run_case("after-the-death", _sum_of_ranks)
