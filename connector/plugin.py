"""vLLM's `vllm.general_plugins` entry point: registers `KvtierConnector` by name in every
vLLM process (front end, EngineCore, workers), once per process."""
from __future__ import annotations

from kvtier.connector.settings import CONNECTOR

MODULE = "kvtier.connector.vllm_connector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR not in KVConnectorFactory._registry:  # registering twice raises
        KVConnectorFactory.register_connector(CONNECTOR, MODULE, CONNECTOR)
