"""Each command's own module runs as that command: ``python -m shardadam.rare_tokens``
is ``python -m shardadam rare-tokens`` (before, the module ran nothing and exited 0)."""

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
