"""pytest fixtures for the shardadam Python tests.

The shared helpers (float64 reference, decoders, snapshots, configurations) live in
_optimizer_testing.py, a module with a name of its own: pytest imports every
conftest.py as the module "conftest", so test files could not import helpers from this
file reliably once another directory (tests/python/distributed) has a conftest too.
"""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# The helper module sits beside the tests; make it importable under any import mode.
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from _optimizer_testing import backend_context  # noqa: E402

# `make test` builds the extension and sets this: a run without it would skip the
# core's own tests, step every other one with torch ops, and still pass.
if os.environ.get("SHARDADAM_REQUIRE_CORE") == "1":
    try:
        import shardadam._C  # noqa: F401
    except ImportError as _error:
        raise pytest.UsageError(f"SHARDADAM_REQUIRE_CORE=1, but shardadam._C does not load "
                                f"({_error}): rebuild the package") from None


@pytest.fixture(params=["auto", "torch"], ids=lambda name: f"backend={name}")
def backend(request):
    """Runs the test on the default path (C++ on CPU when built) and on the forced
    pure-torch path (S7.2)."""
    with backend_context(request.param):
        yield request.param


@pytest.fixture
def restore_torch_threads():
    """For tests that change torch.set_num_threads: put the count back afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
