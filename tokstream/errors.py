"""The errors a user should see as a single line, never a traceback, and the wrapper that prints them."""

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


CONVERSION_INTERRUPTED = "interrupted: the output was not completed (see README: what resumes and what restarts)"


def run_cli(main: Callable[[], int | None], *, sigterm_interrupts: bool = True, report: bool = True,
            interrupted: str = CONVERSION_INTERRUPTED) -> NoReturn:
    """Run a CLI entry point; turn UserError, StoreError and Ctrl-C into one line and a non-zero exit.

    `main` returns its exit status (None: 0).

    `sigterm_interrupts`: treat SIGTERM like Ctrl-C, so cleanup runs (converters); training handles
    SIGTERM itself, as a preemption. `report`: print the line (training: on rank 0 only).
    """
    if sigterm_interrupts:
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        status = main()
    except (UserError, StoreError, WorkLost) as err:
        if report:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if report:
            print(interrupted, file=sys.stderr)
        sys.exit(130)
    sys.exit(status or 0)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
