"""torchrun train/main.py on CPU with gloo, and the helpers the other training tests launch it with.

The contract: a run that is preempted (SIGTERM, SIGUSR1) or killed (SIGKILL, a crashed rank) and
relaunched with the same command consumes, step by step and rank by rank, exactly the samples of an
uninterrupted run, with bitwise-equal losses. The interruptions themselves, with changes of world
size and micro-batch on relaunch: test_interruptions.py; several nodes and S3: test_s3.py.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SHARED, TRAINING_VOCAB, Node, training_tokenizer

from tokstream.errors import UserError
from warm_ranks import WarmLaunch, WarmPython
from tokstream.train.metrics import read_records

STEPS = 16
BASE = ["configs/tiny.yaml", f"model.vocab_size={TRAINING_VOCAB}", f"max_steps={STEPS}", f"optim.decay_steps={STEPS}", "checkpoint_interval=4", "eval_interval=8",
        "trace_samples=true", "log_interval=100"]


def launch(nproc: int, dataset: Path | str | None, run_dir: Path, *overrides: str, torchrun: tuple = (),
           env: dict | None = None, warm: bool = False) -> WarmPython | WarmLaunch:
    """torchrun train/main.py on BASE, its agent forked from the test process's warm server and its ranks new
    interpreters, as torchrun starts them; dataset None: the overrides give a mixture (data.streams) instead.
    warm: the ranks forked from the warm server instead, without torchrun (tests/warm_ranks.py), for a launch that
    no signal, kill or restart reaches."""
    data = ["data.remote="] if dataset is None else [f"data.remote={dataset}"]
    argv = [*BASE, *data, f"run_dir={run_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    if warm:
        assert not torchrun, "torchrun's options need torchrun"
        return WarmLaunch(nproc, argv, env, ROOT)
    # torchrun's agent forked from the warm server too (its ranks are new interpreters, as torchrun starts them); the
    # demo, the DDP example, the full disk, several nodes and Slurm run torchrun's command line
    command = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun,
               str(ROOT / "train/main.py"), *argv]
    return WarmPython(*command, cwd=ROOT, env=env, merged=True, new_session=True)


def launch_node(node: int, nodes: int, nproc: int, port: int, *overrides: str, disk: Path) -> Node:
    """Node `node` of a job of `nodes` on this machine: torchrun train/main.py on BASE in an IPC and
    mount namespace of its own, meeting the other nodes on 127.0.0.1:port, with its own /dev/shm and its
    own disk: a tmpfs mounted at `disk` (its TMPDIR: streaming's lock files; the callers put its data
    cache and run_local there too), empty at each launch and gone with the node. `disk` is a folder of
    its own: a tmpfs over one of its parents (/tmp) would hide the checkout, the venv or ../shared
    when they are under it. The process is torchrun itself (unshare and sh exec it), so a signal to
    it is a signal to the node's agent."""
    disk = Path(disk).resolve()
    needed = (ROOT, SHARED, Path(sys.prefix), Path(sys.base_prefix))  # the code, its data, the venv and its python
    hidden = [str(path) for path in needed if path.is_relative_to(disk) or path.resolve().is_relative_to(disk)]
    assert not hidden, f"a node's disk at {disk} would hide {hidden}"
    disk.mkdir(parents=True, exist_ok=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node_rank={node}",
                f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}",
                str(ROOT / "train/main.py"), *BASE, *overrides]
    mounts = f"mount -t tmpfs node-shm /dev/shm && mount -t tmpfs node-disk {shlex.quote(str(disk))}"
    return Node(f"node {node}", f"{mounts} && exec {shlex.join(torchrun)}",
                env=dict(os.environ, TMPDIR=str(disk), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def finish(process: subprocess.Popen, timeout: float = 300) -> str:
    output, _ = process.communicate(timeout=timeout)
    errors = [line for line in output.splitlines() if "Error" in line or "error:" in line]
    assert process.returncode == 0, "\n".join(errors[:20]) + "\n...\n" + output[-2000:]
    return output


def train(nproc: int, dataset: Path, run_dir: Path, *overrides: str) -> str:
    """A run to its end, nothing sent to it: its ranks warm (the tests of torchrun's part launch torchrun)."""
    return finish(launch(nproc, dataset, run_dir, *overrides, warm=True))


def metrics(run_dir: Path) -> list[dict]:
    return read_records(run_dir)  # polled while the run writes: a half-written last line is left out


def wait_for(condition, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def trained_steps(run_dir: Path) -> list[tuple]:
    """What must match across interruptions: step, per-rank sample ids, loss (exact float), lr."""
    return [(m["step"], m["samples"], m["loss"], m["lr"]) for m in metrics(run_dir)]


def test_uninterrupted_run_partitions_every_global_batch(reference, dataset):
    seen = set()
    for _, samples, loss, _ in reference:
        rank0, rank1 = samples
        assert len(rank0) == len(rank1) == 4
        assert not set(rank0) & set(rank1)  # ranks never share a sample within an epoch
        assert not seen & set(rank0 + rank1)
        seen |= set(rank0 + rank1)
    assert reference[-1][2] < reference[0][2]  # it learns


@pytest.mark.long
def test_torchrun_max_restarts_recovers_a_crashed_rank_by_itself(reference, dataset, tmp_path):
    """Rank 1 dies abruptly (SIGKILL, as a segfault or a failed device would end it) after the first
    checkpoint: torchrun --max-restarts=1 restarts both ranks, which resume from the newest checkpoint
    by themselves and finish with the uninterrupted run's samples and losses, bitwise."""
    from tokstream.testing.processes import worker_pids
    from tokstream.train.checkpoint_files import latest_step
    from tokstream.train.run_store import LocalRunStore

    process = launch(2, dataset, tmp_path, torchrun=("--max-restarts=1",))
    wait_for(lambda: (latest_step(LocalRunStore(tmp_path)) or 0) >= 4 and len(metrics(tmp_path)) >= 6)
    os.kill(worker_pids(process.pid)[1], signal.SIGKILL)
    output = finish(process)
    resumed = re.findall(rf"resumed from {re.escape(str(tmp_path))}/ckpt-(\d{{8}})\.pt at step (\d+)", output)
    assert len(resumed) == 1 and int(resumed[0][0]) == int(resumed[0][1]) >= 4, output[-3000:]
    assert trained_steps(tmp_path) == reference
    records = metrics(tmp_path)  # what the README says each line holds (no mfu on a CPU: its peak is unknown)
    assert all({"step", "loss", "lr", "grad_norm", "clipped", "tokens_per_s", "data_wait_s", "data_wait_fraction",
                "step_s"} <= set(r) and "mfu" not in r for r in records)
    assert all(r["grad_norm"] > 0 and r["clipped"] == (r["grad_norm"] > 1.0) and 0 <= r["data_wait_fraction"] < 1
               for r in records)  # configs/tiny.yaml clips at optim.grad_clip 1.0
    assert [r["step"] for r in records if "val_loss" in r] == [8, 16]  # every eval_interval


HOLD_A_DATASET = """
import sys
from streaming import StreamingDataset
from tokstream.reader.streaming_door.streaming_internals import shm_prefix
dataset = StreamingDataset(local=sys.argv[1], split="train", shuffle=False, batch_size=1)
next(iter(dataset))
print(shm_prefix(dataset), flush=True)
sys.stdin.readline()
"""


def test_start_removes_only_unmapped_blocks_of_its_own_dataset(dataset, tmp_path):
    """What training runs at start (that it does, through torchrun after a hard kill: test_interruptions.py)
    unlinks the stale streaming blocks of its own cache directories. Another job reading the same
    dataset keeps its live blocks; an unmapped block of another dataset stays too."""
    from tokstream.reader import open_dataset
    from tokstream.reader.config import DataConfig
    from tokstream.reader.stale_shm import OWNER_MARK, SHM_DIR, remove_stale_shared_memory
    from tokstream.reader.streaming_door.streaming_internals import LOCALS_BLOCK, locals_block

    other_job = subprocess.Popen([sys.executable, "-c", HOLD_A_DATASET, str(dataset)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
    live = f"{int(other_job.stdout.readline()):06}"
    fakes = {}
    for prefix, local in ((987001, dataset / "val"), (987002, tmp_path / "elsewhere" / "train")):
        fakes[prefix] = [SHM_DIR / f"{prefix}_{LOCALS_BLOCK}", SHM_DIR / f"{prefix}_barrier"]
        fakes[prefix][0].write_bytes(locals_block([str(local)], prefix))  # what a killed run leaves
        fakes[prefix][1].write_bytes(bytes(64))
    try:
        removed = remove_stale_shared_memory(open_dataset(DataConfig(remote=str(dataset))).cache_dirs)
        assert {path.name for path in fakes[987001]} <= set(removed)  # ours and unmapped: removed
        assert not any(path.exists() for path in fakes[987001])
        assert all(path.exists() for path in fakes[987002])  # another dataset's: left alone
        # Its blocks (beside them may lie the owner record of a process, say another test's rank, that read from
        # this number before the other job took it, until that process lets it go: not a block)
        assert sorted(p.name for p in SHM_DIR.glob(f"{live}_*") if OWNER_MARK not in p.name) == sorted(
            f"{live}_{n}" for n in ("barrier", "cache_usage", "locals", "next_epoch", "shard_access_times", "shard_states"))
    finally:
        other_job.communicate("done\n", timeout=60)
        for path in fakes[987001] + fakes[987002]:
            path.unlink(missing_ok=True)


def tiny_splits(root: Path, train_samples: int, val_samples: int, seed: int = 0, block_size: int = 64,
                shard_size: str = "64mb", gpt2: bool = False) -> Path:
    """A dataset with exactly these sample counts (block 64 unless said), from token files, in the training tests'
    vocabulary (gpt2: GPT-2's, ids below its separator 50,256); no separator: one document. Another seed, other
    tokens."""
    import numpy as np

    from tokstream.convert.options import ConversionOptions
    from tokstream.convert.token_conversion import Vocabulary, convert_token_files
    from tokstream.convert.token_files import open_token_file
    from tokstream.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("gpt2") if gpt2 else training_tokenizer(root)
    first, ids = (0, 50256) if gpt2 else (1, TRAINING_VOCAB - 1)  # the training vocabulary's separator is 0
    files = {}
    for split, samples in (("train", train_samples), ("val", val_samples)):
        path = root / f"{split}.bin"
        (first + (np.arange(samples * block_size + 1) * 7919 + seed * 104729) % ids).astype("<u2").tofile(path)
        files[split] = [open_token_file(path)]
    convert_token_files(files, str(root / "ds"), Vocabulary.of(tokenizer),
                        ConversionOptions(block_size=block_size, progress=False, shard_size=shard_size))
    return root / "ds"


def test_a_dataset_that_does_not_fit_the_run_is_refused_in_one_line(dataset, tmp_path):
    """Checked at start-up, before anything is built (through torchrun: the damaged-dataset test)."""
    from tokstream.reader import open_dataset
    from tokstream.reader.batch_plan import BatchPlan
    from tokstream.reader.config import DataConfig
    from tokstream.reader.dataset import val_split_holds_a_batch

    def refusal(check) -> str:
        with pytest.raises(UserError) as refused:
            check()
        return str(refused.value)

    assert "dataset block_size 64 != model block_size 128" in refusal(
        lambda: open_dataset(DataConfig(remote=str(dataset)), 50257, 128))
    assert f"{dataset} has no training split (it has train, val): set data.split" in refusal(
        lambda: open_dataset(DataConfig(remote=str(dataset), split="training"), 50257, 64))
    # 2 ranks x 4 samples on a 5-sample split: each rank would wait forever for its first batch
    small = open_dataset(DataConfig(remote=str(tiny_splits(tmp_path, 5, 3))), 50257, 64)
    assert "the train split has 5 samples, fewer than one step's global_batch_size 8" in refusal(
        lambda: small.epoch_samples(BatchPlan(8, 4, 2)))
    # 3 val samples cannot give each of 2 ranks a batch of 4: evaluation is turned off, not reported as 0
    assert small.samples("val") == [3]
    assert not val_split_holds_a_batch(3, 2, 4) and val_split_holds_a_batch(3, 1, 3)


def test_an_epoch_is_whole_steps_that_divide_over_the_canonical_nodes():
    from tokstream.reader.batch_plan import BatchPlan

    assert BatchPlan(8, 4, 2).epoch_samples(44, 1) == BatchPlan(8, 8, 1).epoch_samples(44, 1) == 40
    assert BatchPlan(8, 4, 2).epoch_samples(44, 3) == 24  # lcm(8, 3)
    assert BatchPlan(480, 12, 8).epoch_samples(8_820_100, 8) == 8_820_000


def test_a_damaged_dataset_is_named_in_one_line_before_training_starts(tmp_path):
    """A cut or missing shard, a missing index.json, a metadata.json without its splits."""
    from tokstream.reader import open_dataset
    from tokstream.reader.config import DataConfig

    data = tiny_splits(tmp_path, 40, 8)
    shard = sorted((data / "train").glob("shard.*"))[0]

    def refusal() -> str:
        with pytest.raises(UserError) as refused:
            open_dataset(DataConfig(remote=str(data)), 50257, 64)
        return str(refused.value)

    intact = shard.read_bytes()
    shard.write_bytes(intact[:-100])  # a copy that stopped early
    assert f"shard {shard} has {len(intact) - 100} bytes, the index says {len(intact)}" in refusal()
    assert "python convert/verify.py" in refusal()
    process = launch(2, data, tmp_path / "run", warm=True)  # and through the trainer's ranks: one line, no traceback
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0 and output.count(f"error: shard {shard} has") == 1  # rank 0 reports
    assert f'File "{ROOT / "tokstream"}' not in output and "Traceback" not in output  # from no rank
    shard.unlink()
    assert f"shard {shard} is missing" in refusal()
    shard.write_bytes(intact)

    (data / "val" / "index.json").unlink()
    assert f"{data / 'val' / 'index.json'} is missing: the val split's conversion never finished" in refusal()

    metadata = json.loads((data / "metadata.json").read_text())
    del metadata["splits"]
    (data / "metadata.json").write_text(json.dumps(metadata))
    assert f"{data / 'metadata.json'} is damaged or hand-edited (KeyError: 'splits')" in refusal()


def test_a_preemption_notice_ends_every_rank_with_status_75(dataset, tmp_path):
    """SIGUSR1 to one rank (Slurm's --signal): every rank checkpoints at the same step and exits with
    EX_TEMPFAIL (75); torchrun reports the first rank to exit as the job's root cause (and ends any
    rank still exiting with SIGTERM), and itself fails, which a scheduler requeues on. With a checkpoint at every
    step, the notice's step is one a periodic save already wrote: the relaunch still records a preemption."""
    from tokstream.testing.processes import worker_pids

    process = launch(2, dataset, tmp_path, "checkpoint_interval=1")
    wait_for(lambda: len(metrics(tmp_path)) >= 2 and len(worker_pids(process.pid)) == 2)
    os.kill(worker_pids(process.pid)[1], signal.SIGUSR1)
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0 and "preempted (signal to another rank): " in output, output[-3000:]
    root_cause = re.search(r"Root Cause \(first observed failure\):.*?exitcode\s*: (-?\d+) ", output, re.DOTALL)
    assert root_cause and root_cause.group(1) == "75", output[-3000:]
    # No rank leaves a crash in the job log: multiprocessing's resource tracker has no KeyError to print about the
    # shared memory streaming registered (torchrun's own report of the exit 75 is its ChildFailedError).
    assert "resource_tracker" not in output and "KeyError" not in output, output[-3000:]
    stopped = len(metrics(tmp_path))
    train(2, dataset, tmp_path, "checkpoint_interval=1", f"max_steps={stopped + 1}")
    assert metrics(tmp_path)[stopped]["relaunch"] == {"from_step": stopped, "after": "preemption"}


def test_dataloader_workers_ignore_preemption_signals_and_the_run_goes_on_exactly(reference, dataset, tmp_path):
    """SIGTERM and SIGUSR1 reach every process of a job in a cgroup or process-group kill: the rank
    reacts (it checkpoints), its DataLoader workers must not (a killed worker would fail the rank's
    next batch). Sent to the workers alone, the run goes on to the uninterrupted run's samples and losses."""
    from tokstream.testing.processes import descendants

    process = launch(2, dataset, tmp_path, "data.num_workers=2", warm=True)  # the signals go to the workers alone
    ranks = [rank.pid for rank in process.processes]

    def data_workers() -> list[list[int]]:  # each rank's: forked from it, its command line
        found = []
        for rank in ranks:
            forks = []
            try:
                command = open(f"/proc/{rank}/cmdline", "rb").read()
            except OSError:  # ended
                command = None
            for pid in descendants(rank) if command else []:
                try:
                    if open(f"/proc/{pid}/cmdline", "rb").read() == command:
                        forks.append(pid)
                except OSError:  # ended meanwhile
                    continue
            found.append(forks)
        return found

    def hold(signum: int) -> None:
        for rank in ranks:
            os.kill(rank, signum)

    # The workers are signalled while the run trains, with batches still ahead: steps take milliseconds, so the ranks
    # are held (SIGSTOP) from when their workers exist and let go a few milliseconds at a time until step 2 is done.
    wait_for(lambda: all(len(workers) >= 2 for workers in data_workers()))
    hold(signal.SIGSTOP)
    try:
        while len(metrics(tmp_path)) < 2:
            hold(signal.SIGCONT)
            time.sleep(0.005)
            hold(signal.SIGSTOP)
        assert len(metrics(tmp_path)) < STEPS, "the run ended before its workers were signalled"
        signalled = data_workers()
        assert all(len(workers) >= 2 for workers in signalled), signalled
        for pid in sum(signalled, []):
            for signum in (signal.SIGTERM, signal.SIGUSR1):
                os.kill(pid, signum)
    finally:
        hold(signal.SIGCONT)
    finish(process)
    assert trained_steps(tmp_path) == reference


@pytest.mark.parametrize("clip", [0.001, 0.0])
def test_each_step_logs_its_gradient_norm_before_clipping_and_its_share_of_waiting_for_data(dataset, tmp_path, clip):
    """The norm a spike shows first, before clipping scales it down (clipped: whether it was); 0 turns clipping off
    and the norm is still logged. The console line shows both and the share of the step spent waiting for data."""
    done = WarmLaunch(None, ["configs/tiny.yaml", f"model.vocab_size={TRAINING_VOCAB}", "max_steps=3",
                             "global_batch_size=8", "micro_batch_size=4",
                             f"optim.grad_clip={clip}", "log_interval=1", "eval_interval=0", f"data.remote={dataset}",
                             f"run_dir={tmp_path / 'run'}"], dict(os.environ), ROOT)  # one process, as python runs it
    said = done.communicate(timeout=300)[0]
    assert done.returncode == 0, said[-2000:]
    records = metrics(tmp_path / "run")
    assert [r["clipped"] for r in records] == [clip > 0] * 3  # a fresh model's norm is far above 0.001
    assert all(r["grad_norm"] > 0.001 for r in records)
    lines = [line for line in said.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all(f"grad_norm {r['grad_norm']:.3g}" in line for r, line in zip(records, lines))
    assert all(("(clipped)" in line) == (clip > 0) and re.search(r"data_wait [\d.]+ ms \(\d+%\)", line)
               for line in lines)
