"""pyproject.toml's ranges hold the environment a user already has: in either tested set, every requirement
of the project with the extra of the streaming the set runs (and the test extra) is met by the version
installed, so installing the project there would replace no torch, numpy or streaming of the user's."""

import importlib.metadata
import importlib.util
import sys
import tomllib

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
    two tested sets passed on, the older one."""
    sets = [locked("requirements.lock"), locked("requirements-community.lock")]
    for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        lower = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        tested = [pins[canonicalize_name(requirement.name)] for pins in sets]
        assert len(lower) == 1 and Version(lower[0]) == min(tested), (line, [str(v) for v in tested])
