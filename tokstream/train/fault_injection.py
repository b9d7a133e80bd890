"""A crash on purpose, for tests of recovery: TOKSTREAM_CRASH_AT="RANK:STEP" makes that rank exit
abruptly after that step, in torchrun's first attempt only (so `--max-restarts` can recover). Unset,
nothing happens."""

import os

CRASH_STATUS = 13
_WANTED = os.environ.get("TOKSTREAM_CRASH_AT") if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else None
_CRASH_AT = tuple(int(part) for part in _WANTED.split(":")) if _WANTED else None  # (rank, step), read once


def crash_if_asked(rank: int, step: int) -> None:
    if (rank, step) == _CRASH_AT:
        print(f"rank {rank}: crashing after step {step} (TOKSTREAM_CRASH_AT)", flush=True)
        os._exit(CRASH_STATUS)  # no cleanup, no checkpoint: as a segfault or a failed device would
