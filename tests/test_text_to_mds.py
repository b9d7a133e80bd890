"""convert/text_to_mds.py: documents per file/line/paragraph, dedup, normalisation, parts and merge."""

import re
import signal
import subprocess
import sys
import time
import unicodedata

import numpy as np
import pytest
from conftest import (ROOT, expected_samples, kill_then_resume, nanogpt_stream, run_script, shakespeare_paragraphs,
                      split_samples, tagged_lines, tree_bytes, wikitext_articles)

from tokstream.format import read_metadata


def test_dedup_drops_exact_repeats_and_counts_them(tmp_path, gpt2):
    paragraphs = shakespeare_paragraphs()[:400]
    # Known duplicates: every 7th paragraph appears again later, across files.
    repeated = paragraphs[::7]
    (tmp_path / "a.txt").write_text("\n\n".join(paragraphs[:200]) + "\n")
    (tmp_path / "b.txt").write_text("\n\n".join(paragraphs[200:] + repeated) + "\n")
    unique = list(dict.fromkeys(paragraphs + repeated))
    assert len(unique) == len(paragraphs) - (len(paragraphs) - len(set(paragraphs)))
    done = run_script("convert/text_to_mds.py", tmp_path / "a.txt", tmp_path / "b.txt", "--doc-per", "paragraph",
                      "--dedup", "--out", tmp_path / "out", "--block-size", "32", "--val-fraction", "0")
    assert done.returncode == 0, done.stderr
    meta = read_metadata(tmp_path / "out")
    assert meta.extra["duplicates"] == len(paragraphs) + len(repeated) - len(unique)
    assert meta.splits["train"].documents == len(unique)
    np.testing.assert_array_equal(split_samples(tmp_path / "out"), expected_samples(nanogpt_stream(gpt2.encoding, unique), 32))
    assert "dropped documents" in done.stdout


def test_normalisation_and_empty_lines(tmp_path, gpt2):
    decomposed = unicodedata.normalize("NFD", "Café  déjà vu\t here")
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate([decomposed, " \n\t\n", "second   line\n\n\n", "Café déjà vu here"]):
        (folder / f"{i}.txt").write_text(text)  # one document per file; the third becomes empty
    done = run_script("convert/text_to_mds.py", folder, "--normalize", "nfc+whitespace", "--dedup",
                      "--out", tmp_path / "out", "--block-size", "2", "--val-fraction", "0")
    assert done.returncode == 0, done.stderr
    docs = ["Café déjà vu here", "second line"]
    np.testing.assert_array_equal(split_samples(tmp_path / "out"), expected_samples(nanogpt_stream(gpt2.encoding, docs), 2))
    extra = read_metadata(tmp_path / "out").extra
    assert (extra["duplicates"], extra["empty"]) == (1, 1)


def corpus_files(tmp_path, copies: int = 1) -> list:
    """Wikitext articles spread over 12 files, some repeated in later files (dedup has work to do)."""
    articles = wikitext_articles()
    chunks = np.array_split(np.arange(len(articles)), 12)
    files = []
    for i, chunk in enumerate(chunks):
        path = tmp_path / "corpus" / f"{i:02d}.jsonl"
        path.parent.mkdir(exist_ok=True)
        docs = [articles[j] for j in chunk] * copies + ([articles[j] for j in chunks[0][:3]] if i % 4 == 3 else [])
        path.write_text("".join(__import__("json").dumps({"text": d}) + "\n" for d in docs))
        files.append(path)
    return files


ARGS = ["--dedup", "--block-size", "64", "--val-fraction", "0.1", "--shard-size", "128kb", "--no-progress"]


def test_parts_then_merge_equal_one_pass_byte_for_byte(tmp_path):
    files = corpus_files(tmp_path)
    one = run_script("convert/text_to_mds.py", tmp_path / "corpus", "--out", tmp_path / "single", *ARGS)
    assert one.returncode == 0, one.stderr
    for part in (2, 0, 1):  # three "machines", finishing in any order
        done = run_script("convert/text_to_mds.py", tmp_path / "corpus", "--out", tmp_path / "multi", *ARGS,
                          "--num-parts", "3", "--part", str(part))
        assert done.returncode == 0, done.stderr
        assert not (tmp_path / "multi").exists()
    merged = run_script("convert/text_to_mds.py", tmp_path / "corpus", "--out", tmp_path / "multi", *ARGS,
                        "--num-parts", "3", "--merge")
    assert merged.returncode == 0, merged.stderr
    assert read_metadata(tmp_path / "multi").extra["duplicates"] == 9  # 3 files repeat 3 articles of file 0
    assert tree_bytes(tmp_path / "multi") == tree_bytes(tmp_path / "single")
    assert not (tmp_path / "multi.parts").exists()
    assert len(files) == 12


def test_a_merge_removes_only_the_parts_it_merged(tmp_path):
    """Another --num-parts run's parts in the same OUT.parts folder are not this merge's: they stay, byte for byte."""
    corpus_files(tmp_path)
    others = tmp_path / "multi.parts" / "part-00000-of-00003"
    others.mkdir(parents=True)
    (others / "part.json").write_text('{"empty": 0}')
    for part in (0, 1):
        done = run_script("convert/text_to_mds.py", tmp_path / "corpus", "--out", tmp_path / "multi", *ARGS,
                          "--num-parts", "2", "--part", str(part))
        assert done.returncode == 0, done.stderr
    merged = run_script("convert/text_to_mds.py", tmp_path / "corpus", "--out", tmp_path / "multi", *ARGS,
                        "--num-parts", "2", "--merge")
    assert merged.returncode == 0, merged.stderr
    assert [p.name for p in (tmp_path / "multi.parts").iterdir()] == ["part-00000-of-00003"]
    assert (others / "part.json").read_text() == '{"empty": 0}'


def test_merge_refuses_until_every_part_is_done(tmp_path):
    corpus_files(tmp_path)
    run_script("convert/text_to_mds.py", tmp_path / "corpus", "--out", tmp_path / "multi", *ARGS,
               "--num-parts", "3", "--part", "1")
    done = run_script("convert/text_to_mds.py", tmp_path / "corpus", "--out", tmp_path / "multi", *ARGS,
                      "--num-parts", "3", "--merge")
    assert done.returncode == 2 and "parts 0, 2 of 3 are not finished" in done.stderr


def test_part_auto_reads_the_launcher_rank(tmp_path):
    corpus_files(tmp_path)
    env = dict(__import__("os").environ, RANK="1", WORLD_SIZE="2")
    done = run_script("convert/text_to_mds.py", tmp_path / "corpus", "--out", tmp_path / "multi", *ARGS,
                      "--num-parts", "2", "--part", "auto", env=env)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in (tmp_path / "multi.parts").iterdir()] == ["part-00001-of-00002"]


def test_killed_one_pass_run_with_dedup_resumes_with_the_same_bytes(tmp_path):
    """The dedup table is not saved: the resumed run rebuilds it by re-reading (fingerprinting, not
    tokenizing) the chunks converted before, so it drops exactly the documents an uninterrupted run drops."""
    corpus = tagged_lines(tmp_path / "lines.txt", 2)
    args = [corpus, "--doc-per", "line", "--normalize", "nfc+whitespace", "--dedup", "--block-size", "64",
            "--shard-size", "64kb", "--num-workers", "1", "--no-progress", "--val-fraction", "0.1"]
    output = kill_then_resume("convert/text_to_mds.py", args, tmp_path / "out", signal.SIGKILL)
    assert int(re.search(r"re-reading the ([\d,]+) chunks converted before", output).group(1)) > 0, output
    clean = run_script("convert/text_to_mds.py", *args, "--out", tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "clean")
    assert read_metadata(tmp_path / "out").extra["duplicates"] > 0


def test_killed_multi_part_run_resumes_by_part_with_the_same_bytes(tmp_path):
    corpus_files(tmp_path, copies=6)
    cmd = [sys.executable, str(ROOT / "convert/text_to_mds.py"), str(tmp_path / "corpus"), "--out",
           str(tmp_path / "out"), *ARGS, "--num-parts", "4", "--num-workers", "1"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    parts = tmp_path / "out.parts"
    deadline = time.monotonic() + 120
    while not (parts / "part-00001-of-00004").exists() and time.monotonic() < deadline:  # part 0 done, 1 running
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert not (tmp_path / "out").exists()
    assert (parts / "part-00000-of-00004" / "part.json").is_file()

    resumed = subprocess.run(cmd, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "part 0 of 4: already complete, kept" in resumed.stdout
    clean = run_script("convert/text_to_mds.py", tmp_path / "corpus", "--out", tmp_path / "clean", *ARGS)
    assert clean.returncode == 0, clean.stderr
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "clean")


@pytest.mark.parametrize("args,message", [
    (["--part", "0"], "--part and --merge need --num-parts"),
    (["--num-parts", "40"], "exceeds the 12 input files"),
    (["--num-parts", "2", "--part", "5"], "--part must be in [0, 2)"),
    (["--normalize", "nfkc"], "invalid choice"),
])
def test_bad_part_arguments(tmp_path, args, message):
    corpus_files(tmp_path)
    done = run_script("convert/text_to_mds.py", tmp_path / "corpus", "--out", tmp_path / "out", *args)
    assert done.returncode == 2 and message in done.stderr
