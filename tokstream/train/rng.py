"""Every rank's random number generators as one checkpointable component."""

import hashlib
import random

import numpy as np
import torch

from tokstream.train.distributed import Distributed


def _local_state() -> dict:
    """Tensors and plain values only, so a checkpoint loads with torch.load(weights_only=True)."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_local_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RankRNG:
    """Python, NumPy, torch (and CUDA) generators of every rank; seeded per rank on a fresh start."""

    def __init__(self, dist: Distributed):
        self.dist = dist

    def seed(self, seed: int) -> None:
        """A different stream per rank (dropout masks must differ between ranks)."""
        random.seed(seed + self.dist.rank)
        np.random.seed(seed + self.dist.rank)
        torch.manual_seed(seed + self.dist.rank)

    def state_dict(self) -> list[dict]:
        """Collective: every rank's state, in rank order."""
        return self.dist.gather(_local_state())

    def load_state_dict(self, states: list[dict]) -> None:
        """Continue each rank's streams. On another world size the ranks are not the same ones: each
        rank is seeded from the saved state instead, so its streams are new (not step 0's again) and
        the same on every relaunch from this checkpoint."""
        if len(states) == self.dist.world:
            _set_local_state(states[self.dist.rank])
        else:
            saved = hashlib.blake2b(states[0]["torch"].numpy().tobytes(), digest_size=4).digest()
            self.seed(int.from_bytes(saved, "little"))
