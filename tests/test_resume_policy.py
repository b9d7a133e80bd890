"""What a relaunch may change: resume_policy.check_relaunch against the config a checkpoint recorded."""

import pytest
from conftest import ROOT

from tokstream.errors import UserError
from tokstream.train.config import TrainConfig, load_config
from tokstream.train.resume_policy import check_relaunch, keep_guard_rewinds, keep_run_order


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


def check_as_the_trainer_does(saved: dict, config: TrainConfig, step: int) -> list[str]:
    """trainer.check_resume's order: the run's own order and the guard's rewinds kept, then the policy."""
    return check_relaunch(saved, keep_guard_rewinds(keep_run_order(config, saved), saved), step)


def skip_refusal(saved: dict, skips: str, step: int = 10) -> str:
    """The one line refusing a relaunch from `saved`, at `step`, with skip_steps `skips`."""
    with pytest.raises(UserError) as refused:
        check_as_the_trainer_does(saved, relaunch(f"skip_steps={skips}"), step)
    return str(refused.value)


def trained_with(skips: list, step: int = 10) -> str:
    """The end of the refusal line: the skips the checkpoint's run trained with, and what a relaunch may do."""
    return (f"which the checkpoint's run has trained with skip_steps {skips}: a skip must begin after step {step}, "
            "and the skips already done stay as they were")


@pytest.mark.parametrize("before", [[], [[3, 4]]], ids=["no-skips-yet", "a-skip-done"])
def test_a_new_skip_that_has_begun_by_the_checkpoints_step_is_refused_and_one_after_it_accepted(before):
    """A checkpoint at step 10 trained steps 1-10: a skip [first, last] jumps at the start of step `first`, so one
    with first <= 10 would change steps already trained (first = 10: step 10 itself, which read its own data); the
    relaunch is refused in one line naming the new skip. From first = 11 on it only changes steps still to come."""
    saved = saved_config(f"skip_steps={before}")
    for new in ([5, 6], [9, 12], [10, 12]):  # before the step, across it, and at it: the edge, refused
        message = skip_refusal(saved, str([*before, new]))
        assert message == f"skip_steps {new} begins at or before step 10, {trained_with(before)}"
    for new in ([11, 12], [20, 40]):  # just after the edge, and later: allowed, said in one line
        now = [*before, new]
        assert check_as_the_trainer_does(saved, relaunch(f"skip_steps={now}"), 10) == [
            f"skip_steps changed from {before!r} to {now!r}, after the checkpoint's step 10"]
    # The skips the run had, kept as they were: nothing to say.
    assert check_as_the_trainer_does(saved, relaunch(f"skip_steps={before}"), 10) == []


def test_a_skip_done_by_the_checkpoints_step_stays_as_it_was():
    """The run at step 10 left out steps 3-4's data: a relaunch that widens, narrows, moves or drops that skip, even
    to the same number of skips, would change what steps 3-10 read; refused in one line naming the skip done."""
    saved = saved_config("skip_steps=[[3,4]]")
    for skips in ("[[3,5]]", "[[3,3]]", "[[2,4]]", "[[3,12]]", "[]", "[[11,12]]"):
        assert skip_refusal(saved, skips) == f"skip_steps [3, 4] begins at or before step 10, {trained_with([[3, 4]])}"


def saved_before_skip_steps() -> dict:
    """A checkpoint's config as a release from before skip_steps wrote it: no such key (its run skipped nothing)."""
    saved = saved_config()
    del saved["skip_steps"]
    return saved


def test_a_checkpoint_from_before_skip_steps_takes_skips_only_after_its_step():
    """A run from before skip_steps trained every step's own data: its relaunch may add skips that begin after the
    checkpoint's step, said in one line, and is refused one that has begun by it, as if the run had skip_steps []."""
    saved = saved_before_skip_steps()
    for new in ([5, 6], [10, 12]):
        assert skip_refusal(saved, str([new])) == f"skip_steps {new} begins at or before step 10, {trained_with([])}"
    assert check_as_the_trainer_does(saved, relaunch("skip_steps=[[11,12]]"), 10) == [
        "skip_steps changed from [] to [[11, 12]], after the checkpoint's step 10"]
    # Relaunched without skips, as the old run was: nothing changed, nothing said.
    assert check_as_the_trainer_does(saved, relaunch(), 10) == []
