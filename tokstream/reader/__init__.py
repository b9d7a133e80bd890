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

# Before any module here imports streaming: streaming without transformers and torchvision until they
# are used, about 4.5 s less start-up in every rank (streaming_door/streaming_import.py). This changes
# no behaviour of streaming; its replacements are put in place only by streaming_door.install().
from tokstream.reader.streaming_door.streaming_import import import_streaming

import_streaming()

from tokstream.reader.batch_plan import BatchPlan  # noqa: E402
from tokstream.reader.batches import TrainBatches, eval_batches, to_device  # noqa: E402
from tokstream.reader.config import DataConfig, StreamConfig  # noqa: E402
from tokstream.reader.dataset import AUTO_SHUFFLE, Dataset, open_dataset  # noqa: E402
from tokstream.reader.order.read_check import read_digest, read_sums  # noqa: E402
from tokstream.reader.sample_order import SampleOrder  # noqa: E402
from tokstream.reader.stale_shm import remove_stale_shared_memory  # noqa: E402

__all__ = ["AUTO_SHUFFLE", "BatchPlan", "DataConfig", "Dataset", "SampleOrder", "StreamConfig", "TrainBatches", "eval_batches",
           "open_dataset", "read_digest", "read_sums", "remove_stale_shared_memory", "to_device"]
