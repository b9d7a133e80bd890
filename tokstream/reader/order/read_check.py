"""A step's samples as two numbers that a run records and the ledger recomputes: what the run read is checked
against what the order says it read, on any world size.

Each id's two 31-bit keyed hashes are summed over the step: the sums do not depend on which rank read which sample
or in what order, so each rank sums its own and one all-reduce adds them up (no overflow below 2^32 samples a step).
Two different steps give the same sums with a chance of about 2^-62."""

import numpy as np

from tokstream.reader.order.keyed import key

_LOW31 = np.uint64((1 << 31) - 1)


def read_sums(sample_ids) -> np.ndarray:
    """The two sums of these samples (int64), to be added across ranks."""
    hashed = key(np.asarray(sample_ids, np.int64).reshape(-1), 0x5EAD)
    return np.array([int((hashed & _LOW31).sum()), int(((hashed >> np.uint64(33)) & _LOW31).sum())], np.int64)


def read_digest(sums) -> str:
    """The step's record of what it read (metrics.jsonl's "read")."""
    first, second = (int(s) for s in sums)
    return f"{first:016x}{second:016x}"
