"""Streaming's epoch order, the same numbers, computed without a Python step or a full array per sample.

At every epoch start and every resume the first rank of each node computes the epoch's sample order
before any rank gets a batch: at OpenWebText's 8.8 M samples that took seconds (bench/scale.py).
The replacements here return what streaming's functions return, and are put in their place when
this module is imported (through streaming_internals.py, as every use of streaming's internals):

- `get_sampling_vectorized` for streaming's `get_sampling`: how many samples an epoch draws from
  each shard when it draws a fraction of a stream (every epoch cut to whole steps does);
- `permutation_tail`: the last entries of numpy's `Generator.permutation`, which is all that
  sampling needs when an epoch leaves out only a few samples;
- `get_shuffle_py1e_fast` for streaming's `py1e` shuffle (the default): the same random draws,
  sorted as packed integers, in 2 arrays of the epoch's size instead of 5;
- `generate_work_random` for streaming's `random` batching (the default), which puts the three
  together with the partition over nodes, ranks and workers: the same array, composed in place,
  each epoch-sized array dropped once used rather than all alive at once.

Each is tested equal to the original on random inputs (tests/test_epoch_order.py).
"""

import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tokstream.reader.streaming_door import streaming_internals as internals
from tokstream.reader.streaming_door.streaming_internals import divide_spans, get_partitions, get_shuffle, stock_get_sampling

# Below this many left-out picks, drawing them one by one in Python beats a whole permutation.
MAX_TAIL = 100_000


def get_sampling_vectorized(samples_per_shard: np.ndarray, choose: int, granularity: int, seed: int, epoch: int,
                            use_epoch: bool) -> np.ndarray:
    """streaming's `get_sampling`, the same numbers, without its Python loop over every sample.

    When a stream's epoch draws a fraction of its samples, streaming shuffles the stream's "picks"
    (one per sample at granularity 1) and adds them up in a Python loop until the epoch is full:
    12-21 s at 8.8 M samples on this machine. At streaming's default granularity of one sample per
    pick, the loop takes the first `remainder` shuffled picks, which is a slice and a count per shard.
    """
    num_samples = int(np.sum(samples_per_shard))
    if granularity != 1 or choose < 0 or seed < 0 or epoch < 0 or not choose % num_samples:
        # Its checks, its whole-repeat case, and a sampling_granularity this project never sets.
        return stock_get_sampling(samples_per_shard, choose, granularity, seed, epoch, use_epoch)
    remainder, epoch_seed = choose % num_samples, seed + epoch if use_epoch else seed
    ends = np.cumsum(samples_per_shard)
    whole = samples_per_shard * (choose // num_samples)

    def per_shard(picks: np.ndarray) -> np.ndarray:
        return np.bincount(np.searchsorted(ends, picks, side="right"), minlength=len(samples_per_shard))

    if num_samples - remainder <= MAX_TAIL:
        # An epoch cut to whole steps leaves out fewer picks than a step: count those, drawn alone.
        return whole + samples_per_shard - per_shard(permutation_tail(epoch_seed, num_samples, num_samples - remainder))
    ordering = np.random.default_rng(epoch_seed).permutation(num_samples)
    if remainder <= num_samples // 2:
        return whole + per_shard(ordering[:remainder])
    return whole + samples_per_shard - per_shard(ordering[remainder:])


def permutation_tail(seed: int, n: int, count: int) -> np.ndarray:
    """`np.random.default_rng(seed).permutation(n)[n - count:]`, in time and memory of `count`, not `n`.

    numpy's permutation is a Fisher-Yates shuffle of arange(n) that fixes the last position first:
    for i from n - 1 down, it swaps position i with j = random_interval(i), the smallest all-ones mask
    over i applied to 32-bit draws (64-bit above 2^32 - 1) until one is at most i. PCG64 serves a
    32-bit draw as the low half of a 64-bit one and keeps the high half for the next. So the last
    `count` positions need only the first `count` swaps, replayed here on the few positions they touch.
    """
    bits = np.random.PCG64(seed)  # what default_rng(seed) draws from
    moved: dict[int, int] = {}  # position -> value, where the swaps so far changed arange(n)
    tail = np.empty(count, np.int64)
    spare: int | None = None  # the high half of the last 64-bit draw, served as the next 32-bit one
    first = n - count
    for i in range(n - 1, max(first, 1) - 1, -1):
        mask = (1 << i.bit_length()) - 1
        while True:
            if i > 0xFFFFFFFF:
                value = int(bits.random_raw())
            elif spare is None:
                raw = int(bits.random_raw())
                value, spare = raw & 0xFFFFFFFF, raw >> 32
            else:
                value, spare = spare, None
            value &= mask
            if value <= i:
                break
        tail[i - first] = moved.get(value, value)
        moved[value] = moved.get(i, i)
    if first == 0:  # position 0 is never drawn for: it keeps what the swaps left there
        tail[0] = moved.get(0, 0)
    return tail


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


def generate_work_random(dataset, world, epoch: int, sample_in_epoch: int) -> np.ndarray:
    """streaming's `generate_work_random_batching`, the same array, with fewer epoch-sized arrays alive.

    Stock resamples the streams, makes the partition of the epoch over nodes, ranks, workers and
    batches, shuffles, and composes the three by two `np.where` copies, all alive at once. Here the
    resampling's draws run in a thread beside the shuffle's (numpy lets go of the GIL in both), its
    mapping is composed into the shuffle and the shuffle into the partition, in place, and each array
    is dropped once used. Only the local leader of each node runs this (in `_get_work`).
    """
    if dataset.num_canonical_nodes is None:
        raise RuntimeError("`num_canonical_nodes` can never be None. Provide a positive integer.")
    if not isinstance(dataset.batch_size, int):
        raise TypeError(f"Batch size must be an integer. Got {type(dataset.batch_size)}.")
    order = epoch_sequence(dataset, epoch)
    ids = get_partitions(dataset.partition_algo, dataset.epoch_size, dataset.num_canonical_nodes, world.num_nodes,
                         world.ranks_per_node, world.workers_per_rank, dataset.batch_size, sample_in_epoch,
                         dataset.initial_physical_nodes)
    return _look_up_in_place(ids, order)


def order_file_sequence(inputs, epoch: int) -> np.ndarray:
    """An epoch's order for order/order_files.py (OrderInputs.compute): streaming's, as the readers compute it with the
    door installed (the same numbers as stock, faster), in whatever process builds the file."""
    from tokstream.reader import streaming_door

    streaming_door.install()
    return epoch_sequence(inputs, epoch)


def epoch_sequence(dataset, epoch: int) -> np.ndarray:
    """The epoch's samples in streaming's order, before the partition deals them out: position -> sample id
    (the array `generate_work_random` indexes with the partition; order_files.py keeps it as a file)."""
    if dataset.shuffle and not isinstance(dataset.shuffle_block_size, int):
        raise TypeError(f"Dataset `shuffle_block_size` must be an integer. Got {type(dataset.shuffle_block_size)} "
                        "instead.")
    stock = internals.StreamingDataset.resample_streams
    if getattr(type(dataset), "resample_streams", stock) is not stock:  # order files' inputs: stock's, by definition
        units, order = dataset.resample_streams(epoch)  # a subclass's own resampling
        shuffle = _shuffle(dataset, units, epoch)
    else:
        units, shards = resampled_shards(dataset, epoch)
        with ThreadPoolExecutor(1) as pool:
            mapping = pool.submit(resampled_sample_ids, dataset, epoch, shards)
            shuffle = _shuffle(dataset, units, epoch)
            order = mapping.result()  # resampled ("big") id -> sample id
            del mapping  # it would hold the mapping alive through the partition, after it is composed
    if shuffle is not None:
        order = _look_up_in_place(shuffle, order)
    return order


def _shuffle(dataset, units: np.ndarray, epoch: int) -> np.ndarray | None:
    if not dataset.shuffle:
        return None
    return get_shuffle(dataset.shuffle_algo, units, dataset.num_canonical_nodes, dataset.shuffle_seed, epoch,
                       dataset.shuffle_block_size)


def resampled_shards(dataset, epoch: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """The first half of streaming's `resample_streams`: how many samples the epoch takes from each
    shard, as the shuffle's units (each whole repeat of a shard, then the part), and per shard
    (shard id, its samples, how many the epoch takes)."""
    units, shards = [], []
    for stream_id in range(dataset.num_streams):
        shard_ids = dataset.shard_offset_per_stream[stream_id] + np.arange(dataset.shards_per_stream[stream_id])
        sizes = dataset.samples_per_shard[shard_ids]
        takes = get_sampling_vectorized(sizes, dataset.streams[stream_id].choose, dataset.sampling_granularity,
                                        dataset.shuffle_seed, epoch, dataset.epoch_seed_change)
        for shard_id, size, take in zip(shard_ids.tolist(), sizes.tolist(), takes.tolist()):
            if size:
                units += [size] * (take // size) + ([take % size] if take % size else [])
            shards.append((shard_id, size, take))
    return np.array(units, np.int64), shards


def resampled_sample_ids(dataset, epoch: int, shards: list[tuple[int, int, int]]) -> np.ndarray:
    """The second half of `resample_streams`: each resampled ("big") id's sample, from the same
    generator by the same calls, written into one array rather than concatenated from pieces.

    An epoch cut to whole steps leaves a sample or two out of most shards, so nearly every shard's
    part is drawn (`choice`) and put in order: by a mask, not a sort of each shard's ids (0.3 s of
    sorting at 8.8 M samples on this machine, beside the shuffle that the first batch waits on)."""
    seed = dataset.shuffle_seed + epoch if dataset.sampling_method == "balanced" else dataset.shuffle_seed
    rng = np.random.default_rng(seed)
    ids = np.empty(sum(take for _, _, take in shards), np.int64)
    at = 0
    for shard_id, size, take in shards:
        if not size:
            continue
        offset = int(dataset.sample_offset_per_shard[shard_id])
        for _ in range(take // size):
            ids[at:at + size] = np.arange(offset, offset + size)
            at += size
        if part := take % size:
            picked = np.zeros(size, bool)  # sorted, as stock sorts them: they are distinct, so a mask will do
            picked[rng.choice(size, part, False)] = True
            ids[at:at + part] = offset + np.flatnonzero(picked)
            at += part
    return ids


def _look_up_in_place(indices: np.ndarray, table: np.ndarray) -> np.ndarray:
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
