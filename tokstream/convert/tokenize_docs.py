"""Turning a source's chunks into tokenized batches: in parallel, in input order, with a bounded number in flight.

Everything done per document happens in the tokenizer processes: decoding and parsing the chunk
(sources.Chunk.documents), normalising and dropping empty documents, the content-keyed train/val
split, tokenizing and fingerprinting. The converting process only reads chunks, hands them out and
takes the arrays back, so its CPU per token stays small enough to feed many cores (see
bench/convert_speed.py). Dedup, whose table is one for the whole input, and `--max-docs` act on
the returned arrays, in order. The output does not depend on the number of processes.
"""

import hashlib
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from tokstream.convert.cleaning import Cleaning, CleaningStats, FingerprintSet, clean_texts, fingerprint
from tokstream.convert.options import ConversionOptions
from tokstream.convert.sources import Chunk, DocumentSource, SourceStats
from tokstream.errors import WorkLost
from tokstream.tokenizer import Tokenizer, TokenizerSpec, load_tokenizer


@dataclass
class TokenizedBatch:
    """One chunk's documents, tokenized and assigned to splits, concatenated per split."""

    train: np.ndarray
    val: np.ndarray
    train_lengths: np.ndarray  # tokens of each document, its separator included, in order
    val_lengths: np.ndarray
    train_prints: np.ndarray  # each document's 64-bit fingerprint (cleaning.fingerprint), if asked for
    val_prints: np.ndarray
    is_val: np.ndarray  # for each document in input order: whether it went to val
    read: SourceStats = field(default_factory=SourceStats)  # what decoding the chunk repaired
    empty: int = 0  # documents dropped as empty
    end: dict | None = None  # the source's position right after the chunk
    chunk: int = 0  # the chunk's number, from the source's start

    @property
    def train_docs(self) -> int:
        return len(self.train_lengths)

    @property
    def val_docs(self) -> int:
        return len(self.val_lengths)

    def prints_in_order(self) -> np.ndarray:
        prints = np.empty(len(self.is_val), np.uint64)
        prints[~self.is_val], prints[self.is_val] = self.train_prints, self.val_prints
        return prints

    def select(self, keep: np.ndarray) -> "TokenizedBatch":
        """The batch with only the documents `keep` (one bool per document, in input order) marks."""
        train_keep, val_keep = keep[~self.is_val], keep[self.is_val]
        return TokenizedBatch(
            train=self.train[np.repeat(train_keep, self.train_lengths)],
            val=self.val[np.repeat(val_keep, self.val_lengths)],
            train_lengths=self.train_lengths[train_keep], val_lengths=self.val_lengths[val_keep],
            train_prints=self.train_prints[train_keep] if len(self.train_prints) else self.train_prints,
            val_prints=self.val_prints[val_keep] if len(self.val_prints) else self.val_prints,
            is_val=self.is_val[keep], read=self.read, empty=self.empty, end=self.end,
            chunk=self.chunk)


def is_val_document(text: str, seed: int, val_fraction: float) -> bool:
    """Content-keyed split: stable under reordering, and duplicates never straddle train/val."""
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8,
                             key=seed.to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


@dataclass(frozen=True)
class Work:
    """What a tokenizer process does to each chunk (sent once, to each process)."""

    seed: int
    val_fraction: float
    dtype: np.dtype
    cleaning: Cleaning
    fingerprints: bool  # each document's fingerprint is returned (dedup, parts)


# Per-process state: set directly for inline work, by the pool initializer in workers.
_WORKER_STATE: dict = {}


def _init_worker(spec: TokenizerSpec, work: Work) -> None:
    # The processes are the parallelism: a tokenizer.json's own threads would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_STATE.update(tokenizer=load_tokenizer(spec), work=work)


def _tokenize_chunk(chunk: Chunk, tokenize: bool) -> TokenizedBatch:
    """Decode, clean, split and tokenize one chunk; without `tokenize`, only the fingerprints (a dedup replay)."""
    tokenizer: Tokenizer = _WORKER_STATE["tokenizer"]
    work: Work = _WORKER_STATE["work"]
    read = SourceStats()
    texts, empty = clean_texts(chunk.documents(read), work.cleaning)
    if not tokenize:  # the fingerprints, in input order (as train's: prints_in_order reads them so)
        tokens, none = np.empty(0, work.dtype), np.empty(0, np.int64)
        return TokenizedBatch(train=tokens, val=tokens, train_lengths=none, val_lengths=none,
                              train_prints=np.array([fingerprint(t) for t in texts], np.uint64),
                              val_prints=np.empty(0, np.uint64), is_val=np.zeros(len(texts), bool),
                              read=read, empty=empty, end=chunk.end)
    separator, before = [tokenizer.separator_id], tokenizer.separator_position == "before"
    ids: dict[bool, list[int]] = {False: [], True: []}
    lengths: dict[bool, list[int]] = {False: [], True: []}
    prints: dict[bool, list[int]] = {False: [], True: []}
    is_val = np.zeros(len(texts), bool)
    for n, (text, encoded) in enumerate(zip(texts, tokenizer.encode_batch(texts))):
        to_val = is_val[n] = is_val_document(text, work.seed, work.val_fraction)
        # nanoGPT appends <|endoftext|> after every document; Llama-3 data starts each with <|begin_of_text|>
        tokens = separator + encoded if before else encoded + separator
        ids[to_val].extend(tokens)
        lengths[to_val].append(len(tokens))
        if work.fingerprints:
            prints[to_val].append(fingerprint(text))
    return TokenizedBatch(
        train=np.array(ids[False], dtype=work.dtype), val=np.array(ids[True], dtype=work.dtype),
        train_lengths=np.array(lengths[False], dtype=np.int64), val_lengths=np.array(lengths[True], dtype=np.int64),
        train_prints=np.array(prints[False], dtype=np.uint64), val_prints=np.array(prints[True], dtype=np.uint64),
        is_val=is_val, read=read, empty=empty, end=chunk.end,
    )


def tokenize_chunks(chunks: Iterable[tuple[Chunk, bool]], tokenizer: Tokenizer, work: Work,
                    num_workers: int) -> Iterator[TokenizedBatch]:
    """Each (chunk, tokenize) as a batch, in input order, with at most 2 x num_workers chunks in flight."""
    if num_workers <= 1:
        _WORKER_STATE.update(tokenizer=tokenizer, work=work)
        for chunk, tokenize in chunks:
            yield _tokenize_chunk(chunk, tokenize)
        return
    # forkserver, not fork: the parent may be importing torch in a thread meanwhile. An executor, not
    # multiprocessing.Pool, whose worker-handler thread spins on forkserver sentinels (Python 3.11: about
    # 3 s of the parent's CPU per 60 MB handed out, measured) and which hangs if a worker is killed.
    context = multiprocessing.get_context("forkserver")
    executor = ProcessPoolExecutor(num_workers, mp_context=context, initializer=_init_worker,
                                   initargs=(tokenizer.spec, work))
    try:
        in_flight: deque = deque()
        for chunk, tokenize in chunks:
            in_flight.append(executor.submit(_tokenize_chunk, chunk, tokenize))
            if len(in_flight) >= 2 * num_workers:
                yield _result(in_flight.popleft(), executor)
        while in_flight:
            yield _result(in_flight.popleft(), executor)
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


WORKER_LOST = ("a tokenizer process died (killed, or out of memory?): the work so far is kept; rerun the same command "
               "to resume (with fewer --num-workers if memory ran out)")


def _result(future: Future, executor: ProcessPoolExecutor) -> TokenizedBatch:
    """The batch, or WorkLost where a tokenizer process died. A process killed while it was sending a batch leaves
    half a message in the results' pipe, which the executor's own thread then waits on for ever (CPython 3.11, 3.12):
    so the wait is in slices, and a dead process found meanwhile ends the others and closes this process's end of
    that pipe, which ends the thread's read (the executor's private parts, used here alone)."""
    while True:
        try:
            return future.result(timeout=1.0)
        except BrokenProcessPool:
            raise WorkLost(WORKER_LOST) from None
        except FutureTimeout:
            processes = list(executor._processes.values())
            if all(process.exitcode is None for process in processes):
                continue
            for process in processes:
                process.kill()
            executor._result_queue._writer.close()
            raise WorkLost(WORKER_LOST) from None


@dataclass
class Counters:
    """What a conversion has counted by a point of its input: saved with its state, restored on resume."""

    read: SourceStats = field(default_factory=SourceStats)
    cleaning: CleaningStats = field(default_factory=CleaningStats)


def tokenized_batches(source: DocumentSource, tokenizer: Tokenizer, options: ConversionOptions,
                      cleaning: Cleaning, counters: Counters, dtype: np.dtype, fingerprints: bool = False,
                      done: int = 0, first_chunk: int = 0, replay: int = 0) -> Iterator[TokenizedBatch]:
    """The source's documents, tokenized, cleaned and deduplicated, in input order, behind a progress bar.

    `done` documents were converted before (a resumed run), counted against `options.max_docs`. The
    source's chunks are numbered from `first_chunk`. With dedup, the first `replay` chunks (converted
    before; the source read from its start) only refill the table. `counters` count as batches are
    yielded, so at each batch they stand at its `end`.
    """
    seen = FingerprintSet(cleaning.dedup_memory) if cleaning.dedup_memory else None
    work = Work(options.seed, options.val_fraction, dtype, cleaning, fingerprints or seen is not None)
    remaining = None if options.max_docs is None else options.max_docs - done
    if remaining is not None and remaining <= 0:
        return
    if replay and seen is None:
        raise ValueError("a replay refills a dedup table: it needs dedup")
    tasks = ((chunk, number >= replay) for number, chunk in enumerate(source.chunks(), start=first_chunk))
    started = time.monotonic()
    total_tokens = 0
    with tqdm(unit=" docs", desc="tokenizing", disable=not options.progress, total=options.max_docs,
              initial=done, smoothing=0.1, delay=2) as bar:
        for number, batch in enumerate(tokenize_chunks(tasks, tokenizer, work, options.num_workers),
                                       start=first_chunk):
            batch.chunk = number
            if seen is not None:
                keep = np.fromiter((seen.add(int(p)) for p in batch.prints_in_order()), bool, len(batch.is_val))
                if number < replay:
                    continue  # counted before the interruption
                counters.cleaning.duplicates += int(len(keep) - keep.sum())
                batch = batch.select(keep)
            if remaining is not None and len(batch.is_val) >= remaining:
                batch = batch.select(np.arange(len(batch.is_val)) < remaining)
            counters.read.add(batch.read)
            counters.cleaning.empty += batch.empty
            remaining = None if remaining is None else remaining - len(batch.is_val)
            yield batch
            total_tokens += len(batch.train) + len(batch.val)
            bar.update(batch.train_docs + batch.val_docs)
            bar.set_postfix_str(f"{total_tokens / max(time.monotonic() - started, 1e-9) / 1e6:.2f}M tok/s",
                                refresh=False)
            if remaining == 0:
                return
