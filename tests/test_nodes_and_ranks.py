"""Two nodes of two ranks each. Through training's loader: the epoch's order is computed once per node
(by its first rank, or that rank's first DataLoader worker, and shared with the others through the
node's shared memory), and every rank reads exactly its part of streaming's partition, over two
epochs in-process and after a resume on fresh caches with 2 DataLoader workers per rank. Through
training itself (train/main.py under one torchrun per node): a preemption notice to one node stops
all four ranks at the same step, and the relaunched job repeats an uninterrupted run of the same
two nodes bitwise.

Each node runs in its own IPC and mount namespace with a /dev/shm of its own, as on separate
machines; its ranks share it. The dataset is "remote" (a local directory), so each node copies the
shards it reads into its own cache, as it would download them.
"""

import json
import os
import re
import shlex
import signal
import sys

import numpy as np
import pytest
import torch
import test_training as training
from conftest import ROOT, Node, namespaces_permitted, wait_for_nodes
from test_ledger import json_lines, ledger

from tokstream.testing.loopback_s3 import free_port
from tokstream.train.checkpoint_files import checkpoint_name, latest_step
from tokstream.train.run_store import LocalRunStore

NODES, RANKS, BATCH = 2, 2, 4
SETTINGS = dict(num_canonical_nodes=2, shuffle_block_size=1000)
RESUME_AT = NODES * RANKS * BATCH * 37  # samples of epoch 1 seen before the relaunch: whole steps

RANK_SCRIPT = r"""
import gc, json, os, sys
import torch.distributed as dist
from tokstream.reader import streaming_door
from tokstream.reader.streaming_door import epoch_order, streaming_internals as internals
from tokstream.reader.order import py1e, sampling
from tokstream.reader.config import DataConfig
from tokstream.reader.batches import make_loader

data, node_dir, batch, resume_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
settings = json.loads(sys.argv[5])


def counted(dataset, world, epoch, sample_in_epoch):
    with open(os.path.join(node_dir, "computed"), "a") as record:  # from a rank or a forked worker
        record.write(json.dumps([os.environ["LOCAL_RANK"], os.getpid(), epoch, sample_in_epoch]) + "\n")
    return epoch_order.generate_work_random(dataset, world, epoch, sample_in_epoch)


streaming_door.install()  # as every reader does, and then the counted batching over it
internals.install_epoch_order(sampling.get_sampling_vectorized, py1e.get_shuffle_py1e_fast, counted)
dist.init_process_group("gloo")


def loader(cache, workers):
    config = DataConfig(remote=data, local=os.path.join(node_dir, cache), num_workers=workers, **settings)
    return make_loader(config, "train", batch, shuffle=True, pin_memory=False)


def epoch(batches):
    return [i for item in batches for i in item["ids"].tolist()]


first = loader("cache", 0)
epochs = [epoch(first), epoch(first)]
del first
gc.collect()
dist.barrier()
resumed = loader("relaunch-cache", 2)  # a relaunch on a fresh disk, with workers
resumed.load_state_dict({"epoch": 1, "sample_in_epoch": resume_at, "num_canonical_nodes": 2, "shuffle_seed": 9176,
                         "initial_physical_nodes": 2})
epochs.append(epoch(resumed))
print(json.dumps({"pid": os.getpid(), "epochs": epochs}), flush=True)
"""


def launch_node(node: int, port: int, dataset, node_dir) -> Node:
    """One node: its own /dev/shm and lock-file directory, its ranks started together inside."""
    ranks = []
    for local_rank in range(RANKS):
        env = dict(RANK=node * RANKS + local_rank, LOCAL_RANK=local_rank, WORLD_SIZE=NODES * RANKS,
                   LOCAL_WORLD_SIZE=RANKS, NODE_RANK=node, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   TMPDIR=node_dir, OMP_NUM_THREADS=1)
        args = [sys.executable, "-c", RANK_SCRIPT, str(dataset), str(node_dir), str(BATCH), str(RESUME_AT),
                json.dumps(SETTINGS)]
        out = node_dir / f"rank{local_rank}.json"
        ranks.append(f"env {' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(args)} > {out} &")
    return Node(f"node {node}", f"mount -t tmpfs node-shm /dev/shm && {' '.join(ranks)} wait",
                env=dict(os.environ, PYTHONPATH=str(ROOT)))


def expected_reads(dataset, stock) -> list[np.ndarray]:
    """What each rank reads of each epoch, from stock streaming's partition (as shipped, in a process of
    its own) for 2 nodes x 2 ranks x its workers."""
    spec = dict(local=str(dataset), split="train", shuffle=True, shuffle_seed=9176, batch_size=BATCH, **SETTINGS)
    cases = [dict(settings={}, world=[NODES, RANKS, 1, 0], epoch=epoch, sample_in_epoch=0) for epoch in (0, 1)]
    cases.append(dict(settings=dict(initial_physical_nodes=NODES),  # as the checkpoint's state sets it
                      world=[NODES, RANKS, 2, 0], epoch=1, sample_in_epoch=RESUME_AT))
    orders = stock.run("epoch_orders", [dataset], spec=spec, cases=cases, resamples=[])
    parts = [orders[f"work{index}"] for index in range(len(cases))]
    return [[[rank_reads(part[node, rank]) for rank in range(RANKS)] for node in range(NODES)] for part in parts]


def rank_reads(workers_part: np.ndarray) -> list[int]:
    """A rank's samples in a DataLoader's order: each worker's part without streaming's padding (-1) in
    whole batches (drop_last), the workers' batches taken in turn until each has run out."""
    batches = []
    for part in workers_part:
        ids = part[part != -1]
        batches.append(ids[:len(ids) // BATCH * BATCH].reshape(-1, BATCH).tolist())
    return [i for turn in range(max(map(len, batches))) for worker in batches if turn < len(worker)
            for i in worker[turn]]


SEVERAL_NODES = pytest.mark.skipif(not namespaces_permitted(), reason="namespaces are not permitted here (unshare "
                                   "--ipc --mount failed): several nodes on one machine need root or user namespaces")


@pytest.mark.long
@SEVERAL_NODES
def test_two_nodes_of_two_ranks_compute_the_order_once_per_node_and_read_streamings_partition(dataset, stock,
                                                                                             tmp_path):
    port = free_port()
    node_dirs = [tmp_path / f"node{node}" for node in range(NODES)]
    nodes = []
    for node, node_dir in enumerate(node_dirs):
        node_dir.mkdir()
        nodes.append(launch_node(node, port, dataset, node_dir))
    errors = [node.communicate(timeout=240)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(e[-3000:] for e in errors)
    reports = [[json.loads((node_dir / f"rank{r}.json").read_text()) for r in range(RANKS)] for node_dir in node_dirs]

    for node_dir, node_reports in zip(node_dirs, reports):
        # one computation of each start's order per node: by its first rank, then by that rank's first worker
        computed = [json.loads(line) for line in (node_dir / "computed").read_text().splitlines()]
        assert [(rank, epoch, at) for rank, _, epoch, at in computed] == [("0", 0, 0), ("0", 1, 0), ("0", 1, RESUME_AT)]
        rank_pid = node_reports[0]["pid"]
        assert computed[0][1] == computed[1][1] == rank_pid != computed[2][1]
        for cache in ("cache", "relaunch-cache"):  # each node fetched shards into its own caches
            assert list((node_dir / cache / "train").glob("shard.*.mds"))
    for index, expected in enumerate(expected_reads(dataset, stock)):
        read = []
        for node in range(NODES):
            for rank in range(RANKS):
                got = reports[node][rank]["epochs"][index]
                assert got == expected[node][rank], (index, node, rank)
                read += got
        assert len(read) == len(set(read)) > 1000  # no sample twice in an epoch across nodes and ranks


def launch_training_node(node: int, port: int, dataset, run_dir, node_dir) -> Node:
    """One node's torchrun with two ranks, on a disk of its own (a tmpfs at node_dir: data cache,
    run_local, TMPDIR) and its own /dev/shm; run_dir is shared, as a run's storage must be."""
    return training.launch_node(node, NODES, RANKS, port, f"data.remote={dataset}", f"run_dir={run_dir}",
                                f"data.local={node_dir / 'cache'}", f"run_local={node_dir / 'run'}",
                                "micro_batch_size=2",  # 4 ranks x 2 samples: the reference's 8 (2 ranks x 4)
                                disk=node_dir)


def final_tensors(run_dir) -> list:
    """The final checkpoint's weights and Adam's state, in order: where a last-bit difference in any step's
    reduction stays, when the losses, means over a step's tokens, often round it away."""
    saved = torch.load(run_dir / checkpoint_name(training.STEPS), map_location="cpu", weights_only=True)
    return [*saved["model"].values(), *(t for state in saved["optimizer"]["state"].values() for t in state.values())]


@pytest.mark.long
@SEVERAL_NODES
def test_training_on_two_nodes_of_two_ranks_stops_together_and_resumes_bitwise(reference, dataset, tmp_path):
    """A notice (SIGTERM) to node 1's torchrun: all four ranks checkpoint at the same step, and both
    agents exit at once with the status a scheduler requeues on. Relaunched on the same two nodes (fresh
    disks), the job finishes as an uninterrupted run of the two nodes did: per step, every rank's
    samples, the loss bitwise, and in the end the weights and Adam's moments bitwise. Over four ranks the
    all-reduce's sums depend on DDP's bucket layout, which a relaunch used to change for its first step
    (trainer.settle_gradient_buckets); over two, a + b == b + a would hide it. The uninterrupted run also
    takes, step by step, the samples of one node of two ranks (the same global batch, split 4 x 2 instead
    of 2 x 4). The ledger, from the run directory alone, names every rank's samples of every step."""

    def job(run_dir, launch: str) -> list[Node]:
        port = free_port()
        return [launch_training_node(node, port, dataset, run_dir, tmp_path / launch / f"node{node}")
                for node in range(NODES)]

    def finished(nodes: list[Node]) -> list[str]:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
        assert all(node.returncode == 0 for node in nodes), "\n".join(o[-3000:] for o in outputs)
        return outputs

    uninterrupted = tmp_path / "uninterrupted"
    finished(job(uninterrupted, "uninterrupted"))
    expected = training.trained_steps(uninterrupted)
    assert [step for step, *_ in expected] == list(range(1, training.STEPS + 1))
    for (_, samples, _, _), (step, two_ranks, _, _) in zip(expected, reference):
        assert len(samples) == NODES * RANKS and sorted(sum(samples, [])) == sorted(sum(two_ranks, [])), step

    run_dir = tmp_path / "run"
    store = LocalRunStore(run_dir)
    nodes = job(run_dir, "first")
    wait_for_nodes(nodes, lambda: (latest_step(store) or 0) >= 4)
    nodes[1].send_signal(signal.SIGTERM)
    outputs = [node.communicate(timeout=120)[0] for node in nodes]  # both end, not only the signalled one
    assert all(node.returncode != 0 for node in nodes), "\n".join(o[-2000:] for o in outputs)
    assert "preempted (signal to another rank)" in outputs[0], outputs[0][-3000:]
    # Node 0's ranks exit with EX_TEMPFAIL, which its torchrun reports (node 1's was signalled itself).
    root_cause = re.search(r"Root Cause \(first observed failure\):.*?exitcode\s*: (-?\d+) ", outputs[0], re.DOTALL)
    assert root_cause and root_cause.group(1) == "75", outputs[0][-3000:]
    stopped = len(training.metrics(run_dir))
    assert 4 <= stopped < training.STEPS and latest_step(store) == stopped  # every rank saved at the step they stopped

    outputs = finished(job(run_dir, "relaunch"))
    assert f"resumed from {run_dir}/ckpt-{stopped:08d}.pt at step {stopped}" in outputs[0], outputs[0][-3000:]
    assert training.trained_steps(run_dir) == expected  # per-rank samples, losses and lr, exactly
    final, wanted = final_tensors(run_dir), final_tensors(uninterrupted)
    assert len(final) == len(wanted) and all(torch.equal(a, b) for a, b in zip(final, wanted))
    # The ledger deals each step to 2 nodes x 2 ranks as they read it (the data where it lies here).
    answered = json_lines(ledger(run_dir, "--steps", f"1:{training.STEPS}", "--json", "data.local="))
    assert [line["samples"] for line in answered] == [samples for _, samples, _, _ in expected]
    assert {(line["nodes"], line["ranks"]) for line in answered} == {(NODES, NODES * RANKS)}
