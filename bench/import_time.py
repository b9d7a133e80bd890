"""A training rank's imports: the project's (streaming without transformers and torchvision until used,
tokstream/reader/streaming_door/streaming_import.py) against stock `import streaming`, fresh processes, same run.

    python bench/import_time.py             # 5 alternating runs of each
    python bench/import_time.py --runs 9

Each run is a new interpreter timing, from its first line, `import torch` and then what follows; the
median of the runs is shown. Both warm: the files are in the page cache after the first run.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TIMED = """
import json, sys, time
started = time.perf_counter()
import torch
torch_s = time.perf_counter() - started
{imports}
print(json.dumps({{"torch_s": torch_s, "total_s": time.perf_counter() - started,
                   "transformers": "transformers" in sys.modules, "torchvision": "torchvision" in sys.modules}}))
"""
WAYS = {
    "stock: import streaming": "import streaming",
    "project: tokstream.reader.batches": "import tokstream.reader.batches, streaming",
}


def run_once(imports: str) -> dict:
    out = subprocess.run([sys.executable, "-c", TIMED.format(imports=imports)], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(args.runs):  # alternating, so that the machine's drift hits both alike
        for way, imports in WAYS.items():
            results[way].append(run_once(imports))
    print(f"{'imports':<32} {'torch_s':>8} {'total_s':>8} {'after_torch_s':>13}  transformers torchvision")
    medians = {}
    for way, runs in results.items():
        torch_s = statistics.median(r["torch_s"] for r in runs)
        total_s = statistics.median(r["total_s"] for r in runs)
        medians[way] = total_s
        print(f"{way:<32} {torch_s:8.2f} {total_s:8.2f} {total_s - torch_s:13.2f}  {runs[0]['transformers']!s:>12} "
              f"{runs[0]['torchvision']!s:>11}")
    stock, project = medians.values()
    print(f"ratio_project_vs_stock={project / stock:.2f} (total, median of {args.runs})")


if __name__ == "__main__":
    main()
