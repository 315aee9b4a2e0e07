"""Importing the package without its compiled core, as a source tree that was not
built, or with a core that cannot load: every batch then steps with torch ops. The
first imports quietly and says so at its first CPU step (a package used only on other
devices stays quiet), once; the second says why the core did not load, at import.
``python -m shardadam info`` tells the two apart. Each case imports a copy of the
package in a fresh interpreter.
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
warnings.simplefilter("error")  # any warning while importing fails
import torch
import shardadam
from shardadam import _slots
assert _slots.extension is None, _slots.extension
p = torch.nn.Parameter(torch.ones(4))
opt = shardadam.FusedAdam([p], lr=0.5)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        p.grad = torch.ones(4)
        opt.step()
for warning in caught:
    print("warned:", warning.category.__name__, warning.message)
q = torch.nn.Parameter(torch.ones(4))
theirs = torch.optim.AdamW([q], lr=0.5, weight_decay=0.0, fused=True)
for _ in range(2):
    q.grad = torch.ones(4)
    theirs.step()
assert torch.equal(p, q), (p, q)  # the C++ core's bits, and torch's fused AdamW's
print("stepped")
"""

INFO = """
import sys
sys.meta_path = [f for f in sys.meta_path if "_editable" not in type(f).__module__]
import warnings
warnings.simplefilter("ignore")
sys.argv = ["shardadam", "info"]
import runpy
runpy.run_module("shardadam", run_name="__main__")
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


def test_a_package_without_its_core_says_so_at_its_first_cpu_step(tmp_path):
    """Not at import (no "circular import" warning either: a module that is not there
    is not a broken one), and once."""
    _copy_without_core(tmp_path)
    result = _run(tmp_path, STEP)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "stepped", result.stdout
    warned = [line for line in lines if line.startswith("warned:")]
    assert len(warned) == 1, warned
    assert warned[0].startswith("warned: RuntimeWarning shardadam._C is not built"), warned
    assert "torch path" in warned[0], warned
    assert "Warning" not in result.stderr, result.stderr
    info = _run(tmp_path, INFO)
    assert "C++ core:       not built" in info.stdout, (info.stdout, info.stderr)


WARNING_AS_ERROR = """
import sys
sys.meta_path = [f for f in sys.meta_path if "_editable" not in type(f).__module__]
import warnings
import torch
import shardadam
p = torch.nn.Parameter(torch.ones(4))
opt = shardadam.FusedAdam([p], lr=0.5)
q = torch.nn.Parameter(torch.ones(4))
opt.param_groups[0]["params"].append(q)  # its state is made by the next step
p.grad, q.grad = torch.ones(4), torch.ones(4)
before = {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
warnings.simplefilter("error")
try:
    opt.step()
    print("not refused")
except RuntimeWarning:
    same = all(torch.equal(opt.state[p][k], v) for k, v in before.items())
    print("refused", torch.equal(p, torch.ones(4)), same, q not in opt.state,
          opt.param_groups[0]["step"])
opt.step()  # said once: the next step steps
print("stepped", not torch.equal(p, torch.ones(4)), opt.param_groups[0]["step"])
"""


def test_the_warning_comes_before_the_step_changes_anything(tmp_path):
    """Turned into an error, it leaves parameters, state and count as they were."""
    _copy_without_core(tmp_path)
    result = _run(tmp_path, WARNING_AS_ERROR)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["refused", "True", "True", "True", "0",
                                     "stepped", "True", "1"], result.stdout


def test_a_core_that_cannot_load_is_named(tmp_path):
    target = _copy_without_core(tmp_path)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (target / f"_C{suffix}").write_bytes(b"not a shared object")
    result = _run(tmp_path, STEP.replace('warnings.simplefilter("error")', ""))
    assert result.returncode == 0, result.stderr
    assert "RuntimeWarning: shardadam._C could not be loaded" in result.stderr, result.stderr
    assert "circular import" not in result.stderr
    assert "warned:" not in result.stdout, result.stdout  # said at import, not again
    info = _run(tmp_path, INFO)
    assert "C++ core:       built, but it does not load" in info.stdout, (info.stdout,
                                                                          info.stderr)


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
    assert result.stdout.splitlines()[-2:] == ["stepped", expected], result.stdout
