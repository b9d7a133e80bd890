"""bin_to_mds.py throughput against `cp` of the same file on the same disk, in one run.

    python bench/bin_speed.py                      # 512 M tokens (1 GiB) built from ../shared/corpora
    python bench/bin_speed.py --tokens 1000 --workdir /scratch

`cp` is the physical limit of a copy-and-reframe: read every byte once, write every byte once. On
Linux it copies with copy_file_range, inside the kernel; `dd` is shown too, a copy that passes the
bytes through user space as the converter must. All write into the page cache without fsync; all
are timed end to end as fresh processes, best of two alternating runs each.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_bin(path: Path, million_tokens: int) -> int:
    """A nanoGPT-style uint16 .bin: the real corpora's GPT-2 tokens, repeated to the requested size."""
    from tokstream.tokenizer import load_tokenizer

    encoding = load_tokenizer("gpt2").encoding
    corpora = ROOT.parent / "shared" / "corpora"
    tokens = np.array([t for name in ("wikitext2_valid.txt", "tinyshakespeare.txt")
                       for t in encoding.encode_ordinary((corpora / name).read_text()) + [encoding.eot_token]],
                      dtype=np.uint16)
    target = million_tokens * 1_000_000
    with open(path, "wb") as out:
        written = 0
        while written < target:
            piece = tokens[: target - written]
            piece.tofile(out)
            written += len(piece)
    return target


def timed(command: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one fresh process tree."""
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    if status:
        raise SystemExit(f"{command[:3]} failed ({status})")
    return time.perf_counter() - started, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="millions of tokens in the .bin")
    parser.add_argument("--workdir", default=None, help="directory on the disk to measure (default: temp)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        source = tmp / "train.bin"
        tokens = build_bin(source, args.tokens)
        # Alternate the three, twice, each after a sync, and keep each one's best run: writeback of
        # the previous run's gigabyte otherwise lands on whichever command comes next.
        runs: dict[str, list[tuple[float, float]]] = {"cp": [], "dd": [], "bin_to_mds.py": []}
        commands = {
            "cp": ["cp", str(source), str(tmp / "copy.bin")],
            "dd": ["dd", f"if={source}", f"of={tmp / 'copy.bin'}", "bs=4M", "status=none"],
            "bin_to_mds.py": [sys.executable, str(ROOT / "convert/bin_to_mds.py"), str(source), "--out",
                              str(tmp / "out"), "--no-progress", "--overwrite"],
        }
        for _ in range(2):
            for name, command in commands.items():
                subprocess.run(["sync"], check=True)
                runs[name].append(timed(command))
                (tmp / "copy.bin").unlink(missing_ok=True)
        best = {name: min(values) for name, values in runs.items()}
    size = tokens * 2 / 1e6
    print(f"input: {tokens / 1e6:.0f} M tokens, {size:.0f} MB nanoGPT .bin")
    labels = {"cp": "cp (copy_file_range, in-kernel)", "dd": "dd bs=4M (through user space)",
              "bin_to_mds.py": "bin_to_mds.py"}
    for name, (seconds, rss) in best.items():
        print(f"{labels[name]:32s}: {seconds:6.2f} s  {tokens / seconds / 1e6:7.1f} M tok/s  "
              f"{size / seconds:7.0f} MB/s  peak RSS {rss:5.0f} MB")
    print(f"ratio_bin_to_mds_vs_cp={best['cp'][0] / best['bin_to_mds.py'][0]:.2f} "
          f"ratio_bin_to_mds_vs_dd={best['dd'][0] / best['bin_to_mds.py'][0]:.2f}")


if __name__ == "__main__":
    main()
