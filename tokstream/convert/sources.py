"""Where documents come from: local .txt/.jsonl/.json/.parquet files or a Hugging Face `datasets` dataset.

A source yields its input as `Chunk`s: runs of whole documents, about a megabyte each, in a fixed
order, each with the source's position right after it. A local chunk is the bytes as read (or a
parquet column batch): decoding, JSON parsing and splitting into documents happen in
`Chunk.documents`, which the converter calls in its tokenizer processes, so the reading process
never touches a document's text and one reader can feed many tokenizer cores. A corpus is never
held in memory, and the same input always gives the same documents.

Positions make every source resumable: `resume_at(position)` starts the next reading right after
the chunk that position came from. Local files are positioned by file, byte offset (or parquet
row) and line; a `datasets` stream (a hub dataset with its configuration, split and data-file
patterns, or a builder such as "parquet" over local data files) by its own `state_dict()`.
"""

import dataclasses
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import BinaryIO
from dataclasses import dataclass, field
from pathlib import Path

from tokstream.errors import UserError

TEXT_SUFFIXES = {".txt"}
JSON_SUFFIXES = {".jsonl", ".json"}
PARQUET_SUFFIXES = {".parquet"}
SUPPORTED_SUFFIXES = TEXT_SUFFIXES | JSON_SUFFIXES | PARQUET_SUFFIXES
TXT_DOC_MODES = ("file", "line", "paragraph")
HUB_NAME = re.compile(r"^(hf://)?[\w.-]+/[\w.-]+$")
CHUNK_BYTES = 1 << 20  # input per chunk: large enough to amortise handing it to a worker
SCAN_BYTES = 1 << 16  # read at a time while looking for a chunk's boundary
CHUNK_ROWS = 1024  # parquet rows per chunk
CHUNK_DOCS = 4096  # documents per chunk of a datasets stream (or CHUNK_BYTES of text, whichever first)
# Byte-order marks of the wide Unicode encodings a .txt file may be in (UTF-32's first: it starts like UTF-16's).
WIDE_BOMS = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"), (b"\xff\xfe", "utf-16"),
             (b"\xfe\xff", "utf-16"))
# A file is refused as not UTF-8 text when, in its first CHUNK_BYTES, more than this share of the bytes
# (and more than NOT_TEXT_MIN of them) are NULs (UTF-16/32 without a mark) or start invalid UTF-8 (Latin-1...);
# fewer are repaired (U+FFFD) and counted, as stray bytes in real text are.
NOT_TEXT_SHARE = 0.01
NOT_TEXT_MIN = 16
# Where chunks of paragraphs may be cut: after a blank line of ASCII whitespace, always a paragraph break
# (a line blank only in Unicode's sense is one too, where the worker splits, but no chunk is cut there).
_BLANK_LINE = re.compile(rb"\n[ \t\r\x0b\x0c]*\n")
_NEWLINE = re.compile(rb"\n")


@dataclass
class SourceStats:
    """What reading the input had to repair."""

    invalid_utf8_docs: int = 0  # documents whose undecodable bytes became U+FFFD

    def add(self, other: "SourceStats") -> None:
        self.invalid_utf8_docs += other.invalid_utf8_docs


@dataclass
class Chunk:
    """A run of whole documents, read and decoded only by `documents` (in a tokenizer process).

    A local text file's chunk is a byte range, nothing read yet: the documents from the first document
    boundary at or after byte `start` (0: the file's start) to the first at or after `stop` (None: the
    file's end). A boundary is the position after a line's newline, or for paragraphs after a blank
    line of ASCII whitespace (`_first_boundary`); neighbouring chunks agree on it, as both compute it
    from the same byte. So the reading process never reads a byte of document text.
    """

    kind: str  # jsonl, json-array, txt-file, txt-line, txt-paragraph, parquet, texts
    path: str
    text_column: str
    end: dict | None  # the source's position right after this chunk
    payload: object = None  # what the reading process holds: a pyarrow string array (parquet), a list of str (texts)
    start: int = 0
    stop: int | None = None
    encoding: str = "utf-8"  # utf-16 or utf-32: a .txt file with that byte-order mark, read whole in one chunk

    def documents(self, stats: SourceStats) -> list[str]:
        """The chunk's document texts, in order; undecodable bytes are replaced and counted in `stats`."""
        if self.kind == "texts":
            return self.payload
        path = Path(self.path)
        if self.kind == "parquet":
            texts = self.payload.to_pylist()
            if None in texts:
                raise UserError(f"{path}: column {self.text_column!r} has a null value")
            return texts
        if self.kind == "txt-file":
            return [_decode_file(path, self.encoding, stats)]
        if self.kind == "json-array":
            try:
                records = json.loads(_decode_file(path, self.encoding, stats))
            except json.JSONDecodeError as err:
                raise UserError(f"{path}: invalid JSON: {err}") from None
            return [_text_of(record, self.text_column, path, n) for n, record in enumerate(records, start=1)]
        if self.encoding != "utf-8":  # split once decoded, as its UTF-8 copy would be: its newlines are not b"\n"
            data, first = _decode_file(path, self.encoding, stats).encode("utf-8"), 0
        else:
            data, first = _read_span(path, self.kind, self.start, self.stop)
            if first == 0:
                refuse_if_not_text(data, path)
        lines = io.BytesIO(data)  # iterates on b"\n" only, as reading the file does
        if self.kind != "jsonl":
            return list(_split_txt(lines, self.kind.removeprefix("txt-"), stats))
        try:
            return self._records(lines, stats, 1)
        except UserError:  # again, now counting the file's lines before the chunk: the message names the line
            self._records(io.BytesIO(data), SourceStats(), _line_at(path, first))
            raise

    def _records(self, lines: Iterator[bytes], stats: SourceStats, first_lineno: int) -> list[str]:
        path = Path(self.path)
        return [_text_of(record, self.text_column, path, lineno)
                for lineno, record in _json_lines(lines, path, stats, first_lineno)]


@dataclass
class DocumentSource:
    """An ordered stream of chunks of documents, resumable at any chunk's end, and a description for the
    metadata."""

    description: dict
    _chunks: Callable[[dict | None], Iterator[Chunk]]  # the chunks from a position (None: the start)
    stats: SourceStats = field(default_factory=SourceStats)
    _start: dict | None = None

    def chunks(self) -> Iterator[Chunk]:
        """The chunks from the start, or from the position given to `resume_at`."""
        return self._chunks(self._start)

    def resume_at(self, position: dict) -> None:
        """The next `chunks()` starts right after the chunk whose `end` this is."""
        self._start = position

    def __iter__(self) -> Iterator[str]:
        """The documents, decoded here (tests, small inputs); counts repairs in `stats`."""
        for chunk in self.chunks():
            yield from chunk.documents(self.stats)


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

    def chunks(start: dict | None) -> Iterator[Chunk]:
        start = start or {"file": 0}
        for index in range(start["file"], len(files)):
            at = start if index == start["file"] else {}
            yield from _file_chunks(index, files[index], text_column, txt_docs, at)

    return DocumentSource(description, chunks)


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


def _decode(raw: bytes, stats: SourceStats, encoding: str = "utf-8") -> str:
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError:
        stats.invalid_utf8_docs += 1
        return raw.decode(encoding, errors="replace")


def _decode_file(path: Path, encoding: str, stats: SourceStats) -> str:
    """A whole file's text: UTF-8 (refused if it is mostly not), or UTF-16/32 after its byte-order mark."""
    raw = path.read_bytes()
    if encoding == "utf-8":
        refuse_if_not_text(raw, path)
    return _decode(raw, stats, encoding)


def refuse_if_not_text(raw: bytes, path: Path) -> None:
    """Refuse a file whose start (up to CHUNK_BYTES of `raw`, its first bytes) is mostly not UTF-8 text, rather
    than tokenize garbage; checked once per file, in the tokenizer process that reads its first chunk."""
    sample = raw[:CHUNK_BYTES]
    limit = max(NOT_TEXT_MIN, NOT_TEXT_SHARE * len(sample))
    nuls = sample.count(0)
    if nuls > limit:
        raise UserError(f"{path}: {nuls:,} of its first {len(sample):,} bytes are NUL: not UTF-8 text (UTF-16 or "
                        "UTF-32 without a byte-order mark?); convert it to UTF-8 (e.g. iconv -f UTF-16 -t UTF-8) or "
                        "leave it out")
    if sample.isascii():
        return
    invalid = sample.decode("utf-8", errors="replace").count("\ufffd") - sample.count("\ufffd".encode())
    if invalid > limit:
        raise UserError(f"{path}: {invalid:,} invalid UTF-8 sequences in its first {len(sample):,} bytes: not UTF-8 "
                        "text (Latin-1 or another legacy encoding?); convert it to UTF-8 (e.g. iconv -f LATIN1 -t "
                        "UTF-8) or leave it out")


def _wide_encoding(head: bytes) -> str | None:
    """utf-16 or utf-32 if the file starts with that byte-order mark."""
    return next((encoding for mark, encoding in WIDE_BOMS if head.startswith(mark)), None)


def _check_text_column(path: Path, text_column: str) -> None:
    """Fail before any work if the first record (a .json array: any record) has no text column."""
    if path.suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path)
        except Exception as err:
            raise UserError(f"{path} is not a readable parquet file: {err}") from None
        if text_column not in schema.names:
            raise UserError(f"{path} has no column {text_column!r}; columns: {', '.join(schema.names)} "
                            "(choose one with --text-column)")
        if not _is_text_type(schema.field(text_column).type):
            raise UserError(f"{path}: column {text_column!r} holds {schema.field(text_column).type}, not text "
                            "(choose a text column with --text-column)")
    elif path.suffix in JSON_SUFFIXES:  # read as a tokenizer process will read it
        first = next(_file_chunks(0, path, text_column, "file", {}), None)
        if first is not None and first.kind == "jsonl":
            first = dataclasses.replace(first, stop=1)  # to the first boundary at or after byte 1: line 1
        if first is not None:
            first.documents(SourceStats())


def _is_text_type(arrow_type) -> bool:
    """Whether a parquet column's values read as str (dictionary-encoded strings too)."""
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


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


def _json_lines(lines: Iterator[bytes], path: Path, stats: SourceStats, first_lineno: int = 1
                ) -> Iterator[tuple[int, object]]:
    for lineno, raw in enumerate(lines, start=first_lineno):
        if not raw.strip():
            continue
        try:
            yield lineno, json.loads(_decode(raw, stats))
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{lineno}: invalid JSON line: {err.msg}") from None


def _file_chunks(index: int, path: Path, text_column: str, txt_docs: str, at: dict) -> Iterator[Chunk]:
    """File number `index` of a local source in chunks, from position `at` (empty: its start)."""
    if path.suffix in PARQUET_SUFFIXES:
        yield from _parquet_chunks(index, path, text_column, at.get("row", 0))
        return
    with open(path, "rb") as handle:
        head = handle.read(4)
    encoding = _wide_encoding(head)
    if path.suffix in JSON_SUFFIXES:
        if encoding:
            raise UserError(f"{path} is {encoding.upper()} text, and JSON files are read as UTF-8: convert it "
                            f"(e.g. iconv -f {encoding.upper()} -t UTF-8)")
        kind = "json-array" if head[:1] == b"[" else "jsonl"
    else:
        kind = f"txt-{txt_docs}"
    if encoding:  # read whole: its chunks cannot be cut at b"\n" (txt only; JSON is refused above)
        yield Chunk(kind, str(path), text_column, {"file": index + 1}, encoding=encoding)
        return
    if kind in ("json-array", "txt-file"):  # one document, or one JSON value: the file whole
        yield Chunk(kind, str(path), text_column, {"file": index + 1})
        return
    size = path.stat().st_size
    for start in range(at.get("offset", 0), size, CHUNK_BYTES):
        stop = start + CHUNK_BYTES
        end = {"file": index, "offset": stop} if stop < size else {"file": index + 1}
        yield Chunk(kind, str(path), text_column, end, start=start, stop=stop if stop < size else None)


def _read_span(path: Path, kind: str, start: int, stop: int | None) -> tuple[bytes, int]:
    """A chunk's bytes (Chunk: from the first boundary at or after `start` to the first at or after `stop`)
    and the offset of the first."""
    with open(path, "rb") as handle:
        first = 0 if start == 0 else _first_boundary(handle, start, kind, give_up=stop)
        if first is None:  # no boundary starts before `stop`: the next chunk begins where this one would
            return b"", start
        last = None if stop is None else _first_boundary(handle, stop, kind)
        handle.seek(first)
        return handle.read() if last is None else handle.read(last - first), first


def _first_boundary(handle: BinaryIO, position: int, kind: str, give_up: int | None = None) -> int | None:
    """The first document boundary at or after `position` (> 0): the end of the first newline (paragraphs:
    blank line, newline to newline) that starts at or after byte position - 1. None: the file ends first
    (its end is the boundary), or no such match starts before byte give_up - 1, whose own boundary is then
    the same one.
    """
    pattern = _BLANK_LINE if kind == "txt-paragraph" else _NEWLINE
    offset = position - 1
    handle.seek(offset)
    carry = b""  # a blank line's start, held over to the next read
    while True:
        block = handle.read(SCAN_BYTES)
        data = carry + block
        match = pattern.search(data)
        if match:
            return offset + match.end() if give_up is None or offset + match.start() < give_up - 1 else None
        if not block:
            return None
        newline = data.rfind(b"\n")
        held = kind == "txt-paragraph" and newline >= 0 and not data[newline + 1:].strip(b" \t\r\x0b\x0c")
        carry = data[newline:] if held else b""
        offset += len(data) - len(carry)  # where `carry` starts: no match starts before it
        if give_up is not None and offset >= give_up - 1:
            return None


def _line_at(path: Path, offset: int) -> int:
    """The number of the line starting at byte `offset` (for a message: reads the file up to there)."""
    lines = 1
    with open(path, "rb") as handle:
        while offset > 0:
            block = handle.read(min(offset, CHUNK_BYTES))
            if not block:
                break
            lines += block.count(b"\n")
            offset -= len(block)
    return lines


def _parquet_chunks(index: int, path: Path, text_column: str, row: int) -> Iterator[Chunk]:
    """A parquet file's text column in batches of CHUNK_ROWS rows, from row `row`."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    group, first = 0, 0  # the row group holding `row`, and that group's first row
    while group < parquet.num_row_groups and first + parquet.metadata.row_group(group).num_rows <= row:
        first += parquet.metadata.row_group(group).num_rows
        group += 1
    row_groups = list(range(group, parquet.num_row_groups))
    skip = row - first
    for batch in parquet.iter_batches(columns=[text_column], batch_size=CHUNK_ROWS, row_groups=row_groups):
        column = batch.column(0)
        if skip:
            column, skip = column.slice(min(skip, len(column))), max(0, skip - len(column))
        if len(column):
            row += len(column)
            yield Chunk("parquet", str(path), text_column, {"file": index, "row": row}, payload=column)


def _split_txt(lines: Iterator[bytes], txt_docs: str, stats: SourceStats) -> Iterator[str]:
    """One document per non-empty line, or per blank-line-separated paragraph."""
    paragraph: list[str] = []
    for raw in lines:
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
    def chunks(start: dict | None) -> Iterator[Chunk]:
        stream = datasets_part(open_datasets_stream(name, config, split, revision, data_files), part)
        if start is not None:
            stream.load_state_dict(start)
        texts: list[str] = []
        size = 0
        where = Path(f"hf://{name}")
        for lineno, record in enumerate(stream, start=1):
            texts.append(_text_of(record, text_column, where, lineno))
            size += len(texts[-1])
            if size >= CHUNK_BYTES or len(texts) >= CHUNK_DOCS:
                yield Chunk("texts", str(where), text_column, stream.state_dict(), payload=texts)
                texts, size = [], 0
        if texts:
            yield Chunk("texts", str(where), text_column, stream.state_dict(), payload=texts)

    return DocumentSource(description, chunks)
