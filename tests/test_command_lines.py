"""What every command-line tool shares: a wrong argument is refused in one line (argparse's own error prints its
usage block first; a value an option refuses: tests/test_converter_safety.py), and the converters' options are
the ones docs/converting.md lists."""

import re
import subprocess
import sys

import pytest
from conftest import ROOT

TOOLS = {  # each with what it requires, so that the unknown option is the one thing wrong
    "convert/owt_to_mds.py": ["--out", "data/x"], "convert/text_to_mds.py": ["notes.txt", "--out", "data/x"],
    "convert/bin_to_mds.py": ["train.bin", "--out", "data/x"], "convert/verify.py": ["data/x"],
    "train/ledger.py": ["runs/x", "--step", "1"], "train/vouch.py": ["runs/x"], "train/plot.py": ["runs/x"]}
CONVERTERS = list(TOOLS)[:3]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("tool", TOOLS)
def test_a_wrong_argument_is_one_line_naming_it(tool):
    refused = run(tool, *TOOLS[tool], "--no-such-option")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == f"error: unrecognized arguments: --no-such-option ({tool.split('/')[1]} --help lists the options)\n"


def test_every_converter_option_is_in_the_options_table():
    text = (ROOT / "docs/converting.md").read_text()
    table = text[text.index("## Options"):text.index("\n## ", text.index("## Options") + 1)]
    listed = set(re.findall(r"`(--[a-z][a-z0-9-]*)`", table))
    for converter in CONVERTERS:
        shown = run(converter, "--help")
        assert shown.returncode == 0
        options = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", shown.stdout)) - {"--help"}
        assert options - listed == set(), f"{converter}: options docs/converting.md does not list"


def test_a_reader_of_the_output_that_goes_away_ends_the_command_quietly(tmp_path):
    """`convert/verify.py DATA | head -1`: the pipe closed before the command writes ends it with 141 (128 + SIGPIPE,
    as a shell reports it) and no traceback."""
    from test_training import tiny_splits

    data = tiny_splits(tmp_path, 16, 8)
    command = subprocess.Popen([sys.executable, str(ROOT / "convert/verify.py"), str(data)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    command.stdout.close()  # the reader is gone before anything is written
    _, errors = command.communicate(timeout=120)
    assert command.returncode == 141 and b"Traceback" not in errors, errors.decode()[-2000:]
