"""Streaming's py1e shuffle (its default), the same ids, computed in less time and memory.

py1e shuffles the shards into canonical nodes, then places each sample at its position plus a uniform shift
within a block around its shard and sorts by position. `get_shuffle_py1e_fast` sorts packed integers instead of an
argsort of floats, in 2 arrays of the epoch's size instead of stock's 5 (`get_shuffle_py1e_by_argsort`, stock's own
argsort in 3, where two positions are equal). `look_up_in_place` composes an order with another in place, a chunk
per thread. Tested equal to streaming's on random inputs (tests/test_epoch_order.py); the door registers the shuffle
under py1e.
"""

import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Bits of a position's fraction its key keeps: all the key has room for, at most this many (tests
# lower it, to make equal keys common); below the minimum, too many keys would be equal to pay.
MAX_FRACTION_BITS = 63
MIN_FRACTION_BITS = 8
# Keys sorted as one run while the next are made (2^18 to 2^21 measured alike at 8.8 M samples; tests lower it).
SORT_RUN = 1 << 18
# Elements per step of the chunked passes over an epoch-sized array (bounds their temporaries).
CHUNK = 1 << 20


def get_shuffle_py1e_fast(shard_sizes: np.ndarray, num_canonical_nodes: int, seed: int, epoch: int,
                          block_size: int = 1 << 18) -> np.ndarray:
    """streaming's `get_shuffle_py1e`, the same ids, by sorting packed integers instead of an argsort.

    py1e orders each canonical node's samples by a float position (its place plus a uniform shift).
    Here a sample's position in fixed point and its id share one int64 key, position above id, and
    the keys are sorted in place: the sorted keys, masked, are the result. Keys whose fixed-point
    positions are equal are then put in float order. A direct sort of integers instead of an indirect
    one of floats, in 2 arrays of the epoch's size (ids, positions) instead of stock's 5.

    The sort is done in runs: every SORT_RUN keys, as soon as they are made, are sorted in a thread
    while the next spans' keys are made, then one merge (numpy's stable sort, a timsort, takes each
    sorted run whole and merges only where neighbours overlap: a key lies within about a shuffle
    block of its place). The keys are distinct (they hold the id), so this is the one sorted order.

    Where two positions are exactly equal, stock's order for them is whatever its unstable argsort
    gave, so the epoch is computed by that argsort instead (`get_shuffle_py1e_by_argsort`): about 1 %
    of epochs at 8.8 M samples per canonical node, most of them past 100 M.
    """
    num_samples = int(np.sum(shard_sizes))
    id_bits = max(1, (num_samples - 1).bit_length())
    fraction_bits = min(MAX_FRACTION_BITS, 63 - 2 * id_bits)  # positions are below num_samples: id_bits whole bits
    if fraction_bits < MIN_FRACTION_BITS:
        return get_shuffle_py1e_by_argsort(shard_sizes, num_canonical_nodes, seed, epoch, block_size)
    spans, node_spans, epoch_rng = _epoch_spans(shard_sizes, num_canonical_nodes, seed, epoch)
    ids = np.empty(num_samples, np.int64)
    positions = np.empty(num_samples, np.float64)  # by sample id
    scale = float(1 << fraction_bits)
    offset, unshuffled_spans = 0, False
    with ThreadPoolExecutor(helper_threads()) as pool:
        for node_begin, node_end in node_spans:
            node_sizes = [end - begin for begin, end in spans[node_begin:node_end]]
            node = ids[offset:offset + sum(node_sizes)]
            _shuffle_within_spans(node, spans[node_begin:node_end], epoch_rng, num_canonical_nodes)
            span_offset, run_start, runs = 0, 0, []
            for size in node_sizes:
                low, high, unshuffled = _shift_range(epoch_rng, block_size, size, span_offset, len(node))
                unshuffled_spans |= unshuffled
                at = np.arange(span_offset, span_offset + size, dtype=np.float64)
                at += epoch_rng.uniform(low=low, high=high, size=size)
                span_ids = node[span_offset:span_offset + size]
                positions[span_ids] = at
                at *= scale
                np.floor(at, out=at)
                span_ids |= at.astype(np.int64) << id_bits
                span_offset += size
                if span_offset - run_start >= SORT_RUN or span_offset == len(node):
                    runs.append(pool.submit(node[run_start:span_offset].sort))  # keys ahead are not touched
                    run_start = span_offset
            for run in runs:
                run.result()
            node.sort(kind="stable")  # the merge of the sorted runs
            if not order_equal_keys(node, positions, id_bits):
                return get_shuffle_py1e_by_argsort(shard_sizes, num_canonical_nodes, seed, epoch, block_size)
            node &= (1 << id_bits) - 1
            offset += len(node)
    _warn_if_unshuffled(unshuffled_spans)
    return ids


def helper_threads() -> int:
    """Threads for the passes over an epoch-sized array (sorting runs, lookups): the cores this process
    may use, a few at most (numpy's sort and take let go of the GIL; past 4 the runs' sorts are no
    longer what the shuffle waits on)."""
    return min(4, len(os.sched_getaffinity(0)))  # Linux, as the project


def order_equal_keys(keys: np.ndarray, positions: np.ndarray, id_bits: int) -> bool:
    """In sorted (fixed-point position, id) keys, put each run of equal fixed-point positions in the
    order of the samples' float positions; False, leaving the keys unfinished, if two are equal."""
    # Sorted and distinct, so a key's fixed-point position equals the previous key's when the key is
    # at most the previous one with every id bit set: one comparison, no shifted copies.
    id_mask = (1 << id_bits) - 1
    same = []
    for at in range(0, len(keys) - 1, CHUNK):
        end = min(at + CHUNK, len(keys) - 1)
        same.append(np.flatnonzero(keys[at + 1:end + 1] <= (keys[at:end] | id_mask)) + at)
    same = np.concatenate(same) if same else np.empty(0, np.int64)
    if not len(same):
        return True
    members = np.union1d(same, same + 1)  # every key in a run, in order
    run_keys = keys[members]
    fixed, exact = run_keys >> id_bits, positions[run_keys & id_mask]
    order = np.lexsort((exact, fixed))
    fixed, exact = fixed[order], exact[order]
    if np.any((fixed[1:] == fixed[:-1]) & (exact[1:] == exact[:-1])):
        return False
    keys[members] = run_keys[order]
    return True


def look_up_in_place(indices: np.ndarray, table: np.ndarray) -> np.ndarray:
    """`table[indices]` where indices are not -1 (the partition's padding, kept), written over indices,
    a chunk per thread (random reads: they wait on memory, not on a core)."""
    flat = indices.ravel(order="K")  # elementwise, so memory order will do: a view of a transposed partition
    if not np.shares_memory(flat, indices):
        indices = np.ascontiguousarray(indices)
        flat = indices.reshape(-1)

    def look_up(at: int) -> None:
        chunk = flat[at:at + CHUNK]
        padding = np.flatnonzero(chunk == -1)
        np.take(table, chunk, out=chunk, mode="wrap")  # each index is read before its place is written
        chunk[padding] = -1

    with ThreadPoolExecutor(helper_threads()) as pool:
        list(pool.map(look_up, range(0, len(flat), CHUNK)))  # list: a chunk's error is raised here
    return indices


def get_shuffle_py1e_by_argsort(shard_sizes: np.ndarray, num_canonical_nodes: int, seed: int, epoch: int,
                                block_size: int = 1 << 18) -> np.ndarray:
    """streaming's `get_shuffle_py1e`, its own argsort of the positions, in 3 arrays of the epoch's size
    at most instead of its 5: the samples go straight into the output, and the positions' memory
    takes the reordered copy."""
    spans, node_spans, epoch_rng = _epoch_spans(shard_sizes, num_canonical_nodes, seed, epoch)
    ids = np.empty(int(np.sum(shard_sizes)), np.int64)
    offset, unshuffled_spans = 0, False
    for node_begin, node_end in node_spans:
        node_sizes = [end - begin for begin, end in spans[node_begin:node_end]]
        samples = ids[offset:offset + sum(node_sizes)]
        _shuffle_within_spans(samples, spans[node_begin:node_end], epoch_rng, num_canonical_nodes)
        positions = np.arange(len(samples), dtype=np.float64)
        span_offset = 0
        for size in node_sizes:
            low, high, unshuffled = _shift_range(epoch_rng, block_size, size, span_offset, len(samples))
            unshuffled_spans |= unshuffled
            positions[span_offset:span_offset + size] += epoch_rng.uniform(low=low, high=high, size=size)
            span_offset += size
        order = np.argsort(positions)
        reordered = positions.view(np.int64)  # the positions are spent: their memory takes the result
        np.take(samples, order, out=reordered)
        samples[:] = reordered
        del order, positions, reordered
        offset += len(samples)
    _warn_if_unshuffled(unshuffled_spans)
    return ids


def _epoch_spans(shard_sizes: np.ndarray, num_canonical_nodes: int, seed: int,
                 epoch: int) -> tuple[list, list, np.random.Generator]:
    """py1e's first steps, in its order: shards in a run-wide shuffled order cut at canonical node
    boundaries, then each node's spans shuffled this epoch; the epoch's generator, for what follows."""
    spans, num_samples = [], 0
    for shard_size in shard_sizes:
        spans.append((num_samples, num_samples + shard_size))
        num_samples += shard_size
    np.random.default_rng(seed).shuffle(spans)
    spans, node_spans = divide_spans(spans, num_samples, num_canonical_nodes)
    epoch_rng = np.random.default_rng(seed + epoch)
    for begin, end in node_spans:
        part = spans[begin:end]
        epoch_rng.shuffle(part)
        spans[begin:end] = part
    return spans, node_spans, epoch_rng


def _shuffle_within_spans(out: np.ndarray, spans: list, epoch_rng: np.random.Generator,
                          num_canonical_nodes: int) -> None:
    """A canonical node's sample ids, span after span, each span's shuffled."""
    if not len(out):
        raise ValueError(f"The number of samples assigned to a canonical node is 0: the stream has fewer "
                         f"samples than num_canonical_nodes ({num_canonical_nodes}); reduce num_canonical_nodes.")
    inserted = 0
    for begin, end in spans:
        span_samples = np.arange(begin, end)
        epoch_rng.shuffle(span_samples)
        out[inserted:inserted + end - begin] = span_samples
        inserted += end - begin


def _shift_range(epoch_rng: np.random.Generator, block_size: int, span_size: int, span_offset: int,
                 node_samples: int) -> tuple[float, float, bool]:
    """The bounds of a span's uniform shifts (a block drawn around it, kept inside the node), and
    whether the block was smaller than the span, as py1e computes them."""
    block = epoch_rng.integers(int(0.75 * block_size), int(1.25 * block_size))
    cutoff = (block - span_size) / 2
    unshuffled = cutoff < 0
    if unshuffled:
        cutoff = 0
    return max(-cutoff, -span_offset), min(cutoff, node_samples - span_offset - span_size), unshuffled


def _warn_if_unshuffled(unshuffled_spans: bool) -> None:
    if unshuffled_spans:
        warnings.warn("Shuffle block size was smaller than shard size for some shards. This will result in "
                      "these shards not being shuffled with other shards. Set shuffle_block_size to a larger "
                      "value for a higher quality shuffle.")


def divide_spans(spans: list[tuple[int, int]], num_samples: int,
                 num_parts: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Streaming's cut of shard spans at the parts' bounds (part p ends at num_samples * (p + 1) // num_parts): a span
    across a bound is split there; an empty span goes to the first part whose end it does not pass. The pieces, and
    each part's range of them (tests/test_lazy_shuffle.py checks it against stock's on random layouts)."""
    pieces, parts, at, index = [], [], 0, 0
    for part in range(num_parts):
        end, first = num_samples * (part + 1) // num_parts, len(pieces)
        while index < len(spans):
            begin, stop = spans[index]
            if at + stop - begin <= end:
                pieces.append((begin, stop))
                at += stop - begin
                index += 1
                continue
            if at < end:  # the span crosses the bound: its head here, its tail starts the next part
                pieces.append((begin, begin + end - at))
                spans[index] = (begin + end - at, stop)
                at = end
            break
        parts.append((first, len(pieces)))
    return pieces, parts
