"""Tokenizing documents in parallel, in input order, with a bounded number of batches in flight."""

import hashlib
import itertools
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from tokstream.cleaning import fingerprint
from tokstream.options import ConversionOptions
from tokstream.tokenizer import Tokenizer, TokenizerSpec, load_tokenizer

BATCH_CHARS = 1 << 20  # about 1 MB of text per task: large enough to amortise pickling
BATCH_DOCS = 4096


@dataclass
class TokenizedBatch:
    """One batch of documents, tokenized and assigned to splits, concatenated per split."""

    train: np.ndarray
    val: np.ndarray
    train_lengths: np.ndarray  # tokens of each document, its separator included, in order
    val_lengths: np.ndarray
    train_prints: np.ndarray  # each document's 64-bit fingerprint (cleaning.fingerprint), if asked for
    val_prints: np.ndarray
    chars: int
    source_position: dict | None = None  # the source's state right after this batch's last document

    @property
    def train_docs(self) -> int:
        return len(self.train_lengths)

    @property
    def val_docs(self) -> int:
        return len(self.val_lengths)


def is_val_document(text: str, seed: int, val_fraction: float) -> bool:
    """Content-keyed split: stable under reordering, and duplicates never straddle train/val."""
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8,
                             key=seed.to_bytes(8, "little", signed=True)).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


# Per-process state: set directly for inline work, by the pool initializer in workers.
_WORKER_STATE: dict = {}


def _init_worker(spec: TokenizerSpec, seed: int, val_fraction: float, dtype: np.dtype, fingerprints: bool) -> None:
    # The processes are the parallelism: a tokenizer.json's own threads would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = load_tokenizer(spec)
    _WORKER_STATE.update(tokenizer=tokenizer, seed=seed, val_fraction=val_fraction, dtype=dtype,
                         fingerprints=fingerprints)


def _tokenize_batch(texts: list[str]) -> TokenizedBatch:
    tokenizer: Tokenizer = _WORKER_STATE["tokenizer"]
    seed, val_fraction, dtype = _WORKER_STATE["seed"], _WORKER_STATE["val_fraction"], _WORKER_STATE["dtype"]
    separator, before = [tokenizer.separator_id], tokenizer.separator_position == "before"
    with_prints = _WORKER_STATE["fingerprints"]
    ids: dict[bool, list[int]] = {False: [], True: []}
    lengths: dict[bool, list[int]] = {False: [], True: []}
    prints: dict[bool, list[int]] = {False: [], True: []}
    for text, encoded in zip(texts, tokenizer.encode_batch(texts)):
        to_val = is_val_document(text, seed, val_fraction)
        # nanoGPT appends <|endoftext|> after every document; Llama-3 data starts each with <|begin_of_text|>
        tokens = separator + encoded if before else encoded + separator
        ids[to_val].extend(tokens)
        lengths[to_val].append(len(tokens))
        if with_prints:  # lets a later merge drop duplicates across parts
            prints[to_val].append(fingerprint(text))
    return TokenizedBatch(
        train=np.array(ids[False], dtype=dtype), val=np.array(ids[True], dtype=dtype),
        train_lengths=np.array(lengths[False], dtype=np.int64), val_lengths=np.array(lengths[True], dtype=np.int64),
        train_prints=np.array(prints[False], dtype=np.uint64), val_prints=np.array(prints[True], dtype=np.uint64),
        chars=sum(map(len, texts)),
    )


def _batches(documents: Iterable[str], position: Callable[[], dict | None]) -> Iterator[tuple[list[str], dict | None]]:
    """Batches of documents, each with the source's position right after its last document."""
    batch: list[str] = []
    chars = 0
    for text in documents:
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
            yield batch, position()
            batch, chars = [], 0
    if batch:
        yield batch, position()


def _positioned(batch: TokenizedBatch, position: dict | None) -> TokenizedBatch:
    batch.source_position = position
    return batch


def tokenize_documents(documents: Iterable[str], tokenizer: Tokenizer, seed: int, val_fraction: float,
                       dtype: np.dtype, num_workers: int, fingerprints: bool = False,
                       position: Callable[[], dict | None] = lambda: None) -> Iterator[TokenizedBatch]:
    """Yield tokenized batches in input order; the output does not depend on num_workers."""
    if num_workers <= 1:
        _WORKER_STATE.update(tokenizer=tokenizer, seed=seed, val_fraction=val_fraction, dtype=dtype,
                             fingerprints=fingerprints)
        for batch, where in _batches(documents, position):
            yield _positioned(_tokenize_batch(batch), where)
        return
    # forkserver, not fork: the parent may be importing torch in a thread meanwhile.
    context = multiprocessing.get_context("forkserver")
    init_args = (tokenizer.spec, seed, val_fraction, dtype, fingerprints)
    with context.Pool(num_workers, initializer=_init_worker, initargs=init_args) as pool:
        in_flight: deque = deque()
        for batch, where in _batches(documents, position):
            in_flight.append((pool.apply_async(_tokenize_batch, (batch,)), where))
            if len(in_flight) >= 2 * num_workers:
                result, where = in_flight.popleft()
                yield _positioned(result.get(), where)
        while in_flight:
            result, where = in_flight.popleft()
            yield _positioned(result.get(), where)


def tokenized_batches(documents: Iterable[str], tokenizer: Tokenizer, options: ConversionOptions,
                      dtype, fingerprints: bool = False, skip: int = 0, done: int = 0,
                      position: Callable[[], dict | None] = lambda: None) -> Iterator[TokenizedBatch]:
    """Tokenized batches in input order, behind a progress bar (docs/s, tokens/s), each with the source's
    `position()` after its last document.

    The first `skip` documents are read (and pass through any cleaning) but not tokenized; `done`
    documents were converted before and are not in `documents` at all (a source resumed at its position).
    """
    limit = None if options.max_docs is None else options.max_docs - done
    documents = itertools.islice(itertools.islice(documents, limit), skip, None)
    started = time.monotonic()
    total_tokens = 0
    with tqdm(unit=" docs", desc="tokenizing", disable=not options.progress, total=options.max_docs,
              initial=skip + done, smoothing=0.1, delay=2) as bar:
        for batch in tokenize_documents(documents, tokenizer, options.seed, options.val_fraction, dtype,
                                        options.num_workers, fingerprints, position):
            yield batch
            total_tokens += len(batch.train) + len(batch.val)
            bar.update(batch.train_docs + batch.val_docs)
            bar.set_postfix_str(f"{total_tokens / max(time.monotonic() - started, 1e-9) / 1e6:.2f}M tok/s",
                                refresh=False)
