"""Text to a dataset in one pass, resumable: the core of owt_to_mds.py and text_to_mds.py without --num-parts.

Documents are read in order, tokenized in parallel (tokenize_docs.py), split by content hash and
packed into each split's shards (dataset_writer.py). Between batches, every `state_interval_s`,
the position is saved (resume.save_state); the same command after a kill writes the bytes an
uninterrupted run writes. It re-reads the input up to the position, or, for a source that can
resume itself (a `datasets` stream) and no dedup (whose table is not saved), continues the source
from its saved position with the counters so far, reading nothing twice.
"""

import dataclasses
import time
from collections.abc import Iterable

from tokstream.dataset_writer import SplitWriter, finish_dataset, text_metadata
from tokstream.format import DatasetMetadata
from tokstream.options import ConversionOptions
from tokstream.resume import STATE_FILE, load_state, save_state, text_resume_key
from tokstream.sources import DocumentSource
from tokstream.staging import staged_output
from tokstream.tokenize_docs import tokenized_batches
from tokstream.tokenizer import Tokenizer


def convert_documents(source: DocumentSource, tokenizer: Tokenizer, out: str, options: ConversionOptions,
                      documents: Iterable[str] | None = None, reports: tuple = (),
                      rereading_needed: bool = False) -> DatasetMetadata:
    """Tokenize, split, pack and write; `out` appears only once everything is written.

    `documents` replaces iterating the source directly (a cleaning stage, say); each dataclass in
    `reports` is recorded in the metadata's `extra` once the input is consumed. The state is saved every
    `state_interval_s` (on S3 too, once the shards it names are up), and the same command after a
    kill continues from it; `rereading_needed` (a cleaning stage with memory, such as dedup) makes
    it re-read the input even from a source that could resume itself.
    """
    counters = (source.stats, *reports)  # what an uninterrupted run has counted by a position
    resumes_itself = source.resumable and not rereading_needed

    def where() -> dict:
        """Taken as each batch is formed: the source's position and the counters, both after its last document."""
        return {"position": source.position(), "counters": [dataclasses.asdict(c) for c in counters]}
    metadata = text_metadata(tokenizer, options, source.description)
    settings = {k: getattr(options, k) for k in ("block_size", "val_fraction", "seed", "max_docs")}
    key = text_resume_key(source.description, [metadata.tokenizer, metadata.tokenizer_sha256, metadata.separator_id,
                                               metadata.separator_position],
                          {**settings, **options.writer_settings})
    with staged_output(out, options.overwrite, options.staging_dir, resume_key=key) as staging:
        outputs = {name: SplitWriter(name, staging.path / name, metadata, options, staging.on_file) for name in options.text_splits}
        next_document, done = 0, 0
        saved = load_state(staging.path, staging.shard_intact) if staging.resumed else None
        if saved is not None:
            next_document, states, at = saved
            for name, state in states.items():
                outputs[name].load_state_dict(state)
            shards = sum(len(s.shards) for s in states.values())
            if resumes_itself and at is not None:
                source.resume_at(at["position"])
                for counter, values in zip(counters, at["counters"]):
                    for name, value in values.items():
                        setattr(counter, name, value)
                done = next_document
                print(f"resuming {out}: {shards} shards verified; the source continues after document "
                      f"{next_document:,}, nothing is read twice")
            else:
                print(f"resuming {out}: {shards} shards verified; re-reading the first {next_document:,} "
                      "documents, tokenizing from there")
        last_save = time.monotonic()
        for batch in tokenized_batches(source if documents is None else documents, tokenizer, options,
                                       metadata.np_dtype, skip=next_document - done, done=done,
                                       position=where if resumes_itself else lambda: None):
            outputs["train"].add(batch.train, batch.train_docs)
            if batch.val_docs:
                outputs["val"].add(batch.val, batch.val_docs)
            next_document += batch.train_docs + batch.val_docs
            if time.monotonic() - last_save >= options.state_interval_s:
                save_state(staging.path, next_document, {n: o.state_dict() for n, o in outputs.items()},
                           batch.source_position)
                if staging.publish is not None:
                    staging.publish(staging.path / STATE_FILE)
                last_save = time.monotonic()
        extra = {"invalid_utf8_documents_replaced": source.stats.invalid_utf8_docs}
        for report in reports:
            extra.update(dataclasses.asdict(report))
        finish_dataset(staging, metadata, outputs, extra)
    return metadata
