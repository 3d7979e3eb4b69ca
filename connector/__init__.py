"""kvtier under vLLM: `KvtierConnector`, a vLLM v1 KV connector (docs/vllm.md).

Importing this package does not import vLLM; `kvtier.connector.vllm_connector` does.
"""
