"""convert/bin_to_mds.py: nanoGPT .bin, llm.c shards and .npy built from real tokens, read back exactly."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (ROOT, expected_samples, nanogpt_stream, run_script, shakespeare_paragraphs, split_samples,
                      wikitext_articles)

from tokstream.format import read_metadata


@pytest.fixture(scope="module")
def stream(gpt2) -> np.ndarray:
    """GPT-2 tokens of the real corpora, nanoGPT-style (end-of-text after each document)."""
    return np.array(nanogpt_stream(gpt2.encoding, wikitext_articles() + shakespeare_paragraphs()), dtype=np.int64)


def write_llmc(path, tokens: np.ndarray, magic: int = 20240520, version: int = 1, dtype=np.uint16, count=None):
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as out:
        out.write(header.tobytes())
        out.write(tokens.astype(dtype).tobytes())
    return path


def test_every_format_gives_the_input_stream(tmp_path, stream):
    """nanoGPT .bin pieces + an llm.c shard + an .npy, concatenated in the order given."""
    a, b, c = np.array_split(stream, [300_000, 500_000])
    a.astype("<u2").tofile(tmp_path / "train.bin")
    write_llmc(tmp_path / "fineweb_train_000001.bin", b)
    np.save(tmp_path / "owt_train_tokens.npy", c.astype(np.int32))
    done = run_script("convert/bin_to_mds.py", tmp_path / "train.bin", tmp_path / "fineweb_train_000001.bin",
                      tmp_path / "owt_train_tokens.npy", "--out", tmp_path / "out", "--block-size", "512",
                      "--shard-size", "256kb", "--no-progress")
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(split_samples(tmp_path / "out"), expected_samples(stream, 512))
    meta = read_metadata(tmp_path / "out")
    assert meta.source["splits"]["train"]["formats"] == ["nanogpt", "llmc", "npy"]
    assert meta.splits["train"].tokens == len(stream)

    # A second split joins the same dataset; stock StreamingDataset reads both. A run over train goes on: its
    # identity is unchanged (a split added elsewhere is not data it reads).
    from tokstream.reader import DataConfig, open_dataset

    train_only = open_dataset(DataConfig(remote=str(tmp_path / "out")))
    stream[:20_000].astype("<u2").tofile(tmp_path / "val.bin")
    done = run_script("convert/bin_to_mds.py", tmp_path / "val.bin", "--out", tmp_path / "out", "--split", "val",
                      "--block-size", "512")
    assert done.returncode == 0, done.stderr
    assert set(read_metadata(tmp_path / "out").splits) == {"train", "val"}
    with_val = open_dataset(DataConfig(remote=str(tmp_path / "out")))
    assert with_val.identity == train_only.identity and with_val.former_identity != train_only.former_identity
    with_val.check_resumes(train_only.identity)
    from streaming import StreamingDataset

    val = StreamingDataset(local=str(tmp_path / "out"), split="val", shuffle=False, batch_size=1)
    np.testing.assert_array_equal(np.stack([val[i]["tokens"] for i in range(len(val))]),
                                  expected_samples(stream[:20_000], 512))
    assert run_script("convert/verify.py", tmp_path / "out").returncode == 0
    refused = run_script("convert/verify.py", tmp_path / "out", "--split", "nope")  # not a pass for a split not there
    assert refused.returncode == 2 and refused.stderr.strip() == \
        f"error: --split nope: {tmp_path / 'out'} has no such split (it has train, val)", refused.stderr


def test_glob_expands_in_sorted_order(tmp_path, stream):
    pieces = np.array_split(stream[:100_000], 3)
    for i, piece in enumerate(pieces):
        write_llmc(tmp_path / f"edu_fineweb_train_{i:06d}.bin", piece)
    done = run_script("convert/bin_to_mds.py", str(tmp_path / "edu_fineweb_train_*.bin"), "--out",
                      tmp_path / "out", "--block-size", "128")
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(split_samples(tmp_path / "out"), expected_samples(stream[:100_000], 128))


BAD_FILES = [
    ("odd length", lambda p, s: p.write_bytes(b"\x01\x02\x03"), "train.bin", "is odd"),
    ("wrong magic", lambda p, s: write_llmc(p, s[:100], magic=20240520, version=3), "x.bin", "version 3 at offset 4"),
    ("header count", lambda p, s: write_llmc(p, s[:100], count=99), "x.bin", "header (offset 8) says 99 tokens"),
    ("id >= vocab", lambda p, s: np.array([1, 2, 50257, 3], "<u2").tofile(p), "train.bin",
     "token id 50257 at token 2 is outside the vocabulary"),
    ("negative npy", lambda p, s: np.save(p, np.array([5, 6, -1, 7], np.int64)), "t.npy", "negative token id -1 at token 2"),
    ("2-d npy", lambda p, s: np.save(p, np.zeros((2, 2), np.int32)), "t.npy", "expected a 1-D integer array"),
    ("missing", None, "nope.bin", "does not exist"),
]


@pytest.mark.parametrize("name,make,filename,message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_token_files_get_one_line_naming_file_and_offset(tmp_path, stream, name, make, filename, message):
    path = tmp_path / filename
    if make:
        make(path, stream)
    done = run_script("convert/bin_to_mds.py", path, "--out", tmp_path / "out", "--block-size", "2")
    assert done.returncode == 2
    assert message in done.stderr and (make is None or str(path) in done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out" / "train").exists()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_conversion_resumes_from_its_shards_with_the_same_bytes(tmp_path, stream, sig):
    big = np.tile(stream, 40).astype("<u2")  # about 50 M tokens: long enough to interrupt
    big.tofile(tmp_path / "train.bin")
    cmd = [sys.executable, str(ROOT / "convert/bin_to_mds.py"), str(tmp_path / "train.bin"), "--out",
           str(tmp_path / "out"), "--block-size", "256", "--shard-size", "128kb", "--no-progress"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    journal = tmp_path / "out.partial" / "train" / ".shards.journal"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not journal.exists() or journal.read_text().count("\n") < 20):
        time.sleep(0.002)
    process.send_signal(sig)
    process.communicate(timeout=60)
    assert process.returncode != 0, "finished before it could be interrupted"
    assert not (tmp_path / "out").exists() and journal.exists()

    resumed = subprocess.run(cmd, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming train:" in resumed.stdout and "shards verified" in resumed.stdout
    whole = run_script("convert/bin_to_mds.py", tmp_path / "train.bin", "--out", tmp_path / "whole", "--block-size",
                       "256", "--shard-size", "128kb")
    assert whole.returncode == 0
    names = sorted(p.name for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert names == sorted(p.name for p in (tmp_path / "whole").rglob("*") if p.is_file())
    for name in names:
        path = next((tmp_path / "out").rglob(name))
        assert path.read_bytes() == (tmp_path / "whole" / path.relative_to(tmp_path / "out")).read_bytes(), name


def test_partial_output_of_other_inputs_is_not_resumed(tmp_path, stream):
    stream[:10_000].astype("<u2").tofile(tmp_path / "a.bin")
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / ".resume-key.json").write_text('{"inputs": "something else"}')
    done = run_script("convert/bin_to_mds.py", tmp_path / "a.bin", "--out", tmp_path / "out", "--block-size", "64")
    assert done.returncode == 2 and "of other inputs or settings" in done.stderr


def test_token_shards_behind_a_url_are_fetched_one_at_a_time_and_resume_without_refetching(tmp_path, stream,
                                                                                            monkeypatch):
    """FineWeb-Edu's GPT-2 token shards as the hub publishes them (llm.c shards), one held out for val,
    through a URL pattern: file://, the same fsspec path as hf:// without a network. The output equals
    the local files' conversion; at most two shards are staged at any time; a conversion interrupted at
    the third fetch resumes without fetching the shards its verified output already holds."""
    from tokstream.convert import remote_token_files
    from tokstream.convert.options import ConversionOptions
    from tokstream.convert.token_conversion import Vocabulary, convert_token_files
    from tokstream.convert.token_files import open_token_file
    from tokstream.tokenizer import load_tokenizer

    hub = tmp_path / "hub"
    hub.mkdir()
    for index, piece in enumerate(np.array_split(stream[:300_000], 6)):
        write_llmc(hub / f"edu_fineweb_train_{index:06d}.bin", piece)
    train, val = f"file://{hub}/edu_fineweb_train_00000[1-5].bin", f"file://{hub}/edu_fineweb_train_000000.bin"
    vocabulary = Vocabulary.of(load_tokenizer("gpt2"))
    options = ConversionOptions(block_size=256, shard_size="64kb", progress=False, staging_dir=str(tmp_path / "stage"))
    (tmp_path / "stage").mkdir()
    local = {"train": [open_token_file(p) for p in sorted(hub.glob("*_00000[1-5].bin"))],
             "val": [open_token_file(hub / "edu_fineweb_train_000000.bin")]}
    convert_token_files(local, str(tmp_path / "local"), vocabulary, options)

    fetched, staged = [], []
    real_fetch = remote_token_files.fetch_file

    def watched_fetch(remote, target):
        staged.append(len([p for p in (tmp_path / "stage").rglob("*") if p.is_file()]))  # before this download
        if len(fetched) == 2 and interrupt:
            raise KeyboardInterrupt  # Ctrl-C as the third shard starts downloading
        fetched.append(Path(remote.fs_path).name)
        return real_fetch(remote, target)

    monkeypatch.setattr(remote_token_files, "fetch_file", watched_fetch)
    urls = {"train": remote_token_files.expand_url(train, "auto"), "val": remote_token_files.expand_url(val, "auto")}
    interrupt = True
    with pytest.raises(KeyboardInterrupt):
        convert_token_files(urls, str(tmp_path / "remote"), vocabulary, options)
    assert (tmp_path / "remote.partial").is_dir() and not (tmp_path / "remote").exists()
    first_run, fetched[:] = list(fetched), []
    interrupt = False
    convert_token_files(urls, str(tmp_path / "remote"), vocabulary, options)

    assert first_run == ["edu_fineweb_train_000001.bin", "edu_fineweb_train_000002.bin"]
    assert "edu_fineweb_train_000001.bin" not in fetched  # its tokens were all in the verified shards
    assert fetched[-1] == "edu_fineweb_train_000000.bin"  # the val split
    assert max(staged) <= 1 and not list((tmp_path / "stage").rglob("*.bin"))  # one staged, one downloading
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_samples(tmp_path / "remote", split), split_samples(tmp_path / "local",
                                                                                               split))
    assert read_metadata(tmp_path / "remote").source["splits"]["val"]["files"] == [val]
