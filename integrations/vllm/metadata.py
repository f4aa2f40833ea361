"""What the scheduler half hands the worker half each step (vLLM pickles it across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstrata.core.keys import Key
from kvstrata.integrations.vllm.events import EventSpec


@dataclass
class TransferSpec:
    """Blocks of one request and one group to load or store: keys and vLLM block ids, paired."""

    req_id: str
    group: int  # index into ModelPlan.groups
    keys: list[Key]
    block_ids: list[int]
    salt: str = ""
    sync: bool = False  # a synchronous, layer-wise load: the forward waits per layer
    # a load every rank's worker confirmed over the lookup socket: that lookup already took the
    # blocks into the worker engine's index, so the load plans from the index without looking up again
    confirmed: bool = False
    # KV events (only when on): the vLLM block infos to announce for some of ``keys``
    events: list[EventSpec] | None = None


@dataclass
class KVStrataMetadata(KVConnectorMetadata):
    loads: list[TransferSpec] = field(default_factory=list)
    stores: list[TransferSpec] = field(default_factory=list)
