"""Shared by the converters (upload), the reader (download) and the trainer's run store: datasets in S3
(or any S3-compatible store): checked before work, uploaded as written, index last.

Credentials and endpoints come the AWS way: environment, profiles, instance roles, and
`S3_ENDPOINT_URL` for MinIO, R2, Ceph... (the variable streaming itself reads). Transient errors
(HTTP 500/503, throttling, connection resets, timeouts) are retried by botocore's standard retry
mode with exponential back-off, `TOKSTREAM_S3_MAX_ATTEMPTS` attempts per request (default 8).
"""

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

from tokstream.errors import StoreError, UserError

MAX_UPLOADS_IN_FLIGHT = 4  # local disk holds at most this many shards beyond the one being written


class UploadError(StoreError):
    """An upload that failed after its retries: the store, not the input, is at fault."""


def is_s3(path: str | os.PathLike) -> bool:
    return str(path).startswith("s3://")


def split_url(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise UserError(f"{url} is not an s3://bucket/prefix URL")
    return parsed.netloc, parsed.path.strip("/")


def s3_client():
    import boto3
    from botocore.config import Config

    attempts = int(os.environ.get("TOKSTREAM_S3_MAX_ATTEMPTS", "8"))
    config = Config(retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=10, read_timeout=60)
    return boto3.session.Session().client("s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL") or None,
                                          config=config)


def describe_error(err: Exception) -> str:
    """One line for the usual ways an S3 call fails."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(err, NoCredentialsError):
        return "no AWS credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or a role"
    if isinstance(err, EndpointConnectionError):
        return f"cannot reach the S3 endpoint ({err}); check S3_ENDPOINT_URL and the network"
    if isinstance(err, ClientError):
        code = err.response.get("Error", {}).get("Code", "?")
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        meanings = {"404": "the bucket does not exist", "NoSuchBucket": "the bucket does not exist",
                    "403": "access denied", "AccessDenied": "access denied",
                    "InvalidAccessKeyId": "the access key is not valid",
                    "SignatureDoesNotMatch": "the secret key does not match the access key"}
        return f"{meanings.get(code, code)} (HTTP {status})"
    return f"{type(err).__name__}: {err}"


class S3Dataset:
    """A dataset root at s3://bucket/prefix: reading, checking and replacing its objects."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.bucket, self.prefix = split_url(url)
        self.client = s3_client()

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def check_writable(self) -> None:
        """Fail in seconds, not after an hour of tokenizing: bucket, credentials, write permission."""
        probe = self.key(".tokstream-write-probe")
        try:
            self.client.head_bucket(Bucket=self.bucket)
            self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"")
            self.client.delete_object(Bucket=self.bucket, Key=probe)
        except Exception as err:
            raise UserError(f"cannot write to s3://{self.bucket}/{self.prefix}: {describe_error(err)}") from None

    def sizes(self) -> dict[str, int]:
        """Every object under the prefix, relative to it, with its size in bytes."""
        found = {}
        start = f"{self.prefix}/" if self.prefix else ""
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            found.update((item["Key"][len(start):], item["Size"]) for item in page.get("Contents", []))
        return found

    def keys(self) -> list[str]:
        """Every object key under the prefix, relative to it."""
        return list(self.sizes())

    def exists(self, relative: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key(relative))
            return True
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise UserError(f"cannot read {self.url}/{relative}: {describe_error(err)}") from None
        except BotoCoreError as err:  # no credentials, no endpoint: often the first call a reader makes
            raise UserError(f"cannot read {self.url}/{relative}: {describe_error(err)}") from None

    def download(self, relative: str, destination: Path) -> Path:
        destination.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.client.download_file(self.bucket, self.key(relative), str(destination))
        except Exception as err:
            raise UserError(f"cannot download {self.url}/{relative}: {describe_error(err)}") from None
        return destination

    def upload(self, source: Path, relative: str) -> None:
        self.client.upload_file(str(source), self.bucket, self.key(relative))

    def put_bytes(self, relative: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key(relative), Body=data)

    def get_bytes(self, relative: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key(relative))["Body"].read()
        except Exception as err:
            raise UserError(f"cannot read {self.url}/{relative}: {describe_error(err)}") from None

    def copy(self, relative: str, to: str) -> None:
        """A server-side copy of one object to another key under the prefix (in parts above 5 GB)."""
        # The copy's checksum computed afresh: a multipart copy's parts are not the upload's.
        self.client.copy({"Bucket": self.bucket, "Key": self.key(relative)}, self.bucket, self.key(to),
                         ExtraArgs={"ChecksumAlgorithm": "CRC32"})

    def delete(self, relatives: list[str]) -> None:
        for start in range(0, len(relatives), 1000):
            objects = [{"Key": self.key(r)} for r in relatives[start : start + 1000]]
            if objects:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})


class Uploader:
    """Uploads files from a local staging root while the conversion goes on, deleting each copy after.

    Shards go up as they are written; `commit` uploads every index.json and then metadata.json,
    so a reader never finds an index naming a shard that is not there, and training (which needs
    metadata.json) never starts on a dataset still being written.
    """

    def __init__(self, dataset: S3Dataset, staging: Path):
        self.dataset, self.staging = dataset, staging
        self.pool = ThreadPoolExecutor(max_workers=MAX_UPLOADS_IN_FLIGHT)
        self.slots = threading.BoundedSemaphore(MAX_UPLOADS_IN_FLIGHT)
        self.futures: list[Future] = []
        self.uploaded: list[str] = []

    def shard_written(self, path: Path) -> None:
        """Queue one finished file; blocks while MAX_UPLOADS_IN_FLIGHT are already going."""
        self.slots.acquire()
        self._raise_failures()
        self.futures.append(self.pool.submit(self._upload_and_remove, path))

    def _upload_and_remove(self, path: Path) -> None:
        try:
            relative = path.relative_to(self.staging).as_posix()
            self.dataset.upload(path, relative)
            self.uploaded.append(relative)
            path.unlink()
        finally:
            self.slots.release()

    def wait(self) -> None:
        """Return once every queued file is up; raise if one failed."""
        for future in self.futures:
            future.exception()
        self._raise_failures()

    def upload_after_queue(self, path: Path, relative: str) -> None:
        """Upload `path` once every file queued before it is up: a record that names them comes last."""
        self.wait()
        try:
            self.dataset.upload(path, relative)
        except Exception as err:
            raise UploadError(f"upload to {self.dataset.url} failed after retries: {describe_error(err)}") from None

    def _raise_failures(self) -> None:
        for future in self.futures:
            if future.done() and future.exception() is not None:
                err = future.exception()
                raise UploadError(f"upload to {self.dataset.url} failed after retries: {describe_error(err)}")

    def commit(self) -> None:
        self.wait()
        self.pool.shutdown()
        indexes = sorted(p for p in self.staging.rglob("index.json"))
        others = sorted(p for p in self.staging.rglob("*") if p.is_file() and p.name not in ("index.json",
                                                                                             "metadata.json"))
        try:
            for path in others + indexes:  # any shard not yet sent, then the indexes
                self.dataset.upload(path, path.relative_to(self.staging).as_posix())
            metadata = self.staging / "metadata.json"
            if metadata.exists():
                self.dataset.upload(metadata, "metadata.json")  # last: the dataset is complete from here
        except Exception as err:
            raise UploadError(f"upload to {self.dataset.url} failed after retries: {describe_error(err)}") from None

    def abort(self, keep: bool = False) -> None:
        """Stop uploading; unless `keep` (a resumable run), remove what was uploaded. No index went
        up either way, so what stays is unreadable as a dataset."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        if keep:
            return
        try:
            self.dataset.delete(self.uploaded)
        except Exception:
            pass  # best effort: without an index the objects are unreadable anyway
