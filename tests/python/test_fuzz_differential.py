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
maximum); non-finite gradients are the subject of test_nonfinite_policy.py. Some
parameter steps still lie outside what the float64 reference can judge
(out_of_domain()): the reference refuses (a denominator within its rounding error of
zero), an fp16 parameter's exact update exceeds the fp16 range (small moments flushed to
zero by a scaled storage, divided by a small eps), or the parameter's stored state went
non-finite at such an earlier step. The unit of that escape is one parameter at one
step: when that parameter's reference check fails, only it is excused, only at that
step, and only for its weight (its moments are still checked,
verify_excused_moments()). Every
other parameter of the step is verified, and so are later steps (each starts from the
decoded stored state, so an excused earlier step does not spoil them). The C++ path and
the torch path must still agree bit for bit on every parameter; for a parameter that
was excused, a NaN only has to be NaN on both (the paths do not agree on NaN signs and
payloads, see test_nonfinite_policy.py). The share of excused parameter steps is
bounded (MAX_EXCUSED), so a regression cannot hide by making most steps "out of
domain". Any other failure fails the test.

Each hypothesis example runs CASES_PER_EXAMPLE cases, so a CI run checks
MAX_EXAMPLES * CASES_PER_EXAMPLE cases; SHARDADAM_FUZZ_EXAMPLES=k multiplies the
number of examples by k for longer runs. The profile is derandomized: CI runs the same
examples every time.
"""

import collections
import dataclasses
import os
import random

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from _optimizer_testing import (
    MASTER_FORMATS, MOMENT_FORMATS, Hyper, Precision, adam_reference, assert_bitwise_equal,
    assert_same_optimizer_state, attach_grads, backend_context, capture_inputs, fused_adam,
    have_core, state_tensors, verify_moments, verify_step)

CASES_PER_EXAMPLE = 4
MAX_EXAMPLES = max(1, round(2500 * float(os.environ.get("SHARDADAM_FUZZ_EXAMPLES", "1"))))

PARAM_PRESETS = ("fp32", "fp16", "bf16", "fp16+bf16")
GRAD_PRESETS = ("same", "fp32", "fp16", "bf16")
# Every moment format chosen by a dtype (_optimizer_testing). The per-block formats
# (moment_format=) are fuzzed by tests/fuzz/adam_fuzz.cc against the C++ reference, and
# their steps checked against float64 and the torch path in test_block_moments_*.py.
MOMENT_PRESETS = MOMENT_FORMATS
MASTER_PRESETS = ("none",) + MASTER_FORMATS
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


def out_of_domain(case, group, index, before, grad, step, excused):
    """Why the float64 reference cannot judge parameter `index` (of `group`) at `step`,
    started from its captured inputs `before`; None when it can. Out of the domain:
    the reference refuses (a denominator within its error of zero), an fp16
    parameter's exact update (plus its bound) would not round to a finite fp16 value
    (65520 and above), or its stored state is not finite; the latter only after the
    same parameter was excused at an earlier step (`excused`), the sole way a verified
    state can become non-finite."""
    if grad is None:
        return None  # a skipped parameter is checked bitwise, never excused
    if not all(bool(torch.isfinite(t).all()) for t in (before.w, before.m, before.v)):
        return "non-finite state after an excused step" if index in excused else None
    try:
        ref = adam_reference(before.w, before.m, before.v, grad, case.hyper(group),
                             step)
    except AssertionError:
        return "reference refuses: denominator within its error of 0"
    if (case.params[index].dtype == torch.float16
            and bool(((ref.w.abs() + ref.w_bound) >= 65520.0).any())):
        return "fp16 parameter overflow"
    return None


def verify_excused_moments(opt, param, before, grad, hyper, step, what):
    """The exp_avg / exp_avg_sq part of verify_step() for a parameter step excused
    from it: S3.6's moments and their bounds do not involve lr or eps, so the reference
    is taken with eps = 1e38 (finite in fp32), far above any sqrt(v) here, which keeps
    its denominator away from zero. Checked when the moments' inputs are finite (the
    weight too in L2 mode, where it enters the gradient)."""
    inputs = (before.m, before.v, grad) + (() if hyper.adam_w_mode else (before.w,))
    if not all(bool(torch.isfinite(t).all()) for t in inputs):
        return
    ref = adam_reference(before.w, before.m, before.v, grad.double(),
                         dataclasses.replace(hyper, eps=1e38), step)
    verify_moments(opt, param, ref, f"{what} step {step}")


@dataclasses.dataclass
class Tally:
    """Cases run to the end (both paths compared), parameter steps with a gradient
    that were checked against the reference, and those excused from it (by reason)."""

    cases: int = 0
    steps: int = 0
    excused: collections.Counter = dataclasses.field(
        default_factory=collections.Counter)


def run(case, backend, tally=None):
    """Builds the case's optimizer on `backend` and steps it; with `tally`, every
    parameter at every step is verified against the float64 reference, one parameter
    at a time, and only a parameter step out of the reference's domain is excused.
    Returns the optimizer, its parameters and the indices of the excused parameters."""
    params = [torch.nn.Parameter(value.clone()) for value in case.params]
    excused = set()
    with backend_context(backend):
        opt = fused_adam()(
            [dict(params=[params[i] for i in members], **hyper.group_kwargs())
             for hyper, members in case.groups],
            adam_w_mode=case.adam_w_mode, bias_correction=case.bias_correction,
            **case.cfg.optimizer_kwargs())
        for step, grads in enumerate(case.grads, start=1):
            attach_grads(params, grads, case.cfg.decoupled)
            # teacher forcing: the reference starts from the decoded stored state
            inputs = capture_inputs(opt, params) if tally is not None else None
            opt.step()
            for g, group in enumerate(opt.param_groups):
                assert group["step"] == step, f"group {g} step {group['step']} != {step}"
            if tally is None:
                continue
            newly = set()
            for g, (_, members) in enumerate(case.groups):
                for i in members:
                    what = (f"{backend} {case.cfg.id} w={case.adam_w_mode} "
                            f"bc={case.bias_correction} group {g} case param {i}:")
                    try:
                        verify_step(opt, [params[i]], [inputs[i]], [grads[i]],
                                    case.hyper(g), step, what)
                    except AssertionError:
                        reason = out_of_domain(case, g, i, inputs[i], grads[i], step,
                                               excused)
                        if reason is None:
                            raise
                        # excused from the weight's reference check, not the moments'
                        verify_excused_moments(opt, params[i], inputs[i], grads[i],
                                               case.hyper(g), step, what)
                        newly.add(i)
                        tally.excused[reason] += 1
                    tally.steps += grads[i] is not None
            excused |= newly
    return opt, params, excused


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


def assert_same_paths(a, b, params_a, params_b, excused, what):
    """C++ path vs torch path, per parameter: bitwise (assert_same_optimizer_state),
    except that a parameter excused from the reference is compared up to NaN signs
    and payloads. Both also compare every group's step count."""
    for i, (p, q) in enumerate(zip(params_a, params_b)):
        compare = (assert_same_up_to_nan_sign if i in excused
                   else assert_same_optimizer_state)
        compare(a, b, [p], [q], f"{what}: case param {i}")


# Upper bound on the share of parameter steps (with a gradient) excused from the
# reference check. Measured with the default example count (10000 cases): 1858 of 44619
# parameter steps (4.2%) excused, in 1072 cases (10.7%): 1055 reference refusals, 219
# fp16 overflows, 584 non-finite states after an excused step (500 cases,
# SHARDADAM_FUZZ_EXAMPLES=0.05: 2.1%). 8% is about twice the measurement and still
# fails long before "most steps out of domain" could pass.
MAX_EXCUSED = 0.08


def test_fuzz_against_reference_and_torch_path():
    tally = Tally()

    @settings(derandomize=True, database=None, deadline=None, max_examples=MAX_EXAMPLES,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(cases(), min_size=CASES_PER_EXAMPLE, max_size=CASES_PER_EXAMPLE))
    def examples(batch):
        for case in batch:
            opt, params, excused = run(case, "auto", tally)
            if have_core():
                # S7.2 / _backend: both paths fulfil the contract bit for bit on CPU
                twin, twin_params, _ = run(case, "torch")
                assert_same_paths(opt, twin, params, twin_params, excused,
                                  f"C++ vs torch path, {case.cfg.id}")
            tally.cases += 1

    examples()
    # The promise (docs/guarantees.md): 10,000 cases per CI run, scaled by
    # SHARDADAM_FUZZ_EXAMPLES. Hypothesis may stop before max_examples (an exhausted
    # search space, too many rejected draws), so the cases that ran are counted.
    assert tally.cases == CASES_PER_EXAMPLE * MAX_EXAMPLES, (
        f"{tally.cases} cases ran, not {CASES_PER_EXAMPLE} x {MAX_EXAMPLES} examples")
    if "SHARDADAM_FUZZ_EXAMPLES" not in os.environ:
        assert tally.cases == 10_000, f"{tally.cases} cases ran, 10,000 are promised"
    excused = sum(tally.excused.values())
    assert tally.steps > 0, "no parameter step was checked against the reference"
    assert excused <= MAX_EXCUSED * tally.steps, (
        f"{excused} of {tally.steps} parameter steps excused from the reference check "
        f"(> {MAX_EXCUSED:.0%}): {dict(tally.excused)}")
