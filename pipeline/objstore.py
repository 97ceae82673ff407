"""Where INPUT and OUT live, a local folder or ``s3://bucket/prefix``, and the store on S3.

``Location.parse`` turns what a user typed into one location type; ``open_store`` gives
the commit log and the lease their ``Store`` for it (``LocalStore`` for a folder,
``S3Store`` here for object storage); ``s3_filesystem`` gives workers a
``pyarrow.fs.S3FileSystem`` on the same endpoint for reading sources and writing Parquet.

``S3Store`` maps each store operation to one S3 call (see ``pipeline/store.py``):
``create`` is a ``PUT`` with ``If-None-Match: *`` (412 PreconditionFailed: the key exists).
A single ``PUT`` is atomic on S3 (readers see the old object or the new one), so commit
records and lease generations need nothing else, provided the server honours the
condition. A server that ignores it would let two writers both commit version N, so
before its first ``create`` a store probes once (a conditional put of a key it has just
written must fail) and refuses such a server with ``EnvironmentFaultError``: there is no
silent fallback to unconditional writes.

Endpoint: the ``endpoint_url`` argument, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
(boto3 reads them; pyarrow does not, so ``s3_filesystem`` passes them itself), else AWS.
Credentials come from the standard AWS chain (environment, config and profile files,
instance or pod roles), never from modalign. Transient errors (throttling, 5xx, connection
resets, timeouts) are retried by botocore's ``standard`` mode (exponential backoff with
jitter, a bounded number of attempts); calls of one store run at most ``max_concurrency``
at a time. What cannot be fixed by retrying (no such bucket, refused credentials, an
unreachable endpoint) raises ``EnvironmentFaultError`` naming the bucket and endpoint,
never a secret.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from modalign.pipeline.store import LocalStore, Store
from modalign.schemas.errors import ConfigError, EnvironmentFaultError

T = TypeVar("T")

# AWS's rules for new bucket names (3-63 characters, lower case, digits, dots and hyphens).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # boto3's order: service-specific first
_ABSENT = frozenset({"NoSuchKey", "404"})  # a missing key (not a missing bucket)
# Error codes that mean "the credentials are wrong or not allowed", whatever the operation.
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
               "TokenRefreshRequired", "InvalidClientTokenId", "AllAccessDisabled", "403"}


@dataclass(frozen=True)
class Location:
    """A local folder (``bucket`` None, ``path`` set) or an S3 prefix (``bucket``, ``prefix``
    without leading or trailing ``/``; ``""`` is the bucket's root)."""

    bucket: str | None = None
    prefix: str = ""
    path: Path | None = None

    @classmethod
    def parse(cls, text: str | Path) -> "Location":
        """``s3://bucket/prefix`` or a local path (``file://`` accepted); ConfigError otherwise."""
        if isinstance(text, Path):
            return cls(path=text.expanduser())
        raw = text.strip()
        scheme, sep, rest = raw.partition("://")
        if not sep:
            return cls(path=Path(raw).expanduser())
        scheme = scheme.lower()
        if scheme == "file":
            return cls(path=Path(rest or "/"))
        if scheme not in ("s3", "s3a"):
            raise ConfigError(f"{raw}: unsupported location scheme {scheme}://; use a local path or s3://bucket/prefix")
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise ConfigError(f"{raw}: {bucket!r} is not a valid S3 bucket name (3-63 characters: lower-case "
                              "letters, digits, dots and hyphens, starting and ending with a letter or digit)")
        prefix = prefix.strip("/")
        if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
            raise ConfigError(f"{raw}: the key prefix has an empty, '.' or '..' segment")
        return cls(bucket=bucket, prefix=prefix)

    @property
    def is_s3(self) -> bool:
        return self.bucket is not None

    @property
    def uri(self) -> str:
        if self.bucket is None:
            return str(self.path)
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, rel: str = "") -> str:
        """The S3 key of ``rel`` (a ``/``-separated path relative to this location)."""
        rel = rel.strip("/")
        return "/".join(p for p in (self.prefix, rel) if p)

    def arrow_path(self, rel: str = "") -> str:
        """The path of ``rel`` on this location's ``pyarrow.fs`` filesystem (``bucket/key`` on S3)."""
        if self.bucket is None:
            assert self.path is not None
            return str(self.path / rel) if rel else str(self.path)
        return f"{self.bucket}/{self.key(rel)}"

    def join(self, rel: str) -> "Location":
        if self.bucket is None:
            assert self.path is not None
            return Location(path=self.path / rel)
        return Location(bucket=self.bucket, prefix=self.key(rel))

    def __str__(self) -> str:
        return self.uri


@dataclass(frozen=True)
class S3Options:
    """How modalign talks to an S3 endpoint. ``None`` fields come from the AWS environment
    (``AWS_ENDPOINT_URL[_S3]``, ``AWS_REGION``/``AWS_DEFAULT_REGION`` and config files)."""

    endpoint_url: str | None = None
    region: str | None = None
    max_attempts: int = 5            # botocore counts the first try: 4 retries
    retry_mode: str = "standard"     # or "adaptive" (adds client-side rate limiting on throttling)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    max_concurrency: int = 16        # concurrent calls per store (and its HTTP connection pool)
    page_size: int = 1000            # ListObjectsV2 MaxKeys

    @classmethod
    def from_config(cls, storage: Any) -> "S3Options":
        """The options of a run's ``storage`` config section (``schemas.config.StorageConfig``)."""
        return cls(endpoint_url=storage.endpoint_url, region=storage.region, max_attempts=storage.max_attempts,
                   retry_mode=storage.retry_mode, connect_timeout_s=storage.connect_timeout_s,
                   read_timeout_s=storage.read_timeout_s, max_concurrency=storage.max_concurrency)

    def resolved_endpoint(self) -> str | None:
        """The endpoint URL in force (None: AWS's own for the region)."""
        if self.endpoint_url:
            return self.endpoint_url
        return next((os.environ[v] for v in _ENDPOINT_VARS if os.environ.get(v)), None)


def open_store(location: Location | str | Path, options: S3Options | None = None) -> Store:
    """The ``Store`` (commit log, lease) for a folder or an S3 prefix."""
    loc = location if isinstance(location, Location) else Location.parse(location)
    if loc.is_s3:
        return S3Store(loc, options)
    assert loc.path is not None
    return LocalStore(loc.path)


def s3_filesystem(location: Location | str, options: S3Options | None = None):
    """A ``pyarrow.fs.S3FileSystem`` for ``location``'s endpoint, with the store's retries and
    timeouts; paths on it are ``bucket/key`` (``Location.arrow_path(rel)``).
    Credentials come from the AWS chain (the AWS C++ SDK reads the same environment and files)."""
    from pyarrow import fs

    loc = location if isinstance(location, Location) else Location.parse(location)
    if not loc.is_s3:
        raise ConfigError(f"{loc.uri} is not an s3:// location")
    opts = options or S3Options()
    kwargs: dict[str, Any] = dict(
        region=opts.region or _session_region() or "us-east-1",
        connect_timeout=opts.connect_timeout_s, request_timeout=opts.read_timeout_s,
        retry_strategy=fs.AwsStandardS3RetryStrategy(max_attempts=opts.max_attempts))
    endpoint = opts.resolved_endpoint()
    if endpoint:
        scheme, sep, host = endpoint.partition("://")
        kwargs.update(endpoint_override=(host if sep else scheme).rstrip("/"), scheme=scheme if sep else "https")
    return fs.S3FileSystem(**kwargs)


def _session_region() -> str | None:
    return os.environ.get("AWS_REGION") or _session().region_name


_loader_lock = threading.Lock()
_loader: Any = None


def _session() -> Any:
    """A new boto3 session (so it resolves the credential chain now, as the environment is),
    sharing one botocore data loader: parsing S3's service model costs ~0.3 s per session."""
    import boto3
    import botocore.session

    global _loader
    core = botocore.session.get_session()
    with _loader_lock:
        if _loader is None:
            _loader = core.get_component("data_loader")
        else:
            core.register_component("data_loader", _loader)
    return boto3.session.Session(botocore_session=core)


class S3Store:
    """``LocalStore``'s operations on the keys under an S3 prefix; keys are relative to it.
    Thread-safe: one boto3 client, at most ``options.max_concurrency`` calls at a time."""

    local = False  # no shared pid space: a lease's staleness comes from its heartbeat alone

    def __init__(self, location: Location | str, options: S3Options | None = None, *, client: Any = None) -> None:
        self.location = location if isinstance(location, Location) else Location.parse(location)
        if not self.location.is_s3:
            raise ConfigError(f"{self.location.uri} is not an s3:// location")
        self.options = options or S3Options()
        self.endpoint = self.options.resolved_endpoint()
        self.client = client if client is not None else self._client()
        self._slots = threading.BoundedSemaphore(self.options.max_concurrency)
        self._probe_lock = threading.Lock()
        self._conditional_ok = False

    @property
    def root(self) -> str:
        return self.location.uri

    @property
    def bucket(self) -> str:
        assert self.location.bucket is not None
        return self.location.bucket

    def _client(self) -> Any:
        from botocore.config import Config

        o = self.options
        config = Config(retries={"mode": o.retry_mode, "max_attempts": o.max_attempts},
                        connect_timeout=o.connect_timeout_s, read_timeout=o.read_timeout_s,
                        max_pool_connections=o.max_concurrency)
        return _session().client("s3", endpoint_url=self.endpoint, region_name=o.region, config=config)

    # -- the store operations ----------------------------------------------------------------
    def create(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if it does not exist (``If-None-Match: *``); False when it does."""
        self.ensure_conditional_writes()
        return self._create(key, data)

    def put(self, key: str, data: bytes) -> None:
        """Replace ``key`` (one PUT: readers see the old or the new object)."""
        self._call("put", key, lambda: self.client.put_object(Bucket=self.bucket, Key=self.location.key(key),
                                                              Body=data))

    def get(self, key: str) -> bytes | None:
        """The object's bytes; None on 404. The body is read inside the call, so a connection
        that breaks mid-body is retried like one that breaks before."""
        def fetch() -> bytes:
            from botocore.exceptions import HTTPClientError  # incl. ResponseStreamingError

            for attempt in range(self.options.max_attempts):
                resp = self.client.get_object(Bucket=self.bucket, Key=self.location.key(key))
                try:
                    return resp["Body"].read()
                except HTTPClientError:
                    if attempt + 1 == self.options.max_attempts:
                        raise
            raise AssertionError("unreachable")

        try:
            return self._call("get", key, fetch, absent=_ABSENT)
        except _Absent:
            return None

    def list(self, prefix: str) -> list[str]:
        """Keys directly under the "folder" ``prefix`` (``ListObjectsV2`` with ``Delimiter=/``,
        every page), sorted, relative to the store; names starting with ``.`` left out."""
        folder = self.location.key(prefix)
        query: dict[str, Any] = dict(Bucket=self.bucket, Prefix=f"{folder}/" if folder else "", Delimiter="/",
                                     MaxKeys=self.options.page_size)
        strip = len(self.location.key()) + 1 if self.location.prefix else 0
        keys: list[str] = []
        while True:
            page = self._call("list", prefix, lambda q=dict(query): self.client.list_objects_v2(**q))
            for obj in page.get("Contents", []):
                name = obj["Key"].rsplit("/", 1)[-1]
                if name and not name.startswith("."):
                    keys.append(obj["Key"][strip:])
            if not page.get("IsTruncated"):
                return sorted(keys)
            query["ContinuationToken"] = page["NextContinuationToken"]

    def walk(self, prefix: str) -> list[str]:
        """Every key under the "folder" ``prefix``, at any depth (``ListObjectsV2`` without a
        delimiter, every page), sorted, relative to the store."""
        folder = self.location.key(prefix)
        query: dict[str, Any] = dict(Bucket=self.bucket, Prefix=f"{folder}/" if folder else "",
                                     MaxKeys=self.options.page_size)
        strip = len(self.location.key()) + 1 if self.location.prefix else 0
        keys: list[str] = []
        while True:
            page = self._call("list", prefix, lambda q=dict(query): self.client.list_objects_v2(**q))
            keys += [obj["Key"][strip:] for obj in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return sorted(keys)
            query["ContinuationToken"] = page["NextContinuationToken"]

    def list_objects(self, prefix: str = "") -> list[dict]:
        """Every object whose key starts with ``prefix`` (relative to the store; no delimiter,
        every ``ListObjectsV2`` page): dicts of ``key`` (relative to the store), ``etag`` (quotes
        stripped), ``size`` (bytes) and ``modified_at`` (epoch seconds), sorted by key."""
        full = self.location.key(prefix)
        query: dict[str, Any] = dict(Bucket=self.bucket, Prefix=full, MaxKeys=self.options.page_size)
        strip = len(self.location.key()) + 1 if self.location.prefix else 0
        found: list[dict] = []
        while True:
            page = self._call("list", prefix, lambda q=dict(query): self.client.list_objects_v2(**q))
            for obj in page.get("Contents", []):
                found.append({"key": obj["Key"][strip:], "etag": str(obj.get("ETag", "")).strip('"'),
                              "size": int(obj.get("Size", 0)), "modified_at": obj["LastModified"].timestamp()})
            if not page.get("IsTruncated"):
                return sorted(found, key=lambda o: o["key"])
            query["ContinuationToken"] = page["NextContinuationToken"]

    def delete(self, key: str) -> None:
        try:
            self._call("delete", key, lambda: self.client.delete_object(Bucket=self.bucket,
                                                                        Key=self.location.key(key)),
                       absent=_ABSENT)
        except _Absent:
            pass

    def digest(self, key: str) -> str | None:
        """None: S3 keeps an MD5-like ETag, not a sha256, and hashing would download the object.
        Commit records of an S3 OUT carry no digests; an erasure there hashes what it reports."""
        return None

    # -- conditional create --------------------------------------------------------------------
    def _create(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        full = self.location.key(key)
        for attempt in range(5):  # 409: a concurrent conditional write of the same key was in progress
            try:
                with self._slots:
                    self.client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*")
                return True
            except ClientError as exc:
                code, status = _code(exc)
                if status == 412 or code == "PreconditionFailed":
                    # A retried PUT whose first try succeeded (its response was lost) meets its own
                    # object: records carry the writer's run id and times, so equal bytes are ours.
                    retried = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) > 0
                    return retried and self.get(key) == data
                if code == "ConditionalRequestConflict" or status == 409:
                    time.sleep(random.uniform(0, 0.1 * 2 ** attempt))
                    continue
                if code == "NotImplemented" or status == 501:
                    raise self._no_conditional_writes() from None
                raise self._fault("create", key, exc) from None
            except BotoCoreError as exc:  # connection, credentials
                raise self._fault("create", key, exc) from None
        raise EnvironmentFaultError(f"create {full} on {self._where()}: the conditional write kept conflicting with "
                                    "another one in progress (409 ConditionalRequestConflict); try again")

    def ensure_conditional_writes(self) -> None:
        """Check once per store that the server refuses a conditional put of an existing key
        (a probe key under ``_modalign/probe/``, deleted after); ``EnvironmentFaultError`` if it
        does not. ``create`` calls it; a writer may call it up front to fail before any work."""
        if self._conditional_ok:
            return
        with self._probe_lock:
            if self._conditional_ok:
                return
            probe = f"_modalign/probe/{secrets.token_hex(8)}.json"
            try:
                first = self._create(probe, b"1")
                second = self._create(probe, b"2")
            finally:
                self.delete(probe)
            if not first or second:
                raise self._no_conditional_writes()
            self._conditional_ok = True

    def _no_conditional_writes(self) -> EnvironmentFaultError:
        return EnvironmentFaultError(
            f"the object store at {self._where()} ignores conditional writes (PUT with If-None-Match: *), "
            "so two writers could both commit the same version or both hold the lease; modalign refuses to "
            "write there: use a store that honours them (AWS S3, SeaweedFS, MinIO and others do) or a local OUT")

    # -- calls and their errors ------------------------------------------------------------------
    def _call(self, op: str, key: str, fn: Callable[[], T], absent: frozenset[str] = frozenset()) -> T:
        """``fn()`` in one of the store's slots, its botocore errors mapped (``_fault``)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            with self._slots:
                return fn()
        except ClientError as exc:
            if _code(exc)[0] in absent:
                raise _Absent() from None
            raise self._fault(op, key, exc) from None
        except BotoCoreError as exc:  # connection, credentials, read errors
            raise self._fault(op, key, exc) from None

    def _where(self) -> str:
        return f"{self.endpoint or 'the AWS S3 endpoint'} (bucket {self.bucket})"

    def _fault(self, op: str, key: str, exc: Exception) -> EnvironmentFaultError:
        """``EnvironmentFaultError`` for what the store did; never a credential in the text."""
        from botocore import exceptions as be

        what = f"{op} {self.location.key(key) or '/'!s} on {self._where()}"
        if isinstance(exc, be.ClientError):
            code, status = _code(exc)
            if code == "NoSuchBucket":
                msg = (f"bucket {self.bucket} does not exist at {self.endpoint or 'AWS'}: create it, or check the "
                       f"location {self.root}")
            elif code in _AUTH_CODES or status == 403:
                msg = (f"{what}: the credentials were refused ({code}); check the AWS credentials in the "
                       "environment, profile or role, and that they may use this bucket")
            else:
                attempts = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) + 1
                msg = f"{what} failed: {code} (HTTP {status}) after {attempts} attempt(s)"
        elif isinstance(exc, (be.NoCredentialsError, be.PartialCredentialsError)):
            msg = (f"{what}: no AWS credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE "
                   "or an instance/pod role")
        elif isinstance(exc, be.ConnectionError):  # endpoint unreachable, connect timeout, proxy
            msg = (f"cannot reach the object store at {self._where()} ({type(exc).__name__}); is the endpoint "
                   "right and up?")
        elif isinstance(exc, be.HTTPClientError):  # connection closed or reset, read timeouts
            msg = f"{what}: the connection failed ({type(exc).__name__}) after the retries"
        else:
            msg = f"{what} failed: {type(exc).__name__}"
        return EnvironmentFaultError(msg)


class _Absent(Exception):
    """The key is not there (a 404 the caller expects)."""


def _code(exc: Any) -> tuple[str, int]:
    err = exc.response.get("Error", {})
    return str(err.get("Code", "")), int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
