"""numpy's AVX2 sort on AMD Zen 4 (tokstream/train/cpu_dispatch.py): which CPUs, and what numpy then uses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokstream.train.cpu_dispatch import FEATURE, VARIABLE, is_zen4

ROOT = Path(__file__).resolve().parents[1]
THIS_MACHINE_HAS_AVX512F = "avx512f" in Path("/proc/cpuinfo").read_text().split()


def cpuinfo(vendor: str, family: int, flags: str) -> str:
    """The first processor's block of /proc/cpuinfo, and the start of a second."""
    return (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: 17\n"
            f"flags\t\t: fpu sse2 avx2 {flags}\n\nprocessor\t: 1\nvendor_id\t: {vendor}\n")


ZEN4 = cpuinfo("AuthenticAMD", 25, "avx512f avx512bw avx512vl")
SAPPHIRE_RAPIDS = cpuinfo("GenuineIntel", 6, "avx512f avx512bw")


@pytest.mark.parametrize("text, expected", [
    (ZEN4, True),
    (cpuinfo("AuthenticAMD", 25, "vaes"), False),  # Zen 3: the same family, no AVX-512
    (cpuinfo("AuthenticAMD", 26, "avx512f avx512bw"), False),  # Zen 5: its AVX-512 sort is fast
    (SAPPHIRE_RAPIDS, False),
    (cpuinfo("AuthenticAMD", 25, "avx512fx"), False),  # a flag is a whole word
    ("", False),
])
def test_zen4_is_amd_family_0x19_with_avx512(text, expected):
    assert is_zen4(text) is expected


def numpy_after(cpu: str | None, feature: str | None = None, **env: str) -> dict:
    """In a fresh interpreter: prefer_avx2_sort() given this cpuinfo (None: a machine without
    /proc/cpuinfo) and FEATURE, if given; then whether numpy may dispatch to any AVX-512 kernel, and
    the variable, as the process sees them."""
    script = ("import json, os, pathlib\nfrom tokstream.train import cpu_dispatch\n"
              + (f"cpu_dispatch.FEATURE = {feature!r}\n" if feature else "")
              + ("cpu_dispatch.CPUINFO = pathlib.Path('/nonexistent/cpuinfo')\n" if cpu is None else "")
              + f"changed = cpu_dispatch.prefer_avx2_sort({cpu!r})\n"
              "import numpy as np\nfrom numpy._core._multiarray_umath import __cpu_features__, __cpu_dispatch__\n"
              "assert np.sort(np.arange(100)[::-1])[0] == 0\n"
              "avx512 = any(__cpu_features__[t] for t in __cpu_dispatch__ if t.startswith(('AVX512', 'X86_V4')))\n"
              f"print(json.dumps({{'changed': changed, 'variable': os.environ.get({VARIABLE!r}),"
              " 'avx512f': avx512}))\n")
    clean = {name: value for name, value in os.environ.items() if name != VARIABLE}
    done = subprocess.run([sys.executable, "-c", script], env={**clean, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_on_zen4_the_variable_is_set_before_numpy_is_imported():
    zen4 = numpy_after(ZEN4)
    assert zen4["changed"] is True and zen4["variable"] == FEATURE


@pytest.mark.skipif(not THIS_MACHINE_HAS_AVX512F, reason="numpy has no AVX-512 kernels to leave out on a CPU "
                    "without AVX-512F: it reports the feature absent whatever the variable says")
def test_on_zen4_numpy_is_imported_without_the_avx512_kernels_it_uses_here_otherwise():
    assert numpy_after(SAPPHIRE_RAPIDS)["avx512f"] is True  # this numpy, on this CPU, left to itself
    assert numpy_after(ZEN4)["avx512f"] is False


def test_elsewhere_numpy_keeps_its_own_choice():
    intel = numpy_after(SAPPHIRE_RAPIDS)
    assert intel["changed"] is False and intel["variable"] is None
    assert intel["avx512f"] == THIS_MACHINE_HAS_AVX512F


def test_without_a_readable_cpuinfo_numpy_keeps_its_own_choice():
    unknown = numpy_after(None)
    assert unknown["changed"] is False and unknown["variable"] is None


def test_a_variable_the_user_set_even_empty_is_left_as_it_is():
    assert numpy_after(ZEN4, **{VARIABLE: ""})["variable"] == ""
    chosen = numpy_after(ZEN4, **{VARIABLE: "AVX512_ICL"})
    assert chosen["changed"] is False and chosen["variable"] == "AVX512_ICL"


def test_a_numpy_that_refuses_to_leave_a_feature_out_is_imported_as_it_is():
    # numpy's baseline stands for AVX-512 in a numpy built to require it: numpy refuses (a RuntimeError
    # on import) to leave out what it requires.
    from numpy._core._multiarray_umath import __cpu_baseline__

    refused = numpy_after(ZEN4, feature=__cpu_baseline__[-1])
    assert refused["changed"] is False and refused["variable"] is None
    assert refused["avx512f"] == THIS_MACHINE_HAS_AVX512F


@pytest.mark.parametrize("tool", ["train/main.py", "train/ledger.py", "train/build_orders.py"])
def test_training_and_the_tools_computing_its_orders_choose_before_anything_imports_numpy(tool):
    # the tool's imports, then whether numpy was loaded by the time prefer_avx2_sort() runs (the same kernels as the
    # trainer's: an epoch whose py1e positions tie is ordered by an unstable argsort, which they break alike)
    script = (f"import sys, runpy\nsys.argv = [{str(ROOT / tool)!r}]\n"
              "from tokstream.train import cpu_dispatch\nreal = cpu_dispatch.prefer_avx2_sort\n"
              "cpu_dispatch.prefer_avx2_sort = lambda: print('numpy' in sys.modules) or real()\n"
              f"runpy.run_path({str(ROOT / tool)!r}, run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True)
    assert done.stdout.splitlines()[0] == "False", done.stdout + done.stderr
