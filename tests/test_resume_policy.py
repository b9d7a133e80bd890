"""What a relaunch may change: resume_policy.check_relaunch against the config a checkpoint recorded."""

import pytest
from conftest import ROOT

from tokstream.errors import UserError
from tokstream.train.config import load_config
from tokstream.train.resume_policy import check_relaunch


def saved_config(*overrides: str) -> dict:
    return load_config(str(ROOT / "configs/tiny.yaml"), ["data.remote=/data", *overrides]).to_dict()


def relaunch(*overrides: str):
    return load_config(str(ROOT / "configs/tiny.yaml"), ["data.remote=/data", *overrides])


def refusal(saved: dict, *overrides: str) -> str:
    with pytest.raises(UserError) as refused:
        check_relaunch(saved, relaunch(*overrides), step=10)
    return str(refused.value)


def test_execution_settings_change_freely_and_are_reported():
    notes = check_relaunch(saved_config(), relaunch("micro_batch_size=2", "data.num_workers=2", "compile=true",
                                                    "run_dir=/elsewhere", "data.local=/cache", "eval_interval=5"), step=10)
    assert "micro_batch_size changed from 4 to 2" in notes and "data.num_workers changed from 0 to 2" in notes
    assert len(notes) == 6
    assert check_relaunch(saved_config(), relaunch(), step=10) == []


@pytest.mark.parametrize("setting", [
    "run_local=/scratch", "log_interval=3", "eval_batches=5", "checkpoint_interval=7", "keep_checkpoints=9",
    "background_checkpoints=false", "preempt_grace_s=120", "lease_interval_s=5", "trace_samples=true",
    "device=auto", "deterministic=true", "data.remote=/moved", "data.val_split=validation", "data.prefetch_factor=4",
    "data.predownload=64", "data.cache_limit=10gb", "data.validate_hash=null", "data.download_retry=9",
    "data.clean_stale_shared_memory=false", "data.max_documents=4096"])
def test_every_free_setting_changes_and_is_said(setting):
    """Each of resume_policy.FREE (those not in the test above), changed alone: accepted, in one line."""
    key, _, value = setting.partition("=")
    notes = check_relaunch(saved_config(), relaunch(setting), step=10)
    assert len(notes) == 1 and notes[0].startswith(f"{key} changed from "), notes


def test_the_recipe_is_refused_with_the_setting_named_unless_allowed():
    for setting in ("optim.lr=0.001", "seed=7", "dtype=float16", "optim.warmup_steps=9"):
        key = setting.split("=")[0]
        assert f"{key} changed from" in refusal(saved_config(), setting)
        assert f"resume_allow=[{key}]" in refusal(saved_config(), setting)
        notes = check_relaunch(saved_config(), relaunch(setting, f"resume_allow=[{key}]"), step=10)
        assert notes == [notes[0]] and notes[0].endswith("(resume_allow: on purpose)")


def test_max_steps_may_grow_only_while_the_schedule_stays_put():
    message = refusal(saved_config(), "max_steps=80")  # decay_steps unset: the cosine would stretch
    assert "max_steps changed from 40 to 80 while optim.decay_steps is unset" in message
    assert "set optim.decay_steps=40 to keep it" in message
    assert check_relaunch(saved_config(), relaunch("max_steps=80", "optim.decay_steps=40"), step=10) == [
        "max_steps changed from 40 to 80", "optim.decay_steps changed from None to 40"]
    assert check_relaunch(saved_config("optim.decay_steps=40"), relaunch("max_steps=80", "optim.decay_steps=40"), step=10)
    assert "optim.decay_steps changed from 40 to 80" in refusal(saved_config("optim.decay_steps=40"),
                                                                "max_steps=80", "optim.decay_steps=80")


def test_what_the_checkpoint_and_sample_order_are_made_of_is_fixed_even_when_allowed():
    for setting, reason in (("model.n_layer=3", "architecture"), ("global_batch_size=16", "each step's samples"),
                            ("data.shuffle_seed=1", "sample order"), ("data.num_canonical_nodes=2", "sample order"),
                            ("data.split=other", "sample order")):
        key = setting.split("=")[0]
        message = refusal(saved_config(), setting, f"resume_allow=[{key}]")
        assert f"{key} changed from" in message and reason in message and "new run_dir" in message
