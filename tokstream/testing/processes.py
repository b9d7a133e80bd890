"""Process trees as a cluster kills them, for tests and benches."""

import os
import signal
import time
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


def rank_pids(run_dir) -> list[tuple[int, int]]:
    """The ranks of a run on this machine, each as (pid, start time): the train/main.py processes training into
    `run_dir`, started by srun, torchrun or python (not their forks: DataLoader workers have the same command)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or ended
            continue
        if any(arg.endswith(b"train/main.py") for arg in argv[1:3]) and f"run_dir={run_dir}".encode() in argv:
            found.add(int(entry.name))
    parents = _parents()
    return identified(sorted(pid for pid in found if parents.get(pid) not in found))


def identified(pids) -> list[tuple[int, int]]:
    """Each of these processes still running as (pid, start time): a pid taken again later is told apart."""
    from tokstream.reader.stale_shm import _start_time

    found = [(pid, _start_time(pid)) for pid in pids]
    return [(pid, start) for pid, start in found if start is not None]


def running(rank: tuple[int, int]) -> bool:
    """Whether that process (not another that took its pid) is still there, not a zombie."""
    from tokstream.reader.stale_shm import _start_time

    return _start_time(rank[0]) == rank[1]


def _wait(condition, timeout: float, what: str, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(every)


def notice_when(find_ranks, ready, send, signum: int, ranks: int = 2) -> None:
    """`send()` a notice (or a kill), signal `signum`, once `ready()`, the run's `ranks` ranks (`find_ranks()`: each
    as (pid, start time)) held (SIGSTOP) from their start and let go 5 ms at a time until then: steps take
    milliseconds, so a notice sent as the run goes lands steps later, on a loaded machine (or a fast one) after the
    run's last. They go on once `signum` is pending in each (or it has ended, or Slurm has let it go on: its SIGCONT
    comes with the signal)."""
    _wait(lambda: len(find_ranks()) == ranks, 240, f"the run's {ranks} ranks did not start")
    held = find_ranks()

    def hold(how: int) -> None:
        for rank in held:
            if running(rank):
                try:
                    os.kill(rank[0], how)
                except ProcessLookupError:  # ended meanwhile
                    pass

    def stop() -> None:  # and wait until each is stopped: one still running would take the signal sent next itself
        hold(signal.SIGSTOP)
        _wait(lambda: all(stopped(rank[0]) or not running(rank) for rank in held), 30, "the ranks did not stop",
              every=0.001)

    def noticed(rank: tuple[int, int]) -> bool:
        return (not running(rank) or signal_state(rank[0], signum) in ("pending", "held", None)
                or not stopped(rank[0]))

    deadline = time.monotonic() + 240  # well inside pytest's timeout, whose exit would skip the `finally`
    stop()
    try:
        while not ready():
            assert all(running(rank) for rank in held), "a rank ended before the notice"
            assert time.monotonic() < deadline, "the ranks did not get to the notice's step"
            hold(signal.SIGCONT)
            time.sleep(0.005)
            stop()
        send()
        _wait(lambda: all(noticed(rank) for rank in held), 60, "the ranks did not get the notice")
    finally:
        hold(signal.SIGCONT)
