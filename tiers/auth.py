"""Keyed record integrity for the shared tiers (``fs``, ``mooncake``, ``nvme``).

Without a secret a tier checks its records with xxh3_64, which catches damage but not a
writer who means harm: anyone who can write the bucket, the mount, the pool or the directory
can publish bytes with a matching checksum. With a secret every record carries a 128-bit
keyed BLAKE3 tag that only holders of the secret can compute, and a reader serves nothing
whose tag does not verify.

Keys (all BLAKE3 ``derive_key`` with the contexts below, 32 bytes):

* the *deployment secret* ``S`` = derive(CONTEXT_SECRET, the bytes of ``secret_file`` /
  ``$secret_env`` / the ``secret = "auto"`` file), at least :data:`MIN_SECRET_BYTES` long;
* the *tenant key* ``T`` = derive(CONTEXT_TENANT, ``S`` || salt digest of the namespace)
  (see :func:`kvstrata.core.keys.salt_digest`). A process given ``secret_scope = "tenant"``
  holds ``T`` itself (64 hex digits, made by ``python -m kvstrata.tiers.auth tenant-secret``)
  and so can key, and check, only that tenant's records; a process with ``S`` (the daemon,
  a shared inference fleet) derives ``T`` of every namespace from its stored salt digest;
* the *record key* ``K`` = derive(CONTEXT_RECORD, ``T`` || the namespace as stored
  (:meth:`~kvstrata.core.keys.Namespace.stored`)): one per namespace, so a record is bound
  to its namespace; and its *key id* = derive(CONTEXT_KID, ``K``)[:8], public, which names
  the area a tier keeps its keyed records in (a reader with another secret never looks at
  them, so it neither serves nor quarantines them).

A record's tag is ``BLAKE3-keyed(K, kind || block key (key + layer) || length || bytes)``
truncated to :data:`MAC_BYTES`, so a valid record copied under another key, layer or
namespace fails. Records of ``PARALLEL_BYTES`` or more are hashed on all cores
(``max_threads=AUTO``; the GIL is released while hashing).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import re
import stat
import sys
import threading
from typing import Any, Literal

import blake3
import numpy as np
from pydantic import field_validator, model_validator

from kvstrata.core.keys import Namespace, salt_digest
from kvstrata.errors import ConfigError
from kvstrata.tiers.base import TierOptions
from kvstrata.tiers.files import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, makedirs, open_new, parse_mode

__all__ = [
    "KID_BYTES",
    "MAC_BYTES",
    "AuthOptions",
    "ModeOptions",
    "RecordKey",
    "auto_secret_path",
    "load_secret",
    "namespace_key",
    "record_key",
    "record_prefix",
    "tenant_secret",
]

CONTEXT_SECRET = "kvstrata 2026-12 tier secret v1"
CONTEXT_TENANT = "kvstrata 2026-12 tenant key v1"
CONTEXT_RECORD = "kvstrata 2026-12 record key v1"
CONTEXT_KID = "kvstrata 2026-12 key id v1"
MAC_BYTES = 16  # 128-bit tags: a forger's chance per try is 2**-128
KID_BYTES = 8
MIN_SECRET_BYTES = 16
PARALLEL_BYTES = 128 * 1024  # from here on all cores hash one record (measured: faster above ~128 KiB)
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEX_RE = re.compile(r"^[0-9a-fA-F]{64}$")

log = logging.getLogger("kvstrata.tiers.auth")


# -- options ------------------------------------------------------------------------------------


class AuthOptions(TierOptions):
    """Where a shared tier's secret comes from (at most one of the three; none: unauthenticated)."""

    secret_file: str | None = None  # a file (mode 0600 or stricter) whose bytes are the secret
    secret_env: str | None = None  # the name of an environment variable holding the secret
    secret: Literal["auto"] | None = None  # "auto": a secret made on first use in ~/.config/kvstrata (one node)
    secret_scope: Literal["deployment", "tenant"] = "deployment"  # tenant: the secret is one tenant's key

    @field_validator("secret_file")
    @classmethod
    def _file(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("secret_file must name a file, got an empty string")
        return value

    @field_validator("secret_env")
    @classmethod
    def _env(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_RE.match(value):
            raise ValueError(f"secret_env must be an environment variable name, got {value!r}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> AuthOptions:
        given = [n for n in ("secret_file", "secret_env", "secret") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of secret_file, secret_env and secret, got {', '.join(given)}")
        if self.secret_scope == "tenant" and not (self.secret_file or self.secret_env):
            raise ValueError(
                "secret_scope = 'tenant' needs secret_file or secret_env (a tenant key made by the operator)"
            )
        return self


class ModeOptions(TierOptions):
    """Permission modes of what a tier creates on a local or mounted filesystem (umask aside)."""

    file_mode: int = DEFAULT_FILE_MODE  # octal string ("0600") or int (0o600)
    dir_mode: int = DEFAULT_DIR_MODE  # octal string ("0700") or int (0o700)

    @field_validator("file_mode", mode="before")
    @classmethod
    def _file_mode(cls, value: Any) -> int:
        return parse_mode(value, "file_mode", 0o600)

    @field_validator("dir_mode", mode="before")
    @classmethod
    def _dir_mode(cls, value: Any) -> int:
        return parse_mode(value, "dir_mode", 0o700)


# -- keys ---------------------------------------------------------------------------------------


def _derive(context: str, material: bytes) -> bytes:
    return blake3.blake3(material, derive_key_context=context).digest()


class RecordKey:
    """The keyed MAC of one namespace's records (see the module docstring)."""

    __slots__ = ("key", "kid")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.kid = _derive(CONTEXT_KID, key)[:KID_BYTES]

    def mac(self, prefix: bytes, data: Any = b"") -> bytes:
        """The tag of ``prefix`` (what the record is) followed by ``data`` (its bytes: any contiguous buffer)."""
        view = data.data if isinstance(data, np.ndarray) else memoryview(data)
        threads = blake3.blake3.AUTO if view.nbytes >= PARALLEL_BYTES else 1
        hasher = blake3.blake3(prefix, key=self.key, max_threads=threads)
        hasher.update(view)
        return hasher.digest(MAC_BYTES)

    def check(self, tag: bytes, prefix: bytes, data: Any = b"") -> bool:
        return len(tag) == MAC_BYTES and hmac.compare_digest(self.mac(prefix, data), tag)

    def __repr__(self) -> str:
        return f"RecordKey(kid={self.kid.hex()})"


def record_prefix(kind: bytes, bkey: bytes, length: int) -> bytes:
    """What a record's tag binds besides its bytes: its kind (one byte), block key (key + layer), length."""
    return kind + bkey + length.to_bytes(8, "little")


def namespace_key(root: bytes, scope: str, namespace: Namespace) -> RecordKey:
    """The record key of ``namespace`` from a loaded secret (``scope`` as in :class:`AuthOptions`)."""
    tenant = root if scope == "tenant" else _derive(CONTEXT_TENANT, root + namespace.salt_digest.encode())
    return RecordKey(_derive(CONTEXT_RECORD, tenant + namespace.stored().encode()))


def tenant_secret(secret: bytes, salt: str) -> str:
    """The tenant key (hex) of the tenant whose salt is ``salt``, from the deployment secret's bytes:
    what a tenant-scoped process's ``secret_file`` holds."""
    return _derive(CONTEXT_TENANT, _derive(CONTEXT_SECRET, secret) + salt_digest(salt).encode()).hex()


# -- loading secrets --------------------------------------------------------------------------------


def auto_secret_path() -> str:
    """Where ``secret = "auto"`` keeps its secret: ``$XDG_CONFIG_HOME/kvstrata/tier-secret``
    (``~/.config/kvstrata/tier-secret``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "kvstrata", "tier-secret")


def _check_bytes(raw: bytes, where: str, field: str, value: object, scope: str) -> bytes:
    raw = raw.strip()
    if not raw:
        raise ConfigError(f"{where} is empty; it must hold the tier secret", field=field, value=value)
    if scope == "tenant":
        text = raw.decode("ascii", "replace")
        if not _HEX_RE.match(text):
            raise ConfigError(
                f"{where} must hold a tenant key of 64 hex digits (python -m kvstrata.tiers.auth tenant-secret)",
                field=field,
                value=value,
            )
        return bytes.fromhex(text)
    if len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{where} holds {len(raw)} bytes; a tier secret needs at least {MIN_SECRET_BYTES} "
            "(e.g. head -c 32 /dev/urandom | base64)",
            field=field,
            value=value,
        )
    return _derive(CONTEXT_SECRET, raw)


def _read_secret_file(path: str, field: str, value: object, scope: str) -> bytes:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{field} {path!r} does not exist", field=field, value=value) from None
    except OSError as exc:
        raise ConfigError(f"{field} {path!r} cannot be read: {exc.strerror or exc}", field=field, value=value) from exc
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{field} {path!r} is not a regular file", field=field, value=value)
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"{field} {path!r} has mode {mode:04o}: group or others may read or change it; "
            f"a secret must be private to its owner (chmod 600 {path})",
            field=field,
            value=value,
        )
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"{field} {path!r} cannot be read: {exc.strerror or exc}", field=field, value=value) from exc
    return _check_bytes(raw, f"{field} {path!r}", field, value, scope)


def _make_auto_secret(path: str) -> None:
    """Create the ``auto`` secret once (atomically: two processes starting together agree)."""
    if os.path.exists(path):
        return
    directory = os.path.dirname(path)
    makedirs(directory, DEFAULT_DIR_MODE)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = open_new(tmp, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32).hex().encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # someone else made it first: theirs counts
            os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    log.info("made a tier secret in %s (secret = 'auto': for a single node; copy it to share it)", path)


def load_secret(opts: AuthOptions) -> tuple[bytes, str] | None:
    """The secret ``opts`` name (32 bytes: the deployment secret, or the tenant key with
    ``secret_scope = "tenant"``) and where it came from; ``None`` when none is configured.
    :class:`ConfigError` naming the file or variable when it is missing, empty, too short, or
    a file that group or others may read."""
    scope = opts.secret_scope
    if opts.secret_file is not None:
        path = os.path.expandvars(os.path.expanduser(opts.secret_file))
        return _read_secret_file(path, "secret_file", opts.secret_file, scope), f"file {path}"
    if opts.secret_env is not None:
        name = opts.secret_env
        raw = os.environ.get(name)
        if raw is None:
            raise ConfigError(f"secret_env: environment variable {name} is not set", field="secret_env", value=name)
        return _check_bytes(raw.encode(), f"secret_env: environment variable {name}", "secret_env", name, scope), (
            f"environment variable {name}"
        )
    if opts.secret == "auto":
        path = auto_secret_path()
        try:
            _make_auto_secret(path)
        except OSError as exc:
            raise ConfigError(
                f"secret = 'auto': cannot create {path!r}: {exc.strerror or exc}", field="secret", value="auto"
            ) from exc
        return _read_secret_file(path, "secret", "auto", scope), f"file {path} (auto)"
    return None


# -- what a tier calls at open ------------------------------------------------------------------------

_NOTED: set[tuple[str, str, str]] = set()
_NOTED_LOCK = threading.Lock()


def _first_time(kind: str, name: str, location: str) -> bool:
    key = (kind, name, location)
    with _NOTED_LOCK:
        if key in _NOTED:
            return False
        _NOTED.add(key)
        return True


def record_key(
    opts: AuthOptions, namespace: Namespace, kind: str, name: str, location: str, *, warn: bool = True
) -> RecordKey | None:
    """The record key of ``namespace`` for a tier opened with ``opts``, or ``None`` without a
    secret. Logs once per process and tier which it is: keyed (and from where), or, with
    ``warn``, that the shared storage at ``location`` is unauthenticated and how to fix it."""
    loaded = load_secret(opts)
    if loaded is None:
        if warn and _first_time(kind, name, location):
            log.warning(
                "%s tier %r: shared storage %s is UNAUTHENTICATED: any process that can write there can make "
                "this tier serve its bytes as KV cache. Give the tier a secret: secret_file = '/path' (a file "
                "of 16+ random bytes, mode 0600), secret_env = 'VAR', or secret = 'auto' (one node only); "
                "see README, Security",
                kind,
                name,
                location,
            )
        return None
    root, source = loaded
    key = namespace_key(root, opts.secret_scope, namespace)
    if _first_time(kind, name, f"keyed:{location}"):
        log.info(
            "%s tier %r: records at %s are authenticated (keyed BLAKE3, secret from %s)", kind, name, location, source
        )
    return key


# -- operators: a tenant's key ---------------------------------------------------------------------


def _main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvstrata.tiers.auth",
        description="tenant-secret: print the tenant key of the salt read from stdin, derived from the "
        "deployment secret, for a tenant's secret_file with secret_scope = 'tenant'.",
    )
    parser.add_argument("command", choices=["tenant-secret"])
    parser.add_argument("--secret-file", required=True, help="the deployment secret (mode 0600)")
    args = parser.parse_args(argv)
    path = os.path.expanduser(args.secret_file)
    _read_secret_file(path, "secret_file", path, "deployment")  # the same checks as a tier's
    with open(path, "rb") as f:
        raw = f.read().strip()
    salt = sys.stdin.read().rstrip("\n")
    print(tenant_secret(raw, salt))
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through a subprocess in the tests
    raise SystemExit(_main(sys.argv[1:]))
