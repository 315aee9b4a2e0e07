"""The soak's short variant (_soak.py; the long one is ``python tools/soak.py``): FSDP2
on gloo CPU ranks with the demo's model, four ranks SIGKILLed in turn (during a
backward, during ``step()``, while writing a checkpoint, from outside at a random
moment), each time restarted from the newest complete checkpoint, the last time at
another world size; the result is compared with the same run never killed.

Two presets keep it within CI's budget: ``remainder-fp8`` holds every kind of stored
state at once (int16 remainders, fp8 codes with their scales, bf16 moments) and
``fp32`` the plain one; the long variant runs all four of the demo. The demo's small
model (about 5 MB of shards and states per rank) rather than its tiny one (0.3 MB):
torch's own caches grow a rank's RSS as it saves checkpoints (torch 2.15: up to 4 MB
over its first hundred or so DCP saves, then flat; 2.9.1: 0.3 MB), which the tiny
model's RSS bound, half its state per checkpoint, could not tell from a leak.
"""

import collections
import os
import subprocess
import sys

import pytest

import _soak

PLAN = _soak.Plan(presets=("fp32", "remainder-fp8"), steps=48, every=4, kills=4,
                  world_sizes=(2, 3), seed=0, kill_window=1.5, size="small")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    try:
        return _soak.soak(PLAN, str(root), log=print)
    except _soak.SoakError as error:
        pytest.fail(f"{error}\n(everything the soak wrote is in {root})", pytrace=False)


def test_a_rank_was_killed_in_every_phase_and_the_run_resumed(report):
    assert report["kills"] == {phase: 1 for phase in _soak.PHASES}, report["kills"]
    assert report["restarts"] == PLAN.kills
    # Each victim's own records say where it died (in backward and in step(): no
    # record that the call returned; in step() before or after the update).
    landed = collections.Counter(x.replace(", after the update", "")
                                 for x in report["kills_landed"])
    assert landed == {"backward: in backward": 1, "step: in step()": 1,
                      "save: writing a checkpoint": 1, "external: from outside": 1}, landed


def test_the_lineage_crosses_world_sizes(report):
    # The last attempt reshards by construction; its checkpoint came from another size.
    sizes = [segment["world_size"] for segment in report["lineage"]]
    assert len(sizes) >= 2 and sizes[-1] != sizes[-2], report["lineage"]


def test_every_step_and_the_final_state_equal_the_run_never_killed(report):
    # soak() compares (and raises on a difference) every step's losses on every rank
    # and preset, and the final parameters, states, scales and step counts, bitwise.
    assert report["compared_steps"] == PLAN.steps


def test_fds_threads_objects_and_rss_flat_after_warm_up(report):
    judged = report["resources"]
    for label, fig in sorted(judged.items()):
        print(f"{label}: steps {fig['warm_step']}+{fig['judged_steps']}, RSS "
              f"{fig['rss_warm'] / 2**20:.2f} MiB after warm-up, then at most "
              f"{fig['rss_growth'] / 1024:+.0f} KiB (bound {fig['rss_bound'] / 1024:.0f} KiB), "
              f"fds {fig['fds']}, threads {fig['threads']}, live objects "
              f"{fig['objects_warm']} -> {fig['objects']}")
    # The last attempt starts at most kills * every steps in (each killed attempt
    # completes at most one checkpoint), which leaves it enough saves for a verdict.
    last = report["attempts"] - 1
    assert any(label.startswith(f"attempt {last} ") for label in judged), sorted(judged)
    assert not report["resource_problems"], "\n".join(report["resource_problems"])


@pytest.mark.parametrize("change,named", [
    (dict(steps=0), "steps and every must be at least 1"),
    (dict(every=0), "steps and every must be at least 1"),
    (dict(kills=-1), "kills at least 0"),
    (dict(kill_window=float("nan")), "kill_window must be finite and > 0"),
    (dict(world_sizes=(2,)), "two or more different world sizes"),
    (dict(world_sizes=(0, 2)), "two or more different world sizes"),
    (dict(world_sizes=(2, 2)), "two or more different world sizes"),
    (dict(presets=("fp32", "fp32")), "each preset once"),
    (dict(kill_window=1.2), "kill_window must span more than one checkpoint interval"),
    (dict(steps=20), "4 kills within 1.5 intervals of 4 steps need more than 28 steps"),
])
def test_a_plan_that_cannot_run_is_refused_before_anything_starts(change, named):
    """tools/soak.py reports these as usage errors before it makes its folder (they
    were tracebacks, or with kills < 0 a PASS with no kill at all)."""
    import dataclasses

    assert _soak.plan_error(PLAN) is None
    error = _soak.plan_error(dataclasses.replace(PLAN, **change))
    assert error is not None and named in error, error


@pytest.mark.parametrize("flags,named", [
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--presets", "fp32,fp32"], "each preset once"),
    (["--world-sizes", "2,2"], "two or more different world sizes"),
    (["--kill-window", "1"], "kill_window must span more than one checkpoint interval")])
def test_the_soak_command_refuses_bad_usage_before_it_runs(flags, named, tmp_path):
    """tools/soak.py: a repeated world size crashed after training had begun, a repeated
    preset failed as a soak that differed, and a window of one interval could pass
    without a kill after a checkpoint; each is a usage error now, and no folder is made."""
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "soak.py")
    out = tmp_path / "soak"
    done = subprocess.run([sys.executable, tool, *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and named in done.stderr, done.stderr
    assert not out.exists()
