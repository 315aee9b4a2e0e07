"""Asynchronous DCP checkpoints (``dcp.async_save``) of FusedAdam, in real processes
(_async_ckpt_jobs.py): FSDP2 at two ranks (DTensor states) and plain tensors at one.

Saved asynchronously and followed at once by several steps, a checkpoint holds bitwise
the state of the moment of the call, for every preset (fp32, bf16 moments with an fp32
master, int16 remainders, fp8 codes with their scales, fp16 master and moments), and
loads into what a blocking save of that moment loads into. Loading a checkpoint whose
save is still writing (no ``.metadata`` yet) fails on every rank and changes nothing;
a save whose write fails on one rank makes its future raise on every rank, leaves no
``.metadata``, and changes nothing in the optimizer, which trains on meanwhile.
"""

import pytest

import _dist_cases
import _launch

_PG_TIMEOUT_S = 10  # every failure here must come well before a collective timeout


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp-async")
    params = {"dir": str(root), "pg_timeout_s": _PG_TIMEOUT_S}
    return {
        "fsdp2": _launch.launch("_async_ckpt_jobs:run", 2, str(root / "job-fsdp2"),
                                params=dict(params, fsdp=True), timeout_s=120),
        "plain": _launch.launch("_async_ckpt_jobs:run", 1, str(root / "job-plain"),
                                params=dict(params, fsdp=False), timeout_s=90),
    }


def _check(result, case):
    failure = result.case_failure(case)
    if failure:
        pytest.fail(failure, pytrace=False)
    if result.failure:
        pytest.fail(result.failure, pytrace=False)


@pytest.mark.parametrize("layout", ["fsdp2", "plain"])
@pytest.mark.parametrize("preset", list(_dist_cases.PRESETS))
def test_async_save_holds_the_state_at_the_call(jobs, layout, preset):
    _check(jobs[layout], f"async-save-then-steps-{preset}")


def test_loading_a_checkpoint_still_being_written_fails_and_changes_nothing(jobs):
    _check(jobs["fsdp2"], "load-while-async-save-in-flight")


def test_async_save_whose_write_fails_raises_on_every_rank(jobs):
    _check(jobs["fsdp2"], "async-save-whose-write-fails")
