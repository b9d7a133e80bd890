"""Where documents come from: local .txt/.jsonl/.json/.parquet files or a Hugging Face `datasets` dataset.

Every source yields document texts one at a time, in a fixed order, so a corpus
is never held in memory and the same input always gives the same stream.

A `datasets` source (a hub dataset, with its configuration, split and data-file patterns, or a
builder such as "parquet" over local data files) streams through `datasets`' IterableDataset,
whose own state (`position()`, `resume_at()`) lets an interrupted conversion continue where it
stood instead of streaming the dataset again from its start.
"""

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tokstream.errors import UserError

TEXT_SUFFIXES = {".txt"}
JSON_SUFFIXES = {".jsonl", ".json"}
PARQUET_SUFFIXES = {".parquet"}
SUPPORTED_SUFFIXES = TEXT_SUFFIXES | JSON_SUFFIXES | PARQUET_SUFFIXES
TXT_DOC_MODES = ("file", "line", "paragraph")
HUB_NAME = re.compile(r"^(hf://)?[\w.-]+/[\w.-]+$")


@dataclass
class SourceStats:
    """What reading the input had to repair."""

    invalid_utf8_docs: int = 0  # documents whose undecodable bytes became U+FFFD


@dataclass
class DocumentSource:
    """An ordered stream of document texts and a description for the metadata."""

    description: dict
    stats: SourceStats = field(default_factory=SourceStats)
    _iterate: object = None  # callable(stats) -> Iterator[str]
    _position: object = None  # callable() -> the state after the last document yielded; None: cannot say
    _resume: object = None  # callable(state): the next iteration starts at that state

    def __iter__(self) -> Iterator[str]:
        return self._iterate(self.stats)

    @property
    def resumable(self) -> bool:
        """Whether the source can continue from a position itself (else a resumed run re-reads it)."""
        return self._position is not None

    def position(self) -> dict | None:
        """The state right after the last document yielded, for `resume_at`; None if it cannot say."""
        return self._position() if self._position is not None else None

    def resume_at(self, state: dict) -> None:
        self._resume(state)


def open_source(
    inputs: list[str],
    text_column: str = "text",
    txt_docs: str = "file",
    revision: str | None = None,
    hub_split: str = "train",
    hub_config: str | None = None,
    data_files: list[str] | None = None,
    part: tuple[int, int] | None = None,
) -> DocumentSource:
    """Resolve the inputs (local paths, or one hub dataset name or `datasets` builder) into a DocumentSource."""
    if txt_docs not in TXT_DOC_MODES:
        raise UserError(f"--txt-docs must be one of {', '.join(TXT_DOC_MODES)}, not {txt_docs!r}")
    hub = len(inputs) == 1 and not os.path.exists(inputs[0]) and HUB_NAME.match(inputs[0])
    if hub or data_files:
        if len(inputs) != 1:
            raise UserError("--data-files go with one dataset: a hub name, or a datasets builder such as parquet")
        return _hub_source(inputs[0].removeprefix("hf://"), text_column, revision, hub_split, hub_config,
                           data_files, part)
    if hub_config:
        raise UserError(f"--name {hub_config} names a configuration of a hub dataset, and {inputs} are local files")
    files = _local_files(inputs)
    for path in files:
        _check_text_column(path, text_column)
    description = {"kind": "local", "files": [str(p) for p in files], "text_column": text_column,
                   "txt_docs": txt_docs}

    def iterate(stats: SourceStats) -> Iterator[str]:
        for path in files:
            yield from _read_file(path, text_column, txt_docs, stats)

    return DocumentSource(description, _iterate=iterate)


def _local_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise UserError(f"input {item} does not exist (not a file, folder or hub dataset name)")
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUPPORTED_SUFFIXES)
            if not found:
                raise UserError(f"folder {item} holds no {'/'.join(sorted(SUPPORTED_SUFFIXES))} files")
            files.extend(found)
        elif path.suffix in SUPPORTED_SUFFIXES:
            files.append(path)
        else:
            raise UserError(
                f"cannot read {item}: unknown file type {path.suffix or '(none)'}; "
                f"use {', '.join(sorted(SUPPORTED_SUFFIXES))}"
            )
    return files


def _decode(raw: bytes, stats: SourceStats) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.invalid_utf8_docs += 1
        return raw.decode("utf-8", errors="replace")


def _check_text_column(path: Path, text_column: str) -> None:
    """Fail before any work if the first record has no text column."""
    if path.suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except Exception as err:
            raise UserError(f"{path} is not a readable parquet file: {err}") from None
        if text_column not in names:
            raise UserError(f"{path} has no column {text_column!r}; columns: {', '.join(names)} "
                            "(choose one with --text-column)")
    elif path.suffix in JSON_SUFFIXES:
        for lineno, record in _json_records(path, SourceStats()):
            _text_of(record, text_column, path, lineno)
            return


def _text_of(record: object, text_column: str, path: Path, lineno: int) -> str:
    if not isinstance(record, dict):
        raise UserError(f"{path}:{lineno}: expected a JSON object per line, got {type(record).__name__}")
    if text_column not in record:
        raise UserError(f"{path}:{lineno}: no field {text_column!r}; fields: {', '.join(record)} "
                        "(choose one with --text-column)")
    text = record[text_column]
    if not isinstance(text, str):
        raise UserError(f"{path}:{lineno}: field {text_column!r} is {type(text).__name__}, not text")
    return text


def _json_records(path: Path, stats: SourceStats) -> Iterator[tuple[int, object]]:
    with open(path, "rb") as handle:
        first = handle.read(1)
        handle.seek(0)
        if first == b"[":  # a .json file holding one array of records
            try:
                records = json.loads(_decode(handle.read(), stats))
            except json.JSONDecodeError as err:
                raise UserError(f"{path}: invalid JSON: {err}") from None
            yield from enumerate(records, start=1)
            return
        for lineno, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                yield lineno, json.loads(_decode(raw, stats))
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{lineno}: invalid JSON line: {err.msg}") from None


def _read_file(path: Path, text_column: str, txt_docs: str, stats: SourceStats) -> Iterator[str]:
    if path.suffix in JSON_SUFFIXES:
        for lineno, record in _json_records(path, stats):
            yield _text_of(record, text_column, path, lineno)
    elif path.suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(columns=[text_column], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text is None:
                    raise UserError(f"{path}: column {text_column!r} has a null value")
                yield text
    elif txt_docs == "file":
        with open(path, "rb") as handle:
            yield _decode(handle.read(), stats)
    else:
        yield from _split_txt(path, txt_docs, stats)


def _split_txt(path: Path, txt_docs: str, stats: SourceStats) -> Iterator[str]:
    """One document per non-empty line, or per blank-line-separated paragraph."""
    paragraph: list[str] = []
    with open(path, "rb") as handle:
        for raw in handle:
            line = _decode(raw, stats)
            if txt_docs == "line":
                if line.strip():
                    yield line.rstrip("\r\n")
            elif line.strip():
                paragraph.append(line)
            elif paragraph:
                yield "".join(paragraph).rstrip("\r\n")
                paragraph = []
    if paragraph:
        yield "".join(paragraph).rstrip("\r\n")


def open_datasets_stream(name: str, config: str | None, split: str, revision: str | None,
                         data_files: list[str] | None):
    """`datasets`' IterableDataset for a hub dataset or a builder over data files, streamed."""
    import datasets  # heavy import, only for these inputs

    where = f"{name}" + (f" ({config})" if config else "") + (f", revision {revision}" if revision else "")
    try:
        return datasets.load_dataset(name, config, split=split, revision=revision, streaming=True,
                                     data_files={split: data_files} if data_files else None)
    except Exception as err:
        raise UserError(
            f"could not open dataset {where}, split {split}: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}. Offline? use local files instead"
        ) from None


def datasets_part(stream, part: tuple[int, int] | None):
    """Part I of N of a stream: a contiguous run of its data files, so the parts in order are the whole."""
    if part is None:
        return stream
    index, num_parts = part
    if num_parts > stream.n_shards:
        raise UserError(f"--num-parts {num_parts} exceeds the dataset's {stream.n_shards} data files; parts are "
                        "whole files")
    return stream.shard(num_parts, index, contiguous=True)


def _hub_source(name: str, text_column: str, revision: str | None, split: str, config: str | None = None,
                data_files: list[str] | None = None, part: tuple[int, int] | None = None) -> DocumentSource:
    """A `datasets` dataset in streaming mode (the full download cache is optional) that can resume itself;
    with `part` (I, N), part I of N of its data files."""
    description = {"kind": "huggingface", "dataset": name, "revision": revision, "split": split,
                   "text_column": text_column}
    if config:
        description["name"] = config
    if data_files:
        description["data_files"] = list(data_files)
    live: dict = {}  # the IterableDataset being iterated, and a state to start the next iteration at

    def iterate(stats: SourceStats) -> Iterator[str]:
        stream = datasets_part(open_datasets_stream(name, config, split, revision, data_files), part)
        if "resume" in live:
            stream.load_state_dict(live.pop("resume"))
        live["stream"] = stream
        for lineno, record in enumerate(stream, start=1):
            yield _text_of(record, text_column, Path(f"hf://{name}"), lineno)

    def position() -> dict:
        return live["stream"].state_dict()

    def resume(state: dict) -> None:
        live["resume"] = state

    return DocumentSource(description, _iterate=iterate, _position=position, _resume=resume)
