"""Each dataset on a node gets its own shared-memory prefix, even when jobs start at the same moment.

StreamingDataset numbers the shared-memory blocks of each dataset on a node (/dev/shm/000007_locals,
_barrier, ...). Stock streaming (`get_shm_prefix`) has every rank scan for the lowest free number on
its own; then the node's first rank creates `NNNNNN_locals`, and the others attach to it. Two jobs
that start together scan alike and pick the same number: one job's first rank fails with
FileExistsError, or one of its other ranks sees the number taken by the other job and fails with
"Internal error: shared memory prefix=... was not registered by local leader". On a shared node,
or when a scheduler starts several jobs at once, that kills a job at start.

Here only the node's first rank scans (stock's scan, with its check that no running dataset uses our
cache directories), and it claims the number by creating the `locals` block exclusively, scanning
again if another job created it first. The other ranks of the node take the number it claimed from
one all_gather instead of scanning themselves. Put in streaming's place when this module is imported
(through streaming_internals.py).
"""

import os

import torch.distributed as dist

from tokstream.reader.streaming_door import streaming_internals as internals


def get_shm_prefix_claimed(streams_local: list[str], streams_remote: list[str | None], world: internals.World,
                           retry: int = 100) -> tuple[int, internals.SharedMemory]:
    """Stock get_shm_prefix's contract (the prefix, and this process's handle on its `locals` block)."""
    grouped = dist.is_available() and dist.is_initialized()
    if world.ranks_per_node > 1 and not grouped:
        # No process group to hear the first rank's number from: stock, which also needs ranks that
        # do not start together (it has no barrier either without a group).
        return internals.stock_get_shm_prefix(streams_local, streams_remote, world, retry)
    if world.is_local_leader:
        prefix, block = _claim(streams_local, streams_remote, retry)
    if grouped:
        claims = [None] * dist.get_world_size()
        dist.all_gather_object(claims, (world.node, prefix) if world.is_local_leader else None)
    if world.is_local_leader:
        return prefix, block
    prefix = next(claim[1] for claim in claims if claim is not None and claim[0] == world.node)
    block = internals.SharedMemory(internals.locals_block_name(prefix), False)
    expected = internals.locals_block(streams_local, prefix)
    if bytes(block.buf[:len(expected)]) != expected:
        raise RuntimeError(f"shared memory prefix {prefix} registers other cache directories than this rank's "
                           f"{streams_local}: every rank of a node must read the same streams into the same `local`")
    return prefix, block


def _claim(streams_local: list[str], streams_remote: list[str | None], retry: int) -> tuple[int, internals.SharedMemory]:
    """Create the `locals` block of the lowest free prefix; if another job creates it between our scan and
    our creation, or a block of another dataset appeared there meanwhile (a rank of a job that ends, still
    releasing it), give it up and scan again (each retry means another dataset registered or is still
    there, so this ends)."""
    while True:
        prefix = internals.first_free_prefix(streams_local, streams_remote, retry)
        data = internals.locals_block(streams_local, prefix)
        try:
            block = internals.SharedMemory(internals.locals_block_name(prefix), True, len(data))
        except FileExistsError:
            continue
        if internals.other_blocks_of(prefix):
            internals.release_shared_memory([block], os.getpid())
            continue
        block.buf[:len(data)] = data
        return prefix, block
