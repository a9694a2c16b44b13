"""Object storage (`s3://`, `gs://`) through fsspec: checkpoint.dir, init.path, data paths.

A URL is a config value like a path: it never reaches a shell, and the key inside the bucket is
checked as a local path is (no `..`, no empty or control-character segments). The backends are
optional extras imported only here, at first use: s3fs (`pip install 'disttrain[s3]'`) and gcsfs
(`disttrain[gcs]`). Credentials and endpoints come from the backend's standard environment
(`AWS_ENDPOINT_URL`, `AWS_PROFILE`, `~/.aws`, `GOOGLE_APPLICATION_CREDENTIALS`) or from the config's
`storage_options` ({protocol: {option: value}}: fsspec's own per-protocol defaults, which every
filesystem of that protocol then takes).

`ObjectPath` is the part of pathlib the checkpoint and data code use (`/`, name, parent, exists,
is_dir, read/write, iterdir, stat), over one fsspec filesystem. An object store has no folders and
no rename: a "folder" is a key prefix, and a checkpoint is committed by writing its manifest last
(`checkpoint.remote`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

from disttrain.config.errors import ConfigError

# scheme -> (the package that serves it, the disttrain extra that installs it)
SCHEMES = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]$")


def is_url(value: Any) -> bool:
    """Whether `value` is an object-store location (a `scheme://` string or an ObjectPath)."""
    return isinstance(value, ObjectPath) or (isinstance(value, str) and "://" in value)


def url_problem(url: str) -> str | None:
    """Why `url` is not an object-store location disttrain reads and writes, or None.

    The key inside the bucket is held to what a local path must be: no `.`/`..` or empty segments
    (they would name another prefix than the one written), no NUL, backslash or control characters."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        return f"the scheme {scheme!r} is not one of {', '.join(s + '://' for s in SCHEMES)}"
    bucket, _, key = rest.partition("/")
    if not _BUCKET.match(bucket):
        return f"the bucket {bucket!r} is not a bucket name (3-63 lowercase letters, digits, '.', '-')"
    key = key.rstrip("/")
    for part in key.split("/") if key else []:
        if part in ("", ".", ".."):
            return f"the key {key!r} has an empty, '.' or '..' segment"
        if any(ord(c) < 32 or c in "\\\x7f" for c in part):
            return f"the key {key!r} has a control character or a backslash"
    return None


def configure(options: Any) -> None:
    """Make `storage_options` ({protocol: {option: value}}) the defaults of every fsspec filesystem
    of that protocol in this process (fsspec.config.conf, which fsspec applies to each new one)."""
    if not options:
        return
    import fsspec.config

    for protocol, kwargs in dict(options).items():
        fsspec.config.conf.setdefault(protocol, {}).update(dict(kwargs))


def options_problem(options: Any) -> str | None:
    """Why `storage_options` is not {protocol: {option: value}} for the known protocols, or None."""
    if options is None:
        return None
    if not isinstance(options, Mapping):
        return f"is {type(options).__name__}, not a mapping"
    for protocol, kwargs in options.items():
        if protocol not in SCHEMES:
            return f"names protocol {protocol!r}, not one of {', '.join(SCHEMES)}"
        if not isinstance(kwargs, Mapping):
            return f"gives {protocol} a {type(kwargs).__name__}, not a mapping of options"
    return None


class MissingBackend(ImportError):
    """The fsspec backend of a URL's scheme is not installed."""


def filesystem(url: str, fresh: bool = False, **extra: Any) -> Any:
    """The fsspec filesystem serving `url` (its backend imported now). `fresh`: a new instance
    (fsspec caches one per set of options), for a probe whose options differ."""
    from disttrain.config.extras import EXTRAS

    scheme = url.partition("://")[0]
    package, extra_name = SCHEMES.get(scheme, (scheme, scheme))
    try:
        import fsspec

        __import__(package)
    except ImportError as exc:
        how = EXTRAS[extra_name].install if extra_name in EXTRAS else f"pip install {package}"
        raise MissingBackend(f"{url} needs the {package} package: {how}") from exc
    if fresh:
        extra["skip_instance_cache"] = True
    return fsspec.filesystem(scheme, **extra)


class ObjectPath:
    """A location in an object store, with the pathlib methods the checkpoint and data code use.

    Listings are never served from fsspec's cache: other ranks and processes write the same prefix."""

    def __init__(self, url: str) -> None:
        url = str(url).rstrip("/")
        if why := url_problem(url):
            raise ValueError(f"{url}: {why}")
        self.url = url
        self.scheme, _, self.key = url.partition("://")  # key: "bucket/prefix/...": fsspec's path

    # -- pure path operations
    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(f"{self.url}/{name}")

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]

    @property
    def parent(self) -> ObjectPath:
        head = self.key.rpartition("/")[0]
        return ObjectPath(f"{self.scheme}://{head}") if head else self

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other: ObjectPath) -> bool:
        return self.url < other.url

    # -- the store
    @property
    def fs(self) -> Any:
        return filesystem(self.url)

    def _fresh(self) -> Any:
        fs = self.fs
        fs.invalidate_cache()
        return fs

    def exists(self) -> bool:
        return bool(self._fresh().exists(self.key))

    def is_dir(self) -> bool:
        return bool(self._fresh().isdir(self.key))

    def is_file(self) -> bool:
        return bool(self._fresh().isfile(self.key))

    def is_symlink(self) -> bool:
        return False  # an object store has none

    def stat(self) -> SimpleNamespace:
        return SimpleNamespace(st_size=int(self._fresh().info(self.key)["size"]))

    def iterdir(self) -> Iterator[ObjectPath]:
        fs = self._fresh()
        try:
            names = fs.ls(self.key, detail=False)
        except FileNotFoundError:
            return iter(())
        return iter(
            ObjectPath(f"{self.scheme}://{n.rstrip('/')}") for n in sorted(names) if n.rstrip("/") != self.key
        )

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to make: a prefix exists once an object is written under it."""

    def read_bytes(self) -> bytes:
        data: bytes = self._fresh().cat_file(self.key)
        return data

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        """One PUT: the object appears whole or not at all."""
        self.fs.pipe_file(self.key, bytes(data))

    def put(self, name: str, data: bytes) -> None:
        """The object `name` under this prefix, written whole."""
        (self / name).write_bytes(data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def open(self, mode: str = "rb", buffering: int = -1, **kwargs: Any) -> Any:
        return self._fresh().open(self.key, mode, **kwargs)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        """Every object under this prefix (one listing, then batched deletes)."""
        fs = self._fresh()
        if keys := fs.find(self.key):
            fs.rm(keys)

    def listing(self) -> dict[str, int]:
        """{key below this prefix: size} of every object under it, at any depth: one listing."""
        found = self._fresh().find(self.key, detail=True)
        return {name[len(self.key) + 1 :]: int(e["size"]) for name, e in found.items() if name != self.key}

    def files(self) -> dict[str, int]:
        """{name: size} of the objects directly under this prefix (not deeper)."""
        return {k: n for k, n in self.listing().items() if "/" not in k}


def probe(key: str, url: str, write: bool = False) -> None:
    """Before launch: the bucket of `url` is reachable with these credentials, exists, and (with
    `write`) takes an object. Else one ConfigError naming `key`, the URL and what to fix."""
    if why := url_problem(url):
        raise ConfigError(key, url, "a path, or s3://BUCKET/KEY or gs://BUCKET/KEY", f"{why}.")
    scheme, _, rest = url.partition("://")
    bucket = rest.partition("/")[0]
    try:
        fs = filesystem(url, fresh=True, **_quick(scheme))
    except MissingBackend as exc:
        raise ConfigError(key, url, "an object-store URL whose backend is installed", f"{exc}.") from None
    except Exception as exc:  # a backend that refuses its options at construction
        raise ConfigError(
            key, url, "a reachable bucket", f"the {scheme} client could not start: {_one_line(exc)}."
        ) from None
    try:
        fs.ls(bucket, detail=False)
        if write:
            token = f"{rest.rstrip('/')}/.disttrain-probe"
            fs.pipe_file(token, b"probe")
            fs.rm_file(token)
    except FileNotFoundError:
        raise ConfigError(
            key,
            url,
            "a URL in an existing bucket",
            f"the bucket {bucket!r} does not exist at this endpoint ({_endpoint(scheme)}): create it, or fix "
            "the bucket name",
        ) from None
    except PermissionError as exc:
        raise ConfigError(
            key,
            url,
            "a bucket these credentials may read and write",
            f"access was refused ({_one_line(exc)}): set credentials the standard way (AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS) or in "
            f"storage_options.{scheme}",
        ) from None
    except Exception as exc:
        raise ConfigError(
            key, url, "a reachable object store with credentials", _failure_hint(scheme, exc)
        ) from None


def _quick(scheme: str) -> dict[str, Any]:
    """A probe fails in seconds on an endpoint nothing answers at (botocore retries for minutes)."""
    if SCHEMES[scheme][0] == "s3fs":
        return {"config_kwargs": {"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 1}}}
    return {}


def _endpoint(scheme: str) -> str:
    import os

    if SCHEMES[scheme][0] == "s3fs":
        import fsspec.config

        conf = fsspec.config.conf.get("s3", {})
        return str(
            conf.get("endpoint_url")
            or conf.get("client_kwargs", {}).get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or "AWS"
        )
    return "Google Cloud Storage"


def _failure_hint(scheme: str, exc: BaseException) -> str:
    name = type(exc).__name__
    text = _one_line(exc)
    if "credential" in text.lower() or "NoCredentials" in name:
        return (
            f"no credentials were found ({text}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            f"AWS_PROFILE (or GOOGLE_APPLICATION_CREDENTIALS for gs://), or storage_options.{scheme}"
        )
    return (
        f"the endpoint {_endpoint(scheme)} did not answer ({name}: {text}): check AWS_ENDPOINT_URL or "
        f"storage_options.{scheme}.endpoint_url, and that the store is running and reachable"
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def location(value: Any) -> Any:
    """A path or URL as the checkpoint code takes it: an ObjectPath for a URL, else a Path."""
    from pathlib import Path

    return (
        value
        if isinstance(value, ObjectPath)
        else ObjectPath(str(value))
        if is_url(value)
        else Path(str(value))
    )
