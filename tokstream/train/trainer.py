"""Training GPT-2 from a converted dataset: `setup` builds a run, `train` is the loop.

Where a sample is produced: `next(run.batches)` (tokstream.reader.TrainBatches) pulls a micro-batch from
TokenLoader (token_loader.py), which takes the rank's share of streaming's shuffled sample order a
micro-batch at a time from TokenDataset.get_batch (token_dataset.py), stacked into (pinned) host
memory; to_device widens the tokens on the device.
"""

import os
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from tokstream.errors import StoreError, UserError, no_space, out_of_space
from tokstream.reader import (BatchPlan, Dataset, TrainBatches, eval_batches, open_dataset, remove_stale_shared_memory,
                              to_device)
from tokstream.train.checkpoint import Checkpointer, Progress, find_latest
from tokstream.train.config import TrainConfig
from tokstream.train.distributed import Distributed
from tokstream.train.grace import budget_line, measure_write_rate, notice_line, state_bytes
from tokstream.train.metrics import METRICS_FILE, MetricsLog, console_line
from tokstream.train.model import GPT, peak_bf16_flops
from tokstream.train.preemption import PreemptionWatch
from tokstream.train.resume_policy import check_relaunch
from tokstream.train.run_lease import RunLease
from tokstream.train.rng import RankRNG
from tokstream.train.run_store import RunStore, S3RunStore, open_run_store
from tokstream.train.schedule import learning_rate


@dataclass
class Run:
    """Everything the loop uses; the stateful parts are also the checkpoint's components."""

    config: TrainConfig
    dist: Distributed
    plan: BatchPlan
    raw_model: GPT  # what is checkpointed
    model: torch.nn.Module  # what is called: compiled and/or wrapped in DDP
    optimizer: torch.optim.Optimizer
    batches: TrainBatches
    source_names: list[str]  # the mixture's, in data.streams order
    val_loaders: dict[str, Iterable[dict]]  # per source with a val split
    val_weights: dict[str, float]  # each one's share of an epoch: val_loss is their weighted mean
    progress: Progress
    store: RunStore
    checkpointer: Checkpointer
    metrics: MetricsLog
    preemption: PreemptionWatch
    autocast: object
    peak_flops: float | None
    lease: RunLease | None  # rank 0's: one live job per run_dir


def setup(config: TrainConfig) -> Run:
    """Build the run; with a checkpoint in run_dir, check it fits and continue from it."""
    if config.deterministic:
        use_deterministic_kernels()
    dist = Distributed.start(config.device)
    plan = BatchPlan(config.global_batch_size, config.micro_batch_size, dist.world)
    dataset = open_dataset(config.data, config.model.vocab_size, config.model.block_size)
    epoch_line = dataset.describe_epoch(plan)  # refuses a split too small for one step
    if dist.master:
        print(epoch_line)
    store = open_run_store(config.run_dir, config.run_local, check_writable=dist.master)
    lease = hold_the_lease(store, config.lease_interval_s, dist)
    try:
        return _build(config, dist, plan, dataset, store, lease)
    except BaseException:  # a refused relaunch gives the lease back at once, not at its process's exit
        if lease is not None:
            lease.release()
        raise


def _build(config: TrainConfig, dist: Distributed, plan: BatchPlan, dataset: Dataset, store: RunStore,
           lease: RunLease | None) -> Run:
    """setup()'s part under the run's lease: resume or start, and everything the loop uses."""
    checkpoint_url, saved = find_latest(store, dist)
    if saved is not None:  # before anything is built: a refused relaunch changes nothing
        old = saved["run"]
        if saved["progress"]["step"] > config.max_steps:
            raise UserError(f"max_steps={config.max_steps} is below the step of {checkpoint_url}, "
                            f"{saved['progress']['step']}: raise max_steps, or point run_dir elsewhere")
        changes = [*check_relaunch(old["config"], config), plan.describe_change(old["batch_plan"])]
        dataset.check_resumes(old["dataset_identity"])
        if dist.master:
            for change in filter(None, changes):
                print(f"relaunch: {change}")

    torch.manual_seed(config.seed)  # identical initial weights on every rank
    raw_model = GPT(config.model).to(dist.device)
    optimizer = raw_model.optimizer(config.optim.lr, config.optim.weight_decay,
                                    (config.optim.beta1, config.optim.beta2), dist.device.type)
    if config.data.clean_stale_shared_memory:
        if dist.local_rank == 0:  # once per node, before any rank registers its datasets
            removed = remove_stale_shared_memory(dataset.cache_dirs)
            if removed:
                print(f"removed {len(removed)} shared-memory blocks a killed run of this dataset left behind")
        dist.barrier()
    use_cuda = dist.device.type == "cuda"
    batches = TrainBatches(dataset, plan, pin_memory=use_cuda, reuse_buffers=True)  # each goes to the device at once
    val_loaders = validation_loaders(config, dataset, dist, pin_memory=use_cuda)
    model = torch.compile(raw_model) if config.compile else raw_model
    autocast = torch.autocast("cuda", dtype=getattr(torch, config.dtype)) if use_cuda else nullcontext()
    if dist.enabled:
        model = DDP(model, device_ids=[dist.local_rank] if use_cuda else None)
        settle_gradient_buckets(model, optimizer, config, dist.device, autocast)

    progress, rng = Progress(), RankRNG(dist)
    rng.seed(config.seed)
    metrics = MetricsLog(store.local, enabled=dist.master)
    in_store = isinstance(store, S3RunStore)  # the metrics are written here and uploaded with each checkpoint
    checkpointer = Checkpointer(store, config.keep_checkpoints, dist,
                                components={"model": raw_model, "optimizer": optimizer, "loader": batches,
                                            "rng": rng, "progress": progress},
                                run_record={"config": config.to_dict(), "batch_plan": plan.state_dict(),
                                            "dataset_identity": dataset.identity},
                                metrics_path=metrics.path if in_store else None)
    if saved is not None:
        checkpointer.restore(saved)
        if dist.master:
            print(f"resumed from {checkpoint_url} at step {progress.step}")
    if in_store and dist.master:
        metrics.replace(store.read_bytes(METRICS_FILE) or b"")
        print(f"metrics: {metrics.path} (a copy goes to {store.url} with each checkpoint)")
    metrics.truncate_after(progress.step)
    shares = {name: count / sum(batches.epoch_samples) for name, count in zip(dataset.source_names, batches.epoch_samples)}
    return Run(config, dist, plan, raw_model, model, optimizer, batches, dataset.source_names, val_loaders,
               {name: shares[name] for name in val_loaders}, progress, store, checkpointer,
               metrics, PreemptionWatch(dist.device), autocast, peak_bf16_flops() if use_cuda else None, lease)


def settle_gradient_buckets(model: DDP, optimizer: torch.optim.Optimizer, config: TrainConfig,
                            device: torch.device, autocast) -> None:
    """One forward/backward of a dummy micro-batch, its gradients then dropped, so that every real step of
    every launch all-reduces its gradients in the same layout and a relaunch repeats the uninterrupted run's
    bits at any number of ranks.

    Why: DDP's first backward in a process all-reduces the gradients flattened in parameter order; the next
    forward rebuilds the buckets in the order the gradients became ready (the reverse, here). Over more than
    two ranks each element's sum (gloo's ring; NCCL too splits the buffer into chunks) adds the ranks'
    values in an order that depends on the element's offset in its bucket, so a relaunch's first step was
    summed otherwise than the uninterrupted run's same step: about 4 % of the gradient differed in its last
    bits at 4 ranks. Over two, a + b == b + a. (No DDP option keeps one layout for free: with bucket_cap_mb or
    gradient_as_bucket_view the buckets are still rebuilt after the first backward, with static_graph after
    the second; find_unused_parameters=True never rebuilds them, at the price of a traversal of the autograd
    graph at every step.)

    The dummy batch has the micro-batch's shape, so a compiled model compiles here rather than again; no
    RNG stream moves (fork_rng: the checkpoint's dropout streams) and no optimizer step is taken."""
    tokens = torch.zeros(config.micro_batch_size, config.model.block_size + 1, dtype=torch.long)
    inputs, targets = to_device({"tokens": tokens}, device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with autocast:
            loss = model(inputs, targets)
        loss.backward()
    optimizer.zero_grad(set_to_none=True)


def hold_the_lease(store: RunStore, interval_s: float, dist: Distributed) -> RunLease | None:
    """Rank 0 takes the run's lease for the job (run_lease.py) and returns it; every rank stops if it cannot."""
    refusal, lease = None, None
    if dist.master:
        try:
            lease = RunLease.acquire(store, interval_s)
        except (UserError, StoreError) as err:
            refusal = str(err)
        except OSError as err:
            refusal = f"cannot write the run's lease in {store.url}: " + (
                no_space(store.local, err) if out_of_space(err) else str(err))
    refusal = dist.gather(refusal)[0]
    if refusal is not None:
        raise UserError(refusal)
    return lease


def validation_loaders(config: TrainConfig, dataset: Dataset, dist: Distributed,
                       pin_memory: bool) -> dict[str, Iterable[dict]]:
    """A loader over each source's val split, for the sources that have one big enough."""
    if not config.eval_interval:
        return {}
    loaders, left_out = eval_batches(dataset, config.micro_batch_size, dist.world, pin_memory)
    if dist.master:
        for line in left_out:
            print(line)
    return loaders


def use_deterministic_kernels() -> None:
    """Kernels that give the same bits on every run, so a resumed GPU run repeats its losses exactly."""
    # cuBLAS reads this when its first handle is made, i.e. before the model's first matmul.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


# sysexits' EX_TEMPFAIL, "try again later": what a preempted rank exits with.
PREEMPTED_EXIT_STATUS = 75


def train(config: TrainConfig) -> bool:
    """Train until max_steps (True) or a preemption notice (False, after a checkpoint)."""
    run = setup(config)
    dist, model, optimizer, progress = run.dist, run.model, run.optimizer, run.progress
    accumulation = run.plan.accumulation
    tokens_per_step = config.global_batch_size * config.model.block_size
    flops_per_token = run.raw_model.flops_per_token()
    if dist.master:
        print(f"{run.raw_model.num_params() / 1e6:.2f}M parameters, {dist.world} ranks x {config.micro_batch_size} "
              f"samples x {accumulation} accumulation = {config.global_batch_size} samples/step, device {dist.device}")
    bar = tqdm(total=config.max_steps, initial=progress.step, unit="step", disable=not dist.master,
               dynamic_ncols=True)
    model.train()
    finished, first_step = True, progress.step
    while progress.step < config.max_steps:
        if run.preemption.should_stop():  # collective: every rank stops at this same step
            saving = time.monotonic()
            run.checkpointer.save(progress.step)
            bar.close()
            if dist.master:
                where = f"signal {run.preemption.received}" if run.preemption.received else "signal to another rank"
                done = time.monotonic()
                print(f"preempted ({where}): " + notice_line(progress.step, done - saving,
                                                             done - run.preemption.noticed_at, config.preempt_grace_s)
                      + ", exiting")
            finished = False
            break
        started = time.perf_counter()
        lr = learning_rate(progress.step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=dist.device)
        data_wait, sample_ids = 0.0, []
        for micro in range(accumulation):
            waited = time.perf_counter()
            batch = next(run.batches)
            data_wait += time.perf_counter() - waited
            inputs, targets = to_device(batch, dist.device)
            sample_ids.extend(batch["ids"].tolist())
            last = micro == accumulation - 1
            with nullcontext() if last or not dist.enabled else model.no_sync(), run.autocast:
                loss = model(inputs, targets) / accumulation  # gradients all-reduced on the last micro-batch
            loss.backward()
            loss_sum += loss.detach()
        if config.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step += 1

        step = progress.step
        record = {"step": step, "loss": dist.mean(loss_sum).item(), "lr": lr}
        if config.trace_samples:
            record["samples"] = dist.gather(sample_ids)
        if len(run.source_names) > 1:
            counts = torch.from_numpy(run.batches.samples_per_source(sample_ids)).to(dist.device)
            dist.sum(counts)
            record["samples_per_source"] = dict(zip(run.source_names, counts.tolist()))
        seconds = time.perf_counter() - started
        record.update(tokens_per_s=tokens_per_step / seconds, data_wait_s=data_wait, step_s=seconds)
        if run.peak_flops:
            record["mfu"] = flops_per_token * tokens_per_step / seconds / (run.peak_flops * dist.world)
        if run.val_loaders and step % config.eval_interval == 0:
            val_losses = evaluate(run)
            if val_losses is not None:
                record["val_loss"] = sum(run.val_weights[name] * loss for name, loss in val_losses.items()) / sum(
                    run.val_weights.values())
                if len(run.source_names) > 1:
                    record["val_loss_per_source"] = val_losses
            elif dist.master:
                bar.write(f"evaluation at step {step} stopped: preemption notice")
        run.metrics.write(record)
        bar.update(1)
        if dist.master and (step % config.log_interval == 0 or "val_loss" in record):
            bar.write(console_line(record))
        if step == first_step + 2 and dist.master:  # the first step warms up; the second is a fair measure
            bar.write(check_grace(run, seconds))
        if step == config.max_steps:
            run.checkpointer.save(step)
        elif step % config.checkpoint_interval == 0:
            run.checkpointer.save(step, background=config.background_checkpoints)
    bar.close()
    dist.close()
    if run.lease is not None:
        run.lease.release()
    return finished


def check_grace(run: Run, step_s: float) -> str:
    """Whether a step plus the saves fit in preempt_grace_s, from the checkpoint's size and the store's speed."""
    state = {"model": run.raw_model.state_dict(), "optimizer": run.optimizer.state_dict()}
    try:
        rate = measure_write_rate(run.store)
    except OSError as err:
        if not out_of_space(err):
            raise
        # A warning, as for a periodic save that fails: space may be freed before the next save.
        return (f"warning: {no_space(run.store.local, err)} for a 16 MiB write probe: checkpoints "
                f"({state_bytes(state) / 2**20:.1f} MiB each) cannot be saved until space is freed there")
    save_s = state_bytes(state) / rate
    return budget_line(step_s, save_s, run.config.background_checkpoints, run.config.preempt_grace_s)[1]


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float] | None:
    """Each source's mean loss over the first eval_batches micro-batches of every rank's val partition;
    None when a preemption notice arrives meanwhile (every rank stops at the same batch, and the run
    goes on to its checkpoint instead of outliving the notice's grace period)."""
    run.model.eval()
    totals = torch.zeros(len(run.val_loaders), 2, device=run.dist.device)
    preempted = False
    for total, loader in zip(totals, run.val_loaders.values()):
        for index, batch in enumerate(loader):
            if index >= run.config.eval_batches:
                break
            if run.preemption.should_stop():
                preempted = True
                break
            inputs, targets = to_device(batch, run.dist.device)
            with run.autocast:
                total[0] += run.model(inputs, targets).float()
            total[1] += 1
        if preempted:
            break
    run.dist.sum(totals)
    run.model.train()
    if preempted:
        return None
    return {name: (total[0] / total[1].clamp(min=1)).item() for name, total in zip(run.val_loaders, totals)}
