"""A run's epoch orders built ahead of time (train/build_orders.py): the files its readers would otherwise build at
their first launch and each epoch's start (data.order_dir, by default the run's orders/), built once on a machine
with the memory, so that every launch of the run maps them.

Each stream of the run (the data one or more phases read, phases.py) is opened as the ledger opens it and its
epochs' orders built; data read in the lazy order (data.shuffle_algo: lazy, or `auto` on large data) needs
none, and is said to. An S3 run keeps its orders in each node's run_local: build them there, on each node, or give
data.order_dir a folder every node sees.
"""

from tokstream.reader import SampleOrder
from tokstream.train.checkpoint import newest_run_record
from tokstream.train.config import TrainConfig
from tokstream.train.phases import Recipe
from tokstream.train.resume_policy import keep_run_order
from tokstream.train.run_store import open_run_store


def build_orders(config: TrainConfig, epochs: range) -> list[str]:
    """One line per stream: the files built (or found) for `epochs`, or why there are none. A run that has
    checkpoints keeps its order (resume_policy.keep_run_order), as its relaunch will."""
    _, record = newest_run_record(open_run_store(config.run_dir, config.run_local, check_writable=False))
    if record is not None:
        config = keep_run_order(config, record["config"])
    recipe = Recipe.open(config, 1)
    lines, seen = [], set()
    for phase in recipe.phases:
        stream = recipe.stream(phase)
        if stream in seen:
            continue
        seen.add(stream)
        dataset = recipe.dataset(phase)
        order = SampleOrder(dataset, recipe.units[phase.index])
        try:
            paths = order.build_order_files(epochs)
        finally:
            order.close()
        where = f"{phase.name}'s data" if config.phases else "the data"
        if paths:
            lines.append(f"{where}: epochs {epochs.start}-{epochs.stop - 1} of {dataset.config.shuffle_algo} in "
                         f"{', '.join(paths)}")
        else:
            lines.append(f"{where}: read in {dataset.config.shuffle_algo}, which keeps no files: nothing to build")
    return lines
