"""Who this process is in a torchrun job, on which device, and the few collectives training uses."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Distributed:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    enabled: bool  # launched by torchrun (a process group exists), even with one rank

    @property
    def master(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, device_setting: str) -> "Distributed":
        """Read torchrun's environment, pick the device ("auto", "cuda" or "cpu") and join the group."""
        enabled = "RANK" in os.environ
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        use_cuda = device_setting == "cuda" or (device_setting == "auto" and torch.cuda.is_available())
        device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        if enabled:
            dist.init_process_group("nccl" if use_cuda else "gloo")
        return cls(rank, world, local_rank, device, enabled)

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
