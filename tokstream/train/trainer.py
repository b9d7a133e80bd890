"""Training GPT-2 from a converted dataset: `setup` builds a run, `train` is the loop.

Where a sample is produced: `next(run.batches)` (the phase's tokstream.reader.TrainBatches: phased_batches.py)
pulls a micro-batch from
TokenLoader (token_loader.py), which takes the rank's share of streaming's shuffled sample order a
micro-batch at a time from TokenDataset.get_batch (token_dataset.py), stacked into (pinned) host
memory; to_device widens the tokens on the device.
"""

import dataclasses
import gc
import json
import os
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from tokstream.errors import StoreError, UserError, no_space, out_of_space
from tokstream.reader import (BatchPlan, Dataset, eval_batches, read_digest, read_sums, remove_stale_shared_memory,
                              to_device)
from tokstream.train.checkpoint import Checkpointer, Progress, find_latest
from tokstream.train.checkpoint_files import Survey, publish_pointer, stopped_by
from tokstream.train.config import TrainConfig
from tokstream.train.dashboards import DashboardState, Dashboards, Takeover
from tokstream.train.distributed import Distributed, peer_gone
from tokstream.train.grace import budget_line, measure_write_rate, notice_line, state_bytes
from tokstream.train.metrics import METRICS_FILE, MetricsLog, console_line
from tokstream.train.model import GPT, peak_bf16_flops
from tokstream.train.phased_batches import PhasedBatches
from tokstream.train.phases import Phase, Recipe
from tokstream.train.preemption import PREEMPTED_EXIT_STATUS, PreemptionWatch
from tokstream.train.resume_policy import check_relaunch, keep_guard_rewinds, keep_run_order
from tokstream.train.rewind import rewind, rewind_target
from tokstream.train.spike_guard import SpikeGuard, advice, rewind_plan
from tokstream.train.run_lease import RunLease
from tokstream.train.rng import RankRNG
from tokstream.train.run_store import RunStore, S3RunStore, open_run_store
from tokstream.train.schedule import in_tokens, learning_rate


@dataclass
class Run:
    """Everything the loop uses; the stateful parts are also the checkpoint's components."""

    config: TrainConfig
    dist: Distributed
    recipe: Recipe  # the phases (one without `phases`), their data opened
    raw_model: GPT  # what is checkpointed
    model: torch.nn.Module  # what is called: compiled and/or wrapped in DDP
    optimizer: torch.optim.Optimizer
    batches: PhasedBatches
    progress: Progress
    store: RunStore
    checkpointer: Checkpointer
    metrics: MetricsLog
    preemption: PreemptionWatch
    autocast: object
    peak_flops: float | None
    lease: RunLease | None  # rank 0's: one live job per run_dir
    # The phase being trained, set by enter_phase, and what it reads:
    phase: Phase | None = None
    plan: BatchPlan | None = None
    source_names: list[str] | None = None  # its data's sources, in data.streams order
    val_loaders: dict[str, Iterable[dict]] | None = None  # per source with a val split
    val_weights: dict[str, float] | None = None  # each one's share of an epoch: val_loss is their weighted mean
    guard: SpikeGuard | None = None  # guard.zscore > 0: the loss-spike guard, a checkpoint component
    dashboards: Dashboards = field(default_factory=Dashboards)  # log.tensorboard, log.wandb (rank 0)
    relaunch: dict | None = None  # a resumed launch: from which step, after what; its first line in metrics.jsonl


def setup(config: TrainConfig, watch: PreemptionWatch | None = None) -> Run:
    """Build the run; with a checkpoint in run_dir, check it fits and continue from it. `watch`: the preemption watch
    the launch installed before anything long began."""
    if config.deterministic:
        use_deterministic_kernels()
    dist = Distributed.start(config.device)
    in_tokens(config)  # refuses half a token schedule
    recipe = Recipe.open(config, dist.world)
    for line in recipe.describe_epochs() + recipe.unreached(config.max_steps):  # refuses a split too small
        if dist.master:
            print(line)
    store = open_run_store(config.run_dir, config.run_local, check_writable=dist.master)
    lease = hold_the_lease(store, config.lease_interval_s, dist)
    try:
        return _build(config, dist, recipe, store, lease, watch=watch)
    except BaseException:  # a refused relaunch gives the lease back at once, not at its process's exit
        if lease is not None:
            lease.release()
        raise


def _build(config: TrainConfig, dist: Distributed, recipe: Recipe, store: RunStore, lease: RunLease | None,
           rewind_to: int | None = None, watch: PreemptionWatch | None = None) -> Run:
    """setup()'s part under the run's lease: resume or start, and everything the loop uses. `rewind_to`: the guard's
    own rewind (in place of config.resume_from, which its branch keeps as the job's command gave it)."""
    rewound, rewind_to = False, config.resume_from if rewind_to is None else rewind_to
    if rewind_to is not None:
        target = rewind_target(store, rewind_to, config.skip_steps)
        if target is not None:  # a refused relaunch changes nothing: checked against the target before any move
            config, recipe = check_resume(config, recipe, dist, target, target["progress"]["step"])
        rewound = rewind_when_asked(store, rewind_to, config.skip_steps, dist, watch)
    checkpoint_url, saved = find_latest(store, dist)
    recipe.check_plans(saved["progress"]["step"] if saved is not None else 0)
    if saved is not None:  # before anything is built: a refused relaunch changes nothing
        config, recipe = check_resume(config, recipe, dist, saved, saved["progress"]["step"], checkpoint_url)

    torch.manual_seed(config.seed)  # identical initial weights on every rank
    raw_model = GPT(config.model).to(dist.device)
    optimizer = raw_model.optimizer(config.optim.lr, config.optim.weight_decay,
                                    (config.optim.beta1, config.optim.beta2), dist.device.type)
    if config.data.clean_stale_shared_memory:
        if dist.local_rank == 0:  # once per node, before any rank registers its datasets
            removed = remove_stale_shared_memory(sorted({d for dataset in recipe.datasets for d in dataset.cache_dirs}))
            if removed:
                print(f"removed {len(removed)} shared-memory blocks a killed run of this dataset left behind")
        dist.barrier()
    use_cuda = dist.device.type == "cuda"
    batches = PhasedBatches(recipe, pin_memory=use_cuda, max_documents=max_documents(config))
    model = torch.compile(raw_model) if config.compile else raw_model
    autocast = torch.autocast("cuda", dtype=getattr(torch, config.dtype)) if use_cuda else nullcontext()
    if dist.enabled:
        model = DDP(model, device_ids=[dist.local_rank] if use_cuda else None)
        settle_gradient_buckets(model, optimizer, config, dist.device, autocast)

    progress, rng = Progress(), RankRNG(dist)
    rng.seed(config.seed)
    metrics = MetricsLog(store.local, enabled=dist.master)
    in_store = isinstance(store, S3RunStore)  # the metrics are written here and uploaded with each checkpoint
    guard = SpikeGuard(config.guard.zscore, config.guard.window) if config.guard.zscore > 0 else None
    dashboard_state = DashboardState()
    checkpointer = Checkpointer(store, config.keep_checkpoints, dist,
                                components={"model": raw_model, "optimizer": optimizer, "loader": batches,
                                            "rng": rng, "progress": progress, "dashboards": dashboard_state,
                                            **({"guard": guard} if guard else {})},
                                run_record={"config": config.to_dict(),
                                            "batch_plan": recipe.plan(recipe.phases[0]).state_dict(),
                                            "dataset_identity": recipe.datasets[0].identity,
                                            "phase_identities": [dataset.identity for dataset in recipe.datasets]},
                                metrics_path=metrics.path if in_store else None,
                                interval=config.checkpoint_interval, last_step=config.max_steps,
                                background=config.background_checkpoints, keep_every=config.keep_every)
    if saved is not None:
        checkpointer.restore(saved)
        if dist.master:
            print(f"resumed from {checkpoint_url} at step {progress.step}")
        if "streams" not in saved["loader"]:
            count_before_phases(batches, recipe, progress.step, dist.master)
    logged_here = metrics.last_step() if in_store else 0  # an S3 run's lines on this node, newer than the store's
    if in_store and dist.master:
        metrics.replace(store.read_bytes(METRICS_FILE) or b"")
        print(f"metrics: {metrics.path} (a copy goes to {store.url} with each checkpoint)")
    logged_to = max(logged_here, metrics.truncate_after(progress.step))
    relaunch, takeover = None, Takeover(0, logged_to > 0, None)
    if saved is not None:
        # A launch that resumes at its resume_from starts the branch: rewinding now, or again after a kill before
        # the branch's first checkpoint.
        after = "rewind" if rewound or rewind_to == progress.step else (
            progress.stopped_by or stopped_by(store, progress.step) or "restart")
        relaunch = {"from_step": progress.step, "after": after}
        if after == "rewind":  # the branch's first line: a rewind to the same step in another branch moves it aside
            relaunch["skip_steps"] = [list(pair) for pair in config.skip_steps]
        known = not in_store or progress.stopped_by in ("preemption", "end")
        takeover = Takeover(progress.step, logged_to > progress.step or not known,
                            f"{'rewound to' if after == 'rewind' else 'relaunched from'} step {progress.step} ({after})")
        progress.stopped_by = None  # this launch's own checkpoints say nothing of it
        if after == "rewind" and guard is not None:  # the branch's data differs from the step it rewound to on
            guard.reset()
    dashboards = Dashboards.open(config, dashboard_state, takeover, store.local, dist.master)
    watch = watch or PreemptionWatch()
    watch.device = dist.device
    run = Run(config, dist, recipe, raw_model, model, optimizer, batches, progress, store, checkpointer, metrics,
              watch, autocast, peak_bf16_flops() if use_cuda else None, lease, guard=guard,
              dashboards=dashboards, relaunch=relaunch)
    line = enter_phase(run, progress.step)
    if line and dist.master:
        print(line)
    return run


def count_before_phases(batches: PhasedBatches, recipe: Recipe, step: int, master: bool) -> None:
    """A checkpoint from before phases counted no samples per source: a single dataset's are its steps'; a
    mixture's are counted from here on."""
    first = recipe.phases[0]
    if len(recipe.dataset(first).source_names) == 1:
        batches.count(first, [first.global_batch_size * step])
    elif master:
        print(f"per-source counts (consumed) start at step {step}: the checkpoint was written before they were kept")


def enter_phase(run: Run, step: int) -> str | None:
    """Train step `step` in its phase: a phase that reads other data opens its stream (PhasedBatches) and its
    evaluation data; the phase's line when it is not the one being trained (with phases)."""
    phase = run.recipe.at(step)
    if phase == run.phase:
        return None
    if run.phase is None or phase.data != run.phase.data:
        if run.phase is not None:  # opened at start-up; a phase's data may be replaced meanwhile
            stop_if_data_changed(run, phase, step)
        run.val_loaders = None
        gc.collect()  # the old evaluation data's StreamingDatasets go before the new ones register
        run.batches.enter(phase)
        dataset = run.recipe.dataset(phase)
        run.val_loaders = validation_loaders(run.config, dataset, run.dist, pin_memory=run.dist.device.type == "cuda")
        epoch = run.batches.batches.epoch_samples
        run.val_weights = {name: epoch[dataset.source_names.index(name)] / sum(epoch) for name in run.val_loaders}
        run.source_names = dataset.source_names
    if run.guard is not None and step == phase.start_step and run.recipe.changes_statistics(phase):
        run.guard.reset()
    run.phase, run.plan = phase, run.recipe.plan(phase)
    return run.recipe.describe(phase) if len(run.recipe.phases) > 1 else None


def stop_if_data_changed(run: Run, phase: Phase, step: int) -> None:
    """Before `phase` reads its data, check on every rank that it is what this launch opened (and recorded in its
    checkpoints); if not, save a checkpoint at this boundary and stop: the relaunch opens and records the data as
    it is now, for a phase that has not started."""
    problem = next(filter(None, run.dist.gather(run.recipe.changed_since_opened(phase))), None)
    if problem is None:
        return
    # A phase that has started may have read the same data (a mixture holding it, or a phase going back to it): then
    # a relaunch is refused too, as it would go on in data other than what those steps read.
    started = [earlier for earlier in run.recipe.phases[:phase.index] if run.recipe.changed_since_opened(earlier)]
    read_before = next(filter(None, run.dist.gather(started[0].name if started else None)), None)
    run.checkpointer.save(step)
    run.dist.close()
    if run.lease is not None:
        run.lease.release()
    if read_before is not None:
        raise UserError(f"{problem}; {read_before}, which has trained, read that data too, so the run cannot go on "
                        f"with it: put the data back as it was (a checkpoint is saved at step {step}, before "
                        f"{phase.name}), or use a new run_dir")
    raise UserError(f"{problem}; saved a checkpoint at step {step}, before {phase.name} starts: relaunch the same "
                    f"command to train {phase.name} on the data as it is now")


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
    batch = {"tokens": tokens, "documents": torch.zeros(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.int32),
             "positions": torch.arange(tokens.shape[1] - 1, dtype=torch.int32).expand(tokens.shape[0], -1)}
    inputs, targets, document_args = model_inputs(batch, device, config)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with autocast:
            loss = model(inputs, targets, **document_args)
        loss.backward()
    optimizer.zero_grad(set_to_none=True)


def max_documents(config: TrainConfig) -> int | None:
    """The reader's document structure is asked for with document attention (data.max_documents pads it)."""
    return config.data.max_documents if config.model.attention == "document" else None


def model_inputs(batch: dict, device: torch.device, config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Inputs and targets on the device, and with document attention each token's document (and position in it)."""
    inputs, targets = to_device(batch, device)
    if config.model.attention != "document":
        return inputs, targets, {}
    document_args = {"documents": batch["documents"].to(device, non_blocking=True)}
    if config.model.positions == "document":
        document_args["positions"] = batch["positions"].to(device, non_blocking=True).long()
    return inputs, targets, document_args


def check_resume(config: TrainConfig, recipe: Recipe, dist: Distributed, saved: dict, step: int,
                 where: str | None = None) -> tuple[TrainConfig, Recipe]:
    """Refuse a relaunch from the checkpoint `saved` (its run record and step) that its policy does not allow; the
    config and recipe it goes on with (a run started in a named order keeps it), each accepted change said once."""
    old = saved["run"]
    kept = keep_guard_rewinds(keep_run_order(config, old["config"]), old["config"])
    if kept is not config:  # data.shuffle_algo: auto, in a run that started in a named order
        config, recipe = kept, Recipe.open(kept, dist.world)
    if step > config.max_steps:
        raise UserError(f"max_steps={config.max_steps} is below the step of {where or f'checkpoint {step}'}, {step}: "
                        "raise max_steps, or point run_dir elsewhere")
    changes = [*check_relaunch(old["config"], config, step),
               recipe.plan(recipe.at(step)).describe_change(old["batch_plan"])]
    recipe.check_resumes(old.get("phase_identities") or [old["dataset_identity"]], step)
    if dist.master and where is not None:
        for change in filter(None, changes):
            print(f"relaunch: {change}")
    return config, recipe


def rewind_when_asked(store: RunStore, step: int, skips: list, dist: Distributed,
                      watch: PreemptionWatch | None) -> bool:
    """resume_from: rank 0 moves aside what the run wrote after checkpoint `step` (rewind.py), under the lease, whole
    even when a preemption notice comes meanwhile; every rank stops if it cannot. Whether it rewound (not when the run
    is already on that branch)."""
    said, refusal = None, None
    if dist.master:
        with watch.whole() if watch is not None else nullcontext():
            try:
                said = rewind(store, step, skips)
            except (UserError, StoreError) as err:
                refusal = str(err)
            if said:
                print(said, flush=True)
    said, refusal = dist.gather((said, refusal))[0]
    if refusal is not None:
        raise UserError(refusal)
    return bool(said)


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
    loaders, left_out = eval_batches(dataset, config.micro_batch_size, dist.world, pin_memory, max_documents(config))
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


# sysexits' EX_DATAERR: guard.action stop met a spike. Not 75: the same command would train into the same spike, and
# a scheduler requeueing on 75 (examples/slurm/train.sbatch) would do so forever; the relaunch needs its settings.
SPIKE_STOP_EXIT_STATUS = 65


def run_job(config: TrainConfig) -> int:
    """The job's exit status: 0 when trained to max_steps, PREEMPTED_EXIT_STATUS after a preemption's checkpoint
    (unfinished: a scheduler should requeue it; it also makes every node's torchrun return at once instead of
    waiting at its exit barrier for the node whose agent the notice ended), SPIKE_STOP_EXIT_STATUS at a spike
    with guard.action stop."""
    try:
        return train(config)
    except RuntimeError as err:
        if not peer_gone(err):
            raise
        # One line from rank 0 instead of every surviving rank's collective traceback.
        raise UserError("another rank of the job ended (its own line above says why): this rank stops too") from None


def train(config: TrainConfig) -> int:
    """Train until max_steps (0), a preemption notice (PREEMPTED_EXIT_STATUS, after a checkpoint) or a spike that
    guard.action stop ends the run at (SPIKE_STOP_EXIT_STATUS); the exit status."""
    run = setup(config, PreemptionWatch())  # before anything long: a notice while starting ends the launch at once
    bar = progress_bar(run)
    first_step = run.progress.step
    run.model.train()
    run.preemption.starting = False  # from here on a notice is a flag, and the loop saves at a step's end
    status = 0
    while run.progress.step < config.max_steps:
        if run.preemption.should_stop():  # collective: every rank stops at this same step
            save_on_notice(run, bar)
            status = PREEMPTED_EXIT_STATUS
            break
        if (line := enter_phase(run, run.progress.step)) and run.dist.master:
            bar.write(line)
        skipped = skip_when_due(run)  # after enter_phase: a stop there checkpoints the streams before the skip
        try:
            record = train_step(run)
        except SpikeStop as spike:
            rewound = rewind_at_spike(run, spike, bar) if config.guard.action == "rewind" else None
            if rewound is None:
                stop_at_spike(run, spike, bar)
                status = SPIKE_STOP_EXIT_STATUS
                break
            run, config = rewound, rewound.config
            bar, first_step = progress_bar(run), run.progress.step
            run.model.train()
            continue
        if skipped:
            record["skipped"] = skipped
        if run.relaunch is not None:  # the launch's first line: where and why it took over
            record["relaunch"], run.relaunch = run.relaunch, None
        if record["step"] == config.max_steps:  # the last step's checkpoint: a relaunch knows nothing came after
            run.progress.stopped_by = "end"
        evaluate_when_due(run, record, bar)
        log_step(run, record, bar, first_step)
        run.checkpointer.after_step(record["step"])
    bar.close()
    run.dashboards.close()
    run.dist.close()
    if run.lease is not None:
        run.lease.release()
    return status


class SpikeStop(Exception):
    """The guard found step `step` (counted from 1) a spike, with guard.action stop: its update is not applied."""

    def __init__(self, step: int, scores: dict, loss: float, grad_norm: float):
        super().__init__(step)
        self.step, self.scores, self.loss, self.grad_norm = step, scores, loss, grad_norm


def log_spike(run: Run, spike: SpikeStop, update: str) -> None:
    """The evidence, beside the steps before it: the spike step's line (not trained: its update `update`), kept under
    abandoned/ by the rewind that follows; for an S3 run uploaded now, as a checkpoint would."""
    if not run.dist.master:
        return
    record = {"step": spike.step, "loss": spike.loss, "grad_norm": spike.grad_norm,
              "guard": {**spike.scores, "update": update}}
    run.metrics.write(record)
    run.dashboards.write(record)
    if isinstance(run.store, S3RunStore):
        run.store.publish_bytes(METRICS_FILE, run.metrics.path.read_bytes())


def rewind_at_spike(run: Run, spike: SpikeStop, bar: tqdm) -> Run | None:
    """guard.action rewind: what stop's advice says, in this job: back to the newest kept checkpoint at least
    guard.rewind steps before the spike, the spike's data left out, the branch it leaves kept under abandoned/ (as a
    relaunch with that resume_from and skip_steps does, through the same _build). The run it goes on with, or None
    where it cannot (guard.max_rewinds done, or no checkpoint before the spike): then it stops."""
    run.checkpointer.wait()
    config, guard = run.config, run.config.guard
    saved = [step for step in Survey.of(run.store).complete if step < spike.step] if run.dist.master else None
    target, skips, _, near = rewind_plan(run.dist.gather(saved)[0], spike.step, config.skip_steps, guard.rewind,
                                         guard.skip, config.max_steps)
    if target is None or len(guard.rewinds_done) >= guard.max_rewinds:
        return None
    log_spike(run, spike, "rewound")
    bar.close()
    if run.dist.master:
        print(f"loss spike at step {spike.step} ({', '.join(f'{k} {v}' for k, v in spike.scores.items())}): rewinding "
              f"to step {target}{' (the nearest checkpoint before it)' if near else ''}, skip_steps={skips} "
              f"(guard.action rewind, {len(guard.rewinds_done) + 1} of guard.max_rewinds={guard.max_rewinds})")
    done = [*guard.rewinds_done, {"spike": spike.step, "resume_from": target, "skip_steps": skips}]
    branch = dataclasses.replace(config, skip_steps=skips, guard=dataclasses.replace(guard, rewinds_done=done))
    close_data(run)
    # The launch's own watch: a notice during the rewind stops the branch at its first step boundary.
    return _build(branch, run.dist, Recipe.open(branch, run.dist.world), run.store, run.lease, rewind_to=target,
                  watch=run.preemption)


def close_data(run: Run) -> None:
    """Let go of what a run reads and shows (its streams, evaluation data and dashboards) before another is built."""
    run.batches.close()
    run.val_loaders = None
    run.dashboards.close()
    gc.collect()  # the readers' StreamingDatasets go before the rewound run's register


def stop_at_spike(run: Run, spike: SpikeStop, bar: tqdm) -> None:
    """guard.action stop: end the run (exit 65: unfinished, but not to be relaunched as it is) with the command that rewinds to a
    checkpoint at least guard.rewind steps before the spike and leaves out guard.skip steps' data from it on."""
    run.checkpointer.wait()
    bar.close()
    log_spike(run, spike, "stopped")
    if not run.dist.master:
        return
    guard = run.config.guard
    saved = [step for step in Survey.of(run.store).complete if step < spike.step]
    said = advice(saved, spike.step, run.config.skip_steps, guard.rewind, guard.skip, run.config.max_steps)
    print(f"loss spike at step {spike.step} ({', '.join(f'{k} {v}' for k, v in spike.scores.items())}): stopped, its "
          f"update not applied; to rewind and leave out its data, {said}")


def skip_when_due(run: Run) -> dict | None:
    """At the first step of a skip (skip_steps [first, last]), leave out the data of steps first..last unread: each
    stream those steps would read moves on to where step last + 1 would have read it (Recipe.read_units_before, the
    ledger's), as a relaunch positions it, whatever the skip's length. What was left out, for that step's line in
    metrics.jsonl."""
    skip = run.recipe.skip_at(run.progress.step)
    if skip is None:
        return None
    first, last = skip
    left_out, moved = 0, set()
    for index in range(first - 1, last):
        phase = run.recipe.at(index)
        if run.recipe.stream(phase) in moved:
            continue
        moved.add(run.recipe.stream(phase))
        skipped = run.recipe.units_before(phase, last) - run.recipe.units_before(phase, first - 1)
        left_out += skipped * run.recipe.units[phase.index]
        run.batches.move(phase, run.recipe.read_units_before(phase, first - 1))
    run.batches.enter(run.recipe.at(run.progress.step))  # the step's own stream, wherever the skip ended
    if run.dist.master:
        print(f"skip_steps: the data of steps {first} to {last} left out unread ({left_out:,} samples); step {first} "
              f"reads what step {last + 1} would have")
    return {"steps": [first, last], "samples_left_out": left_out}


def progress_bar(run: Run) -> tqdm:
    """The run's line (parameters, ranks, batch, tokens) and its progress bar, on rank 0."""
    config, plan = run.config, run.plan
    if run.dist.master:
        print(f"{run.raw_model.num_params() / 1e6:.2f}M parameters, {run.dist.world} ranks x {config.micro_batch_size} "
              f"samples x {plan.accumulation} accumulation = {plan.global_batch_size} samples/step, "
              f"{run.recipe.tokens_before(config.max_steps):,} tokens in {config.max_steps} steps, "
              f"device {run.dist.device}")
    return tqdm(total=config.max_steps, initial=run.progress.step, unit="step", disable=not run.dist.master,
                dynamic_ncols=True)


def save_on_notice(run: Run, bar: tqdm) -> None:
    """A preemption notice: every rank checkpoints this step, and rank 0 says how long it took of the grace."""
    saving = time.monotonic()
    run.progress.stopped_by = "preemption"
    if not run.checkpointer.save(run.progress.step) and run.dist.master:  # a periodic save wrote this step already
        publish_pointer(run.store, run.progress.step, stopped_by="preemption")
    bar.close()
    if run.dist.master:
        where = f"signal {run.preemption.received}" if run.preemption.received else "signal to another rank"
        done = time.monotonic()
        print(f"preempted ({where}): " + notice_line(run.progress.step, done - saving, done - run.preemption.noticed_at,
                                                     run.config.preempt_grace_s) + ", exiting")


def train_step(run: Run) -> dict:
    """One optimizer step over the phase's accumulation of micro-batches; its record for metrics.jsonl."""
    config, dist, optimizer, recipe = run.config, run.dist, run.optimizer, run.recipe
    started = time.perf_counter()
    accumulation = run.plan.accumulation
    step_tokens = run.plan.global_batch_size * recipe.block_size(run.phase)
    tokens_before = recipe.tokens_before(run.progress.step)
    lr = learning_rate(run.progress.step, config, tokens_before, step_tokens)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=dist.device)
    data_wait, sample_ids = 0.0, []
    for micro in range(accumulation):
        waited = time.perf_counter()
        batch = next(run.batches)
        data_wait += time.perf_counter() - waited
        inputs, targets, document_args = model_inputs(batch, dist.device, config)
        sample_ids.extend(batch["ids"].tolist())
        last = micro == accumulation - 1
        with nullcontext() if last or not dist.enabled else run.model.no_sync(), run.autocast:
            loss = run.model(inputs, targets, **document_args) / accumulation  # gradients all-reduced on the last one
        loss.backward()
        loss_sum += loss.detach()
    # The gradients' norm before clipping (what a loss spike shows first); clipping, when on, scales them to grad_clip.
    if config.optim.grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.optim.grad_clip)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in run.model.parameters() if p.grad is not None])
    grad_norm, loss = grad_norm.item(), dist.mean(loss_sum).item()  # every rank's, alike: the guard judges them
    spike = run.guard.judge(loss, grad_norm) if run.guard is not None else None
    if spike is not None and config.guard.action in ("stop", "rewind"):
        optimizer.zero_grad(set_to_none=True)
        raise SpikeStop(run.progress.step + 1, spike, loss, grad_norm)
    if spike is None:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    run.progress.step += 1

    record = {"step": run.progress.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
              "clipped": 0 < config.optim.grad_clip < grad_norm,
              **account_step(run, sample_ids, tokens_before + step_tokens)}
    if spike is not None:
        record["guard"] = {**spike, "update": "skipped"}
    seconds = time.perf_counter() - started
    record.update(tokens_per_s=step_tokens / seconds, data_wait_s=data_wait, step_s=seconds,
                  data_wait_fraction=data_wait / seconds)
    if run.peak_flops:
        record["mfu"] = run.raw_model.flops_per_token() * step_tokens / seconds / (run.peak_flops * dist.world)
    return record


def evaluate_when_due(run: Run, record: dict, bar: tqdm) -> None:
    """Every eval_interval steps: the validation loss (each source's weighted by its share of an epoch) into the
    step's record."""
    if not run.val_loaders or record["step"] % run.config.eval_interval:
        return
    val_losses = evaluate(run)
    if val_losses is None:
        if run.dist.master:
            bar.write(f"evaluation at step {record['step']} stopped: preemption notice")
        return
    record["val_loss"] = sum(run.val_weights[name] * loss for name, loss in val_losses.items()) / sum(
        run.val_weights.values())
    if len(run.source_names) > 1:
        record["val_loss_per_source"] = val_losses


def log_step(run: Run, record: dict, bar: tqdm, first_step: int) -> None:
    """The step's line in metrics.jsonl, its console line every log_interval (and with a validation loss), and after
    the second step of a launch whether a step plus the saves fit in the preemption grace."""
    run.metrics.write(record)
    run.dashboards.write(record)
    bar.update(1)
    step = record["step"]
    if run.dist.master and (step % run.config.log_interval == 0 or "val_loss" in record):
        bar.write(console_line(record))
    if step == first_step + 2 and run.dist.master:  # the first step warms up; the second is a fair measure
        bar.write(check_grace(run, record["step_s"]))


def account_step(run: Run, sample_ids: list[int], tokens: int) -> dict:
    """Count a step's samples per source into what each source has given the run (PhasedBatches.consumed, part
    of the checkpoint), and return what the step read for metrics.jsonl: tokens so far, the data, ranks and nodes,
    its phase and samples (trace_samples), per source its samples and everything consumed."""
    # Which data and ranks: with the config, what train/ledger.py needs to say which samples each rank read.
    record = {"tokens": tokens, "ranks": run.dist.world, "nodes": run.dist.nodes, "data": run.recipe.data_digest(run.phase)}
    if len(run.recipe.phases) > 1:
        record["phase"] = run.phase.index
    if run.config.trace_samples:
        record["samples"] = run.dist.gather(sample_ids)
    # One all-reduce: the step's read sums (read_check.py, checked by the ledger), and per source its samples.
    many = len(run.source_names) > 1
    summed = np.concatenate([read_sums(sample_ids), run.batches.samples_per_source(sample_ids) if many else []])
    summed = torch.from_numpy(summed.astype(np.int64)).to(run.dist.device)
    run.dist.sum(summed)
    summed = summed.tolist()
    record["read"] = read_digest(summed[:2])
    counts = [run.plan.global_batch_size]
    if many:  # a single source gives every sample
        counts = summed[2:]
        record["samples_per_source"] = dict(zip(run.source_names, counts))
    run.batches.count(run.phase, counts)
    record["consumed"] = run.batches.consumed_by_name()
    return record


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
            inputs, targets, document_args = model_inputs(batch, run.dist.device, run.config)
            with run.autocast:
                total[0] += run.model(inputs, targets, **document_args).float()
            total[1] += 1
        if preempted:
            break
    run.dist.sum(totals)
    run.model.train()
    if preempted:
        return None
    return {name: (total[0] / total[1].clamp(min=1)).item() for name, total in zip(run.val_loaders, totals)}
