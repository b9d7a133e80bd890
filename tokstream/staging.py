"""Outputs that appear only when complete: a local directory renamed into place, or an S3 prefix
whose indexes and metadata are uploaded last.

Local: the dataset is built in `OUT.partial/` and renamed to `OUT` at the end; a killed run leaves
`OUT.partial/`, which the next run refuses to touch without --overwrite. S3: shards are staged in a
local temporary directory (`--staging`), uploaded as soon as each is written and deleted locally;
the index files and then metadata.json go up last, and a failed run deletes what it uploaded.
"""

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


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


@contextmanager
def staged_output(out: str | os.PathLike, overwrite: bool, staging_dir: str | None = None) -> Iterator[Staging]:
    """Yield an empty staging area; on success it becomes `out`, on any failure it is removed."""
    if is_s3(out):
        with _staged_s3(str(out), overwrite, staging_dir) as staging:
            yield staging
        return
    out = Path(out)
    staging = partial_path(out)
    if out.exists() and not overwrite and (out.is_file() or any(out.iterdir())):
        raise UserError(f"output {out} already exists: pass --overwrite to replace it, or choose another --out")
    if staging.exists():
        if not overwrite:
            raise UserError(f"{staging} is left from an interrupted conversion: pass --overwrite to "
                            "discard it and convert again")
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        yield Staging(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
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
