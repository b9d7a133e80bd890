"""Convert straight to S3 and train from S3, against a real S3 endpoint (moto's server) on 127.0.0.1."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import test_training as training
from conftest import (BUCKET, ROOT, Node, namespaces_permitted, run_script, shakespeare_paragraphs, tagged_lines,
                      tree_bytes, wait_for_nodes, wikitext_articles, write_jsonl)
from tokstream.object_store import S3Dataset
from tokstream.testing.loopback_s3 import free_port
from tokstream.testing.processes import kill_tree
from tokstream.train.checkpoint_files import latest_step
from tokstream.train.run_store import S3RunStore


def keys(prefix: str) -> list[str]:
    return sorted(S3Dataset(f"s3://{BUCKET}/{prefix}").keys())


def assert_store_holds_exactly(prefix: str, root) -> None:
    """The objects under the prefix are the files of a local dataset, byte for byte, and nothing else."""
    expected = tree_bytes(root)
    assert keys(prefix) == sorted(expected)  # no state or resume-key objects left either
    store = S3Dataset(f"s3://{BUCKET}/{prefix}")
    for name, data in expected.items():
        assert store.get_bytes(name) == data, name


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "wiki.jsonl", wikitext_articles())


CONVERT = ["--block-size", "128", "--val-fraction", "0.05", "--shard-size", "96kb", "--no-progress"]


def stock_samples(remote: str, local, split: str = "train") -> np.ndarray:
    from streaming import StreamingDataset

    dataset = StreamingDataset(remote=remote, local=str(local), split=split, shuffle=False, batch_size=1,
                               validate_hash="xxh64")
    return np.stack([dataset[i]["tokens"] for i in range(len(dataset))])


def test_round_trip_equals_the_local_conversion(proxy, corpus, tmp_path):
    local = run_script("convert/owt_to_mds.py", "--dataset", corpus, "--out", tmp_path / "local", *CONVERT)
    remote = run_script("convert/owt_to_mds.py", "--dataset", corpus, "--out", f"s3://{BUCKET}/wiki", *CONVERT,
                        "--compression", "zstd", "--staging", tmp_path / "staging")
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    assert list((tmp_path / "staging").iterdir()) == []  # local copies removed after upload
    uploaded = keys("wiki")
    assert "metadata.json" in uploaded and "train/index.json" in uploaded
    assert sum(k.startswith("train/shard.") for k in uploaded) > 3
    for split in ("train", "val"):
        np.testing.assert_array_equal(stock_samples(f"s3://{BUCKET}/wiki", tmp_path / f"cache-{split}", split),
                                      stock_samples(str(tmp_path / "local"), tmp_path / f"copy-{split}", split))
    checked = run_script("convert/verify.py", f"s3://{BUCKET}/wiki")
    assert checked.returncode == 0 and checked.stdout.rstrip().endswith("OK"), checked.stderr

    again = run_script("convert/owt_to_mds.py", "--dataset", corpus, "--out", f"s3://{BUCKET}/wiki", *CONVERT)
    assert again.returncode == 2 and "already holds a dataset" in again.stderr


def test_transient_errors_are_retried(proxy, corpus, tmp_path):
    proxy.fail("PUT", "/shard.", times=3, status=503)  # SlowDown
    proxy.fail("PUT", "/shard.", times=2, status=None)  # connection dropped mid-request
    proxy.fail("GET", "/index.json", times=2, status=500)
    done = run_script("convert/bin_to_mds.py", *_token_file(tmp_path), "--out", f"s3://{BUCKET}/retried",
                      "--block-size", "64", "--shard-size", "64kb", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert proxy.spoiled >= 5
    local = run_script("convert/bin_to_mds.py", *_token_file(tmp_path), "--out", tmp_path / "local",
                       "--block-size", "64", "--shard-size", "64kb")
    assert local.returncode == 0
    np.testing.assert_array_equal(stock_samples(f"s3://{BUCKET}/retried", tmp_path / "cache"),
                                  stock_samples(str(tmp_path / "local"), tmp_path / "copy"))


def _token_file(tmp_path) -> list[str]:
    from tokstream.tokenizer import load_tokenizer

    encoding = load_tokenizer("gpt2").encoding
    tokens = [t for p in shakespeare_paragraphs() for t in encoding.encode_ordinary(p) + [encoding.eot_token]]
    path = tmp_path / "train.bin"
    if not path.exists():
        np.array(tokens, dtype="<u2").tofile(path)
    return [str(path)]


def test_a_conversion_that_finally_fails_leaves_nothing_readable(proxy, corpus, tmp_path):
    """Not resumable (bin_to_mds to S3): what was uploaded is removed."""
    proxy.fail("PUT", "/shard.00003", times=-1, status=503)  # never recovers
    env = dict(os.environ, TOKSTREAM_S3_MAX_ATTEMPTS="3")  # give up sooner than the default 8
    done = run_script("convert/bin_to_mds.py", *_token_file(tmp_path), "--out", f"s3://{BUCKET}/broken",
                      "--block-size", "64", "--shard-size", "64kb", "--no-progress", env=env)
    assert done.returncode == 2
    assert "upload to s3://corpora/broken failed after retries" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert keys("broken") == []


def test_a_text_conversion_that_loses_the_store_keeps_its_uploads_and_resumes(proxy, tmp_path):
    """One-pass text to S3: the shards named by the last saved state stay, and the rerun continues
    from them once the store is back, with the bytes of a local conversion."""
    corpus = tagged_lines(tmp_path / "lines.txt", 2)
    args = ["--dataset", corpus, "--txt-docs", "line", *CONVERT, "--num-workers", "1", "--state-interval", "0"]
    proxy.fail("PUT", "/shard.00020", times=-1, status=503)  # after the first batch's shards: a state is up
    env = dict(os.environ, TOKSTREAM_S3_MAX_ATTEMPTS="3")
    failed = run_script("convert/owt_to_mds.py", *args, "--out", f"s3://{BUCKET}/lines", env=env)
    assert failed.returncode == 2
    assert "failed after retries" in failed.stderr and "rerun the same command" in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    left = keys("lines")
    assert ".conversion-state.npz" in left and "train/shard.00000.mds" in left
    assert not [k for k in left if k.endswith(("index.json", "metadata.json"))]  # nothing a reader would take

    proxy.clear()
    resumed = run_script("convert/owt_to_mds.py", *args, "--out", f"s3://{BUCKET}/lines")
    assert resumed.returncode == 0, resumed.stderr
    assert int(re.search(r"continues after document ([\d,]+)", resumed.stdout).group(1).replace(",", "")) > 0
    local = run_script("convert/owt_to_mds.py", *args, "--out", tmp_path / "local")
    assert local.returncode == 0, local.stderr
    assert_store_holds_exactly("lines", tmp_path / "local")


def test_a_text_conversion_killed_mid_upload_resumes_with_the_same_bytes(proxy, tmp_path):
    corpus = tagged_lines(tmp_path / "lines.txt", 2)
    args = ["--dataset", corpus, "--txt-docs", "line", *CONVERT, "--num-workers", "1", "--state-interval", "0",
            "--out", f"s3://{BUCKET}/killed"]
    process = subprocess.Popen([sys.executable, str(ROOT / "convert/owt_to_mds.py"), *map(str, args)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while ".conversion-state.npz" not in keys("killed") and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.kill()  # SIGKILL: no handler runs, uploads in flight are cut off
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert "metadata.json" not in keys("killed")

    rerun_resumes_to_a_local_conversions_bytes(args, "killed", tmp_path)


def rerun_resumes_to_a_local_conversions_bytes(args: list, prefix: str, tmp_path) -> None:
    """Rerun an interrupted owt_to_mds.py conversion to S3 (`args` end with --out): it resumes, and the
    objects are then a local conversion's files."""
    resumed = run_script("convert/owt_to_mds.py", *args)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming s3://" in resumed.stdout
    local = run_script("convert/owt_to_mds.py", *args[:-2], "--out", tmp_path / "local")
    assert local.returncode == 0, local.stderr
    assert_store_holds_exactly(prefix, tmp_path / "local")


@pytest.mark.parametrize("case,message", [
    ("no bucket", "the bucket does not exist"),
    ("no credentials", "no AWS credentials found"),
    ("access denied", "access denied (HTTP 403)"),
])
def test_start_up_errors_are_one_line_before_any_work(proxy, tmp_path, case, message):
    """Before any work: the corpus is a FIFO nobody writes, so a converter that opened it first would hang."""
    corpus = tmp_path / "corpus.jsonl"
    os.mkfifo(corpus)
    env = dict(os.environ)
    out = f"s3://{BUCKET}/denied"
    if case == "no bucket":
        out = "s3://no-such-bucket/x"
    elif case == "no credentials":
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.pop(name)
        env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"))
    else:
        proxy.fail("*", f"/{BUCKET}", times=-1, status=403)
    done = run_script("convert/owt_to_mds.py", "--dataset", corpus, "--out", out, *CONVERT, env=env, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_training_on_s3_data_without_credentials_says_so_in_one_line(proxy, tmp_path):
    env = {name: value for name, value in os.environ.items() if name not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"))
    done = run_script("train/main.py", "configs/tiny.yaml", f"data.remote=s3://{BUCKET}/owt",
                      f"data.local={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}", env=env, timeout=120)
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        f"error: cannot read s3://{BUCKET}/owt/metadata.json: no AWS credentials found: set "
        "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or a role"], done.stderr[-3000:]


def test_a_corrupt_shard_is_rejected_by_name(proxy, corpus, tmp_path):
    done = run_script("convert/owt_to_mds.py", "--dataset", corpus, "--out", f"s3://{BUCKET}/corrupt", *CONVERT)
    assert done.returncode == 0, done.stderr

    store = S3Dataset(f"s3://{BUCKET}/corrupt")
    shard = store.key("train/shard.00001.mds")
    body = bytearray(store.client.get_object(Bucket=BUCKET, Key=shard)["Body"].read())
    body[-5] ^= 0xFF
    store.client.put_object(Bucket=BUCKET, Key=shard, Body=bytes(body))

    with pytest.raises(ValueError, match=r"Checksum failure: .*train/shard\.00001\.mds"):
        stock_samples(f"s3://{BUCKET}/corrupt", tmp_path / "cache")
    checked = run_script("convert/verify.py", f"s3://{BUCKET}/corrupt")
    assert checked.returncode == 2 and "train/shard.00001.mds: xxh64 hash mismatch" in checked.stderr


@pytest.fixture(scope="module")
def plays_on_s3(s3, dataset) -> str:
    """The training tests' dataset, uploaded file for file (converting to S3 is tested above)."""
    store = S3Dataset(f"s3://{BUCKET}/plays")
    for path in sorted(p for p in dataset.rglob("*") if p.is_file()):
        store.upload(path, path.relative_to(dataset).as_posix())
    return store.url


def s3_checkpointer(url: str, local, seed: int = 1):
    import torch
    from test_checkpoint import _components

    from tokstream.train.checkpoint import Checkpointer
    from tokstream.train.distributed import Distributed
    from tokstream.train.run_store import open_run_store

    single = Distributed(rank=0, world=1, local_rank=0, device=torch.device("cpu"), enabled=False)
    store = open_run_store(url, str(local))
    components = _components(seed)
    return store, components, Checkpointer(store, 2, single, components, {})


def test_a_checkpoint_whose_upload_fails_never_becomes_the_newest(proxy, tmp_path, capsys, monkeypatch):
    """Uploads cut off mid-checkpoint: a periodic (background) save says so and training goes on with
    the previous checkpoint the newest; a final save fails in one line; nothing half-visible. Then the
    store unreachable at resume: one line, not a fresh start."""
    from tokstream.errors import StoreError
    from tokstream.train.checkpoint import find_latest

    monkeypatch.setenv("TOKSTREAM_S3_MAX_ATTEMPTS", "2")
    url = f"s3://{BUCKET}/runs/faulty"
    store, components, checkpointer = s3_checkpointer(url, tmp_path / "node-a")
    components["progress"].step = 4
    checkpointer.save(4)
    proxy.fail("PUT", "/ckpt-00000008.pt", times=-1, status=None)  # every attempt's connection dropped
    components["progress"].step = 8
    checkpointer.save(8, background=True)
    checkpointer.wait()
    warning = capsys.readouterr().out
    assert "warning: checkpoint at step 8 not saved (cannot upload ckpt-00000008.pt to s3://corpora/runs/faulty: " in warning
    assert "the newest checkpoint is still step 4; training goes on" in warning
    with pytest.raises(StoreError, match="checkpoint at step 8 not saved: cannot upload ckpt-00000008.pt"):
        checkpointer.save(8)  # the final save (or the preemption's) cannot hide it
    assert keys("runs/faulty") == ["LATEST", "ckpt-00000004.manifest.json", "ckpt-00000004.pt"]
    assert list((tmp_path / "node-a").iterdir()) == []  # no staging copies left either

    proxy.clear()
    fresh_store, _, _ = s3_checkpointer(url, tmp_path / "node-b")  # another machine, empty disk
    url_found, saved = find_latest(fresh_store)
    assert url_found == f"{url}/ckpt-00000004.pt" and saved["progress"]["step"] == 4
    proxy.fail("GET", "/LATEST", times=-1, status=503)
    with pytest.raises(StoreError) as unreachable:
        find_latest(fresh_store)
    assert str(unreachable.value) == "cannot read LATEST in s3://corpora/runs/faulty: SlowDown (HTTP 503)"


# Several nodes on one machine, as a cluster has them: one torchrun agent per node, each in its own IPC
# and mount namespaces with private tmpfs on /dev/shm (streaming's shared memory) and on a folder of its
# own, its TMPDIR (its lock files, the node's data cache and run_local: the node's disk, gone with the
# node; not /tmp itself, which would hide a checkout under /tmp), meeting by static
# rendezvous on 127.0.0.1. The run is in S3, as for a cluster of preemptible nodes without a shared
# filesystem; the test sees what a scheduler would: the processes and the store.
CACHE_LIMIT = "data.cache_limit=300kb"  # under half the 700 kB dataset: streaming evicts, and must resume exactly


def launch_node(node: int, nodes: int, port: int, dataset: str, run_dir: str, disk) -> Node:
    """One node's torchrun with one rank, its disk (data cache, run_local, lock files) and /dev/shm its own."""
    return training.launch_node(node, nodes, 1, port, f"data.remote={dataset}", f"run_dir={run_dir}",
                                f"data.local={disk / 'cache'}", f"run_local={disk / 'run'}", CACHE_LIMIT, disk=disk)


@pytest.mark.long
@pytest.mark.skipif(not namespaces_permitted(), reason="namespaces are not permitted here (unshare --ipc --mount "
                    "failed): several nodes on one machine need root or user namespaces")
def test_two_nodes_with_the_run_in_s3_preempted_lost_and_relaunched_on_fresh_disks(reference, plays_on_s3, s3, tmp_path):
    """2 nodes x 1 rank, dataset and run_dir in S3, each node's disk (a tmpfs) and /dev/shm gone whenever
    the job ends. A notice to node 1 alone: every rank checkpoints at the same step and both agents
    exit at once with a non-zero status a scheduler requeues on (node 0's used to wait out its exit
    barrier). Relaunched on new disks, node 1 is then lost for good (SIGKILL) right after the next
    periodic checkpoint and the job torn down; relaunched on one new node with 2 ranks, it finishes on the same
    samples at every step, having downloaded the checkpoint once for its 2 ranks (a first try, whose download
    the store refuses, stops in one line). Every node reads through a cache under half the dataset:
    streaming evicts. The world size is 2 throughout, with the reference's micro-batch: what the two
    nodes trained is the reference's, rank by rank and bit for bit."""
    run_dir = f"s3://{BUCKET}/runs/two-nodes"
    store = S3RunStore(run_dir, tmp_path / "reader")

    disks = [tmp_path / f"node{node}" for node in range(2)]  # each launch mounts a new one there

    def job() -> list[Node]:
        port = free_port()
        return [launch_node(node, 2, port, plays_on_s3, run_dir, disks[node]) for node in range(2)]

    def newest_checkpoint() -> int:
        return latest_step(store) or 0

    nodes = job()
    wait_for_nodes(nodes, lambda: newest_checkpoint() >= 4)
    nodes[1].send_signal(signal.SIGTERM)
    outputs = [node.communicate(timeout=90)[0] for node in nodes]  # both gone, not just the signalled one
    assert all(node.returncode != 0 for node in nodes), "\n".join(map(Node.report, nodes))
    assert "preempted (signal to another rank)" in outputs[0], outputs[0][-3000:]
    stopped = len(training.metrics(run_dir))
    assert stopped >= 4 and newest_checkpoint() == stopped
    periodic = (stopped // 4 + 1) * 4  # the next periodic checkpoint (checkpoint_interval=4)
    assert periodic < training.STEPS, "the notice came too late for the rest of the test"

    nodes = job()
    wait_for_nodes(nodes, lambda: newest_checkpoint() >= periodic)
    for node in (nodes[1], nodes[0]):  # node 1 lost; the scheduler then ends the job's other node
        kill_tree(node.pid)
        node.communicate(timeout=60)
    assert not [path for disk in disks for path in disk.iterdir()]  # the nodes' files were on their own disks alone

    resumed_from = f"ckpt-{periodic:08d}.pt"
    # The node's first rank cannot download it: the job stops with its one line (no rank waits for it forever).
    s3.fail("GET", resumed_from, times=-1, status=403)
    refused = training.launch(2, plays_on_s3, run_dir, f"data.local={tmp_path / 'denied' / 'cache'}",
                              f"run_local={tmp_path / 'denied' / 'run'}", CACHE_LIMIT, warm=True)
    output = refused.communicate(timeout=120)[0]
    s3.clear()
    assert refused.returncode != 0
    denied = f"error: cannot download {run_dir}/{resumed_from}: access denied (HTTP 403)"
    assert output.count(denied) == 1, output[-3000:]  # errors are reported once, by rank 0
    gets_before = s3.count("GET", resumed_from)
    (tmp_path / "third").mkdir()  # its TMPDIR: run_local's default is under it
    output = training.finish(training.launch(2, plays_on_s3, run_dir, f"data.local={tmp_path / 'third' / 'cache'}",
                                             CACHE_LIMIT, env={"TMPDIR": str(tmp_path / "third")}, warm=True))
    assert f"resumed from {run_dir}/{resumed_from} at step {periodic}" in output
    gets_by_the_run = s3.count("GET", resumed_from) - gets_before
    final = f"ckpt-{newest_checkpoint():08d}.pt"  # the one the run resumed from is gone (keep_checkpoints)
    gets_before = s3.count("GET", final)
    store.release_copy(store.local_copy(final))  # what one download of a checkpoint of this run takes
    assert gets_by_the_run == s3.count("GET", final) - gets_before > 0
    (run_local,) = (tmp_path / "third" / "tokstream-runs").iterdir()
    assert (run_local / "metrics.jsonl").is_file()
    assert not any(run_local.glob("download-*"))  # the node's copy went once read
    steps = training.metrics(run_dir)
    assert [m["step"] for m in steps] == list(range(1, len(reference) + 1))
    for got, (step, samples, loss, lr) in zip(steps, reference):
        assert sorted(sum(got["samples"], [])) == sorted(samples[0] + samples[1]), step
        if step <= periodic:  # the two nodes' steps
            assert got["samples"] == samples and got["loss"] == loss, step
        else:
            # The last launch resumed on one node of 2 ranks what two nodes of 1 saved: streaming resumes
            # the epoch on another physical topology, where it keeps each step's global batch but not
            # always each rank's share of it (in one run of four, step 9's shares differed, and the loss
            # of step 11 in its last bits): other shares sum to other bits.
            assert got["loss"] == pytest.approx(loss, rel=1e-4), step


def test_a_nodes_checkpoint_copy_is_released_even_beside_a_killed_loads_leftover(proxy, tmp_path):
    """A rank killed while loading leaves its node's copy behind; the next resume, maybe from a newer
    checkpoint, downloads into the same node folder and must still release it, and the leftover."""
    url = f"s3://{BUCKET}/runs/leftover"
    store, components, checkpointer = s3_checkpointer(url, tmp_path / "node")
    for step in (4, 8):
        components["progress"].step = step
        checkpointer.save(step)
    killed = store.local_copy("ckpt-00000004.pt", "node0")  # what the killed load left
    path = store.local_copy("ckpt-00000008.pt", "node0")
    assert path.parent == killed.parent and path.read_bytes()[:2] == b"PK"  # torch.save's zip
    store.release_copy(path)
    assert not path.parent.exists()


PEER_ENDED = "error: another rank of the job ended (its own line above says why): this rank stops too"


def test_training_refuses_a_shard_that_fails_its_hash_after_download(dataset, s3, tmp_path):
    """data.validate_hash (xxh64, the default) through training's own download path (the reader's
    prepare_shard, not stock's loader): a train shard whose bytes changed in the store, with every token
    still inside the vocabulary, ends the run naming the shard, rather than training on it."""
    import json

    url = f"s3://{BUCKET}/tampered-{os.getpid()}"
    store = S3Dataset(url)
    for path in sorted(p for p in dataset.rglob("*") if p.is_file()):
        store.upload(path, path.relative_to(dataset).as_posix())
    shard = json.loads((dataset / "train" / "index.json").read_text())["shards"][0]["raw_data"]["basename"]
    body = bytearray(store.get_bytes(f"train/{shard}"))
    tokens = np.frombuffer(bytes(body[-4096:]), dtype=np.uint16)
    at = len(body) - 4096 + 2 * int(np.flatnonzero(tokens < 50000)[0])  # a token well inside the vocabulary
    body[at] ^= 0x01
    store.put_bytes(f"train/{shard}", bytes(body))

    run = training.launch(2, url, tmp_path / "run", f"data.local={tmp_path / 'cache'}", "max_steps=4", warm=True)
    output = run.communicate(timeout=180)[0]
    assert run.returncode != 0, output[-3000:]
    damaged = (f"error: shard {url}/train/{shard} does not match its xxh64 hash in index.json once downloaded: the "
               f"dataset is damaged; python convert/verify.py {url} checks every shard, reconverting repairs it")
    errors = re.findall(r"error: .*", output)  # a progress bar may stand before one on its line
    assert damaged in errors and set(errors) <= {damaged, PEER_ENDED}, output[-3000:]
    assert "Traceback" not in output  # from no rank
    assert not training.metrics(tmp_path / "run")  # not one step trained on it


def test_a_conversion_to_s3_keeps_at_most_4_uploads_in_flight_and_a_few_shards_on_disk(proxy, corpus, tmp_path):
    """Against a slow store (every shard PUT answered 0.3 s late): shards go up several at once, never
    more than MAX_UPLOADS_IN_FLIGHT, and the staging folder never holds more than those and the shard
    being written, whatever the corpus's size."""
    from tokstream.object_store import MAX_UPLOADS_IN_FLIGHT

    proxy.slow("PUT", "/shard.", 0.3)
    staging = tmp_path / "staging"
    conversion = subprocess.Popen([sys.executable, str(ROOT / "convert/owt_to_mds.py"), "--dataset", str(corpus),
                                   "--out", f"s3://{BUCKET}/slow", "--staging", str(staging), *CONVERT,
                                   "--shard-size", "16kb"], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
    def shards_on_disk() -> int:  # os.walk passes over a folder the conversion removes while it is walked
        return sum(name.startswith("shard.") for _, _, names in os.walk(staging) for name in names)

    most_on_disk = 0
    while conversion.poll() is None:
        most_on_disk = max(most_on_disk, shards_on_disk())
        time.sleep(0.02)
    assert conversion.returncode == 0, conversion.stdout.read()
    shards = [key for key in keys("slow") if "/shard." in key]
    assert len(shards) > 4 * MAX_UPLOADS_IN_FLIGHT  # enough to fill the pipeline several times over
    assert 2 <= proxy.most_at_once("PUT", "/shard.") <= MAX_UPLOADS_IN_FLIGHT == 4
    assert 2 <= most_on_disk <= MAX_UPLOADS_IN_FLIGHT + 1


def test_parts_for_s3_need_no_credentials_and_the_merge_uploads_a_one_pass_conversion(proxy, tmp_path):
    """Parts write only under --staging (the merge uploads), so machines without AWS credentials can run them."""
    articles = wikitext_articles()
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        write_jsonl(tmp_path / "corpus" / f"wiki-{i}.jsonl", articles[i::3])
    args = [tmp_path / "corpus", *CONVERT, "--staging", tmp_path / "staging"]
    uncredentialed = {name: value for name, value in os.environ.items()
                      if name not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    uncredentialed.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"))
    out = f"s3://{BUCKET}/parts"
    for part in (1, 0, 2):
        done = run_script("convert/text_to_mds.py", *args, "--out", out, "--num-parts", "3", "--part", str(part),
                          env=uncredentialed)
        assert done.returncode == 0, done.stderr
    assert keys("parts") == []
    merged = run_script("convert/text_to_mds.py", *args, "--out", out, "--num-parts", "3", "--merge")
    assert merged.returncode == 0, merged.stderr
    local = run_script("convert/text_to_mds.py", *args[:-2], "--out", tmp_path / "local")
    assert local.returncode == 0, local.stderr
    assert_store_holds_exactly("parts", tmp_path / "local")


def test_plotting_a_run_without_metrics_is_one_line_not_a_blank_plot(proxy, tmp_path):
    """A mistyped S3 run reads as no metrics (there is no file to miss), as does a run that has logged no step."""
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "metrics.jsonl").write_text("")
    for run_dir in (f"s3://{BUCKET}/no-such-run", str(tmp_path / "fresh")):
        done = run_script("train/plot.py", run_dir, "--out", tmp_path / "loss.png")
        assert (done.returncode, done.stderr) == (2, f"error: {run_dir} holds no metrics: is it a run directory, "
                                                     "and has its run logged a step?\n")
        assert not (tmp_path / "loss.png").exists()


def test_a_run_in_s3_rewinds_keeping_the_abandoned_branch_byte_for_byte(proxy, dataset, tmp_path):
    """resume_from on an S3 run_dir: the checkpoints after the step, with metrics.jsonl and LATEST as they were, are
    copied under abandoned/ byte for byte and then deleted where they were; the branch trains as a run that had
    skip_steps from the start (the same samples, the same losses), and its relaunch does not rewind again."""
    url = f"s3://{BUCKET}/rewind-{os.getpid()}"
    store = S3Dataset(url)
    common = ("max_steps=12", "optim.decay_steps=12", "keep_checkpoints=0", f"run_local={tmp_path / 'local'}")
    training.train(1, dataset, tmp_path / "reference", *common, "skip_steps=[[5,6]]")
    reference = training.metrics(tmp_path / "reference")
    training.train(1, dataset, url, *common)
    before = {name: store.get_bytes(name) for name in store.keys()
              if name in ("metrics.jsonl", "LATEST") or (name.startswith("ckpt-") and int(name[5:13]) > 4)}
    assert len(before) == 2 + 2 * 2  # checkpoints 8 and 12, each with its manifest
    said = training.train(1, dataset, url, *common, "resume_from=4", "skip_steps=[[5,6]]")
    assert f"resume_from=4: rewound; checkpoints 8, 12 and metrics.jsonl as it was moved to {url}/abandoned/" in said
    (folder,) = {name.split("/")[1] for name in store.keys() if name.startswith("abandoned/")}
    aside = S3Dataset(f"{url}/abandoned/{folder}")
    assert sorted(aside.keys()) == sorted(before) and all(aside.get_bytes(name) == data for name, data in before.items())
    branch = training.metrics(url)
    assert [(m["step"], m["samples"], m["loss"]) for m in branch] == \
        [(m["step"], m["samples"], m["loss"]) for m in reference]
    again = training.train(1, dataset, url, *common, "resume_from=4", "skip_steps=[[5,6]]", "max_steps=13")
    assert "rewound" not in again and "resumed from" in again
    from train.plot import plot_runs

    _, marks = plot_runs([url], str(tmp_path / "loss.png"))  # the abandoned branch read back from the store
    assert marks == [("rewind", 4), ("abandoned", 5), ("skip", 5), ("end", 12)]


def test_a_notice_while_a_relaunch_loads_its_checkpoint_ends_it_at_once_in_one_line(proxy, dataset, tmp_path):
    """A relaunch of an S3 run spends its start-up downloading the checkpoint (GBs for a real model), longer than a
    notice's grace: a SIGTERM then ends the rank at once, exit 75 and one line (nothing was trained, nothing to save),
    not a kill after the grace. The next launch resumes from that checkpoint."""
    url = f"s3://{BUCKET}/notice-at-start-{os.getpid()}"
    common = ("optim.decay_steps=8", "checkpoint_interval=4", f"run_local={tmp_path / 'local'}")
    training.train(1, dataset, url, *common, "max_steps=4")
    proxy.hold("GET", "/ckpt-00000004.pt", seconds=120)
    process = training.launch(1, dataset, url, *common, "max_steps=8", warm=True)
    training.wait_for(proxy.holding.is_set)
    process.send_signal(signal.SIGTERM)  # to the rank
    output = process.communicate(timeout=60)[0]  # well before the held download would have ended
    assert "preempted (signal 15) while starting: nothing trained in this launch, nothing to save; exiting" in output
    assert process.returncode == 75, output[-3000:]
    proxy.clear()
    assert f"resumed from {url}/ckpt-00000004.pt" in training.train(1, dataset, url, *common, "max_steps=8")
