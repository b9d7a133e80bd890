"""The tests' "stock streaming" (tests/stock_streaming.py) is streaming as shipped, not with the project's parts.

The README's claims compare the project's reader and epoch order with stock StreamingDataset and
StreamingDataLoader; the project installs its own versions in streaming's modules once imported,
so the references run in a process of their own that must have none of them.
"""

import tokstream.train.data  # noqa: F401  (installs the project's replacements in this process, as training does)
from stock_streaming import replaced_in_streaming

# Every name streaming_internals.py and streaming_import.py put the project's own versions at.
THE_PROJECTS = {
    "streaming.base.dataset.get_sampling",
    "streaming.base.dataset.Spanner",
    "streaming.base.dataset.get_shm_prefix",
    "streaming.base.dataset.FileLock",
    'streaming.base.shuffle.algos["py1e"]',
    'streaming.base.batching.batching_methods["random"]',
    "streaming.base.dataloader.BatchEncoding",
    "streaming.base.dataloader.BatchFeature",
}


def test_the_stock_references_run_in_a_process_with_none_of_the_projects_replacements(stock):
    assert stock.replaced() == []


def test_the_check_finds_each_replacement_in_a_process_that_imported_the_project():
    replaced = replaced_in_streaming()
    assert {name for name in replaced if not name.startswith("imported ")} == THE_PROJECTS
    assert "imported tokstream.train.data" in replaced
