"""Crash-safe checkpoints through torch.distributed.checkpoint, with FSDP2 and FusedAdam
(int16 remainders, fp8 exp_avg with its scale, bf16 exp_avg_sq), in two jobs of real
processes (_dist_crash_jobs.py).

A rank killed half way through writing checkpoint B leaves B without ``.metadata`` and
checkpoint A byte for byte as it was; the surviving rank's save raises within the
process group's 10 s timeout.
A new process group resumes from A bitwise like the run that never crashed. Loading B,
or A with garbage / truncated ``.metadata``, fails on every rank before anything changes;
A with a truncated data file fails on every rank after DCP has already overwritten part
of the live state, which loading A again restores.
"""

import signal

import pytest

import _launch

# Short collective timeout: every failure here must come well before it, not from it.
_PG_TIMEOUT_S = 10
_DYING_RANK = 1  # as in _dist_crash_jobs


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp-crash")
    params = {"dir": str(root), "pg_timeout_s": _PG_TIMEOUT_S}
    crash = _launch.launch("_dist_crash_jobs:save_then_crash", 2, str(root / "job-crash"),
                           params=params, timeout_s=90,
                           expect_exit={_DYING_RANK: -signal.SIGKILL})
    resume = _launch.launch("_dist_crash_jobs:resume_and_damage", 2,
                            str(root / "job-resume"), params=params, timeout_s=90)
    return {"crash": crash, "resume": resume}


def _check(result, case):
    failure = result.case_failure(case)
    if failure:
        pytest.fail(failure, pytrace=False)
    if result.failure:
        pytest.fail(result.failure, pytrace=False)


def test_rank_killed_while_saving_leaves_an_incomplete_checkpoint(jobs):
    crash = jobs["crash"]
    _check(crash, "train-save-A-reload-and-train")
    _check(crash, "rank-killed-while-saving-B")
    assert sorted(crash.cases["rank-killed-while-saving-B"]) == [0]  # rank 1 died in it


def test_resume_from_last_complete_checkpoint_equals_uninterrupted_run(jobs):
    _check(jobs["resume"], "resume-from-A-equals-uninterrupted-run")


def test_loading_the_interrupted_checkpoint_fails_and_changes_nothing(jobs):
    _check(jobs["resume"], "load-interrupted-B-fails")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_damaged_metadata_fails_and_changes_nothing(jobs, damage):
    _check(jobs["resume"], f"load-{damage}-metadata-fails")


def test_truncated_data_file_fails_after_a_partial_load(jobs):
    _check(jobs["resume"], "load-truncated-data-file-fails")
