"""Where a run's files live: a local directory, or s3://bucket/prefix so that they outlive the node.

A run directory holds `ckpt-XXXXXXXX.pt` checkpoints with their manifests, `LATEST` (a hint naming
the newest save), `LEASE` (the live job's: run_lease.py) and `metrics.jsonl`. The invariant: a file
becomes visible only when whole: a local one by fsync and rename, an S3 object by the store's own
all-or-nothing PUT (a killed multipart upload is never an object). What makes a checkpoint complete,
and what may ever be deleted: checkpoint_files.py.

An S3 run also has a local directory (`run_local`): the metrics being written, staging for uploads,
downloads of the checkpoint to resume from. Nothing in it is needed to resume: a relaunch on a
machine with an empty disk reads everything back from the store.
"""

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from tokstream.errors import StoreError
from tokstream.object_store import S3Dataset, describe_error, is_s3

POINTER = "LATEST"


class LocalRunStore:
    """A run directory on a filesystem (node-local, or shared between the nodes of a job)."""

    def __init__(self, path: str | os.PathLike):
        self.url = str(path)
        self.root = Path(path)
        self.local = self.root  # files are written and read in place

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir()) if self.root.is_dir() else []

    def read_bytes(self, name: str) -> bytes | None:
        path = self.root / name
        return path.read_bytes() if path.exists() else None

    def local_copy(self, name: str, owner: str | None = None) -> Path:
        return self.root / name

    def copy_path(self, name: str, owner: str | None = None) -> Path:
        return self.root / name

    def release_copy(self, path: Path) -> None:
        pass  # the run directory's own file

    def publish(self, staged: Path, name: str) -> None:
        """Move a finished, fsynced file from the run directory's staging name to `name`, durably."""
        os.replace(staged, self.root / name)
        directory = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(directory)  # make the rename itself durable
        finally:
            os.close(directory)

    def publish_bytes(self, name: str, data: bytes) -> None:
        staged = self.root / f"{name}.tmp{os.getpid()}"
        with open(staged, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        self.publish(staged, name)

    def remove(self, names: list[str]) -> None:
        for name in names:
            (self.root / name).unlink(missing_ok=True)

    def set_aside(self, copied: list[str], moved: list[str], folder: str) -> None:
        """Copy `copied` and move `moved` (those that exist, in that order) into the sub-folder `folder`, durably."""
        target = self.root / folder
        target.mkdir(parents=True)
        for name in copied:
            if (self.root / name).exists():
                shutil.copy2(self.root / name, target / name)
        for name in moved:
            if (self.root / name).exists():
                os.replace(self.root / name, target / name)
        for directory in (target, self.root):
            handle = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(handle)
            finally:
                os.close(handle)


class S3RunStore:
    """A run directory at s3://bucket/prefix, with a node-local directory for staging and metrics."""

    def __init__(self, url: str, local: str | os.PathLike):
        self.url = url.rstrip("/")
        self.store = S3Dataset(self.url)
        self.local = Path(local)

    def _fail(self, doing: str, err: Exception) -> StoreError:
        return StoreError(f"cannot {doing} {self.url}: {describe_error(err)}")

    def names(self) -> list[str]:
        try:
            return sorted(name for name in self.store.keys() if "/" not in name)
        except Exception as err:
            raise self._fail("list", err) from None

    def read_bytes(self, name: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return self.store.client.get_object(Bucket=self.store.bucket, Key=self.store.key(name))["Body"].read()
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._fail(f"read {name} in", err) from None
        except Exception as err:
            raise self._fail(f"read {name} in", err) from None

    def local_copy(self, name: str, owner: str | None = None) -> Path:
        """Download `name` into run_local, in a folder of its own per `owner` (default: this process)."""
        return self.store.download(name, self.copy_path(name, owner))

    def copy_path(self, name: str, owner: str | None = None) -> Path:
        """Where local_copy(name, owner) puts the file."""
        return self.local / f"download-{owner or os.getpid()}" / name

    def release_copy(self, path: Path) -> None:
        """Remove the copy's folder: it holds only its owner's downloads, and one a killed load left is spent."""
        shutil.rmtree(path.parent)

    def publish(self, staged: Path, name: str) -> None:
        """Upload a finished local file as `name` (visible only once whole), then drop the local copy."""
        try:
            self.store.upload(staged, name)
        except Exception as err:
            raise self._fail(f"upload {name} to", err) from None
        staged.unlink(missing_ok=True)

    def publish_bytes(self, name: str, data: bytes) -> None:
        try:
            self.store.put_bytes(name, data)
        except Exception as err:
            raise self._fail(f"upload {name} to", err) from None

    def remove(self, names: list[str]) -> None:
        try:
            self.store.delete(names)
        except Exception as err:
            raise self._fail("delete old checkpoints in", err) from None

    def set_aside(self, copied: list[str], moved: list[str], folder: str) -> None:
        """Copy `copied` and `moved` (those that exist) under the prefix `folder/`, server-side; then, every copy
        there with its original's size, delete the originals of `moved`, in their order. Cut off before the deletes,
        the originals are all still there (and a copy of them)."""
        try:
            sizes = self.store.sizes()
            present = [name for name in copied + moved if name in sizes]
            for name in present:
                self.store.copy(name, f"{folder}/{name}")
            copies = S3Dataset(f"{self.url}/{folder}").sizes()
            short = [name for name in present if copies.get(name) != sizes[name]]
            if short:
                raise StoreError(f"cannot set aside {', '.join(short)} in {self.url}: the copies in {folder}/ are not "
                                 "whole; nothing was deleted")
            for name in moved:
                if name in sizes:
                    self.store.delete([name])
        except StoreError:
            raise
        except Exception as err:
            raise self._fail("set aside checkpoints in", err) from None


RunStore = LocalRunStore | S3RunStore


def default_run_local(run_dir: str) -> Path:
    """Node-local scratch for an S3 run: under the temporary directory, one folder per run URL."""
    digest = hashlib.blake2b(run_dir.encode(), digest_size=6).hexdigest()
    return Path(tempfile.gettempdir()) / "tokstream-runs" / digest


def run_orders_dir(run_dir: str, run_local: str | None) -> Path:
    """Where a run keeps its epochs' orders as files (data.order_dir by default): in run_dir, or for an S3 run in
    its node-local run_local, where every relaunch on the node maps them."""
    if is_s3(run_dir):
        return (Path(run_local) if run_local else default_run_local(run_dir)) / "orders"
    return Path(run_dir) / "orders"


def open_run_store(run_dir: str, run_local: str | None, check_writable: bool = True) -> RunStore:
    """The store for `run_dir` (a path or s3://bucket/prefix); S3 is checked before any work."""
    if is_s3(run_dir):
        store = S3RunStore(run_dir, Path(run_local) if run_local else default_run_local(run_dir))
        if check_writable:
            store.store.check_writable()
    else:
        store = LocalRunStore(run_dir)
    store.local.mkdir(parents=True, exist_ok=True)
    return store


def staging_path(store: RunStore, name: str) -> Path:
    """Where a file is written before `publish`: beside its final name locally, in run_local for S3."""
    store.local.mkdir(parents=True, exist_ok=True)
    return store.local / f"{name}.tmp{os.getpid()}"
