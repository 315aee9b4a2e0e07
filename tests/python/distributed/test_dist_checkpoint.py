"""torch.distributed.checkpoint with FusedAdam on DTensor parameters.

Saved after two steps at world size 2 and reloaded at 2 and at 3, saved at 4 (partly on a
2x2 mesh) and reloaded at 2, through get/set_optimizer_state_dict (nested and flattened)
and through the raw optimizer.state_dict() / load_state_dict(): the loaded values equal
the saved ones and the next steps equal the uninterrupted run (S5.6, S6.1, S6.2).
get_optimizer_state_dict on a fresh optimizer changes nothing (S6.3).
"""

import pytest

import _dist_cases


@pytest.mark.parametrize("case", _dist_cases.of_kind("dcp_resume"), ids=str)
def test_resume_equals_uninterrupted_run(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("dcp_save"), ids=str)
def test_save(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("fresh_get_state_dict"), ids=str)
def test_get_state_dict_on_fresh_optimizer_changes_nothing(case, dist_jobs):
    dist_jobs.check(case)
