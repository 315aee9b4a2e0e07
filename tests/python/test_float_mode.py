"""A caller's flush-to-zero mode (``torch.set_flush_denormal(True)``) changes no bit the
optimizer makes (S3.7, docs/guarantees.md): the C++ core steps in IEEE mode on its own
threads (float_mode.h), and every torch op the package runs on CPU state (the torch
path's step, state converted at a step, masters seeded from their parameter,
``state_dict``, ``load_state_dict``, ``get_unscaled_state``, ``set_scaled_state``) keeps
subnormals too (_float_mode), on torch's worker threads as well; the caller's mode and
thread count are theirs again after. Each case is run in IEEE mode and under the
caller's flush-to-zero and compared bit for bit; values are read through their integer
bits (under flush-to-zero a subnormal read as a float is 0)."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from _optimizer_testing import (
    assert_bitwise_equal, assert_same_optimizer_state, backend_context, have_core)
from shardadam import FusedAdam

BACKENDS = ["auto", "torch"]
TINY = 1e-39  # an fp32 subnormal


def _flushes() -> bool:
    """Whether this thread's CPU float ops flush subnormals, seen through the bits."""
    bits = torch.full((1,), 8, dtype=torch.int32).view(torch.float32)
    return int(bits.mul(1.0).view(torch.int32)) == 0


@contextlib.contextmanager
def flush_to_zero():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        yield
        assert _flushes(), "the caller's flush-to-zero mode is theirs again"
    finally:
        torch.set_flush_denormal(False)


def _moments_with_subnormals(shape):
    v = torch.zeros(shape)
    v.view(-1)[::7] = TINY
    v.view(-1)[1] = 3 * TINY
    return v


# Each case builds an optimizer, runs `act` (what may be under flush-to-zero) and returns
# the optimizer, its params and the tensors `act` handed out.
def _set_state(kwargs):
    p = torch.nn.Parameter(torch.zeros(4, 64))
    opt = FusedAdam([p], **kwargs)
    v = _moments_with_subnormals(p.shape)  # made here: act() may flush what it makes
    m = -v

    def act():
        opt.set_scaled_state(p, "exp_avg_sq", v)
        opt.set_scaled_state(p, "exp_avg", m)
        return []
    return opt, [p], act


def _read_state(kwargs):
    opt, params, set_state = _set_state(kwargs)
    set_state()
    p = params[0]

    def act():
        exported = opt.state_dict()["state"][0]
        return [opt.get_unscaled_state(p, "exp_avg_sq"), exported["exp_avg_sq"],
                exported["exp_avg"]]
    return opt, params, act


def _load_state(kwargs):
    source, _, set_state = _set_state(kwargs)
    set_state()
    saved = source.state_dict()
    p = torch.nn.Parameter(torch.zeros(4, 64))
    opt = FusedAdam([p], **kwargs)

    def act():
        opt.load_state_dict(saved)
        return []
    return opt, [p], act


def _convert_at_step(kwargs):
    """fp32 state holding subnormals, stored in `kwargs`' format from the next step."""
    p = torch.nn.Parameter(torch.full((4, 64), TINY))
    opt = FusedAdam([p], lr=1e-3, eps=1e-30)
    opt.set_scaled_state(p, "exp_avg_sq", _moments_with_subnormals(p.shape))
    for name, value in kwargs.items():
        setattr(opt, name, value)
    p.grad = torch.full_like(p, TINY)

    def act():
        opt.step()
        return []
    return opt, [p], act


def _seed_master(kwargs):
    """A first step of lr 0 leaves a subnormal bf16 weight as it is (its fp16 master is
    seeded from it)."""
    p = torch.nn.Parameter(torch.full((4, 64), -TINY).to(torch.bfloat16))
    opt = FusedAdam([p], lr=0.0, weight_decay=0.0, master_weights=True,
                    master_weight_dtype=torch.float16)
    p.grad = torch.zeros_like(p)

    def act():
        opt.step()
        return []
    return opt, [p], act


FORMATS = {
    "block8": dict(moment_format="block8"),
    "block4": dict(moment_format="block4"),
    "fp16": dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16),
    "fp8": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
}
CASES = [(case, fmt) for case in (_set_state, _read_state, _load_state, _convert_at_step)
         for fmt in FORMATS] + [(_seed_master, None)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case,fmt", CASES,
                         ids=[f"{c.__name__[1:]}-{f}" if f else c.__name__[1:]
                              for c, f in CASES])
def test_state_is_made_and_read_as_in_ieee_mode(case, fmt, backend):
    if backend == "auto" and not have_core():
        pytest.skip("C++ extension not built")
    kwargs = FORMATS.get(fmt, {})
    runs = {}
    for mode in ("ieee", "flush"):
        opt, params, act = case(kwargs)
        with backend_context(backend), (flush_to_zero() if mode == "flush"
                                        else contextlib.nullcontext()):
            handed_out = act()
        runs[mode] = opt, params, handed_out
    (ieee, p, out), (flushed, q, out_flushed) = runs["ieee"], runs["flush"]
    assert_same_optimizer_state(ieee, flushed, p, q, f"{backend}: flush-to-zero vs IEEE")
    for i, (a, b) in enumerate(zip(out, out_flushed)):
        assert_bitwise_equal(b, a, f"{backend}: tensor {i} handed out")
    if case is _seed_master:
        assert bool((q[0].detach().view(torch.int16) != 0).all()), "the weights kept"
    if case is _set_state and fmt.startswith("block"):  # zero-free (S2.10, S2.12)
        codes = flushed.state[q[0]]["exp_avg_sq"].view(-1)
        assert int(codes[0]) != 0


def test_each_path_steps_as_in_ieee_mode():
    """The C++ core and the torch path step a block8 layout whose moments and weights
    go subnormal with the same bits under the caller's flush-to-zero as without, and
    the two paths agree."""
    if not have_core():
        pytest.skip("C++ extension not built")

    def run(backend):
        with backend_context(backend):
            p = torch.nn.Parameter(torch.full((300,), 1e-30))
            opt = FusedAdam([p], lr=1e-3, eps=1e-30, moment_format="block8")
            p.grad = torch.full((300,), 1e-21)
            opt.step()
            return opt, p

    ieee = {backend: run(backend) for backend in BACKENDS}
    with flush_to_zero():
        flushed = {backend: run(backend) for backend in BACKENDS}
    for backend, (opt, p) in flushed.items():
        assert_same_optimizer_state(ieee[backend][0], opt, [ieee[backend][1]], [p],
                                    f"backend={backend}: flush-to-zero on vs off")
    (core, p), (torch_path, q) = flushed["auto"], flushed["torch"]
    assert_same_optimizer_state(core, torch_path, [p], [q], "core vs torch path under FTZ")
    assert bool((p.detach() != 0).all())  # subnormal arithmetic kept the weights


# torch's OpenMP workers keep the mode of the thread that started them: the caller
# flushed before torch's first parallel op, so its workers flush too.
_WORKERS_SCRIPT = r"""
import torch
from shardadam import FusedAdam
from shardadam._backend import use_backend

torch.set_num_threads(2)
if not torch.set_flush_denormal(True):
    print("SKIP: this CPU cannot flush subnormals"); raise SystemExit(0)
n = 1 << 17  # two of torch's grains: both threads take part
subnormal = torch.full((n,), 8 << 10, dtype=torch.int32).view(torch.float32)

def flushed_on_workers():
    torch.set_flush_denormal(False)
    lost = int(subnormal.mul(1.0).view(torch.int32).eq(0).sum())
    torch.set_flush_denormal(True)
    return lost

if not flushed_on_workers():
    print("SKIP: torch's workers here do not take the caller's mode"); raise SystemExit(0)

def run(backend):
    p = torch.nn.Parameter(subnormal.clone())
    opt = FusedAdam([p], lr=1e-3, eps=1e-30, weight_decay=0.0,
                    exp_avg_dtype=torch.float16)  # its fp32 values are subnormal
    p.grad = subnormal.clone()
    with use_backend(backend):
        opt.step()
        opt.step()
    sd = opt.state_dict()["state"][0]
    return [p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"],
            opt.get_unscaled_state(p, "exp_avg"), sd["exp_avg"]]

core, torch_path = run("auto"), run("torch")
for i, (a, b) in enumerate(zip(core, torch_path)):
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"tensor {i} differs"
assert int(core[1].view(torch.int16).eq(0).sum()) == 0, "the core kept the moments"
assert int(core[3].view(torch.int32).eq(0).sum()) == 0, "get_unscaled_state kept them"
assert int(core[4].view(torch.int32).eq(0).sum()) == 0, "the export kept them"
assert torch.get_num_threads() == 2, "the caller's thread count is theirs again"
assert flushed_on_workers(), "the workers still flush"
print("OK")
"""


def test_torch_workers_that_flush_do_not_change_the_bits():
    if not have_core():
        pytest.skip("C++ extension not built")
    env = dict(os.environ, OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, "-c", _WORKERS_SCRIPT], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    if done.stdout.startswith("SKIP"):
        pytest.skip(done.stdout.strip())
    assert done.stdout.strip() == "OK", done.stdout + done.stderr


@pytest.mark.parametrize("mode", ["ieee", "flush"])
def test_a_default_device_context_does_not_reach_the_probe(mode):
    """Under ``with torch.device("meta")`` (where models are built for meta init) an
    optimizer of CPU parameters is made, read and written as elsewhere: the mode is
    probed on CPU tensors, which a default device does not change."""
    p = torch.nn.Parameter(torch.full((4, 64), TINY))
    v = _moments_with_subnormals(p.shape)
    ieee = FusedAdam([torch.nn.Parameter(p.detach().clone())], moment_format="block8")
    ieee.set_scaled_state(ieee.param_groups[0]["params"][0], "exp_avg_sq", v)
    with (flush_to_zero() if mode == "flush" else contextlib.nullcontext()), \
            torch.device("meta"):
        opt = FusedAdam([p], moment_format="block8")
        opt.set_scaled_state(p, "exp_avg_sq", v)
        exported = opt.state_dict()["state"][0]["exp_avg_sq"]
    assert exported.device.type == "cpu"
    assert_same_optimizer_state(ieee, opt, ieee.param_groups[0]["params"], [p],
                                f"{mode}: under a meta default device")
    assert_bitwise_equal(exported, ieee.state_dict()["state"][0]["exp_avg_sq"], "export")


def test_an_optimizer_is_made_under_fake_tensor_mode():
    """The mode is probed on real tensors under a caller's dispatch mode: an optimizer
    over fake parameters (memory estimates, dry runs) gets fake state, as before the
    probe existed, in either mode."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    for mode in ("ieee", "flush"):
        with (flush_to_zero() if mode == "flush" else contextlib.nullcontext()), \
                FakeTensorMode():
            p = torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16))
            opt = FusedAdam([p], master_weights=True)
        assert all(isinstance(v, FakeTensor) for v in opt.state[p].values()), mode


def test_an_interrupt_while_switching_gives_the_mode_and_threads_back(monkeypatch):
    """Ctrl-C at the workers' probe (the longest part of the switch) or inside the
    section leaves the caller's flush mode and thread count as they were."""
    from shardadam import _float_mode

    probe = _float_mode._flushes

    def interrupted_wide_probe(numel):
        if numel > 1:
            raise KeyboardInterrupt
        return probe(numel)

    threads = torch.get_num_threads()
    with flush_to_zero():
        with monkeypatch.context() as patch:
            patch.setattr(_float_mode, "_flushes", interrupted_wide_probe)
            if threads == 1:
                patch.setattr(torch, "get_num_threads", lambda: 2)
            with pytest.raises(KeyboardInterrupt):
                with _float_mode.kept():
                    pass
        assert _flushes()
        with pytest.raises(KeyboardInterrupt):
            with _float_mode.kept():
                assert not _flushes()
                raise KeyboardInterrupt
    assert torch.get_num_threads() == threads
