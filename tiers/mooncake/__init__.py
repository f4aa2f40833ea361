"""The ``mooncake`` tier: layer-blocks in a cluster-wide DRAM pool (Mooncake Store).

Every process that opens this tier becomes a Mooncake client: it contributes
``global_segment_size`` bytes of its DRAM to a pool that one ``mooncake_master`` manages,
and may put objects into, and read them from, any node's share. The pool is a cache
(``persistent=False``): the master may evict objects, and the objects in a node's share
vanish when that process exits. It is shared (``shared=True``): ``contains`` asks the
master, so a process finds blocks that another one stored.

Objects
-------
One object holds one key's layer-blocks of one *span*: consecutive layers of one layer
group (same kind, shape and dtype), as many as fit in ``object_size`` (at least one).
A 32-layer model with 64 KiB layer-blocks thus keeps a block as one 2 MiB object, large
enough for full transfer speed (per-call overhead dominates small objects), and a
mixed model (full attention, sliding window, Mamba state) keeps each group apart. The
split into spans is a pure function of the layout and ``object_size``, so a reader knows where
layer ``L`` of key ``K`` lies without asking anyone. An object is its layers' *records*
back to back, each at a 64-byte aligned offset; a record is a 64-byte header and then
the layer's bytes (little-endian)::

    0    magic "KVMR", format u16, layer u16, flags u16 (1: present), reserved u16, length u32
    16   namespace seed (16 B), key (16 B)
    48   xxh3_64 of the layer's bytes
    56   xxh3_64 of header bytes 0-55
    64   the layer's bytes, zero-padded to a multiple of 64

So a record checks itself (identity and both checksums) and one contiguous byte range
serves one layer: a layer-by-layer load reads one range per layer of each object. With a
secret (:mod:`kvstrata.tiers.auth`) records are keyed instead (format 2, see :mod:`.format`)
and names start ``<prefix>/k<key id>/`` instead of the seed: any pool member can put and
remove objects, but only holders of the secret can make one a keyed reader serves; a
forged object is ``CORRUPT`` (``auth_failures``) and removed so its name is free again.
Object names are ``<prefix>/<namespace seed, hex>/<key, hex>/<first>-<last>-<hash of the
span's layers>``: the namespace digest (model, layout, dtype, TP rank, tenant salt, ...)
keeps models and tenants apart in a shared master, and a process configured with another
``object_size`` misses instead of misreading. No pickle anywhere.

Moving bytes
------------
All transfers go through staging slabs carved out of one buffer registered with the
client (``register_buffer``), so the transfer engine moves bytes straight between that
buffer and the pool (RDMA or TCP) with one call per slab-full, never one per block:

* ``write`` packs a batch's objects into a slab and sends them with one
  ``batch_put_from``; objects it replaces (ones this tier put before) are removed first
  in the same client-thread call. Not ``upsert``: two clients upserting one key at once
  leak pool space in Mooncake 0.3.13. A put of a name that exists keeps the object there
  (the first writer wins): keys are prefix hashes, so both writers hold the same bytes,
  and a bad copy reads as ``CORRUPT``, which the engine drops and stores again. An
  object that the batch covers only in part (some of its layers) is first read back
  (``batch_get_into``), merged and replaced, under a lock of this process; two processes
  merging into one object at once may lose one's layers (a miss later, never wrong
  bytes).
* ``read`` fetches only the records of the requested layers (``get_into_ranges``, one
  call per slab-full), so the engine's layer-by-layer loads do not move whole objects
  once per layer; consecutive records travel as one range. Every record is verified
  (identity and xxh3_64 of header and bytes) before a byte reaches the caller's buffer;
  a mismatch is re-read once (a concurrent rewrite or eviction tears reads): the same
  bad bytes again are ``CORRUPT``, other bytes (the object is changing) ``MISSING``.
  Objects that are gone, or between the remove and the put of a rewrite, are
  ``MISSING``.
* ``delete`` removes whole objects (``batch_remove(force=True)``: a reader's lease must
  not keep evicted blocks alive) and rewrites objects that lose only some layers.

Faults
------
The tiers of one process that name the same master and client settings share one
Mooncake client (a client is heavy: a DRAM segment, a transfer engine, ports,
heartbeats; closing one stalls the interpreter for 1-2 s); it closes with the last of
them. Every client call runs on the client's own threads with a deadline
(``timeout_s``). A call that times out or fails with an RPC error trips a breaker: for a
backoff period (doubling up to 8 s) every operation answers at once with misses,
``False`` or ``ERROR``, and so does every operation while the client's own health check
says the master is unreachable. Nothing is raised into the engine except ``TierError``
after ``close``. Reconnecting: the Mooncake client re-mounts its segment by itself when
a restarted master comes back on the same address; if the master stays unreachable for
``reconnect_after_s`` a fresh client is set up (with backoff) and replaces it once
that succeeded, unless the old one recovered meanwhile. A master that is down when the
tier opens is retried the same way; the tier serves misses meanwhile (``connected``
says whether it has a client now). ``faults`` counts the operations answered that way,
``checksum_failures`` the layer-blocks reported ``CORRUPT``.

Space
-----
The pool's capacity is cluster-wide and the master's business. This tier's
``capacity`` bounds what *this process* has put: ``used_bytes`` is the size of the
objects it put and has not deleted (headers and padding included), whichever node's
share holds them. ``write`` never lets it exceed ``capacity``; ``has_room`` answers
from it and from the engine's live bytes, assuming each layer-block costs its bytes plus
its record header and padding (an object written in part costs its full size, absent
records included; ``write`` then refuses what does not fit). A delete releases the bytes
from the account even if the master cannot be reached (a restarted master has lost
them anyway), so the account cannot leak space forever.

Deployment notes (mooncake-transfer-engine 0.3.13)
--------------------------------------------------
``local_hostname`` must be this node's address as other nodes reach it. ``P2PHANDSHAKE``
needs no metadata server; the master's HTTP metadata server binds 0.0.0.0 whatever
``-http_metadata_server_host`` says, and the client's transfer engine listens on all
interfaces. Client knobs are environment variables read by Mooncake itself, e.g.
``MC_DISABLE_METACACHE=1`` (no cached replica locations: fewer torn reads while objects
are rewritten) or ``MC_TCP_BIND_ADDRESS``; this module sets none of them.

Modules: :mod:`.options`, :mod:`.format` (objects and records), :mod:`.staging` (slabs),
:mod:`.link` (the shared client), :mod:`.objects` (transfer plans), :mod:`.tier`
(:class:`MooncakeTier`).
"""

from kvstrata.tiers.mooncake.format import FORMAT_VERSION, plan_spans
from kvstrata.tiers.mooncake.options import MooncakeOptions
from kvstrata.tiers.mooncake.tier import MooncakeTier

__all__ = ["FORMAT_VERSION", "MooncakeOptions", "MooncakeTier", "plan_spans"]
