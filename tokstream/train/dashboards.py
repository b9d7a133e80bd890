"""TensorBoard event files and a Weights & Biases run, written by rank 0 (log.tensorboard, log.wandb;
docs/loss-spikes.md, "Where to look"): each step's numbers from its metrics.jsonl record, on the run's step axis,
continued by every relaunch.

The invariant: neither shows two values for one step of the run's branch. Every checkpoint keeps the W&B run's id
and, per dashboard, the last step it was given along the branch (DashboardState; a launch with a dashboard off
gives it nothing). A relaunch from step S may train again steps some launch logged (a SIGKILL after the last
checkpoint, a rewind, another branch's launch):
- TensorBoard: the writer opens with purge_step just after the last step it holds of this branch (at most S), so
  TensorBoard hides whatever its files hold from there on; a text event ("run") at step S + 1 marks the relaunch.
- W&B: a run's history only grows (W&B's own rewind is a private preview). The run goes on only when it holds this
  branch up to S exactly and no launch can have logged past S (metrics.jsonl says so where it is written in place;
  for an S3 run, a checkpoint saved on a preemption notice or at the run's end). Otherwise the relaunch starts the
  next branch: a new W&B run named `<name> (branch N)`, forked from the old at the last step they share, its config
  saying which run and step (`tokstream_branch`).
"""

import sys
import uuid
from dataclasses import dataclass

from tokstream.errors import UserError
from tokstream.train.config import TrainConfig

# Metrics of a record that are not numbers on a step axis (lists, identities, per-source dicts kept as they are).
NOT_PLOTTED = {"step", "ranks", "nodes", "data", "phase", "samples", "consumed", "samples_per_source", "skipped",
               "guard", "relaunch"}


class DashboardState:
    """The W&B run a run logs to, its branch number, and the last step each dashboard was given along the run's
    branch: part of every checkpoint, so that a relaunch knows what each already holds."""

    optional_in_checkpoints = True  # a checkpoint from before dashboards: a new W&B run

    def __init__(self) -> None:
        self.wandb_id: str | None = None
        self.branch = 0
        self.wandb_step = 0  # the last step logged to wandb_id that is on this branch
        self.tensorboard_step = 0  # the last step written to TensorBoard that is on this branch

    def state_dict(self) -> dict:
        return {"wandb_id": self.wandb_id, "branch": self.branch, "wandb_step": self.wandb_step,
                "tensorboard_step": self.tensorboard_step}

    def load_state_dict(self, state: dict) -> None:
        self.wandb_id, self.branch = state["wandb_id"], state["branch"]
        self.wandb_step, self.tensorboard_step = state.get("wandb_step", 0), state.get("tensorboard_step", 0)


@dataclass(frozen=True)
class Takeover:
    """Where a launch takes over its run: the checkpoint's step (0: fresh), and whether any launch may have logged a
    step after it (`after_logged`: a SIGKILL after the last checkpoint, a rewind; known from metrics.jsonl where it
    is written in place, else unless the checkpoint says a preemption or the run's end saved it)."""

    step: int
    after_logged: bool
    event: str | None  # the mark for the dashboards ("relaunched from step S (preemption)"), None for a fresh run


def plotted(record: dict) -> dict[str, float]:
    """The record's numbers by name: a per-source validation loss as val_loss/<source>, the guard's z-scores as
    guard/<name>, a skip's length as skipped_steps."""
    numbers = {key: float(value) for key, value in record.items()
               if key not in NOT_PLOTTED and isinstance(value, (int, float)) and not isinstance(value, bool)}
    numbers.update({f"val_loss/{name}": float(loss) for name, loss in record.get("val_loss_per_source", {}).items()})
    numbers.update({f"guard/{name}": float(value) for name, value in (record.get("guard") or {}).items()
                    if isinstance(value, (int, float)) and not isinstance(value, bool)})
    if "skipped" in record:  # a skip_steps range left out at this step: its length, as a mark on the curve
        first, last = record["skipped"]["steps"]
        numbers["skipped_steps"] = float(last - first + 1)
    return numbers


class Dashboards:
    """Rank 0's TensorBoard writer and W&B run, either or both; on other ranks, and with neither set, nothing."""

    def __init__(self, state: DashboardState | None = None, tensorboard=None, wandb_run=None):
        self.state, self.tensorboard, self.wandb_run = state, tensorboard, wandb_run

    @classmethod
    def open(cls, config: TrainConfig, state: DashboardState, takeover: Takeover, local_dir: str,
             master: bool) -> "Dashboards":
        """Open what config.log names for a launch taking over at `takeover`; `state` is the checkpoint's."""
        if not master or (not config.log.tensorboard and not config.log.wandb):
            return cls()
        wandb_run = _wandb_run(config, state, takeover, local_dir) if config.log.wandb else None
        tensorboard = _tensorboard(config.log.tensorboard, state, takeover) if config.log.tensorboard else None
        return cls(state, tensorboard, wandb_run)

    def write(self, record: dict) -> None:
        if self.tensorboard is None and self.wandb_run is None:
            return
        numbers = plotted(record)
        if self.tensorboard is not None:
            for name, value in numbers.items():
                self.tensorboard.add_scalar(name, value, record["step"])
            self.tensorboard.flush()  # a SIGKILL loses no step a later relaunch does not train again
            self.state.tensorboard_step = record["step"]
        if self.wandb_run is not None:
            self.wandb_run.log(numbers, step=record["step"])
            self.state.wandb_step = record["step"]

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


def _tensorboard(folder: str, state: DashboardState, takeover: Takeover):
    _needs("tensorboard", "log.tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    # purge_step: TensorBoard hides what its files hold from that step on: every step after the last one this
    # branch gave it (steps a SIGKILL or a rewind makes the run train again, or another branch's).
    shared = min(takeover.step, state.tensorboard_step)
    writer = SummaryWriter(folder, purge_step=shared + 1)
    state.tensorboard_step = shared
    if takeover.event:  # at the launch's first step: the next relaunch from here purges it with its steps
        writer.add_text("run", takeover.event, global_step=takeover.step + 1)
        writer.flush()
    return writer


# wandb.init's arguments the project sets itself: a relaunch's run and branch are the checkpoint's to say.
WANDB_OWN = ("id", "resume", "fork_from", "resume_from")


def _check_wandb_settings(settings: dict, wandb) -> None:
    import inspect

    known = set(inspect.signature(wandb.init).parameters)
    for key in settings:
        if key in WANDB_OWN:
            raise UserError(f"log.wandb.{key}: the run's W&B id and branch are kept in its checkpoints; leave {key} out")
        if key not in known:
            hint = " (YAML reads {project:p} as one key: put a space after the colon)" if ":" in str(key) else ""
            raise UserError(f"log.wandb holds {key!r}, which wandb.init does not take{hint}; give wandb.init's "
                            "settings, e.g. {project: gpt2, entity: me}")


def _wandb_run(config: TrainConfig, state: DashboardState, takeover: Takeover, local_dir: str):
    wandb = _needs("wandb", "log.wandb")
    settings = dict(config.log.wandb)
    _check_wandb_settings(settings, wandb)
    user_config = settings.pop("config", None) or {}
    settings.setdefault("dir", local_dir)  # its files beside metrics.jsonl, not in the working directory
    extra = {}
    # The W&B run goes on only if it holds exactly this branch's steps up to the takeover, and none after it.
    goes_on = state.wandb_step == takeover.step and not takeover.after_logged
    if state.wandb_id is not None and not goes_on:  # a new branch: the old run keeps what it logged
        state.branch += 1
        shared = min(takeover.step, state.wandb_step)
        extra["tokstream_branch"] = {"of": state.wandb_id, "at_step": shared, "branch": state.branch}
        state.wandb_id = None
    if state.wandb_id is None:
        state.wandb_id = uuid.uuid4().hex[:12]  # W&B's own ids are 8 such characters
        state.wandb_step = extra.get("tokstream_branch", {}).get("at_step", 0)
    if state.branch:
        settings["name"] = f"{settings.get('name') or config.run_dir} (branch {state.branch})"
    init = dict(settings, id=state.wandb_id, config={**config.to_dict(), **extra, **user_config})
    if extra:  # W&B's own mark of a branch, where the server offers forking; the config says it either way
        branch = extra["tokstream_branch"]
        try:
            run = wandb.init(**init, fork_from=f"{branch['of']}?_step={branch['at_step']}")
        except wandb.errors.Error as err:  # a server without forking: the branch is a run of its own
            print(f"wandb: forking refused ({err}); the branch is a run of its own", file=sys.stderr)
            run = wandb.init(**init)
    else:
        run = wandb.init(**init, resume="allow")  # the run the checkpoint names, or a new one
    if takeover.event:
        print(f"wandb: {takeover.event}; logging to run {state.wandb_id}", file=sys.stderr)
    return run
