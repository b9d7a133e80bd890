"""Mixtures (data.streams): the config, the checks at start-up, each source's share of an epoch, the
accounting, and the plot. Resumption with a mixture through torchrun (SIGTERM, SIGUSR1, SIGKILL,
epoch ends, world-size changes, a changed mixture refused): test_interruptions.py, which runs on one."""

import json
import math

import pytest
from conftest import ROOT, SHARED, training_tokenizer
from test_training import tiny_splits

from tokstream.errors import UserError
from tokstream.reader.batch_plan import BatchPlan
from tokstream.reader.mixture import apportion, samples_per_epoch, sources
from tokstream.train.config import load_config


def mixture_config(*overrides: str):
    return load_config(None, ["data.streams=[{remote: /data/web, proportion: 0.7}, {remote: /data/books, "
                              "proportion: 0.3}]", *overrides])


def refusal(check) -> str:
    with pytest.raises(UserError) as refused:
        check()
    return str(refused.value)


def test_streams_are_set_in_yaml_or_item_by_item_on_the_command_line(tmp_path):
    config = mixture_config("data.streams.1.proportion=0.25", "data.streams.2.remote=s3://bucket/code",
                            "data.streams.2.proportion=0.05", "data.local=/cache")
    assert [(s.name, s.remote, s.local, s.weight, s.value) for s in sources(config.data)] == [
        ("web", "/data/web", "/cache/web", "proportion", 0.7),
        ("books", "/data/books", "/cache/books", "proportion", 0.25),
        ("code", "s3://bucket/code", "/cache/code", "proportion", 0.05)]
    yaml_file = tmp_path / "mix.yaml"
    yaml_file.write_text("data:\n  streams:\n    - {remote: /a, name: first, repeat: 2}\n"
                         "    - {remote: /b, choose: 7}\n")
    loaded = load_config(str(yaml_file), [])
    assert [(s.name, s.weight, s.value) for s in sources(loaded.data)] == [("first", "repeat", 2.0),
                                                                          ("b", "choose", 7)]
    assert "data.streams has 2 items, so data.streams.0 to data.streams.2 (which appends one), not " \
           "data.streams.5" in refusal(lambda: mixture_config("data.streams.5.remote=/x"))
    assert "data.streams.0.proportion must be a number, got 'lots'" in refusal(
        lambda: mixture_config("data.streams.0.proportion=lots"))
    assert "data.streams.1.choose must be a whole number, got 2.5" in refusal(lambda: mixture_config("data.streams.1.choose=2.5"))
    assert "unknown config key 'data.streams.0.weight'" in refusal(lambda: mixture_config("data.streams.0.weight=1"))


@pytest.mark.parametrize("overrides, message", [
    (["data.remote=/data/one"], "data.remote=/data/one and data.streams are both set: give one dataset in "
                                "data.remote or a mixture in data.streams"),
    (["data.streams.1.proportion=null", "data.streams.1.repeat=2"],
     "data.streams.1 (books) is weighted by repeat, data.streams.0 (web) by proportion: give every source a "
     "proportion, or none of them one"),
    (["data.streams.1.choose=5"], "data.streams.1 (books) sets proportion and choose: give at most one weight"),
    (["data.streams.1.proportion=0"], "data.streams.1 (books): proportion=0.0 draws nothing; give a positive "
                                      "weight, or remove the source"),
    (["data.streams.1.name=web"], "data.streams.1 and data.streams.0 are both named 'web'"),
    (["data.streams.1.remote=/data/web/"], "data.streams.1 (web) and data.streams.0 (web) read the same dataset"),
    (["data.streams.1.remote=s3://bucket/books"], "data.streams.1 (books)=s3://bucket/books is remote: set "
                                                  "data.streams.1.local (or data.local) to a local cache directory"),
])
def test_a_mixture_that_cannot_work_is_refused_in_one_line(overrides, message):
    from tokstream.reader.dataset import local_root

    def check():
        for source in sources(mixture_config(*overrides).data):
            if source.remote.startswith("s3://"):
                local_root(source)

    assert message in refusal(check)


@pytest.mark.parametrize("key, value", [("tokenizer_sha256", "0" * 64), ("vocab_size", 50000), ("separator_id", 1),
                                        ("separator_position", "before"), ("block_size", 32)])
def test_sources_that_tokenize_differently_are_refused_naming_the_odd_one(tmp_path, key, value):
    from tokstream.reader import open_dataset

    roots = []
    for index, name in enumerate(("web", "books")):
        (tmp_path / name).mkdir()
        roots.append(tiny_splits(tmp_path / name, 16, 8, seed=index))
    metadata = json.loads((roots[1] / "metadata.json").read_text())
    first = metadata[key]
    metadata[key] = value
    (roots[1] / "metadata.json").write_text(json.dumps(metadata))
    config = load_config(None, [f"data.streams=[{{remote: {roots[0]}, name: web}}, {{remote: {roots[1]}, "
                                "name: books}]"])
    expected = (f"{roots[1]}: dataset block_size 32 != model block_size 64" if key == "block_size" else  # the model's
                f"data.streams.1 (books) at {roots[1]} has {key}={value!r}, data.streams.0 (web) {first!r}: a "
                "mixture's sources must share tokenizer, vocabulary, block size and dtype; reconvert one of them")
    assert refusal(lambda: open_dataset(config.data, 50257, 64)).startswith(expected)


def weighted(*weights: tuple[str | None, float | None]):
    overrides = [f"data.streams.{i}.remote=/data/{i}" for i in range(len(weights))]
    overrides += [f"data.streams.{i}.{kind}={value}" for i, (kind, value) in enumerate(weights) if kind]
    return sources(load_config(None, overrides).data)


def test_each_source_gets_its_weights_share_of_an_epoch_of_whole_steps():
    unit = BatchPlan(8, 4, 2).epoch_unit(1)
    # proportions share all the sources' samples (80), already whole steps
    assert samples_per_epoch(weighted(("proportion", 0.7), ("proportion", 0.3)), [50, 30], unit) == [56, 24]
    # repeat and choose: 30 + 14 = 44 samples cut to 40, shared 30:14 by largest remainder
    assert samples_per_epoch(weighted(("repeat", 1.5), ("choose", 14)), [20, 30], unit) == [27, 13]
    assert samples_per_epoch(weighted(("repeat", 2.0), ("choose", 8)), [20, 30], unit) == [40, 8]  # fits: kept
    assert samples_per_epoch(weighted((None, None), (None, None)), [20, 30], unit) == [19, 29]  # 48 of 50
    assert samples_per_epoch(sources(load_config(None, ["data.remote=/d"]).data), [44], unit) == [
        BatchPlan(8, 4, 2).epoch_samples(44, 1)]  # one dataset: as before mixtures
    assert samples_per_epoch(weighted(("choose", 3), ("choose", 4)), [20, 30], unit) == [0, 0]  # under a step
    assert "data.streams.1 (1) gives no sample to an epoch of 48: raise its proportion, or remove the source" in \
        refusal(lambda: samples_per_epoch(weighted(("proportion", 1.0), ("proportion", 0.001)), [20, 30], unit))
    assert apportion(10, [1, 1, 1]) == [4, 3, 3] and apportion(7, [0.1, 0.2, 0.7]) == [1, 1, 5]
    assert sum(apportion(10**15 + 7, [0.1, 0.2, 0.3])) == 10**15 + 7  # exact arithmetic: no sample lost to rounding


def test_realised_proportions_match_the_configured_ones_epoch_by_epoch(tmp_path):
    """Proportions 0.7 / 0.3 of 50 + 30 samples: 56 web samples an epoch (every one, 6 twice) and 24
    books (a different 24 each epoch), exactly per epoch and within binomial error part way through one."""
    from tokstream.reader import TrainBatches, open_dataset

    roots = {}
    for index, (name, samples) in enumerate((("web", 50), ("books", 30))):
        (tmp_path / name).mkdir()
        roots[name] = tiny_splits(tmp_path / name, samples, 8, seed=index)
    config = load_config(None, [f"data.streams=[{{remote: {roots['web']}, name: web, proportion: 0.7}}, "
                                f"{{remote: {roots['books']}, name: books, proportion: 0.3}}]"])
    dataset = open_dataset(config.data, 50257, 64)
    batches = TrainBatches(dataset, BatchPlan(8, 8, 1))
    assert batches.epoch_samples == [56, 24]
    books_drawn = []
    for epoch in range(3):
        ids = [i for _ in range(10) for i in next(batches)["ids"].tolist()]
        web, books = [i for i in ids if i < 50], [i for i in ids if i >= 50]
        assert list(batches.samples_per_source(ids)) == [56, 24] == [len(web), len(books)]
        assert set(web) == set(range(50)) and len(books) == len(set(books))
        books_drawn.append(frozenset(books))
    assert len(set(books_drawn)) == 3  # each epoch its own subset
    part = [i for _ in range(4) for i in next(batches)["ids"].tolist()]  # 32 samples into the 4th epoch
    share = batches.samples_per_source(part)[0] / len(part)
    assert abs(share - 0.7) <= 3 * math.sqrt(0.7 * 0.3 / len(part))
    # a mixture smaller than one step is refused at start-up, not left to hang its ranks
    with pytest.raises(UserError, match="the mixture's weights give an epoch of train fewer samples, fewer than "
                                        "one step's global_batch_size 96"):
        dataset.epoch_samples(BatchPlan(96, 8, 1))


def test_a_relaunch_may_move_or_rename_a_source_but_not_reweigh_or_add_one():
    from tokstream.train.resume_policy import check_relaunch

    saved = mixture_config().to_dict()
    moved = mixture_config("data.streams.0.remote=s3://bucket/web", "data.streams.0.local=/cache/web",
                           "data.streams.1.name=novels")
    assert check_relaunch(saved, moved, step=10) == [
        "data.streams.0.remote changed from '/data/web' to 's3://bucket/web'",
        "data.streams.0.local changed from None to '/cache/web'",
        "data.streams.1.name changed from None to 'novels'"]
    assert refusal(lambda: check_relaunch(saved, mixture_config("data.streams.1.proportion=0.4"), step=10)) == (
        "data.streams.1.proportion changed from 0.3 to 0.4 since the checkpoint: the mixture, and so the sample "
        "order, would change; keep it, or use a new run_dir")
    assert refusal(lambda: check_relaunch(saved, mixture_config("data.streams.2.remote=/data/code",
                                                                "data.streams.2.proportion=0.1"), step=10)) == (
        "data.streams: the checkpoint's run read a mixture of 2, this launch a mixture of 3: the mixture, and so "
        "the sample order, would change; keep it, or use a new run_dir")
    three = mixture_config("data.streams.2.remote=/data/code", "data.streams.2.proportion=0.1").to_dict()
    assert refusal(lambda: check_relaunch(three, mixture_config(), step=10)) == (  # a source dropped
        "data.streams: the checkpoint's run read a mixture of 3, this launch a mixture of 2: the mixture, and so "
        "the sample order, would change; keep it, or use a new run_dir")
    single = load_config(None, ["data.remote=/data/web"])
    assert "the checkpoint's run read one dataset (data.remote), this launch a mixture of 2" in refusal(
        lambda: check_relaunch(single.to_dict(), mixture_config(), step=10))
    before_mixtures = single.to_dict()
    del before_mixtures["data"]["streams"]  # a checkpoint written before data.streams existed
    assert check_relaunch(before_mixtures, single, step=10) == []


def test_the_example_config_mixes_two_real_corpora(dataset, tmp_path):
    """configs/tiny-mixture.yaml, pointed at the training tests' plays and at WikiText-2 from ../shared (in the
    plays' tokenizer: a mixture's sources share one)."""
    from tokstream.convert.options import ConversionOptions
    from tokstream.convert.sources import open_source
    from tokstream.convert.text_one_pass import convert_documents
    from tokstream.reader import open_dataset

    wiki = tmp_path / "wiki.txt"
    wiki.write_text((SHARED / "corpora" / "wikitext2_valid.txt").read_text()[:150_000])
    convert_documents(open_source([str(wiki)], txt_docs="line"), training_tokenizer(tmp_path), str(tmp_path / "wiki"),
                      ConversionOptions(block_size=64, val_fraction=0.05, progress=False))
    config = load_config(str(ROOT / "configs/tiny-mixture.yaml"), [f"data.streams.0.remote={dataset}",
                                                                   f"data.streams.1.remote={tmp_path / 'wiki'}"])
    mixed = open_dataset(config.data, config.model.vocab_size, config.model.block_size)
    counts = mixed.epoch_samples(BatchPlan(config.global_batch_size, config.micro_batch_size, 2))
    assert mixed.source_names == ["plays", "wiki"]
    assert sum(counts) % config.global_batch_size == 0
    assert counts[0] / sum(counts) == pytest.approx(0.7, abs=1 / sum(counts))


def test_plot_draws_each_sources_validation_loss(tmp_path):
    from train.plot import plot_runs

    records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "val_loss": 4.5,
                                          "val_loss_per_source": {"web": 4.0, "books": 5.0}}]
    run = tmp_path / "mix"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    labels, _ = plot_runs([str(run)], str(tmp_path / "loss.png"))
    assert labels == ["mix train", "mix val", "mix val books", "mix val web"]
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
