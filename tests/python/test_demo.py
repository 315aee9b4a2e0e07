"""``python -m shardadam demo`` end to end (tiny model, 2 -> 3 ranks), and its errors.

The full run happens once per module (real gloo processes, ~20 s on 2 cores); the tests
read what it wrote. Bad arguments are checked in-process (they are rejected before any
rank starts); the crashed-rank case runs the demo once more with a rank made to fail.
"""

import json
import math
import os
import re
import subprocess
import sys
import time
import uuid

import pytest

from shardadam.__main__ import main

STEPS = 10  # checkpoint after step 5, so 5 steps are resumed
RANKS, RESUME_RANKS = 2, 3
SEED = 0
# The test's own bound on |resumed loss - uninterrupted loss| over the resumed steps, per
# configuration (state preset, model, steps, ranks, resume ranks); not the product's
# own (config.StatePreset.resume_tolerance).
#
# What differs: the checkpoint restores bf16 params, bf16 moments and int16 remainders
# bitwise (S5.6), and every step trains on the same tokens; only the rank count changes,
# i.e. how the fp32 sums are split (each rank's fp32 cross-entropy sum over its 3 or 4
# rows, FSDP's gradient reduce-scatter). The loss of the first resumed step comes from
# bitwise-equal parameters, so its difference is that summation order alone; later
# steps add ulp-level gradient differences. One fp32 ulp of a rank's loss sum (below
# 1024 here: at most 4 rows x 32 tokens x ~4.3 nats) is at most 2**-14, i.e.
# 2**-22 = 2.4e-7 in the per-token loss (256 tokens per step).
# Measured on a 2-core runner, seeds 0-7, 40 resumed steps: max 3.6e-7 (1.5 such units),
# identical in repeated runs; the first resumed step 2.4e-7. The bound, 8 units (1.9e-6),
# leaves room for other thread counts (other machines) to change the intra-rank orders;
# it still fails a resume that loses the remainders' low byte (measured 1.1e-5), moments
# that go through an fp8 round trip on load (4.9e-4), or a lost remainder (3.1e-3).
RESUME_TOL = {("remainder-bf16", "tiny", STEPS, RANKS, RESUME_RANKS): 8 * 2.0 ** -22}
# Generous bounds for a loaded 2-core runner; the demo itself bounds every phase too.
RUN_TIMEOUT_S = 240
LEFTOVER_WAIT_S = 15


def _run_demo(out, *extra, env=None):
    command = [sys.executable, "-m", "shardadam", "demo", "--model", "tiny",
               "--steps", str(STEPS), "--seed", str(SEED), "--ranks", str(RANKS),
               "--resume-ranks", str(RESUME_RANKS), "--out", str(out), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          cwd=out.parent, env=env)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    result = _run_demo(out)
    # No skip: FusedAdam must take the FSDP2 DTensor parameters (S1.4); a rejection
    # fails here like any other failure of the demo.
    assert result.returncode == 0, f"demo failed:\n{result.stdout}\n{result.stderr}"
    with open(out / "demo.json") as f:
        figures = json.load(f)
    return out, result, figures


def test_both_runs_learn(demo):
    _, _, figures = demo
    for name in ("adamw", "shardadam"):
        run = figures["runs"][name]
        assert run["step"] == list(range(1, STEPS + 1))
        assert run["ranks"] == RANKS
        # From ~ln(256) = 5.5 nats per byte; 10 steps of the tiny model reach ~3.9.
        assert run["final_loss"] < run["first_loss"] - 0.5, run["loss"]
        # the README's accuracy figure: the mean of the last 10 steps' losses
        assert run["last_mean_loss"] == pytest.approx(sum(run["loss"][-10:]) / 10,
                                                      rel=1e-12)


def test_small_state(demo):
    _, _, figures = demo
    adamw, fused = figures["runs"]["adamw"], figures["runs"]["shardadam"]
    assert figures["config"]["state"] == "remainder-bf16"
    # exp_avg and exp_avg_sq in bf16, the master as an int16 remainder: 6 bytes exactly.
    assert fused["state_bytes_per_param"] == pytest.approx(6.0)
    assert fused["param_bytes_per_param"] == pytest.approx(2.0)
    # torch keeps two fp32 moments (plus a 4-byte step tensor per parameter tensor).
    assert 8.0 <= adamw["state_bytes_per_param"] < 8.1
    for run in figures["runs"].values():
        assert run["peak_rss_mib"] > 0 and run["opt_ms_mean"] > 0


def test_resume_continues_uninterrupted_run(demo):
    """Tolerance and why: RESUME_TOL above (the test's own, measured)."""
    _, _, figures = demo
    config = figures["config"]
    key = (config["state"], config["model"], config["steps"], config["ranks"],
           config["resume_ranks"])
    assert config["seed"] == SEED and key in RESUME_TOL, key
    uninterrupted, resumed = figures["runs"]["shardadam"], figures["runs"]["resume"]
    mid = STEPS // 2
    assert resumed["ranks"] == RESUME_RANKS
    assert resumed["step"] == list(range(mid + 1, STEPS + 1))
    reference = dict(zip(uninterrupted["step"], uninterrupted["loss"]))
    diffs = [loss - reference[step] for step, loss in zip(resumed["step"], resumed["loss"])]
    assert max(map(abs, diffs)) <= RESUME_TOL[key], diffs
    check = figures["resume_check"]
    # the demo's own verdict, and the differences it reports are these
    assert check["passed"] and check["from_step"] == mid
    assert check["ranks"] == [RANKS, RESUME_RANKS]
    assert check["diff"] == diffs


def test_png_written(demo):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import image

    out, _, _ = demo
    path = out / "demo.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # two panels of curves, not an empty canvas
    pixels = image.imread(str(path))
    assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 300


def test_progress_and_summary_printed(demo):
    out, result, _ = demo
    step_lines = [line for line in result.stdout.splitlines()
                  if re.search(r"step +\d+/\d+ +loss \d+\.\d+ .*tok/s .*opt .*ms", line)]
    # Rank 0 of each phase reports every step it runs.
    assert len(step_lines) == STEPS + STEPS + (STEPS - STEPS // 2)
    assert "resume check" in result.stdout and "PASS" in result.stdout
    assert str(out / "demo.json") in result.stdout
    assert str(out / "demo.png") in result.stdout


def test_the_machine_is_recorded(demo):
    """The report names what its figures come from: CPU, versions, SIMD target."""
    import torch

    import shardadam

    _, result, figures = demo
    machine = figures["machine"]
    assert machine["torch"] == torch.__version__
    assert machine["shardadam"] == shardadam.__version__
    assert machine["cpu"] and machine["logical_cpus"] == os.cpu_count()
    assert (f"machine: {machine['cpu']}, {machine['logical_cpus']} logical CPUs; torch "
            f"{machine['torch']}" in result.stdout)


def test_a_failed_resume_check_reads_as_one(demo):
    """A FAIL prints its difference as above the bound (it printed "<=" either way)."""
    import copy

    from shardadam.demo import report

    _, _, figures = demo
    failed = copy.deepcopy(figures)
    check = failed["resume_check"]
    check["passed"], check["early_max_abs_diff"] = False, 1e-2
    line = next(l for l in report.table(failed).splitlines() if l.startswith("resume check"))
    assert "FAIL" in line and f"1.0e-02 > {check['early_tolerance']:.0e}" in line, line


def test_short_runs_say_what_their_columns_cover(demo):
    """The resumed run has fewer steps than the "last 10 mean" column averages: its
    figure is the mean of the steps it has, and a footnote says so; a one-step run's
    step time is its first step's, also said."""
    from shardadam.demo import report

    _, result, figures = demo
    resumed = figures["runs"]["resume"]
    assert resumed["last_mean_steps"] == STEPS - STEPS // 2
    assert resumed["last_mean_loss"] == pytest.approx(
        sum(resumed["loss"]) / len(resumed["loss"]), rel=1e-12)
    assert f"{resumed['label']}: last 10 mean over its {STEPS - STEPS // 2} steps." \
        in result.stdout
    assert "opt step times its only step" not in result.stdout
    one_step = dict(resumed, label="one", last_mean_steps=1, opt_ms_steps=0)
    assert report._short_runs({"one": one_step}) == [
        "one: last 10 mean over its 1 step.", "one: opt step times its only step, the first."]


def _bad_input_cases(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    taken = tmp_path / "taken"
    (taken / "demo.json").mkdir(parents=True)  # where the report goes, after the run
    return [
        (["--state", "nope"], r"--state: invalid choice: 'nope'"),
        (["--ranks", "0"], r"--ranks: must be at least 1, got 0"),
        (["--resume-ranks", "0"], r"--resume-ranks: must be at least 1, got 0"),
        # 2 would judge only a resumed step taken before any resumed update
        (["--steps", "2"], r"--steps: must be at least 3, got 2"),
        (["--model", "tiny", "--ranks", "9"], r"--ranks 9 exceeds the 8 sequences"),
        (["--out", str(blocker / "out")], r"cannot write to output folder"),
        # seed * 1_000_003 + step seeds the data order: torch takes up to 2**64 - 1
        (["--seed", str(2**32)], r"--seed: must be at most 4294967295"),
        (["--also", "nope"], r"--also: 'nope' is not one of torchao-adamw8bit, "),
        # bitsandbytes' optimizers do not step DTensor parameters.
        (["--also", "bnb-adamw8bit"], r"--also: 'bnb-adamw8bit' is not one of "),
        (["--also", "torchao-adamw8bit,torchao-adamw8bit"], r"--also: a name is given twice"),
        # "" would write into the current folder, not a run folder of its own.
        (["--out", ""], r"--out: expected a folder name, got an empty one"),
        (["--out", str(taken)], r"cannot write the report into .*demo\.json' is a folder"),
    ]


@pytest.mark.parametrize("index", range(12), ids=["unknown-preset", "zero-ranks",
                                                   "zero-resume-ranks", "two-steps",
                                                   "more-ranks-than-rows", "unwritable-out",
                                                   "seed-beyond-torch", "unknown-peer",
                                                   "peer-without-dtensor", "peer-twice",
                                                   "empty-out", "report-name-taken"])
def test_bad_input_one_line_and_nonzero_exit(index, tmp_path, capsys):
    args, pattern = _bad_input_cases(tmp_path)[index]
    try:
        code = main(["demo", *args])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert re.search(pattern, lines[0]), lines[0]


def test_a_torch_without_fsdp2_on_cpu_is_refused_before_any_rank(tmp_path, capsys,
                                                                  monkeypatch):
    """torch 2.6's FSDP2 fails on CPU ranks (its CPU stream has no events): one line
    naming the version needed, before any rank starts; 2.7 and later run."""
    import importlib.metadata

    version = importlib.metadata.version

    def installed(name):
        if name != "torch":
            return version(name)
        if torch_version is None:  # a torch without package metadata: nothing assumed
            raise importlib.metadata.PackageNotFoundError(name)
        return torch_version

    monkeypatch.setattr(importlib.metadata, "version", installed)
    for torch_version, refused in (("2.6.0", True), ("2.7.1", False), ("10.0", False),
                                   (None, False)):
        out = tmp_path / str(torch_version)
        # --ranks past the rows is the next check: it tells a pass from a refusal.
        code = main(["demo", "--model", "tiny", "--ranks", "9", "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        wanted = ("FSDP2 on CPU ranks needs torch 2.7 or newer, this is 2.6.0" if refused
                  else "--ranks 9 exceeds")
        assert wanted in err[0], err[0]


def test_also_refuses_a_peer_not_installed(tmp_path, capsys, monkeypatch):
    """``--also`` with a package that is not installed: one line naming it, before any
    rank starts."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else find_spec(name, *a))
    code = main(["demo", "--also", "torchao-adamw4bit", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--also torchao-adamw4bit: torchao is not installed" in err[0]
    assert not (tmp_path / "out" / "demo.json").exists()


@pytest.mark.parametrize("hidden", ["numpy", "matplotlib"])
def test_a_missing_optional_module_is_named_before_any_rank(tmp_path, capsys, monkeypatch,
                                                            hidden):
    """numpy (torch's checkpoints gather objects through it) and matplotlib (demo.png)
    are the package's ``demo`` extra: without one, one line names it before any rank
    starts, not a rank's traceback minutes later."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == hidden else find_spec(name, *a))
    code = main(["demo", "--model", "tiny", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"the demo cannot run without {hidden}" in err[0] and "shardadam[demo]" in err[0]
    assert not (tmp_path / "out").exists()


def _torchao_adamw8bit_bytes(shapes, ranks):
    """State bytes torchao's AdamW8bit holds over FSDP2's Shard(0) shards on ``ranks``
    ranks: its rule, applied to each rank's local shard, quantizes a shard of at least
    4,096 elements that is a multiple of its block (256): 1 + 1 code bytes and 2 x 4 /
    256 scale bytes per element and a 256-entry fp32 code map per moment; other shards
    keep two fp32 moments. Every rank keeps a 4-byte step counter per parameter."""
    total = 0
    for shape in shapes:
        rows, per_row = shape[0], math.prod(shape[1:])
        chunk = -(-rows // ranks)
        for rank in range(ranks):
            n = max(0, min(chunk, rows - rank * chunk)) * per_row
            quantized = n >= 4096 and n % 256 == 0
            total += (2 * n + 8 * n // 256 + 2 * 256 * 4 if quantized else 8 * n) + 4
    return total


def test_also_trains_a_peer(tmp_path):
    """``--also torchao-adamw8bit`` (where torchao is installed, as ``make bench`` does;
    CI's venv has none): its run trains on the same data and ranks, and its state is
    counted from the codes, scales and code maps inside its DTensor-wrapped states."""
    pytest.importorskip("torchao.optim")
    from shardadam.demo.config import SIZES
    from shardadam.demo.data import VOCAB_SIZE
    from shardadam.demo.model import Transformer

    out = tmp_path / "out"
    result = _run_demo(out, "--also", "torchao-adamw8bit")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    figures = json.loads((out / "demo.json").read_text())
    assert figures["config"]["also"] == ["torchao-adamw8bit"]
    run = figures["runs"]["torchao-adamw8bit"]
    assert run["ranks"] == RANKS and run["step"] == list(range(1, STEPS + 1))
    assert run["final_loss"] < run["first_loss"] - 0.5, run["loss"]
    shapes = [p.shape for p in Transformer(VOCAB_SIZE, SIZES["tiny"]).parameters()]
    expected = _torchao_adamw8bit_bytes(shapes, RANKS) / run["params"]
    assert run["state_bytes_per_param"] == pytest.approx(expected, rel=1e-12)
    assert "torchao-adamw8bit x2" in result.stdout


def _processes_with(marker):
    """PIDs of live processes whose environment holds ``marker`` (Linux)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read():
                    found.append(int(pid))
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return found


def test_failure_is_blamed_on_the_rank_that_failed_first(tmp_path):
    """A failed rank's peers fail milliseconds later on the lost connection, and the
    launcher may see their exits first (it waits on them in rank order): the report
    names the rank whose recorded failure came first; a rank that died without a
    record counts from when its exit was seen."""
    from types import SimpleNamespace

    from shardadam.demo import launcher

    config = {"results": str(tmp_path), "phase": "adamw"}

    def record(rank, when, why):
        (tmp_path / f"adamw-rank{rank}.error").write_text(f"{when!r}\n{why}")

    ranks = [SimpleNamespace(exitcode=1), SimpleNamespace(exitcode=1),
             SimpleNamespace(exitcode=None)]
    record(0, 100.020, "RuntimeError: Connection reset by peer")
    record(1, 100.001, "RuntimeError: injected failure on rank 1 at step 2")
    assert launcher._first_failure(ranks, config, seen_rank=0, seen_at=100.05) == 1
    message = launcher._failure_message(config, 1, 3, ranks[1])
    assert message.startswith("rank 1 of 3 failed in the adamw phase (exit code 1): "
                              "RuntimeError: injected failure on rank 1 at step 2;")
    # Rank 1 killed before it could record: seen to exit before rank 0's record.
    (tmp_path / "adamw-rank1.error").unlink()
    ranks[1].exitcode = -9
    assert launcher._first_failure(ranks, config, seen_rank=1, seen_at=100.010) == 1
    assert launcher._first_failure(ranks, config, seen_rank=1, seen_at=100.030) == 0
    assert "(killed by SIGKILL): no error recorded" in launcher._failure_message(
        config, 1, 3, ranks[1])
    # An unrecorded death not the one seen has no time: any recorded failure is first.
    assert launcher._first_failure(ranks, config, seen_rank=0, seen_at=100.05) == 0


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to list processes")
def test_crashed_rank_stops_every_rank(tmp_path):
    marker = f"SHARDADAM_DEMO_TEST={uuid.uuid4().hex}"
    env = dict(os.environ, SHARDADAM_DEMO_TEST=marker.split("=", 1)[1])
    out = tmp_path / "out"
    # An earlier run's report and logs in the same folder are removed first, so the
    # failed run leaves none of them beside its own (they stayed, read as this run's).
    (out / "logs").mkdir(parents=True)
    (out / "demo.json").write_text("{}")
    (out / "logs" / "shardadam-rank0.json").write_text("{}")
    (out / "logs" / "train-rank0.log").write_text("not the demo's")  # kept
    began = time.monotonic()
    result = _run_demo(out, "--fail-at", "1:2", env=env)
    assert result.returncode == 1, result.stderr
    assert f"{out} held an earlier run's report and logs (2 files): removed" in result.stdout
    assert not (out / "logs" / "shardadam-rank0.json").exists()
    assert (out / "logs" / "train-rank0.log").read_text() == "not the demo's"
    assert re.search(r"rank 1 of 2 failed in the adamw phase \(exit code 1\): "
                     r"RuntimeError: injected failure on rank 1 at step 2", result.stderr)
    assert "all ranks stopped" in result.stderr
    assert not (out / "demo.json").exists()
    # Every process the demo started (ranks, fork server) ends: SIGKILL for the ranks,
    # the fork server follows its parent out (it may take a moment to shut down).
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while _processes_with(marker.encode()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker.encode()) == []
    assert time.monotonic() - began < RUN_TIMEOUT_S


def test_remainder_block8_preset():
    """The remainder-block8 preset builds FusedAdam with bf16 parameters, int16
    remainders and block8 moments (S2.11): 1 + 1 code bytes, a 4-byte scale per 256
    elements of each moment and a 2-byte remainder per parameter."""
    import torch

    from shardadam import FusedAdam
    from shardadam.demo.config import PRESETS

    preset = PRESETS["remainder-block8"]
    p = torch.nn.Parameter(torch.zeros(4, 256, dtype=getattr(torch, preset.param_dtype)))
    opt = FusedAdam([p], **preset.fused_adam_kwargs())
    formats = {name: fmt.name for name, fmt in opt._formats[p].items()}
    assert formats["exp_avg"] == "fp8-block" and formats["master_param"] == "remainder"
    stored = sum(t.numel() * t.element_size() for t in opt.state[p].values())
    scales = sum(t.numel() * t.element_size() for t in opt._scales[p].values())
    assert (stored + scales) / p.numel() == 4.03125


def test_bf16_sr_block8_preset():
    """The bf16-sr-block8 preset builds FusedAdam with bf16 parameters, no master, block8
    moments and the parameters rounded stochastically (S2.14): 2 + 2 scale bytes per 256
    elements, and its steps store other bits than bf16-block8's rounding to nearest."""
    import torch

    from shardadam import FusedAdam
    from shardadam.demo.config import PRESETS

    params = {}
    for name, rounding in (("bf16-sr-block8", "stochastic"), ("bf16-block8", "nearest")):
        preset = PRESETS[name]
        p = torch.nn.Parameter(torch.ones(4, 256, dtype=getattr(torch, preset.param_dtype)))
        opt = FusedAdam([p], lr=1e-3, **preset.fused_adam_kwargs())
        assert opt.param_rounding == rounding
        assert "master_param" not in opt.state[p]
        stored = sum(t.numel() * t.element_size() for t in opt.state[p].values())
        scales = sum(t.numel() * t.element_size() for t in opt._scales[p].values())
        assert (stored + scales) / p.numel() == 2.03125
        p.grad = torch.ones_like(p)
        opt.step()
        params[name] = p.detach()
    assert torch.equal(params["bf16-block8"], torch.ones(4, 256))
    assert not torch.equal(params["bf16-sr-block8"], params["bf16-block8"])


def _start_and_wait_for_ranks(tmp_path, marker):
    """A long tiny demo whose processes carry ``marker``, once its first phase's ranks
    have started; ``(process, out, its TMPDIR)``."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, SHARDADAM_DEMO_TEST=marker.split("=", 1)[1], TMPDIR=str(tmp))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "shardadam", "demo", "--model", "tiny", "--steps",
               "4000", "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path, env=env)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not all((out / "logs" / f"adamw-rank{r}.log").exists() for r in range(2)):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.2)
    return process, out, tmp


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to list processes")
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_a_demo_killed_alone_takes_its_ranks_with_it(tmp_path, signum):
    """A signal to the demo's own process only (a job runner's SIGTERM, timeout's, or
    SIGKILL) ends its fork server and ranks too: they kept training, the server held
    alive by the pipe multiprocessing hands every child. SIGTERM ends it as Ctrl-C
    does: a message, exit status 128 + 15, the temporary folder removed."""
    import signal

    marker = f"SHARDADAM_DEMO_TEST={uuid.uuid4().hex}"
    process, out, tmp = _start_and_wait_for_ranks(tmp_path, marker)
    process.send_signal(getattr(signal, signum))
    stdout, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while _processes_with(marker.encode()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker.encode()) == []
    if signum == "SIGTERM":
        assert process.returncode == 128 + signal.SIGTERM, stderr
        assert "interrupted; all ranks stopped" in stderr
        assert list(tmp.iterdir()) == []  # the run's temporary folder removed
    else:
        assert process.returncode == -signal.SIGKILL


def test_stopping_a_phase_interrupted_while_starting_joins_only_started_ranks():
    """Ctrl-C while a phase's ranks start leaves some never started: stopping the phase
    joins only those that were (it was "can only join a started process")."""
    import multiprocessing

    from shardadam.demo import launcher

    started = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    unstarted = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    started.start()
    launcher._stop([started, unstarted])
    assert started.exitcode is not None and unstarted.pid is None
