"""The layout's rules, checked on the source: streaming's internals behind one fence, no path tricks."""

import ast
import importlib.util
import re
from pathlib import Path

import pytest
from conftest import ROOT, modules_imported

DOOR = ROOT / "tokstream/reader/streaming_door"
FENCE = DOOR / "streaming_internals.py"
# Private names of mosaicml-streaming the project relies on (see the fence's docstring): read, called,
# imported, or overridden in a subclass. Each is checked against the streaming versions CHECKED_VERSIONS names.
STREAMING_PRIVATE_NAMES = {
    "_ShardState", "_shard_states", "_shard_access_times", "_cache_filelock", "_cache_filelock_path",
    "_evict_coldest_shard", "_event", "_shared_barrier", "_shm_prefix_int",
    "_pack_locals", "_unpack_locals", "_get_path", "_check_self",
    "_prepare_thread", "_ready_thread", "_each_sample_id", "_share_work", "_set_shuffle_block_size",
    "_resume", "_resume_incr_epoch", "_get_work", "_parallel_worker_world", "_unique_worker_world",
}
# torch's, not streaming's: the DataLoader iterator's own shutdown (token_loader.py, at exit).
TORCH_PRIVATE_NAMES = {"_shutdown_workers", "_workers"}
STREAMING_PRIVATE = re.compile(r"streaming\.base|\bTICK\b|" + "|".join(
    rf"\b{name}\b" for name in sorted(STREAMING_PRIVATE_NAMES)))
# This test, and the stock reference process and its test, which check by these names that streaming is as shipped.
NAMES_STREAMING_ON_PURPOSE = (ROOT / "tests/test_layout.py", ROOT / "tests/stock_streaming.py",
                              ROOT / "tests/test_stock_streaming.py")
SCRIPT_FOLDERS = ("convert", "train", "bench", "scripts", "examples")
PATH_EDIT = re.compile(r"sys\.path\.(insert|append|extend|remove)\(|sys\.path\s*(\+)?=")
ROOT_FIRST = ("sys.path.insert(0, str(ROOT))", "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))")


def python_files() -> list:
    folders = ("tokstream", "tests", *SCRIPT_FOLDERS)
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_streaming_internals_are_used_only_behind_the_door():
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in python_files() if DOOR not in path.parents and path not in NAMES_STREAMING_ON_PURPOSE
                 for number, line in enumerate(path.read_text().splitlines(), start=1)
                 if STREAMING_PRIVATE.search(line)]
    assert not offenders, "\n".join(offenders)
    assert STREAMING_PRIVATE.search(FENCE.read_text())  # the pattern still finds what the fence does


def private_names_in(paths: list) -> dict[str, set[str]]:
    """Per file, the underscore names it reads as attributes, imports from streaming, or defines as methods."""
    found = {}
    for path in paths:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("streaming"):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.FunctionDef):
                names.add(node.name)
        found[str(path.relative_to(ROOT))] = {n for n in names if n.startswith("_") and not n.startswith("__")}
    return found


def test_the_door_lists_every_private_name_of_streaming_the_project_uses():
    """Every underscore name of the project's modules that streaming's own source also has is a private name
    of streaming the project relies on (or a helper that could collide with one): it must be in the
    list above and used only behind the door; every name the list holds is still used there."""
    import streaming

    streaming_source = "\n".join(p.read_text() for p in Path(streaming.__file__).parent.rglob("*.py"))
    of_streaming = set(re.findall(r"\b_[A-Za-z][A-Za-z0-9_]*\b", streaming_source))
    used = private_names_in(sorted([*(ROOT / "tokstream").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]))
    outside = {path: names & of_streaming - TORCH_PRIVATE_NAMES for path, names in used.items()
               if not path.startswith("tokstream/reader/streaming_door/")}
    assert not any(outside.values()), {path: names for path, names in outside.items() if names}
    behind = set().union(*(names for path, names in used.items() if path.startswith("tokstream/reader/streaming_door/")))
    assert behind & of_streaming == STREAMING_PRIVATE_NAMES


def test_no_module_changes_another_at_import():
    """No module of the project assigns into another object, or calls anything but the one documented
    import_streaming() (the transformers deferral), at import: every replacement in streaming is made
    inside a function (streaming_door.install() calls them), so importing the project changes no
    behaviour of streaming."""
    for path in sorted((ROOT / "tokstream").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            assert all(isinstance(target, (ast.Name, ast.Tuple)) for target in targets), (path, ast.unparse(node))
            if isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant):  # a docstring is one
                assert ast.unparse(node) == "import_streaming()", (path, ast.unparse(node))


def test_a_module_that_imports_streaming_defers_transformers_first():
    """Three modules import streaming, each at its top and after import_streaming() (the package's __init__ imports
    nothing eagerly, so that order files' builder imports neither streaming nor torch: whichever of them a process
    imports first sees to the deferral). Nothing else imports it, at any depth."""
    def of_streaming(node) -> bool:
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        return any(name.split(".")[0] == "streaming" for name in names)

    importing = []
    for path in sorted((ROOT / "tokstream").rglob("*.py")):
        tree = ast.parse(path.read_text())
        if not any(isinstance(node, (ast.Import, ast.ImportFrom)) and of_streaming(node) for node in ast.walk(tree)):
            assert "import_streaming()" not in map(ast.unparse, tree.body), path
            continue
        importing.append(path.relative_to(ROOT).as_posix())
        body = tree.body
        first = next(i for i, node in enumerate(body) if isinstance(node, (ast.Import, ast.ImportFrom)) and of_streaming(node))
        assert "import_streaming()" in map(ast.unparse, body[:first]), path
        at_top = [node for node in body if isinstance(node, (ast.Import, ast.ImportFrom)) and of_streaming(node)]
        everywhere = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and of_streaming(node)]
        assert len(at_top) == len(everywhere), (path, "imports streaming below its top level")
    assert importing == ["tokstream/reader/batches.py", "tokstream/reader/streaming_door/streaming_internals.py",
                         "tokstream/reader/token_loader.py"]


def test_the_testing_helpers_are_used_by_tests_and_benchmarks_alone():
    users = [path.relative_to(ROOT) for path in python_files()
             if path.parent.name not in ("tests", "bench") and ROOT / "tokstream/testing" not in path.parents
             and re.search(r"tokstream\.testing|from tokstream import testing", path.read_text())]
    assert not users, users


def test_the_trainer_reads_data_through_the_public_reader_api_alone():
    import tokstream.reader

    for path in sorted([*(ROOT / "tokstream/train").glob("*.py"), *(ROOT / "train").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tokstream.reader"):
                assert node.module == "tokstream.reader", (path, ast.unparse(node))
                assert {alias.name for alias in node.names} <= set(tokstream.reader.__all__), (path, ast.unparse(node))
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith(("tokstream.reader", "streaming")), (path, alias.name)
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("streaming"), (path, ast.unparse(node))


def imported_modules(path: Path) -> list[str]:
    """Every module `path` imports, by its full name (`from tokstream import x` is tokstream.x)."""
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules += ([f"{node.module}.{alias.name}" for alias in node.names] if node.module == "tokstream"
                        else [node.module])
    return modules


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


# What each command folder may import of the project: its wing's core and the one-line errors. train/main.py also
# switches numpy's sort kernel (cpu_dispatch), which must come before anything imports numpy.
COMMAND_IMPORTS = {"convert": ("tokstream.convert", "tokstream.errors"),
                   "train": ("tokstream.train", "tokstream.errors")}
BEFORE_NUMPY = {("train/main.py", "tokstream.train.cpu_dispatch")}


def test_each_command_folder_stands_over_the_core_of_its_own_name():
    for folder, allowed in COMMAND_IMPORTS.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            for module in imported_modules(path):
                if module.startswith("tokstream") and (str(path.relative_to(ROOT)), module) not in BEFORE_NUMPY:
                    assert within(module, allowed), (str(path.relative_to(ROOT)), module)


def test_the_wings_stand_apart_and_what_they_share_says_who_uses_it():
    """The converters' core imports neither the reader nor the trainer, nor they it; each module at tokstream/'s root,
    what the wings share, begins by saying who uses it."""
    wings = {"convert": ("tokstream.reader", "tokstream.train"), "reader": ("tokstream.convert", "tokstream.train"),
             "train": ("tokstream.convert",)}
    for wing, others in wings.items():
        for path in sorted((ROOT / "tokstream" / wing).rglob("*.py")):
            assert not [m for m in imported_modules(path) if within(m, others)], path.relative_to(ROOT)
    shared = sorted(path for path in (ROOT / "tokstream").glob("*.py") if path.name != "__init__.py")
    assert {path.stem for path in shared} >= {"errors", "format", "object_store", "split_check", "tokenizer"}
    for path in shared:
        assert path.read_text().startswith(('"""Shared', '"""Used by')), path.relative_to(ROOT)


def test_only_scripts_edit_sys_path_and_only_to_put_the_repository_root_first():
    edits = {path: [line.strip() for line in path.read_text().splitlines() if PATH_EDIT.search(line)]
             for path in python_files() if path != ROOT / "tests/test_layout.py"}
    assert edits[ROOT / "train/main.py"]  # the check sees the edits that are there
    # A warm process stands in for `python script`, `-c` and `-m`: it puts first what the interpreter does.
    assert edits.pop(ROOT / "tests/warm_ranks.py") == [
        'sys.path.insert(0, {"-c": "", "-m": os.getcwd()}.get(argv[0], os.path.dirname(os.path.abspath(argv[0]))))']
    for path, lines in edits.items():
        if path.parent.name in SCRIPT_FOLDERS:
            assert all(line.startswith(ROOT_FIRST) for line in lines), (path, lines)
        else:
            assert not lines, (path, lines)


@pytest.mark.parametrize("version", ["0.99.0", "0.12.0"])
def test_another_streaming_version_is_refused_in_one_line(monkeypatch, version):
    """The fence module, run afresh (a copy, not the imported one) under another version of the installed
    distribution (mosaicml-streaming in requirements.lock, streaming-community in requirements-community.lock)."""
    import streaming

    from tokstream.errors import UserError
    from tokstream.reader.streaming_door.streaming_internals import streaming_distribution

    monkeypatch.setattr(streaming, "__version__", version)
    spec = importlib.util.spec_from_file_location("fence_under_another_version", FENCE)
    with pytest.raises(UserError) as refused:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert str(refused.value).startswith(f"{streaming_distribution()} {version} is installed; ")
    assert str(refused.value).endswith("pip install 'tokstream[mosaicml]' (mosaicml-streaming==0.13.0) or "
                                       "'tokstream[community]' (streaming-community 0.14)")


def test_the_order_imports_nothing_of_streaming_and_no_module_imports_one_that_imports_it_back():
    """The order (tokstream/reader/order/) is the project's own: the door adapts streaming to it, never the other
    way. And no chain of imports, at the top or inside a function, comes back to where it started."""
    def name(path: Path) -> str:
        parts = path.relative_to(ROOT).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(path): path for path in (ROOT / "tokstream").rglob("*.py")}

    def imports(path: Path) -> set[str]:  # `from a.b import c` is a.b.c where that is a module, else a.b
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            assert not isinstance(node, ast.ImportFrom) or not node.level, f"{path}: a relative import"
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
        return found

    order = sorted((ROOT / "tokstream/reader/order").glob("*.py"))
    assert {path.stem for path in order} >= {"lazy", "py1e", "sampling", "partition", "order_files"}
    for path in order:
        assert not [m for m in imports(path) if within(m, ("streaming", "tokstream.reader.streaming_door"))], \
            path.relative_to(ROOT)

    graph = {module: (imports(path) & modules.keys()) - {module} for module, path in modules.items()}
    assert "tokstream.reader.order.py1e" in graph["tokstream.reader.streaming_door"]  # the check sees lazy imports
    for start in graph:
        seen, frontier = set(), set(graph[start])
        while frontier:
            module = frontier.pop()
            assert module != start, f"{start} imports a module that imports it back"
            if module not in seen:
                seen.add(module)
                frontier |= graph[module]


def test_the_plot_reads_a_run_without_importing_torch():
    """train/plot.py runs where people look at runs (a login node, a laptop): what it imports imports no torch (1.3
    of its 3 CPU s when one did: the checkpoint writer's). Its imports are all at its top, before it reads its
    arguments."""
    traced, imported = modules_imported("train/plot.py", "--help")
    assert traced.returncode == 0 and "tokstream.train.rewind" in imported, traced.stderr[-2000:]
    assert "torch" not in imported, "train/plot.py imports torch"
