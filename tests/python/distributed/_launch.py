"""Run one test job as real processes, one per rank, on the gloo backend (CPU).

The parent side (``launch``) forks the ranks from a pre-loaded multiprocessing fork
server, watches them and returns a ``JobResult``; each rank (``_child_main``, also
runnable as ``python _launch.py --job module:function ...`` to debug one rank by hand)
initialises the gloo process group, runs the job function with a ``Context`` and records
one line per test case.

Why the shape of this harness:

* A job runs many cases: starting ranks (interpreter, torch, gloo rendezvous) costs
  seconds on a 2-core machine, a case costs milliseconds. So one job per world size
  runs every selected case and pytest turns each recorded case into its own test.
* Cases fail independently. After each case the ranks meet on the store (not on the
  process group, whose collectives may be the broken thing) and compare outcomes; if any
  rank failed, every rank rebuilds the process group, because a rank that left a case
  early leaves the others' collective sequence numbers out of step.
* Nothing hangs forever: collectives time out (``PG_TIMEOUT_S``), the meeting after a
  case times out (3x that), and the parent kills every rank at the job's
  deadline, after asking each for a stack dump (``SIGUSR1`` -> faulthandler) so the
  report shows where it hung.
* A rank that dies takes the job down at once (its peers would only wait for it); the
  report carries its traceback, exit code and log tail. A job that tests surviving a
  crash declares the death instead (``launch(expect_exit=...)``, ``run_case(dies=...)``):
  the dying rank must exit with exactly that status, and the others carry on without it.
"""

import argparse
import datetime
import faulthandler
import importlib
import json
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

from shardadam.demo.launcher import die_with_parent, drop_fork_server_pipe

HERE = os.path.dirname(os.path.abspath(__file__))

# A collective that waits longer than this raises on its own instead of hanging. Real
# collectives here take milliseconds; the margin is for an overloaded 2-core runner.
PG_TIMEOUT_S = 30
# Ranks meet after every case; one rank may still be inside a collective that only its
# peers left, which ends after the collective timeout, so the meeting waits 3x longer.
# Time the parent leaves the other ranks to write their report once one rank has died.
_GRACE_AFTER_DEATH_S = 2.0
_LOG_TAIL_CHARS = 4000


def timeout_scale():
    """Multiplier for every job deadline, for slow or heavily shared machines."""
    return float(os.environ.get("SHARDADAM_DIST_TIMEOUT_SCALE", "1"))


# --------------------------------------------------------------------------- parent side


@dataclass
class JobResult:
    """What one job left behind: per-case records from every rank, and job-level trouble."""

    job: str
    world_size: int
    workdir: str
    seconds: float
    # case id -> {rank: record}; a record is {"ok": bool, "error": str, "seconds": float}
    cases: dict = field(default_factory=dict)
    # None when every rank exited as expected; otherwise a readable account (crash, ...)
    failure: str = None
    pids: list = field(default_factory=list)
    # rank -> exit status it was meant to die with; such a rank records no case it died in
    expect_exit: dict = field(default_factory=dict)
    # rank -> the case it had started and not recorded when the job ended (where it died,
    # hung, or waited for a peer that did)
    running: dict = field(default_factory=dict)

    def case_failure(self, case_id):
        """None if the case passed on every rank, else the text to fail its test with."""
        records = self.cases.get(case_id, {})
        failed = {r: rec for r, rec in sorted(records.items()) if not rec["ok"]}
        if failed:
            # Ranks usually fail the same way: show each distinct traceback once.
            by_error = {}
            for rank, rec in failed.items():
                by_error.setdefault(rec["error"].rstrip(), []).append(rank)
            parts = [f"case {case_id!r} failed on rank(s) {sorted(failed)} of {self.world_size}"]
            for error, ranks in by_error.items():
                parts.append(f"---------- rank(s) {ranks} ----------\n{error}")
            return "\n".join(parts)
        missing = sorted(set(range(self.world_size)) - set(records))
        # A rank meant to die (the job checks it did) records nothing of the case it died in.
        if records and not set(missing) - set(self.expect_exit):
            return None
        broke_in = sorted(set(self.running.values()))
        if self.failure and broke_in and case_id not in broke_in:
            # Queued behind the case that broke the job: say where, once, briefly; that
            # case's report carries the tracebacks and log tails.
            return (f"case {case_id!r} did not run on rank(s) {missing}: job {self.job} "
                    f"(world size {self.world_size}) ended in case(s) {broke_in}: "
                    f"{self.failure.splitlines()[0]} (see the report of {broke_in})")
        ranks_in = sorted(r for r, c in self.running.items() if c == case_id)
        where = f"; rank(s) {ranks_in} were in it when the job ended" if ranks_in else ""
        return (f"case {case_id!r} did not finish on rank(s) {missing} "
                f"(job {self.job}, world size {self.world_size}{where}):\n"
                f"{self.failure or 'the job ended without running it'}")


# Modules the fork server imports once; every rank is forked from it with them loaded.
# ``torch._dynamo`` is the big one: DTensor imports it lazily on first use, which costs
# each rank of each job several CPU-seconds otherwise.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
            "torch.distributed.fsdp", "torch.distributed.checkpoint"]
_mp_context = None


def _context():
    """A multiprocessing context whose children fork from one pre-loaded server.

    ``spawn`` would re-import torch in every rank of every job; plain ``fork`` from the
    pytest process would copy whatever threads and state pytest and torch hold there. The
    fork server is a fresh, single-threaded interpreter started once per session; it only
    imports, so forking it is safe, and each rank starts in well under a second.
    """
    global _mp_context
    if _mp_context is None:
        import multiprocessing

        from multiprocessing import forkserver

        _mp_context = multiprocessing.get_context("forkserver")
        _mp_context.set_forkserver_preload(_PRELOAD)
        # Start it now, so that a job's deadline does not include the server's imports;
        # with one OpenMP thread, which the ranks inherit (they also set it themselves).
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
            # ensure_running returns before the preload ends; the first child forks
            # after it, so this one waits for the imports here, not in a job's time.
            warm_up = _mp_context.Process(target=os.getpid, name="fork-server-warm-up")
            warm_up.start()
            warm_up.join()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
    return _mp_context


def _tail(path):
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return "<no log>"
    return text[-_LOG_TAIL_CHARS:]


def _kill(proc):
    # Each rank leads its own process group (setsid at start), so this also ends any
    # helper process it started; only processes this harness created are touched.
    for kill, target in ((os.killpg, proc.pid), (os.kill, proc.pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def launch(job, world_size, workdir, *, params=None, timeout_s=120.0, expect_exit=None):
    """Run ``job`` ("module:function") on ``world_size`` ranks; return a ``JobResult``.

    ``workdir`` must be a fresh folder: it holds the rendezvous file store (so concurrent
    jobs never share a port or a store), each rank's log and case records, and
    ``params.json`` which the ranks read as ``ctx.params``. ``expect_exit`` maps ranks that
    are meant to die to the exit status they must end with (``-signal.SIGKILL`` for a rank
    that kills itself, as multiprocessing reports it); every other rank must exit 0.
    """
    expect_exit = dict(expect_exit or {})
    timeout_s *= timeout_scale()
    procs = []
    start = time.monotonic()
    failure = None
    try:
        start_ranks(job, world_size, workdir, params=params, started=procs)
        failure = _watch(procs, start + timeout_s, timeout_s, expect_exit)
    finally:
        stop_ranks(procs)
    result = JobResult(job=job, world_size=world_size, workdir=workdir,
                       seconds=time.monotonic() - start, pids=[p.pid for p in procs],
                       expect_exit=expect_exit)
    for rank in range(world_size):
        path = os.path.join(workdir, f"rank{rank}.cases.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.strip():
                        rec = json.loads(line)
                        result.cases.setdefault(rec["case"], {})[rank] = rec
        try:
            with open(os.path.join(workdir, f"rank{rank}.current")) as f:
                started = f.read()
        except OSError:
            started = ""
        if started and rank not in result.cases.get(started, {}):
            result.running[rank] = started
    if failure is not None:
        details = [failure]
        for rank in range(world_size):
            err = os.path.join(workdir, f"rank{rank}.error")
            if os.path.exists(err):
                with open(err) as f:
                    details.append(f"---------- rank {rank} raised ----------\n{f.read().rstrip()}")
            details.append(f"---------- rank {rank} log tail ----------\n"
                           f"{_tail(os.path.join(workdir, f'rank{rank}.log')).rstrip()}")
        result.failure = "\n".join(details)
    return result


def start_ranks(job, world_size, workdir, *, params=None, started=None):
    """Start ``job`` on ``world_size`` ranks as ``launch`` does, and return their processes
    at once, for a caller that watches (and kills) them itself; ``stop_ranks`` ends them.
    ``started``: a list the processes are appended to as they start."""
    procs = [] if started is None else started
    os.makedirs(workdir, exist_ok=True)
    ctx = _context()
    with open(os.path.join(workdir, "params.json"), "w") as f:
        json.dump(params or {}, f)
    for rank in range(world_size):
        proc = ctx.Process(target=_forked_child, name=f"rank{rank}",
                           args=(job, rank, world_size, workdir))
        proc.start()
        procs.append(proc)
    return procs


def stop_ranks(procs):
    """SIGKILL every rank still running (and what it started), then reap them all."""
    for proc in procs:
        if proc.exitcode is None:
            _kill(proc)
        proc.join()


def _watch(procs, deadline, timeout_s, expect_exit):
    """Wait for the ranks; return None if all exited as expected (0 unless ``expect_exit``
    says otherwise), else a description of what broke."""
    first_death = None
    while True:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            bad = {r: c for r, c in enumerate(codes) if c != expect_exit.get(r, 0)}
            if not bad:
                return None
            if expect_exit:
                return (f"rank(s) exited with unexpected status: {bad} (expected 0, "
                        f"except {expect_exit})")
            return f"rank(s) exited with non-zero status: {bad}"
        now = time.monotonic()
        # A planned death is not one: the survivors go on (they must cope without it).
        dead = {r: c for r, c in enumerate(codes) if c not in (None, 0, expect_exit.get(r))}
        if first_death is None and dead:
            first_death = now
        if first_death is not None and now - first_death > _GRACE_AFTER_DEATH_S:
            alive = [r for r, c in enumerate(codes) if c is None]
            _dump_stacks(procs)
            return (f"rank(s) died with status {dead}; killed the remaining rank(s) {alive}, "
                    f"which could only wait for them")
        if now > deadline:
            alive = [r for r, c in enumerate(codes) if c is None]
            _dump_stacks(procs)
            return (f"job timed out after {timeout_s:.0f}s with rank(s) {alive} still running "
                    f"(stack dumps at the end of their log tails); all ranks killed")
        time.sleep(0.05)


def _dump_stacks(procs):
    for proc in procs:
        if proc.exitcode is None:
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(1.0)  # let faulthandler write before the kill


# ---------------------------------------------------------------------------- child side


class CaseSyncError(RuntimeError):
    """The ranks could not meet after a case: the job cannot continue."""


class Context:
    """What a job function gets: rank, world size, parameters, meshes, case runner."""

    def __init__(self, rank, world_size, workdir):
        import torch.distributed as dist

        self.rank = rank
        self.world_size = world_size
        self.workdir = workdir
        with open(os.path.join(workdir, "params.json")) as f:
            self.params = json.load(f)
        # The harness's own tests shorten the timeouts to exercise them quickly.
        self.pg_timeout_s = float(self.params.get("pg_timeout_s", PG_TIMEOUT_S))
        self.case_sync_timeout_s = 3 * self.pg_timeout_s
        self._base_store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        self._sync_store = dist.PrefixStore("case-sync", self._base_store)
        self._generation = 0
        self._meshes = {}
        self._case_index = 0
        self._lost = ()  # ranks that died as planned: no collective can run after that
        self._records = open(os.path.join(workdir, f"rank{rank}.cases.jsonl"), "a")
        self._init_process_group()

    # Process group ------------------------------------------------------------------

    def _init_process_group(self):
        import torch.distributed as dist

        # A fresh prefix per generation: the old group's keys must not satisfy the new
        # group's rendezvous.
        store = dist.PrefixStore(f"pg{self._generation}", self._base_store)
        dist.init_process_group("gloo", store=store, rank=self.rank,
                                world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=self.pg_timeout_s))

    def _rebuild_process_group(self):
        import torch.distributed as dist

        self._meshes.clear()
        try:
            dist.destroy_process_group()
        except Exception:  # a group broken by a timed-out collective may complain
            pass
        self._generation += 1
        self._init_process_group()

    def shutdown(self):
        import torch.distributed as dist

        self._meshes.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._records.close()

    def mesh(self, shape=None):
        """A CPU DeviceMesh of this shape over all ranks (1-D over all ranks by default)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(shape or (self.world_size,))
        if shape not in self._meshes:
            self._meshes[shape] = init_device_mesh("cpu", shape)
        return self._meshes[shape]

    # Cases --------------------------------------------------------------------------

    def run_case(self, case_id, fn, *, dies=()):
        """Run ``fn()`` as one test case; record its outcome; keep the ranks in step.

        ``dies``: ranks meant to die inside ``fn`` (declared to ``launch`` as
        ``expect_exit``). The others meet without them and record their own outcome; the
        process group has lost a member, so this must be the job's last case.
        """
        if self._lost:
            raise RuntimeError(f"case {case_id!r}: rank(s) {list(self._lost)} died in an "
                               f"earlier case; no case can run after that")
        # Which case this rank is in, for the parent if the job breaks here (a rank that
        # dies records nothing): the report names it, not every case queued behind it.
        with open(os.path.join(self.workdir, f"rank{self.rank}.current"), "w") as f:
            f.write(case_id)
        start = time.monotonic()
        error = ""
        try:
            fn()
            if self.rank in dies:
                raise AssertionError(f"rank {self.rank} was meant to die in this case, "
                                     f"but the case returned")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # also torch's CheckpointException, a BaseException in 2.9
            error = traceback.format_exc()
        ok_here = not error
        # A rank that passed while a peer failed records a pass; the test still fails
        # through the peer's record.
        all_ok = self._meet(ok_here, absent=dies)
        rec = {"case": case_id, "ok": ok_here, "error": error,
               "seconds": round(time.monotonic() - start, 3)}
        self._records.write(json.dumps(rec) + "\n")
        self._records.flush()
        if dies:
            self._lost = tuple(dies)
        elif not all_ok:
            self._rebuild_process_group()
        return ok_here

    def _meet(self, ok_here, absent=()):
        index = self._case_index
        self._case_index += 1
        self._sync_store.set(f"{index}/{self.rank}", "1" if ok_here else "0")
        keys = [f"{index}/{r}" for r in range(self.world_size) if r not in absent]
        try:
            self._sync_store.wait(keys, datetime.timedelta(seconds=self.case_sync_timeout_s))
        except Exception as error:
            raise CaseSyncError(f"ranks did not meet after case #{index}: {error}") from error
        return all(self._sync_store.get(k) == b"1" for k in keys)


@contextmanager
def _redirect_faults():
    # Fatal signals and the parent's SIGUSR1 print every thread's stack to the log.
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    yield


def _forked_child(job, rank, world_size, workdir):
    """Entry point of a rank forked from the server: own session, own log, then run;
    killed with the server, which ends with the process that started it once no rank
    holds its pipe (shardadam.demo.launcher's docstring: a killed soak left ranks
    running)."""
    os.setsid()
    die_with_parent()
    drop_fork_server_pipe()
    log = os.open(os.path.join(workdir, f"rank{rank}.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # One intra-op thread per rank: W ranks already oversubscribe 2 cores, and results
    # must not depend on the thread count anyway (S3.7).
    os.environ["OMP_NUM_THREADS"] = "1"
    _child_main(["--job", job, "--rank", str(rank), "--world-size", str(world_size),
                 "--workdir", workdir])


def _child_main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)
    status = 0
    with _redirect_faults():
        try:
            import torch

            torch.set_num_threads(1)
            module_name, func_name = args.job.split(":")
            func = getattr(importlib.import_module(module_name), func_name)
            ctx = Context(args.rank, args.world_size, args.workdir)
            try:
                func(ctx)
            finally:
                ctx.shutdown()
        except BaseException:
            status = 1
            with open(os.path.join(args.workdir, f"rank{args.rank}.error"), "w") as f:
                f.write(traceback.format_exc())
            traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's background threads can stall it, and everything
    # worth keeping is already on disk.
    os._exit(status)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
