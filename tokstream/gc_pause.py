"""Used by the reader (reader/token_dataset.py), the split check (split_check.py) and a rank's start-up
(train/process_start.py): Python's cyclic garbage collector paused while many long-lived objects are made, here
a dataset's index read into objects.

Opening a dataset makes a few Python objects per shard (the parsed index.json, streaming's shard readers): at
27,474 shards (880 M samples of 1,025 tokens) some 800 K of them, all long-lived. Each generational collection
those allocations trigger walks every object made so far, which is quadratic in the shards: building the dataset
at that size took 0.91-1.01 s with the collector on and 0.46-0.48 s paused (one rank, 2 cores; the first batch's
figures in bench/README.md, "First batch as the dataset grows"). Nothing made there is cyclic garbage; the one
collection of them all happens later, once. The collector's state is restored afterwards. Process-wide, as Python's
collector is: the project builds datasets in the main thread only."""

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collections inside the block; the collector as it was after it (nested blocks too)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
