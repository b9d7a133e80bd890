"""A rank's start-up (tokstream/train/process_start.py): no collection while it imports, what the imports made
frozen out of the garbage collector's way, the collector running by itself after them, and nothing left frozen for
the interpreter's teardown (a rank that ends with an error exits through it)."""

import subprocess
import sys

from conftest import ROOT

SCRIPT = r"""
import atexit, gc
atexit.register(lambda: print("frozen at the teardown:", gc.get_freeze_count()))  # runs last: registered first
from tokstream.train.process_start import start_up_frozen

collections = []
gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
with start_up_frozen():
    import torch._dynamo  # what every rank imports
    during = len(collections)
print("collections during the imports:", during)
print("frozen:", gc.get_freeze_count())
cycles = []
for _ in range(20_000):  # allocations: the collector starts by itself every 700 or so
    cycle = []
    cycle.append(cycle)
    cycles.append(cycle)
print("collections after:", len(collections) - during)
"""


def test_a_ranks_imports_are_not_collected_then_frozen_the_collector_runs_after_and_the_teardown_finds_none():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    during, frozen, after, at_exit = done.stdout.splitlines()
    assert during == "collections during the imports: 0"
    assert int(frozen.split()[1]) > 100_000  # torch's objects
    assert int(after.split()[2]) > 0  # the automatic collector is on again
    assert at_exit == "frozen at the teardown: 0"
    assert done.stderr == ""  # torch 2.15's triton bindings report as leaked objects left frozen at the teardown
