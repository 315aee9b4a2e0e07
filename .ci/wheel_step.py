"""Run by .ci/wheel inside the fresh venv the wheel was installed into: shardadam
and its extension come from that venv, the extension is the one stepping (not the
torch fallback), no libhwy is loaded, and one FusedAdam step on a small fp32 model
matches torch.optim.AdamW."""

import os
import sys

import torch

import shardadam
import shardadam._C
from shardadam import _cpu_path

venv = os.path.realpath(sys.prefix)
for module in (shardadam, shardadam._C):
    where = os.path.realpath(module.__file__)
    assert where.startswith(venv + os.sep), f"{module.__name__} from {where}, not {venv}"
# Without the extension the optimizer would quietly step with torch ops.
assert _cpu_path.available(), "shardadam._C imported but the C++ path is unavailable"

torch.manual_seed(0)
ours_model = torch.nn.Sequential(
    torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
theirs_model = torch.nn.Sequential(
    torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
theirs_model.load_state_dict(ours_model.state_dict())
x, y = torch.randn(64, 16), torch.randn(64, 4)
for model in (ours_model, theirs_model):
    torch.nn.functional.mse_loss(model(x), y).backward()

options = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
ours = shardadam.FusedAdam(ours_model.parameters(), **options)
theirs = torch.optim.AdamW(theirs_model.parameters(), **options)
ours.step()
theirs.step()

# One step from zero moments, the same fp32 inputs: the two differ by rounding
# only, a few fp32 ulps (SEMANTICS S3.7); a wrong formula is off by ~lr.
for (name, p), q in zip(ours_model.named_parameters(), theirs_model.parameters()):
    torch.testing.assert_close(p.detach(), q.detach(), rtol=5e-7, atol=1e-9,
                               msg=lambda m: f"{name}: {m}")
    for state in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours.get_unscaled_state(p, state).float(),
                                   theirs.state[q][state], rtol=5e-7, atol=0,
                                   msg=lambda m: f"{name} {state}: {m}")

with open("/proc/self/maps") as maps:
    loaded = sorted({line.split()[-1] for line in maps if "libhwy" in line})
assert not loaded, f"libhwy loaded: {loaded}"
print(f"wheel OK: shardadam {shardadam.__version__} from {os.path.dirname(shardadam.__file__)},"
      f" torch {torch.__version__}, one FusedAdam step == AdamW, no libhwy in the process")
