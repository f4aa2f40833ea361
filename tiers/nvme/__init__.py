"""The ``nvme`` tier: layer-blocks in large append-only segment files on a local disk.

Layout of ``<path>/<namespace fingerprint>/``::

    meta.json                  layout, namespace (its tenant salt as a digest) and format version
    index.lmdb/                the LMDB index (see :mod:`kvstrata.tiers.segments`)
    index.lmdb.broken-<time>/  an index a rebuild replaced (kept for inspection)
    segments/<writer>-<seq>.seg

A write batch is packed into aligned staging buffers (records back to back at
64-byte offsets, see :mod:`kvstrata.tiers.segments`) and written with one ``pwrite``
per 16 MiB chunk (``O_DIRECT`` where the filesystem allows it), then the segment is
``fdatasync``-ed, then one synced LMDB transaction points the index at the
new records. Only then does ``write`` report success, so after a crash the index
never points at bytes that were not durable; torn tails of segments are unreferenced
garbage that compaction or ``verify(repair=True)`` reclaims.

Modules: :mod:`.options` (options, constants, choices at open), :mod:`.root` (the namespace
directory and its ``meta.json``), :mod:`.state` (what the
parts share), :mod:`.writer` (appends), :mod:`.reader` (reads and checks), :mod:`.reclaim`
(unlink and compaction), :mod:`.verify` (``verify``), :mod:`.rebuild` (the index rebuilt from the
records' headers), :mod:`.tier` (:class:`NVMeTier`); the on-disk format is
:mod:`kvstrata.tiers.segments`.
"""

from kvstrata.tiers.nvme.options import CHUNK_BYTES, NVMeOptions, gds_available
from kvstrata.tiers.nvme.tier import NVMeTier

__all__ = ["CHUNK_BYTES", "NVMeOptions", "NVMeTier", "gds_available"]
