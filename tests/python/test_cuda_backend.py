"""The CUDA backend: ``shardadam._C.adam_step_cuda`` and FusedAdam on CUDA tensors.

With a GPU: the kernels store exactly the CPU core's bits (params, moments, masters,
scales) for every dtype combination, AdamW and L2, with and without bias correction,
for sizes from 0 to several MiB, for many tensors per call (across the kernel's
tensors-per-launch packing, empty tensors anywhere) and for misaligned views; a call
runs on the stream it is given and nothing in ``step()`` waits for the device;
FusedAdam on CUDA parameters equals FusedAdam on CPU parameters bitwise, also with
per-block scaled moments (``moment_format="block8"``, S2.11) on every parameter / master
option; bad input raises ValueError and writes nothing.

Without a GPU, where the extension has CUDA compiled in: validation is done on the host
(a child process that sees no device still gets the ValueError naming the tensor and
the rule), and the workspace size is sane. On any build: which path steps which batch
(SEMANTICS S7.1, S7.2) and what ``python -m shardadam info`` says.
"""

import json
import os
import random
import re
import subprocess
import sys
import types

import pytest
import torch

from _optimizer_testing import (
    MASTER_FORMATS, MOMENT_FORMATS, SHAPES, Hyper, Precision, assert_bitwise_equal,
    attach_grads, backend_context, decode_codes, fused_adam, make_grads, make_params,
    merge_remainder, state_tensors)
from _slot_buffers import (
    BAD_HYPER, COLUMNS, NAMES_TENSOR_1, NULL_CASES, PRESETS, Buffers, assert_guards_intact,
    bad_slots, embed_buffers, embedded, make_bad_call, preset_id)

_C = pytest.importorskip("shardadam._C", reason="C++ extension shardadam._C is not built")

from shardadam import _backend, _cpu_path, _cuda_path, _slots, _torch_path  # noqa: E402
from shardadam._formats import TAG_NONE  # noqa: E402

INFO = _C.info()
CUDA_BUILT = hasattr(_C, "adam_step_cuda")


def _why_no_gpu():
    if not CUDA_BUILT:
        return ("shardadam._C was built without CUDA (no adam_step_cuda); it is built "
                "with CUDA when nvcc is found")
    if INFO.get("cuda_devices", 0) == 0:
        return "the extension's CUDA runtime sees no device"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


NO_GPU = _why_no_gpu()
needs_cuda_build = pytest.mark.skipif(
    not CUDA_BUILT, reason="shardadam._C was built without CUDA (no adam_step_cuda)")
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=f"needs a CUDA GPU: {NO_GPU}")

DEVICE = torch.device("cuda", 0)
FIELDS = ("param", "grad", "exp_avg", "exp_avg_sq", "master")
# Sizes around the kernel's work split (8192 elements per block today) and one of
# several MiB; the tests do not rely on the block size.
SIZES = (0, 1, 3, 255, 8191, 8192, 8193, 3 * 8192 + 5, 3 * 2 ** 20 + 7)
# Cycles of torch.cuda._sleep that keep a stream busy far longer (about 0.1 s) than
# a call takes to return.
BUSY_CYCLES = 200_000_000


def all_presets():
    """Every valid (param, grad, exp_avg, exp_avg_sq, master) combination of the declared
    formats: 384 (an fp32 parameter has no master, remainders go beside bf16 ones)."""
    floats = ("fp32", "bf16", "fp16")
    for p in floats:
        masters = ["none"] + [master for master in MASTER_FORMATS
                              if p != "fp32" and (master != "rem" or p == "bf16")]
        for g in floats:
            for m in MOMENT_FORMATS:
                for v in MOMENT_FORMATS:
                    for master in masters:
                        yield (p, g, m, v, master)


ALL_PRESETS = list(all_presets())


# --------------------------------------------------------------------------------------
# Calls on raw buffers: a CPU twin through adam_step, the GPU copy through adam_step_cuda


def cpu_step(buffers, hyper, step):
    rows = [value for b in buffers for value in b.row()]
    beta1, beta2 = hyper.betas
    _C.adam_step(rows, hyper.lr, beta1, beta2, hyper.eps, hyper.weight_decay,
                 hyper.adam_w_mode, hyper.bias_correction, step, torch.get_num_threads())


WORKSPACE_GUARD = 256  # bytes after the workspace that must stay untouched


def cuda_step(buffers, hyper, step, stream=None):
    """adam_step_cuda over GPU `buffers` on `stream` (default: the current one) with
    exactly the workspace it asks for, followed by guard bytes. Returns (workspace,
    bytes asked for) for assert_workspace_guard once the stream is done."""
    rows = [value for b in buffers for value in b.row()]
    need = _C.cuda_workspace_bytes(len(buffers))
    workspace = torch.full((need + WORKSPACE_GUARD,), 0xA5, dtype=torch.uint8,
                           device=DEVICE)
    stream = torch.cuda.current_stream(DEVICE) if stream is None else stream
    beta1, beta2 = hyper.betas
    _C.adam_step_cuda(rows, hyper.lr, beta1, beta2, hyper.eps, hyper.weight_decay,
                      hyper.adam_w_mode, hyper.bias_correction, step, workspace.data_ptr(),
                      need, stream.cuda_stream)
    return workspace, need


def assert_workspace_guard(workspace, need):
    assert bool((workspace[need:] == 0xA5).all()), \
        f"adam_step_cuda wrote past the {need} workspace bytes it asked for"


class Twin:
    """One tensor's buffers on the CPU and an identical copy on the GPU, stepped with
    identical gradients."""

    def __init__(self, preset, numel, seed, magnitude=1.0):
        self.preset = preset
        self.cpu = Buffers(preset, numel, seed)
        self.gpu = self.cpu.to(DEVICE)
        self.magnitude = magnitude

    def new_grad(self):
        self.cpu.new_grad(self.magnitude)
        self.gpu.grad = self.cpu.grad.to(DEVICE)

    @property
    def label(self):
        return f"{preset_id(self.preset)} numel {self.cpu.param.numel()}"


def step_twins(twins, hyper, step):
    for twin in twins:
        twin.new_grad()
    cpu_step([t.cpu for t in twins], hyper, step)
    workspace, need = cuda_step([t.gpu for t in twins], hyper, step)
    torch.cuda.synchronize()
    assert_workspace_guard(workspace, need)


def assert_twins_equal(twins, what):
    for i, twin in enumerate(twins):
        for name, on_gpu, on_cpu in zip(twin.cpu.names(), twin.gpu.everything(),
                                        twin.cpu.everything()):
            assert_bitwise_equal(on_gpu.cpu(), on_cpu, f"{what}: tensor {i} ({twin.label}) "
                                                       f"{name}, GPU vs CPU")


HYPER = Hyper(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


# --------------------------------------------------------------------------------------
# The kernels give the CPU core's bits


@needs_gpu
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bias-correction", "none"])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_every_dtype_combination_matches_cpu_bitwise(adam_w_mode, bias_correction):
    """All 384 dtype combinations in one call (mixed presets share launches), with
    gradient magnitudes 1e-2 to 1, over three steps (the scales move)."""
    hyper = Hyper(**{**HYPER.__dict__, "adam_w_mode": adam_w_mode,
                     "bias_correction": bias_correction})
    sizes = (0, 1, 7, 8191, 8193, 20_001)
    twins = [Twin(preset, sizes[i % len(sizes)], 1000 + i, 10.0 ** (i % 3 - 2))
             for i, preset in enumerate(ALL_PRESETS)]
    for step in (1, 2, 3):
        step_twins(twins, hyper, step)
        assert_twins_equal(twins, f"step {step}")


@needs_gpu
@pytest.mark.parametrize("preset", PRESETS, ids=preset_id)
def test_sizes_match_cpu_bitwise(preset):
    twins = [Twin(preset, numel, 50 + i) for i, numel in enumerate(SIZES)]
    for step in (1, 2, 3):
        step_twins(twins, HYPER, step)
        assert_twins_equal(twins, f"step {step}")


def many_tensors(count, seed):
    """`count` tensors of random presets and sizes, with empty ones first, last, at
    random, and at the edges of 32-tensor groups. A launch holds up to 32 tensors of
    one layout, so full launches come only from runs of one compiled layout or of the
    catch-all (counts 33, 100 and 257 have some)."""
    rng = random.Random(seed)
    empty = {0, count - 1, 31, 32, 33, 63, 64} | {i for i in range(count) if rng.random() < 0.1}
    return [Twin(rng.choice(ALL_PRESETS),
                 0 if i in empty else rng.choice((1, 2, 17, 300, 8193, 40_000)),
                 seed * 1000 + i, 10.0 ** rng.randint(-3, 0))
            for i in range(count)]


@needs_gpu
@pytest.mark.parametrize("count", [31, 32, 33, 100, 257])
def test_many_tensors_per_call_match_cpu_bitwise(count):
    twins = many_tensors(count, count)
    for step in (1, 2, 3):
        step_twins(twins, HYPER, step)
        assert_twins_equal(twins, f"{count} tensors, step {step}")


@needs_gpu
@pytest.mark.parametrize("shape", ["all-empty", "one-non-empty-last"])
def test_calls_of_mostly_empty_tensors(shape):
    """Empty scaled states get scale 1 (S2.3) even in a launch with no element."""
    presets = [PRESETS[19], PRESETS[13], PRESETS[0]] * 34
    twins = [Twin(preset, 0, 300 + i) for i, preset in enumerate(presets)]
    if shape == "one-non-empty-last":
        twins.append(Twin(PRESETS[19], 5000, 299))
    for twin in twins:
        for scale in list(twin.cpu.scales.values()) + list(twin.gpu.scales.values()):
            scale.fill_(4.0)
    for step in (1, 2):
        step_twins(twins, HYPER, step)
        assert_twins_equal(twins, f"{shape}, step {step}")


@needs_gpu
@pytest.mark.parametrize("offset", [1, 3])
@pytest.mark.parametrize("preset", [PRESETS[0], PRESETS[7], PRESETS[10], PRESETS[13],
                                    PRESETS[19]], ids=preset_id)
def test_misaligned_views_match_cpu_and_stay_in_bounds(preset, offset):
    """Views `offset` elements past GUARD (37) sentinels in larger buffers, of lengths
    that leave every kind of tail: the CPU core's bits, nothing written outside them.
    At offset 1 (38 elements in) no buffer is aligned to four elements, so every
    element goes alone; at 3 (40 in) all are, and the presets the kernels are compiled
    for (the first two here) take four elements per access up to the tail."""
    numels = (1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 257, 1031, 8193)
    twins = [Twin(preset, n, 70 + i) for i, n in enumerate(numels)]
    guarded = [g for twin in twins for g in embed_buffers(twin.gpu, offset)]
    for step in (1, 2, 3):
        for twin in twins:
            twin.new_grad()
            twin.gpu.grad, whole = embedded(twin.gpu.grad, offset)
            guarded.append(("grad", whole, offset + twin.gpu.grad.numel()))
        cpu_step([t.cpu for t in twins], HYPER, step)
        workspace, need = cuda_step([t.gpu for t in twins], HYPER, step)
        torch.cuda.synchronize()
        assert_workspace_guard(workspace, need)
        assert_guards_intact(guarded, f"step {step}")
        assert_twins_equal(twins, f"offset {offset}, step {step}")


def nan_aware_fields(b):
    """(name, stored tensor, NaN mask) of each buffer of `b`, on the CPU. A remainder
    is NaN where the fp32 master it holds with its param is (the param is then NaN
    itself: S2.5 splits a NaN master as the quiet NaN, whatever its payload)."""
    fields = {name: getattr(b, name).cpu() for name in FIELDS if getattr(b, name) is not None}
    masks = {name: decode_codes(t).isnan() for name, t in fields.items()}
    if b.formats["master"] == "rem":
        masks["master"] = merge_remainder(fields["param"], fields["master"]).isnan()
    return [(name, fields[name], masks[name]) for name in fields]


@needs_gpu
@pytest.mark.parametrize("preset", [PRESETS[0], PRESETS[6], PRESETS[7], PRESETS[10],
                                    PRESETS[13], PRESETS[19]], ids=preset_id)
def test_non_finite_gradients_match_cpu(preset):
    """The non-finite policy on the GPU: the same elements become NaN/Inf and every
    other element and every scale is bitwise the CPU core's. NaN signs and payloads may
    differ (x86 propagates an operand's, CUDA returns its canonical NaN: S7.1), so a
    -NaN gradient is among them."""
    twins = [Twin(preset, n, 90 + i) for i, n in enumerate((1, 100, 8193, 40_000))]
    for step in (1, 2):
        for i, twin in enumerate(twins):
            twin.new_grad()
            grad = twin.cpu.grad.float()
            grad.view(-1)[::7] = (float("nan"), float("inf"), -float("inf"),
                                  -float("nan"))[(i + step) % 4]
            twin.cpu.grad = grad.to(twin.cpu.grad.dtype)
            twin.gpu.grad = twin.cpu.grad.to(DEVICE)
        cpu_step([t.cpu for t in twins], HYPER, step)
        workspace, need = cuda_step([t.gpu for t in twins], HYPER, step)
        torch.cuda.synchronize()
        for i, twin in enumerate(twins):
            what = f"step {step} tensor {i} ({twin.label})"
            for (name, on_gpu, gpu_nan), (_, on_cpu, cpu_nan) in zip(
                    nan_aware_fields(twin.gpu), nan_aware_fields(twin.cpu)):
                assert torch.equal(gpu_nan, cpu_nan), f"{what}: {name} NaN positions differ"
                assert_bitwise_equal(on_gpu[~gpu_nan], on_cpu[~cpu_nan], f"{what}: {name}")
            for key in twin.cpu.scales:
                assert_bitwise_equal(twin.gpu.scales[key].cpu(), twin.cpu.scales[key],
                                     f"{what}: {key} scale")


# --------------------------------------------------------------------------------------
# Streams: launched where asked, never waited for


def busy_stream_supported():
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not available in this torch")


def load_kernels(stream):
    """Runs once what a timed section runs (sleep, copy, fill, both step kernels, the
    scale kernel): CUDA loads a kernel lazily at its first launch, and loading may
    wait for the device, which the section must not mistake for the call waiting."""
    twins = [Twin(PRESETS[0], 5, 1), Twin(PRESETS[19], 5, 2)]
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1000)
        for twin in twins:
            twin.new_grad()
            twin.gpu.grad.copy_(twin.gpu.grad.clone())
        cuda_step([t.gpu for t in twins], HYPER, 1, stream=stream)
    torch.cuda.synchronize()


@needs_gpu
def test_runs_on_the_given_stream_without_waiting():
    """A long sleep is queued on a side stream, then the new gradients are written on
    that stream behind it, then the step is called for that stream. Right after the
    call returns the stream must still be busy (nothing waited for the device), and
    the results must be those of the new gradients: kernels on any other stream would
    have run at once, on the old ones."""
    busy_stream_supported()
    twins = [Twin(preset, numel, 110 + i)
             for i, (preset, numel) in enumerate(zip(PRESETS, (5, 8193, 100_000) * 7))]
    staged = []
    for twin in twins:
        twin.cpu.new_grad()
        staged.append(twin.cpu.grad.to(DEVICE))
    side = torch.cuda.Stream(DEVICE)
    load_kernels(side)
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_CYCLES)
        for twin, grad in zip(twins, staged):
            twin.gpu.grad.copy_(grad)
        workspace, need = cuda_step([t.gpu for t in twins], HYPER, 1, stream=side)
        still_busy = not side.query()
    assert still_busy, "the side stream was idle when adam_step_cuda returned: the " \
                       "call (or the test's own setup) waited for the device"
    cpu_step([t.cpu for t in twins], HYPER, 1)
    torch.cuda.synchronize()
    assert_workspace_guard(workspace, need)
    assert_twins_equal(twins, "on a side stream")


# --------------------------------------------------------------------------------------
# FusedAdam on CUDA parameters

OPTIMIZER_PRESETS = [
    Precision(),
    Precision(param="bf16", exp_avg="fp32", exp_avg_sq="fp32", master="fp32"),
    Precision(param="bf16", exp_avg="bf16", exp_avg_sq="bf16", master="fp32"),
    Precision(param="bf16", exp_avg="bf16", exp_avg_sq="bf16", master="rem"),
    Precision(param="bf16", exp_avg="fp8", exp_avg_sq="fp8", master="fp32"),
    Precision(param="fp16+bf16", grad="fp32", exp_avg="fp16", exp_avg_sq="fp8",
              master="fp16"),
]
OPTIMIZER_SHAPES = SHAPES + [(257, 129), (8193,), (3, 0, 5), (33, 64)]
TRANSPOSED = len(OPTIMIZER_SHAPES) - 1  # this parameter is a non-contiguous view


@pytest.fixture
def cuda_path_only(monkeypatch):
    """Fails the test if a CUDA batch reaches the torch path (the CUDA backend must
    have stepped it)."""
    original = _torch_path.step

    def guarded(work, hyper):
        assert not work.batch.is_cuda, "a CUDA batch took the torch path"
        original(work, hyper)

    monkeypatch.setattr(_torch_path, "step", guarded)


def optimizer_params(cfg, device, seed=7):
    params = make_params(cfg.param_dtypes(len(OPTIMIZER_SHAPES)), OPTIMIZER_SHAPES, seed)
    params = [torch.nn.Parameter(p.detach().to(device, copy=True)) for p in params]
    # Not dense (every other column): stepped through a contiguous copy that is written
    # back (_slots.Call.finish). Dense strided parameters: test_memory_order.py.
    last = params[TRANSPOSED].detach()
    params[TRANSPOSED] = torch.nn.Parameter(torch.stack((last, torch.zeros_like(last)),
                                                        dim=-1)[..., 0])
    return params


def step_grads(cfg, params, step, seed=8):
    """The step's gradients, on the CPU, for parameters shaped like `params`: the first
    one non-contiguous (read through a contiguous copy), the second None at step 3
    (skipped, S3.2)."""
    grads = make_grads(params, [cfg.grad_dtype(p.dtype) for p in params], step, seed)
    grads[0] = grads[0].t().contiguous().t()  # SHAPES[0] is 2-D
    if step == 3:
        grads[1] = None
    return grads


def on_device(grads, device):
    return [None if g is None else g.to(device, copy=True) for g in grads]


def assert_optimizers_equal(opt_gpu, opt_cpu, params_gpu, params_cpu, what):
    for i, (p, q) in enumerate(zip(params_gpu, params_cpu)):
        assert_bitwise_equal(p.detach().cpu(), q.detach(), f"{what}: param {i}")
        on_gpu, on_cpu = state_tensors(opt_gpu, p), state_tensors(opt_cpu, q)
        assert sorted(on_gpu) == sorted(on_cpu), f"{what}: param {i} state names"
        for key in on_cpu:
            assert on_gpu[key].device == p.device, f"{what}: param {i} {key} not on GPU"
            assert_bitwise_equal(on_gpu[key].cpu(), on_cpu[key], f"{what}: param {i} {key}")
    for i, (a, b) in enumerate(zip(opt_gpu.param_groups, opt_cpu.param_groups)):
        assert a["step"] == b["step"], f"{what}: group {i} step"


@needs_gpu
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("cfg", OPTIMIZER_PRESETS, ids=lambda c: c.id)
def test_fused_adam_on_cuda_equals_fused_adam_on_cpu(cfg, adam_w_mode, cuda_path_only):
    hyper = Hyper(**{**HYPER.__dict__, "adam_w_mode": adam_w_mode})
    FusedAdam = fused_adam()
    runs = {}
    for device in ("cpu", DEVICE):
        params = optimizer_params(cfg, device)
        runs[device] = (FusedAdam(params, **hyper.optimizer_kwargs(),
                                  **cfg.optimizer_kwargs()), params)
    (opt_gpu, params_gpu), (opt_cpu, params_cpu) = runs[DEVICE], runs["cpu"]
    assert_optimizers_equal(opt_gpu, opt_cpu, params_gpu, params_cpu, f"{cfg.id}: initial")
    for step in range(1, 6):
        grads = step_grads(cfg, params_cpu, step)
        attach_grads(params_cpu, grads, cfg.decoupled)
        attach_grads(params_gpu, on_device(grads, DEVICE), cfg.decoupled)
        opt_cpu.step()
        opt_gpu.step()
        torch.cuda.synchronize()
        assert_optimizers_equal(opt_gpu, opt_cpu, params_gpu, params_cpu,
                                f"{cfg.id}: after step {step}")


@needs_gpu
@pytest.mark.parametrize("cfg", [OPTIMIZER_PRESETS[0], OPTIMIZER_PRESETS[3],
                                 OPTIMIZER_PRESETS[5]], ids=lambda c: c.id)
def test_optimizer_step_never_waits_for_the_device(cfg, cuda_path_only):
    """No host synchronisation anywhere in step(): torch's sync debug mode raises on
    any torch-level sync (``.item()``, a copy to the host, a stream sync), and a step
    queued behind a long sleep must return while the stream is still busy (which also
    covers synchronisation inside the extension, which torch cannot see)."""
    busy_stream_supported()
    params = optimizer_params(cfg, DEVICE)
    opt = fused_adam()(params, **HYPER.optimizer_kwargs(), **cfg.optimizer_kwargs())
    cpu_shapes = [p.detach().cpu() for p in params]
    grads = [on_device(step_grads(cfg, cpu_shapes, step), DEVICE) for step in (1, 2, 3)]
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        # The first step also builds and binds the plan; both load every kernel the
        # third one launches (CUDA loads kernels lazily, which may wait for the device).
        for step_grads_ in grads[:2]:
            attach_grads(params, step_grads_, cfg.decoupled)
            opt.step()
        attach_grads(params, grads[2], cfg.decoupled)
        torch.cuda._sleep(BUSY_CYCLES)
        opt.step()
        still_busy = not torch.cuda.current_stream(DEVICE).query()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert still_busy, "optimizer.step() returned only after the device was idle"
    torch.cuda.synchronize()


@needs_gpu
def test_a_step_captured_into_a_cuda_graph_is_refused(cuda_path_only):
    """capturable=True is not supported, so a step under CUDA graph capture is refused
    before anything is queued: replayed, it would repeat one step's counter, bias
    corrections and random keys (torch's optimizers refuse it likewise)."""
    cfg = OPTIMIZER_PRESETS[0]
    params = optimizer_params(cfg, DEVICE)
    opt = fused_adam()(params, **HYPER.optimizer_kwargs(), **cfg.optimizer_kwargs())
    cpu_shapes = [p.detach().cpu() for p in params]
    attach_grads(params, on_device(step_grads(cfg, cpu_shapes, 1), DEVICE), cfg.decoupled)
    opt.step()  # the plan built and bound outside the capture
    torch.cuda.synchronize()
    before = [p.detach().clone() for p in params]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"captured into a CUDA graph.*capturable=True"):
        with torch.cuda.graph(graph):
            opt.step()
    torch.cuda.synchronize()
    for p, old in zip(params, before):
        assert_bitwise_equal(p.detach(), old, "param after a refused capture")
    assert [g["step"] for g in opt.param_groups] == [1] * len(opt.param_groups)


def test_a_cpu_step_does_not_ask_about_cuda_graph_capture(monkeypatch):
    """The capture check runs only for a plan with CUDA tensors: a CPU step never
    calls into CUDA for it."""
    def asked():
        raise AssertionError("a CPU step asked whether a CUDA graph is being captured")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", asked)
    param = torch.nn.Parameter(torch.randn(8))
    param.grad = torch.ones(8)
    fused_adam()([param], lr=1e-3).step()


# Per-block scaled moments (S2.9, S2.10): parameter dtype and FusedAdam options.
BLOCK8_OPTIONS = {
    "fp32": (torch.float32, {}),
    "bf16-master": (torch.bfloat16, dict(master_weights=True)),
    "bf16-remainder": (torch.bfloat16, dict(master_weights=True,
                                            store_param_remainders=True)),
    "fp16-master": (torch.float16, dict(master_weights=True)),
    # No master: the parameter rounded stochastically (S2.14), the same bits on both.
    "bf16-stochastic": (torch.bfloat16, dict(param_rounding="stochastic")),
}


def block8_grads(params, step, seed=3):
    """CPU gradients whose magnitudes change every 100 elements (so neighbouring blocks
    get different scales) and zero stretches. Finite: NaN payloads differ between the
    CPU and the GPU (test_non_finite_gradients_match_cpu); the C++ GPU test steps
    non-finite blocks (tests/cpp/cuda/adam_cuda_test.cc)."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    grads = []
    for p in params:
        n = p.numel()
        exponents = -(torch.arange(n) // 100 % 14).float() * 3
        g = torch.randn(n, generator=gen) * torch.pow(2.0, exponents)
        g[(torch.arange(n) // 300) % 5 == 2] = 0.0
        grads.append(g.view(p.shape).to(p.dtype))
    return grads


@needs_gpu
@pytest.mark.parametrize("family", ["block8", "block4"])
@pytest.mark.parametrize("block", [128, 4096])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("option", list(BLOCK8_OPTIONS))
def test_block_moments_on_cuda_equal_the_cpu_core(option, adam_w_mode, block, family,
                                                  cuda_path_only):
    """The CUDA kernels store the CPU core's codes, block scales, parameters and masters
    bitwise, step after step (block sizes at both ends, partial and empty blocks, a
    non-contiguous parameter); block4 packs the 2-D parameters with an even last
    dimension and gives the others block8's codes."""
    dtype, extra = BLOCK8_OPTIONS[option]
    hyper = Hyper(**{**HYPER.__dict__, "adam_w_mode": adam_w_mode})
    runs = {}
    for device in ("cpu", DEVICE):
        params = make_params([dtype] * len(OPTIMIZER_SHAPES), OPTIMIZER_SHAPES, 5)
        params = [torch.nn.Parameter(p.detach().to(device, copy=True)) for p in params]
        last = params[TRANSPOSED].detach()
        params[TRANSPOSED] = torch.nn.Parameter(last.t().contiguous().t())
        runs[device] = (fused_adam()(params, **hyper.optimizer_kwargs(), **extra,
                                     moment_format=family, moment_block_size=block),
                        params)
    (opt_gpu, params_gpu), (opt_cpu, params_cpu) = runs[DEVICE], runs["cpu"]
    stored = {opt_gpu._formats[p]["exp_avg"].name for p in params_gpu if p.numel()}
    assert ("fp4-block" in stored) == (family == "block4"), stored
    for step in range(1, 6):
        grads = block8_grads(params_cpu, step)
        attach_grads(params_cpu, grads, False)
        attach_grads(params_gpu, on_device(grads, DEVICE), False)
        opt_cpu.step()
        opt_gpu.step()
        torch.cuda.synchronize()
        assert_optimizers_equal(opt_gpu, opt_cpu, params_gpu, params_cpu,
                                f"{family} {option}, block {block}: after step {step}")


@needs_gpu
def test_block8_step_never_waits_for_the_device(cuda_path_only):
    busy_stream_supported()
    dtype, extra = BLOCK8_OPTIONS["bf16-remainder"]
    params = [torch.nn.Parameter(torch.randn(s).to(dtype).to(DEVICE))
              for s in OPTIMIZER_SHAPES]
    opt = fused_adam()(params, **HYPER.optimizer_kwargs(), **extra, moment_format="block8")
    grads = [on_device(block8_grads([p.cpu() for p in params], step), DEVICE)
             for step in (1, 2)]
    attach_grads(params, grads[0], False)
    opt.step()  # builds the plan and loads the kernels
    attach_grads(params, grads[1], False)
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    opt.step()
    assert not torch.cuda.current_stream(DEVICE).query(), \
        "optimizer.step() returned only after the device was idle"
    torch.cuda.synchronize()


# S1.2: an lr in a CUDA tensor. Per step, as a scheduler on the device sets it (0 is a
# real step, S3.8).
LR_VALUES = (3e-3, 1.7e-3, 0.0, 2.2e-3)


@needs_gpu
@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("option", ["fp8", "fp16-master", "block8", "block4"])
def test_lr_in_a_cuda_tensor_is_read_on_the_device(option, lr_dtype, cuda_path_only):
    """Every kernel kind reads it there (fp8 moments: the store kernel; an fp16 master:
    the measuring kernel too, its scale follows the new weights; block8 / block4: the
    per-block kernel): the CPU core's bits for the same values given as floats, and no
    step after the first (which builds the plan and reads lr and the block scales on the
    host) waits: torch's sync debug mode raises on any sync, and the last step returns
    while the stream is busy. Set in place at every step, and at step 3 replaced by a new
    tensor, as a scheduler may do either."""
    busy_stream_supported()
    cfg = OPTIMIZER_PRESETS[5 if option == "fp16-master" else 4]
    kwargs, decoupled = cfg.optimizer_kwargs(), cfg.decoupled
    if option.startswith("block"):
        kwargs = dict(BLOCK8_OPTIONS["bf16-remainder"][1], moment_format=option)
        decoupled = False
    device_lr = torch.tensor(LR_VALUES[0], dtype=lr_dtype, device=DEVICE)
    runs = {}
    for device, lr in ((DEVICE, device_lr), ("cpu", float(device_lr))):
        params = optimizer_params(cfg, device)
        runs[device] = (fused_adam()(params, **{**HYPER.optimizer_kwargs(), "lr": lr},
                                     **kwargs), params)
    (opt_gpu, params_gpu), (opt_cpu, params_cpu) = runs[DEVICE], runs["cpu"]
    previous = torch.cuda.get_sync_debug_mode()
    for step, value in enumerate(LR_VALUES, 1):
        grads = (block8_grads(params_cpu, step) if option.startswith("block")
                 else step_grads(cfg, params_cpu, step))
        attach_grads(params_cpu, grads, decoupled)
        attach_grads(params_gpu, on_device(grads, DEVICE), decoupled)
        opt_cpu.param_groups[0]["lr"] = float(torch.tensor(value, dtype=lr_dtype))
        opt_cpu.step()
        if step == 3:
            device_lr = torch.tensor(value, dtype=lr_dtype, device=DEVICE)
            opt_gpu.param_groups[0]["lr"] = device_lr
        torch.cuda.synchronize()
        if step > 1:
            torch.cuda.set_sync_debug_mode("error")
        try:
            device_lr.fill_(value)
            if step == len(LR_VALUES):
                torch.cuda._sleep(BUSY_CYCLES)
            opt_gpu.step()
            still_busy = not torch.cuda.current_stream(DEVICE).query()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()
        assert opt_gpu.param_groups[0]["lr"] is device_lr
        assert_optimizers_equal(opt_gpu, opt_cpu, params_gpu, params_cpu,
                                f"{option}, {lr_dtype} lr: after step {step}")
    assert still_busy, "optimizer.step() returned only after the device was idle"


@needs_gpu
def test_lr_in_a_cuda_tensor_beside_cpu_parameters_is_read_and_checked():
    """A group that also steps CPU parameters needs lr's value on the host: read there
    (a sync) and checked like any lr, so a negative one is refused before anything is
    written; a CUDA lr of several elements is refused without reading it."""
    params = [torch.nn.Parameter(torch.randn(33, 5)),
              torch.nn.Parameter(torch.randn(40, device=DEVICE))]
    device_lr = torch.tensor(2e-3, device=DEVICE)
    runs = []
    for lr in (device_lr, float(device_lr)):
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        runs.append((fused_adam()(copies, **{**HYPER.optimizer_kwargs(), "lr": lr}), copies))
    (opt_t, params_t), (opt_f, params_f) = runs
    for step in (1, 2):
        grads = [torch.randn_like(p) for p in params]
        attach_grads(params_t, grads, False)
        attach_grads(params_f, [g.clone() for g in grads], False)
        opt_t.step()
        opt_f.step()
    torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(params_t, params_f)):
        assert_bitwise_equal(p.detach().cpu(), q.detach().cpu(), f"mixed devices: param {i}")
        tensor_lr, float_lr = state_tensors(opt_t, p), state_tensors(opt_f, q)
        assert sorted(tensor_lr) == sorted(float_lr)
        for key in float_lr:
            assert_bitwise_equal(tensor_lr[key].cpu(), float_lr[key].cpu(),
                                 f"mixed devices: param {i} {key}")
    before = [p.detach().clone() for p in params_t]
    states = [{k: v.clone() for k, v in state_tensors(opt_t, p).items()} for p in params_t]
    for bad in (torch.tensor(-1e-3, device=DEVICE), torch.full((2,), 1e-3, device=DEVICE)):
        opt_t.param_groups[0]["lr"] = bad
        with pytest.raises(ValueError, match="Invalid learning rate"):
            opt_t.step()
        for i, p in enumerate(params_t):
            assert_bitwise_equal(p.detach(), before[i], f"param {i} after a refused step")
            for key, value in state_tensors(opt_t, p).items():
                assert_bitwise_equal(value, states[i][key], f"param {i} {key}")
        assert opt_t.param_groups[0]["step"] == 2


@needs_gpu
def test_a_sparse_cuda_lr_is_read_on_the_host():
    """A one-element sparse CUDA lr has no storage the kernels could read: it is read on
    the host at every step (a sync), with the float lr's bits, never passed by address
    (which raised mid-step, after other batches had stepped)."""
    sparse = torch.sparse_coo_tensor([[0]], [2e-3], (1,), device=DEVICE)
    runs = []
    # The float: the fp32 value the tensor holds, as the host reads it.
    for lr in (sparse, float(torch.tensor(2e-3))):
        params = [torch.nn.Parameter(torch.full((37,), 0.5, device=DEVICE))]
        runs.append((fused_adam()(params, **{**HYPER.optimizer_kwargs(), "lr": lr}), params))
    for step in (1, 2, 3):
        grad = torch.randn(37, device=DEVICE)
        for opt, params in runs:
            params[0].grad = grad.clone()
            opt.step()
    (_, got), (_, want) = runs
    assert_bitwise_equal(got[0].detach().cpu(), want[0].detach().cpu(), "sparse lr")


@needs_gpu
def test_use_backend_torch_keeps_cuda_tensors_off_the_extension(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("use_backend('torch') reached the CUDA backend")

    monkeypatch.setattr(_cuda_path, "prepare", refuse)
    monkeypatch.setattr(_cuda_path, "run", refuse)
    cfg = OPTIMIZER_PRESETS[2]
    params = optimizer_params(cfg, DEVICE)
    before = [p.detach().clone() for p in params]
    opt = fused_adam()(params, **HYPER.optimizer_kwargs(), **cfg.optimizer_kwargs())
    attach_grads(params, on_device(step_grads(cfg, [b.cpu() for b in before], 1), DEVICE),
                 cfg.decoupled)
    with backend_context("torch"):
        opt.step()
    assert any(not torch.equal(p.detach(), b) for p, b in zip(params, before))


@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_parameters_on_a_device_that_is_not_current(cuda_path_only):
    """The backend makes the batch's device current for the call."""
    cfg = OPTIMIZER_PRESETS[4]
    other = torch.device("cuda", 1)
    runs = {}
    for device in ("cpu", other):
        params = optimizer_params(cfg, device)
        runs[device] = (fused_adam()(params, **HYPER.optimizer_kwargs(),
                                     **cfg.optimizer_kwargs()), params)
    with torch.cuda.device(0):
        for step in (1, 2):
            grads = step_grads(cfg, runs["cpu"][1], step)
            attach_grads(runs["cpu"][1], grads, cfg.decoupled)
            attach_grads(runs[other][1], on_device(grads, other), cfg.decoupled)
            runs["cpu"][0].step()
            runs[other][0].step()
    torch.cuda.synchronize(other)
    assert_optimizers_equal(runs[other][0], runs["cpu"][0], runs[other][1], runs["cpu"][1],
                            "cuda:1 vs cpu")


# --------------------------------------------------------------------------------------
# Bad input on the GPU: ValueError, nothing written


def assert_call_rejected(buffers, rows, pattern, **changes):
    before = [t.clone() for b in buffers for t in b.everything()]
    need = _C.cuda_workspace_bytes(len(rows) // COLUMNS)
    workspace = torch.zeros(max(need, 1), dtype=torch.uint8, device=DEVICE)
    args = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                adam_w_mode=True, bias_correction=True, step=1,
                workspace=workspace.data_ptr(), workspace_bytes=need,
                stream=torch.cuda.current_stream(DEVICE).cuda_stream)
    args.update(changes)
    torch.cuda.synchronize()
    with pytest.raises(ValueError) as raised:
        _C.adam_step_cuda(rows, **args)
    torch.cuda.synchronize()
    message = str(raised.value)
    assert re.search(pattern, message, flags=re.IGNORECASE), message
    after = [t for b in buffers for t in b.everything()]
    for i, (a, b) in enumerate(zip(after, before)):
        assert_bitwise_equal(a, b, f"buffer {i} after a rejected adam_step_cuda")
    assert bool((workspace == 0).all()), "the workspace was written by a rejected call"
    return message


@needs_gpu
@pytest.mark.parametrize("case", bad_slots(), ids=[c[0] for c in bad_slots()])
def test_bad_slot_on_the_gpu_raises_and_writes_nothing(case):
    _, preset, overrides, pattern = case
    good, bad, rows = make_bad_call(preset, overrides, device=DEVICE)
    message = assert_call_rejected((good, bad), rows, pattern)
    assert re.search(NAMES_TENSOR_1, message), message


@needs_gpu
@pytest.mark.parametrize("case", BAD_HYPER, ids=[c[0] for c in BAD_HYPER])
def test_bad_hyper_parameter_on_the_gpu_raises_and_writes_nothing(case):
    _, change, pattern = case
    good = Buffers(("bf16", "bf16", "fp8", "fp16", "rem"), 40, 23)
    good.new_grad()
    good = good.to(DEVICE)
    assert_call_rejected((good,), good.row(), pattern, **change)


@needs_gpu
@pytest.mark.parametrize("case", ["null", "too-small"])
def test_bad_workspace_on_the_gpu_raises_and_writes_nothing(case):
    good = Buffers(PRESETS[19], 40, 24)
    good.new_grad()
    good = good.to(DEVICE)
    need = _C.cuda_workspace_bytes(1)
    changes = {"workspace": 0} if case == "null" else {"workspace_bytes": need - 1}
    assert_call_rejected((good,), good.row(), r"workspace", **changes)


# --------------------------------------------------------------------------------------
# Without a device: validation is host-side, the workspace size is sane


@needs_cuda_build
def test_workspace_bytes_is_sane():
    sizes = [_C.cuda_workspace_bytes(n) for n in range(0, 300)]
    assert all(isinstance(s, int) and s >= 0 for s in sizes), sizes[:10]
    assert all(a <= b for a, b in zip(sizes, sizes[1:])), "not monotone in the count"
    assert _C.cuda_workspace_bytes(100_000) <= 1024 * 100_000, "over 1 KiB per tensor"


# The child sees no CUDA device (CUDA_VISIBLE_DEVICES is empty) and loads the extension
# file directly. It is handed slot rows built in the parent: their pointers mean
# nothing in the child, so any access to them, on the host or a device, would crash or
# fail differently from the ValueError each call must raise.
_NO_DEVICE_SCRIPT = r"""
import importlib.machinery, importlib.util, json, sys
loader = importlib.machinery.ExtensionFileLoader("_C", sys.argv[1])
module = importlib.util.module_from_spec(importlib.util.spec_from_loader("_C", loader))
loader.exec_module(module)
results = {"devices": module.info()["cuda_devices"]}
for case_id, rows, args in json.load(sys.stdin):
    try:
        module.adam_step_cuda(rows, **args)
        results[case_id] = {"raised": None}
    except Exception as e:
        results[case_id] = {"raised": type(e).__name__, "message": str(e)}
print(json.dumps(results))
"""

_FAKE = 1 << 40  # a non-null address that is nobody's memory


def _host_cases():
    """(id, rows, argument changes, expected exception, message patterns)."""
    cases = []
    for case_id, preset, overrides, pattern in bad_slots():
        _, _, rows = make_bad_call(preset, overrides)
        cases.append((f"slot:{case_id}", rows, {}, "ValueError", [pattern, NAMES_TENSOR_1]))
    fp32 = Buffers(PRESETS[0], 16, 25).row()
    for case_id, change, pattern in BAD_HYPER:
        cases.append((f"hyper:{case_id}", fp32, change, "ValueError", [pattern]))
    for case_id, column in NULL_CASES.items():
        # numel, then param, grad, exp_avg (+ scale), exp_avg_sq (+ scale) fp32; the
        # columns after them 0.
        row = [16, _FAKE, 1, _FAKE, 1, _FAKE, 1, 0, _FAKE, 1, 0]
        row += [0] * (COLUMNS - len(row))
        if column == 11:
            row[2], row[12] = 3, 1  # bf16 param, fp32 master
        row[column] = 0
        cases.append((f"null:{case_id}", row, {}, "ValueError", [r"null|missing|absent"]))
    cases.append(("slots-not-a-multiple-of-the-columns", fp32 + [1], {}, "ValueError",
                  [rf"not a multiple of {COLUMNS}\b"]))
    cases.append(("workspace-null", fp32, {"workspace": 0}, "ValueError", [r"workspace"]))
    cases.append(("workspace-too-small", fp32,
                  {"workspace_bytes": _C.cuda_workspace_bytes(1) - 1}, "ValueError",
                  [r"workspace"]))
    cases.append(("lr-in-device-memory-misaligned", fp32,
                  {"lr_in_device_memory": _FAKE + 4}, "ValueError",
                  [r"lr_in_device_memory.*not aligned to 8 bytes"]))
    # Valid input gets past validation and is refused by the runtime: no device.
    cases.append(("valid-without-a-device", fp32, {}, "RuntimeError", [r"."]))
    # With lr in device memory, the host lr is not used, so not checked.
    cases.append(("lr-in-device-memory-with-a-bad-host-lr", fp32,
                  {"lr": float("nan"), "lr_in_device_memory": _FAKE + 4096}, "RuntimeError",
                  [r"."]))
    # The workspace is written while every kernel reads the lr.
    cases.append(("lr-in-device-memory-in-the-workspace", fp32,
                  {"lr_in_device_memory": _FAKE}, "ValueError",
                  [r"lr_in_device_memory lies in the workspace"]))
    return cases


@pytest.fixture(scope="module")
def no_device_results():
    cases = _host_cases()
    payload = []
    for case_id, rows, change, _, _ in cases:
        args = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                    adam_w_mode=True, bias_correction=True, step=1, workspace=_FAKE,
                    workspace_bytes=_C.cuda_workspace_bytes(max(len(rows) // COLUMNS, 1)),
                    stream=0)
        args.update(change)
        payload.append((case_id, rows, args))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", _NO_DEVICE_SCRIPT, _C.__file__],
                          input=json.dumps(payload), capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, f"child crashed (rc {done.returncode}): {done.stderr[-2000:]}"
    results = json.loads(done.stdout.strip().splitlines()[-1])
    if results["devices"] != 0:
        pytest.skip("the child still sees a CUDA device with CUDA_VISIBLE_DEVICES empty")
    return results


@needs_cuda_build
@pytest.mark.parametrize("case", _host_cases() if CUDA_BUILT else [],
                         ids=lambda case: case[0])
def test_rejected_on_the_host_without_a_device(case, no_device_results):
    case_id, _, _, expected, patterns = case
    result = no_device_results[case_id]
    assert result["raised"] == expected, result
    for pattern in patterns:
        assert re.search(pattern, result["message"], flags=re.IGNORECASE), result


def _fp32_row_at(address, numel=1000, param_dtype=None, param_offset=0):
    """One slot row at fake addresses (nothing reads them: the checks below only
    validate): fp32 moments, no scales, a param of ``param_dtype`` (fp32 by default)
    ``param_offset`` bytes past its buffer's start."""
    param_dtype = _C.DTYPE_FLOAT32 if param_dtype is None else param_dtype
    values = dict(numel=numel, param=address + param_offset, param_dtype=param_dtype,
                  grad=address + (1 << 20), grad_dtype=param_dtype,
                  exp_avg=address + (2 << 20), exp_avg_dtype=_C.DTYPE_FLOAT32,
                  exp_avg_sq=address + (3 << 20), exp_avg_sq_dtype=_C.DTYPE_FLOAT32)
    row = [0] * COLUMNS
    for name, value in values.items():
        row[_slots._COLUMN[name]] = value
    row[_slots._COLUMN["master_dtype"]] = TAG_NONE
    return row


@needs_cuda_build
def test_a_step_of_several_cuda_calls_checks_the_cuda_rules_before_any_runs():
    """S3.1: the calls of one step are checked together before the first runs, with
    the CUDA backend's own rules (here: a bf16 param at an odd address, which the
    kernels would fault on) as well as the core's, so a refusal by a later call's rules
    comes before an earlier call has updated anything. The core's rules alone accept
    these rows; the step's check for a CUDA device refuses them, naming the tensor."""
    rows = (_fp32_row_at(_FAKE)
            + _fp32_row_at(_FAKE + (16 << 20), param_dtype=_C.DTYPE_BFLOAT16, param_offset=1))
    _C.check_step_slots(rows, True)  # the core's rules pass
    with pytest.raises(ValueError, match=r"tensor 1: param is not aligned"):
        _backend._check_slots(torch.device("cuda", 0), rows)
    _backend._check_slots(torch.device("cpu"), rows)  # the CPU core reads them unaligned


# --------------------------------------------------------------------------------------
# Which path steps a batch (S7.1, S7.2), on any build


ROUTES = [
    # (batch device, backend mode, C++ CPU available, CUDA backend available, path);
    # "+block": the batch holds per-block scaled moments in formats the CUDA kernels
    # step; "+uncoded": one in a per-block format they have no codec for.
    ("cpu", "auto", True, True, "cpu"),
    ("cpu+block", "auto", True, True, "cpu"),
    ("cpu+uncoded", "auto", True, True, "cpu"),
    ("cuda+block", "auto", True, True, "cuda"),
    ("cuda+uncoded", "auto", True, True, "torch"),
    ("cuda+block", "auto", True, False, "torch"),
    ("cuda+block", "torch", True, True, "torch"),
    ("cpu", "auto", False, True, "torch"),
    ("cpu", "torch", True, True, "torch"),
    ("cuda", "auto", True, True, "cuda"),
    ("cuda", "auto", True, False, "torch"),
    ("cuda", "torch", True, True, "torch"),
    ("meta", "auto", True, True, "torch"),
    ("xpu", "auto", True, True, "torch"),
]


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: "-".join(map(str, r)))
def test_backend_choice(route, monkeypatch):
    device, mode, cpu_ok, cuda_ok, expected = route
    device, _, block = device.partition("+")
    monkeypatch.setattr(_cpu_path, "available", lambda: cpu_ok)
    monkeypatch.setattr(_cuda_path, "available", lambda device: cuda_ok)
    monkeypatch.setattr(_cuda_path, "stepped_tags", lambda: frozenset({1, 6, 7}))
    fp32, fp8_block, ufp8_block = (types.SimpleNamespace(tag=t) for t in (1, 6, 7))
    uncoded = types.SimpleNamespace(tag=99)  # a per-block format without a CUDA codec
    entries = [types.SimpleNamespace(scale_block=0, exp_avg_format=fp32,
                                     exp_avg_sq_format=fp32)]
    if block:
        entries.append(types.SimpleNamespace(
            scale_block=256, exp_avg_format=fp8_block,
            exp_avg_sq_format=ufp8_block if block == "block" else uncoded))
    batch = types.SimpleNamespace(device=torch.device(device), is_cpu=device == "cpu",
                                  is_cuda=device == "cuda", entries=entries,
                                  backend_cache={})
    with backend_context(mode):
        path = _backend.path_of(batch)
    assert path is {"cpu": _cpu_path, "cuda": _cuda_path, "torch": None}[expected]


def test_cuda_format_support_is_decided_once_per_plan(monkeypatch):
    """steps_formats asks the extension's list once and keeps the answer in the
    batch's cache, which a rebuilt plan starts without."""
    asked = []
    monkeypatch.setattr(_cuda_path, "stepped_tags",
                        lambda: asked.append(1) or frozenset({6, 7}))
    entry = types.SimpleNamespace(scale_block=128,
                                  exp_avg_format=types.SimpleNamespace(tag=6),
                                  exp_avg_sq_format=types.SimpleNamespace(tag=7))
    batch = types.SimpleNamespace(entries=[entry], backend_cache={})
    assert _cuda_path.steps_formats(batch) and _cuda_path.steps_formats(batch)
    assert len(asked) == 1
    entry.exp_avg_sq_format = types.SimpleNamespace(tag=99)
    assert not _cuda_path.steps_formats(types.SimpleNamespace(entries=[entry],
                                                              backend_cache={}))


@needs_cuda_build
def test_extension_lists_the_formats_its_cuda_kernels_step():
    """Every format that is not per-block scaled, and block8's and block4's two each
    (S2.11)."""
    from shardadam import _formats

    expected = {f.tag for f in _formats.FORMATS if f.scale != "block"}
    expected |= {_formats.by_name(name).tag
                 for name in ("fp8-block", "ufp8-block", "fp4-block", "ufp4-block")}
    assert expected <= set(INFO["cuda_formats"])
    assert _cuda_path.stepped_tags() == frozenset(INFO["cuda_formats"])


def test_cuda_backend_available_only_with_a_build_and_a_device(monkeypatch):
    monkeypatch.setattr(_cuda_path, "_usable", {})
    expected = (CUDA_BUILT and INFO.get("cuda_devices", 0) > 0
                and _C.cuda_kernels_run_on(0))
    assert _cuda_path.available(torch.device("cuda", 0)) == expected


def test_info_command_reports_the_cuda_backend(capsys):
    from shardadam.__main__ import main

    assert main(["info"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("CUDA backend:")]
    assert len(lines) == 1, lines
    line = lines[0]
    if not INFO.get("cuda"):
        assert "not compiled" in line, line
    else:
        assert INFO["cuda_archs"] in line, line
        if INFO["cuda_devices"] == 0:
            assert "no device" in line, line
        else:
            assert f"{INFO['cuda_devices']} device" in line, line


@needs_gpu
def test_gpu_benchmark_metadata_names_the_step_backend():
    """benchmarks/cuda_bench.py's report header (run only by the GPU check)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "cuda_bench.py")
    spec = importlib.util.spec_from_file_location("cuda_bench", path)
    cuda_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cuda_bench)
    info = cuda_bench.meta(torch.device("cuda", 0))
    expected = ("cuda (C++)" if _cuda_path.available(torch.device("cuda", 0))
                else "torch ops (the CUDA backend is not available)")
    assert info["step_backend"] == expected
    assert info["gpu"] == torch.cuda.get_device_properties(0).name
