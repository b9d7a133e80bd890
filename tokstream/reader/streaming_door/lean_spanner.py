"""streaming's Spanner (which shard holds global sample i), built in O(shards).

Every rank builds one when its dataset is created. Stock lists each sample's shard (np.repeat) and keeps, for
each span of 1,024 samples, an array of the shards it touches: at 880 M samples, 860 K arrays and 0.25 s per
rank even without the per-sample list. A lookup here is a binary search of the shards' bounds, which answers
the same (shard, index in shard) and needs nothing per span. Put in streaming's place by the door's install().
"""

import bisect

import numpy as np

from tokstream.reader.streaming_door import streaming_internals as internals


class LeanSpanner(internals.Spanner):
    """Stock Spanner's fields and answers, without its spans (`spans` is made only if asked for). Tested equal
    (tests/test_epoch_order.py)."""

    def __init__(self, shard_sizes: np.ndarray, span_size: int = 1 << 10) -> None:
        if not len(shard_sizes):
            super().__init__(shard_sizes, span_size)  # stock's own failure
            return
        self.shard_sizes = shard_sizes
        self.span_size = span_size
        self.num_samples = sum(shard_sizes)
        self.shard_bounds = np.concatenate([np.zeros(1, np.int64), shard_sizes.cumsum()])
        self._bounds = self.shard_bounds.tolist()  # bisect on a list: a lookup is ~0.5 us at 27 K shards

    def __getitem__(self, index: int) -> tuple[int, int]:
        if not (0 <= index < self.num_samples):
            raise IndexError(f'Invalid sample index `{index}`: 0 <= {index} < {self.num_samples}')
        # The last shard whose start is at or before the index: empty shards share their start with the next one.
        shard = bisect.bisect_right(self._bounds, index) - 1
        return shard, int(index - self._bounds[shard])

    @property
    def spans(self) -> list[np.ndarray]:
        """Stock's per-span shard arrays, for whoever reads them (nothing in streaming does)."""
        return internals.Spanner(self.shard_sizes, self.span_size).spans
