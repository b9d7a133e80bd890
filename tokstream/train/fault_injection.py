"""A crash on purpose, for tests of recovery: TOKSTREAM_CRASH_AT="RANK:STEP" makes that rank exit
abruptly after that step, in torchrun's first attempt only (so `--max-restarts` can recover). Unset,
nothing happens."""

import os

CRASH_STATUS = 13


def crash_if_asked(rank: int, step: int) -> None:
    wanted = os.environ.get("TOKSTREAM_CRASH_AT")
    if not wanted or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    crash_rank, crash_step = (int(part) for part in wanted.split(":"))
    if (rank, step) == (crash_rank, crash_step):
        print(f"rank {rank}: crashing after step {step} (TOKSTREAM_CRASH_AT)", flush=True)
        os._exit(CRASH_STATUS)  # no cleanup, no checkpoint: as a segfault or a failed device would
