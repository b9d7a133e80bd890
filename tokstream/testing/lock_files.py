"""Removing the lock files streaming leaves in the temp dir, for tests and benches that create them."""

import atexit
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from tempfile import gettempdir

from tokstream.reader.streaming_door.streaming_internals import LOCK_FILE_SUFFIXES

_LOCK_FILE = re.compile(r"^(\d{6})_(%s)$" % "|".join(map(re.escape, LOCK_FILE_SUFFIXES)))


def _lock_files() -> set[Path]:
    return {p for p in Path(gettempdir()).iterdir() if _LOCK_FILE.match(p.name)}


def _remove_new(before: set[Path]) -> None:
    shm = Path("/dev/shm")
    live = {p.name[:6] for p in shm.iterdir()} if shm.is_dir() else set()
    for path in _lock_files() - before:
        if path.name[:6] not in live:
            path.unlink(missing_ok=True)


@contextmanager
def removing_new_lock_files() -> Iterator[None]:
    """Every StreamingDataset leaves NNNNNN_*_filelock files behind, and each later one walks past all
    of them to find a free prefix: left to pile up, they slow every start on the machine. Those that
    appear while the block runs are removed at its end, and again at interpreter exit (registered
    first, this runs after streaming's own exit hooks have released the datasets still alive), unless
    their prefix is in use (has shm blocks)."""
    before = _lock_files()
    atexit.register(_remove_new, before)
    try:
        yield
    finally:
        _remove_new(before)
