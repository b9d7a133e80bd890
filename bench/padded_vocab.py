"""The tiny configs' vocabulary: GPT-2's 50,257 ids as the model's rows, or padded to 50,304 (a multiple of 64, as the
GPU configs and nanoGPT pad it), and the 2,048 ids of the training tests' vocabulary (tests/conftest.py), in the same
run. A training step of configs/tiny.yaml's model on one rank's micro-batch (4 x 64 tokens, ids drawn from the rows),
one thread as each test rank has, alternating the three over the trials. Printed: CPU seconds per step (medians), and
the ratios to 50,304 rows.

    ./dev python bench/padded_vocab.py --trials 5
"""

import argparse
import statistics
import time

import torch

from tokstream.train.config import ModelConfig
from tokstream.train.model import GPT

ROWS = (50257, 50304, 2048)


def step_cpu_s(vocab_size: int, steps: int) -> float:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=64))
    optimizer = model.optimizer(3e-3, 0.1, (0.9, 0.95), "cpu")
    ids = torch.randint(0, min(vocab_size, 50257), (4, 65))  # GPT-2's ids, or the tests' vocabulary's

    def step() -> None:
        model(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first allocates
    started = time.process_time()
    for _ in range(steps):
        step()
    return (time.process_time() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    times = {rows: [] for rows in ROWS}
    for _ in range(args.trials):
        for rows in ROWS:
            times[rows].append(step_cpu_s(rows, args.steps))
    medians = {rows: statistics.median(values) for rows, values in times.items()}
    print(f"{'model rows':>10}  CPU s per step (median of {args.trials})")
    for rows in ROWS:
        print(f"{rows:>10}  {medians[rows]:.3f}")
    print(f"padded/unpadded: {medians[50304] / medians[50257]:.2f}")
    print(f"tests' 2,048/padded: {medians[2048] / medians[50304]:.3f}")


if __name__ == "__main__":
    main()
