"""Used by train/main.py (and bench/scale.py) before numpy loads: the reader's epoch order sorts with numpy, whose
sort on AMD Zen 4 must take its AVX2 kernel, not its AVX-512 one, which is 4-5 times slower there. The tools that
compute a run's orders again (train/ledger.py, train/build_orders.py) call it too: where an epoch's py1e positions
tie, its order is an unstable argsort's, which the two kernels break differently.

numpy sorts 32- and 64-bit numbers with x86-simd-sort, whose AVX-512 kernel it picks wherever the
CPU has AVX-512. Zen 4 (AMD family 0x19 with AVX-512) runs that kernel's compress-stores to memory
in microcode: 8.8 M int64 took 0.57 s to sort on this project's Zen 4 machine, 0.11 s with the AVX2
kernel. That sort is most of what every rank waits for before its first batch, at each start and
each epoch (the epoch order's py1e shuffle, tokstream/reader/order/py1e.py; bench/scale.py).

numpy chooses its kernels once, when it is imported, from NPY_DISABLE_CPU_FEATURES. So training's
entry point calls `prefer_avx2_sort()` before anything imports numpy, which sets the variable to
every AVX-512 target numpy may dispatch to, on Zen 4 only, and only where it is unset: set it yourself,
even to nothing, to choose. Every target is named: leaving out AVX512F alone left numpy 2.1's
AVX512_SKX sort in use, and numpy 2.5 names its targets by x86-64 level (X86_V4). A name a numpy does not
dispatch to is ignored by it.
numpy's other AVX-512 loops then run as AVX2, which Zen 4 executes at the same width (it splits
512-bit operations in two). Zen 5 (family 0x1A) and Intel run the AVX-512 sort fast: left alone.
"""

import os
import subprocess
import sys
from pathlib import Path

VARIABLE = "NPY_DISABLE_CPU_FEATURES"
CPUINFO = Path("/proc/cpuinfo")
# numpy 2.0-2.4's AVX-512 targets, then 2.5's; each numpy ignores the names it does not know
FEATURE = "AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR X86_V4"
ZEN_3_AND_4_FAMILY = 0x19  # Zen 3 has no AVX-512


def prefer_avx2_sort(cpuinfo: str | None = None) -> bool:
    """On AMD Zen 4, import numpy without its AVX-512 kernels, unless the user chose; whether it did.

    Call it before anything imports numpy. A numpy built to require AVX-512 refuses to leave them out
    (a RuntimeError on import): then numpy is left as it is."""
    if VARIABLE in os.environ or "numpy" in sys.modules:
        return False
    if not (on_zen4() if cpuinfo is None else is_zen4(cpuinfo)):
        return False
    if not imports_without(FEATURE):
        return False
    os.environ[VARIABLE] = FEATURE
    return True


def imports_without(features: str) -> bool:
    """Whether numpy imports with `features` left out, tried in a child process: a numpy that refuses
    cannot be imported again in the process that tried (numpy 2.5: "cannot load module more than once")."""
    env = {**os.environ, VARIABLE: features}
    return subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True).returncode == 0


def on_zen4() -> bool:
    """Whether this machine is AMD Zen 4; False where /proc/cpuinfo cannot be read (numpy's own
    choice, rather than no training)."""
    try:
        return is_zen4(CPUINFO.read_text())
    except OSError:
        return False


def is_zen4(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's text describes AMD Zen 4: family 0x19 with AVX-512."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block will do: a machine's cores are alike
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return (fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == str(ZEN_3_AND_4_FAMILY)
            and "avx512f" in fields.get("flags", "").split())
