"""The I/O half of the ``fs`` tier: one fsspec filesystem, bounded in time.

Every remote call runs on a small thread pool and is waited for at most
``timeout_s`` (per batch of calls: ``timeout_s`` times the number of waves the
pool needs), so a hung NFS mount or a silent S3 server never blocks the caller.
A call that times out or fails with anything but "not found" opens a circuit
breaker for ``retry_after_s``: until then every call fails at once with
:class:`~kvstrata.errors.TierError` instead of waiting again, so a dead store
costs one timeout per ``retry_after_s``, not one per lookup.

Publication is atomic: on a local (or NFS/Lustre-mounted) directory an object is
written to a temporary name in its final directory, ``fsync``-ed and renamed, and the
directory is ``fsync``-ed after the rename (and after a new directory is made, a file
moved aside or deleted), so neither a published object or tombstone nor a deletion is
undone by a power loss (``fsync = false`` skips all of these). On object stores it is
one PUT (s3fs switches to a multipart upload only above 100 MiB, which also becomes
visible atomically at completion).

On a local or mounted directory, files are created with ``file_mode`` and directories with
``dir_mode`` whatever the umask (see :mod:`kvstrata.tiers.files`). An object store has no
modes: who may read or write objects is the bucket's policy (s3fs sends no ACL unless told,
so objects get the bucket's default, normally private to its account).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from kvstrata.errors import ConfigError, TierError
from kvstrata.tiers.files import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, fsync_dir, makedirs, write_atomic
from kvstrata.tiers.fs.format import TMP_SUFFIX
from kvstrata.tiers.fs.options import FSOptions

T = TypeVar("T")
S3_PROTOCOLS = ("s3", "s3a")


def default_storage_options(protocol: str, timeout_s: float, retries: int) -> dict[str, Any]:
    """Defaults that keep an unreachable object store from hanging callers.

    For S3 (s3fs): connect/read timeouts and few botocore attempts; no listing cache
    (a cached listing would hide what other nodes publish)."""
    if protocol not in S3_PROTOCOLS:
        return {}
    return {
        "use_listings_cache": False,
        "config_kwargs": {
            "connect_timeout": min(timeout_s, 3.0),
            "read_timeout": timeout_s,
            "retries": {"max_attempts": max(1, retries), "mode": "standard"},
        },
    }


def merge_options(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` over ``defaults``, merging nested dicts (``config_kwargs`` and the like)."""
    out = copy.deepcopy(defaults)
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_options(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class ObjectStore:
    """Relative paths under one root URL, with timeouts, a breaker and atomic puts."""

    @classmethod
    def of(cls, url: str, opts: FSOptions, label: str) -> ObjectStore:
        """The store at ``url`` (the tier's URL or below it) with the tier options' bounds."""
        return cls(
            url,
            opts.storage_options,
            timeout_s=opts.timeout_s,
            retry_after_s=opts.retry_after_s,
            concurrency=opts.max_concurrency,
            retries=opts.retries,
            fsync=opts.fsync,
            label=label,
            file_mode=opts.file_mode,
            dir_mode=opts.dir_mode,
        )

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any],
        *,
        timeout_s: float,
        retry_after_s: float,
        concurrency: int,
        retries: int,
        fsync: bool,
        label: str,
        file_mode: int = DEFAULT_FILE_MODE,
        dir_mode: int = DEFAULT_DIR_MODE,
    ) -> None:
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        opts = merge_options(default_storage_options(protocol, timeout_s, retries), storage_options)
        opts["skip_instance_cache"] = True  # our own instance: its settings and caches are ours
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **opts)
        except (ImportError, ValueError, TypeError) as exc:
            raise ConfigError(f"{label}: cannot open url {url!r}: {exc}", field="url", value=url) from exc
        if isinstance(getattr(self.fs, "retries", None), int):
            self.fs.retries = max(1, retries)  # s3fs/gcsfs retry loops on top of botocore's
        self.url = url
        kwargs = opts.get("client_kwargs")
        self.endpoint = kwargs.get("endpoint_url") if isinstance(kwargs, dict) else None  # named in faults
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.concurrency = concurrency
        self.fsync = fsync
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.label = label
        self.faults = 0  # calls that failed or timed out (not counting "not found")
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix=f"kvstrata-fs-{label}")

    # -- paths ---------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def rel(self, path: str) -> str:
        path = path.rstrip("/")
        root = self.fs._strip_protocol(self.root).rstrip("/")
        path = self.fs._strip_protocol(path)
        return path[len(root) + 1 :] if path.startswith(root + "/") else path

    # -- health ----------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False while the breaker is open after a fault."""
        return time.monotonic() >= self._down_until

    def _check_up(self, what: str, rel: str) -> None:
        left = self._down_until - time.monotonic()
        if left > 0:
            raise TierError(
                f"{self.label}: {what} {self.path(rel)!r} skipped: the store failed recently, retrying in {left:.1f}s"
            )

    def _fault(self, what: str, rel: str, exc: BaseException, waited: float) -> TierError:
        with self._lock:
            self.faults += 1
            self._down_until = time.monotonic() + self.retry_after_s
        timed_out = isinstance(exc, FutureTimeout)
        detail = f"timed out after {waited:g}s" if timed_out else f"{type(exc).__name__}: {exc}"
        if self.endpoint and str(self.endpoint) not in detail:
            detail += f" (endpoint {self.endpoint})"
        return TierError(f"{self.label}: {what} {self.path(rel)!r} failed: {detail}")

    # -- calls -------------------------------------------------------------------------------
    def run(self, what: str, rel: str, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        """Run one call within ``timeout_s`` (the store's own unless given); ``FileNotFoundError``
        passes through, other faults become ``TierError`` (and open the breaker)."""
        return self.run_all([(what, rel, fn, args)], raise_first=True, timeout_s=timeout_s)[0]  # type: ignore[no-any-return]

    def run_all(
        self,
        calls: Sequence[tuple[str, str, Callable[..., Any], tuple[Any, ...]]],
        raise_first: bool = False,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Run calls in parallel; each result is the value or the exception it ended with
        (``FileNotFoundError`` or ``TierError``). The batch waits at most ``timeout_s`` (the
        store's own unless given) per wave of ``concurrency`` calls. With ``raise_first`` the
        first exception is raised."""
        if not calls:
            return []
        self._check_up(calls[0][0], calls[0][1])
        wait = self.timeout_s if timeout_s is None else timeout_s
        try:
            futures: list[Future[Any]] = [self._pool.submit(fn, *args) for _, _, fn, args in calls]
        except RuntimeError as exc:  # the pool was shut down: the tier is closing
            raise TierError(f"{self.label}: {calls[0][0]} {self.path(calls[0][1])!r}: the store is closed") from exc
        deadline = time.monotonic() + wait * math.ceil(len(calls) / self.concurrency) + 0.05
        out: list[Any] = []
        for (what, rel, _, _), fut in zip(calls, futures, strict=True):
            try:
                out.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FileNotFoundError as exc:
                out.append(exc)
            except (FutureTimeout, Exception) as exc:  # backend errors are translated here, at the boundary
                fut.cancel()
                out.append(self._fault(what, rel, exc, wait))
        if raise_first:
            for item in out:
                if isinstance(item, BaseException):
                    raise item
        return out

    # -- operations (each returns the callable and its arguments for run / run_all) ----------
    def put_call(self, rel: str, data: bytes | memoryview) -> tuple[str, str, Callable[..., Any], tuple[Any, ...]]:
        return ("put", rel, self._put, (rel, data))

    def get_call(
        self, rel: str, start: int | None = None, end: int | None = None
    ) -> tuple[str, str, Callable[..., Any], tuple[Any, ...]]:
        return ("get", rel, self._get, (rel, start, end))

    def list_call(self, rel: str, recursive: bool = False) -> tuple[str, str, Callable[..., Any], tuple[Any, ...]]:
        return ("list", rel, self._list, (rel, recursive))

    def delete_call(self, rel: str) -> tuple[str, str, Callable[..., Any], tuple[Any, ...]]:
        return ("delete", rel, self._delete, (rel,))

    def put(self, rel: str, data: bytes | memoryview, timeout_s: float | None = None) -> None:
        self.run("put", rel, self._put, rel, data, timeout_s=timeout_s)

    def get(self, rel: str, start: int | None = None, end: int | None = None, timeout_s: float | None = None) -> bytes:
        return self.run("get", rel, self._get, rel, start, end, timeout_s=timeout_s)

    def list(self, rel: str, recursive: bool = False) -> dict[str, int]:
        return self.run("list", rel, self._list, rel, recursive)

    def delete(self, rel: str) -> None:
        self.run("delete", rel, self._delete, rel)

    def move(self, src: str, dst: str) -> None:
        self.run("move", src, self._move, src, dst)

    def glob(self, pattern: str, timeout_s: float | None = None) -> tuple[str, ...]:
        """Relative paths matching ``pattern`` (relative to the root, fsspec glob syntax)."""
        return self.run("list", pattern, self._glob, pattern, timeout_s=timeout_s)  # type: ignore[no-any-return]

    def check_reachable(self, timeout_s: float | None = None) -> None:
        """``TierError`` unless the store answers: on an object store, that its bucket exists (a
        listing under a missing bucket is empty, not an error); a local root may be absent."""
        protocol = fsspec.core.split_protocol(self.url)[0]
        if self.local or protocol not in S3_PROTOCOLS:
            return
        bucket = self.fs._strip_protocol(self.root).split("/", 1)[0]
        try:
            self.run("stat", "", self.fs.info, bucket, timeout_s=timeout_s)
        except FileNotFoundError:
            raise TierError(f"{self.label}: bucket {bucket!r} of {self.url!r} does not exist") from None

    # -- raw operations (run on the pool) ------------------------------------------------
    def _put(self, rel: str, data: bytes | memoryview) -> None:
        path = self.path(rel)
        if not self.local:
            self.fs.pipe_file(path, bytes(data))
            return
        directory = os.path.dirname(path)
        makedirs(directory, self.dir_mode, self.fsync)
        tmp = f"{directory}/.{os.path.basename(path)}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        write_atomic(path, data, self.file_mode, self.fsync, tmp=tmp)

    def _get(self, rel: str, start: int | None, end: int | None) -> bytes:
        path = self.path(rel)
        if not self.local:
            return bytes(self.fs.cat_file(path, start=start, end=end))
        with open(path, "rb") as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(end - (start or 0))

    def _list(self, rel: str, recursive: bool) -> dict[str, int]:
        """Files under ``rel`` (relative path -> size); an absent directory is empty."""
        path = self.path(rel)
        with contextlib.suppress(AttributeError, TypeError):
            self.fs.invalidate_cache(path)
        try:
            entries = self.fs.find(path, detail=True).values() if recursive else self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return {}
        return {self.rel(e["name"]): int(e.get("size") or 0) for e in entries if e.get("type", "file") == "file"}

    def _glob(self, pattern: str) -> tuple[str, ...]:
        with contextlib.suppress(AttributeError, TypeError):
            self.fs.invalidate_cache()
        return tuple(sorted(self.rel(str(p)) for p in self.fs.glob(self.path(pattern))))

    def _delete(self, rel: str) -> None:
        path = self.path(rel)
        if not self.local:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        if self.fsync:  # a collected object must not come back after a power loss (its tombstone goes next)
            fsync_dir(os.path.dirname(path))

    def _move(self, src: str, dst: str) -> None:
        if self.local:
            source, target = self.path(src), self.path(dst)
            makedirs(os.path.dirname(target), self.dir_mode, self.fsync)
            os.replace(source, target)
            if self.fsync:
                fsync_dir(os.path.dirname(target))
                fsync_dir(os.path.dirname(source))
        else:
            self.fs.mv(self.path(src), self.path(dst))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
