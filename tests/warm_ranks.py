"""train/main.py's ranks forked from a warm process, for the training tests that are not about torchrun.

A torchrun launch of the tiny config on 2 CPU ranks spends most of its CPU on imports before its first step:
torch in the agent and in each rank (about 4 s each on the 2-core test machine), torch._dynamo in each rank (about
3 s more: every torch.optim optimizer imports it). Here multiprocessing's forkserver imports all of it once per test
process (`tests/warm_rank_preload.py`, its preload; tests/conftest.py starts it before anything else can), and each
rank is a fork of that server: a real process, with the variables torchrun gives a rank, running train/main.py as
`__main__`, with the stdout and stderr of every rank merged in one stream, as torchrun's agent has them. A signal
sent to the launch goes to every rank, as torchrun's agent forwards it; a kill takes every rank's tree.

Not here is torchrun's agent: it restarts nothing, hosts no store, and a rank does not watch it. The tests of
those, of the agent's own forwarding and death, launch torchrun.

`WarmPython` forks any `python -c` or `python -m` from the same server: torchrun's agent (tests/test_training.py's
`launch`: torchrun's own code, whose ranks are new interpreters as torchrun starts them; the demo, the DDP example,
the full disk, several nodes and Slurm run torchrun's command line), and a test's own processes (a rank of a reader
test: about 2.5 CPU s of imports each) where the test is about what they do together, not how one starts or exits."""

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from multiprocessing import reduction
from pathlib import Path

from tokstream.train.cpu_dispatch import VARIABLE as NUMPY_CHOICE
from tokstream.train.process_exit import exit_without_teardown

PRELOAD = "warm_rank_preload"
TESTS = Path(__file__).resolve().parent
TRAINER = TESTS.parent / "train" / "main.py"


def start_warm_server() -> None:
    """Start multiprocessing's forkserver now, importing what a rank imports (`PRELOAD`), before anything else
    in this process starts it without. Its preload is imported by name, and the server of Python 3.11-3.13
    ignores the sys.path it is handed: the tests' folder reaches it through PYTHONPATH, for its start alone."""
    multiprocessing.set_forkserver_preload([PRELOAD])
    given = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), given]))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if given is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = given


class WarmLaunch:
    """`script *argv` (train/main.py unless said) forked from the warm server, as a Popen of torchrun has it:
    `stdout` (every rank's stdout and stderr, merged), `poll`, `wait`, `communicate` and `returncode` (0 when every
    rank exited 0, else the first failed rank's status), `send_signal` (to every rank, as torchrun's agent forwards
    it) and `kill_tree` (a node lost). `ranks`: that many ranks with torchrun's variables on one node; None: one
    process without them, as `python train/main.py`. No `pid`: a signal to one rank is not a signal to the launch."""

    def __init__(self, ranks: int | None, argv: list[str], env: dict, cwd: Path, script: Path = TRAINER):
        self.args = ["warm", str(script), *map(str, argv)]
        reader, writer = os.pipe()  # a pipe, as Popen's: a socket holds far fewer of a rank's small writes
        port = _free_port()
        context = multiprocessing.get_context("forkserver")
        self.processes = []
        for rank in range(ranks or 1):
            rank_env = dict(env)
            if ranks is not None:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                                WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks), ROLE_WORLD_SIZE=str(ranks),
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            process = context.Process(target=_rank, args=(rank_env, self.args[1:], str(cwd), _ForChild(writer)),
                                      name=f"rank {rank}")
            _start(process)
            self.processes.append(process)
        os.close(writer)
        self.stdout = open(reader, "r", encoding="utf-8", errors="replace")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and all(process.exitcode is not None for process in self.processes):
            failed = [process.exitcode for process in self.processes if process.exitcode != 0]
            self.returncode = failed[0] if failed else 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        for process in self.processes:
            process.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """All of the output, once every rank has ended (killed after `timeout`)."""
        output: list[str] = []
        reading = threading.Thread(target=lambda: output.append(self.stdout.read()), daemon=True)
        reading.start()
        try:
            reading.join(timeout)
            self.wait(0 if reading.is_alive() else timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return output[0], None

    def send_signal(self, signum: int) -> None:
        """`signum` to every rank still running: what torchrun's agent does with the SIGTERM it is sent (that it
        does is tested through torchrun itself: test_interruptions.py's "SIGTERM to torchrun", test_nothing_lost.py,
        the demo)."""
        for process in self.processes:
            if process.exitcode is None:
                try:
                    os.kill(process.pid, signum)
                except ProcessLookupError:  # ended, not yet reaped by the server: its status says how
                    pass

    def kill_tree(self) -> None:
        """Every rank and every process it started, stopped then SIGKILLed at once: a node lost."""
        from tokstream.testing.processes import kill_tree

        kill_tree(*(process.pid for process in self.processes if process.exitcode is None))

    def kill(self) -> None:
        """Every rank still running, killed (a test that failed or timed out leaves none behind)."""
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
        for process in self.processes:
            process.join()
        self.poll()


def run_warm(script: Path | str, *args, cwd: Path, env: dict | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    """`python script *args` forked from the warm server, as `subprocess.run(capture_output=True, text=True)` has it,
    for a CLI whose process start is not what the test tests (the ledger, vouch.py, build_orders.py import torch:
    seconds a call, here imported once)."""
    command = [str(Path(cwd, script)), *map(str, args)]
    pipes = [os.pipe() for _ in ("stdout", "stderr")]
    process = multiprocessing.get_context("forkserver").Process(
        target=_rank, args=(dict(os.environ if env is None else env), command, str(cwd), _ForChild(pipes[0][1]),
                            _ForChild(pipes[1][1])))
    _start(process)
    said: list[list[str]] = [[], []]
    readers = [threading.Thread(target=_read_all, args=(open(reader, "r", encoding="utf-8", errors="replace"), parts),
                                daemon=True) for (reader, _), parts in zip(pipes, said)]
    for (_, writer), thread in zip(pipes, readers):
        os.close(writer)
        thread.start()
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise subprocess.TimeoutExpired(command, timeout)
    deadline = time.monotonic() + timeout
    for thread in readers:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():  # something the process started still holds its output open
            raise subprocess.TimeoutExpired(command, timeout)
    return subprocess.CompletedProcess(command, process.exitcode, "".join(said[0]), "".join(said[1]))


class WarmPython:
    """`python *argv` (`-c code *args`, or `-m module *args`) forked from the warm server, as `subprocess.Popen(...,
    stdin=PIPE, stdout=PIPE, stderr=PIPE, text=True)` has it (`merged`: stderr=STDOUT; `new_session`:
    start_new_session=True): `pid`, `stdin`, `stdout`, `stderr`, `poll`, `wait`, `communicate`, `kill`, `send_signal`,
    `returncode`. As a new interpreter it has its `sys.argv` and `sys.path[0]`, its own resource tracker (started
    when it first needs one) and numpy random state, and its environment is `env` alone. Not as one: its parent is
    the server, which reaps it at once (no zombie); torch, torchrun and the project are imported already, with
    numpy's sort kernels as train/main.py chooses them (cpu_dispatch.py) and the server's hash seed and start-up
    variables (PYTHONPATH's entries stay on sys.path); and it exits as train/main.py does (exit_without_teardown:
    threads joined and atexit handlers run, no finalization of objects). Tests of those, of imports, of a notice to
    a process group or of a process in a namespace of its own start a new interpreter."""

    def __init__(self, *argv, cwd: Path, env: dict | None = None, merged: bool = False, new_session: bool = False):
        assert argv[0] in ("-c", "-m"), argv
        self.args = ["warm", *map(str, argv)]
        pipes = {name: os.pipe() for name in ("stdin", "stdout", *(() if merged else ("stderr",)))}
        ends = [pipes["stdin"][0], pipes["stdout"][1], None if merged else pipes["stderr"][1]]  # the child's
        self.process = multiprocessing.get_context("forkserver").Process(
            target=_python, args=(dict(os.environ if env is None else env), self.args[1:], str(cwd), new_session,
                                  *(None if end is None else _ForChild(end) for end in ends)),
            name=shlex.join(self.args))
        _start(self.process)
        for end in ends:
            if end is not None:
                os.close(end)
        self.pid = self.process.pid
        self.stdin = open(pipes["stdin"][1], "w", encoding="utf-8")
        self.stdout = open(pipes["stdout"][0], "r", encoding="utf-8", errors="replace")
        self.stderr = None if merged else open(pipes["stderr"][0], "r", encoding="utf-8", errors="replace")
        self._said: dict[str, list[str]] | None = None  # what communicate() has read
        self._threads: list[threading.Thread] = []
        if new_session:  # as Popen's start_new_session: the session is there once this returns
            deadline = time.monotonic() + 60
            while _group(self.pid) not in (self.pid, None) and time.monotonic() < deadline:
                time.sleep(0.001)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self.process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, input: str | None = None, timeout: float | None = None) -> tuple[str, str | None]:
        """As Popen's: `input` written and stdin closed while stdout and stderr are read, then all of both once the
        process has ended; a TimeoutExpired carries the output so far, and a later call goes on from there."""
        if self._said is None:
            self._said = {name: [] for name in ("stdout", "stderr") if getattr(self, name) is not None}
            self._threads = [threading.Thread(target=_read_all, args=(getattr(self, name), said), daemon=True)
                             for name, said in self._said.items()]
            if not self.stdin.closed:
                self._threads.append(threading.Thread(target=_write_all, args=(self.stdin, input), daemon=True))
            for thread in self._threads:
                thread.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout, output="".join(self._said["stdout"]))
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        said = {name: "".join(parts) for name, parts in self._said.items()}
        return said["stdout"], said.get("stderr")

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # ended and reaped by the server meanwhile: as Popen, nothing to signal
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _start(process: multiprocessing.Process) -> None:
    """Start a fork that the test process's exit does not wait for, as it does not wait for a Popen (multiprocessing's
    exit joins its children: one a failed test left running would hold pytest's exit for ever)."""
    process.start()
    multiprocessing.process._children.discard(process)


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _read_all(file, said: list[str]) -> None:
    with file:
        for line in file:  # line by line, as they come: what a timeout finds read is there
            said.append(line)


def _write_all(file, text: str | None) -> None:
    try:
        with file:
            if text:
                file.write(text)
    except BrokenPipeError:  # it ended without reading: as Popen, not an error
        pass


class _ForChild:
    """A pipe's end handed to a forked process as multiprocessing hands it a socket (the server passes a duplicate
    on); the fork receives its number."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _inherited, (reduction.DupFd(self.fd),)  # called while the process starts: its duplicate


def _inherited(duplicate) -> int:
    return duplicate.detach()


def _python(env: dict, argv: list[str], cwd: str, new_session: bool, stdin: int, output: int,
            errors: int | None) -> None:
    """In the fork of a `WarmPython`: its session and stdin, and a resource tracker of its own (the test process's,
    which the server hands every fork, is left to the test process), then as a rank."""
    from multiprocessing import resource_tracker

    if new_session:
        os.setsid()
    tracker = resource_tracker._resource_tracker
    if tracker._fd is not None:
        os.close(tracker._fd)
        tracker._fd = tracker._pid = None
    os.dup2(stdin, 0)
    os.close(stdin)
    sys.stdin = open(0, "r", closefd=False)
    _rank(env, argv, cwd, output, errors, numpy_choice=False)


def _rank(env: dict, argv: list[str], cwd: str, output: int, errors: int | None = None,
          numpy_choice: bool = True) -> None:
    """In the fork: the rank's environment, output and threads as torchrun's would be, then the script
    (argv[0]) as `__main__`, and its exit as the interpreter's (its threads joined, its atexit handlers run).
    Its stderr goes to `errors`, else with its stdout."""
    if PRELOAD not in sys.modules:  # a server started before start_warm_server(): the rank would import it all
        raise RuntimeError(f"the warm server did not import {PRELOAD}: start_warm_server() must start it")
    import torch

    os.dup2(output, 1)
    os.dup2(output if errors is None else errors, 2)
    for fd in {output, errors} - {None}:
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    chosen = os.environ.get(NUMPY_CHOICE)  # made by the server before it imported numpy, as train/main.py makes it
    os.environ.clear()
    os.environ.update(env)
    if numpy_choice and chosen is not None:  # a rank's (or a tool's) own: not a WarmPython's, whose children choose
        os.environ.setdefault(NUMPY_CHOICE, chosen)
    import numpy

    numpy.random.seed()  # numpy's global random state from fresh entropy, as a new interpreter's (not the server's)
    tempfile.tempdir = None  # found again from this environment's TMPDIR, not the server's
    # multiprocessing's start method as in a new interpreter (fork on Linux before Python 3.14), not the forkserver
    # this fork came from: DataLoader workers are forked from the rank, as in a rank torchrun starts.
    multiprocessing.set_start_method(None, force=True)
    sys.path[:] = [entry for entry in sys.path if entry != str(TESTS)]  # the test process's (pytest's): not a rank's
    os.chdir(cwd)
    # sys.path and sys.argv as `python script`, `python -c code` and `python -m module` have them
    sys.path.insert(0, {"-c": "", "-m": os.getcwd()}.get(argv[0], os.path.dirname(os.path.abspath(argv[0]))))
    sys.argv = [argv[0], *argv[2:]] if argv[0] in ("-c", "-m") else list(argv)
    if "OMP_NUM_THREADS" in env:  # read by the server when it imported torch, from its own environment
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        if argv[0] == "-c":
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.modules.pop(argv[1], None)  # preloaded: run as `__main__` afresh, as a new interpreter would (no warning)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as done:  # as the interpreter reads it: None is 0, a message is printed and is 1
        status = 0 if done.code is None else done.code
        if not isinstance(status, int):
            print(status, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001  (as the interpreter ends on it)
        traceback.print_exc()
        status = 1
    exit_without_teardown(status)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
