"""streaming's per-shard readers (which a dataset builds from index.json when it is created), built without
`copy.deepcopy`.

Stock's `MDSReader.from_json` deep-copies each shard's entry of the index before it builds the reader from it:
at 27,474 shards (880 M samples of 1,025 tokens) that was 2.0 s of the 2.7 s a rank spent building its dataset
(bench/README.md, "First batch as the dataset grows"). The entries are parsed from index.json by Stream.get_shards
for the readers alone and dropped afterwards, so the readers take their fields as they are. Put in streaming's place
by the door's install()
(streaming_internals.install_reader_from_json); tested equal (tests/test_epoch_order.py).
"""

from tokstream.reader.streaming_door import streaming_internals as internals


def reader_from_json(dirname: str, split: str | None, obj: dict):
    """Stock's `reader_from_json`, the same reader; an MDS shard's without deepcopy (stock's own for any other)."""
    if obj.get("version") != 2 or obj.get("format") != "mds":
        return internals.stock_reader_from_json(dirname, split, obj)  # its checks and its other formats
    # Its fields, not a copy of them: Stream.get_shards parsed the index for these readers alone and drops it after.
    args = dict(obj)
    del args["version"], args["format"]
    args["dirname"], args["split"] = dirname, split
    for key in ("raw_data", "zip_data"):
        args[key] = internals.FileInfo(**args[key]) if args[key] else None
    return internals.MDSReader(**args)
