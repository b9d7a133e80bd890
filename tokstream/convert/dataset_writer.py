"""Writing a dataset: one SplitWriter per split (token stream -> samples -> shards), then the metadata.

Every converter writes through this: text in one pass or merged from parts, and token files.
"""

from collections.abc import Callable
from pathlib import Path

import numpy as np

from tokstream.convert.options import ConversionOptions
from tokstream.convert.resume import ShardJournal, SplitState, discard_state
from tokstream.convert.staging import Staging
from tokstream.errors import UserError
from tokstream.format import (BlockPacker, DatasetMetadata, ShardWriter, SplitStats, stored_file, token_dtype,
                              write_metadata)
from tokstream.tokenizer import Tokenizer


class SplitWriter:
    """Packs one split's token stream into samples and writes them as shards, counting as it goes.

    The shard writer is opened with the first sample, so a split that never gets one leaves no
    files. With `journal`, each completed shard is journaled (resume.ShardJournal) for resuming.
    """

    def __init__(self, name: str, directory: Path, metadata: DatasetMetadata, options: ConversionOptions,
                 on_file: Callable[[Path], None] | None = None, journal: bool = False):
        self.name, self.directory, self.metadata, self.options = name, directory, metadata, options
        self.on_file = on_file  # told of each finished shard file (staging.on_file: an uploader, say)
        self.journal = ShardJournal(self.directory) if journal else None
        self.packer = BlockPacker(metadata.block_size, metadata.np_dtype)
        self.documents = 0
        self.writer: ShardWriter | None = None

    def _open_writer(self) -> ShardWriter:
        if self.writer is None:
            self.writer = ShardWriter(self.directory, self.metadata, self.options.shard_size, self.options.compression,
                                      list(self.options.hashes), on_file=self.on_file, journal=self.journal)
        return self.writer

    def add(self, tokens: np.ndarray, documents: int) -> None:
        """Append tokens to the split's stream; `documents` is how many documents they complete."""
        self.documents += documents
        samples = self.packer.add(tokens)
        if len(samples):
            self._open_writer().write(samples)

    def state_dict(self) -> SplitState:
        """Everything needed to continue this split exactly where it stands."""
        packer = self.packer.state_dict()
        if self.writer is not None:
            written = self.writer.state_dict()
        else:
            written = {"shards": [], "buffered": np.empty((0, self.metadata.sample_length), self.metadata.np_dtype)}
        return SplitState(shards=written["shards"], documents=self.documents, tokens=packer["tokens"],
                          samples=packer["samples"], buffered=written["buffered"], pending=packer["pending"])

    def load_state_dict(self, state: SplitState) -> None:
        self.documents = state.documents
        self.packer.load_state_dict({"tokens": state.tokens, "samples": state.samples, "pending": state.pending})
        if state.shards or len(state.buffered):
            self._open_writer().load_state_dict({"shards": state.shards, "buffered": state.buffered})

    def finish(self) -> SplitStats:
        """Write the last shard and the index; refuse a split without a single sample."""
        if self.writer is None:
            hint = " or --val-fraction 0" if self.name == "val" else ""
            raise UserError(
                f"the {self.name} split got {self.packer.tokens} tokens from {self.documents} documents, fewer "
                f"than one sample of block_size + 1 = {self.metadata.block_size + 1}: use more data, a "
                f"smaller --block-size{hint}"
            )
        self.writer.finish()
        shards = self.writer.shards
        return SplitStats(documents=self.documents, tokens=self.packer.tokens, samples=self.packer.samples,
                          dropped_tokens=self.packer.dropped_tokens, shards=len(shards),
                          bytes=sum(stored_file(s)["bytes"] for s in shards))


def text_metadata(tokenizer: Tokenizer, options: ConversionOptions, description: dict) -> DatasetMetadata:
    """The metadata of a text conversion, before any counts are known."""
    return DatasetMetadata(
        tokenizer=tokenizer.name, tokenizer_sha256=tokenizer.sha256, vocab_size=tokenizer.vocab_size,
        separator_id=tokenizer.separator_id, separator_position=tokenizer.separator_position,
        block_size=options.block_size, dtype=token_dtype(tokenizer.vocab_size).name, source=description,
        split={"method": "blake2b-of-text", "seed": options.seed, "val_fraction": options.val_fraction},
    )


def finish_dataset(staging: Staging, metadata: DatasetMetadata, outputs: dict[str, SplitWriter],
                   extra: dict) -> None:
    """Close every split, then write the metadata: the record of a complete dataset comes last."""
    if sum(o.documents for o in outputs.values()) == 0:
        raise UserError("the input holds no documents: nothing to convert")
    metadata.splits = {name: output.finish() for name, output in outputs.items()}
    metadata.extra = extra
    discard_state(staging.path)
    write_metadata(staging.path, metadata)
