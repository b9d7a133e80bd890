"""Nothing lost, ever (issue 29): --overwrite replaces only a dataset this project wrote, an output never
lies among its inputs, one conversion at a time writes an output, text that is not UTF-8 is decoded or
refused, bad input is one line, and verify.py checks the tokenizer's name against its hash."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import BUCKET, CORPORA, ROOT, run_script, split_samples, tagged_lines, tree_bytes

from tokstream.format import read_metadata

TEXT = "convert/text_to_mds.py"
SMALL = ["--block-size", "64", "--num-workers", "1", "--no-progress", "--val-fraction", "0"]


def plays(folder: Path, name: str = "plays.txt") -> Path:
    """The start of Tiny Shakespeare, about 5,000 tokens of real text, as a .txt file in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text((CORPORA / "tinyshakespeare.txt").read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


def assert_refused(done: subprocess.CompletedProcess, *words: str) -> None:
    """Exit status 2 and one line on stderr holding every word, no traceback."""
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def everything(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under `root`: 'untouched' compares the whole tree."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


# --- 1. --overwrite replaces only a dataset this project wrote, or an empty folder ----------------------

def foreign_file(out: Path) -> Path:
    out.mkdir()
    (out / "thesis.doc").write_bytes(b"four years of work")
    return out / "thesis.doc"


def beside_a_dataset(out: Path) -> Path:
    assert run_script(TEXT, plays(out.parent / "earlier"), "--out", out, *SMALL).returncode == 0
    (out / "train" / "notes.txt").write_text("mine")
    return out / "train" / "notes.txt"


def a_shard_like_file_of_its_own(out: Path) -> Path:
    """A user's backup named like one of the project's shards: a shard's name must match whole, not begin alike."""
    assert run_script(TEXT, plays(out.parent / "earlier"), "--out", out, *SMALL).returncode == 0
    shard = next((out / "train").glob("shard.*.mds"))
    (out / "train" / f"{shard.name}.bak").write_bytes(shard.read_bytes())
    return out / "train" / f"{shard.name}.bak"


def metadata_json_of_its_own(out: Path) -> Path:
    out.mkdir()
    (out / "metadata.json").write_text('{"title": "my photos"}')
    return out / "metadata.json"


def a_part_record_of_its_own(out: Path) -> Path:
    """A folder holding a user's file that happens to be named like a finished part's record."""
    out.mkdir()
    (out / "part.json").write_text('{"part": "A-113"}')
    return out / "part.json"


def a_folder_of_its_own_beside_a_dataset(out: Path) -> Path:
    """A user's folder in a dataset, with an index.json like a split's: a split only if the metadata names it."""
    assert run_script(TEXT, plays(out.parent / "earlier"), "--out", out, *SMALL).returncode == 0
    (out / "website").mkdir()
    (out / "website" / "index.json").write_text("{}")
    return out / "website"


def a_file(out: Path) -> Path:
    out.write_text("not a folder")
    return out


def in_an_unfinished_output(out: Path) -> Path:
    partial = out.with_name(out.name + ".partial")
    partial.mkdir()
    (partial / "draft.doc").write_text("mine")
    return partial / "draft.doc"


REFUSAL = "--overwrite replaces only a dataset this project wrote, or an empty folder, and {out}"
OVERWRITES = [  # (what lies at --out, the words of the refusal)
    (foreign_file, REFUSAL + " holds thesis.doc, which no conversion writes: move it away"),
    (beside_a_dataset, REFUSAL + " holds train/notes.txt, which no conversion writes"),
    (a_shard_like_file_of_its_own, REFUSAL + " holds train/shard.00000.mds.bak, which no conversion writes"),
    (metadata_json_of_its_own, REFUSAL + " holds no metadata.json of a finished conversion"),
    (a_part_record_of_its_own, REFUSAL + " holds no metadata.json of a finished conversion"),
    (a_folder_of_its_own_beside_a_dataset, REFUSAL + " holds website/, which no conversion writes"),
    (a_file, REFUSAL + " is a file"),
    (in_an_unfinished_output, "{out}.partial holds draft.doc, which no conversion writes"),
]


@pytest.mark.parametrize("make, words", OVERWRITES, ids=[o[0].__name__ for o in OVERWRITES])
def test_overwrite_refuses_what_this_project_did_not_write_and_replaces_it_once_moved_away(tmp_path, make, words):
    corpus = plays(tmp_path / "corpus")
    out = tmp_path / "out"
    theirs = make(out)
    before = everything(tmp_path)
    refused = run_script(TEXT, corpus, "--out", out, "--overwrite", *SMALL)
    assert_refused(refused, words.format(out=out))
    assert everything(tmp_path) == before  # byte for byte, and no lock or staging folder left

    shutil.rmtree(theirs) if theirs.is_dir() else theirs.unlink()  # what is left is ours, empty, or nothing
    replaced = run_script(TEXT, corpus, "--out", out, "--overwrite", *SMALL)
    assert replaced.returncode == 0, replaced.stderr
    assert read_metadata(out).source["files"] == [str(corpus)]
    assert {p.name for p in tmp_path.iterdir()} - {"earlier"} == {"corpus", "out"}


# --- 2. an output never lies inside, at, or around an input ------------------------------------------------

def write_bin(path: Path) -> Path:
    """A nanoGPT .bin of 300 GPT-2 ids (documents of 50 tokens, each ended by <|endoftext|>)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = np.arange(300, dtype=np.uint16)
    tokens[49::50] = 50256
    tokens.tofile(path)
    return path


PLACES = [  # (converter, input under tmp, --out under tmp, extra args, the words of the refusal)
    (TEXT, "hin2", "hin2/out", [], "is inside the input"),
    (TEXT, "hin", "hin", ["--overwrite"], "is the input"),
    (TEXT, "data/hin/plays.txt", "data", ["--overwrite"], "contains the input"),
    ("convert/bin_to_mds.py", "data/train.bin", "data", ["--overwrite"], "contains the input"),
]


@pytest.mark.parametrize("script, given, out, args, words", PLACES, ids=["inside", "equal", "containing", "bin"])
def test_an_output_among_its_inputs_is_refused_and_the_inputs_stay(tmp_path, script, given, out, args, words):
    if script == TEXT:
        plays((tmp_path / given).parent if given.endswith(".txt") else tmp_path / given)
    else:
        write_bin(tmp_path / given)
    before = everything(tmp_path)
    done = run_script(script, tmp_path / given, "--out", tmp_path / out, *args,
                      *(SMALL if script == TEXT else SMALL[:2] + ["--no-progress"]))
    assert_refused(done, f"--out {tmp_path / out} {words} {tmp_path / given}")
    assert everything(tmp_path) == before


# --- S3: --overwrite leaves objects no conversion writes -----------------------------------------------------

def test_overwrite_of_an_s3_prefix_holding_foreign_objects_is_refused(proxy, tmp_path):
    from tokstream.object_store import S3Dataset

    store = S3Dataset(f"s3://{BUCKET}/theirs")
    store.put_bytes("thesis.doc", b"four years of work")
    done = run_script(TEXT, plays(tmp_path / "corpus"), "--out", f"s3://{BUCKET}/theirs", "--overwrite", *SMALL,
                      "--staging", tmp_path / "staging")
    assert_refused(done, f"s3://{BUCKET}/theirs holds thesis.doc, which no conversion writes")
    assert store.sizes() == {"thesis.doc": 18}


def test_overwrite_of_an_s3_prefix_whose_metadata_is_not_a_datasets_is_refused(proxy, tmp_path):
    """Object names alone do not make a prefix this project's: a site's metadata.json and an index.json."""
    from tokstream.object_store import S3Dataset

    store = S3Dataset(f"s3://{BUCKET}/site")
    store.put_bytes("metadata.json", b'{"title": "my website config"}')
    store.put_bytes("assets/index.json", b"{}")
    done = run_script(TEXT, plays(tmp_path / "corpus"), "--out", f"s3://{BUCKET}/site", "--overwrite", *SMALL,
                      "--staging", tmp_path / "staging")
    assert_refused(done, f"s3://{BUCKET}/site/metadata.json is not a tokstream dataset's")
    assert sorted(store.sizes()) == ["assets/index.json", "metadata.json"]


def test_an_output_named_by_dot_is_its_absolute_path_and_the_root_is_refused(tmp_path):
    corpus = plays(tmp_path / "corpus")
    here = tmp_path / "here"
    here.mkdir()
    done = run_script(TEXT, corpus, "--out", ".", *SMALL, cwd=here)
    assert done.returncode == 0 and read_metadata(here).splits["train"].samples > 0, done.stderr
    root = run_script(TEXT, corpus, "--out", "/", *SMALL)
    assert root.returncode == 2 and root.stderr == ("error: argument --out: / is the root folder: give the output "
                                                    "folder's own path (text_to_mds.py --help lists the options)\n")


@pytest.mark.parametrize("script", [TEXT, "convert/bin_to_mds.py"])
def test_an_output_under_a_regular_file_is_one_line(tmp_path, script):
    given = plays(tmp_path / "corpus") if script == TEXT else write_bin(tmp_path / "corpus" / "train.bin")
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    done = run_script(script, given, "--out", tmp_path / "notes.txt" / "data", "--no-progress")
    assert_refused(done, f"{tmp_path / 'notes.txt'} is a file, not a folder")
    assert (tmp_path / "notes.txt").read_text() == "a file, not a folder"


# --- 3. one conversion at a time per output ----------------------------------------------------------------

def test_a_second_conversion_to_the_same_output_refuses_naming_the_first_and_a_killed_one_blocks_nothing(tmp_path):
    corpus = tagged_lines(tmp_path / "lines.txt", 2)
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / TEXT), corpus, "--out", out, "--doc-per", "line", "--state-interval",
               "0", *SMALL]
    partial = out.with_name("out.partial")

    def start() -> subprocess.Popen:
        process = subprocess.Popen(list(map(str, command)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        deadline = time.monotonic() + 60
        while not (partial / ".conversion-state.npz").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process.poll() is None, "finished before it could be caught: the input is too small"
        return process

    first = start()
    os.kill(first.pid, signal.SIGSTOP)  # held mid-conversion, its lock with it
    try:
        second = run_script(TEXT, *command[2:])
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert_refused(second, f"another conversion to {out} is running (host {socket.gethostname()}, "
                           f"PID {first.pid}, started ")
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr  # the refusal took nothing from the first
    converted = tree_bytes(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lines.txt", "out"]  # no lock file left

    out.rename(tmp_path / "clean")
    killed = start()
    killed.send_signal(signal.SIGKILL)  # the kernel drops its lock; its file and the staging folder stay
    killed.communicate(timeout=60)
    assert partial.exists() and (tmp_path / "out.lock").exists()
    rerun = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming" in rerun.stdout and tree_bytes(out) == converted
    assert not (tmp_path / "out.lock").exists() and not partial.exists()


# --- 4. text that is not UTF-8 -------------------------------------------------------------------------------

def bom_encoded(text: str, codec: str) -> bytes:
    """The text in `codec` with its byte-order mark first (Python's utf-16 and utf-32 write one themselves)."""
    return text.encode(codec) if codec in ("utf-16", "utf-32") else ("\ufeff" + text).encode(codec)


@pytest.mark.parametrize("codec, doc_per", [("utf-16", "paragraph"), ("utf-32", "file"), ("utf-16-be", "line")])
def test_utf16_and_utf32_text_converts_to_the_tokens_of_its_utf8(tmp_path, codec, doc_per):
    text = plays(tmp_path / "utf8").read_text(encoding="utf-8")
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "plays.txt").write_bytes(bom_encoded(text, codec))
    for name in ("utf8", "wide"):
        done = run_script(TEXT, tmp_path / name, "--out", tmp_path / f"{name}.out", "--doc-per", doc_per, *SMALL)
        assert done.returncode == 0, done.stderr
        assert "invalid UTF-8" not in done.stdout
    np.testing.assert_array_equal(split_samples(tmp_path / "wide.out"), split_samples(tmp_path / "utf8.out"))
    wide, utf8 = read_metadata(tmp_path / "wide.out"), read_metadata(tmp_path / "utf8.out")
    assert wide.splits == utf8.splits and wide.extra == utf8.extra


def latin1(path: Path) -> None:
    path.write_bytes(plays(path.parent, "source.txt").read_text().replace("e", "\u00e9").encode("latin-1"))
    (path.parent / "source.txt").unlink()


def utf16_without_mark(path: Path) -> None:
    path.write_bytes(plays(path.parent, "source.txt").read_text().encode("utf-16-le"))
    (path.parent / "source.txt").unlink()


def utf16_jsonl(path: Path) -> None:
    path.write_bytes(json.dumps({"text": "To be, or not to be"}).encode("utf-16") + "\n".encode("utf-16-le"))


NOT_UTF8 = [  # (how the file is made, its name, --doc-per, the words of the refusal)
    (latin1, "plays.txt", "line", "invalid UTF-8 sequences in its first 20,000 bytes: not UTF-8 text"),
    (latin1, "plays.txt", "file", "invalid UTF-8 sequences in its first 20,000 bytes: not UTF-8 text"),
    (utf16_without_mark, "plays.txt", "paragraph", "20,000 of its first 40,000 bytes are NUL: not UTF-8 text"),
    (utf16_jsonl, "docs.jsonl", "file", "is UTF-16 text, and JSON files are read as UTF-8"),
]


@pytest.mark.parametrize("make, name, doc_per, words", NOT_UTF8,
                         ids=["latin-1 by line", "latin-1 whole", "utf-16 without a mark", "utf-16 jsonl"])
def test_a_file_that_is_mostly_not_utf8_is_refused_naming_it(tmp_path, make, name, doc_per, words):
    (tmp_path / "corpus").mkdir()
    plays(tmp_path / "corpus", "fine.txt")  # a good file beside it: the bad one is refused, not skipped
    make(tmp_path / "corpus" / name)
    done = run_script(TEXT, tmp_path / "corpus", "--out", tmp_path / "out", "--doc-per", doc_per, *SMALL)
    assert_refused(done, f"{tmp_path / 'corpus' / name}", words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]  # no output, staging or lock left


def test_up_to_one_percent_of_invalid_utf8_is_repaired_and_counted_and_more_is_refused(tmp_path):
    corpus = plays(tmp_path / "corpus")  # 20,000 bytes of ASCII: 1 % is 200
    text = corpus.read_bytes()
    corpus.write_bytes(text.replace(b"e", b"\xe9", 200))
    done = run_script(TEXT, corpus, "--out", tmp_path / "out", "--doc-per", "paragraph", *SMALL)
    assert done.returncode == 0, done.stderr
    assert "documents had invalid UTF-8 bytes, replaced with U+FFFD" in done.stdout
    corpus.write_bytes(text.replace(b"e", b"\xe9", 201))
    assert_refused(run_script(TEXT, corpus, "--out", tmp_path / "again", "--doc-per", "paragraph", *SMALL),
                   f"{corpus}: 201 invalid UTF-8 sequences in its first 20,000 bytes")
    assert not (tmp_path / "again").exists()


# --- 5. bad input: one line, not a traceback (a --out under a file: above, with 2) -----------

def test_a_parquet_text_column_of_integers_is_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ids.parquet")
    done = run_script(TEXT, tmp_path / "ids.parquet", "--out", tmp_path / "out", *SMALL)
    assert_refused(done, f"{tmp_path / 'ids.parquet'}: column 'text' holds int64, not text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.parquet"]


# --- 6. verify.py: the tokenizer's name and hash must agree --------------------------------------------------

@pytest.mark.parametrize("field, value, words", [
    ("tokenizer_sha256", "0" * 64, "tokenizer 'gpt2' has sha256 306cd27f03c1, not 000000000000"),
    ("tokenizer", "cl100k_base", "sha256 306cd27f03c1 is r50k_base's, not that of tokenizer 'cl100k_base'"),
], ids=["hash", "name"])
def test_verify_refuses_metadata_whose_tokenizer_contradicts_its_hash(tmp_path, field, value, words):
    assert run_script(TEXT, plays(tmp_path / "corpus"), "--out", tmp_path / "out", *SMALL).returncode == 0
    checked = run_script("convert/verify.py", tmp_path / "out")
    assert checked.returncode == 0 and checked.stdout.endswith("OK\n"), checked.stderr
    metadata = tmp_path / "out" / "metadata.json"
    edited = json.loads(metadata.read_text())
    edited[field] = value
    metadata.write_text(json.dumps(edited))
    assert_refused(run_script("convert/verify.py", tmp_path / "out"), f"{tmp_path / 'out'}/metadata.json "
                   f"contradicts itself: {words}")


def test_a_ranks_file_that_is_not_gpt2s_is_refused_rather_than_named_gpt2(tmp_path):
    """A dataset must not carry GPT-2's name over other ranks: verify.py would (rightly) call it damaged,
    and reconverting could never repair it."""
    ranks = Path(os.environ["TIKTOKEN_CACHE_DIR"]) / "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4"
    edited = tmp_path / "custom.tiktoken"
    edited.write_bytes(b"".join(ranks.read_bytes().splitlines(keepends=True)[:-1]))
    done = run_script(TEXT, plays(tmp_path / "corpus"), "--out", tmp_path / "out", "--ranks-file", edited, *SMALL)
    assert_refused(done, f"ranks file {edited} is not GPT-2's BPE ranks (sha256 ")
    assert not (tmp_path / "out").exists()


def test_an_encoding_that_cannot_be_fetched_offline_is_one_line_naming_the_ways_out(tmp_path):
    """No cached ranks and no way to download them (a proxy on a closed loopback port stands for a machine
    without a network): the line says what to set."""
    from tokstream.testing.loopback_s3 import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / "empty-cache"), HTTPS_PROXY=closed, HTTP_PROXY=closed,
               https_proxy=closed, http_proxy=closed, NO_PROXY="", no_proxy="")
    done = run_script(TEXT, plays(tmp_path / "corpus"), "--out", tmp_path / "out", *SMALL, env=env, timeout=120)
    assert_refused(done, "could not load tiktoken encoding 'gpt2'", "Offline? set TIKTOKEN_CACHE_DIR to a tiktoken "
                   "cache or pass --ranks-file r50k_base.tiktoken")
    assert not (tmp_path / "out").exists()
