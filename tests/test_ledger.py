"""train/ledger.py and the reader's SampleOrder: which samples each rank read in a step, computed without reading.

The answer is checked against what runs recorded (trace_samples): here a run on one process and the reader
itself; tests/test_phases.py checks it on a run interrupted at every kind of phase boundary and relaunched on
other world sizes, micro-batches and workers, with mixtures and epoch ends, and tests/test_nodes_and_ranks.py on
a run of two nodes of two ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TRAINING_VOCAB, run_script
from test_training import tiny_splits

from tokstream.errors import UserError
from tokstream.reader import BatchPlan, DataConfig, SampleOrder, StreamConfig, TrainBatches, open_dataset
from warm_ranks import WarmLaunch, run_warm


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ledger")
    made = {}
    for name, samples, seed in (("a", 40, 0), ("b", 30, 2)):
        (root / name).mkdir()
        made[name] = tiny_splits(root / name, samples, 8, seed=seed)
    return made


@pytest.mark.parametrize("mixture", [False, True])
def test_the_order_is_what_the_reader_reads_across_epoch_ends_from_any_step(datasets, mixture):
    config = DataConfig(remote=str(datasets["a"])) if not mixture else DataConfig(streams=[
        StreamConfig(remote=str(datasets["a"]), name="a", proportion=0.5),
        StreamConfig(remote=str(datasets["b"]), name="b", proportion=0.5)])
    dataset = open_dataset(config)
    batches = TrainBatches(dataset, BatchPlan(4, 2, 1))
    read = [next(batches)["ids"].tolist() + next(batches)["ids"].tolist() for _ in range(25)]  # 2.5 epochs
    batches.close()
    order = SampleOrder(dataset, 4)
    try:
        assert order.epoch_size < 25 * 4
        assert order.steps(0, 25)[:, 0].tolist() == read
        assert order.steps(13, 5)[:, 0].tolist() == read[13:18]  # from any step, not only from the first
        two_ranks = order.steps(3, 4, 1, 2)
        assert [sorted(step.ravel().tolist()) for step in two_ranks] == [sorted(ids) for ids in read[3:7]]
        if mixture:
            sources, ids = order.source_of(np.array(read[0]))
            first = order.first_sample_of_source
            assert np.array_equal(first[sources] + ids, read[0]) and 0 <= ids.min() and set(sources.tolist()) <= {0, 1}
    finally:
        order.close()


def ledger(run_dir: Path, *args: str, fresh: bool = False) -> subprocess.CompletedProcess:
    """The ledger forked warm (torch imported once); fresh: in a new interpreter, whose stderr holds whatever its
    imports print too (where a test compares stderr whole)."""
    if fresh:
        return run_script("train/ledger.py", run_dir, *args, cwd=ROOT)
    return run_warm("train/ledger.py", run_dir, *args, cwd=ROOT)


def json_lines(done: subprocess.CompletedProcess) -> list[dict]:
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def train(run_dir: Path, data: Path, steps: int, *extra: str) -> None:
    """configs/tiny.yaml on one process (warm: no signal reaches it) over `data`, 8 samples a step, traced, to `steps` (a relaunch goes on)."""
    done = WarmLaunch(None, ["configs/tiny.yaml", f"model.vocab_size={TRAINING_VOCAB}", f"max_steps={steps}",
                             "optim.decay_steps=10", "checkpoint_interval=5", "eval_interval=0", "trace_samples=true",
                             "global_batch_size=8", "micro_batch_size=4",
                             f"data.remote={data}", f"run_dir={run_dir}", *extra], dict(os.environ), ROOT)
    output, _ = done.communicate(timeout=300)
    assert done.returncode == 0, output[-4000:]


@pytest.fixture(scope="module")
def run(datasets, tmp_path_factory) -> Path:
    """10 steps over `a` (40 samples: 8 a step, two epoch ends)."""
    run_dir = tmp_path_factory.mktemp("run")
    train(run_dir, datasets["a"], 10)
    return run_dir


def test_the_ledger_gives_each_steps_samples_with_their_text(run, datasets):
    from tokstream.convert.verify import read_sample
    from tokstream.tokenizer import load_tokenizer
    from tokstream.train.metrics import read_records

    traced = read_records(run)
    answered = json_lines(ledger(run, "--steps", "1:12", "--json"))
    assert [line["samples"] for line in answered[:10]] == [record["samples"] for record in traced]
    assert [line["recorded"] for line in answered] == [True] * 10 + [False] * 2  # 11, 12: not made yet
    assert all(name == "ds" for line in answered for rank in line["sources"] for name, _ in rank)
    text = ledger(run, "--step", "7", "--decode")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == "step 7 (ds): 8 samples, 1 rank on 1 node (as the run recorded)"
    assert lines[1] == "  rank 0: " + " ".join(map(str, traced[6]["samples"][0]))
    sample = traced[6]["samples"][0][2]
    tokenizer = load_tokenizer(str(Path(datasets["a"]).parent / "tokenizer.json"))  # beside it: tiny_splits
    decoded = tokenizer.decode(read_sample(datasets["a"], "train", sample).tolist())
    assert lines[4] == f"    ds {sample}: {json.dumps(decoded, ensure_ascii=False)}"


def test_steps_not_made_yet_are_what_the_run_reads_when_it_goes_on(run, datasets, tmp_path):
    """Past the run's last step, the ledger deals the steps to the last launch's ranks: what a relaunch that goes
    on then reads (here into the next epoch)."""
    import shutil

    from tokstream.train.metrics import read_records

    predicted = json_lines(ledger(run, "--steps", "11:14", "--json"))
    shutil.copytree(run, tmp_path / "run")
    train(tmp_path / "run", datasets["a"], 14)
    assert [line["samples"] for line in predicted] == [record["samples"] for record in read_records(tmp_path / "run")[10:]]
    assert [line["recorded"] for line in json_lines(ledger(tmp_path / "run", "--steps", "11:14", "--json"))] == [True] * 4


def refusal(call) -> str:
    with pytest.raises(UserError) as refused:
        call()
    return str(refused.value)


def test_a_run_without_ranks_in_its_metrics_needs_them_given_and_other_data_is_refused(run, datasets, tmp_path):
    """In process, as the CLI's core answers (the CLI's one-line errors: the last cases)."""
    import shutil

    from tokstream.train.ledger import Ledger

    def rewritten(name: str, edit) -> Path:
        """A copy of the run whose metrics lines are edit(record)."""
        shutil.copytree(run, tmp_path / name)
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(edit(r)) + "\n" for r in records))
        return tmp_path / name

    def answer(run_dir: Path, step: int, *overrides: str, **layout):
        ledger = Ledger.of_run(str(run_dir), list(overrides))
        try:
            return ledger.step(step, **layout).samples.tolist()
        finally:
            ledger.close()

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    old = rewritten("old", lambda r: {k: v for k, v in r.items() if k not in ("ranks", "nodes")})
    assert refusal(lambda: answer(old, 3)) == (
        "the run's metrics.jsonl does not say which ranks ran step 3 (a run from before the ledger, or a step "
        "it has no line for): give --ranks (and --nodes)")
    dealt = answer(old, 3, ranks=2)
    assert [len(rank) for rank in dealt] == [4, 4] and sorted(sum(dealt, [])) == sorted(records[2]["samples"][0])
    for layout, said in ((dict(ranks=0), "--ranks must be a positive number"),
                         (dict(nodes=2), "--nodes (1 or more) comes with --ranks"),
                         (dict(ranks=3), "global batches of 8 samples, which 3 ranks on 1 node do not share")):
        assert said in refusal(lambda: answer(run, 3, **layout))
    assert refusal(lambda: answer(run, 3, "global_batch_size=16")).startswith(
        "global_batch_size: the ledger reads the run's own settings")
    assert "is not the data the run read" in refusal(lambda: answer(run, 3, f"data.remote={datasets['b']}"))
    # The run's record comes from LATEST's manifest, so the checkpoint (gigabytes, from S3) is not read; where a
    # manifest has no record (saves before 2026-11-25), from the checkpoint itself, verified.
    unread = rewritten("unread", lambda r: r)
    for path in unread.glob("ckpt-*.pt"):
        path.write_bytes(b"not read")
    assert answer(unread, 7) == records[6]["samples"]
    # Not the newest manifest, but the checkpoint a relaunch resumes from: one that fell back past a damaged
    # checkpoint left it newer than LATEST, with a manifest of other settings
    ahead = rewritten("ahead", lambda r: r)
    (ahead / "ckpt-00000015.pt").write_bytes(b"damaged")
    manifest = json.loads((ahead / "ckpt-00000010.manifest.json").read_text())
    manifest["run"]["config"]["global_batch_size"] = 16
    (ahead / "ckpt-00000015.manifest.json").write_text(json.dumps({**manifest, "step": 15}))
    assert answer(ahead, 7) == records[6]["samples"]
    older = rewritten("older", lambda r: r)
    for path in older.glob("ckpt-*.manifest.json"):
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "run"}))
    assert answer(older, 7) == records[6]["samples"]
    for path in older.glob("ckpt-*.pt"):
        path.write_bytes(b"read")
    assert "none of which can be resumed from" in refusal(lambda: answer(older, 7))
    busy = tmp_path / "busy"  # a cache a running reader uses (streaming refuses a second): the setting to change
    reading = TrainBatches(open_dataset(DataConfig(remote=str(datasets["a"]), local=str(busy))), BatchPlan(8, 4, 1))
    try:
        for setting in ("data.local", "phases.0.data.local"):
            assert refusal(lambda: answer(run, 3, f"{setting}={busy}")).endswith(
                f"in use by a running reader (the run itself?): give the ledger a cache of its own, e.g. {setting}=DIR")
    finally:
        reading.close()
    (tmp_path / "empty").mkdir()
    assert "holds no checkpoint" in refusal(lambda: answer(tmp_path / "empty", 1))
    assert "is not a directory" in refusal(lambda: answer(tmp_path / "missing", 1))
    assert not (tmp_path / "missing").exists()
    # Steps made since the newest checkpoint by a launch with another config (none of its checkpoints left), in
    # another phase or on other data (a phase not started at the checkpoint may change its data on relaunch):
    other_data = rewritten("data", lambda r: {**r, "data": "0" * 12} if r["step"] > 8 else r)
    assert answer(other_data, 8) == records[7]["samples"]
    assert "on data 000000000000, the config" in refusal(lambda: answer(other_data, 9))
    other_phase = rewritten("phase", lambda r: {**r, "phase": 1} if r["step"] > 8 else r)
    data = records[8]["data"]
    refused = ledger(other_phase, "--step", "9", fresh=True)
    assert refused.returncode != 0 and refused.stderr.strip() == (
        f"error: step 9: metrics.jsonl says it trained phases.1 with 4,608 tokens done on data {data}, the config of "
        f"the newest checkpoint (step 10) gives phases.0 with 4,608 on data {data}: a launch since ran another "
        "config, which no checkpoint holds")
    refused = ledger(run, "--step", "3", "--tokenizer", "gpt2")
    assert refused.returncode != 0 and refused.stderr.strip() == (
        "error: --tokenizer and --ranks-file say how to decode: they come with --decode")
    refused = ledger(run, "--steps", "5:3")
    assert refused.returncode == 2 and refused.stderr == "error: --steps 5:3: FIRST is after LAST\n"


def test_a_damaged_metrics_line_or_latest_blocks_neither_the_relaunch_nor_the_ledger_nor_the_plot(run, datasets,
                                                                                                   tmp_path):
    """A line cut by a kill and then appended to, a line that is a list, a line without a step, lines whose fields are
    not what the run writes (ranks without nodes, tokens null), and a LATEST whose step
    is JSON's 1e999 (infinity): each tool says which lines it skipped, in one warning, and goes on; the relaunch keeps
    the damaged lines as they are (nothing lost) and resumes from the newest checkpoint."""
    import shutil

    from tokstream.train.metrics import read_records

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    lines = (copy / "metrics.jsonl").read_text().splitlines(keepends=True)
    cut_then_appended = lines[3][:20] + json.dumps({"step": 99, "loss": 1.0}) + "\n"
    odd_fields = [json.dumps({"step": 4, "loss": 1.0, "ranks": 1}), json.dumps({"step": 4, "loss": 1.0, "tokens": None})]
    damaged = lines[:3] + [cut_then_appended, "[1, 2]\n", json.dumps({"loss": 1.0}) + "\n",
                           *(line + "\n" for line in odd_fields)] + lines[3:]
    (copy / "metrics.jsonl").write_text("".join(damaged))  # lines 4 to 8
    (copy / "LATEST").write_text('{"checkpoint": "ckpt-00000010.pt", "step": 1e999}')
    warning = ("warning: {}/metrics.jsonl lines 4, 5, 6, 7, 8 are not a step's record (cut by a kill, or edited): "
               "skipped; "
               "delete or repair them to silence this")

    answered = ledger(copy, "--steps", "1:10", "--json")
    assert warning.format(copy) in answered.stderr
    assert [line["samples"] for line in json_lines(answered)] == [r["samples"] for r in read_records(run)]
    plotted = subprocess.run([sys.executable, str(ROOT / "train/plot.py"), str(copy), "--out", str(tmp_path / "loss.png")],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert plotted.returncode == 0 and warning.format(copy) in plotted.stderr, plotted.stderr
    assert (tmp_path / "loss.png").stat().st_size > 0

    train(copy, datasets["a"], 12)
    kept = (copy / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert kept[:15] == damaged and [json.loads(line)["step"] for line in kept[15:]] == [11, 12]
    assert [r["samples"] for r in read_records(copy)][:10] == [r["samples"] for r in read_records(run)]


@pytest.mark.parametrize("start", [0, 2])
def test_each_rank_of_asymmetric_layouts_reads_what_streamings_own_partition_deals_it(datasets, start):
    """2 nodes x 4 ranks and 4 x 2, rank by rank and in order (not sorted): SampleOrder against stock streaming's
    get_partitions over the epoch's order, from the epoch's start and from step 2. 1 x N and 2 x 2 give the same
    answer with nodes and ranks per node swapped; these do not."""
    from tokstream.reader.streaming_door.streaming_internals import get_partitions  # stock streaming's own

    order = SampleOrder(open_dataset(DataConfig(remote=str(datasets["a"]))), 8)
    try:
        epoch = order.steps(0, 5, 1, 1).reshape(-1)  # 40 samples: one rank reads the epoch's order itself
        for nodes, per_node in ((2, 4), (4, 2)):
            dealt = get_partitions("orig", 40 - 8 * start, 1, nodes, per_node, 1, 1, 0).reshape(8, -1)
            expected = epoch[8 * start:][dealt]  # a reader resumed at step `start` deals out the rest alike
            read = order.steps(start, 5 - start, nodes, per_node)  # (steps, ranks, samples per rank)
            assert read.transpose(1, 0, 2).reshape(8, -1).tolist() == expected.tolist(), (nodes, per_node)
    finally:
        order.close()


def test_the_ledger_checks_its_answer_against_what_the_run_recorded_reading(run, tmp_path):
    """Each step's metrics line says what it read ("read": the sums of read_check.py, all ranks together); the
    ledger's answer for a recorded step must give the same, or it says in one line that it cannot answer."""
    import shutil

    from tokstream.reader.order.read_check import read_digest, read_sums
    from tokstream.train.ledger import Ledger
    from tokstream.train.metrics import read_records

    records = read_records(run)
    assert all(r["read"] == read_digest(read_sums(r["samples"])) for r in records)  # the run's own record
    shutil.copytree(run, tmp_path / "run")
    records[6]["read"] = read_digest(read_sums(np.array(records[6]["samples"]) + 1))  # other samples than step 7's
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    checked = Ledger.of_run(str(tmp_path / "run"))
    try:
        assert checked.step(6).samples.tolist() == records[5]["samples"]
        said = refusal(lambda: checked.step(7))
        assert said.startswith("step 7: metrics.jsonl records reading other samples than the order gives") and \
            "\n" not in said
    finally:
        checked.close()
    done = ledger(tmp_path / "run", "--step", "7")
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1].startswith("error: step 7: metrics.jsonl")


def test_a_run_from_before_the_lazy_order_changed_is_answered_in_the_order_it_read(datasets, tmp_path):
    """Before issue 51, `auto` read data past data.lazy_order_from in feistel_window, and a run's recorded config did
    not say data.shuffle_auto_lazy. Such a run (trained here as `auto` then was, its manifests' config stripped of the
    key as an old run's are) is answered by the ledger in feistel_window, the samples it read, not in today's lazy
    order; and a relaunch goes on in it too (its checkpoints then record the key)."""
    from tokstream.train.metrics import read_records

    run_dir = tmp_path / "run"
    then = ["data.lazy_order_from=1", "data.shuffle_auto_lazy=feistel_window"]
    train(run_dir, datasets["a"], 5, *then)
    for manifest in run_dir.glob("ckpt-*.manifest.json"):
        saved = json.loads(manifest.read_text())
        del saved["run"]["config"]["data"]["shuffle_auto_lazy"]
        manifest.write_text(json.dumps(saved))
    traced = [record["samples"] for record in read_records(run_dir)]
    answered = json_lines(ledger(run_dir, "--steps", "1:5", "--json"))
    assert [line["samples"] for line in answered] == traced
    train(run_dir, datasets["a"], 8, "data.lazy_order_from=1")  # today's default: shuffle_auto_lazy=lazy
    relaunched = json_lines(ledger(run_dir, "--steps", "1:8", "--json"))
    assert [line["samples"] for line in relaunched] == [record["samples"] for record in read_records(run_dir)]

