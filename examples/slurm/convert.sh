#!/usr/bin/env bash
# A conversion in parts as a Slurm job array, and the merge as a job that waits for every part.
#
#   examples/slurm/convert.sh PARTS convert/text_to_mds.py INPUT... --out OUT [options...]
#
# Task I of the array converts part I of PARTS (the converter reads SLURM_ARRAY_TASK_ID); the merge
# starts once every task has ended well (--dependency=afterok). If a task fails or is cancelled, the
# merge is cancelled with it (--kill-on-invalid-dep): run the same command again. Finished parts are
# kept, so only the missing ones are converted, and the merge's bytes are a one-pass conversion's.
# Run it from the repository's root, in the Python environment the jobs should use (sbatch passes the
# environment on). sbatch's own settings come from its SBATCH_* variables (SBATCH_PARTITION, ...).
set -euo pipefail
if [[ $# -lt 3 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
    sed -n '4p' "$0" >&2
    exit 2
fi
parts=$1
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
array=$(sbatch --parsable --array="0-$((parts - 1))" --job-name=tokstream-convert "$here/convert.sbatch" \
        "$@" --num-parts "$parts")
merge=$(sbatch --parsable --dependency="afterok:${array%%;*}" --kill-on-invalid-dep=yes \
        --job-name=tokstream-merge --output=%x-%j.out "$here/convert.sbatch" "$@" --num-parts "$parts" --merge)
echo "parts: job ${array%%;*} (array 0-$((parts - 1))); merge: job ${merge%%;*}"
