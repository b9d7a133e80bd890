"""Train GPT-2 from a converter's MDS dataset; survives preemption and resumes at the exact sample.

    torchrun --nproc_per_node=8 train/main.py configs/gpt2-124m-owt.yaml data.remote=data/owt
    torchrun --nproc_per_node=2 train/main.py configs/tiny.yaml data.remote=demo/data run_dir=demo/run

Relaunching the same command resumes from the newest complete checkpoint in run_dir.
"""

import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from tqdm import tqdm  # noqa: E402

import data  # noqa: E402
from checkpoint import load_latest_checkpoint, save_checkpoint  # noqa: E402
from config import TrainConfig, load_config  # noqa: E402
from model import GPT, peak_bf16_flops  # noqa: E402
from preemption import PreemptionWatch  # noqa: E402
from stale_shm import remove_stale_shared_memory  # noqa: E402
from tokstream.errors import UserError  # noqa: E402
from tokstream.format import check_compatible, read_metadata  # noqa: E402


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr."""
    optim = config.optim
    decay_steps = optim.decay_steps or config.max_steps
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if step >= decay_steps:
        return optim.min_lr
    progress = (step - optim.warmup_steps) / max(1, decay_steps - optim.warmup_steps)
    return optim.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def check_resumable(saved: dict, config: TrainConfig, world: int, identity: str) -> None:
    """What exact resumption needs to be unchanged; the rest (ranks, accumulation) may change."""
    old = saved["config"]
    if saved["dataset_identity"] != identity:
        raise UserError("the dataset differs from the one the checkpoint was trained on; use a new run_dir")
    for key in ("shuffle_seed", "shuffle_algo", "num_canonical_nodes", "shuffle_block_size", "split"):
        if old["data"][key] != getattr(config.data, key):
            raise UserError(f"data.{key} changed from {old['data'][key]!r} to {getattr(config.data, key)!r}: "
                            "the sample order would change; keep it, or use a new run_dir")
    if old["global_batch_size"] != config.global_batch_size:
        raise UserError(f"global_batch_size changed from {old['global_batch_size']} to "
                        f"{config.global_batch_size}: resuming needs the same global batch")
    if old["model"] != config.to_dict()["model"]:
        raise UserError("the model config differs from the checkpoint's; use a new run_dir")
    if saved["world_size"] != world:
        print(f"resuming a {saved['world_size']}-rank run on {world} ranks: same global batch and sample "
              "order; losses match to float rounding, not bitwise")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    config = load_config(sys.argv[1], sys.argv[2:])

    distributed = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    master = rank == 0

    per_step = config.micro_batch_size * world
    if config.global_batch_size % per_step:
        raise UserError(f"global_batch_size {config.global_batch_size} is not a multiple of micro_batch_size "
                        f"{config.micro_batch_size} x {world} ranks")
    accumulation = config.global_batch_size // per_step
    index_root = data.fetch_index_files(config.data)  # downloaded once, when remote
    metadata = read_metadata(index_root)
    check_compatible(metadata, config.model.vocab_size, config.model.block_size, config.data.remote)
    identity = data.dataset_identity(index_root, config.data.split)

    run_dir = Path(config.run_dir)
    if master:
        run_dir.mkdir(parents=True, exist_ok=True)
    if distributed:
        dist.barrier()
    checkpoint_file, saved = load_latest_checkpoint(run_dir)
    if saved is not None:
        check_resumable(saved, config, world, identity)

    torch.manual_seed(config.seed)  # identical initial weights on every rank
    model = GPT(config.model).to(device)
    optimizer = model.optimizer(config.optim.lr, config.optim.weight_decay,
                                (config.optim.beta1, config.optim.beta2), device.type)
    step = 0
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        if saved["world_size"] == world:
            set_rng_state(saved["rng"][rank])
        if master:
            print(f"resumed from {checkpoint_file} at step {step}")
    else:
        random.seed(config.seed + rank)
        np.random.seed(config.seed + rank)
        torch.manual_seed(config.seed + rank)

    if config.data.clean_stale_shared_memory:
        if local_rank == 0:  # once per node, before any rank registers its datasets
            removed = remove_stale_shared_memory(data.cache_dirs(config.data))
            if removed:
                print(f"removed {len(removed)} shared-memory blocks a killed run of this dataset left behind")
        if distributed:
            dist.barrier()
    train_loader = data.make_loader(config.data, config.data.split, config.micro_batch_size, shuffle=True,
                                    pin_memory=use_cuda)
    if saved is not None:
        train_loader.load_state_dict(saved["loader"])
    has_val = config.data.val_split in metadata.splits
    val_loader = data.make_loader(config.data, config.data.val_split, config.micro_batch_size, shuffle=False,
                                  pin_memory=use_cuda, num_workers=0) if has_val and config.eval_interval else None

    raw_model = model
    if config.compile:
        model = torch.compile(model)
    if distributed:
        model = DDP(model, device_ids=[local_rank] if use_cuda else None)
    autocast = torch.autocast("cuda", dtype=getattr(torch, config.dtype)) if use_cuda else nullcontext()

    def batches():
        while True:  # epoch after epoch; streaming picks up the next epoch on each new iterator
            yield from train_loader

    stream = batches()
    preemption = PreemptionWatch(device)
    metrics_path = run_dir / "metrics.jsonl"
    if master:
        _truncate_metrics(metrics_path, step)
    tokens_per_step = config.global_batch_size * config.model.block_size
    peak = peak_bf16_flops() if use_cuda else None
    flops_per_token = raw_model.flops_per_token()
    if master:
        print(f"{raw_model.num_params() / 1e6:.2f}M parameters, {world} ranks x {config.micro_batch_size} samples "
              f"x {accumulation} accumulation = {config.global_batch_size} samples/step, device {device}")

    def checkpoint_state() -> dict:
        rngs = [None] * world
        if distributed:
            dist.all_gather_object(rngs, rng_state())
        else:
            rngs = [rng_state()]
        return {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "loader": train_loader.state_dict(), "rng": rngs, "config": config.to_dict(),
                "world_size": world, "accumulation": accumulation, "dataset_identity": identity}

    def save() -> None:
        state = checkpoint_state()  # collective: every rank takes part
        if master:
            save_checkpoint(run_dir, step, state, config.keep_checkpoints)
        if distributed:
            dist.barrier()

    bar = tqdm(total=config.max_steps, initial=step, unit="step", disable=not master, dynamic_ncols=True)
    model.train()
    while step < config.max_steps:
        if preemption.should_stop():
            save()
            if master:
                bar.close()
                print(f"preempted (signal {preemption.received}): saved checkpoint at step {step}, exiting")
            break
        started = time.perf_counter()
        lr = learning_rate(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        data_wait = 0.0
        sample_ids = []
        for micro in range(accumulation):
            waited = time.perf_counter()
            batch = next(stream)
            data_wait += time.perf_counter() - waited
            inputs, targets = data.to_device(batch, device)
            sample_ids.extend(batch["ids"].tolist())
            sync = nullcontext() if not distributed or micro == accumulation - 1 else model.no_sync()
            with sync, autocast:
                loss = model(inputs, targets) / accumulation
            loss.backward()
            loss_sum += loss.detach()
        if config.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if distributed:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
            loss_sum /= world
        record = {"step": step, "loss": loss_sum.item(), "lr": lr}
        if config.trace_samples:
            gathered = [None] * world
            if distributed:
                dist.all_gather_object(gathered, sample_ids)
            else:
                gathered = [sample_ids]
            record["samples"] = gathered
        seconds = time.perf_counter() - started
        record.update(tokens_per_s=tokens_per_step / seconds, data_wait_s=data_wait, step_s=seconds)
        if peak:
            record["mfu"] = flops_per_token * tokens_per_step / seconds / (peak * world)
        if val_loader is not None and step % config.eval_interval == 0:
            record["val_loss"] = evaluate(model, val_loader, config, device, autocast, distributed, world)
        if master:
            with open(metrics_path, "a") as out:
                out.write(json.dumps(record) + "\n")
            bar.update(1)
            if step % config.log_interval == 0 or "val_loss" in record:
                val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
                bar.write(f"step {step} loss {record['loss']:.4f}{val} lr {lr:.2e} "
                          f"{record['tokens_per_s']:,.0f} tok/s data_wait {data_wait * 1e3:.1f} ms"
                          + (f" mfu {record['mfu']:.1%}" if peak else ""))
        if step % config.checkpoint_interval == 0 or step == config.max_steps:
            save()
    bar.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


@torch.no_grad()
def evaluate(model, loader, config: TrainConfig, device, autocast, distributed: bool, world: int) -> float:
    """Mean loss over the first eval_batches micro-batches of every rank's val partition."""
    model.eval()
    total = torch.zeros(2, device=device)
    for index, batch in enumerate(loader):
        if index >= config.eval_batches:
            break
        inputs, targets = data.to_device(batch, device)
        with autocast:
            total[0] += model(inputs, targets).float()
        total[1] += 1
    if distributed:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1].clamp(min=1)).item()


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop lines for steps after the checkpoint we resume from: they will be trained again."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    temporary = path.with_suffix(".tmp")
    temporary.write_text("".join(line + "\n" for line in kept))
    os.replace(temporary, path)


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
