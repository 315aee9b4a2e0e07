"""Where the C++ core's workers run (docs/semantics.md S3.7, shardadam/adam.h
SetThreadRuntime): on the OpenMP runtime torch has loaded, found at run time, else on
the core's own pool. Results are bitwise the same on either, for any thread count;
a forked child, where that runtime's threads do not exist, steps on the pool."""

import hashlib
import os
import signal
import sys

import pytest
import torch

from _optimizer_testing import (
    Precision, assert_same_optimizer_state, fused_adam, have_core,
    make_params, run_precision_steps)

pytestmark = [pytest.mark.skipif(not have_core(), reason="the C++ core is not built"),
              pytest.mark.usefixtures("restore_torch_threads")]

# Large enough that every thread of a team gets work (the core wakes a thread per
# 32,768 elements), of sizes that split unevenly.
SHAPES = [(200_003,), (129, 1031), (3,)]
CONFIGS = [
    Precision(),
    Precision(param="bf16", exp_avg="bf16", exp_avg_sq="bf16", master="rem"),
    Precision(param="bf16", exp_avg="fp8", exp_avg_sq="fp16", master="fp32"),
]


@pytest.fixture
def core():
    from shardadam import _C

    yield _C
    _C.set_thread_runtime("auto")


def torch_uses_openmp() -> bool:
    return sys.platform.startswith("linux") and \
        "OpenMP" in torch.__config__.parallel_info()


def run(cfg, threads, steps=3):
    torch.set_num_threads(threads)
    params = make_params(cfg.param_dtypes(len(SHAPES)), SHAPES, seed=5)
    opt = fused_adam()(params, lr=1e-2, weight_decay=0.1, **cfg.optimizer_kwargs())
    run_precision_steps(opt, params, cfg, None, steps, 1, seed=5, what="run", check=False)
    return opt, params


def digest(params) -> str:
    """A hash of the params' bytes."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.skipif(not torch_uses_openmp(), reason="torch here has no OpenMP runtime")
def test_info_names_torchs_openmp_runtime(core):
    torch.mm(torch.ones(64, 64), torch.ones(64, 64))
    name = core.info()["thread_runtime"]
    assert name.startswith("openmp:"), name
    assert "omp" in os.path.basename(name), name
    core.set_thread_runtime("pool")
    assert core.info()["thread_runtime"] == "pool"


def test_info_command_names_the_workers(core, capsys):
    from shardadam.__main__ import main

    for setting in ("auto", "pool"):
        core.set_thread_runtime(setting)
        assert main(["info"]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines()
                 if line.startswith("workers:")]
        runtime = core.info()["thread_runtime"]
        assert len(lines) == 1, lines
        expected = ("own pool" if runtime == "pool" else
                    f"OpenMP runtime, {runtime[len('openmp:'):]}")
        assert expected in lines[0], (setting, lines[0])


def test_unknown_runtime_is_refused(core):
    with pytest.raises(ValueError, match=r'runtime must be "auto" or "pool", got "omp"'):
        core.set_thread_runtime("omp")
    core.set_thread_runtime("pool")
    with pytest.raises(ValueError):
        core.set_thread_runtime("")
    assert core.info()["thread_runtime"] == "pool", "a refused name changed the setting"


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.id for c in CONFIGS])
def test_runtime_does_not_change_a_bit(cfg, core):
    core.set_thread_runtime("pool")
    a, pa = run(cfg, 1)
    core.set_thread_runtime("auto")
    for threads in (2, 3):
        b, pb = run(cfg, threads)
        assert_same_optimizer_state(a, b, pa, pb, f"{cfg.id}: auto, {threads} threads")
    core.set_thread_runtime("pool")
    c, pc = run(cfg, 3)
    assert_same_optimizer_state(a, c, pa, pc, f"{cfg.id}: pool, 3 threads")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_forked_child_steps_on_the_pool(core):
    """After the parent's OpenMP threads have run torch's work and steps, a forked
    child's step runs on the core's pool (libgomp's threads are not forked: torch's own
    parallel ops would wait for them forever there, so the child runs none) and gives
    the parent's bits."""
    cfg = CONFIGS[1]
    torch.mm(torch.ones(256, 256), torch.ones(256, 256))
    opt, params = run(cfg, 2)  # its last gradients stay for one more step
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        status = 1
        try:
            os.close(read)
            signal.alarm(120)  # a hang ends the child; the parent sees no report
            on_pool = core.info()["thread_runtime"] == "pool"
            opt.step()
            os.write(write, f"{int(on_pool)} {digest(params)}".encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    opt.step()  # the same step in the parent, on its OpenMP runtime where torch has one
    assert (core.info()["thread_runtime"] != "pool") == torch_uses_openmp()
    assert report == f"1 {digest(params)}", "the child stepped off the pool or to other bits"
