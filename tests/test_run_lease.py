"""The run lease's rules (tokstream/train/run_lease.py), in one process: who may take a lease, how long
a launch waits, what a lease this project did not write does. Through torchrun: test_nothing_lost.py."""

import json
import os
import subprocess
import time

import pytest

from tokstream.errors import UserError
from tokstream.train.run_lease import LEASE, RunLease, _patience_s, _this_process
from tokstream.train.run_store import LocalRunStore


def lease_of(process: dict, **fields) -> bytes:
    return json.dumps({**process, "token": "someone", "beat": 7, "interval_s": 0.1, "since": "then", **fields}).encode()


def take(tmp_path) -> tuple[RunLease, float]:
    began = time.monotonic()
    lease = RunLease.acquire(LocalRunStore(tmp_path), 0.1)
    return lease, time.monotonic() - began


def test_a_lease_of_a_live_process_on_this_machine_is_refused_at_once(tmp_path):
    (tmp_path / LEASE).write_bytes(lease_of(_this_process()))  # this very process holds it
    began = time.monotonic()
    with pytest.raises(UserError, match=rf"^{tmp_path} is in use by a live job \(host .*, PID {os.getpid()}, since "
                                        r"then; its process is running on this machine\): stop that job first"):
        RunLease.acquire(LocalRunStore(tmp_path), 0.1)
    assert time.monotonic() - began < 1


@pytest.mark.parametrize("ended", ["reaped", "zombie"])
def test_a_lease_whose_holder_is_gone_from_this_machine_is_taken_at_once(tmp_path, ended):
    """A zombie is gone too: an init that does not reap would otherwise keep the run locked for ever."""
    child = subprocess.Popen(["sleep", "0"])
    holder = {**_this_process(), "pid": child.pid}
    holder["started"] = open(f"/proc/{child.pid}/stat").read().rpartition(")")[2].split()[19]
    if ended == "reaped":
        child.wait()
    else:
        while open(f"/proc/{child.pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
            time.sleep(0.01)
    (tmp_path / LEASE).write_bytes(lease_of(holder, interval_s=100))
    lease, took = take(tmp_path)
    assert took < 1 and json.loads((tmp_path / LEASE).read_bytes())["token"] == lease.record["token"]
    lease.release()
    assert not (tmp_path / LEASE).exists()
    child.wait()


@pytest.mark.parametrize("content", [b"[1]", b"\x00garbage", b'{"interval_s": "abc", "host": "elsewhere"}',
                                     b'{"interval_s": null, "pid": "x"}'])
def test_a_lease_this_project_did_not_write_is_waited_out_not_a_traceback(tmp_path, content, capsys):
    (tmp_path / LEASE).write_bytes(content)
    lease, took = take(tmp_path)
    assert 0.3 <= took < 3  # 3 beats of this launch's own interval: nothing in it says another
    assert "waiting up to 0 s to see whether that job is still alive" in capsys.readouterr().out
    lease.release()


def test_a_lease_that_moves_is_a_live_job_on_another_machine(tmp_path):
    other = {**_this_process(), "host": "another-node"}
    (tmp_path / LEASE).write_bytes(lease_of(other, interval_s=0.5))
    beating = subprocess.Popen(["sh", "-c", f"sleep 0.5; echo '{{\"host\": \"another-node\", \"beat\": 8}}' "
                                            f"> {tmp_path / LEASE}"])
    with pytest.raises(UserError, match=r"in use by a live job \(host another-node, .*its lease moved within 2 s\)"):
        RunLease.acquire(LocalRunStore(tmp_path), 0.1)
    beating.wait()


def test_the_wait_and_the_interval_are_bounded(tmp_path):
    assert _patience_s({"interval_s": 1e9}, 10) == 360  # a garbage interval cannot make a launch wait for ever
    assert _patience_s({"interval_s": True}, 10) == 30
    for interval in (0, -1, 1000):
        with pytest.raises(UserError, match=rf"lease_interval_s={interval:g} is outside 0.1..120 seconds"):
            RunLease.acquire(LocalRunStore(tmp_path), interval)
    assert not (tmp_path / LEASE).exists()


def test_a_lease_of_another_machine_that_stops_moving_is_taken_after_three_of_its_beats(tmp_path):
    """A node lost with its job: the relaunch waits 3 x the holder's own interval (0.3 s here), then takes it."""
    (tmp_path / LEASE).write_bytes(lease_of({**_this_process(), "host": "lost-node"}, interval_s=0.1))
    lease, took = take(tmp_path)
    assert 0.3 <= took < 3 and lease.record["host"] != "lost-node"
    lease.release()


HOLD = """
import sys, time
from tokstream.train.run_lease import RunLease
from tokstream.train.run_store import LocalRunStore
lease = RunLease.acquire(LocalRunStore(sys.argv[1]), float(sys.argv[2]))
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def test_a_live_holders_lease_moves_so_a_launch_from_another_host_refuses_it(tmp_path):
    """Two real holders on two hostnames (the second in a UTS namespace of its own, named other-node): the live one
    beats, its lease moves, and the launch from the other host refuses in one line instead of taking over a live job.
    A holder whose beat stood still would lose its run after three intervals."""
    import sys

    from conftest import ROOT

    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
        pytest.skip("no UTS namespace here: cannot give a second process another hostname")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), "1.0", "60"], stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert holder.stdout.readline() == "held\n"
        held = json.loads((tmp_path / LEASE).read_text())
        command = [sys.executable, "-c", HOLD, str(tmp_path), "1.0", "0"]
        launch = subprocess.run(["unshare", "--uts", "sh", "-c", 'hostname other-node && exec "$@"', "sh", *command],
                                capture_output=True, text=True, env=env, timeout=60)
        assert launch.returncode == 1 and "held" not in launch.stdout
        assert (f"is in use by a live job (host {held['host']}, PID {holder.pid}, since {held['since']}; its lease "
                "moved within 3 s): stop that job first, or point run_dir elsewhere") in launch.stderr
        assert holder.poll() is None and json.loads((tmp_path / LEASE).read_text())["token"] == held["token"]
    finally:
        holder.kill()
        holder.wait()
