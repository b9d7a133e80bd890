"""Outputs that appear only when complete: a local directory renamed into place, or an S3 prefix
whose indexes and metadata are uploaded last.

Local: the dataset is built in `OUT.partial/` and renamed to `OUT` at the end; a killed run leaves
`OUT.partial/`, which the next run continues when its resume key matches, and otherwise refuses to
touch without --overwrite. S3: shards are staged in a local temporary directory (`--staging`),
uploaded as soon as each is written and deleted locally; the index files and then metadata.json go
up last. A failed S3 run deletes what it uploaded, unless it is resumable (a resume key) and was
interrupted or lost the store: then the objects stay, with the key, for the next run to continue.
"""

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tokstream.convert.output_guard import check_discardable, check_replaceable, check_s3_replaceable
from tokstream.convert.resume import RESUME_KEY_FILE, STATE_FILE, key_matches, partial_path, replaced_path, write_key
from tokstream.errors import NoSpace, UserError, WorkLost, no_space, out_of_space
from tokstream.format import shard_file_intact, stored_file
from tokstream.object_store import S3Dataset, Uploader, UploadError, is_s3


@dataclass
class Staging:
    """Where to write, and whom to tell about each finished shard file (to upload it, say)."""

    path: Path
    on_file: Callable[[Path], None] | None = None
    resumed: bool = False  # an interrupted run with the same resume key left work to continue
    remote_sizes: dict[str, int] | None = None  # S3: the objects found at start, by key
    publish: Callable[[Path], None] | None = None  # S3: uploads a saved state once every shard it names is up

    def shard_intact(self, split: str, shard: dict) -> bool:
        """Whether a shard an interrupted run recorded is still there, whole."""
        if self.remote_sizes is None:
            return shard_file_intact(self.path / split, shard)
        stored = stored_file(shard)
        return self.remote_sizes.get(f"{split}/{stored['basename']}") == stored["bytes"]


def refuse_existing_output(out: str | os.PathLike, overwrite: bool) -> None:
    """A local output that already holds something is replaced only with --overwrite, and only if it is
    a dataset this project wrote (output_guard.check_replaceable); so is what an interrupted swap left."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not overwrite and (not out.is_dir() or any(out.iterdir())):
            raise UserError(f"output {out} already exists: pass --overwrite to replace it, or choose another --out")
        check_replaceable(out)
    if replaced_path(out).exists():
        check_discardable(replaced_path(out))


@contextmanager
def staged_output(out: str | os.PathLike, overwrite: bool, staging_dir: str | None = None,
                  resume_key: dict | None = None) -> Iterator[Staging]:
    """Yield a staging area; on success it becomes `out`, on failure it is removed.

    With a resume key (local outputs), an interrupted run's `OUT.partial` made with the same key is
    handed back (`resumed`), and an interruption (Ctrl-C, SIGTERM) keeps it for the next run.
    """
    if is_s3(out):
        with _staged_s3(str(out), overwrite, staging_dir, resume_key) as staging:
            yield staging
        return
    out = Path(out)
    staging = partial_path(out)
    key_file = staging / RESUME_KEY_FILE
    refuse_existing_output(out, overwrite)
    resumed = False
    if staging.exists():
        if key_matches(key_file, resume_key):
            resumed = True
        elif not overwrite:
            raise UserError(f"{staging} is left from an interrupted conversion of other inputs or settings: "
                            "pass --overwrite to discard it and convert again")
        else:
            check_discardable(staging)
            shutil.rmtree(staging)
    if not resumed:
        staging.mkdir(parents=True)
        if resume_key is not None:
            write_key(key_file, resume_key)
    try:
        yield Staging(staging, resumed=resumed)
    except BaseException as err:
        # A full disk stops the work where a kill could have: a resumable conversion keeps it.
        keep = resume_key is not None and (isinstance(err, (KeyboardInterrupt, WorkLost)) or out_of_space(err))
        if not keep:
            shutil.rmtree(staging, ignore_errors=True)
        if out_of_space(err):
            done = ("what was converted so far is kept there; free space and run the same command again to "
                    "continue from it" if keep else "the unfinished output was removed; free space (or choose "
                    "another --out) and run the command again")
            raise NoSpace(f"{no_space(err.filename or staging, err)}: {done}") from None
        raise
    refuse_existing_output(out, overwrite)  # again: files put there meanwhile stay, and the staging with its key
    key_file.unlink(missing_ok=True)
    replaced = replaced_path(out)
    if out.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(out, replaced) if out.is_dir() else out.unlink()
    os.replace(staging, out)
    shutil.rmtree(replaced, ignore_errors=True)


@contextmanager
def _staged_s3(url: str, overwrite: bool, staging_dir: str | None, resume_key: dict | None) -> Iterator[Staging]:
    dataset = S3Dataset(url)
    dataset.check_writable()
    existing = dataset.sizes()
    resumed = False
    if existing and overwrite:
        check_s3_replaceable(url, existing, dataset.get_bytes)
    if existing and not overwrite:
        if "metadata.json" in existing:
            raise UserError(f"{url} already holds a dataset: pass --overwrite to replace it, or choose another --out")
        if (resume_key is None or RESUME_KEY_FILE not in existing
                or json.loads(dataset.get_bytes(RESUME_KEY_FILE)) != resume_key):
            raise UserError(f"{url} already holds objects of an interrupted conversion of other inputs or "
                            "settings: pass --overwrite to replace them, or choose another --out")
        resumed = True
    if not resumed:
        dataset.delete(list(existing))  # metadata.json among them: training stops seeing the old dataset first
        if resume_key is not None:
            dataset.put_bytes(RESUME_KEY_FILE, json.dumps(resume_key).encode("utf-8"))
    if staging_dir:
        Path(staging_dir).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="tokstream-upload-", dir=staging_dir))
    if resumed and STATE_FILE in existing:
        dataset.download(STATE_FILE, staging / STATE_FILE)
    uploader = Uploader(dataset, staging)
    try:
        yield Staging(staging, uploader.shard_written, resumed=resumed, remote_sizes=existing if resumed else None,
                      publish=lambda path: uploader.upload_after_queue(path, STATE_FILE))
        uploader.commit()
    except BaseException as err:
        keep = resume_key is not None and (isinstance(err, (KeyboardInterrupt, UploadError, WorkLost))
                                           or out_of_space(err))
        uploader.abort(keep=keep)
        if keep and isinstance(err, UploadError):
            raise UploadError(f"{err}; what was uploaded stays: rerun the same command to resume from it, or "
                              "pass --overwrite to start over") from None
        if out_of_space(err):
            kept = "what was uploaded stays; " if keep else ""
            raise NoSpace(f"{no_space(err.filename or staging, err)}, where shards wait for their upload: {kept}free "
                          "space there or pass --staging DIR on another disk, and run the same command again") from None
        if not keep and resume_key is not None:  # with what an earlier, resumed run left
            _delete_quietly(dataset, [RESUME_KEY_FILE, STATE_FILE, *(existing if resumed else [])])
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if resume_key is not None:
        _delete_quietly(dataset, [RESUME_KEY_FILE, STATE_FILE])  # the dataset is complete: no longer needed


def _delete_quietly(dataset: S3Dataset, relatives: list[str]) -> None:
    try:
        dataset.delete(relatives)
    except Exception:
        pass  # leftovers beside a dataset or an aborted run are harmless; the next run replaces them
