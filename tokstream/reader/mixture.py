"""A mixture of converted datasets (data.streams): its sources, and how many samples each gives an epoch.

A single `data.remote` is a mixture of one source, so training reads every dataset one way: as
streaming Streams, each drawing a fixed number of samples per epoch (its `choose`). Those numbers
follow streaming's own weights:

- proportion: the epoch holds all sources' samples together, shared out in these proportions;
- repeat (x the source's samples) or choose (samples), or no weight (every sample once): each
  source's own count, the epoch their sum.

The epoch is then cut down to whole steps (BatchPlan.epoch_unit), shared out in the same ratios by
largest remainder, in exact arithmetic. Counts that already fit are kept exactly. Which samples a
source gives an epoch, and the order, are streaming's (a source drawn below its size gives a
different subset each epoch; above it, whole repeats plus a subset).
"""

import hashlib
import math
import os
from dataclasses import dataclass
from fractions import Fraction

from tokstream.errors import UserError
from tokstream.format import DatasetMetadata
from tokstream.reader.config import DataConfig

WEIGHTS = ("proportion", "repeat", "choose")


@dataclass(frozen=True)
class Source:
    """One dataset of the mixture, its settings resolved."""

    key: str  # where it is configured: data.remote or data.streams.N
    name: str  # its label in metrics
    remote: str
    local: str | None
    weight: str | None  # proportion, repeat, choose, or None (every sample once)
    value: float | None

    @property
    def where(self) -> str:
        return self.key if self.key == "data.remote" else f"{self.key} ({self.name})"


def _default_name(remote: str) -> str:
    return os.path.basename(remote.rstrip("/")) or remote


def sources(config: DataConfig) -> list[Source]:
    """The mixture's sources, checked: one line naming the odd one when a setting is wrong."""
    if not config.streams:
        return [Source("data.remote", _default_name(config.remote), config.remote, config.local, None, None)]
    if config.remote:
        raise UserError(f"data.remote={config.remote} and data.streams are both set: give one dataset in "
                        "data.remote or a mixture in data.streams")
    resolved = []
    for index, stream in enumerate(config.streams):
        key = f"data.streams.{index}"
        if not stream.remote:
            raise UserError(f"{key} has no remote: give each source's dataset root (data.streams.{index}.remote=...)")
        name = stream.name or _default_name(stream.remote)
        given = [(w, getattr(stream, w)) for w in WEIGHTS if getattr(stream, w) is not None]
        if len(given) > 1:
            raise UserError(f"{key} ({name}) sets {' and '.join(w for w, _ in given)}: give at most one weight")
        weight, value = given[0] if given else (None, None)
        if value is not None and not value > 0:
            raise UserError(f"{key} ({name}): {weight}={value} draws nothing; give a positive weight, or remove "
                            "the source")
        local = stream.local or (os.path.join(config.local, name) if config.local else None)
        resolved.append(Source(key, name, stream.remote, local, weight, value))
    first = resolved[0]
    for index, source in enumerate(resolved[1:], start=1):
        if (source.weight == "proportion") != (first.weight == "proportion"):
            raise UserError(f"{source.where} is weighted by {source.weight or 'nothing'}, {first.where} by "
                            f"{first.weight or 'nothing'}: give every source a proportion, or none of them one "
                            "(repeat, choose or nothing)")
        for other in resolved[:index]:
            if source.remote.rstrip("/") == other.remote.rstrip("/"):
                raise UserError(f"{source.where} and {other.where} read the same dataset {source.remote}: "
                                "give it one source and a larger weight")
            if source.name == other.name:
                raise UserError(f"{source.key} and {other.key} are both named {source.name!r}: set data.streams.N.name")
    return resolved


# What makes a token id mean the same to a model; a mixture's sources also share how samples are laid out.
MEANING = ("vocab_size", "separator_id", "separator_position")
LAYOUT = ("block_size", "dtype")


def token_difference(first: DatasetMetadata, other: DatasetMetadata, layout: bool = True) -> tuple | None:
    """(key, other's value, first's) of the first setting in which `other`'s tokens differ from `first`'s, or
    None. The tokenizer's file identifies it where both record one; its name otherwise."""
    identity = "tokenizer_sha256" if first.tokenizer_sha256 and other.tokenizer_sha256 else "tokenizer"
    for key in (identity, *MEANING, *(LAYOUT if layout else ())):
        if getattr(other, key) != getattr(first, key):
            return key, getattr(other, key), getattr(first, key)
    return None


def check_same_tokens(sources: list[Source], metadata: list[DatasetMetadata]) -> None:
    """Refuse sources whose samples do not mean the same to the model."""
    for source, other in zip(sources[1:], metadata[1:]):
        difference = token_difference(metadata[0], other)
        if difference is not None:
            key, value, first = difference
            raise UserError(f"{source.where} at {source.remote} has {key}={value!r}, {sources[0].where} {first!r}: a "
                            "mixture's sources must share tokenizer, vocabulary, block size and dtype; reconvert one "
                            "of them")


def apportion(total: int, weights: list[float | int]) -> list[int]:
    """`total` shared out in proportion to `weights`, by largest remainder (ties to the first), exactly."""
    exact = [Fraction(w) for w in weights]
    scale = Fraction(total) / sum(exact)
    shares = [w * scale for w in exact]
    counts = [math.floor(share) for share in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts


def samples_per_epoch(sources: list[Source], split_samples: list[int], unit: int) -> list[int]:
    """Each source's samples per epoch: its weight's, the epoch cut to a multiple of `unit`.

    May be all zeros (the mixture holds less than one unit); a source's zero is refused here.
    """
    if sources[0].weight == "proportion":
        total, weights = sum(split_samples), [s.value for s in sources]
    else:
        weights = [int(s.value * n) if s.weight == "repeat" else s.value if s.weight == "choose" else n
                   for s, n in zip(sources, split_samples)]
        total = sum(weights)
    counts = apportion(total // unit * unit, weights) if total >= unit else [0] * len(sources)
    if any(counts):
        for source, count in zip(sources, counts):
            if count == 0:
                raise UserError(f"{source.where} gives no sample to an epoch of {sum(counts)}: raise its "
                                f"{source.weight or 'weight'}, or remove the source")
    return counts


def identity(source_identities: list[str]) -> str:
    """A mixture's identity from its sources' (a single source keeps its own, so older runs resume)."""
    if len(source_identities) == 1:
        return source_identities[0]
    return hashlib.sha256("+".join(source_identities).encode()).hexdigest()[:16]


def describe_epoch(sources: list[Source], split_samples: list[int], counts: list[int], global_batch_size: int) -> str:
    """One line for the start of a run: the epoch's steps and what each source gives it."""
    epoch = sum(counts)
    head = f"epochs of {epoch // global_batch_size} steps: {epoch} samples"
    if len(sources) == 1:
        left_out = split_samples[0] - epoch
        return head + (f", {left_out} of the split left out of each epoch (a different few each time)" if left_out
                       else ", the whole split")
    shares = [f"{source.name} {count} ({count / epoch:.1%}, {count / samples:.2f}x its {samples})"
              for source, count, samples in zip(sources, counts, split_samples)]
    return head + ": " + ", ".join(shares)
