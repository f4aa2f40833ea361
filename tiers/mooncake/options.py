"""Options and constants of the ``mooncake`` tier."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from kvstrata.tiers.auth import AuthOptions
from kvstrata.tiers.base import TierOptions
from kvstrata.units import Size

MiB = 1024**2
GiB = 1024**3
SLABS = 4  # transfers in flight per tier (one staging slab each)


WORKERS = 4  # threads that run client calls


BACKOFF_MIN_S = 0.25


BACKOFF_MAX_S = 8.0


PROBE_TIMEOUT_S = 2.0


class MooncakeOptions(AuthOptions):
    """Options of the ``mooncake`` tier (with the secret of :mod:`kvstrata.tiers.auth`)."""

    master_address: str = "127.0.0.1:50051"  # host:port of mooncake_master's RPC service
    metadata_server: str = "P2PHANDSHAKE"  # or the transfer-engine metadata URL, e.g. http://host:port/metadata
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_names: str = ""  # RDMA devices, e.g. "mlx5_0,mlx5_1" ("" lets Mooncake choose)
    local_hostname: str = "127.0.0.1"  # the address other nodes reach this node's segment at
    global_segment_size: Size = Field(GiB, ge=0)  # DRAM this node contributes to the pool
    local_buffer_size: Size = Field(16 * MiB, ge=0)  # the client's own transfer buffer
    staging_size: Size = Field(64 * MiB, ge=MiB)  # registered staging buffers of this tier (split in 4 slabs)
    object_size: Size = Field(4 * MiB, ge=4096)  # largest object: layers of a group are packed up to this
    timeout_s: float = Field(5.0, gt=0, le=600)  # deadline of one client call
    setup_timeout_s: float = Field(30.0, gt=0, le=3600)  # how long opening the tier waits for the master
    reconnect_after_s: float = Field(60.0, gt=0)  # replace the client after the master was unreachable this long
    prefix: str = Field("kvstrata", pattern=r"^[A-Za-z0-9._-]{1,64}$")  # first part of every object name

    @field_validator("master_address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"master_address must be host:port, e.g. '10.0.0.1:50051', got {value!r}")
        return value

    @field_validator("metadata_server")
    @classmethod
    def _metadata_url(cls, value: str) -> str:
        if value == "P2PHANDSHAKE":
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https", "etcd", "redis") or not parts.netloc:
            raise ValueError(
                f"metadata_server must be 'P2PHANDSHAKE' or a URL such as 'http://host:port/metadata', got {value!r}"
            )
        return value

    @field_validator("local_hostname")
    @classmethod
    def _hostname(cls, value: str) -> str:
        if not value or any(c.isspace() for c in value):
            raise ValueError(f"local_hostname must be a host name or address, got {value!r}")
        return value


def _coerce_options(options: object) -> MooncakeOptions:
    data = options.model_dump() if isinstance(options, TierOptions) else options
    return MooncakeOptions.model_validate(data)
