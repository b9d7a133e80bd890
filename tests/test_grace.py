"""The preemption grace a save can count on (grace.py): preempt_grace_s, at most torchrun's 30 s under torchrun."""

import inspect

from tokstream.train.grace import TORCHRUN_SHUTDOWN_S, budget_line, notice_line

UNDER_TORCHRUN = {"TORCHELASTIC_RUN_ID": "none"}


def test_torchruns_agent_kills_its_ranks_30_s_after_it_is_signalled():
    """The fact the cap rests on, in each tested torch: the agent's shutdown waits this long, then SIGKILLs."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert inspect.signature(LocalElasticAgent._shutdown).parameters["timeout"].default == TORCHRUN_SHUTDOWN_S


def test_a_grace_longer_than_torchruns_30_s_is_counted_as_30_under_torchrun_only():
    fits, line = budget_line(10.0, 15.0, True, 120.0, environ=UNDER_TORCHRUN)
    assert not fits and line == (
        "warning: a preemption notice would end in a kill: a step 10.0 s + a save in flight 15.0 s + the final save "
        "15.0 s = 40.0 s of preempt_grace_s=120 (under torchrun at most 30 s: when the notice reaches its agent, it "
        "kills the ranks that long after); give the job a longer grace period and set preempt_grace_s to it, or make "
        "the state smaller or the store faster")
    assert budget_line(10.0, 15.0, True, 120.0, environ={}) == (
        True, "preemption: a step 10.0 s + a save in flight 15.0 s + the final save 15.0 s = 40.0 s of "
              "preempt_grace_s=120")
    assert budget_line(1.0, 2.0, False, 20.0, environ=UNDER_TORCHRUN) == (
        True, "preemption: a step 1.0 s + the final save 2.0 s = 3.0 s of preempt_grace_s=20")
    assert notice_line(7, 20.0, 35.0, 120.0, environ=UNDER_TORCHRUN).endswith(
        "35.0 s after the notice: PAST preempt_grace_s=120 (under torchrun at most 30 s: when the notice reaches its "
        "agent, it kills the ranks that long after)")
    assert notice_line(7, 20.0, 35.0, 120.0, environ={}).endswith("35.0 s after the notice: within preempt_grace_s=120")
