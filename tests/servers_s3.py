"""A real S3 server for tests: SeaweedFS on loopback (see :mod:`kvstrata.servers`)."""

from __future__ import annotations

from kvstrata.servers import SeaweedS3, free_ports, weed_binary

__all__ = ["SeaweedS3", "free_ports", "weed_binary"]
