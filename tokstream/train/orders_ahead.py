"""A run's epoch orders built ahead of time (train/build_orders.py): the files its readers would otherwise build at
their first launch and each epoch's start (data.order_dir, by default the run's orders/), built once on a machine
with the memory, so that every launch of the run maps them.

Each stream of the run (the data one or more phases read, phases.py) is opened as the ledger opens it and its
epochs' orders built; data read in the lazy order (data.shuffle_algo: feistel_window, or `auto` on large data) needs
none, and is said to.
"""

from tokstream.reader import SampleOrder
from tokstream.train.config import TrainConfig
from tokstream.train.phases import Recipe


def build_orders(config: TrainConfig, epochs: range) -> list[str]:
    """One line per stream: the files built (or found) for `epochs`, or why there are none."""
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
