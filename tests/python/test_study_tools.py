"""The study tools under tools/ keep working: their self-checks run here, since the
README's accuracy figures and S2.12/S2.13's map choices cite them."""

import os
import subprocess
import sys

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")


def test_shrinking_gradient_study_runs():
    """The README's long-run figures at beta2 = 0.999 come from this tool: one line
    per optimizer, the mean squared error after every 1,000 steps."""
    done = subprocess.run([sys.executable, os.path.join(TOOLS, "shrinking_gradient_study.py"),
                           "--steps", "2000", "adamw", "block8"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["adamw", "block8"]
    for line in lines:
        errors = [float(x) for x in line.split()[1:3]]
        assert 0.0 < errors[1] < errors[0], line  # two figures, the error falling


def test_state_map_study_self_checks_pass():
    """Codecs against their tables, re-encoding, the counter hash, and stochastic
    rounding unbiased where it rounds stochastically (the @srt maps, as block4, round
    to nearest from T / 2 up)."""
    done = subprocess.run([sys.executable, os.path.join(TOOLS, "state_map_study.py"),
                           "--check"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "unbiased within the bounds" in done.stdout
