"""The namespaces stored under an ``fs`` tier's URL, listed with the tier's bounds (for the
daemon's discovery and ``kvstrata verify``, which must not hang on, nor pass over, a store that
does not answer)."""

from __future__ import annotations

from kvstrata.errors import TierError
from kvstrata.tiers.fs.format import META
from kvstrata.tiers.fs.options import FSOptions
from kvstrata.tiers.fs.store import ObjectStore


def stored_namespaces(opts: FSOptions, label: str, timeout_s: float | None = None) -> list[tuple[str, str, bytes]]:
    """(fingerprint, URL, raw ``meta.json``) of every namespace directory under ``opts.url``.

    Every call is bounded by ``timeout_s`` (default: the tier's ``open_timeout_s``, at least its
    ``timeout_s``, as when a tier opens). Raises
    :class:`~kvstrata.errors.TierError` naming the URL when the store cannot be listed: nothing
    listens at the endpoint, the bucket does not exist, credentials are refused, a timeout."""
    store = ObjectStore.of(opts.url, opts, label)
    wait = max(opts.timeout_s, opts.open_timeout_s) if timeout_s is None else timeout_s
    try:
        rels = store.glob(f"*/{META}", timeout_s=wait)
        store.check_reachable(timeout_s=wait)
        results = store.run_all([store.get_call(rel) for rel in rels], timeout_s=wait)
    except FileNotFoundError as exc:
        raise TierError(f"{label}: cannot list {opts.url!r}: {exc}") from None
    finally:
        store.close()
    out: list[tuple[str, str, bytes]] = []
    for rel, res in zip(rels, results, strict=True):
        if isinstance(res, FileNotFoundError):
            continue  # removed since the listing
        if isinstance(res, BaseException):
            raise res
        fingerprint = rel.rsplit("/", 2)[-2]
        out.append((fingerprint, f"{opts.url.rstrip('/')}/{fingerprint}", bytes(res)))
    return out
