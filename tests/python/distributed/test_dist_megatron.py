"""FusedAdam on Megatron FSDP's shards (docs/semantics.md S2.6, S3.3, S3.5, S2.8).

Megatron FSDP packs parameters into one flat buffer per rank, whole rows of any length per
rank, empty shards and ranks that own nothing (``_megatron_layout``), on 1-D, replicated,
HSDP and HFSDP meshes. Every state preset steps there exactly as one process over the full
tensors does, in place in the flat buffer.
"""

import pytest

import _dist_cases


@pytest.mark.parametrize("case", _dist_cases.of_kind("megatron_layout"), ids=str)
def test_megatron_layout_matches_full_tensor_run(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("megatron_fsdp_save"), ids=str)
def test_megatron_fsdp_optimizer_code_trains_and_saves(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("megatron_fsdp_resume"), ids=str)
def test_megatron_fsdp_checkpoint_resumes_at_another_world_size(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("megatron_handling"), ids=str)
def test_outside_state_keys_and_regrouping(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("state_layout_mismatch"), ids=str)
def test_dcp_checkpoint_of_another_master_layout(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("megatron_real_save"), ids=str)
def test_megatron_fully_shard_trains_like_one_process(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("megatron_real_resume"), ids=str)
def test_megatron_fully_shard_checkpoint_resumes_bitwise(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("megatron_error"), ids=str)
def test_megatron_layout_errors(case, dist_jobs):
    dist_jobs.check(case)
