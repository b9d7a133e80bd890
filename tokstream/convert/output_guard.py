"""What a conversion may replace or delete, where its output may go, and the lock that keeps a second
conversion off an output while the first is writing it.

A conversion deletes only what it can prove is its own: a folder whose every file has a name this
project writes (`is_own_file`), which for a finished output must also hold a metadata.json of this
format (or a part's part.json); never on the word of a name or a flag alone. The lock is an flock on
`OUT.lock` beside the output (for S3, under --staging): the kernel drops it when its process dies,
so a killed conversion never blocks the next one, and a second conversion refuses, naming the first.
"""

import fcntl
import json
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from tokstream.convert.resume import JOURNAL_FILE, PART_DONE_FILE, RESUME_KEY_FILE, SPLIT_STATS_FILE, STATE_FILE
from tokstream.errors import NoSpace, UserError, no_space, out_of_space
from tokstream.format import METADATA_FILE, DatasetMetadata
from tokstream.object_store import S3Dataset, is_s3

# The files a conversion writes at the top of an output (OUT, OUT.partial or a part's folder) ...
_TOP_FILES = {METADATA_FILE, METADATA_FILE + ".tmp", RESUME_KEY_FILE, STATE_FILE, STATE_FILE + ".tmp",
              PART_DONE_FILE, ".tokstream-write-probe"}  # the last: S3Dataset.check_writable's, if its delete failed
_PART_STREAM = re.compile(r"(train|val)\.(tokens|docs)")  # text_parts.py's token streams and records
# ... and in each split's folder (any name: bin_to_mds.py --split names it).
_SPLIT_FILES = {"index.json", JOURNAL_FILE, SPLIT_STATS_FILE,  # and a split being added (bin_to_mds --split)'s
                RESUME_KEY_FILE, STATE_FILE, STATE_FILE + ".tmp"}
_SHARD = re.compile(r"shard\.\d{5}\.mds(\.zstd)?")
_LOCK_TAG = "tokstream conversion lock"


def is_own_file(relative: PurePosixPath) -> bool:
    """Whether a file at this path inside an output is one a conversion writes."""
    parts = relative.parts
    if len(parts) == 1:
        return parts[0] in _TOP_FILES or bool(_PART_STREAM.fullmatch(parts[0]))
    return len(parts) == 2 and (parts[1] in _SPLIT_FILES or bool(_SHARD.fullmatch(parts[1])))


def foreign_entries(root: Path) -> list[str]:
    """What under `root` no conversion writes: other files, deeper folders, symbolic links (sorted)."""
    found = []
    for directory, folders, files in os.walk(root):
        here = PurePosixPath(Path(directory).relative_to(root))
        for name in sorted(folders) + sorted(files):
            relative = here / name
            if os.path.islink(Path(directory, name)):
                found.append(str(relative))
            elif name in folders:
                if len(relative.parts) > 1:
                    found.append(f"{relative}/")
            elif not is_own_file(relative):
                found.append(str(relative))
    return sorted(found)


def _foreign(entries: list[str]) -> str:
    """'holds X, which no conversion writes: move it away', naming the first of several."""
    more = f" and {len(entries) - 1} more" if len(entries) > 1 else ""
    return f"holds {entries[0]}{more}, which no conversion writes: move {'them' if more else 'it'} away"


def _our_metadata(text: str, where: str) -> DatasetMetadata | None:
    """The metadata in `text` if it is this format's, else None."""
    try:
        return DatasetMetadata.from_json(text, where=where)
    except (UserError, ValueError, AttributeError, TypeError, KeyError):  # not JSON, or not this format's fields
        return None


def _read_our_metadata(path: Path) -> DatasetMetadata | None:
    try:
        return _our_metadata(path.read_text(), str(path))
    except (OSError, UnicodeDecodeError):
        return None


_PART_FOLDER = re.compile(r"part-\d{5}-of-\d{5}")
_PART_REPORT_KEYS = {"invalid_utf8_documents_replaced", "empty"}  # what text_parts.py writes in part.json


def _is_our_part(folder: Path) -> bool:
    """A finished part of a conversion in parts: its folder's name, and part.json as text_parts.py writes it."""
    try:
        report = json.loads((folder / PART_DONE_FILE).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return bool(_PART_FOLDER.fullmatch(folder.name)) and isinstance(report, dict) and set(report) == _PART_REPORT_KEYS


def check_replaceable(out: Path) -> None:
    """Refuse to --overwrite `out` unless it is a finished output this project wrote, or empty."""
    refuse = f"--overwrite replaces only a dataset this project wrote, or an empty folder, and {out}"
    if out.is_symlink() or not out.is_dir():
        raise UserError(f"{refuse} is {'a symbolic link' if out.is_symlink() else 'a file'}: move it away, or "
                        "choose another --out")
    if not any(out.iterdir()):
        return
    foreign = foreign_entries(out)
    if foreign:
        raise UserError(f"{refuse} {_foreign(foreign)}, or choose another --out")
    metadata = _read_our_metadata(out / METADATA_FILE)
    if metadata is None and not _is_our_part(out):
        raise UserError(f"{refuse} holds no {METADATA_FILE} of a finished conversion: move it away, or choose "
                        "another --out")
    if metadata is not None:  # a folder is a split only if the metadata names it (or one being added)
        others = sorted(f"{d.name}/" for d in out.iterdir()
                        if d.is_dir() and d.name not in metadata.splits and not d.name.endswith(".partial"))
        if others:
            raise UserError(f"{refuse} {_foreign(others)}, or choose another --out")


def check_discardable(leftover: Path) -> None:
    """Refuse to delete an unfinished output (OUT.partial, OUT.replaced) holding anything a conversion does
    not write."""
    if leftover.is_symlink() or not leftover.is_dir():
        raise UserError(f"{leftover} is not a folder a conversion left: move it away, or choose another --out")
    foreign = foreign_entries(leftover)
    if foreign:
        raise UserError(f"{leftover} {_foreign(foreign)}, or choose another --out")


def check_s3_replaceable(url: str, relatives: Iterable[str], read: Callable[[str], bytes]) -> None:
    """Refuse to --overwrite an S3 prefix holding objects no conversion writes, or a metadata.json that is
    not this format's (`read` fetches an object's bytes)."""
    relatives = list(relatives)
    if METADATA_FILE in relatives:
        try:
            ours = _our_metadata(read(METADATA_FILE).decode(), f"{url}/{METADATA_FILE}") is not None
        except UnicodeDecodeError:
            ours = False
        if not ours:
            raise UserError(f"--overwrite replaces only a dataset this project wrote, and {url}/{METADATA_FILE} is "
                            "not a tokstream dataset's: move it away, or choose another --out")
    foreign = sorted(r for r in relatives if not is_own_file(PurePosixPath(r)))
    if foreign:
        raise UserError(f"--overwrite replaces only a dataset this project wrote, and {url} {_foreign(foreign)}, "
                        "or choose another --out")


# --- where an output may go ----------------------------------------------------------------------------

def check_output_location(out: str, inputs: Iterable[str | os.PathLike]) -> None:
    """Refuse a local --out under a file, or inside, equal to or containing a local input (a folder that
    holds its own output could never be converted again, and --overwrite would replace the input)."""
    if is_s3(out):
        return
    target = Path(out).resolve()
    blocker = next((p for p in target.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UserError(f"--out {out} cannot be created: {blocker} is a file, not a folder; choose another --out")
    for item in inputs:
        if not os.path.exists(item):
            continue  # a hub dataset's name, or a missing input the source reports itself
        source = Path(item).resolve()
        if target == source or source in target.parents or target in source.parents:
            where = "is" if target == source else "is inside" if source in target.parents else "contains"
            raise UserError(f"--out {out} {where} the input {item}: write the dataset outside its inputs")


def check_s3_output(out: str) -> None:
    """Refuse an S3 --out this machine cannot write (bucket, credentials, write permission) before the inputs
    are opened, not after an hour of tokenizing; the upload checks again."""
    if is_s3(out):
        S3Dataset(out).check_writable()


def local_stand_in(out: str | os.PathLike, staging_dir: str | None = None) -> Path:
    """The local path that stands for an output: itself, or for S3 a name under --staging (or the temp dir)."""
    if is_s3(out):
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", str(out).removeprefix("s3://").strip("/"))
        return Path(staging_dir or tempfile.gettempdir()) / name
    return Path(out)


# --- one conversion per output at a time -------------------------------------------------------------------

def lock_path(out: str | os.PathLike, staging_dir: str | None = None) -> Path:
    stand_in = Path(os.path.abspath(local_stand_in(out, staging_dir)))  # absolute: --out . has a name too
    return stand_in.with_name(stand_in.name + ".lock")


@contextmanager
def conversion_lock(out: str | os.PathLike, staging_dir: str | None = None) -> Iterator[None]:
    """Hold `OUT.lock` (an flock) while converting to `out`; refuse if another live process holds it.

    For an S3 output the lock is under --staging, so it keeps apart the conversions on this machine
    that share that staging folder. The file is removed on release; a killed holder leaves it, unlocked.
    """
    path = lock_path(out, staging_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = _take_lock(path, out)
    except OSError as err:
        if out_of_space(err):
            raise NoSpace(f"{no_space(path, err)}: free space there, or choose another --out") from None
        raise UserError(f"cannot create the lock file {path}: {err.strerror}; choose another --out") from None
    try:
        yield
    finally:
        if _same_file(handle, path):
            path.unlink()
        os.close(handle)  # releases the flock


def _take_lock(path: Path, out: str | os.PathLike) -> int:
    while True:
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(_read(handle))
            os.close(handle)
            raise UserError(f"another conversion to {out} is running ({holder}, lock {path}): wait for it to "
                            "finish, or choose another --out") from None
        if _same_file(handle, path):
            break
        os.close(handle)  # its holder removed the file between our open and our lock: take the new one
    content = _read(handle)
    if content and not content.startswith(_LOCK_TAG):
        os.close(handle)
        raise UserError(f"{path} is not a conversion's lock file, and a conversion to {out} needs that name: "
                        "move it away, or choose another --out")
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(handle, 0)
    os.pwrite(handle, f"{_LOCK_TAG} {json.dumps(record)}\n".encode(), 0)
    return handle


def _read(handle: int) -> str:
    return os.pread(handle, 4096, 0).decode("utf-8", "replace")


def _holder(content: str) -> str:
    try:
        record = json.loads(content.removeprefix(_LOCK_TAG))
        return f"host {record['host']}, PID {record['pid']}, started {record['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not yet written its host and PID"


def _same_file(handle: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(handle), os.stat(path))
    except FileNotFoundError:
        return False
