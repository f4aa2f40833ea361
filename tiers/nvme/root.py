"""The namespace directory of the ``nvme`` tier: created with the tier's modes, its ``meta.json``
checked (or written, with the tenant salt as a digest only; one that still holds the salt in clear
is rewritten)."""

from __future__ import annotations

import json
import os

from kvstrata.core.keys import Namespace
from kvstrata.core.layout import KVLayout
from kvstrata.errors import ConfigError, LayoutMismatchError
from kvstrata.tiers.files import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, makedirs, write_atomic
from kvstrata.tiers.records import check_meta, legacy_meta, meta_document
from kvstrata.tiers.segments import FORMAT_VERSION, fsync_dir

__all__ = ["existing_root", "prepare_root"]


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
    meta = meta_document(FORMAT_VERSION, layout, namespace)
    path = os.path.join(root, "meta.json")
    if os.path.exists(path):
        with open(path, "rb") as f:
            raw = f.read()
        try:
            check_meta(raw, meta, FORMAT_VERSION, path, hint=f" (delete {root!r} to start afresh)")
            return
        except LayoutMismatchError:
            if not legacy_meta(raw, meta, namespace):
                raise
            if not rewrite:
                return
    elif not rewrite:
        raise LayoutMismatchError(f"{path}: missing; not an nvme tier directory")
    write_atomic(path, json.dumps(meta, indent=1, sort_keys=True).encode(), file_mode)
    fsync_dir(root)
