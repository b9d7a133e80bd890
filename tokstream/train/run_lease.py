"""One live job per run: the job's rank 0 holds `LEASE` in the run's store and rewrites it every
`lease_interval_s`, counting beats.

A launch that finds a lease:
- whose holder ran on this machine (same host, boot and PID namespace): takes it at once if that
  process is gone, refuses at once if it runs;
- otherwise takes it only once its beat has not moved for STALE_BEATS of its holder's intervals
  (bounded: INTERVAL_BOUNDS_S). The launch watches the count rather than comparing times: the nodes'
  clocks may disagree. A lease that moves belongs to a live job: the launch refuses in one line
  naming it. A job paused longer than that (SIGSTOP) looks dead, and is taken over. The holder rereads
the lease before each beat; if another job has taken it over (two launches at once: the last writer
wins), the holder exits at once, writing nothing more. An orderly exit removes the lease.
"""

import atexit
import json
import os
import socket
import sys
import threading
import time
import uuid

from tokstream.errors import StoreError, UserError
from tokstream.train.run_store import RunStore

LEASE = "LEASE"
STALE_BEATS = 3
LOST_LEASE_STATUS = 3
INTERVAL_BOUNDS_S = (0.1, 120.0)  # a lease is renewed at most 10 times a second, and goes stale within 6 minutes


def _read_first_line(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.readline().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (a PID reused later has another); "" when
    there is no such process, or only its zombie (an init that does not reap would keep it for ever)."""
    fields = _read_first_line(f"/proc/{pid}/stat").rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else ""


def _this_process() -> dict:
    try:
        pid_namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_namespace = ""
    return {"host": socket.gethostname(), "boot_id": _read_first_line("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": pid_namespace, "pid": os.getpid(), "started": _start_time(os.getpid())}


def _on_this_machine(holder: dict) -> bool:
    here = _this_process()
    return all(holder.get(key) == here[key] and here[key] for key in ("host", "boot_id", "pid_namespace"))


def _alive(holder: dict) -> bool:
    """Its process still exists (on this machine), with the start time it recorded: not a reused PID."""
    pid = holder.get("pid")
    return isinstance(pid, int) and pid > 0 and _start_time(pid) == holder.get("started")


def _patience_s(holder: dict, own_interval_s: float) -> float:
    """How long a lease must stand still to be stale: 3 of its holder's beats, within the bounds any
    holder's interval has (a garbage value cannot make a launch wait for ever)."""
    interval = holder.get("interval_s")
    if not isinstance(interval, (int, float)) or isinstance(interval, bool):
        interval = own_interval_s
    return STALE_BEATS * min(max(float(interval), INTERVAL_BOUNDS_S[0]), INTERVAL_BOUNDS_S[1])


def describe(holder: dict) -> str:
    return f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, since {holder.get('since', '?')}"


class RunLease:
    """The lease held by this job; `acquire` takes it, a daemon thread keeps it alive."""

    def __init__(self, store: RunStore, interval_s: float):
        low, high = INTERVAL_BOUNDS_S
        if not low <= interval_s <= high:
            raise UserError(f"lease_interval_s={interval_s:g} is outside {low:g}..{high:g} seconds: the run's lease is "
                            "renewed that often, and a relaunch after a lost node waits 3 intervals")
        self.store, self.interval_s = store, interval_s
        self.record = {**_this_process(), "token": uuid.uuid4().hex, "beat": 0, "interval_s": interval_s,
                       "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, store: RunStore, interval_s: float) -> "RunLease":
        """Take the run's lease, waiting for a stale one to prove itself stale; UserError if a live job holds it."""
        lease = cls(store, interval_s)
        found = lease._read()
        if found is not None and _on_this_machine(found):
            if _alive(found):
                raise lease._in_use(found, "its process is running on this machine")
        elif found is not None:
            lease._wait_until_stale(found)
        if lease._read() != found:
            raise lease._in_use(lease._read() or found, "another launch took it meanwhile")
        lease._write()
        lease._thread = threading.Thread(target=lease._keep_alive, name="run-lease", daemon=True)
        lease._thread.start()
        atexit.register(lease.release)
        return lease

    def _read(self) -> dict | None:
        data = self.store.read_bytes(LEASE)
        if data is None:
            return None
        try:
            found = json.loads(data)
        except ValueError:
            found = None
        # Not a lease this project wrote: whoever wrote it, only its bytes moving would show a live job.
        return found if isinstance(found, dict) else {"unreadable": data[:40].decode(errors="replace")}

    def _write(self) -> None:
        self.store.publish_bytes(LEASE, json.dumps(self.record).encode())

    def _wait_until_stale(self, found: dict) -> None:
        patience = _patience_s(found, self.interval_s)
        print(f"{self.store.url} has a lease ({describe(found)}): waiting up to {patience:.0f} s to see whether "
              "that job is still alive", flush=True)
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            time.sleep(min(1.0, patience / 10))
            now = self._read()
            if now is not None and now != found:
                raise self._in_use(now, f"its lease moved within {patience:.0f} s")

    def _in_use(self, holder: dict, evidence: str) -> UserError:
        return UserError(f"{self.store.url} is in use by a live job ({describe(holder)}; {evidence}): stop that "
                         "job first, or point run_dir elsewhere")

    def _keep_alive(self) -> None:
        failing = False  # said once, not at every beat of a long outage
        while not self._stop.wait(self.interval_s):
            try:
                now = self._read()
                if now is not None and now.get("token") != self.record["token"]:
                    print(f"error: another job took over {self.store.url} ({describe(now)}): this job stops "
                          "without writing anything more", file=sys.stderr, flush=True)
                    os._exit(LOST_LEASE_STATUS)
                self.record["beat"] += 1
                self._write()
                failing = False
            except (OSError, StoreError) as err:  # a full disk or a store hiccup: the next beat tries again
                if not failing:
                    print(f"warning: cannot renew the lease in {self.store.url} ({err}); trying again every "
                          f"{self.interval_s:g} s, and after {STALE_BEATS} missed beats another launch may take "
                          "the run over", file=sys.stderr, flush=True)
                failing = True

    def release(self) -> None:
        """Stop beating and remove the lease, if it is still this job's (once: also registered to run at exit)."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self.release)
        if self._thread is not None:
            self._thread.join()
        try:
            now = self._read()
            if now is not None and now.get("token") == self.record["token"]:
                self.store.remove([LEASE])
        except (OSError, StoreError):
            pass  # the lease goes stale by itself
