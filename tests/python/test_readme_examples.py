"""The README's Python examples, run as written: the FSDP2 example and the DCP save, load
and async-save recipes under ``torchrun`` on 2 gloo ranks, the single-process example
that saves a state dict, and the FSDP2 recipe whose model is the reader's (given one
here). A README edit that breaks one fails here; one that renames or drops an example
fails the lookup, naming it.

Megatron's recipes (``fsdp_unit_modules=[...]`` and Megatron Core's shim) are fragments
of a Megatron setup; their behaviour is tested in ``distributed/test_dist_megatron.py``
and ``test_megatron_core.py``.
"""

import os
import subprocess
import sys

import pytest
import torch

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")

pytestmark = pytest.mark.skipif(not os.path.exists(README), reason="no README beside the tests")


def _python_blocks() -> list:
    with open(README, encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, block = [], None
    for line in lines:
        if block is None and line.strip() == "```python":
            block = []
        elif block is not None and line.strip() == "```":
            blocks.append("\n".join(block) + "\n")
            block = None
        elif block is not None:
            block.append(line)
    return blocks


def _block(marker: str) -> str:
    """The README's Python block holding ``marker`` (exactly one)."""
    found = [b for b in _python_blocks() if marker in b]
    assert len(found) == 1, f"README: {len(found)} Python blocks hold {marker!r}"
    return found[0]


EXAMPLE = "fully_shard(model, mesh=mesh)            # the parameters are now DTensor shards"
DCP = 'dcp.load(state, checkpoint_id="ckpt/step-1000")'
ASYNC = "future = dcp.async_save("
SINGLE = 'torch.save(opt.state_dict(), "opt.pt")'
YOUR_MODEL = "for block in model.blocks:"

# Around the DCP recipe (which saves, then, after the line that says "later", loads):
# one more step between the two, which the load undoes: the state it loads is the state
# it saved (copies: remainders are exported as the stored tensors); after the async-save
# recipe, its checkpoint is complete.
_DCP_LATER = "# later, on any number of ranks"
_BEFORE_DCP = """
import os
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

def local_copies():
    # each rank its own shards (gloo gathers no int16 remainders, README)
    exported = get_optimizer_state_dict(model, opt)
    return ({key: {name: value.to_local().clone() for name, value in entry.items()}
             for key, entry in exported["state"].items()},
            [group["step"] for group in exported["param_groups"]])

before = local_copies()
"""
_BETWEEN_DCP = """
for p in model.parameters():
    p.grad = torch.ones_like(p)
opt.step()
opt.zero_grad()
assert local_copies()[1] != before[1]
"""
_AFTER_DCP = """
after = local_copies()
assert after[1] == before[1], (after[1], before[1])
assert before[0].keys() == after[0].keys()
for key, entry in before[0].items():
    for name, value in entry.items():
        assert torch.equal(value, after[0][key][name]), name
print(f"rank {dist.get_rank()}: example stepped {opt.param_groups[0]['step']} times, "
      f"checkpoint loaded back", flush=True)
"""
_AFTER_ASYNC = """
dist.barrier()
assert os.path.exists("ckpt/step-1000/.metadata")
"""

# The reader's model for the recipe that shards "your model's repeated layers".
_YOUR_MODEL = """
import torch
model = torch.nn.Module()
model.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
"""
_STEP_YOUR_MODEL = """
import torch.distributed as dist
x = torch.randn(4, 64)
for block in model.blocks:
    x = block(x)
x.square().mean().backward()
opt.step()
print(f"rank {dist.get_rank()}: your model stepped", flush=True)
dist.destroy_process_group()
# Ended without the interpreter's teardown, as test_cpu_offload's ranks are: torch
# 2.15's gloo thread can release a finished collective while Python finalizes and
# abort the rank (std::terminate), after all of the above has run.
import os, sys
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def _run(args: list, cwd, timeout: int = 240) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_the_fsdp2_example_and_the_checkpoint_recipes_run_under_torchrun(tmp_path):
    save, later = _block(DCP).split(_DCP_LATER)
    script = "\n".join([_block(EXAMPLE), _BEFORE_DCP, save, _BETWEEN_DCP, _DCP_LATER + later,
                        _AFTER_DCP,
                        _block(ASYNC), _AFTER_ASYNC, _YOUR_MODEL, _block(YOUR_MODEL),
                        _STEP_YOUR_MODEL])
    (tmp_path / "train.py").write_text(script)
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "train.py"], tmp_path)
    for rank in range(2):
        assert f"rank {rank}: example stepped 10 times, checkpoint loaded back" in out
        assert f"rank {rank}: your model stepped" in out


def test_the_single_process_example_saves_fp32_values_and_int16_remainders(tmp_path):
    (tmp_path / "example.py").write_text(_block(SINGLE))
    _run([sys.executable, "example.py"], tmp_path)
    saved = torch.load(tmp_path / "opt.pt")
    assert len(saved["state"]) == 4  # two weights, two biases
    for entry in saved["state"].values():
        assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.float32
        assert entry["master_param"].dtype == torch.int16  # the remainder (S2.5)
    assert saved["param_groups"][0]["step"] == 1
