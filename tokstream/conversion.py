"""Text documents to a block-aligned MDS dataset: the core every text converter calls."""

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tokstream.conversion_state import STATE_FILE, SplitState, discard_state, load_state, save_state
from tokstream.errors import UserError
from tokstream.format import (SPLITS, BlockPacker, DatasetMetadata, SplitStats, ShardWriter,
                              token_dtype, write_metadata)
from tokstream.sources import DocumentSource
from tokstream.staging import Staging, file_stamp, staged_output
from tokstream.tokenize_docs import TokenizedBatch, tokenize_documents
from tokstream.tokenizer import Tokenizer


@dataclass
class ConversionOptions:
    block_size: int = 1024
    val_fraction: float = 0.0005
    seed: int = 2357
    num_workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    max_docs: int | None = None
    shard_size: str = "64mb"
    compression: str | None = None
    hashes: tuple[str, ...] = ("xxh64",)
    overwrite: bool = False
    progress: bool = True
    staging_dir: str | None = None  # local scratch for S3 outputs (default: the system temp dir)
    state_interval_s: float = 60.0  # how often a local one-pass conversion saves its state for resuming

    def validate(self) -> None:
        if self.block_size < 1:
            raise UserError(f"--block-size must be at least 1, got {self.block_size}")
        if not 0 <= self.val_fraction < 1:
            raise UserError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_docs is not None and self.max_docs < 1:
            raise UserError(f"--max-docs must be at least 1, got {self.max_docs}")


class SplitWriter:
    """Packs one split's token stream into samples and writes them, opening the writer lazily."""

    def __init__(self, name: str, directory: Path, metadata: DatasetMetadata, options: ConversionOptions,
                 on_file=None):
        self.name, self.directory, self.metadata, self.options = name, directory, metadata, options
        self.on_file = on_file
        self.packer = BlockPacker(metadata.block_size, metadata.np_dtype)
        self.stats = SplitStats()
        self.writer = None

    def _open_writer(self, shards: list[dict] | None = None) -> ShardWriter:
        if self.writer is None:
            self.writer = ShardWriter(self.directory, self.metadata, self.options.shard_size,
                                      self.options.compression, list(self.options.hashes), on_file=self.on_file,
                                      resume_shards=shards)
        return self.writer

    def add(self, tokens, documents: int) -> None:
        self.stats.documents += documents
        samples = self.packer.add(tokens)
        if len(samples):
            self._open_writer().write(samples)

    def snapshot(self) -> SplitState:
        """Everything needed to continue this split exactly where it stands (see conversion_state)."""
        writer = self.writer
        buffered = (writer.body[: writer.pending_count].copy() if writer is not None
                    else np.empty((0, self.metadata.sample_length), dtype=self.metadata.np_dtype))
        return SplitState(shards=list(writer.shards) if writer is not None else [], documents=self.stats.documents,
                          tokens=self.packer.tokens, samples=self.packer.samples, buffered=buffered,
                          pending=self.packer.pending.copy())

    def restore(self, state: SplitState) -> None:
        self.stats.documents = state.documents
        self.packer.tokens, self.packer.samples, self.packer.pending = state.tokens, state.samples, state.pending
        if state.shards or len(state.buffered):
            self._open_writer(state.shards).write(state.buffered)  # fewer than a shard: nothing is written yet

    def finish(self) -> SplitStats:
        stats = self.stats
        if self.writer is None:
            hint = " or --val-fraction 0" if self.name == "val" else ""
            raise UserError(
                f"the {self.name} split got {self.packer.tokens} tokens from {stats.documents} documents, fewer "
                f"than one sample of block_size + 1 = {self.metadata.block_size + 1}: use more data, a "
                f"smaller --block-size{hint}"
            )
        self.writer.finish()
        return self.writer.split_stats(self.packer, stats.documents)


def new_metadata(tokenizer: Tokenizer, options: ConversionOptions, description: dict) -> DatasetMetadata:
    """The metadata of a text conversion, before any counts are known."""
    return DatasetMetadata(
        tokenizer=tokenizer.name, vocab_size=tokenizer.vocab_size, eot_id=tokenizer.eot_id,
        block_size=options.block_size, dtype=token_dtype(tokenizer.vocab_size).name, source=description,
        split={"method": "blake2b-of-text", "seed": options.seed, "val_fraction": options.val_fraction},
    )


def split_names(options: ConversionOptions) -> tuple[str, ...]:
    return SPLITS if options.val_fraction > 0 else ("train",)


def tokenized_batches(documents: Iterable[str], tokenizer: Tokenizer, options: ConversionOptions,
                      dtype, fingerprints: bool = False, skip: int = 0) -> Iterator[TokenizedBatch]:
    """Tokenized batches in input order, behind a progress bar (docs/s, tokens/s).

    The first `skip` documents are read (and pass through any cleaning) but not tokenized.
    """
    documents = itertools.islice(itertools.islice(documents, options.max_docs), skip, None)
    started = time.monotonic()
    total_tokens = 0
    with tqdm(unit=" docs", desc="tokenizing", disable=not options.progress, total=options.max_docs,
              initial=skip, smoothing=0.1, delay=2) as bar:
        for batch in tokenize_documents(documents, tokenizer, options.seed, options.val_fraction, dtype,
                                        options.num_workers, fingerprints):
            yield batch
            total_tokens += len(batch.train) + len(batch.val)
            bar.update(batch.train_docs + batch.val_docs)
            bar.set_postfix_str(f"{total_tokens / max(time.monotonic() - started, 1e-9) / 1e6:.2f}M tok/s",
                                refresh=False)


def finish_dataset(staging: Staging, metadata: DatasetMetadata, outputs: dict[str, "SplitWriter"],
                   extra: dict) -> None:
    """Close every split, then write the metadata: the record of a complete dataset comes last."""
    if sum(o.stats.documents for o in outputs.values()) == 0:
        raise UserError("the input holds no documents: nothing to convert")
    metadata.splits = {name: output.finish() for name, output in outputs.items()}
    metadata.extra = extra
    discard_state(staging.path)
    write_metadata(staging.path, metadata)


def resume_key(source: DocumentSource, tokenizer: Tokenizer, options: ConversionOptions) -> dict:
    """What must match for an interrupted one-pass conversion to be continued rather than redone.

    In its JSON form (tuples as lists), as it is compared with the copy the interrupted run stored.
    """
    inputs = source.description
    if inputs.get("kind") == "local":
        inputs = {**inputs, "stat": [file_stamp(f) for f in inputs["files"]]}
    settings = {k: getattr(options, k) for k in ("block_size", "val_fraction", "seed", "max_docs", "shard_size",
                                                  "compression", "hashes")}
    key = {"inputs": inputs, "tokenizer": [tokenizer.name, tokenizer.ranks_file], **settings}
    return json.loads(json.dumps(key))


def convert_documents(source: DocumentSource, tokenizer: Tokenizer, out: str, options: ConversionOptions,
                      documents: Iterable[str] | None = None, reports: tuple = ()) -> DatasetMetadata:
    """Tokenize, split, pack and write; `out` appears only once everything is written.

    `documents` replaces iterating the source directly (a cleaning stage, say); each dataclass in
    `reports` is recorded in the metadata's `extra` once the input is consumed. The state is saved every
    `state_interval_s` (on S3 too, once the shards it names are up), and the same command after a
    kill continues from it.
    """
    options.validate()
    metadata = new_metadata(tokenizer, options, source.description)
    key = resume_key(source, tokenizer, options)
    with staged_output(out, options.overwrite, options.staging_dir, resume_key=key) as staging:
        outputs = {name: SplitWriter(name, staging.path / name, metadata, options, staging.on_file)
                   for name in split_names(options)}
        next_document = 0
        saved = load_state(staging.path, staging.shard_intact) if staging.resumed else None
        if saved is not None:
            next_document, states = saved
            for name, state in states.items():
                outputs[name].restore(state)
            print(f"resuming {out}: {sum(len(s.shards) for s in states.values())} shards verified; re-reading "
                  f"the first {next_document:,} documents, tokenizing from there")
        last_save = time.monotonic()
        for batch in tokenized_batches(source if documents is None else documents, tokenizer, options,
                                       metadata.np_dtype, skip=next_document):
            outputs["train"].add(batch.train, batch.train_docs)
            if batch.val_docs:
                outputs["val"].add(batch.val, batch.val_docs)
            next_document += batch.train_docs + batch.val_docs
            if time.monotonic() - last_save >= options.state_interval_s:
                save_state(staging.path, next_document, {n: o.snapshot() for n, o in outputs.items()})
                if staging.publish is not None:
                    staging.publish(staging.path / STATE_FILE)
                last_save = time.monotonic()
        extra = {"invalid_utf8_documents_replaced": source.stats.invalid_utf8_docs}
        for report in reports:
            extra.update(dataclasses.asdict(report))
        finish_dataset(staging, metadata, outputs, extra)
    return metadata


def summary(metadata: DatasetMetadata, out: str, seconds: float) -> str:
    """Human-readable closing lines for a conversion."""
    lines = [f"wrote {out} ({metadata.tokenizer}, block_size {metadata.block_size}, {metadata.dtype})"]
    tokens = 0
    for name, s in metadata.splits.items():
        tokens += s.tokens
        lines.append(f"  {name:5s} {s.documents:>10,} docs {s.tokens:>14,} tokens {s.samples:>11,} samples "
                     f"{s.dropped_tokens:>6,} dropped tail tokens {s.shards:>5} shards {s.bytes / 1e6:>9.1f} MB")
    replaced = metadata.extra.get("invalid_utf8_documents_replaced", 0)
    if replaced:
        lines.append(f"  {replaced} documents had invalid UTF-8 bytes, replaced with U+FFFD")
    dropped = {k: v for k, v in metadata.extra.items() if k in ("empty", "duplicates") and v}
    if dropped:
        lines.append("  dropped documents: " + ", ".join(f"{v:,} {k}" for k, v in dropped.items()))
    lines.append(f"  {seconds:.1f} s, {tokens / max(seconds, 1e-9) / 1e6:.2f} M tokens/s")
    return "\n".join(lines)
