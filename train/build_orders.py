"""Build a run's epoch orders ahead of time, where its readers would otherwise build them at the first launch and
at each epoch's start (streaming's orders, kept as files in data.order_dir: by default <run_dir>/orders).

    python train/build_orders.py configs/gpt2-124m-owt.yaml data.remote=data/owt run_dir=runs/gpt2 --epochs 2

The config and overrides are the run's, as torchrun train/main.py takes them. Building an epoch takes one process
about as long, and as much memory, as a node's first rank would take at that epoch's start; every launch then maps
the files. Data read in the lazy order (docs/scale.md) needs none.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from tokstream.train.cpu_dispatch import prefer_avx2_sort  # noqa: E402

prefer_avx2_sort()  # numpy's kernels as the trainer's here: the orders it builds break ties as its readers do

from tokstream.errors import CommandLine, UserError, run_cli  # noqa: E402


def main() -> None:
    parser = CommandLine(__doc__)
    parser.add_argument("config", help="the run's YAML config (configs/)")
    parser.add_argument("--epochs", type=int, default=1, help="how many epochs' orders, from the first (default 1)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="the run's overrides, e.g. run_dir=DIR")
    args = parser.parse_intermixed_args()
    if args.epochs < 1:
        raise UserError(f"--epochs {args.epochs}: give how many epochs to build, at least 1")

    from tokstream.train.config import load_config
    from tokstream.train.orders_ahead import build_orders

    for line in build_orders(load_config(args.config, args.overrides), range(args.epochs)):
        print(line)


if __name__ == "__main__":
    run_cli(main)
