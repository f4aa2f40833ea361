"""The ``fs`` tier: layer-blocks in objects on a shared filesystem or object store (fsspec).

Any fsspec URL works: ``file:///mnt/lustre/kv`` (NFS, Lustre, 3FS, ... mounted on every
node), ``s3://bucket/prefix`` (s3fs; any S3-compatible server through
``storage_options = {client_kwargs = {endpoint_url = "..."}}``), ``memory://name``
(tests). Data goes to ``<url>/<namespace fingerprint>/`` so models and tenants never
share keys; the on-store format is in :mod:`kvstrata.tiers.fs.format`.

Objects of useful size
    A write batch becomes objects of up to ``object_size`` bytes (default 4 MiB), each a
    header table (block key, offset, length, xxh3_64) followed by the records, published
    atomically (one PUT; temp file + fsync + rename on a mounted filesystem). Objects
    never change; deletes are recorded in small tombstone objects.

Finding what others published
    Each process keeps a catalog (:mod:`kvstrata.tiers.fs.catalog`) of every object's
    header. ``contains`` answers from it; for blocks it lacks it first *refreshes*, at
    most once every ``refresh_s`` (default 1 s): it lists the one to three newest epoch
    directories of objects and tombstones (names start with the writer's clock, see
    fs.format) and fetches the headers of new objects with one ranged GET each. So a
    block another node published becomes visible here within ``refresh_s`` and a
    lookup never lists the namespace. Every ``full_refresh_s`` (default 60 s, and at
    open) the whole namespace is listed, which also notices objects others removed
    and writers whose clocks are off by more than ``SKEW_S``.

Checksums and quarantine
    Every record read is checked against its xxh3_64; a mismatch is reported
    ``CORRUPT`` (the engine counts it and treats it as a miss), counted in
    ``checksum_failures``, and its object is quarantined: moved to ``quarantine/``
    (so no node serves it again; others see it vanish, a miss) and dropped from the
    catalog, so a second read costs no I/O. A damaged header is handled the same way.

Who may write (a secret)
    Without a secret anyone who can write the bucket or mount can publish a newer object
    with bytes of their choice and a matching xxh3 for any block (the tier logs this once at
    open). With ``secret_file`` / ``secret_env`` / ``secret = "auto"``
    (:mod:`kvstrata.tiers.auth`) objects and tombstones are written in the keyed format under
    ``k<key id>/`` (see :mod:`.format`): headers carry a keyed BLAKE3 tag over themselves and
    the object's name, records one over their block id and bytes. A header that fails is
    quarantined at discovery, before it can displace the genuine copy of a block; a record that
    fails on read is ``CORRUPT`` and its object quarantined; both count in ``auth_failures``.
    Objects without the secret (from before it was set, or of other secrets) are never read.

Space, deletes and garbage collection
    ``used_bytes`` is the size of every object in the namespace that holds a live block
    (objects of all nodes, as far as the last refresh knows them). ``delete`` records a
    tombstone; an object whose live records fall below ``compact_threshold`` of its size
    is compacted (live records rewritten into a new object that names the old one in its
    header, so a tombstone for the old one, even from a node that had not seen the
    compaction, deletes the block from the new one too), an object with none is
    dead and stops counting at once. Dead objects are deleted ``gc_grace_s`` after this
    process saw them die (by the background thread every ``gc_interval_s``, or by
    :meth:`FSTier.maintain`), so a node still reading one from a stale view has that
    long to finish; a reader that finds an object gone reports a miss. Physical usage
    may therefore exceed ``capacity`` by what was deleted within the grace period.
    Objects older than ``ttl_s`` expire. If the namespace holds more than ``capacity``
    (other nodes wrote), the oldest objects are expired until it is back under 90 %;
    and ``has_room`` may expire objects of other nodes that this engine never adopted
    (it cannot evict those itself). Give every node sharing a namespace the same
    capacity. The grace period should exceed ``full_refresh_s + timeout_s``.

Faults
    Every remote call is bounded by ``timeout_s``; s3fs gets short connect/read timeouts
    and few retries by default. After a fault the store is considered down for
    ``retry_after_s``: lookups answer "absent", reads ``ERROR``, writes raise
    ``TierError``, all without waiting. Deletes made while it is down are kept and
    their tombstones published later (or at close).

Modules: :mod:`.options`, :mod:`.format` (object and tombstone bytes, names), :mod:`.catalog`
(what this process knows is published), :mod:`.store` (the fsspec store with deadlines and a
breaker), :mod:`.state` (what the parts share), :mod:`.discover` (refreshes), :mod:`.writer`
(publishing), :mod:`.reader` (ranged reads, checks), :mod:`.housekeeping` (expiry, compaction,
garbage collection), :mod:`.tier` (:class:`FSTier`).
"""

from kvstrata.tiers.fs.options import FSOptions, check_url, parse_duration
from kvstrata.tiers.fs.state import FSCounters
from kvstrata.tiers.fs.tier import FSTier

__all__ = ["FSCounters", "FSOptions", "FSTier", "check_url", "parse_duration"]
