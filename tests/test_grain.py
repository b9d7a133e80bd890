"""tokstream.grain_source through the real `grain` package: the samples Grain reads are the converted tokens,
every one once per epoch over the processes that share it; an iterator checkpointed part way and restored in
a fresh process goes on with the very samples of one never interrupted (Grain's MapDataset and its DataLoader
with worker processes); damage and misuse are refused in one line."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from tokstream.errors import UserError

grain = pytest.importorskip("grain")

BLOCK = 16
SAMPLES = 60


def known_stream(seed: int = 0) -> np.ndarray:
    """Token ids whose every 17-token window differs, so that a sample names its index."""
    return ((np.arange(SAMPLES * BLOCK + 1) * 7919 + seed * 104729) % 50256).astype("<u2")


def convert(root: Path, seed: int = 0, compression: str | None = None) -> Path:
    """SAMPLES samples of BLOCK + 1 tokens from known_stream, in shards of about 10 samples, no val split."""
    from tokstream.convert.options import ConversionOptions
    from tokstream.convert.token_conversion import Vocabulary, convert_token_files
    from tokstream.convert.token_files import open_token_file
    from tokstream.tokenizer import load_tokenizer

    root.mkdir(parents=True)
    known_stream(seed).tofile(root / "train.bin")
    convert_token_files({"train": [open_token_file(root / "train.bin")]}, str(root / "ds"),
                        Vocabulary.of(load_tokenizer("gpt2")),
                        ConversionOptions(block_size=BLOCK, shard_size=str(10 * (BLOCK + 1) * 2 + 64),
                                          compression=compression, progress=False))
    return root / "ds"


def index_of(rows, seed: int = 0) -> list[int]:
    """Each sample's index in the split, read back from its tokens (known_stream's windows are all distinct);
    -1 for a row that is none of them."""
    stream = known_stream(seed)
    windows = {tuple(stream[k * BLOCK: k * BLOCK + BLOCK + 1].tolist()): k for k in range(SAMPLES)}
    return [windows.get(tuple(np.asarray(row).tolist()), -1) for row in rows]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return convert(tmp_path_factory.mktemp("grain") / "plain")


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_sample_is_the_converted_tokens_and_each_comes_once_an_epoch_over_the_processes(tmp_path, compression):
    from tokstream.grain_source import TokenSampleSource

    source = TokenSampleSource(convert(tmp_path / "ds", compression=compression))
    assert len(source) == SAMPLES and len(list((tmp_path / "ds/ds/train").glob("shard.*"))) > 3
    assert bool(list((tmp_path / "ds/ds/train").glob("shard.*.mds.zstd"))) == (compression is not None)
    assert index_of(source[k] for k in range(SAMPLES)) == list(range(SAMPLES))  # record k is sample k, exactly
    epochs = 2
    shuffled = grain.MapDataset.source(source).shuffle(seed=7).repeat(epochs)
    read = {}
    for process in (0, 1):  # docs/grain.md's recipe, per process: its slice, in batches
        batches = list(shuffled[process::2].batch(4))
        read[process] = index_of(row for batch in batches for row in batch)
        assert all(batch.shape == (4, BLOCK + 1) for batch in batches[:-1]) and batches[0].dtype == np.uint16
    for epoch in range(epochs):
        # Process p holds records p, p + 2, ... of the repeated order: epoch e is records e*SAMPLES onwards.
        this_epoch = [k for process, ids in read.items() for j, k in enumerate(ids)
                      if epoch * SAMPLES <= process + 2 * j < (epoch + 1) * SAMPLES]
        assert sorted(this_epoch) == list(range(SAMPLES))
    assert read[0][:SAMPLES // 2] != sorted(read[0][:SAMPLES // 2])  # shuffled, and each epoch anew:
    assert read[0][:SAMPLES // 2] != read[0][SAMPLES // 2:]


RESTORE = """
import json, sys
import grain
from tokstream.grain_source import TokenSampleSource

kind, root, state, take = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
source = TokenSampleSource(root)
if kind == "map":
    iterator = iter(grain.MapDataset.source(source).shuffle(seed=3).repeat()[1::2].batch(4).to_iter_dataset())
    iterator.set_state(json.loads(state))
else:
    sampler = grain.samplers.IndexSampler(len(source), shard_options=grain.sharding.ShardOptions(1, 2), shuffle=True,
                                          num_epochs=3, seed=3)
    loader = grain.DataLoader(data_source=source, sampler=sampler, worker_count=2,
                              operations=[grain.transforms.Batch(4, drop_remainder=True)])
    iterator = iter(loader)
    iterator.set_state(state.encode())
print(json.dumps([next(iterator).tolist() for _ in range(take)]))
"""


def restored(kind: str, root: Path, state, take: int) -> list:
    """`take` batches from a fresh process that restored `state`."""
    state = json.dumps(state) if kind == "map" else state.decode()
    done = subprocess.run([sys.executable, "-c", RESTORE, kind, str(root), state, str(take)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["map", "loader"])
def test_an_iterator_restored_in_a_fresh_process_goes_on_with_the_same_samples(converted, tmp_path, kind):
    """7 batches, a checkpoint, then 10 more that cross an epoch end (30 samples a process an epoch), against
    the same 10 from a fresh process restored from the checkpoint: with the dataset moved elsewhere too (the
    source is known by its identity, not its path)."""
    from tokstream.grain_source import TokenSampleSource

    source = TokenSampleSource(converted)
    if kind == "map":
        iterator = iter(grain.MapDataset.source(source).shuffle(seed=3).repeat()[1::2].batch(4).to_iter_dataset())
    else:  # Grain's DataLoader, its workers each with a pickled copy of the source
        sampler = grain.samplers.IndexSampler(len(source), shard_options=grain.sharding.ShardOptions(1, 2),
                                              shuffle=True, num_epochs=3, seed=3)
        iterator = iter(grain.DataLoader(data_source=source, sampler=sampler, worker_count=2,
                                         operations=[grain.transforms.Batch(4, drop_remainder=True)]))
    before = [next(iterator) for _ in range(7)]
    state = iterator.get_state()
    after = [next(iterator).tolist() for _ in range(10)]
    # the split's samples, 68 of them: more than the 30 of one epoch's share
    assert -1 not in index_of(row for batch in before + after for row in np.asarray(batch))
    assert restored(kind, converted, state, 10) == after
    moved = tmp_path / "moved"
    shutil.copytree(converted, moved)
    assert restored(kind, moved, state, 10) == after


def test_a_loader_checkpoint_is_refused_for_another_dataset(converted, tmp_path):
    """Grain checks its DataLoader's source by repr on restore; the repr holds the split's identity."""
    from tokstream.grain_source import TokenSampleSource

    other = TokenSampleSource(convert(tmp_path / "other", seed=1))
    assert len(other) == SAMPLES and repr(other) != repr(TokenSampleSource(converted))
    sampler = grain.samplers.IndexSampler(SAMPLES, shuffle=True, num_epochs=1, seed=3)
    iterator = iter(grain.DataLoader(data_source=TokenSampleSource(converted), sampler=sampler))
    next(iterator)
    state = iterator.get_state()
    restarted = iter(grain.DataLoader(data_source=other, sampler=sampler))
    with pytest.raises(ValueError, match="identity="):
        restarted.set_state(state)


def test_sources_mix_through_grain_and_the_module_imports_neither_torch_nor_streaming(converted, tmp_path):
    from tokstream.grain_source import TokenSampleSource

    other = TokenSampleSource(convert(tmp_path / "other", seed=1))
    mixed = list(grain.MapDataset.mix([grain.MapDataset.source(TokenSampleSource(converted)).shuffle(seed=1),
                                       grain.MapDataset.source(other).shuffle(seed=1)], [0.75, 0.25])[:40])
    first, second = index_of(mixed), index_of(mixed, seed=1)
    assert all((a == -1) != (b == -1) for a, b in zip(first, second))  # each record is a sample of one of them
    assert sum(b != -1 for b in second) == 10
    imported = subprocess.run([sys.executable, "-c", "import sys, tokstream.grain_source; "
                               "print(sorted({'torch', 'streaming'} & set(sys.modules)))"],
                              cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert imported.stdout.strip() == "[]", imported.stderr


def test_what_it_cannot_read_is_refused_in_one_line(converted, tmp_path):
    from tokstream.grain_source import TokenSampleSource

    def refusal(*args) -> str:
        with pytest.raises(UserError) as refused:
            TokenSampleSource(*args)
        assert "\n" not in str(refused.value)
        return str(refused.value)

    assert "local disk" in refusal("s3://bucket/owt")
    assert "has no val split" in refusal(converted, "val")
    assert "has no metadata.json" in refusal(tmp_path)
    damaged = tmp_path / "damaged"
    shutil.copytree(converted, damaged)
    shard = sorted((damaged / "train").glob("shard.*.mds"))[1]
    shard.write_bytes(shard.read_bytes()[:-BLOCK])
    assert f"shard {shard} has" in refusal(damaged)
    for key in ("column_encodings", "raw_data"):  # read by this source, and by the split's checks
        index = json.loads((converted / "train/index.json").read_text())
        del index["shards"][0][key]
        shutil.rmtree(damaged)
        shutil.copytree(converted, damaged)
        (damaged / "train/index.json").write_text(json.dumps(index))
        assert f"index.json is damaged (KeyError: '{key}')" in refusal(damaged)
    with pytest.raises(IndexError):
        TokenSampleSource(converted)[SAMPLES]
    with pytest.raises(TypeError):
        TokenSampleSource(converted)[1.5]


def test_a_compressed_shard_that_does_not_decompress_is_named_when_read(tmp_path):
    from tokstream.grain_source import TokenSampleSource

    root = convert(tmp_path / "zstd", compression="zstd")
    shard = sorted((root / "train").glob("shard.*.mds.zstd"))[1]
    shard.write_bytes(bytes(shard.stat().st_size))  # the size the index says, none of the content
    source = TokenSampleSource(root)
    assert index_of([source[0]]) == [0]  # the first shard still reads
    with pytest.raises(UserError, match=f"shard {shard} does not decompress"):
        [source[k] for k in range(SAMPLES)]


def test_a_split_of_more_shards_than_it_keeps_mapped_reads_through_with_few_files_open(converted):
    from tokstream.grain_source import TokenSampleSource

    def open_files() -> int:
        return len(os.listdir("/proc/self/fd"))

    source = TokenSampleSource(converted)
    source.max_mapped_shards = 2
    before = open_files()
    order = np.random.default_rng(0).permutation(SAMPLES).tolist()
    assert [index_of([source[k]])[0] for k in order] == order
    assert open_files() - before <= 2


def test_a_shard_damaged_in_place_or_truncated_while_read_is_refused_not_read_as_other_tokens(converted, tmp_path):
    """As the training reader refuses it: an id equal to the vocabulary's size (50257 for GPT-2: past the embedding)
    written over a shard's last token, the size unchanged, is refused when the shard is read, and the last id of the
    vocabulary is read as it is; a shard cut short after it was mapped is refused, not read as zeros (or a SIGBUS)."""
    from tokstream.grain_source import TokenSampleSource

    def with_last_token(name: str, token: int) -> Path:
        copy = tmp_path / name
        shutil.copytree(converted, copy)
        shard = sorted((copy / "train").glob("shard.*.mds"))[1]
        data = bytearray(shard.read_bytes())
        data[-2:] = np.array([token], dtype="<u2").tobytes()  # the shard's last sample's last token
        shard.write_bytes(bytes(data))
        return copy

    last_of_shard = TokenSampleSource(converted)._starts[2] - 1
    assert TokenSampleSource(with_last_token("last-id", 50256))[last_of_shard][-1] == 50256
    source = TokenSampleSource(with_last_token("past-it", 50257))
    assert index_of([source[0]]) == [0]  # the first shard still reads
    with pytest.raises(UserError) as refused:
        source[last_of_shard]
    shard = sorted((tmp_path / "past-it/train").glob("shard.*.mds"))[1]
    assert str(refused.value) == (f"shard {shard} holds token id 50257, outside the dataset's vocab_size 50257: the "
                                  f"dataset is damaged; python convert/verify.py {tmp_path / 'past-it'} checks every "
                                  "shard, reconverting repairs it")

    copy = tmp_path / "truncated"
    shutil.copytree(converted, copy)
    source = TokenSampleSource(copy)
    assert index_of([source[last_of_shard]]) == [last_of_shard]  # mapped
    shard = sorted((copy / "train").glob("shard.*.mds"))[1]
    size = shard.stat().st_size
    os.truncate(shard, size - 2 * (BLOCK + 1))
    with pytest.raises(UserError, match=f"shard {shard} is {size - 2 * (BLOCK + 1)} bytes since it was opened, not the "
                                        f"{size} its samples need"):
        source[last_of_shard]
