"""convert/owt_to_mds.py: exact token streams, determinism, inputs, interruption and bad input."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import (ROOT, expected_samples, kill_then_resume, nanogpt_stream, run_script, saved_state_header,
                      shakespeare_paragraphs,
                      tagged_lines, tree_bytes, write_jsonl)

from tokstream.convert.options import ConversionOptions
from tokstream.convert.tokenize_docs import is_val_document
from tokstream.errors import UserError
from tokstream.format import read_metadata


def stock_samples(root: Path, split: str) -> np.ndarray:
    """Every sample of a split as stock StreamingDataset returns it, in order."""
    from streaming import StreamingDataset

    dataset = StreamingDataset(local=str(root), split=split, shuffle=False, batch_size=1)
    return np.stack([dataset[i]["tokens"] for i in range(len(dataset))])


def convert(inputs: list, out: Path, **options) -> None:
    """What `owt_to_mds.py` does, in-process."""
    from tokstream.convert.cleaning import Cleaning
    from tokstream.convert.text_conversion import convert_text
    from tokstream.tokenizer import load_tokenizer

    options.setdefault("progress", False)
    source_kwargs = {"txt_docs": options.pop("txt_docs", "file"), "text_column": options.pop("text_column", "text")}
    convert_text([str(i) for i in inputs], str(out), source_kwargs, Cleaning(), ConversionOptions(**options),
                 load_tokenizer("gpt2"))


@pytest.mark.parametrize("block_size", [64, 1024])
def test_stream_equals_nanogpt_sample_by_sample(tmp_path, gpt2, articles, block_size):
    corpus = write_jsonl(tmp_path / "wiki.jsonl", articles)
    convert([corpus], tmp_path / "out", block_size=block_size, val_fraction=0, num_workers=2)

    expected = expected_samples(nanogpt_stream(gpt2.encoding, articles), block_size)
    got = stock_samples(tmp_path / "out", "train")
    assert got.dtype == np.uint16
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    meta = read_metadata(tmp_path / "out")
    train = meta.splits["train"]
    assert (train.documents, train.samples) == (len(articles), len(expected))
    assert train.tokens == len(nanogpt_stream(gpt2.encoding, articles))
    assert not (tmp_path / "out" / "val").exists()


def test_split_is_reproducible_and_partitions_documents(tmp_path, gpt2):
    docs = shakespeare_paragraphs()
    corpus = tmp_path / "plays.txt"
    corpus.write_text("\n\n".join(docs) + "\n")
    convert([corpus], tmp_path / "a", block_size=32, val_fraction=0.05, seed=7, txt_docs="paragraph")

    val_docs = [d for d in docs if is_val_document(d, 7, 0.05)]
    train_docs = [d for d in docs if not is_val_document(d, 7, 0.05)]
    assert 0.03 < len(val_docs) / len(docs) < 0.07
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        expected = expected_samples(nanogpt_stream(gpt2.encoding, split_docs), 32)
        np.testing.assert_array_equal(stock_samples(tmp_path / "a", split), expected)
    meta = read_metadata(tmp_path / "a")
    assert meta.splits["train"].documents + meta.splits["val"].documents == len(docs)

    # Same seed, same bytes; the documents in another order, the same documents in val; another seed, another split.
    convert([corpus], tmp_path / "b", block_size=32, val_fraction=0.05, seed=7, txt_docs="paragraph")
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")
    reordered = tmp_path / "reordered.txt"
    reordered.write_text("\n\n".join(docs[::-1]) + "\n")
    convert([reordered], tmp_path / "c", block_size=32, val_fraction=0.05, seed=7, txt_docs="paragraph")
    expected = expected_samples(nanogpt_stream(gpt2.encoding, val_docs[::-1]), 32)
    np.testing.assert_array_equal(stock_samples(tmp_path / "c", "val"), expected)
    assert [d for d in docs if is_val_document(d, 8, 0.05)] != val_docs


def test_byte_identical_for_any_worker_count(tmp_path, articles):
    corpus = write_jsonl(tmp_path / "wiki.jsonl", articles * 3)
    outputs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        convert([corpus], out, block_size=128, val_fraction=0.1, num_workers=workers, shard_size="200kb",
                compression="zstd")
        outputs.append(tree_bytes(out))
    assert len([name for name in outputs[0] if name.startswith("train/shard")]) > 3
    assert outputs[0] == outputs[1] == outputs[2]


def test_txt_jsonl_parquet_and_folders_give_the_same_stream(tmp_path, articles):
    docs = articles[:40]
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, doc in enumerate(docs):
        (folder / f"{i:04d}.txt").write_text(doc, encoding="utf-8")
    write_jsonl(tmp_path / "docs.jsonl", docs, column="content")
    pq.write_table(pa.table({"id": list(range(len(docs))), "content": docs}), tmp_path / "docs.parquet")

    convert([folder], tmp_path / "from_txt", block_size=64, val_fraction=0)
    for name in ("docs.jsonl", "docs.parquet"):
        convert([tmp_path / name], tmp_path / f"out_{name}", block_size=64, val_fraction=0, text_column="content")
        np.testing.assert_array_equal(stock_samples(tmp_path / f"out_{name}", "train"),
                                      stock_samples(tmp_path / "from_txt", "train"))


def test_invalid_utf8_is_replaced_and_counted(tmp_path, gpt2):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_bytes(b'{"text": "caf\xe9 au lait and more words to fill a block"}\n{"text": "fine text"}\n')
    convert([corpus], tmp_path / "out", block_size=4, val_fraction=0)
    meta = read_metadata(tmp_path / "out")
    assert meta.extra["invalid_utf8_documents_replaced"] == 1
    stream = nanogpt_stream(gpt2.encoding, ["caf\ufffd au lait and more words to fill a block", "fine text"])
    np.testing.assert_array_equal(stock_samples(tmp_path / "out", "train"), expected_samples(stream, 4))


def test_cli_converts_and_verifies(tmp_path):
    corpus = ROOT.parent / "shared" / "corpora" / "tinyshakespeare.txt"
    done = run_script("convert/owt_to_mds.py", "--dataset", corpus, "--txt-docs", "paragraph", "--out",
                      tmp_path / "out", "--block-size", "256", "--val-fraction", "0.05", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "train" in done.stdout and "samples" in done.stdout
    checked = run_script("convert/verify.py", tmp_path / "out", "--decode", "0")
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.rstrip().endswith("OK")
    assert "First Citizen:" in checked.stdout

    # Existing output is refused unless --overwrite.
    again = run_script("convert/owt_to_mds.py", "--dataset", corpus, "--out", tmp_path / "out")
    assert again.returncode == 2
    assert "--overwrite" in again.stderr and len(again.stderr.strip().splitlines()) == 1


def test_verify_names_a_corrupt_shard(tmp_path, articles):
    write_jsonl(tmp_path / "wiki.jsonl", articles)
    convert([tmp_path / "wiki.jsonl"], tmp_path / "out", block_size=64, val_fraction=0, shard_size="100kb")
    shard = tmp_path / "out" / "train" / "shard.00002.mds"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    checked = run_script("convert/verify.py", tmp_path / "out")
    assert checked.returncode == 2
    assert "shard.00002.mds: xxh64 hash mismatch" in checked.stderr


BAD_INPUTS = [
    # (description, files to create, extra args, words the one-line error must contain)
    ("missing path", {}, ["--dataset", "{tmp}/nope.jsonl"], "does not exist"),
    ("unknown type", {"a.csv": b"text\nhello\n"}, ["--dataset", "{tmp}/a.csv"], "unknown file type .csv"),
    ("missing column", {"a.jsonl": b'{"body": "x", "id": 1}\n'}, ["--dataset", "{tmp}/a.jsonl"],
     "no field 'text'; fields: body, id"),
    ("missing parquet column", None, ["--dataset", "{tmp}/a.parquet"], "columns: body"),
    ("empty corpus", {"a.jsonl": b""}, ["--dataset", "{tmp}/a.jsonl"], "no documents"),
    ("too small", {"a.jsonl": b'{"text": "hi"}\n'}, ["--dataset", "{tmp}/a.jsonl"], "fewer than one sample"),
    ("block size", {"a.jsonl": b'{"text": "hi"}\n'}, ["--dataset", "{tmp}/a.jsonl", "--block-size", "0"],
     "--block-size must be at least 1"),
    ("bad json", {"a.jsonl": b'{"text": "hi"\n'}, ["--dataset", "{tmp}/a.jsonl"], "a.jsonl:1: invalid JSON"),
]


@pytest.mark.parametrize("name,files,args,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_one_line_and_no_output(tmp_path, name, files, args, message):
    if files is None:
        pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    for filename, content in (files or {}).items():
        (tmp_path / filename).write_bytes(content)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    done = run_script("convert/owt_to_mds.py", *args, "--out", tmp_path / "out", "--val-fraction", "0")
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("sig, tokenizer_process", [(signal.SIGKILL, False), (signal.SIGTERM, False),
                                                    (signal.SIGKILL, True)],
                         ids=["SIGKILL", "SIGTERM", "a tokenizer process SIGKILLed"])
def test_killed_conversion_never_looks_complete_and_resumes_exactly(tmp_path, sig, tokenizer_process):
    """The rerun continues the file at the saved byte offset: what lies before it is never read again
    (here it is overwritten, size and modification time kept, and the output is still exact), but for
    the byte just before, which says whether a document starts at the offset."""
    corpus = tagged_lines(tmp_path / "lines.txt", 2)
    original = corpus.read_bytes()
    args = ["--dataset", corpus, "--txt-docs", "line", "--block-size", "64", "--shard-size", "64kb",
            "--num-workers", "2" if tokenizer_process else "1", "--no-progress", "--val-fraction", "0.1"]

    def overwrite_what_was_read():
        offset = saved_state_header(tmp_path / "out.partial")["source"]["position"]["offset"]
        assert 0 < offset < len(original)
        stamp = os.stat(corpus)
        corpus.write_bytes(b"#" * (offset - 1) + original[offset - 1:])
        os.utime(corpus, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))

    output = kill_then_resume("convert/owt_to_mds.py", args, tmp_path / "out", sig, overwrite_what_was_read,
                              tokenizer_process)
    resumed_at = int(re.search(r"continues after document ([\d,]+), nothing is read twice", output).group(1)
                     .replace(",", ""))
    assert resumed_at > 0, output

    corpus.write_bytes(original)
    clean = run_script("convert/owt_to_mds.py", *args, "--out", tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "clean")


def test_a_rerun_with_other_settings_refuses_the_interrupted_output(tmp_path):
    corpus = tagged_lines(tmp_path / "lines.txt", 2)
    args = ["--dataset", corpus, "--txt-docs", "line", "--block-size", "64", "--shard-size", "64kb",
            "--num-workers", "1", "--no-progress"]
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / ".resume-key.json").write_text('{"inputs": "something else"}')  # what another run left
    refused = run_script("convert/owt_to_mds.py", *args, "--out", tmp_path / "out")
    assert refused.returncode == 2 and "interrupted conversion of other inputs or settings" in refused.stderr
    redone = run_script("convert/owt_to_mds.py", *args, "--out", tmp_path / "out", "--overwrite")
    assert redone.returncode == 0, redone.stderr
    assert not partial.exists() and (tmp_path / "out" / "metadata.json").exists()


def test_offline_hub_dataset_is_one_clear_line(tmp_path):
    import os

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = run_script("convert/owt_to_mds.py", "--out", tmp_path / "owt", "--max-docs", "10", env=env, timeout=120)
    assert done.returncode == 2
    assert "could not open dataset Skylion007/openwebtext" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "owt").exists() and not (tmp_path / "owt.partial").exists()


def test_local_ranks_file_gives_the_same_tokens_offline(tmp_path, articles):
    import os

    corpus = write_jsonl(tmp_path / "wiki.jsonl", articles[:50])
    ranks = ROOT.parent / "shared" / "tokenizers" / "r50k_base.tiktoken"
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_CACHE_DIR"}
    env["TIKTOKEN_CACHE_DIR"] = str(tmp_path / "empty-cache")  # nothing cached: only the ranks file can work
    by_file = run_script("convert/owt_to_mds.py", "--dataset", corpus, "--out", tmp_path / "a", "--ranks-file", ranks,
                         "--val-fraction", "0", "--block-size", "64", env=env)
    assert by_file.returncode == 0, by_file.stderr
    convert([corpus], tmp_path / "b", block_size=64, val_fraction=0)
    assert (tmp_path / "a/train/shard.00000.mds").read_bytes() == (tmp_path / "b/train/shard.00000.mds").read_bytes()


def write_parquet_files(directory: Path, docs: list[str], files: int) -> list[int]:
    """`docs` spread over `files` parquet files (small row groups); returns each file's document count."""
    directory.mkdir(exist_ok=True)
    counts = []
    for index, part in enumerate(np.array_split(np.array(docs, dtype=object), files)):
        pq.write_table(pa.table({"text": list(part)}), directory / f"part-{index:03d}.parquet", row_group_size=200)
        counts.append(len(part))
    return counts


def hub_docs(copies: int) -> list[str]:
    paragraphs = shakespeare_paragraphs()
    return [f"{copy} {p}" for copy in range(copies) for p in paragraphs]


def convert_stream(out: Path, data_files: str, split: str = "train", max_docs: int | None = None, **parts):
    """What owt_to_mds.py --dataset parquet --data-files ... runs, in this process (a thin CLI over it)."""
    from tokstream.convert.cleaning import Cleaning
    from tokstream.convert.text_conversion import convert_text
    from tokstream.tokenizer import load_tokenizer

    options = ConversionOptions(block_size=64, val_fraction=0.1, num_workers=1, progress=False, max_docs=max_docs)
    return convert_text(["parquet"], str(out), {"hub_split": split, "data_files": [data_files]}, Cleaning(), options,
                        load_tokenizer("gpt2"), **parts)


def test_a_killed_datasets_stream_continues_where_it_stood_reading_nothing_twice(tmp_path):
    """Through `datasets`' own streaming (here its parquet builder over local files; a hub dataset takes the
    same path): after a SIGKILL past the first file, the rerun continues the stream from the saved position
    and writes the bytes of an uninterrupted run, --max-docs counted from the start. The first file is
    rewritten with other text before the rerun: a rerun that read it again would write other tokens."""
    from tokstream.convert.resume import STATE_FILE

    docs = hub_docs(3)  # ~3.4 MB of text: 1 MB batches, so states are saved within and after the first file
    pattern = str(tmp_path / "data" / "*.parquet")
    counts = write_parquet_files(tmp_path / "data", docs, 3)
    max_docs = len(docs) - counts[2] // 2  # ends half way through the last file
    convert_stream(tmp_path / "reference", pattern, max_docs=max_docs)

    args = ["--dataset", "parquet", "--data-files", pattern, "--block-size", "64", "--val-fraction", "0.1",
            "--num-workers", "1", "--no-progress", "--state-interval", "0", "--max-docs", str(max_docs),
            "--out", str(tmp_path / "resumed")]
    process = subprocess.Popen([sys.executable, str(ROOT / "convert/owt_to_mds.py"), *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    state = tmp_path / "resumed.partial" / STATE_FILE

    def documents_saved() -> int:
        try:
            with np.load(state) as saved:
                return json.loads(saved["header"].tobytes())["next_document"]
        except (OSError, ValueError, KeyError):
            return 0

    while documents_saved() < counts[0] and process.poll() is None:
        time.sleep(0.005)
    process.kill()
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, "finished before the kill: give the test more text"
    saved = documents_saved()
    write_parquet_files(tmp_path / "data", ["other text"] * counts[0] + docs[counts[0]:], 3)

    resumed = run_script("convert/owt_to_mds.py", *args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"the source continues after document {saved:,}, nothing is read twice" in resumed.stdout
    assert tree_bytes(tmp_path / "resumed") == tree_bytes(tmp_path / "reference")
    metadata = read_metadata(tmp_path / "resumed")
    assert metadata.splits["train"].documents + metadata.splits["val"].documents == max_docs


def test_a_datasets_split_and_data_files_are_chosen(tmp_path):
    write_parquet_files(tmp_path / "data", hub_docs(1)[:600], 2)
    (tmp_path / "data" / "part-001.parquet").rename(tmp_path / "data" / "held-out.parquet")
    metadata = convert_stream(tmp_path / "out", str(tmp_path / "data" / "part-*.parquet"), split="validation")
    assert metadata.splits["train"].documents + metadata.splits["val"].documents == 300  # the files named only
    assert metadata.source["split"] == "validation"
    assert metadata.source["data_files"] == [str(tmp_path / "data" / "part-*.parquet")]
    with pytest.raises(UserError, match=r"could not open dataset parquet, split train: ValueError: At least one "):
        convert_stream(tmp_path / "refused", str(tmp_path / "data" / "none-*.parquet"))
    assert not (tmp_path / "refused").exists()


def test_a_datasets_stream_in_parts_merges_to_the_one_pass_bytes(tmp_path):
    """--num-parts for a `datasets` stream: each part a contiguous run of its data files (datasets' own
    sharding), merged byte-identical to one pass over the same files."""
    pattern = str(tmp_path / "data" / "*.parquet")
    write_parquet_files(tmp_path / "data", hub_docs(1), 5)
    convert_stream(tmp_path / "one", pattern)
    for part in ("1", "0"):
        assert convert_stream(tmp_path / "parts", pattern, num_parts=2, part=part) is None
    convert_stream(tmp_path / "parts", pattern, num_parts=2, merge=True)
    assert tree_bytes(tmp_path / "parts") == tree_bytes(tmp_path / "one")
    with pytest.raises(UserError, match="--num-parts 6 exceeds the dataset's 5 data files"):
        convert_stream(tmp_path / "six", pattern, num_parts=6)


def _dies_mid_message():
    """A tokenizer process killed while it sends its batch: half a message in the results' pipe, then the kill."""
    import struct

    result_queue = sys._getframe(1).f_locals["result_queue"]  # concurrent.futures.process._process_worker's
    result_queue._writer._send(struct.pack("!i", 1 << 20) + b"half of it")
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_tokenizer_process_killed_while_sending_its_batch_ends_the_conversion_in_one_line():
    """The executor's own thread would wait on the half message for ever (the conversion hung, found under load):
    the converter finds the dead process, says so in its one line, and the executor shuts down."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from tokstream.convert.tokenize_docs import _result
    from tokstream.errors import WorkLost

    executor = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver"))
    future = executor.submit(_dies_mid_message)
    with pytest.raises(WorkLost, match="a tokenizer process died"):
        _result(future, executor)
    executor.shutdown(wait=True, cancel_futures=True)  # returns: its thread is not left reading
