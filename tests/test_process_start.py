"""A rank's start-up (tokstream/train/process_start.py): what its imports made is frozen out of the garbage
collector's way, the collector runs as usual after them, and at exit nothing is left frozen for the teardown."""

import subprocess
import sys

from conftest import ROOT

SCRIPT = r"""
import atexit, gc
atexit.register(lambda: print("frozen at the teardown:", gc.get_freeze_count()))  # runs last: registered first
from tokstream.train.process_start import start_up_frozen

with start_up_frozen():
    import torch._dynamo  # what every rank imports
print("frozen:", gc.get_freeze_count(), "enabled:", gc.isenabled())
cycle = []
cycle.append(cycle)
del cycle
print("collected:", gc.collect())
"""


def test_a_ranks_imports_are_frozen_the_collector_runs_after_them_and_the_teardown_finds_nothing_frozen():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    frozen, collected, at_exit = done.stdout.splitlines()
    assert int(frozen.split()[1]) > 100_000 and frozen.endswith("enabled: True")  # torch's objects, and it runs
    assert int(collected.split()[1]) >= 1  # the cycle made after the start-up
    assert at_exit == "frozen at the teardown: 0"
    assert done.stderr == ""  # torch 2.15's triton bindings report as leaked objects left frozen at the teardown
