"""Text to a dataset in one pass, resumable: the core of owt_to_mds.py and text_to_mds.py without --num-parts.

Chunks of documents are read in order, tokenized in parallel (tokenize_docs.py), split by content
hash and packed into each split's shards (dataset_writer.py). Between batches, every
`state_interval_s`, the state is saved (resume.save_state): the source's position after the last
chunk written, that chunk's number and the counters so far. The same command after a kill writes
the bytes an uninterrupted run writes: it continues the source at that position, reading nothing
twice; with dedup, whose table is not saved, it reads the input again from its start and only
fingerprints the chunks converted before, to refill the table.
"""

import dataclasses
import time

from tokstream.convert.cleaning import Cleaning, CleaningStats
from tokstream.convert.dataset_writer import SplitWriter, finish_dataset, text_metadata
from tokstream.convert.options import ConversionOptions
from tokstream.convert.resume import STATE_FILE, load_state, save_state, text_resume_key
from tokstream.convert.sources import DocumentSource, SourceStats
from tokstream.convert.staging import staged_output
from tokstream.convert.tokenize_docs import Counters, tokenized_batches
from tokstream.format import DatasetMetadata
from tokstream.tokenizer import Tokenizer


def convert_documents(source: DocumentSource, tokenizer: Tokenizer, out: str, options: ConversionOptions,
                      cleaning: Cleaning = Cleaning()) -> DatasetMetadata:
    """Tokenize, clean, split, pack and write; `out` appears only once everything is written.

    The state is saved every `state_interval_s` (on S3 too, once the shards it names are up), and
    the same command after a kill continues from it.
    """
    metadata = text_metadata(tokenizer, options, source.description)
    settings = {k: getattr(options, k) for k in ("block_size", "val_fraction", "seed", "max_docs")}
    key = text_resume_key(source.description, [metadata.tokenizer, metadata.tokenizer_sha256, metadata.separator_id,
                                               metadata.separator_position],
                          {**settings, **options.writer_settings})
    counters = Counters()
    with staged_output(out, options.overwrite, options.staging_dir, resume_key=key) as staging:
        outputs = {name: SplitWriter(name, staging.path / name, metadata, options, staging.on_file) for name in options.text_splits}
        next_document, first_chunk, replay = 0, 0, 0
        saved = load_state(staging.path, staging.shard_intact) if staging.resumed else None
        if saved is not None:
            next_document, states, at = saved
            for name, state in states.items():
                outputs[name].load_state_dict(state)
            counters = Counters(SourceStats(**at["counters"]["read"]), CleaningStats(**at["counters"]["cleaning"]))
            shards = sum(len(s.shards) for s in states.values())
            if cleaning.dedup_memory:
                replay = at["chunks"]
                print(f"resuming {out}: {shards} shards verified; re-reading the {replay:,} chunks converted "
                      f"before to refill the dedup table, converting after document {next_document:,}")
            else:
                source.resume_at(at["position"])
                first_chunk = at["chunks"]
                print(f"resuming {out}: {shards} shards verified; the source continues after document "
                      f"{next_document:,}, nothing is read twice")
        last_save = time.monotonic()
        for batch in tokenized_batches(source, tokenizer, options, cleaning, counters, metadata.np_dtype,
                                       done=next_document, first_chunk=first_chunk, replay=replay):
            outputs["train"].add(batch.train, batch.train_docs)
            if batch.val_docs:
                outputs["val"].add(batch.val, batch.val_docs)
            next_document += batch.train_docs + batch.val_docs
            if time.monotonic() - last_save >= options.state_interval_s:
                position = {"position": batch.end, "chunks": batch.chunk + 1,
                            "counters": dataclasses.asdict(counters)}
                save_state(staging.path, next_document, {n: o.state_dict() for n, o in outputs.items()}, position)
                if staging.publish is not None:
                    staging.publish(staging.path / STATE_FILE)
                last_save = time.monotonic()
        extra = {"invalid_utf8_documents_replaced": counters.read.invalid_utf8_docs,
                 **dataclasses.asdict(counters.cleaning)}
        finish_dataset(staging, metadata, outputs, extra)
    return metadata
