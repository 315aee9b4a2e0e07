"""The process harness itself: outcomes per case, tracebacks, timeouts, dead ranks and
planned deaths.

These run without the optimizer, so they pass whatever state the package is in.
"""

import os
import signal
import time

import _launch


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_cases_are_isolated_and_failures_carry_the_rank_traceback(tmp_path):
    result = _launch.launch("_dist_toy_jobs:isolation", 2, str(tmp_path), timeout_s=120,
                            params={"pg_timeout_s": 3})
    assert result.failure is None, result.failure
    for case in ("passes", "one-thread-per-rank", "passes-after-failure",
                 "uses-a-2d-mesh-after-failure"):
        assert result.case_failure(case) is None, result.case_failure(case)
    failure = result.case_failure("fails")
    assert failure is not None
    assert "rank(s) [1]" in failure
    assert "ValueError: deliberate failure on the last rank" in failure
    assert "_fails_on_last_rank_before_collective" in failure  # the traceback, not just text
    failure = result.case_failure("raises-a-base-exception")
    assert failure is not None and "_NotAnException: deliberate BaseException" in failure


def test_hung_rank_fails_the_job_and_every_rank_is_killed(tmp_path):
    start = time.monotonic()
    result = _launch.launch("_dist_toy_jobs:hang", 2, str(tmp_path), timeout_s=6)
    assert time.monotonic() - start < 20
    assert result.failure is not None and "timed out" in result.failure
    assert "stuck" in result.failure, "the hung rank's stack dump is missing"
    assert "did not finish" in result.case_failure("hangs")
    assert all(_gone(pid) for pid in result.pids)


def test_dead_rank_ends_the_job_at_once(tmp_path):
    start = time.monotonic()
    result = _launch.launch("_dist_toy_jobs:crash", 2, str(tmp_path), timeout_s=120)
    assert time.monotonic() - start < 60
    assert result.failure is not None and "died with status {1: 3}" in result.failure
    assert result.case_failure("dies") is not None
    assert all(_gone(pid) for pid in result.pids)


def test_dead_rank_is_reported_by_its_case_and_the_cases_after_it_point_there(tmp_path):
    # A job of many cases whose rank dies in one: that case's report has the death and
    # the log tails; each case queued behind it says in one line where the job ended,
    # instead of repeating the whole report.
    result = _launch.launch("_dist_toy_jobs:crash", 2, str(tmp_path), timeout_s=120,
                            params={"cases_around": True})
    assert result.case_failure("passes") is None, result.case_failure("passes")
    assert result.running == {0: "dies", 1: "dies"}, result.running
    died = result.case_failure("dies")
    assert "died with status {1: 3}" in died and "rank(s) [0, 1] were in it" in died
    assert "rank 1 exits with status 3" in died  # the dead rank's log tail
    for queued in ("queued-1", "queued-2"):
        failure = result.case_failure(queued)
        assert failure is not None and len(failure.splitlines()) == 1, failure
        assert "ended in case(s) ['dies']" in failure and "died with status {1: 3}" in failure
        assert "log tail" not in failure


def test_error_outside_a_case_is_reported_with_its_traceback(tmp_path):
    result = _launch.launch("_dist_toy_jobs:raise_outside_case", 2, str(tmp_path), timeout_s=120)
    assert result.case_failure("passes") is None
    assert result.failure is not None
    assert "RuntimeError: boom outside any case" in result.failure
    assert "raise_outside_case" in result.failure


def test_planned_death_lets_the_survivors_finish(tmp_path):
    start = time.monotonic()
    result = _launch.launch("_dist_toy_jobs:planned_death", 2, str(tmp_path), timeout_s=120,
                            params={"pg_timeout_s": 10}, expect_exit={1: -signal.SIGKILL})
    assert time.monotonic() - start < 60
    assert result.failure is None, result.failure
    assert result.case_failure("passes") is None
    assert result.case_failure("dies") is None, result.case_failure("dies")
    assert sorted(result.cases["dies"]) == [0]  # the dead rank recorded nothing
    with open(tmp_path / "rank0.log") as f:
        assert "all_reduce with a dead peer raised" in f.read()
    assert all(_gone(pid) for pid in result.pids)


def test_planned_death_that_does_not_happen_fails_the_job(tmp_path):
    # Rank 1 survives the case it was meant to die in, and the job then tries another
    # case on a group that (as far as the ranks know) has lost a member.
    result = _launch.launch("_dist_toy_jobs:planned_death", 2, str(tmp_path), timeout_s=120,
                            params={"pg_timeout_s": 3, "die": False, "case_after": True},
                            expect_exit={1: -signal.SIGKILL})
    # Both ranks then fail; how the job's failure words their exits depends on whether
    # they end within the harness's grace period of each other, so it is not checked.
    assert result.failure is not None
    assert "'dies' failed on rank(s) [1]" in result.case_failure("dies")
    assert "meant to die in this case, but the case returned" in result.case_failure("dies")
    assert "no case can run after that" in result.failure
    assert all(_gone(pid) for pid in result.pids)
