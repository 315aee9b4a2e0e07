"""Megatron Core (``megatron-core``) builds its optimizer with shardadam.FusedAdam as its
Adam, by the README's recipe, and trains on a CPU rank (docs/semantics.md S6.5).

The work is in ``_megatron_core_run.py``, its own process (the recipe and the CPU
stand-ins change module-level state): every step of the optimizer Megatron built is
checked there against the float64 Adam reference; this test checks what it reports.
Megatron Core comes from ``$VENV/megatron-core`` (``make setup``; why apart:
requirements-megatron-core.txt).
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


MEGATRON_CORE = os.path.join(sys.prefix, "megatron-core")


def test_get_megatron_optimizer_builds_and_steps_fused_adam():
    assert os.path.isdir(os.path.join(MEGATRON_CORE, "megatron", "core")), \
        f"megatron-core is not installed in {MEGATRON_CORE}: run make setup"
    path = os.pathsep.join(filter(None, [MEGATRON_CORE, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=path)
    done = subprocess.run([sys.executable, os.path.join(HERE, "_megatron_core_run.py")],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # Megatron's precision-aware options reached the constructor (S1.1 names) ...
    assert report["config"] == "exp_avg=bf16 exp_avg_sq=bf16 master=remainder", report
    assert report["decoupled"], report
    assert report["state_dtypes"] == {"exp_avg": "torch.bfloat16",
                                      "exp_avg_sq": "torch.bfloat16",
                                      "master_param": "torch.int16"}, report
    # ... and every step of Megatron's went through it, checked, and trained.
    assert report["inner_steps"] == 3 and report["moved"], report
    losses = report["losses"]
    assert losses[-1] < losses[0], losses
