"""The soak: a long FSDP2 run on gloo CPU ranks (the demo's model, one FusedAdam per
state preset, trained side by side) whose ranks are SIGKILLed at random moments,
restarted by a supervisor from the newest complete checkpoint, and compared at the end
with the same run never killed. ``soak(plan, root)`` is the supervisor;
``_soak_jobs.run`` is what every rank runs. ``tools/soak.py`` is its command line,
``test_dist_soak.py`` its short variant in CI.

* Attempts. Each attempt is a fresh process group. It deletes checkpoint folders
  without ``.metadata`` (DCP writes it last, after every rank's data), loads the
  newest complete one and trains on. All but the last lose one rank to SIGKILL, the
  phases in shuffled turns: in a backward (a backward pre-hook on one of a preset's
  modules), in ``step()`` (a thread released right before it, which strikes once
  ``step()`` lets it run, at the latest in a step post-hook that waits for it), part
  way through writing a checkpoint (``_dist_crash_jobs``' tripwire), or at a random
  moment, from outside. Backward and
  ``step()`` kills come after the attempt's first checkpoint, so the run moves on. The
  other ranks are then killed too, as a launcher does when a rank fails. An attempt
  keeps its predecessor's world size half of the time and takes another otherwise; the
  last one always loads at another world size than its checkpoint was saved at. The
  checkpoint an attempt starts from must be byte for byte the same after it ended.
* Lineage. A complete checkpoint of step k was written by the one attempt that ran
  step k and finished that save. The final state descends from a chain of them: steps
  1..k1 by one attempt at world size W1, k1..k2 by another at W2, ...
* Reference. The chain replayed without kills: one process group per stretch of equal
  world size (a world size changes only through a checkpoint), and at every other
  restart point the presets with scaled states (fp16/fp8) reload that checkpoint in
  place, since a load re-derives their scales (S5.5, S6.2); the exact presets never
  stop within a stretch. Every rank's local loss of every preset at every step, and at
  the end its parameters, exported and stored states (codes, scales, remainders) and
  step counts, must be bitwise equal.
* Resources. Every rank records after each step its RSS, open file descriptors and
  threads, and after each checkpoint also its live Python objects (those created since
  it started, after a collection). A process that checkpointed at least
  ``WARMUP_SAVES + 2`` times is judged from its ``WARMUP_SAVES``-th checkpoint on: file
  descriptors and threads constant, live objects back at their warm-up count by the
  last two checkpoints, and RSS grown by less than half of what keeping one copy of
  that rank's parameter shards and optimizer states per checkpoint would add (a plan or
  an exported state dict held on to, the leak this guards against).
"""

import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import time

import _launch

JOB = "_soak_jobs:run"
PHASES = ("backward", "step", "save", "external")
# Samples up to a process's WARMUP_SAVES-th checkpoint are warm-up: the first steps and
# saves fill torch's and DCP's caches and size the heap (measured here: live objects
# settle by the second save).
WARMUP_SAVES = 3
# Every rank fixes glibc's mmap threshold here (mallopt): buffers this large are then
# always mapped and unmapped, so RSS follows what the process holds. By default glibc
# raises the threshold as such buffers are freed, and later ones stay in the heap: RSS
# then swung by up to 2 MB over a rank's first 100 steps here (4 presets, 2 ranks) and
# crept 0.3 MB over the next 900, with live Python objects constant throughout.
MMAP_THRESHOLD = 64 << 10
# How long the other ranks of a killed attempt get to end on their own (they fail at
# their next collective) before they are killed as well.
_PEER_GRACE_S = 0.5
_POLL_S = 0.01
# A SIGKILLed rank's sockets close when its last thread exits, a moment before its end
# is reported; a peer that fails in a collective with it can be seen to end first on a
# loaded machine. Ends seen this close to the first one count as first.
_SAME_END_S = 0.25


@dataclasses.dataclass
class Plan:
    presets: tuple
    steps: int
    every: int            # a checkpoint every this many steps
    kills: int            # attempts that lose a rank; one more attempt then finishes
    world_sizes: tuple
    # A rank dies within this many checkpoint intervals of its attempt's start.
    kill_window: float = 2.0
    seed: int = 0
    size: str = "tiny"    # the demo's model size
    attempt_timeout_s: float = 600.0


class SoakError(AssertionError):
    """The soak found a difference, a leak, or an attempt that ended the wrong way."""


# ------------------------------------------------------------------------ small helpers


def _complete(path):
    return os.path.exists(os.path.join(path, ".metadata"))


def _checkpoints(root):
    """step -> folder of every checkpoint folder under ``root``."""
    out = {}
    for name in os.listdir(root):
        if name.startswith("step-"):
            out[int(name[len("step-"):])] = os.path.join(root, name)
    return out


def _digest(path):
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        digest.update(name.encode())
        with open(os.path.join(path, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def _read_records(path):
    """The JSON lines a rank wrote; a line cut short by SIGKILL is dropped."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


class _Tail:
    """The last step a rank has recorded, read incrementally while it runs."""

    def __init__(self, path):
        self._path, self._offset, self._buffer = path, 0, b""
        self.last_step = None
        self.step_seconds = []
        self.reached = None  # when the step before the one to strike was recorded

    def poll(self):
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        for line in lines:
            rec = json.loads(line)
            if rec.get("event") == "step":
                self.last_step = rec["step"]
                self.step_seconds.append(rec["seconds"])


# ----------------------------------------------------------------------------- attempts


@dataclasses.dataclass
class Attempt:
    index: int
    world_size: int
    start: int
    kill: dict
    workdir: str
    records: str
    seconds: float = 0.0
    wrote: list = dataclasses.field(default_factory=list)  # complete checkpoints
    exits: dict = dataclasses.field(default_factory=dict)
    landed: str = ""      # where the kill landed, as far as the records tell
    first_dead: list = dataclasses.field(default_factory=list)


class _Supervisor:
    def __init__(self, plan, root, corpus, log):
        self.plan, self.root, self.corpus, self.log = plan, root, corpus, log
        self.rng = random.Random(plan.seed)
        self.ckpt_root = os.path.join(root, "ckpt")
        os.makedirs(self.ckpt_root, exist_ok=True)
        phases = []
        while len(phases) < plan.kills:
            batch = list(PHASES)
            self.rng.shuffle(batch)
            phases.extend(batch)
        self.phases = phases[:plan.kills]
        self.attempts = []
        self.owner = {}  # checkpoint step -> index of the attempt that completed it

    def params(self, **extra):
        p = self.plan
        return dict(presets=list(p.presets), size=p.size, seed=p.seed, steps=p.steps,
                    every=p.every, corpus=self.corpus, pg_timeout_s=30,
                    mmap_threshold=MMAP_THRESHOLD, **extra)

    def run(self):
        while True:
            attempt = self._next_attempt()
            self._run_attempt(attempt)
            if attempt.kill is None:
                return

    def _newest_complete(self):
        """Deletes incomplete checkpoint folders and all but the two newest complete
        ones; returns the newest complete step (0: none yet)."""
        found = _checkpoints(self.ckpt_root)
        complete = sorted(step for step, path in found.items() if _complete(path))
        for step, path in found.items():
            if step not in complete[-2:]:
                shutil.rmtree(path)
        return complete[-1] if complete else 0

    def _next_attempt(self):
        p, rng = self.plan, self.rng
        index = len(self.attempts)
        start = self._newest_complete()
        last = index == len(self.phases)
        if not self.attempts:
            world = p.world_sizes[0]
        elif last and start:
            # The last attempt always reshards: another world size than the checkpoint's.
            saved_at = self.attempts[self.owner[start]].world_size
            world = rng.choice([w for w in p.world_sizes if w != saved_at])
        elif rng.random() < 0.5:
            world = self.attempts[-1].world_size
        else:
            world = rng.choice([w for w in p.world_sizes if w != self.attempts[-1].world_size])
        kill = None if last else self._draw_kill(self.phases[index], start, world)
        workdir = os.path.join(self.root, "attempts", f"{index:03d}-W{world}")
        records = os.path.join(workdir, "records")
        os.makedirs(records)
        return Attempt(index, world, start, kill, workdir, records)

    def _draw_kill(self, phase, start, world):
        """Where this attempt loses a rank, within ``kill_window`` checkpoint intervals of
        its start: in backward or step() after its first checkpoint (so the run moves
        on), while writing one of its checkpoints, or from outside at any step."""
        p, rng = self.plan, self.rng
        last = min(p.steps - 1, start + int(p.kill_window * p.every))
        first = start + 1
        if phase in ("backward", "step") and start + p.every < last:
            first = start + p.every + 1
        saves = [s for s in range(start + 1, last + 1) if s % p.every == 0]
        if phase == "save" and not saves:
            phase = "backward"
        step = rng.choice(saves) if phase == "save" else rng.randint(first, last)
        return {"phase": phase, "rank": rng.randrange(world), "step": step,
                "preset": rng.randrange(len(p.presets)),
                # external: how far into the step (in units of a median step) to strike
                "fraction": rng.random()}

    def _run_attempt(self, a):
        p = self.plan
        start_path = os.path.join(self.ckpt_root, f"step-{a.start:06d}")
        before = _digest(start_path) if a.start else None
        params = self.params(ckpt_root=self.ckpt_root, start=a.start, end=p.steps,
                             records=a.records, kill=a.kill,
                             kill_seed=self.rng.randrange(2**32))
        if a.kill is None:
            params["snapshot"] = os.path.join(a.workdir, "snapshot")
            os.makedirs(params["snapshot"])
        began = time.monotonic()
        procs = _launch.start_ranks(JOB, a.world_size, a.workdir, params=params)
        try:
            self._watch(a, procs, began)
        finally:
            _launch.stop_ranks(procs)
        a.seconds = time.monotonic() - began
        a.exits = {r: proc.exitcode for r, proc in enumerate(procs)}
        self.attempts.append(a)
        self._check_attempt(a, procs, start_path, before)
        for step, path in sorted(_checkpoints(self.ckpt_root).items()):
            if step > a.start and _complete(path) and step not in self.owner:
                self.owner[step] = a.index
                a.wrote.append(step)
        self.log(f"attempt {a.index:>3}  W={a.world_size}  steps {a.start:>5} -> "
                 f"{max(a.wrote, default=a.start):>5} checkpointed  "
                 f"{self._kill_text(a)}  {a.seconds:5.1f} s")

    def _watch(self, a, procs, began):
        kill = a.kill
        external = kill is not None and kill["phase"] == "external"
        tail = _Tail(os.path.join(a.records, f"rank{kill['rank']}.jsonl")) if external \
            else None
        deadline = began + self.plan.attempt_timeout_s * _launch.timeout_scale()
        struck = False
        first_death = None
        while True:
            codes = [proc.exitcode for proc in procs]
            now = time.monotonic()
            # Before the all-ended check: on a loaded machine the victim and the peers
            # that fail with it can all end within one poll.
            if first_death is None and any(c not in (None, 0) for c in codes):
                first_death = now
            if first_death is not None and now - first_death <= _SAME_END_S:
                a.first_dead = sorted(r for r, c in enumerate(codes) if c not in (None, 0))
            if all(c is not None for c in codes):
                return
            if first_death is not None and now - first_death > _PEER_GRACE_S:
                return  # the rest are killed by stop_ranks, as a launcher would
            if now > deadline:
                _launch._dump_stacks(procs)
                raise SoakError(f"attempt {a.index} ran past {self.plan.attempt_timeout_s}"
                                f" s; logs in {a.workdir}")
            if external and not struck:
                tail.poll()
                if self._strike_now(kill, tail, a.start, now - began):
                    os.kill(procs[kill["rank"]].pid, signal.SIGKILL)
                    struck = True
            time.sleep(_POLL_S)

    @staticmethod
    def _strike_now(kill, tail, start, elapsed):
        """External kills land ``fraction`` of a median step into step ``kill['step']``
        of the chosen rank (into start-up and loading when that is the first step)."""
        if kill["step"] == start + 1:
            # Into start-up and loading (a few seconds), and at the latest once the first
            # step is recorded: where start-up is quick, a timer alone let an attempt run
            # past its kill window and the last attempt too few saves to be judged.
            return elapsed > kill["fraction"] * 4.0 or tail.last_step is not None
        if tail.last_step is None or tail.last_step < kill["step"] - 1:
            return False
        if tail.reached is None:
            tail.reached = time.monotonic()
        typical = statistics.median(tail.step_seconds)
        return time.monotonic() - tail.reached > kill["fraction"] * typical

    def _check_attempt(self, a, procs, start_path, before):
        if before is not None and _digest(start_path) != before:
            raise SoakError(f"attempt {a.index} changed the checkpoint it started from")
        if a.kill is None:
            if any(code != 0 for code in a.exits.values()):
                raise SoakError(f"the last attempt failed: exits {a.exits}\n"
                                f"{self._errors(a)}")
            return
        victim = a.kill["rank"]
        # Peers may end in the same poll: they fail at once in a collective with it.
        if victim not in a.first_dead or a.exits[victim] != -signal.SIGKILL:
            raise SoakError(f"attempt {a.index}: rank {victim} was to be SIGKILLed first "
                            f"({a.kill}); first to end: {a.first_dead}, exit statuses "
                            f"{a.exits}\n{self._errors(a)}")
        a.landed = self._landed(a)
        if a.kill["phase"] == "save":
            path = os.path.join(self.ckpt_root, f"step-{a.kill['step']:06d}")
            if _complete(path):
                raise SoakError(f"attempt {a.index}: a rank died writing {path}, "
                                f"which has .metadata")

    def _landed(self, a):
        """Where the kill struck, from the victim's own records."""
        events = {r.get("event") for r in
                  _read_records(os.path.join(a.records, f"rank{a.kill['rank']}.jsonl"))}
        phase = a.kill["phase"]
        if phase == "backward":
            return "in backward" if "backward-returned" not in events else "after backward"
        if phase == "step":
            if "step-returned" in events:
                return "after step()"
            return "in step(), after the update" if "update-done" in events else "in step()"
        return {"save": "writing a checkpoint", "external": "from outside"}[phase]

    def _errors(self, a):
        parts = []
        for r in a.exits:
            for name in (f"rank{r}.error", f"rank{r}.log"):
                path = os.path.join(a.workdir, name)
                if os.path.exists(path):
                    with open(path, errors="replace") as f:
                        parts.append(f"--- {name}\n{f.read()[-3000:]}")
        return "\n".join(parts)

    @staticmethod
    def _kill_text(a):
        if a.kill is None:
            return "no kill (last attempt)".ljust(44)
        k = a.kill
        where = {"backward": f"{a.landed}, step {k['step']}",
                 "step": f"{a.landed}, step {k['step']}",
                 "save": f"writing checkpoint {k['step']}",
                 "external": f"from outside, near step {k['step']}"}[k["phase"]]
        ended = sum(code == 1 for r, code in a.exits.items() if r != k["rank"])
        return f"rank {k['rank']} killed {where} ({ended} peer(s) failed on their own)" \
            .ljust(44)

    def lineage(self):
        """[(from, to, world size, attempt)] that produced the final state, oldest first."""
        segments = []
        a = self.attempts[-1]
        end = self.plan.steps
        while True:
            segments.append((a.start, end, a.world_size, a.index))
            if a.start == 0:
                break
            end = a.start
            a = self.attempts[self.owner[a.start]]
        return segments[::-1]


# ---------------------------------------------------------------------------- reference


def _reference(sup, segments, root, log):
    """Replays ``segments`` without kills; returns its runs (records folder, range)."""
    ckpt_root = os.path.join(root, "ckpt")
    os.makedirs(ckpt_root)
    stretches = []
    for lo, hi, world, _ in segments:
        if stretches and stretches[-1]["world"] == world:
            stretches[-1]["reload"].append(lo)
            stretches[-1]["end"] = hi
        else:
            stretches.append({"start": lo, "end": hi, "world": world, "reload": []})
    runs = []
    for i, s in enumerate(stretches):
        workdir = os.path.join(root, f"run{i}-W{s['world']}")
        records = os.path.join(workdir, "records")
        os.makedirs(records)
        last = i == len(stretches) - 1
        params = sup.params(ckpt_root=ckpt_root, start=s["start"], end=s["end"],
                            records=records, reload=s["reload"])
        if last:
            params["snapshot"] = os.path.join(workdir, "snapshot")
            os.makedirs(params["snapshot"])
        began = time.monotonic()
        result = _launch.launch(JOB, s["world"], workdir, params=params,
                                timeout_s=sup.plan.attempt_timeout_s)
        if result.failure:
            raise SoakError(f"reference run {i} failed:\n{result.failure}")
        log(f"reference {i}  W={s['world']}  steps {s['start']:>5} -> {s['end']:>5}  "
            f"reloads of scaled presets at {s['reload'] or 'none'}  "
            f"{time.monotonic() - began:5.1f} s")
        runs.append(dict(s, workdir=workdir, records=records,
                         snapshot=params.get("snapshot")))
    return runs


# ---------------------------------------------------------------------------- comparing


def _losses(records_dir, world, lo, hi):
    """rank -> {step: [loss per preset]} for steps lo+1 .. hi."""
    out = {}
    for rank in range(world):
        recs = _read_records(os.path.join(records_dir, f"rank{rank}.jsonl"))
        out[rank] = {r["step"]: r["loss"] for r in recs
                     if r.get("event") == "step" and lo < r["step"] <= hi}
    return out


def _compare(sup, segments, runs):
    """Bitwise: every lineage step's losses, then the final snapshots of every preset."""
    import torch

    from _dist_helpers import assert_snapshots_bitwise

    compared_steps = 0
    for lo, hi, world, index in segments:
        soaked = _losses(sup.attempts[index].records, world, lo, hi)
        run = next(r for r in runs if r["start"] <= lo and hi <= r["end"])
        ref = _losses(run["records"], world, lo, hi)
        for rank in range(world):
            for step in range(lo + 1, hi + 1):
                got, want = soaked[rank].get(step), ref[rank].get(step)
                if got is None or got != want:
                    raise SoakError(f"rank {rank} step {step} (W={world}): losses {got} "
                                    f"after kills, {want} without")
        compared_steps += hi - lo
    final = sup.attempts[-1]
    presets = sup.plan.presets
    for rank in range(final.world_size):
        got = torch.load(os.path.join(final.workdir, "snapshot", f"rank{rank}.pt"))
        want = torch.load(os.path.join(runs[-1]["snapshot"], f"rank{rank}.pt"))
        for name in presets:
            assert_snapshots_bitwise(got[name], want[name], f"rank {rank} preset {name}")
    return compared_steps


# ---------------------------------------------------------------------------- resources


def _judge_process(records_path):
    """Figures of one rank process after its warm-up, and what broke the rule (None if
    it held); (None, None) for a process too short to judge (killed early)."""
    recs = _read_records(records_path)
    saves = [r for r in recs if r.get("event") == "saved"]
    if len(saves) < WARMUP_SAVES + 2:
        return None, None
    state_bytes = next(r["bytes"] for r in recs if r.get("event") == "sizes")
    warm, later = saves[WARMUP_SAVES - 1], saves[WARMUP_SAVES:]
    after = [r for r in recs if r.get("event") == "step" and r["step"] > warm["step"]]
    after += later
    # Half of what keeping one copy of the shards and states per checkpoint would add.
    bound = state_bytes * len(later) // 2
    fig = {"steps": sum(r.get("event") == "step" for r in recs), "warm_step": warm["step"],
           "judged_steps": after[-1]["step"] - warm["step"], "saves_judged": len(later),
           "rss_warm": warm["rss"], "rss_growth": max(r["rss"] for r in after) - warm["rss"],
           "rss_bound": bound, "state_bytes": state_bytes,
           "fds": sorted({r["fds"] for r in after + [warm]}),
           "threads": sorted({r["threads"] for r in after + [warm]}),
           "objects_warm": warm["objects"],
           "objects": sorted({r["objects"] for r in later})}
    problems = []
    for key in ("fds", "threads"):
        if len(fig[key]) != 1:
            problems.append(f"{key} changed after warm-up: {fig[key]}")
    # A sample may catch a few objects in passing; a leak stays.
    if min(r["objects"] for r in later[-2:]) > warm["objects"]:
        problems.append(f"live objects grew from {warm['objects']} to "
                        f"{[r['objects'] for r in later]} after warm-up")
    if fig["rss_growth"] >= bound:
        problems.append(f"RSS grew {fig['rss_growth']} bytes over {len(later)} saves after "
                        f"warm-up; bound {bound} (one copy of the rank's shards and states "
                        f"is {state_bytes})")
    return fig, "; ".join(problems) or None


def _resources(sup, runs):
    judged, problems = {}, []
    processes = [(f"attempt {a.index} rank {r}", a.records, r)
                 for a in sup.attempts for r in range(a.world_size)]
    processes += [(f"reference {i} rank {r}", run["records"], r)
                  for i, run in enumerate(runs) for r in range(run["world"])]
    for label, records, rank in processes:
        fig, problem = _judge_process(os.path.join(records, f"rank{rank}.jsonl"))
        if fig is not None:
            judged[label] = fig
        if problem:
            problems.append(f"{label}: {problem}")
    return judged, problems


# --------------------------------------------------------------------------------- soak


def plan_error(plan):
    """Why ``plan`` cannot run (a sentence), or None."""
    if plan.steps < 1 or plan.every < 1 or plan.kills < 0:
        return (f"steps and every must be at least 1 and kills at least 0, got steps "
                f"{plan.steps}, every {plan.every}, kills {plan.kills}")
    if not 0 < plan.kill_window < float("inf"):
        return f"kill_window must be finite and > 0, got {plan.kill_window}"
    if (len(plan.world_sizes) < 2 or min(plan.world_sizes) < 1
            or len(set(plan.world_sizes)) != len(plan.world_sizes)):
        return (f"two or more different world sizes of at least 1 rank (the last attempt "
                f"loads at another one), got {plan.world_sizes}")
    if len(set(plan.presets)) != len(plan.presets):
        return f"each preset once, got {plan.presets}"
    if int(plan.kill_window * plan.every) <= plan.every:
        return (f"kill_window must span more than one checkpoint interval (a rank killed "
                f"in backward or step() dies after its attempt's first checkpoint), got "
                f"{plan.kill_window} intervals of {plan.every} steps")
    room = plan.kills * int(plan.kill_window * plan.every) + plan.every
    if plan.steps <= room:
        return (f"{plan.kills} kills within {plan.kill_window} intervals of {plan.every} "
                f"steps need more than {room} steps, got {plan.steps}")
    return None


def soak(plan, root, log=print):
    """Runs the whole soak in ``root`` (a fresh folder); returns its report (a dict) or
    raises ``SoakError``."""
    from shardadam.demo.config import SIZES
    from shardadam.demo.corpus import build_corpus

    error = plan_error(plan)
    if error is not None:
        raise ValueError(error)
    began = time.monotonic()
    os.makedirs(root, exist_ok=True)
    corpus = os.path.join(root, "corpus.txt")
    build_corpus(corpus, SIZES[plan.size].corpus_bytes)
    sup = _Supervisor(plan, os.path.join(root, "soak"), corpus, log)
    sup.run()
    soak_s = time.monotonic() - began
    segments = sup.lineage()
    if plan.kills and len(segments) == 1:
        # Every kill struck before its attempt's first checkpoint was complete (while
        # writing it, or from outside): a pass would say nothing of resuming.
        raise SoakError(f"the final state was never loaded from a checkpoint (lineage "
                        f"{segments[0][0]}-{segments[0][1]} at W={segments[0][2]}): the "
                        f"soak tested no resume; run it again with another seed")
    runs = _reference(sup, segments, os.path.join(root, "reference"), log)
    compared = _compare(sup, segments, runs)
    judged, problems = _resources(sup, runs)
    killed = [a for a in sup.attempts if a.kill is not None]
    return {
        "plan": dataclasses.asdict(plan),
        "seconds": round(time.monotonic() - began, 1),
        "soak_seconds": round(soak_s, 1),
        "attempts": len(sup.attempts),
        "restarts": len(sup.attempts) - 1,
        "kills": {ph: sum(a.kill["phase"] == ph for a in killed) for ph in PHASES},
        "kills_landed": sorted(f"{a.kill['phase']}: {a.landed}" for a in killed),
        "steps_run": sum(len(_losses(a.records, 1, a.start, plan.steps)[0])
                         for a in sup.attempts),
        "world_sizes_visited": sorted({a.world_size for a in sup.attempts}),
        "lineage": [{"from": lo, "to": hi, "world_size": w, "attempt": i}
                    for lo, hi, w, i in segments],
        "reference_runs": [{k: r[k] for k in ("start", "end", "world", "reload")}
                           for r in runs],
        "compared_steps": compared,
        "resources": judged,
        "resource_problems": problems,
    }
