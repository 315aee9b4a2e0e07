"""The rare-token workload (``shardadam.rare_tokens``, ``python -m shardadam
rare-tokens``) at a size CI affords: it must still expose what one scale per tensor
does to rarely seen rows, and still train with fp32 state.

Why the small size still shows it. With 512 tokens per step over 2,048 Zipf(1.2) tokens,
token 0 takes about 512 / H = 116 of a batch (H = sum of k**-1.2 over the vocabulary =
4.4), while most tokens that occur at all occur once. The head's rows of targets absent
from a batch get only the softmax's gradient, about batch / vocab = 1/4 of a token's
share, against token 0's target's 116 shares: a ratio near 460 in gradient, 2e5 in
``exp_avg_sq``, and single elements spread further. fp8 E4M3 with one scale per tensor
holds magnitudes from 448 down to 2**-9, a ratio of 2.3e5: the smallest ``exp_avg_sq``
entries round to 0 while their ``exp_avg`` (a ratio of only ~460, inside the range)
survives, and ``m / (sqrt(0) + eps)`` with eps = 1e-8 moves those weights by about
lr * |m| / eps. The full workload (16,384 tokens, 4,096 per step) has the same ratios
or wider. One scale per block of 256 elements (block8, S2.11) sees only its own
elements' range, and learns.
"""

import contextlib
import json
import math
from dataclasses import replace

import pytest
import torch

from shardadam import rare_tokens
from shardadam.__main__ import main

STEPS = 20
SMALL = replace(rare_tokens.FULL, vocab=2048, dim=64, batch=512, steps=STEPS, last=5)
# The weights start at N(0, 0.02**2), so the first logits are sums of 64 products of two
# such numbers: N(0, 0.0032**2), and the first loss is ln(vocab) (a uniform guess's,
# 7.62 here) to within a few thousandths.
UNIFORM_LOSS = math.log(SMALL.vocab)
FIRST_LOSS_TOL = 0.01
# A loss twice a uniform guess's is confidently wrong: weights thrown off, not slow.
THROWN_OFF = 2 * UNIFORM_LOSS
# Learning, not a figure: fp32 goes from 7.62 to 7.40 in these 20 steps (seeds 0-3).
LEARNED = 0.1


@pytest.fixture(autouse=True)
def one_thread(restore_torch_threads):
    """One torch thread: these steps are small, and on a busy 2-core runner two threads
    spend most of their time waiting for each other."""
    torch.set_num_threads(1)


def _fused(**kwargs):
    return rare_tokens.fused_adam_factory(**kwargs)


def _run(make, workload=SMALL):
    return rare_tokens.train(make, workload)


def _assert_learns(result):
    assert result.diverged_at is None
    assert len(result.losses) == STEPS
    first = result.losses[0]
    assert abs(first - UNIFORM_LOSS) < FIRST_LOSS_TOL, first
    # No step above the first: the loss falls by ~0.005 per step at the start, while
    # sampling moves a batch's loss far less (the first logits are all but equal).
    assert max(result.losses) <= first, result.losses
    assert result.losses[-1] < first - LEARNED, result.losses


def test_fp32_learns():
    _assert_learns(_run(rare_tokens.adamw_factory))


def test_per_tensor_fp8_moments_diverge():
    """Both moments in fp8 with one scale per tensor: within the steps the fp32 run
    above spends learning, the loss passes twice a uniform guess's (measured: at steps
    12-14 for seeds 0-7, peaking at 35-69 by step 20; the workload's own bound, 100
    nats, at steps 23-46). If this fails, the workload no longer shows the problem."""
    result = _run(_fused(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8))
    assert max(result.losses) > THROWN_OFF, result.losses


def test_fp8_exp_avg_alone_trains():
    """The failure is ``exp_avg_sq``'s: fp8 ``exp_avg`` beside bf16 ``exp_avg_sq`` (which
    keeps fp32's exponent range) learns as fp32 does."""
    _assert_learns(_run(_fused(exp_avg_dtype=torch.uint8,
                               exp_avg_sq_dtype=torch.bfloat16)))


def test_block8_moments_learn():
    """Both moments in 8 bits with one scale per block of 256 (S2.11) learn where one
    scale per tensor is thrown off: a block holds the range of its own rows."""
    _assert_learns(_run(_fused(moment_format="block8")))


def test_block8_with_remainders_learns():
    """The demo's remainder-block8 state: bf16 parameters, int16 remainders, block8."""
    result = rare_tokens.train(
        _fused(moment_format="block8", master_weights=True, store_param_remainders=True),
        SMALL, param_dtype=torch.bfloat16)
    _assert_learns(result)


def test_repeatable():
    """Same seed, same thread count: the same losses bit for bit (weights, permutation
    and batches come from seeded generators alone)."""
    short = replace(SMALL, steps=3, last=3)
    make = _fused(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    assert _run(make, short).losses == _run(make, short).losses


def test_command(tmp_path, capsys):
    out = tmp_path / "result.json"
    status = main(["rare-tokens", "--vocab", "512", "--dim", "32", "--batch", "256",
                   "--steps", "3", "--exp-avg", "bf16", "--exp-avg-sq", "bf16",
                   "--params", "bf16", "--master", "remainder", "--threads", "1",
                   "--quiet", "--json", str(out)])
    assert status == 0
    assert "mean loss of the last 3 steps" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert len(figures["losses"]) == 3 and figures["diverged_at"] is None
    # bf16 moments (2 + 2 bytes) and an int16 remainder (2 bytes) per parameter.
    assert figures["state_bytes_per_param"] == 6.0
    assert figures["workload"]["vocab"] == 512


def test_command_block8(tmp_path, capsys):
    out = tmp_path / "result.json"
    status = main(["rare-tokens", "--vocab", "512", "--dim", "32", "--batch", "256",
                   "--steps", "3", "--moment-format", "block8", "--params", "bf16",
                   "--master", "remainder", "--threads", "1", "--quiet", "--json",
                   str(out)])
    assert status == 0
    assert "moments block8 (blocks of 256)" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    # 1 + 1 code bytes, 2 x 4 / 256 scale bytes and a 2-byte remainder per parameter.
    assert figures["state_bytes_per_param"] == 4.03125


def test_command_beta2(tmp_path, capsys):
    """--beta2 sets the second moment's decay (the workload's betas, in the header and
    the JSON) and changes the run."""
    runs = {}
    for beta2 in ("0.95", "0.999"):
        out = tmp_path / f"{beta2}.json"
        assert main(["rare-tokens", "--vocab", "512", "--dim", "32", "--batch", "256",
                     "--steps", "3", "--beta2", beta2, "--threads", "1", "--quiet",
                     "--json", str(out)]) == 0
        assert f"betas (0.9, {beta2})" in capsys.readouterr().out
        runs[beta2] = json.loads(out.read_text())
    assert runs["0.999"]["workload"]["betas"] == [0.9, 0.999]
    assert runs["0.95"]["losses"][0] == runs["0.999"]["losses"][0]  # before any step
    assert runs["0.95"]["losses"][1:] != runs["0.999"]["losses"][1:]


def test_command_refuses_state_flags_for_adamw(capsys):
    assert main(["rare-tokens", "--optimizer", "adamw", "--exp-avg", "fp8"]) == 2
    assert "takes no state" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--moment-format", "block8", "--moment-block-size", "100"],
     "moment_block_size must be a power of two in [128, 4096]"),
    (["--moment-format", "block4", "--master", "fp16", "--params", "bf16"],
     "master_weight_dtype=torch.float16 is scaled per tensor"),
    (["--seed", str(2**32)], "--seed: must be below 2**32"),
    (["--seed", "-1"], "--seed: must be at least 0, got -1"),
    (["--threads", "-1"], "--threads: must be at least 1, got -1"),
    (["--steps", "0"], "--steps: must be at least 1, got 0"),
    (["--beta2", "1"], "--beta2: must be in [0, 1), got 1.0"),
    (["--beta2", "x"], "--beta2: expected a number, got 'x'"),
    (["--json", "/nonexistent-folder/result.json"], "cannot write into '/nonexistent-folder'"),
    (["--json", "/"], "'/' is a folder, not a file"),
    # tried before the run, not only its folder: these failed when the result was written
    (["--json", "/nonexistent-folder/"], "names a folder (it ends in '/'), not a file"),
    (["--json", "x" * 300 + ".json"], "File name too long"),
    # sizes past the machine's memory: named, not torch's allocation traceback
    (["--vocab", str(10**11)], "need at least"),
    # The bf16 options on fp32 parameters would run under a label they do not apply to.
    (["--master", "remainder"], "--master and --param-rounding apply to bf16 parameters"),
    (["--param-rounding", "stochastic"], "apply to bf16 parameters only"),
])
def test_command_refuses_bad_settings_before_training(flags, message, capsys):
    """The optimizer's own checks and the output path, before minutes of training;
    each bound named as it is (argparse's own refusals exit)."""
    refused_by_argparse = flags[0] in ("--seed", "--threads", "--steps", "--beta2", "--json")
    with pytest.raises(SystemExit) if refused_by_argparse else contextlib.nullcontext():
        assert main(["rare-tokens", *flags]) == 2
    out, err = capsys.readouterr()
    assert message in err and "loss" not in out


def test_command_refuses_state_flags_for_a_peer(capsys):
    assert main(["rare-tokens", "--optimizer", "torchao-adamw8bit", "--params", "bf16"]) == 2
    assert "--optimizer torchao-adamw8bit takes no state" in capsys.readouterr().err


def test_command_refuses_a_peer_not_installed_before_the_run(capsys, monkeypatch):
    """A peer whose package is not installed: exit 2 before anything is printed or
    trained, naming what to install (as the demo's --also)."""
    from shardadam import peers

    monkeypatch.setitem(peers.PEERS, "torchao-adamw8bit",
                        ("no_such_package.optim", "AdamW8bit", "a package that is not there"))
    status = main(["rare-tokens", "--optimizer", "torchao-adamw8bit", "--vocab", "512",
                   "--dim", "32", "--batch", "256", "--steps", "3", "--quiet"])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert ("--optimizer torchao-adamw8bit: no_such_package is not installed "
            "(`pip install no_such_package`") in captured.err


def test_command_reports_a_peer_not_importable(capsys, monkeypatch):
    """A peer whose package is there but whose module cannot be imported: exit 1 and
    the reason, nothing trained."""
    from shardadam import peers

    monkeypatch.setitem(peers.PEERS, "torchao-adamw8bit",
                        ("shardadam.no_such_module", "AdamW8bit", "a module that is not there"))
    status = main(["rare-tokens", "--optimizer", "torchao-adamw8bit", "--vocab", "512",
                   "--dim", "32", "--batch", "256", "--steps", "3", "--quiet"])
    captured = capsys.readouterr()
    assert status == 1
    assert "shardadam not importable: ModuleNotFoundError" in captured.err
    assert "mean loss" not in captured.out


def test_command_peer(tmp_path, capsys):
    """torchao's AdamW8bit (where installed, as `make bench` does; CI's venv has none) on
    the workload: its state counted from the codes and scales inside its tensors."""
    pytest.importorskip("torchao.optim")
    out = tmp_path / "result.json"
    status = main(["rare-tokens", "--optimizer", "torchao-adamw8bit", "--vocab", "512",
                   "--dim", "32", "--batch", "256", "--steps", "3", "--threads", "1",
                   "--quiet", "--json", str(out)])
    assert status == 0, capsys.readouterr().err
    figures = json.loads(out.read_text())
    assert figures["label"].startswith("torchao.optim.AdamW8bit")
    # Per parameter 1 + 1 code bytes and 2 x 4 / 256 scale bytes; per tensor (2 of
    # 16,384 elements) a 256-entry fp32 code map per moment and a 4-byte step.
    expected = 2 + 8 / 256 + 2 * (2 * 256 * 4 + 4) / (2 * 512 * 32)
    assert figures["state_bytes_per_param"] == pytest.approx(expected)
