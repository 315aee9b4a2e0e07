"""GPU benchmark of shardadam's CUDA backend, by docs/benchmarking.md's rules, in one
process.

(a) copy: the device's copy bandwidth (``dst.copy_(src)`` of a large buffer, read +
    write), the ceiling the step is compared with.
(b) kernel: ``FusedAdam.step()`` on one large tensor (rows of ``ROW``) per state preset, beside
    ``torch.optim.AdamW(fused=True)`` in fp32; GB/s at docs/benchmarking.md's minimum
    bytes per element and the fraction of (a) (the goals: ``KERNEL_TARGETS``). Plus an
    fp8 ``exp_avg`` beside a bf16 ``exp_avg_sq``, block8 and block4 moments, and two
    layouts the CUDA kernels are not compiled for (csrc/cuda/layouts.h), which the
    catch-all kernel steps: the cost of leaving the list.
(c) model: a transformer's parameter list (``shardadam.bench.cases.transformer_shapes``,
    195 tensors, about 1.3B elements at d_model 2048, reduced to fit the free memory)
    stepped by FusedAdam with each preset and by torch's fused AdamW in fp32 on the
    same shapes; the ratio of step times (targets: ``MODEL_TARGETS``) beside the ratio
    of bytes moved, which bounds what a memory-bound step can reach.
(d) torch path: FusedAdam on its pure-torch path (S7.2: what a device without the
    C++ build runs) on a quarter of (b)'s tensor, in pieces of ``PIECE_DEVICE``
    elements against the whole tensor at once: time and extra memory of each, which
    says what the piece size costs on this device.

Times are CUDA events around each call, contenders interleaved round by round after a
warm-up, medians with min/max. Each part that fails records its error and the others
still run; the JSON is rewritten after every part. Exit status 1 if any part failed
(a missed target is reported, not a failure).

    python benchmarks/cuda_bench.py --json out/cuda_bench.json
    python benchmarks/cuda_bench.py --device cpu --quick   # checks the script itself
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import sys
import time
import traceback

import torch

from shardadam import FusedAdam, _backend, _cuda_path, _torch_path
from shardadam.bench.cases import LOWBIT_CASES, PRESETS, Preset, transformer_shapes
from shardadam.bench.timing import summary

KERNEL_TARGET = 0.85  # fraction of copy bandwidth at large sizes
# Step-time ratios vs torch fused fp32 on the transformer, for the presets that move
# fewer bytes than it.
MODEL_TARGETS = {"bf16-master-bf16m": 1.5, "bf16-remainder-bf16m": 1.5, "bf16-master-fp8m": 1.2}
TORCH_FP32_BYTES = PRESETS["fp32"].minimum_bytes  # torch's fused fp32 step: 28 B/elem
TORCH_FP32_RESIDENT = PRESETS["fp32"].state_bytes_per_element
HYPER = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
# A compiled layout beside the presets: an fp8 exp_avg with a bf16 exp_avg_sq.
FP8_BF16 = Preset("bf16-master-fp8m-bf16v", torch.bfloat16, torch.uint8, "fp32",
                  exp_avg_sq_dtype=torch.bfloat16)
# Outside csrc/cuda/layouts.h (the catch-all kernel): fp16 params with an fp32 master
# and fp32 moments; fp32 params with a per-tensor scaled fp16 exp_avg and fp8 exp_avg_sq.
CATCH_ALL = (Preset("fp16-master-fp32", torch.float16, torch.float32, "fp32"),
             Preset("fp32-fp16m-fp8v", torch.float32, torch.float16, None,
                    exp_avg_sq_dtype=torch.uint8))
# Fractions of copy bandwidth by preset (the others have none yet). Per-tensor fp8
# moments read the gradient and moments twice (their measuring pass): 20 bytes move
# per element where 16 are counted, a ceiling of 0.80.
KERNEL_TARGETS = {**{name: KERNEL_TARGET for name in PRESETS}, "bf16-master-fp8m": 0.75,
                  FP8_BF16.name: 0.80}


# --------------------------------------------------------------------------------------
# Timing


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> float:
    """Seconds one call takes on the device (wall clock off CUDA)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()  # the next call starts on an idle device
    return start.elapsed_time(end) / 1e3


def interleaved(contenders: dict, rounds: int, warmup: int, device) -> dict:
    """``{name: [seconds]}``: warm-up calls, then rounds of one call each, the order
    reversed every other round so no contender always runs first."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    samples = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            samples[name].append(timed(contenders[name], device))
    return samples


def extra_memory(fn, device):
    """Bytes allocated during one call beyond what was allocated before it."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def stats(samples: list) -> dict:
    s = summary(samples)
    return {"median_s": s["median"], "min_s": s["min"], "max_s": s["max"],
            "rounds": len(samples)}


# --------------------------------------------------------------------------------------
# Inputs


def make_params(shapes, dtype, device, seed):
    """Parameters with gradients, the same values for every contender of a seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for shape in shapes:
        value = torch.randn(shape, generator=gen, device=device).mul_(0.02)
        param = torch.nn.Parameter(value.to(dtype))
        del value
        grad = torch.randn(shape, generator=gen, device=device).mul_(1e-3)
        param.grad = grad.to(dtype)
        params.append(param)
    return params


def fused_adam(preset, params):
    return FusedAdam(params, **HYPER, **preset.fused_adam_kwargs())


def stored_moments(opt) -> list:
    """The formats the optimizer's first parameter stores its moments in, as recorded
    layouts name them (what the row timed, e.g. ``fp4-block:128``)."""
    param = opt.param_groups[0]["params"][0]
    return [opt._formats[param][name].label for name in ("exp_avg", "exp_avg_sq")]


def torch_adamw(params):
    return torch.optim.AdamW(params, **HYPER, fused=True)


def release(device):
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------
# Parts


def copy_part(args, device) -> dict:
    numel = args.numel  # fp32 elements per buffer: the size of the largest param
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    samples = interleaved({"copy": lambda: dst.copy_(src)}, args.rounds, args.warmup,
                          device)["copy"]
    moved = 2 * src.numel() * src.element_size()
    result = {"bytes_moved": moved, **stats(samples)}
    result["gbps"] = moved / result["median_s"] / 1e9
    return result


# (b)'s tensor is rows of this many elements: whole blocks of every block size, and an
# even last dimension, so block4 packs its codes (a 1-D tensor would take block8's).
ROW = 4096


def kernel_part(args, device, copy_gbps) -> dict:
    contenders, optimizers = {}, []
    presets = [*PRESETS.values(), FP8_BF16, *(preset for preset, _ in LOWBIT_CASES),
               *CATCH_ALL]
    shape = (max(1, args.numel // ROW), ROW)
    numel = shape[0] * shape[1]
    for preset in presets:
        opt = fused_adam(preset, make_params([shape], preset.param_dtype, device, 1))
        optimizers.append(opt)
        contenders[preset.name] = opt.step
    reference = torch_adamw(make_params([shape], torch.float32, device, 1))
    contenders["torch-fused-fp32"] = reference.step
    samples = interleaved(contenders, args.rounds, args.warmup, device)
    torch_s = stats(samples["torch-fused-fp32"])["median_s"]
    rows = []
    for preset, opt in zip(presets, optimizers):
        row = {"preset": preset.name, "label": preset.label, "numel": numel,
               "tensors": 1, "bytes_per_element": preset.minimum_bytes,
               "stored_moments": stored_moments(opt),
               **stats(samples[preset.name])}
        row["elements_per_s"] = numel / row["median_s"]
        row["gbps"] = row["elements_per_s"] * preset.minimum_bytes / 1e9
        row["fraction_of_copy"] = row["gbps"] / copy_gbps if copy_gbps else None
        row["target"] = KERNEL_TARGETS.get(preset.name)
        row["meets_target"] = (None if row["target"] is None else
                               row["fraction_of_copy"] is not None
                               and row["fraction_of_copy"] >= row["target"])
        if preset in CATCH_ALL:
            row["label"] += " (catch-all)"
        row["vs_torch_fused_fp32"] = torch_s / row["median_s"]
        rows.append(row)
    torch_row = {"preset": "torch-fused-fp32", "label": "torch AdamW(fused=True) fp32",
                 "numel": numel, "tensors": 1, "bytes_per_element": TORCH_FP32_BYTES,
                 **stats(samples["torch-fused-fp32"])}
    torch_row["gbps"] = numel * TORCH_FP32_BYTES / torch_row["median_s"] / 1e9
    torch_row["fraction_of_copy"] = torch_row["gbps"] / copy_gbps if copy_gbps else None
    for row, opt in zip(rows, optimizers):
        row["extra_memory_bytes"] = extra_memory(opt.step, device)
    torch_row["extra_memory_bytes"] = extra_memory(reference.step, device)
    return {"copy_gbps": copy_gbps, "rows": rows, "torch": torch_row}


def fit_d_model(wanted: int, device) -> int:
    """The largest d_model <= wanted (a multiple of 64) whose model fits twice (torch's
    fp32 copy and one preset's) in 70% of the free memory."""
    d = wanted
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        per_element = TORCH_FP32_RESIDENT + max(p.state_bytes_per_element
                                                for p in PRESETS.values())
        while d > 64 and model_numel(d) * per_element > 0.7 * free:
            d -= 64
    return d


def model_numel(d_model: int) -> int:
    return sum(math.prod(shape) for shape in transformer_shapes(d_model))


def model_part(args, device) -> dict:
    d_model = fit_d_model(args.d_model, device)
    shapes = transformer_shapes(d_model)
    numel = model_numel(d_model)
    reference = torch_adamw(make_params(shapes, torch.float32, device, 2))
    rows = []
    # One preset at a time beside torch's fp32 run: two models fit where six would not.
    for preset in PRESETS.values():
        opt = fused_adam(preset, make_params(shapes, preset.param_dtype, device, 2))
        samples = interleaved({"torch": reference.step, "shardadam": opt.step},
                              args.rounds, args.warmup, device)
        ours, theirs = stats(samples["shardadam"]), stats(samples["torch"])
        row = {"preset": preset.name, "label": preset.label,
               "bytes_per_element": preset.minimum_bytes,
               "state_bytes_per_element": preset.state_bytes_per_element,
               "shardadam": ours, "torch_fused_fp32": theirs,
               "speedup": theirs["median_s"] / ours["median_s"],
               "byte_ratio": TORCH_FP32_BYTES / preset.minimum_bytes,
               "target": MODEL_TARGETS.get(preset.name),
               "extra_memory_bytes": extra_memory(opt.step, device)}
        row["meets_target"] = (None if row["target"] is None
                               else row["speedup"] >= row["target"])
        rows.append(row)
        del opt
        release(device)
    return {"d_model": d_model, "tensors": len(shapes), "numel": numel,
            "torch_extra_memory_bytes": extra_memory(reference.step, device),
            "rows": rows}


# (d)'s presets beside block8 (the first low-bit case): fp32, 16-bit moments with
# remainders, per-tensor fp8 moments (stepped twice where cut).
TORCH_PATH_PRESETS = ("fp32", "bf16-remainder-bf16m", "bf16-master-fp8m")


@contextlib.contextmanager
def _on_torch_path(whole: bool):
    """Steps on the pure-torch path; ``whole``: one piece however large the tensor."""
    pieces = _torch_path.PIECE_CPU, _torch_path.PIECE_DEVICE
    if whole:
        _torch_path.PIECE_CPU = _torch_path.PIECE_DEVICE = 1 << 62
    try:
        with _backend.use_backend("torch"):
            yield
    finally:
        _torch_path.PIECE_CPU, _torch_path.PIECE_DEVICE = pieces


def torch_path_part(args, device) -> dict:
    shape = (max(1, args.numel // 4 // ROW), ROW)
    presets = [PRESETS[name] for name in TORCH_PATH_PRESETS] + [LOWBIT_CASES[0][0]]
    rows = []
    for preset in presets:
        opt = fused_adam(preset, make_params([shape], preset.param_dtype, device, 3))

        def step(whole):
            with _on_torch_path(whole):
                opt.step()

        samples = interleaved({"pieces": lambda: step(False), "whole": lambda: step(True)},
                              min(args.rounds, 5), args.warmup, device)
        rows.append({"preset": preset.name, "label": preset.label,
                     "numel": shape[0] * shape[1],
                     "pieces": {**stats(samples["pieces"]),
                                "extra_memory_bytes": extra_memory(lambda: step(False),
                                                                   device)},
                     "whole": {**stats(samples["whole"]),
                               "extra_memory_bytes": extra_memory(lambda: step(True),
                                                                  device)}})
        del opt
        release(device)
    return {"piece_elements": _torch_path.PIECE_DEVICE if device.type != "cpu"
            else _torch_path.PIECE_CPU, "rows": rows}


# --------------------------------------------------------------------------------------
# Report


def meta(device) -> dict:
    from shardadam import _C

    info = {"torch": torch.__version__, "device": str(device),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "shardadam_core": _C.info()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    memory_bytes=props.total_memory, torch_cuda=torch.version.cuda)
        info["step_backend"] = ("cuda (C++)" if _cuda_path.available(device)
                                else "torch ops (the CUDA backend is not available)")
    return info


def print_tables(report):
    parts = report["parts"]
    copy = parts.get("copy", {})
    if "gbps" in copy:
        print(f"\n(a) copy bandwidth: {copy['gbps']:.0f} GB/s "
              f"({copy['bytes_moved'] / 2**30:.2f} GiB moved, median of {copy['rounds']})")
    kernel = parts.get("kernel", {})
    if "rows" in kernel:
        print(f"\n(b) one large tensor, {kernel['rows'][0]['numel']:,} elements "
              f"(targets: fractions of copy)")
        print(f"{'preset':<52}{'B/elem':>7}{'ms median':>11}{'min..max':>16}{'GB/s':>8}"
              f"{'of copy':>9}{'target':>13}{'vs torch':>10}")
        for row in kernel["rows"] + [kernel["torch"]]:
            fraction = row.get("fraction_of_copy")
            versus = row.get("vs_torch_fused_fp32")
            met = {True: "met", False: "missed", None: "-"}[row.get("meets_target")]
            if row.get("target") is not None:
                met = f"{row['target']:.2f} {met}"
            print(f"{row['label']:<52}{row['bytes_per_element']:>7}"
                  f"{row['median_s'] * 1e3:>11.3f}"
                  f"{row['min_s'] * 1e3:>8.3f}..{row['max_s'] * 1e3:<6.3f}"
                  f"{row['gbps']:>8.0f}"
                  f"{'' if fraction is None else f'{fraction:.2f}':>9}{met:>13}"
                  f"{'' if versus is None else f'{versus:.2f}x':>10}")
    model = parts.get("model", {})
    if "rows" in model:
        print(f"\n(c) transformer shapes, d_model {model['d_model']}, {model['tensors']} "
              f"tensors, {model['numel'] / 1e9:.2f}B elements: FusedAdam vs torch "
              f"AdamW(fused=True) fp32")
        print(f"{'preset':<46}{'ms ours':>9}{'ms torch':>10}{'speedup':>9}{'byte bound':>12}"
              f"{'target':>13}")
        for row in model["rows"]:
            met = {True: "met", False: "missed", None: "-"}[row["meets_target"]]
            if row["target"] is not None:
                met = f"{row['target']:.1f}x {met}"
            print(f"{row['label']:<46}{row['shardadam']['median_s'] * 1e3:>9.2f}"
                  f"{row['torch_fused_fp32']['median_s'] * 1e3:>10.2f}"
                  f"{row['speedup']:>8.2f}x{row['byte_ratio']:>11.2f}x{met:>13}")
    path = parts.get("torch_path", {})
    if "rows" in path:
        print(f"\n(d) the pure-torch path, {path['rows'][0]['numel']:,} elements: pieces of "
              f"{path['piece_elements']:,} against the whole tensor at once")
        print(f"{'preset':<58}{'ms pieces':>11}{'ms whole':>10}{'MiB pieces':>12}"
              f"{'MiB whole':>11}")
        for row in path["rows"]:
            def mib(value):
                return "-" if value is None else f"{value / 2**20:.0f}"
            print(f"{row['label']:<58}{row['pieces']['median_s'] * 1e3:>11.2f}"
                  f"{row['whole']['median_s'] * 1e3:>10.2f}"
                  f"{mib(row['pieces']['extra_memory_bytes']):>12}"
                  f"{mib(row['whole']['extra_memory_bytes']):>11}")
    for error in report["errors"]:
        print(f"\nFAILED part {error['part']}:\n{error['error']}")


def write_json(report, path):
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--numel", type=int, default=250_000_003,
                        help="elements of the large tensor of (a) and (b)")
    parser.add_argument("--d-model", type=int, default=2048,
                        help="d_model of (c)'s transformer, reduced to fit memory")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None, help="where to write the results")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and 3 rounds: checks the script, not the speed")
    args = parser.parse_args(argv)
    if args.quick:
        args.numel, args.d_model, args.rounds, args.warmup = 1_000_003, 128, 3, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    report = {"args": vars(args), "parts": {}, "errors": []}
    try:
        report["meta"] = meta(device)
        if device.type == "cuda" and not _cuda_path.available(device):
            raise RuntimeError("FusedAdam would step CUDA tensors with torch ops: the "
                               "extension has no CUDA backend or sees no device "
                               f"(_C.info() = {report['meta']['shardadam_core']})")
    except Exception:
        report["errors"].append({"part": "setup", "error": traceback.format_exc()})
    write_json(report, args.json)

    def run(name, fn):
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        try:
            report["parts"][name] = fn()
        except Exception as error:
            report["parts"][name] = {"error": repr(error)}
            report["errors"].append({"part": name, "error": traceback.format_exc()})
            print(report["errors"][-1]["error"], file=sys.stderr, flush=True)
        try:
            release(device)
        except Exception:  # the part's own error (e.g. no driver) says why
            pass
        report["parts"][name]["seconds"] = time.perf_counter() - started
        write_json(report, args.json)

    run("copy", lambda: copy_part(args, device))
    copy_gbps = report["parts"]["copy"].get("gbps")
    run("kernel", lambda: kernel_part(args, device, copy_gbps))
    run("model", lambda: model_part(args, device))
    run("torch_path", lambda: torch_path_part(args, device))
    print_tables(report)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
