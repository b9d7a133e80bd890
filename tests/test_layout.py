"""The layout's rules, checked on the source: streaming's internals behind one fence, no path tricks."""

import importlib.util
import re

import pytest
from conftest import ROOT

FENCE = ROOT / "tokstream/train/streaming_internals.py"
# Private names of mosaicml-streaming the project relies on (see the fence's docstring).
STREAMING_PRIVATE = re.compile(
    r"streaming\.base|_ShardState|_shard_states|_shard_access_times|_prepare_thread|_ready_thread|"
    r"_pack_locals|_unpack_locals|_shm_prefix_int|\._event\b|\bTICK\b|_shared_barrier|_cache_filelock|"
    r"_evict_coldest_shard"
)
# This test, and the stock reference process and its test, which check by these names that streaming is as shipped.
NAMES_STREAMING_ON_PURPOSE = (ROOT / "tests/test_layout.py", ROOT / "tests/stock_streaming.py",
                              ROOT / "tests/test_stock_streaming.py")
SCRIPT_FOLDERS = ("convert", "train", "bench", "scripts")
PATH_EDIT = re.compile(r"sys\.path\.(insert|append|extend|remove)\(|sys\.path\s*(\+)?=")
ROOT_FIRST = ("sys.path.insert(0, str(ROOT))", "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))")


def python_files() -> list:
    folders = ("tokstream", "tests", *SCRIPT_FOLDERS)
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_streaming_internals_are_used_only_behind_the_fence():
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in python_files() if path not in (FENCE, *NAMES_STREAMING_ON_PURPOSE)
                 for number, line in enumerate(path.read_text().splitlines(), start=1)
                 if STREAMING_PRIVATE.search(line)]
    assert not offenders, "\n".join(offenders)
    assert STREAMING_PRIVATE.search(FENCE.read_text())  # the pattern still finds what the fence does


def test_only_scripts_edit_sys_path_and_only_to_put_the_repository_root_first():
    edits = {path: [line.strip() for line in path.read_text().splitlines() if PATH_EDIT.search(line)]
             for path in python_files() if path != ROOT / "tests/test_layout.py"}
    assert edits[ROOT / "train/main.py"]  # the check sees the edits that are there
    for path, lines in edits.items():
        if path.parent.name in SCRIPT_FOLDERS:
            assert all(line.startswith(ROOT_FIRST) for line in lines), (path, lines)
        else:
            assert not lines, (path, lines)


def test_another_streaming_version_is_refused_in_one_line(monkeypatch):
    """The fence module, run afresh (a copy, not the imported one) under another streaming version."""
    import streaming

    from tokstream.errors import UserError

    monkeypatch.setattr(streaming, "__version__", "0.99.0")
    spec = importlib.util.spec_from_file_location("fence_under_another_version", FENCE)
    with pytest.raises(UserError) as refused:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert "mosaicml-streaming 0.99.0 is installed" in str(refused.value)
    assert "pip install mosaicml-streaming==0.13.0" in str(refused.value)
