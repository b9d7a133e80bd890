"""Shared by every wing and command: the errors a user sees as one line, never a traceback, and their printer."""

import argparse
import errno
import os
import select
import signal
import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(Exception):
    """Bad input or environment: the message says what is wrong and what to do."""


class StoreError(Exception):
    """The storage service failed after its retries: the input is fine, the store is at fault."""


class WorkLost(Exception):
    """A failure outside the input stopped the work (a tokenizer process was killed): what was done is
    kept, as after an interruption, for the same command to resume."""


class DamagedData(UserError):
    """Data found damaged while it is read (a shard's hash, counts or token ids): said, like NoSpace, by
    every process that meets it, since the ranks that read that shard may not include rank 0."""


class PeerEnded(RuntimeError):
    """A process that read the same dataset on this node (another rank) ended or closed it while this one waited
    for it at the start of an epoch: the node's barrier can no longer fill, and the job cannot go on."""


class NoSpace(Exception):
    """A disk this process writes to is full (or its quota is). Said by every process that meets it, not
    only by training's rank 0: each node has its own disks, and the other ranks may never meet it."""


def out_of_space(err: BaseException) -> bool:
    """Whether a write failed for want of space: the disk is full, or the user's quota on it is."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def no_space(where: object, err: OSError | None = None) -> str:
    """The start of every full-disk line: which device, and the system's word for why (ENOSPC's if no
    write has failed yet)."""
    return f"no space left on the device holding {where} ({err.strerror if err else os.strerror(errno.ENOSPC)})"


class CommandLine(argparse.ArgumentParser):
    """argparse for a script run through run_cli, its docstring as the description: a wrong argument is one
    line like every other refusal (argparse's own error prints its usage block first)."""

    def __init__(self, description: str | None, **kwargs):
        super().__init__(description=description, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} ({self.prog} --help lists the options)")


CONVERSION_INTERRUPTED = "interrupted: the output was not completed (see README: what resumes and what restarts)"


def run_cli(main: Callable[[], int | None], *, sigterm_interrupts: bool = True, report: bool = True,
            interrupted: str = CONVERSION_INTERRUPTED) -> NoReturn:
    """Run a CLI entry point; turn UserError, StoreError, a full disk and Ctrl-C into one line and a
    non-zero exit.

    `main` returns its exit status (None: 0).

    `sigterm_interrupts`: treat SIGTERM like Ctrl-C, so cleanup runs (converters); training handles
    SIGTERM itself, as a preemption. `report`: print the line (training: on rank 0 only), except for
    a full disk, which the process that meets it always reports.
    """
    if sigterm_interrupts:
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        status = main()
    except DamagedData as err:
        _say(f"error: {err}")
        sys.exit(2)
    except (UserError, StoreError, WorkLost) as err:
        if report:
            _say(f"error: {err}")
        sys.exit(2)
    except NoSpace as err:
        _say(f"error: {err}")
        sys.exit(2)
    except BrokenPipeError:
        if not _stdout_gone():  # another pipe (a socket, a child's stdin) broke: not this command's reader
            raise
        # The reader of the output went away (`| head`): nothing more to say to it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # 128 + SIGPIPE, as a shell reports a command a closed pipe ended
    except OSError as err:
        if not out_of_space(err):
            raise
        _say(f"error: {no_space(err.filename or 'a file this command writes', err)}: free space there, or point "
             "the command at another disk")
        sys.exit(2)
    except KeyboardInterrupt:
        if report:
            _say(interrupted)
        sys.exit(130)
    sys.exit(status or 0)


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError):
        return False


def _say(line: str) -> None:
    """One line to stderr in one write: lines several ranks print at once (a damaged shard) stay whole."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
