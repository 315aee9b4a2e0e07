"""Every user-facing check of FusedAdam, run before anything is mutated (SEMANTICS S3.1).

Errors name the class, the group and parameter index (and the parameter's name when
the group carries ``param_names``), the rule, and the offending value (S8). Types follow
Transformer Engine and torch: ``RuntimeError`` for unsupported configurations, dtypes
and layouts, ``ValueError`` for bad hyper-parameter values and malformed state dicts,
``KeyError`` for unknown state names or parameters.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
import sys
import types
from collections.abc import Collection, Iterable, Mapping, Sized
from typing import Optional

import torch

from . import _dtensor, _formats, _state
from ._memory import extent, short_storage
from ._formats import PARAM_TAGS
from ._state import StateConfig

CLASS_NAME = "FusedAdam"


def place(group: Optional[int] = None, param: Optional[int] = None,
          name: Optional[str] = None) -> str:
    """``"group 0, param 3 ('fc.weight')"``, or what of it is known."""
    parts = []
    if group is not None:
        parts.append(f"group {group}")
    if param is not None:
        # A name that is not a string (a tensor, put in param_names by mistake) is
        # shown as shown() shows values: never its contents (S8).
        shown_name = repr(name) if isinstance(name, str) else shown(name)
        parts.append(f"param {param}" + (f" ({shown_name})" if name is not None else ""))
    return ", ".join(parts)


def where(group: Optional[int] = None, param: Optional[int] = None,
          name: Optional[str] = None) -> str:
    """``"FusedAdam: group 0, param 3 ('fc.weight')"``-style prefix of a message."""
    at = place(group, param, name)
    return CLASS_NAME + (": " + at if at else "")


def param_name(group: dict, index: int) -> Optional[str]:
    names = group.get("param_names")  # anything but a list or tuple names nothing
    if isinstance(names, (list, tuple)) and index < len(names):
        return names[index]
    return None


def fail(exc_type, rule: str, *, group=None, param=None, name=None):
    """An exception of ``exc_type`` whose message starts with ``where``."""
    return exc_type(f"{where(group, param, name)}: {rule}")


_SHOWN_MAX = 200  # characters of a value's repr in a message: a log line, not a dump


def shown(value) -> str:
    """``value`` as an error message may show it: never a tensor's contents (S8: a model
    tensor given by mistake must not reach the logs), only its kind, dtype and shape,
    and its value when it holds a single element of a plain local tensor (a DTensor's
    would need communication, a meta tensor has none). A numpy array likewise; a value
    whose repr could print one (``_hidden``) by its kind (and length); anything else as
    its repr, cut at ``_SHOWN_MAX`` characters."""
    if not isinstance(value, torch.Tensor):
        if _is_array(value):
            # An array's repr is its contents, which may be a model's (as a tensor's).
            return f"a numpy array of dtype {value.dtype} and shape {list(value.shape)}"
        why = _hidden(value)
        text = repr(value) if why is None else ""
        if why is None and not _is_numpy(value) and any(map(text.__contains__,
                                                            _CONTENTS_MARKS)):
            why = "its repr could show tensor contents"  # held where no scan looks
        if why is not None:
            kind = type(value).__name__
            try:
                count = len(value) if isinstance(value, Sized) else None
            except Exception:  # noqa: BLE001 - a length that cannot be read is left out
                count = None
            if count is not None:
                kind += f" of {count} {'item' if count == 1 else 'items'}"
            return f"a {kind}, {why}"
        return text if len(text) <= _SHOWN_MAX else (
            f"{text[:_SHOWN_MAX]}... ({type(value).__name__}, {len(text)} characters)")
    kind = "a DTensor" if _dtensor.is_dtensor(value) else "a tensor"
    text = f"{kind} of dtype {value.dtype} and shape {list(value.shape)}"
    if value.is_meta:
        text += " on the meta device"
    elif value.numel() == 1 and kind == "a tensor":
        text += f" holding {value.item()!r}"
    return text


# How a tensor's (any subclass's, a DTensor's local one) and an array's repr begin.
_CONTENTS_MARKS = ("tensor(", "array(")
_HIDDEN_SCAN = 10_000  # values looked through for tensors before a value is not shown
# Values whose repr prints none of what they hold (or that hold nothing).
_LEAVES = (str, bytes, bytearray, numbers.Number, type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.dtype,
           torch.device)


def _is_numpy(value) -> bool:
    return type(value).__module__ == "numpy"


def _is_array(value) -> bool:
    return _is_numpy(value) and bool(getattr(value, "ndim", 0))


def _hidden(value) -> Optional[str]:
    """Why ``value``'s repr may not be shown (it could print a tensor's or an array's
    contents): "tensors among them" where it holds one, at any depth, in a collection,
    a mapping (keys too) or the attributes its repr prints (``SimpleNamespace``,
    dataclasses); "too large to look through" past ``_HIDDEN_SCAN`` values, or where
    looking fails. None where it holds none."""
    stack, seen, budget = [value], set(), _HIDDEN_SCAN
    try:
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor) or _is_array(item):
                return "tensors among them"
            if isinstance(item, _LEAVES) or _is_numpy(item) or id(item) in seen:
                continue  # (a numpy value that is no array: one number)
            seen.add(id(item))
            for child in _held(item):
                budget -= 1
                if budget < 0:
                    return "too large to look through"
                stack.append(child)
    except Exception:  # noqa: BLE001 - a container that cannot be read is not shown
        return "too large to look through"
    return None


def _held(item):
    """What ``item``'s repr may print of its own: a mapping's keys and values, a
    collection's items, else the attributes of an object with a repr of its own."""
    if isinstance(item, Mapping):
        return itertools.chain(item.keys(), item.values())
    if isinstance(item, Collection):
        return iter(item)
    if type(item).__repr__ is object.__repr__:
        return ()  # its address only
    attributes = getattr(item, "__dict__", None)
    held = list(attributes.values()) if isinstance(attributes, dict) else []
    for cls in type(item).__mro__:
        slots = getattr(cls, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if hasattr(item, name):
                held.append(getattr(item, name))
    return held


# ---------------------------------------------------------------------------
# Constructor and hyper-parameters (S1.2).

def check_options(*, amsgrad, capturable, master_weights, master_weight_dtype,
                  exp_avg_dtype, exp_avg_sq_dtype) -> None:
    if amsgrad:
        raise RuntimeError("FusedAdam does not support the AMSGrad variant "
                           f"(rule: amsgrad must be False, got {shown(amsgrad)}).")
    if capturable:
        raise RuntimeError("FusedAdam does not support capturable mode "
                           f"(rule: capturable must be False, got {shown(capturable)}).")
    check_master_dtype(master_weights, master_weight_dtype)
    names, dtypes = _spelled("moment")
    for name, dtype in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
        if _formats.configured(dtype, "moment") is None:
            raise RuntimeError(
                f"FusedAdam only supports {names} {name} (rule: {name}_dtype "
                f"in {dtypes}, got {shown(dtype)}{_fp8_hint(dtype)}).")


def _array_note(value, cast: str) -> str:
    """What to pass instead of a numpy 0-d array, which torch's optimizers take as a
    number; "" for anything else."""
    if (type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"
            and value.ndim == 0):
        return f" (a numpy 0-d array is not taken: pass {cast}(x))"
    return ""


def check_flag(name: str, value, group_index: Optional[int] = None) -> None:
    """A switch, read by truth value as TE reads it: a bool, or an int 0 or 1 (numpy's
    bools and ints included). Anything else is refused: a string above all ("False" is
    true)."""
    if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):
        return  # numpy.bool_, which is no numbers.Integral (a 0-d array is not taken:
        # it can change in place, where settings are re-read by identity, S1.5)
    raise fail(ValueError, f"{name} must be a bool (rule: True/False, or an int 0 or 1), "
                           f"got {shown(value)}{_array_note(value, 'bool')}",
               group=group_index)


# The settings FusedAdam keeps as attributes of the whole optimizer (beyond torch's
# defaults): a parameter group cannot change them.
OPTIMIZER_SETTINGS = ("adam_w_mode", "capturable", "master_weights", "master_weight_dtype",
                      "exp_avg_dtype", "exp_avg_sq_dtype", "use_decoupled_grad",
                      "store_param_remainders", "moment_format", "moment_block_size",
                      "param_rounding")


# Options of torch.optim.Adam / AdamW that FusedAdam does not have. A group read from
# a torch checkpoint holds them: checked (check_loaded_options), then dropped.
TORCH_OPTIONS = ("amsgrad", "maximize", "decoupled_weight_decay", "capturable", "foreach",
                 "fused", "differentiable")
_GROUP_MAY_SET = "a group may set lr, betas, eps, weight_decay and bias_correction"
# The whole optimizer's settings, which a group may repeat but not change.
WHOLE_OPTIMIZER = OPTIMIZER_SETTINGS + ("amsgrad", "set_grad_none")
_IGNORED_KEY_SET = frozenset(WHOLE_OPTIMIZER + TORCH_OPTIONS)


# Switches among the optimizer's settings and torch's options, compared by truth value.
_SWITCHES = frozenset(("adam_w_mode", "capturable", "master_weights", "use_decoupled_grad",
                       "store_param_remainders", "amsgrad", "maximize", "differentiable",
                       "decoupled_weight_decay"))


def check_group_options(group: dict, group_index: int, settings: dict) -> None:
    """A group (given to the constructor or ``add_param_group``, or found by ``step()``)
    may repeat one of the optimizer's settings only at the optimizer's value, and hold
    an option of torch's Adam that FusedAdam lacks only at a value with which torch
    steps as FusedAdam does: torch's ``ZeroRedundancyOptimizer`` copies its keyword
    arguments into every group it hands over, and groups taken from a torch optimizer
    hold its options. Any other value would be kept in the group and ignored
    (``maximize=True`` would descend all the same). ``settings``: the optimizer's
    values of ``WHOLE_OPTIMIZER`` and its ``weight_decay`` default."""
    for key in [key for key in group if key in _IGNORED_KEY_SET]:
        value = group[key]
        if key in settings:
            own = settings[key]
            if key == "store_param_remainders" and _is_switch(value):
                # As the constructor takes it: remainders only beside an fp32 master.
                value = bool(value and settings["master_weights"]
                             and settings["master_weight_dtype"] == torch.float32)
            if _same_value(key, value, own):
                continue
            why = (f"{key} is one setting of the whole optimizer, here {shown(own)}: a "
                   f"group may repeat it only at that value; pass another to the "
                   f"constructor")
        else:
            wanted = _torch_option_like_fused_adam(key, group, settings)
            if wanted is None or (_is_switch(value) and bool(value) in wanted):
                continue
            why = (f"{key} is an option of torch's Adam/AdamW that FusedAdam does not "
                   f"have: a group may hold it only where torch steps as FusedAdam does "
                   f"({key} {' or '.join(map(str, sorted(wanted)))})")
        raise fail(ValueError, f"the group sets {key}={shown(group[key])} (rule: {why}; "
                               f"{_GROUP_MAY_SET})", group=group_index)


def _is_switch(value) -> bool:
    try:
        check_flag("", value)
    except ValueError:
        return False
    return True


def _same_value(key: str, value, own) -> bool:
    if key in _SWITCHES or (key == "set_grad_none" and value is not None
                            and own is not None):  # None is its own meaning there
        return _is_switch(value) and bool(value) == bool(own)
    if _is_int(value) and _is_int(own):  # numpy's ints as the constructor takes them
        return int(value) == int(own)
    return type(value) is type(own) and value == own


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _torch_option_like_fused_adam(key: str, group: dict, settings: dict):
    """The truth values of torch's option ``key`` with which torch's Adam steps as this
    optimizer does, or None where any value does (``foreach`` and ``fused`` choose an
    implementation; None, torch's default, also passes for the others)."""
    if key in ("foreach", "fused") or group[key] is None:
        return None
    if key == "decoupled_weight_decay":
        if _number(group.get("weight_decay", settings["weight_decay"])) == 0.0:
            return {False, True}  # without weight decay both modes step alike
        return {bool(settings["adam_w_mode"])}
    return {False}  # maximize, differentiable


PARAM_ROUNDINGS = ("nearest", "stochastic")


def check_param_rounding(param_rounding, master_weights) -> None:
    """S2.14: ``param_rounding`` says how a bf16 parameter stepped without a master is
    rounded; stochastic rounding stands in for a master, so not beside one."""
    if not isinstance(param_rounding, str) or param_rounding not in PARAM_ROUNDINGS:
        raise ValueError(f"FusedAdam: unknown param_rounding {shown(param_rounding)} "
                         f"(rule: param_rounding in {list(PARAM_ROUNDINGS)})")
    if param_rounding == "stochastic" and master_weights:
        raise ValueError("FusedAdam: param_rounding='stochastic' rounds bf16 parameters "
                         "that have no master, but master_weights is True (rule: "
                         "param_rounding='stochastic' needs master_weights=False)")


def check_moment_format(moment_format, moment_block_size, exp_avg_dtype,
                        exp_avg_sq_dtype, master_weights=False,
                        master_weight_dtype=None) -> None:
    """S2.11: ``moment_format`` names a pair of per-block moment formats and replaces
    the moments' dtypes; ``moment_block_size`` is its elements per scale. Its master
    is unscaled: an fp16 master's per-tensor scale needs a measuring pass over the
    whole tensor, which the one-pass block kernels do not make."""
    families = sorted(_formats.MOMENT_FAMILIES)
    if moment_format is None:
        if moment_block_size is not None:
            raise ValueError(f"FusedAdam: moment_block_size={shown(moment_block_size)} "
                             f"needs a moment_format (rule: moment_block_size is the block "
                             f"size of moment_format in {families})")
        return
    if not isinstance(moment_format, str) or moment_format not in families:
        raise ValueError(f"FusedAdam: unknown moment_format {shown(moment_format)} (rule: "
                         f"moment_format in {families}, or None for exp_avg_dtype / "
                         f"exp_avg_sq_dtype)")
    fp32 = _formats.FP32.argument
    if exp_avg_dtype is not fp32 or exp_avg_sq_dtype is not fp32:
        raise ValueError(f"FusedAdam: moment_format={moment_format!r} chooses both moments' "
                         f"storage, so exp_avg_dtype and exp_avg_sq_dtype must stay at "
                         f"their default torch.float32 (got exp_avg_dtype="
                         f"{shown(exp_avg_dtype)}, exp_avg_sq_dtype={shown(exp_avg_sq_dtype)}; "
                         f"rule S2.11)")
    if master_weights and master_weight_dtype is _formats.FP16.argument:
        raise ValueError(f"FusedAdam: moment_format={moment_format!r} steps in one pass "
                         f"per block, but master_weight_dtype=torch.float16 is scaled per "
                         f"tensor and needs a second pass (rule S2.11: moment_format "
                         f"takes master_weight_dtype=torch.float32 or "
                         f"store_param_remainders=True)")
    low, high = _formats.SCALE_BLOCK_RANGE
    block = moment_block_size
    if block is not None and (not isinstance(block, numbers.Integral)
                              or isinstance(block, bool)):
        raise ValueError(f"FusedAdam: moment_block_size must be an int (rule S2.11: an int "
                         f"power of two in [{low}, {high}], numpy's included), got "
                         f"{shown(block)}")
    if block is not None and (not low <= block <= high or block & (block - 1)):
        raise ValueError(f"FusedAdam: moment_block_size must be a power of two in "
                         f"[{low}, {high}] (rule S2.11: elements per block scale), got "
                         f"{shown(block)}")
    block = None if block is None else int(block)
    needed = {fmt for packable in (True, False)
              for fmt in _formats.moment_family(moment_format, block, packable)}
    for fmt in sorted(needed, key=lambda f: f.tag):
        if not _formats.available(fmt):
            raise ValueError(f"FusedAdam: moment_format={moment_format!r} needs the "
                             f"{fmt.name!r} format, which this build of shardadam._C "
                             f"does not have: rebuild the extension")


def check_master_dtype(master_weights, master_weight_dtype) -> None:
    if master_weights and _formats.configured(master_weight_dtype, "master") is None:
        names, dtypes = _spelled("master")
        raise RuntimeError(
            f"FusedAdam only supports {names} master weights (rule: master_weight_dtype "
            f"in {dtypes} when master_weights, got {shown(master_weight_dtype)}).")


def _fp8_hint(dtype) -> str:
    """What to pass instead of one of torch's 8-bit float dtypes: TE spells fp8 moments
    ``torch.uint8``."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize == 1:
        return ("; fp8 moments are torch.uint8, as in TE: E4M3 codes with one scale per "
                "tensor, S2.2")
    return ""


def _spelled(role: str) -> tuple:
    """The formats the constructor can name for ``role``, and their dtypes, as the
    messages spell them: ``("fp32/fp16", "torch.float32/float16")``."""
    formats = _formats.choices(role)
    dtypes = "/".join(str(f.argument).removeprefix("torch.") for f in formats)
    return "/".join(f.name for f in formats), "torch." + dtypes


def _number(value) -> Optional[float]:
    """``value`` as a float (a real number, numpy's included, or a one-element tensor),
    else None. Not a bool, and not a string: ``float("0.1")`` would pass here and break
    the schedulers that later multiply the stored value."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_meta:  # a meta tensor has no value
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an int past float's range
        return math.inf if value > 0 else -math.inf


# What step() reads from every group.
GROUP_KEYS = ("params", "lr", "betas", "eps", "weight_decay", "bias_correction")
_GROUP_KEY_SET = frozenset(GROUP_KEYS)


def check_group_keys(group: dict, group_index: int, settings) -> None:
    """A group edited or appended by hand may lack a key that step() reads, or set one
    check_group_options refuses (it would be ignored). ``settings()``: the optimizer's,
    as check_group_options takes them."""
    if (type(group) is dict and type(group.get("params")) is list
            and group.keys() >= _GROUP_KEY_SET and _IGNORED_KEY_SET.isdisjoint(group)):
        return  # C-level tests for the usual group
    check_groups([group], group_index)
    check_group_options(group, group_index, settings())
    for key in GROUP_KEYS:
        if key not in group:
            raise fail(KeyError, f"the group has no {key!r} (rule: every group holds "
                       f"{', '.join(GROUP_KEYS)}; add_param_group fills missing ones "
                       "from the defaults)", group=group_index)


def check_groups(groups: list, first_index: int = 0) -> None:
    """The optimizer's ``param_groups`` (numbered from ``first_index``), as edited by
    hand, can be read: each a dict whose ``params`` is a list (torch's
    ``add_param_group`` makes one; a tensor put there would be read as its rows, each
    stepped as a parameter of its own, S8)."""
    if not isinstance(groups, list):
        raise TypeError(f"{CLASS_NAME}: param_groups must be a list of dicts, got "
                        f"{shown(groups)} (rule S8)")
    for g, group in enumerate(groups, first_index):
        if type(group) is dict and type(group.get("params")) is list:
            continue
        if not isinstance(group, dict):
            raise fail(TypeError, f"a parameter group must be a dict, got {shown(group)} "
                                  f"(rule S8)", group=g)
        if "params" not in group:
            raise fail(KeyError, "the group has no 'params' (rule S8: every group holds "
                       f"{', '.join(GROUP_KEYS)})", group=g)
        if not isinstance(group["params"], list):
            raise fail(TypeError, f"'params' must be a list of parameters, got "
                       f"{shown(group['params'])} (rule S8: torch's add_param_group makes "
                       f"one; a tensor there would be read as its rows)", group=g)


def check_params_argument(params) -> None:
    """The constructor's ``params`` (S8): an iterable of tensors or of groups, which a
    dict (torch would step its keys as parameters), a lone tensor and a non-iterable
    are not."""
    if isinstance(params, dict):
        why = "one group goes in a list, [group]"
    elif isinstance(params, torch.Tensor):
        why = "a lone tensor goes in a list, [tensor]"
    elif not isinstance(params, Iterable):
        why = "a list of tensors, of (name, tensor) pairs, or of groups"
    else:
        return
    raise TypeError(f"{CLASS_NAME}: params must be an iterable of tensors or of parameter "
                    f"groups, got {shown(params)} (rule S8: {why})")


def check_params_are_tensors(groups: list) -> None:
    """Every parameter put into the (readable, ``check_groups``) groups by hand is a
    tensor (S8), for the methods that read them all; ``step()`` checks each parameter
    as S1.4 says, without this scan of every group at every step."""
    for g, group in enumerate(groups):
        params = group["params"]
        if not all(map(isinstance, params, itertools.repeat(torch.Tensor))):
            i = next(i for i, p in enumerate(params) if not isinstance(p, torch.Tensor))
            raise fail(TypeError, f"parameters must be tensors, got {shown(params[i])} "
                                  f"(rule S8)", group=g, param=i)


def check_grads_clearable(groups: list, decoupled: bool, set_to_none: bool) -> None:
    """Before ``zero_grad`` clears anything (S4, S8): every parameter put into the groups
    by hand is a tensor, and a ``decoupled_grad`` it would zero is one."""
    check_params_are_tensors(groups)
    if not decoupled or set_to_none:
        return
    for g, group in enumerate(groups):
        grads = [getattr(p, "decoupled_grad", None) for p in group["params"]]
        bad = [i for i, grad in enumerate(grads)
               if grad is not None and not isinstance(grad, torch.Tensor)]
        if bad:
            raise fail(TypeError, f"decoupled_grad must be a tensor or None, got "
                                  f"{shown(grads[bad[0]])} (rule S3.2)", group=g,
                       param=bad[0], name=param_name(group, bad[0]))


def group_params(param_group, group_index: int) -> list:
    """The ``params`` of a group handed to the constructor or ``add_param_group``, as the
    list torch stores: a tensor alone, or an ordered iterable of tensors, or of
    ``(name, tensor)`` pairs throughout (S8; torch's rules, named here)."""
    if not isinstance(param_group, dict):
        raise fail(TypeError, f"a parameter group must be a dict, got {shown(param_group)} "
                              f"(rule S8)", group=group_index)
    if "params" not in param_group:
        raise fail(KeyError, "the group has no 'params' (rule S8)", group=group_index)
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, (set, frozenset)) or not isinstance(params, Iterable):
        raise fail(TypeError, f"'params' must be a tensor or an ordered collection of them "
                              f"(a list: a set's order changes between runs), got "
                              f"{shown(params)} (rule S8)", group=group_index)
    params = list(params)
    named = [isinstance(p, tuple) for p in params]
    if any(named) and not all(named):
        raise fail(ValueError, "names some parameters and not others (rule S8, as torch's: "
                               "(name, tensor) pairs throughout, or tensors throughout)",
                   group=group_index)
    for i, pair in enumerate(params if any(named) else ()):
        if len(pair) != 2:
            raise fail(ValueError, f"a named parameter must be a (name, tensor) pair, got "
                                   f"a tuple of {len(pair)} (rule S8)", group=group_index,
                       param=i)
    return params


def check_names_like(named: dict, groups: list, group_index: int) -> None:
    """A new group names its parameters (``param_names`` in ``named``) if and only if
    the groups before it do (S8, torch's rule, refused by name before torch refuses it)."""
    if groups and ("param_names" in named) != ("param_names" in groups[0]):
        new, old = (("names", "do not") if "param_names" in named else ("does not name",
                                                                           "do"))
        raise fail(ValueError, f"{new} its parameters where the groups before it {old} "
                               f"(rule S8, as torch's: every group named, or none)",
                   group=group_index)


def hyper_parameters(group: dict, group_index: Optional[int] = None,
                     lr_on_device: bool = False) -> tuple:
    """``(lr, beta1, beta2, eps, weight_decay)`` of a group as floats, checked (S1.2),
    and its ``bias_correction`` checked as a flag.
    With ``lr_on_device``, an lr held in a one-element floating CUDA tensor (a plain
    one, not a DTensor) comes back as that tensor, checked for its shape and dtype only:
    reading its value would wait for the device."""
    lr, eps, wd, betas = group["lr"], group["eps"], group["weight_decay"], group["betas"]
    # The usual group, Python floats and ints in range, without a call per value:
    # step() checks every group at every step.
    if (type(lr) in _PLAIN_REALS and type(eps) in _PLAIN_REALS and type(wd) in _PLAIN_REALS
            and type(betas) is tuple and len(betas) == 2 and type(betas[0]) in _PLAIN_REALS
            and type(betas[1]) in _PLAIN_REALS and 0.0 <= lr <= _FLOAT_MAX
            and 0.0 <= eps <= _FLOAT_MAX and 0.0 <= wd <= _FLOAT_MAX and 0.0 <= betas[0] < 1.0
            and 0.0 <= betas[1] < 1.0 and type(group.get("bias_correction", True)) is bool):
        return float(lr), float(betas[0]), float(betas[1]), float(eps), float(wd)
    return _checked_hyper_parameters(group, group_index, lr_on_device)


_PLAIN_REALS = (float, int)  # not bool: type(True) is bool
# Finite as a float: an int above it (10**400) would overflow float().
_FLOAT_MAX = sys.float_info.max


def is_device_lr(value) -> bool:
    """Whether ``value`` is an lr the CUDA kernels can read where it is: a one-element
    floating dense tensor in CUDA memory (a sparse one has no storage to point at)."""
    return (type(value) is torch.Tensor and value.is_cuda and value.layout == torch.strided
            and value.numel() == 1 and value.is_floating_point())


def _checked_hyper_parameters(group: dict, group_index: Optional[int],
                              lr_on_device: bool = False) -> tuple:
    """hyper_parameters for any value: tensors, numpy numbers, lists; refusals."""
    def bad(rule, value):
        return fail(ValueError, f"{rule}: {shown(value)}{_array_note(value, 'float')}",
                    group=group_index)

    if "bias_correction" in group:
        check_flag("bias_correction", group["bias_correction"], group_index)

    lr = group["lr"]
    if not (lr_on_device and is_device_lr(lr)):
        lr = _number(lr)
        if lr is None or not math.isfinite(lr) or lr < 0.0:
            raise bad("Invalid learning rate (rule: a real number, finite and >= 0)",
                      group["lr"])
    eps = _number(group["eps"])
    if eps is None or not math.isfinite(eps) or eps < 0.0:
        raise bad("Invalid epsilon value (rule: a real number, finite and >= 0)",
                  group["eps"])
    wd = _number(group["weight_decay"])
    if wd is None or not math.isfinite(wd) or wd < 0.0:
        raise bad("Invalid weight_decay value (rule: a real number, finite and >= 0)",
                  group["weight_decay"])
    betas = group["betas"]
    try:
        # Indexed, as torch reads them: a set or a dict would be iterated in an order
        # of its own (a dict's keys, at that).
        beta_values = [_number(betas[0]), _number(betas[1])] if len(betas) == 2 else []
    except (TypeError, KeyError, IndexError):
        beta_values = []
    if len(beta_values) != 2 or isinstance(betas, (Mapping, str, bytes)):
        raise bad("Invalid betas (rule: a pair (beta1, beta2))", betas)
    for i, beta in enumerate(beta_values):
        if beta is None or not 0.0 <= beta < 1.0:
            raise bad(f"Invalid beta parameter at index {i} (rule: a real number in "
                      f"[0, 1))", betas[i])
    return lr, beta_values[0], beta_values[1], eps, wd


def bias_correction1(hyper) -> float:
    """``c1 = 1 - beta1^t`` of S3.6 in double (1 without bias correction), as
    csrc/element.h ``BiasCorrection1``."""
    return 1.0 - math.pow(hyper.beta1, float(hyper.step)) if hyper.bias_correction else 1.0


# The smallest double that rounds to inf in fp32: FLT_MAX plus half its ulp (the tie
# rounds to the even 2^128).
_FP32_OVERFLOW = 2.0**128 - 2.0**103
_FP32_HALF_SMALLEST = 2.0**-150  # and below, a double rounds to fp32's 0


def check_step_constants(hyper, group_index: int) -> None:
    """The fp32 constants a group's step uses (S3.6: lr / c1, eps, and 1 - lr * wd or
    wd), each computed in double and rounded to fp32, are finite, as the core checks
    them: a finite hyper-parameter past fp32's range (lr = 1e39, or lr / c1 beyond its
    largest value) would turn every weight it touches to inf or NaN."""
    lr, wd = hyper.lr, hyper.weight_decay
    used = (("lr / (1 - beta1^step)", lr / bias_correction1(hyper)),
            ("1 - lr * weight_decay", 1.0 - lr * wd) if hyper.adam_w_mode
            else ("weight_decay", wd),
            ("eps", hyper.eps))
    for name, value in used:
        if abs(value) >= _FP32_OVERFLOW:
            raise fail(ValueError, f"{name} is beyond fp32's range at step {hyper.step} "
                                   f"(lr {lr!r}, beta1 {hyper.beta1!r}, weight_decay "
                                   f"{wd!r}, eps {hyper.eps!r}; rule: each fp32 constant "
                                   f"of the step is finite, S3.6)", group=group_index)
    # At most half fp32's smallest subnormal (2^-150, a tie to even) rounds to 0: a
    # zero gradient on zero moments would then step 0 / 0 into NaN.
    if 0.0 < hyper.eps <= _FP32_HALF_SMALLEST:
        raise fail(ValueError, f"eps {hyper.eps!r} rounds to 0 in fp32, where the step adds "
                               f"it (rule: a positive eps stays positive in fp32, at least "
                               f"2^-149; 0 means none, S3.6)", group=group_index)


# The largest step counter: the core counts the step it takes, one more, in an int64.
MAX_STEP = 2**63 - 2


def check_step_counter(group: dict, group_index: int) -> int:
    """The group's step counter; a group without one (added to ``param_groups``
    directly) has taken no step."""
    step = group.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise fail(ValueError, f"group['step'] must be an int in [0, 2**63 - 2] (rule S2.8: "
                               f"the step taken next is a signed 64-bit count), got "
                               f"{shown(step)}",
                   group=group_index)
    return step


def loaded_step(step, group_index: int) -> int:
    """A checkpoint's ``step`` (an int, an integral float or a one-element tensor)."""
    value = (step.item() if isinstance(step, torch.Tensor) and step.numel() == 1
             and not step.is_meta else step)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        value = _number(step)  # an integral float; ints stay exact beyond 2**53
        value = int(value) if value is not None and value.is_integer() else None
    # One more than a step takes: the count its last step leaves, saved, loads (its next
    # step is refused, as in the optimizer that saved it).
    if value is None or not 0 <= value <= MAX_STEP + 1:
        raise fail(ValueError, f"loaded step must be an integer in [0, 2**63 - 1] (a "
                               f"signed 64-bit count), got {shown(step)}",
                   group=group_index)
    return int(value)


def check_loaded_dict(state_dict, whole: bool = False) -> None:
    """A loaded state dict has ``state_dict()``'s shape: a dict; ``whole`` (after the
    load pre-hooks) also with a dict ``state`` and a list ``param_groups`` of dicts,
    each listing its parameters' keys under ``params``."""
    rule = "rule: as state_dict() makes it"
    if not isinstance(state_dict, Mapping):
        raise fail(ValueError, f"the loaded state dict must be a dict ({rule}), got "
                               f"{shown(state_dict)}")
    if not whole:
        return
    for key in ("state", "param_groups"):
        if key not in state_dict:
            held = sorted(shown(k) for k in state_dict)
            raise fail(ValueError, f"the loaded state dict has no {key!r} (rule: it holds "
                                   f"'state' and 'param_groups', as state_dict() makes "
                                   f"it; it holds {held})")
    if not isinstance(state_dict["state"], Mapping):
        raise fail(ValueError, f"the loaded state dict's 'state' must be a dict ({rule}), "
                               f"got {shown(state_dict['state'])}")
    groups = state_dict["param_groups"]
    if not isinstance(groups, (list, tuple)):
        raise fail(ValueError, f"the loaded state dict's 'param_groups' must be a list of "
                               f"dicts ({rule}), got {shown(groups)}")
    for g, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"),
                                                            (list, tuple)):
            raise fail(ValueError, f"the loaded group must be a dict whose 'params' lists "
                                   f"its parameters' keys ({rule}), got {shown(group)}",
                       group=g)
        for key in group["params"]:
            try:
                hash(key)
            except TypeError:
                raise fail(ValueError, f"the loaded group's 'params' lists {shown(key)}, "
                                       f"which cannot key 'state' ({rule}: ints, or "
                                       f"names)", group=g) from None


def check_loaded_names(saved: dict, group_index: int) -> None:
    """A loaded group's ``param_names``, which replace the group's own (S5.5, as torch's
    load does): one per parameter, in a list or tuple."""
    if "param_names" not in saved:
        return
    names = saved["param_names"]
    if not isinstance(names, (list, tuple)) or len(names) != len(saved["params"]):
        raise fail(ValueError, f"the loaded group's param_names must list one name per "
                               f"parameter ({len(saved['params'])}), got {shown(names)} "
                               f"(rule S5.5: they replace the group's own)",
                   group=group_index)


def check_loaded_options(saved: dict, adam_w_mode, group_index: int,
                         weight_decay) -> None:
    """Options of ``torch.optim.Adam`` / ``AdamW`` this optimizer lacks are refused
    rather than ignored; their ``decoupled_weight_decay`` must be ``adam_w_mode``, which
    this optimizer applies to every group, unless the group's ``weight_decay`` (as
    loaded) is 0: then both modes step alike."""
    for option in ("amsgrad", "maximize", "decoupled_weight_decay"):
        if saved.get(option) is not None:
            check_flag(f"the loaded group's {option}", saved[option], group_index)
    for option in ("amsgrad", "maximize"):
        if saved.get(option):
            raise fail(ValueError, f"the loaded group has {option}=True (rule: FusedAdam "
                                   f"has no {option}; load such a checkpoint only into an "
                                   f"optimizer that has)", group=group_index)
    decoupled = saved.get("decoupled_weight_decay")
    if (decoupled is not None and bool(decoupled) != bool(adam_w_mode)
            and _number(weight_decay) != 0.0):
        raise fail(ValueError, f"the loaded group has decoupled_weight_decay={decoupled!r} "
                               f"but this optimizer has adam_w_mode={bool(adam_w_mode)} "
                               f"(rule: a torch Adam checkpoint loads into "
                               f"adam_w_mode=False, an AdamW one into adam_w_mode=True, "
                               f"either into both when its weight_decay is 0)",
                   group=group_index)


def loaded_group_step(saved: dict, saved_state: dict, group_index: int) -> int:
    """A checkpoint group's step counter: its ``step``; else, in the layout of
    ``torch.optim.Adam`` / ``AdamW``, the one ``step`` its parameters' states share;
    else 0 (TE's checkpoint before its first step)."""
    if "step" in saved:
        return loaded_step(saved["step"], group_index)
    steps = set()
    for key in saved["params"]:
        values = saved_state.get(key)
        if isinstance(values, dict) and "step" in values:
            steps.add(loaded_step(values["step"], group_index))
    if len(steps) > 1:
        raise fail(ValueError, f"the loaded parameters' step counts differ "
                               f"({sorted(steps)}; rule: one step counter per group, as "
                               f"every parameter of a group steps together)",
                   group=group_index)
    return steps.pop() if steps else 0


def check_moments_of_step_0(saved: dict, saved_state: dict, group_index: int) -> None:
    """A group loaded with its own step 0 holds zero moments (S5.5), unless its recorded
    layout says they were set by hand (``moments=set``, which the caller reads): others
    belong to an optimizer that has stepped, whose counter was lost. That happens to a
    torch Adam/AdamW checkpoint, which keeps its step per parameter, loaded through this
    optimizer's state dict as a template (DCP with ``allow_partial_load``, or torch's
    ``set_optimizer_state_dict`` with ``broadcast_from_rank0``): the template's own group
    step stands in for it. Checked on each rank's local values."""
    if saved["step"] != 0:
        return
    for key in saved["params"]:
        values = saved_state.get(key)
        if not isinstance(values, dict):
            continue
        for name in ("exp_avg", "exp_avg_sq"):
            value = values.get(name)
            # One without values here (sparse, mkldnn, nested, freed, meta) is left to
            # check_value, which refuses it by name.
            if (_state.holds_values(value) and value.is_floating_point()
                    and not value.is_meta and bool(_dtensor.to_local(value).any())):
                raise fail(ValueError, f"the loaded step is 0 but {name} of parameter key "
                                       f"{shown(key)} is not zero (rule S5.5: a group at step 0 "
                                       f"has zero moments unless its state_layout says "
                                       f"moments=set). A torch Adam/AdamW checkpoint "
                                       f"keeps its step per parameter, which a load through "
                                       f"this optimizer's state dict (DCP, "
                                       f"set_optimizer_state_dict) does not read: load it "
                                       f"into a torch AdamW of the same model, then pass "
                                       f"that optimizer's state_dict() to load_state_dict",
                           group=group_index)


def loaded_layout(record, group_index: int):
    """The ``StateConfig`` a checkpoint group recorded under ``state_layout`` (S5.4), or
    None for a checkpoint that recorded none (TE's, torch's, older ones)."""
    if record is None:
        return None
    if not isinstance(record, str):
        raise fail(ValueError, f"the loaded group's state_layout must be a str, as "
                               f"state_dict() records it, got {shown(record)}",
                   group=group_index)
    try:
        return StateConfig.from_record(record)
    except ValueError as error:
        raise fail(ValueError, f"the loaded group's state_layout: {error}. The states "
                               f"are exported as fp32 values either way: a checkpoint "
                               f"whose layout this version does not name loads once "
                               f"that entry is removed from its groups",
                   group=group_index) from None


def loaded_master(value: torch.Tensor, saved, local: torch.Tensor, config, where_: str):
    """A loaded ``master_param`` checked against the layout it was saved with (S6.4).

    torch.distributed.checkpoint loads into the tensors of this optimizer's own
    ``state_dict()``, casting to their dtype: int16 remainders saved under
    ``store_param_remainders`` arrive here as fp32 (exact, and turned back into int16),
    an fp32 / fp16 master loaded into this optimizer's int16 remainders has lost its
    bits (refused). The record names the saved storage whatever this parameter's dtype
    is now (S5.4: remainders are recorded beside bf16 parameters only). Where it names
    remainders, floating-point values that are no int16 codes are an fp32 master that an
    fp16 parameter's group recorded so before that rule, or in a group that also held
    bf16 parameters; so are whole numbers in int16's range beside a parameter (``local``)
    that is no bf16 one and holds them rounded (a master's parameter is rounded from it;
    cast remainder codes match no such parameter). Beside a bf16 parameter they cannot be
    told apart from cast remainders, and are read as remainders.
    """
    saved_format = saved.master_format()
    if saved_format is None:
        return value
    codes = _formats.REMAINDER.value_dtype  # int16: remainder codes, the only such values
    if saved_format.value_dtype == codes and value.dtype != codes:
        low, high = torch.iinfo(codes).min, torch.iinfo(codes).max
        if not value.is_floating_point():
            return value  # check_loaded_dtype names it
        exact = bool((value == value.round()).all() & (value >= low).all()
                     & (value <= high).all())
        if exact and local.dtype != _formats.REMAINDER.pairs_with and torch.equal(
                value.to(device=local.device, dtype=local.dtype), local):
            return value  # the master of the parameter it rounds to
        return value.to(codes) if exact else value
    if (saved_format.value_dtype != codes and value.dtype == codes
            and not config.uses_remainders(local.dtype)):
        raise RuntimeError(
            f"{where_}: the checkpoint recorded a floating-point 'master_param' "
            f"({saved.record()}) but holds int16 values (rule S6.4: a recorded layout "
            f"must match the saved values)")
    if saved_format.value_dtype != codes and value.dtype == codes:
        raise RuntimeError(
            f"{where_}: the checkpoint holds a floating-point 'master_param' (saved with "
            f"{saved.record()}) but it arrived as int16: torch.distributed.checkpoint "
            f"cast it into this optimizer's remainders ({config.record()}), which loses "
            f"its bits (rule S6.4: load it into an optimizer whose master is floating "
            f"point, store_param_remainders=False, or through load_state_dict with the "
            f"values as saved; the next step with remainders converts it)")
    return value


def check_loaded_dtype(value: torch.Tensor, spec, param_dtype, where_: str,
                       saved=None) -> None:
    """A loaded state value holds true values in a floating dtype, or int16 remainder
    codes (S5.4: exported values are told apart by dtype) of a bf16 parameter's
    ``master_param``: a moment never holds them. ``saved``: the layout the checkpoint
    recorded (a StateConfig), if any, named in the refusal."""
    codes = _formats.REMAINDER
    if value.dtype == codes.value_dtype and spec.name != "master_param":
        raise RuntimeError(f"{where_}: state {spec.name!r} must hold floating point "
                           f"values, got torch.int16 (rule S5.4: only 'master_param' "
                           f"holds int16 remainder codes)")
    if value.dtype == codes.value_dtype and param_dtype != codes.pairs_with:
        layout = f" (saved with {saved.record()})" if saved is not None else ""
        raise RuntimeError(f"{where_}: the loaded {spec.name!r} holds int16 remainders"
                           f"{layout}, whose true value needs the bf16 parameter they were "
                           f"saved beside; this one is {param_dtype} (rule S6.4: load with the "
                           f"parameter dtype saved, then change it: the next step "
                           f"converts the state, S2.5)")
    if value.dtype != codes.value_dtype and not value.is_floating_point():
        raise RuntimeError(f"{where_}: state {spec.name!r} must hold floating "
                           f"point values (or int16 remainders), got {value.dtype}")


# ---------------------------------------------------------------------------
# Parameters, gradients and state values.

def param_error(param) -> Optional[str]:
    """Why ``param`` cannot be optimized (S1.4), or None."""
    if not isinstance(param, torch.Tensor):
        return f"parameters must be tensors, got {type(param).__name__} (rule S1.4)"
    if isinstance(param, torch.nn.parameter.UninitializedTensorMixin):
        return ("the parameter is an uninitialized lazy one (rule: state is created "
                "with the optimizer, so run a forward pass to materialize lazy modules "
                "first)")
    layout_error = _dtensor.param_layout_error(param)
    if layout_error is not None:
        return layout_error
    if param.layout is not torch.strided:
        return (f"sparse parameters are not supported (layout {param.layout}; rule S1.4: "
                f"parameters are strided tensors, updated in place)")
    if param.dtype not in PARAM_TAGS:
        return (f"parameter dtype must be fp32, fp16 or bf16, got {param.dtype} (rule "
                f"S1.4)")
    local = _dtensor.to_local(param)
    if local.is_neg():
        return ("the parameter is a lazily negated view (torch's neg bit, e.g. from "
                "_neg_view or the imaginary part of a conjugate; rule S1.4: a parameter "
                "is updated in place in memory that holds its values: pass "
                "resolve_neg()'s copy)")
    freed = freed_error(local)
    if freed is not None:
        return freed
    if _overlaps_itself(local):
        return (f"elements of the parameter share memory (shape {list(local.shape)}, "
                f"strides {list(local.stride())}; rule: a parameter is updated in place, "
                f"so each element needs memory of its own)")
    return None


def _overlaps_itself(tensor) -> bool:
    """Whether two elements share an address: a dimension of stride 0, fewer addresses
    in reach than elements, or, where the strides do not prove the elements apart,
    fewer distinct addresses than elements (counted in a mask over the reach, a cost
    paid only by views such as ``as_strided`` windows)."""
    if tensor.numel() == 0:
        return False
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride())
                  if size > 1)
    if any(stride == 0 for stride, _ in dims):
        return True
    reach_all = extent(tensor)
    if 0 < reach_all < tensor.numel():
        return True
    # Sorted by stride, each dimension stepping past all the smaller ones' reach
    # proves every element its own address (contiguous, transposed, sliced views).
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            break
        reach += (size - 1) * stride
    else:
        return False
    if tensor.is_meta:  # no memory, so no storage bounds the reach: not counted
        return False
    mask = torch.zeros(reach_all, dtype=torch.bool)
    mask.as_strided(tensor.shape, tensor.stride()).fill_(True)
    return int(mask.sum()) < tensor.numel()


def freed_error(local) -> Optional[str]:
    """Why the local tensor of a parameter holds no values (its storage freed or
    shrunk below the elements it spans), or None (S1.4)."""
    short = short_storage(local)
    if short is None:
        return None
    return (f"the parameter's storage holds {short[0]} bytes, fewer than its elements span "
            f"({short[1]}): its memory was freed or shrunk (FSDP2 frees the unsharded "
            f"parameters a forward leaves on the root module: build the optimizer from "
            f"the sharded ones, before the first forward or after model.reshard(); rule "
            f"S1.4: a parameter holds its values)")


def storages_hold(tensors: list) -> bool:
    """Whether every one of ``tensors`` (contiguous) has the bytes its elements span in
    its storage: one pass of C-level maps, for the step's common case."""
    held = map(torch.UntypedStorage.nbytes, map(torch.Tensor.untyped_storage, tensors))
    spanned = map(operator.add, map(operator.mul, map(torch.Tensor.storage_offset, tensors),
                                    map(torch.Tensor.element_size, tensors)),
                  map(_nbytes_of, tensors))
    return all(map(operator.ge, held, spanned))


_nbytes_of = operator.attrgetter("nbytes")


def check_params(params, group_index: int, group: dict,
                 placed: Optional[dict] = None) -> None:
    """``placed``, for a group being added: ``{id(param): (group, index)}`` of the groups
    already there, which torch's add_param_group checks next (with a bare message)."""
    first_index = {}
    for i, param in enumerate(params):
        error = param_error(param)
        if error is None and placed is not None:
            # ValueError, the type torch's add_param_group raises for these two.
            if not (param.is_leaf or param.retains_grad):
                raise fail(ValueError, "can't optimize a non-leaf Tensor (rule: a parameter "
                                       "is a leaf, e.g. an nn.Parameter; pass it, not a "
                                       "result computed from it)", group=group_index,
                           param=i, name=param_name(group, i))
            if id(param) in placed:
                other_group, other = placed[id(param)]
                raise fail(ValueError, f"the same tensor as group {other_group}, param "
                                       f"{other} (rule: each parameter in one group only)",
                           group=group_index, param=i, name=param_name(group, i))
        if error is None:
            first = first_index.setdefault(id(param), i)
            if first != i:  # torch only warns; stepped twice it would be wrong
                error = (f"the same tensor as param {first} (rule: each parameter once; "
                         f"list a tied weight once)")
        if error is not None:
            raise fail(RuntimeError, error, group=group_index, param=i,
                       name=param_name(group, i))


def memory_span(tensor) -> tuple:
    """``(first byte, end)`` of the memory a non-empty tensor covers; empty for a
    tensor without memory (the meta device)."""
    if tensor.is_meta:
        return 0, 0
    start = tensor.data_ptr()
    if tensor.is_contiguous():
        return start, start + tensor.nbytes
    return start, start + extent(tensor) * tensor.element_size()


def spans_meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory ranges of two tensors on one device overlap (they may then
    share bytes)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (a_start, a_end), (b_start, b_end) = memory_span(a), memory_span(b)
    return a_start < b_end and b_start < a_end


def first_overlap(spans: list, tensor_of=None, written_apart: bool = False
                  ) -> Optional[tuple]:
    """The first pair of ``spans`` (one device's ``(start, end, order, written, ...)``
    tuples, ``order`` telling their owners apart) that share memory where at least one
    of the two is written (exactly one with ``written_apart``: the written spans are
    known to share none), as (earlier owner's span, later owner's span); None if there
    is none. Sorting by address finds it in O(n log n) when no spans overlap.
    ``tensor_of(span)``, when given, is the span's tensor: overlapping ranges of two
    tensors that are not both contiguous are then compared byte by byte (a matrix's even
    and odd columns cover the same range and share no byte). ``spans`` is sorted in
    place."""
    spans.sort(key=lambda span: span[:2])
    active = []  # earlier spans reaching past the current start, furthest first
    for span in spans:
        active = [hit for hit in active if hit[1] > span[0]]
        for hit in active:
            compared = span[3] != hit[3] if written_apart else span[3] or hit[3]
            if compared and (tensor_of is None
                             or share_bytes(tensor_of(hit), tensor_of(span))):
                first, second = sorted([hit, span], key=lambda s: s[2])
                return first, second
        active.append(span)
        active.sort(key=lambda hit: -hit[1])
    return None


def share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose memory ranges overlap share a byte. Contiguous ones do;
    otherwise each byte of ``a`` is marked in a scratch mask over the range, where
    ``b``'s bytes are then looked up (a cost of the range's size, paid only for views
    that interleave)."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    start = min(a.data_ptr(), b.data_ptr())
    mask = torch.zeros(max(memory_span(a)[1], memory_span(b)[1]) - start, dtype=torch.bool,
                       device=a.device)

    def bytes_of(t):
        size = t.element_size()
        strides = [stride * size for stride in t.stride()]
        return [mask.as_strided(t.shape, strides, t.data_ptr() - start + k)
                for k in range(size)]

    for view in bytes_of(a):
        view.fill_(True)
    return any(bool(view.any()) for view in bytes_of(b))


def refuse_shared_grads(by_device: dict, written_apart: bool = False) -> None:
    """The core's rule on gradients, for spans gathered in Python: raises on the first
    gradient sharing memory with a buffer a step writes (or two buffers of one parameter
    sharing memory). ``by_device``: per device, spans ``(start, end, order, written,
    name, place, tensor)`` with one ``order`` per parameter, which ``place`` names; the
    later parameter of a pair is blamed, as the core does. ``written_apart``: as for
    ``first_overlap``."""
    for spans in by_device.values():
        overlap = first_overlap(spans, tensor_of=lambda span: span[6],
                                written_apart=written_apart)
        if overlap is None:
            continue
        (_, _, order0, _, name0, place0, _), (_, _, order, _, name, place, _) = overlap
        if order == order0:
            rule = (f"{name} shares memory with its {name0} (rule: the buffers of one "
                    f"parameter must not share memory)")
        else:
            rule = (f"{name} shares memory with {place0}'s {name0} (rule: only gradients "
                    f"may share memory; a buffer the step writes must not be read as a "
                    f"gradient)")
        raise ValueError(f"{CLASS_NAME}: {place}: {rule}")


def check_disjoint_params(groups: list) -> None:
    """No two parameters of the optimizer share memory: each is updated in place, so
    one would see the other half-updated. ``groups``: the param_groups."""
    by_device = {}
    for g, group in enumerate(groups):
        for i, param in enumerate(group["params"]):
            local = _dtensor.to_local(param)
            if local.numel() > 0:
                by_device.setdefault(local.device, []).append(
                    memory_span(local) + ((g, i), True, local))
    for spans in by_device.values():
        overlap = first_overlap(spans, tensor_of=lambda span: span[4])
        if overlap is not None:
            (g0, i0), (g, i) = overlap[0][2], overlap[1][2]  # blame the later one
            other = place(g0, i0, param_name(groups[g0], i0))
            raise fail(RuntimeError,
                       f"shares memory with {other} (rule: parameters are updated in "
                       f"place and must not overlap)",
                       group=g, param=i, name=param_name(groups[g], i))


def grad_error(param: torch.Tensor, grad) -> Optional[str]:
    """Why ``grad`` cannot update ``param`` (S3.2 - S3.4), or None."""
    if not isinstance(grad, torch.Tensor):
        return (f"the gradient must be a tensor or None, got {type(grad).__name__} "
                f"(rule S3.2)")
    layout_error = _dtensor.grad_layout_error(param, grad)
    if layout_error is not None:
        return layout_error
    # The local tensor's own: Megatron FSDP keeps one gradient DTensor and swaps the
    # local tensor inside it (S3.4), so the wrapper's dtype may not be the data's.
    local_param, local_grad = _dtensor.to_local(param), _dtensor.to_local(grad)
    if local_grad.layout is not torch.strided or local_grad.is_nested:
        layout = "a nested tensor" if local_grad.is_nested else local_grad.layout
        return (f"gradient layout must be torch.strided (dense), got {layout} (rule "
                f"S3.2: a gradient is dense; sparse, mkldnn and nested ones are not "
                f"supported)")
    if local_grad.dtype not in PARAM_TAGS:
        return (f"gradient dtype must be fp32, fp16 or bf16, got {local_grad.dtype} (rule "
                f"S3.4)")
    if local_grad.shape != local_param.shape:
        what = "local shape" if _dtensor.is_dtensor(param) else "shape"
        return (f"gradient {what} {tuple(local_grad.shape)} does not match the parameter's "
                f"{what} {tuple(local_param.shape)} (rule S3.4: local shapes must match)")
    if local_grad.device != local_param.device:
        return (f"gradient is on {local_grad.device} but the parameter is on "
                f"{local_param.device} (rule S3.4: a gradient is on its parameter's device)")
    short = short_storage(local_grad)
    if short is not None:
        return (f"the gradient's storage holds {short[0]} bytes, fewer than its elements "
                f"span ({short[1]}): its memory was freed or shrunk (rule S3.2: a gradient "
                f"is read by value, so it must hold its values)")
    return None


def check_value(param: torch.Tensor, spec, value, where_: str) -> None:
    """A value given for ``param``'s state ``spec`` (S5.3, S5.5): a tensor of the
    parameter's local shape, fp32 (or int16 for a remainder)."""
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"{where_}: state {spec.name!r} must be a tensor, "
                           f"got {type(value).__name__} (rule S5.3)")
    layout_error = _dtensor.value_layout_error(param, value)
    if layout_error is not None:
        raise RuntimeError(f"{where_}: state {spec.name!r}: {layout_error}")
    local, local_param = _dtensor.to_local(value), _dtensor.to_local(param)
    if local.is_meta:
        raise RuntimeError(f"{where_}: state {spec.name!r} is a meta tensor (rule: a "
                           f"value holds data; a meta tensor has none to load)")
    if local.layout is not torch.strided:
        raise RuntimeError(f"{where_}: state {spec.name!r} must be dense, "
                           f"got layout {local.layout} (rule S5.3)")
    short = short_storage(local)
    if short is not None:
        raise RuntimeError(f"{where_}: state {spec.name!r} has a storage of {short[0]} bytes, "
                           f"fewer than its elements span ({short[1]}): its memory was "
                           f"freed or shrunk (rule S5.3: a value is read as S3.2 reads a "
                           f"gradient, so it must hold its values)")
    if tuple(local.shape) != tuple(local_param.shape):
        hint = ""
        if _dtensor.is_dtensor(param) and not _dtensor.is_dtensor(value):
            hint = (" (a plain value for a DTensor parameter is this rank's local part; "
                    "pass that, or a DTensor of the parameter's layout)")
        raise RuntimeError(f"{where_}: state {spec.name!r} has shape {tuple(local.shape)}, "
                           f"the parameter's local shape is {tuple(local_param.shape)} "
                           f"(rule S5.3: local shapes must match)" + hint)
