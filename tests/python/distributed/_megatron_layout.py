"""Megatron FSDP's shard layout, built by hand (no Megatron import), for the optimizer tests.

What Megatron FSDP (``megatron_fsdp`` 0.6, ``param_and_grad_buffer.py``) hands an
optimizer, and FSDP2 never does:

* every parameter of a bucket lives in ONE flat buffer: parameters with the longest rows
  first, each starting at a multiple of its own row length (small ones fill the gaps
  alignment leaves), the whole padded to a multiple of (number of shards) x LCM(row
  lengths). Shard k owns the flat elements ``[k*S, (k+1)*S)``. So a shard holds a run of
  whole rows of any length (3 rows of one weight, none of the next, all of a bias), and a
  rank can own nothing at all;
* each parameter is ``nn.Parameter(DTensor.from_local(view, mesh, placements,
  run_check=False, shape=global shape, stride=global stride))`` where ``view`` is a view of
  this rank's part of the flat buffer (non-zero storage offset). The optimizer must
  update that memory in place: Megatron copies from the flat buffer afterwards;
* gradients are DTensor views of a flat gradient buffer laid out the same way, None where
  the local shard is empty, and the same DTensor object is reused every step with its
  ``_local_tensor`` swapped (here: alternating between two gradient buffers, so a stale
  cached pointer would read last step's gradient).

Mesh kinds (``MESH_KINDS``): ``dp`` 1-D ``[Shard(0)]``; ``no_shard`` ``[Replicate()]``;
``hsdp`` (dp_outer, dp_shard) with ``[Replicate(), Shard(0)]``; ``hfsdp`` (dp_outer, dp_shard)
with ``[Shard(0), Shard(0)]`` and ``mesh._shard_order = [1, 0]``: shard over dp_shard
first, then each of those over dp_outer (``uneven_dtensor.gather_and_compute_chunk_metadata``
walks the mesh dims in that order), so shard index = dp_shard coordinate x dp_outer size +
dp_outer coordinate.

``MegatronRun`` is ``ManualRun`` (``_dist_helpers``) on this layout: the same references
and comparisons apply, with ``regions`` giving each rank's flat indices of a parameter.
"""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from _dist_helpers import (
    OPT_DEFAULTS, ManualRun, ParamSpec, _pack, _unpack, assemble, assert_bitwise,
    fused_adam, full_grad, full_param, local_of, seed_of, symmetric)

MESH_KINDS = ("dp", "no_shard", "hsdp", "hfsdp")

# Rows of 24, 8, 4, 3 and 1 elements: LCM 24. "odd" starts at a multiple of 3, and "tiny"
# fills the gap that leaves. At world size 3 the data (91 elements) ends inside shard 1 of
# 48 elements, so rank 2 owns nothing; at 2 shard 0 holds 3 of the 5 rows of "embed",
# shard 1 the other 2; group 1 holds small vectors only, empty on most ranks.
SPECS = (ParamSpec("head", (1, 24), ()), ParamSpec("embed", (5, 8), ()),
         ParamSpec("proj", (3, 4), ()), ParamSpec("odd", (2, 3), ()),
         ParamSpec("bias", (4,), ()), ParamSpec("norm", (3,), (), group=1),
         ParamSpec("tiny", (1,), (), group=1))

# What the buffers hold outside every parameter: NaN bits no update writes.
_PAD_BITS = {torch.float32: 0x7FC0DEAD, torch.bfloat16: 0x7FDE, torch.float16: 0x7EAD}
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def row_length(shape):
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def pack(specs, n_shards):
    """``({name: flat start}, shard size)`` by Megatron's rule (module docstring)."""
    order = sorted(specs, key=lambda s: (-row_length(s.shape), -math.prod(s.shape)))
    starts, gaps, end = {}, [], 0  # gaps: [lo, hi) left free by alignment
    for spec in order:
        row, numel = row_length(spec.shape), math.prod(spec.shape)
        for i, (lo, hi) in enumerate(gaps):
            start = -(-lo // row) * row
            if start + numel <= hi:
                starts[spec.name] = start
                gaps[i:i + 1] = [g for g in ((lo, start), (start + numel, hi)) if g[0] < g[1]]
                break
        else:
            start = -(-end // row) * row
            if start > end:
                gaps.append((end, start))
            starts[spec.name] = start
            end = start + numel
    unit = n_shards * math.lcm(*(row_length(s.shape) for s in specs))
    return starts, -(-end // unit) * unit // n_shards


class Placement:
    """A mesh kind at a world size: mesh shape and dim names, placements, shard count."""

    def __init__(self, kind, world_size):
        assert kind in MESH_KINDS, kind
        self.kind = kind
        if kind in ("hsdp", "hfsdp"):
            assert world_size % 2 == 0, f"{kind} needs an even world size"
            self.mesh_shape, self.names = (2, world_size // 2), ("dp_outer", "dp_shard")
        else:
            self.mesh_shape, self.names = (world_size,), ("dp",)
        self.placements = {"dp": [Shard(0)], "no_shard": [Replicate()],
                           "hsdp": [Replicate(), Shard(0)],
                           "hfsdp": [Shard(0), Shard(0)]}[kind]
        self.n_shards = {"dp": world_size, "no_shard": 1, "hsdp": world_size // 2,
                         "hfsdp": world_size}[kind]

    def shard_index(self, coord):
        """The shard a mesh coordinate holds."""
        if self.kind == "dp":
            return coord[0]
        if self.kind == "no_shard":
            return 0
        if self.kind == "hsdp":
            return coord[1]
        return coord[1] * self.mesh_shape[0] + coord[0]  # hfsdp, shard order [1, 0]

    def mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", self.mesh_shape, mesh_dim_names=self.names)


class MegatronRun(ManualRun):
    """``ManualRun`` on Megatron FSDP's layout: one flat parameter buffer per rank and two
    gradient buffers, parameters and gradients as DTensor views of them."""

    def __init__(self, ctx, preset, kind, tag, *, grad_dtype=None, decoupled=True,
                 opt_kwargs=None, specs=SPECS, full_params=None):
        self.ctx = ctx
        self.preset = preset
        self.specs = list(specs)
        self.tag = tag
        self.layout = Placement(kind, ctx.world_size)
        self.mesh_ = self.layout.mesh()
        self.shard = self.layout.shard_index(self.mesh_.get_coordinate())
        self.starts, self.shard_size = pack(self.specs, self.layout.n_shards)
        dtype = preset.param_dtype
        self.grad_dtype = grad_dtype or dtype
        self.buffer = self._buffer(dtype)
        self.grad_buffers = [self._buffer(self.grad_dtype) for _ in range(2)]
        self.params, self.full_params, self.grad_objects = {}, {}, {}
        for spec in self.specs:
            full = (full_params[spec.name].clone() if full_params is not None
                    else full_param(spec.shape, seed_of(tag, spec.name), dtype))
            self.full_params[spec.name] = full
            local = self.local_view(self.buffer, spec)
            local.copy_(self._local_part(full, spec))
            self.params[spec.name] = nn.Parameter(self._wrap(local, spec))
        self.module = nn.Module()
        self.module.params = nn.ParameterDict(self.params)
        kwargs = dict(OPT_DEFAULTS, **preset.kwargs(), use_decoupled_grad=decoupled)
        self.opt_kwargs = dict(kwargs, **(opt_kwargs or {}))
        self.opt = fused_adam()(self.groups(self.params), **self.opt_kwargs)
        self.steps_taken = 0

    # ------------------------------------------------------------------ the layout

    def _buffer(self, dtype):
        bits = torch.full((self.shard_size,), _PAD_BITS[dtype], dtype=_INT[dtype])
        return bits.view(dtype)

    def _range(self, spec, shard):
        """``[lo, hi)`` of ``spec``'s flat elements held by ``shard`` (whole rows)."""
        start = self.starts[spec.name]
        lo = max(start, shard * self.shard_size)
        hi = min(start + math.prod(spec.shape), (shard + 1) * self.shard_size)
        return (lo - start, hi - start) if lo < hi else (0, 0)

    def local_view(self, buffer, spec, shard=None):
        shard = self.shard if shard is None else shard
        lo, hi = self._range(spec, shard)
        offset = self.starts[spec.name] + lo - shard * self.shard_size
        view = buffer[offset:offset + hi - lo] if hi > lo else buffer[:0]
        return view.view(-1, *spec.shape[1:])

    def _local_part(self, full, spec):
        lo, hi = self._range(spec, self.shard)
        return full.reshape(-1)[lo:hi].view(-1, *spec.shape[1:])

    def _wrap(self, local, spec):
        # Megatron's own construction (param_and_grad_buffer.py): from_local with the
        # global shape and stride, no check.
        dtensor = DTensor.from_local(local, self.mesh_, self.layout.placements,
                                     run_check=False, shape=torch.Size(spec.shape),
                                     stride=torch.empty(spec.shape).stride())
        if self.layout.kind == "hfsdp":
            # On the mesh object the spec holds: torch may reuse an equal one.
            dtensor.device_mesh._shard_order = [1, 0]
        return dtensor

    def regions(self, name):
        spec = next(s for s in self.specs if s.name == name)
        mesh = self.mesh_.mesh
        out = {}
        for coord in zip(*(t.reshape(-1).tolist() for t in torch.meshgrid(
                *(torch.arange(n) for n in mesh.shape), indexing="ij"))):
            lo, hi = self._range(spec, self.layout.shard_index(coord))
            out[int(mesh[coord])] = torch.arange(lo, hi)
        return out

    def mesh_shape(self, name):
        return tuple(self.mesh_.shape)

    def gather(self, use_full_tensor=False):
        # Always this layout's own assembly: DTensor.full_tensor() assumes torch's
        # chunking, which these shards do not follow.
        return super().gather(use_full_tensor=False)

    # ------------------------------------------------------------------ gradients

    def set_grads(self, full_grads, skip=()):
        """Write this rank's part of each gradient into the next gradient buffer and point
        the parameter's (reused) gradient DTensor at it; None on an empty local shard."""
        buffer = self.grad_buffers[self.steps_taken % 2]
        self.steps_taken += 1
        for spec in self.specs:
            p, grad = self.params[spec.name], full_grads.get(spec.name)
            local = self.local_view(buffer, spec)
            if spec.name in skip or grad is None or local.numel() == 0:
                setattr(p, self.grad_attr, None)
                continue
            local.copy_(self._local_part(grad, spec))
            obj = self.grad_objects.get(spec.name)
            if obj is None:
                obj = self.grad_objects[spec.name] = self._wrap(local, spec)
            else:
                obj._local_tensor = local  # Megatron swaps the local tensor in place
            setattr(p, self.grad_attr, obj)

    def full_grads(self, step):
        return {s.name: full_grad(s.shape, seed_of(self.tag, "grad", s.name, step),
                                  self.grad_dtype) for s in self.specs}

    def local_grads(self, full_grads):
        return {s.name: self._local_part(full_grads[s.name], s) for s in self.specs
                if s.name in full_grads}

    # ------------------------------------------------------------------ checks

    def check_raw_against_full(self, ref_raw):
        for spec in self.specs:
            p = self.params[spec.name]
            for sname in self.preset.state_names(p.dtype):
                if not self.preset.is_scaled(sname):
                    assert_bitwise(local_of(self.opt.state[p][sname]),
                                   self._local_part(ref_raw[spec.name][sname], spec),
                                   f"optimizer.state[{spec.name}][{sname!r}] (local vs "
                                   f"full run)")

    def check_buffers(self, what):
        """Each parameter's update is in the flat buffer itself (its local tensor is still
        the view made at the start), and nothing outside the parameters' views changed:
        the padding keeps its NaN bits."""
        used = torch.zeros(self.shard_size, dtype=torch.bool)
        for spec in self.specs:
            local = self.params[spec.name]._local_tensor
            view = self.local_view(self.buffer, spec)
            assert local.data_ptr() == view.data_ptr() and local.shape == view.shape, \
                f"{what}: {spec.name}'s local tensor is no longer its flat-buffer view"
            lo, hi = self._range(spec, self.shard)
            offset = self.starts[spec.name] + lo - self.shard * self.shard_size
            used[offset:offset + hi - lo] = True
        bits = self.buffer.view(_INT[self.buffer.dtype])
        pad = bits[~used]
        assert bool((pad == _PAD_BITS[self.buffer.dtype]).all()), \
            f"{what}: {int((pad != _PAD_BITS[self.buffer.dtype]).sum())} padding elements " \
            f"of the flat buffer were written"

    def gather_values(self, tensors):
        """Full tensors from every rank's local parts of ``{name: DTensor}`` (this layout's
        own assembly: DTensor.full_tensor() assumes torch's chunking)."""
        per_rank = symmetric(lambda: {n: _pack(t._local_tensor) for n, t in tensors.items()})
        return {n: assemble([_unpack(r[n]) for r in per_rank], t, self.regions(n))
                for n, t in tensors.items()}
