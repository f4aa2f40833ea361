"""kvstrata as a vLLM KV connector.

Use ``kv_connector="KVStrataConnector"`` with
``kv_connector_module_path="kvstrata.integrations.vllm"``. Importing this module
imports vLLM; ``import kvstrata`` alone never does.
"""

from kvstrata.integrations.vllm.connector import KVStrataConnector, KVStrataMetadata

__all__ = ["KVStrataConnector", "KVStrataMetadata"]
