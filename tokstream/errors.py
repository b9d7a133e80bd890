"""The one exception type a user should see as a single line, never a traceback."""

import signal
import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(Exception):
    """Bad input or environment: the message says what is wrong and what to do."""


def run_cli(main: Callable[[], object]) -> NoReturn:
    """Run a CLI entry point; turn UserError, Ctrl-C and SIGTERM into one line and a non-zero exit."""
    signal.signal(signal.SIGTERM, _raise_interrupt)  # so cleanup runs as for Ctrl-C
    try:
        main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: the output was not completed (see README: what resumes and what restarts)", file=sys.stderr)
        sys.exit(130)
    sys.exit(0)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
