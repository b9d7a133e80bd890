"""A rank's start-up imports without the cyclic garbage collector walking them (train/main.py).

torch and torch._dynamo (every torch.optim optimizer imports it) make some 600 K objects that live as long as the
process. With the collector on, the import walks them over and over, and the first collections after it walk
them all again: about a fifth of a rank's CPU to its first steps (bench/rank_start.py). So the collector is paused
over the imports and what they made is frozen (gc.freeze: never walked by a collection again, nor written to by
one in a forked DataLoader worker); it collects the rest as usual. Unfrozen at exit, so that the interpreter's
teardown collects those objects as it would have (triton's bindings, which torch 2.15's dynamo imports, report
as leaked what it does not)."""

import atexit
import gc
from collections.abc import Iterator
from contextlib import contextmanager

from tokstream.gc_pause import collector_paused


@contextmanager
def start_up_frozen() -> Iterator[None]:
    """No collection inside the block (imports, as a rule); what was made by its end frozen, unfrozen at exit."""
    with collector_paused():
        yield
        gc.freeze()
    atexit.register(gc.unfreeze)
