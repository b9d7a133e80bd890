"""Checkpoint files: atomic writes, newest complete one wins, damaged ones are skipped, last K kept."""


import torch
from conftest import ROOT

from tokstream.errors import UserError
from tokstream.train.checkpoint import list_checkpoints, load_latest_checkpoint, save_checkpoint
from tokstream.train.config import load_config


def test_keeps_last_k_and_ignores_interrupted_writes(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, {"step": step, "weights": torch.full((3,), float(step))}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000030.pt", "ckpt-00000040.pt"]
    (tmp_path / "ckpt-00000050.pt.tmp123").write_bytes(b"half a checkpoint")  # a save killed mid-write
    path, state = load_latest_checkpoint(tmp_path)
    assert path.name == "ckpt-00000040.pt" and state["step"] == 40


def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    save_checkpoint(tmp_path, 1, {"step": 1}, keep=3)
    save_checkpoint(tmp_path, 2, {"step": 2}, keep=3)
    newest = tmp_path / "ckpt-00000002.pt"
    newest.write_bytes(newest.read_bytes()[:20])  # e.g. a disk that lost the tail
    path, state = load_latest_checkpoint(tmp_path)
    assert state["step"] == 1
    assert "skipping unreadable checkpoint" in capsys.readouterr().out


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert load_latest_checkpoint(tmp_path / "missing") == (None, None)


def test_config_overrides_are_typed_and_checked():
    config = load_config(str(ROOT / "configs/tiny.yaml"), ["data.remote=/x", "max_steps=7", "optim.lr=1e-3",
                                                           "trace_samples=true", "data.local=/cache"])
    assert (config.max_steps, config.optim.lr, config.trace_samples, config.data.local) == (7, 1e-3, True, "/cache")
    for bad, message in (["data.remot=/x"], "unknown config key 'remot'"), (["max_steps=lots"], "must be int"):
        try:
            load_config(str(ROOT / "configs/tiny.yaml"), bad)
        except UserError as err:
            assert message in str(err)
        else:
            raise AssertionError(f"{bad} was accepted")
