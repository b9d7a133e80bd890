"""The tests' "stock streaming" (tests/stock_streaming.py) is streaming as shipped, not with the project's parts.

The README's claims compare the project's reader and epoch order with stock StreamingDataset and
StreamingDataLoader; the project installs its own versions in streaming's modules when a reader is
built (streaming_door.install()), so the references run in a process of their own that must have
none of them.
"""

import os
import subprocess
import sys

import pytest

from tokstream.reader import streaming_door  # first: it imports streaming as training does (stock_streaming imports it too)

from conftest import ROOT  # noqa: I001
from stock_streaming import replaced_in_streaming

# Every name streaming_internals.py and streaming_import.py put the project's own versions at.
THE_PROJECTS = {
    "streaming.base.dataset.get_sampling",
    "streaming.base.dataset.Spanner",
    "streaming.base.stream.reader_from_json",
    "streaming.base.dataset.get_shm_prefix",
    "streaming.base.dataset.FileLock",
    "streaming.base.shared.barrier.FileLock",
    'streaming.base.shuffle.algos["py1e"]',
    'streaming.base.shuffle.algos["feistel_window"]',  # the project's own lazy orders, registered beside stock's
    'streaming.base.shuffle.algos["lazy"]',
    'streaming.base.batching.batching_methods["random"]',
    "streaming.base.dataloader.BatchEncoding",
    "streaming.base.dataloader.BatchFeature",
}


def test_the_stock_references_run_in_a_process_with_none_of_the_projects_replacements(stock):
    assert stock.replaced() == []


def test_importing_the_reader_or_the_trainer_replaces_nothing_but_what_defers_transformers():
    """The door is switched on by install() alone: a module import patches no behaviour of streaming."""
    code = ("import tokstream.train.trainer, tokstream.reader; from stock_streaming import replaced_in_streaming; "
            "print([n for n in replaced_in_streaming() if not n.startswith('imported ')])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "['streaming.base.dataloader.BatchEncoding', 'streaming.base.dataloader.BatchFeature']", (
        out.stderr[-2000:])


@pytest.mark.parametrize("reader", [
    "TrainBatches(open_dataset(DataConfig(remote=sys.argv[1])), BatchPlan(8, 8, 1)).close()",
    "next(iter(eval_batches(open_dataset(DataConfig(remote=sys.argv[1])), 4, 1)[0]['ds']))"])
def test_building_a_reader_puts_every_replacement_in_place(dataset, reader):
    """What opens the door: TrainBatches or eval_batches (through TokenDataset), in a fresh process that did
    nothing else."""
    code = ("import sys; from tokstream.reader import BatchPlan, DataConfig, TrainBatches, eval_batches, open_dataset; "
            f"from stock_streaming import replaced_in_streaming; {reader}; "
            "print(sorted(n for n in replaced_in_streaming() if not n.startswith('imported ')))")
    out = subprocess.run([sys.executable, "-c", code, str(dataset)], cwd=ROOT / "tests", capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == str(sorted(THE_PROJECTS)), out.stderr[-2000:]


def test_the_check_finds_each_replacement_in_a_process_that_imported_the_project():
    streaming_door.install()  # as every reader does when it is built
    replaced = replaced_in_streaming()
    assert {name for name in replaced if not name.startswith("imported ")} == THE_PROJECTS
    assert "imported tokstream.reader.streaming_door.epoch_order" in replaced
