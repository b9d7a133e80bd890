"""The on-disk format: sample layout, dtype rule, and shards byte-identical to streaming's MDSWriter."""

import json
from pathlib import Path

import numpy as np
import pytest

from tokstream.errors import UserError
from tokstream.format import (BlockPacker, DatasetMetadata, ShardWriter, column_encoding, parse_column_encoding,
                              shard_samples, token_dtype)


def metadata(block_size: int, vocab_size: int = 50257) -> DatasetMetadata:
    return DatasetMetadata(tokenizer="gpt2", tokenizer_sha256=None, vocab_size=vocab_size, separator_id=vocab_size - 1,
                           separator_position="after", block_size=block_size,
                           dtype=token_dtype(vocab_size).name, source={}, split={})


def test_dtype_rule():
    assert token_dtype(50257) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    assert token_dtype(128256) == np.uint32  # Llama-3
    assert column_encoding(np.uint16, 1024) == "ndarray:uint16:1025"
    assert parse_column_encoding(column_encoding(np.uint32, 64)) == (np.dtype(np.uint32), 65)


def test_packer_overlaps_by_one_and_counts_the_dropped_tail():
    stream = np.arange(23, dtype=np.uint32)
    packer = BlockPacker(block_size=5, dtype=np.uint32)
    pieces = [packer.add(chunk).copy() for chunk in np.array_split(stream, [1, 2, 9, 9, 17])]
    samples = np.concatenate(pieces)
    np.testing.assert_array_equal(samples, [stream[k * 5 : k * 5 + 6] for k in range(4)])
    assert packer.tokens == 23 and packer.samples == 4
    assert packer.dropped_tokens == 23 - (4 * 5 + 1)  # tokens 21 and 22 never become targets


def _mds_writer_output(directory: Path, samples: np.ndarray, meta: DatasetMetadata, **settings) -> None:
    from streaming import MDSWriter

    writer = MDSWriter(out=str(directory), columns={"tokens": column_encoding(meta.np_dtype, meta.block_size)},
                       **settings)
    for sample in samples:
        writer.write({"tokens": sample})
    writer.finish()


@pytest.mark.parametrize("settings", [
    {"size_limit": 1 << 26, "hashes": []},
    {"size_limit": 20_000, "hashes": ["sha1", "xxh64"]},
    {"size_limit": 20_000, "hashes": ["xxh64"], "compression": "zstd"},
    {"size_limit": 9_000, "hashes": ["xxh3_64"], "compression": "zstd:7"},
])
@pytest.mark.parametrize("vocab_size", [50257, 100277])
def test_shards_are_byte_identical_to_mdswriter(tmp_path, settings, vocab_size):
    meta = metadata(block_size=128, vocab_size=vocab_size)
    rng = np.random.default_rng(0)
    samples = rng.integers(0, vocab_size, size=(301, 129)).astype(meta.np_dtype)
    _mds_writer_output(tmp_path / "stock", samples, meta, **settings)

    writer = ShardWriter(tmp_path / "ours", meta, settings["size_limit"], settings.get("compression"),
                         settings["hashes"])
    for chunk in np.array_split(samples, [0, 7, 150, 151]):  # arbitrary write sizes
        writer.write(chunk)
    writer.finish()

    stock = sorted(p.name for p in (tmp_path / "stock").iterdir())
    assert stock == sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert len(stock) > 2 or settings["size_limit"] == 1 << 26
    for name in stock:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "stock" / name).read_bytes(), name


def test_shard_samples_reads_back_what_was_written(tmp_path):
    meta = metadata(block_size=16)
    samples = np.arange(17 * 10, dtype=np.uint16).reshape(10, 17)
    writer = ShardWriter(tmp_path, meta, "64mb")
    writer.write(samples)
    writer.finish()
    data = (tmp_path / "shard.00000.mds").read_bytes()
    np.testing.assert_array_equal(shard_samples(data, np.uint16, 17), samples)
    np.testing.assert_array_equal(shard_samples(data, np.uint16, 17, every_offset=False), samples)


def test_shard_samples_refuses_a_shard_whose_offsets_are_not_this_formats(tmp_path):
    """Every offset for the checker; the first and last, all a reader's view depends on, for a reader."""
    meta = metadata(block_size=16)
    writer = ShardWriter(tmp_path, meta, "64mb")
    writer.write(np.arange(17 * 10, dtype=np.uint16).reshape(10, 17))
    writer.finish()
    data = bytearray((tmp_path / "shard.00000.mds").read_bytes())
    offsets = np.frombuffer(data, dtype=np.uint32, count=11, offset=4)
    middle, last = data.copy(), data.copy()
    np.frombuffer(middle, dtype=np.uint32, count=11, offset=4)[5] = offsets[5] + 2
    np.frombuffer(last, dtype=np.uint32, count=11, offset=4)[-1] = offsets[-1] + 2
    with pytest.raises(ValueError, match="samples are not 34 bytes each"):
        shard_samples(bytes(middle), np.uint16, 17)
    shard_samples(bytes(middle), np.uint16, 17, every_offset=False)  # the view does not use it
    for every_offset in (True, False):
        with pytest.raises(ValueError):
            shard_samples(bytes(last), np.uint16, 17, every_offset=every_offset)


def test_packer_and_writer_continue_from_their_state_with_the_same_bytes(tmp_path):
    """What a resumed conversion relies on: state_dict mid-stream, fresh objects, load_state_dict."""
    meta = metadata(block_size=8)
    stream = np.random.default_rng(1).integers(0, 50257, size=5_000).astype(np.uint16)
    pieces = np.array_split(stream, [3, 700, 1_800, 1_801, 4_000])

    packer, writer = BlockPacker(8, np.uint16), ShardWriter(tmp_path / "whole", meta, 2_000)
    for piece in pieces:
        writer.write(packer.add(piece))
    writer.finish()

    packer, writer = BlockPacker(8, np.uint16), ShardWriter(tmp_path / "resumed", meta, 2_000)
    for piece in pieces[:3]:
        writer.write(packer.add(piece))
    packer_state, writer_state = packer.state_dict(), writer.state_dict()
    assert len(writer_state["shards"]) >= 2 and len(writer_state["buffered"]) and len(packer_state["pending"])
    packer, writer = BlockPacker(8, np.uint16), ShardWriter(tmp_path / "resumed", meta, 2_000)
    packer.load_state_dict(packer_state)
    writer.load_state_dict(writer_state)
    for piece in pieces[3:]:
        writer.write(packer.add(piece))
    writer.finish()

    assert packer.tokens == len(stream) and packer.samples == (len(stream) - 1) // 8
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "resumed").iterdir())
    for name in names:
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_version_1_metadata_reads_as_an_end_of_text_after_each_document(tmp_path):
    """Datasets converted before separators were explicit keep training and resuming (their identity
    is their files' bytes, unchanged)."""
    from tokstream.format import FORMAT_VERSION, read_metadata

    current = json.loads(metadata(64).to_json())
    old = {key: value for key, value in current.items() if key not in ("separator_id", "separator_position",
                                                                       "tokenizer_sha256")}
    (tmp_path / "metadata.json").write_text(json.dumps({**old, "format_version": 1, "eot_id": 50256}))
    read = read_metadata(tmp_path)
    assert (read.format_version, read.separator_id, read.separator_position, read.tokenizer_sha256) == (
        FORMAT_VERSION, 50256, "after", None)
    (tmp_path / "metadata.json").write_text(json.dumps({**old, "format_version": 3}))
    with pytest.raises(UserError, match="has format version 3, this code reads versions 1 and 2"):
        read_metadata(tmp_path)
