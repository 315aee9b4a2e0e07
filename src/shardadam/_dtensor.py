"""Every DTensor concern of the optimizer, in one place (SEMANTICS S1.4, S2.6, S3.3).

The arithmetic only ever sees local tensors. A parameter's distributed layout is a
``Layout`` (mesh, placements, global shape and stride) or ``PLAIN`` for a plain tensor;
the rest of the optimizer holds one per parameter and asks it to wrap a local state
tensor back into the parameter's layout (``wrap``) or to say why a tensor does not fit
it (``*_error``: a sentence, or None). ``to_local`` gives the local tensor of anything;
``GradCheck`` checks and unwraps a batch's gradients at every step.

Nothing here communicates: no redistribution, no ``run_check``, no ``full_tensor``.

Private torch APIs, used here only:

* ``DTensor(local, DTensorSpec(...), requires_grad=False)``: the public
  ``DTensor.from_local`` moves the local tensor to the mesh's device type, which would
  move the states of a CPU-offloaded parameter (FSDP2 keeps CPU local tensors under a
  CUDA mesh) to the GPU; the constructor wraps the local tensor as it is.
* ``DeviceMesh._shard_order`` (set by Megatron FSDP, not torch): checked to be an order
  of the mesh's dims; the optimizer never needs the order itself.
* ``DTensor._local_tensor`` / ``DTensor._spec`` (and the spec's ``mesh``,
  ``placements``, ``tensor_meta``) on the per-step path: what the public ``to_local()``
  returns under ``torch.no_grad()`` and what ``device_mesh`` / ``placements`` /
  ``shape`` read, without a Python call per parameter per step (attribute reads on a
  DTensor cost several times more than on a plain tensor).
* ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``: the shape
  and global offset of torch's chunk at this rank's coordinate, which keys per-block
  scales of FSDP2's shards (S2.11) without communication.
* ``torch.distributed.tensor.placement_types._StridedShard``: the placement FSDP2 gives
  a dimension that tensor parallelism splits too. Up to torch 2.10 it derives from
  ``Shard`` (so ``is_shard()`` says it splits); from 2.11 it does not, and is recognised
  by its type.

Two attributes of another package are read: ``megatron_fsdp_slice`` and ``orig_param``,
which Megatron FSDP sets on each parameter it hands the optimizer (the flat range of the
module's tensor ``orig_param`` that this rank's shard holds, gathered when it built the
shards). Where ``orig_param`` is the whole parameter (no tensor parallelism split it) the
slice keys the per-block scales of its uneven shards (S2.11), once checked against the
local shape.
"""

from __future__ import annotations

import itertools
import operator
from typing import Optional

import torch

# Private attributes read on the per-step path (see the module docstring).
_local_tensor_of = operator.attrgetter("_local_tensor")
_spec_of = operator.attrgetter("_spec")
_mesh_of = operator.attrgetter("mesh")
_placements_of = operator.attrgetter("placements")
_shape_of = operator.attrgetter("tensor_meta.shape")

_dtensor_type = None
_spec_types = None


def _dtensor_class():
    """``torch.distributed.tensor.DTensor``, imported on first use (or a stand-in)."""
    global _dtensor_type
    if _dtensor_type is None:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # a torch build without torch.distributed
            class DTensor:  # noqa: D401 - nothing is ever an instance of it
                """No DTensor support in this torch build."""
        _dtensor_type = DTensor
    return _dtensor_type


def _spec_classes():
    """``(DTensorSpec, TensorMeta)``: private, see the module docstring."""
    global _spec_types
    if _spec_types is None:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        _spec_types = (DTensorSpec, TensorMeta)
    return _spec_types


def is_dtensor(tensor) -> bool:
    return isinstance(tensor, _dtensor_class())


def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor the kernels work on (the tensor itself when plain).

    Under ``no_grad`` ``to_local()`` returns the stored local tensor itself -- for FSDP2 a
    view into its flat shard buffer, which the update must write in place -- instead of
    an autograd view that in-place writes would refuse.
    """
    if type(tensor) is torch.Tensor or not is_dtensor(tensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def any_dtensor(tensors) -> bool:
    dtensor = _dtensor_class()
    return any(isinstance(t, dtensor) for t in tensors)


_dtype_of = operator.attrgetter("dtype")


def local_storage_keys(params, plain: bool) -> list:
    """What the optimizer's cached view of each parameter's local tensor rests on: data
    pointer, shape, strides, dtype and neg bit. Any of them changes when the storage is
    replaced or re-viewed (FSDP2 re-pointing a parameter at a new shard buffer,
    ``p.data = p.data[:n]``, a view of another shape over the same elements' first
    address and strides, a dtype view, a lazily negated view). ``plain``: the caller
    knows none is a DTensor. (The shape as a plain tuple: a torch.Size is a tuple the
    garbage collector never untracks, so a list of one per parameter sets off full
    collections.)"""
    if plain:
        tensors = params
    elif all(map(isinstance, params, itertools.repeat(_dtensor_class()))):
        tensors = list(map(_local_tensor_of, params))  # no Python frame per parameter
    else:  # plain and DTensor parameters mixed (by type: a plain tensor may carry any
        tensors = [to_local(p) for p in params]  # attribute, `_local_tensor` included)
    return list(zip(map(torch.Tensor.data_ptr, tensors),
                    map(tuple, map(torch.Tensor.size, tensors)),
                    map(torch.Tensor.stride, tensors), map(_dtype_of, tensors),
                    map(torch.Tensor.is_neg, tensors)))


# ---------------------------------------------------------------------------
# Layouts.

def _mesh_text(mesh) -> str:
    # DeviceMesh's repr omits the ranks; two meshes of one shape differ only there.
    names = f", dims {tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
    return f"{mesh.device_type} mesh {mesh.mesh.tolist()}{names}"


def describe(tensor) -> str:
    """A tensor's layout in words (mesh ranks, placements, global shape), for errors."""
    if not is_dtensor(tensor):
        return f"a plain tensor of shape {list(tensor.shape)}"
    return (f"a DTensor on {_mesh_text(tensor.device_mesh)} with placements "
            f"{tuple(tensor.placements)} and global shape {list(tensor.shape)}")


def _megatron_slice(param) -> Optional[slice]:
    """Megatron FSDP's ``megatron_fsdp_slice`` of ``param`` (see the module docstring)
    where the tensor it counts elements of, ``orig_param``, has the parameter's global
    shape; None elsewhere. Under tensor parallelism that tensor is the rank's part of the
    parameter, and the slice does not locate the shard in the whole."""
    held = getattr(param, "megatron_fsdp_slice", None)
    orig = getattr(param, "orig_param", None)
    if (not isinstance(held, slice) or held.step is not None
            or type(held.start) is not int or type(held.stop) is not int
            or not isinstance(orig, torch.Tensor)
            or tuple(to_local(orig).shape) != tuple(param.shape)):
        return None
    return held


class _Plain:
    """The layout of a plain-tensor parameter: wrapping is the identity."""

    is_dtensor = False

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def state_error(self, stored) -> Optional[str]:
        if is_dtensor(stored):
            return (f"is {describe(stored)} but the parameter is a plain tensor (rule "
                    f"S3.3: a plain parameter's states are plain)")
        return None

    def first_index(self, local: torch.Tensor) -> int:
        """S2.11: a plain tensor is the whole parameter."""
        return 0

    def packable(self, local: torch.Tensor) -> bool:
        """S2.12: whether packed 4-bit states can hold ``local``: whole bytes per row."""
        return local.dim() >= 2 and local.shape[-1] % 2 == 0

    def of(self, fmt) -> "_Plain":
        """The layout of a state stored in ``fmt``: plain too."""
        return self


PLAIN = _Plain()


class Layout:
    """A DTensor parameter's layout; states are wrapped in exactly this (S2.6)."""

    is_dtensor = True

    def __init__(self, param):
        self.mesh = param.device_mesh
        self.placements = tuple(param.placements)
        self.shape = param.shape
        self.stride = param.stride()
        self.spec = param._spec  # gradients built from the same spec skip the compares
        self._specs = {}  # local dtype -> DTensorSpec shared by the states of that dtype
        self._first = {}  # local shape -> first_index
        self._megatron_slice = _megatron_slice(param)
        self._packed = None  # the layout of packed states (``of``)

    def first_index(self, local: torch.Tensor) -> int:
        """The flat index in the whole parameter of ``local``'s first element, which
        keys per-block scales (S2.11). Known without communication in two cases: a
        Megatron FSDP parameter whose ``megatron_fsdp_slice`` is ``local``'s run of
        whole rows (its start), and placements that are each Shard(0) or Replicate with
        the local tensor being torch's chunk (FSDP2's rows, also beside HSDP's replicate
        dimension: torch's global row offset times the row length). Any other layout
        (Shard(d > 0) or _StridedShard anywhere, a shard order, a local shape other than
        torch's chunk's, no such slice) keys blocks to the local tensor's own flat
        index: 0."""
        shape = tuple(local.shape)
        first = self._first.get(shape)
        if first is None:
            first = self._slice_first(shape)
            if first is None:
                first = self._chunk_first(shape)
            self._first[shape] = first
        return first

    def packable(self, local: torch.Tensor) -> bool:
        """S2.12: whether packed 4-bit states can hold the local tensor ``local``: two or
        more dimensions, an even last one, and no placement sharding the last dimension
        (the packed states are then sharded exactly like the parameter's rows)."""
        last = len(self.shape) - 1
        return (last >= 1 and self.shape[-1] % 2 == 0 and local.dim() == last + 1
                and not any(_splits(p, last) or _splits(p, -1) for p in self.placements))

    def of(self, fmt) -> "Layout":
        """The layout of a state stored in ``fmt``: this one, or for packed 4-bit codes
        (``packable`` parameters only) the same mesh and placements over the packed
        global shape, the last dimension halved."""
        if fmt is None or not fmt.packed:
            return self
        packed = self._packed
        if packed is None:
            packed = self._packed = Layout.__new__(Layout)
            packed.mesh, packed.placements = self.mesh, self.placements
            packed.shape = torch.Size(fmt.storage_shape(self.shape))
            packed.stride = torch.empty(packed.shape, device="meta").stride()
            packed.spec, packed._specs, packed._first = None, {}, {}
            packed._megatron_slice = None
            packed._packed = packed
        return packed

    def _row_length(self) -> int:
        row = 1
        for size in self.shape[1:]:
            row *= size
        return row

    def _slice_first(self, shape: tuple) -> Optional[int]:
        """The start of Megatron FSDP's slice where it is exactly ``shape``'s run of whole
        rows of the parameter, else None."""
        held = self._megatron_slice
        if (held is None or len(self.shape) == 0 or len(shape) != len(self.shape)
                or shape[1:] != tuple(self.shape[1:])):
            return None
        row = self._row_length()
        if (held.stop - held.start != shape[0] * row or held.start < 0
                or held.stop > self.shape[0] * row or (row and held.start % row)):
            return None
        return held.start

    def _chunk_first(self, shape: tuple) -> int:
        """The start of torch's chunk at this rank's coordinate where ``shape`` is its
        shape under placements that are each Shard(0) or Replicate (HSDP's replicate
        dimension adds nothing to the offset), else 0."""
        # Shard itself: a _StridedShard (FSDP2 beside tensor parallelism), which up to
        # torch 2.10 compares equal to Shard(0), holds rows that are not one run of the
        # parameter.
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if (len(self.shape) == 0 or getattr(self.mesh, "_shard_order", None) is not None
                or not all((type(p) is Shard and p.dim == 0) or type(p) is Replicate
                           for p in self.placements)):
            return 0

        chunk, offset = compute_local_shape_and_global_offset(
            self.shape, self.mesh, self.placements)
        if tuple(chunk) != shape or len(offset) == 0:
            return 0
        return int(offset[0]) * self._row_length()

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (local shape, on its own device) as a DTensor of this layout, with
        the parameter's global shape and stride: never derived from the local shard,
        whose size differs between ranks when the parameter is sharded unevenly."""
        spec = self._specs.get(local.dtype)
        if spec is None:
            spec_type, meta_type = _spec_classes()
            spec = spec_type(self.mesh, self.placements,
                             tensor_meta=meta_type(self.shape, self.stride, local.dtype))
            self._specs[local.dtype] = spec
        # Private constructor: DTensor.from_local would move `local` to the mesh's device.
        return _dtensor_class()(local, spec, requires_grad=False)

    def fits(self, tensor) -> bool:
        """Whether DTensor ``tensor`` has this mesh, placements and global shape (S3.3)."""
        return self.fits_spec(tensor._spec)

    def fits_spec(self, spec) -> bool:
        # Reads the spec only: attribute reads on a DTensor itself cost several times
        # more than on a plain object, and this runs per gradient per step.
        if spec is self.spec:
            return True
        meta = spec.tensor_meta
        return ((spec.mesh is self.mesh or spec.mesh == self.mesh)
                and tuple(spec.placements) == self.placements
                and meta is not None and meta.shape == self.shape)

    def describe(self) -> str:
        return (f"a DTensor on {_mesh_text(self.mesh)} with placements {self.placements} "
                f"and global shape {list(self.shape)}")

    def state_error(self, stored) -> Optional[str]:
        """Why ``stored`` cannot be this parameter's state (S2.6, S3.3), or None."""
        if not is_dtensor(stored):
            return f"is a plain tensor but the parameter is {self.describe()}"
        if not self.fits(stored) or stored.stride() != self.stride:
            return (f"is {describe(stored)} (global stride {stored.stride()}) but the "
                    f"parameter is {self.describe()} (global stride {self.stride})")
        return None


def layout_of(param: torch.Tensor):
    """``PLAIN`` or the ``Layout`` of a DTensor parameter."""
    return Layout(param) if is_dtensor(param) else PLAIN


class GradCheck:
    """One batch's gradients against its parameters' layouts (S3.3), cheaply per step.

    Works on the gradients' specs with C-level ``map``s rather than a Python loop per
    gradient, and remembers the last specs that fitted: FSDP2 gives every gradient its
    parameter's own spec object, which then needs no comparison at all.
    """

    def __init__(self, layouts: list):
        self.layouts = layouts
        self.all_dtensor = all(layout.is_dtensor for layout in layouts)
        self.known = [layout.spec if layout.is_dtensor else None for layout in layouts]
        if self.all_dtensor:
            self.meshes = [layout.mesh for layout in layouts]
            self.placements = [layout.placements for layout in layouts]
            self.shapes = [layout.shape for layout in layouts]

    def local_grads(self, grads: list) -> Optional[list]:
        """The local tensors of ``grads`` when every one is None or a DTensor that fits
        its parameter's layout; else None, and the caller checks each in full."""
        try:
            specs = list(map(_spec_of, grads))
        except AttributeError:  # a None or plain gradient somewhere
            return _local_grads_each(self.layouts, grads)
        if not all(map(operator.is_, specs, self.known)):
            if not self._fit(specs, grads):
                return None
            self.known = specs
        return list(map(_local_tensor_of, grads))

    def _fit(self, specs: list, grads: list) -> bool:
        dtensor = _dtensor_class()
        if not all(map(isinstance, grads, itertools.repeat(dtensor))):
            return False
        if not self.all_dtensor:
            return all(layout.is_dtensor and layout.fits_spec(spec)
                       for layout, spec in zip(self.layouts, specs))
        try:  # list equality compares elements by identity first, then ==
            return (list(map(_mesh_of, specs)) == self.meshes
                    and list(map(_placements_of, specs)) == self.placements
                    and list(map(_shape_of, specs)) == self.shapes)
        except AttributeError:  # a spec without tensor_meta
            return False


def _local_grads_each(layouts: list, grads: list) -> Optional[list]:
    dtensor = _dtensor_class()
    out = []
    for layout, grad in zip(layouts, grads):
        if grad is None:
            out.append(None)
        elif layout.is_dtensor and isinstance(grad, dtensor) and layout.fits(grad):
            out.append(grad._local_tensor)
        else:
            return None
    return out


# ---------------------------------------------------------------------------
# Checks (S1.4, S3.3, S5.3, S5.5).

def _splits(placement, dim=None) -> bool:
    """Whether ``placement`` splits dimension ``dim`` (any, for None) of the tensor:
    ``Shard``, and ``_StridedShard``, which torch 2.11 no longer derives from it."""
    if placement.is_shard(dim):
        return True
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard) and (dim is None or placement.dim == dim)


def param_layout_error(param: torch.Tensor) -> Optional[str]:
    """Why a DTensor parameter's placements cannot be stepped locally, or None."""
    if not is_dtensor(param):
        return None
    bad = [p for p in param.placements if not (_splits(p) or p.is_replicate())]
    if bad:
        return (f"DTensor parameters must have Shard(d) or Replicate placements (rule S1.4: "
                f"a Partial parameter still needs a reduction, which the optimizer does "
                f"not perform), got placements {tuple(param.placements)} on "
                f"{_mesh_text(param.device_mesh)}")
    order_error = _shard_order_error(param.device_mesh)
    if order_error is not None:
        return order_error
    local = to_local(param)
    if local.layout is not torch.strided:
        return f"sparse local tensors are not supported (layout {local.layout})"
    return _local_shape_error(param.shape, tuple(local.shape), param.placements)


def _local_shape_error(shape, local: tuple, placements) -> Optional[str]:
    """Why a local tensor of shape ``local`` cannot be a run of a global tensor of
    ``shape`` under ``placements``, or None: the kernels index the local tensor by the
    global shape (its rows, its packed last dimension), so a local tensor of another
    rank, or shorter in a dimension no placement splits, would be read past its end."""
    split = {p.dim for p in placements if _splits(p)}
    if len(local) != len(shape) or any(
            size > whole if dim in split or dim - len(shape) in split else size != whole
            for dim, (size, whole) in enumerate(zip(local, shape))):
        return (f"the local tensor's shape {list(local)} cannot be part of the global "
                f"shape {list(shape)} under placements {tuple(placements)} (rule S1.4: "
                f"the same number of dimensions, each as long as the global one unless a "
                f"placement splits it, then no longer)")
    return None


def _shard_order_error(mesh) -> Optional[str]:
    """Why Megatron FSDP's ``mesh._shard_order`` (the order in which a parameter's mesh
    dims split it; read by its checkpoint code, see the module docstring) is not one, or
    None. The update is elementwise, so any order steps the same; an attribute that names
    no order means the layout is not what this optimizer was built against."""
    order = getattr(mesh, "_shard_order", None)
    if order is None:
        return None
    try:
        valid = sorted(order) == list(range(mesh.ndim))
    except TypeError:
        valid = False
    if not valid:
        return (f"the mesh's _shard_order {order!r} is not an order of its {mesh.ndim} "
                f"dims (rule S1.4: Megatron FSDP's shard order names each mesh dim once) "
                f"on {_mesh_text(mesh)}")
    return None


def grad_layout_error(param: torch.Tensor, grad: torch.Tensor) -> Optional[str]:
    """Why ``grad``'s layout cannot update ``param`` (S3.3), or None."""
    if is_dtensor(param):
        layout = Layout(param)
        if not is_dtensor(grad):
            return (f"the gradient is {describe(grad)} but the parameter is "
                    f"{layout.describe()} (rule S3.3: a DTensor parameter needs a DTensor "
                    f"gradient of the same mesh, placements and global shape)")
        if not layout.fits(grad):
            return (f"the gradient is {describe(grad)} but the parameter is "
                    f"{layout.describe()} (rule S3.3: same mesh, placements and global "
                    f"shape; the optimizer does not redistribute)")
        return None
    if is_dtensor(grad):
        return (f"the gradient is {describe(grad)} but the parameter is a plain tensor of "
                f"shape {list(param.shape)} (rule S3.3: a plain parameter needs a plain "
                f"gradient)")
    return None


def value_layout_error(param: torch.Tensor, value: torch.Tensor) -> Optional[str]:
    """Why ``value`` cannot be stored as ``param``'s state (S5.3, S5.5), or None.

    A DTensor value must have the parameter's mesh, placements and global shape (its
    local tensor is then this rank's part). A plain value is taken as this rank's local
    part; its shape is checked against the local shape by the caller, so a full-size
    plain value for a sharded parameter is refused unless the shard is the whole tensor.
    """
    if is_dtensor(value):
        if not is_dtensor(param):
            return (f"the value is {describe(value)} but the parameter is a plain tensor "
                    f"of shape {list(param.shape)} (rule S5.3: a plain parameter takes a "
                    f"plain value, its local part)")
        layout = Layout(param)
        if not layout.fits(value):
            return (f"the value is {describe(value)} but the parameter is "
                    f"{layout.describe()} (rule: same mesh, placements and global shape; "
                    f"the optimizer does not redistribute)")
    return None
