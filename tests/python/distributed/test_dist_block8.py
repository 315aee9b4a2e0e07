"""block8 and block4 moments (S2.11, S2.12) under FSDP2 on a CPU gloo mesh: saved with DCP
at world size 2, resumed at 3, at 4 (a rank's shard empty) and at 1, and bitwise the run
that never stopped, codes and scales included (rows that are whole blocks: the stored
state does not depend on the sharding).
Under ``megatron_fsdp.fully_shard`` (uneven runs of rows, blocks keyed to the global index
Megatron marks them with): saved at 2, resumed at 2 and 3, bitwise the uninterrupted run
where the mesh rule promises it (``_megatron_block_jobs``). block4 on uneven rows that
declare no offset: keyed to the local index, resumed bitwise at the same cut. The
pure-torch path in pieces that do not start at the shard boundaries: bitwise the C++
core on the same shards. An optimizer built over a meta-device model before
``to_empty``: refused until ``initialize_state``, then bitwise one built after."""

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


@pytest.mark.parametrize("case", _dist_cases.of_kind("block4_uneven_rows"), ids=str)
def test_block4_on_rows_cut_off_torch_chunks(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("block_meta_init"), ids=str)
def test_block_moments_built_on_meta_before_to_empty(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("megatron_block_save"), ids=str)
def test_block_moments_megatron_fully_shard_trains_and_saves(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("megatron_block_resume"), ids=str)
def test_block_moments_megatron_fully_shard_resume_equals_uninterrupted_run(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("torch_path_pieces"), ids=str)
def test_torch_path_in_pieces_equals_the_core_on_shards(case, dist_jobs):
    dist_jobs.check(case)
