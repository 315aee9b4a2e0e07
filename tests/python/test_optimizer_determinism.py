"""Determinism (SEMANTICS S3.7): results are bitwise identical between runs, for any
thread count, and one parameter's update does not depend on which other parameters
share its group or call.

Tensors here are larger than elsewhere (and of sizes that are not multiples of any
vector width or cache line) so that the work is split between threads unevenly.
"""

import pytest
import torch

from _optimizer_testing import (
    Precision, assert_same_optimizer_state, fused_adam, have_core, make_params,
    run_precision_steps, true_state)

CONFIGS = [
    Precision(),
    Precision(param="bf16", exp_avg="fp8", exp_avg_sq="fp16", master="rem"),
    Precision(param="fp16+bf16", grad="fp32", exp_avg="bf16", exp_avg_sq="fp8",
              master="fp16"),
    Precision(param="bf16", exp_avg="bf16", exp_avg_sq="bf16", master="fp32"),
]
pytestmark = pytest.mark.usefixtures("restore_torch_threads")

# Over 32,768 elements of work per thread (work_items.cc) for 3 threads and more.
BIG_SHAPES = [(200_001,), (129, 331), (3,), (0,)]


def run(cfg, threads, shapes=BIG_SHAPES, steps=3, seed=0):
    torch.set_num_threads(threads)
    params = make_params(cfg.param_dtypes(len(shapes)), shapes, seed=seed)
    opt = fused_adam()(params, lr=1e-2, weight_decay=0.1, **cfg.optimizer_kwargs())
    run_precision_steps(opt, params, cfg, None, steps, 1, seed=seed, what="run",
                        check=False)
    return opt, params


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.id for c in CONFIGS])
def test_two_runs_bitwise_equal(cfg, backend):
    a, pa = run(cfg, 2)
    b, pb = run(cfg, 2)
    assert_same_optimizer_state(a, b, pa, pb, f"{cfg.id}: second run")


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.id for c in CONFIGS])
def test_thread_counts_bitwise_equal(cfg, backend):
    a, pa = run(cfg, 1)
    for threads in (2, 3):
        b, pb = run(cfg, threads)
        assert_same_optimizer_state(a, b, pa, pb, f"{cfg.id}: {threads} threads vs 1")


@pytest.mark.parametrize("cfg", CONFIGS[1:3], ids=[c.id for c in CONFIGS[1:3]])
def test_update_independent_of_group_company(cfg, backend):
    """The same parameter stepped alone, or after other parameters in its group, or in
    a group of its own beside others, ends bitwise the same."""
    shapes = [(300,), (7, 11), (1,)]
    results = []
    for layout in ("alone", "shared", "separate"):
        params = make_params(cfg.param_dtypes(3), shapes, seed=1)
        if layout == "alone":
            groups, watched = [dict(params=params[2:])], params[2:]
        elif layout == "shared":
            groups, watched = [dict(params=params)], params[2:]
        else:
            groups, watched = [dict(params=params[:2]), dict(params=params[2:])], params[2:]
        opt = fused_adam()(groups, lr=1e-2, weight_decay=0.1, **cfg.optimizer_kwargs())
        # gradients for all three every time (the same values whatever the layout); the
        # ones of parameters outside this optimizer are simply not read
        run_precision_steps(opt, params, cfg, None, 3, 1, seed=2, what=layout,
                            check=False)
        results.append((opt, watched))
    (base, base_params), *others = results
    for opt, watched in others:
        assert_same_optimizer_state(base, opt, base_params, watched, f"{cfg.id}: company")


@pytest.mark.skipif(not have_core(), reason="the C++ core is not built")
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.id for c in CONFIGS])
def test_callers_flush_denormal_mode_does_not_reach_the_core(cfg):
    """torch.set_flush_denormal(True) sets flush-to-zero on the calling thread only; the
    C++ core computes in the IEEE mode on every thread anyway, so steps whose gradients
    square to subnormals give the same bits with the flag on or off, for any thread
    count. (The pure-torch path keeps subnormals too, test_block_moments_api.py.)"""
    def tiny_run(threads, flush):
        torch.set_num_threads(threads)
        params = make_params(cfg.param_dtypes(len(BIG_SHAPES)), BIG_SHAPES, seed=3)
        # fp32 gradients (S3.4) through decoupled_grad, which takes any dtype
        kwargs = {**cfg.optimizer_kwargs(), "use_decoupled_grad": True}
        opt = fused_adam()(params, lr=1e-2, **kwargs)
        generator = torch.Generator().manual_seed(4)
        for _ in range(2):
            for p in params:
                p.decoupled_grad = torch.randn(p.shape, generator=generator) * 1e-18
            if not torch.set_flush_denormal(flush) and flush:
                pytest.skip("this CPU has no flush-to-zero mode")
            try:
                opt.step()
            finally:
                torch.set_flush_denormal(False)
        return opt, params

    want, want_params = tiny_run(1, False)
    # (1 - beta2) * g * g is ~1e-39: the second moments hold fp32 subnormals
    subnormal = [((v != 0) & (v.abs() < 2.0 ** -126)).sum().item()
                 for v in (true_state(want, p, "exp_avg_sq") for p in want_params)]
    assert sum(subnormal) > 1000, subnormal
    for threads in (1, 2, 3):
        got, got_params = tiny_run(threads, True)
        assert_same_optimizer_state(want, got, want_params, got_params,
                                    f"{cfg.id}: flush-to-zero caller, {threads} threads")


@pytest.mark.parametrize("cfg", CONFIGS[1:2], ids=[c.id for c in CONFIGS[1:2]])
def test_optimizers_stepping_in_two_python_threads_at_once(cfg, backend):
    """The core releases the GIL: two optimizers stepping at the same time from two
    Python threads share its thread pool and get the bits each gets alone."""
    import threading

    def run_steps(results, key, barrier=None):
        if barrier is not None:
            barrier.wait()  # both threads start stepping together
        results[key] = run(cfg, 2, steps=20, seed=key)

    alone = {}
    for key in (1, 2):
        run_steps(alone, key)
    together, barrier = {}, threading.Barrier(2)
    threads = [threading.Thread(target=run_steps, args=(together, key, barrier))
               for key in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for key in (1, 2):
        (a, pa), (b, pb) = alone[key], together[key]
        assert_same_optimizer_state(a, b, pa, pb, f"optimizer {key} in two threads")
