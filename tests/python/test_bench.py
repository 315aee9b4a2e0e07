"""``python -m shardadam bench``: runs end to end on tiny sizes and writes well-formed
JSON and PNG. Checks the shape of the results, never their speed (docs/benchmarking.md:
benchmarks do not gate CI)."""

import json
import math
import operator
import os
import random
import struct
import subprocess
import sys

import pytest
import torch

from shardadam import peers
from shardadam.bench import cases, cli, contenders, multipass, runner, timing

# Every case kind with the contenders it must report (probes included).
_FP32 = {"shardadam", "torch-fused", "torch-foreach", "torch-default", "deepspeed",
         "probe"}
_LOW_PRECISION = {"shardadam", "multipass", "probe"}
_PRESETS = {"fp32", "bf16-master-fp32", "bf16-master-bf16m", "bf16-remainder-bf16m",
            "bf16-master-fp8m"}
_RECORD_TYPES = {
    "case": str, "kind": str, "contender": str, "description": str, "preset": str,
    "preset_name": str, "dtypes": dict, "numel": int, "tensors": int, "threads": int,
    "ranks": int, "state_bytes": int, "bytes_per_element": dict, "status": str,
    "ratio_to": dict, "own_layout": bool,
}
_TIMED_FIELDS = ("elements_per_s", "gb_per_s")
# The large presets' step right after torch's work (bench/training.py).
_TRAINING = {"shardadam", "after-matmul", "after-backward", "after-backward-pool", "probe",
             "core"}
_LOWBIT = {"bf16-remainder-block8": {"shardadam", "shardadam-sr", "torchao-adamw8bit",
                                      "torchao-adamwfp8", "bnb-adamw8bit", "probe"},
           "bf16-remainder-block4": {"shardadam", "shardadam-sr", "torchao-adamw4bit",
                                      "probe"}}
# A contender may be missing from this machine (DeepSpeed, the low-bit optimizers of
# other packages) or reject a layout (DTensor support): then it says so instead of
# timing.
_MAY_BE_ABSENT = {"deepspeed": "unavailable", "dtensor": "unsupported",
                  "torchao-adamw8bit": "unavailable", "torchao-adamw4bit": "unavailable",
                  "torchao-adamwfp8": "unavailable", "bnb-adamw8bit": "unavailable"}


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "shardadam", "bench", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("hidden, flags, named", [
    ("numpy", ["--cases", "dtensor"], "the dtensor cases cannot run without numpy"),
    ("matplotlib", ["--cases", "many", "--png", "b.png"],
     "--png cannot run without matplotlib")])
def test_a_missing_optional_module_is_named_before_the_run(capsys, monkeypatch, tmp_path,
                                                           hidden, flags, named):
    """numpy (the dtensor cases' ranks gather objects, which torch pickles through it)
    and matplotlib (--png) are the package's ``demo`` extra, not its dependencies: a
    bench that needs one that is missing says so in one line before timing anything,
    not after minutes of it."""
    import importlib.util

    from shardadam.__main__ import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == hidden else find_spec(name, *a))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "time_case", lambda *a: pytest.fail("timed a case"))
    assert main(["bench", "--quick", "--no-kernel-bench", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and "shardadam[demo]" in err[0], err


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "bench.json", out / "bench.png"
    # One thread, two repetitions: on a shared 2-core runner thread hand-offs, not
    # work, dominate tiny steps.
    done = _run("--quick", "--scale", "0.001", "--threads", "1", "--reps", "2",
                "--json", str(json_path), "--png", str(png_path))
    assert done.returncode == 0, done.stderr[-3000:]
    with open(json_path) as f:
        return done.stdout, json.load(f), png_path


def test_help_and_bad_arguments(capsys):
    from shardadam.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--quick", "--json", "--png", "--scale", "--cases", "--threads"):
        assert flag in usage
    for flag, value in (("--scale", "0"), ("--scale", "inf"), ("--settle-ms", "nan"),
                        ("--settle-ms", "-5"), ("--json", "/nonexistent/b.json"),
                        ("--png", "/nonexistent/b.png"),
                        # checked before the run, not when the files are written after it
                        ("--json", "/"), ("--png", "chart.svg")) + (
                            # tried, not asked: os.access says yes to root there
                            (("--json", "/proc/b.json"),) if os.path.isdir("/proc") else ()):
        with pytest.raises(SystemExit) as bad:
            main(["bench", flag, value])
        assert bad.value.code == 2 and flag in capsys.readouterr().err, (flag, value)
    # One file for both outputs: the PNG would replace the JSON.
    assert main(["bench", "--json", "out.png", "--png", "out.png"]) == 2
    assert "--json and --png name the same file" in capsys.readouterr().err


def test_table_is_printed(tiny_run):
    stdout, _, _ = tiny_run
    assert "median ms" in stdout and "large/fp32" in stdout


def test_meta(tiny_run):
    _, data, _ = tiny_run
    meta = data["meta"]
    assert meta["mode"] == "quick" and meta["scale"] == 0.001 and meta["threads"] == 1
    assert len(meta["load_average_start"]) == 3
    assert isinstance(meta["probe"], str) and isinstance(meta["torch"], str)
    # Provenance: which CPU generation and which source gave the figures.
    assert isinstance(meta["cpu_id"], dict) and isinstance(meta["cpu"], str)
    with open("/proc/cpuinfo") as f:
        if "cpu family" in f.read():
            assert meta["cpu_id"]["cpu family"] and "model" in meta["cpu_id"]
    assert meta["commit"] is None or len(meta["commit"].split("+")[0]) == 40


def test_every_case_and_contender_is_reported(tiny_run):
    _, data, _ = tiny_run
    by_case = {}
    for record in data["results"]:
        by_case.setdefault((record["kind"], record["preset_name"]), set()).add(
            record["contender"])
    for preset in _PRESETS:
        expected = _FP32 if preset == "fp32" else _LOW_PRECISION
        assert expected | {"core"} <= by_case[("large", preset)], preset
        assert _TRAINING <= by_case[("training", preset)], preset
    assert _FP32 <= by_case[("transformer", "fp32")]
    assert _FP32 <= by_case[("many", "fp32")]
    assert _FP32 <= by_case[("groups", "fp32")]
    assert by_case[("dtensor", "fp32")] == {"dtensor", "plain"}
    for preset, contenders in _LOWBIT.items():
        assert contenders <= by_case[("lowbit", preset)], preset


def test_records_have_the_documented_fields(tiny_run):
    _, data, _ = tiny_run
    for record in data["results"]:
        where = f"{record.get('case')} {record.get('contender')}"
        for key, kind in _RECORD_TYPES.items():
            assert isinstance(record[key], kind), (where, key)
        assert record["numel"] > 0 and record["tensors"] > 0, where
        assert set(record["bytes_per_element"]) == {"minimum", "effective"}, where
        assert record["bytes_per_element"]["minimum"] <= \
            record["bytes_per_element"]["effective"], where
        for key in ("seconds", "fraction_of_probe", "peak_extra_bytes",
                    "peak_extra_fraction_of_state", "reason"):
            assert key in record, (where, key)
        # The contenders that keep no master count their own layout's bytes.
        own = record["contender"] in ("shardadam-sr", *peers.PEERS) and \
            record["kind"] == "lowbit"
        assert record["own_layout"] is own, where
        if own:
            assert record["dtypes"]["master"] is None, where


def test_timings_are_positive_and_ordered(tiny_run):
    _, data, _ = tiny_run
    for record in data["results"]:
        where = f"{record['case']} {record['contender']}"
        if record["status"] != "ok":
            assert record["status"] == _MAY_BE_ABSENT.get(record["contender"]), where
            assert isinstance(record["reason"], str) and record["reason"], where
            continue
        seconds = record["seconds"]
        assert 0 < seconds["min"] <= seconds["median"] <= seconds["max"], where
        for key in _TIMED_FIELDS:
            assert record[key] > 0, (where, key)
        if record["kind"] in ("large", "lowbit") and not record["own_layout"]:
            assert record["fraction_of_probe"] > 0, where
        else:  # the probe's per-tensor overhead would set the ratio (runner._relate),
            # or it moves another layout's bytes than this contender's
            assert record["fraction_of_probe"] is None, where
        for other, ratio in record["ratio_to"].items():
            assert ratio > 0 and other != record["contender"], where
        if record["contender"].startswith("kernel_bench"):  # another process's figures
            assert record["samples"] is None, where
        else:
            assert len(record["samples"]) == record["reps"], where


def test_paired_ratios_pair_repetitions_of_one_round(tiny_run):
    """paired_ratio_to[other]: the median over repetitions of other's seconds over this
    one's in the same round, recomputed here from the samples; kernel_bench's rows
    (another process) and the probes are never paired."""
    _, data, _ = tiny_run
    by_case = {}
    for record in data["results"]:
        if record["status"] == "ok":
            by_case.setdefault(record["case"], {})[record["contender"]] = record
    paired = 0
    for case, records in by_case.items():
        for name, record in records.items():
            expected = {}
            for other_name, other in records.items():
                if other_name in (name, "probe", "kernel_bench-probe") \
                        or other["samples"] is None or record["samples"] is None:
                    continue
                ratios = sorted(o / t for o, t in zip(other["samples"], record["samples"]))
                middle = len(ratios) // 2
                expected[other_name] = (ratios[middle] if len(ratios) % 2 else
                                        (ratios[middle - 1] + ratios[middle]) / 2)
            assert record["paired_ratio_to"].keys() == expected.keys(), (case, name)
            # Two repetitions are too few for an interval (6 at least).
            assert record["paired_ratio_interval_to"] == dict.fromkeys(expected), (case, name)
            for other_name, ratio in expected.items():
                assert record["paired_ratio_to"][other_name] == pytest.approx(
                    ratio, rel=1e-12), (case, name, other_name)
                paired += 1
    assert paired > 0
    assert any("core" in r["paired_ratio_to"] for r in data["results"]
               if r["kind"] == "training")


def test_lowbit_ceiling_is_one_thread_in_cache_times_the_threads(tiny_run):
    """runner.CEILING: kernel_bench's bare kernel on one thread over a tensor that stays
    in cache, as the time the case's elements would take on every thread at that rate;
    a yardstick like the probes, so no contender's ratios name it."""
    _, data, _ = tiny_run
    if data["meta"]["kernel_bench"] is None:
        pytest.skip("benchmarks/kernel_bench is not built")
    results = data["results"]
    ceilings = {r["case"]: r for r in results if r["contender"] == "kernel_bench-ceiling"}
    assert set(ceilings) == {f"lowbit/{name}" for name in _LOWBIT}
    for case, record in ceilings.items():
        assert record["status"] == "ok" and record["samples"] is None, case
        assert record["cache_numel"] == cli._CACHE_NUMEL, case
        for key in ("median", "min", "max"):
            assert record["seconds"][key] == pytest.approx(
                record["cache_seconds"][key] * record["numel"]
                / (record["threads"] * record["cache_numel"]), rel=1e-12), (case, key)
        probe = next(r for r in results if r["case"] == case and r["contender"] == "probe")
        assert record["fraction_of_probe"] == pytest.approx(
            probe["seconds"]["median"] / record["seconds"]["median"], rel=1e-12), case
    for record in results:
        assert "kernel_bench-ceiling" not in record["ratio_to"], record["contender"]
        assert "kernel_bench-ceiling" not in record["paired_ratio_to"], record["contender"]


def test_optimizer_state_bytes_follow_the_layout(tiny_run):
    """Counted from each optimizer's own state: shardadam's block8 beside remainders
    holds 2 (remainder) + 1 + 1 (codes) + 2 * 4 / 256 (a scale per 256 elements of each
    moment) bytes per parameter, block4 2 + 0.5 + 0.5 + 2 * 4 / 128, each without the
    remainder where the params are rounded stochastically; torch's fp32 AdamW 8 (two
    fp32 moments)."""
    _, data, _ = tiny_run
    held = {(r["case"], r["contender"]): r.get("optimizer_state_bytes_per_param")
            for r in data["results"] if r["status"] == "ok"}
    assert held[("lowbit/bf16-remainder-block8", "shardadam")] == pytest.approx(
        2 + 1 + 1 + 2 * 4 / 256)
    assert held[("lowbit/bf16-remainder-block4", "shardadam")] == pytest.approx(
        2 + 0.5 + 0.5 + 2 * 4 / 128)
    assert held[("lowbit/bf16-remainder-block8", "shardadam-sr")] == pytest.approx(
        1 + 1 + 2 * 4 / 256)
    assert held[("lowbit/bf16-remainder-block4", "shardadam-sr")] == pytest.approx(
        0.5 + 0.5 + 2 * 4 / 128)
    assert held[("large/fp32", "torch-fused")] == pytest.approx(8, abs=0.01)


def test_a_failed_memory_measurement_is_shown_as_failed(tiny_run):
    """A memory subprocess that failed leaves no figure: the table says "failed" where a
    contender not measured shows "-" (its reason is in the JSON's memory_error)."""
    from shardadam.bench import report

    _, data, _ = tiny_run
    record = next(dict(r) for r in data["results"]
                  if r["contender"] == "shardadam" and r["kind"] == "large")
    record.update(peak_extra_bytes=None, peak_extra_fraction_of_state=None,
                  memory_error="Traceback ...\nNameError: x")
    line = report.table([record]).splitlines()[-1]
    assert "failed" in line and "shardadam" in line
    del record["memory_error"]
    assert "failed" not in report.table([record]).splitlines()[-1]


def test_a_failed_kernel_bench_is_said_where_its_rows_are_missing():
    """A kernel_bench that fails leaves its rows out of the table; the log says so and
    why (it was said only in the JSON's meta)."""
    done = subprocess.run(
        [sys.executable, "-m", "shardadam", "bench", "--quick", "--scale", "0.001", "--reps",
         "2", "--cases", "large", "--no-memory"], capture_output=True, text=True,
        timeout=600, env=dict(os.environ, SHARDADAM_KERNEL_BENCH="/bin/false"))
    assert done.returncode == 0, done.stderr
    assert "kernel_bench failed, its rows are left out: /bin/false" in done.stderr, \
        done.stderr


def test_a_kernel_bench_path_that_names_no_executable_is_refused(tmp_path):
    """$SHARDADAM_KERNEL_BENCH naming no executable stops the bench before it runs (it
    fell back to the checkout's build, timing a binary the user did not choose)."""
    done = subprocess.run(
        [sys.executable, "-m", "shardadam", "bench", "--quick", "--scale", "0.001", "--reps",
         "1", "--cases", "large", "--no-memory"], capture_output=True, text=True,
        timeout=600, env=dict(os.environ, SHARDADAM_KERNEL_BENCH=str(tmp_path / "none")))
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "SHARDADAM_KERNEL_BENCH=" in lines[0], done.stderr
    assert "is no executable file" in lines[0]


def test_peak_memory_is_measured_per_contender(tiny_run):
    _, data, _ = tiny_run
    for record in data["results"]:
        # The training cases hold the large cases' state and are timed only; the bare
        # core call is shardadam's step without its Python.
        if record["status"] != "ok" or "probe" in record["contender"] \
                or record["contender"].startswith("kernel_bench") \
                or record["kind"] == "training" or record["contender"] == "core":
            continue
        where = f"{record['case']} {record['contender']}"
        assert "memory_error" not in record, (where, record.get("memory_error"))
        assert isinstance(record["peak_extra_bytes"], int), where
        assert record["peak_extra_bytes"] >= 0, where
        assert record["peak_extra_fraction_of_state"] >= 0, where
        # multipass's chunk buffers (four fp32 ones, and int64 lookup indices for fp8
        # codes; a chunk no longer than the case's largest tensor) count, though they
        # live between steps.
        held = record["held_extra_bytes"]
        if record["contender"] == "multipass":
            per_element = 4 * 4 + (8 if record["dtypes"]["exp_avg"] == "fp8" else 0)
            assert held == per_element * min(multipass.CHUNK, record["numel"]), where
            assert record["peak_extra_bytes"] >= held, where
        else:
            assert held == 0, where


def test_peak_memory_sees_a_step_that_allocates():
    """The method measures: a step that allocates and touches 64 MiB reads at least
    that much (less 4 MiB for rounding to pages and the interpreter's own use); one
    that allocates nothing reads under 4 MiB."""
    from shardadam.bench import memory

    held = []
    allocating = memory.peak_extra_bytes(lambda: held.append(torch.ones(1 << 24)))
    assert allocating["peak_extra_bytes"] >= (64 - 4) << 20, allocating
    held.clear()
    idle = memory.peak_extra_bytes(lambda: None)
    assert idle["peak_extra_bytes"] < 4 << 20, idle


def test_shardadams_large_steps_allocate_nothing_the_measurement_resolves():
    """README: "shardadam's step needs no extra memory in these cases" (the large
    cases). Measured as the bench measures it (a fresh process per contender, the RSS
    high-water mark over one step after a warm-up step), on the quick run's own sizes,
    each preset's step adds less than 4 MiB: the floor under which the method reads a
    step that allocates nothing (test_peak_memory_sees_a_step_that_allocates). At
    7,000,003 elements the smallest full-size temporary any preset could make -- one
    bf16 copy of the parameter, 14 MB -- is more than three times that floor, so a
    step that copies any stream of the tensor fails."""
    from shardadam.bench import memory

    large = [case for case in cases.build_cases("quick", 1.0) if case.kind == "large"]
    assert {case.preset.name for case in large} == _PRESETS
    assert min(case.numel for case in large) * 2 > 3 * (4 << 20)
    results = memory.measure("shardadam", [case.id for case in large], "quick", 1.0, 1)
    for case in large:
        result = results[case.id]
        assert "error" not in result, (case.id, result)
        assert result["memory_method"] == "VmHWM after clear_refs", (case.id, result)
        assert result["peak_extra_bytes"] < 4 << 20, (case.id, result)


@pytest.mark.parametrize("preset", [p for p in cases.PRESETS.values()
                                    if p.master is not None], ids=lambda p: p.name)
def test_multipass_steps_as_shardadam_does(preset):
    """The multipass contender does the same work as shardadam's step: chunked or in
    one piece it stores the same bits, and after three steps its bf16 parameters are
    shardadam's to within one bf16 step (2^-7 of the value: they differ only where
    the masters' last fp32 bit decides a rounding)."""
    from shardadam import FusedAdam

    case = cases.Case("check", "large", preset, ((25_007,),), ())
    results = []
    for chunk in (multipass.CHUNK, 1000):
        params = cases.make_params(case)
        step = multipass.Multipass(params, preset, **contenders.HYPER, chunk=chunk).step
        for _ in range(3):
            step()
        state = step.__self__.state[0]
        results.append([params[0].detach().view(torch.int16)] + [
            state[name] for name in ("exp_avg", "exp_avg_sq", "master")])
    for one, chunked in zip(*results):
        assert torch.equal(one, chunked)
    params = cases.make_params(case)
    optimizer = FusedAdam(params, **contenders.HYPER, adam_w_mode=True,
                          **preset.fused_adam_kwargs())
    for _ in range(3):
        optimizer.step()
    torch.testing.assert_close(params[0].detach().float(),
                               results[0][0].view(torch.bfloat16).float(),
                               rtol=2.0 ** -7, atol=0)


def test_png_is_a_valid_image(tiny_run):
    _, _, png_path = tiny_run
    data = png_path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
    from matplotlib import image

    assert image.imread(str(png_path)).shape[:2] == (height, width)


@pytest.mark.parametrize("preset", ["fp32", "bf16-remainder-bf16m", "bf16-master-fp8m"])
def test_core_call_steps_as_step_does(preset):
    """The in-process yardstick (bench/core_call.py) is the same computation as
    ``FusedAdam.step()``: three steps either way store the same bits."""
    import torch

    pytest.importorskip("shardadam._C")
    from shardadam import FusedAdam
    from shardadam.bench import cases
    from shardadam.bench.contenders import HYPER
    from shardadam.bench.core_call import CoreCall
    from _optimizer_testing import assert_bitwise_equal, state_tensors

    case = cases.find_case(f"large/{preset}", "quick", 0.001)
    stepped, called = cases.make_params(case), cases.make_params(case)
    kwargs = dict(HYPER, adam_w_mode=True, **case.preset.fused_adam_kwargs())
    opt = FusedAdam(stepped, **kwargs)
    call = CoreCall(FusedAdam(called, **kwargs))  # its first step is a step()
    for _ in range(3):
        opt.step()
    for _ in range(2):
        call()
    # Params, every state entry and the scales (fp8 moments keep theirs apart); the
    # group's step counter is step()'s to keep, not the core call's.
    for a, b in zip(stepped, called):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        mine, its = state_tensors(opt, a), state_tensors(call.__self__, b)
        assert sorted(mine) == sorted(its)
        for name, value in mine.items():
            assert_bitwise_equal(its[name], value, name)


def test_core_call_is_unavailable_without_the_core():
    """Where the core does not step the tensors (not built), the in-process yardstick
    is a contender that cannot run here, reported as such, not a crash of the run."""
    import torch

    from shardadam import FusedAdam, _backend
    from shardadam.bench.core_call import CoreCall
    from shardadam.peers import Unavailable

    param = torch.nn.Parameter(torch.ones(8))
    param.grad = torch.ones(8)
    with _backend.use_backend("torch"), pytest.raises(Unavailable, match="C\+\+ core"):
        CoreCall(FusedAdam([param]))


@pytest.mark.parametrize("n", [6, 7, 15, 16, 45])
def test_paired_ratio_interval_covers_the_median(n):
    """The interval holds the true median of the ratios in at least 95% of runs (and
    not in all of them: it is no wider than its order statistics allow), checked on
    4,000 seeded runs of lognormal ratios with median 1; the bounds are ratios of the
    run, the lower one at most the paired ratio and the upper one at least."""
    rng = random.Random(n)
    # Exact coverage of the order statistics chosen: 1 - 2 P(Binomial(n, 1/2) < k),
    # the largest k that keeps it >= 0.95.
    k = max(j for j in range(1, n // 2 + 1)
            if sum(math.comb(n, i) for i in range(j)) / 2 ** n <= 0.025)
    exact = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n
    hits = 0
    for _ in range(4000):
        this = [1.0] * n
        other = [math.exp(rng.gauss(0.0, 0.3)) for _ in range(n)]
        low, high = timing.paired_ratio_interval(other, this)
        assert low in other and high in other
        assert low <= timing.paired_ratio(other, this) <= high
        hits += low <= 1.0 <= high
    assert 0.95 <= exact < 1.0
    assert abs(hits / 4000 - exact) < 4 * math.sqrt(exact * (1 - exact) / 4000)


def test_paired_ratio_interval_needs_six_repetitions():
    assert timing.paired_ratio_interval([1.0] * 5, [1.0] * 5) is None
    assert timing.paired_ratio_interval([2.0, 1.0, 3.0, 6.0, 5.0, 4.0], [1.0] * 6) == (1.0, 6.0)


@pytest.mark.parametrize("name", contenders.SHARING)
def test_sharing_contenders_step_the_shardadam_contenders_optimizer(name):
    """The bare call and the steps after torch's work time the shardadam contender's own
    optimizer and tensors when given its step, and make their own without it."""
    case = cases.find_case("large/bf16-master-bf16m", "quick", 0.0002)
    made = []

    def params():
        made.append(cases.make_params(case))
        return made[-1]

    shardadam = contenders.make("shardadam", params, case.preset)
    shared = contenders.make(name, params, case.preset, shardadam)
    assert shared.__self__ is shardadam.__self__ and len(made) == 1
    own = contenders.make(name, params, case.preset)
    assert own.__self__ is not shardadam.__self__ and len(made) == 2
    owned = own.__self__.param_groups[0]["params"]
    assert len(owned) == len(made[1]) and all(map(operator.is_, owned, made[1]))


def test_gpu_benchmark_script_runs_on_the_cpu(tmp_path):
    """benchmarks/cuda_bench.py, which only the GPU check runs for its figures, runs its
    four parts on the CPU (--device cpu --quick): each of the bench's presets and of the
    low-bit cases' in the kernel part, the transformer part beside torch's AdamW, no
    error. A script broken here would cost a GPU session its benchmark."""
    import os

    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "cuda_bench.py")
    path = tmp_path / "cuda_bench.json"
    done = subprocess.run([sys.executable, script, "--device", "cpu", "--quick", "--json",
                           str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with open(path) as f:
        report = json.load(f)
    assert report["errors"] == [], report["errors"]
    assert set(report["parts"]) == {"copy", "kernel", "model", "torch_path"}, \
        sorted(report["parts"])
    assert all(row[how]["median_s"] > 0 for row in report["parts"]["torch_path"]["rows"]
               for how in ("pieces", "whole"))
    timed = {row["preset"] for row in report["parts"]["kernel"]["rows"]}
    wanted = set(cases.PRESETS) | {preset.name for preset, _ in cases.LOWBIT_CASES}
    assert wanted <= timed, sorted(wanted - timed)
    assert all(row["median_s"] > 0 for row in report["parts"]["kernel"]["rows"])
    # each row timed the formats it is named for (block4 packs the rows' codes)
    stored = {row["preset"]: row["stored_moments"] for row in report["parts"]["kernel"]["rows"]
              if "stored_moments" in row}
    for preset, _ in cases.LOWBIT_CASES:
        want = {"block8": ["fp8-block:256", "ufp8-block:256"],
                "block4": ["fp4-block:128", "ufp4-block:128"]}.get(preset.moment_format)
        if want is not None:
            assert stored[preset.name] == want, (preset.name, stored[preset.name])
