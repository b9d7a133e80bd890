"""Stale shared memory: what counts as still in use when the node is busy with other jobs."""

import mmap
import os

from tokstream.train.stale_shm import SHM_DIR, remove_stale_shared_memory
from tokstream.train.streaming_internals import LOCALS_BLOCK, locals_block

PREFIX = 987101


def test_a_block_is_in_use_only_if_its_own_file_is_mapped(tmp_path):
    """Another process still mapping an older, unlinked block of the same name (a '(deleted)' mapping,
    common on a busy node where prefix numbers are reused) does not keep our stale block alive."""
    blocks = [SHM_DIR / f"{PREFIX}_{LOCALS_BLOCK}", SHM_DIR / f"{PREFIX}_barrier"]
    try:
        blocks[1].write_bytes(bytes(4096))
        with open(blocks[1], "r+b") as handle:
            older = mmap.mmap(handle.fileno(), 4096)  # this process maps the older block...
        blocks[1].unlink()  # ...which its job unlinked; a killed run of ours then took the name
        blocks[0].write_bytes(locals_block([str(tmp_path / "train")], PREFIX))
        blocks[1].write_bytes(bytes(64))
        assert any(line.endswith(f"/dev/shm/{blocks[1].name} (deleted)")
                   for line in open(f"/proc/{os.getpid()}/maps").read().splitlines())

        removed = remove_stale_shared_memory([str(tmp_path / "train")])
        assert removed == sorted(block.name for block in blocks)
        assert not any(block.exists() for block in blocks)
        older.close()
    finally:
        for block in blocks:
            block.unlink(missing_ok=True)


def test_a_block_mapped_by_a_live_process_stays(tmp_path):
    blocks = [SHM_DIR / f"{PREFIX}_{LOCALS_BLOCK}", SHM_DIR / f"{PREFIX}_barrier"]
    try:
        blocks[0].write_bytes(locals_block([str(tmp_path / "train")], PREFIX))
        blocks[1].write_bytes(bytes(4096))
        with open(blocks[1], "r+b") as handle:
            live = mmap.mmap(handle.fileno(), 4096)
        assert remove_stale_shared_memory([str(tmp_path / "train")]) == []
        assert all(block.exists() for block in blocks)
        live.close()
    finally:
        for block in blocks:
            block.unlink(missing_ok=True)
