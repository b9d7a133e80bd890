"""Stale shared memory: what counts as still in use when the node is busy with other jobs."""

import mmap
import os

from tokstream.reader.stale_shm import SHM_DIR, remove_stale_shared_memory
from tokstream.reader.streaming_door.streaming_internals import LOCALS_BLOCK, locals_block

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


def test_owner_records_decide_for_prefixes_our_trainer_registered(tmp_path):
    """A prefix whose recorded owners are all gone is stale even while other processes map it; one
    whose owner still runs is kept even when nothing maps it."""
    import subprocess
    import sys

    from tokstream.reader.stale_shm import OWNER_MARK, _start_time

    def plant(prefix: int, directory: str) -> list:
        blocks = [SHM_DIR / f"{prefix}_{LOCALS_BLOCK}", SHM_DIR / f"{prefix}_barrier"]
        blocks[0].write_bytes(locals_block([directory], prefix))
        blocks[1].write_bytes(bytes(4096))
        return blocks

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    killed = plant(PREFIX, str(tmp_path / "train"))
    running = plant(PREFIX + 1, str(tmp_path / "val"))
    marks = [SHM_DIR / f"{PREFIX}_{OWNER_MARK}.{int(gone.stdout)}.1",  # a pid that has ended
             SHM_DIR / f"{PREFIX + 1}_{OWNER_MARK}.{alive.pid}.{_start_time(alive.pid)}"]
    try:
        for mark, blocks in zip(marks, (killed, running)):
            mark.write_text(str(blocks[0].stat().st_ino))  # what record_owner writes: the locals block's inode
        with open(killed[1], "r+b") as handle:
            walker = mmap.mmap(handle.fileno(), 4096)  # e.g. another job that walked past this prefix
        removed = remove_stale_shared_memory([str(tmp_path / "train"), str(tmp_path / "val")])
        assert removed == sorted(block.name for block in killed)
        assert not marks[0].exists() and marks[1].exists() and all(block.exists() for block in running)
        walker.close()
    finally:
        alive.communicate(b"\n", timeout=60)
        for path in killed + running + marks:
            path.unlink(missing_ok=True)


def test_owner_records_of_a_prefix_without_blocks_go_once_their_owners_are_gone(tmp_path):
    """A run killed after streaming unlinked its blocks leaves only its owner records: the next start
    removes the dead owners' records, and keeps a live owner's."""
    import subprocess
    import sys

    from tokstream.reader.stale_shm import OWNER_MARK, _start_time

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = SHM_DIR / f"{PREFIX}_{OWNER_MARK}.{int(ended.stdout)}.1"
    live = SHM_DIR / f"{PREFIX}_{OWNER_MARK}.{os.getpid()}.{_start_time(os.getpid())}"
    try:
        dead.touch()
        live.touch()
        assert remove_stale_shared_memory([str(tmp_path / "train")]) == []
        assert not dead.exists() and live.exists()
    finally:
        dead.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


def test_a_dead_owners_record_from_an_earlier_registration_does_not_condemn_the_blocks_there_now(tmp_path):
    """A run of ours killed while its resource tracker lived: the tracker unlinked the blocks, our owner
    record stayed, and another job (stock streaming, no records) registered the same number. Its live
    blocks are judged by mapping, not by the dead record, which goes."""
    import subprocess
    import sys

    from tokstream.reader.stale_shm import OWNER_MARK

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    blocks = [SHM_DIR / f"{PREFIX}_{LOCALS_BLOCK}", SHM_DIR / f"{PREFIX}_barrier"]
    dead = SHM_DIR / f"{PREFIX}_{OWNER_MARK}.{int(ended.stdout)}.1"
    try:
        blocks[0].write_bytes(locals_block([str(tmp_path / "train")], PREFIX))
        dead.write_text(str(blocks[0].stat().st_ino))  # recorded for the earlier registration...
        blocks[0].unlink()  # ...whose blocks its resource tracker removed
        blocks[0].write_bytes(locals_block([str(tmp_path / "train")], PREFIX))  # the other job's, now
        blocks[1].write_bytes(bytes(4096))
        with open(blocks[1], "r+b") as handle:
            live = mmap.mmap(handle.fileno(), 4096)
        assert remove_stale_shared_memory([str(tmp_path / "train")]) == []
        assert all(block.exists() for block in blocks) and not dead.exists()
        live.close()
    finally:
        for path in blocks + [dead]:
            path.unlink(missing_ok=True)


def test_a_killed_run_of_another_pid_namespace_leaves_no_blocks_that_stay_for_ever(tmp_path):
    """A run in a container of its own (its own pid namespace, the host's /dev/shm) killed hard: its relaunch, in a
    new container, can never see that namespace again. Its stale blocks go at the relaunch's start, judged by pid."""
    import subprocess
    import sys

    from tokstream.reader.stale_shm import OWNER_MARK, _PID_NAMESPACE

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    blocks = [SHM_DIR / f"{PREFIX}_{LOCALS_BLOCK}", SHM_DIR / f"{PREFIX}_barrier"]
    dead = SHM_DIR / f"{PREFIX}_{OWNER_MARK}.{int(ended.stdout)}.1"
    try:
        blocks[0].write_bytes(locals_block([str(tmp_path / "train")], PREFIX))
        blocks[1].write_bytes(bytes(4096))
        dead.write_text(f"{blocks[0].stat().st_ino} {(_PID_NAMESPACE or 0) + 12345}")  # another namespace's
        assert sorted(remove_stale_shared_memory([str(tmp_path / "train")])) == sorted(b.name for b in blocks)
        assert not any(path.exists() for path in blocks + [dead])
    finally:
        for path in blocks + [dead]:
            path.unlink(missing_ok=True)
