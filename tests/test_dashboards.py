"""Dashboards.write across a relaunch, in-process against TensorBoard's own files (the end-to-end runs with W&B are in
test_loss_spikes.py): every step shown once, the branch's value where a relaunch trained a step again."""

from tokstream.train.config import load_config
from tokstream.train.dashboards import DashboardState, Dashboards, Takeover


def test_tensorboard_across_a_killed_launchs_relaunch_shows_each_step_once_with_the_branchs_values(tmp_path):
    """A launch logs steps 1-10 and is killed; its checkpoint at 6 holds the dashboards' state. The relaunch from 6
    logs 7-12 anew (other values, a skip, the guard's z-score): TensorBoard shows 1-6 of the first launch, 7-12 of
    the relaunch, one mark at the relaunch's first step, nothing twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = load_config(None, ["data.remote=d", f"log.tensorboard={tmp_path / 'tb'}"])
    state = DashboardState()
    first = Dashboards.open(config, state, Takeover(0, False, None), str(tmp_path), master=True)
    for step in range(1, 11):
        first.write({"step": step, "loss": 10.0 - step, "samples": [[step]]})
        if step == 6:
            checkpointed = state.state_dict()
    first.close()
    resumed = DashboardState()
    resumed.load_state_dict(checkpointed)
    second = Dashboards.open(config, resumed, Takeover(6, True, "relaunched from step 6 (kill)"), str(tmp_path),
                             master=True)
    for step in range(7, 13):
        record = {"step": step, "loss": 100.0 + step}
        if step == 9:
            record.update({"skipped": {"steps": [9, 11], "samples_left_out": 24}, "guard": {"loss_z": 7.5}})
        second.write(record)
    second.close()
    assert resumed.tensorboard_step == 12

    board = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0},
                             purge_orphaned_data=True)
    board.Reload()
    assert [(event.step, event.value) for event in board.Scalars("loss")] == \
        [(step, 10.0 - step) for step in range(1, 7)] + [(step, 100.0 + step) for step in range(7, 13)]
    assert [(event.step, event.value) for event in board.Scalars("skipped_steps")] == [(9, 3.0)]
    assert [(event.step, event.value) for event in board.Scalars("guard/loss_z")] == [(9, 7.5)]
    assert [(event.step, event.tensor_proto.string_val[0].decode()) for event in board.Tensors("run/text_summary")] \
        == [(7, "relaunched from step 6 (kill)")]
    assert "samples" not in board.Tags()["scalars"]
