"""A real ``mooncake_master`` for tests (see :mod:`kvstrata.servers`), plus tier options."""

from __future__ import annotations

from typing import Any

import xxhash

from kvstrata.servers import LOOPBACK, MooncakeMaster, free_port, master_binary

__all__ = ["LOOPBACK", "MooncakeMaster", "free_port", "master_binary", "mooncake_import_error", "tier_options"]


def mooncake_import_error() -> str | None:
    """Why ``mooncake.store`` does not import here (e.g. libibverbs missing), or None."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def tier_options(master_address: str, tag: str = "", **overrides: Any) -> dict[str, Any]:
    """Options of a small mooncake tier for tests; ``tag`` makes the object names private to one test."""
    options: dict[str, Any] = {
        "master_address": master_address,
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "local_hostname": LOOPBACK,
        "global_segment_size": "32MiB",
        "local_buffer_size": "4MiB",
        "staging_size": "4MiB",
        "timeout_s": 5.0,
        "setup_timeout_s": 20.0,
        "prefix": "t" + xxhash.xxh32_hexdigest(tag.encode()) if tag else "kvstrata-test",
    }
    options.update(overrides)
    return options
