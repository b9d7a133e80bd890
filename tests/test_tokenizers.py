"""Tokenizers beyond tiktoken and Llama-3 token shards: a real Hugging Face BPE, trained here on
Tiny Shakespeare from ../shared and saved as tokenizer.json, through the text converter; llm.c-format Llama-3
shards (the documented 256-int32 header, uint32 ids, <|begin_of_text|> before each document)
through bin_to_mds.py. Exact token streams, separators after or before each document, documents
counted by separator, the tokenizer's identity in the metadata, and training's check of it."""

import hashlib
import json

import numpy as np
import pytest
from conftest import expected_samples, run_script, shakespeare_paragraphs, split_samples, tree_bytes
from test_bin_to_mds import write_llmc

from tokstream.errors import UserError
from tokstream.format import read_metadata

LLAMA3_VOCAB, BEGIN_OF_TEXT = 128256, 128000


def train_bpe(path, specials: list[str]):
    """A byte-level BPE of 2,000 tokens trained on Tiny Shakespeare, the specials first (ids 0, 1, ...)."""
    from tokstream.testing.bpe import train_bpe as train

    return train(path, shakespeare_paragraphs(), specials)


@pytest.fixture(scope="module")
def bpe_after(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", ["<|endoftext|>"])


@pytest.fixture(scope="module")
def bpe_before(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", ["<|begin_of_text|>", "<|end_of_text|>"])


@pytest.fixture(scope="module")
def bpe_plain(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", ["<pad>"])  # no separator it knows


def encode(path, text: str) -> list[int]:
    """The tokenizer's own encoding of a document, its special tokens' text read as text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.encode_special_tokens = True
    return tokenizer.encode(text, add_special_tokens=False).ids


DOCS = shakespeare_paragraphs()[:300] + ["a document that names <|endoftext|> and <|begin_of_text|> in its text"]


def convert_text(tmp_path, tokenizer, *extra: str, workers: int = 1):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in DOCS))
    out = tmp_path / f"out-{workers}"
    done = run_script("convert/text_to_mds.py", corpus, "--out", out, "--tokenizer", tokenizer, "--block-size", "32",
                      "--val-fraction", "0", "--num-workers", str(workers), "--no-progress", *extra)
    return out, done


@pytest.mark.parametrize("position", ["after", "before"])
def test_a_tokenizer_json_gives_its_own_tokens_with_the_separator_after_or_before(tmp_path, bpe_after, bpe_before,
                                                                                   position):
    path, special = (bpe_after, "<|endoftext|>") if position == "after" else (bpe_before, "<|begin_of_text|>")
    out, done = convert_text(tmp_path, path)
    assert done.returncode == 0, done.stderr
    separator = [0]  # the first special token of each tokenizer
    stream = [i for doc in DOCS for i in (encode(path, doc) + separator if position == "after" else
                                          separator + encode(path, doc))]
    np.testing.assert_array_equal(split_samples(out), expected_samples(stream, 32))
    metadata = read_metadata(out)
    assert (metadata.tokenizer, metadata.tokenizer_sha256, metadata.vocab_size, metadata.separator_id,
            metadata.separator_position) == (str(path), hashlib.sha256(path.read_bytes()).hexdigest(), 2000, 0,
                                             position)
    assert metadata.splits["train"].documents == len(DOCS) == stream.count(0)  # the literal text stayed text
    assert f"separator 0 {position} each document" in done.stdout
    decoded = run_script("convert/verify.py", out, "--decode", "0")
    assert decoded.returncode == 0 and (special if position == "before" else DOCS[0][:20]) in decoded.stdout


def test_the_separator_can_be_named_and_any_worker_count_writes_the_same_bytes(tmp_path, bpe_before):
    one, done = convert_text(tmp_path, bpe_before, "--separator", "after:<|end_of_text|>")
    assert done.returncode == 0, done.stderr
    two, done = convert_text(tmp_path, bpe_before, "--separator", "after:<|end_of_text|>", workers=2)
    assert done.returncode == 0, done.stderr
    assert tree_bytes(one) == tree_bytes(two)
    metadata = read_metadata(one)
    assert (metadata.separator_id, metadata.separator_position) == (1, "after")
    stream = [i for doc in DOCS for i in encode(bpe_before, doc) + [1]]
    np.testing.assert_array_equal(split_samples(one), expected_samples(stream, 32))


@pytest.mark.parametrize("tokenizer, extra, message", [
    ("missing.json", [], "tokenizer file missing.json does not exist"),
    ("{plain}", [], "holds none of <|endoftext|>, <|begin_of_text|>: name the document separator with --separator "
                    "after:TOKEN (end of each document) or before:TOKEN (its start)"),
    ("{after}", ["--separator", "before:<|eos|>"], "has no token '<|eos|>'"),
    ("{after}", ["--separator", "middle:<|endoftext|>"], "--separator 'middle:<|endoftext|>': give auto, after:TOKEN "
                                                         "or before:TOKEN"),
])
def test_a_tokenizer_that_cannot_separate_documents_is_one_line(tmp_path, bpe_after, bpe_plain, tokenizer, extra,
                                                                message):
    out, done = convert_text(tmp_path, tokenizer.format(plain=bpe_plain, after=bpe_after), *extra)
    assert done.returncode != 0 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not out.exists()


def llama3_documents(rng, count: int) -> list[list[int]]:
    """Documents as llm.c's fineweb.py writes them for Llama-3: <|begin_of_text|>, then the text's ids."""
    return [[BEGIN_OF_TEXT] + rng.integers(0, BEGIN_OF_TEXT, int(rng.integers(5, 400))).tolist() for _ in range(count)]


def test_llama3_llmc_shards_become_uint32_samples_counted_by_begin_of_text(tmp_path):
    rng = np.random.default_rng(3)
    train_docs, val_docs = llama3_documents(rng, 300), llama3_documents(rng, 40)
    train_docs[7][5] = LLAMA3_VOCAB - 1  # the highest id, past uint16
    stream = [i for doc in train_docs for i in doc]
    halves = np.array_split(np.array(stream), 2)
    for index, half in enumerate(halves):
        write_llmc(tmp_path / f"fineweb_train_{index:06d}.bin", half, magic=20240801, version=7, dtype=np.uint32)
    write_llmc(tmp_path / "fineweb_val_000000.bin", np.array([i for d in val_docs for i in d]), magic=20240801,
               version=7, dtype=np.uint32)
    inputs = [str(tmp_path / "fineweb_train_*.bin"), "--val", str(tmp_path / "fineweb_val_000000.bin")]

    refused = run_script("convert/bin_to_mds.py", *inputs, "--out", tmp_path / "refused", "--block-size", "64")
    assert refused.returncode != 0 and not (tmp_path / "refused").exists()
    assert ("is an llm.c Llama-3 shard (magic 20240801, uint32 ids): pass --tokenizer with Llama-3's tokenizer.json "
            "(or hub repository), or --vocab-size 128256 --separator-id 128000 --separator-position before"
            ) in refused.stderr

    out = tmp_path / "out"
    done = run_script("convert/bin_to_mds.py", *inputs, "--out", out, "--block-size", "64", "--vocab-size",
                      str(LLAMA3_VOCAB), "--separator-id", str(BEGIN_OF_TEXT), "--separator-position", "before")
    assert done.returncode == 0, done.stderr
    metadata = read_metadata(out)
    assert (metadata.tokenizer, metadata.tokenizer_sha256, metadata.vocab_size, metadata.separator_id,
            metadata.separator_position, metadata.dtype) == ("vocab-128256", None, LLAMA3_VOCAB, BEGIN_OF_TEXT,
                                                             "before", "uint32")
    assert metadata.splits["train"].documents == 300 and metadata.splits["val"].documents == 40
    samples = split_samples(out)
    assert samples.dtype == np.uint32 and samples.max() == LLAMA3_VOCAB - 1
    np.testing.assert_array_equal(samples, expected_samples(stream, 64))
    assert run_script("convert/verify.py", out).returncode == 0

    from tokstream.reader.config import DataConfig
    from tokstream.reader import open_dataset

    assert open_dataset(DataConfig(remote=str(out)), LLAMA3_VOCAB, 64).samples("train") == [len(samples)]
    with pytest.raises(UserError, match="dataset vocab_size 128256 > model vocab_size 50304"):
        open_dataset(DataConfig(remote=str(out)), 50304, 64)


def test_llmc_shards_of_a_tokenizer_json_take_its_identity(tmp_path, bpe_before):
    docs = DOCS[:50]
    stream = [i for doc in docs for i in [0] + encode(bpe_before, doc)]
    write_llmc(tmp_path / "shard.bin", np.array(stream), magic=20240801, version=7, dtype=np.uint32)
    out = tmp_path / "out"
    done = run_script("convert/bin_to_mds.py", tmp_path / "shard.bin", "--out", out, "--block-size", "32",
                      "--tokenizer", bpe_before)
    assert done.returncode == 0, done.stderr
    metadata = read_metadata(out)
    assert (metadata.tokenizer_sha256, metadata.vocab_size, metadata.separator_id, metadata.separator_position) == (
        hashlib.sha256(bpe_before.read_bytes()).hexdigest(), 2000, 0, "before")
    assert metadata.dtype == "uint16" and metadata.splits["train"].documents == 50
    np.testing.assert_array_equal(split_samples(out), expected_samples(stream, 32))

    from tokstream.reader.config import DataConfig
    from tokstream.reader import open_dataset

    open_dataset(DataConfig(remote=str(out)), 2048, 32)  # 2,000 padded to a multiple of 64
    with pytest.raises(UserError, match="dataset vocab_size 2000 > model vocab_size 1024"):
        open_dataset(DataConfig(remote=str(out)), 1024, 32)


@pytest.mark.parametrize("magic, count, message", [
    (20240522, 10, "is an llm.c evaluation file (magic 20240522: HellaSwag examples), not token data"),
    (20250101, 1000, "has an llm.c-style header (its token count matches the file size) with magic 20250101, which "
                     "this converter does not know"),
])
def test_a_file_with_another_magic_is_named_for_what_it_is(tmp_path, magic, count, message):
    write_llmc(tmp_path / "odd.bin", np.arange(1000), magic=magic, version=1, count=count)
    done = run_script("convert/bin_to_mds.py", tmp_path / "odd.bin", "--out", tmp_path / "out")
    assert done.returncode != 0 and message in done.stderr and not (tmp_path / "out").exists()
