"""Checkpoint files: atomic writes with a manifest, the newest one that passes its checks wins, damaged
ones are skipped with a warning, LATEST is a hint, last K kept, nothing deleted that is not provably
this run's and spent."""


import json
import os

import pytest
import torch
from conftest import ROOT

from tokstream.errors import UserError
from tokstream.train.checkpoint import find_latest
from tokstream.train.checkpoint_files import Survey, manifest_name, read_manifest, write_checkpoint
from tokstream.train.config import load_config
from tokstream.train.metrics import METRICS_FILE
from tokstream.train.run_store import LocalRunStore


RUN_ID = "run-under-test"


def save_checkpoint(run_dir, step: int, state: dict, keep: int, run_id: str = RUN_ID) -> None:
    """As one job saving steps in order: every earlier checkpoint of the run is one it wrote."""
    write_checkpoint(LocalRunStore(run_dir), step, state, keep, run_id, trusted=complete(run_dir))


def load_latest(run_dir):
    return find_latest(LocalRunStore(run_dir))


def trainer_state(step: int) -> dict:
    return {"progress": {"step": step}, "weights": torch.full((64,), float(step))}


def complete(run_dir) -> list[int]:
    return Survey.of(LocalRunStore(run_dir)).complete


def test_keeps_last_k_and_ignores_interrupted_writes(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, trainer_state(step), keep=2)
    assert complete(tmp_path) == [30, 40]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "LATEST", "ckpt-00000030.manifest.json", "ckpt-00000030.pt", "ckpt-00000040.manifest.json", "ckpt-00000040.pt"]
    (tmp_path / "ckpt-00000050.pt.tmp123").write_bytes(b"half a checkpoint")  # a save killed mid-write
    url, state = load_latest(tmp_path)
    assert url == f"{tmp_path}/ckpt-00000040.pt" and state["progress"]["step"] == 40


class Killed(BaseException):
    """The writer's process killed: nothing of it runs on."""


class KilledAfterTheManifest(LocalRunStore):
    """A store whose writer is killed the moment step `step`'s manifest is in place (what makes it complete)."""

    def __init__(self, root, step: int):
        super().__init__(root)
        self.killed_at = manifest_name(step)

    def publish_bytes(self, name: str, data: bytes) -> None:
        super().publish_bytes(name, data)
        if name == self.killed_at:
            raise Killed(name)


def test_a_checkpoint_complete_in_the_store_has_its_metrics_copy_there_too(tmp_path):
    """An S3 run's metrics go to the store with each checkpoint, and a relaunch resumes from the newest checkpoint
    with a manifest, its metrics.jsonl replaced by the store's copy: so the copy must be there before the manifest.
    Written after it, a kill between the two lost the step's line for good (seen once in the random interruption
    schedule: metrics.jsonl without step 5)."""
    store = KilledAfterTheManifest(tmp_path, 5)
    write_checkpoint(store, 4, trainer_state(4), 2, RUN_ID, trusted=[], metrics=b"steps 1-4\n")
    with pytest.raises(Killed):
        write_checkpoint(store, 5, trainer_state(5), 2, RUN_ID, trusted=[4], metrics=b"steps 1-5\n")
    assert complete(tmp_path) == [4, 5]  # a relaunch resumes from 5
    assert store.read_bytes(METRICS_FILE) == b"steps 1-5\n"


def test_keep_every_keeps_older_checkpoints_at_its_multiples_for_a_rewind(tmp_path):
    for step in range(10, 110, 10):
        write_checkpoint(LocalRunStore(tmp_path), step, trainer_state(step), 2, RUN_ID, trusted=complete(tmp_path),
                         keep_every=40)
    assert complete(tmp_path) == [40, 80, 90, 100]


def test_truncated_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    save_checkpoint(tmp_path, 1, trainer_state(1), keep=3)
    save_checkpoint(tmp_path, 2, trainer_state(2), keep=3)
    newest = tmp_path / "ckpt-00000002.pt"
    size = newest.stat().st_size
    newest.write_bytes(newest.read_bytes()[:20])  # e.g. a disk that lost the tail
    _, state = load_latest(tmp_path)
    assert state["progress"]["step"] == 1
    assert capsys.readouterr().out.splitlines()[0] == (
        f"warning: {newest} not used: 20 bytes where its manifest records {size}; falling back to the "
        "checkpoint before it")
    assert newest.exists()  # kept: a person may still want it


def test_flipped_bytes_in_the_newest_checkpoint_are_caught_and_it_falls_back(tmp_path, capsys):
    """torch.load reads a zip whose record checksums it does not check: 64 flipped bytes inside the
    weights load without a word, and training goes on from garbage. The manifest's checksum catches it."""
    save_checkpoint(tmp_path, 1, trainer_state(1), keep=3)
    save_checkpoint(tmp_path, 2, trainer_state(2), keep=3)
    newest = tmp_path / "ckpt-00000002.pt"
    data = bytearray(newest.read_bytes())
    weights = data.find(torch.full((64,), 2.0).numpy().tobytes())
    assert weights > 0
    data[weights:weights + 64] = bytes(b ^ 0x5A for b in data[weights:weights + 64])
    newest.write_bytes(bytes(data))
    assert torch.load(newest, weights_only=True)["progress"]["step"] == 2  # it loads: only the checksum tells
    _, state = load_latest(tmp_path)
    assert state["progress"]["step"] == 1 and torch.equal(state["weights"], torch.full((64,), 1.0))
    assert capsys.readouterr().out == (f"warning: {newest} not used: its xxh3_128 checksum differs from its "
                                       "manifest's; falling back to the checkpoint before it\n"
                                       "LATEST names ckpt-00000002.pt, a checkpoint that is missing or failed its "
                                       "checks: resuming from the newest checkpoint that passes its checks, "
                                       "ckpt-00000001.pt\n")


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert load_latest(tmp_path / "missing") == (None, None)
    (tmp_path / "notes.txt").write_text("a user's file")
    assert load_latest(tmp_path) == (None, None)


POINTERS = {"missing": None, "older": b'{"checkpoint": "ckpt-00000010.pt", "step": 10}', "damaged": b"\x00garbage",
            "gone": b'{"checkpoint": "ckpt-00000030.pt", "step": 30}'}


@pytest.mark.parametrize("pointer", POINTERS)
def test_latest_is_a_hint_the_newest_complete_checkpoint_wins_and_nothing_is_deleted(tmp_path, capsys, pointer):
    """LATEST missing (a copy to a new prefix without it), older than the newest checkpoint, damaged,
    or naming a checkpoint that is gone: the relaunch resumes from the newest complete one, says so in
    one line, and removes nothing."""
    for step in (10, 15, 20):
        save_checkpoint(tmp_path, step, trainer_state(step), keep=3)
    (tmp_path / "LATEST").unlink()
    if POINTERS[pointer] is not None:
        (tmp_path / "LATEST").write_bytes(POINTERS[pointer])
    before = sorted(p.name for p in tmp_path.iterdir())
    url, state = load_latest(tmp_path)
    assert url == f"{tmp_path}/ckpt-00000020.pt" and state["progress"]["step"] == 20
    said = {"missing": f"LATEST in {tmp_path} is missing",
            "damaged": f"LATEST in {tmp_path} is damaged (b'\\x00garbage')",
            "older": "LATEST names ckpt-00000010.pt, an older checkpoint",
            "gone": "LATEST names ckpt-00000030.pt, a checkpoint that is missing or failed its checks"}[pointer]
    assert capsys.readouterr().out == f"{said}: resuming from the newest checkpoint that passes its checks, " \
                                      "ckpt-00000020.pt\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_config_overrides_are_typed_and_checked():
    config = load_config(str(ROOT / "configs/tiny.yaml"), ["data.remote=/x", "max_steps=7", "optim.lr=1e-3",
                                                           "trace_samples=true", "data.local=/cache"])
    assert (config.max_steps, config.optim.lr, config.trace_samples, config.data.local) == (7, 1e-3, True, "/cache")
    for bad, message in (["data.remot=/x"], "unknown config key 'data.remot'; valid here: remote, local, split"), (["max_steps=lots"], "must be a whole number"):
        try:
            load_config(str(ROOT / "configs/tiny.yaml"), bad)
        except UserError as err:
            assert message in str(err)
        else:
            raise AssertionError(f"{bad} was accepted")


def _components(seed: int):
    from tokstream.train.checkpoint import Progress

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {"model": model, "optimizer": optimizer, "progress": Progress()}


def test_checkpoint_is_assembled_from_components_and_restores_them(tmp_path):
    from tokstream.train.checkpoint import Checkpointer, find_latest
    from tokstream.train.distributed import Distributed

    single = Distributed(rank=0, world=1, local_rank=0, device=torch.device("cpu"), enabled=False)
    trained = _components(seed=1)
    trained["model"](torch.ones(2, 4)).sum().backward()
    trained["optimizer"].step()  # AdamW now has moments to save
    trained["progress"].step = 7
    store = LocalRunStore(tmp_path)
    Checkpointer(store, 2, single, trained, {"note": "facts a relaunch is checked against"}).save(7)

    url, saved = find_latest(store)
    assert url.endswith("/ckpt-00000007.pt") and set(saved) == {"model", "optimizer", "progress", "run"}
    fresh = _components(seed=2)
    Checkpointer(store, 2, single, fresh, {}).restore(saved)
    assert fresh["progress"].step == 7
    assert torch.equal(fresh["model"].weight, trained["model"].weight)
    assert fresh["optimizer"].state_dict()["state"][0]["exp_avg"].equal(
        trained["optimizer"].state_dict()["state"][0]["exp_avg"])


def test_checkpoint_of_the_earlier_flat_layout_is_refused_in_one_line(tmp_path):
    from tokstream.train.checkpoint import find_latest

    save_checkpoint(tmp_path, 4, {"model": {}, "optimizer": {}, "step": 4, "loader": {}, "rng": []}, keep=2)
    try:
        find_latest(LocalRunStore(tmp_path))
    except UserError as err:
        assert "ckpt-00000004.pt was written before" in str(err) and "new run_dir" in str(err)
    else:
        raise AssertionError("a checkpoint without components was accepted")


def test_checkpoints_that_all_fail_their_checks_are_refused_not_restarted_from_zero(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, trainer_state(step), keep=3)
        path = tmp_path / f"ckpt-{step:08d}.pt"
        path.write_bytes(path.read_bytes()[:20])
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(UserError) as refused:
        load_latest(tmp_path)
    assert str(refused.value).startswith(
        f"{tmp_path} holds checkpoints none of which can be resumed from: ckpt-00000001.pt (20 bytes where its "
        "manifest records ")
    assert "ckpt-00000002.pt (20 bytes" in str(refused.value)
    assert str(refused.value).endswith("nothing was deleted; to start the run afresh, point run_dir at a new directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("left", ["manifests and LATEST", "LATEST"])
def test_a_run_whose_checkpoint_files_are_gone_is_refused_not_started_over(tmp_path, left):
    """A copy that left out *.pt (rsync --exclude, a lifecycle rule): the manifests or LATEST show that
    a run saved there, so starting from step 0 (and rewriting its metrics) is refused in one line."""
    for step in (12, 16):
        save_checkpoint(tmp_path, step, trainer_state(step), keep=3)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    for path in tmp_path.glob("ckpt-*.pt" if left != "LATEST" else "ckpt-*"):
        path.unlink()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(UserError) as refused:
        load_latest(tmp_path)
    named = "ckpt-00000012.pt, ckpt-00000016.pt" if left != "LATEST" else "LATEST names ckpt-00000016.pt"
    assert str(refused.value) == (f"the checkpoints of the run in {tmp_path} are gone ({named}, but no checkpoint "
                                  "file is there): restore them; nothing was deleted; to start the run afresh, "
                                  "point run_dir at a new directory")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_checkpoints_without_a_manifest_are_never_resumed_from_nor_deleted(tmp_path):
    """A run_dir of checkpoint files no manifest vouches for (a release before manifests, or a copy
    that lost them): refused in one line naming them, not a fresh start over them."""
    for step in (4, 8):
        torch.save(trainer_state(step), tmp_path / f"ckpt-{step:08d}.pt")
    with pytest.raises(UserError, match=r"holds checkpoints none of which can be resumed from: ckpt-00000004\.pt "
                                        r"\(no manifest\), ckpt-00000008\.pt \(no manifest\); .* python "
                                        r"train/vouch\.py RUN_DIR writes manifests for those you vouch for"):
        load_latest(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000004.pt", "ckpt-00000008.pt"]


def test_vouching_for_checkpoints_without_a_manifest_lets_the_run_resume_from_them(tmp_path):
    """train/vouch.py: the upgrade path for a run whose checkpoints predate manifests. A file that does
    not hold the trainer's state of the step its name says is refused in one line, nothing written."""
    import subprocess
    import sys

    run = {"run_id": "0123abcd", "config": {"max_steps": 8}, "phase_identities": ["a1b2"]}
    for step in (4, 8):
        torch.save({**trainer_state(step), "run": run}, tmp_path / f"ckpt-{step:08d}.pt")
    torch.save(trainer_state(3), tmp_path / "ckpt-00000012.pt")  # misnamed
    vouch = [sys.executable, str(ROOT / "train/vouch.py"), str(tmp_path)]
    refused = subprocess.run(vouch, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr == (
        f"error: {tmp_path}/ckpt-00000012.pt cannot be vouched for: ValueError: it holds no trainer state of step "
        "12; nothing was written\n")
    assert complete(tmp_path) == [4, 8]  # the two before it were vouched for
    manifest = read_manifest(LocalRunStore(tmp_path), 8)
    assert manifest["run_id"] == "0123abcd" and manifest["run"] == run  # the ledger reads the run's record there
    done = subprocess.run([*vouch, "--step", "8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "ckpt-00000008.pt: it has a manifest already" in done.stderr
    url, state = load_latest(tmp_path)
    assert url == f"{tmp_path}/ckpt-00000008.pt" and state["progress"]["step"] == 8


def test_a_relaunch_removes_saves_a_kill_interrupted_and_does_not_save_a_step_twice(tmp_path, capsys):
    from tokstream.train.checkpoint import Checkpointer
    from tokstream.train.distributed import Distributed

    (tmp_path / "ckpt-00000050.pt.tmp123").write_bytes(b"half a checkpoint")
    (tmp_path / "LATEST.tmp77").write_bytes(b"half a pointer")
    users = {"notes.tmp1": b"a user's notes", "ckpt-00000050.pt.tmp123.bak": b"a user's copy", "x.tmp9": b"mine"}
    for name, data in users.items():
        (tmp_path / name).write_bytes(data)
    single = Distributed(rank=0, world=1, local_rank=0, device=torch.device("cpu"), enabled=False)
    checkpointer = Checkpointer(LocalRunStore(tmp_path), 2, single, _components(seed=1), {})
    assert capsys.readouterr().out == ("removed LATEST.tmp77, a save that was interrupted\n"
                                       "removed ckpt-00000050.pt.tmp123, a save that was interrupted\n")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == users  # only a save's own staging names go
    checkpointer.save(7)
    written = (tmp_path / "ckpt-00000007.pt").stat().st_ino  # a save writes a new file
    checkpointer.save(7)  # a preemption notice right after the periodic save of the same step
    assert (tmp_path / "ckpt-00000007.pt").stat().st_ino == written


def test_retention_removes_only_this_runs_older_checkpoints(tmp_path):
    """keep_checkpoints removes complete checkpoints of the run that is saving, never another run's
    (copied in by hand), and never a checkpoint file without a manifest."""
    save_checkpoint(tmp_path, 2, trainer_state(2), keep=2, run_id="another-run")
    torch.save(trainer_state(3), tmp_path / "ckpt-00000003.pt")  # no manifest: not provably anything
    for step in (4, 6, 8, 10):
        save_checkpoint(tmp_path, step, trainer_state(step), keep=2)
    assert complete(tmp_path) == [2, 8, 10]
    assert (tmp_path / "ckpt-00000003.pt").exists()


def test_metrics_with_a_torn_last_line_are_truncated_without_error(tmp_path):
    from tokstream.train.metrics import MetricsLog

    log = MetricsLog(tmp_path, enabled=True)
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0 / step})
    with open(log.path, "a") as out:
        out.write('{"step": 4, "lo')  # killed mid-write
    log.truncate_after(2)
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [1, 2]


def test_rng_after_a_world_size_change_is_new_and_repeatable():
    from tokstream.train.distributed import Distributed
    from tokstream.train.rng import RankRNG

    def rank(number: int, world: int) -> RankRNG:
        return RankRNG(Distributed(rank=number, world=world, local_rank=number, device=torch.device("cpu"),
                                   enabled=False))

    two_ranks = rank(0, 2)
    two_ranks.seed(1337)
    first_draw = torch.rand(4)
    torch.rand(100)  # training moves the stream on
    saved = [two_ranks.state_dict()[0]] * 2  # what a 2-rank checkpoint holds (one process here)

    draws = []
    for _ in range(2):  # two relaunches on one rank from the same checkpoint
        rank(0, 1).load_state_dict(saved)
        draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[1])  # repeatable
    assert not torch.equal(draws[0], first_draw)  # not step 0's stream again
    rank(1, 3).load_state_dict(saved)
    assert not torch.equal(torch.rand(4), draws[0])  # ranks differ


class _RunsCode:
    """What a planted checkpoint could carry: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    from tokstream.train.checkpoint_files import file_digest

    save_checkpoint(tmp_path, 4, trainer_state(4), keep=3)
    marker = tmp_path / "code-ran"
    planted = tmp_path / "ckpt-00000008.pt"
    torch.save({"model": _RunsCode(marker)}, planted)  # planted, with a manifest that vouches for it
    (tmp_path / "ckpt-00000008.manifest.json").write_text(json.dumps(
        {"step": 8, "bytes": planted.stat().st_size, "xxh3_128": file_digest(planted), "run_id": RUN_ID}))
    with pytest.raises(UserError, match=r"ckpt-00000008\.pt holds objects other than tensors and plain values"):
        load_latest(tmp_path)
    assert not marker.exists()


def test_a_trainer_checkpoint_is_plain_data_and_restores_every_rng(tmp_path):
    import random

    import numpy as np

    from tokstream.train.checkpoint import Checkpointer, find_latest
    from tokstream.train.distributed import Distributed
    from tokstream.train.rng import RankRNG

    single = Distributed(rank=0, world=1, local_rank=0, device=torch.device("cpu"), enabled=False)
    rng = RankRNG(single)
    rng.seed(5)
    np.random.rand(3)
    components = {**_components(seed=1), "rng": rng}
    store = LocalRunStore(tmp_path)
    Checkpointer(store, 2, single, components, {"config": {"optim": {"lr": 0.1}}, "dataset_identity": "x"}).save(3)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    _, saved = find_latest(store)  # loads with weights_only=True
    RankRNG(single).load_state_dict(saved["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_a_damaged_checkpoint_left_in_place_does_not_push_good_ones_out(tmp_path, capsys):
    """Checkpoints 12 and 16; 16's bytes flipped. The relaunch resumes from 12 and saves 15 and 18 with
    keep_checkpoints=2: the two newest good ones (15, 18) stay, and so does 16, which is neither deleted
    (it is not provably spent) nor counted (12 goes only once two good ones are newer)."""
    from tokstream.train.checkpoint import Checkpointer
    from tokstream.train.distributed import Distributed

    single = Distributed(rank=0, world=1, local_rank=0, device=torch.device("cpu"), enabled=False)
    store = LocalRunStore(tmp_path)
    first = _components(seed=1)
    writer = Checkpointer(store, 2, single, first, {})
    for step in (12, 16):
        first["progress"].step = step
        writer.save(step)
    damaged = tmp_path / "ckpt-00000016.pt"
    damaged.write_bytes(flip_bytes(damaged.read_bytes()))
    _, saved = find_latest(store)
    relaunch = _components(seed=2)
    resumed = Checkpointer(store, 2, single, relaunch, {})
    resumed.restore(saved)
    for step in (15, 18):
        relaunch["progress"].step = step
        resumed.save(step)
    assert complete(tmp_path) == [15, 16, 18]
    capsys.readouterr()
    assert find_latest(store)[1]["progress"]["step"] == 18


def flip_bytes(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xA5 for b in data[middle:middle + 64]) + data[middle + 64:]


def test_a_checkpoint_without_its_manifest_is_not_resumed_from_and_is_kept(tmp_path, capsys):
    """A save cut off after the checkpoint file but before its manifest: the one before is resumed
    from, with a line naming the newer file, which stays until the run saves that step again."""
    save_checkpoint(tmp_path, 4, trainer_state(4), keep=3)
    torch.save(trainer_state(8), tmp_path / "ckpt-00000008.pt")  # whole, but no manifest
    assert load_latest(tmp_path)[1]["progress"]["step"] == 4
    assert capsys.readouterr().out == ("not resumed from (no manifest: a save cut off before it finished; kept, and "
                                       "replaced when the run saves that step again): ckpt-00000008.pt\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "LATEST", "ckpt-00000004.manifest.json", "ckpt-00000004.pt", "ckpt-00000008.pt"]
    save_checkpoint(tmp_path, 8, trainer_state(8), keep=3)
    assert complete(tmp_path) == [4, 8]


def test_a_background_save_holds_the_state_of_its_step_and_a_later_save_waits_for_it(tmp_path, monkeypatch):
    """Training goes on (and changes the weights) while the periodic save is written: the checkpoint
    has the step's weights. A preemption save of the same step right after is not written twice."""
    import threading

    from tokstream.train import checkpoint  # noqa: F811
    from tokstream.train.checkpoint import Checkpointer, find_latest
    from tokstream.train.distributed import Distributed

    # Each step's write starts only once training has changed the weights after that step. One event per
    # step: with a single event cleared for step 2, step 1's writer, not yet at its wait, would wait for
    # step 2's training, which waits for step 1's writer (save() joins it): a hang.
    trained_on = {1: threading.Event(), 2: threading.Event()}
    write = checkpoint.write_checkpoint
    monkeypatch.setattr(checkpoint, "write_checkpoint", lambda store, step, *args: (
        trained_on[step].wait(timeout=60), write(store, step, *args)))

    single = Distributed(rank=0, world=1, local_rank=0, device=torch.device("cpu"), enabled=False)
    components = _components(seed=1)
    model, progress = components["model"], components["progress"]
    store = LocalRunStore(tmp_path)
    checkpointer = Checkpointer(store, 3, single, components, {})
    weights = {}
    for step in (1, 2):
        progress.step = step
        with torch.no_grad():
            model.weight.fill_(step)
        weights[step] = model.weight.clone()
        checkpointer.save(step, background=True)
        with torch.no_grad():
            model.weight.fill_(-1.0)  # the next steps' training, while the save is written
        trained_on[step].set()
    checkpointer.save(2)  # the preemption notice at the same step boundary
    assert Survey.of(store).complete == [1, 2]
    for step in (1, 2):
        state = torch.load(tmp_path / f"ckpt-{step:08d}.pt", weights_only=True)
        assert torch.equal(state["model"]["weight"], weights[step]) and state["progress"]["step"] == step
    assert find_latest(store)[1]["progress"]["step"] == 2
