"""Two nodes of two ranks each, reading through training's loader: the epoch's order is computed once per
node (by its first rank, shared with the other through the node's shared memory), and every rank reads
exactly its part of streaming's partition, over two epochs and after a resume on fresh caches.

Each node runs in its own IPC and mount namespace with a /dev/shm of its own, as on separate
machines; its ranks share it. The dataset is "remote" (a local directory), so each node copies the
shards it reads into its own cache, as it would download them.
"""

import gc
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, namespaces_permitted

from tokstream.testing.loopback_s3 import free_port

NODES, RANKS, BATCH = 2, 2, 4
SETTINGS = dict(num_canonical_nodes=2, shuffle_block_size=1000)
RESUME_AT = NODES * RANKS * BATCH * 37  # samples of epoch 1 seen before the relaunch: whole steps

RANK_SCRIPT = r"""
import gc, json, os, sys
import torch.distributed as dist
from tokstream.train import epoch_order, streaming_internals as internals
from tokstream.train.config import DataConfig
from tokstream.train.data import make_loader

data, node_dir, resume_at, settings = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
computed = []  # the epoch starts at which this process computed the node's order


def counted(dataset, world, epoch, sample_in_epoch):
    computed.append([epoch, sample_in_epoch])
    return epoch_order.generate_work_random(dataset, world, epoch, sample_in_epoch)


internals.install_epoch_order(epoch_order.get_sampling_vectorized, epoch_order.get_shuffle_py1e_fast, counted)
dist.init_process_group("gloo")


def loader(cache):
    config = DataConfig(remote=data, local=os.path.join(node_dir, cache), **settings)
    return make_loader(config, "train", 4, shuffle=True, pin_memory=False)


def epoch(batches):
    return [i for batch in batches for i in batch["ids"].tolist()]


first = loader("cache")
epochs = [epoch(first), epoch(first)]
del first
gc.collect()
dist.barrier()
resumed = loader("relaunch-cache")  # a relaunch on a fresh disk
resumed.load_state_dict({"epoch": 1, "sample_in_epoch": resume_at, "num_canonical_nodes": 2, "shuffle_seed": 9176,
                         "initial_physical_nodes": 2})
epochs.append(epoch(resumed))
print(json.dumps({"epochs": epochs, "computed": computed}), flush=True)
"""


def launch_node(node: int, port: int, dataset, node_dir) -> subprocess.Popen:
    """One node: its own /dev/shm and lock-file directory, its ranks started together inside."""
    ranks = []
    for local_rank in range(RANKS):
        env = dict(RANK=node * RANKS + local_rank, LOCAL_RANK=local_rank, WORLD_SIZE=NODES * RANKS,
                   LOCAL_WORLD_SIZE=RANKS, NODE_RANK=node, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   TMPDIR=node_dir, OMP_NUM_THREADS=1)
        args = [sys.executable, "-c", RANK_SCRIPT, str(dataset), str(node_dir), str(RESUME_AT), json.dumps(SETTINGS)]
        out = node_dir / f"rank{local_rank}.json"
        ranks.append(f"env {' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(args)} > {out} &")
    script = f"mount -t tmpfs node-shm /dev/shm && {' '.join(ranks)} wait"
    return subprocess.Popen(["unshare", "--ipc", "--mount", "--propagation", "private", "sh", "-c", script],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=subprocess.PIPE, text=True)


def expected_parts(dataset, tmp_path) -> list[np.ndarray]:
    """Streaming's partition of each epoch read, for 2 nodes x 2 ranks x 1 worker: (nodes, ranks, samples)."""
    from streaming import StreamingDataset

    from tokstream.train.streaming_internals import World, generate_work

    ds = StreamingDataset(remote=str(dataset), local=str(tmp_path / "expected"), split="train", shuffle=True,
                          shuffle_seed=9176, batch_size=BATCH, **SETTINGS)
    world = World(NODES, RANKS, 1, 0)
    parts = [generate_work(ds.batching_method, ds, world, 0, 0), generate_work(ds.batching_method, ds, world, 1, 0)]
    ds.initial_physical_nodes = NODES  # as the checkpoint's state sets it
    parts.append(generate_work(ds.batching_method, ds, world, 1, RESUME_AT))
    del ds
    gc.collect()
    return [part[:, :, 0].reshape(NODES, RANKS, -1) for part in parts]


@pytest.mark.skipif(not namespaces_permitted(), reason="namespaces are not permitted here (unshare --ipc --mount "
                    "failed): several nodes on one machine need root or user namespaces")
def test_two_nodes_of_two_ranks_compute_the_order_once_per_node_and_read_streamings_partition(dataset, tmp_path):
    port = free_port()
    node_dirs = [tmp_path / f"node{node}" for node in range(NODES)]
    nodes = []
    for node, node_dir in enumerate(node_dirs):
        node_dir.mkdir()
        nodes.append(launch_node(node, port, dataset, node_dir))
    errors = [node.communicate(timeout=240)[1] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(e[-3000:] for e in errors)
    reports = [[json.loads((node_dir / f"rank{r}.json").read_text()) for r in range(RANKS)] for node_dir in node_dirs]

    for node in range(NODES):  # the first rank of each node computes each start's order, the other reuses it
        assert reports[node][0]["computed"] == [[0, 0], [1, 0], [1, RESUME_AT]]
        assert all(not reports[node][rank]["computed"] for rank in range(1, RANKS))
        for cache in ("cache", "relaunch-cache"):  # each node fetched shards into its own caches
            assert list((node_dirs[node] / cache / "train").glob("shard.*.mds"))
    for index, part in enumerate(expected_parts(dataset, tmp_path)):
        read = []
        for node in range(NODES):
            for rank in range(RANKS):
                ids = part[node, rank]
                ids = ids[ids != -1]  # streaming's padding
                expected = ids[:len(ids) // BATCH * BATCH].tolist()  # whole batches, as a DataLoader's drop_last
                got = reports[node][rank]["epochs"][index]
                assert got == expected, (index, node, rank)
                read += got
        assert len(read) == len(set(read)) > 1000  # no sample twice in an epoch across nodes and ranks
