"""Rank-side helpers shared by the distributed jobs: presets, deterministic data, bitwise
and rounding-bounded comparisons, layout checks, collective counting, manual DTensor runs.

Everything that compares gathered (full) tensors runs on every rank with the same data, so
a mismatch fails on every rank together; per-rank checks go through ``symmetric`` so one
rank's failure is raised on all ranks and nobody is left waiting in a collective.
"""

import contextlib
import itertools
import math
import os
import sys
import traceback
import zlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import _dist_cases

# The shared numeric helpers (fp32 error bounds, format grids) sit one directory up.
_PYTHON_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _PYTHON_TESTS not in sys.path:
    sys.path.insert(0, _PYTHON_TESTS)

from _optimizer_testing import (  # noqa: E402
    ABS_SLACK, SCALED_FORMATS, TORCH_DTYPE, U, expected_scale, stored_bound)

DTYPES = TORCH_DTYPE  # a format's name -> the dtype the constructor takes and stores
# The scaled formats, by the dtype they are stored in.
SCALED_DTYPES = {TORCH_DTYPE[name]: name for name in SCALED_FORMATS}

# Optimizer hyper-parameters: defaults, and per group (group 1 differs in everything).
OPT_DEFAULTS = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
GROUP_HP = ({}, dict(lr=3e-3, betas=(0.8, 0.95), weight_decay=0.0))


def fused_adam():
    from shardadam import FusedAdam

    return FusedAdam


# --------------------------------------------------------------------------- presets


class Preset:
    """A configuration from ``_dist_cases.PRESETS`` turned into dtypes and constructor kwargs."""

    def __init__(self, preset_id):
        self.id = preset_id
        param, master, moments = _dist_cases.PRESETS[preset_id]
        self.param_dtype = DTYPES[param]
        self.master = master
        self.moments = moments

    def kwargs(self):
        kw = dict(exp_avg_dtype=DTYPES[self.moments], exp_avg_sq_dtype=DTYPES[self.moments])
        if self.master == "remainder":
            kw.update(master_weights=True, store_param_remainders=True)
        elif self.master is not None:
            kw.update(master_weights=True, master_weight_dtype=DTYPES[self.master])
        return kw

    def fp32_state_kwargs(self):
        """Same configuration with every scaled state kept in fp32 (the one-step oracle)."""
        kw = self.kwargs()
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype", "master_weight_dtype"):
            if kw.get(name) in SCALED_DTYPES:
                kw[name] = torch.float32
        return kw

    def state_names(self, param_dtype):
        names = ["exp_avg", "exp_avg_sq"]
        if self.master is not None and param_dtype != torch.float32:
            names.append("master_param")  # S2.1: fp32 parameters never get a master
        return names

    def storage_dtype(self, name):
        """The dtype of the raw stored tensor (S2.2)."""
        if name == "master_param":
            return torch.int16 if self.master == "remainder" else DTYPES[self.master]
        return DTYPES[self.moments]

    def true_dtype(self, name):
        """The dtype of the value ``state_dict()`` exposes (S5.4)."""
        return torch.int16 if name == "master_param" and self.master == "remainder" \
            else torch.float32

    def is_scaled(self, name):
        return self.storage_dtype(name) in SCALED_DTYPES

    @property
    def has_scaled_state(self):
        return any(self.is_scaled(n) for n in self.state_names(self.param_dtype))


# ------------------------------------------------------------------ deterministic data


def seed_of(*parts):
    """A seed from readable parts; identical on every rank and across runs."""
    return zlib.crc32("/".join(map(str, parts)).encode())


def full_param(shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(shape, generator=g)).to(dtype)


def full_grad(shape, seed, dtype):
    # Magnitudes spread over several decades so per-shard scales (S2.3) differ from the
    # full tensor's and small values reach the fp16/fp8 subnormal range.
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.exp(2.0 * torch.randn(shape, generator=g))
            ).to(dtype)


def local_of(tensor):
    """The local tensor of a DTensor (the tensor itself when plain), detached. Under no_grad
    ``to_local()`` returns the stored local tensor directly instead of going through
    autograd, which is both faster and the object FSDP2 updates in place."""
    with torch.no_grad():
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()


def shard_of(full, like):
    """The part of ``full`` that ``like`` (a DTensor) holds on this rank; no communication."""
    return distribute_tensor(full, like.device_mesh, like.placements,
                             src_data_rank=None).to_local()


def gather(dt):
    """``full_tensor()`` as a copy (for Replicate it may alias the live local tensor); int16
    travels as fp16 bits because gloo has no int16 collectives."""
    if dt.dtype == torch.int16:
        bits = DTensor.from_local(dt.to_local().view(torch.float16), dt.device_mesh,
                                  dt.placements, shape=dt.shape, stride=dt.stride())
        return bits.full_tensor().view(torch.int16).clone()
    return dt.full_tensor().clone()


def _shard_dim(placement):
    """The sharded tensor dim of a placement (a Placement or "S0"/"S1"/"R"), else None."""
    if isinstance(placement, str):
        return int(placement[1:]) if placement.startswith("S") else None
    return placement.dim if placement.is_shard() else None


def region_indices(shape, mesh_shape, placements):
    """Flat indices of the part of a tensor of ``shape`` each mesh coordinate holds, in
    DTensor's chunking (torch.chunk: ceil-sized chunks, missing trailing ones empty);
    lets every rank evaluate per-shard quantities without communication."""
    index = torch.arange(math.prod(shape)).view(shape)
    regions = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        part = index
        for size, c, placement in zip(mesh_shape, coord, placements):
            dim = _shard_dim(placement)
            if dim is not None:
                chunks = torch.chunk(part, size, dim=dim)
                part = chunks[c] if c < len(chunks) else part.narrow(dim, 0, 0)
        regions[coord] = part.flatten()
    return regions


def _pack(tensor):
    """A tensor as plain bytes: object collectives pickle these far faster than tensors."""
    data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return str(tensor.dtype), tuple(tensor.shape), data


def _unpack(packed):
    dtype, shape, data = packed
    dtype = getattr(torch, dtype.split(".")[1])
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)


def assemble(locals_by_rank, like, regions):
    """The global tensor of DTensor ``like`` from every rank's local tensor, each rank's
    part at the flat indices ``regions[rank]`` (replicas must agree bitwise)."""
    full = torch.empty(like.shape, dtype=like.dtype)
    flat = full.view(-1)
    seen = torch.zeros(flat.numel(), dtype=torch.bool)
    bits = _BITS[like.dtype]
    for rank, region in regions.items():
        local = locals_by_rank[rank].reshape(-1)
        assert local.numel() == region.numel(), \
            f"rank {rank} holds {local.numel()} elements, its shard has {region.numel()}"
        if seen[region].any():  # a replica: must be bitwise the same as the one kept
            assert torch.equal(flat[region].view(bits), local.view(bits)), \
                f"replicas differ (rank {rank})"
        flat[region] = local
        seen[region] = True
    return full


def chunk_regions(like):
    """``{rank: flat indices}`` of DTensor ``like``'s shards by DTensor's chunking rule."""
    mesh = like.device_mesh.mesh
    return {int(mesh[coord]): region for coord, region in
            region_indices(like.shape, tuple(mesh.shape), like.placements).items()}


def wrap_like(local, like):
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape,
                              stride=like.stride())


# ------------------------------------------------------------------------ comparisons

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
         torch.int16: torch.int16, torch.uint8: torch.uint8, torch.int32: torch.int32,
         torch.float64: torch.int64}  # an fp64 gradient: bad input, compared unchanged


def assert_bitwise(actual, expected, what):
    """Same dtype, shape and bits (NaN payloads included)."""
    assert isinstance(actual, torch.Tensor) and not isinstance(actual, DTensor), \
        f"{what}: expected a local/plain tensor, got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, \
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    bits = _BITS[actual.dtype]
    diff = actual.contiguous().view(bits) != expected.contiguous().view(bits)
    if diff.any():
        idx = diff.nonzero()[0].tolist()
        a, e = actual.float(), expected.float()
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {diff.numel()} elements differ bitwise; first at "
            f"{idx}: {a[tuple(idx)].item()!r} != {e[tuple(idx)].item()!r}; "
            f"max |diff| {(a - e).abs().max().item():.3e}")


def rounding_bound(u, storage):
    """Largest |true value - u| after one store of the fp32 values ``u`` (one local shard)
    in the scaled format ``storage``, read back as the fp32 true value ``state_dict()``
    exposes (S2.2, S5.4). Float64.

    Derivation (S2.3): s = max(a / R, tiny) over the LOCAL shard (1 when empty, zero or
    not finite), as ``expected_scale`` computes it. The code is q = rne(fl(u / s)):
    the division rounds once (U |u / s|, or to q itself when it crosses up to a power of
    two), the store rounds to nearest, within half the format's spacing at |u / s|. So
    |q s - u| <= s * half_spacing(|u| / s) + U |u| -- ``stored_bound`` with a zero
    compute error. The true value fl(q * s) rounds once more: U |q s| (q s <= |u| plus
    the above) and, among fp32 subnormals, ABS_SLACK. Nothing here covers a scale other
    than S2.3's (e.g. a * (1 / R)) or a store that does not round to nearest: S2.3 forbids
    both. The full-tensor reference has one scale for the whole tensor, the sharded run
    one per local shard, so the bound is evaluated per shard.
    """
    u = u.float()
    fmt = SCALED_DTYPES[storage]
    exact = u.double()
    s = expected_scale(u, fmt)
    quantized = stored_bound(fmt, exact, exact, torch.zeros_like(exact), scale=s)
    return quantized + U * (exact.abs() + quantized) + ABS_SLACK


def assert_within(actual, expected, bound, what):
    assert actual.shape == expected.shape, \
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).abs()
    bad = ~(err <= bound.double())
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        t = tuple(idx)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements outside the one-rounding "
            f"bound; first at {idx}: {actual[t].item()!r} vs {expected[t].item()!r} "
            f"(|diff| {err[t].item():.3e} > bound {bound[t].item():.3e})")


def symmetric(fn, *args, **kwargs):
    """Run a per-rank check everywhere; raise the same error on every rank if any rank
    failed, else return every rank's return value (one object collective in all)."""
    try:
        value, message = fn(*args, **kwargs), None
    except AssertionError as error:
        value, message = None, str(error) or repr(error)
    except Exception:  # noqa: BLE001 - anything else is reported with its traceback
        value, message = None, traceback.format_exc()
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (value, message))
    by_message = {}
    for rank, (_, m) in enumerate(outcomes):
        if m is not None:
            by_message.setdefault(m, []).append(rank)
    if by_message:
        raise AssertionError("\n".join(f"rank(s) {ranks}: {m}" for m, ranks in by_message.items()))
    return [v for v, _ in outcomes]


def same_on_all_ranks(value, what):
    values = symmetric(lambda: value)
    assert all(v == values[0] for v in values), f"{what} differs between ranks: {values}"


# ---------------------------------------------------------------------- layout checks


def check_state_layout(state, param, dtype, what):
    """S2.6: a DTensor with the parameter's mesh, placements, global shape and stride whose
    local tensor has the parameter's local shape and device and the given dtype."""
    assert isinstance(state, DTensor), \
        f"{what}: expected a DTensor like its parameter, got {type(state).__name__}"
    assert state.device_mesh == param.device_mesh, f"{what}: mesh differs from the parameter's"
    assert tuple(state.placements) == tuple(param.placements), \
        f"{what}: placements {state.placements} != parameter's {param.placements}"
    assert state.shape == param.shape, \
        f"{what}: global shape {tuple(state.shape)} != parameter's {tuple(param.shape)}"
    assert state.stride() == param.stride(), \
        f"{what}: global stride {state.stride()} != parameter's {param.stride()}"
    local, plocal = local_of(state), local_of(param)
    assert local.shape == plocal.shape, \
        f"{what}: local shape {tuple(local.shape)} != parameter's {tuple(plocal.shape)}"
    assert local.device == plocal.device, \
        f"{what}: local device {local.device} != parameter's {plocal.device}"
    assert local.dtype == dtype, f"{what}: local dtype {local.dtype}, configured {dtype}"


def check_raw_entry(opt, param, preset, what):
    """S2.2 / S2.3: ``optimizer.state[param]`` holds exactly the storage tensors (no
    scales: DCP's flattened load expects a saved value for every key there), and
    ``optimizer._scales[param]`` holds a plain 0-dim fp32 scale, on the local tensor's
    device, for exactly the fp16 / fp8 states (per local shard, never a DTensor)."""
    names = preset.state_names(param.dtype)
    assert sorted(opt.state.get(param, {})) == sorted(names), \
        f"{what}: optimizer.state keys {sorted(opt.state.get(param, {}))}, expected {names}"
    scaled = sorted(n for n in names if preset.is_scaled(n))
    scales = opt._scales.get(param, {})
    assert sorted(scales) == scaled, \
        f"{what}: optimizer._scales keys {sorted(scales)}, expected {scaled}"
    for name, scale in scales.items():
        assert type(scale) is torch.Tensor and scale.dtype == torch.float32 \
            and scale.dim() == 0 and scale.device == local_of(param).device, \
            f"{what}: scale of {name} must be a plain local 0-dim fp32 tensor, got " \
            f"{type(scale).__name__} {getattr(scale, 'dtype', None)} " \
            f"{tuple(getattr(scale, 'shape', ()))}"


def raw_state(opt, param):
    """Every stored tensor of a parameter, local: the storage in ``optimizer.state`` under
    its name, and each scale in ``optimizer._scales`` under ``scale:<name>``."""
    out = {k: local_of(v) for k, v in opt.state.get(param, {}).items()
           if isinstance(v, torch.Tensor)}
    for k, v in opt._scales.get(param, {}).items():
        out[f"scale:{k}"] = v
    return out


def set_raw_state(opt, param, raw):
    """Clones of ``raw_state`` tensors into a plain-tensor optimizer of the same
    configuration (its storage and scales, which already exist, are replaced)."""
    for key, value in raw.items():
        if key.startswith("scale:"):
            opt._scales[param][key[len("scale:"):]] = value.clone()
        else:
            opt.state[param][key] = value.clone()


# ------------------------------------------------------------------ collective counting

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_PY_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "all_reduce_coalesced", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "irecv", "isend", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "new_group",
)


class _DispatchCounter(TorchDispatchMode):
    """Counts dispatcher ops of the c10d / functional-collective namespaces. DTensor-typed
    calls are handed back to DTensor first (NotImplemented) so the collectives a DTensor op
    would issue are seen when it re-dispatches on local tensors."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_collectives(profile=False):
    """Yields a list that ends up holding every collective issued inside the block, seen by
    three independent witnesses: the dispatcher (c10d and functional-collective ops), the
    Python API of torch.distributed (patched), and -- with ``profile`` -- the profiler's
    gloo/c10d events."""
    calls = []
    originals = []
    modules = (dist, dist.distributed_c10d)
    for module in modules:
        for name in _PY_COLLECTIVES:
            original = getattr(module, name, None)
            if original is None:
                continue

            def counting(*a, __name=name, __original=original, **kw):
                calls.append(f"torch.distributed.{__name}")
                return __original(*a, **kw)

            originals.append((module, name, original))
            setattr(module, name, counting)
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    mode = _DispatchCounter()
    try:
        with mode:
            yield calls
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
        calls.extend(f"dispatch:{c}" for c in mode.calls)
        if prof is not None:
            prof.__exit__(None, None, None)
            for event in prof.events():
                name = event.name
                if name.startswith(("gloo:", "nccl:", "c10d::", "_c10d_functional::")) \
                        or "ProcessGroup" in name:
                    calls.append(f"profiler:{name}")


# ------------------------------------------------------------------- manual DTensor runs

_PLACEMENT = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}


class ParamSpec:
    """One parameter of a manual run: name, global shape, mesh shape, placements, group."""

    def __init__(self, name, shape, placements, group=0, mesh_shape=None):
        self.name = name
        self.shape = tuple(shape)
        self.placements = tuple(placements)
        self.group = group
        self.mesh_shape = mesh_shape

    def __repr__(self):
        return f"{self.name}{list(self.shape)}@{'/'.join(self.placements)}"


def layout_specs(layout, world_size):
    """The parameters of a numerics case: dim-0 sizes {1, W-1, W, W+1, 7} so that some ranks
    hold empty shards; 1-D and 2-D; group 1 holds the size-1 parameters, which are empty on
    every rank but one (a whole group empty on most ranks)."""
    if layout.startswith("mesh=2x2"):
        # Replicated over mesh dim 0, sharded over mesh dim 1 (2 shards).
        n_shards, mesh_shape = 2, (2, 2)
    else:
        n_shards, mesh_shape = world_size, None
    sizes = sorted({1, n_shards - 1, n_shards, n_shards + 1, 7} - {0})
    specs = []
    for n in sizes:
        group = 1 if n == 1 else 0
        if layout == "Shard(0)":
            specs += [ParamSpec(f"vec{n}", (n,), ("S0",), group),
                      ParamSpec(f"mat{n}x3", (n, 3), ("S0",), group)]
        elif layout == "Shard(1)":
            specs += [ParamSpec(f"mat3x{n}", (3, n), ("S1",), group)]
        elif layout == "Replicate":
            specs += [ParamSpec(f"vec{n}", (n,), ("R",), group),
                      ParamSpec(f"mat{n}x3", (n, 3), ("R",), group)]
        else:
            specs += [ParamSpec(f"vec{n}", (n,), ("R", "S0"), group, mesh_shape),
                      ParamSpec(f"mat{n}x3", (n, 3), ("R", "S0"), group, mesh_shape)]
    # Group 0 first: the first parameter is the one left without a gradient at one step.
    return sorted(specs, key=lambda s: s.group)


def mixed_specs(world_size):
    """A bit of every layout in one optimizer (for checks that are not about numerics)."""
    w = world_size
    specs = [ParamSpec("vec7", (7,), ("S0",)), ParamSpec(f"mat{w + 1}x3", (w + 1, 3), ("S0",)),
             ParamSpec("vec1", (1,), ("S0",)), ParamSpec("mat3x5", (3, 5), ("S1",)),
             ParamSpec("rep4x3", (4, 3), ("R",), group=1)]
    if w == 4:
        specs.append(ParamSpec("mesh2x2_5x3", (5, 3), ("R", "S0"), 1, mesh_shape=(2, 2)))
    return specs


class ManualRun:
    """DTensor parameters built by hand from full values generated identically on every
    rank, a FusedAdam over them, and gradients set by hand each step."""

    def __init__(self, ctx, preset, specs, tag, *, opt_kwargs=None, full_params=None):
        from torch import nn

        self.ctx = ctx
        self.preset = preset
        self.specs = list(specs)
        self.tag = tag
        self.params = {}
        self.full_params = {}
        for spec in self.specs:
            mesh = ctx.mesh(spec.mesh_shape)
            if full_params is not None:
                full = full_params[spec.name].clone()
            else:
                full = full_param(spec.shape, seed_of(tag, spec.name), preset.param_dtype)
            self.full_params[spec.name] = full
            if spec.placements == ("plain",):
                self.params[spec.name] = nn.Parameter(full.clone())
                continue
            placements = [_PLACEMENT[p] for p in spec.placements]
            self.params[spec.name] = nn.Parameter(
                distribute_tensor(full, mesh, placements, src_data_rank=None))
        self.module = nn.Module()
        self.module.params = nn.ParameterDict(self.params)
        self.opt_kwargs = dict(OPT_DEFAULTS, **preset.kwargs(), **(opt_kwargs or {}))
        self.opt = fused_adam()(self.groups(self.params), **self.opt_kwargs)

    def groups(self, params):
        out = []
        for g, hp in enumerate(GROUP_HP):
            members = [params[s.name] for s in self.specs if s.group == g]
            if members:
                out.append(dict(params=members, **hp))
        return out

    def ordered_names(self):
        """Parameter names in optimizer order (the index used by ``state_dict()``)."""
        return [s.name for g in range(len(GROUP_HP)) for s in self.specs if s.group == g]

    def full_grads(self, step):
        return {s.name: full_grad(s.shape, seed_of(self.tag, "grad", s.name, step),
                                  self.preset.param_dtype) for s in self.specs}

    @property
    def grad_attr(self):
        return "decoupled_grad" if self.opt_kwargs.get("use_decoupled_grad") else "grad"

    def set_grads(self, full_grads, skip=()):
        """Each parameter's gradient: its full gradient laid out like the parameter."""
        for name, p in self.params.items():
            grad = full_grads.get(name)
            if name in skip or grad is None:
                grad = None
            elif isinstance(p, DTensor):
                grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
            setattr(p, self.grad_attr, grad)

    def local_grads(self, full_grads):
        return {n: shard_of(g, self.params[n]) if isinstance(self.params[n], DTensor) else g
                for n, g in full_grads.items()}

    def step(self, check=True):
        """``optimizer.step()`` with every collective counted; the count must be 0 (S3.3).
        With ``check=False`` the caller checks the returned list (to save a collective)."""
        with count_collectives() as calls:
            self.opt.step()
        if check:
            symmetric(_assert_no_calls, calls, "optimizer.step()")
        return calls

    def mesh_shape(self, name):
        return tuple(self.params[name].device_mesh.shape)

    def regions(self, name):
        """``{rank: flat indices of the full tensor}`` that each rank holds of ``name``."""
        return chunk_regions(self.params[name])

    def check_layouts(self, sd):
        """S2.6 / S5.4 for every parameter: the names, and each ``state_dict()`` value and
        raw ``optimizer.state`` tensor laid out like its parameter, in the right dtype."""
        for i, name in enumerate(self.ordered_names()):
            p = self.params[name]
            expected = self.preset.state_names(p.dtype)
            entry = sd["state"].get(i, {})
            assert sorted(entry) == sorted(expected), \
                f"state_dict()['state'][{i}] ({name}) holds {sorted(entry)}, expected {expected}"
            for sname in expected:
                check_state_layout(entry[sname], p, self.preset.true_dtype(sname),
                                   f"state_dict() value {name}.{sname}")
                check_state_layout(self.opt.state.get(p, {}).get(sname), p,
                                   self.preset.storage_dtype(sname),
                                   f"optimizer.state[{name}][{sname!r}]")
            check_raw_entry(self.opt, p, self.preset, name)

    def gather(self, use_full_tensor=False):
        """Full parameters, full ``state_dict()`` values and group steps, on every rank.

        Layouts are checked first (S2.6, S5.4). With ``use_full_tensor`` every value goes
        through ``DTensor.full_tensor()``; otherwise the local tensors of all ranks travel in
        one object collective and are assembled by DTensor's chunking rule (``assemble``),
        which is the same result for the layouts just checked, at a fraction of the
        collectives (one instead of one per tensor). Replicas must agree bitwise.
        """
        sd = self.opt.state_dict()
        names = self.ordered_names()

        def local_parts():
            self.check_layouts(sd)
            if use_full_tensor:
                return None
            parts = {}
            for i, n in enumerate(names):
                parts[n, None] = _pack(local_of(self.params[n]))
                for sname in self.preset.state_names(self.params[n].dtype):
                    parts[n, sname] = _pack(local_of(sd["state"][i][sname]))
            return parts

        per_rank = symmetric(local_parts)

        def full(key, dt):
            return gather(dt) if use_full_tensor else \
                assemble([_unpack(r[key]) for r in per_rank], dt, self.regions(key[0]))

        out = {"params": {n: full((n, None), self.params[n].detach()) for n in names},
               "state": {}, "steps": [g["step"] for g in sd["param_groups"]]}
        for i, name in enumerate(names):
            p = self.params[name]
            out["state"][name] = {sname: full((name, sname), sd["state"][i][sname])
                                  for sname in self.preset.state_names(p.dtype)}
        return out

    def check_raw_against_full(self, ref_raw):
        """Raw stored tensors of unscaled states equal the full reference's, shard by shard
        (fp16 / fp8 codes only mean something with their own per-shard scale)."""
        for name in self.ordered_names():
            p = self.params[name]
            for sname in self.preset.state_names(p.dtype):
                if not self.preset.is_scaled(sname):
                    assert_bitwise(local_of(self.opt.state[p][sname]),
                                   shard_of(ref_raw[name][sname], p),
                                   f"optimizer.state[{name}][{sname!r}] (local vs full run)")


def _assert_no_calls(calls, where):
    assert not calls, f"{where} communicated: {calls}"


class PlainReference:
    """The same optimizer on plain tensors: the full tensors in one process (``full``), or
    this rank's local shards (``local``), fed the same gradients."""

    def __init__(self, run, tensors, kwargs):
        from torch import nn

        self.run = run
        self.names = run.ordered_names()
        self.params = {n: nn.Parameter(tensors[n].detach().clone()) for n in self.names}
        # Gradients of another dtype than the parameter only pass as decoupled_grad.
        self.grad_attr = "decoupled_grad" if run.grad_attr == "decoupled_grad" else "grad"
        kwargs = dict(kwargs, use_decoupled_grad=self.grad_attr == "decoupled_grad")
        self.opt = fused_adam()(run.groups(self.params), **kwargs)

    def load(self, snapshot):
        """Put a gathered snapshot (params, true state values, steps) into this optimizer."""
        with torch.no_grad():
            for n in self.names:
                self.params[n].copy_(snapshot["params"][n])
        sd = self.opt.state_dict()
        for i, n in enumerate(self.names):
            for sname, value in snapshot["state"][n].items():
                sd["state"][i][sname] = value.clone()
        for group, step in zip(sd["param_groups"], snapshot["steps"]):
            group["step"] = step
            # Masters written in by hand: not the ones that followed (S5.4), at step 0.
            group["state_layout"] = group["state_layout"].replace(" masters=follow", "")
        self.opt.load_state_dict(sd)

    def copy_raw_from(self, run):
        """Take the sharded run's stored local tensors (codes and scales) as they are: a
        scale re-derived from already rounded values may differ by an ulp from the one
        the sharded optimizer derived while loading."""
        for n in self.names:
            set_raw_state(self.opt, self.params[n], raw_state(run.opt, run.params[n]))

    def step(self, grads, skip=()):
        for n in self.names:
            g = grads.get(n)
            setattr(self.params[n], self.grad_attr, None if n in skip or g is None else g.clone())
        self.opt.step()

    def snapshot(self, raw=True):
        sd = self.opt.state_dict()
        out = {"params": {n: self.params[n].detach().clone() for n in self.names},
               "state": {}, "raw": {}, "steps": [g["step"] for g in sd["param_groups"]]}
        for i, n in enumerate(self.names):
            out["state"][n] = {k: v.clone() for k, v in sd["state"][i].items()}
            if raw:  # every stored tensor, scales included
                out["raw"][n] = {k: v.clone()
                                 for k, v in raw_state(self.opt, self.params[n]).items()}
        return out


def _grad_record(grad):
    """What a gradient attribute holds, for a bitwise comparison later: the object
    itself (identity), its kind and layout, and a copy of its (local) bits."""
    if grad is None:
        return None
    record = {"object": grad, "type": type(grad).__name__, "dtype": grad.dtype,
              "shape": tuple(grad.shape), "stride": grad.stride()}
    if isinstance(grad, DTensor):
        record.update(mesh=grad.device_mesh, placements=tuple(grad.placements))
    record["local"] = local_of(grad).clone()
    return record


def local_snapshot(run):
    """This rank's local view of a manual run: params, their ``grad`` and
    ``decoupled_grad`` (S3.2: read, never written), ``state_dict()`` values, raw storage."""
    sd = run.opt.state_dict()
    out = {"params": {}, "grads": {}, "decoupled_grads": {}, "state": {}, "raw": {},
           "steps": [g["step"] for g in sd["param_groups"]]}
    for i, n in enumerate(run.ordered_names()):
        p = run.params[n]
        out["params"][n] = local_of(p).clone()
        out["grads"][n] = _grad_record(p.grad)
        out["decoupled_grads"][n] = _grad_record(getattr(p, "decoupled_grad", None))
        out["state"][n] = {k: local_of(v).clone()
                           for k, v in sd["state"].get(i, {}).items()}
        out["raw"][n] = {k: v.clone() for k, v in raw_state(run.opt, p).items()}
    return out


def _assert_same_grad(actual, expected, what):
    if expected is None or actual is None:
        assert actual is None and expected is None, \
            f"{what}: {'set' if actual is not None else 'None'}, was " \
            f"{'set' if expected is not None else 'None'}"
        return
    assert actual["object"] is expected["object"], f"{what}: replaced by another tensor"
    for key in ("type", "dtype", "shape", "stride", "placements"):
        assert actual.get(key) == expected.get(key), \
            f"{what}: {key} {actual.get(key)} != {expected.get(key)}"
    assert actual.get("mesh") == expected.get("mesh"), f"{what}: device mesh changed"
    assert_bitwise(actual["local"], expected["local"], f"{what} (local bits)")


def assert_snapshots_bitwise(actual, expected, what):
    assert actual["steps"] == expected["steps"], \
        f"{what}: group steps {actual['steps']} != {expected['steps']}"
    for n, value in expected["params"].items():
        assert_bitwise(actual["params"][n], value, f"{what}: param {n}")
    for part, label in (("grads", "grad"), ("decoupled_grads", "decoupled_grad")):
        for n, record in expected.get(part, {}).items():
            _assert_same_grad(actual[part][n], record, f"{what}: {n}.{label}")
    for part in ("state", "raw"):
        for n, states in expected.get(part, {}).items():
            assert sorted(actual[part][n]) == sorted(states), \
                f"{what}: {part} names of {n}: {sorted(actual[part][n])} != {sorted(states)}"
            for sname, value in states.items():
                assert_bitwise(actual[part][n][sname], value, f"{what}: {part} {n}.{sname}")


def compare_full(run, got, ref, what):
    """Compare a gathered sharded run with a full-tensor reference (same data on all ranks,
    so a mismatch fails on every rank at once).

    Parameters bitwise; ``state_dict()`` values bitwise, except scaled states (fp16 / fp8),
    which must lie within one rounding of the reference's value at the sharded run's
    per-shard scale (``rounding_bound``: half a storage spacing plus the fp32 roundings,
    evaluated for every shard's region).
    """
    assert got["steps"] == ref["steps"], f"{what}: group steps {got['steps']} != {ref['steps']}"
    for n, value in ref["params"].items():
        assert_bitwise(got["params"][n], value, f"{what}: param {n} (full)")
    for n, states in got["state"].items():
        for sname, value in states.items():
            expected = ref["state"][n][sname]
            label = f"{what}: state_dict() {n}.{sname} (full)"
            if run.preset.is_scaled(sname):
                storage = run.preset.storage_dtype(sname)
                bound = torch.empty(expected.numel(), dtype=torch.float64)
                flat = expected.reshape(-1)
                for region in run.regions(n).values():
                    bound[region] = rounding_bound(flat[region], storage)
                assert_within(value, expected, bound.view(expected.shape), label)
            else:
                assert_bitwise(value, expected, label)
