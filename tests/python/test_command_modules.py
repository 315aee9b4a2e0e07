"""Each command's own module runs as that command: ``python -m shardadam.rare_tokens``
is ``python -m shardadam rare-tokens`` (before, the module ran nothing and exited 0)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module, command", [("shardadam.rare_tokens", "rare-tokens"),
                                             ("shardadam.demo.cli", "demo"),
                                             ("shardadam.bench.cli", "bench")])
def test_module_runs_its_command(module, command):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: python -m shardadam {command} "), result.stdout
    # Arguments reach the command's own parser, which refuses what it does not know.
    refused = subprocess.run([sys.executable, "-m", module, "--no-such-flag"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in refused.stderr
