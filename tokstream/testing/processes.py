"""Process trees as a cluster kills them, for tests and benches."""

import os
import signal
from pathlib import Path


def _parents() -> dict[int, int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    return parents


def worker_pids(launcher_pid: int) -> list[int]:
    """The rank processes torchrun started (its direct children), oldest first."""
    return sorted(pid for pid, parent in _parents().items() if parent == launcher_pid)


def descendants(root: int) -> list[int]:
    """Every process under `root`, children before grandchildren."""
    parents = _parents()
    tree, frontier = [], [root]
    while frontier:
        frontier = sorted(pid for pid, parent in parents.items() if parent in frontier)
        tree += frontier
    return tree


def kill_tree(*roots: int) -> None:
    """SIGKILL processes and all their descendants at once, as node loss or a cgroup kill does.

    torchrun starts each rank in its own session, so killing torchrun's process group would
    leave the ranks running; and each rank's multiprocessing resource tracker would unlink the
    rank's shared memory if it outlived the rank. Everything is stopped first, so nothing reacts.
    """
    tree = [pid for root in roots for pid in (root, *descendants(root))]
    for signum in (signal.SIGSTOP, signal.SIGKILL):
        for pid in tree:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def signal_state(pid: int, signum: int) -> str | None:
    """How `signum` stands in a process, from /proc/PID/status: "held" (sent and blocked: pending for as long as it
    blocks it), "pending" (sent, not yet taken: the process stopped, or about to run), "ignored", "blocked" (not
    sent), or "open"; None if the process has ended (gone, or a zombie)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    if status["State"].startswith(("Z", "X")):
        return None
    bit = 1 << (signum - 1)
    pending, blocked = (int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)) & bit, int(status["SigBlk"], 16) & bit
    if int(status["SigIgn"], 16) & bit:
        return "ignored"
    if pending:
        return "held" if blocked else "pending"
    return "blocked" if blocked else "open"


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, or a tracer)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False
