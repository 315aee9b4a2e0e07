"""block8 moments (S2.11) under FSDP2 on a CPU gloo mesh: saved with DCP at world size 2,
resumed at 3, and bitwise the run that never stopped, codes and scales included (rows
that are whole blocks: the stored state does not depend on the sharding)."""

import pytest

import _dist_cases


@pytest.mark.parametrize("case", _dist_cases.of_kind("block8_dcp_save"), ids=str)
def test_block8_checkpoint_save(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("block8_dcp_resume"), ids=str)
def test_block8_resume_at_another_world_size_equals_uninterrupted_run(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("block8_mesh_rule"), ids=str)
def test_block8_mesh_rule(case, dist_jobs):
    dist_jobs.check(case)
