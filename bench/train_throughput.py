"""Training throughput fed by tokstream.reader's TrainBatches vs nanoGPT's get_batch, on the same model.

    python bench/train_throughput.py          # GPT-2 124M, bf16, torch.compile, on one CUDA GPU
    python bench/train_throughput.py --config configs/tiny.yaml --steps 4 --rounds 2   # CPU smoke run
    python bench/train_throughput.py micro_batch_size=16 compile=false                 # config overrides
    python bench/train_throughput.py --attention causal document --doc-length 400    # attention's cost

With --attention, the sources are the project loader feeding one model per attention (model.attention:
causal, or document with model.positions: document and each micro-batch's documents), the same weights,
on tokens where a document ends every --doc-length tokens on average.

One model, one optimizer and one loop: tokstream/train/trainer.py's step (a forward and backward pass per
micro-batch, gradient clipping, fused AdamW, one loss.item() sync per step). Only the batch
source differs:
- resident: one batch already on the device, reused: the loop with no data loading at all;
- memmap:   nanoGPT's get_batch on a train.bin (a memmap per call, random offsets, int64 x and y,
            pinned and copied without blocking);
- project:  the same tokens converted to MDS, read shuffled through tokstream.reader's TrainBatches with
            the settings train/main.py uses, then to_device.
The sources take turns in rounds, so clock or thermal drift affects all three equally.
data_wait = 1 - (tokens/s of the source) / (tokens/s of resident): the share of step time
lost to loading. host_wait = time spent in the call that returns the next batch, as a share of
step time. This is an upper bound: on a GPU the host queues a micro-batch's kernels and fetches
the next batch while they run, so most of that time is hidden.
"""

import argparse
import dataclasses
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from tokstream.reader import BatchPlan, TrainBatches, open_dataset, to_device  # noqa: E402
from tokstream.train.config import load_config  # noqa: E402
from tokstream.train.model import GPT, peak_bf16_flops  # noqa: E402
from tokstream.train.trainer import max_documents, model_inputs  # noqa: E402

GPT2_VOCAB, GPT2_EOT = 50257, 50256


def build_token_files(workdir: Path, million_tokens: int, block_size: int, doc_length: int = 0) -> tuple[Path, Path]:
    """Random GPT-2 token ids (the loop does not care what they say) as train.bin and as MDS; with `doc_length`,
    a separator ends a document every doc_length tokens on average."""
    from tokstream.convert.options import ConversionOptions
    from tokstream.convert.token_conversion import Vocabulary, convert_token_files
    from tokstream.convert.token_files import open_token_file

    bin_path = workdir / "train.bin"
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, GPT2_VOCAB - bool(doc_length), size=million_tokens * 1_000_000, dtype=np.uint16)
    if doc_length:  # documents of doc_length tokens on average, each ended by the separator
        tokens[rng.random(tokens.size) < 1 / doc_length] = GPT2_EOT
    tokens.tofile(bin_path)
    mds_root = workdir / "mds"
    convert_token_files({"train": [open_token_file(bin_path)]}, str(mds_root),
                        Vocabulary("gpt2", None, GPT2_VOCAB, GPT2_EOT, "after"), ConversionOptions(block_size=block_size, progress=False))
    return bin_path, mds_root


def memmap_source(bin_path: Path, batch: int, block: int, device: torch.device):
    """nanoGPT's get_batch, in its logic."""
    def get_batch():
        tokens = np.memmap(bin_path, dtype=np.uint16, mode="r")  # re-opened per call, as nanoGPT does
        ix = torch.randint(len(tokens) - block, (batch,))
        x = torch.stack([torch.from_numpy(tokens[i:i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(tokens[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
        if device.type == "cuda":
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y, {}
    return get_batch


def project_source(config, batch: int, device: torch.device):
    """The trainer's reader (tokstream.reader.TrainBatches), epoch after epoch, through the trainer's model_inputs:
    with model.attention: document, each micro-batch's documents (and positions) as the model's keyword arguments."""
    batches = TrainBatches(open_dataset(config.data), BatchPlan(batch, batch, 1), pin_memory=device.type == "cuda",
                           max_documents=max_documents(config))
    return lambda: model_inputs(next(batches), device, config)


def run_steps(model, optimizer, next_batch, steps: int, accumulation: int, autocast, grad_clip: float,
              device: torch.device, fetch_ahead: bool = False) -> tuple[float, float]:
    """Wall seconds for `steps` optimizer steps, and the seconds of it spent inside next_batch.

    fetch_ahead: ask for the next micro-batch right after the forward pass is queued, as nanoGPT's
    train.py does, so the fetch overlaps the GPU's work also across the per-step loss sync.
    """
    host_wait = 0.0

    def fetch():
        nonlocal host_wait
        asked = time.perf_counter()
        batch = next_batch()
        host_wait += time.perf_counter() - asked
        return batch

    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    batch = fetch() if fetch_ahead else None
    for _ in range(steps):
        for _ in range(accumulation):
            inputs, targets, documents = batch if fetch_ahead else fetch()
            with autocast:
                loss = model(inputs, targets, **documents) / accumulation
            if fetch_ahead:
                batch = fetch()
            loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # train/main.py logs the loss every step: one sync per step
    return time.perf_counter() - started, host_wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs/gpt2-124m-owt.yaml"))
    parser.add_argument("--tokens", type=int, default=100, help="millions of random tokens in the dataset")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per source per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (compilation happens here)")
    parser.add_argument("--accumulation", type=int, default=None,
                        help="micro-batches per step (default: the config's global / micro batch)")
    parser.add_argument("--fetch-ahead", action="store_true",
                        help="fetch each micro-batch while the previous one runs, as nanoGPT's train.py does")
    parser.add_argument("--workdir", default=None, help="where to write the dataset (default: a temporary dir)")
    parser.add_argument("--attention", nargs="+", choices=("causal", "document"), default=None,
                        help="compare these attentions, each a model fed by the project loader")
    parser.add_argument("--doc-length", type=int, default=0, help="mean document length in the dataset (0: none)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value, as for train/main.py")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.workdir, ignore_cleanup_errors=True) as tmp:
        config = load_config(args.config, [*args.overrides, f"data.remote={Path(tmp) / 'mds'}"])
        micro, block = config.micro_batch_size, config.model.block_size
        accumulation = args.accumulation or config.global_batch_size // micro
        bin_path, _ = build_token_files(Path(tmp), args.tokens, block, args.doc_length)

        use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        device = torch.device("cuda" if use_cuda else "cpu")
        autocast = torch.autocast("cuda", dtype=getattr(torch, config.dtype)) if use_cuda else nullcontext()

        def with_attention(attention: str):
            model = dataclasses.replace(config.model, attention=attention,
                                        positions="document" if attention == "document" else "absolute")
            return dataclasses.replace(config, model=model)

        def build(attention: str) -> tuple:
            torch.manual_seed(config.seed)  # the same weights for every attention
            raw = GPT(with_attention(attention).model).to(device)
            optimizer = raw.optimizer(config.optim.lr, config.optim.weight_decay,
                                      (config.optim.beta1, config.optim.beta2), device.type)
            return raw, (torch.compile(raw) if config.compile else raw), optimizer

        if args.attention:
            sources, models = {}, {}
            for attention in args.attention:
                name = f"attention={attention}"
                sources[name] = project_source(with_attention(attention), micro, device)
                models[name] = build(attention)
        else:
            if config.model.attention != "causal":
                raise SystemExit("the memmap and resident sources have no documents: measure document attention "
                                 "with --attention causal document")
            memmap = memmap_source(bin_path, micro, block, device)
            resident_batch = memmap()
            sources = {"resident (no loading)": lambda: resident_batch, "memmap get_batch": memmap,
                       "project loader": project_source(config, micro, device)}
            models = dict.fromkeys(sources, build(config.model.attention))
        raw_model = next(iter(models.values()))[0]

        def run(source: str, steps: int) -> tuple[float, float]:
            _, model, optimizer = models[source]
            return run_steps(model, optimizer, sources[source], steps, accumulation, autocast,
                             config.optim.grad_clip, device, args.fetch_ahead)

        if args.attention:
            for name in sources:
                run(name, args.warmup)  # each model compiles
        else:
            run("resident (no loading)", args.warmup)  # compiles
            for name in sources:
                run(name, 1)  # each source's own first-call costs: pinned pool, streaming's threads
        totals = {name: [0.0, 0.0] for name in sources}
        for _ in range(args.rounds):
            for name in sources:
                seconds, host_wait = run(name, args.steps)
                totals[name][0] += seconds
                totals[name][1] += host_wait

        tokens = args.rounds * args.steps * accumulation * micro * block
        peak = peak_bf16_flops() if use_cuda else None
        flops_per_token = raw_model.flops_per_token()
        where = torch.cuda.get_device_name() if use_cuda else "cpu"
        precision = config.dtype if use_cuda else "float32"
        print(f"device {where}; GPT {raw_model.num_params() / 1e6:.1f}M parameters; {precision}"
              f"{', compiled' if config.compile else ''}; {micro} x {block} tokens x {accumulation} micro-batches "
              f"= {micro * block * accumulation:,} tokens/step; {args.rounds} rounds x {args.steps} steps per source"
              f"{'; batches fetched one ahead' if args.fetch_ahead else ''}")
        print(f"{'source':24s} {'tokens/s':>12s} {'MFU':>7s} {'data_wait':>10s} {'host_wait':>10s}")
        rates = {name: tokens / seconds for name, (seconds, _) in totals.items()}
        if args.attention:
            for name, (seconds, host_wait) in totals.items():
                mfu = f"{flops_per_token * rates[name] / peak:7.1%}" if peak else f"{'-':>7s}"
                print(f"{name:24s} {rates[name]:12,.0f} {mfu} {'':>10s} {host_wait / seconds:10.2%}")
            if len(rates) == 2:
                print(f"ratio_document_vs_causal={rates['attention=document'] / rates['attention=causal']:.3f} "
                      "(MFU counts causal attention's FLOPs for both)")
            return
        ceiling = rates["resident (no loading)"]
        for name, (seconds, host_wait) in totals.items():
            mfu = f"{flops_per_token * rates[name] / peak:7.1%}" if peak else f"{'-':>7s}"
            print(f"{name:24s} {rates[name]:12,.0f} {mfu} {1 - rates[name] / ceiling:10.2%} "
                  f"{host_wait / seconds:10.2%}")
        print(f"ratio_project_vs_memmap={rates['project loader'] / rates['memmap get_batch']:.3f} "
              f"data_wait_project={1 - rates['project loader'] / ceiling:.2%} "
              f"data_wait_memmap={1 - rates['memmap get_batch'] / ceiling:.2%}")


if __name__ == "__main__":
    from tokstream.testing.lock_files import removing_new_lock_files

    with removing_new_lock_files():
        main()
