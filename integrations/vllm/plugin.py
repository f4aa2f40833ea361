"""vLLM general plugin (entry point ``vllm.general_plugins``): registers ``KVStrataConnector`` in
vLLM's connector registry, in every vLLM process (front end, engine core, workers), lazily (the
connector module is imported only when vLLM asks for the class).

With it, ``"kv_connector": "KVStrataConnector"`` works without ``kv_connector_module_path``, and
vLLM's MultiConnector can rebuild kvstrata's stats in the front end: it looks the class of every
chained connector up by name (``KVConnectorFactory.get_connector_class_by_name``), so an
unregistered one ended the whole engine at the first stats report ("Connector 'KVStrataConnector'
is not registered"). Importing this module imports nothing of vLLM's until :func:`register` runs.
"""

from __future__ import annotations

NAME = "KVStrataConnector"
MODULE = "kvstrata.integrations.vllm.connector"


def register() -> None:
    """Register the connector once (a second call, or a vLLM that already knows it, is a no-op)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # pragma: no cover - the entry point runs only inside vLLM
        return
    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
