"""Does the suite catch the bugs it claims to? Applies each of a curated list of one-line mutations, the shape
a real bug takes, to a scratch copy of the repository, runs the tests that must catch it, and prints a table of
caught and survived. Run it before resolving an issue that touches a guarantee; every new guarantee adds its
mutations to MUTATIONS. Not part of CI (minutes per mutation); the last table lives in docs/mutation-check.md.

    ./dev python scripts/mutation_check.py                     # every mutation
    ./dev python scripts/mutation_check.py --only lease        # those whose name holds "lease"
    ./dev python scripts/mutation_check.py --write             # also rewrite docs/mutation-check.md
"""

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
REPORT = ROOT / "docs" / "mutation-check.md"
SKIPPED_ONLY = -2  # run_tests: pytest passed with every test skipped (hardware this machine lacks): no verdict


@dataclass(frozen=True)
class Mutation:
    name: str
    claim: str  # what the README (or docs/) promises that the mutation breaks
    path: str  # the file it edits
    old: str  # text found exactly once in that file
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions


# The lazy orders' properties of an epoch (tests/test_order_engine.py): each catches one epoch key forgotten.
EPOCH_PROPERTIES = ("tests/test_order_engine.py", "-k", "afresh or order_of_its_own or anew")

MUTATIONS = [
    # Issue 45: the four the suite let through.
    Mutation("overwrite: a shard-like user file", "--overwrite replaces only a dataset this project wrote",
             "tokstream/convert/output_guard.py", "bool(_SHARD.fullmatch(parts[1]))", "bool(_SHARD.match(parts[1]))",
             ("tests/test_converter_safety.py", "-k", "overwrite_refuses")),
    Mutation("lease: the holder stops beating", "only one live job at a time may write a run_dir",
             "tokstream/train/run_lease.py", 'self.record["beat"] += 1', "pass",
             ("tests/test_run_lease.py", "-k", "live_holders")),
    Mutation("vocabulary: the last id's edge", "a token id past the vocabulary is refused in one line naming the file",
             "tokstream/split_check.py", "if largest >= vocab_size:", "if largest > vocab_size:",
             ("tests/test_dataset_checks.py", "tests/test_grain.py", "-k", "vocabularys_last_id or damaged_in_place")),
    Mutation("verify: the last id's edge", "convert/verify.py checks every token id against the vocabulary",
             "tokstream/convert/verify.py", "if int(samples.max()) >= metadata.vocab_size:",
             "if int(samples.max()) > metadata.vocab_size:",
             ("tests/test_dataset_checks.py", "-k", "vocabularys_last_id")),
    Mutation("ledger: nodes and ranks per node swapped", "the ledger is right on other world sizes and nodes",
             "tokstream/reader/sample_order.py", "rank_orders(self._loader.dataset, nodes, ranks_per_node, epoch, start)",
             "rank_orders(self._loader.dataset, ranks_per_node, nodes, epoch, start)",
             ("tests/test_ledger.py", "-k", "asymmetric")),
    # The ten the suite caught when the list began (2026-11-27), in the fast tests that catch them now.
    Mutation("phases: units counted in samples", "each step's samples are a function of the config and the step",
             "tokstream/train/phases.py", "taken += max(0, end - other.start_step) * (other.global_batch_size // unit)",
             "taken += max(0, end - other.start_step) * other.global_batch_size",
             ("tests/test_phases.py", "-k", "units_before_and_the_ledger")),
    Mutation("ledger: ranks' rows not transposed", "the ledger says which rank read which sample",
             "tokstream/train/ledger.py", "read.transpose(1, 0, 2).reshape(ranks, -1)", "read.reshape(ranks, -1)",
             ("tests/test_phases.py", "-k", "units_before_and_the_ledger")),
    Mutation("documents: a start at the separator itself", "document attention: each token attends to its document",
             "tokstream/reader/documents.py", "starts[:, 1:] = inputs[:, :-1] == separator_id",
             "starts[:, 1:] = inputs[:, 1:] == separator_id",
             ("tests/test_document_attention.py", "-k", "structure or separator")),
    Mutation("checkpoints: the digest not compared", "a damaged checkpoint is never resumed from",
             "tokstream/train/checkpoint_files.py", "if file_digest(path) != manifest[HASH]:", "if False:",
             ("tests/test_checkpoint.py", "-k", "flipped_bytes")),
    Mutation("relaunch: the shuffle settings free", "a relaunch that would change the sample order is refused",
             "tokstream/train/resume_policy.py", '"data.shuffle_*": "the sample order would change",', "",
             ("tests/test_resume_policy.py",)),
    Mutation("mixtures: rounding towards the smallest remainder", "each source gets its weight's share of an epoch",
             "tokstream/reader/mixture.py", "key=lambda i: (-(shares[i] - counts[i]), i))",
             "key=lambda i: (shares[i] - counts[i], i))",
             ("tests/test_mixtures.py", "-k", "share_of_an_epoch or realised_proportions")),
    Mutation("mixtures: proportions ignored", "each source gets its weight's share of an epoch",
             "tokstream/reader/mixture.py", "total, weights = sum(split_samples), [s.value for s in sources]",
             "total, weights = sum(split_samples), [1 for s in sources]",
             ("tests/test_mixtures.py", "-k", "share_of_an_epoch or realised_proportions")),
    Mutation("converters: no separator after a chunk's last document", "the token stream is nanoGPT's, whatever the chunks",
             "tokstream/convert/tokenize_docs.py", "tokens = separator + encoded if before else encoded + separator",
             "tokens = separator + encoded if before else encoded + (separator if n < len(texts) - 1 else [])",
             ("tests/test_chunked_reading.py", "-k", "does_not_depend_on_chunks")),
    Mutation("reader: a stale resume position used", "a state saved by rank 0 after another rank closed is the whole "
             "position", "tokstream/reader/streaming_door/streaming_internals.py",
             'if kept is None or pid != os.getpid() or kept["epoch"] < epoch:', "if kept is None or pid != os.getpid():",
             ("tests/test_reader_api.py", "-k", "rank_0_saves")),
    Mutation("lease: patience of one beat", "a relaunch takes over a lost node's lease after three of its beats",
             "tokstream/train/run_lease.py", "STALE_BEATS = 3", "STALE_BEATS = 1",
             ("tests/test_run_lease.py", "-k", "three_of_its_beats")),
    # Issue 40: what cannot be honoured is refused.
    Mutation("phases: data not opened again at the boundary", "a phase reads the data the run recorded, or the run "
             "stops", "tokstream/train/trainer.py",
             "if run.phase is not None:  # opened at start-up; a phase's data may be replaced meanwhile",
             "if False:",
             ("tests/test_phases.py", "-k", "replaced_mid_run")),
    Mutation("phases: another tokenizer accepted", "every phase's data shares phase 0's tokenizer and separator",
             "tokstream/train/phases.py", "difference = dataset.token_difference(datasets[0])", "difference = None",
             ("tests/test_phases.py", "-k", "mean_other_things")),
    Mutation("reader state: weights left out", "a reader state of another order is refused",
             "tokstream/reader/batches.py", '"weights": [[source.weight, source.value] for source in dataset.sources],',
             '"weights": [],', ("tests/test_reader_api.py", "-k", "another_order")),
    Mutation("settings: ranges unchecked", "a setting out of its range is refused when the config is made",
             "tokstream/train/config.py", "above = value >= lowest if inclusive else value > lowest", "above = True",
             ("tests/test_dataset_checks.py", "-k", "range or zero_interval")),
    Mutation("metrics: a line that is a list", "a damaged metrics line blocks neither the relaunch nor the ledger",
             "tokstream/train/metrics.py", "if not isinstance(record, dict):", "if False:",
             ("tests/test_ledger.py", "-k", "damaged_metrics")),
    # Issue 42: the lazy order.
    Mutation("lazy partition: a node's padding one sample late", "the lazy partition is streaming's, exactly",
             "tokstream/reader/order/partition.py", "per_node - ranks - self.rank_padding + 1 + beyond",
             "per_node - ranks - self.rank_padding + 2 + beyond",
             ("tests/test_lazy_partition.py", "-k", "exhaustively")),
    Mutation("feistel_window: no cycle walking", "every epoch of the first lazy order is a permutation",
             "tokstream/reader/order/feistel_window.py", "walking &= out >= sizes", "walking[:] = False",
             ("tests/test_lazy_shuffle.py", "-k", "permutation")),
    Mutation("lazy order: the door reads it as stock would", "a worker reads its part of the lazy order",
             "tokstream/reader/streaming_door/streaming_internals.py",
             "if not (in_lazy_order(self) or kept_as_files(self)):", "if True:",
             ("tests/test_lazy_order.py", "-k", "itself")),
    Mutation("lazy order: shards' counts not drawn", "an epoch of the lazy order holds each source's count",
             "tokstream/reader/order/lazy.py", "takes = shard_counts(stream_sizes, rest,",
             "takes = np.minimum(stream_sizes, rest) + 0 * shard_counts(stream_sizes, rest,",
             ("tests/test_lazy_order.py", "-k", "count_once")),
    Mutation("lean readers: dirname and split swapped", "the door's shard readers are streaming's",
             "tokstream/reader/streaming_door/lean_readers.py", 'args["dirname"], args["split"] = dirname, split',
             'args["dirname"], args["split"] = split, dirname',
             ("tests/test_epoch_order.py", "-k", "lean_shard_readers")),
    Mutation("lazy order: an epoch's kept order reused for another", "each epoch of the lazy order is its own",
             "tokstream/reader/streaming_door/streaming_internals.py",
             "if kept is not None and kept[0] == settings:", "if kept is not None:",
             ("tests/test_lazy_order.py", "-k", "same_on_any_world_size")),
    # Issue 43: where users look (TensorBoard, W&B, the plot's marks).
    Mutation("tensorboard: no purge on relaunch", "TensorBoard never shows two values for one step of the branch",
             "tokstream/train/dashboards.py", "SummaryWriter(folder, purge_step=shared + 1)",
             "SummaryWriter(folder)", ("tests/test_loss_spikes.py", "-k", "rewind_with_a_skip")),
    Mutation("wandb: no branch for steps logged again", "a W&B run never holds two values for one step",
             "tokstream/train/dashboards.py", "goes_on = state.wandb_step == takeover.step and not takeover.after_logged",
             "goes_on = state.wandb_step == takeover.step", ("tests/test_loss_spikes.py", "-k", "rewind_with_a_skip")),
    Mutation("plot: a preemption not recorded", "the plot marks preemptions",
             "tokstream/train/trainer.py", 'run.progress.stopped_by = "preemption"', "pass",
             ("tests/test_loss_spikes.py", "-k", "rewind_with_a_skip")),
    Mutation("tensorboard: another branch's steps kept", "TensorBoard never shows two values for one step of the branch",
             "tokstream/train/dashboards.py", "shared = min(takeover.step, state.tensorboard_step)",
             "shared = takeover.step", ("tests/test_loss_spikes.py", "-k", "turned_off")),
    Mutation("wandb: a run holding another branch continued", "a W&B run never holds two branches' steps",
             "tokstream/train/dashboards.py", "goes_on = state.wandb_step == takeover.step and not takeover.after_logged",
             "goes_on = not takeover.after_logged", ("tests/test_loss_spikes.py", "-k", "turned_off")),
    Mutation("rewind in S3: nothing copied", "a rewind deletes nothing it has not copied whole",
             "tokstream/train/run_store.py", 'self.store.copy(name, f"{folder}/{name}")', "pass",
             ("tests/test_s3.py", "-k", "rewinds")),
    # Issue 42: start-up at 880 M samples (the rows' vocabulary check, the spanner, the lazy order's set-up).
    Mutation("reader vocabulary: the rows' edge", "a token id past the vocabulary is refused where it is read",
             "tokstream/reader/token_dataset.py", "over = np.flatnonzero(largest >= ", "over = np.flatnonzero(largest > ",
             ("tests/test_dataset_checks.py", "-k", "vocabularys_last_id")),
    Mutation("reader vocabulary: the batch's fast path", "a token id past the vocabulary is refused where it is read",
             "tokstream/reader/token_dataset.py", "int(tokens.max()) < min(self.vocab_sizes)",
             "int(tokens.max()) <= min(self.vocab_sizes)", ("tests/test_dataset_checks.py", "-k", "vocabularys_last_id")),
    Mutation("reader vocabulary: the first row's shard named", "the refusal names the shard holding the id",
             "tokstream/reader/token_dataset.py", "shard_id = int(shards[over[0]])", "shard_id = int(shards[0])",
             ("tests/test_dataset_checks.py", "-k", "later_shard")),
    Mutation("reader vocabulary: the targets' column left out", "every token a batch reads is checked",
             "tokstream/reader/token_dataset.py", "largest = tokens.max(axis=1).astype(np.int64)",
             "largest = tokens[:, :-1].max(axis=1).astype(np.int64)", ("tests/test_dataset_checks.py", "-k", "later_shard")),
    Mutation("spanner: a shard's first sample", "each sample is read from its own shard",
             "tokstream/reader/streaming_door/lean_spanner.py", "bisect.bisect_right(self._bounds, index) - 1",
             "bisect.bisect_left(self._bounds, index) - 1", ("tests/test_epoch_order.py", "-k", "lean_spanner")),
    Mutation("lazy order: a repeat's partial unit", "a run resumes in the lazy order it was trained in",
             "tokstream/reader/order/feistel_window.py", "partial.append(nth >= repeats)",
             "partial.append(nth > repeats)", ("tests/test_lazy_order.py", "-k", "runs_were_trained")),
    # Issue 51: the order engine at every size, never silently wrong, well mixed.
    Mutation("lazy order: a shard read front to back", "each shard is read in another order every epoch",
             "tokstream/reader/order/lazy.py", "within[whole] = permutation(within[whole],",
             "within[whole] = (lambda w, *_: w)(within[whole],", ("tests/test_order_engine.py", "-k", "shard")),
    Mutation("lazy order: the epoch left out of the draw", "each epoch leaves out other samples",
             "tokstream/reader/order/lazy.py", "key_of(self.seed, self.epoch, stream, _RESAMPLE)",
             "key_of(self.seed, stream, _RESAMPLE)", ("tests/test_order_engine.py", "-k", "property")),
    # Issue 53's review: each of the orders' epoch keys caught by a property, not only by a pinned digest.
    Mutation("lazy order: the epoch left out of the pick", "a shard drawn from gives other samples each epoch",
             "tokstream/reader/order/lazy.py", "key(self.seed, self.epoch, _PICK,",
             "key(self.seed, _PICK,", EPOCH_PROPERTIES),
    Mutation("lazy order: the epoch left out of a unit's permutation", "each shard is read in another order every epoch",
             "tokstream/reader/order/lazy.py", "key(self.seed, self.epoch, _UNIT,",
             "key(self.seed, _UNIT,", EPOCH_PROPERTIES),
    Mutation("lazy order: the epoch left out of the pieces' order", "each epoch reads the shards in an order of its own",
             "tokstream/reader/order/lazy.py", "key(self.seed, self.epoch, _EPOCH,",
             "key(self.seed, _EPOCH,", EPOCH_PROPERTIES),
    Mutation("lazy order: the epoch left out of the windows", "each epoch shuffles each window anew",
             "tokstream/reader/order/lazy.py", "key(self.seed, self.epoch, _WINDOW,",
             "key(self.seed, _WINDOW,", EPOCH_PROPERTIES),
    Mutation("feistel_window: the epoch left out of the windows", "each epoch shuffles each window anew",
             "tokstream/reader/order/feistel_window.py", "keys = _key(self.seed, self.epoch, node, window)",
             "keys = _key(self.seed, 0, node, window)", EPOCH_PROPERTIES),
    Mutation("feistel_window: the spans' order the same every epoch", "each epoch reads the shards in an order of its own",
             "tokstream/reader/order/feistel_window.py", "default_rng(self.seed + self.epoch)",
             "default_rng(self.seed)", EPOCH_PROPERTIES),
    Mutation("feistel_window: the epoch left out of the draw", "each epoch draws each shard's count again",
             "tokstream/reader/order/feistel_window.py", "default_rng([seed, epoch, stream])",
             "default_rng([seed, stream])", EPOCH_PROPERTIES),
    Mutation("feistel_window: the epoch left out of the pick", "a shard drawn from gives other samples each epoch",
             "tokstream/reader/order/feistel_window.py", "_key(self.seed, self.epoch, shard[picked], 1 << 40)",
             "_key(self.seed, 0, shard[picked], 1 << 40)", EPOCH_PROPERTIES),
    Mutation("hypergeometric: the integer part of the mean lost", "the draw is exact past a billion samples",
             "tokstream/reader/order/hypergeometric.py", "k = base + math.floor(dx)", "k = math.floor(dx)",
             ("tests/test_order_engine.py", "-k", "draw")),
    Mutation("keyed permutation: small windows walked too", "a small window's permutation is uniform",
             "tokstream/reader/order/keyed.py", "small = sizes <= EXACT_UP_TO", "small = sizes < 0",
             ("tests/test_order_engine.py", "-k", "pairs")),
    Mutation("order files: the checksum not compared", "a damaged order file is never read",
             "tokstream/reader/order/order_files.py",
             "if digest.digest() != footer[len(CHECKSUM_TAG):]:", "if False:",
             ("tests/test_order_files.py", "-k", "damaged and halves")),
    Mutation("order files: ids' range not checked", "an id out of range is one line naming the file",
             "tokstream/reader/order/order_files.py", "if largest >= samples or smallest < 0:", "if False:",
             ("tests/test_order_files.py", "-k", "damaged and checksummed")),
    Mutation("order files: the name left out of the checksum", "a whole file under another epoch's name is never read",
             "tokstream/reader/order/order_files.py", "return xxhash.xxh3_128(name.encode())",
             "return xxhash.xxh3_128()", ("tests/test_order_files.py", "-k", "damaged and another")),
    Mutation("ledger: an old run read in today's auto", "the ledger answers a run in the order it was read in",
             "tokstream/train/ledger.py",
             'config = keep_run_order(apply_overrides(config_from_dict(run["config"]), overrides), run["config"])',
             'config = apply_overrides(config_from_dict(run["config"]), overrides)',
             ("tests/test_ledger.py", "-k", "from_before")),
    Mutation("resume policy: auto's lazy order not kept", "a relaunch never changes a run's order",
             "tokstream/train/resume_policy.py",
             'data = dataclasses.replace(data, shuffle_auto_lazy=saved["data"].get("shuffle_auto_lazy", FIRST_LAZY_ORDER))',
             "pass", ("tests/test_ledger.py", "-k", "from_before")),
    Mutation("ledger: the recorded read not compared", "the ledger's answer agrees with what the run read",
             "tokstream/train/ledger.py", "if said is not None and said != gives:", "if False:",
             ("tests/test_ledger.py", "-k", "checks_its_answer")),
    # Issue 42: streaming's orders kept as files, and auto.
    Mutation("order files: the seed left out of the file's name", "a file never answers for other settings",
             "tokstream/reader/order/order_files.py", '"shuffle_algo", "shuffle_seed", "num_canonical_nodes",',
             '"shuffle_algo", "num_canonical_nodes",', ("tests/test_order_files.py", "-k", "built_once")),
    Mutation("order files: not looked for again under the lock", "an epoch's order is built once",
             "tokstream/reader/order/order_files.py",
             "if path.exists():  # built while this process waited, or damaged", "if False:",
             ("tests/test_order_files.py", "-k", "racing")),
    Mutation("order files: another host's partial taken for dead", "only a provably dead build's partial is removed",
             "tokstream/reader/order/order_files.py",
             "if len(parts) != 4 or parts[1] != host or not parts[2].isdigit():",
             "if len(parts) != 4 or not parts[2].isdigit():", ("tests/test_order_files.py", "-k", "dead_builders")),
    Mutation("order files: a worker reads its positions from the wrong rank", "the files give stock's own work",
             "tokstream/reader/streaming_door/streaming_internals.py",
             "return [WorkerIds(order, partition, node, rank, worker) for node, rank, worker in workers]",
             "return [WorkerIds(order, partition, node, 0, worker) for node, rank, worker in workers]",
             ("tests/test_epoch_order.py", "-k", "lean_random_batching and 97")),
    Mutation("order files: the builder ahead without the package's path", "the next epoch's order is built ahead",
             "tokstream/reader/order/order_files.py",
             'path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))',
             'path = os.environ.get("PYTHONPATH", "")', ("tests/test_order_files.py", "-k", "from_anywhere")),
    Mutation("auto: a state's order not kept", "auto never changes the order a state was read in",
             "tokstream/reader/batches.py", "if saved in shuffle_names() and saved != self._of[\"shuffle_algo\"]:",
             "if False:", ("tests/test_order_files.py", "-k", "auto_takes")),
    Mutation("auto: a run's named order not kept", "a run started in py1e goes on in py1e",
             "tokstream/train/resume_policy.py", "if data.shuffle_algo == AUTO_SHUFFLE and algo != AUTO_SHUFFLE:",
             "if False:", ("tests/test_order_files.py", "-k", "before_auto")),
    # Issue 43: skip_steps and resume_from.
    Mutation("skip: the ledger ignores skips", "the ledger answers every step after a skip",
             "tokstream/train/phases.py", "for first, last in self.skips if first - 1 <= step)",
             "for first, last in self.skips if False)", ("tests/test_phases.py", "-k", "skipped_steps_move")),
    Mutation("skip: a trained step's skip changed on a relaunch", "a skip that would change a trained step is refused",
             "tokstream/train/resume_policy.py", "    if begun(saved) != begun(now):", "    if False:",
             ("tests/test_loss_spikes.py", "-k", "preemption")),
    Mutation("skip: a phase a done skip read stays editable", "a phase whose data a skip read keeps its recipe",
             "tokstream/train/resume_policy.py", 'read = read_through(step, saved.get("skip_steps", []))',
             "read = step", ("tests/test_phases.py", "-k", "done_skip")),
    Mutation("guard: the window not in the checkpoint", "a resumed run judges each step as the uninterrupted run",
             "tokstream/train/checkpoint.py", 'if name not in saved and getattr(component, "optional_in_checkpoints", False):',
             'if getattr(component, "optional_in_checkpoints", False):', ("tests/test_loss_spikes.py", "-k", "guard")),
    Mutation("rewind: the branch not recognised", "relaunching the same command goes on in the branch",
             "tokstream/train/rewind.py", 'return config.get("resume_from") == step', "return False",
             ("tests/test_loss_spikes.py", "-k", "rewind")),
    Mutation("rewind: metrics.jsonl not kept", "the abandoned branch is kept byte for byte",
             "tokstream/train/rewind.py", "store.set_aside([METRICS_FILE, POINTER], moved, folder)",
             "store.set_aside([POINTER], moved, folder)",
             ("tests/test_loss_spikes.py", "-k", "rewind")),
    # Issue 43: what is logged.
    Mutation("logging: clipped said without clipping", "each step says whether its gradients were clipped",
             "tokstream/train/trainer.py", '"clipped": 0 < config.optim.grad_clip < grad_norm',
             '"clipped": grad_norm > 0', ("tests/test_training.py", "-k", "gradient_norm")),
    # Issue 44: Slurm, and numpy's AVX-512 sort on Zen 4.
    Mutation("slurm: an array task runs every part", "task I of a Slurm job array converts part I",
             "tokstream/convert/cli.py", "args.part, args.num_parts = array_part(args.part, args.num_parts)", "pass",
             ("tests/test_slurm.py", "-k", "conversion_array")),
    Mutation("slurm: no requeue on 75", "a job stopped by a notice is requeued and ends COMPLETED",
             "examples/slurm/train.sbatch", "if [[ $status -eq 75 ]]; then", "if [[ $status -eq 76 ]]; then",
             ("tests/test_slurm.py", "-k", "preempted")),
    Mutation("slurm: the batch script taken for a rank", "only srun's tasks are ranks",
             "tokstream/slurm.py", '"SLURM_STEP_ID" not in environ or ', "",
             ("tests/test_slurm.py", "-k", "srun_tasks")),
    Mutation("zen 4: AVX512F alone left out", "numpy on Zen 4 dispatches to no AVX-512 kernel",
             "tokstream/train/cpu_dispatch.py", 'FEATURE = "AVX512F AVX512CD', 'FEATURE = "AVX512F"  # "AVX512CD',
             ("tests/test_cpu_dispatch.py", "-k", "without_the_avx512_kernels")),
    Mutation("guard: a spike stop exits 75", "a spike stop is never requeued as a preemption",
             "tokstream/train/trainer.py", "SPIKE_STOP_EXIT_STATUS = 65", "SPIKE_STOP_EXIT_STATUS = 75",
             ("tests/test_loss_spikes.py", "-k", "rewinds_by_itself")),
    # Issue 52: loss spikes, second pass.
    Mutation("guard advice: the spike's skip appended, not merged", "every advice the guard prints is accepted pasted",
             "tokstream/train/spike_guard.py", "    return joined(skips)\n",
             "    return [list(pair) for pair in skips]\n", ("tests/test_spike_advice.py", "-k", "pasted")),
    Mutation("guard advice: a checkpoint after a changed skip", "every advice the guard prints is accepted pasted",
             "tokstream/train/spike_guard.py", "limit = min((pair[0] for pair in changed), default=spike) - 1",
             "limit = spike - 1", ("tests/test_spike_advice.py", "-k", "pasted")),
    Mutation("rewind: nothing kept when no checkpoint moves", "a rewind deletes nothing, metrics lines included",
             "tokstream/train/rewind.py", "if not _lines_of_another_branch(lines, step, skips) or _already_set_aside(",
             "if True or _already_set_aside(", ("tests/test_spike_advice.py", "-k", "newest")),
    Mutation("guard: a window that never judges", "no setting silently does nothing",
             "tokstream/train/config.py", '"guard.window": (16, True,', '"guard.window": (1, True,',
             ("tests/test_spike_advice.py", "-k", "silently")),
    Mutation("skip: past max_steps accepted", "no setting silently does nothing",
             "tokstream/train/config.py", "if max_steps is not None and pair[1] > max_steps:", "if False:",
             ("tests/test_spike_advice.py", "-k", "silently")),
    Mutation("guard: no restart after a rewind", "the guard's statistics restart after a rewind",
             "tokstream/train/trainer.py", 'if after == "rewind" and guard is not None:', "if False:",
             ("tests/test_loss_spikes.py", "-k", "rewinds_by_itself")),
    Mutation("guard: no restart at a phase's start", "no false alarm where a phase changes data, batch or block",
             "tokstream/train/trainer.py", "if run.guard is not None and step == phase.start_step and "
             "run.recipe.changes_statistics(phase):", "if False:", ("tests/test_phases.py", "-k", "example_config_runs")),
    Mutation("notice while starting: waited for", "a preemption notice is honoured during start-up",
             "tokstream/train/preemption.py", "        elif self.starting:\n", "        elif False:\n",
             ("tests/test_s3.py", "-k", "notice_while")),
    Mutation("preemption record: a step saved already", "a relaunch records a preemption whenever a notice stopped it",
             "tokstream/train/trainer.py", '        publish_pointer(run.store, run.progress.step, stopped_by="preemption")',
             "        pass", ("tests/test_training.py", "-k", "status_75")),
    Mutation("skip: the stream moved one unit short", "a skip leaves out exactly its steps' data",
             "tokstream/train/trainer.py", "run.batches.move(phase, run.recipe.read_units_before(phase, first - 1))",
             "run.batches.move(phase, run.recipe.read_units_before(phase, first - 1) - 1)",
             ("tests/test_loss_spikes.py", "-k", "skipped_steps_data")),
    Mutation("guard rewind: the requeue forgets the guard's skips", "a requeued job goes on in the guard's branch",
             "tokstream/train/trainer.py", "kept = keep_guard_rewinds(keep_run_order(config, old[\"config\"]), old[\"config\"])",
             "kept = keep_run_order(config, old[\"config\"])", ("tests/test_loss_spikes.py", "-k", "rewinds_by_itself")),
    Mutation("verify: any --split passes", "verify.py refuses a split the dataset does not have",
             "convert/verify.py", "    if args.split not in meta.splits:", "    if False:",
             ("tests/test_bin_to_mds.py", "-k", "every_format")),
    # CI's failure of 2026-11-28: a rank attached to a block another rank had created but not sized.
    Mutation("shared memory: an unsized block attached at once", "jobs and ranks that start together all start",
             "tokstream/reader/streaming_door/streaming_internals.py",
             'if create or "empty file" not in str(err) or waited >= SIZING_WAIT_S:', "if True:",
             ("tests/test_prefix_registration.py", "-k", "not_sized")),
    Mutation("identity: every split's entry hashed", "a split added beside the one a run reads does not stop it",
             "tokstream/split_check.py", "if name == split}", "}",
             ("tests/test_bin_to_mds.py", "-k", "every_format")),
    Mutation("identity: the former one refused", "runs started before the identity changed resume",
             "tokstream/reader/dataset.py", "return recorded_identity in (self.identity, self.former_identity)",
             "return recorded_identity == self.identity", ("tests/test_reader_api.py", "-k", "start_up_line")),
    Mutation("grace: torchrun's 30 s forgotten", "the grace line warns when torchrun would kill the save",
             "tokstream/train/grace.py", 'if "TORCHELASTIC_RUN_ID" in environ and', "if False and",
             ("tests/test_grace.py",)),
    Mutation("identity: a former checkpoint's streams not found", "a run checkpointed before the identity changed "
             "reads on where it stood", "tokstream/train/phased_batches.py",
             "{streams.get(key, key): position for", "{key: position for",
             ("tests/test_phases.py", "-k", "carried_by_the_state")),
    Mutation("advice: a skip holding the spike grows by guard.skip only", "the advice leaves the spike's data out",
             "tokstream/train/spike_guard.py", "holding[1] + spike - holding[0] + skip,", "holding[1] + skip,",
             ("tests/test_spike_advice.py", "-k", "pasted")),
    Mutation("rewind: a branch known by resume_from alone", "new advice with the same resume_from rewinds",
             "tokstream/train/rewind.py", "for pair in skips or [])", "for pair in [])",
             ("tests/test_spike_advice.py", "-k", "same_resume_from")),
    Mutation("guard: hand-made rewinds_done accepted", "no setting silently does nothing",
             "tokstream/train/config.py", "    check_rewinds_done(config.guard.rewinds_done)\n", "",
             ("tests/test_spike_advice.py", "-k", "silently")),
    Mutation("guard: a NaN is judged by the window", "a NaN or inf loss is a spike, its update not applied",
             "tokstream/train/spike_guard.py", "finite = math.isfinite(loss) and math.isfinite(grad_norm)",
             "finite = True", ("tests/test_spike_advice.py", "-k", "nan_or_inf")),
    Mutation("guard: its window not restored", "a resumed guard judges as the uninterrupted one",
             "tokstream/train/spike_guard.py", '        self.losses.extend(state["losses"])\n', "",
             ("tests/test_spike_advice.py", "-k", "across_a_resume")),
    Mutation("rewind: a save cut off after the target left in place", "nothing is deleted or overwritten",
             "tokstream/train/rewind.py", "for s in survey.complete + survey.without_manifest + survey.stray_manifests",
             "for s in survey.complete + survey.stray_manifests", ("tests/test_spike_advice.py", "-k", "cut_off")),
    Mutation("rewind: the next step's checkpoint left in place", "nothing is deleted or overwritten",
             "tokstream/train/rewind.py", "survey.without_manifest + survey.stray_manifests if s > step})",
             "survey.without_manifest + survey.stray_manifests if s > step + 1})",
             ("tests/test_spike_advice.py", "-k", "cut_off")),
    Mutation("rewind: a manifest whose data file is gone left in place", "nothing is deleted or overwritten",
             "tokstream/train/rewind.py", "survey.without_manifest + survey.stray_manifests if s > step})",
             "survey.without_manifest if s > step})", ("tests/test_spike_advice.py", "-k", "cut_off")),
    Mutation("rewind: later checkpoints' manifests left in place", "nothing is deleted or overwritten",
             "tokstream/train/rewind.py", "for name in (checkpoint_name(later_step), manifest_name(later_step))]",
             "for name in (checkpoint_name(later_step),)]", ("tests/test_spike_advice.py", "-k", "cut_off")),
    Mutation("relaunch: a skip beginning at the checkpoint's step may change", "a trained step's data never changes",
             "tokstream/train/resume_policy.py", "if skip[0] <= step]", "if skip[0] < step]",
             ("tests/test_spike_advice.py", "-k", "first_step_keeps")),
    # Issue 53's review: the skips' relaunch rules, fast and direct (tests/test_resume_policy.py).
    Mutation("relaunch: a new skip begun by the checkpoint's step accepted", "a trained step's data never changes",
             "tokstream/train/resume_policy.py", "    if begun(saved) != begun(now):",
             "    if any(skip not in now for skip in begun(saved)):", ("tests/test_resume_policy.py", "-k", "skip")),
    Mutation("relaunch: skips added to a run from before skip_steps unchecked", "a trained step's data never changes",
             "tokstream/train/resume_policy.py",
             'if "skip_steps" in changed or ("skip_steps" not in old_flat and config.skip_steps):',
             'if "skip_steps" in changed:', ("tests/test_resume_policy.py", "-k", "skip")),
    Mutation("slurm: the job's task count taken for the step's", "srun -n 1 in a bigger job trains alone",
             "tokstream/slurm.py", 'int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1")))',
             'int(environ.get("SLURM_NTASKS", environ.get("SLURM_STEP_NUM_TASKS", "1")))',
             ("tests/test_slurm.py", "-k", "srun_tasks_get or smaller_than_their_job")),
    Mutation("order files: the digest leaves out the streams' counts", "mixtures at other weights sharing an "
             "order_dir each read their own order", "tokstream/reader/order/order_files.py",
             '("shards_per_stream", "chooses", "sampling_method",', '("shards_per_stream", "sampling_method",',
             ("tests/test_order_files.py", "-k", "other_weights")),
    Mutation("order files: the digest leaves out the seed", "runs sharing an order_dir each read their own order",
             "tokstream/reader/order/order_files.py", '"shuffle_algo", "shuffle_seed", "num_canonical_nodes",',
             '"shuffle_algo", "num_canonical_nodes",', ("tests/test_order_files.py", "-k", "every_setting")),
    Mutation("order files: the digest leaves out the block size", "runs sharing an order_dir each read their own "
             "order", "tokstream/reader/order/order_files.py", '"shuffle_block_size")}', ")}",
             ("tests/test_order_files.py", "-k", "every_setting")),
    Mutation("order files: the digest leaves out the shards' sizes", "runs sharing an order_dir each read their own "
             "order", "tokstream/reader/order/order_files.py",
             'described["samples_per_shard"] = hashlib.sha256(self.samples_per_shard.astype("<i8").tobytes()).hexdigest()',
             "pass", ("tests/test_order_files.py", "-k", "every_setting")),
    Mutation("parts: the merge removes the parts folder whole", "another run's parts beside this merge's stay",
             "tokstream/convert/text_parts.py", "    _remove_parts(directories, parts_root(out, options.staging_dir))",
             "    shutil.rmtree(parts_root(out, options.staging_dir))",
             ("tests/test_text_to_mds.py", "-k", "only_the_parts_it_merged")),
    Mutation("dashboards: TensorBoard not flushed at each step", "a SIGKILL loses no step a relaunch keeps",
             "tokstream/train/dashboards.py", "self.tensorboard.flush()  # a SIGKILL", "pass  # a SIGKILL",
             ("tests/test_dashboards.py", "-k", "tensorboard")),
    Mutation("dashboards: W&B's last step not kept", "a relaunch's W&B runs hold each step once",
             "tokstream/train/dashboards.py", 'self.state.wandb_step = record["step"]', "pass",
             ("tests/test_dashboards.py", "-k", "wandb")),
    Mutation("dashboards: a W&B branch not forked", "a W&B branch holds the run's steps up to its relaunch",
             "tokstream/train/dashboards.py",
             "run = wandb.init(**init, fork_from=f\"{branch['of']}?_step={branch['at_step']}\")",
             "run = wandb.init(**init)", ("tests/test_dashboards.py", "-k", "wandb")),
    Mutation("dashboards: TensorBoard's last step not kept", "a relaunch's dashboards show each step once",
             "tokstream/train/dashboards.py", "            self.state.tensorboard_step = record[\"step\"]\n", "",
             ("tests/test_dashboards.py",)),
    Mutation("converters: a dead tokenizer process waited on", "a killed tokenizer process ends the conversion in "
             "one line, resumable", "tokstream/convert/tokenize_docs.py", "return future.result(timeout=1.0)",
             "return future.result()", ("tests/test_owt_to_mds.py", "-k", "killed_while_sending", "--timeout", "60")),
    Mutation("rewind: a notice cuts its moves", "a preemption notice during a rewind lets the rewind finish whole",
             "tokstream/train/preemption.py", "if self.starting and self._holding:", "if False:",
             ("tests/test_spike_advice.py", "-k", "notice_during_a_rewind")),
    Mutation("rewind: lines set aside already are copied again", "a launch stopped after its rewind does not rewind "
             "again", "tokstream/train/rewind.py", "    return store.read_bytes(relative) == lines",
             "    return False", ("tests/test_spike_advice.py", "-k", "rewind_to_the_newest")),
    Mutation("order: the door imported back from the order", "the order is one component, the door adapts "
             "streaming to it", "tokstream/reader/order/sampling.py", "import numpy as np\n",
             "import numpy as np\n\n\ndef _installed():\n    from tokstream.reader import streaming_door\n",
             ("tests/test_layout.py", "-k", "imports_it_back")),
    Mutation("order: py1e's spans cut a sample late", "the py1e order files and replacements give stock's order",
             "tokstream/reader/order/py1e.py", "            if at < end:  # the span crosses",
             "            if at < end - 1:  # the span crosses", ("tests/test_lazy_shuffle.py", "-k", "cut_at_canonical")),
    Mutation("order: granules' last pick not cut", "an epoch drawing a fraction of a stream draws stock's counts",
             "tokstream/reader/order/sampling.py", "    sizes[last] -= int(taken[last]) - remainder\n", "\n",
             ("tests/test_epoch_order.py", "-k", "vectorized_sampling")),
    Mutation("exit: non-daemon threads not waited for", "a rank's exit is a normal exit, without the teardown",
             "tokstream/train/process_exit.py", "    threading._shutdown()  # as a normal exit",
             "    pass  # as a normal exit", ("tests/test_process_exit.py",)),
    Mutation("start-up: the collector left off after the imports", "a rank's start-up freezes torch's objects, and collects after",
             "tokstream/train/process_start.py", "    with collector_paused():\n        yield\n        gc.freeze()",
             "    gc.disable()\n    yield\n    gc.freeze()", ("tests/test_process_start.py",)),
    Mutation("start-up: the collector not paused over the imports", "a rank's start-up freezes torch's objects, and collects after",
             "tokstream/train/process_start.py", "    with collector_paused():\n        yield\n        gc.freeze()",
             "    if True:\n        yield\n        gc.freeze()", ("tests/test_process_start.py",)),
    Mutation("resource tracker: started as streaming starts it", "a Slurm notice reaches the rank alone",
             "tokstream/reader/token_dataset.py", "        start_resource_tracker()  # before the stock",
             "        pass  # before the stock", ("tests/test_reader_api.py", "-k", "notice_to_every")),
    Mutation("resource tracker: notices not blocked at its start", "a Slurm notice reaches the rank alone",
             "tokstream/reader/notices.py", "    with _blocked_in_this_thread():  # from any thread",
             "    with contextlib.nullcontext():  # from any thread",
             ("tests/test_reader_api.py", "tests/test_slurm.py", "-k", "notice_to_every or preempted_job_is_requeued")),
    Mutation("start-up: left frozen for the teardown", "a rank that ends with an error exits through a normal teardown",
             "tokstream/train/process_start.py", "    atexit.register(gc.unfreeze)", "    pass",
             ("tests/test_process_start.py",)),
    Mutation("order files' builder: py1e through streaming's registry", "the builder ahead imports no streaming in py1e",
             "tokstream/reader/streaming_door/__init__.py", '    if not inputs.shuffle or inputs.shuffle_algo == "py1e":',
             "    if False:", ("tests/test_order_files.py", "-k", "builder_ahead")),
    Mutation("imports: the loader's streaming without the deferral", "each module that imports streaming defers transformers",
             "tokstream/reader/token_loader.py",
             "import_streaming()  # before streaming is imported: without transformers and torchvision (streaming_import.py)\n",
             "\n", ("tests/test_layout.py", "-k", "defers_transformers")),
    Mutation("workers: notices not ignored", "a notice to a DataLoader worker leaves the run exact",
             "tokstream/reader/token_loader.py",
             "        signal.signal(signum, signal.SIG_IGN)  # a notice held back since the fork",
             "        pass  # a notice held back since the fork", ("tests/test_training.py", "-k", "dataloader_workers")),
    Mutation("resume: no wait for the next epoch to be set", "a resume from an epoch end's checkpoint reads the next "
             "epoch on every rank", "tokstream/reader/streaming_door/streaming_internals.py",
             "workers_per_node)  # until the next epoch is set",
             "workers_per_node) if False else None  # until the next epoch is set",
             ("tests/test_reader_api.py", "-k", "epoch_ends_checkpoint")),
    Mutation("ledger: numpy's kernels not chosen", "the ledger's order breaks ties as the trainer's readers do",
             "train/ledger.py", "prefer_avx2_sort()  # numpy's kernels as the trainer's here", "pass  # numpy's kernels",
             ("tests/test_cpu_dispatch.py", "-k", "ledger")),
    Mutation("node barrier: an ended peer not looked for", "a rank killed before an epoch starts ends its node's "
             "others in one line instead of leaving them waiting",
             "tokstream/reader/streaming_door/__init__.py",
             "    internals.install_node_barrier(stale_shm.ended_owners, stale_shm.locals_registration)\n",
             "\n", ("tests/test_reader_api.py", "-k", "ends_before_an_epoch")),
    Mutation("node barrier: a released record removed", "a rank that fails on its own before an epoch starts ends "
             "its node's others in one line instead of leaving them waiting", "tokstream/reader/stale_shm.py",
             "        os.replace(path, path.with_name(path.name + RELEASED))", "        path.unlink()",
             ("tests/test_reader_api.py", "-k", "ends_before_an_epoch and fails")),
    Mutation("node barrier: a closed reader's live process still awaited", "a rank that closed its reader before "
             "an epoch starts ends its node's others in one line", "tokstream/reader/stale_shm.py",
             "inode == registration and (released or _ended(", "inode == registration and (_ended(",
             ("tests/test_reader_api.py", "-k", "ends_before_an_epoch and closes")),
    Mutation("node barrier: a rank of another pid namespace judged by its pid", "ranks in containers of their own "
             "that share /dev/shm read on together", "tokstream/reader/stale_shm.py",
             "    if namespace is not None and _PID_NAMESPACE is not None and namespace != _PID_NAMESPACE:",
             "    if False:", ("tests/test_reader_api.py", "-k", "cannot_see")),
    Mutation("node barrier: released records go with the first rank's blocks", "the node's first rank failing "
             "before an epoch starts ends the node's others in one line", "tokstream/reader/stale_shm.py",
             "        if released and (name.partition(\"_\")[0], inode) not in held:",
             "        if released and _recorded_inode(name) != locals_registration(int(name.partition(\"_\")[0])):",
             ("tests/test_reader_api.py", "-k", "ends_before_an_epoch and fails-0-0")),
    Mutation("stale blocks: a killed run of another pid namespace kept for ever", "a relaunch after a hard kill "
             "removes its stale shared memory, also from a container of its own", "tokstream/reader/stale_shm.py",
             "            in_use = any(_start_time(pid) == start for _, pid, start in recorded)",
             "            in_use = any(not _ended(pid, start, (_record(name) or (None, None))[1]) for name, pid, start in recorded)",
             ("tests/test_stale_shm.py",)),
    Mutation("stale blocks: a zombie owner taken as running", "a rank killed before an epoch starts ends its node's "
             "others, also before its parent reaps it", "tokstream/reader/stale_shm.py",
             'return None if fields[0] in ("Z", "X") else int(fields[19])', "return int(fields[19])",
             ("tests/test_reader_api.py", "-k", "ends_before_an_epoch and killed")),
    Mutation("ddp example: the reader's state not loaded", "the README's DDP loop resumes exactly after a preemption",
             "examples/ddp_loop.py", '        batches.load_state_dict(state["batches"])\n', "\n",
             ("tests/test_examples.py", "-k", "ddp")),
    Mutation("checkpoint: the metrics copy after the manifest", "nothing a run wrote is lost to a kill",
             "tokstream/train/checkpoint_files.py",
             "    if metrics is not None:\n        store.publish_bytes(METRICS_FILE, metrics)\n    write_manifest(store, step,"
             " (writer.bytes, writer.digest.hexdigest()), run_id, state.get(\"run\"))\n",
             "    write_manifest(store, step, (writer.bytes, writer.digest.hexdigest()), run_id, state.get(\"run\"))\n"
             "    if metrics is not None:\n        store.publish_bytes(METRICS_FILE, metrics)\n",
             ("tests/test_checkpoint.py", "-k", "metrics_copy")),
]


def scratch_copy(into: Path) -> Path:
    """The working tree's tracked and untracked (not ignored) files, beside a link to ../shared as the tests expect."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    copy = into / ROOT.name
    for relative in filter(None, listed):
        source = ROOT / relative
        if source.is_file():
            (copy / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / relative)
    (into / "shared").symlink_to(SHARED)
    return copy


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float, show_failure: bool = False) -> tuple[int, float]:
    """pytest's status (-1: timed out; SKIPPED_ONLY: it passed, every test skipped on this machine) and seconds."""
    began = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(copy))
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *tests],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        status = done.returncode
        if status == 0 and not re.search(r"\d+ passed", done.stdout):
            status = SKIPPED_ONLY
        if status and status != SKIPPED_ONLY and show_failure:
            print("\n".join([line for line in done.stdout.splitlines() if line.startswith("E ")][:60]))
    except subprocess.TimeoutExpired:
        status = -1
    return status, time.monotonic() - began


def check(mutation: Mutation, copy: Path, timeout: float) -> tuple[str, float]:
    path = copy / mutation.path
    text = path.read_text()
    found = text.count(mutation.old)
    if found != 1:
        return f"not applied ({found} matches: the code moved; update the mutation)", 0.0
    mutated = text.replace(mutation.old, mutation.new)
    try:
        if path.suffix == ".py":  # a shell script (examples/slurm/) is checked by running it
            compile(mutated, str(path), "exec")
    except SyntaxError as err:  # a test failing on a file that does not compile proves nothing
        return f"not applied (the mutated file does not compile: {err.msg})", 0.0
    path.write_text(mutated)
    try:
        status, seconds = run_tests(copy, mutation.tests, timeout)
    finally:
        path.write_text(text)
    # pytest: 1 a test failed; 5 none was collected, 2-4 an error of its own: neither is a catch.
    verdict = {0: "SURVIVED", 1: "caught", -1: "timed out",
               SKIPPED_ONLY: "not run here (its tests skip on this machine)"}.get(status,
                                                                                 f"not run (pytest status {status})")
    return verdict, seconds


def table(rows: list[tuple[Mutation, str, float]]) -> str:
    lines = ["| mutation | claim it breaks | tests | result | s |", "| --- | --- | --- | --- | --- |"]
    for mutation, verdict, seconds in rows:
        lines.append(f"| {mutation.name} (`{mutation.path}`) | {mutation.claim} | `{' '.join(mutation.tests)}` | "
                     f"{verdict} | {seconds:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run the mutations whose name holds this text")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutation's tests")
    parser.add_argument("--write", action="store_true", help=f"write the table to {REPORT.relative_to(ROOT)}")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or args.only in m.name]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as scratch:
        copy = scratch_copy(Path(scratch))
        for tests in dict.fromkeys(m.tests for m in chosen):
            baseline, _ = run_tests(copy, tests, args.timeout, show_failure=True)
            if baseline not in (0, SKIPPED_ONLY):  # a test that fails unmutated proves nothing about a mutation
                print(f"{' '.join(tests)} fails without any mutation (pytest status {baseline}): fix it first",
                      file=sys.stderr)
                return 2
        for mutation in chosen:
            verdict, seconds = check(mutation, copy, args.timeout)
            rows.append((mutation, verdict, seconds))
            print(f"{verdict:>9}  {mutation.name}  ({seconds:.0f} s)", flush=True)
    print(table(rows))
    if args.write:
        caught = sum(verdict == "caught" for _, verdict, _ in rows)
        REPORT.write_text(f"# Mutation check\n\n`scripts/mutation_check.py` on {datetime.date.today()}: {caught} of "
                          f"{len(rows)} mutations caught. Each is one line changed in a scratch copy, and the tests "
                          "named beside it run on that copy; a mutation that survives is a guarantee the suite does "
                          "not hold.\n\n" + table(rows) + "\n")
    return 0 if all(verdict == "caught" for _, verdict, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
