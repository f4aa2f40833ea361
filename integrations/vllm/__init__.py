"""kvstrata as a vLLM KV connector.

Use ``kv_connector="KVStrataConnector"`` with
``kv_connector_module_path="kvstrata.integrations.vllm"``. vLLM is imported only when
the connector class is first accessed (PEP 562), so ``kvstrata.integrations.vllm.plan``
and ``import kvstrata`` work without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVStrataConnector", "KVStrataMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvstrata.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
