"""Phases (tokstream/train/phases.py): a recipe that changes during a run, each step's samples a function of
the config and the step alone, resumed exactly across the boundaries; the relaunch policy for phases; tokens.

In process, the trainer's loop over PhasedBatches (WORLD_SIZE 1) shows what a boundary does to each stream's
order, as the README's "Phases" says it. In processes of their own (SIGTERM and SIGKILL to the ranks), an
interruption schedule across every kind of boundary is compared with an uninterrupted run (and with what the
ledger says each step read), and configs/tiny-phases.yaml runs on the real corpora through torchrun.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, SHARED
from test_ledger import json_lines, ledger
from test_training import launch, metrics, tiny_splits, train, wait_for

from tokstream.errors import UserError
from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset
from warm_ranks import WarmLaunch
from tokstream.train.checkpoint_files import latest_step
from tokstream.train.config import load_config
from tokstream.train.phased_batches import PhasedBatches
from tokstream.train.phases import Recipe, resolve_phases, stream_key
from tokstream.train.resume_policy import check_relaunch
from tokstream.train.run_store import LocalRunStore
from tokstream.train.schedule import learning_rate


def refusal(call) -> str:
    with pytest.raises(UserError) as caught:
        call()
    return str(caught.value)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """a: 40 samples at block 64 (an epoch of 10 warm-up steps); b and c: block 128."""
    root = tmp_path_factory.mktemp("phase-data")
    made = {}
    for name, samples, block, seed in (("a", 40, 64, 1), ("b", 24, 128, 2), ("c", 30, 128, 3)):
        (root / name).mkdir()
        made[name] = str(tiny_splits(root / name, samples, 8, seed=seed, block_size=block))
    return made


def phased(data: dict[str, str], *overrides: str):
    """A run of five phases: a (batch 4), a (batch 8), b, a again, then a mixture of b and c."""
    mixture = f"[{{remote: '{data['b']}', name: b, proportion: 0.5}}, {{remote: '{data['c']}', name: c, proportion: 0.5}}]"
    return load_config(None, [
        "micro_batch_size=2", "model.block_size=128", "max_steps=20",
        f"phases=[{{start_step: 0, global_batch_size: 4, data: {{remote: '{data['a']}'}}}}, "
        f"{{start_step: 6, global_batch_size: 8}}, {{start_step: 10, data: {{remote: '{data['b']}'}}}}, "
        f"{{start_step: 12, data: {{remote: '{data['a']}'}}}}, {{start_step: 14, data: {{streams: {mixture}}}}}]",
        *overrides])


def read_steps(recipe: Recipe, batches: PhasedBatches, first: int, last: int) -> list[list[int]]:
    """Steps first .. last - 1 as the trainer reads them: each its phase's accumulation of micro-batches."""
    steps = []
    for step in range(first, last):
        phase = recipe.at(step)
        batches.enter(phase)
        ids = []
        for _ in range(recipe.plan(phase).accumulation):
            ids += next(batches)["ids"].tolist()
        steps.append(ids)
    return steps


def stream(remote_or_streams: DataConfig, unit: int, samples: int) -> list[int]:
    """The first `samples` of a data's stream, read alone in its unit."""
    batches = TrainBatches(open_dataset(remote_or_streams), BatchPlan(unit, 2, 1))
    ids = []
    while len(ids) < samples:
        ids += next(batches)["ids"].tolist()
    batches.close()
    return ids


def test_phases_are_resolved_in_order_each_setting_from_the_phase_before(data):
    phases = resolve_phases(phased(data))
    assert [(p.start_step, p.global_batch_size) for p in phases] == [(0, 4), (6, 8), (10, 8), (12, 8), (14, 8)]
    assert [p.data.remote for p in phases] == [data["a"], data["a"], data["b"], data["a"], ""]
    assert [s.name for s in phases[4].data.streams] == ["b", "c"]
    single = resolve_phases(load_config(None, [f"data.remote={data['a']}", "global_batch_size=16"]))
    assert [(p.start_step, p.global_batch_size, p.data.remote) for p in single] == [(0, 16, data["a"])]
    assert refusal(lambda: resolve_phases(phased(data, "phases.0.start_step=1"))) == (
        "phases.0.start_step is 1: the first phase starts at step 0")
    assert refusal(lambda: resolve_phases(phased(data, "phases.2.start_step=6"))) == (
        "phases.2.start_step 6 is not after phases.1.start_step 6: list the phases in the order they start")


def test_a_recipe_that_cannot_be_read_exactly_is_refused_at_start_in_one_line(data):
    assert refusal(lambda: Recipe.open(phased(data, "phases.1.global_batch_size=6"), 1)) == (
        "phases.1.global_batch_size 6 is not a multiple of 4, the global batch its data is read in (phases.0's, "
        "the first phase to read it): use a multiple of 4, so that each step takes whole units of the data's order")
    wide = Recipe.open(phased(data, "micro_batch_size=4"), 2)
    assert refusal(lambda: wide.check_plans(0)) == (
        "phases.0 reads its data in units of 4 samples (the global batch of the first phase to read it), which "
        "micro_batch_size 4 x 2 ranks does not divide: lower micro_batch_size")
    assert refusal(lambda: wide.check_plans(13)).startswith("phases.3 reads its data in units of 4")  # a, again
    wide.check_plans(14)  # only the mixture is read from step 14: a's warm-up unit binds no more
    assert refusal(lambda: resolve_phases(phased(data, "phases.1.start_step=null"))) == (
        "phases.1.start_step must be a step (a whole number from 0), got None")
    assert refusal(lambda: resolve_phases(phased(data, "phases.1.global_batch_size=0"))) == (
        "phases.1.global_batch_size must be a positive whole number, got 0")
    assert refusal(lambda: Recipe.open(phased(data, "model.block_size=256"), 1)) == (
        "model.block_size is 256, but the largest block any phase reads is 128 (phases.2): set "
        "model.block_size=128, the model is built once for it")
    assert refusal(lambda: Recipe.open(phased(data, "phases.2.data.remote=/nowhere"), 1)).startswith(
        "phases.2: data.remote=/nowhere does not exist")  # a late phase's missing data is said at start


def test_tokens_count_each_phases_batch_and_block(data):
    recipe = Recipe.open(phased(data), 1)
    assert recipe.unreached(20) == [] and recipe.unreached(13) == [
        "phases.4 starts at step 14, at or after max_steps 13: it will not run (a relaunch with a larger max_steps "
        "reaches it)"]
    assert [recipe.block_size(p) for p in recipe.phases] == [64, 64, 128, 64, 128]
    assert recipe.tokens_before(0) == 0
    assert recipe.tokens_before(6) == 6 * 4 * 64
    assert recipe.tokens_before(11) == 6 * 4 * 64 + 4 * 8 * 64 + 1 * 8 * 128
    assert recipe.tokens_before(20) == 6 * 4 * 64 + 4 * 8 * 64 + 2 * 8 * 128 + 2 * 8 * 64 + 6 * 8 * 128


# The orders phases are tested in: `auto`'s for these small datasets (py1e) and the lazy order (auto's from 2^24
# samples), which the torchrun tests of the lazy order (test_lazy_order.py) resume through SIGTERM and SIGKILL.
ORDERS = ["auto", "lazy"]


@pytest.mark.parametrize("order", ORDERS)
def test_a_boundary_keeps_each_streams_position_and_a_mixture_reads_its_own(data, order):
    """The README's promise: data that continues keeps its position whatever the batch; data read again goes
    on where it stopped; a mixture is its own stream from its start. And every step has its phase's batch."""
    recipe = Recipe.open(phased(data, f"data.shuffle_algo={order}"), 1)
    assert {recipe.dataset(phase).config.shuffle_algo for phase in recipe.phases} == {
        "py1e" if order == "auto" else order}
    batches = PhasedBatches(recipe, pin_memory=False)
    steps = read_steps(recipe, batches, 0, 20)
    assert [len(ids) for ids in steps] == [4] * 6 + [8] * 14
    a = stream(DataConfig(remote=data["a"], shuffle_algo=order), 4, 72)
    assert sum(steps[:10] + steps[12:14], []) == a  # phases 0, 1 and 3: one order, across an epoch end
    assert sorted(a[:40]) == list(range(40))  # no sample again before the epoch ends, whatever the batch
    assert sum(steps[10:12], []) == stream(DataConfig(remote=data["b"], shuffle_algo=order), 8, 16)
    mixture = recipe.dataset(recipe.phases[4]).config
    assert sum(steps[14:], []) == stream(mixture, 8, 48)  # its b samples start over within it
    batches.close()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("skip", [(7, 8), (7, 9)])
def test_a_skip_moves_its_stream_across_an_epoch_end_as_reading_would(data, order, skip):
    """skip_steps in phases.1 (a at batch 8): its stream moves as the trainer moves it (PhasedBatches.move, to
    Recipe.read_units_before), to a's epoch end at sample 40 exactly or past it to 48; a reads on from there, in
    phases.1 and again in phases.3, the very stream read straight with the skipped samples left out."""
    first, last = skip
    recipe = Recipe.open(phased(data, f"data.shuffle_algo={order}", f"skip_steps=[[{first},{last}]]"), 1)
    batches = PhasedBatches(recipe, pin_memory=False)
    steps = read_steps(recipe, batches, 0, first - 1)
    assert recipe.skip_at(first - 1) == skip
    phase = recipe.at(first - 1)
    batches.move(phase, recipe.read_units_before(phase, first - 1))
    steps += read_steps(recipe, batches, first - 1, 14)
    batches.close()
    a = stream(DataConfig(remote=data["a"], shuffle_algo=order), 4, 100)
    gone = 8 * (last - first + 1)  # samples of a the skipped steps would have read, from sample 24 on
    assert sum(steps[:10] + steps[12:14], []) == a[:24] + a[24 + gone:72 + gone]
    assert sorted(a[40:80]) == list(range(40))  # past the epoch end: epoch 1's order, every sample once


@pytest.mark.parametrize("order", ORDERS)
def test_each_sources_samples_and_tokens_are_counted_across_phases_and_carried_by_the_state(data, order):
    recipe = Recipe.open(phased(data, f"data.shuffle_algo={order}"), 1)
    batches = PhasedBatches(recipe, pin_memory=False)
    read_steps(recipe, batches, 0, 13)
    for step in range(13):
        phase = recipe.at(step)
        batches.count(phase, [recipe.plan(phase).global_batch_size])  # a single source: every sample
    state = batches.state_dict()
    batches.close()
    # a and b are both called "ds" (their folders' name): counted apart, per dataset, their identity told
    a, b = (recipe.dataset(recipe.phases[index]).source_identities[0] for index in (0, 2))
    a_samples, b_samples = 6 * 4 + 4 * 8 + 1 * 8, 2 * 8
    assert batches.consumed_by_name() == {f"ds ({a[:8]})": {"samples": a_samples, "tokens": a_samples * 64},
                                          f"ds ({b[:8]})": {"samples": b_samples, "tokens": b_samples * 128}}
    resumed = PhasedBatches(recipe, pin_memory=False)
    resumed.load_state_dict(state)
    assert resumed.consumed_by_name() == batches.consumed_by_name()
    again = PhasedBatches(recipe, pin_memory=False)
    straight = read_steps(recipe, again, 0, 20)
    assert read_steps(recipe, resumed, 13, 20) == straight[13:]
    resumed.close()
    again.close()
    # A checkpoint made before 2026-11-28 filed streams and sources under their former identities: read on the same.
    streams = {stream_key(d): stream_key(d, former=True) for d in recipe.datasets}
    sources = {now: then for d in recipe.datasets for now, then in zip(d.source_identities, d.former_source_identities)}
    assert not set(streams) & set(streams.values()) and not set(sources) & set(sources.values())
    older = {"streams": {streams[key]: position for key, position in state["streams"].items()},
             "consumed": {sources[key]: totals for key, totals in state["consumed"].items()}}
    from_older = PhasedBatches(recipe, pin_memory=False)
    from_older.load_state_dict(older)
    assert from_older.consumed_by_name() == batches.consumed_by_name()
    assert read_steps(recipe, from_older, 13, 20) == straight[13:]
    from_older.close()


def test_the_schedule_in_tokens_is_not_stretched_by_a_batch_ramp(data):
    def rates(config) -> dict[tuple[int, int], float]:
        """The learning rate of each step, by the tokens trained before it and after it."""
        recipe, by_tokens = Recipe.open(config, 1), {}
        for step in range(20):
            before = recipe.tokens_before(step)
            step_tokens = recipe.plan(recipe.at(step)).global_batch_size * recipe.block_size(recipe.at(step))
            by_tokens[before, before + step_tokens] = learning_rate(step, config, before, step_tokens)
        return by_tokens

    ramp = rates(phased(data, "optim.warmup_tokens=2048", "optim.decay_tokens=40000"))
    flat = rates(phased(data, "phases.0.global_batch_size=8", "optim.warmup_tokens=2048", "optim.decay_tokens=40000"))
    # A function of tokens alone: in the warm-up of the tokens at the step's end (so the first is not 0), then
    # of those before it.
    warming = {after: rate for (before, after), rate in ramp.items() if before < 2048}, {
        after: rate for (before, after), rate in flat.items() if before < 2048}
    decaying = {before: rate for (before, after), rate in ramp.items() if before >= 2048}, {
        before: rate for (before, after), rate in flat.items() if before >= 2048}
    for ramped, unramped in (warming, decaying):
        shared = ramped.keys() & unramped.keys()
        assert len(shared) >= 2 and all(ramped[t] == unramped[t] for t in shared)
    assert ramp[0, 256] == 6e-4 * 256 / 2048  # the first step's 256 tokens of the 2,048 of warm-up
    assert len(warming[0]) == 7 and len(warming[1]) == 4  # the ramp's smaller steps: more of them warm up
    assert refusal(lambda: learning_rate(0, phased(data, "optim.warmup_tokens=2048"))) == (
        "optim.warmup_tokens is set but not optim.decay_tokens: a schedule in tokens needs both (the run's start-up "
        "line gives its total tokens)")
    assert refusal(lambda: learning_rate(0, phased(data, "optim.warmup_tokens=2048", "optim.decay_tokens=1024"))) == (
        "optim.warmup_tokens 2048 and optim.decay_tokens 1024: the warm-up must end (from 0) before the decay does")


def test_phases_not_started_may_change_a_started_one_may_not(data):
    saved = phased(data).to_dict()
    assert check_relaunch(saved, phased(data), step=12) == []
    assert check_relaunch(saved, phased(data, "phases.4.start_step=16", "phases.3.global_batch_size=16"), step=12) == [
        "phases that start after step 12 changed (not started yet, so allowed): phases.3.global_batch_size 8 -> 16, "
        "phases.4.global_batch_size 8 -> 16, phases.4.start_step 14 -> 16"]
    # a phase beginning at the checkpoint's step has not started: the state saved there is the phase before's
    assert check_relaunch(saved, phased(data, "phases.3.data.remote=" + data["b"]), step=12) == [
        f"phases that start after step 12 changed (not started yet, so allowed): phases.3.data.remote "
        f"'{data['a']}' -> '{data['b']}'"]
    assert refusal(lambda: check_relaunch(saved, phased(data, "phases.2.global_batch_size=16"), step=12)) == (
        "phases.2 has started (at step 10; the checkpoint is at step 12) but changed: phases.2.global_batch_size "
        "8 -> 16; a phase that has started or ended keeps its recipe; edit only phases that start after step 12, "
        "or use a new run_dir")
    assert refusal(lambda: check_relaunch(saved, phased(data, "phases.1.start_step=7"), step=12)).startswith(
        "phases.1 has started (at step 6; the checkpoint is at step 12) but changed: phases.1.start_step 6 -> 7;")
    assert refusal(lambda: check_relaunch(saved, phased(data, "phases.3.start_step=11"), step=12)).startswith(
        "phases.3 would start at step 11, before the checkpoint's step 12: those steps were trained in phases.2;")
    # where a started phase's data lives may change (its identity is checked against the checkpoint's)
    moved = phased(data, "phases.0.data.remote=/elsewhere/a", "phases.0.data.local=/cache/a")
    assert check_relaunch(saved, moved, step=12) == []
    # a run without phases may be extended by phases that start later
    plain = load_config(None, [f"data.remote={data['a']}", "global_batch_size=4", "micro_batch_size=2"]).to_dict()
    extended = load_config(None, [f"data.remote={data['a']}", "global_batch_size=4", "micro_batch_size=2",
                                  "phases=[{start_step: 0}, {start_step: 30, global_batch_size: 8}]"])
    assert check_relaunch(plain, extended, step=20) == [
        "phases that start after step 20 changed (not started yet, so allowed): phases.1 added (from step 30)"]


class Output(threading.Thread):
    """A launch's output, read as it comes, so a test can wait for a line."""

    def __init__(self, process: subprocess.Popen):
        super().__init__(daemon=True)
        self.process, self.text = process, ""
        self.start()

    def run(self) -> None:
        for line in self.process.stdout:
            self.text += line

    def wait_for(self, condition) -> None:
        def met() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"the launch ended (status {self.process.returncode}) first:\n{self.text[-4000:]}")
            return condition(self.text)
        wait_for(met)

    def finish(self) -> str:
        self.process.wait(timeout=180)
        self.join(timeout=10)
        return self.text


SCHEDULE_STEPS = 20


def schedule_phases(data: dict[str, str]) -> list[str]:
    """a at batch 4 (steps 1-4), a at 8 (5-8), b at block 128 (9-12), a mixture of b and c at batch 16 (13-16),
    a again (17-20)."""
    mixture = f"[{{remote: '{data['b']}', name: b, proportion: 0.5}}, {{remote: '{data['c']}', name: c, proportion: 0.5}}]"
    return [f"max_steps={SCHEDULE_STEPS}", f"optim.decay_steps={SCHEDULE_STEPS}", "model.block_size=128",
            "checkpoint_interval=4", "eval_interval=0", "eval_batches=100000",
            f"phases=[{{start_step: 0, global_batch_size: 4, data: {{remote: '{data['a']}'}}}}, "
            f"{{start_step: 4, global_batch_size: 8}}, {{start_step: 8, data: {{remote: '{data['b']}'}}}}, "
            f"{{start_step: 12, global_batch_size: 16, data: {{streams: {mixture}}}}}, "
            f"{{start_step: 16, global_batch_size: 8, data: {{remote: '{data['a']}'}}}}]"]


@pytest.mark.long
def test_an_interruption_at_every_kind_of_boundary_resumes_exactly(tmp_path):
    """Against an uninterrupted run on 2 ranks x 2: SIGTERM on the last step of a phase (4), on the first step
    of the next (5), SIGKILL just after a boundary's checkpoint (8, where data and block change), SIGTERM on the
    last step before the mixture (12, with DataLoader workers), all on the reference's settings: every step's
    samples per rank, tokens, per-source counts, learning rate and loss bitwise. Then a relaunch on 1 rank x 4
    that lands in the mixture's batch of 16, and one with micro_batch_size 1 that returns to the first data: the
    same samples, losses to float rounding (the gradients are summed in another order from there)."""
    data = {}
    for name, samples, val, block, seed in (("a", 40, 4000, 64, 1), ("b", 24, 2000, 128, 2), ("c", 30, 8, 128, 3)):
        (tmp_path / name).mkdir()
        data[name] = str(tiny_splits(tmp_path / name, samples, val, seed=seed, block_size=block))
    common = schedule_phases(data)
    train(2, None, tmp_path / "reference", *common, "micro_batch_size=2")
    reference = metrics(tmp_path / "reference")
    run_dir = tmp_path / "interrupted"
    store = LocalRunStore(str(run_dir))

    def relaunch(ranks: int, micro: int, *extra: str) -> Output:
        return Output(launch(ranks, None, run_dir, *common, f"micro_batch_size={micro}", *extra, warm=True))

    def at_step(output: Output, step: int) -> None:
        """SIGTERM while step `step` trains or is evaluated (the notice is taken after it either way): once this
        launch has begun its loop and trained the step before, with a long evaluation of `step` to land in."""
        output.wait_for(lambda text: "M parameters" in text and len(metrics(run_dir)) >= step - 1)
        time.sleep(0.3)  # into step `step`, whose evaluation takes seconds
        output.process.send_signal(signal.SIGTERM)
        text = output.finish()
        assert latest_step(store) == step, text[-3000:]

    at_step(relaunch(2, 2, "eval_interval=4"), 4)  # the last step of phases.0
    at_step(relaunch(2, 2, "eval_interval=5"), 5)  # the first of phases.1, resumed at its boundary
    killed = relaunch(2, 2, "eval_interval=9")  # a long evaluation at step 9: room to kill before checkpoint 12
    killed.wait_for(lambda text: (latest_step(store) or 0) >= 8)  # the checkpoint before phases.2's new data
    killed.process.kill_tree()
    killed.finish()
    assert latest_step(store) == 8
    resumed = relaunch(2, 2, "eval_interval=12", "data.num_workers=2")
    at_step(resumed, 12)  # the last step before the mixture
    assert "phases.2 from step 8: global batch 8 (accumulation 2), block 128" in resumed.text
    for change in ("eval_interval changed from 9 to 12", "data.num_workers changed from 0 to 2"):
        assert f"relaunch: {change}\n" in resumed.text  # every accepted change is said (9: the killed launch's)
    other_world = relaunch(1, 4)
    other_world.wait_for(lambda text: len(metrics(run_dir)) >= 13)
    other_world.process.send_signal(signal.SIGTERM)
    text = other_world.finish()
    assert "relaunch: resuming a 2-rank run on 1 ranks" in text
    assert "phases.3 from step 12: global batch 16 (accumulation 4), block 128, a mixture of b, c" in text
    stopped = latest_step(store)
    assert 13 <= stopped < SCHEDULE_STEPS, text[-3000:]
    last = Output(launch(2, None, run_dir, *common, "micro_batch_size=1", warm=True)).finish()
    assert f"resumed from {run_dir}/ckpt-{stopped:08d}.pt" in last
    assert "relaunch: micro_batch_size changed from 4 to 1\n" in last

    interrupted = metrics(run_dir)
    assert [m["step"] for m in interrupted] == [m["step"] for m in reference] == list(range(1, 21))
    assert [m["phase"] for m in reference] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert [len(sum(m["samples"], [])) for m in reference] == [4] * 4 + [8] * 8 + [16] * 4 + [8] * 4
    for got, want in zip(interrupted, reference):
        where = f"step {got['step']}"
        for key in ("phase", "tokens", "consumed", "lr"):
            assert got[key] == want[key], where
        assert got.get("samples_per_source") == want.get("samples_per_source"), where
        assert sorted(sum(got["samples"], [])) == sorted(sum(want["samples"], [])), where
        if len(got["samples"]) == 2:
            assert got["samples"] == want["samples"], where
        if got["step"] <= 12:
            assert got["loss"] == want["loss"], where
        else:
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), where
    assert reference[-1]["tokens"] == 4 * 4 * 64 + 4 * 8 * 64 + 4 * 8 * 128 + 4 * 16 * 128 + 4 * 8 * 64
    consumed = reference[-1]["consumed"]  # per dataset: b is counted as one source, read alone and in the mixture
    assert set(consumed) == {"ds", "b", "c"} and consumed["ds"] == {"samples": 80, "tokens": 80 * 64}
    assert consumed["b"]["samples"] + consumed["c"]["samples"] == 32 + 64

    # The ledger (train/ledger.py), from the run's checkpoint and metrics alone, names each rank's samples of
    # every step as the interrupted run traced them, on the world size each launch had.
    answered = json_lines(ledger(run_dir, "--steps", f"1:{SCHEDULE_STEPS}", "--json"))
    assert [line["samples"] for line in answered] == [m["samples"] for m in interrupted]
    assert [line["ranks"] for line in answered] == [len(m["samples"]) for m in interrupted]
    assert {line["ranks"] for line in answered} == {1, 2} and all(line["recorded"] for line in answered)
    for line, traced in zip(answered, interrupted):
        names = [name for rank in line["sources"] for name, _ in rank]
        assert {name: names.count(name) for name in set(names)} == (traced.get("samples_per_source")
                                                                    or {names[0]: len(names)}), line["step"]


@pytest.mark.long
def test_the_phases_example_config_runs_on_the_real_corpora(tmp_path):
    """configs/tiny-phases.yaml (a batch warm-up, twice the block, an annealing mixture), its data converted from
    ../shared as its header says, on 2 ranks; then its loss curve, with tokens and phases. With the
    loss-spike guard on (zscore 6, action stop): the statistics that each phase moves by design raise no alarm (the
    window starts again at each phase); relaunched on to step 50, then with the learning rate raised 10,000-fold, the
    real spike that follows, inside the last phase, stops the run."""
    corpora = SHARED / "corpora"
    for corpus, doc_per, block, out in (("tinyshakespeare.txt", "paragraph", 64, "data"),
                                        ("tinyshakespeare.txt", "paragraph", 128, "plays-128"),
                                        ("wikitext2_valid.txt", "line", 128, "wiki-128")):
        subprocess.run([sys.executable, "convert/text_to_mds.py", str(corpora / corpus), "--doc-per", doc_per,
                        "--val-fraction", "0.05", "--block-size", str(block), "--out", str(tmp_path / out)],
                       cwd=ROOT, check=True, capture_output=True)
    argv = ["configs/tiny-phases.yaml", f"run_dir={tmp_path / 'run'}", f"phases.0.data.remote={tmp_path / 'data'}",
            f"phases.2.data.remote={tmp_path / 'plays-128'}",
            f"phases.3.data.streams.0.remote={tmp_path / 'plays-128'}",
            f"phases.3.data.streams.1.remote={tmp_path / 'wiki-128'}", "guard.zscore=6", "guard.action=stop"]

    def launch(*overrides: str) -> tuple[int, str]:  # 2 ranks, warm (tests/test_training.py's launch)
        process = WarmLaunch(2, [*argv, *overrides], {**os.environ, "OMP_NUM_THREADS": "1"}, ROOT)
        said = process.communicate(timeout=300)[0]
        return process.returncode, said

    status, said = launch()
    assert status == 0, said[-3000:]
    for line in ("phases.1 from step 10: global batch 8 (accumulation 2), block 64",
                 "phases.2 from step 20: global batch 8 (accumulation 2), block 128",
                 "phases.3 from step 30: global batch 8 (accumulation 2), block 128, a mixture of plays, wiki",
                 "28,160 tokens in 40 steps", "step 40 tokens 28,160 loss"):
        assert line in said, line
    records = metrics(tmp_path / "run")
    assert [r["tokens"] for r in records][9:11] == [2560, 3072]  # 10 steps of 4 x 64, then 8 x 64
    assert records[-1]["lr"] == pytest.approx(3e-4, rel=0.05)  # decayed over the 28,160 tokens
    consumed = records[-1]["consumed"]
    assert set(consumed) == {"data", "plays", "wiki"}  # plays-128, then in the mixture as plays: one dataset
    assert sum(c["tokens"] for c in consumed.values()) == 28160
    assert all(r["val_loss"] == r["val_loss"] for r in records if "val_loss" in r)  # evaluated, finite
    from train.plot import plot_runs

    labels, _ = plot_runs([str(tmp_path / "run")], str(tmp_path / "loss.png"))
    assert (tmp_path / "loss.png").stat().st_size > 10_000 and "run train" in labels
    assert not any("guard" in r for r in records)  # no false alarm at a phase's start

    status, said = launch("max_steps=50")
    assert status == 0 and not any("guard" in r for r in metrics(tmp_path / "run")), said[-3000:]
    raised = ["max_steps=60", "optim.lr=3", "optim.min_lr=3", "resume_allow=[optim.lr,optim.min_lr]"]
    status, said = launch(*raised)
    caught = re.search(r"loss spike at step (\d+) \(loss_z ([\d.]+|inf)", said)
    assert status != 0 and caught and int(caught.group(1)) in (51, 52), said[-3000:]


def test_a_reader_state_from_before_phases_resumes_as_the_first_phases_stream(data):
    """A checkpoint written before phases holds one TrainBatches state as its `loader`."""
    config = load_config(None, [f"data.remote={data['a']}", "global_batch_size=4", "micro_batch_size=2",
                                "model.block_size=64"])
    recipe = Recipe.open(config, 1)
    old = TrainBatches(recipe.dataset(recipe.phases[0]), BatchPlan(4, 2, 1))
    for _ in range(6):
        next(old)
    state = old.state_dict()
    old.close()
    resumed = PhasedBatches(recipe, pin_memory=False)
    resumed.load_state_dict(state)
    whole = stream(config.data, 4, 32)
    assert read_steps(recipe, resumed, 3, 8) == [whole[at:at + 4] for at in range(12, 32, 4)]  # 6 micro-batches in
    resumed.close()


def test_the_gpu_phases_config_counts_the_tokens_its_header_says(tmp_path):
    """configs/gpt2-124m-shared-phases.yaml (bench/README.md's GPU run), on stand-in datasets of its two blocks."""
    roots = {}
    for block in (1024, 2048):
        (tmp_path / str(block)).mkdir()
        roots[block] = tiny_splits(tmp_path / str(block), 24, 24, block_size=block)
    config = load_config(str(ROOT / "configs/gpt2-124m-shared-phases.yaml"),
                         [f"data.remote={roots[1024]}", f"phases.2.data.remote={roots[2048]}"])
    recipe = Recipe.open(config, 1)
    assert [(p.start_step, p.global_batch_size, recipe.block_size(p)) for p in recipe.phases] == [
        (0, 12, 1024), (30, 24, 1024), (200, 12, 2048)]
    assert recipe.tokens_before(config.max_steps) == config.optim.decay_tokens == 7_004_160


def test_a_phase_that_reweighs_a_mixture_reads_it_at_its_new_weights(data):
    """The same sources at other weights are other data: a stream of their own, each epoch the new counts."""
    def mixture(b: float, c: float) -> str:
        return (f"{{streams: [{{remote: '{data['b']}', name: b, proportion: {b}}}, "
                f"{{remote: '{data['c']}', name: c, proportion: {c}}}]}}")

    config = load_config(None, ["micro_batch_size=2", "model.block_size=128", "max_steps=12",
                                f"phases=[{{start_step: 0, global_batch_size: 8, data: {mixture(0.5, 0.5)}}}, "
                                f"{{start_step: 4, data: {mixture(0.9, 0.1)}}}]"])
    recipe = Recipe.open(config, 1)
    assert recipe.stream(recipe.phases[0]) != recipe.stream(recipe.phases[1])
    batches = PhasedBatches(recipe, pin_memory=False)
    steps = read_steps(recipe, batches, 0, 10)  # the second phase's first epoch: 48 samples, 6 steps
    epoch = recipe.dataset(recipe.phases[1]).epoch_samples(BatchPlan(8, 2, 1))
    assert sum(epoch) == 48 and epoch[0] > 5 * epoch[1]
    assert batches.samples_per_source(sum(steps[4:], [])).tolist() == epoch
    batches.close()


def test_a_checkpoint_from_before_phases_counts_a_single_datasets_samples_from_its_step(data):
    from tokstream.train.trainer import count_before_phases

    config = load_config(None, [f"data.remote={data['a']}", "global_batch_size=4", "micro_batch_size=2",
                                "model.block_size=64"])
    recipe = Recipe.open(config, 1)
    batches = PhasedBatches(recipe, pin_memory=False)
    count_before_phases(batches, recipe, 10, master=False)
    assert batches.consumed_by_name() == {"ds": {"samples": 40, "tokens": 40 * 64}}


def val_loss_of_checkpoint(run_dir: Path, step: int, remote: Path, attention: str) -> float:
    """The mean loss of the checkpoint of `step` over the first eval_batches micro-batches of `remote`'s val split,
    with `attention`, in one process: what a 1-rank run's val_loss at that step is (its weights are the same)."""
    import torch

    from tokstream.reader import eval_batches
    from tokstream.train.checkpoint_files import checkpoint_name
    from tokstream.train.config import config_from_dict
    from tokstream.train.model import GPT
    from tokstream.train.trainer import max_documents, model_inputs

    saved = torch.load(run_dir / checkpoint_name(step), map_location="cpu", weights_only=True)
    config = config_from_dict(saved["run"]["config"])
    config.model.attention = attention
    model = GPT(config.model)
    model.load_state_dict(saved["model"])
    loaders, _ = eval_batches(open_dataset(DataConfig(remote=str(remote))), config.micro_batch_size, 1,
                              max_documents=max_documents(config))
    (loader,) = loaders.values()
    losses = []
    model.eval()
    with torch.no_grad():
        for _, batch in zip(range(config.eval_batches), loader):
            inputs, targets, document_args = model_inputs(batch, torch.device("cpu"), config)
            losses.append(float(model(inputs, targets, **document_args)))
    return sum(losses) / len(losses)


def test_evaluation_reads_the_current_phases_val_split_with_the_models_attention(dataset, tmp_path):
    """A run with document attention whose second phase reads another corpus (both with several documents a
    sample): each val_loss is its step's weights over that step's phase's val split with document attention,
    not the other phase's split and not causal attention."""
    from conftest import training_tokenizer, wikitext_articles

    from tokstream.convert.options import ConversionOptions
    from tokstream.convert.sources import open_source
    from tokstream.convert.text_one_pass import convert_documents

    (tmp_path / "wiki.txt").write_text("".join(wikitext_articles()[:40]))
    wiki = tmp_path / "wiki"
    convert_documents(open_source([str(tmp_path / "wiki.txt")], txt_docs="line"), training_tokenizer(tmp_path),
                      str(wiki), ConversionOptions(block_size=64, val_fraction=0.1, progress=False))
    run_dir = tmp_path / "run"
    train(1, dataset, run_dir, "max_steps=32", "optim.decay_steps=32", "eval_interval=16", "keep_checkpoints=0",
          "model.attention=document", f"phases=[{{start_step: 0}}, {{start_step: 16, data: {{remote: '{wiki}'}}}}]")
    val_loss = {record["step"]: record["val_loss"] for record in metrics(run_dir) if "val_loss" in record}
    assert sorted(val_loss) == [16, 32]
    # Equal to rel 1e-5 (float32 sums in another order); the alternatives differ by more than 1e-4 (causal attention
    # by 8e-3 at step 32: a tiny model barely uses its context so early, but these numbers are deterministic)
    assert val_loss[16] == pytest.approx(val_loss_of_checkpoint(run_dir, 16, dataset, "document"), rel=1e-5)
    assert val_loss[32] == pytest.approx(val_loss_of_checkpoint(run_dir, 32, wiki, "document"), rel=1e-5)
    assert val_loss[32] != pytest.approx(val_loss_of_checkpoint(run_dir, 32, dataset, "document"), rel=1e-4)
    assert val_loss[32] != pytest.approx(val_loss_of_checkpoint(run_dir, 32, wiki, "causal"), rel=1e-4)


def bin_dataset(root: Path, *options: str) -> str:
    """A dataset converted by convert/bin_to_mds.py from 30 samples of block 128 of ids below 500."""
    import numpy as np

    root.mkdir()
    (np.arange(30 * 128 + 1) % 500).astype("<u2").tofile(root / "ids.bin")
    done = subprocess.run([sys.executable, "convert/bin_to_mds.py", str(root / "ids.bin"), "--val", str(root / "ids.bin"),
                           "--block-size", "128", "--out", str(root / "ds"), "--no-progress", *options],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return str(root / "ds")


def test_a_phase_whose_tokens_mean_other_things_or_whose_data_is_too_small_is_refused_naming_it(data, tmp_path):
    """Every phase feeds one model: another vocabulary or separator is refused as a mixture's source would be."""
    tokenizer = str(Path(data["a"]).parent / "tokenizer.json")  # the training tests' (tiny_splits)
    other_vocabulary = bin_dataset(tmp_path / "vocab-512", "--vocab-size", "512", "--separator-id", "0",
                                   "--separator-position", "before")
    assert refusal(lambda: Recipe.open(phased(data, f"phases.2.data.remote={other_vocabulary}"), 1)) == (
        f"phases.2's data ({other_vocabulary}) has tokenizer='vocab-512', phases.0's {tokenizer!r}: every phase feeds "
        "one model, so its data must share the tokenizer, vocabulary and separator (and its position); reconvert it")
    begin_of_text = bin_dataset(tmp_path / "before", "--tokenizer", tokenizer, "--separator", "before:<|endoftext|>")
    assert refusal(lambda: Recipe.open(phased(data, f"phases.2.data.remote={begin_of_text}"), 1)) == (
        f"phases.2's data ({begin_of_text}) has separator_position='before', phases.0's 'after': every phase feeds "
        "one model, so its data must share the tokenizer, vocabulary and separator (and its position); reconvert it")
    same = bin_dataset(tmp_path / "same", "--tokenizer", tokenizer, "--separator", "after:<|endoftext|>")
    Recipe.open(phased(data, f"phases.2.data.remote={same}"), 1)
    too_small = Recipe.open(phased(data, "phases.2.global_batch_size=32", "phases.3.global_batch_size=32",
                                   "phases.4.global_batch_size=32", "micro_batch_size=4"), 1)
    assert refusal(too_small.describe_epochs) == (
        f"phases.2's data ({data['b']}): the train split has 24 samples, fewer than one step's global_batch_size 32: "
        "convert more data or lower global_batch_size")
    moved = phased(data, "phases.2.start_step=12", "phases.3.start_step=13")
    assert refusal(lambda: check_relaunch(phased(data).to_dict(), moved, step=12)).startswith(
        "phases.2 started at step 10, but this launch moves its start_step to 12, after the checkpoint's step 12; ")


def test_a_later_phases_data_replaced_mid_run_stops_the_run_at_its_boundary_and_the_relaunch_reads_it(tmp_path):
    """The README lets a phase that has not started be edited, so its data may be converted again while the run
    trains an earlier phase. The run opened it at start-up; at the boundary it is opened again, found changed, and
    the run saves a checkpoint there and stops in one line (status 2) instead of reading the new data with the old
    one's epoch. The same command then goes on: the new data is opened, recorded and read (every step as the
    ledger says), where before the fix the relaunch was refused for good."""
    from tokstream.train.ledger import Ledger

    for name in ("a", "b", "b-again"):
        (tmp_path / name).mkdir()
    a = tiny_splits(tmp_path / "a", 40, 300, seed=1)  # a val split whose evaluation at step 2 takes seconds
    b = tiny_splits(tmp_path / "b", 24, 8, seed=2, block_size=128)
    replacement = tiny_splits(tmp_path / "b-again", 32, 8, seed=3, block_size=128)
    run_dir = tmp_path / "run"
    settings = ["max_steps=10", "global_batch_size=4", "micro_batch_size=2", "model.block_size=128",
                "eval_interval=2", "eval_batches=100000", "checkpoint_interval=100",
                f"phases=[{{start_step: 0, data: {{remote: '{a}'}}}}, {{start_step: 4, data: {{remote: '{b}'}}}}]"]
    first = Output(launch(1, None, run_dir, *settings, warm=True))
    first.wait_for(lambda text: len(metrics(run_dir)) >= 1)  # started: every phase's data opened
    os.rename(b, tmp_path / "b" / "old")
    os.rename(replacement, b)  # as a conversion with --overwrite puts its output in place
    text = first.finish()
    assert first.process.returncode == 2, text[-3000:]
    assert latest_step(LocalRunStore(str(run_dir))) == 4
    identity = open_dataset(DataConfig(remote=str(b))).identity
    assert f"phases.1's data ({b}) changed since this launch opened it (identity " in text
    assert (f", now {identity}); saved a checkpoint at step 4, before phases.1 starts: relaunch the same command to "
            "train phases.1 on the data as it is now\n") in text

    Output(launch(1, None, run_dir, *settings, warm=True)).finish()
    traced = metrics(run_dir)
    assert [m["step"] for m in traced] == list(range(1, 11))
    new_stream = stream(DataConfig(remote=str(b)), 4, 24)
    assert [m["samples"][0] for m in traced[4:]] == [new_stream[at:at + 4] for at in range(0, 24, 4)]
    ledger = Ledger.of_run(str(run_dir))
    try:
        assert [ledger.step(step).samples.tolist() for step in range(1, 11)] == [m["samples"] for m in traced]
    finally:
        ledger.close()


def each_step_reads_its_stream_at(recipe: Recipe, steps: list[list[int]], units_before) -> dict[int, list[int]]:
    """Assert that each step's ids are its phase's stream from `units_before(phase, step)` units on; each phase's
    stream (its first 200 samples, read alone)."""
    streams = {phase.index: stream(recipe.dataset(phase).config, recipe.units[phase.index], 200)
               for phase in recipe.phases}
    for step, ids in enumerate(steps):
        phase = recipe.at(step)
        at = units_before(phase, step) * recipe.units[phase.index]
        assert ids == streams[phase.index][at:at + phase.global_batch_size], step
    return streams


@pytest.mark.parametrize("order", ORDERS)
def test_units_before_and_the_ledger_give_the_steps_the_reader_reads_across_every_boundary(data, order):
    """In process, in seconds: for each step of the five phases (a ramp, other data, data read again, a mixture),
    units_before places the step in its stream exactly where PhasedBatches reads it, and the ledger's core, given
    no records, deals it to 1 rank and to 2 as the reader would."""
    from tokstream.train.ledger import Ledger

    config = phased(data, f"data.shuffle_algo={order}")
    recipe = Recipe.open(config, 1)
    batches = PhasedBatches(recipe, pin_memory=False)
    steps = read_steps(recipe, batches, 0, 20)
    batches.close()
    each_step_reads_its_stream_at(recipe, steps, recipe.units_before)
    assert [recipe.units_before(recipe.phases[3], s) for s in (0, 6, 10, 12, 14, 20)] == [0, 6, 14, 14, 18, 18]

    ledger = Ledger(config, recipe, records={}, saved_step=0)
    try:
        for step, ids in enumerate(steps, start=1):
            assert ledger.step(step, ranks=1).samples.tolist() == [ids], step
            two = ledger.step(step, ranks=2).samples  # each rank's share of each unit, in its reading order
            unit = recipe.units[recipe.at(step - 1).index]
            assert sorted(two.reshape(-1).tolist()) == sorted(ids) and two.shape == (2, len(ids) // 2), step
            units = [ids[at:at + unit] for at in range(0, len(ids), unit)]
            assert [sorted(two[:, k * unit // 2:(k + 1) * unit // 2].reshape(-1).tolist()) for k in range(len(units))] \
                == [sorted(u) for u in units], step
    finally:
        ledger.close()


def test_skipped_steps_move_each_stream_by_what_they_would_have_read_and_the_ledger_follows(data):
    """skip_steps across phase boundaries, in process: steps 5-7 (a's batch ramp: two steps of 4, one of 8) and 11-12
    (b's). The trainer reads a skip's steps and leaves them out (skip_when_due, done here as it does it); every step
    then reads its stream where read_units_before says, and the ledger says the same."""
    from tokstream.train.ledger import Ledger

    config = phased(data, "skip_steps=[[5,7],[11,12]]")
    recipe = Recipe.open(config, 1)
    batches = PhasedBatches(recipe, pin_memory=False)
    steps, left_out = [], []
    for step in range(20):
        if skip := recipe.skip_at(step):
            left_out += read_steps(recipe, batches, skip[0] - 1, skip[1])
        steps += read_steps(recipe, batches, step, step + 1)
    batches.close()
    streams = each_step_reads_its_stream_at(recipe, steps, recipe.read_units_before)
    a, b = streams[0], streams[2]
    assert steps[4] == a[32:36] and steps[6] == a[40:48]  # step 5 reads what step 8 would have; a's ramp goes on
    assert steps[10] == b[16:24] and steps[12] == a[72:80]  # b moved by its two steps; a again, by the first skip
    assert sum(left_out, []) == a[16:24] + a[24:32] + b[:16]
    ledger = Ledger(config, recipe, records={}, saved_step=0)
    try:
        assert [ledger.step(step, ranks=1).samples.tolist() for step in range(1, 21)] == [[ids] for ids in steps]
    finally:
        ledger.close()


def test_a_phase_a_done_skip_read_into_is_started_and_keeps_its_recipe(data):
    """skip_steps [[5, 7]] read step 7's data, phase 1's: a relaunch from step 5 may not edit phase 1 any more."""
    from tokstream.train.resume_policy import check_relaunch

    saved = phased(data, "skip_steps=[[5,7]]").to_dict()
    with pytest.raises(UserError, match="phases.1"):
        check_relaunch(saved, phased(data, "skip_steps=[[5,7]]", "phases.1.global_batch_size=12"), 5)
    assert check_relaunch(saved, phased(data, "skip_steps=[[5,7]]", "phases.2.global_batch_size=16"), 5)


def test_data_a_trained_phase_read_changed_under_a_later_phase_stops_the_run_saying_to_put_it_back(tmp_path):
    """Phases a, b, then a again: a is converted again while b trains. At the boundary the run stops in one line
    that says the data must be put back (phases.0 trained on it, so a relaunch would be refused, and is); put back,
    the same command goes on, every step as the ledger says."""
    from tokstream.train.ledger import Ledger

    for name in ("a", "b", "a-again"):
        (tmp_path / name).mkdir()
    a = tiny_splits(tmp_path / "a", 40, 8, seed=1)
    b = tiny_splits(tmp_path / "b", 24, 300, seed=2)  # a val split whose evaluation at step 6 takes seconds
    replacement = tiny_splits(tmp_path / "a-again", 32, 8, seed=3)
    run_dir = tmp_path / "run"
    settings = ["max_steps=10", "global_batch_size=4", "micro_batch_size=2", "model.block_size=64",
                "eval_interval=2", "eval_batches=100000", "checkpoint_interval=100",
                f"phases=[{{start_step: 0, data: {{remote: '{a}'}}}}, {{start_step: 4, data: {{remote: '{b}'}}}}, "
                f"{{start_step: 8, data: {{remote: '{a}'}}}}]"]
    first = Output(launch(1, None, run_dir, *settings, warm=True))
    first.wait_for(lambda text: len(metrics(run_dir)) >= 5)  # phases.1 trains: a's reader is closed
    os.rename(a, tmp_path / "a" / "old")
    os.rename(replacement, a)
    text = first.finish()
    assert first.process.returncode == 2, text[-3000:]
    assert (f"changed since this launch opened it (identity {open_dataset(DataConfig(remote=str(tmp_path / 'a' / 'old'))).identity}, "
            f"now {open_dataset(DataConfig(remote=str(a))).identity}); phases.0, which has trained, read that data too, "
            "so the run cannot go on with it: put the data back as it was (a checkpoint is saved at step 8, before "
            "phases.2), or use a new run_dir\n") in text
    refused = Output(launch(1, None, run_dir, *settings, warm=True))
    assert "phases.0's data differs from the one the checkpoint's run read in it" in refused.finish()

    os.rename(a, tmp_path / "a-again" / "ds")
    os.rename(tmp_path / "a" / "old", a)  # put back
    Output(launch(1, None, run_dir, *settings, warm=True)).finish()
    traced = metrics(run_dir)
    assert [m["step"] for m in traced] == list(range(1, 11))
    ledger = Ledger.of_run(str(run_dir))
    try:
        assert [ledger.step(step).samples.tolist() for step in range(1, 11)] == [m["samples"] for m in traced]
    finally:
        ledger.close()


def test_two_phases_datasets_of_one_folder_name_are_refused_one_cache(tmp_path):
    """With data.local, a phase's cache is data.local/<its dataset folder's name>: two datasets named alike (every
    tiny_splits dataset is .../ds) would read each other's shards there."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    a, b = tiny_splits(tmp_path / "a", 40, 8, seed=1), tiny_splits(tmp_path / "b", 24, 8, seed=2, block_size=128)
    settings = ["micro_batch_size=2", "global_batch_size=4", "model.block_size=128", f"data.local={tmp_path / 'cache'}",
                f"phases=[{{start_step: 0, data: {{remote: '{a}'}}}}, {{start_step: 4, data: {{remote: '{b}'}}}}]"]
    assert refusal(lambda: Recipe.open(load_config(None, settings), 1)) == (
        f"phases.1's data ({b}) and phases.0's ({a}) would share the cache {tmp_path / 'cache' / 'ds'} and read each "
        "other's shards: give phases.1.data.local a folder of its own")
    Recipe.open(load_config(None, [*settings, f"phases.1.data.local={tmp_path / 'cache-b'}"]), 1)
