"""Document attention (model.attention: document): the reader's document structure, and the proof of the mask.

The proof: with document attention and positions that restart per document, the loss of a packed
micro-batch is the token-weighted loss of each of its documents run alone through the same model, for
samples of one document, two, many short ones, a document spanning two samples, and separators after
and before each document. Float32 on CPU: equal to rel 1e-5 (the sums run in another order). The same
batch with causal attention is not, which shows the comparison can fail.
"""

import numpy as np
import pytest
import torch

from tokstream.errors import UserError
from tokstream.reader import BatchPlan, DataConfig, TrainBatches, open_dataset
from tokstream.reader.documents import document_structure
from tokstream.train.config import ModelConfig
from tokstream.train.model import GPT

SEP = 63  # the tiny model's separator id


def model(attention: str = "document", positions: str = "document") -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, attention=attention,
                           positions=positions)).eval()


BLOCK = 16


def sample(*documents: list[int], where: str = "after", continued: bool = False) -> tuple[list[int], list[int]]:
    """Block 16 + 1 tokens of these documents (each a list of ids), separated as `where` says (`continued`: the
    first one began in the sample before, with no separator of its own); and, from how they were put together,
    how many of the 16 inputs each document holds (the truth the reader's structure is checked against)."""
    tokens, lengths = [], []
    for index, document in enumerate(documents):
        lead = where == "before" and not (index == 0 and continued)
        piece = ([SEP] if lead else []) + document + ([SEP] if where == "after" else [])
        lengths.append(max(0, min(len(piece), BLOCK - len(tokens))))
        tokens += piece
    assert len(tokens) > BLOCK, tokens
    return tokens[:BLOCK + 1], [length for length in lengths if length]


def packed_and_alone(net: GPT, samples: list[tuple[list[int], list[int]]], where: str) -> tuple[float, float]:
    """The summed loss of the micro-batch (its documents found by the reader's structure), and the sum over
    its documents as they were put together, each run alone (positions from 0)."""
    tokens = np.array([sample_tokens for sample_tokens, _ in samples], dtype=np.uint16)
    structure = document_structure(tokens, SEP, where, max_documents=64)
    batch = torch.from_numpy(tokens.astype(np.int64))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with torch.no_grad():
        packed = net(inputs, targets, structure["documents"].long(), structure["positions"].long()) * inputs.numel()
        alone = 0.0
        for row, (_, lengths) in enumerate(samples):
            start = 0
            for length in lengths:
                piece = slice(start, start + length)
                alone += float(net(inputs[row, piece][None], targets[row, piece][None], torch.zeros(1, length).long(),
                                   torch.arange(length)[None])) * length
                start += length
    return float(packed), alone


CASES = {
    "one document": ([sample(list(range(1, 20)))], "after"),
    "two documents": ([sample(list(range(1, 7)), list(range(10, 30)))], "after"),
    "many short ones": ([sample(*[[n, n + 1] for n in range(1, 40, 2)])], "after"),
    "a document spanning two samples": ([sample(list(range(1, 12)), list(range(20, 40))),
                                         sample(list(range(25, 29)), list(range(40, 60)), continued=True)], "after"),
    "separator before": ([sample(list(range(1, 5)), list(range(10, 14)), list(range(20, 40)), where="before"),
                          sample(list(range(3, 9)), list(range(30, 50)), where="before", continued=True)], "before"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_packed_micro_batch_has_the_loss_of_its_documents_run_alone(case):
    samples, where = CASES[case]
    packed, alone = packed_and_alone(model(), samples, where)
    assert packed == pytest.approx(alone, rel=1e-5)


def test_causal_attention_over_the_same_batch_is_not_its_documents_alone():
    samples, where = CASES["two documents"]
    packed, alone = packed_and_alone(model("causal", "absolute"), samples, where)
    assert packed != pytest.approx(alone, rel=1e-3)


def test_flex_attentions_block_mask_and_the_masked_sdpa_agree():
    """A GPU (or torch.compile) runs FlexAttention; without either, a masked SDPA: the same attention."""
    samples, where = CASES["many short ones"]
    tokens = np.array([sample_tokens for sample_tokens, _ in samples] * 2, dtype=np.uint16)
    structure = document_structure(tokens, SEP, where, max_documents=64)
    batch = torch.from_numpy(tokens.astype(np.int64))
    net = model()
    with torch.no_grad():
        losses = [float(net(batch[:, :-1], batch[:, 1:], structure["documents"].long(), structure["positions"].long(),
                            flex=flex)) for flex in (True, False)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="training's path on a GPU: compiled on CUDA")
def test_on_a_gpu_compiled_training_uses_flex_attention_and_it_is_the_masked_sdpa():
    """Compiled on a GPU, the model picks FlexAttention's block mask by itself; its loss and gradients are the
    masked SDPA's (the attention the proof above checks), float32, documents of about 50 tokens at block 256."""
    torch.manual_seed(1)
    net = GPT(ModelConfig(vocab_size=64, block_size=256, n_layer=2, n_head=2, n_embd=64, attention="document",
                          positions="document")).cuda()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SEP, size=(4, 257), dtype=np.uint16)
    tokens[rng.random(tokens.shape) < 0.02] = SEP
    structure = document_structure(tokens, SEP, "after", max_documents=64)
    assert structure["document_count"] > 12
    batch = torch.from_numpy(tokens.astype(np.int64)).cuda()
    arguments = (batch[:, :-1], batch[:, 1:], structure["documents"].long().cuda(), structure["positions"].long().cuda())
    masks, document_mask = [], net.document_mask
    net.document_mask = torch.compiler.disable(lambda documents, flex: masks.append(flex) or document_mask(documents,
                                                                                                             flex))

    def loss_and_gradients(forward, **flex):
        net.zero_grad()
        loss = forward(*arguments, **flex)
        loss.backward()
        return loss.item(), [parameter.grad.clone() for parameter in net.parameters()]

    compiled = loss_and_gradients(torch.compile(net))
    sdpa = loss_and_gradients(net, flex=False)
    assert masks == [True, False]
    assert compiled[0] == pytest.approx(sdpa[0], rel=1e-5)
    for flex_gradient, sdpa_gradient in zip(compiled[1], sdpa[1]):
        torch.testing.assert_close(flex_gradient, sdpa_gradient, rtol=1e-4, atol=1e-6)


def test_the_structure_of_a_micro_batch_and_more_documents_than_its_maximum():
    tokens = np.array([[5, SEP, 6, 7, SEP, 8, SEP], [9, 9, SEP, 4, 4, 4, 4]], dtype=np.uint16)  # block 6
    structure = document_structure(tokens, SEP, "after", max_documents=8)
    assert structure["documents"].tolist() == [[0, 0, 1, 1, 1, 2], [3, 3, 3, 4, 4, 4]]
    assert structure["positions"].tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 0, 1, 2]]
    assert structure["cu_seqlens"].tolist() == [0, 2, 5, 6, 9, 12, 12, 12, 12]  # padded with the total
    assert structure["cu_seqlens"].dtype == torch.int32
    assert structure["document_count"] == 5
    before = document_structure(tokens, SEP, "before", max_documents=8)
    assert before["documents"].tolist() == [[0, 1, 1, 1, 2, 2], [3, 3, 4, 4, 4, 4]]
    assert before["positions"].tolist() == [[0, 0, 1, 2, 0, 1], [0, 1, 0, 1, 2, 3]]
    # more documents than max_documents: the last sequence holds the rest; indices and positions stay exact
    few = document_structure(tokens, SEP, "after", max_documents=3)
    assert few["cu_seqlens"].tolist() == [0, 2, 5, 12]
    assert few["documents"].tolist() == structure["documents"].tolist()
    assert few["positions"].tolist() == structure["positions"].tolist()


@pytest.mark.parametrize("order", ["auto", "lazy"])
def test_the_reader_gives_each_micro_batch_its_documents_from_the_datasets_separator(dataset, order):
    """A real corpus (Tiny Shakespeare, a document per paragraph, block 64: several per sample), in the order
    `auto` gives it (py1e) and in the lazy order."""
    opened = open_dataset(DataConfig(remote=str(dataset), shuffle_algo=order))
    separator = opened.metadata[0].separator_id
    batches = TrainBatches(opened, BatchPlan(8, 4, 1), max_documents=32)
    for _ in range(3):
        batch = next(batches)
        inputs = batch["tokens"].numpy()[:, :-1]
        starts = np.zeros(inputs.shape, dtype=bool)
        starts[:, 0] = True
        starts[:, 1:] = inputs[:, :-1] == separator
        assert ((batch["positions"].numpy() == 0) == starts).all()
        assert (np.diff(batch["documents"].numpy().ravel()) == starts.ravel()[1:]).all()
        assert starts.sum() > 4  # packed: more documents than samples
        cu = batch["cu_seqlens"].numpy()
        assert cu[0] == 0 and (np.diff(cu) >= 0).all() and cu[-1] == inputs.size
    batches.close()
    with pytest.raises(UserError, match="max_documents must be a positive whole number, got 0"):
        TrainBatches(opened, BatchPlan(8, 4, 1), max_documents=0)


def test_document_attention_resumes_exactly_after_sigterm_sigkill_and_on_another_world_size(dataset, tmp_path):
    """Against an uninterrupted run (2 ranks x 4, document attention and positions, in the lazy order, which
    `auto` gives datasets from 2^24 samples): SIGTERM part way, SIGKILL just after a checkpoint, then 1 rank to the
    end. Every step's samples per rank; losses bitwise on the reference's settings, to float rounding once on 1
    rank."""
    import signal

    from test_phases import Output
    from test_training import launch, metrics, train

    from tokstream.train.checkpoint_files import latest_step
    from tokstream.train.run_store import LocalRunStore

    common = ["max_steps=12", "optim.decay_steps=12", "checkpoint_interval=4", "eval_interval=4",
              "model.attention=document", "model.positions=document", "data.shuffle_algo=lazy"]
    train(2, dataset, tmp_path / "reference", *common)
    reference = metrics(tmp_path / "reference")
    run_dir, store = tmp_path / "interrupted", LocalRunStore(str(tmp_path / "interrupted"))
    first = Output(launch(2, dataset, run_dir, *common, warm=True))
    first.wait_for(lambda text: len(metrics(run_dir)) >= 3)
    first.process.send_signal(signal.SIGTERM)
    assert "preempted (signal" in first.finish()
    stopped = latest_step(store)
    # Checkpointing every step, killed right after its first: steps to spare before the run's end at 12.
    killed = Output(launch(2, dataset, run_dir, *common, "checkpoint_interval=1", warm=True))
    killed.wait_for(lambda text: (latest_step(store) or 0) > stopped)
    killed.process.kill_tree()
    killed.finish()
    kept = latest_step(store)
    assert killed.process.returncode == -signal.SIGKILL and 3 <= stopped < kept < 12, (stopped, kept)
    last = Output(launch(1, dataset, run_dir, *common, "micro_batch_size=8", warm=True)).finish()
    assert "resumed from" in last and "relaunch: resuming a 2-rank run on 1 ranks" in last, last[-3000:]
    interrupted = metrics(run_dir)
    assert [m["step"] for m in interrupted] == [m["step"] for m in reference] == list(range(1, 13))
    for got, want in zip(interrupted, reference):
        assert sorted(sum(got["samples"], [])) == sorted(sum(want["samples"], [])), got["step"]
        if got["step"] <= kept:
            assert got["samples"] == want["samples"] and got["loss"] == want["loss"], got["step"]
        else:
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), got["step"]
    evaluated = [(got["val_loss"], want["val_loss"]) for got, want in zip(interrupted, reference)
                 if "val_loss" in got]  # with the same attention; one a SIGTERM stopped has none
    assert len(evaluated) >= 2 and all(got == pytest.approx(want, rel=1e-4) for got, want in evaluated)


def test_settings_and_calls_that_cannot_work_are_refused_in_one_line(dataset):
    with pytest.raises(UserError, match="^model.dropout with model.attention=document: FlexAttention"):
        GPT(ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=1, n_embd=8, attention="document",
                        dropout=0.1))
    with pytest.raises(UserError, match="^model.positions=document needs model.attention=document"):
        GPT(ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=1, n_embd=8, positions="document"))
    tokens = torch.ones(1, 17, dtype=torch.long)
    with pytest.raises(UserError, match=r"needs each token's documents= \(and with positions=document"):
        model()(tokens[:, :-1], tokens[:, 1:])
    batches = TrainBatches(open_dataset(DataConfig(remote=str(dataset))), BatchPlan(8, 4, 1), max_documents=2)
    with pytest.warns(UserWarning, match=r"documents, more than max_documents 2: its cu_seqlens merges the last ones"):
        batch = next(batches)
    assert batch["document_count"] > 2 and batch["cu_seqlens"].tolist()[-1] == batch["tokens"][:, :-1].numel()
    batches.close()
    import warnings

    again = TrainBatches(open_dataset(DataConfig(remote=str(dataset))), BatchPlan(8, 4, 1), max_documents=2)
    with warnings.catch_warnings(record=True) as caught:  # once per process: a run opens several readers
        warnings.simplefilter("always")
        next(again)
    assert not [w for w in caught if "max_documents" in str(w.message)]
    again.close()
