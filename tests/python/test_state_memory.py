"""Creating state costs its own bytes, not full-size fp32 temporaries (S1.6).

State exists from construction: zero moments and remainders, masters seeded from the
parameter. Each is encoded straight into its storage, the zeros read as one broadcast
0 and a master from the parameter a chunk at a time, so creating a state needs its
storage plus the chunked encoders' temporaries (2^20 elements at a time), whatever
the parameter's size. Measured in a fresh process (the RSS high-water mark, as the
bench measures a step's extra memory) on a parameter of 2^24 elements, where one
full-size fp32 temporary is 64 MiB: the bound leaves the chunks 32 MiB. A conversion
from another format (a setting changed between steps, a load that merges or splits a
remainder) may hold one such fp32 value besides; an export (``state_dict()``) only the
tensors it hands out.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("shardadam._C")

NUMEL = 1 << 24
CHUNK_SLACK = 32 << 20  # the chunked encoders' temporaries; a full-size fp32 one is 64 MiB

_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from shardadam import FusedAdam
    from shardadam.bench import memory

    PRESETS = {
        "block4 + remainders": dict(moment_format="block4", master_weights=True,
                                    store_param_remainders=True),
        "block8": dict(moment_format="block8"),
        "fp8 moments": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
        "fp32 master": dict(master_weights=True),
        "fp16 master + bf16 moments": dict(master_weights=True,
                                           master_weight_dtype=torch.float16,
                                           exp_avg_dtype=torch.bfloat16,
                                           exp_avg_sq_dtype=torch.bfloat16),
    }

    def param(numel):
        return torch.nn.Parameter(torch.randn(numel // 1024, 1024).to(torch.bfloat16))

    def state_tensors(opt, p):
        tensors = list(opt.state[p].values()) + list((opt._scales.get(p) or {}).values())
        return [t for t in tensors if isinstance(t, torch.Tensor)]

    def state_bytes(opt, p, old=()):  # p's state tensors' bytes, but those in `old`
        return sum(t.numel() * t.element_size() for t in state_tensors(opt, p)
                   if all(t is not o for o in old))

    method = memory.peak_extra_bytes(lambda: None)["memory_method"]
    numel, out = int(sys.argv[1]), {"method": method}
    for name, kw in PRESETS.items():
        FusedAdam([param(4096)], lr=1e-3, **kw)  # the extension and its pools loaded
        p, held = param(numel), []
        peak = memory.peak_extra_bytes(lambda: held.append(FusedAdam([p], lr=1e-3, **kw)))
        out["constructor, " + name] = (peak["peak_extra_bytes"], state_bytes(held[0], p))

    kw = PRESETS["block4 + remainders"]
    opt = FusedAdam([param(4096)], lr=1e-3, **kw)
    p = param(numel)
    peak = memory.peak_extra_bytes(lambda: opt.add_param_group({"params": [p]}))
    out["add_param_group, block4 + remainders"] = (peak["peak_extra_bytes"],
                                                    state_bytes(opt, p))

    # A checkpoint taken before the parameter's first step, without state_layout
    # (TE's): the parameter's moments load as initialisation makes them.
    saved = opt.state_dict()
    del saved["state"][1]
    for group in saved["param_groups"]:
        group.pop("state_layout", None)
    peak = memory.peak_extra_bytes(lambda: opt.load_state_dict(saved))
    out["load without the parameter's state, block4 + remainders"] = (
        peak["peak_extra_bytes"], state_bytes(opt, p))
    del opt, saved, p

    # Conversions (S1.5) hold one state's fp32 values at a time, or a remainder split
    # off a master and the parameter's new bits: "converted" entries.
    for name, kw, change in [
            ("block8 to block4", PRESETS["block8"], dict(moment_format="block4")),
            ("fp32 master to remainders", PRESETS["fp32 master"],
             dict(store_param_remainders=True))]:
        p = param(numel)
        opt = FusedAdam([p], lr=1e-3, **kw)
        for setting, value in change.items():
            setattr(opt, setting, value)
        p.grad = torch.zeros_like(p)
        old = state_tensors(opt, p)
        peak = memory.peak_extra_bytes(opt.step)
        out["converted, " + name] = (peak["peak_extra_bytes"], state_bytes(opt, p, old))
        del opt, p, old

    p = param(numel)
    saved = FusedAdam([p], lr=1e-3, master_weights=True).state_dict()
    opt = FusedAdam([p], lr=1e-3, master_weights=True, store_param_remainders=True)
    peak = memory.peak_extra_bytes(lambda: opt.load_state_dict(saved))
    out["converted, load of an fp32 master into remainders"] = (
        peak["peak_extra_bytes"], state_bytes(opt, p))
    del opt, saved, p

    # An export's fp32 values, decoded straight into the tensors it hands out.
    p = param(numel)
    opt = FusedAdam([p], lr=1e-3, **PRESETS["fp8 moments"])
    exported = []
    peak = memory.peak_extra_bytes(lambda: exported.append(opt.state_dict()))
    values = exported[0]["state"][0].values()
    out["state_dict, fp8 moments"] = (peak["peak_extra_bytes"], sum(
        t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor)))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def measured():
    from shardadam.bench import memory

    env = {**os.environ, **memory._MALLOC_ENV, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(NUMEL)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    if results.pop("method") != "VmHWM after clear_refs":
        pytest.skip("no /proc/self/clear_refs: the RSS high-water mark cannot be reset")
    return results


def test_every_way_state_is_created_was_measured(measured):
    assert len(measured) == 11, sorted(measured)


@pytest.mark.parametrize("case", [
    "constructor, block4 + remainders", "constructor, block8", "constructor, fp8 moments",
    "constructor, fp32 master", "constructor, fp16 master + bf16 moments",
    "add_param_group, block4 + remainders",
    "load without the parameter's state, block4 + remainders",
    "converted, block8 to block4", "converted, fp32 master to remainders",
    "converted, load of an fp32 master into remainders", "state_dict, fp8 moments"])
def test_creating_state_costs_the_state_and_chunks(measured, case):
    peak, state = measured[case]
    assert state > 0, case
    # The state itself is touched (zero pages would not count: it must be written).
    assert peak >= state * 0.9, (case, peak, state)
    # A conversion may hold one fp32 value of the parameter's size (S1.6).
    held = 4 * NUMEL if case.startswith("converted") else 0
    assert peak <= state + held + CHUNK_SLACK, (
        f"{case}: peak {peak / NUMEL:.2f} bytes per element above what was held, "
        f"state {state / NUMEL:.2f}")
