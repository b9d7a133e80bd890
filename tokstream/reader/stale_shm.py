"""Remove the shared memory a killed run of *this* dataset left behind, and nothing else.

StreamingDataset registers each dataset on a node under a numbered prefix of shared-memory
blocks (/dev/shm/000007_locals, _barrier, ...). A run killed with its resource trackers (node
loss, a cgroup kill, OOM) leaves them behind, and a relaunch that reads the same remote into the
same cache directory is refused ("Reused local directory"). streaming's own
`clean_stale_shared_memory()` unlinks every prefix from 0 up to the first gap, including those
of other live jobs on the node, and misses stale ones past a gap.

Here a prefix is removed only when its `locals` block names one of our cache directories and it
is not in use. In use means: for a prefix our trainer registered, one of the processes that
recorded themselves as its owners (`record_owner`, a `NNNNNN_tokstream_owner.PID.START` file
beside the blocks, holding the inode of the `locals` block it was recorded for) is still running. A
record whose inode is not the current `locals` block's belongs to an earlier registration of the
number (a killed run whose resource tracker unlinked the blocks but not our records, after which
another job took the number): it says nothing about the blocks there now. Whether a process maps
the blocks says little, because every process that ever starts a StreamingDataset maps every
prefix it walks past for the rest of its life (streaming keeps each attached block alive through
an atexit hook). For a prefix without owner records (another program's), mapped by any process
counts as in use. Owner records left by killed processes of a prefix whose blocks are gone are
removed too.

The same records tell the node's barrier (streaming_internals.NodeBarrier) that a rank has ended: a
process that lets its reader go renames its record `....released` (`release_owner`) rather than
removing it, until no owner of that registration is left, and a killed one leaves its record in place.
Each record also holds its process's pid namespace: a waiter never judges a process of another one by pid.
"""

import os
import re
from pathlib import Path
from tempfile import gettempdir

from tokstream.reader.streaming_door.streaming_internals import (LOCALS_BLOCK, LOCK_FILE_SUFFIXES, SHM_BLOCK_SUFFIXES,
                                                 locals_of_block)

SHM_DIR = Path("/dev/shm")
_BLOCK = re.compile(r"^(\d{6})_(%s)$" % "|".join(map(re.escape, SHM_BLOCK_SUFFIXES)))
OWNER_MARK = "tokstream_owner"
_OWNER = re.compile(r"^(\d{6})_%s\.(\d+)\.(\d+)$" % OWNER_MARK)


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart), or None if it has ended
    (gone, or a zombie: killed, not yet reaped by its parent, say torchrun's agent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # field 3 onwards: the command before them may hold anything
    return None if fields[0] in ("Z", "X") else int(fields[19])  # state (3), start time (22)


def record_owner(prefix: int) -> Path | None:
    """Mark this process as a user of a prefix it registered or attached to; `release_owner` unmarks it."""
    start = _start_time(os.getpid())
    locals_inode = locals_registration(prefix)
    if not SHM_DIR.is_dir() or start is None or locals_inode is None:
        return None
    path = SHM_DIR / f"{prefix:06d}_{OWNER_MARK}.{os.getpid()}.{start}"
    writing = SHM_DIR / f".{path.name}.writing"  # whole or not there: a waiter reads the namespace in it
    writing.write_text(f"{locals_inode} {_PID_NAMESPACE or ''}")
    os.replace(writing, path)
    return path


def _pid_namespace() -> int | None:
    """Which pid namespace this process's pids are read in (None: unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


_PID_NAMESPACE = _pid_namespace()


def _record(name: str) -> tuple[int, int | None] | None:
    """What a record holds: the inode of the `locals` block it was recorded for, and its process's pid namespace
    (None: not recorded, by an older version)."""
    try:
        fields = (SHM_DIR / name).read_text().split()
        return int(fields[0]), int(fields[1]) if len(fields) > 1 else None
    except (OSError, ValueError, IndexError):  # gone meanwhile, being written, or without an inode (older versions)
        return None


def _recorded_inode(name: str) -> int | None:
    return None if (record := _record(name)) is None else record[0]


def _ended(pid: int, start: int, namespace: int | None) -> bool:
    """Whether the process of a record no longer runs, for a barrier's waiter: one of another pid namespace (ranks in
    containers of their own that share /dev/shm) is never taken as ended, its pid means another process here. (The
    stale blocks' removal judges by pid alone, as before namespaces were recorded: a relaunch in a new container
    could never see the killed run's namespace again.)"""
    if namespace is not None and _PID_NAMESPACE is not None and namespace != _PID_NAMESPACE:
        return False
    return _start_time(pid) != start


def locals_registration(prefix: int) -> int | None:
    """The inode of the prefix's `locals` block now (which registration of the number is there), None if gone."""
    return _inode(SHM_DIR / f"{prefix:06d}_{LOCALS_BLOCK}")


def ended_owners(prefix: int, registration: int) -> list[int]:
    """The processes recorded as owners of registration `registration` of the prefix that have ended: released it
    (closed their reader, or exited), or were killed with their record in place. None of them comes back to it (a
    process that opens the dataset again gets a registration of its own), so the prefix's barrier cannot fill."""
    ended = []
    for name, pid, start, released, (inode, namespace) in _records(f"{prefix:06d}"):
        if inode == registration and (released or _ended(pid, start, namespace)
                                      and (SHM_DIR / name).exists()):  # not released just now
            ended.append(pid)
    return sorted(ended)


def _records(prefix: str = "[0-9]*") -> list[tuple[str, int, int, bool, tuple[int | None, int | None]]]:
    """The owner records of `prefix` (or of every prefix): (name, pid, start time, released, (the locals inode
    recorded, the pid namespace recorded))."""
    found = []
    for path in SHM_DIR.glob(f"{prefix}_{OWNER_MARK}.*"):
        if match := _OWNER.match(path.name.removesuffix(RELEASED)):
            found.append((path.name, int(match.group(2)), int(match.group(3)), path.name.endswith(RELEASED),
                          _record(path.name) or (None, None)))
    return found


def release_owner(path: Path | None, owner_pid: int) -> None:
    """Mark the record released (`ended_owners` reads it: its barrier's waiters stop); the released records of a
    registration go when none of its owners is left."""
    if path is None or os.getpid() != owner_pid:  # not in a DataLoader worker's copy of the dataset
        return
    try:
        os.replace(path, path.with_name(path.name + RELEASED))
    except FileNotFoundError:  # removed as stale meanwhile
        pass
    drop_spent_releases(path.name.partition("_")[0])


RELEASED = ".released"


def drop_spent_releases(prefix: str = "[0-9]*") -> None:
    """Unlink the released records (of `prefix`, or every one) of registrations that no running process still
    holds: nobody is left to wait for their processes. Each process renames its own record before it looks, so
    of ranks releasing together, the last to look removes them all."""
    records = _records(prefix)
    held = {(name.partition("_")[0], inode) for name, pid, start, released, (inode, namespace) in records
            if not released and not _ended(pid, start, namespace)}
    for name, _, _, released, (inode, _) in records:
        if released and (name.partition("_")[0], inode) not in held:
            (SHM_DIR / name).unlink(missing_ok=True)


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
    """Unlink the streaming prefixes registered for any of `local_dirs` that are not in use; returns
    the names of the blocks removed."""
    if not SHM_DIR.is_dir():  # not Linux: nothing we can inspect safely
        return []
    drop_spent_releases()
    ours = {os.path.abspath(d) for d in local_dirs}
    blocks: dict[str, list[str]] = {}
    owners: dict[str, list[tuple[str, int, int]]] = {}
    for path in SHM_DIR.iterdir():
        if match := _BLOCK.match(path.name):
            blocks.setdefault(match.group(1), []).append(path.name)
        elif match := _OWNER.match(path.name):
            owners.setdefault(match.group(1), []).append((path.name, int(match.group(2)), int(match.group(3))))
    for prefix, recorded in owners.items():
        if prefix not in blocks:  # the blocks went without their owners' records (those were killed): ours, spent
            _unlink([name for name, pid, start in recorded if _start_time(pid) != start])
    candidates = {}
    for prefix, names in blocks.items():
        try:
            their_locals = locals_of_block((SHM_DIR / f"{prefix}_{LOCALS_BLOCK}").read_bytes())
        except (OSError, ValueError, IndexError):
            continue  # no readable locals block: not attributable to us
        if ours & set(their_locals):
            candidates[prefix] = names
    if not candidates:
        return []
    mapped = None  # read only if some candidate has no owner records
    removed = []
    for prefix, names in candidates.items():
        locals_inode = _inode(SHM_DIR / f"{prefix}_{LOCALS_BLOCK}")
        recorded, earlier = [], []
        for record in owners.get(prefix, []):
            (recorded if _recorded_inode(record[0]) == locals_inode else earlier).append(record)
        _unlink([name for name, pid, start in earlier if _start_time(pid) != start])
        if recorded:  # by pid alone, also a record of another pid namespace: a killed run's container is gone
            in_use = any(_start_time(pid) == start for _, pid, start in recorded)
        else:
            mapped = mapped_shm_inodes() if mapped is None else mapped
            in_use = any(_inode(SHM_DIR / name) in mapped for name in names)
        if in_use:
            continue
        removed += _unlink(names)
        _unlink([name for name, _, _ in recorded])
        drop_spent_releases(prefix)
        for lock in LOCK_FILE_SUFFIXES:
            try:
                Path(gettempdir(), f"{prefix}_{lock}").unlink(missing_ok=True)
            except PermissionError:
                pass
    return sorted(removed)


def _unlink(names: list[str]) -> list[str]:
    done = []
    for name in names:
        try:
            (SHM_DIR / name).unlink()
            done.append(name)
        except (FileNotFoundError, PermissionError):
            pass
    return done
