"""Python's cyclic garbage collector paused while a dataset's index is read into objects.

Opening a dataset makes a few Python objects per shard (the parsed index.json, streaming's shard readers): at
27,474 shards (880 M samples of 1,025 tokens) some 800 K of them, all long-lived. Each generational collection
those allocations trigger walks every object made so far, which is quadratic in the shards: 45 % of a rank's
0.99 s to build its dataset at that size (bench/README.md, "First batch as the dataset grows"). Nothing made
there is cyclic garbage, so pausing loses nothing; the collector's state is restored afterwards."""

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
