"""``FusedAdam``: Adam/AdamW with Transformer Engine's API and a C++ core.

docs/semantics.md is the contract; rule numbers (S3.1, ...) below point into it.
``step()`` only orchestrates: validate every group, then hand each group's tensors on
each device to one backend call (``_backend``). State layout and codecs live in
``_state``, checks in ``_validate``, DTensor handling in ``_dtensor``.

``optimizer.state[param]`` holds the storage tensors ``exp_avg``, ``exp_avg_sq`` and
``master_param`` (where S2.1 gives one), DTensors like the parameter for a DTensor
parameter (S2.6), and whatever else a framework writes there (kept, S5.4); the fp32
scale of each fp16 / fp8 state is a local 0-dim tensor in
``optimizer._scales[param][name]`` (S2.3), and the format each state was stored in
(``_formats``) in ``optimizer._formats[param][name]``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import warnings
from collections import defaultdict
from collections.abc import Iterable
from copy import deepcopy
from typing import Optional

import torch

from . import (_backend, _collector, _dtensor, _float_mode, _formats, _held_signals,
               _last_export, _plan, _state, _step_hooks, _step_lock, _stored_by, _validate)
from ._state import LAYOUT_KEY, STATE_NAMES


@contextlib.contextmanager
def _making_state():
    """Where state is created or converted: with IEEE subnormals (_float_mode), and
    outside ``torch.inference_mode``, whose tensors no later step outside that mode may
    update (torch's own optimizers create state at their first step, so they meet this
    less), and without autograd (leaving inference mode turns it on)."""
    with _float_mode.kept():
        if not torch.is_inference_mode_enabled():
            yield
            return
        with torch.inference_mode(False), torch.no_grad():
            yield


def _normal_tensors(method):
    """``method`` run as ``_making_state`` says."""
    @functools.wraps(method)
    def making_state(*args, **kwargs):
        with _making_state():
            return method(*args, **kwargs)
    return making_state


def _subnormals_kept(method):
    """``method`` (one that reads state) run with IEEE subnormals (_float_mode)."""
    @functools.wraps(method)
    def reading_state(*args, **kwargs):
        with _float_mode.kept():
            return method(*args, **kwargs)
    return reading_state


# Settings beyond torch's defaults that travel with a pickled optimizer.
_CONFIG_ATTRIBUTES = _validate.OPTIMIZER_SETTINGS + ("set_grad_none",)


class FusedAdam(torch.optim.Optimizer):
    """Adam / AdamW with low-precision state, a drop-in for TE's ``FusedAdam``.

    Arguments follow ``transformer_engine.pytorch.optimizers.FusedAdam``. State exists
    for every parameter from construction; moments may be stored as fp32, bf16, fp16
    or fp8 (``torch.uint8``) with a per-tensor scale; fp16/bf16 parameters may keep an
    fp32 or fp16 master (``master_weights``), or for bf16 an int16 remainder
    (``store_param_remainders``). CPU tensors step in the C++ core, CUDA tensors in its
    CUDA build where there is one, other devices with torch ops. ``amsgrad`` and
    ``capturable`` are not supported. Beyond TE, keyword-only: ``moment_format`` /
    ``moment_block_size`` (per-block scaled 8- or 4-bit moments, S2.11) and
    ``param_rounding="stochastic"`` (bf16 parameters with no master rounded
    stochastically, S2.14).

    Args (the S-rules are docs/semantics.md's):
        params: tensors (plain, or DTensor shards, S1.4) or dicts defining groups.
        lr: learning rate, >= 0: a number or a one-element tensor (S1.2).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: >= 0 (TE's default 0.0, not AdamW's 0.01).
        amsgrad: must be False (not supported).
        bias_correction: divide by ``1 - beta**step`` (False: by 1).
        adam_w_mode: True: decoupled weight decay (AdamW); False: L2, added to the
            gradient (Adam).
        capturable: must be False (CUDA graph capture is not supported).
        master_weights: keep a master copy of fp16/bf16 parameters (fp32 ones are
            their own master).
        master_weight_dtype: ``torch.float32``, or ``torch.float16`` (with a
            per-tensor scale).
        exp_avg_dtype, exp_avg_sq_dtype: ``torch.float32``, ``float16``, ``bfloat16``,
            or ``uint8`` (fp8 E4M3 with one scale per local tensor, S2.3).
        use_decoupled_grad: read ``param.decoupled_grad`` instead of ``param.grad``.
        store_param_remainders: with an fp32 master, keep a bf16 parameter's master as
            an int16 remainder beside it (2 bytes instead of 4, S2.5); off without
            ``master_weights``.
        set_grad_none: TE's deprecated default for ``zero_grad(set_to_none=None)``.
        moment_format: None, ``"block8"`` or ``"block4"``: both moments in 8- or 4-bit
            codes with one fp32 scale per block (S2.11). block4 packs two codes a
            byte along the last dimension: a parameter with one dimension, an odd last
            one or shards cut along it takes block8's codes. The moment dtypes stay at
            fp32; no fp16 master.
        moment_block_size: elements per scale, a power of two in [128, 4096]; None:
            256 for block8, 128 for block4.
        param_rounding: ``"nearest"``, or ``"stochastic"`` for bf16 parameters stepped
            without a master (S2.14).
    Every value is checked here; a bad one raises naming it and the rule (S1.2).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter | dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction=True,
        adam_w_mode=True,
        capturable=False,
        master_weights=False,
        master_weight_dtype=torch.float32,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        use_decoupled_grad=False,
        store_param_remainders=False,
        set_grad_none: Optional[bool] = None,
        moment_format: Optional[str] = None,
        moment_block_size: Optional[int] = None,
        param_rounding: str = "nearest",
    ):
        for name, value in (("amsgrad", amsgrad), ("adam_w_mode", adam_w_mode),
                            ("capturable", capturable), ("master_weights", master_weights),
                            ("use_decoupled_grad", use_decoupled_grad),
                            ("store_param_remainders", store_param_remainders)):
            _validate.check_flag(name, value)
        if set_grad_none is not None:  # TE's deprecated switch: None, or a flag
            _validate.check_flag("set_grad_none", set_grad_none)
        _validate.check_options(
            amsgrad=amsgrad, capturable=capturable, master_weights=master_weights,
            master_weight_dtype=master_weight_dtype, exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype)
        _validate.check_moment_format(moment_format, moment_block_size, exp_avg_dtype,
                                      exp_avg_sq_dtype, master_weights, master_weight_dtype)
        _validate.check_param_rounding(param_rounding, master_weights)
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas,
                    "eps": eps, "weight_decay": weight_decay}
        _validate.hyper_parameters(defaults)
        # Read by add_param_group, which torch's constructor calls: set them first.
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = False
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        # Beyond TE (S2.11): per-block scaled moments, named by no dtype.
        self.moment_format = moment_format
        self.moment_block_size = moment_block_size
        # Beyond TE (S2.14): bf16 parameters with no master rounded stochastically.
        self.param_rounding = param_rounding
        self.use_decoupled_grad = use_decoupled_grad
        # Remainders only ever replace an fp32 master (of a bf16 parameter); as in TE,
        # the flag stays off when master weights are off at construction.
        self.store_param_remainders = bool(store_param_remainders and master_weights
                                           and master_weight_dtype == torch.float32)
        self.set_grad_none = set_grad_none
        self._scales = {}  # {param: {state name: 0-dim fp32 scale}} (S2.3)
        self._formats = {}  # {param: {state name: the _formats.Format it was stored in}}
        # {param: the master tensor seeded from it} for masters that have not stepped
        # since: they follow the parameter until its first step (S1.6).
        self._seeded = {}
        # The groups at step 0 whose moments were set by hand (S5.4's moments=set): the
        # dicts themselves, which stay marked when another group is removed.
        self._moments_set = []
        self._plans = []
        self._plan_set = None  # every plan checked as one (_plan.PlanSet)
        self._param_index = {}
        self._checked = {}  # _backend.check_together's last passed lists, per device
        self._settings_passed = None  # _checked_config's last passed settings
        self._stepping = _step_lock.StepLock()  # held while a step checks and steps (S3.1)
        self._last_export = _last_export.LastExport()  # state_dict()'s, weakly (S5.5)
        self._constructing = True  # add_param_group leaves the parameters' overlaps to us
        _validate.check_params_argument(params)
        super().__init__(params, defaults)
        self._constructing = False
        _validate.check_disjoint_params(self.param_groups)  # S1.4, all groups at once
        if set_grad_none is not None:
            warnings.warn(
                "set_grad_none kwarg in FusedAdam constructor is deprecated. "
                "Use set_to_none kwarg in zero_grad instead.", DeprecationWarning,
                stacklevel=2)

    def __getstate__(self) -> dict:
        # torch pickles defaults, state and groups only; the configuration, the scales
        # and the formats go too (one pickle, so parameters stay shared between them).
        self._check_whole("a copy (deepcopy, pickle)")
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in _CONFIG_ATTRIBUTES})
        state["_scales"] = self._scales
        state["_formats"] = self._formats
        state["_seeded"] = self._seeded
        state["_moments_set"] = self._moments_set
        # States moved by hand (or put back in a replaced format): refused in a copy too.
        state["_moved"] = _state.moved_claims(self.state, self._formats, self)
        return state

    def __copy__(self):
        # copy.copy would share the state tensors, and the copy's __setstate__ would claim
        # them: the original would then refuse its own state as another optimizer's.
        raise TypeError(
            "FusedAdam cannot be copied with copy.copy: a shallow copy shares the state "
            "tensors, which one optimizer steps (rule S2.3: each scaled state is known as "
            "its optimizer's); use copy.deepcopy(optimizer), or a new FusedAdam and "
            "load_state_dict(optimizer.state_dict())")

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for name in ("moment_format", "moment_block_size"):  # older pickles lack them
            self.__dict__.setdefault(name, None)
        self.__dict__.setdefault("param_rounding", "nearest")
        self._scales = dict(state.get("_scales") or {})
        # An older pickle has none: its states are read by their dtypes.
        self._formats = dict(state.get("_formats") or {})
        # An older pickle marked the masters that follow True, not by their tensor.
        self._seeded = {param: self.state[param]["master_param"] if mark is True else mark
                        for param, mark in (state.get("_seeded") or {}).items()
                        if mark is not True or "master_param" in self.state.get(param, {})}
        # An older pickle marked the groups by index.
        self._moments_set = [self.param_groups[m] if isinstance(m, int) else m
                             for m in state.get("_moments_set") or ()
                             if not isinstance(m, int) or m < len(self.param_groups)]
        if "_scales" not in state:  # an older pickle kept them beside their states
            _state.migrate_scales(self.state, self._scales)
        # Restored with their scales; those moved by hand claimed where they were.
        _state.claim_all(self.state, self._formats, self, state.get("_moved") or ())
        self.__dict__.pop("_moved", None)  # torch's __setstate__ put every key here
        self._plans = []
        self._plan_set = None
        self._param_index = {}
        self._checked = {}
        self._settings_passed = None
        self._stepping = _step_lock.StepLock()
        self._last_export = _last_export.LastExport()

    # ------------------------------------------------------------------ groups

    @_normal_tensors
    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``; the new parameters get their state now (S1.6)."""
        config = self._checked_config()  # before torch adds the group
        index = len(self.param_groups)
        _validate.check_groups(self.param_groups)
        _validate.check_params_are_tensors(self.param_groups)
        params = param_group["params"] = _validate.group_params(param_group, index)
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        # (name, tensor) pairs: torch sets param_names later; name them now.
        named = ({"param_names": [p[0] for p in params]}
                 if params and isinstance(params[0], tuple) else param_group)
        _validate.check_names_like(named, self.param_groups, index)
        _validate.check_group_options(param_group, index, self._group_settings())
        _validate.check_step_counter(param_group, index)  # as step() would
        placed = {id(p): (g, i) for g, group in enumerate(self.param_groups)
                  for i, p in enumerate(group["params"])}
        _validate.check_params(tensors, index, named, placed)
        if not getattr(self, "_constructing", False):
            _validate.check_disjoint_params(self.param_groups + [dict(named, params=tensors)])
        _validate.hyper_parameters({**self.defaults, **param_group}, index)
        # Every new entry is planned (and checked) before anything changes.
        planned = [self._planned_entry(param, config, index, i, named)
                   for i, param in enumerate(tensors)]
        super().add_param_group(param_group)
        # Only once the group passed (torch's own checks too): a refused one changes
        # nothing, not even the records of a state taken out by hand to be put back.
        _state.drop_replaced_masters(self._seeded, self.state)  # S1.6
        self._forget_dropped()
        # A plan slot for the new group: removed before it steps, the groups are then
        # fewer than the slots, which tells the next step to drop its state (S1.6).
        self._plans.extend([None] * (len(self.param_groups) - len(self._plans)))
        group = self.param_groups[-1]
        group.setdefault("step", 0)
        group[LAYOUT_KEY] = config.record(params=group["params"])
        for param, writes, local, layout in planned:
            self._apply(param, writes, local, layout)

    def _forget_dropped(self) -> None:
        """Drops the scales and formats of parameters whose state is gone (cleared by
        hand, as Megatron FSDP does before it adds its shards as a new group): kept,
        they would keep those parameters and their storage alive."""
        for held in (self._scales, self._formats, self._seeded):
            for param in [p for p in held if p not in self.state]:
                del held[param]

    def _planned_entry(self, param, config, group: int, index: int, named: dict):
        """What add_param_group writes for ``param``; state it already has (a parameter
        moved between groups) must be readable: scaled codes need usable scales."""
        local, layout = _dtensor.to_local(param), _dtensor.layout_of(param)
        specs = config.specs_of(local, layout)
        entry, scales, formats = (self.state.get(param), self._scales.get(param),
                                  self._formats.get(param))
        error = ((_state.origin_error(specs, entry, formats, self, param)
                  or _state.undecodable_error(specs, entry, scales, formats, local))
                 if entry else None)
        if error is not None:
            raise _validate.fail(RuntimeError, error, group=group, param=index,
                                 name=_validate.param_name(named, index))
        writes = _state.plan_entry(specs, entry, scales, formats, local, layout,
                                   seeded=_state.follows(self._seeded, self.state, param))
        return param, writes, local, layout

    def _apply(self, param, writes: _state.EntryWrites, local, layout) -> None:
        _state.apply_entry(self.state, self._scales, self._formats, param, writes, local,
                           layout, self)
        _state.mark_seeded(self._seeded, self.state, param, writes)
        # The plans holding ``param`` (and the checks' record of the batches that
        # passed) hold the storages they bound: kept, a replaced state would stay alive
        # beside its successor until the next step rebuilt them. The other groups'
        # plans stand (rebuilding every group cost the next step ~15x a steady one).
        self._plans = [None if plan is not None and plan.holds(param) else plan
                       for plan in self._plans]
        self._plan_set = None
        self._checked = {}

    def _follow_params(self, stepping: list, followed: list) -> None:
        """Masters that follow their parameter (S1.6) and whose parameter steps now
        (``stepping``: it has a gradient) take its value again, as TE creates masters at
        the first step: weights loaded into the model after the optimizer was built are
        not undone by a master of the weights before. Runs after validation, binding and
        the calls' checks, in place (the plans stay bound); appends (parameter, mark) to
        ``followed`` as it takes the mark, once its master is re-seeded (one that fails
        keeps its mark)."""
        for param in stepping:
            self._reseed_master(param)
            followed.append((param, self._seeded.pop(param)))

    def _reseed_master(self, param) -> None:
        """Writes ``param``'s master, in its stored format, as seeded from the
        parameter's value now (S1.6)."""
        stored = _state.master_of(self.state.get(param))
        if stored is None:
            return
        stored = _dtensor.to_local(stored)
        fmt = _state.stored_format(stored, self._formats.get(param), "master_param")
        if fmt is None:
            return
        local = _dtensor.to_local(param).detach()
        spec = _state.StateSpec("master_param", fmt)
        scale = (self._scales.get(param) or {}).get("master_param")
        # In place, a chunk at a time: no master-sized temporary.
        _state.write_value(spec, _state.initial_value(spec, local, to_store=True), stored,
                           scale)

    def _group_settings(self) -> dict:
        """What a group may repeat, at these values (S1.2): the whole optimizer's
        settings, and the weight decay a group without its own takes."""
        settings = {name: getattr(self, name) for name in _validate.OPTIMIZER_SETTINGS}
        return dict(settings, amsgrad=False, set_grad_none=self.set_grad_none,
                    weight_decay=self.defaults["weight_decay"])

    def _config(self) -> _state.StateConfig:
        """The settings that shape the state, read now (S1.5: they may change)."""
        return _state.StateConfig(self.exp_avg_dtype, self.exp_avg_sq_dtype,
                                  bool(self.master_weights), self.master_weight_dtype,
                                  bool(self.store_param_remainders), self.moment_format,
                                  None if self.moment_block_size is None
                                  else int(self.moment_block_size), self.param_rounding)

    # ------------------------------------------------------------------ step

    def _plain_step(self, closure=None, grad_scaler=None):
        """One Adam/AdamW step for every group (S3).

        ``grad_scaler`` is accepted and ignored (S3.8): ``GradScaler.step`` unscales the
        gradients and skips steps with non-finite gradients before calling this.
        """
        # torch.no_grad() as C calls, dynamo's disable wrapper only where dynamo
        # evaluates frames (_step_hooks).
        grad_enabled = _step_hooks.is_grad_enabled()
        _step_hooks.set_grad_enabled(False)
        try:
            if _step_hooks.dynamo_frames():
                return self._undynamic_step(closure)
            return self._step(closure)
        finally:
            _step_hooks.set_grad_enabled(grad_enabled)

    @torch.no_grad()
    def _traced_step(self, closure=None, grad_scaler=None):
        # The step with hooks or a profiler, and what dynamo traces: in its disable
        # wrapper always (dynamo cannot trace dynamo_frames), as torch's optimizers.
        return self._undynamic_step(closure)

    def step(self, *args, **kwargs):
        # torch's profiler range and step hooks where they are in use, and while dynamo
        # traces the call (_step_hooks); they see the arguments as given. A subclass's
        # own step() is wrapped by torch and runs them itself.
        if _step_hooks.needed(self):
            if type(self).step is FusedAdam.step:
                return self._hooked_step(*args, **kwargs)
            return self._traced_step(*args, **kwargs)
        return self._plain_step(*args, **kwargs)

    _hooked_step = _step_hooks.profiled(_traced_step)
    step.__doc__ = _plain_step.__doc__
    step.__signature__ = inspect.signature(_plain_step)
    step.hooked = True  # so torch.optim.Optimizer leaves it unwrapped

    def _step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _backend.warn_unbuilt(self.param_groups)  # before anything changes
        # Ctrl-C and SIGTERM wait until the step is whole or refused (S3.1), and the
        # garbage collector is off meanwhile (_collector): switched inside the hold, so
        # that no handler can raise between the switches and leave it off.
        with _held_signals.held(), _collector.paused():
            self._check_whole("step()")
            # Another step of this optimizer inside this one (a signal handler's, another
            # thread's) would step state this one has checked and is stepping.
            if self._stepping.busy():
                raise RuntimeError(
                    f"{_validate.CLASS_NAME}: step() was called while another step() of "
                    f"this optimizer runs (from a signal handler or another thread); "
                    f"nothing changed (rule S3.1: one step at a time)")
            with self._stepping.held():
                self._step_groups()
        return loss

    def _check_whole(self, call):
        if self._stepping.torn:
            raise RuntimeError(
                f"{_validate.CLASS_NAME}: {call} refused: this process was forked while "
                f"another thread was inside step() of this optimizer, so here its "
                f"parameters and state may be partly stepped (some tensors or groups "
                f"updated, their step counts not); load a checkpoint (load_state_dict "
                f"ends this) or build a new optimizer (rule S3.1)")

    def _step_groups(self):
        config = self._checked_config()
        dropped = _state.drop_replaced_masters(self._seeded, self.state)  # S1.6
        try:
            self._check_and_step_groups(config)
        except BaseException:
            # Refused (S3.1): a master whose entry was out, to be put back, follows
            # again once it is back.
            for param, mark in dropped.items():
                self._seeded.setdefault(param, mark)
            raise

    def _check_and_step_groups(self, config):
        # (2) validate everything, (3) only then mutate (S3.1).
        listing = _plan.Listing()  # the state containers, listed once for every group
        groups = self.param_groups
        if type(groups) is not list:  # refused by name, as every other method does
            _validate.check_groups(groups)
        plan_set = self._plan_set
        current = plan_set is not None and plan_set.is_current(
            groups, self._plans, config, self.state, self._scales, self._formats, listing)
        work = [self._prepare_group(i, group, config, listing, current)
                for i, group in enumerate(groups)]
        unbound = [plan for plan, _, _ in work if not plan.bound]
        if not current:
            # Every plan passed its own check or was rebuilt; once all passed, the next
            # steps check them as one.
            self._plan_set = None if unbound else _plan.PlanSet(
                groups, [plan for plan, _, _ in work], config, self.state, self._scales,
                self._formats, listing)
        if unbound:  # a parameter set is new
            _validate.check_disjoint_params(self.param_groups)
            # Before binding writes state, if it does (plans dropped by
            # add_param_group or initialize_state bind without writing: the
            # checks of the calls below then come first).
            checked = False

            def before_writing():
                nonlocal checked
                if not checked:
                    _backend.check_before_binding(
                        [b for _, _, batches in work for b in batches],
                        [b for plan, _, batches in work if plan.bound for b in batches],
                        self.state, self._scales)
                    checked = True

            with _making_state():
                for plan in unbound:
                    plan.bind(self._seeded, self, before_writing)
        prepared = [[_backend.prepare(batch_grads) for batch_grads in batches]
                    for _, _, batches in work]
        # Masters that follow a parameter stepping now are re-seeded in place before
        # the calls run (S1.6).
        attr = "decoupled_grad" if self.use_decoupled_grad else "grad"
        following = []
        if self._seeded:  # of parameters the groups hold (one taken out is not stepped)
            held = {id(p) for group in self.param_groups for p in group["params"]}
            following = [p for p in self._seeded
                         if id(p) in held and getattr(p, attr, None) is not None]
        # The core's own checks (buffers shared between tensors), for every group at
        # once: the last check before anything is updated, a lone call's too when
        # masters are re-seeded before it runs (it would check itself only after).
        _backend.check_together([item for items in prepared for item in items],
                                self._checked, lone_too=bool(following))
        followed = []  # (param, mark) of the masters re-seeded
        try:
            if following:
                with _float_mode.kept():
                    self._follow_params(following, followed)
            for (_, hyper, _), items in zip(work, prepared):
                for item in items:
                    _backend.run(item, hyper)
        except BaseException:
            # A call refused on its own (S3.1): the re-seeded masters hold the
            # values they are read as while they follow, so their marks restore
            # them whole.
            self._seeded.update(followed)
            raise
        # Every group, even with no gradient (S2.8), once every batch has run: a
        # call refused on its own leaves no group counted.
        rebound = set(map(id, unbound))  # by identity: one lookup per group
        for group, (plan, hyper, _) in zip(self.param_groups, work):
            group["step"] = hyper.step
            if id(plan) in rebound:  # its record describes the state again (S1.5)
                group[LAYOUT_KEY] = config.record(params=group["params"])
        if unbound or len(self._plans) > len(groups):
            # The groups' parameters changed (a group removed leaves the other plans
            # current): some may have left them.
            del self._plans[len(groups):]
            self._drop_left_state()

    def _drop_left_state(self) -> None:
        """Drops the state of tensors that no group holds any longer (S1.6). Made at
        construction, it would otherwise outlive a swap of the groups' parameters:
        accelerate's FSDP2 ``prepare`` puts the sharded parameters in place of the whole
        ones the optimizer was built over, whose full-size state (and the whole
        parameters, its keys) every rank then kept beside the shards'."""
        held = {id(p) for group in self.param_groups for p in group["params"]}
        for key in [k for k in self.state if id(k) not in held]:
            del self.state[key]
        self._forget_dropped()  # their scales, formats and following masters

    def _own_step(self, closure):
        return self._step(closure)  # a subclass's own _step, as on the plain path

    # The step where dynamo evaluates frames (_step_hooks). (Not step() itself:
    # torch.compile(opt.step) then calls it without `self`.)
    _undynamic_step = _step_hooks.disable_dynamo(_own_step)

    def _checked_config(self) -> _state.StateConfig:
        """The state configuration after checking the settings (S1.5: they may change
        between steps). Checked again only when a setting is another object than at the
        last check that passed (all are immutable where valid, so the same objects pass
        again), or when what the loaded core offers is; otherwise the configuration that
        check made is returned."""
        seen = (self.capturable, self.master_weights, self.master_weight_dtype,
                self.exp_avg_dtype, self.exp_avg_sq_dtype, self.store_param_remainders,
                self.moment_format, self.moment_block_size, self.param_rounding,
                _formats.unavailable(), _formats.SCALE_BLOCK_RANGE)
        passed = self._settings_passed
        if passed is not None and all(map(operator.is_, seen, passed[0])):
            return passed[1]
        for name in ("capturable", "master_weights", "store_param_remainders"):
            _validate.check_flag(name, getattr(self, name))
        _validate.check_options(
            amsgrad=False, capturable=self.capturable, master_weights=self.master_weights,
            master_weight_dtype=self.master_weight_dtype, exp_avg_dtype=self.exp_avg_dtype,
            exp_avg_sq_dtype=self.exp_avg_sq_dtype)
        _validate.check_moment_format(self.moment_format, self.moment_block_size,
                                      self.exp_avg_dtype, self.exp_avg_sq_dtype,
                                      self.master_weights, self.master_weight_dtype)
        _validate.check_param_rounding(self.param_rounding, self.master_weights)
        config = self._config()
        self._settings_passed = (seen, config)
        return config

    def _prepare_group(self, index: int, group: dict, config: _state.StateConfig,
                       listing: Optional[_plan.Listing] = None, current: bool = False):
        """Checks one group and gathers its gradients; reads only. ``current``: its
        cached plan is known to be current (``_plan.PlanSet``)."""
        _validate.check_group_keys(group, index, self._group_settings)
        lr, beta1, beta2, eps, weight_decay = _validate.hyper_parameters(
            group, index, lr_on_device=True)
        step = _validate.check_step_counter(group, index)  # a missing counter is 0
        plan = self._plans[index] if current else self._plan(index, group, config, listing)
        if plan.inference_param is not None and not torch.is_inference_mode_enabled():
            i = plan.inference_param.index
            raise _validate.fail(
                RuntimeError, "is an inference tensor, made under torch.inference_mode, "
                "and only a step under that mode may update it (rule: parameters are "
                "updated in place, S1.4; as torch's optimizers)", group=index, param=i,
                name=_validate.param_name(group, i))
        if plan.has_cuda and torch.cuda.is_current_stream_capturing():
            # Replays of a captured step would repeat its counter, bias corrections and
            # random keys, while group["step"] counts only the capture.
            raise _validate.fail(
                RuntimeError, "step() is being captured into a CUDA graph (rule: "
                "capturable=True, TE's graph-safe step, is not supported; step outside "
                "the graph, as torch's optimizers with capturable=False require)",
                group=index)
        if isinstance(lr, torch.Tensor) and not (plan.bound and
                                                 _backend.reads_lr_on_device(plan.batches)):
            # A batch that steps elsewhere needs lr's value: read and checked here,
            # before anything is written (this waits for the device, S1.2). So does
            # a plan not yet bound, whose batches cannot tell their path yet.
            lr = _validate.hyper_parameters(group, index)[0]
        adam_w_mode = self.adam_w_mode  # read at every step, as TE's
        if type(adam_w_mode) is not int or adam_w_mode not in (0, 1):
            _validate.check_flag("adam_w_mode", adam_w_mode)
        hyper = _backend.Hyper(lr, beta1, beta2, eps, weight_decay, bool(adam_w_mode),
                               bool(group["bias_correction"]), step + 1)  # S3.6
        if not isinstance(lr, torch.Tensor):  # a device lr is read by the kernels only
            _validate.check_step_constants(hyper, index)
        decoupled = self.use_decoupled_grad
        if type(decoupled) is not bool:  # S1.5: Megatron sets it after construction
            _validate.check_flag("use_decoupled_grad", decoupled)
        batches = [_plan.gather_grads(batch, bool(decoupled), group, index)
                   for batch in plan.batches]
        if not decoupled:
            _plan.warn_unread_decoupled_grads(batches)
        return plan, hyper, batches

    def _plan(self, index: int, group: dict, config: _state.StateConfig,
              listing: Optional[_plan.Listing] = None) -> _plan.GroupPlan:
        """The group's cached plan for ``config`` if still valid, else a new, not yet
        bound one."""
        while len(self._plans) <= index:
            self._plans.append(None)
        plan = self._plans[index]
        held = (self.state, self._scales, self._formats)
        if plan is None or not plan.is_current(group, config, *held, listing):
            plan = self._plans[index] = _plan.build_plan(group, index, config, *held, self)
        return plan

    # ------------------------------------------------------------------ grads

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """TE's ``zero_grad`` (S4): with ``use_decoupled_grad`` it clears
        ``param.decoupled_grad`` and leaves ``param.grad`` alone."""
        if set_to_none is not None:  # read by truth value: "False" would be true
            _validate.check_flag("set_to_none", set_to_none)
        # Attributes read here, which may have changed since construction (S1.5).
        _validate.check_flag("use_decoupled_grad", self.use_decoupled_grad)
        if self.set_grad_none is not None:
            _validate.check_flag("set_grad_none", self.set_grad_none)
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(  # TE's message, and the rule
                    f"Called zero_grad with set_to_none={set_to_none}, "
                    f"but FusedAdam was initialized with set_grad_none={self.set_grad_none} "
                    f"(rule S4: the deprecated set_grad_none decides; pass no set_to_none "
                    f"or the same value)")
            set_to_none = self.set_grad_none
        if set_to_none is None:
            set_to_none = True
        _validate.check_groups(self.param_groups)
        _validate.check_grads_clearable(self.param_groups, self.use_decoupled_grad,
                                        set_to_none)
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for param in group["params"]:
                grad = getattr(param, "decoupled_grad", None)
                if set_to_none:
                    param.decoupled_grad = None
                elif grad is not None:
                    grad.zero_()

    # ------------------------------------------------------------------ state access

    def _locate(self, param) -> tuple:
        """``(group index, param index)`` of a parameter of this optimizer, else KeyError."""
        found = self._param_index.get(id(param))
        if found is not None:
            g, i = found
            groups = self.param_groups
            params = (groups[g].get("params") if g < len(groups) and type(groups[g]) is dict
                      else None)
            if type(params) is list and i < len(params) and params[i] is param:
                return found
        _validate.check_groups(self.param_groups)  # what the index is built from
        self._param_index = {id(p): (g, i) for g, group in enumerate(self.param_groups)
                             for i, p in enumerate(group["params"])}
        found = self._param_index.get(id(param))
        if found is None:
            raise KeyError(f"{_validate.CLASS_NAME}: {_validate.shown(param)} is not a "
                           f"parameter of this optimizer (rule S5.2: state is read and set "
                           f"by the parameter tensor itself)")
        return found

    def _where(self, param) -> str:
        """"group g, param i ('name')" of a parameter of this optimizer, else KeyError."""
        g, i = self._locate(param)
        return _validate.where(g, i, _validate.param_name(self.param_groups[g], i))

    def _spec(self, param, state_name: str):
        """``(where, spec)`` for a state name of one parameter, else KeyError (S5.2)."""
        where = self._where(param)
        local = _dtensor.to_local(param)
        specs = {s.name: s
                 for s in self._checked_config().specs_of(local, _dtensor.layout_of(param))}
        if not isinstance(state_name, str) or state_name not in specs:
            raise KeyError(f"{where}: unknown state name {_validate.shown(state_name)}; "
                           f"this parameter's states are {sorted(specs)} (rule S5.2)")
        return where, specs[state_name]

    @_normal_tensors
    @torch.no_grad()  # state is data, never part of a graph
    def initialize_state(self, param, store_param_remainders=None) -> None:
        """(Re)creates ``param``'s state (S5.1): zero moments, master seeded from the
        parameter (or a zero remainder). ``None`` means what the configuration
        implies; an explicit value that contradicts it is an error."""
        where = self._where(param)
        error = _validate.param_error(param)
        if error is not None:
            raise RuntimeError(f"{where}: {error}")
        config = self._checked_config()
        local, layout = _dtensor.to_local(param), _dtensor.layout_of(param)
        implied = config.uses_remainders(local.dtype)
        if store_param_remainders is not None:
            _validate.check_flag("store_param_remainders", store_param_remainders)
        if store_param_remainders is not None and bool(store_param_remainders) != implied:
            raise RuntimeError(
                f"{where}: store_param_remainders={store_param_remainders!r} contradicts "
                f"the configuration (rule: remainders iff master_weights, fp32 "
                f"master_weight_dtype, store_param_remainders and a bf16 parameter; "
                f"implied {implied})")
        writes = _state.plan_entry(config.specs_of(local, layout), None, None, None, local,
                                   layout)
        # A fresh entry holds nothing else.
        entry = self.state.get(param)
        for key in entry if isinstance(entry, dict) else ():  # anything else is replaced
            writes.stored.setdefault(key, None)
        for key in self._scales.get(param, ()):
            writes.scales.setdefault(key, None)
        self._apply(param, writes, local, layout)

    @_subnormals_kept
    def get_unscaled_state(self, param, state_name: str, skip_unscale: bool = False):
        """The true value of a state (S5.2), as a local tensor: fp32 (the stored tensor
        itself when stored as fp32, else a copy), the raw int16 for remainders, or the
        stored bf16 tensor when ``skip_unscale`` and the state is bf16. In the form the
        configuration exports, as ``state_dict()`` gives it: after a setting changed
        (S1.5), the true values stored until then (a master as the remainder the next
        step makes of it), not yet rounded to the new format."""
        where, spec = self._spec(param, state_name)
        entry = self.state.get(param)
        if entry is None or (isinstance(entry, dict) and entry.get(state_name) is None):
            raise KeyError(f"{where}: no state {state_name!r} yet (rule S5.2: reading "
                           f"creates none; initialize_state(param) creates it)")
        self._check_decodable(param, (spec,), entry)
        if state_name == "master_param" and _state.follows(self._seeded, self.state, param):
            # Read through TE's accessor (which hands out the fp32 tensor itself), a
            # master that follows its parameter is seeded now and is the truth (S1.6).
            local = self._param_values(param, spec)
            if _state.stored_format(_dtensor.to_local(entry[state_name]),
                                    self._formats.get(param), state_name) is spec.format:
                del self._seeded[param]
                self._reseed_master(param)
            else:  # a setting changed since: what the next step would seed
                return _state.seeded_value(spec, local)
        formats = self._formats.get(param)
        stored = _dtensor.to_local(entry[state_name])
        fmt = _state.stored_format(stored, formats, state_name)
        if skip_unscale and fmt is not None and not fmt.scaled and fmt is spec.format:
            return stored  # TE's bf16 as stored (fp32 and remainders are returned so anyway)
        local = _dtensor.to_local(param)
        value, bits = _state.converted_value(spec, entry, self._scales.get(param), formats,
                                             local)
        if bits is not None:  # a master made a remainder since (S1.5): pair them now
            _state.write_param_bits(local, bits)
        return value

    def _check_decodable(self, param, specs, entry) -> None:
        """Refuses to read per-block codes whose scales are missing or unusable, as
        step() refuses to step them (S2.11: their values would be wrong), and a state
        that no longer has its parameter's shape (``param.data`` given another: the
        export could not be loaded back)."""
        formats = self._formats.get(param)
        local = _dtensor.to_local(param)
        error = (_state.origin_error(specs, entry, formats, self, param)
                 or _state.misshapen_error(specs, entry, local, formats)
                 or _state.undecodable_error(specs, entry, self._scales.get(param),
                                             formats, local))
        if error is not None:
            g, i = self._locate(param)
            raise _validate.fail(RuntimeError, error, group=g, param=i,
                                 name=_validate.param_name(self.param_groups[g], i))

    @_normal_tensors
    @torch.no_grad()  # state is data, never part of a graph
    def set_scaled_state(self, param, state_name: str, unscaled_state) -> None:
        """Stores true values (fp32; int16 for remainders) with a fresh scale (S5.3).

        ``unscaled_state`` may be a DTensor of the parameter's layout (mesh, placements,
        global shape) or a plain tensor of the parameter's local shape (this rank's
        part); it is not modified. The scale is measured over the local part (S2.3).
        """
        where, spec = self._spec(param, state_name)
        _validate.check_value(param, spec, unscaled_state, where)
        value = _dtensor.to_local(unscaled_state).resolve_neg()  # read by value (S3.2)
        wanted = spec.format.value_dtype
        if value.dtype != wanted:
            hint = ("; with store_param_remainders on, a bf16 parameter's master is set as "
                    "its int16 remainder, S2.5: switch it off to set an fp32 master"
                    if wanted == torch.int16 else "")
            raise RuntimeError(f"{where}: state {state_name!r} takes {wanted} values, "
                               f"got {value.dtype} (rule S5.3{hint})")
        local, layout = _dtensor.to_local(param), _dtensor.layout_of(param)
        entry, scales = self.state.get(param), self._scales.get(param)
        if entry is not None and not isinstance(entry, dict):
            raise RuntimeError(f"{where}: {_state.entry_type_error(entry)}")
        stored = entry.get(state_name) if entry is not None else None
        if _state.holds_values(stored) and _validate.spans_meet(
                value, _dtensor.to_local(stored)):
            value = value.clone()  # a view of the state itself: read before it is written
        if state_name == "master_param":  # set by hand, it no longer follows (S1.6)
            self._seeded.pop(param, None)
        else:  # moments before the first step: a checkpoint now must still load (S5.5)
            group = self.param_groups[self._locate(param)[0]]
            if group.get("step", 0) == 0 and all(m is not group for m in self._moments_set):
                self._moments_set.append(group)
        if entry is not None and _state.entry_matches(spec, entry, scales,
                                                      self._formats.get(param), local,
                                                      layout):
            # In place: the storage, its DTensor wrapper and every cached pointer to
            # them stay valid. Scaled values written here with their scales are this
            # place's now, wherever the tensor was stored before.
            _state.write_value(spec, value, _dtensor.to_local(entry[state_name]),
                               scales.get(state_name) if scales else None)
            if spec.format.scaled:
                _stored_by.claim(entry[state_name], self, param, state_name,
                                 spec.format.label)
            return
        writes = _state.EntryWrites()
        writes.put(spec, value, local)
        self._apply(param, writes, local, layout)

    # ------------------------------------------------------------------ checkpoints

    @_subnormals_kept
    def state_dict(self) -> dict:
        """torch's layout with, per parameter, ``exp_avg``, ``exp_avg_sq`` and
        ``master_param`` where there is one, as fp32 true values (int16 for remainders),
        wrapped like the parameter, plus any other key kept in its state; each group
        records the state layout under ``state_layout`` (S5.4)."""
        self._check_whole("state_dict()")
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        _validate.check_groups(self.param_groups)
        _validate.check_params_are_tensors(self.param_groups)
        config = self._checked_config()
        # Only a group still at step 0 keeps the mark of moments set by hand.
        held = set(map(id, self.param_groups))
        self._moments_set = [m for m in self._moments_set
                             if id(m) in held and m.get("step", 0) == 0]
        marked = set(map(id, self._moments_set))
        records = [config.record(id(group) in marked, group["params"],
                                 self._masters_follow(group, config))
                   for group in self.param_groups]
        param_groups, packed_state, start, rounded, exported = [], {}, 0, [], []
        for group, record in zip(self.param_groups, records):
            packed = {k: v for k, v in group.items() if k != "params"}
            packed[LAYOUT_KEY] = record  # the configuration may have changed (S1.5)
            packed["params"] = list(range(start, start + len(group["params"])))
            param_groups.append(packed)
            for index, param in zip(packed["params"], group["params"]):
                packed_state[index], bits = self._exported_state(param, config)
                exported.append((param, packed_state[index]))
                if bits is not None:
                    rounded.append((_dtensor.to_local(param), bits))
            start += len(group["params"])
        for group, record in zip(self.param_groups, records):  # once all were exported
            group[LAYOUT_KEY] = record
        for local, bits in rounded:  # masters made remainders since (S1.5): paired now
            _state.write_param_bits(local, bits)
        self._last_export.record(exported, records)
        state_dict = {"state": packed_state, "param_groups": param_groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _exported_state(self, param, config) -> tuple:
        """``param``'s entry of ``state_dict()`` (S5.4): its states, then any other key
        someone keeps in ``optimizer.state[param]`` (Megatron writes ``step``), as is.
        Also the bf16 bits the parameter must take for an exported remainder to pair
        with it (a master made a remainder by a setting changed since the last step,
        S1.5, S2.5), else None; the caller writes them once nothing can be refused."""
        local, layout = _dtensor.to_local(param), _dtensor.layout_of(param)
        entry = self.state.get(param)
        entry = {} if entry is None else entry  # anything but a dict is refused below
        scales, formats = self._scales.get(param), self._formats.get(param)
        specs = config.specs_of(local, layout)
        self._check_decodable(param, specs, entry)
        exported, param_bits = {}, None
        follows = _state.follows(self._seeded, self.state, param)
        for spec in specs:
            if follows and spec.name == "master_param":  # until it steps (S1.6)
                value = _state.seeded_value(spec, self._param_values(param, spec))
            elif entry.get(spec.name) is not None:  # None: cleared, as step() reads it
                value, bits = _state.converted_value(spec, entry, scales, formats, local)
                param_bits = bits if bits is not None else param_bits
            else:  # what initialisation would create (state may have been cleared)
                value = _state.initial_value(spec, self._param_values(param, spec))
            exported[spec.name] = layout.wrap(value)
        exported.update((k, v) for k, v in entry.items() if k not in STATE_NAMES)
        return exported, param_bits

    def _masters_follow(self, group: dict, config) -> bool:
        """Whether ``group``, at step 0, has masters seeded from their parameters and
        every one still follows its parameter (S1.6, S5.4's masters=follow)."""
        if group.get("step", 0) != 0:
            return False
        seeds = {dtype: any(map(_state.seeds_from_param, config.specs(dtype)))
                 for dtype in {p.dtype for p in group["params"]}}
        seeding = [p for p in group["params"] if seeds[p.dtype]]
        return bool(seeding) and all(_state.follows(self._seeded, self.state, p)
                                     for p in seeding)

    def _param_values(self, param, spec) -> torch.Tensor:
        """``param``'s local tensor, where state ``spec`` is to be seeded from it: one
        whose storage was freed is refused by name (S1.4), not by torch's bare "data is
        not allocated yet"."""
        local = _dtensor.to_local(param)
        error = _validate.freed_error(local) if _state.seeds_from_param(spec) else None
        if error is not None:
            raise RuntimeError(f"{self._where(param)}: {error}")
        return local

    @_normal_tensors
    @torch.no_grad()  # state is data, never part of a graph
    def load_state_dict(self, state_dict: dict) -> None:
        """Restores what ``state_dict()`` produced (S5.5): configured storage dtypes
        (never the parameter's dtype), fresh scales, ``step``. Everything is checked and
        prepared first; on any error the optimizer is unchanged."""
        _validate.check_loaded_dict(state_dict)
        state_dict = dict(state_dict)  # any Mapping, as checked
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        _validate.check_loaded_dict(state_dict, whole=True)
        _validate.check_groups(self.param_groups)
        saved_groups = deepcopy([dict(group) for group in state_dict["param_groups"]])
        prepared, presets = self._prepare_load(state_dict, saved_groups)
        # Nothing above wrote anything; from here on nothing can fail.
        new_state, new_scales, new_formats = defaultdict(dict), {}, {}
        for param, local, layout, writes in prepared:
            _state.apply_entry(new_state, new_scales, new_formats, param, writes, local,
                               layout, self)
        seeded = {param: new_state[param]["master_param"] for param, _, _, writes in prepared
                  if "master_param" in writes.seeded}
        # Saved hyper-parameters win; keys the checkpoint lacks keep their values.
        marks = [marked and saved["step"] == 0 for marked, saved in zip(presets, saved_groups)]
        config = self._config()  # as _prepare_load checked it
        self.param_groups = [{**group, **saved, "params": group["params"],
                              LAYOUT_KEY: config.record(mark, group["params"])}
                             for group, saved, mark in zip(self.param_groups, saved_groups,
                                                           marks)]
        self._moments_set = [group for group, mark in zip(self.param_groups, marks) if mark]
        self.state = new_state
        self._scales = new_scales
        self._formats = new_formats
        self._seeded = seeded
        self._plans = []
        self._plan_set = None
        self._checked = {}
        self._stepping.torn = False  # whole again (_step_lock)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _prepare_load(self, state_dict: dict, saved_groups: list) -> tuple:
        """Checks a state dict against this optimizer and builds every new state tensor
        (in fresh storage), and whether each group's moments were set at step 0 (S5.4).
        Raises on the first problem, with the optimizer's values unchanged; it only
        forgets seeded-master marks whose master was already replaced (S1.6)."""
        where = _validate.CLASS_NAME
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{where}: loaded state dict has a different number of "
                             f"parameter groups ({len(saved_groups)} vs "
                             f"{len(self.param_groups)}; rule S5.5: groups load in order, "
                             f"one for one)")
        own_steps, saved_layouts, presets, following = [], [], [], []
        for g, (group, saved, original) in enumerate(
                zip(self.param_groups, saved_groups, state_dict["param_groups"])):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{_validate.where(g)}: loaded state dict contains a parameter group "
                    f"that doesn't match the size of optimizer's group "
                    f"({len(saved['params'])} vs {len(group['params'])} parameters; rule "
                    f"S5.5: parameters load in order, one for one)")
            saved["params"] = original["params"]  # the keys of "state", not copies
            _validate.check_loaded_names(saved, g)
            # A group without its own step takes its parameters' (torch's Adam layout):
            # then their per-parameter "step" is consumed, not kept as an extra key.
            own_steps.append("step" in saved)
            _validate.check_loaded_options(
                saved, self.adam_w_mode, g, saved.get("weight_decay", group["weight_decay"]))
            for key in _validate.TORCH_OPTIONS:  # then dropped: not this optimizer's
                saved.pop(key, None)
            for key in _validate.WHOLE_OPTIMIZER:  # the saver's (a ZeRO-held group's):
                saved.pop(key, None)  # its state converts through state_layout
            saved["step"] = _validate.loaded_group_step(saved, state_dict["state"], g)
            presets.append(_state.StateConfig.moments_set_in(saved.get(LAYOUT_KEY)))
            # A record this optimizer's last state_dict() made (DCP left the template's
            # where the checkpoint has none) says nothing of the checkpoint's masters.
            following.append(_state.StateConfig.masters_follow_in(saved.get(LAYOUT_KEY))
                             and not self._last_export.made(saved.get(LAYOUT_KEY)))
            if own_steps[-1] and not presets[-1]:
                _validate.check_moments_of_step_0(saved, state_dict["state"], g)
            saved_layouts.append(_validate.loaded_layout(saved.pop(LAYOUT_KEY, None), g))
            saved.pop("params")
            merged = {**group, **saved}
            _validate.check_group_keys(merged, g, self._group_settings)
            _validate.hyper_parameters(merged, g)
        config = self._checked_config()
        saved_state = state_dict["state"]
        # The template this optimizer's state_dict() made (dcp.load filled it in place).
        template = self._last_export.holds_any(saved_state)
        prepared = []
        for g, group in enumerate(self.param_groups):
            keys = state_dict["param_groups"][g]["params"]
            for i, (param, key) in enumerate(zip(group["params"], keys)):
                here = _validate.where(g, i, _validate.param_name(group, i))
                values, saved_layout = saved_state.get(key), saved_layouts[g]
                if saved_layout is None and isinstance(values, dict) and not values:
                    values = None  # torch's defaultdict state exports {} for a lookup
                kept_bits, kept = None, False
                if values is None and not param.requires_grad:
                    # torch's set_optimizer_state_dict leaves a frozen parameter's
                    # state out: read from the template it was loaded into, else it
                    # keeps its state, re-stored as by any load.
                    values = self._last_export.frozen_entry(param) if template else None
                    if values is None:
                        values, kept_bits = self._exported_state(param, config)
                        saved_layout, kept = None, True  # its own, not the checkpoint's
                elif values is None and saved_layout is None:
                    # TE's and torch's optimizers create a parameter's state at its
                    # first gradient: one that never had one (unused, or a checkpoint
                    # taken before the first step) starts fresh, as initialisation.
                    values = self._initial_values(param, config)
                if values is None:
                    raise ValueError(f"{here}: the loaded state dict has no state for "
                                     f"this parameter (key {_validate.shown(key)}; only a "
                                     f"parameter with requires_grad=False, or one of a "
                                     f"checkpoint without state_layout, may have none)")
                if not isinstance(values, dict):
                    raise ValueError(f"{here}: the loaded state of this parameter (key "
                                     f"{_validate.shown(key)}) must be a dict of its "
                                     f"states, as state_dict() makes it, got "
                                     f"{_validate.shown(values)}")
                at_step_0 = saved_groups[g]["step"] == 0
                prepared.append(self._prepare_param_load(
                    param, values, config, here, saved_layout, own_steps[g], at_step_0,
                    at_step_0 and following[g] and saved_layout is not None))
                writes = prepared[-1][3]
                if kept_bits is not None:  # its kept master made a remainder (S1.5)
                    writes.param_bits = kept_bits
                if (kept and _state.follows(self._seeded, self.state, param)
                        and "master_param" in writes.stored):
                    writes.seeded.add("master_param")  # a kept master still follows
        return prepared, presets

    @staticmethod
    def _initial_values(param, config) -> dict:
        """The moments initialisation gives ``param`` (S1.6: 0), as a load takes them;
        its master, missing here, is seeded by the load."""
        local, layout = _dtensor.to_local(param), _dtensor.layout_of(param)
        return {spec.name: _state.initial_value(spec, local, to_store=True)
                for spec in config.specs_of(local, layout) if spec.name != "master_param"}

    def _prepare_param_load(self, param, values: dict, config, here: str, saved_layout,
                            own_step: bool, at_step_0: bool = False,
                            masters_followed: bool = False):
        """The new state of one parameter from its saved ``values`` (S5.5): a DTensor
        value must have the parameter's layout, a plain one is taken as this rank's local
        part and must have the local shape. ``saved_layout``: the ``StateConfig`` the
        checkpoint recorded (None if it recorded none); ``at_step_0``: its group loads
        at step 0; ``masters_followed``: its record says its masters followed."""
        local, layout = _dtensor.to_local(param), _dtensor.layout_of(param)
        error = _validate.param_error(param)
        if error is not None:
            raise RuntimeError(f"{here}: {error}")
        loaded, seeded = {}, set()
        for spec in config.specs_of(local, layout):
            if spec.name == "master_param" and (masters_followed or (
                    saved_layout.master_format() is None if saved_layout is not None
                    else spec.name not in values)):
                # Saved without masters (a master here is then the template's own: DCP
                # leaves what the checkpoint lacks as it was), or with masters that
                # followed their parameters (S5.4's masters=follow): seeded from the
                # loaded parameter, as at initialisation (S1.6, S5.5).
                loaded[spec.name] = _state.initial_value(spec, local, to_store=True)
                seeded.add(spec.name)
                continue
            if spec.name not in values:
                # A group that held fp32 parameters beside others records their master
                # too, though each fp32 one was its own (S5.4).
                hint = ("; a parameter that was fp32 when saved, its own master, has "
                        "none: load with the saved parameter dtypes, then change them, "
                        "S2.5" if spec.name == "master_param" else "")
                raise ValueError(f"{here}: the loaded state has no {spec.name!r} "
                                 f"(it holds {sorted(values, key=str)}; rule S5.5: a checkpoint "
                                 f"holds every state its state_layout records{hint})")
            value = values[spec.name]
            _validate.check_value(param, spec, value, here)
            value = _dtensor.to_local(value).resolve_neg()  # read by value (S3.2)
            if saved_layout is not None and spec.name == "master_param":
                value = _validate.loaded_master(value, saved_layout, local, config, here)
            _validate.check_loaded_dtype(value, spec, local.dtype, here, saved_layout)
            loaded[spec.name] = value.to(local.device)
            if at_step_0 and _state.seeds_from_param(spec) and _state.is_seeded_value(
                    spec, loaded[spec.name], local):
                # Exported while it followed its parameter (a round trip through
                # state_dict() before the first step, as accelerate's prepare() makes),
                # in a group whose record does not say so (saved before the mark, or
                # beside a master set by hand): told by its bits, which for an fp16
                # master depend on the shard's scale. It goes on following, so weights
                # loaded into the model afterwards are still what the first step starts
                # from (S1.6, S5.5). Only at step 0: a master that stepped (its bits may
                # still match, a one-element shard's fp16 master easily) keeps its own
                # value and scale.
                seeded.add(spec.name)
        writes = _state.entry_from_values(config.specs_of(local, layout), loaded, local)
        writes.seeded = seeded
        # Other keys (e.g. Megatron's "step") come back as saved, copied.
        writes.extra = {k: v.clone() if isinstance(v, torch.Tensor) else v
                        for k, v in values.items()
                        if k not in STATE_NAMES and (own_step or k != "step")}
        return param, local, layout, writes
