"""Removing the shared memory that test runs of training leave when they are killed on purpose."""

from pathlib import Path

from tokstream.reader.stale_shm import SHM_DIR, remove_stale_shared_memory
from tokstream.reader.streaming_door.streaming_internals import locals_of_block


def cache_dirs_under(directory: Path) -> list[str]:
    """The cache directories under `directory` that some streaming prefix on this node registers."""
    found = set()
    for block in SHM_DIR.glob("*_locals") if SHM_DIR.is_dir() else ():
        try:
            found.update(d for d in locals_of_block(block.read_bytes()) if d.startswith(f"{directory}/"))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not a streaming block
            continue
    return sorted(found)


def remove_stale_blocks_under(directory: Path) -> list[str]:
    """What a relaunch would remove (stale_shm.py: blocks no live process owns or maps), for every cache
    directory under `directory`: the tests' killed runs that were never relaunched on their machine."""
    return remove_stale_shared_memory(cache_dirs_under(directory))
