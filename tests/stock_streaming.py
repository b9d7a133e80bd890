"""Stock mosaicml-streaming as shipped, for the tests that compare the project's reader and epoch order with it.

Any process that has built a reader has the project's replacements installed in streaming's own
modules (streaming_door.install(): sampling, the py1e shuffle, random batching, Spanner,
get_shm_prefix, FileLock; and once a reader module has imported streaming, streaming_import.py's
stand-ins for transformers' batch classes), so a StreamingDataset built in the test process may run the project's
code. The references are computed
instead by this file run as a script, in a process of its own that imports streaming and none of
the project: it serves requests (one JSON line each on stdin, the result as .npz) until its stdin
closes, and refuses every one if `replaced_in_streaming()` finds anything not streaming's own.

The tests use `StockStreaming` (conftest.py's `stock` fixture): one such process per test process,
started at the first request, and results kept for the test run in a folder every pytest-xdist
process shares, so a reference asked for twice (same job, arguments and dataset contents) is
computed once.
"""

import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
from streaming import StreamingDataset

REQUEST_TIMEOUT_S = 300


def replaced_in_streaming() -> list[str]:
    """The names in streaming's modules that the project replaces (listed in streaming_internals.py and
    streaming_import.py) and that are not streaming's own in this process; with the project's modules
    that are imported, as "imported tokstream...". Empty in a process running stock streaming."""
    import filelock
    import streaming.base.batching as batching
    import streaming.base.batching.random
    import streaming.base.dataloader as dataloader
    import streaming.base.dataset as dataset
    import streaming.base.sampling
    import streaming.base.shared.barrier
    import streaming.base.shared.prefix
    import streaming.base.shuffle as shuffle
    import streaming.base.shuffle.py1e
    import streaming.base.spanner
    import streaming.base.format
    import streaming.base.stream

    originals = {  # where streaming's code looks each one up -> what streaming defines there
        "streaming.base.dataset.get_sampling": (dataset.get_sampling, streaming.base.sampling.get_sampling),
        "streaming.base.dataset.Spanner": (dataset.Spanner, streaming.base.spanner.Spanner),
        "streaming.base.stream.reader_from_json": (streaming.base.stream.reader_from_json,
                                                   streaming.base.format.reader_from_json),
        "streaming.base.dataset.get_shm_prefix": (dataset.get_shm_prefix, streaming.base.shared.prefix.get_shm_prefix),
        "streaming.base.dataset.FileLock": (dataset.FileLock, filelock.FileLock),
        "streaming.base.shared.barrier.FileLock": (streaming.base.shared.barrier.FileLock, filelock.FileLock),
        'streaming.base.shuffle.algos["py1e"]': (shuffle.algos["py1e"], streaming.base.shuffle.py1e.get_shuffle_py1e),
        'streaming.base.batching.batching_methods["random"]': (
            batching.batching_methods["random"], streaming.base.batching.random.generate_work_random_batching),
    }
    replaced = [name for name, (used, original) in originals.items()
                if used is not original or not used.__module__.startswith(("streaming.", "filelock"))]
    # Any other entry of streaming's registries, and the classes its loader checks batches against.
    replaced += [f'streaming.base.shuffle.algos["{name}"]' for name, algo in shuffle.algos.items()
                 if not algo.__module__.startswith("streaming.")]
    replaced += [f'streaming.base.batching.batching_methods["{name}"]'
                 for name, method in batching.batching_methods.items() if not method.__module__.startswith("streaming.")]
    replaced += [f"streaming.base.dataloader.{name}" for name in ("BatchEncoding", "BatchFeature")
                 if not getattr(dataloader, name).__module__.startswith("transformers.")]
    imported = sorted(f"imported {name}" for name in sys.modules if name.split(".")[0] == "tokstream")
    return list(dict.fromkeys(replaced)) + imported  # a registry entry is found both ways


def streaming_dataset(spec: dict, dataset_class: type = StreamingDataset) -> StreamingDataset:
    """A dataset from JSON-able arguments: `streams` as a list of Stream's keyword arguments."""
    from streaming import Stream

    args = dict(spec)
    if "streams" in args:
        args["streams"] = [Stream(**stream) for stream in args["streams"]]
    return dataset_class(**args)


def configure(dataset: StreamingDataset, settings: dict) -> None:
    """Set a built dataset's epoch settings (shuffle, nodes, batch size...), as the epoch-order tests vary them."""
    for name, value in settings.items():
        setattr(dataset, name, value)


class EveryOtherSample(StreamingDataset):
    """A subclass that resamples its own way (test_epoch_order.py): here so that both processes have it."""

    def resample_streams(self, epoch, stream_id=None):
        units, sample_ids = super().resample_streams(epoch, stream_id)
        return units, sample_ids // 2 * 2


DATASET_CLASSES = {cls.__name__: cls for cls in (StreamingDataset, EveryOtherSample)}


def loader_batches(root: str, seed: int, workers: int, batch_size: int, epochs: int = 1, state: dict | None = None,
                   shuffle_block_size: int | None = None, choose: int | None = None,
                   stop_after: int | None = None) -> dict[str, np.ndarray]:
    """StreamingDataset + StreamingDataLoader over `root`'s train split, shuffled, on one canonical node:
    the `tokens` of every batch over `epochs` (from `state`, if given; the first `stop_after` only, if
    given), the loader's state_dict then (taken with the iterator alive, as a checkpoint is) and the
    dataset's epoch_size."""
    from streaming import Stream, StreamingDataLoader

    with tempfile.TemporaryDirectory() as tmp:
        local = shutil.copytree(root, Path(tmp) / "ds")  # a directory of its own, as each live dataset needs
        dataset = StreamingDataset(streams=[Stream(local=str(local), split="train", choose=choose)], shuffle=True,
                                   shuffle_seed=seed, num_canonical_nodes=1, batch_size=batch_size,
                                   shuffle_block_size=shuffle_block_size)
        loader = StreamingDataLoader(dataset, batch_size=batch_size, num_workers=workers, drop_last=True)
        if state:
            loader.load_state_dict(state)
        batches: list[np.ndarray] = []
        for _ in range(epochs):
            iterator = iter(loader)
            left = None if stop_after is None else stop_after - len(batches)
            batches += [batch["tokens"].numpy().copy() for batch in itertools.islice(iterator, left)]
        out = {"tokens": np.stack(batches) if batches else np.zeros(0, np.uint16),
               "state": np.array(json.dumps(loader.state_dict())), "epoch_size": np.array(dataset.epoch_size)}
        del iterator, loader, dataset
        return out


def epoch_orders(spec: dict, cases: list[dict], resamples: list[dict],
                 dataset_class: str = "StreamingDataset") -> dict[str, np.ndarray]:
    """Streaming's whole-epoch order (generate_work with the dataset's batching method) for each case
    (`settings` of the dataset, `world` as World's arguments, `epoch`, `sample_in_epoch`), or the
    ValueError's repr where streaming refuses it; and `resample_streams(epoch)` for each resample."""
    from streaming.base.batching import generate_work
    from streaming.base.world import World

    dataset = streaming_dataset(spec, DATASET_CLASSES[dataset_class])
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stock's about sizes
        for index, case in enumerate(cases):
            configure(dataset, case["settings"])
            try:
                out[f"work{index}"] = generate_work(dataset.batching_method, dataset, World(*case["world"]),
                                                    case["epoch"], case["sample_in_epoch"])
            except ValueError as refused:
                out[f"work{index}"] = np.array(repr(refused))
        for index, resample in enumerate(resamples):
            configure(dataset, resample["settings"])
            out[f"units{index}"], out[f"ids{index}"] = dataset.resample_streams(resample["epoch"])
    del dataset
    return out


JOBS = {"loader_batches": loader_batches, "epoch_orders": epoch_orders}


def run_beside_other_jobs(job, args: dict) -> dict:
    """The job, tried again when stock's shared-memory prefix scan collides with a dataset another test
    process registers at the same moment (FileExistsError: the race the project's own registration closes,
    prefix_registration.py); its results do not depend on the prefix."""
    for attempt in range(5):
        try:
            return job(**args)
        except FileExistsError:
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))


def serve() -> None:
    """Answer each request line ({"job", "args", "out"}, or {"job": "check"}) with one JSON line:
    {"replaced": replaced_in_streaming()}, and {"error": traceback} if the job raised or was refused. Replies go to the original stdout; anything
    else printing there (streaming, its DataLoader workers) goes to stderr instead."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        request = json.loads(line)
        reply: dict = {"replaced": replaced_in_streaming()}
        try:
            if request["job"] != "check":
                if reply["replaced"]:
                    raise RuntimeError("not stock streaming: " + ", ".join(reply["replaced"]))
                np.savez(request["out"], **run_beside_other_jobs(JOBS[request["job"]], request["args"]))
        except Exception:  # noqa: BLE001  (the test process raises it)
            reply["error"] = traceback.format_exc()
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class StockStreaming:
    """The test side: requests to a stock-streaming process, results kept in `folder` for the test run."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def run(self, job: str, datasets: list, **args) -> dict[str, np.ndarray]:
        """JOBS[job](**args) in the stock process, or its result kept from earlier in the test run.
        `datasets`: the dataset directories `args` names; their contents, not their paths, identify
        the result (each test process builds its own copy of a dataset)."""
        from filelock import FileLock

        request = json.dumps(args, sort_keys=True)
        key = request
        for root in datasets:
            key = key.replace(json.dumps(str(root))[1:-1], directory_digest(Path(root)))
        path = self.folder / f"{job}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.npz"
        with FileLock(path.with_suffix(".lock")):
            if not path.exists():
                partial = path.with_suffix(".partial.npz")
                self.request({"job": job, "args": json.loads(request), "out": str(partial)})
                partial.rename(path)
        with np.load(path) as saved:
            return dict(saved)

    def replaced(self) -> list[str]:
        """replaced_in_streaming() as the stock process finds it."""
        return self.request({"job": "check"})["replaced"]

    def request(self, request: dict) -> dict:
        with self.lock:
            if self.process is None:
                self.log = self.folder / f"stock-streaming-{os.getpid()}.log"
                with open(self.log, "w") as log:
                    self.process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                                    stdout=subprocess.PIPE, stderr=log, text=True)
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            watchdog = threading.Timer(REQUEST_TIMEOUT_S, self.process.kill)  # a hang fails the test
            watchdog.start()
            try:
                line = self.process.stdout.readline()
            finally:
                watchdog.cancel()
            if not line:
                self.process = None
                raise RuntimeError(f"the stock streaming process ended: {self.log.read_text()[-3000:]}")
            reply = json.loads(line)
            if "error" in reply:
                raise RuntimeError(f"in the stock streaming process: {reply['error']}")
            return reply

    def close(self) -> None:
        """End the stock process: between requests it holds no dataset (so no shared memory) to clean
        up, and its interpreter's orderly exit took seconds at the end of the test run."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()


def directory_digest(root: Path) -> str:
    """A digest of every file's path and contents under `root`."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file():
            digest.update(f"{path.relative_to(root)}\0{path.stat().st_size}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


if __name__ == "__main__":
    serve()
