"""The README's first set-up command, `./dev demo`, as a user runs it: its last line is the proof."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.long
def test_the_demo_preempts_relaunches_and_matches_the_uninterrupted_run(tmp_path):
    env = dict(os.environ, TOKSTREAM_DEMO_DIR=str(tmp_path / "demo"), PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, str(ROOT / "scripts/demo.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.rstrip().splitlines()[-1] == ("RESUMED RUN MATCHED: 30/30 steps consumed the same samples on "
                                                     "both ranks with bitwise-equal losses")
    assert "resumed from " in done.stdout and "preempted (signal 15)" in done.stdout
    assert (tmp_path / "demo" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
