"""Reading in chunks (tokstream/convert/sources.py): the documents do not depend on where chunks are cut or how
their boundaries are searched, and every chunk's end is a position the source resumes at, for every
kind of local input."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import shakespeare_paragraphs, tree_bytes, wikitext_articles

import tokstream.convert.sources as sources
from tokstream.convert.cleaning import Cleaning
from tokstream.convert.options import ConversionOptions
from tokstream.convert.sources import SourceStats, open_source
from tokstream.convert.text_one_pass import convert_documents
from tokstream.errors import UserError


def inputs(tmp_path):
    """Every local kind, with the awkward bytes: blank and whitespace-only lines, CRLF, a Unicode-only blank
    line, invalid UTF-8, a file without a final newline."""
    paragraphs = shakespeare_paragraphs()[:60]
    articles = [article[:3000] for article in wikitext_articles()[:12]]  # each still many chunks long at every size
    jsonl = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": t}) for t in [*articles[:3], " \t ", *articles[3:]]]  # one empty after cleaning
    jsonl.write_bytes(("\n".join(lines[:5]) + "\n\n   \n" + "\n".join(lines[5:])).encode()
                      + b'\n{"text": "bad \xff byte"}')
    array = tmp_path / "b.json"
    array.write_text(json.dumps([{"text": t} for t in paragraphs[:9]]))
    text = tmp_path / "c.txt"
    text.write_bytes("\n\n".join(paragraphs[:20]).encode() + b"\r\n  \r\n" + "\n\u00a0\n".join(paragraphs[20:40]).encode()
                     + b"\n\n\n" + b"\xfe not utf-8\n" + "\n \n".join(paragraphs[40:]).encode())
    table = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": paragraphs}), table, row_group_size=17)
    return {"jsonl": ([jsonl], "file"), "json array": ([array], "file"), "txt files": ([text, array], "file"),
            "txt lines": ([text], "line"), "txt paragraphs": ([text], "paragraph"), "parquet": ([table], "file"),
            "several files": ([jsonl, table, text], "paragraph")}


KINDS = ["jsonl", "json array", "txt files", "txt lines", "txt paragraphs", "parquet", "several files"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_chunk_end_resumes_at_the_next_document(tmp_path, monkeypatch, kind):
    files, txt_docs = inputs(tmp_path)[kind]
    whole = open_source([str(f) for f in files], txt_docs=txt_docs)
    expected = list(whole)  # each file read in one chunk: the documents as a plain reading of the file gives them
    assert len(expected) > 5

    for size in (5, 37, 500):  # chunks of a line (or paragraph) each, up to many
        monkeypatch.setattr(sources, "CHUNK_BYTES", size)
        monkeypatch.setattr(sources, "CHUNK_ROWS", size)
        monkeypatch.setattr(sources, "SCAN_BYTES", max(1, size // 3))  # boundaries found across several reads
        source = open_source([str(f) for f in files], txt_docs=txt_docs)
        chunks = list(source.chunks())
        stats = SourceStats()
        per_chunk = [chunk.documents(stats) for chunk in chunks]
        assert [d for docs in per_chunk for d in docs] == expected
        assert stats == whole.stats
        for number in sorted(set(range(0, len(chunks), max(1, len(chunks) // 12))) | {len(chunks) - 1}):
            chunk = chunks[number]
            resumed = open_source([str(f) for f in files], txt_docs=txt_docs)
            resumed.resume_at(json.loads(json.dumps(chunk.end)))  # as saved in the state
            done = sum(len(docs) for docs in per_chunk[: number + 1])
            assert list(resumed) == expected[done:], (size, number)


def test_the_dataset_does_not_depend_on_chunks_or_workers(tmp_path, monkeypatch, gpt2):
    """Cleaning, dedup, the split and --max-docs act per document wherever chunks are cut."""
    files, txt_docs = inputs(tmp_path)["several files"]
    repeated = tmp_path / "e.txt"
    repeated.write_text("\n\n".join(shakespeare_paragraphs()[:30]) + "\n\n\n\n   \n\n")  # repeats of d.parquet's
    files = [*files, repeated]
    cleaning = Cleaning(normalize="nfc+whitespace", drop_empty=True, dedup_memory=1 << 16)
    outputs = []
    for size, workers in ((1 << 20, 1), (100, 2), (3, 1)):
        monkeypatch.setattr(sources, "CHUNK_BYTES", size)
        monkeypatch.setattr(sources, "CHUNK_ROWS", size)
        monkeypatch.setattr(sources, "SCAN_BYTES", 2)
        for max_docs in (None, 40):
            options = ConversionOptions(block_size=16, shard_size="4kb", val_fraction=0.2, num_workers=workers,
                                        max_docs=max_docs, progress=False)
            out = tmp_path / f"out-{size}-{workers}-{max_docs}"
            metadata = convert_documents(open_source([str(f) for f in files], txt_docs=txt_docs), gpt2, str(out),
                                         options, cleaning)
            outputs.append((max_docs, tree_bytes(out)))
            if max_docs is None:
                assert metadata.extra["duplicates"] >= 30 and metadata.extra["invalid_utf8_documents_replaced"] == 2
                assert metadata.extra["empty"] > 0
    for max_docs, tree in outputs:
        assert tree == next(t for m, t in outputs if m == max_docs)
    assert outputs[0][1] != outputs[1][1]


@pytest.mark.parametrize("bad, message", [("{not json", "invalid JSON line"), ('{"body": "x"}', "no field 'text'")])
def test_a_bad_record_deep_in_a_file_is_named_by_its_line(tmp_path, monkeypatch, bad, message):
    """Chunks do not count lines as they are cut; a message still names the line of the file."""
    monkeypatch.setattr(sources, "CHUNK_BYTES", 64)
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {n}"}) + "\n" for n in range(1, 40)) + "\n" + bad + "\n")
    with pytest.raises(UserError, match=f"a.jsonl:41: {message}"):
        list(open_source([str(path)]))
