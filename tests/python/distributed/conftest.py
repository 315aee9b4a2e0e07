"""pytest side of the distributed suite: one job per world size, run on first use.

Tests are parametrized by ``_dist_cases.Case``; the first test of a job (a world size, or
a named job at that size) starts it with every *selected* case of it (``-k`` narrows the
job too), plus the cases in other jobs that they read from (checkpoints), run first.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# The helper modules sit beside the tests; make them importable under any import mode.
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _dist_cases  # noqa: E402
import _launch  # noqa: E402

# Rough cost of one case on a 2-core machine, in seconds, by kind; the job deadline is a
# multiple of the sum, so a hung rank fails the job instead of stalling CI.
_CASE_COST_S = {"numerics": 2.0, "empty_shard_none_grads": 1.5, "zero_collectives": 1.5,
                "layout_error": 1.0, "fsdp2": 4.0, "fresh_get_state_dict": 2.0,
                "dcp_save": 2.0, "dcp_resume": 3.0, "fsdp2_dcp_save": 4.0,
                "fsdp2_dcp_resume": 4.0, "fsdp2_frozen_dcp": 4.0,
                "fsdp2_step0_save": 3.0, "fsdp2_step0_resume": 4.0,
                "fsdp2_built_before_sharding": 4.0, "fsdp2_torch_adamw_dcp": 5.0,
                "state_access": 1.5, "tensor_parallel": 2.0,
                "megatron_layout": 2.0, "megatron_fsdp_save": 4.0,
                "megatron_fsdp_resume": 4.0, "megatron_handling": 3.0,
                "state_layout_mismatch": 3.0, "megatron_real_save": 6.0,
                "megatron_real_resume": 6.0, "megatron_error": 2.0,
                "block8_dcp_save": 3.0, "block8_dcp_resume": 4.0,
                "block8_mesh_rule": 1.5, "megatron_block_save": 6.0,
                "megatron_block_resume": 6.0, "block4_uneven_rows": 1.5,
                "torch_path_pieces": 2.0, "zero_redundancy": 2.0, "block_meta_init": 1.5}
_STARTUP_S = 30.0
_DEADLINE_FACTOR = 3.0


class JobRunner:
    """Starts each world size's job once, lazily, and answers per-case verdicts."""

    def __init__(self, session, root):
        self._session = session
        self._root = root
        self._results = {}
        self._selected = None

    def _selected_ids(self):
        if self._selected is None:
            ids = set()
            for item in self._session.items:
                callspec = getattr(item, "callspec", None)
                case = callspec.params.get("case") if callspec else None
                if isinstance(case, _dist_cases.Case):
                    ids.add(case.id)
            # Close over dependencies (a resharding load needs its save).
            todo = list(ids)
            while todo:
                for need in _dist_cases.BY_ID[todo.pop()].needs:
                    if need not in ids:
                        ids.add(need)
                        todo.append(need)
            self._selected = ids
        return self._selected

    def result(self, world_size, job=""):
        """The outcome of the job that runs the selected cases of ``(world_size, job)``."""
        key = (world_size, job)
        if key in self._results:
            return self._results[key]
        selected = self._selected_ids()
        cases = [c for c in _dist_cases.CASES
                 if (c.world_size, c.job) == key and c.id in selected]
        # Jobs that produce what this one reads run first.
        for case in cases:
            for need in case.needs:
                producer = _dist_cases.BY_ID[need]
                if (producer.world_size, producer.job) != key:
                    self.result(producer.world_size, producer.job)
        timeout = _STARTUP_S + _DEADLINE_FACTOR * sum(_CASE_COST_S[c.kind] for c in cases)
        workdir = os.path.join(self._root, f"job-W{world_size}" + (f"-{job}" if job else ""))
        self._results[key] = _launch.launch(
            "_dist_jobs:run", world_size, workdir, timeout_s=timeout,
            params={"cases": [c.id for c in cases], "shared_dir": self._root})
        return self._results[key]

    def check(self, case):
        failure = self.result(case.world_size, case.job).case_failure(case.id)
        if failure:
            pytest.fail(failure, pytrace=False)


@pytest.fixture(scope="session")
def dist_jobs(request, tmp_path_factory):
    return JobRunner(request.session, str(tmp_path_factory.mktemp("dist")))
