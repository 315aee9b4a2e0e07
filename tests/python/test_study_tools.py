"""The study tools under tools/ keep working: their self-checks run here, since the
README's accuracy figures and S2.12/S2.13's map choices cite them."""

import os
import subprocess
import sys

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools")


def test_state_map_study_self_checks_pass():
    """Codecs against their tables, re-encoding, the counter hash, and stochastic
    rounding unbiased where it rounds stochastically (the @srt maps, as block4, round
    to nearest from T / 2 up)."""
    done = subprocess.run([sys.executable, os.path.join(TOOLS, "state_map_study.py"),
                           "--check"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "unbiased within the bounds" in done.stdout
