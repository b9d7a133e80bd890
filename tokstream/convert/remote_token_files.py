"""Token files behind a URL, fetched one at a time into bounded local staging: hub datasets' token shards.

    hf://datasets/karpathy/fineweb-edu-100B-gpt2-token-shards/edu_fineweb_train_00000[1-9].bin

A URL pattern is expanded by the fsspec filesystem of its scheme: `hf://` is huggingface_hub's
HfFileSystem (public datasets need no token; HF_TOKEN reads gated ones), `file://` the local
filesystem, the same code path without a network (what the tests run). Each file is downloaded into
the staging directory just before it is packed and deleted right after, with the next one
downloading meanwhile: at most two files are staged however many the pattern names. A resumed
conversion does not fetch files whose tokens are all in shards it already verified; it reads only
their 1 KB llm.c header (or their size) to know where they end.
"""

import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokstream.convert.token_files import LLMC_HEADER_INTS, LLMC_LLAMA3_MAGIC, LLMC_VERSIONS, TokenFile, open_token_file
from tokstream.errors import UserError


def is_url(pattern: str) -> bool:
    return "://" in pattern


@dataclass
class RemoteTokenFile:
    """One file a URL pattern named, not yet fetched."""

    path: str  # the URL, as the metadata and the resume key record it
    format: str  # as asked (--format); detected once fetched
    fs: object
    fs_path: str

    def stamp(self) -> list:
        """What tells a changed file apart in a resume key: its size (and its checksum where the store gives one)."""
        info = self.fs.info(self.fs_path)
        return [info.get("size"), str(info.get("lfs", {}).get("sha256") if isinstance(info.get("lfs"), dict) else
                                      info.get("mtime", ""))]

    def _header(self) -> np.ndarray:
        with self.fs.open(self.fs_path, "rb") as handle:
            return np.frombuffer(handle.read(LLMC_HEADER_INTS * 4), dtype="<i4")

    @property
    def is_llama3_llmc(self) -> bool:
        header = self._header()
        return self.format in ("auto", "llmc") and len(header) > 0 and int(header[0]) == LLMC_LLAMA3_MAGIC

    def token_count(self) -> int:
        """Its tokens, from its llm.c header or (headerless uint16) its size, without fetching it."""
        header = self._header()
        if self.format in ("auto", "llmc") and len(header) == LLMC_HEADER_INTS and int(header[0]) in LLMC_VERSIONS:
            return int(header[2])
        if self.format in ("auto", "nanogpt") and not self.fs_path.endswith(".npy"):
            return self.fs.size(self.fs_path) // 2
        raise UserError(f"{self.path}: resuming needs each input's token count; an .npy behind a URL is fetched "
                        "again from the start (rerun with --overwrite)")


def expand_url(pattern: str, fmt: str) -> list[RemoteTokenFile]:
    """The files a URL pattern names, sorted (a plain URL names one file)."""
    import fsspec  # installed with datasets and huggingface_hub; importing the latter registers hf://

    if pattern.startswith("hf://"):
        import huggingface_hub  # noqa: F401  (registers the hf:// filesystem)
    try:
        fs, path = fsspec.core.url_to_fs(pattern)
        matches = sorted(fs.glob(path)) if any(c in path for c in "*?[") else [path]
        matches = [m for m in matches if fs.isfile(m)]
    except Exception as err:  # offline, no such repository, an unknown scheme
        raise UserError(f"cannot list {pattern}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                        ) from None
    if not matches:
        raise UserError(f"{pattern} matches no file")
    scheme = pattern.split("://", 1)[0]
    return [RemoteTokenFile(f"{scheme}://{m.removeprefix(scheme + '://')}", fmt, fs, m) for m in matches]


def fetch_file(remote: RemoteTokenFile, target: Path) -> Path:
    """Download one file into `target` (a temporary name, renamed when complete)."""
    temporary = target.with_name(target.name + ".download")
    remote.fs.get_file(remote.fs_path, str(temporary))
    os.replace(temporary, target)
    return target


class Fetcher:
    """Fetches remote files in the order they are asked for, the next one in the background."""

    def __init__(self, staging: Path, say=print):
        self.staging, self.say = staging, say
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fetch")
        self._pending: dict[str, Future] = {}

    def prefetch(self, remote: RemoteTokenFile) -> None:
        if remote.path not in self._pending:
            target = self.staging / f"{len(self._pending):06d}-{Path(remote.fs_path).name}"
            self._pending[remote.path] = self._pool.submit(fetch_file, remote, target)

    @contextmanager
    def opened(self, remote: RemoteTokenFile, following: RemoteTokenFile | None) -> Iterator[TokenFile]:
        """The file fetched and open (the following one fetching meanwhile), deleted when done with."""
        self.prefetch(remote)
        local = self._pending[remote.path].result()
        if following is not None:
            self.prefetch(following)
        self.say(f"fetched {remote.path} ({local.stat().st_size / 1e6:.1f} MB)")
        try:
            token_file = open_token_file(local, remote.format)
            yield TokenFile(Path(remote.path), token_file.format, token_file.tokens)
        finally:
            local.unlink(missing_ok=True)

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.staging, ignore_errors=True)
