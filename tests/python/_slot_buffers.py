"""Raw buffers of one tensor for the extension's step calls, and the tables both of
them are checked against.

``shardadam._C.adam_step`` (CPU) and ``adam_step_cuda`` take the same 14-column slot
rows, apply the same rules and reject the same bad input with the same messages, so
their tests share: the storage of each preset (``Buffers``, movable to a device with
``to``), the slot row, guarded embedding (misaligned views with sentinels around them),
the preset list, and the tables of bad slots, bad hyper-parameters and null buffers.
"""

import copy
import math

import torch

from shardadam import _formats
from _optimizer_testing import (TORCH_DTYPE, decode_codes, merge_remainder,
                                quantize_like_spec)

CODE = {"none": 0, "fp32": 1, "fp16": 2, "bf16": 3, "fp8": 4, "rem": 5}
STORAGE = dict(TORCH_DTYPE, rem=torch.int16)
COLUMNS = 20


class Buffers:
    """One tensor's buffers for a step call, in the storage the preset names (built on
    the CPU; ``to`` gives a copy on another device)."""

    def __init__(self, preset, numel, seed):
        p_fmt, g_fmt, m_fmt, v_fmt, master_fmt = preset
        self.formats = dict(param=p_fmt, grad=g_fmt, exp_avg=m_fmt, exp_avg_sq=v_fmt,
                            master=master_fmt)
        generator = torch.Generator().manual_seed(seed)
        values = torch.randn(numel, generator=generator) * 2
        self.param = values.to(STORAGE[p_fmt])
        self.grad = torch.zeros(numel, dtype=STORAGE[g_fmt])
        self.scales = {}
        self.exp_avg = self._store(torch.zeros(numel), m_fmt, "exp_avg")
        self.exp_avg_sq = self._store(torch.zeros(numel), v_fmt, "exp_avg_sq")
        self.master = None
        if master_fmt == "rem":
            self.master = torch.zeros(numel, dtype=torch.int16)
        elif master_fmt != "none":
            self.master = self._store(self.param.float(), master_fmt, "master")
        self.generator = torch.Generator().manual_seed(seed + 1)

    def _store(self, values, fmt, name):
        codes, scale = quantize_like_spec(values, fmt)
        if scale is not None:
            self.scales[name] = torch.tensor(scale, dtype=torch.float32)
        return codes

    def new_grad(self, magnitude=1.0):
        g = torch.randn(self.param.shape, generator=self.generator) * magnitude
        self.grad = g.to(STORAGE[self.formats["grad"]])

    def row(self):
        def ptr(t):
            return t.data_ptr() if t is not None else 0

        def scale(name):
            return ptr(self.scales.get(name))

        f = self.formats
        return [self.param.numel(), ptr(self.param), CODE[f["param"]], ptr(self.grad),
                CODE[f["grad"]], ptr(self.exp_avg), CODE[f["exp_avg"]], scale("exp_avg"),
                ptr(self.exp_avg_sq), CODE[f["exp_avg_sq"]], scale("exp_avg_sq"),
                ptr(self.master), CODE[f["master"]], scale("master"),
                0, 0,  # first_index, scale_block: no per-block scaled state here
                0, 0,  # exp_avg_rounding (nearest), rounding_key
                0, 0]  # param_rounding, exp_avg_sq_rounding (nearest)

    def true(self, name):
        values = decode_codes(getattr(self, name))
        if name in self.scales:
            values = values * self.scales[name].double()
        return values

    def weight(self):
        fmt = self.formats["master"]
        if fmt == "none":
            return self.param.double()
        if fmt == "rem":
            return merge_remainder(self.param, self.master).double()
        return self.true("master")

    def everything(self):
        tensors = [self.param, self.grad, self.exp_avg, self.exp_avg_sq]
        tensors += [self.master] if self.master is not None else []
        return tensors + [self.scales[k] for k in sorted(self.scales)]

    def names(self):
        """What each tensor of ``everything()`` is, for messages."""
        names = ["param", "grad", "exp_avg", "exp_avg_sq"]
        names += ["master"] if self.master is not None else []
        return names + [f"{k} scale" for k in sorted(self.scales)]

    def to(self, device):
        """A copy with every buffer (scales too) in fresh memory on ``device``."""
        twin = copy.copy(self)
        for name in ("param", "grad", "exp_avg", "exp_avg_sq", "master"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(twin, name, tensor.to(device, copy=True))
        twin.scales = {k: v.to(device, copy=True) for k, v in self.scales.items()}
        return twin


GUARD = 37  # elements of sentinel before and after every embedded buffer


def embedded(tensor, offset):
    """A copy of `tensor` living `offset` elements into a larger buffer (so its address
    is not vector-aligned), with GUARD sentinel elements on either side. Returns
    (view, whole buffer)."""
    flat = tensor.reshape(-1)
    whole = torch.empty(flat.numel() + 2 * GUARD + offset, dtype=tensor.dtype,
                        device=tensor.device)
    whole.view(torch.uint8).fill_(0xA5)
    view = whole[GUARD + offset:GUARD + offset + flat.numel()]
    view.copy_(flat)
    return view.reshape(tensor.shape), whole


def embed_buffers(b, offset):
    """Moves every buffer of `b` (scales too) into guarded, misaligned storage; returns
    the guarded wholes with the slices that must never be written."""
    guarded = []
    for name in ("param", "grad", "exp_avg", "exp_avg_sq", "master"):
        tensor = getattr(b, name)
        if tensor is None:
            continue
        view, whole = embedded(tensor, offset)
        setattr(b, name, view)
        guarded.append((f"{name}", whole, offset + tensor.numel()))
    for key in list(b.scales):
        view, whole = embedded(b.scales[key].reshape(1), offset)
        b.scales[key] = view.reshape(())
        guarded.append((f"{key} scale", whole, offset + 1))
    return guarded


def assert_guards_intact(guarded, what):
    for name, whole, used in guarded:
        raw = whole.view(torch.uint8).reshape(-1)
        size = whole.element_size()
        before = raw[:GUARD * size]
        after = raw[(GUARD + used) * size:]
        assert bool((before == 0xA5).all()) and bool((after == 0xA5).all()), \
            f"{what}: {name} written outside its buffer"


PRESETS = [
    # (param, grad, exp_avg, exp_avg_sq, master)
    ("fp32", "fp32", "fp32", "fp32", "none"),
    ("fp32", "bf16", "fp32", "fp32", "none"),
    ("fp32", "fp16", "bf16", "bf16", "none"),
    ("bf16", "bf16", "fp32", "fp32", "none"),
    ("fp16", "fp16", "fp32", "fp32", "none"),
    ("bf16", "bf16", "bf16", "bf16", "none"),
    ("bf16", "fp32", "fp32", "fp32", "fp32"),
    ("bf16", "bf16", "bf16", "bf16", "fp32"),
    ("fp16", "fp16", "fp32", "fp32", "fp32"),
    ("bf16", "bf16", "fp32", "fp32", "fp16"),
    ("fp16", "fp32", "fp16", "fp16", "fp16"),
    ("bf16", "bf16", "fp32", "fp32", "rem"),
    ("bf16", "bf16", "bf16", "bf16", "rem"),
    ("bf16", "bf16", "fp8", "fp8", "rem"),
    ("fp32", "fp32", "fp16", "fp32", "none"),
    ("fp32", "fp32", "fp32", "fp16", "none"),
    ("fp32", "fp32", "fp8", "fp32", "none"),
    ("fp32", "fp32", "fp32", "fp8", "none"),
    ("bf16", "bf16", "fp8", "fp8", "fp32"),
    ("bf16", "bf16", "fp16", "fp8", "fp16"),
]


def preset_id(preset):
    p, g, m, v, master = preset
    return f"p={p}-g={g}-m={m}-v={v}-master={master}"


# --------------------------------------------------------------------------------------
# Validation tables: ValueError naming the tensor and the rule, nothing written.

# A message names the offending tensor: index 1 of the call in every table row.
NAMES_TENSOR_1 = r"(?i)(tensor|index|slot)\D{0,3}1\b"


def bad_slots():
    """(id, preset of tensor 1, column overrides of tensor 1, message pattern)."""
    ok = ("bf16", "bf16", "fp16", "fp32", "fp32")
    return [
        ("param-fp8", ("fp32", "fp32", "fp32", "fp32", "none"), {2: CODE["fp8"]},
         r"param"),
        ("param-remainder-tag", ("fp32", "fp32", "fp32", "fp32", "none"), {2: CODE["rem"]},
         r"param"),
        ("param-none", ("fp32", "fp32", "fp32", "fp32", "none"), {2: CODE["none"]},
         r"param"),
        ("param-unknown-tag", ("fp32", "fp32", "fp32", "fp32", "none"), {2: 99},
         r"param_dtype 99 \(unknown\) is not allowed for a parameter"),
        ("param-block-tag", ("fp32", "fp32", "fp32", "fp32", "none"),
         {2: _formats.UFP4_BLOCK.tag},
         r"param_dtype \d+ \(ufp4-block\) is not allowed for a parameter"),
        ("grad-fp8", ("fp32", "fp32", "fp32", "fp32", "none"), {4: CODE["fp8"]}, r"grad"),
        ("grad-remainder-tag", ("fp32", "fp32", "fp32", "fp32", "none"), {4: CODE["rem"]},
         r"grad"),
        ("exp_avg-remainder-tag", ("fp32", "fp32", "fp32", "fp32", "none"),
         {6: CODE["rem"]}, r"exp_avg"),
        ("exp_avg_sq-none", ("fp32", "fp32", "fp32", "fp32", "none"), {9: CODE["none"]},
         r"exp_avg_sq"),
        ("exp_avg-fp16-without-scale", ok, {7: 0}, r"exp_avg.*scale|scale.*exp_avg"),
        ("master-bf16", ("bf16", "bf16", "fp32", "fp32", "fp32"), {12: CODE["bf16"]},
         r"master"),
        ("master-fp8", ("bf16", "bf16", "fp32", "fp32", "fp32"), {12: CODE["fp8"]},
         r"master"),
        ("master-fp16-without-scale", ("bf16", "bf16", "fp32", "fp32", "fp16"), {13: 0},
         r"master.*scale|scale.*master"),
        ("remainder-with-fp16-param", ("fp16", "fp16", "fp32", "fp32", "fp32"),
         {12: CODE["rem"]}, r"remainder|master"),
        ("remainder-with-fp32-param", ("fp32", "fp32", "fp32", "fp32", "fp32"),
         {12: CODE["rem"]}, r"remainder|master"),
        ("negative-numel", ("fp32", "fp32", "fp32", "fp32", "none"), {0: -1}, r"numel"),
        # S2.1: an fp32 parameter is its own master
        ("master-beside-fp32-param", ("fp32", "fp32", "fp32", "fp32", "fp32"), {},
         r"master"),
    ]


def make_bad_call(preset, overrides, device="cpu"):
    """A valid tensor 0 and tensor 1 of `preset` with `overrides` applied to its row,
    on `device`: (good, bad, flat slots)."""
    good = Buffers(("bf16", "bf16", "fp16", "fp8", "fp32"), 40, 21)
    bad = Buffers(preset, 40, 22)
    for b in (good, bad):
        b.new_grad()
    if torch.device(device).type != "cpu":
        good, bad = good.to(device), bad.to(device)
    row = bad.row()
    for column, value in overrides.items():
        row[column] = value
    return good, bad, good.row() + row


BAD_HYPER = [  # (id, change, the parameter's name and the rule it breaks)
    ("step-0", dict(step=0), r"\bstep 0\b.*less than 1"),
    ("negative-lr", dict(lr=-1e-3), r"\blr\b.*negative"),
    ("nan-lr", dict(lr=math.nan), r"\blr\b.*not finite"),
    ("beta1-one", dict(beta1=1.0), r"\bbeta1\b.*outside \[0, 1\)"),
    ("beta2-negative", dict(beta2=-0.1), r"\bbeta2\b.*outside \[0, 1\)"),
    ("negative-eps", dict(eps=-1e-8), r"\beps\b.*negative"),
    ("inf-eps", dict(eps=math.inf), r"\beps\b.*not finite"),
    ("negative-weight-decay", dict(weight_decay=-0.1), r"\bweight_decay\b.*negative"),
]


NULL_CASES = {
    # column set to 0 on a non-empty fp32 tensor (scale columns are in bad_slots);
    # the master case declares an fp32 master (beside a bf16 param) without a buffer
    "param-null": 1, "grad-null": 3, "exp_avg-null": 5, "exp_avg_sq-null": 8,
    "master-null": 11,
}

