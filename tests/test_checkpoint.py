"""Checkpoint files: atomic writes, newest complete one wins, damaged ones are skipped, last K kept."""


import json
import os

import pytest
import torch
from conftest import ROOT

from tokstream.errors import UserError
from tokstream.train.checkpoint import checkpoints, load_latest_checkpoint, write_checkpoint
from tokstream.train.config import load_config
from tokstream.train.run_store import LocalRunStore


def save_checkpoint(run_dir, step: int, state: dict, keep: int) -> None:
    write_checkpoint(LocalRunStore(run_dir), step, state, keep)


def load_latest(run_dir):
    return load_latest_checkpoint(LocalRunStore(run_dir))


def test_keeps_last_k_and_ignores_interrupted_writes(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, {"step": step, "weights": torch.full((3,), float(step))}, keep=2)
    assert checkpoints(LocalRunStore(tmp_path)) == (["ckpt-00000030.pt", "ckpt-00000040.pt"], [])
    (tmp_path / "ckpt-00000050.pt.tmp123").write_bytes(b"half a checkpoint")  # a save killed mid-write
    url, state = load_latest(tmp_path)
    assert url == f"{tmp_path}/ckpt-00000040.pt" and state["step"] == 40


def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    save_checkpoint(tmp_path, 1, {"step": 1}, keep=3)
    save_checkpoint(tmp_path, 2, {"step": 2}, keep=3)
    newest = tmp_path / "ckpt-00000002.pt"
    newest.write_bytes(newest.read_bytes()[:20])  # e.g. a disk that lost the tail
    _, state = load_latest(tmp_path)
    assert state["step"] == 1
    assert "skipping unreadable checkpoint" in capsys.readouterr().out


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert load_latest(tmp_path / "missing") == (None, None)


def test_config_overrides_are_typed_and_checked():
    config = load_config(str(ROOT / "configs/tiny.yaml"), ["data.remote=/x", "max_steps=7", "optim.lr=1e-3",
                                                           "trace_samples=true", "data.local=/cache"])
    assert (config.max_steps, config.optim.lr, config.trace_samples, config.data.local) == (7, 1e-3, True, "/cache")
    for bad, message in (["data.remot=/x"], "unknown config key 'data.remot'"), (["max_steps=lots"], "must be int"):
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


def test_checkpoints_that_all_fail_to_load_are_refused_not_restarted_from_zero(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"step": step}, keep=3)
        path = tmp_path / f"ckpt-{step:08d}.pt"
        path.write_bytes(path.read_bytes()[:20])
    try:
        load_latest(tmp_path)
    except UserError as err:
        assert f"none of the 2 checkpoints in {tmp_path} can be read (newest: ckpt-00000002.pt)" in str(err)
    else:
        raise AssertionError("a run whose checkpoints are all damaged would restart from step 0")


def test_a_relaunch_removes_saves_a_kill_interrupted_and_does_not_save_a_step_twice(tmp_path, capsys):
    from tokstream.train.checkpoint import Checkpointer
    from tokstream.train.distributed import Distributed

    (tmp_path / "ckpt-00000050.pt.tmp123").write_bytes(b"half a checkpoint")
    single = Distributed(rank=0, world=1, local_rank=0, device=torch.device("cpu"), enabled=False)
    checkpointer = Checkpointer(LocalRunStore(tmp_path), 2, single, _components(seed=1), {})
    assert not list(tmp_path.glob("*.tmp*"))
    assert "removed ckpt-00000050.pt.tmp123, a save that was interrupted" in capsys.readouterr().out
    checkpointer.save(7)
    written = (tmp_path / "ckpt-00000007.pt").stat().st_ino  # a save writes a new file
    checkpointer.save(7)  # a preemption notice right after the periodic save of the same step
    assert (tmp_path / "ckpt-00000007.pt").stat().st_ino == written


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
    save_checkpoint(tmp_path, 4, {"step": torch.tensor(4)}, keep=3)
    marker = tmp_path / "code-ran"
    torch.save({"model": _RunsCode(marker)}, tmp_path / "ckpt-00000008.pt")  # planted, and named the newest:
    (tmp_path / "LATEST").write_text('{"checkpoint": "ckpt-00000008.pt", "step": 8}')
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


def test_a_checkpoint_latest_never_named_is_not_resumed_from_and_is_removed(tmp_path, capsys):
    """A save cut off after the checkpoint file but before LATEST: the one before stays in charge."""
    from tokstream.train.checkpoint import Checkpointer
    from tokstream.train.distributed import Distributed

    save_checkpoint(tmp_path, 4, {"step": 4}, keep=3)
    torch.save({"step": 8}, tmp_path / "ckpt-00000008.pt")  # whole, but never published
    assert load_latest(tmp_path)[1]["step"] == 4
    single = Distributed(rank=0, world=1, local_rank=0, device=torch.device("cpu"), enabled=False)
    Checkpointer(LocalRunStore(tmp_path), 2, single, _components(seed=1), {})
    assert "removed ckpt-00000008.pt, a save that was interrupted" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "ckpt-00000004.pt"]


def test_a_background_save_holds_the_state_of_its_step_and_a_later_save_waits_for_it(tmp_path, monkeypatch):
    """Training goes on (and changes the weights) while the periodic save is written: the checkpoint
    has the step's weights. A preemption save of the same step right after is not written twice."""
    import threading

    from tokstream.train import checkpoint
    from tokstream.train.checkpoint import Checkpointer, find_latest
    from tokstream.train.distributed import Distributed

    trained_on = threading.Event()  # the write starts only once training has changed the weights
    write = checkpoint.write_checkpoint
    monkeypatch.setattr(checkpoint, "write_checkpoint", lambda *args: (trained_on.wait(), write(*args)))

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
        trained_on.clear()
        checkpointer.save(step, background=True)
        with torch.no_grad():
            model.weight.fill_(-1.0)  # the next steps' training, while the save is written
        trained_on.set()
    checkpointer.save(2)  # the preemption notice at the same step boundary
    assert checkpoints(store) == (["ckpt-00000001.pt", "ckpt-00000002.pt"], [])
    for step in (1, 2):
        state = torch.load(tmp_path / f"ckpt-{step:08d}.pt", weights_only=True)
        assert torch.equal(state["model"]["weight"], weights[step]) and state["progress"]["step"] == step
    assert find_latest(store)[1]["progress"]["step"] == 2
