"""Shared fixtures: real documents from ../shared/corpora and helpers to run the CLIs."""

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
CORPORA = SHARED / "corpora"
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED / "tiktoken_cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The processes the tests start (torchrun, its ranks, the CLIs) take their large buffers from malloc's heap and keep
# it: on CPU, every training step's logits (50,257 per token) were fresh mmaps, faulted in page by page: a third of
# a tiny run's CPU time was the kernel's (measured: 2 ranks x 16 steps, 10.5 s of system time -> 4.1 s).
os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295")

from warm_ranks import start_warm_server  # noqa: E402


def pytest_configure(config):
    """Training runs that no signal reaches fork their ranks from a server that has imported torch once per test
    process (tests/warm_ranks.py): started in each process that runs tests (not in pytest-xdist's controller),
    before anything here starts multiprocessing's forkserver without it."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        start_warm_server()


def pytest_collection_modifyitems(items):
    """The long tests first: each test process starts its share in order and the idle one takes
    pending tests from the other, so a long test started last would end the suite alone."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: otherwise in file order


@pytest.fixture(scope="session", autouse=True)
def torchruns_logs_under_the_tests_temp(tmp_path_factory):
    """torchrun's agent makes a log folder per launch (tempfile.mkdtemp, "torchelastic_*") and leaves it: the
    suite's launches put theirs under pytest's own temp folder, which pytest rotates, not in /tmp for ever. Set
    as torchrun's own variable for --log-dir, which every launch inherits (the demo, Slurm's jobs included)."""
    folder = tmp_path_factory.getbasetemp() / "torchrun-logs"
    folder.mkdir(exist_ok=True)
    given = os.environ.get("PET_LOG_DIR")
    os.environ["PET_LOG_DIR"] = str(folder)
    yield
    if given is None:
        del os.environ["PET_LOG_DIR"]
    else:
        os.environ["PET_LOG_DIR"] = given


@pytest.fixture(scope="session", autouse=True)
def remove_the_lock_files_streaming_leaves():
    from tokstream.testing.lock_files import removing_new_lock_files

    with removing_new_lock_files():
        yield


@pytest.fixture(scope="session", autouse=True)
def remove_the_shared_memory_killed_runs_leave(tmp_path_factory):
    """Set up after the lock files' fixture, so torn down before it: the removed prefixes' lock files go too."""
    from tokstream.testing.shared_memory import remove_stale_blocks_under

    yield
    remove_stale_blocks_under(tmp_path_factory.getbasetemp())


def wikitext_articles() -> list[str]:
    """WikiText-2 validation split, one document per article (top-level ' = Title = ' headings)."""
    text = (CORPORA / "wikitext2_valid.txt").read_text(encoding="utf-8")
    starts = [m.start() for m in re.finditer(r"^ ?= [^=].*? = ", text, flags=re.M)]
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


def shakespeare_paragraphs() -> list[str]:
    """Tiny Shakespeare, one document per blank-line-separated speech."""
    text = (CORPORA / "tinyshakespeare.txt").read_text(encoding="utf-8")
    return [p.strip("\n") for p in text.split("\n\n") if p.strip()]


# The training tests' vocabulary: a byte-level BPE of 2,048 ids trained on the plays, so that a step of the tiny GPT
# costs a tenth of one with GPT-2's 50,257 ids, whose 50,304 rows of embedding and logits miss the caches
# (bench/padded_vocab.py). Each dataset the training tests train on holds its ids, with the tokenizer.json
# beside it, and test_training's BASE sets model.vocab_size to it. GPT-2's own tokenizer is what the converters'
# tests and the README's demo run.
TRAINING_VOCAB = 2048


@functools.cache
def _training_tokenizer_json() -> str:
    """The tokenizer.json's text, trained once per process (the trainer is deterministic: the same bytes each time)."""
    from tokstream.testing.bpe import train_bpe

    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # else every process forked from here later says it is disabled
    try:
        with tempfile.TemporaryDirectory() as folder:
            path = train_bpe(Path(folder) / "tokenizer.json", shakespeare_paragraphs(), ["<|endoftext|>"],
                             vocab_size=TRAINING_VOCAB)
            return path.read_text()
    finally:
        if parallelism is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = parallelism


def training_tokenizer(folder: Path):
    """The training tests' tokenizer, its tokenizer.json written into `folder`."""
    from tokstream.tokenizer import load_tokenizer

    path = Path(folder) / "tokenizer.json"
    path.write_text(_training_tokenizer_json())
    return load_tokenizer(str(path))


@pytest.fixture(scope="session")
def gpt2():
    from tokstream.tokenizer import load_tokenizer

    return load_tokenizer("gpt2")


@pytest.fixture(scope="session")
def articles() -> list[str]:
    return wikitext_articles()


def write_jsonl(path: Path, docs: list[str], column: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for doc in docs:
            handle.write(json.dumps({column: doc}) + "\n")
    return path


def nanogpt_stream(encoding, docs: list[str]) -> list[int]:
    """What nanoGPT's prepare.py writes: encode_ordinary(doc) + [eot] for every document, in order."""
    stream: list[int] = []
    for doc in docs:
        stream.extend(encoding.encode_ordinary(doc))
        stream.append(encoding.eot_token)
    return stream


def namespaces_permitted() -> bool:
    """Whether processes can get a node's own /dev/shm here (several nodes on one machine)."""
    return subprocess.run(["unshare", "--ipc", "--mount", "--propagation", "private", "true"],
                          capture_output=True).returncode == 0


class Node(subprocess.Popen):
    """A node simulated on this machine: the shell `script` in an IPC and mount namespace of its own (what
    it mounts, such as its own /dev/shm, nothing else sees), its output (stdout and stderr together) read
    as it comes, so that a node that fails shows why, whatever the test was waiting for."""

    def __init__(self, name: str, script: str, env: dict):
        super().__init__(["unshare", "--ipc", "--mount", "--propagation", "private", "sh", "-c", script], cwd=ROOT,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.name = name
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.stdout:
            self._lines.append(line)

    def report(self, size: int = 4000) -> str:
        """Whether it runs, and the last `size` characters of its output so far."""
        state = "running" if self.poll() is None else f"exited with status {self.returncode}"
        return f"--- {self.name} ({state}), the end of its output:\n{''.join(self._lines)[-size:]}"

    def communicate(self, input=None, timeout: float | None = None) -> tuple[str, None]:
        """Its whole output once it has ended (and every process it started that held its output); still
        running after `timeout`: the test fails with its output so far."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s\n{self.report()}") from None
        self._reader.join(timeout)
        assert not self._reader.is_alive(), f"ended, but what it started still holds its output\n{self.report()}"
        return "".join(self._lines), None


def wait_for_nodes(nodes: list[Node], condition, timeout: float = 180) -> None:
    """Wait until condition() holds, every node running; a node that ends first, or the timeout, fails
    the test with every node's output."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = any(node.poll() is not None for node in nodes)
        if ended or time.monotonic() > deadline:
            why = "a node ended" if ended else f"timed out after {timeout} s"
            raise AssertionError(f"{why} before what the test waits for\n" + "\n".join(map(Node.report, nodes)))
        time.sleep(0.05)


def modules_imported(script: str, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """One of the project's CLIs run under `python -X importtime`: its result, and every module it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / script), *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    return done, set(re.findall(r"^import time:.*\|\s*(\S+)$", done.stderr, re.MULTILINE))


def run_script(script: str, *args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run one of the project's CLIs as a user would."""
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def expected_samples(stream, block_size: int):
    """The format's samples of a token stream: k-th holds stream[k*B : k*B + B + 1]."""
    import numpy as np

    count = (len(stream) - 1) // block_size
    return np.array([stream[k * block_size : k * block_size + block_size + 1] for k in range(count)])


def split_samples(root, split: str = "train"):
    """Every sample of a split, read straight from its shards (checked by tokstream.convert.verify)."""
    import numpy as np

    from tokstream.convert.verify import iter_split_samples

    problems: list[str] = []
    arrays = list(iter_split_samples(root, split, problems))
    assert not problems, problems
    return np.concatenate(arrays)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def kill_then_resume(script: str, args: list, out: Path, sig: int, between=lambda: None,
                     tokenizer_process: bool = False) -> str:
    """Run a converter, send `sig` once it has saved a state mid-run (to one of its tokenizer processes
    instead, if asked), check that nothing looks complete, call `between()`, rerun the same command
    and return its output. The caller compares the result."""
    import signal
    import time

    from tokstream.convert.resume import STATE_FILE
    from tokstream.testing.processes import descendants, worker_pids

    cmd = [sys.executable, str(ROOT / script), *map(str, args), "--out", str(out), "--state-interval", "0"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial = out.with_name(out.name + ".partial")
    deadline = time.monotonic() + 120
    while not (partial / STATE_FILE).exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if tokenizer_process:  # a grandchild: the converter starts them through a forkserver
        children = set(worker_pids(process.pid))
        os.kill(next(pid for pid in descendants(process.pid) if pid not in children), sig)
    else:
        process.send_signal(sig)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0, "finished before the signal: the input is too small for this test"
    assert not out.exists() and not (partial / "metadata.json").exists()
    if sig == signal.SIGTERM:  # caught: one line, and the partial output is kept to resume from
        assert "interrupted" in stderr and len(stderr.strip().splitlines()) == 1, stderr
    if tokenizer_process:
        assert "a tokenizer process died" in stderr and len(stderr.strip().splitlines()) == 1, stderr
        assert process.returncode == 2
    between()
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert not partial.exists()
    return resumed.stdout


def saved_state_header(partial: Path) -> dict:
    """The header of the state a one-pass text conversion saved in `partial`."""
    import numpy as np

    from tokstream.convert.resume import STATE_FILE

    with np.load(partial / STATE_FILE) as saved:
        return json.loads(saved["header"].tobytes())


def tagged_lines(path: Path, copies: int) -> Path:
    """Lines of both corpora, several times over, tagged so that each line recurs in two copies."""
    lines = [line for name in ("tinyshakespeare.txt", "wikitext2_valid.txt")
             for line in (ROOT.parent / "shared" / "corpora" / name).read_text().splitlines()]
    path.write_text("".join(f"{line} {copy % (copies // 2)}\n" for copy in range(copies) for line in lines))
    return path


# The training tests' dataset and uninterrupted reference run, shared by test_training.py and
# test_s3.py (whose S3 copy of the same plays, in the same 64 kB shards, must train identically).
@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    return plays(tmp_path_factory.mktemp("data"), "64kb")


def plays(tmp: Path, shard_size: str) -> Path:
    """The plays' paragraphs as a dataset of 64-token blocks (5 % val) in shards of `shard_size`, under `tmp`, in the
    training tests' vocabulary."""
    from tokstream.convert.options import ConversionOptions
    from tokstream.convert.sources import open_source
    from tokstream.convert.text_one_pass import convert_documents

    corpus = tmp / "plays.txt"
    corpus.write_text("\n\n".join(shakespeare_paragraphs()) + "\n")
    convert_documents(open_source([str(corpus)], txt_docs="paragraph"), training_tokenizer(tmp), str(tmp / "ds"),
                      ConversionOptions(block_size=64, val_fraction=0.05, shard_size=shard_size, progress=False))
    return tmp / "ds"


@pytest.fixture(scope="session")
def reference(dataset, tmp_path_factory) -> list[tuple]:
    """(step, per-rank sample ids, loss, lr) of an uninterrupted 2-rank run of test_training's BASE."""
    import test_training as training

    def run() -> list[tuple]:
        run_dir = tmp_path_factory.mktemp("reference")
        training.train(2, dataset, run_dir)
        return training.trained_steps(run_dir)

    steps = [tuple(step) for step in once_per_test_run(tmp_path_factory, "reference", run)]
    assert [s[0] for s in steps] == list(range(1, training.STEPS + 1))
    return steps


def once_per_test_run(tmp_path_factory, name: str, compute):
    """compute() once per test run, its JSON shared by pytest-xdist's test processes (each would
    otherwise compute it, side by side on the same cores); each process's own dataset is built
    the same, byte for byte."""
    folder = xdist_shared_folder(tmp_path_factory)
    if folder is None:
        return compute()
    from filelock import FileLock

    with FileLock(folder / f"{name}.lock"):
        path = folder / f"{name}.json"
        if not path.exists():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())


def xdist_shared_folder(tmp_path_factory) -> Path | None:
    """A folder every pytest-xdist test process of this run shares; None without xdist."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set by xdist in its test processes, one per run
    if run is None:
        return None
    folder = tmp_path_factory.getbasetemp().parent / f"shared-{run}"  # the parent of every process's own
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def stock(tmp_path_factory):
    """Stock streaming as shipped, in a process of its own (tests/stock_streaming.py), its results kept
    for the test run."""
    from stock_streaming import StockStreaming

    shared = xdist_shared_folder(tmp_path_factory)
    server = StockStreaming((shared or tmp_path_factory.getbasetemp()) / "stock-streaming")
    yield server
    server.close()


# A real S3 endpoint for the tests: moto's server on 127.0.0.1, reached through a proxy that injects
# faults (tokstream/testing/loopback_s3.py); one per session, the environment pointing at it.
BUCKET = "corpora"


@pytest.fixture(scope="session")
def s3():
    from tokstream.testing.loopback_s3 import FaultProxy, start_loopback_s3

    saved = dict(os.environ)
    server = start_loopback_s3(BUCKET)
    proxy = FaultProxy(server.port)  # clients talk to moto through the fault-injecting proxy
    os.environ.update(S3_ENDPOINT_URL=proxy.url, TOKSTREAM_S3_MAX_ATTEMPTS="6")
    yield proxy
    proxy.stop()
    server.stop()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture()
def proxy(s3):
    s3.clear()
    yield s3
    s3.clear()


# A real Slurm for the tests: Debian's slurm-wlm on 127.0.0.1, one per test process, in a folder of its own
# (tokstream/testing/slurm_cluster.py). Where it cannot start, its tests skip; CI sets TOKSTREAM_REQUIRE_SLURM
# (.ci/run, which installs it), so there they fail instead.
@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    from tokstream.testing.slurm_cluster import SlurmCluster, missing_reason

    def unavailable(reason: str):
        if os.environ.get("TOKSTREAM_REQUIRE_SLURM"):
            pytest.fail(f"TOKSTREAM_REQUIRE_SLURM is set, and {reason}")
        pytest.skip(reason)

    reason = missing_reason()
    if reason:
        unavailable(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except RuntimeError as err:
        cluster.stop()
        unavailable(f"the test Slurm did not start: {err}")
    yield cluster
    cluster.stop()
