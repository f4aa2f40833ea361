"""The namespace directory of the ``nvme`` tier: created with the tier's modes, its ``meta.json``
checked (or written, with the tenant salt as a digest only; one that still holds the salt in clear
is rewritten, and one of format 2, records without headers, is upgraded in place: it says
``"format": 3, "upgraded_from": 2`` from then on and its old records stay readable)."""

from __future__ import annotations

import json
import os

from kvstrata.core.keys import Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.errors import ConfigError, LayoutMismatchError
from kvstrata.tiers.files import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, makedirs, write_atomic
from kvstrata.tiers.records import check_meta, legacy_meta, meta_document
from kvstrata.tiers.segments import FORMAT_VERSION, HEADERLESS_FORMAT, fsync_dir

__all__ = ["existing_root", "prepare_root", "upgraded_from"]


def prepare_root(
    path: str,
    layout: KVLayout,
    namespace: Namespace,
    file_mode: int = DEFAULT_FILE_MODE,
    dir_mode: int = DEFAULT_DIR_MODE,
) -> str:
    """Create ``<path>/<namespace fingerprint>/segments`` (directories it creates get ``dir_mode``)
    and check or write ``meta.json`` (``file_mode``).

    ``ConfigError`` (naming the path) when ``path`` cannot hold the tier;
    ``LayoutMismatchError`` when ``meta.json`` describes other data."""
    base = os.path.expandvars(os.path.expanduser(path))
    if os.path.exists(base) and not os.path.isdir(base):
        raise ConfigError(f"nvme tier path {base!r} exists and is not a directory", field="path", value=path)
    root = os.path.join(base, namespace.fingerprint)
    try:
        makedirs(os.path.join(root, "segments"), dir_mode)
        _check_meta(root, layout, namespace, file_mode)
    except OSError as exc:
        raise ConfigError(
            f"nvme tier path {base!r} is not usable: {exc.strerror or exc}", field="path", value=path
        ) from exc
    return root


def existing_root(path: str, layout: KVLayout, namespace: Namespace) -> str:
    """The namespace directory under ``path`` for a read-only open (``verify`` without repair):
    checked like :func:`prepare_root`, but nothing is created or rewritten.

    ``ConfigError`` (naming the path) when it is not a tier directory that holds an index."""
    base = os.path.expandvars(os.path.expanduser(path))
    root = os.path.join(base, namespace.fingerprint)
    for need in (root, os.path.join(root, "segments"), os.path.join(root, "index.lmdb")):
        if not os.path.isdir(need):
            why = "is not a directory" if os.path.exists(need) else "does not exist"
            raise ConfigError(f"nvme tier directory {need!r} {why}", field="path", value=path)
    _check_meta(root, layout, namespace, rewrite=False)
    return root


def _check_meta(
    root: str, layout: KVLayout, namespace: Namespace, file_mode: int = DEFAULT_FILE_MODE, rewrite: bool = True
) -> None:
    """Check ``meta.json``; with ``rewrite``, write it where it is missing, holds the salt in clear
    or says format 2 (upgraded in place)."""
    path = os.path.join(root, "meta.json")
    target = expected = meta_document(FORMAT_VERSION, layout, namespace)
    if os.path.exists(path):
        with open(path, "rb") as f:
            raw = f.read()
        stored = _stored(raw)
        upgraded = meta_document(FORMAT_VERSION, layout, namespace, upgraded_from=HEADERLESS_FORMAT)
        if stored.get("format") == HEADERLESS_FORMAT:  # records written from now on get headers
            expected, target = meta_document(HEADERLESS_FORMAT, layout, namespace), upgraded
        elif stored.get("upgraded_from") == HEADERLESS_FORMAT:
            target = expected = upgraded
        hint = f" (it upgrades format {HEADERLESS_FORMAT} in place; delete {root!r} to start afresh)"
        try:
            check_meta(raw, expected, expected["format"], path, hint=hint)
            if target is expected or not rewrite:
                return
        except LayoutMismatchError:
            if not legacy_meta(raw, expected, namespace):
                raise
            if not rewrite:
                return
    elif not rewrite:
        raise LayoutMismatchError(f"{path}: missing; not an nvme tier directory")
    write_atomic(path, json.dumps(target, indent=1, sort_keys=True).encode(), file_mode)
    fsync_dir(root)


def _stored(raw: bytes) -> dict[str, object]:
    try:
        stored = json.loads(raw)
    except ValueError:
        return {}
    return stored if isinstance(stored, dict) else {}


def upgraded_from(root: str) -> object:
    """The format the namespace directory ``root`` was upgraded from, if any (its ``meta.json``
    says): records written before the upgrade have no header and cannot be rebuilt from the segments."""
    try:
        with open(os.path.join(root, "meta.json"), "rb") as f:
            return _stored(f.read()).get("upgraded_from")
    except OSError:
        return None
