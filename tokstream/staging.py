"""Outputs that appear only when complete: a local directory renamed into place, or an S3 prefix
whose indexes and metadata are uploaded last.

Local: the dataset is built in `OUT.partial/` and renamed to `OUT` at the end; a killed run leaves
`OUT.partial/`, which the next run refuses to touch without --overwrite. S3: shards are staged in a
local temporary directory (`--staging`), uploaded as soon as each is written and deleted locally;
the index files and then metadata.json go up last, and a failed run deletes what it uploaded.
"""

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tokstream.errors import UserError
from tokstream.object_store import S3Dataset, Uploader, is_s3


@dataclass
class Staging:
    """Where to write, and whom to tell about each finished shard file (to upload it, say)."""

    path: Path
    on_file: Callable[[Path], None] | None = None
    resumed: bool = False  # the path holds the work of an interrupted run with the same resume key


RESUME_KEY_FILE = ".resume-key.json"


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


@contextmanager
def staged_output(out: str | os.PathLike, overwrite: bool, staging_dir: str | None = None,
                  resume_key: dict | None = None) -> Iterator[Staging]:
    """Yield a staging area; on success it becomes `out`, on failure it is removed.

    With a resume key (local outputs), an interrupted run's `OUT.partial` made with the same key is
    handed back (`resumed`), and an interruption (Ctrl-C, SIGTERM) keeps it for the next run.
    """
    if is_s3(out):
        with _staged_s3(str(out), overwrite, staging_dir) as staging:
            yield staging
        return
    out = Path(out)
    staging = partial_path(out)
    key_file = staging / RESUME_KEY_FILE
    if out.exists() and not overwrite and (out.is_file() or any(out.iterdir())):
        raise UserError(f"output {out} already exists: pass --overwrite to replace it, or choose another --out")
    resumed = False
    if staging.exists():
        if resume_key is not None and key_file.is_file() and json.loads(key_file.read_text()) == resume_key:
            resumed = True
        elif not overwrite:
            raise UserError(f"{staging} is left from an interrupted conversion of other inputs or settings: "
                            "pass --overwrite to discard it and convert again")
        else:
            shutil.rmtree(staging)
    if not resumed:
        staging.mkdir(parents=True)
        if resume_key is not None:
            key_file.write_text(json.dumps(resume_key))
    try:
        yield Staging(staging, resumed=resumed)
    except KeyboardInterrupt:
        if resume_key is None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    key_file.unlink(missing_ok=True)
    replaced = out.with_name(out.name + ".replaced")
    if out.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(out, replaced) if out.is_dir() else out.unlink()
    os.replace(staging, out)
    shutil.rmtree(replaced, ignore_errors=True)


@contextmanager
def _staged_s3(url: str, overwrite: bool, staging_dir: str | None) -> Iterator[Staging]:
    dataset = S3Dataset(url)
    dataset.check_writable()
    existing = dataset.keys()
    if existing and not overwrite:
        what = "a dataset" if "metadata.json" in existing else "objects of an interrupted conversion"
        raise UserError(f"{url} already holds {what}: pass --overwrite to replace it, or choose another --out")
    dataset.delete(existing)  # metadata.json among them: training stops seeing the old dataset first
    if staging_dir:
        Path(staging_dir).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="tokstream-upload-", dir=staging_dir))
    uploader = Uploader(dataset, staging)
    try:
        yield Staging(staging, uploader.shard_written)
        uploader.commit()
    except BaseException:
        uploader.abort()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
