"""A rank's start-up imports without the cyclic garbage collector walking them (train/main.py).

torch and torch._dynamo (every torch.optim optimizer imports it) make some 500 K objects that live as long as the
process. With the collector on, the import walks them over and over, and the first full collection after it walks
them all again: about 0.8 CPU s per rank on the 2-core test machine (bench/rank_start.py). So the collector is
paused over the imports and what they made is frozen (gc.freeze: never walked by a collection again); objects made
after are collected as usual. The imports' own cyclic garbage (some 9 K objects, about 6 MB: caught ImportErrors'
frames, functions and cells) is frozen with them and kept until exit: bounded, made once. Unfrozen at exit, so
that the interpreter's teardown, where one runs (an error's exit), collects those objects as it would have
(triton's bindings, which torch 2.15's dynamo imports, report as leaked what it does not)."""

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
