"""pyproject.toml's ranges hold the environment a user already has: in each tested set, every requirement
of the project with the extra of the streaming the set runs (and the test extra) is met by the version
installed, so installing the project there would replace no torch, numpy or streaming of the user's."""

import fcntl
import importlib.metadata
import importlib.util
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tokstream.reader.streaming_door.streaming_internals import streaming_distribution

EXTRA = {"mosaicml-streaming": "mosaicml", "streaming-community": "community"}


def test_every_requirement_is_met_by_what_this_environment_has():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements = [*project["dependencies"], *extras[EXTRA[streaming_distribution()]], *extras["test"]]
    if importlib.util.find_spec("grain") is not None:  # the main set has the grain extra too
        requirements += extras["grain"]
    assert sys.version_info[:2] >= (3, 11) and project["requires-python"] == ">=3.11"
    unmet = []
    for line in requirements:
        requirement = Requirement(line)
        installed = importlib.metadata.version(requirement.name)
        if not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{requirement} (installed: {installed})")
    assert not unmet, unmet


def locked(lock: str) -> dict[str, Version]:
    pins = (line.split("==") for line in (ROOT / lock).read_text().splitlines()
            if "==" in line and not line.startswith("#"))
    return {canonicalize_name(name): Version(version) for name, version in pins}


def test_each_lower_bound_is_the_older_tested_sets_version():
    """What the README says of the ranges: the lower bound of each runtime dependency is a version one of the
    tested sets passed on, the oldest."""
    sets = [locked(lock) for lock in ("requirements.lock", "requirements-community.lock", "requirements-today.lock")]
    for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        lower = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        tested = [pins[canonicalize_name(requirement.name)] for pins in sets]
        assert len(lower) == 1 and Version(lower[0]) == min(tested), (line, [str(v) for v in tested])


def dev(*args: str, env: dict, **popen) -> subprocess.Popen:
    return subprocess.Popen([str(ROOT / "dev"), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **popen)


def built_by_dev() -> Path:
    """This environment, if ./dev built it (its cache folder's name and marker); else the tests are skipped: a
    ./dev of their own would build one, minutes from the package index."""
    here = Path(sys.prefix)
    if not (here.name.startswith("venv-") and (here / ".complete").is_file()):
        pytest.skip("the tests run in an environment ./dev did not build")
    return here


def test_dev_finds_its_environment_where_TOKSTREAM_ENV_CACHE_says_and_points_tiktoken_at_shared(tmp_path):
    here = built_by_dev()
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_CACHE_DIR"}
    default = dev("env", env=env).communicate(timeout=60)
    assert default == (f"{here}\n", "")  # the cache key of this lock and Python is this environment's
    (tmp_path / here.name).symlink_to(here)  # the same environment in another cache: nothing to build
    moved = dev("env", env={**env, "TOKSTREAM_ENV_CACHE": str(tmp_path)}).communicate(timeout=60)
    assert moved == (f"{tmp_path / here.name}\n", "")
    said = dev("python", "-c", "import os; print(os.environ.get('TIKTOKEN_CACHE_DIR'))", env=env).communicate(timeout=60)
    shared = ROOT / "../shared/tiktoken_cache"
    assert said[0] == (f"{shared}\n" if shared.is_dir() else "None\n")
    mine = dev("python", "-c", "import os; print(os.environ['TIKTOKEN_CACHE_DIR'])",
               env={**env, "TIKTOKEN_CACHE_DIR": str(tmp_path)}).communicate(timeout=60)
    assert mine[0] == f"{tmp_path}\n"  # a user's own setting wins


def test_dev_waits_for_a_build_in_progress_rather_than_removing_it(tmp_path):
    """Two ./dev at once on a fresh machine: the second must not take the first's half-built folder for a dead
    build's and remove it."""
    name = built_by_dev().name
    building = tmp_path / name
    building.mkdir()
    (building / "half-installed").write_text("")
    with open(tmp_path / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # what the first ./dev holds while it builds
        second = dev("env", env={**os.environ, "TOKSTREAM_ENV_CACHE": str(tmp_path)})
        try:
            assert second.stderr.readline() == f"waiting for another ./dev building {building}\n"
            time.sleep(0.5)
            assert (building / "half-installed").exists() and second.poll() is None
        finally:
            os.killpg(second.pid, signal.SIGKILL)
            second.communicate(timeout=60)
