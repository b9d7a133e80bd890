"""Vouch for checkpoint files that have no manifest, so that a relaunch may resume from them.

    python train/vouch.py RUN_DIR              # every checkpoint file without a manifest
    python train/vouch.py RUN_DIR --step 4000  # only that one

A relaunch resumes only from checkpoints whose manifest (size and checksum, written after the data)
matches their file. Checkpoints written by tokstream before 2026-11-24 have none, nor does a save cut
off between its file and its manifest. This writes one for each file named, after checking that it
loads as the trainer's checkpoint of the step its name says. Nothing is deleted.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from tokstream.errors import CommandLine, run_cli  # noqa: E402


def main() -> int:
    parser = CommandLine(__doc__)
    parser.add_argument("run_dir", help="the run's directory, or s3://bucket/prefix")
    parser.add_argument("--step", type=int, action="append", help="a checkpoint's step (repeatable); default: all")
    parser.add_argument("--run-local", help="scratch for an S3 run's downloads (default: under TMPDIR)")
    args = parser.parse_args()
    from tokstream.train.checkpoint import vouch_for
    from tokstream.train.run_store import open_run_store

    for line in vouch_for(open_run_store(args.run_dir, args.run_local), args.step):
        print(line)
    return 0


if __name__ == "__main__":
    run_cli(main, interrupted="interrupted: a manifest is written whole or not at all; run it again for the checkpoints still without one")
