"""How a global batch is cut into micro-batches over ranks, and what a resumed run must keep of it."""

import math
from dataclasses import dataclass

from tokstream.errors import UserError


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int  # samples per optimizer step, over all ranks and micro-batches
    micro_batch_size: int  # samples per rank per forward pass
    world_size: int

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"{name} must be a positive whole number, got {value!r}")
        per_pass = self.micro_batch_size * self.world_size
        if self.global_batch_size % per_pass:
            raise UserError(f"global_batch_size {self.global_batch_size} is not a multiple of micro_batch_size "
                            f"{self.micro_batch_size} x {self.world_size} ranks")

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    def epoch_samples(self, split_samples: int, num_canonical_nodes: int) -> int:
        """Samples per epoch: the most that make whole steps and divide evenly over the canonical nodes.

        Streaming then neither pads nor drops anything that depends on the world size or micro-batch,
        and no step spans two epochs, so each step's samples are the same however the global batch
        is cut. The rest of the split (fewer than lcm(global batch, canonical nodes) samples) is left
        out of each epoch, a different random subset each time (streaming's epoch_size sampling).
        """
        unit = self.epoch_unit(num_canonical_nodes)
        return split_samples // unit * unit

    def epoch_unit(self, num_canonical_nodes: int) -> int:
        """The smallest epoch of whole steps that divides evenly over the canonical nodes."""
        return math.lcm(self.global_batch_size, num_canonical_nodes)

    def state_dict(self) -> dict:
        return {"global_batch_size": self.global_batch_size, "world_size": self.world_size,
                "accumulation": self.accumulation}

    def describe_change(self, saved: dict) -> str | None:
        """A line for a resume on another number of ranks (the global batch is fixed: resume_policy.py)."""
        if saved["world_size"] == self.world_size:
            return None
        return (f"resuming a {saved['world_size']}-rank run on {self.world_size} ranks: same samples at every step; "
                "losses match to float rounding, not bitwise")
