"""Training checks its dataset (issue 29): a dataset that disagrees with itself, or with the model, ends the
run in one line naming the file, through torchrun, instead of training on repeats or an IndexError mid-run.

Counts are checked at start (metadata.json against index.json, index.json against the shards' headers), and
the counts of shards not local at start (compressed, or remote) when a reader first maps one; token ids in every
batch read. A bad config file or override is one line too.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, modules_imported

import test_training as training
from tokstream.format import shard_samples

NO_TRACEBACK = f'File "{ROOT / "tokstream"}'  # the trainer's own frames (torchrun prints its own traceback)


def error_lines(output: str) -> list[str]:
    """The "error: ..." lines, a progress bar's text before them left out."""
    return re.findall(r"error: .*", output)


def refused(dataset: Path, tmp_path: Path, nproc: int = 2) -> list[str]:
    """The error lines of a run that must fail (on GPT-2's vocabulary, as this file's datasets), checked for a
    non-zero exit and no traceback of the trainer."""
    process = training.launch(nproc, dataset, tmp_path / "run", "model.vocab_size=50304", warm=True)
    output, _ = process.communicate(timeout=180)
    assert process.returncode != 0, output[-3000:]
    assert NO_TRACEBACK not in output, output[-3000:]
    return sorted(set(error_lines(output)))  # a reader's line: said by each rank that met the shard


def edit_json(path: Path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


@pytest.fixture
def data(tmp_path) -> Path:
    """246 train samples in one shard, 16 val: the issue's numbers, in GPT-2's vocabulary (the edges below are its)."""
    return training.tiny_splits(tmp_path, 246, 16, gpt2=True)


def test_metadata_counts_must_agree_with_the_index(data, tmp_path):
    """99,999 train samples claimed for an index of 246: epochs of repeats, rc 0, before the check."""
    edit_json(data / "metadata.json", lambda m: m["splits"]["train"].update(samples=99_999))
    assert refused(data, tmp_path) == [
        f"error: {data}/metadata.json says the train split has 99999 samples, its index.json 246: one of them is "
        f"stale or hand-edited; python convert/verify.py {data} checks the dataset, reconverting repairs it"]


def claim_300_samples(data: Path) -> None:
    """An index (and a metadata, so that the two agree) claiming 300 samples of a shard holding 246."""
    edit_json(data / "train" / "index.json", lambda index: index["shards"][0].update(samples=300))
    edit_json(data / "metadata.json", lambda m: m["splits"]["train"].update(samples=300))


def test_an_index_claiming_more_samples_than_the_shard_holds_is_refused_at_start(data, tmp_path):
    """The file's size is the index's (only the count changed): the shard's header says 246. Before the
    check: an IndexError traceback at the first sample past 246."""
    claim_300_samples(data)
    assert refused(data, tmp_path) == [
        f"error: shard {data}/train/shard.00000.mds holds 246 samples, the index says 300: the dataset is damaged; "
        f"python convert/verify.py {data} checks every shard, reconverting repairs it"]


def test_a_compressed_shard_claiming_more_samples_is_refused_when_first_read(tmp_path):
    """A compressed shard's header is read once streaming has decompressed it: when the reader maps it."""
    from tokstream.convert.options import ConversionOptions
    from tokstream.convert.token_conversion import Vocabulary, convert_token_files
    from tokstream.convert.token_files import open_token_file
    from tokstream.tokenizer import load_tokenizer

    tokens = tmp_path / "train.bin"
    (np.arange(246 * 64 + 1) % 50256).astype("<u2").tofile(tokens)
    data = tmp_path / "zstd"
    convert_token_files({"train": [open_token_file(tokens)]}, str(data), Vocabulary.of(load_tokenizer("gpt2")),
                        ConversionOptions(block_size=64, compression="zstd", progress=False))
    claim_300_samples(data)
    assert refused(data, tmp_path) == [
        f"error: shard {data}/train/shard.00000.mds holds 246 samples, the index says 300: the dataset is damaged; "
        f"python convert/verify.py {data} checks every shard, reconverting repairs it"]


def test_a_token_id_outside_the_vocabulary_is_refused_naming_the_shard(data, tmp_path):
    """Id 60,000 in a GPT-2 dataset (vocab_size 50,257): an IndexError in the embedding lookup (a device
    assert on a GPU) without the check. Both ranks read the shard; the one that meets it first says so,
    even when it is not rank 0."""
    shard = data / "train" / "shard.00000.mds"
    body = bytearray(shard.read_bytes())
    shard_samples(body, np.uint16, 65)[:, 0] = 60_000  # every sample's first input; the file keeps its size
    shard.write_bytes(body)
    assert refused(data, tmp_path) == [
        f"error: shard {shard} holds token id 60000, outside the dataset's vocab_size 50257: the dataset is damaged; "
        f"python convert/verify.py {data} checks every shard, reconverting repairs it"]


@pytest.mark.parametrize("workers,reuse_buffers", [(0, False), (2, False), (2, True)],
                         ids=["in-rank", "workers", "workers-ring"])
def test_an_id_past_the_vocabulary_in_a_later_shard_and_a_target_column_is_refused_on_every_path(
        tmp_path, workers, reuse_buffers):
    """The check is on what each batch reads: an id planted in the last column (a target only) of one sample of the
    third of five shards is refused in the batch holding it, naming that shard, never handed out, whether the rank
    reads the batch itself or DataLoader workers do, through their pickles or the shared ring."""
    import xxhash

    from tokstream.errors import DamagedData
    from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset

    data = training.tiny_splits(tmp_path, 600, 16, shard_size="16kb", gpt2=True)
    index = json.loads((data / "train" / "index.json").read_text())
    assert len(index["shards"]) >= 5
    shard = data / "train" / index["shards"][2]["raw_data"]["basename"]
    body = bytearray(shard.read_bytes())
    shard_samples(body, np.uint16, 65)[5, 64] = 50257  # sample 5 of shard 2: its last token, a target only
    shard.write_bytes(body)
    edit_json(data / "train" / "index.json",
              lambda index: index["shards"][2]["raw_data"]["hashes"].update(xxh64=xxhash.xxh64(bytes(body)).hexdigest()))
    planted = sum(entry["samples"] for entry in index["shards"][:2]) + 5
    batches = TrainBatches(open_dataset(DataConfig(remote=str(data), num_workers=workers), 50257), BatchPlan(8, 8, 1),
                           reuse_buffers=reuse_buffers)
    given = []
    try:
        with pytest.raises(DamagedData, match=f"shard {shard} holds token id 50257, outside the dataset's vocab_size "
                                              "50257: the dataset is damaged"):
            for _ in range(600 // 8):
                given += next(batches)["ids"].tolist()
    finally:
        batches.close()
    assert planted not in given and len(given) < 600 - 8


def main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train/main.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_bad_yaml_in_a_config_file_or_an_override_is_one_line(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("max_steps: 10\ndata:\n  remote: [demo/data\n")
    result = main(str(config))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"error: config file {config} is not valid YAML (line 4, column 1): expected ',' or "
                             "']', but got '<stream end>'; fix it there\n")

    result = main("configs/tiny.yaml", "max_steps=[")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("error: override 'max_steps=[': '[' is not valid YAML (line 1, column 2): expected the "
                             "node content, but found '<stream end>'; quote a string YAML would misread inside the "
                             "argument, e.g. 'key=\"[a\"'\n")

    config.write_text("- max_steps: 10\n")
    result = main(str(config))
    assert (result.returncode, result.stderr) == (2, f"error: config file {config} holds a list, not keys and "
                                                     "values (see configs/)\n")

    # Said before torch is imported: a mistake costs no start-up (2.5 CPU s there).
    traced, imported = modules_imported("train/main.py", "configs/tiny.yaml", "max_steps=[")
    assert traced.returncode == 2 and "tokstream.train.config" in imported, traced.stderr[-2000:]
    assert "torch" not in imported, "torch imported before the config was read"


@pytest.mark.parametrize("override,message", [
    ("data.cache_limit=2024-01-01", "data.cache_limit must be text, a number or true/false, got "
                                    "datetime.date(2024, 1, 1) (YAML reads it as a date: quote it)"),
    ("resume_allow=[optim.lr, 2024-01-01]", "resume_allow must be text, a number or true/false, got "
                                            "datetime.date(2024, 1, 1) (YAML reads it as a date: quote it)"),
])
def test_a_setting_json_cannot_record_is_refused_at_load(override, message):
    """Each checkpoint records the config as JSON: a YAML date failed the first save, after the run began. (.inf,
    e.g. a preempt_grace_s with no kill to come, is recorded as JSON's Infinity and read back.)"""
    import json

    from tokstream.errors import UserError
    from tokstream.train.config import config_from_dict, load_config

    with pytest.raises(UserError) as refused:
        load_config("configs/tiny.yaml", [override])
    assert str(refused.value) == f"command line: {message}"
    endless = load_config("configs/tiny.yaml", ["preempt_grace_s=.inf"])
    assert config_from_dict(json.loads(json.dumps(endless.to_dict()))) == endless


@pytest.mark.parametrize("chunk", [2, 6, 4 << 20])
def test_the_vocabulary_check_reads_the_samples_exact_in_pieces_of_any_size(tmp_path, monkeypatch, chunk):
    """largest_token (the check's read, kept out of the rank's mapping) against numpy's max of the samples,
    with the samples at an odd offset of the file and the largest id in the first, a middle and the last token."""
    from tokstream import split_check

    monkeypatch.setattr(split_check, "CHECK_CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    for at in (0, 5_000, 9_999):
        tokens = rng.integers(0, 50_000, 10_000).astype("<u2")
        tokens[at] = 60_123
        path = tmp_path / f"shard-{at}.mds"
        path.write_bytes(b"\x01\x02\x03" + tokens.tobytes() + b"\xff\xff")  # a 3-byte header, 2 bytes after
        assert split_check.largest_token(path, 3, 3 + tokens.nbytes, np.uint16) == 60_123


@pytest.mark.parametrize("override,message", [
    ("checkpoint_interval=0", "checkpoint_interval must be a whole number at least 1, got 0"),
    ("log_interval=0", "log_interval must be a whole number at least 1, got 0"),
    ("eval_batches=0", "eval_batches must be a whole number at least 1, got 0"),
    ("max_steps=-3", "max_steps must be a whole number at least 1, got -3"),
    ("eval_interval=-1", "eval_interval must be a whole number at least 0, got -1 (0 turns evaluation off)"),
    ("keep_checkpoints=-1", "keep_checkpoints must be a whole number at least 0, got -1 (0 keeps every checkpoint)"),
    ("lease_interval_s=0", "lease_interval_s must be a finite number above 0, got 0.0"),
    ("optim.beta2=1", "optim.beta2 must be a finite number at least 0 and below 1, got 1.0"),
    ("model.dropout=.nan", "model.dropout must be a finite number at least 0 and below 1, got nan"),
    ("optim.lr=.inf", "optim.lr must be a finite number at least 0, got inf"),
    ("seed=-1", "seed must be a whole number at least 0 and below 2147483648, got -1 (each rank seeds with seed + its "
                "rank)"),
    ("max_steps=null", "max_steps must be set, got null"),
    ("model.n_head=null", "model.n_head must be set, got null"),
    ("data.num_workers=-2", "data.num_workers must be a whole number at least 0, got -2"),
    ("model.n_head=3", "model.n_embd 64 is not a multiple of model.n_head 3: each head takes an equal share of the "
                       "embedding"),
])
def test_a_numeric_setting_out_of_its_range_is_refused_when_the_config_is_made(override, message):
    """Once, at load, naming the setting: a zero interval crashed with ZeroDivisionError after step 1 with nothing
    saved, eval_batches=0 logged val_loss 0.0, max_steps=-3 trained "0 tokens in -3 steps" and exited 0."""
    from tokstream.errors import UserError
    from tokstream.train.config import load_config

    with pytest.raises(UserError) as refused:
        load_config("configs/tiny.yaml", [override])
    assert str(refused.value) == message
    edges = load_config("configs/tiny.yaml", ["eval_interval=0", "keep_checkpoints=0", "optim.grad_clip=.inf",
                                              "optim.decay_steps=null", "seed=0"])  # the edges, and unset optionals
    assert (edges.eval_interval, edges.optim.grad_clip, edges.optim.decay_steps) == (0, float("inf"), None)


def test_a_zero_interval_is_refused_by_the_trainer_in_one_line_before_anything_runs(tmp_path):
    result = main("configs/tiny.yaml", "checkpoint_interval=0", f"run_dir={tmp_path / 'run'}")
    assert (result.returncode, result.stderr) == (2, "error: checkpoint_interval must be a whole number at least 1, "
                                                     "got 0\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("token,refused_", [(50256, False), (50257, True)], ids=["last-id", "vocab-size"])
def test_the_vocabularys_last_id_is_read_and_its_size_refused_by_the_reader_and_verify(data, token, refused_):
    """The edge of the check: GPT-2's vocab_size 50257 is the first id past the embedding, 50256 its last row (the
    torchrun test above uses 60000). The reader reads every sample of a shard holding 50256 and refuses the batch
    holding 50257, naming the shard, and not before it; convert/verify.py, a process of its own, says the same."""
    from tokstream.errors import DamagedData
    from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset

    shard = data / "train" / "shard.00000.mds"
    body = bytearray(shard.read_bytes())
    shard_samples(body, np.uint16, 65)[7, 3] = token  # one token of one sample; the file keeps its size
    shard.write_bytes(body)
    # Its hash made to agree, as a converter that wrote the id would have: only the id is wrong.
    import xxhash

    edit_json(data / "train" / "index.json",
              lambda index: index["shards"][0]["raw_data"]["hashes"].update(xxh64=xxhash.xxh64(bytes(body)).hexdigest()))
    batches = TrainBatches(open_dataset(DataConfig(remote=str(data)), 50257), BatchPlan(8, 8, 1))
    try:
        if refused_:
            given = []
            with pytest.raises(DamagedData, match=f"^shard {shard} holds token id 50257, outside the dataset's "
                                                  "vocab_size 50257: the dataset is damaged"):
                for _ in range(246 // 8):
                    given += next(batches)["ids"].tolist()
            assert 7 not in given and len(given) < 246 - 8  # sample 7 of the first shard: refused where it is read
        else:
            read = np.concatenate([next(batches)["tokens"].numpy() for _ in range(246 // 8)])
            assert (read == token).sum() == 1
    finally:
        batches.close()
    verified = subprocess.run([sys.executable, "convert/verify.py", str(data)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    said = verified.stdout + verified.stderr
    if refused_:
        assert verified.returncode == 2 and "PROBLEM train: token id 50257 >= vocab_size 50257" in said, said
    else:  # 50256 is GPT-2's separator too: verify counts one more than the metadata's documents, and nothing else
        assert "token id" not in said and "1 separator tokens but 0 documents" in said, said
