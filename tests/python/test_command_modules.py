"""Each command's own module runs as that command: ``python -m shardadam.rare_tokens``
is ``python -m shardadam rare-tokens`` (before, the module ran nothing and exited 0); a
command whose reader leaves stops quietly."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module, command", [("shardadam.rare_tokens", "rare-tokens"),
                                             ("shardadam.demo.cli", "demo"),
                                             ("shardadam.bench.cli", "bench")])
def test_module_runs_its_command(module, command):
    """Its arguments reach the command's own parser: the usage it prints is the
    command's (one interpreter start each: they import torch)."""
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: python -m shardadam {command} "), result.stdout


def test_a_reader_that_leaves_stops_the_command_quietly():
    """`python -m shardadam rare-tokens | head -1`: the command stops at its next write,
    exit status 1, without a BrokenPipeError traceback."""
    child = subprocess.Popen(
        [sys.executable, "-m", "shardadam", "rare-tokens", "--vocab", "64", "--dim", "8",
         "--batch", "32", "--steps", "300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    first = child.stdout.readline()
    child.stdout.close()  # the reader leaves
    errors = child.stderr.read()
    assert child.wait(timeout=120) == 1
    assert first.startswith("rare tokens: "), first
    assert "Traceback" not in errors and "BrokenPipe" not in errors, errors


@pytest.mark.parametrize("argv", [["--bogus"], ["--bogus", "demo"], ["-x"]])
def test_a_flag_before_the_command_is_named(argv, capsys):
    """`python -m shardadam --bogus` names the flag and where the command goes (argparse
    alone says only that a command is missing); status 2, as for every bad argument."""
    from shardadam.__main__ import main
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"python -m shardadam: error: unrecognized argument {argv[0]}: the "
                   "command comes first (demo, bench, rare-tokens, info) (see --help)\n")


def test_help_before_the_command_still_prints_the_usage(capsys):
    from shardadam.__main__ import main
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m shardadam ")
