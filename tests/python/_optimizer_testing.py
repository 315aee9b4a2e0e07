"""Shared helpers for the shardadam Python tests (fixtures are in conftest.py).

What lives here:

* dtype names as test ids spell them (``fp32``, ``bf16``, ``fp16``, ``fp8``, ``rem``) and
  the storage each one implies (SEMANTICS S2.2), stated here independently of the
  package; the lists of formats that tests run through, taken from the package's
  declarations (``shardadam._formats``);
* decoders that read the optimizer's raw state storage back to float64 *in the test*
  (fp8 codes, fp16 with scale, int16 remainders), independent of the package's getters;
* a float64 Adam/AdamW step (SEMANTICS S3.6) that also returns, per element, a bound on
  how far any fp32 evaluation of the same step may land from it, and the checks that
  compare a stored state against it with the storage format's rounding added;
* snapshots of everything an optimizer owns, compared bit for bit (used after every
  failed call: S3.1 says a failure changes nothing).

Tolerances, once for all files: u = 2**-24 is the fp32 unit roundoff. An fp32 step is
a chain of about a dozen correctly rounded operations on exactly known inputs, so every
intermediate is off by at most u times its own magnitude per operation; adam_reference()
propagates those first-order terms through the formula (derivation beside each line).
A value stored in a narrower format adds half a spacing of that format's grid at the
value (round to nearest); a scaled format (fp16 / fp8 with scale s) adds s times half
the grid spacing at value / s, plus the one rounding of the division by s.

Why each step is checked from the optimizer's own stored state ("teacher forcing"): the
contract (S3.7) is stated per step. Feeding the reference the decoded state the
optimizer actually holds keeps the bound of every step tight and independent of the
gradient history, and still catches any wrong step, wrong storage or lost state,
because the next step starts from what was stored.
"""

import contextlib
import dataclasses
import math
from typing import Optional

import torch

from shardadam import _formats

# --------------------------------------------------------------------------------------
# Constants of the formats

U = 2.0 ** -24  # fp32 unit roundoff: |fl(x) - x| <= U * |x| for a normal result
FP32_TINY = torch.finfo(torch.float32).tiny  # smallest normal fp32, S2.3's floor
FP32_MIN_SUBNORMAL = 2.0 ** -149
# An operation whose result falls among fp32 subnormals is off by at most half of
# 2**-149 instead of U * |x|; four such roundings per value are allowed for.
ABS_SLACK = 4 * FP32_MIN_SUBNORMAL
# First-order bounds drop products of rounding errors (k**2 * U**2 for k operations,
# plus the float64 reference's own 2**-53 per operation); a 2**-10 relative margin
# covers those many times over and is far below any format's rounding.
SECOND_ORDER = 1.0 + 2.0 ** -10

# S2.3: magnitude a scaled state's largest element is stored as.
SCALE_TARGET = {"fp16": 32752.0, "fp8": 448.0}

# Storage dtype of a configured dtype name (fp8 moments are uint8 codes, S2.2).
TORCH_DTYPE = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.uint8,
}
NAME_OF_DTYPE = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.uint8: "fp8",
}

# (explicit mantissa bits, exponent of the smallest normal number) of each grid.
GRID = {"fp32": (23, -126), "bf16": (7, -126), "fp16": (10, -14), "fp8": (3, -6)}

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")


def id_name(fmt):
    """A declared format's name as test ids spell it."""
    return "rem" if fmt is _formats.REMAINDER else fmt.name


# The formats tests run through: every one the package declares for the moments, for the
# master, and with a scale. A format added there is run here at once and needs its facts
# above (test_formats.py checks that they agree with the declarations).
# Per-block formats are chosen by moment_format, not by a dtype, and have tests of their
# own (test_block_moments*.py).
_BY_DTYPE = [f for f in _formats.FORMATS if f.scale != "block"]
MOMENT_FORMATS = tuple(id_name(f) for f in _BY_DTYPE if "moment" in f.roles)
MASTER_FORMATS = tuple(id_name(f) for f in _BY_DTYPE if "master" in f.roles)
SCALED_FORMATS = tuple(id_name(f) for f in _BY_DTYPE if f.scaled)
BLOCK_FORMATS = tuple(f.name for f in _formats.FORMATS if f.scale == "block")


def have_core():
    """True when the C++ extension is built and importable."""
    try:
        import shardadam._C  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------
# Bits


def bits(t):
    """The raw bytes of a dense tensor, for bitwise comparison (NaN-safe)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(actual, expected, what=""):
    assert actual.dtype == expected.dtype, \
        f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, \
        f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.device == expected.device, \
        f"{what}: device {actual.device} != {expected.device}"
    if actual.device.type == "meta":
        return  # no data to compare
    if torch.equal(bits(actual), bits(expected)):
        return
    a = actual.detach().reshape(-1)
    e = expected.detach().reshape(-1)
    if a.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        differ = (bits_as_int(a) != bits_as_int(e)).nonzero().reshape(-1)
    else:
        differ = (a != e).nonzero().reshape(-1)
    i = int(differ[0])
    raise AssertionError(
        f"{what}: {differ.numel()} of {a.numel()} elements differ bitwise; "
        f"first at flat index {i}: {a[i].item()!r} vs {e[i].item()!r}")


def bits_as_int(t):
    """Integer view of the bit patterns of a float tensor (same width)."""
    width = {torch.float64: torch.int64, torch.float32: torch.int32,
             torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return t.contiguous().view(width[t.dtype])


def f32(x):
    """A Python float rounded to the nearest fp32 value (round to nearest even)."""
    return torch.tensor(x, dtype=torch.float64).to(torch.float32).item()


# --------------------------------------------------------------------------------------
# Grids and decoders


def half_spacing(fmt, magnitude):
    """Half the distance between neighbours of `fmt`'s grid around |magnitude|.

    A round-to-nearest store of x is within this of x. For subnormals the spacing is
    that of the smallest binade. Exact (powers of two from frexp), float64.
    """
    mbits, emin = GRID[fmt]
    magnitude = magnitude.double().abs()
    # magnitude = mantissa * 2**exponent with mantissa in [0.5, 1)
    _, exponent = torch.frexp(magnitude)
    binade = torch.where(magnitude == 0, torch.full_like(exponent, emin), exponent - 1)
    binade = torch.clamp(binade, min=emin)
    return torch.ldexp(torch.full_like(magnitude, 0.5), binade - mbits)


def decode_codes(stored):
    """Stored codes of any storage dtype as float64 (before any scale)."""
    if stored.dtype == torch.uint8:
        return stored.view(torch.float8_e4m3fn).double()
    return stored.double()


def merge_remainder(param, remainder):
    """S2.5 in reverse: the fp32 master rebuilt from a bf16 param and its int16 remainder.

    The param holds the master's high 16 bits, plus one when the low half (the
    remainder's bit pattern) is >= 0x8000, i.e. when the remainder is negative.
    """
    high = param.detach().view(torch.int16).to(torch.int64) & 0xFFFF
    low = remainder.to(torch.int64) & 0xFFFF
    high = (high - (remainder < 0).to(torch.int64)) & 0xFFFF
    word = (high << 16) | low
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)
    return word.to(torch.int32).view(torch.float32).reshape(param.shape)


def split_master(master):
    """S2.5: (bf16 param, int16 remainder) that store the fp32 `master`."""
    word = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = word >> 16
    low = word & 0xFFFF
    param = (high + (low >= 0x8000).to(torch.int64)) & 0xFFFF
    param = torch.where(param >= 2 ** 15, param - 2 ** 16, param).to(torch.int16)
    low = torch.where(low >= 2 ** 15, low - 2 ** 16, low).to(torch.int16)
    return param.view(torch.bfloat16).reshape(master.shape), low.reshape(master.shape)


def storage_format(tensor):
    """Short name of a state tensor's storage dtype."""
    if tensor.dtype == torch.int16:
        return "rem"
    return NAME_OF_DTYPE[tensor.dtype]


def scale_of(opt, param, name):
    """The 0-dim fp32 scale of `param`'s state `name`, or None when it has none.

    The package keeps scales beside the state, in ``optimizer._scales[param][name]``
    (TE's layout), so that ``optimizer.state[param]`` holds exactly the
    state names torch's checkpoint tools iterate; ``optimizer.state[param][name +
    "_scale"]`` is read as well. Every test reads scales through here only.
    """
    scales = getattr(opt, "_scales", None)
    if scales is not None and param in scales and name in scales[param]:
        return scales[param][name]
    return opt.state[param].get(name + "_scale")


def state_tensors(opt, param):
    """Every tensor the optimizer keeps for `param`, by name: the state entries and,
    as ``<name>_scale``, their scales."""
    tensors = {k: v for k, v in opt.state[param].items() if isinstance(v, torch.Tensor)}
    for name in STATE_NAMES:
        scale = scale_of(opt, param, name)
        if scale is not None:
            tensors[name + "_scale"] = scale
    return tensors


def true_state(opt, param, name):
    """Float64 true value of a state (S2.2), decoded here from the raw storage."""
    state = opt.state[param]
    stored = state[name]
    fmt = storage_format(stored)
    if fmt == "rem":
        return merge_remainder(param, stored).double()
    values = decode_codes(stored)
    if fmt in SCALE_TARGET:
        values = values * scale_of(opt, param, name).double()
    return values


def weight_of(opt, param):
    """Float64 weight the next step starts from: the master if any, else the param."""
    if "master_param" in opt.state[param]:
        return true_state(opt, param, "master_param")
    return param.detach().double()


def expected_scale(values, fmt):
    """S2.3 evaluated in fp32 arithmetic: the scale of fp32 `values` stored as `fmt`."""
    values = values.detach().float()
    if values.numel() == 0:
        return 1.0
    a = values.abs().max()
    if not torch.isfinite(a) or a.item() == 0.0:
        return 1.0
    s = a / torch.tensor(SCALE_TARGET[fmt], dtype=torch.float32)
    return max(s.item(), FP32_TINY)


def quantize_like_spec(values, fmt):
    """(codes, scale) S2.3/S2.4 prescribe for fp32 `values` stored as `fmt`."""
    values = values.detach().float()
    if fmt == "fp32":
        return values.clone(), None
    if fmt == "bf16":  # torch's rounding; a NaN quiet, with its sign and top payload
        nan = ((values.view(torch.int32) | 0x00400000) >> 16).to(torch.int16)
        return torch.where(torch.isnan(values), nan.view(torch.bfloat16),
                           values.to(torch.bfloat16)), None
    s = expected_scale(values, fmt)
    quotient = values / torch.tensor(s, dtype=torch.float32)
    if fmt == "fp16":
        return quotient.to(torch.float16), s
    return e4m3_codes(quotient), s


def near_ties(fmt, count, seed):
    """fp32 values u whose u / s lands within an fp32 ulp or two of a rounding
    midpoint of `fmt`'s grid, for a scale s whose reciprocal is inexact, with the largest
    element setting s (S2.3). Rounding them exposes any evaluation other than S2.3's
    fp32 division u / s followed by one round to nearest even (e.g. u * (1 / s)).
    Returns (values, scale)."""
    generator = torch.Generator().manual_seed(seed)
    target = SCALE_TARGET[fmt]
    codes = torch.randint(1, 2 ** 16 if fmt == "fp16" else 2 ** 8, (count,),
                          generator=generator, dtype=torch.int32)
    if fmt == "fp16":
        grid = codes.to(torch.int16).view(torch.float16).double()
    else:
        grid = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    usable = torch.isfinite(grid) & (grid.abs() < target)
    grid = torch.where(usable, grid, torch.ones_like(grid))
    spacing = 2 * half_spacing(fmt, grid)
    midpoints = grid + torch.sign(grid) * spacing / 2
    s0 = 0.3 + 0.1 * torch.rand((), generator=generator, dtype=torch.float64).item()
    values = (midpoints * s0).float()
    values[0] = float(target * s0)  # the absmax: scale close to s0
    return values, expected_scale(values, fmt)


# --------------------------------------------------------------------------------------
# Configurations


@dataclasses.dataclass(frozen=True)
class Hyper:
    """Hyper-parameters of one param group, as the test passes them."""

    lr: float = 1e-2
    betas: tuple = (0.9, 0.99)
    eps: float = 1e-8
    weight_decay: float = 0.05
    adam_w_mode: bool = True
    bias_correction: bool = True

    def group_kwargs(self):
        return dict(lr=self.lr, betas=self.betas, eps=self.eps,
                    weight_decay=self.weight_decay)

    def optimizer_kwargs(self):
        return dict(self.group_kwargs(), adam_w_mode=self.adam_w_mode,
                    bias_correction=self.bias_correction)


@dataclasses.dataclass(frozen=True)
class Precision:
    """One row of the precision matrix; `id` spells it as the test ids do."""

    param: str = "fp32"  # "fp32" | "bf16" | "fp16" | "fp16+bf16" (alternating in one group)
    grad: str = "same"  # "same" (param.grad) or a dtype name (param.decoupled_grad)
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"
    master: str = "none"  # "none" | "fp32" | "fp16" | "rem"

    @property
    def id(self):
        grad = "p" if self.grad == "same" else self.grad
        return (f"p={self.param}-g={grad}-m={self.exp_avg}-v={self.exp_avg_sq}"
                f"-master={self.master}")

    def param_dtypes(self, count):
        names = self.param.split("+")
        return [TORCH_DTYPE[names[i % len(names)]] for i in range(count)]

    @property
    def decoupled(self):
        return self.grad != "same"

    def grad_dtype(self, param_dtype):
        return param_dtype if self.grad == "same" else TORCH_DTYPE[self.grad]

    def optimizer_kwargs(self):
        return dict(
            master_weights=self.master != "none",
            master_weight_dtype=torch.float16 if self.master == "fp16" else torch.float32,
            store_param_remainders=self.master == "rem",
            exp_avg_dtype=TORCH_DTYPE[self.exp_avg],
            exp_avg_sq_dtype=TORCH_DTYPE[self.exp_avg_sq],
            use_decoupled_grad=self.decoupled,
        )

    def state_formats(self, param_dtype):
        """Storage format of each state of a parameter of `param_dtype` (S2.1, S2.2)."""
        formats = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.master != "none" and param_dtype != torch.float32:
            formats["master_param"] = self.master
        return formats

    @property
    def bitwise_round_trip(self):
        """S5.6: bitwise after reload unless some state is fp16/fp8 scaled."""
        return not {self.exp_avg, self.exp_avg_sq, self.master} & set(SCALE_TARGET)


SHAPES = [(4, 9), (33,), (1,), (0,), ()]


def make_params(dtypes, shapes=SHAPES, seed=0):
    """Leaf parameters with values spread over a few decades (exact in their dtype)."""
    generator = torch.Generator().manual_seed(seed)
    params = []
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        values = torch.randn(shape, generator=generator) * (0.5 + i)
        params.append(torch.nn.Parameter(values.to(dtype)))
    return params


def make_grads(params, grad_dtypes, step, seed=0, zero_fraction=0.1):
    """Deterministic gradients for one step: per tensor a different magnitude (1e-3 to
    1e1), with some exact zeros, in the requested dtypes."""
    generator = torch.Generator().manual_seed(seed * 100003 + step)
    grads = []
    for i, (p, dtype) in enumerate(zip(params, grad_dtypes)):
        g = torch.randn(p.shape, generator=generator) * 10.0 ** (i % 5 - 3)
        keep = torch.rand(p.shape, generator=generator) >= zero_fraction
        grads.append((g * keep).to(dtype))
    return grads


def attach_grads(params, grads, decoupled):
    """Give each param its gradient (None skips it) via .grad or .decoupled_grad."""
    for p, g in zip(params, grads):
        if decoupled:
            p.decoupled_grad = g
        else:
            p.grad = g


# --------------------------------------------------------------------------------------
# The float64 reference step and its bounds


@dataclasses.dataclass
class StepConstants:
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    weight_decay: float
    decay: float
    step_size: float
    bias_correction2_sqrt: float
    eps: float


def step_constants(hyper, step, lr=None):
    """S3.6: the per-step scalars, computed in double and rounded to fp32."""
    lr = hyper.lr if lr is None else lr
    beta1, beta2 = hyper.betas
    c1 = 1.0 - math.pow(beta1, step) if hyper.bias_correction else 1.0
    c2 = 1.0 - math.pow(beta2, step) if hyper.bias_correction else 1.0
    return StepConstants(
        beta1=f32(beta1), one_minus_beta1=f32(1.0 - beta1),
        beta2=f32(beta2), one_minus_beta2=f32(1.0 - beta2),
        weight_decay=f32(hyper.weight_decay), decay=f32(1.0 - lr * hyper.weight_decay),
        step_size=f32(lr / c1), bias_correction2_sqrt=f32(math.sqrt(c2)),
        eps=f32(hyper.eps))


def fp32_emulated_step(w, m, v, g, hyper, step):
    """(w, m, v) after S3.6 in fp32 tensor arithmetic: step_constants' scalars, one
    rounding per operation in the contract's order. fp32 tensors in and out."""
    k = {name: torch.tensor(value, dtype=torch.float32)
         for name, value in dataclasses.asdict(step_constants(hyper, step)).items()}
    if not hyper.adam_w_mode:
        g = g + k["weight_decay"] * w
    m = k["beta1"] * m + k["one_minus_beta1"] * g
    v = k["beta2"] * v + (k["one_minus_beta2"] * g) * g
    if hyper.adam_w_mode:
        w = w * k["decay"]
    # sqrt in float64, rounded once, is fp32's correctly rounded sqrt; torch's own
    # float32 sqrt on CPU is not (it differs in the last bit for ~18% of inputs)
    denom = torch.sqrt(v.double()).float() / k["bias_correction2_sqrt"] + k["eps"]
    return w - (k["step_size"] * m) / denom, m, v


@dataclasses.dataclass
class Reference:
    """Exact (float64) results of one step and per-element bounds for fp32 evaluation."""

    w: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    w_bound: torch.Tensor
    m_bound: torch.Tensor
    v_bound: torch.Tensor


def adam_reference(w, m, v, g, hyper, step, lr=None):
    """One Adam/AdamW step (S3.6) in float64 from float64 inputs.

    The bounds hold for any fp32 evaluation that rounds each operation correctly, in
    the order S3.6 / element.h gives or in torch's fused order (lerp for m, decay as
    w - lr*wd*w), with constants that may each be off by one fp32 rounding. Inputs
    decoded from a scaled storage cost one more rounding (float(q) * s in fp32); it is
    included for every input, which is harmless where the input was exact.
    """
    k = step_constants(hyper, step, lr)
    w, m, v, g = (t.double() for t in (w, m, v, g))
    if hyper.adam_w_mode:
        grad, grad_err = g, torch.zeros_like(g)
    else:
        # L2: g + wd*w: the constant, the product and the sum round once each.
        penalty = k.weight_decay * w
        grad = g + penalty
        grad_err = 2 * U * penalty.abs() + U * grad.abs() + ABS_SLACK

    # m: decode of m (1), beta1*m and (1-beta1)*g with their constants (2 + 2) or the
    # lerp form m + w*(g - m) (3 roundings of terms <= |m| + |g|), the sum (1 of |m1|).
    m1 = k.beta1 * m + k.one_minus_beta1 * grad
    m_err = (4 * U * (m.abs() + grad.abs()) + U * m1.abs() + grad_err + ABS_SLACK)

    # v: decode of v (1), beta2*v with its constant (2), (1-beta2)*g*g with the constant
    # (3), the sum (1 of v1); an error e in g changes g*g by 2|g|e + e**2.
    v1 = k.beta2 * v + k.one_minus_beta2 * grad * grad
    v_err = (3 * U * v + 3 * U * k.one_minus_beta2 * grad * grad + U * v1
             + 2 * grad.abs() * grad_err + grad_err ** 2 + ABS_SLACK)

    # denominator sqrt(v1)/bc2 + eps: an error e in v moves sqrt(v) by at most
    # sqrt(v) - sqrt(v - e) (concavity); sqrt, the constant and the division round once
    # each (3 of sqrt(v1)), eps and the sum once each.
    root = torch.sqrt(v1)
    root_err = root - torch.sqrt(torch.clamp(v1 - v_err, min=0.0))
    denom = root / k.bias_correction2_sqrt + k.eps
    denom_err = ((root_err + 3 * U * root) / k.bias_correction2_sqrt + U * k.eps
                 + U * denom + ABS_SLACK)

    # update step_size * m1 / denom: first-order error of the quotient from the errors
    # of m1 and denom (denominator bounded below by denom - denom_err), then the
    # constant, the product and the division (3 of |update|).
    ratio = m1 / denom
    denom_low = denom - denom_err
    # a test whose inputs leave the denominator indistinguishable from zero cannot be
    # bounded; it is a badly chosen input, not a pass
    assert bool((denom_low > 0).all()), "reference: denominator within its error of 0"
    update = k.step_size * ratio
    # the numerator (step_size * m, or lr * (m / c1)) may land among fp32 subnormals
    # before the division: its absolute slack is then amplified by 1 / denom
    update_err = (k.step_size * (m_err + ratio.abs() * denom_err) / denom_low
                  + 3 * U * update.abs() + ABS_SLACK
                  + ABS_SLACK * max(1.0, k.step_size) / denom_low)

    # weight: decode (1 of |w|), decoupled decay w*(1 - lr*wd) or w - lr*wd*w
    # (3 of |w|), the subtraction (1 of |w1|).
    if hyper.adam_w_mode:
        w0 = w * k.decay
        w_err0 = 4 * U * w.abs()
    else:
        w0 = w
        w_err0 = U * w.abs()
    w1 = w0 - update
    w_err = w_err0 + U * w1.abs() + update_err + ABS_SLACK

    return Reference(w1, m1, v1, w_err * SECOND_ORDER, m_err * SECOND_ORDER,
                     v_err * SECOND_ORDER)


def assert_close_bounded(actual, reference, bound, what):
    """|actual - reference| <= bound elementwise (NaN anywhere fails)."""
    actual = actual.double()
    ok = (actual - reference).abs() <= bound
    if bool(ok.all()):
        return
    excess = torch.where(ok, torch.zeros_like(bound), (actual - reference).abs() - bound)
    excess = torch.nan_to_num(excess, nan=float("inf"))
    i = int(excess.reshape(-1).argmax())
    a, r, b = (t.reshape(-1)[i].item() for t in (actual, reference, bound))
    raise AssertionError(
        f"{what}: {int((~ok).sum())} of {ok.numel()} elements outside the derived bound; "
        f"worst at flat index {i}: got {a!r}, reference {r!r}, |diff| "
        f"{abs(a - r)!r} > bound {b!r}")


def stored_bound(fmt, stored, reference, bound, scale=None):
    """Tolerance for a value computed within `bound` of `reference` and then stored in
    `fmt` (S2.2-S2.4): the format's half spacing; for a scaled state (`scale` given:
    fp16 / fp8 moments and masters, never params) at value / scale, times the scale,
    plus the rounding of the division by the scale."""
    if fmt in ("fp32", "rem"):
        return bound
    magnitude = torch.maximum(stored.double().abs(), reference.abs())
    if scale is not None:
        return (bound + U * (reference.abs() + bound)
                + scale * half_spacing(fmt, magnitude / scale))
    return bound + half_spacing(fmt, magnitude)


def check_scale(stored, scale_t, reference, bound, what):
    """S2.3 on a freshly stored scaled state (`stored` codes, `scale_t` its 0-dim fp32
    scale): empty or all-zero -> 1; otherwise the largest stored code is the target R
    (the largest element divided by a / R is R up to two roundings, far below the
    format's spacing at R), and scale * R tracks the reference's absmax."""
    fmt = storage_format(stored)
    assert scale_t.dtype == torch.float32 and scale_t.dim() == 0, \
        f"{what}: scale must be a 0-dim fp32 tensor, got {scale_t.dtype} " \
        f"{tuple(scale_t.shape)}"
    scale = scale_t.item()
    codes = decode_codes(stored)
    if codes.numel() == 0:
        assert scale == 1.0, f"{what}: empty state must have scale 1, got {scale!r}"
        return
    largest = codes.abs().max().item()
    if largest == 0.0 and scale != FP32_TINY:
        # all codes zero: u was zero (scale 1) or so small that u / s rounded to zero
        # under the fp32 floor (checked below)
        assert scale == 1.0, f"{what}: all-zero state must have scale 1, got {scale!r}"
        return
    if scale != FP32_TINY:
        assert largest == SCALE_TARGET[fmt], (
            f"{what}: largest stored code {largest!r} != S2.3 target {SCALE_TARGET[fmt]!r} "
            f"(scale {scale!r})")
    amax = reference.abs().max().item()
    worst = bound.max().item()
    # the absmax of the computed values is within `worst` of the reference's; a / R
    # rounds once more.
    slack = worst + U * (amax + worst)
    if scale == FP32_TINY:
        # S2.3's floor: a / R is at most the smallest normal fp32, so R * s bounds a
        assert amax - slack <= FP32_TINY * SCALE_TARGET[fmt] * SECOND_ORDER, (
            f"{what}: scale at the fp32 floor but the reference absmax {amax!r} "
            f"exceeds floor * R")
        return
    assert abs(scale * SCALE_TARGET[fmt] - amax) <= slack * SECOND_ORDER, (
        f"{what}: scale {scale!r} * R = {scale * SCALE_TARGET[fmt]!r} does not track the "
        f"reference absmax {amax!r} within {slack!r}")


@dataclasses.dataclass
class StepInputs:
    """What one parameter's step starts from, decoded in float64 before the step."""

    w: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    param_bits: torch.Tensor
    state_bits: dict


def capture_inputs(opt, params):
    """StepInputs of every parameter, read before a step (with copies of all their
    tensors, scales included, for the parameters the step must leave alone)."""
    return [StepInputs(w=weight_of(opt, p), m=true_state(opt, p, "exp_avg"),
                       v=true_state(opt, p, "exp_avg_sq"), param_bits=p.detach().clone(),
                       state_bits={k: t.clone() for k, t in state_tensors(opt, p).items()})
            for p in params]


def verify_moments(opt, p, ref, label):
    """`p`'s stored exp_avg / exp_avg_sq (and their scales) against the reference step
    `ref` (an adam_reference() result)."""
    state = opt.state[p]
    for name, value, bound in (("exp_avg", ref.m, ref.m_bound),
                               ("exp_avg_sq", ref.v, ref.v_bound)):
        fmt = storage_format(state[name])
        scale = scale_of(opt, p, name).item() if fmt in SCALE_TARGET else None
        stored = true_state(opt, p, name)
        tolerance = stored_bound(fmt, stored, value, bound, scale)
        assert_close_bounded(stored, value, tolerance, f"{label}: {name} ({fmt})")
        if scale is not None:
            check_scale(state[name], scale_of(opt, p, name), value, bound,
                        f"{label}: {name} scale")


def verify_step(opt, params, inputs, grads, hyper, step, what, lr=None):
    """Checks every parameter's new param/master/moments against adam_reference()
    started from `inputs` (see the module docstring for the tolerances). A None
    gradient means the parameter must be left bitwise alone (S3.2)."""
    for index, (p, before, g) in enumerate(zip(params, inputs, grads)):
        label = f"{what} step {step} param {index} ({p.dtype}, shape {tuple(p.shape)})"
        state = opt.state[p]
        if g is None:
            assert_bitwise_equal(p.detach(), before.param_bits, f"{label}: skipped param")
            now = state_tensors(opt, p)
            for key, t in before.state_bits.items():
                assert_bitwise_equal(now[key], t, f"{label}: skipped state {key}")
            continue
        ref = adam_reference(before.w, before.m, before.v, g.double(), hyper, step, lr)
        verify_moments(opt, p, ref, label)
        param_fmt = NAME_OF_DTYPE[p.dtype]
        param_now = p.detach().double()
        assert_close_bounded(param_now, ref.w,
                             stored_bound(param_fmt, param_now, ref.w, ref.w_bound),
                             f"{label}: param")
        if "master_param" in state:
            fmt = storage_format(state["master_param"])
            master = true_state(opt, p, "master_param")
            scale = (scale_of(opt, p, "master_param").item() if fmt in SCALE_TARGET
                     else None)
            assert_close_bounded(master, ref.w,
                                 stored_bound(fmt, master, ref.w, ref.w_bound, scale),
                                 f"{label}: master_param ({fmt})")
            if fmt == "fp32":
                # S3.7: the param is the master rounded to the param's dtype.
                assert_bitwise_equal(p.detach(), state["master_param"].to(p.dtype),
                                     f"{label}: param vs rounded fp32 master")
            if scale is not None:
                check_scale(state["master_param"], scale_of(opt, p, "master_param"), ref.w,
                            ref.w_bound, f"{label}: master_param scale")


# --------------------------------------------------------------------------------------
# Snapshots: everything a failed call must leave bitwise alone


def _clone(value):
    if isinstance(value, torch.Tensor):
        value = value.detach()
        # A sparse or mkldnn tensor (bad input) is compared by its dense values.
        return value.to_dense().clone() if value.layout is not torch.strided else value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def facts(*patterns):
    """A regex that requires every pattern somewhere in the message (any order); a
    pattern starting with (?i) is matched ignoring case."""
    parts = []
    for p in patterns:
        flags = "i" if p.startswith("(?i)") else ""
        p = p[4:] if flags else p
        parts.append(f"(?=.*(?{flags}:{p}))" if flags else f"(?=.*(?:{p}))")
    return "(?s)" + "".join(parts)


def snapshot(opt, extra_params=()):
    """Params, their grads and decoupled grads, every state entry (moments, masters,
    scales, anything else) and every group's settings, copied."""
    params = [p for group in opt.param_groups for p in group["params"]]
    params += [p for p in extra_params if all(p is not q for q in params)]
    return {
        "params": [(p, _clone(p)) for p in params],
        "grads": [_clone(p.grad) for p in params],
        "decoupled": [_clone(getattr(p, "decoupled_grad", None)) for p in params],
        "state_keys": [id(p) for p in opt.state],
        # An entry put there from outside may be no dict: kept as it is.
        "state": [(p, {k: _clone(v) for k, v in opt.state[p].items()}
                   if isinstance(opt.state[p], dict) else opt.state[p])
                  for p in params if p in opt.state],
        "scales": [(p, {k: _clone(v) for k, v in state_tensors(opt, p).items()
                        if k.endswith("_scale")})
                   for p in params if isinstance(opt.state.get(p), dict)],
        "scale_keys": [id(p) for p in getattr(opt, "_scales", {})],
        # The formats states were stored in and the masters that follow their
        # parameters (S1.6), recorded per parameter beside the state.
        "formats": [(id(p), dict(f)) for p, f in getattr(opt, "_formats", {}).items()],
        "seeded_keys": [id(p) for p in getattr(opt, "_seeded", {})],
        # The groups whose moments were set by hand before their first step (S5.5).
        "moments_set": sorted(map(id, getattr(opt, "_moments_set", ()))),
        "groups": [{k: (_clone(v) if k != "params" else [id(q) for q in v])
                    for k, v in group.items()} for group in opt.param_groups],
    }


def _assert_same_value(a, b, what):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), \
            f"{what}: {type(a).__name__} vs {type(b).__name__}"
        assert_bitwise_equal(a, b, what)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{what}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_value(x, y, f"{what}[{i}]")
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        assert math.isnan(b), f"{what}: {a!r} != {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{what}: {a!r} != {b!r}"


def assert_unchanged(opt, before, what="optimizer"):
    """Bitwise comparison of `opt` now against snapshot `before`."""
    after = snapshot(opt, [p for p, _ in before["params"]])
    assert len(after["params"]) == len(before["params"]), f"{what}: params added/removed"
    for i, ((p, old), (q, new)) in enumerate(zip(before["params"], after["params"])):
        assert p is q, f"{what}: param {i} replaced"
        assert_bitwise_equal(new, old, f"{what}: param {i}")
    for key in ("grads", "decoupled"):
        for i, (old, new) in enumerate(zip(before[key], after[key])):
            _assert_same_value(new, old, f"{what}: {key} of param {i}")
    assert after["state_keys"] == before["state_keys"], \
        f"{what}: optimizer.state keys changed"
    assert after["scale_keys"] == before["scale_keys"], f"{what}: scale entries changed"
    assert after["formats"] == before["formats"], f"{what}: recorded formats changed"
    assert after["seeded_keys"] == before["seeded_keys"], f"{what}: seeded masters changed"
    assert after["moments_set"] == before["moments_set"], \
        f"{what}: groups marked with moments set changed"
    for (p, old), (q, new) in zip(before["scales"], after["scales"]):
        assert p is q
        assert sorted(new) == sorted(old), f"{what}: scales {sorted(new)} != {sorted(old)}"
        for key in old:
            _assert_same_value(new[key], old[key], f"{what}: {key}")
    for (p, old), (q, new) in zip(before["state"], after["state"]):
        assert p is q
        if not isinstance(old, dict) or not isinstance(new, dict):
            _assert_same_value(new, old, f"{what}: state entry")
            continue
        assert sorted(new) == sorted(old), \
            f"{what}: state names {sorted(new)} != {sorted(old)}"
        for key in old:
            _assert_same_value(new[key], old[key], f"{what}: state {key}")
    assert len(after["groups"]) == len(before["groups"]), f"{what}: param_groups changed"
    for i, (old, new) in enumerate(zip(before["groups"], after["groups"])):
        assert sorted(new) == sorted(old), f"{what}: group {i} keys changed"
        for key in old:
            _assert_same_value(new[key], old[key], f"{what}: group {i} {key}")


def assert_same_optimizer_state(a, b, params_a, params_b, what):
    """Two optimizers hold bitwise the same params, state and group steps."""
    for i, (p, q) in enumerate(zip(params_a, params_b)):
        assert_bitwise_equal(q.detach(), p.detach(), f"{what}: param {i}")
        sa, sb = state_tensors(a, p), state_tensors(b, q)
        assert sorted(sa) == sorted(sb), f"{what}: param {i} state names"
        for key in sa:
            assert_bitwise_equal(sb[key], sa[key], f"{what}: param {i} {key}")
    for i, (ga, gb) in enumerate(zip(a.param_groups, b.param_groups)):
        assert ga["step"] == gb["step"], \
            f"{what}: group {i} step {gb['step']} != {ga['step']}"


@contextlib.contextmanager
def backend_context(name):
    from shardadam import _backend

    with _backend.use_backend(name):
        yield


def fused_adam():
    from shardadam import FusedAdam

    return FusedAdam


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def run_precision_steps(opt, params, cfg, hyper, steps, first_step, seed, what,
                        check=True):
    """Takes `steps` steps with the test's gradients, checking each against the
    reference; returns the gradients used (for replaying the same run)."""
    dtypes = [cfg.grad_dtype(p.dtype) for p in params]
    used = []
    for step in range(first_step, first_step + steps):
        grads = make_grads(params, dtypes, step, seed)
        attach_grads(params, grads, cfg.decoupled)
        inputs = capture_inputs(opt, params) if check else None
        opt.step()
        assert opt.param_groups[0]["step"] == step, \
            f"{what}: group step {opt.param_groups[0]['step']} after step {step}"
        if check:
            verify_step(opt, params, inputs, grads, hyper, step, what)
        used.append(grads)
    return used


# S2.9's overflow bounds, from its text: (2 - 2^-(m+1)) · 2^127 for m mantissa bits.
OVERFLOW = {"fp8-block": (2 - 2.0 ** -4) * 2.0 ** 127, "ufp8-block": (2 - 2.0 ** -5) * 2.0 ** 127,
            "fp4-block": (2 - 2.0 ** -2) * 2.0 ** 127, "ufp4-block": (2 - 2.0 ** -2) * 2.0 ** 127}


def _power_of_two_scales(u: torch.Tensor, first: int, block: int, bound: float,
                         zero_max: float, overflow: float):
    """S2.9's block scales in float64 Python: per block (keyed from flat index `first`),
    the smallest power of two s in [2^-126, 2^127] with max|u| / s <= bound; 1 for a
    non-finite max, one <= zero_max, or one >= overflow. Yields (start, end, s) in u's
    own indices."""
    start = 0
    while start < u.numel():
        end = min(u.numel(), ((first + start) // block + 1) * block - first)
        a = u[start:end].double().abs().max().item()
        if not math.isfinite(a) or a <= zero_max or a >= overflow:
            s = 1.0
        else:
            e = -126
            while a > bound * 2.0 ** e:
                e += 1
            s = 2.0 ** e
        yield start, end, s
        start = end


# S2.10's finite unsigned E4M4 values, increasing with the code (0 .. 0xFE).
UFP8_VALUES = torch.tensor([m * 2.0 ** -10 if c >> 4 == 0 else (16 + m) * 2.0 ** ((c >> 4) - 11)
                            for c in range(255) for m in [c & 15]], dtype=torch.float64)


def ufp8_codes(x: torch.Tensor, u: Optional[torch.Tensor] = None) -> torch.Tensor:
    """S2.10's encode of |x| (fp32) by search over every finite code: the nearest, ties
    to the even code; beyond 488, inf and NaN 0xFF; code 0 only where the true value
    ``u`` (x / its scale; x itself if not given) is zero, also where x underflowed."""
    a = x.double().abs().reshape(-1, 1)
    distance = (UFP8_VALUES.view(1, -1) - a).abs()
    nearest = distance == distance.min(dim=1, keepdim=True).values
    odd = (torch.arange(255) & 1).bool().view(1, -1)
    # the even code where two tie, else the only one
    code = torch.where(nearest & ~odd, 0, 1).argmin(dim=1)
    code = torch.where(nearest.sum(dim=1) == 1, nearest.to(torch.int64).argmax(dim=1), code)
    true = a.view(-1) if u is None else u.double().abs().reshape(-1)
    code = torch.where((code == 0) & (true > 0), 1, code)
    code = torch.where(a.view(-1) <= 488.0, code, 0xFF)  # NaN compares false too
    return code.to(torch.uint8)


# E4M3's finite magnitudes, increasing with the code (0 .. 0x7E): k * 2^-9 below 8, then
# (8 + M) * 2^(E - 10).
E4M3_VALUES = torch.tensor([c * 2.0 ** -9 if c >> 3 == 0 else (8 + (c & 7)) * 2.0 ** ((c >> 3) - 10)
                            for c in range(127)], dtype=torch.float64)


def e4m3_codes(x: torch.Tensor) -> torch.Tensor:
    """S2.4's fp32 -> E4M3 by search over the finite magnitudes: the nearest, ties to
    the even code; beyond 464 (the tie between 448 and 480 goes to 448), inf and NaN
    0x7F; each with x's sign bit. (torch's own conversion saturates from 2.13 on.)"""
    a = x.double().abs().reshape(-1)
    high = torch.searchsorted(E4M3_VALUES, a).clamp(max=126)  # the first value >= a
    low = (high - 1).clamp(min=0)
    below, above = a - E4M3_VALUES[low], E4M3_VALUES[high] - a
    code = torch.where((above < below) | ((above == below) & (high % 2 == 0)), high, low)
    code = torch.where(a <= 464.0, code, 0x7F)  # NaN compares false too
    code = code | (torch.signbit(x.reshape(-1)).to(torch.int64) << 7)
    return code.to(torch.uint8).view(x.shape)


def block8_decode(codes, scales, first, block, unsigned):
    """Block8 codes decoded here (S2.9, S2.10): E4M3 through torch's float8_e4m3fn,
    unsigned E4M4 by UFP8_VALUES (0xFF: NaN), times each element's block scale, blocks
    keyed from flat index `first`; float32, shaped like the codes."""
    flat = codes.reshape(-1)
    if unsigned:
        table = torch.cat([UFP8_VALUES, torch.tensor([math.nan], dtype=torch.float64)])
        units = table[flat.to(torch.int64)]
    else:
        units = flat.view(torch.float8_e4m3fn).double()
    blocks = (first + torch.arange(flat.numel())) // block - first // block
    return (units * scales.double()[blocks]).float().view(codes.shape)


def ufp8_block_oracle(u: torch.Tensor, first: int, block: int):
    """S2.10 in float64 Python, block by block: S2.9's scales with bound 488, 1 only for
    a zero or non-finite max, and the searched codes of u / s."""
    codes, scales = [], []
    for start, end, s in _power_of_two_scales(u, first, block, 488.0, 0.0,
                                              OVERFLOW["ufp8-block"]):
        # fp32 division by a power of two, which may underflow: zero-free on u
        codes.append(ufp8_codes(u[start:end] / s, u[start:end]))
        scales.append(s)
    return torch.cat(codes), torch.tensor(scales, dtype=torch.float32)


def fp8_block_oracle(u: torch.Tensor, first: int, block: int):
    """S2.9 in float64 Python, block by block (scale: the smallest power of two in
    [2^-126, 2^127] with max|u| / s <= 464; 1 for a non-finite max, one <= 2^-136 or
    one >= the overflow bound), codes by S2.4's E4M3 rounding."""
    codes, scales = [], []
    for start, end, s in _power_of_two_scales(u, first, block, 464.0, 2.0 ** -136,
                                              OVERFLOW["fp8-block"]):
        codes.append(e4m3_codes(u[start:end] / s))
        scales.append(s)
    return torch.cat(codes), torch.tensor(scales, dtype=torch.float32)


# S2.12's 4-bit maps, written from the rule's text.

def fp4_value(code: int) -> float:
    """S2.12's signed E2M1 by its fields: magnitude E = 0 is M/2, else (2+M)·2^(E-2);
    bit 3 the sign; 0x8 (where -0 would be) is NaN."""
    if code == 0x8:
        return math.nan
    e, m = (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else (2 + m) * 2.0 ** (e - 2)
    return -mag if code & 8 else mag


def ufp4_value(code: int) -> float:
    """S2.12's unsigned E3M1: E = 0 is M/8, else (2+M)·2^(E-4); 0xF is NaN."""
    if code == 0xF:
        return math.nan
    e, m = code >> 1, code & 1
    return m * 0.125 if e == 0 else (2 + m) * 2.0 ** (e - 4)


def nearest(values: dict, a: float) -> int:
    """The code whose value is nearest to ``a``, ties to the even code (the last code
    at or beyond its value: float64 differences of huge ``a`` would all tie)."""
    last = max(values)
    if a >= values[last]:
        return last
    return min(values, key=lambda c: (abs(values[c] - a), c & 1))


FP4_MAGNITUDES = {c: fp4_value(c) for c in range(8)}
# Magnitude code 8 stands for 8, where rounding to even sends 7 and above: NaN.
FP4_ROUNDING = {**FP4_MAGNITUDES, 8: 8.0}
UFP4_VALUES = {c: ufp4_value(c) for c in range(15)}
# Code 15 would be 24: rounding there (above 20) is NaN.
UFP4_ROUNDING = {**UFP4_VALUES, 15: 24.0}


def fp4_oracle(x: float) -> int:
    if math.isnan(x) or math.isinf(x):
        return 0x8
    mag = nearest(FP4_ROUNDING, abs(x))
    if mag == 8:
        return 0x8
    return mag | 8 if mag and math.copysign(1.0, x) < 0 else mag


def ufp4_oracle(x: float, u: float) -> int:
    if math.isnan(x) or math.isinf(x):
        return 0xF
    code = nearest(UFP4_ROUNDING, abs(x))
    return 1 if code == 0 and u != 0 else code


def block4_oracle(name: str, u: torch.Tensor, first: int, block: int):
    """S2.12 block by block: the smallest power of two s in [2^-126, 2^127] with
    max|u| / s below the map's bound (fp4: < 7; ufp4: <= 20); 1 for a non-finite max,
    one >= the overflow bound, and for fp4 one <= 0.25 · 2^-126 (all codes 0 at every
    scale); codes of u / s."""
    codes, scales, start = [], [], 0
    while start < u.numel():
        end = min(u.numel(), ((first + start) // block + 1) * block - first)
        part = u[start:end]
        a = part.double().abs().max().item()
        fits = (lambda q: q < 7.0) if name == "fp4-block" else (lambda q: q <= 20.0)
        zero = 0.25 * 2.0 ** -126 if name == "fp4-block" else 0.0
        if not math.isfinite(a) or a <= zero or a >= OVERFLOW[name]:
            s = 1.0
        else:
            e = -126
            while not fits(a / 2.0 ** e):
                e += 1
            s = 2.0 ** e
        x = (part / s).tolist()  # fp32 division by a power of two, as the core's
        if name == "fp4-block":
            row = [fp4_oracle(v) for v in x]
        else:
            row = [ufp4_oracle(v, w) for v, w in zip(x, part.tolist())]
        codes.append(torch.tensor(row, dtype=torch.uint8))
        scales.append(s)
        start = end
    return torch.cat(codes), torch.tensor(scales, dtype=torch.float32)


def fp4_block_oracle(u: torch.Tensor, first: int, block: int):
    """``block4_oracle`` of S2.12's signed map, in the block8 oracles' signature."""
    return block4_oracle("fp4-block", u, first, block)


def ufp4_block_oracle(u: torch.Tensor, first: int, block: int):
    """``block4_oracle`` of S2.12's unsigned map, in the block8 oracles' signature."""
    return block4_oracle("ufp4-block", u, first, block)
