"""A rank's exit without the interpreter's teardown (tokstream/train/process_exit.py) is otherwise a normal exit.
(The run's own files are closed, or flushed and fsynced, before it: what a SIGKILL at any moment may not lose.)"""

import subprocess
import sys

from conftest import ROOT

SCRIPT = r"""
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tokstream.train.process_exit import exit_without_teardown

out = Path(sys.argv[1])
idle = ThreadPoolExecutor(2)  # its workers wait for work: a plain join of them would never end
idle.submit(lambda: None).result()
late = threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done")))
late.start()
atexit.register(lambda: (out / "atexit").write_text(str((out / "thread").exists())))
sys.stdout.write("no newline yet")  # stdout is a pipe: block-buffered until flushed
sys.stderr.write("and stderr")
exit_without_teardown(75)
"""


def test_the_exit_keeps_its_status_waits_for_threads_runs_atexit_handlers_and_flushes_the_standard_streams(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 75, done.stderr
    assert (done.stdout, done.stderr) == ("no newline yet", "and stderr")
    assert (tmp_path / "thread").read_text() == "done"  # the non-daemon thread finished first
    assert (tmp_path / "atexit").read_text() == "True"  # and then the handlers ran, as at a normal exit
