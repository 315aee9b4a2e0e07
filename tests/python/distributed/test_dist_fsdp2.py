"""FusedAdam under FSDP2 (``fully_shard``) on a CPU gloo mesh, world sizes 2, 3 and 4.

A small transformer-like model trains a few steps; after every step each rank's parameters
and states equal a plain-tensor FusedAdam fed the same sharded gradients (bitwise), the
update lands in FSDP2's own storage (local data pointers unchanged), step() issues no
collective, and the fp32 run agrees with torch.optim.AdamW. The reference is deliberately
not an unsharded model: it would test gloo's gradient reduction rather than the optimizer.

Also: model and optimizer saved with DCP at world size 2 and loaded into a fresh FSDP2
model at 3 (uneven and empty shards), then trained on; and a DCP round trip with a frozen
parameter, whose state torch's helpers leave out of the checkpoint; a checkpoint taken
before the first step, resharded, then pretrained weights loaded (the masters still follow
them); and an optimizer built
over the whole model and then handed the sharded parameters (as accelerate's FSDP2
``prepare`` does), which steps as one built over the shards and drops the whole state.
"""

import pytest

import _dist_cases


@pytest.mark.parametrize("case", _dist_cases.of_kind("fsdp2"), ids=str)
def test_fsdp2_matches_plain_optimizer_on_shards(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("fsdp2_dcp_resume"), ids=str)
def test_fsdp2_checkpoint_reloads_at_another_world_size(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("fsdp2_dcp_save"), ids=str)
def test_fsdp2_checkpoint_save(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("fsdp2_step0_save"), ids=str)
def test_fsdp2_checkpoint_save_before_the_first_step(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("fsdp2_step0_resume"), ids=str)
def test_fsdp2_step_0_checkpoint_resharded_keeps_masters_following(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("fsdp2_frozen_dcp"), ids=str)
def test_fsdp2_checkpoint_with_a_frozen_parameter(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("fsdp2_torch_adamw_dcp"), ids=str)
def test_fsdp2_torch_adamw_checkpoint(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("zero_redundancy"), ids=str)
def test_zero_redundancy_optimizer_over_fused_adam(case, dist_jobs):
    dist_jobs.check(case)


@pytest.mark.parametrize("case", _dist_cases.of_kind("fsdp2_built_before_sharding"), ids=str)
def test_optimizer_built_before_sharding_drops_the_whole_state(case, dist_jobs):
    dist_jobs.check(case)
