"""Starts the ranks of one demo phase as real processes and watches them.

Ranks are forked from a multiprocessing fork server that has imported torch once, so a
phase starts in about a second instead of every rank importing torch again (seconds of
CPU each on a 2-core machine). They meet through a ``FileStore`` in the run's private
temporary folder, so concurrent demos never share a rendezvous.

Nothing is left behind: the first rank that exits non-zero stops the phase and every
other rank is killed; a phase that outlives its deadline is killed; each rank asks the
kernel to kill it if the fork server goes away, and the fork server exits when this
process ends, however it ends: it sees the write end of a pipe close. multiprocessing
hands a copy of that write end to every child it forks, and while a rank held it the
server never saw this process end: a demo killed by a signal left its ranks training.
Each rank closes its copy (``drop_fork_server_pipe``, which reads multiprocessing's
private ``forkserver._forkserver._forkserver_alive_fd``, there since Python 3.4).

The report names the rank that failed first by the time each recorded, not the first
exit seen: its peers fail milliseconds later on the lost connection, and exits seen
together are taken in rank order.
"""

import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import time

# Modules the fork server imports once for all ranks of all phases.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
            "torch.distributed.fsdp", "torch.distributed.checkpoint", "shardadam",
            "shardadam.demo.worker"]
# Time the other ranks get to end on their own once one has failed, before being killed.
_GRACE_S = 1.0
_context = None


class RankFailure(RuntimeError):
    """A rank of a phase failed (or the phase ran past its deadline)."""


def _fork_server_context():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
        # The server only imports; one OpenMP thread there, and each rank sets its own
        # count (cores / ranks) with torch.set_num_threads.
        os.environ["OMP_NUM_THREADS"] = "1"
    return _context


def die_with_parent():
    """Linux: deliver SIGKILL to this process when its parent ends."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the launcher's own kill on failure has to do


def drop_fork_server_pipe():
    """In a process forked by multiprocessing's fork server: closes this process's copy
    of the pipe's write end by which the server sees its parent end (see the module
    docstring). Nothing in the process uses it: one that starts processes through a
    fork server starts a server of its own."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _rank_entry(rank, world_size, store_path, config):
    die_with_parent()  # the fork server
    drop_fork_server_pipe()
    from . import worker  # preloaded in the fork server: no import cost here

    worker.main(rank, world_size, store_path, config)


def _exit_reason(process):
    code = process.exitcode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _stop(processes):
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        if process.pid is not None:  # interrupted while starting: some never started
            process.join(timeout=10)


def run_phase(config, world_size, workdir, deadline_s):
    """Runs ``world_size`` ranks of the phase described by ``config``; returns when all
    exited 0, else raises ``RankFailure`` naming the first rank that failed."""
    context = _fork_server_context()
    _clear_previous(config["results"], config["phase"])
    store_path = os.path.join(workdir, f"store-{config['phase']}")
    processes = [context.Process(target=_rank_entry, name=f"{config['phase']}-rank{rank}",
                                 args=(rank, world_size, store_path, config))
                 for rank in range(world_size)]
    try:
        for process in processes:
            process.start()
        _watch(processes, config, world_size, deadline_s)
    finally:
        _stop(processes)


def _clear_previous(results, phase):
    """Removes what an earlier demo in the same folder left for this phase, so that a
    stale error or figure file is never read as this run's."""
    prefix = f"{phase}-rank"
    for name in os.listdir(results):
        if name.startswith(prefix) and name.endswith((".json", ".error", ".log")):
            os.remove(os.path.join(results, name))


def _watch(processes, config, world_size, deadline_s):
    deadline = time.monotonic() + deadline_s
    running = {process.sentinel: rank for rank, process in enumerate(processes)}
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = sorted(running.values())
            raise RankFailure(f"the {config['phase']} phase ran past its deadline of "
                              f"{deadline_s:.0f} s; rank(s) {late} of {world_size} killed")
        for sentinel in multiprocessing.connection.wait(list(running), timeout=remaining):
            rank = running.pop(sentinel)
            process = processes[rank]
            process.join()
            if process.exitcode != 0:
                seen_at = time.monotonic()
                time.sleep(_GRACE_S)  # let the peers notice and write their logs
                first = _first_failure(processes, config, rank, seen_at)
                raise RankFailure(_failure_message(config, first, world_size,
                                                   processes[first]))


def _recorded_error(config, rank):
    """``(when, why)`` from the rank's error file (worker.main), or None."""
    try:
        with open(os.path.join(config["results"],
                               f"{config['phase']}-rank{rank}.error")) as f:
            when, why = f.read().split("\n", 1)
        return float(when), why.strip()
    except (OSError, ValueError):
        return None


def _first_failure(processes, config, seen_rank, seen_at):
    """The failed rank whose failure came first: by the time each recorded; one that
    died without recording counts from when it was seen to exit (``seen_rank`` at
    ``seen_at``), or last."""
    def failed_at(rank):
        recorded = _recorded_error(config, rank)
        if recorded is not None:
            return recorded[0]
        return seen_at if rank == seen_rank else math.inf

    failed = [rank for rank, process in enumerate(processes)
              if process.exitcode not in (None, 0)]
    return min(failed, key=lambda rank: (failed_at(rank), rank))


def _failure_message(config, rank, world_size, process):
    results, phase = config["results"], config["phase"]
    recorded = _recorded_error(config, rank)
    reason = recorded[1] if recorded else "no error recorded: the process died"
    log = os.path.join(results, f"{phase}-rank{rank}.log")
    where = f"log: {log}" if os.path.exists(log) else "it ended before opening its log"
    return (f"rank {rank} of {world_size} failed in the {phase} phase "
            f"({_exit_reason(process)}): {reason}; all ranks stopped; {where}")
