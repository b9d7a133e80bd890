"""Build an output directory under a temporary name and move it into place only when complete.

A reader never sees a half-written dataset at the real path: a killed run leaves
`OUT.partial`, which the next run refuses to touch without --overwrite.
"""

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tokstream.errors import UserError


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


@contextmanager
def staged_output(out: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """Yield an empty staging directory; on success it replaces `out`, on any failure it is removed."""
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
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replaced = out.with_name(out.name + ".replaced")
    if out.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(out, replaced) if out.is_dir() else out.unlink()
    os.replace(staging, out)
    shutil.rmtree(replaced, ignore_errors=True)
