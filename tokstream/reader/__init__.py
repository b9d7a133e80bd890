"""tokstream's reader: converted datasets as exact, resumable micro-batches for any training loop.

    from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset, to_device

    dataset = open_dataset(DataConfig(remote="data/owt"))          # or s3://... with local=, or streams=[...]
    plan = BatchPlan(global_batch_size=64, micro_batch_size=8, world_size=world)
    batches = TrainBatches(dataset, plan, pin_memory=True)          # this rank's part, epoch after epoch
    batches.load_state_dict(saved)                                  # to resume (on any world size)
    for step in ...:
        for _ in range(plan.accumulation):
            inputs, targets = to_device(next(batches), device)
        saved = batches.state_dict()                                # with the checkpoint
    batches.close()

examples/ddp_loop.py is a whole DDP loop that resumes exactly; tokstream's trainer uses these names alone.
Everything that reaches into mosaicml-streaming lives in streaming_door/.
"""

import importlib

# The public names, imported on first use (PEP 562): a process that needs only the order's modules (order files'
# builder, a process of its own at every epoch) imports neither streaming nor torch: 4 CPU s and 600 MB less
# (bench/order_builder.py). The modules that import streaming call import_streaming() first
# (streaming_door/streaming_import.py).
_HOMES = {
    "BatchPlan": "batch_plan", "TrainBatches": "batches", "eval_batches": "batches", "to_device": "batches",
    "DataConfig": "config", "StreamConfig": "config", "AUTO_SHUFFLE": "dataset", "Dataset": "dataset",
    "open_dataset": "dataset", "read_digest": "order.read_check", "read_sums": "order.read_check",
    "SampleOrder": "sample_order", "remove_stale_shared_memory": "stale_shm",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{_HOMES[name]}")
    except AttributeError as err:  # raised inside that module's imports: `from ... import` would hide it
        raise ImportError(f"importing {__name__}.{_HOMES[name]} failed: {err!r}") from err
    value = globals()[name] = getattr(module, name)  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
