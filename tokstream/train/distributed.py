"""Who this process is in a torchrun job (or an srun step), on which device, and the few collectives training uses."""

import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tokstream.errors import PeerEnded
from tokstream.slurm import alone_in_a_bigger_job, ranks_from_srun


@dataclass(frozen=True)
class Distributed:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    enabled: bool  # launched by torchrun (a process group exists), even with one rank
    node: int = 0  # which of the job's nodes (torchrun numbers ranks node after node)
    nodes: int = 1

    @property
    def master(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, device_setting: str) -> "Distributed":
        """Read torchrun's environment, pick the device ("auto", "cuda" or "cpu") and join the group.

        A rank that srun started without torchrun gets torchrun's variables from Slurm's first: streaming
        and the reader read them from the environment too."""
        os.environ.update(ranks_from_srun())
        if (alone := alone_in_a_bigger_job()) is not None:
            print(alone, file=sys.stderr, flush=True)
        enabled = "RANK" in os.environ
        if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun's agent
            exit_when_orphaned()
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        use_cuda = device_setting == "cuda" or (device_setting == "auto" and torch.cuda.is_available())
        device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        if enabled:
            store = _store_of_this_attempt(world)
            if store is None:
                dist.init_process_group("nccl" if use_cuda else "gloo")
            else:
                dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world)
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(rank, world, local_rank, device, enabled, rank // ranks_per_node, world // ranks_per_node)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def gather(self, value: object) -> list:
        """Every rank's `value`, in rank order, on every rank."""
        if not self.enabled:
            return [value]
        values = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean over ranks, in place."""
        if self.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor /= self.world
        return tensor

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def close(self) -> None:
        if self.enabled:
            dist.barrier()
            dist.destroy_process_group()


def _store_of_this_attempt(world: int) -> dist.Store | None:
    """torchrun --max-restarts: the agent's store outlives a restart of the workers and still holds the
    previous attempt's addresses, so a restarted rank connects to a dead peer (gloo: "Connection
    refused"; pytorch/pytorch#167288 for NCCL). The restarted attempt keys its process group apart.

    One node only: on several nodes TORCHELASTIC_RESTART_COUNT counts each node's own restarts
    (pytorch/pytorch#108158), so the nodes could not agree on the prefix; there, relaunch the job.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    one_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
    if attempt == 0 or not one_node or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                           timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"tokstream/attempt_{attempt}", client)


PARENT_GONE_STATUS = 4


def exit_when_orphaned(poll_s: float = 1.0) -> None:
    """End this rank within `poll_s` of its parent (torchrun's agent) dying, writing nothing: the agent
    starts each rank in a session of its own, so killing the agent's process group leaves the ranks
    training, saving and racing a relaunch. A watch of the parent's PID, not prctl's parent-death
    signal, which fires when the parent's *thread* that started us ends."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"rank {os.environ.get('RANK', '?')}: torchrun's agent (PID {parent}) is gone: exiting without "
              "writing", file=sys.stderr, flush=True)
        os._exit(PARENT_GONE_STATUS)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def peer_gone(err: BaseException) -> bool:
    """A collective failed because another rank of the job ended (it says why itself): gloo's and NCCL's
    words for a peer's closed connection; or the reader's node barrier found it ended (PeerEnded)."""
    return isinstance(err, PeerEnded) or isinstance(err, RuntimeError) and any(
        words in str(err) for words in ("Connection closed by peer", "Connection reset by peer",
                                        "remote process exited or there was a network error"))
