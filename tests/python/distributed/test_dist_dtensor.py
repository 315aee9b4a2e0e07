"""FusedAdam on hand-built DTensors, real gloo processes at world sizes 2, 3 and 4.

Each test is one case of the job of its world size (see conftest.py and _dist_jobs.py):

* numerics: parameters with dim-0 sizes {1, W-1, W, W+1, 7} (empty shards on some ranks),
  1-D and 2-D, Shard(0) / Shard(1) / Replicate and a 2x2 mesh (Replicate, Shard(0)) at
  W=4, five state presets, three steps: full_tensor() of parameters, state_dict() values
  and raw state equals the same optimizer on full plain tensors (bitwise; fp16/fp8
  states within one rounding at the per-shard scale), each rank's shards equal a plain
  FusedAdam on them (bitwise), every state is laid out like its parameter (S2.6);
* empty shards whose gradient is None (S3.5, S2.8);
* no collective inside step() (S3.3);
* layout errors rejected, naming parameter and layouts, nothing changed (S3.1, S3.3, S1.4);
* Transformer Engine's state methods on DTensor parameters (S5.1 - S5.3).
"""

import pytest

import _dist_cases


def _params(*kinds):
    return pytest.mark.parametrize("case", _dist_cases.of_kind(*kinds), ids=str)


@_params("numerics")
def test_matches_full_tensor_run(case, dist_jobs):
    dist_jobs.check(case)


@_params("empty_shard_none_grads")
def test_empty_shards_without_gradient(case, dist_jobs):
    dist_jobs.check(case)


@_params("zero_collectives")
def test_step_issues_no_collective(case, dist_jobs):
    dist_jobs.check(case)


@_params("layout_error")
def test_bad_layout_rejected_and_nothing_changes(case, dist_jobs):
    dist_jobs.check(case)


@_params("state_access")
def test_te_state_methods_on_dtensor_parameters(case, dist_jobs):
    dist_jobs.check(case)


@_params("tensor_parallel")
def test_tensor_parallel_gradients_redistributed_by_the_caller(case, dist_jobs):
    dist_jobs.check(case)
