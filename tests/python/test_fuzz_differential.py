"""Differential fuzzing of FusedAdam: random configurations against the float64
reference of _optimizer_testing.py, and the C++ path against the forced torch path.

One *case* is one independently built optimizer: a random precision preset (parameter,
gradient, moment and master dtypes, S2.1/S2.2, S3.4), one to three param groups with
their own hyper-parameters (lr including 0, betas, eps, weight decay), adam_w_mode and
bias_correction, parameters of random shapes (0-dim, empty and odd sizes), and one to
three steps of gradients drawn from a pattern per parameter (normal, zeros, huge, tiny,
subnormal, a spread over many decades, or None = skipped, S3.2). Every step of the
default path is checked with verify_step() (teacher forcing from the decoded stored
state, bounds derived in _optimizer_testing.py); the same case is then replayed on the
torch path (S7.2) and must agree bit for bit, state, scales and step counts included.

Gradient magnitudes stay where the fp32 step is finite (|g|**2 far below the fp32
maximum); non-finite gradients are the subject of test_nonfinite_policy.py. Some steps
still leave what the float64 reference can judge: an fp16 parameter whose exact update
exceeds the fp16 range (small moments flushed to zero by a scaled storage, divided by
a small eps), or a denominator within its rounding error of zero. When a step fails
the reference check and is such a step (out_of_domain()), the case's later steps are
only compared across the two paths, and NaNs there need only be NaN in both: the paths
do not agree on NaN signs and payloads (see test_nonfinite_policy.py). Any other
failure fails the test.

Each hypothesis example runs CASES_PER_EXAMPLE cases, so a CI run checks
MAX_EXAMPLES * CASES_PER_EXAMPLE cases; SHARDADAM_FUZZ_EXAMPLES=k multiplies the
number of examples by k for longer runs. The profile is derandomized: CI runs the same
examples every time.
"""

import dataclasses
import os
import random

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from _optimizer_testing import (
    Hyper, Precision, adam_reference, assert_bitwise_equal, assert_same_optimizer_state,
    attach_grads, backend_context, capture_inputs, fused_adam, have_core, state_tensors,
    verify_step)

CASES_PER_EXAMPLE = 4
MAX_EXAMPLES = max(1, round(2500 * float(os.environ.get("SHARDADAM_FUZZ_EXAMPLES", "1"))))

PARAM_PRESETS = ("fp32", "fp16", "bf16", "fp16+bf16")
GRAD_PRESETS = ("same", "fp32", "fp16", "bf16")
MOMENT_PRESETS = ("fp32", "bf16", "fp16", "fp8")
MASTER_PRESETS = ("none", "fp32", "fp16", "rem")
PATTERNS = ("normal", "zeros", "huge", "tiny", "subnormal", "spread", "none")

# Per gradient dtype: magnitudes of the "huge", "tiny" and "subnormal" patterns. Huge
# keeps (1 - beta2) * g**2 finite in fp32 (and g finite in fp16); subnormal lies below
# the dtype's smallest normal number.
MAGNITUDES = {
    torch.float32: {"huge": 1e15, "tiny": 1e-30, "subnormal": 1e-40},
    torch.bfloat16: {"huge": 1e15, "tiny": 1e-30, "subnormal": 1e-40},
    torch.float16: {"huge": 3e4, "tiny": 1e-4, "subnormal": 2e-6},
}


@dataclasses.dataclass
class Case:
    cfg: Precision
    adam_w_mode: bool
    bias_correction: bool
    groups: list  # [(Hyper, [param index, ...])]
    params: list  # initial values, in the parameter dtypes
    grads: list  # per step, per param: a tensor or None

    def hyper(self, group):
        return dataclasses.replace(self.groups[group][0], adam_w_mode=self.adam_w_mode,
                                   bias_correction=self.bias_correction)


def make_grad(pattern, shape, dtype, generator):
    if pattern == "none":
        return None
    if pattern == "zeros":
        return torch.zeros(shape, dtype=dtype)
    values = torch.randn(shape, generator=generator)
    if pattern == "normal":
        scale = 10.0 ** float(torch.randint(-4, 3, (), generator=generator))
        return (values * scale).to(dtype)
    if pattern == "spread":
        # many decades within one tensor: stresses one scale for all elements (S2.3)
        low, high = (-6, 4) if dtype == torch.float16 else (-30, 12)
        exponents = torch.randint(low, high, shape, generator=generator)
        return (values.double() * 10.0 ** exponents.double()).to(dtype)
    return (values.double() * MAGNITUDES[dtype][pattern]).to(dtype)


def pick(rng, fixed, low, high):
    """One of the notable values `fixed` or, half the time, uniform in [low, high]."""
    return rng.choice(fixed) if rng.random() < 0.5 else rng.uniform(low, high)


def build_case(cfg, adam_w_mode, bias_correction, seed):
    """The rest of a case (groups, hyper-parameters, shapes, gradients) from `seed`:
    hypothesis draws the discrete configuration, a seeded generator the bulk, which
    keeps an example cheap enough for thousands of cases per run."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    shapes = [tuple(rng.randint(0, 37) for _ in range(rng.randint(0, 2)))
              for _ in range(rng.randint(1, 4))]
    dtypes = cfg.param_dtypes(len(shapes))
    group_count = rng.choice((1, 1, 2, 3))  # several groups, not always (cost)
    owners = [rng.randrange(group_count) for _ in shapes]
    groups = []
    for g in range(group_count):
        hyper = Hyper(lr=pick(rng, [0.0, 1e-3, 1e-2, 0.1], 0.0, 0.5),
                      betas=(pick(rng, [0.0, 0.5, 0.9, 0.999], 0.0, 0.999),
                             pick(rng, [0.0, 0.9, 0.999, 0.9999], 0.0, 0.9999)),
                      eps=pick(rng, [1e-8, 1e-6, 1e-12, 1e-3], 1e-12, 1e-2),
                      weight_decay=pick(rng, [0.0, 0.01, 0.1], 0.0, 1.0))
        groups.append((hyper, [i for i, owner in enumerate(owners) if owner == g]))
    params = [(torch.randn(shape, generator=generator) * (0.1 + 2 * i)).to(dtype)
              for i, (shape, dtype) in enumerate(zip(shapes, dtypes))]
    grads = [[make_grad(rng.choice(PATTERNS), shape, cfg.grad_dtype(dtype), generator)
              for shape, dtype in zip(shapes, dtypes)]
             for _ in range(rng.randint(1, 3))]
    return Case(cfg, adam_w_mode, bias_correction, groups, params, grads)


@st.composite
def cases(draw):
    cfg = Precision(param=draw(st.sampled_from(PARAM_PRESETS)),
                    grad=draw(st.sampled_from(GRAD_PRESETS)),
                    exp_avg=draw(st.sampled_from(MOMENT_PRESETS)),
                    exp_avg_sq=draw(st.sampled_from(MOMENT_PRESETS)),
                    master=draw(st.sampled_from(MASTER_PRESETS)))
    return build_case(cfg, draw(st.booleans()), draw(st.booleans()),
                      draw(st.integers(0, 2 ** 32 - 1)))


def out_of_domain(case, inputs, grads, step):
    """True when the float64 reference cannot judge this step: some fp16 parameter's
    exact update (plus its bound) would not round to a finite fp16 value (65520 and
    above), or a denominator is within its error of zero (adam_reference refuses)."""
    for g, (_, members) in enumerate(case.groups):
        for i in members:
            if grads[i] is None:
                continue
            try:
                ref = adam_reference(inputs[i].w, inputs[i].m, inputs[i].v, grads[i],
                                     case.hyper(g), step)
            except AssertionError:
                return True
            if (case.params[i].dtype == torch.float16
                    and bool(((ref.w.abs() + ref.w_bound) >= 65520.0).any())):
                return True
    return False


def run(case, backend, check):
    """Builds the case's optimizer on `backend` and steps it; with `check`, every step
    is verified against the float64 reference."""
    params = [torch.nn.Parameter(value.clone()) for value in case.params]
    with backend_context(backend):
        opt = fused_adam()(
            [dict(params=[params[i] for i in members], **hyper.group_kwargs())
             for hyper, members in case.groups],
            adam_w_mode=case.adam_w_mode, bias_correction=case.bias_correction,
            **case.cfg.optimizer_kwargs())
        for step, grads in enumerate(case.grads, start=1):
            attach_grads(params, grads, case.cfg.decoupled)
            inputs = capture_inputs(opt, params) if check else None
            opt.step()
            for g, group in enumerate(opt.param_groups):
                assert group["step"] == step, f"group {g} step {group['step']} != {step}"
            if not check:
                continue
            try:
                for g, (_, members) in enumerate(case.groups):
                    verify_step(opt, [params[i] for i in members],
                                [inputs[i] for i in members],
                                [grads[i] for i in members], case.hyper(g), step,
                                f"{backend} {case.cfg.id} w={case.adam_w_mode} "
                                f"bc={case.bias_correction} group {g}")
            except AssertionError:
                if not out_of_domain(case, inputs, grads, step):
                    raise
                # beyond what the reference models (overflow of an fp16 parameter, a
                # denominator lost in rounding): later steps are only compared across
                # the two paths
                check = False
    return opt, params, check


def assert_same_up_to_nan_sign(a, b, params_a, params_b, what):
    """assert_same_optimizer_state, except that a NaN only has to be a NaN in both
    (fp8 codes 0x7F / 0xFF): the two paths do not agree on the sign of the NaNs that
    an overflowed step produces (reported; S2.4 only says NaN stays NaN)."""
    def canonical(t):
        t = t.detach()
        if t.dtype == torch.uint8:
            return torch.where((t & 0x7F) == 0x7F, torch.full_like(t, 0x7F), t)
        if t.is_floating_point():
            return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
        return t
    for i, (p, q) in enumerate(zip(params_a, params_b)):
        assert_bitwise_equal(canonical(q), canonical(p), f"{what}: param {i}")
        sa, sb = state_tensors(a, p), state_tensors(b, q)
        assert sorted(sa) == sorted(sb), f"{what}: param {i} state names"
        for key in sa:
            assert_bitwise_equal(canonical(sb[key]), canonical(sa[key]),
                                 f"{what}: param {i} {key}")
    for i, (ga, gb) in enumerate(zip(a.param_groups, b.param_groups)):
        assert ga["step"] == gb["step"], f"{what}: group {i} step"


@settings(derandomize=True, database=None, deadline=None, max_examples=MAX_EXAMPLES,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(cases(), min_size=CASES_PER_EXAMPLE, max_size=CASES_PER_EXAMPLE))
def test_fuzz_against_reference_and_torch_path(batch):
    for case in batch:
        opt, params, in_domain = run(case, "auto", check=True)
        if have_core():
            # S7.2 / _backend: both paths fulfil the contract bit for bit on CPU
            twin, twin_params, _ = run(case, "torch", check=False)
            compare = (assert_same_optimizer_state if in_domain
                       else assert_same_up_to_nan_sign)
            compare(opt, twin, params, twin_params, f"C++ vs torch path, {case.cfg.id}")
