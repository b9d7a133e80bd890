"""TensorBoard event files and a Weights & Biases run, written by rank 0 (log.tensorboard, log.wandb;
docs/loss-spikes.md, "Where to look"): each step's numbers from its metrics.jsonl record, on the run's step axis,
continued by every relaunch.

The invariant: neither shows two values for one step of the run's branch. A relaunch trains again the steps after
its checkpoint that an earlier launch logged (after a SIGKILL, or when it rewinds with resume_from):
- TensorBoard: the writer opens with purge_step at the first step trained again, so TensorBoard hides the earlier
  launch's values from there on; a text event ("run") marks every relaunch and rewind at its checkpoint's step.
- W&B: a run's history only grows (W&B's own rewind is a private preview), so a relaunch that would log such steps
  again starts a new W&B run, the next branch: named `<name> (branch N)`, its config saying which run and step it
  branches from (`tokstream_branch`). A relaunch that would not (a preemption saved its step) continues the same
  W&B run, whose id every checkpoint keeps (DashboardState).
"""

import sys
import uuid

from tokstream.errors import UserError
from tokstream.train.config import TrainConfig

# Metrics of a record that are not numbers on a step axis (lists, identities, per-source dicts kept as they are).
NOT_PLOTTED = {"step", "ranks", "nodes", "data", "phase", "samples", "consumed", "samples_per_source", "skipped"}


class DashboardState:
    """The W&B run a run logs to and its branch number: part of every checkpoint, so a relaunch goes on in it."""

    optional_in_checkpoints = True  # a checkpoint from before dashboards: a new W&B run

    def __init__(self) -> None:
        self.wandb_id: str | None = None
        self.branch = 0

    def state_dict(self) -> dict:
        return {"wandb_id": self.wandb_id, "branch": self.branch}

    def load_state_dict(self, state: dict) -> None:
        self.wandb_id, self.branch = state["wandb_id"], state["branch"]


def plotted(record: dict) -> dict[str, float]:
    """The record's numbers by name: a per-source validation loss as val_loss/<source>."""
    numbers = {key: float(value) for key, value in record.items()
               if key not in NOT_PLOTTED and isinstance(value, (int, float)) and not isinstance(value, bool)}
    numbers.update({f"val_loss/{name}": float(loss) for name, loss in record.get("val_loss_per_source", {}).items()})
    if "skipped" in record:  # a skip_steps range left out at this step: its length, as a mark on the curve
        first, last = record["skipped"]["steps"]
        numbers["skipped_steps"] = float(last - first + 1)
    return numbers


class Dashboards:
    """Rank 0's TensorBoard writer and W&B run, either or both; on other ranks, and with neither set, nothing."""

    def __init__(self, tensorboard=None, wandb_run=None):
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    @classmethod
    def open(cls, config: TrainConfig, state: DashboardState, step: int, logged_to: int, rewound: bool,
             local_dir: str, master: bool) -> "Dashboards":
        """Open what config.log names, for a launch that trains from step `step` (its checkpoint's; 0 fresh), after
        earlier launches logged up to step `logged_to` (metrics.jsonl's last line before this launch truncated it)."""
        if not master or (not config.log.tensorboard and not config.log.wandb):
            return cls()
        again = logged_to > step  # steps an earlier launch logged are trained again
        if step:
            event = (f"rewound to step {step}: steps {step + 1}-{logged_to} moved to abandoned/" if rewound
                     else f"relaunched from step {step}" + (f", training steps {step + 1}-{logged_to} again" if again
                                                             else ""))
        else:
            event = None
        tensorboard = _tensorboard(config.log.tensorboard, step, event) if config.log.tensorboard else None
        wandb_run = _wandb_run(config, state, step, again, event, local_dir) if config.log.wandb else None
        return cls(tensorboard, wandb_run)

    def write(self, record: dict) -> None:
        if self.tensorboard is None and self.wandb_run is None:
            return
        numbers = plotted(record)
        if self.tensorboard is not None:
            for name, value in numbers.items():
                self.tensorboard.add_scalar(name, value, record["step"])
            self.tensorboard.flush()  # a SIGKILL loses no step a later relaunch does not train again
        if self.wandb_run is not None:
            self.wandb_run.log(numbers, step=record["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        self.tensorboard = self.wandb_run = None


def _needs(package: str, setting: str):
    try:
        return __import__(package)
    except ImportError:
        raise UserError(f"{setting} needs the {package} package: pip install 'tokstream[dashboards]', or unset "
                        f"{setting}") from None


def _tensorboard(folder: str, step: int, event: str | None):
    _needs("tensorboard", "log.tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    # purge_step: TensorBoard drops what earlier files hold from that step on (the steps trained again).
    writer = SummaryWriter(folder, purge_step=step + 1 if step else None)
    if event:
        writer.add_text("run", event, global_step=step)
        writer.flush()
    return writer


def _wandb_run(config: TrainConfig, state: DashboardState, step: int, again: bool, event: str | None,
               local_dir: str):
    wandb = _needs("wandb", "log.wandb")
    settings = dict(config.log.wandb)
    user_config = settings.pop("config", None) or {}
    settings.setdefault("dir", local_dir)  # its files beside metrics.jsonl, not in the working directory
    extra = {}
    if state.wandb_id is not None and again:  # a new branch: the old run keeps what it logged
        state.branch += 1
        extra["tokstream_branch"] = {"of": state.wandb_id, "at_step": step, "branch": state.branch}
        state.wandb_id = None
    if state.wandb_id is None:
        state.wandb_id = uuid.uuid4().hex[:12]  # W&B's own ids are 8 such characters
    if state.branch:
        settings["name"] = f"{settings.get('name') or config.run_dir} (branch {state.branch})"
    init = dict(settings, id=state.wandb_id, config={**config.to_dict(), **extra, **user_config})
    if extra:  # W&B's own mark of a branch, where the server offers forking; the config says it either way
        try:
            run = wandb.init(**init, fork_from=f"{extra['tokstream_branch']['of']}?_step={step}")
        except Exception as err:  # noqa: BLE001  (a server without forking: the branch is a run of its own)
            print(f"wandb: forking refused ({err}); the branch is a run of its own", file=sys.stderr)
            run = wandb.init(**init)
    else:
        run = wandb.init(**init, resume="allow")  # the run the checkpoint names, or a new one
    if event:
        print(f"wandb: {event}; logging to run {state.wandb_id}", file=sys.stderr)
    return run
