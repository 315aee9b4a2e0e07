"""Importing the package without its compiled core, as a source tree that was not
built, or with a core that cannot load: the first steps every batch with torch ops
without a word (``python -m shardadam info`` says "not built"); the second says why
the core did not load. Each case imports a copy of the package in a fresh interpreter.
"""

import importlib.machinery
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import shardadam

PACKAGE = Path(shardadam.__file__).parent

STEP = """
import sys
# A development install's redirecting finder maps shardadam's modules to its checkout
# and build: only the copy on PYTHONPATH is wanted.
sys.meta_path = [f for f in sys.meta_path if "_editable" not in type(f).__module__]
import warnings
warnings.simplefilter("error")  # any warning fails the import
import torch
import shardadam
from shardadam import _slots
assert _slots.extension is None, _slots.extension
p = torch.nn.Parameter(torch.ones(4))
opt = shardadam.FusedAdam([p], lr=0.5)
p.grad = torch.ones(4)
opt.step()
q = torch.nn.Parameter(torch.ones(4))
q.grad = torch.ones(4)
torch.optim.AdamW([q], lr=0.5, weight_decay=0.0, fused=True).step()
assert torch.equal(p, q), (p, q)  # the C++ core's bits, and torch's fused AdamW's
print("stepped")
"""


def _copy_without_core(tmp_path):
    """The package's Python sources, without any compiled ``_C`` module."""
    target = tmp_path / "shardadam"
    shutil.copytree(PACKAGE, target,
                    ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    return target


def _run(tmp_path, code):
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180, env={"PYTHONPATH": str(tmp_path),
                                                       "PATH": "/usr/bin:/bin"})


def test_a_package_without_its_core_steps_with_torch_ops_silently(tmp_path):
    """No "circular import" warning: a module that is not there is not a broken one."""
    _copy_without_core(tmp_path)
    result = _run(tmp_path, STEP)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "stepped", result.stdout
    assert "Warning" not in result.stderr, result.stderr


def test_a_core_that_cannot_load_is_named(tmp_path):
    target = _copy_without_core(tmp_path)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (target / f"_C{suffix}").write_bytes(b"not a shared object")
    result = _run(tmp_path, STEP.replace('warnings.simplefilter("error")', ""))
    assert result.returncode == 0, result.stderr
    assert "RuntimeWarning: shardadam._C could not be loaded" in result.stderr, result.stderr
    assert "circular import" not in result.stderr


NO_METADATA = """
import importlib.metadata
# As in a source tree that was never installed: no distribution named shardadam.
found = importlib.metadata.version
def version(name):
    if name == "shardadam":
        raise importlib.metadata.PackageNotFoundError(name)
    return found(name)
importlib.metadata.version = version
""" + STEP + """
print(shardadam.__version__)
"""


@pytest.mark.parametrize("header", ["with the header", "alone"])
def test_a_source_tree_never_installed_imports_with_its_headers_version(tmp_path, header):
    """PYTHONPATH=src in a checkout that pip never installed: the version comes from
    csrc/include/shardadam/version.h two levels up, or is "0+unknown"."""
    _copy_without_core(tmp_path / "src")
    if header == "with the header":
        headers = tmp_path / "csrc" / "include" / "shardadam"
        headers.mkdir(parents=True)
        (headers / "version.h").write_text(
            "#define SHARDADAM_VERSION_MAJOR 3\n#define SHARDADAM_VERSION_MINOR 14\n"
            "#define SHARDADAM_VERSION_PATCH 15\n")
    result = _run(tmp_path / "src", NO_METADATA)
    assert result.returncode == 0, result.stderr
    expected = "3.14.15" if header == "with the header" else "0+unknown"
    assert result.stdout.split() == ["stepped", expected], result.stdout
