"""Remove the shared memory a killed run of *this* dataset left behind, and nothing else.

StreamingDataset registers each dataset on a node under a numbered prefix of shared-memory
blocks (/dev/shm/000007_locals, _barrier, ...). A run killed with its resource trackers (node
loss, a cgroup kill, OOM) leaves them behind, and a relaunch that reads the same remote into the
same cache directory is refused ("Reused local directory"). streaming's own
`clean_stale_shared_memory()` unlinks every prefix from 0 up to the first gap, including those
of other live jobs on the node, and misses stale ones past a gap. Here a prefix is removed only
when its `locals` block names one of our cache directories and no process maps any of its blocks.
"""

import os
import re
from pathlib import Path
from tempfile import gettempdir

from tokstream.train.streaming_internals import (LOCALS_BLOCK, LOCK_FILE_SUFFIXES, SHM_BLOCK_SUFFIXES,
                                                 locals_of_block)

SHM_DIR = Path("/dev/shm")
_BLOCK = re.compile(r"^(\d{6})_(%s)$" % "|".join(map(re.escape, SHM_BLOCK_SUFFIXES)))


def mapped_shm_inodes() -> set[int]:
    """Inodes of the /dev/shm files that some process we can see has mapped.

    By inode, not name: a process may still map an older block of the same name that its job
    unlinked (listed as "(deleted)"), which says nothing about the file now under that name.
    """
    inodes = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or belongs to another user (whose blocks we cannot unlink)
            continue
        for line in text.splitlines():
            if " /dev/shm/" in line:
                inodes.add(int(line.split(maxsplit=5)[4]))  # address perms offset dev inode path
    return inodes


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def remove_stale_shared_memory(local_dirs: list[str]) -> list[str]:
    """Unlink the unmapped streaming prefixes registered for any of `local_dirs`; returns the names removed."""
    if not SHM_DIR.is_dir():  # not Linux: nothing we can inspect safely
        return []
    ours = {os.path.abspath(d) for d in local_dirs}
    prefixes: dict[str, list[str]] = {}
    for path in SHM_DIR.iterdir():
        match = _BLOCK.match(path.name)
        if match:
            prefixes.setdefault(match.group(1), []).append(path.name)
    candidates = {}
    for prefix, names in prefixes.items():
        try:
            their_locals = locals_of_block((SHM_DIR / f"{prefix}_{LOCALS_BLOCK}").read_bytes())
        except (OSError, ValueError, IndexError):
            continue  # no readable locals block: not attributable to us
        if ours & set(their_locals):
            candidates[prefix] = names
    if not candidates:
        return []
    in_use = mapped_shm_inodes()
    removed = []
    for prefix, names in candidates.items():
        if any(_inode(SHM_DIR / name) in in_use for name in names):
            continue  # a live process still uses it
        for name in names:
            try:
                (SHM_DIR / name).unlink()
                removed.append(name)
            except (FileNotFoundError, PermissionError):
                pass
        for lock in LOCK_FILE_SUFFIXES:
            try:
                Path(gettempdir(), f"{prefix}_{lock}").unlink(missing_ok=True)
            except PermissionError:
                pass
    return sorted(removed)
