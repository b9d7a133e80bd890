"""A disk that fills up: the converter's output, training's data cache, training's checkpoints.

Each case runs on a small tmpfs mounted in a mount namespace of its own (unshare), as a small disk
would be, and what is "freed" afterwards is freed by growing it (mount -o remount,size=...); a
plain write meets /dev/full, a device that is always full.

What a user relies on: one line that names the full device and says what to do, a non-zero exit
and no hang; nothing half-written that looks complete; and the fix the line suggests works: the
conversion resumes with the bytes of a clean one, training trains on the samples of an
uninterrupted run.
"""

import gc
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import test_training as training
from conftest import ROOT, namespaces_permitted, plays, run_script, tagged_lines, tree_bytes

from tokstream.format import index_shards
from tokstream.train.checkpoint_files import latest_step
from tokstream.train.run_store import LocalRunStore

SMALL_DISK = pytest.mark.skipif(not namespaces_permitted(), reason="namespaces are not permitted here (unshare "
                                "--mount): a small disk of its own is mounted for each case")


def on_a_small_disk(disk: Path, size: str, script: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run the shell `script` with a tmpfs of `size` mounted at `disk`, seen by nothing else."""
    disk.mkdir()
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           f"mount -t tmpfs -o size={size} small-disk {disk} && {script}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def sh(*command) -> str:
    return shlex.join(map(str, command))


def converter(script: str, *args) -> str:
    return sh(sys.executable, ROOT / script, *args)


def the_error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error:" in line]


def token_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(3)
    path = tmp_path / "train.bin"
    rng.integers(0, 50257, 1_500_000).astype("<u2").tofile(path)  # 3 MB, and as much of shards
    return path


CONVERSIONS = {
    # a one-pass text conversion saves its state between batches; token files journal their shards
    "text": lambda tmp_path: ("convert/text_to_mds.py", tagged_lines(tmp_path / "lines.txt", 2), "--doc-per",
                              "line", "--block-size", "64", "--shard-size", "64kb", "--num-workers", "1",
                              "--state-interval", "0", "--no-progress"),
    "token file": lambda tmp_path: ("convert/bin_to_mds.py", token_file(tmp_path), "--block-size", "64",
                                    "--shard-size", "64kb", "--no-progress"),
}


@SMALL_DISK
@pytest.mark.parametrize("kind", CONVERSIONS)
def test_a_conversion_that_fills_the_disk_keeps_its_work_and_resumes_to_the_same_bytes(tmp_path, kind):
    script, *args = CONVERSIONS[kind](tmp_path)
    disk = tmp_path / "disk"
    out = disk / "out"
    result = on_a_small_disk(disk, "1500k", f"""
        {converter(script, *args, "--out", out)} 2> {tmp_path}/full.err; echo $? > {tmp_path}/full.rc
        ls -A {out}.partial > {tmp_path}/kept.txt; test ! -e {out}/metadata.json && echo none > {tmp_path}/complete.txt
        mount -o remount,size=16m {disk}
        {converter(script, *args, "--out", out)} > {tmp_path}/resumed.out 2>&1 && cp -r {out} {tmp_path}/out""")
    assert result.returncode == 0, result.stderr + (tmp_path / "resumed.out").read_text()
    error = (tmp_path / "full.err").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "2" and len(error.strip().splitlines()) == 1, error
    assert error.startswith(f"error: no space left on the device holding {out}.partial (No space left on device): "
                            "what was converted so far is kept there; free space and run the same command again "
                            "to continue from it"), error
    assert (tmp_path / "kept.txt").read_text().split() and (tmp_path / "complete.txt").read_text() == "none\n"
    assert "resuming" in (tmp_path / "resumed.out").read_text()  # it continued, not started over

    clean = run_script(script, *args, "--out", tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "clean")


@SMALL_DISK
def test_a_conversion_in_parts_that_fills_the_disk_removes_the_unfinished_part_and_reruns_to_the_same_bytes(tmp_path):
    """Parts resume by part, not within one: the part that met the full disk is removed (that finished
    parts stay is test_text_to_mds's kill test), and the rerun after space was freed converts it and
    merges to a clean run's bytes. numpy's tofile had raised a short write without ENOSPC's errno."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    lines = tagged_lines(tmp_path / "lines.txt", 2).read_text().splitlines(keepends=True)
    for index in range(2):
        (inputs / f"part{index}.txt").write_text("".join(lines[index::2]))
    args = [inputs, "--doc-per", "line", "--block-size", "64", "--shard-size", "64kb", "--num-workers", "1",
            "--no-progress", "--num-parts", "2"]
    disk = tmp_path / "disk"
    out = disk / "out"
    result = on_a_small_disk(disk, "1000k", f"""
        {converter("convert/text_to_mds.py", *args, "--out", out)} 2> {tmp_path}/full.err; echo $? > {tmp_path}/full.rc
        echo "$(ls -A {out}.parts)" > {tmp_path}/parts.txt
        mount -o remount,size=16m {disk}
        {converter("convert/text_to_mds.py", *args, "--out", out)} > {tmp_path}/rerun.out 2>&1 && cp -r {out} {tmp_path}/out""")
    assert result.returncode == 0, result.stderr + (tmp_path / "rerun.out").read_text()
    error = (tmp_path / "full.err").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "2" and len(error.strip().splitlines()) == 1, error
    assert error.startswith(f"error: no space left on the device holding {out}.parts/part-0000"), error
    assert error.strip().endswith("(No space left on device): the unfinished output was removed; free space (or "
                                  "choose another --out) and run the command again"), error
    assert not [name for name in (tmp_path / "parts.txt").read_text().split() if name.endswith(".partial")]

    clean = run_script("convert/text_to_mds.py", *args, "--out", tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "clean")


@SMALL_DISK
def test_a_conversion_to_s3_whose_staging_disk_fills_keeps_its_uploads_and_resumes_to_the_same_bytes(proxy, tmp_path):
    """Shards wait in --staging for their upload. That disk filling up (by another writer, once the
    conversion has saved a state) is one line naming it; the objects uploaded so far stay, and the
    rerun continues from them to a local conversion's bytes."""
    from test_s3 import BUCKET, CONVERT, rerun_resumes_to_a_local_conversions_bytes

    args = ["--dataset", tagged_lines(tmp_path / "lines.txt", 2), "--txt-docs", "line", *CONVERT, "--num-workers",
            "1", "--state-interval", "0", "--out", f"s3://{BUCKET}/small-staging"]  # 30 train shards of 96 kB
    disk = tmp_path / "disk"
    result = on_a_small_disk(disk, "1m", f"""
        {converter("convert/owt_to_mds.py", *args, "--staging", disk)} 2> {tmp_path}/err & converting=$!
        until ls {disk}/tokstream-upload-*/.conversion-state.npz > /dev/null 2>&1; do sleep 0.005; done
        dd if=/dev/zero of={disk}/filler bs=64k 2> /dev/null
        wait $converting; echo $? > {tmp_path}/rc; rm {disk}/filler; echo "$(ls -A {disk})" > {tmp_path}/left.txt""")
    assert result.returncode == 0, result.stderr
    error = (tmp_path / "err").read_text()
    assert (tmp_path / "rc").read_text().strip() == "2" and len(error.strip().splitlines()) == 1, error
    assert error.startswith(f"error: no space left on the device holding {disk}/tokstream-upload-"), error
    assert error.strip().endswith("(No space left on device), where shards wait for their upload: what was "
                                  "uploaded stays; free space there or pass --staging DIR on another disk, and run "
                                  "the same command again"), error
    assert (tmp_path / "left.txt").read_text().strip() == ""  # the staging directory itself is gone

    rerun_resumes_to_a_local_conversions_bytes(args, "small-staging", tmp_path)


def test_any_other_write_that_finds_no_space_is_one_line_too():
    """What no part of the project turned into a line of its own: a plain write to a full device."""
    command = "from tokstream.errors import run_cli; run_cli(lambda: open('/dev/full', 'wb').write(bytes(1 << 20)))"
    ended = subprocess.run([sys.executable, "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ended.returncode == 2 and ended.stderr == (
        "error: no space left on the device holding a file this command writes (No space left on device): free "
        "space there, or point the command at another disk\n"), ended.stderr


def torchrun(dataset: Path, run_dir: Path, *overrides: str) -> str:
    """test_training's 2-rank launch, as a shell command."""
    return sh(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
              ROOT / "train/main.py", *training.BASE, f"data.remote={dataset}", f"run_dir={run_dir}", *overrides)


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory) -> Path:
    """The training tests' plays in shards of 16 kB (41 train, 3 val): a cache can hold some of them."""
    return plays(tmp_path_factory.mktemp("small-shards"), "16kb")


@pytest.mark.long
@SMALL_DISK
def test_a_full_data_cache_ends_every_rank_in_one_line_and_the_cache_limit_it_suggests_trains_exactly(
        small_shards, tmp_path):
    """The shards are copied into data.local, on a disk that holds about half of them: the ranks stop
    with one line each (their DataLoader workers met it), none waits forever for a shard whose copy
    failed (stock streaming's ranks did, until torchrun's SIGKILL 30 s later), and no partial copy is
    left. Relaunched on the same disk with the data.cache_limit the line suggests, the run evicts
    and fetches again, evaluates (the val split's shards fit beside), and trains on the samples of a
    run on a big disk."""
    steps = "max_steps=8"  # an evaluation at step 8
    training.train(2, small_shards, tmp_path / "reference", steps)
    disk = tmp_path / "disk"
    cache, run_dir = disk / "cache", tmp_path / "run"
    environment = "OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1"
    result = on_a_small_disk(disk, "400k", f"""
        {environment} timeout 90 {torchrun(small_shards, run_dir, f"data.local={cache}", steps, "data.num_workers=2")} \\
            > {tmp_path}/full.log 2>&1
        echo $? > {tmp_path}/full.rc; find {cache} -name '*.tmp' > {tmp_path}/partial.txt
        limit=$(grep -o 'set data.cache_limit to at most [0-9a-z]*' {tmp_path}/full.log | head -1 | sed 's/.* //')
        echo "$limit" > {tmp_path}/limit.txt
        {environment} {torchrun(small_shards, run_dir, f"data.local={cache}", steps)} "data.cache_limit=$limit" \\
            > {tmp_path}/relaunch.log 2>&1""")
    full = (tmp_path / "full.log").read_text()
    assert (tmp_path / "full.rc").read_text().strip() not in ("0", "124"), full  # 124: timed out, a rank hung
    errors = the_error_lines(full)
    said = re.compile(rf"error: no space left on the device holding the data cache {re.escape(str(cache))}/train "
                      r"\(No space left on device\): a shard of \d+kb did not fit in the \d+k?b free there; set "
                      r"data\.cache_limit to at most \d+kb ")  # which shard meets the full disk depends on timing
    assert errors and all(said.search(line) for line in errors), full
    assert f'File "{ROOT / "tokstream"}' not in full  # no traceback from the trainer (torchrun adds its own)
    assert (tmp_path / "partial.txt").read_text() == ""
    assert (tmp_path / "limit.txt").read_text().strip().endswith("kb")

    assert result.returncode == 0, (tmp_path / "relaunch.log").read_text()[-3000:]
    assert training.trained_steps(run_dir) == training.trained_steps(tmp_path / "reference")


EPOCH_SCRIPT = """
import sys
import numpy as np
from tokstream.reader.config import DataConfig
from tokstream.reader.batches import make_loader

def epoch(remote: str, local: str, cache_limit: str) -> np.ndarray:
    loader = make_loader(DataConfig(remote=remote, local=local, cache_limit=cache_limit, shuffle_seed=5), "train", 8,
                         shuffle=True, pin_memory=False)
    return np.concatenate([batch["tokens"].numpy() for batch in loader])

if __name__ == "__main__":
    np.save(sys.argv[4], epoch(*sys.argv[1:4]))
"""


@SMALL_DISK
def test_a_cache_limit_larger_than_the_disk_is_capped_by_the_disk(small_shards, tmp_path):
    """A data.cache_limit of 16 MB, for 650 kB of shards, on a 400 kB disk: streaming never evicts for
    that limit, so shards are evicted for the disk instead, before a download that would not fit (or
    after one that found it full), and the epoch reads the same samples as from a big disk."""
    disk = tmp_path / "disk"
    command = sh(sys.executable, "-c", EPOCH_SCRIPT, small_shards, disk / "cache", "16mb", tmp_path / "small.npy")
    small = on_a_small_disk(disk, "400k", f"PYTHONPATH={ROOT} {command}")
    assert small.returncode == 0, small.stderr
    namespace = {}
    exec(EPOCH_SCRIPT, namespace)  # the same epoch, here, from a cache on a big disk
    big = namespace["epoch"](str(small_shards), str(tmp_path / "big"), "16mb")
    assert len(list((tmp_path / "big" / "train").glob("shard.*"))) == len(index_shards(small_shards / "train"))
    np.testing.assert_array_equal(np.load(tmp_path / "small.npy"), big)
    gc.collect()  # the loader's dataset and its shared memory go now, not at another test's collection


@pytest.mark.long
@SMALL_DISK
def test_checkpoints_on_a_full_disk_fail_in_one_line_and_the_one_kept_resumes_exactly(dataset, tmp_path):
    """run_dir on a disk with room for one checkpoint (40 MB) and not two: the periodic save at step 8
    warns and training goes on; the final one, at step 12, ends every rank with one line. The
    checkpoint LATEST names is whole: copied to a bigger disk, the same command resumes from it and trains on
    the reference's samples to step 12. On a disk without room for the write probe that sizes the
    preemption grace period (step 2), that is a warning too, and the probe leaves nothing behind."""
    gpt2_rows = "model.vocab_size=50304"  # GPT-2's embedding: checkpoints of 38 MiB, as the sizes here are
    training.train(2, dataset, tmp_path / "reference", gpt2_rows, "max_steps=12")
    disk = tmp_path / "disk"
    tiny = disk / "tiny"  # 8 MB, mounted on the disk: no room even for the 16 MiB write probe at step 2
    result = on_a_small_disk(disk, "60m", f"""
        OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 {torchrun(dataset, disk / "run", "max_steps=12", gpt2_rows)} \
            > {tmp_path}/full.log 2>&1
        echo $? > {tmp_path}/full.rc; cp -r {disk / "run"} {tmp_path}/run
        mkdir {tiny} && mount -t tmpfs -o size=8m tiny {tiny}
        OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 {torchrun(dataset, tiny / "run", "max_steps=3", gpt2_rows)} \
            > {tmp_path}/tiny.log 2>&1
        echo $? > {tmp_path}/tiny.rc; echo "$(ls -A {tiny / "run"})" > {tmp_path}/tiny.txt""")
    assert result.returncode == 0, result.stderr
    tiny_run = (tmp_path / "tiny.log").read_text()
    assert (tmp_path / "tiny.rc").read_text().strip() != "0", tiny_run
    assert (f"warning: no space left on the device holding {tiny / 'run'} (No space left on device) for a 16 MiB "
            "write probe: checkpoints (38.0 MiB each) cannot be saved until space is freed there") in tiny_run
    assert len(the_error_lines(tiny_run)) == 1 and "error: checkpoint at step 3 not saved" in tiny_run, tiny_run
    assert (tmp_path / "tiny.txt").read_text().split() == ["metrics.jsonl", "orders"]  # no probe or checkpoint left
    full = (tmp_path / "full.log").read_text()
    assert (tmp_path / "full.rc").read_text().strip() != "0", full
    no_space = (f"no space left on the device holding {disk / 'run'} (No space left on device): the checkpoint "
                "takes 38.0 MiB")
    assert f"warning: checkpoint at step 8 not saved ({no_space}" in full
    assert "the newest checkpoint is still step 4; training goes on" in full
    errors = the_error_lines(full)  # rank 0's: rank 1 learns of the failure and ends without a word
    assert len(errors) == 1 and f"error: checkpoint at step 12 not saved: {no_space}" in errors[0], full
    assert f'File "{ROOT / "tokstream"}' not in full  # rank 1 too ended without a traceback

    run = tmp_path / "run"
    assert latest_step(LocalRunStore(run)) == 4
    assert sorted(p.name for p in run.iterdir()) == ["LATEST", "ckpt-00000004.manifest.json", "ckpt-00000004.pt",
                                                     "metrics.jsonl", "orders"]
    training.train(2, dataset, run, gpt2_rows, "max_steps=12")  # the disk run's command, on a bigger disk
    assert training.trained_steps(run) == training.trained_steps(tmp_path / "reference")
