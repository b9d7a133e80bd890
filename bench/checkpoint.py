"""Training stall per checkpoint: synchronous against background saving, to local disk and to S3, in one run.

    python bench/checkpoint.py                                   # GPT-2 124M's state (model + AdamW), 3 rounds
    python bench/checkpoint.py --config configs/tiny.yaml --rounds 1     # smoke run

The state is the 124M config's model and AdamW moments after one optimizer step (1.5 GB in fp32).
Each round saves it four ways, in turn, through tokstream/train/checkpoint.py's Checkpointer (one per
store, kept across rounds as a run keeps it, so from round 2 on the snapshot reuses its buffers):
- sync:       save(step): the loop waits for torch.save, fsync and the rename (or the upload);
- background: save(step, background=True): the loop waits only for the snapshot into host memory,
              then runs training steps (forward, backward, AdamW on the same model) until the write
              is done; those steps' mean time against the steps' time with no save going on is the
              cost the background write still has.
stall = seconds the training loop is paused by the save call. The S3 store is moto's server in a
process of its own on 127.0.0.1: no network, so S3 figures are the software cost of the upload path
(and moto's, which shares this machine's cores with training).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from tokstream.testing.loopback_s3 import free_port  # noqa: E402
from tokstream.train.checkpoint import Checkpointer, Progress  # noqa: E402
from tokstream.train.config import load_config  # noqa: E402
from tokstream.train.distributed import Distributed  # noqa: E402
from tokstream.train.grace import state_bytes  # noqa: E402
from tokstream.train.model import GPT  # noqa: E402
from tokstream.train.run_store import open_run_store  # noqa: E402


def start_moto(bucket: str) -> subprocess.Popen:
    """moto's S3 server as its own process (in this one it would compete with training for the GIL)."""
    import os

    from tokstream.object_store import s3_client

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1",
                               "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(S3_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="loopback",
                      AWS_SECRET_ACCESS_KEY="loopback", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    deadline = time.monotonic() + 60
    while True:
        try:
            s3_client().create_bucket(Bucket=bucket)
            return server
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Training:
    """The model, its AdamW, and a step on a small batch: enough to move the weights and use the cores."""

    def __init__(self, config, tokens: int):
        torch.manual_seed(0)
        self.model = GPT(config.model)
        self.optimizer = self.model.optimizer(config.optim.lr, config.optim.weight_decay,
                                              (config.optim.beta1, config.optim.beta2), "cpu")
        self.batch = torch.randint(0, config.model.vocab_size, (1, tokens + 1))
        self.step()  # AdamW's moments exist from here: the state a checkpoint holds

    def step(self) -> float:
        began = time.perf_counter()
        loss = self.model(self.batch[:, :-1], self.batch[:, 1:])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs/gpt2-124m-owt.yaml"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per training step while a save is written")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()

    config = load_config(args.config, [*args.overrides, "data.remote=unused"])
    training = Training(config, args.tokens)
    single = Distributed(rank=0, world=1, local_rank=0, device=torch.device("cpu"), enabled=False)
    progress = Progress()
    components = {"model": training.model, "optimizer": training.optimizer, "progress": progress}
    size = state_bytes({"model": training.model.state_dict(), "optimizer": training.optimizer.state_dict()})
    alone = statistics.median(training.step() for _ in range(3))
    print(f"state: {size / 1e9:.2f} GB ({training.model.num_params() / 1e6:.0f}M parameters + AdamW), "
          f"training step alone {alone:.3f} s, {torch.get_num_threads()} threads", flush=True)

    moto = start_moto("bench")
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    try:
        with tempfile.TemporaryDirectory(dir=ROOT.parent) as workdir:
            stores = {"local": open_run_store(str(Path(workdir) / "run"), None),
                      "s3": open_run_store("s3://bench/run", str(Path(workdir) / "s3-local"))}
            # One checkpointer per store for the whole bench, as for a whole run: its host buffers are reused.
            checkpointers = {where: Checkpointer(store, 1, single, components, {}) for where, store in stores.items()}
            for round_number in range(args.rounds):
                for where, checkpointer in checkpointers.items():
                    for mode in ("sync", "background"):
                        progress.step += 1
                        began = time.perf_counter()
                        checkpointer.save(progress.step, background=mode == "background")
                        stall = time.perf_counter() - began
                        steps = []
                        while checkpointer.in_flight:
                            steps.append(training.step())
                        checkpointer.wait()
                        slowdown = statistics.mean(steps) / alone if steps else float("nan")
                        write = checkpointer.write_s
                        results.setdefault((where, mode), []).append((stall, write, slowdown))
                        print(f"round {round_number + 1} {where:5} {mode:10} stall {stall:7.3f} s  write {write:7.3f} s"
                              + (f"  {len(steps)} steps during the write, {slowdown:.2f}x their time alone"
                                 if steps else ""), flush=True)
    finally:
        moto.terminate()
        moto.wait()

    print(f"\n{'store':6} {'mode':11} {'stall_s':>8} {'write_s':>8} {'steps_during_write':>19}")
    for (where, mode), rows in results.items():
        stall, write = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        slowdown = statistics.median(r[2] for r in rows)
        during = f"{slowdown:.2f}x step time" if mode == "background" else "-"
        print(f"{where:6} {mode:11} {stall:8.3f} {write:8.3f} {during:>19}")
    ratios = []
    for where in ("local", "s3"):
        sync = statistics.median(r[0] for r in results[(where, "sync")])
        background = statistics.median(r[0] for r in results[(where, "background")])
        ratios.append(f"stall_background_vs_sync_{where}={background / sync:.3f}")
    print(" ".join(ratios) + "  (goal: at most 0.10)")


if __name__ == "__main__":
    main()
