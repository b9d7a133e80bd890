"""A plain PyTorch DDP loop on tokstream's reader that survives preemption (a bigram model, to stay short):
    torchrun --nproc_per_node=2 examples/ddp_loop.py DATASET CHECKPOINT STEPS
SIGTERM: every rank finishes the step, rank 0 saves, all exit; the same command resumes exactly, on any number
of ranks that divides the global batch. tests/test_examples.py holds it to an uninterrupted run."""
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset, to_device

GLOBAL_BATCH = 8  # samples per step over all ranks: the reader's order is a function of it and the step


def main(dataset: str, checkpoint: str, steps: int) -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs, with a device per rank
    world, device = dist.get_world_size(), torch.device("cpu")
    notices = []
    signal.signal(signal.SIGTERM, lambda *_: notices.append(1))
    data = open_dataset(DataConfig(remote=dataset))
    vocab_size = data.metadata[0].vocab_size  # the dataset's tokenizer's (GPT-2's: 50,257)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(vocab_size, 32), torch.nn.Linear(32, vocab_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = TrainBatches(data, BatchPlan(GLOBAL_BATCH, GLOBAL_BATCH // world, world))
    step = 0
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"]), optimizer.load_state_dict(state["optimizer"])
        batches.load_state_dict(state["batches"])
        step = state["step"]
    ddp = DistributedDataParallel(model)
    while step < steps:
        inputs, targets = to_device(next(batches), device)
        loss = F.cross_entropy(ddp(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        stop = torch.tensor([loss.item(), len(notices)])
        dist.all_reduce(stop)  # the mean loss, and whether any rank got a notice: all stop at this step
        if dist.get_rank() == 0:
            print(f"step {step} loss {stop[0].item() / world!r}", flush=True)
        if stop[1] or step == steps:
            if dist.get_rank() == 0:  # the reader's state is global: rank 0's is every rank's
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "batches": batches.state_dict(), "step": step}
                with open(checkpoint + ".tmp", "wb") as file:
                    torch.save(state, file)
                    file.flush(), os.fsync(file.fileno())  # on disk before it takes the name: a node that
                os.replace(checkpoint + ".tmp", checkpoint)  # dies mid-save leaves the last one whole
            break
    batches.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
